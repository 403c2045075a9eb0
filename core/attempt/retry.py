"""When a failed event is tried again, and when it is given up on (parked).

The strategy (``fixed_interval``, ``linear``, ``exponential``) spaces the retries of failures
that may go away; one retrying cannot fix backs off exponentially whatever the strategy
(:meth:`RetryPolicy.delay`). With ``parking`` on, a permanent failure or the one that uses up
``max_attempts`` parks the event as ``failed``; without it the event stays pending and is
retried for ever: a room message is never dropped silently (:meth:`RetryPolicy.parks`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from room_outbox.config import OutboxWorkerSettings

#: The defaults of every retry option: those of the configuration, never a second copy.
_DEFAULTS = OutboxWorkerSettings()


@dataclass(frozen=True)
class RetryPolicy:
    strategy: str = _DEFAULTS.retry_strategy
    interval: float = _DEFAULTS.poll_interval  # fixed_interval's delay: the poll interval
    base: float = _DEFAULTS.retry.base
    factor: float = _DEFAULTS.retry.factor
    cap: float = _DEFAULTS.retry.cap
    jitter: float = _DEFAULTS.retry.jitter
    max_attempts: int = _DEFAULTS.retry.max_attempts
    parking: bool = _DEFAULTS.parking

    @classmethod
    def from_settings(cls, worker: OutboxWorkerSettings) -> RetryPolicy:
        retry = worker.retry
        return cls(
            strategy=worker.retry_strategy,
            interval=worker.poll_interval,
            base=retry.base,
            factor=retry.factor,
            cap=retry.cap,
            jitter=retry.jitter,
            max_attempts=retry.max_attempts,
            parking=worker.parking,
        )

    def delay(self, attempts: int, permanent: bool = False) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt (1 for the first);
        ``permanent``: a failure retrying cannot fix (always exponential).

        ``fixed_interval`` (the default, as room-service's V1 worker does): ``poll_interval``;
        ``linear``: ``base × attempts``; ``exponential``: ``base × factor^(attempts-1)``; both
        capped at ``cap`` and spread by ± ``jitter``, so that events failing together (an
        outage) do not come back together. A permanent failure not parked is still tried now
        and then (its cause may be fixed: a group created), but no longer every
        ``poll_interval``, which would cost a write and a warning per bad row per second."""
        if self.strategy == "fixed_interval" and not permanent:
            return self.interval
        if self.strategy == "linear" and not permanent:
            raw = self.base * attempts
        else:
            # min() before the power would overflow for large attempt counts.
            raw = self.cap if attempts > 64 else self.base * self.factor ** (attempts - 1)
        delay = min(raw, self.cap)
        return delay * (1 + random.uniform(-self.jitter, self.jitter)) if self.jitter else delay

    def parks(self, attempts: int, permanent: bool) -> bool:
        """Whether the failure that makes ``attempts`` attempts ends the event's retries. (An
        event no sink takes, and under per-room ordering any failure retrying cannot fix, is
        parked by the dispatcher whatever ``parking`` says: :mod:`room_outbox.delivery.routing`.)"""
        if not self.parking:
            return False
        return permanent or (self.max_attempts > 0 and attempts >= self.max_attempts)
