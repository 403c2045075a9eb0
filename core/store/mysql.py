"""The IM lane's state on MySQL 8 / MariaDB ≥ 10.6, through an aiomysql pool.

Schema added to room-service's V1 ``room_outbox`` (all with defaults, so room-service's own
INSERT and ``UPDATE … SET status='published' WHERE event_id=?`` keep working):

* ``worker_id``: the claim holding the row (``<node_id>#<n>``), NULL when free.
* ``lock_until_ms``: the row is not claimable before this time. A claim sets it to the end of
  its lease; a failed attempt sets it to the retry time. One column for both keeps the claim
  an exact index range scan (see below).
* index ``idx_room_outbox_claim (status, lock_until_ms, id)``.

The claim reads ``status='pending' AND lock_until_ms <= now ORDER BY lock_until_ms, id``: a
range on that index that stops after ``limit`` rows, whatever number of published rows, rows
leased to others or rows waiting for a retry the table holds. Fresh rows (``lock_until_ms`` 0)
come first in id order, then rows whose retry time or expired lease came up. Transactions run
at READ COMMITTED so the claim locks only the rows it takes, and ``SKIP LOCKED`` lets
concurrent claimants pass each other without waiting.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import aiomysql
import anyio
from pymysql.constants import CLIENT

from room_outbox.errors import SchemaError
from room_outbox.store.deadline import DEFAULT_QUERY_TIMEOUT, SessionLimits, TimeoutWatch, query_deadline
from room_outbox.store.leased import (
    TABLE,
    LeasedRows,
    _marks,
    claim_sql,
    now_ms,
)
from room_outbox.store.membership import bucket_plan

#: Client-side bound on ``migrate``'s transaction: adding a column or an index to a large
#: table may take long. Its lock waits stay bounded by the session's limits.
SCHEMA_CHANGE_TIMEOUT = 3600.0

V1_TABLE_DDL = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
  id            BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
  app_code      VARCHAR(64)  NOT NULL DEFAULT '',
  event_id      VARCHAR(64)  NOT NULL,
  event_type    VARCHAR(64)  NOT NULL,
  room_id       VARCHAR(64)  NOT NULL,
  envelope      LONGTEXT     NOT NULL,
  status        VARCHAR(16)  NOT NULL DEFAULT 'pending',
  retry_count   INT          NOT NULL DEFAULT 0,
  last_error    VARCHAR(1024) NULL,
  created_at_ms BIGINT       NOT NULL,
  updated_at_ms BIGINT       NOT NULL,
  UNIQUE KEY uk_room_outbox_event_id (event_id),
  KEY idx_room_outbox_status_id (status, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4
"""

#: What room-outbox adds to the V1 table: column name → definition.
ADDED_COLUMNS = {
    "worker_id": "VARCHAR(128) NULL DEFAULT NULL",
    "lock_until_ms": "BIGINT NOT NULL DEFAULT 0",
}
ADDED_INDEXES = {
    "idx_room_outbox_claim": "(status, lock_until_ms, id)",
    # per-room ordering asks "which earlier rows of these rooms are still pending?"
    "idx_room_outbox_room": "(room_id, status, id)",
}
REQUIRED_V1_COLUMNS = (
    "id", "app_code", "event_id", "event_type", "room_id", "envelope",
    "status", "retry_count", "last_error", "created_at_ms", "updated_at_ms",
)  # fmt: skip


def require_v1_columns(columns: set[str]) -> None:
    """Refuse a ``room_outbox`` that is not room-service's V1 table (whatever the database)."""
    missing = [c for c in REQUIRED_V1_COLUMNS if c not in columns]
    if missing:
        raise SchemaError(
            f"table {TABLE} exists but lacks the V1 columns {missing}; refusing to guess how to upgrade it"
        )


@dataclass(frozen=True)
class Migration:
    """One step of a migration: its statements and the line ``migrate`` reports once they ran."""

    change: str
    statements: tuple[str, ...]


#: The IM lane's claim statement (tests read its plan with EXPLAIN).
CLAIM_SQL = claim_sql(TABLE, "id", "envelope", LeasedRows.row_lock)


@dataclass(frozen=True)
class MySQLAddress:
    host: str
    port: int
    user: str
    password: str
    database: str

    @classmethod
    def from_dsn(cls, dsn: str) -> MySQLAddress:
        """``mysql://user:password@host:port/database``. Errors never echo the DSN, which
        holds the password."""
        parts = urlsplit(dsn)
        if parts.scheme not in ("mysql", "mariadb", "mysql+aiomysql"):
            raise ValueError(f"mysql.dsn: scheme must be mysql:// (got {parts.scheme or 'none'}://)")
        database = parts.path.lstrip("/")
        if not database:
            raise ValueError("mysql.dsn: names no database (mysql://user:password@host:port/DATABASE)")
        unknown = set(parse_qs(parts.query))
        if unknown:
            raise ValueError(f"mysql.dsn: unsupported options {sorted(unknown)}")
        try:
            port = parts.port or 3306
        except ValueError:
            raise ValueError("mysql.dsn: port is not a number") from None
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=port,
            user=unquote(parts.username or "root"),
            password=unquote(parts.password or ""),
            database=unquote(database),
        )

    def connect_kwargs(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": self.password,
            "charset": "utf8mb4",
            "autocommit": False,
            # Matched, not changed, rows: a fenced UPDATE then counts what it found.
            "client_flag": CLIENT.FOUND_ROWS,
            "init_command": "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
            "connect_timeout": 5,
        }

    def session_kwargs(self, server_version: str, limits: SessionLimits) -> dict[str, Any]:
        """:meth:`connect_kwargs` for the store's pool: every session also gets ``limits``,
        in one statement at connect time. MariaDB and MySQL name two of the variables
        differently: the isolation level, and the statement time limit (MySQL's applies to
        SELECTs only, the claim's among them)."""
        isolation = "tx_isolation" if is_mariadb(server_version) else "transaction_isolation"
        init = (
            f"SET SESSION {isolation} = 'READ-COMMITTED', wait_timeout = {limits.idle_seconds},"
            f" innodb_lock_wait_timeout = {limits.lock_wait_seconds}, lock_wait_timeout = {limits.lock_wait_seconds},"
            f" net_read_timeout = {limits.network_seconds}, net_write_timeout = {limits.network_seconds},"
            f" {statement_time_limit(server_version, limits.statement_seconds)}"
        )
        return {**self.connect_kwargs(), "init_command": init}


def is_mariadb(server_version: str) -> bool:
    return "mariadb" in server_version.lower()


def statement_time_limit(server_version: str, seconds: int) -> str:
    """The assignment capping a statement's run time (0: none), in the server's dialect."""
    if is_mariadb(server_version):
        return f"max_statement_time = {seconds}"
    return f"max_execution_time = {seconds * 1000}"


class MySQLStore(LeasedRows):
    """:class:`~room_outbox.store.OutboxStore` on MySQL/MariaDB: owns the pool and keeps the
    IM lane's state in ``room_outbox`` itself.

    Every transaction ends within ``query_timeout`` (see :mod:`.deadline`); every session
    carries the server-side limits derived from it."""

    def __init__(
        self,
        pool: aiomysql.Pool,
        address: MySQLAddress,
        query_timeout: float = DEFAULT_QUERY_TIMEOUT,
        server_version: str = "",
    ) -> None:
        self._pool = pool
        self.address = address
        self.query_timeout = query_timeout
        #: The server's version string, as its greeting gives it ("10.11.19-MariaDB…", "8.4.3").
        self.server_version = server_version
        self.limits = SessionLimits.for_query_timeout(query_timeout)
        self._timeouts = TimeoutWatch()

    @classmethod
    async def connect(
        cls,
        dsn: str,
        pool_size: int = 10,
        create_database: bool = False,
        query_timeout: float = DEFAULT_QUERY_TIMEOUT,
    ) -> MySQLStore:
        """Open the pool; each step ends within ``query_timeout`` or raises :class:`QueryTimeout`."""
        address = MySQLAddress.from_dsn(dsn)
        limits = SessionLimits.for_query_timeout(query_timeout)
        with query_deadline(query_timeout):
            conn = await aiomysql.connect(**address.connect_kwargs())
            try:
                server_version = conn.get_server_info()
                if create_database:
                    async with conn.cursor() as cur:
                        await cur.execute(
                            "SELECT 1 FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = %s", (address.database,)
                        )
                        if not await cur.fetchone():
                            await cur.execute(f"CREATE DATABASE `{address.database}`")
            finally:
                conn.close()
            pool = await aiomysql.create_pool(
                minsize=1,
                maxsize=pool_size,
                db=address.database,
                pool_recycle=limits.pool_recycle,
                **address.session_kwargs(server_version, limits),
            )
        return cls(pool, address, query_timeout, server_version)

    async def aclose(self) -> None:
        """Close the pool. Connections still in use get ``query_timeout`` to come back; then
        they are closed regardless, so closing never waits on the database for longer."""
        self._pool.close()
        with anyio.move_on_after(self.query_timeout):
            await self._pool.wait_closed()
            return
        self._pool.terminate()
        with anyio.move_on_after(1.0):
            await self._pool.wait_closed()

    @asynccontextmanager
    async def transaction(self, timeout: float | None = None) -> AsyncIterator[aiomysql.Cursor]:
        """A cursor in a transaction: commit on success; on error roll back and drop the
        connection, which may be broken (a server restart leaves dead ones in the pool).

        The whole transaction — taking a connection, the block, the commit — ends within
        ``timeout`` (default ``query_timeout``) or raises :class:`QueryTimeout`."""
        with self._timeouts.call(timeout or self.query_timeout):
            conn = await self._acquire()
            try:
                async with conn.cursor() as cur:
                    yield cur
                await conn.commit()
            except BaseException:
                conn.close()
                raise
            finally:
                self._pool.release(conn)

    async def _acquire(self) -> aiomysql.Connection:
        """A connection from the pool, passing over those idle since before the last timeout."""
        while True:
            conn = await self._pool.acquire()
            if self._timeouts.trusts(conn.last_usage):
                return conn
            conn.close()
            self._pool.release(conn)

    # -- schema ------------------------------------------------------------------------

    async def migrate(self) -> list[str]:
        async with self.transaction(SCHEMA_CHANGE_TIMEOUT) as cur:
            plan = await self._plan(cur)
            # The session's statement time limit would stop a long ALTER TABLE half-way; it is
            # lifted for this transaction and put back before the connection returns to the pool.
            await cur.execute(f"SET SESSION {statement_time_limit(self.server_version, 0)}")
            for step in plan:
                for statement in step.statements:
                    await cur.execute(statement)
            await cur.execute(f"SET SESSION {statement_time_limit(self.server_version, self.limits.statement_seconds)}")
        return [step.change for step in plan]

    async def migration_plan(self) -> list[Migration]:
        """The statements that bring ``room_outbox`` up to date, read from the catalogue; none
        when it is. ``migrate`` runs them; ``migrate --sql`` prints them."""
        async with self.transaction() as cur:
            return await self._plan(cur)

    async def _plan(self, cur: aiomysql.Cursor) -> list[Migration]:
        """What is missing from ``room_outbox``, read in the caller's transaction."""
        await cur.execute(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
            (TABLE,),
        )
        columns = {row[0].lower() for row in await cur.fetchall()}
        await cur.execute(
            "SELECT DISTINCT INDEX_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
            (TABLE,),
        )
        indexes = {row[0].lower() for row in await cur.fetchall()}
        plan: list[Migration] = []
        if not columns:
            plan.append(Migration(f"created table {TABLE}", (V1_TABLE_DDL.strip(),)))
            columns = set(REQUIRED_V1_COLUMNS)
        require_v1_columns(columns)
        for name, definition in ADDED_COLUMNS.items():
            if name not in columns:
                plan.append(
                    Migration(f"added column {TABLE}.{name}", (f"ALTER TABLE {TABLE} ADD COLUMN {name} {definition}",))
                )
        for name, columns_sql in ADDED_INDEXES.items():
            if name not in indexes:
                plan.append(
                    Migration(f"added index {TABLE}.{name}", (f"ALTER TABLE {TABLE} ADD INDEX {name} {columns_sql}",))
                )
        plan += [Migration(change, statements) for change, statements in await bucket_plan(cur, [TABLE])]
        return plan


@dataclass(frozen=True)
class RequeueFilter:
    """Which rows ``room-outbox requeue`` selects; every given criterion must hold."""

    event_ids: tuple[str, ...] = ()
    event_type: str | None = None
    error_contains: str | None = None
    older_than_ms: int | None = None  # created at least this long ago
    statuses: tuple[str, ...] = ("pending", "failed")


async def find_requeue_candidates(store: MySQLStore, where: RequeueFilter, limit: int = 10_000) -> list[dict[str, Any]]:
    """Rows the filter selects, leaving out rows leased right now (their in-flight result
    would be lost) and rows neither pending nor failed (published, cancelled)."""
    statuses = [s for s in where.statuses if s in ("pending", "failed")]
    if not statuses:
        return []
    clauses = [f"status IN ({_marks(statuses)})", "NOT (worker_id IS NOT NULL AND lock_until_ms > %s)"]
    params: list[Any] = [*statuses, now_ms()]
    if where.event_ids:
        clauses.append(f"event_id IN ({_marks(where.event_ids)})")
        params.extend(where.event_ids)
    if where.event_type:
        clauses.append("event_type = %s")
        params.append(where.event_type)
    if where.error_contains:
        clauses.append("INSTR(last_error, %s) > 0")
        params.append(where.error_contains)
    if where.older_than_ms is not None:
        clauses.append("created_at_ms <= %s")
        params.append(now_ms() - where.older_than_ms)
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT id, event_id, event_type, room_id, status, retry_count, last_error, created_at_ms FROM {TABLE}"
            f" WHERE {' AND '.join(clauses)} ORDER BY id LIMIT %s",
            (*params, limit),
        )
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]


async def requeue(store: MySQLStore, row_ids: Sequence[int]) -> int:
    """Make rows pending and due now, with a fresh attempt count (``max_attempts`` starts
    over); ``last_error`` is kept until the next attempt. Returns rows changed."""
    if not row_ids:
        return 0
    async with store.transaction() as cur:
        return int(
            await cur.execute(
                f"UPDATE {TABLE} SET status = 'pending', retry_count = 0, lock_until_ms = 0, worker_id = NULL,"
                f" updated_at_ms = %s WHERE id IN ({_marks(row_ids)}) AND status IN ('pending', 'failed')"
                " AND NOT (worker_id IS NOT NULL AND lock_until_ms > %s)",
                (now_ms(), *row_ids, now_ms()),
            )
        )


async def cancel(store: MySQLStore, event_id: str) -> tuple[bool, str | None]:
    """Mark a pending or failed event ``cancelled`` (never delivered, kept for audit).
    Returns whether it was cancelled and the status it has now (None: no such event)."""
    async with store.transaction() as cur:
        changed = await cur.execute(
            f"UPDATE {TABLE} SET status = 'cancelled', worker_id = NULL, lock_until_ms = 0, updated_at_ms = %s"
            " WHERE event_id = %s AND status IN ('pending', 'failed')",
            (now_ms(), event_id),
        )
        await cur.execute(f"SELECT status FROM {TABLE} WHERE event_id = %s", (event_id,))
        row = await cur.fetchone()
    return bool(changed), (row[0] if row else None)
