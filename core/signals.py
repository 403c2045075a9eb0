"""How the long-running commands (``run``, ``consume``) are stopped by the operator: the first
SIGTERM or SIGINT sets their stop event and ends what they may be waiting for as they start
(the database); a second one has its default action, a forced stop.

A service handles signals from its start, never leaving one to its default action while it
starts: that would kill it holding what it had just taken (buckets, leases) until others time
it out. Python delivers signals to the main thread only; elsewhere (a service embedded in
another thread) its caller sets the stop event."""

from __future__ import annotations

import logging
import signal
import threading

import anyio
from anyio.abc import TaskStatus

log = logging.getLogger("room_outbox.signals")


def signals_reach_here(handle_signals: bool) -> bool:
    """Whether a service asked to ``handle_signals`` can: only in the main thread."""
    return handle_signals and threading.current_thread() is threading.main_thread()


async def stop_on_signal(
    stop: anyio.Event, *waits: anyio.CancelScope, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Until the first SIGTERM or SIGINT: then ``stop`` is set and each of ``waits`` cancelled.
    Started (``task_status``) once the signals are received here."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("signal received", extra={"signal": signal.Signals(signum).name})
            stop.set()
            for wait in waits:
                wait.cancel()
            return
