"""Log lines for a failure that comes back every round while it lasts (the database
unreachable, a partition): the first failure logged in full, then one line per ``interval``
while it lasts (how many rounds failed, for how long, the latest error), and one line when a
round succeeds again. A line per round would be one per ``poll_interval`` per lane (a
ten-minute outage at a one-second poll: 600 lines a lane), burying everything else in the log;
``/readyz`` still counts every failed round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

#: Seconds between two lines about the same failure while it lasts.
REPEAT_EVERY = 60.0


class RepeatedFailure:
    """One recurring failure's log lines: :meth:`failed` after each failed round,
    :meth:`succeeded` after each successful one. ``message`` is the failure's line (at
    ``level``), ``recovered`` the line once it is over; ``fields`` go on every line."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        recovered: str,
        interval: float = REPEAT_EVERY,
        clock: Callable[[], float] = time.monotonic,
        level: int = logging.ERROR,
        **fields: object,
    ) -> None:
        self._log = logger
        self.level = level
        self.message = message
        self.recovered = recovered
        self.interval = interval
        self._clock = clock
        self._fields = fields
        #: Failed rounds in a row, when the first of them failed, when the next line is due.
        self.failures = 0
        self._since = 0.0
        self._next_line = 0.0

    def failed(self, error: str, **more: object) -> None:
        now = self._clock()
        self.failures += 1
        if self.failures == 1:
            self._since = now
        elif now < self._next_line:
            return
        fields = {**self._fields, **more, "error": error}
        if self.failures > 1:
            fields |= {"failed_rounds": self.failures, "failing_for_s": round(now - self._since, 1)}
        self._log.log(self.level, self.message, extra=fields)
        self._next_line = now + self.interval

    def succeeded(self) -> None:
        if not self.failures:
            return
        failing_for = round(self._clock() - self._since, 1)
        self._log.warning(
            self.recovered, extra={**self._fields, "failed_rounds": self.failures, "failing_for_s": failing_for}
        )
        self.failures = 0
