"""How the long-running commands (``run``, ``consume``) are stopped by the operator: the first
of :data:`STOP_SIGNALS` sets their stop event and ends their wait for the database if they are
still starting; a second one has its default action, a forced stop.

SIGHUP stops them as SIGTERM does. It comes when the terminal a process was started from goes
away (an SSH session dropped), or from an operator used to it meaning "reload": the
configuration is read at start only, so a clean stop (which a supervisor restarts with the new
configuration) is what it can mean here. Its default action would end the process at once,
holding its leases until they expire.

A service handles signals from its start, never leaving one to its default action while it
starts: that would kill it holding what it had just taken (buckets, leases) until others time
it out. Python delivers signals to the main thread only; elsewhere (a service embedded in
another thread) its caller sets the stop event."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskStatus

log = logging.getLogger("room_outbox.signals")

#: The signals that stop a command cleanly.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def stopped_by_signals(
    stop: anyio.Event, handle_signals: bool, service: Callable[[anyio.CancelScope], Awaitable[None]]
) -> None:
    """Run ``service(database_wait)``: the first of :data:`STOP_SIGNALS` sets ``stop`` and cancels
    ``database_wait`` (the scope around the service's wait for its database), when
    ``handle_signals`` and in the main thread."""
    database_wait = anyio.CancelScope()
    if not handle_signals or threading.current_thread() is not threading.main_thread():
        await service(database_wait)
        return
    async with anyio.create_task_group() as signals:
        await signals.start(_stop_on_signal, stop, database_wait)
        await service(database_wait)
        signals.cancel_scope.cancel()


async def _stop_on_signal(
    stop: anyio.Event, database_wait: anyio.CancelScope, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
        task_status.started()  # signals are received from here on
        async for signum in signals:
            log.info("signal received", extra={"signal": signal.Signals(signum).name})
            stop.set()
            database_wait.cancel()
            return


#: Seconds ``run`` or ``consume`` may take to exit once its service has stopped, before
#: threads left running hold it no longer (see :func:`exit_despite_threads`).
EXIT_WAIT = 2.0


def exit_despite_threads(wait: float = EXIT_WAIT) -> None:
    """Once a service has stopped: make sure the process exits within ``wait`` seconds,
    whatever threads still run. A plugin's blocking call in a worker thread
    (``asyncio.to_thread``) that never returns is cut by ``publish_timeout`` or
    ``handler_timeout``, but its thread runs on, and the interpreter waits for such threads at
    exit, for ever: the stop would never end, past any grace period. Said at WARNING, then the
    process exits 0 without them (the stop itself was clean)."""

    def exit_now() -> None:
        stuck = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon)
        if not stuck:
            return  # no thread holds the exit: the process is finishing (its last log lines, say)
        log.warning(
            f"threads still running {wait:g}s after the stop (a plugin's blocking call?): exiting without them",
            extra={"lifecycle": "exit_forced", "threads": stuck},
        )
        logging.shutdown()
        os._exit(0)

    watchdog = threading.Timer(wait, exit_now)
    watchdog.daemon = True  # the process exiting in time ends it unused
    watchdog.start()
