"""Log lines for a failure that comes back every round while it lasts (the database
unreachable, a partition): the first failure logged in full, then one line per ``interval``
while it lasts (how many rounds failed, for how long, the latest error), and one line when a
round succeeds again. An error of a kind not logged yet while the failure lasts (its exception
type, the text before the first ``:``) is logged at once: a transient one (a deadlock) does not
hide for a minute the lasting one that follows it (a table without its index), and two kinds
taking turns make no more lines than one. A line per round would be one per ``poll_interval`` per lane (a
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
        #: The kinds of error logged while the failure lasts (see the module docstring).
        self._kinds: set[str] = set()

    def failed(self, error: str, **more: object) -> None:
        now = self._clock()
        self.failures += 1
        kind = error.partition(":")[0] if ":" in error else ""
        if self.failures == 1:
            self._since, self._kinds = now, set()
        elif now < self._next_line and kind in self._kinds:
            return
        self._kinds.add(kind)
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
