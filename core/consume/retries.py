"""A consumer's retry worker: due rows of ``room_consumer_retry``, claimed under a lease and
handled again.

Retries keep a room's order: a failed handling goes to the table and the partition moves on.
With ``ordering: per_room`` later messages of the same room and handler queue behind it in the
table, and the worker claims only each room's first row: the room is handled in order, the
rest of the partition is not held up. A row whose lease runs out (its process died or lost the
database) is claimed again by any process of the consumer.
"""

from __future__ import annotations

import logging

import anyio

from room_outbox.attempt.failure import describe, error_text
from room_outbox.consume.dead_letters import DeadLetters
from room_outbox.consume.handling import Handling
from room_outbox.consume.messages import Message, Router
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import RepeatedFailure
from room_outbox.store.clock import now_ms
from room_outbox.store.consumers.protocol import NO_HANDLER, ConsumerStore, RetryRow

log = logging.getLogger("room_outbox.consume")

#: The most rows the retry backlog metric counts: past it, the reading says "at least this many"
#: and costs no more.
RETRY_COUNT_LIMIT = 10_000


class RetryWorker:
    """Handles one consumer's due retry rows, up to ``concurrency`` at a time, until ``stop``
    is set; rows claimed but not started by then are released at once."""

    def __init__(
        self,
        consumer: str,
        owner: str,
        settings: ConsumerSettings,
        store: ConsumerStore,
        router: Router,
        handling: Handling,
        dead_letters: DeadLetters,
        redactor: Redactor,
        stop: anyio.Event,
    ) -> None:
        self.consumer = consumer
        #: Who holds the leases of the rows this worker claims.
        self.owner = owner
        self.settings = settings
        self.store = store
        self.router = router
        self.handling = handling
        self.dead_letters = dead_letters
        self.redactor = redactor
        self._stop = stop
        self.ordered = settings.ordering == "per_room"
        #: A claimed row's lease: once it has run out, another process may claim the row.
        self.lease_ms = int((2 * settings.handler_timeout + 5) * 1000)
        self._limiter = anyio.CapacityLimiter(settings.concurrency)
        #: A claim fails again every ``retry.poll_interval`` while the database is away: logged
        #: as a recurring failure, not once a poll.
        self.claim_failing = RepeatedFailure(
            log, "retry claim failed", "retry claims succeed again", level=logging.WARNING, consumer=consumer
        )

    async def run(self) -> None:
        """Take due rows (each room's first, when ordered) and handle them; again at once while
        there were any, else after ``retry.poll_interval``; until the consumer stops."""
        while not self._stop.is_set():
            try:
                rows = await self.store.claim_retries(
                    self.consumer, self.owner, self.settings.concurrency, self.lease_ms, self.ordered
                )
            except Exception as exc:
                self.claim_failing.failed(error_text(self.redactor, describe(exc)))
                rows = []
            else:
                self.claim_failing.succeeded()
            if not rows:
                with anyio.move_on_after(self.settings.retry.poll_interval):
                    await self._stop.wait()
                continue
            async with anyio.create_task_group() as tasks:
                for row in rows:
                    tasks.start_soon(self._retry_one, row)

    async def _retry_one(self, row: RetryRow) -> None:
        try:
            async with self._limiter:
                if self._stop.is_set():
                    await self.store.release([row])
                    return
                await self._retry(row)
        except Exception as exc:  # the row's lease runs out and it comes back
            log.warning(
                "retry failed to settle",
                extra={"consumer": self.consumer, "error": error_text(self.redactor, describe(exc))},
            )

    async def _retry(self, row: RetryRow) -> None:
        message = Message(
            topic=row.topic, partition=row.partition, offset=row.offset, key=row.room_key, value=row.value,
            headers=row.headers,
        )  # fmt: skip
        self.router.parse(message)
        if row.handler == NO_HANDLER:
            # A redriven dead letter that no handler was chosen for: route it anew (the
            # consumer's handlers may have changed since).
            if message.rejected is None:
                self.router.choose_handlers(message)
            if message.rejected is not None or not message.handlers:
                error = message.rejected or f"no handler of consumer {self.consumer} takes {message.event_type!r}"
                await self._dead(row, message.retry_row(self.consumer, NO_HANDLER, row.attempts + 1, error))
                return
            await self.store.replace(row, [message.retry_row(self.consumer, h.name, 0, None) for h in message.handlers])
            return
        handler = self.router.handlers.get(row.handler)
        if handler is None or message.envelope is None:
            error = message.rejected or f"handler {row.handler!r} is not among consumer {self.consumer}'s handlers"
            await self._dead(row, message.retry_row(self.consumer, row.handler, row.attempts, error))
            return
        await self.handling.handle(message, handler, attempt=row.attempts + 1, retry=row)

    async def _dead(self, row: RetryRow, dead: RetryRow) -> None:
        """``row`` made a dead letter no handler can take (``dead``: as it is recorded): logged,
        counted and copied like every dead letter, so the dead-letter alert sees it too."""
        if await self.store.retry_failed(row, dead.attempts, now_ms(), dead.last_error or "", dead=True):
            await self.dead_letters.announce([(dead, "rejected")])


class RetryBacklogWatch:
    """A consumer's retry backlog metric (``room_outbox.consumer.retrying``), read every
    ``interval``: its rows waiting for a retry, up to RETRY_COUNT_LIMIT, as ``room-outbox
    status`` counts them. The table is the group's: every process reports the same number
    (take their max). A reading that fails leaves the gauge as it was, and is logged as a
    recurring failure (:class:`RepeatedFailure`)."""

    def __init__(
        self, consumer: str, store: ConsumerStore, metrics: ConsumerMetrics, redactor: Redactor, interval: float
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.metrics = metrics
        self.redactor = redactor
        self.interval = interval
        self.failing = RepeatedFailure(
            log,
            "retry backlog not read; its metric keeps its last value until it is",
            "retry backlog read again",
            level=logging.WARNING,
            consumer=consumer,
        )

    async def run(self, stop: anyio.Event) -> None:
        """Read the backlog now, then every ``interval``, until ``stop`` is set."""
        while not stop.is_set():
            await self.read_once()
            with anyio.move_on_after(self.interval):
                await stop.wait()

    async def read_once(self) -> None:
        try:
            waiting = await self.store.count_retrying(self.consumer, RETRY_COUNT_LIMIT)
        except Exception as exc:  # a metric never stops consuming (the store bounds the wait)
            self.failing.failed(error_text(self.redactor, describe(exc)))
            return
        self.failing.succeeded()
        self.metrics.retrying.set(waiting, {"consumer": self.consumer})
