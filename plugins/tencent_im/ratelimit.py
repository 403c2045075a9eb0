"""Client-side rate limits: per Tencent app (default 200 requests/s) and per group (40/s).

Tencent counts requests as they *arrive*, and a request arrives somewhere between the moment
we send it and the moment its answer is back. So a :class:`SlidingWindowLimiter` holds
``rate`` slots, and a slot is busy from the start of a request until ``window`` seconds after
its answer (or its failure). Then no ``window`` can ever see more than ``rate`` arrivals,
whatever the latency or the jitter: if ``rate + 1`` arrivals fell in one window, the last
of them would have started while the other ``rate`` slots were still busy. The cost is one
request latency plus the margin per slot cycle: the share of the quota used is
``1 / (1 + JITTER_MARGIN + latency)``, so a faster server leaves less of it unused.

The window is one second plus :data:`JITTER_MARGIN`, to stay clear of rounding in whatever
way the server buckets time. Waiters are served first come, first served (``anyio.Lock`` is
fair), which keeps one busy caller from starving the others.

A caller that would have to wait longer than ``max_wait`` gets no slot: the sink then hands
that delivery back unsent at once (throttled, not an attempt: it costs the event no retry)
instead of holding a dispatcher slot, so a hot room's backlog waits in the outbox, until
:meth:`SlidingWindowLimiter.next_slot_in`, while other rooms' events keep flowing.

The destination may still refuse for its rate (others send with the same credentials:
room-service's pushes above their reserve). Then :meth:`SlidingWindowLimiter.slow_down`: no new
slot for a window, so the destination's window empties, and the rate halved (at most once a
window: the refusals of requests already sent tell nothing new), growing back to the whole
rate by a sixteenth of it per window without a refusal. So a process that meets the
destination's limit backs off to what is left of it instead of sending at its own share.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import anyio

from room_outbox import JITTER_MARGIN

#: How often a caller waiting while its rate is 0 (this process may send nothing right now)
#: looks again.
ZERO_RATE_POLL = 0.05
#: A limiter slowed down by the destination's refusals keeps at least this part of its rate...
MIN_SLOWDOWN = 1 / 16
#: ...and gets this part of it back per window without a refusal.
RECOVERY_PER_WINDOW = 1 / 16

__all__ = ["JITTER_MARGIN", "KeyedLimiter", "SlidingWindowLimiter"]


def _rate_source(rate: int | Callable[[], int]) -> Callable[[], int]:
    if callable(rate):
        return rate
    if rate < 1:
        raise ValueError("rate must be at least 1")
    return lambda: rate


class SlidingWindowLimiter:
    """``rate`` may be a number or a function giving the number right now (this process's share
    of a deployment-wide limit, :mod:`room_outbox.cluster.quota`). A slot is taken only while
    fewer than the current rate are busy, so a rate that shrinks applies at once: no new slot
    until enough busy ones have freed.

    The bookkeeping costs the same whatever the rate: a count of requests in flight, and the
    times at which answered ones free their slots, oldest first. ``clock`` must never go back
    (so those times only grow and are appended in order)."""

    def __init__(
        self,
        rate: int | Callable[[], int],
        window: float = 1.0 + JITTER_MARGIN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._full_rate = _rate_source(rate)
        self.window = window
        self._clock = clock
        #: After the destination refused for its rate (:meth:`slow_down`): the part of the rate
        #: kept as of ``_held_until``, before which no slot is taken. 1.0: not slowed down.
        self._factor = 1.0
        self._held_until = -math.inf
        #: Refusals since the last :meth:`slow_down` that changed something, told by the next.
        self._refusals = 0
        #: Requests in flight: each holds its slot until its answer (or failure) is back.
        self._in_flight = 0
        #: When each answered request's slot frees, in order; entries in the past are free.
        self._cooling: deque[float] = deque()
        self._lock = anyio.Lock()
        #: Set when a request is over, for the one caller waiting on answers (made only then:
        #: an event costs more to make than a whole take and release).
        self._released: anyio.Event | None = None

    @property
    def rate(self) -> int:
        return self._rate()

    def _rate(self) -> int:
        full = self._full_rate()
        if self._factor >= 1.0 or full < 1:
            return full
        return max(1, int(full * self._slowed_factor(self._clock())))

    def _slowed_factor(self, now: float) -> float:
        """The part of the rate kept right now, after a :meth:`slow_down`."""
        regained = RECOVERY_PER_WINDOW * max(0.0, now - self._held_until) / self.window
        factor = min(1.0, self._factor + regained)
        if factor >= 1.0:
            self._factor = 1.0  # recovered: back to the path without clock readings
        return factor

    def slow_down(self) -> int:
        """The destination refused a request for its rate: hold every new slot for a window
        and halve the rate (see the module's docstring). Refusals within the hold answer
        requests sent before it and change nothing (0 back). One that slows down gives how
        many refusals there were since the last one that did, itself included: one line
        about it then tells the scale of what it stands for."""
        now = self._clock()
        self._refusals += 1
        if now < self._held_until:
            return 0
        factor = self._slowed_factor(now) if self._factor < 1.0 else 1.0
        self._factor = max(MIN_SLOWDOWN, factor / 2)
        self._held_until = now + self.window
        if self._released is not None:  # a waiter recomputes when its slot may free
            self._released.set()
            self._released = None
        refusals, self._refusals = self._refusals, 0
        return refusals

    @property
    def slowed_down(self) -> bool:
        """Whether a :meth:`slow_down` still holds back slots or part of the rate."""
        return self._factor < 1.0 and self._slowed_factor(self._clock()) < 1.0

    def try_acquire(self) -> bool:
        """Take a slot if one is free and nobody is queued for one, without waiting."""
        return not self._lock.locked() and self._take_free()

    async def acquire(self, max_wait: float) -> bool:
        """Wait for a slot; ``False`` when none frees within ``max_wait``.

        The caller must :meth:`release` the slot when its request is over.
        """
        if self.try_acquire():  # without a checkpoint
            return True
        deadline = self._clock() + max_wait
        with anyio.move_on_after(max_wait):
            async with self._lock:
                while True:
                    if self._take_free():
                        return True
                    now = self._clock()
                    rate = self.rate
                    if rate < 1:  # no share right now: look again shortly
                        await anyio.sleep(min(ZERO_RATE_POLL, max(0.0, deadline - now)))
                        if self._clock() >= deadline:
                            return False
                        continue
                    free_at = self._next_free(rate)
                    if free_at > deadline and math.isfinite(free_at):
                        return False  # known to be too late: say so at once
                    if math.isfinite(free_at):
                        await anyio.sleep(free_at - now)
                    else:  # the slots that must free are in flight: their answers decide
                        if deadline - now < self.window:
                            return False  # an answer now would still free its slot too late
                        with anyio.move_on_after(ZERO_RATE_POLL * 4):  # or the rate grows
                            if self._released is None:
                                self._released = anyio.Event()
                            await self._released.wait()
        return False

    def _busy(self) -> int:
        """Slots busy right now (forgetting the ones whose window is over)."""
        self._forget_cooled(self._clock())
        return self._in_flight + len(self._cooling)

    def _forget_cooled(self, now: float) -> None:
        cooling = self._cooling
        while cooling and cooling[0] <= now:
            cooling.popleft()

    def _take_free(self) -> bool:
        if self._factor < 1.0 and self._clock() < self._held_until:
            return False
        rate = self._rate()
        # Slots that have cooled are forgotten only when the count reaches the rate (and at
        # each release), so a limiter far from its rate costs no clock reading here.
        if self._in_flight + len(self._cooling) >= rate and self._busy() >= rate:
            return False
        self._in_flight += 1
        return True

    def _next_free(self, rate: int) -> float:
        """When enough busy slots will have freed for one to be taken (``inf``: it takes an
        answer still outstanding). Busy slots in the order they free: the cooling ones, then
        the ones in flight."""
        excess = self._busy() - rate  # how many more must free, less one
        if excess >= len(self._cooling):
            return math.inf
        free_at = self._clock() if excess < 0 else self._cooling[excess]
        return max(free_at, self._held_until) if self._factor < 1.0 else free_at

    def next_slot_in(self) -> float | None:
        """Seconds until a slot may free for one more caller (not counting those queued), for
        a caller turned away to come back then; ``None`` while the rate is 0 (unknown)."""
        rate = self.rate
        if rate < 1:
            return None
        free_at = self._next_free(rate)
        # A slot held by a request in flight frees a window after its answer at the earliest.
        return self.window if math.isinf(free_at) else max(0.0, free_at - self._clock())

    def release(self, sent: bool = True) -> None:
        """A request is over: its slot stays busy for a window (``sent=False``: it was never
        sent, so the slot is free at once)."""
        self._in_flight -= 1
        if sent:
            now = self._clock()
            self._forget_cooled(now)
            self._cooling.append(now + self.window)
        if self._released is not None:  # somebody is waiting for an answer to free a slot
            self._released.set()
            self._released = None

    def idle(self) -> bool:
        """No slot busy, nobody waiting, not slowed down: the limiter holds no information
        worth keeping."""
        return not self._lock.locked() and self._busy() == 0 and not self.slowed_down


class KeyedLimiter:
    """One :class:`SlidingWindowLimiter` per key (a group), forgotten once idle, so millions
    of rooms over a day cost memory only for the ones active right now."""

    _PRUNE_ABOVE = 1024

    def __init__(
        self,
        rate: int | Callable[[], int],
        window: float = 1.0 + JITTER_MARGIN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = _rate_source(rate)
        self.window = window
        self._clock = clock
        self._limiters: dict[str, SlidingWindowLimiter] = {}

    @property
    def rate(self) -> int:
        return self._rate()

    def get(self, key: str) -> SlidingWindowLimiter:
        limiter = self._limiters.get(key)
        if limiter is None:
            if len(self._limiters) >= self._PRUNE_ABOVE:
                self._prune()
            limiter = self._limiters[key] = SlidingWindowLimiter(self._rate, self.window, self._clock)
        return limiter

    def _prune(self) -> None:
        for key in [k for k, limiter in self._limiters.items() if limiter.idle()]:
            del self._limiters[key]

    def __len__(self) -> int:
        return len(self._limiters)
