"""What time it is in the cluster: the database server's clock, as this process reads it.

Every time one process writes and another compares comes from :func:`now_ms`: heartbeats and
liveness, bucket hand-overs and ``claimable_from_ms``, lease ends (``lock_until_ms``), retry
due times, the quota's membership views. Hosts' clocks drift apart; the database is the one
thing every process shares, so its clock is the cluster's. Delivery does not depend on the
host's clock: its offset from the server's is measured and corrected, whatever its size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from room_outbox.config import MAX_CLOCK_SKEW
from room_outbox.store.dialect import Dialect

log = logging.getLogger("room_outbox.cluster")


class ClusterClock:
    """The process's reading of the database's clock.

    Measured (:meth:`measure`) when the store opens and at every membership heartbeat: one
    ``SELECT`` of the server's time (the dialect's ``now_ms``, which the statements comparing
    room-service's ``created_at_ms`` use inline), taken at the middle of the round trip.
    Between two measurements the time runs on the local monotonic clock, which a step of the
    host's wall clock does not move; until a first one (SQLite: one box, no server) it is the
    local clock. An offset beyond ``cluster.max_clock_skew`` is logged once (again only after
    it came back within the bound) and shown by ``/readyz`` and the clock offset gauge."""

    def __init__(self, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._wall = wall
        self._monotonic = monotonic
        #: The server's epoch ms minus the local monotonic ms; None until measured.
        self._base_ms: float | None = None
        #: Seconds this host's wall clock is ahead of the server's (negative: behind).
        self.offset = 0.0
        #: The offset beyond which the host's clock counts as skewed.
        self.max_skew = MAX_CLOCK_SKEW
        self._warned = False

    @property
    def skewed(self) -> bool:
        return abs(self.offset) > self.max_skew

    def now_ms(self) -> int:
        if self._base_ms is None:
            return int(self._wall() * 1000)
        return int(self._monotonic() * 1000 + self._base_ms)

    async def measure(self, cur: Any, dialect: Dialect) -> None:
        """Read the server's time on ``cur`` (a MySQL/MariaDB or PostgreSQL cursor, speaking
        ``dialect``) and set the offset from it."""
        sent = self._monotonic()
        await cur.execute(f"SELECT {dialect.now_ms}")
        (server_ms,) = await cur.fetchone()
        received, received_wall = self._monotonic(), self._wall()
        # The wall clock read once, taken back to the round trip's middle on the monotonic one:
        # the mean of two wall readings would halve a step of the host's clock made in between.
        middle = (sent + received) / 2
        self.observe(int(server_ms), middle, received_wall - (received - middle))

    def observe(self, server_ms: int, monotonic_at: float, wall_at: float) -> None:
        """The server's clock read ``server_ms`` at local ``monotonic_at`` / ``wall_at``."""
        self._base_ms = server_ms - monotonic_at * 1000
        self.offset = wall_at - server_ms / 1000
        if not self.skewed:
            self._warned = False
        elif not self._warned:
            self._warned = True
            log.warning(
                f"this host's clock is {self.offset:+.1f}s off the database's (cluster.max_clock_skew"
                f" {self.max_skew:g}s); room-outbox keeps to the database's clock",
                extra={"clock_offset": round(self.offset, 3)},
            )


#: The process's one clock.
CLOCK = ClusterClock()


def now_ms() -> int:
    """The cluster's time in epoch milliseconds: the database's clock, as last measured."""
    return CLOCK.now_ms()
