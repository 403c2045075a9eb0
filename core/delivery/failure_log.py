"""Warnings about failed deliveries, rate-limited per row.

A row that keeps failing (a bad envelope, an event type no sink takes, a group that is gone)
is tried again and again; a WARNING per attempt would bury everything else in the log. So the
first failure of a row is logged in full, and later failures of the same row are only counted:
every ``interval`` one summary line reports how many warnings were held back, for how many
rows, with the rows that failed most (event id, count, latest error). A row that is published
is forgotten, and so is a row that has not failed for ten intervals: its next failure is news
and is logged in full again. At most ``max_rows`` rows are remembered (the least recently
failed go first), so memory stays bounded whatever the backlog of bad rows.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: How many of the most frequent rows a summary names.
SUMMARY_EXAMPLES = 5
#: A row quiet for this many intervals is forgotten.
FORGET_AFTER_INTERVALS = 10


@dataclass
class _Row:
    held_back: int
    last_error: str
    last_failed: float


class FailureLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 60.0,
        max_rows: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        **summary_fields: object,
    ) -> None:
        self._log = logger
        self.interval = interval
        self._max_rows = max_rows
        self._clock = clock
        self._summary_fields = summary_fields
        self._rows: OrderedDict[str, _Row] = OrderedDict()
        self._next_summary = clock() + interval

    def failed(self, key: str, message: str, fields: dict[str, object], error: str) -> None:
        """A failure of row ``key``: logged in full the first time, counted afterwards."""
        now = self._clock()
        row = self._rows.get(key)
        if row is not None:
            row.held_back += 1
            row.last_error, row.last_failed = error, now
            self._rows.move_to_end(key)
            return
        self._log.warning(message, extra=fields)
        self._rows[key] = _Row(0, error, now)
        if len(self._rows) > self._max_rows:
            self._rows.popitem(last=False)

    def forget(self, key: str) -> None:
        """Row ``key`` is done with (published, parked): its next failure is news."""
        if self._rows:
            self._rows.pop(key, None)

    def summarise(self) -> None:
        """Once per ``interval``: one line for the warnings held back since the last one."""
        now = self._clock()
        if now < self._next_summary:
            return
        self._next_summary = now + self.interval
        repeated = [(key, row) for key, row in self._rows.items() if row.held_back]
        if repeated:
            top = sorted(repeated, key=lambda item: -item[1].held_back)[:SUMMARY_EXAMPLES]
            self._log.warning(
                "repeated delivery failures (not logged one by one)",
                extra={
                    **self._summary_fields,
                    "held_back": sum(row.held_back for _, row in repeated),
                    "rows": len(repeated),
                    "interval": self.interval,
                    "most_frequent": [
                        {"event_id": key, "failures": row.held_back, "error": row.last_error} for key, row in top
                    ],
                },
            )
        for key, row in list(self._rows.items()):
            row.held_back = 0
            if now - row.last_failed > FORGET_AFTER_INTERVALS * self.interval:
                del self._rows[key]
