"""The consumer engine's tables on MySQL/MariaDB and PostgreSQL (see
:mod:`room_outbox.store.consumers.protocol`): one implementation, every statement written once with
``%s`` placeholders; where the two databases disagree (the DDL, the upserts, how a duplicate
processed record shows, how the processed records' multi-row INSERT carries its values)
:class:`ConsumerDialect` holds each one's words.

Claims of retry rows work like the outbox's: ``FOR UPDATE SKIP LOCKED`` at READ COMMITTED, a
lease in ``due_at_ms`` plus the ``owner`` that holds it, and every later write fenced on that
owner. Per-room order among retries: a row is claimable only while no earlier ``retrying`` row
of its room and handler exists, so a room's rows leave the table one after another.

SQLite has no consumers' tables: consumers run on a server their processes share.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from room_outbox.handler import Transaction
from room_outbox.store.backends.errors import mysql_error
from room_outbox.store.clock import now_ms
from room_outbox.store.consumers.protocol import (
    EVENT_ID_MAX,
    RETRY_ERROR_MAX,
    DeadLetters,
    LeaseLost,
    Processed,
    RetryRow,
    fit_key,
    fit_room_key,
    fit_text,
)
from room_outbox.store.dialect import marks as _marks
from room_outbox.store.dialect import table_names
from room_outbox.store.schema.consumers import PROCESSED, RETRY, consumer_steps
from room_outbox.store.schema.outbox import Migration
from room_outbox.store.schema.registry import WantedSchema, migrate

if TYPE_CHECKING:
    from room_outbox.store.backends.mysql import MySQLStore
    from room_outbox.store.backends.postgres import PostgresStore

DUPLICATE_KEY = 1062
_KEY = "consumer, handler, app_code, event_id"
#: MySQL/MariaDB errors refusing a row's values, not the server: a NULL (1048), a row too large
#: (1118), a packet above max_allowed_packet (1153, 1301), out of range (1264), truncated or
#: too long (1265, 1406), a bad date (1292), a string the character set cannot hold (1366),
#: a CHECK constraint (3819, 4025).
_REFUSED_VALUES = (1048, 1118, 1153, 1264, 1265, 1292, 1301, 1366, 1406, 3819, 4025)
#: PostgreSQL's SQLSTATE classes for the same: data exceptions (22), program limits (54).
_REFUSED_STATES = ("22", "54")


def _same_handling(retry: str, processed: str) -> str:
    """A retry row and a processed record (tables or aliases) of the same handling."""
    return " AND ".join(f"{retry}.{column} = {processed}.{column}" for column in _KEY.split(", "))


_RETRY_COLUMNS = (
    "id, consumer, handler, app_code, event_id, event_type, room_key, topic, kafka_partition, kafka_offset,"
    " value, headers, attempts, due_at_ms, last_error, owner"
)
_INSERT = (
    f"INSERT INTO {RETRY} (consumer, handler, app_code, event_id, event_type, room_key, topic, kafka_partition,"
    " kafka_offset, value, headers, status, attempts, due_at_ms, last_error, created_at_ms, updated_at_ms)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
_INSERT_PROCESSED_INTO = (
    f"INSERT INTO {PROCESSED} (consumer, handler, app_code, event_id, topic, kafka_partition, kafka_offset,"
    " processed_at_ms) VALUES "
)
_PROCESSED_MARKS = "(%s, %s, %s, %s, %s, %s, %s, %s)"
_INSERT_PROCESSED = _INSERT_PROCESSED_INTO + _PROCESSED_MARKS
#: Rows per INSERT of many processed records: a statement stays well under MySQL's
#: max_allowed_packet (about 1 kB a row at most) and PostgreSQL's 65,535 parameters however
#: large ``max_batch`` is.
_ROWS_PER_INSERT = 1000


@dataclass(frozen=True)
class ConsumerDialect:
    """The consumers' statements that differ between the two servers."""

    #: Ends :data:`_INSERT` so that a row already there (same consumer, handler, app_code,
    #: event_id) is left as it is.
    schedule: str
    #: Ends :data:`_INSERT` so that a row already there becomes the dead letter.
    dead_letter: str
    #: Ends the processed record's INSERT; empty: a duplicate raises (MySQL's error 1062,
    #: caught), else the duplicate is skipped and the INSERT reports 0 rows.
    record_skip: str
    #: Whether the processed records' multi-row INSERT carries its values written out with the
    #: connection's quoting rather than as parameters (MySQL: the driver's per-parameter path
    #: costs several times more, and this runs for every message; PostgreSQL's driver sends
    #: parameters apart from the statement, so they stay parameters).
    inline_values: bool


MYSQL = ConsumerDialect(
    schedule=" ON DUPLICATE KEY UPDATE id = id",
    dead_letter=" ON DUPLICATE KEY UPDATE status = 'dead', owner = NULL, attempts = VALUES(attempts),"
    " last_error = VALUES(last_error), updated_at_ms = VALUES(updated_at_ms)",
    record_skip="",
    inline_values=True,
)

POSTGRESQL = ConsumerDialect(
    schedule=f" ON CONFLICT ({_KEY}) DO NOTHING",
    dead_letter=f" ON CONFLICT ({_KEY}) DO UPDATE SET status = 'dead', owner = NULL, attempts = EXCLUDED.attempts,"
    " last_error = EXCLUDED.last_error, updated_at_ms = EXCLUDED.updated_at_ms",
    # An error would abort PostgreSQL's whole transaction; skipping waits, like MySQL's INSERT,
    # for a concurrent insert of the same key to commit or roll back first.
    record_skip=f" ON CONFLICT ({_KEY}) DO NOTHING",
    inline_values=False,
)

DIALECTS = {"mysql": MYSQL, "postgresql": POSTGRESQL}


class CursorTransaction:
    """:class:`~room_outbox.handler.Transaction` over a store's ``%s``-style cursor."""

    def __init__(self, cursor: Any, dialect: str) -> None:
        self._cursor = cursor
        self.dialect = dialect

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        # No parameters: no %-formatting either, so a literal % in the statement stays as is.
        return int(await self._cursor.execute(sql, tuple(params) if params else None))

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        return int(await self._cursor.executemany(sql, [tuple(r) for r in rows]) or 0)

    async def fetchone(self) -> tuple[Any, ...] | None:
        row = await self._cursor.fetchone()
        return tuple(row) if row is not None else None

    async def fetchall(self) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in await self._cursor.fetchall()]


def _row(values: Sequence[Any]) -> RetryRow:
    (id_, consumer, handler, app_code, event_id, event_type, room_key, topic, partition, offset,
     value, headers, attempts, due, error, owner) = values  # fmt: skip
    return RetryRow(
        consumer=consumer, handler=handler, app_code=app_code, event_id=event_id, event_type=event_type,
        room_key=room_key, topic=topic, partition=int(partition), offset=int(offset), value=bytes(value),
        headers=json.loads(headers), attempts=int(attempts), due_at_ms=int(due), last_error=error,
        id=int(id_), owner=owner,
    )  # fmt: skip


def _insert_params(row: RetryRow, status: str, now: int) -> tuple[Any, ...]:
    return (
        row.consumer, row.handler, row.app_code, row.event_id, row.event_type, fit_room_key(row.room_key), row.topic,
        row.partition, row.offset, row.value, json.dumps(row.headers), status, row.attempts, row.due_at_ms,
        row.last_error or None, now, now,
    )  # fmt: skip


class _Writes:
    """The writes a handling's transaction makes besides the handler's, on one cursor."""

    def __init__(self, cursor: Any, dialect: ConsumerDialect) -> None:
        self._cursor = cursor
        self._dialect = dialect

    async def schedule(self, row: RetryRow) -> None:
        await self._cursor.execute(_INSERT + self._dialect.schedule, _insert_params(row, "retrying", now_ms()))

    async def dead_letter(self, row: RetryRow) -> None:
        await self._cursor.execute(_INSERT + self._dialect.dead_letter, _insert_params(row, "dead", now_ms()))

    async def record(self, record: Processed) -> bool:
        """Insert the processed record; False when it exists. A second handling of the same
        event (a redelivery racing a retry, say) waits here on its key until the first commits."""
        params = _processed_params(record, now_ms())
        if self._dialect.record_skip:
            return bool(await self._cursor.execute(_INSERT_PROCESSED + self._dialect.record_skip, params))
        try:
            await self._cursor.execute(_INSERT_PROCESSED, params)
        except Exception as exc:
            if not mysql_error(exc, DUPLICATE_KEY):
                raise
            return False
        return True

    async def record_many(self, records: list[Processed]) -> list[bool]:
        """Insert the records of one consumer and handler; per record, whether it is new (False:
        it exists, or the same event comes earlier in ``records``). The common case (all new) is
        one multi-row statement, rows in key order so that two such statements never lock each
        other's keys in opposite orders.

        A record that exists shows as the dialect's duplicates do: on PostgreSQL ``ON CONFLICT DO
        NOTHING RETURNING`` names the rows inserted (an error there would abort the whole
        transaction); on MySQL it fails the statement (InnoDB undoes the statement, not the
        transaction), then the existing keys are read and only the others inserted."""
        first: dict[tuple[str, str], int] = {}
        for n, record in enumerate(records):
            first.setdefault((record.app_code, record.event_id), n)
        new = sorted((records[n] for n in first.values()), key=lambda r: (r.event_id, r.app_code))
        inserted: set[tuple[str, str]] = set()
        for start in range(0, len(new), _ROWS_PER_INSERT):
            chunk = new[start : start + _ROWS_PER_INSERT]
            if self._dialect.record_skip:
                inserted |= await self._insert_records(chunk, skip_existing=True)
                continue
            try:
                inserted |= await self._insert_records(chunk)
            except Exception as exc:
                if not mysql_error(exc, DUPLICATE_KEY):
                    raise
                existing = await self._existing(chunk)
                inserted |= await self._insert_records([r for r in chunk if (r.app_code, r.event_id) not in existing])
        fresh = [False] * len(records)
        for key, n in first.items():
            fresh[n] = key in inserted
        return fresh

    async def _existing(self, records: list[Processed]) -> set[tuple[str, str]]:
        """The (app_code, event_id) of ``records`` (one consumer and handler) already recorded."""
        ids = sorted({r.event_id for r in records})
        await self._cursor.execute(
            f"SELECT app_code, event_id FROM {PROCESSED} WHERE consumer = %s AND handler = %s"
            f" AND event_id IN ({_marks(ids)})",
            (records[0].consumer, records[0].handler, *ids),
        )
        return {(str(a), str(e)) for a, e in await self._cursor.fetchall()}

    async def _insert_records(self, records: list[Processed], skip_existing: bool = False) -> set[tuple[str, str]]:
        """One multi-row INSERT of ``records`` (at most ``_ROWS_PER_INSERT``); the (app_code,
        event_id) inserted. ``skip_existing``: the dialect's ``record_skip`` passes over rows that
        exist and RETURNING names those inserted; else all are, or a duplicate raises."""
        if not records:
            return set()
        now = now_ms()
        tail = self._dialect.record_skip + " RETURNING app_code, event_id" if skip_existing else ""
        if self._dialect.inline_values:
            await self._cursor.execute(_INSERT_PROCESSED_INTO + _quoted_rows(self._cursor, records, now) + tail)
        else:
            await self._cursor.execute(
                _INSERT_PROCESSED_INTO + ", ".join([_PROCESSED_MARKS] * len(records)) + tail,
                [value for r in records for value in _processed_params(r, now)],
            )
        if skip_existing:
            return {(str(a), str(e)) for a, e in await self._cursor.fetchall()}
        return {(r.app_code, r.event_id) for r in records}


def _processed_params(record: Processed, now: int) -> tuple[Any, ...]:
    return (record.consumer, record.handler, record.app_code, record.event_id, record.topic,
            record.partition, record.offset, now)  # fmt: skip


def _quoted_rows(cursor: Any, records: list[Processed], now: int) -> str:
    """The VALUES rows of ``records`` quoted by MySQL's connection as parameters would be
    (:attr:`ConsumerDialect.inline_values`): consumer, handler and topic are the same on every
    row and quoted once, numbers need no quoting."""
    quote = cursor.connection.escape
    same: dict[str, str] = {}

    def once(value: str) -> str:
        if value not in same:
            same[value] = quote(value)
        return same[value]

    return ", ".join(
        f"({once(r.consumer)}, {once(r.handler)}, {quote(r.app_code)}, {quote(r.event_id)}, {once(r.topic)},"
        f" {int(r.partition)}, {int(r.offset)}, {now})"
        for r in records
    )


class SQLBatch(_Writes):
    """Many handlings in one transaction, each inside a savepoint: a failing handling rolls
    back to its savepoint (its record and writes go, the others stay) and its retry row is
    written in the same transaction; one commit settles them all."""

    def __init__(self, cursor: Any, dialect: ConsumerDialect, name: str) -> None:
        super().__init__(cursor, dialect)
        self._name = name

    @asynccontextmanager
    async def processing(self, record: Processed) -> AsyncIterator[Transaction | None]:
        cur = self._cursor
        await cur.execute("SAVEPOINT handling")
        try:
            first = await self.record(record)
            yield CursorTransaction(cur, self._name) if first else None
        except Exception:
            await cur.execute("ROLLBACK TO SAVEPOINT handling")
            raise
        await cur.execute("RELEASE SAVEPOINT handling")


#: Dead letters one transaction of a redrive changes.
REDRIVE_BATCH = 1_000


class SQLConsumerStore:
    """:class:`~room_outbox.store.consumers.protocol.ConsumerStore` on ``owner``'s database (MySQL or
    PostgreSQL: :func:`consumer_store` picks it by the store). ``handling_timeout``: how long a
    transaction that runs a handler may take (its writes included); the store's other
    transactions keep the pool's ``query_timeout``."""

    def __init__(self, owner: MySQLStore | PostgresStore, handling_timeout: float | None = None) -> None:
        self.owner = owner
        self.handling_timeout = handling_timeout
        self.name = owner.dialect.name
        self.dialect = DIALECTS[self.name]

    async def migrated(self) -> bool:
        """Whether the consumers' tables exist here (``migrate`` made them)."""
        async with self.owner.transaction() as cur:
            return RETRY in await table_names(cur, self.owner.dialect)

    async def migration_plan(self) -> list[Migration]:
        """The consumers' tables and indexes that do not exist yet (``migrate --sql`` prints this)."""
        async with self.owner.transaction() as cur:
            return await consumer_steps(cur, self.owner.dialect)

    async def migrate(self) -> list[str]:
        """The consumers' tables, through the one migration path (:mod:`room_outbox.store.schema.registry`)."""
        return await migrate(self.owner, WantedSchema(outbox=False, consumers=True))

    @asynccontextmanager
    async def processing(self, record: Processed, retry: RetryRow | None = None) -> AsyncIterator[Transaction | None]:
        async with self.owner.transaction(self.handling_timeout) as cur:
            if retry is not None:
                deleted = await cur.execute(
                    f"DELETE FROM {RETRY} WHERE id = %s AND owner = %s", (retry.id, retry.owner)
                )
                if not deleted:
                    raise LeaseLost(f"retry row {retry.id} is no longer held by {retry.owner}")
            # not first: only the retry row's deletion commits
            first = await _Writes(cur, self.dialect).record(record)
            yield CursorTransaction(cur, self.name) if first else None

    @asynccontextmanager
    async def processing_many(self, records: list[Processed]) -> AsyncIterator[tuple[Transaction, list[bool]]]:
        async with self.owner.transaction(self.handling_timeout) as cur:
            fresh = await _Writes(cur, self.dialect).record_many(records)
            yield CursorTransaction(cur, self.name), fresh

    @asynccontextmanager
    async def batch(self, timeout: float | None = None) -> AsyncIterator[SQLBatch]:
        async with self.owner.transaction(timeout or self.handling_timeout) as cur:
            yield SQLBatch(cur, self.dialect, self.name)

    async def blocked_rooms(self, consumer: str, room_keys: set[str]) -> set[tuple[str, str]]:
        if not room_keys:
            return set()
        keys = sorted({fit_room_key(k) for k in room_keys})
        async with self.owner.transaction() as cur:
            # Mostly nothing is retrying: one index look-up says so, and the statement naming
            # every room of the batch is not needed.
            await cur.execute(f"SELECT 1 FROM {RETRY} WHERE consumer = %s AND status = 'retrying' LIMIT 1", (consumer,))
            if not await cur.fetchone():
                return set()
            await cur.execute(
                f"SELECT DISTINCT handler, room_key FROM {RETRY}"
                f" WHERE consumer = %s AND room_key IN ({_marks(keys)}) AND status = 'retrying'",
                (consumer, *keys),
            )
            return {(str(h), str(k)) for h, k in await cur.fetchall()}

    async def count_retrying(self, consumer: str, limit: int) -> int:
        async with self.owner.transaction() as cur:
            # A range of the (consumer, status, due_at_ms, id) index, read no further than
            # ``limit`` entries: the cost stays bounded however large the backlog.
            await cur.execute(
                f"SELECT COUNT(*) FROM (SELECT 1 FROM {RETRY} WHERE consumer = %s AND status = 'retrying' LIMIT %s)"
                " AS waiting",
                (consumer, limit),
            )
            (count,) = await cur.fetchone()
        return int(count)

    async def schedule(self, row: RetryRow) -> None:
        async with self.owner.transaction() as cur:
            await _Writes(cur, self.dialect).schedule(row)

    async def dead_letter(self, row: RetryRow) -> None:
        async with self.owner.transaction() as cur:
            await _Writes(cur, self.dialect).dead_letter(row)

    def refused(self, exc: BaseException) -> bool:
        if isinstance(exc, UnicodeError) or mysql_error(exc, *_REFUSED_VALUES):
            return True
        state = getattr(exc, "sqlstate", None)  # psycopg's errors; the store imports no driver
        return isinstance(state, str) and (state[:2] in _REFUSED_STATES or state == "23514")

    async def claim_retries(
        self, consumer: str, owner: str, limit: int, lease_ms: int, ordered: bool
    ) -> list[RetryRow]:
        now = now_ms()
        head = (
            f" AND NOT EXISTS (SELECT 1 FROM {RETRY} e WHERE e.consumer = r.consumer AND e.room_key = r.room_key"
            " AND e.status = 'retrying' AND e.handler = r.handler AND e.id < r.id)"
            if ordered
            else ""
        )
        async with self.owner.transaction() as cur:
            # Candidates first (a plain read), then lock those still due: a row another
            # process locked or claimed meanwhile is skipped, never waited for.
            await cur.execute(
                f"SELECT r.id FROM {RETRY} r WHERE r.consumer = %s AND r.status = 'retrying' AND r.due_at_ms <= %s"
                f"{head} ORDER BY r.due_at_ms, r.id LIMIT %s",
                (consumer, now, limit),
            )
            ids = [int(i) for (i,) in await cur.fetchall()]
            if not ids:
                return []
            await cur.execute(
                f"SELECT {_RETRY_COLUMNS} FROM {RETRY} WHERE id IN ({_marks(ids)}) AND status = 'retrying'"
                f" AND due_at_ms <= %s ORDER BY id{self.owner.dialect.row_lock}",
                (*ids, now),
            )
            rows = [_row(values) for values in await cur.fetchall()]
            if not rows:
                return []
            await cur.execute(
                f"UPDATE {RETRY} SET owner = %s, due_at_ms = %s, updated_at_ms = %s WHERE id IN ({_marks(rows)})",
                (owner, now + lease_ms, now, *(r.id for r in rows)),
            )
        return [RetryRow(**{**r.__dict__, "owner": owner}) for r in rows]

    async def retry_failed(self, row: RetryRow, attempts: int, due_at_ms: int, error: str, dead: bool) -> bool:
        async with self.owner.transaction() as cur:
            changed = await cur.execute(
                f"UPDATE {RETRY} SET status = %s, attempts = %s, due_at_ms = %s, last_error = %s, owner = NULL,"
                " updated_at_ms = %s WHERE id = %s AND owner = %s",
                (
                    "dead" if dead else "retrying",
                    attempts,
                    due_at_ms,
                    fit_text(error, RETRY_ERROR_MAX),
                    now_ms(),
                    row.id,
                    row.owner,
                ),
            )
        return bool(changed)

    async def release(self, rows: list[RetryRow]) -> None:
        if not rows:
            return
        async with self.owner.transaction() as cur:
            for row in rows:
                await cur.execute(
                    f"UPDATE {RETRY} SET owner = NULL, due_at_ms = %s WHERE id = %s AND owner = %s",
                    (now_ms(), row.id, row.owner),
                )

    async def replace(self, row: RetryRow, by: list[RetryRow]) -> bool:
        async with self.owner.transaction() as cur:
            if not await cur.execute(f"DELETE FROM {RETRY} WHERE id = %s AND owner = %s", (row.id, row.owner)):
                return False
            writes = _Writes(cur, self.dialect)
            for new in by:
                await writes.schedule(new)
        return True

    async def redrive(self, dead: DeadLetters) -> int:
        """The dead letters ``dead`` selects made ``retrying``, due now, attempts from 0; returns
        how many. In batches of :data:`REDRIVE_BATCH` rows, each its own transaction, so that no
        other writer waits on one long UPDATE; up the ids to the highest there at the start, so
        that one redriven and dead again meanwhile is not taken twice."""
        where, params = dead.where()
        async with self.owner.transaction() as cur:
            await cur.execute(f"SELECT MAX(id) FROM {RETRY} WHERE {where}", params)
            (highest,) = await cur.fetchone()
        done, after = 0, 0
        while highest is not None and after < highest:
            async with self.owner.transaction() as cur:
                await cur.execute(
                    f"SELECT id FROM {RETRY} WHERE {where} AND id > %s AND id <= %s ORDER BY id LIMIT %s",
                    (*params, after, highest, REDRIVE_BATCH),
                )
                ids = [int(id_) for (id_,) in await cur.fetchall()]
                if not ids:
                    break
                done += int(
                    await cur.execute(
                        f"UPDATE {RETRY} SET status = 'retrying', attempts = 0, due_at_ms = 0, owner = NULL,"
                        f" updated_at_ms = %s WHERE id IN ({_marks(ids)}) AND status = 'dead'",
                        (now_ms(), *ids),
                    )
                )
            after = ids[-1]
        return done

    async def count_dead_letters(self, dead: DeadLetters) -> int:
        """How many dead letters ``dead`` selects: what :meth:`redrive` would change."""
        where, params = dead.where()
        async with self.owner.transaction() as cur:
            await cur.execute(f"SELECT COUNT(*) FROM {RETRY} WHERE {where}", params)
            (count,) = await cur.fetchone()
        return int(count)

    async def dead_letter_apps(self, dead: DeadLetters) -> list[str]:
        """The apps whose dead letters ``dead`` selects (event ids may be unique per app only)."""
        where, params = dead.where()
        async with self.owner.transaction() as cur:
            await cur.execute(f"SELECT DISTINCT app_code FROM {RETRY} WHERE {where} ORDER BY app_code", params)
            return [str(app_code) for (app_code,) in await cur.fetchall()]

    async def overview(self) -> list[dict[str, Any]]:
        async with self.owner.transaction() as cur:
            await cur.execute(
                f"SELECT consumer, handler, status, COUNT(*), MIN(created_at_ms) FROM {RETRY}"
                " GROUP BY consumer, handler, status ORDER BY consumer, handler, status"
            )
            return [
                {"consumer": c, "handler": h, "status": s, "rows": int(n), "oldest_created_at_ms": int(oldest)}
                for c, h, s, n, oldest in await cur.fetchall()
            ]

    async def dead_letters(self, dead: DeadLetters, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` (lowest ids) of the dead letters ``dead`` selects."""
        where, params = dead.where()
        async with self.owner.transaction() as cur:
            await cur.execute(
                "SELECT consumer, handler, app_code, event_id, event_type, room_key, topic, kafka_partition,"
                f" kafka_offset, attempts, last_error, updated_at_ms FROM {RETRY} WHERE {where} ORDER BY id LIMIT %s",
                (*params, limit),
            )
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]

    async def event_states(self, event_id: str) -> list[dict[str, Any]]:
        event_id = fit_key(event_id, EVENT_ID_MAX)  # as the tables keep it
        async with self.owner.transaction() as cur:
            if RETRY not in await table_names(cur, self.owner.dialect):
                return []
            await cur.execute(
                f"SELECT consumer, handler, app_code, topic, kafka_partition, kafka_offset, processed_at_ms"
                f" FROM {PROCESSED} WHERE event_id = %s ORDER BY consumer, handler",
                (event_id,),
            )
            states = [
                {"consumer": c, "handler": h, "app_code": a, "state": "consumed", "topic": t, "partition": p,
                 "offset": o, "at_ms": at}
                for c, h, a, t, p, o, at in await cur.fetchall()
            ]  # fmt: skip
            await cur.execute(
                f"SELECT consumer, handler, app_code, status, attempts, due_at_ms, last_error, topic, kafka_partition,"
                f" kafka_offset FROM {RETRY} WHERE event_id = %s ORDER BY consumer, handler",
                (event_id,),
            )
            for c, h, a, status, attempts, due, error, t, p, o in await cur.fetchall():
                states.append(
                    {"consumer": c, "handler": h or "(none)", "app_code": a, "state": status, "attempts": attempts,
                     "due_at_ms": due, "last_error": error, "topic": t, "partition": p, "offset": o}
                )  # fmt: skip
        return states

    # -- retention (room_outbox.store.operator.retention.prune_consumer_records) ---------------------------

    async def remove_resolved_retries(self, limit: int) -> int:
        """Delete up to ``limit`` retry rows (retrying or dead, not leased right now) whose
        event the same consumer and handler has a processed record for: it was handled since
        (a redelivery succeeded after the row was written), so a retry would find the record
        and do nothing, and a dead letter only misleads."""
        async with self.owner.transaction() as cur:
            await cur.execute(
                f"SELECT r.id FROM {RETRY} r WHERE r.owner IS NULL AND EXISTS (SELECT 1 FROM {PROCESSED} p"
                f" WHERE {_same_handling('r', 'p')}) ORDER BY r.id LIMIT %s",
                (limit,),
            )
            ids = [int(i) for (i,) in await cur.fetchall()]
            if not ids:
                return 0
            return int(
                await cur.execute(
                    f"DELETE FROM {RETRY} WHERE id IN ({_marks(ids)}) AND owner IS NULL"
                    f" AND EXISTS (SELECT 1 FROM {PROCESSED} p WHERE {_same_handling(RETRY, 'p')})",
                    ids,
                )
            )

    async def remove_old_processed(self, cutoff_ms: int, limit: int) -> int:
        """Delete up to ``limit`` processed records older than ``cutoff_ms`` (oldest first, along
        the age index). A record stays while a retry row of its key exists: that row would run
        the handler again without it (:meth:`remove_resolved_retries` clears those first)."""
        async with self.owner.transaction() as cur:
            await cur.execute(
                f"SELECT {_KEY} FROM {PROCESSED} p WHERE p.processed_at_ms < %s"
                f" AND NOT EXISTS (SELECT 1 FROM {RETRY} r WHERE {_same_handling('r', 'p')}) ORDER BY p.processed_at_ms LIMIT %s",
                (cutoff_ms, limit),
            )
            keys = [tuple(row) for row in await cur.fetchall()]
            if not keys:
                return 0
            rows = ", ".join(["(%s, %s, %s, %s)"] * len(keys))
            return int(
                await cur.execute(
                    f"DELETE FROM {PROCESSED} WHERE ({_KEY}) IN ({rows}) AND processed_at_ms < %s"
                    f" AND NOT EXISTS (SELECT 1 FROM {RETRY} r WHERE {_same_handling('r', PROCESSED)})",
                    (*(value for key in keys for value in key), cutoff_ms),
                )
            )

    async def count_removable(self, cutoff_ms: int) -> tuple[int, int]:
        """What the two removals would take now (``cleanup --dry-run``): resolved retry rows,
        processed records older than ``cutoff_ms``."""
        async with self.owner.transaction() as cur:
            await cur.execute(
                f"SELECT COUNT(*) FROM {RETRY} r WHERE r.owner IS NULL"
                f" AND EXISTS (SELECT 1 FROM {PROCESSED} p WHERE {_same_handling('r', 'p')})"
            )
            resolved = int((await cur.fetchone())[0])
            # A record's retry row, if any, is resolved and goes first, unless leased right now.
            await cur.execute(
                f"SELECT COUNT(*) FROM {PROCESSED} p WHERE p.processed_at_ms < %s AND NOT EXISTS (SELECT 1"
                f" FROM {RETRY} r WHERE {_same_handling('r', 'p')} AND r.owner IS NOT NULL)",
                (cutoff_ms,),
            )
            processed = int((await cur.fetchone())[0])
        return resolved, processed
