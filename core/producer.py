"""The producer side of the outbox, for Python services and for our tests.

room-service's pattern: write state and event in one transaction, then push at once::

    async with pool.acquire() as conn:                 # the command's own transaction
        async with conn.cursor() as cur:
            await cur.execute("UPDATE rooms ...")      # room state
            event = await append_event(cur, {...})     # + the outbox row, same transaction
        await conn.commit()
    await producer.publish_committed(event)           # after commit: try IM right away
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiomysql

from room_outbox.attempt.failure import error_text
from room_outbox.attempt.pipeline import Attempts
from room_outbox.delivery.routing import Router
from room_outbox.envelope import EventEnvelope
from room_outbox.observability.redaction import Redactor
from room_outbox.store.dialect import MYSQL, Dialect
from room_outbox.store.producer import insert_event, mark_published
from room_outbox.store.protocol import SQLStore

log = logging.getLogger("room_outbox.producer")


async def append_event(
    cur: Any, envelope: EventEnvelope | Mapping[str, Any], dialect: Dialect = MYSQL
) -> EventEnvelope:
    """Insert the event as a ``pending`` row using the caller's cursor (its transaction), in
    ``dialect`` (aiomysql's cursor: MySQL; psycopg's: PostgreSQL; a store's cursor: its own).
    Only room-service's V1 columns are written, so a table room-outbox never migrated works.

    An event_id already in the table is skipped, not raised: the caller's transaction stays
    usable and commits the rest of its work (a retried command re-appends the same event).
    Raises pydantic's ``ValidationError`` for an envelope without event_id, event_type or
    room_id, before anything is written.
    """
    event = envelope if isinstance(envelope, EventEnvelope) else EventEnvelope.model_validate(dict(envelope))
    now = int(time.time() * 1000)
    await insert_event(
        cur, dialect, event.app_code, event.event_id, event.event_type, event.room_id, event.model_dump_json(), now
    )
    return event


@dataclass(frozen=True)
class PublishOutcome:
    event_id: str
    #: The sink accepted the event.
    published: bool
    #: The row was marked ``published`` (only tried after a successful push).
    marked: bool = False
    #: Why the push or the mark failed (short, secrets redacted).
    error: str | None = None


class OutboxProducer:
    """Publishes committed events synchronously through the lane's sinks.

    ``pool`` is the service's aiomysql pool (for the ``published`` mark); ``router`` the
    same routing the worker uses (:func:`room_outbox.delivery.routing.build_router`), so a noop event
    type is marked ``published`` without a Tencent call, as the worker would.
    """

    def __init__(
        self,
        pool: aiomysql.Pool,
        router: Router,
        publish_timeout: float = 3.0,
        redactor: Redactor | None = None,
    ) -> None:
        self.pool = pool
        self.router = router
        self.publish_timeout = publish_timeout
        self.redactor = redactor or Redactor()
        self.attempts = Attempts(self.redactor, publish_timeout)

    async def publish_committed(self, event: EventEnvelope) -> PublishOutcome:
        """Push one committed event; on success mark it ``published`` (best effort).

        Never raises for a delivery problem: a failed push leaves the row ``pending`` untouched
        (``retry_count`` is the worker's count, not the producer's), and a failed ``published``
        mark only means the worker may deliver the event once more (clients de-duplicate by
        ``event_id``)."""
        error = await self._push(event)
        if error is not None:
            log.warning(
                "sync publish failed; the row stays pending for the worker",
                extra=self._fields(event, status="pending", error=error),
            )
            return PublishOutcome(event.event_id, published=False, error=error)
        try:
            await self._mark_published(event.event_id)
        except Exception as exc:  # the command already succeeded: at worst a duplicate push
            error = self._short(f"marking published failed: {type(exc).__name__}: {exc}")
            log.warning(
                "sync publish succeeded but the row could not be marked; the worker may send it again",
                extra=self._fields(event, status="pending", error=error),
            )
            return PublishOutcome(event.event_id, published=True, marked=False, error=error)
        log.debug("sync publish succeeded", extra=self._fields(event, status="published"))
        return PublishOutcome(event.event_id, published=True, marked=True)

    async def _push(self, event: EventEnvelope) -> str | None:
        """``None`` on success, else the short error text."""
        route = self.router.sink_for(event.event_type)
        if route is None:
            return f"no sink for event_type {event.event_type}"
        name, sink = route
        failure = await self.attempts.run(name, sink.deliver, event)  # a sink's bug is a failure too
        return None if failure is None else failure.error

    async def _mark_published(self, event_id: str) -> None:
        conn = await self.pool.acquire()
        try:
            async with conn.cursor() as cur:
                await mark_published(cur, event_id)
            await conn.commit()
        except BaseException:
            conn.close()  # possibly broken: never hand it back to the pool as healthy
            raise
        finally:
            self.pool.release(conn)

    def _short(self, text: str) -> str:
        return error_text(self.redactor, text)

    @staticmethod
    def _fields(event: EventEnvelope, **more: object) -> dict[str, object]:
        return {"event_id": event.event_id, "event_type": event.event_type, "room_id": event.room_id, **more}


class StoreProducer(OutboxProducer):
    """The producer on any :class:`~room_outbox.store.protocol.SQLStore`: the published mark
    (room-service's own statement) goes through the store's transaction instead of an aiomysql
    pool, so the same code path serves MySQL, PostgreSQL and SQLite."""

    def __init__(self, store: SQLStore, router: Router, publish_timeout: float, redactor: Redactor) -> None:
        super().__init__(None, router, publish_timeout, redactor)
        self.store = store

    async def _mark_published(self, event_id: str) -> None:
        async with self.store.transaction() as cur:
            await mark_published(cur, event_id)
