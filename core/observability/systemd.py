"""systemd's service notifications, for ``run`` and ``consume`` as a ``Type=notify`` unit.

``READY=1`` once the worker runs (the moment ``/readyz`` can first pass), so that units ordered
after this one start when it delivers, not when it was forked; ``STOPPING=1`` as it begins to
stop. Where the unit sets ``WatchdogSec=``, ``WATCHDOG=1`` at half that interval while the
process is live (the ``/healthz`` check): a process whose lanes have stalled stops pinging, and
systemd restarts it. Outside systemd (no ``NOTIFY_SOCKET``) nothing is sent.

The protocol is a datagram of ``KEY=value`` lines on the Unix socket systemd names; written here
in a few lines rather than taken from a library (those that are kept wrap libsystemd, a C
library to build against).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import anyio

from room_outbox.observability.health import Health

log = logging.getLogger("room_outbox.systemd")

#: How often the worker's state is looked at, in seconds (READY=1 and STOPPING=1 follow it).
STATE_EVERY = 0.2


class Notifier:
    """Sends notifications to the socket systemd named in the environment; a send that fails is
    logged once, and the process goes on (a notification is never worth stopping delivery for)."""

    def __init__(self, address: str) -> None:
        # An abstract socket's name starts with "@", for a NUL byte on the wire.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.failed = False

    def send(self, message: str) -> None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self.failed:
                log.warning("systemd notification failed", extra={"error": f"{type(exc).__name__}: {exc}"})
            self.failed = True


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Seconds between two watchdog pings (half the unit's ``WatchdogSec=``), or None when
    systemd watches no process of this unit or another one (``WATCHDOG_PID``)."""
    usec, pid = environ.get("WATCHDOG_USEC", ""), environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000


async def notify_systemd(health: Health, environ: Mapping[str, str] = os.environ) -> None:
    """Tell systemd the process's state for as long as it runs (until cancelled)."""
    address = environ.get("NOTIFY_SOCKET", "")
    if not address:
        return
    notifier = Notifier(address)
    watchdog = watchdog_interval(environ)
    next_ping = 0.0
    ready = False
    try:
        while health.worker != "stopping":
            if not ready and health.worker in ("running", "disabled"):
                notifier.send(f"READY=1\nSTATUS=worker {health.worker}\nMAINPID={os.getpid()}")
                ready = True
            if watchdog is not None and anyio.current_time() >= next_ping:
                if health.liveness()[0]:  # not live: no ping, and systemd restarts the process
                    notifier.send("WATCHDOG=1")
                next_ping = anyio.current_time() + watchdog
            await anyio.sleep(min(STATE_EVERY, watchdog or STATE_EVERY))
    finally:  # stopping, or the process leaves before it got so far: either way it stops
        notifier.send("STOPPING=1\nSTATUS=stopping")
