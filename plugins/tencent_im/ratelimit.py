"""Client-side rate limits: per Tencent app (default 200 requests/s) and per group (40/s).

A :class:`SlidingWindowLimiter` hands out start times so that no window of ``window``
seconds ever holds more than ``rate`` starts: the next start is ``rate`` starts after the
one it displaces, plus the window. Starts are reserved in arrival order (FIFO), which is what
keeps one busy caller from starving the others.

The window is one second plus :data:`JITTER_MARGIN`: the server counts arrivals, and a
request that waited a little longer in the event loop or on the network than the one
``rate`` places after it would otherwise land in the same server-side second.

A caller that would have to wait longer than ``max_wait`` gets no reservation: the sink
then fails that delivery as retryable at once instead of holding a dispatcher slot, so a hot
room's backlog waits in the outbox while other rooms' events keep flowing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

JITTER_MARGIN = 0.05


class SlidingWindowLimiter:
    def __init__(
        self, rate: int, window: float = 1.0 + JITTER_MARGIN, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate < 1:
            raise ValueError("rate must be at least 1")
        self.rate = rate
        self.window = window
        self._clock = clock
        # The last `rate` reserved start times, oldest first; they never decrease.
        self._starts: deque[float] = deque(maxlen=rate)

    def reserve(self, max_wait: float) -> float | None:
        """Reserve the earliest allowed start; return the wait until it, or ``None`` (nothing
        reserved) when that wait would exceed ``max_wait``."""
        now = self._clock()
        start = now if len(self._starts) < self.rate else max(now, self._starts[0] + self.window)
        if start - now > max_wait:
            return None
        self._starts.append(start)
        return start - now

    def idle_since(self) -> float:
        """Monotonic time of the last reserved start (``-inf`` when none)."""
        return self._starts[-1] if self._starts else float("-inf")


class KeyedLimiter:
    """One :class:`SlidingWindowLimiter` per key (a group), forgotten once idle for a window,
    so millions of rooms over a day cost memory only for the ones active right now."""

    _PRUNE_ABOVE = 1024

    def __init__(
        self, rate: int, window: float = 1.0 + JITTER_MARGIN, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.window = window
        self._clock = clock
        self._limiters: dict[str, SlidingWindowLimiter] = {}

    def reserve(self, key: str, max_wait: float) -> float | None:
        limiter = self._limiters.get(key)
        if limiter is None:
            if len(self._limiters) >= self._PRUNE_ABOVE:
                self._prune()
            limiter = self._limiters[key] = SlidingWindowLimiter(self.rate, self.window, self._clock)
        return limiter.reserve(max_wait)

    def _prune(self) -> None:
        horizon = self._clock() - self.window
        for key in [k for k, limiter in self._limiters.items() if limiter.idle_since() < horizon]:
            del self._limiters[key]

    def __len__(self) -> int:
        return len(self._limiters)
