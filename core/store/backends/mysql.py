"""The main lane's state on MySQL 8 / MariaDB ≥ 10.6, through an aiomysql pool.

Schema: room-service's V1 ``room_outbox`` plus ``worker_id``, ``lock_until_ms`` and two
indexes (see :mod:`.schema`).

The claim reads ``status='pending' AND lock_until_ms <= now ORDER BY lock_until_ms, id``: a
range on that index that stops after ``limit`` rows, whatever number of published rows, rows
leased to others or rows waiting for a retry the table holds. Fresh rows (``lock_until_ms`` 0)
come first in id order, then rows whose retry time or expired lease came up. Transactions run
at READ COMMITTED so the claim locks only the rows it takes, and ``SKIP LOCKED`` lets
concurrent claimants pass each other without waiting.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import aiomysql
import anyio
import pymysql
from anyio.streams.buffered import BufferedByteReceiveStream
from pymysql.constants import CLIENT

from room_outbox.errors import StoreUnavailable
from room_outbox.store.backends.dsn import DsnOptionError, host_and_port, parse_server_dsn, socket_option
from room_outbox.store.backends.errors import named_fix
from room_outbox.store.backends.leased import LeasedRows, claim_sql
from room_outbox.store.backends.mysql_online import OnlineSchemaChange, exclusive_migration, to_stderr
from room_outbox.store.deadline import (
    DEFAULT_QUERY_TIMEOUT,
    SessionLimits,
    TimeoutWatch,
    query_deadline,
)
from room_outbox.store.dialect import MYSQL, Dialect
from room_outbox.store.schema import registry
from room_outbox.store.schema.outbox import TABLE, Migration
from room_outbox.store.schema.registry import Planner
from room_outbox.tls import as_servers_clients_check

__all__ = ["CLAIM_SQL", "Migration", "MySQLAddress", "MySQLStore"]

#: The main lane's claim statement (tests read its plan with EXPLAIN).
CLAIM_SQL = claim_sql(TABLE, "id", "envelope", MYSQL.row_lock)


#: Every session's SQL mode, whatever the server's default. Left out are the modes that change
#: how a statement reads: ANSI_QUOTES, PIPES_AS_CONCAT, ONLY_FULL_GROUP_BY and
#: NO_BACKSLASH_ESCAPES (under which the driver's escaping of a bytes value corrupts it). Strict
#: mode is on, so a value that does not fit its column is an error, never cut silently. (MySQL 8
#: warns that ERROR_FOR_DIVISION_BY_ZERO is deprecated; no statement divides by anything but a
#: constant.)
SQL_MODE = "STRICT_TRANS_TABLES,NO_ENGINE_SUBSTITUTION"
#: Every session's time zone, whatever the server's. The database's clock is read as
#: ``UNIX_TIMESTAMP(NOW(3))``, which goes through the session's local time: in a zone with
#: daylight saving time, the hour repeated when the clocks go back reads an hour early the
#: second time, and leases, retries and ``claim_after`` would wait an hour more.
TIME_ZONE = "+00:00"
#: Every session's character set for what it sends and reads, whatever the login left it in:
#: the driver asks for utf8mb4 in its handshake, but a server's ``init_connect`` (``SET NAMES
#: utf8``, run for users without SUPER) or ``skip-character-set-client-handshake`` overrides
#: that, and utf8mb3 turns every 4-byte character (emoji) read into ``?``: a room id, a payload.
#: The session's init statement runs after ``init_connect``, so it has the last word. The
#: collation is the one the handshake asks for (a literal compared with a column takes the
#: column's, so no index use depends on it).
CHARACTER_SET = (
    "character_set_client = utf8mb4",
    "character_set_results = utf8mb4",
    "collation_connection = utf8mb4_general_ci",  # sets character_set_connection too
)


#: Every session without the guards a server's default may put on ad-hoc statements, which
#: room-outbox's are not: ``sql_select_limit`` cut every SELECT without a LIMIT of its own short,
#: silently (a per-room look-back, the cluster's members, a report), ``sql_safe_updates`` refused
#: retention's DELETEs, and ``max_join_size`` refused migrate's reads (``sql_big_selects``).
UNGUARDED = ("sql_select_limit = 18446744073709551615", "sql_safe_updates = 0", "sql_big_selects = 1")

#: ``ssl_mode`` in a DSN, as MySQL's own client names its modes: ``disabled`` (no TLS), ``required``
#: (encrypted, the server's certificate not checked), ``verify_ca`` (it must chain to ``ssl_ca``,
#: or to the system's trust store) and ``verify_identity`` (that, and name the host connected to).
SSL_MODES = ("disabled", "required", "verify_ca", "verify_identity")
#: Seconds a new connection may take to reach the server and read its greeting.
CONNECT_TIMEOUT = 5
#: The DSN options a MySQL/MariaDB DSN may carry: TLS's, and the server's Unix socket.
_DSN_OPTIONS = ("ssl_mode", "ssl_ca", "ssl_cert", "ssl_key", "unix_socket")


@dataclass(frozen=True)
class MySQLAddress:
    host: str
    port: int
    user: str
    password: str
    database: str
    ssl_mode: str = "disabled"
    #: PEM files: the CA the server's certificate must chain to (empty: the system's trust
    #: store), and this client's certificate and key for a server that asks for one.
    ssl_ca: str = ""
    ssl_cert: str = ""
    ssl_key: str = ""
    #: The server's Unix socket file, connected to instead of host and port ("": TCP).
    unix_socket: str = ""

    @classmethod
    def from_dsn(cls, dsn: str) -> MySQLAddress:
        """``mysql://user:password@host:port/database[?ssl_mode=…&ssl_ca=…]``, or
        ``mysql://user:password@/database?unix_socket=/run/mysqld/mysqld.sock`` for a server on
        this machine. An ``ssl_ca`` without ``ssl_mode`` means ``verify_ca``, as for MySQL's
        client. Errors never echo the DSN, which holds the password."""
        parsed = parse_server_dsn(dsn, ("mysql", "mariadb", "mysql+aiomysql"), default_port=3306, default_user="root")
        unknown = set(parsed.query) - set(_DSN_OPTIONS)
        if unknown:
            raise DsnOptionError(
                f"database.dsn: unsupported options {sorted(unknown)} (allowed: {', '.join(_DSN_OPTIONS)})"
            )
        unix_socket = socket_option(parsed, "unix_socket")
        tls = {name: values[-1] for name, values in parsed.query.items() if name != "unix_socket"}
        mode = tls.pop("ssl_mode", "verify_ca" if tls.get("ssl_ca") else "disabled").lower()
        if mode not in SSL_MODES:
            raise DsnOptionError(f"database.dsn: ssl_mode={mode!r} is not one of {', '.join(SSL_MODES)}")
        if mode == "disabled" and tls:
            raise DsnOptionError(f"database.dsn: {', '.join(sorted(tls))} given with ssl_mode=disabled")
        if bool(tls.get("ssl_cert")) != bool(tls.get("ssl_key")):
            raise DsnOptionError("database.dsn: ssl_cert and ssl_key go together")
        address = cls(
            host=parsed.host,
            port=parsed.port,
            user=parsed.user,
            password=parsed.password,
            database=parsed.database,
            ssl_mode=mode,
            unix_socket=unix_socket,
            **tls,
        )
        address.tls_context()  # its files exist and hold what they should, before any connection
        return address

    async def connect(self, *session: str, **overrides: Any) -> aiomysql.Connection:
        """A connection of its own, outside the pool: :meth:`connect_kwargs` with ``session``'s
        assignments and ``overrides``, its TLS checked before the login
        (:meth:`refuse_without_tls`) and after (:meth:`check_tls`)."""
        await self.refuse_without_tls()
        conn = await aiomysql.connect(**{**self.connect_kwargs(*session), **overrides})
        self.check_tls(conn)
        return conn

    async def refuse_without_tls(self) -> None:
        """Refuse a server that :attr:`ssl_mode` wants encrypted and that offers no TLS, before
        any login: the driver would send the login unencrypted (the user's name, a scramble of the
        password open to guessing offline, the password itself for a plugin that asks for it),
        then go on in the clear. The offer is read from the greeting a server sends every new
        connection, on one closed without a word: MySQL's client refuses such a server at the
        same point."""
        if self.ssl_mode == "disabled" or self.unix_socket:
            return  # a Unix socket never leaves the machine: MySQL counts it as secure
        try:
            with anyio.fail_after(CONNECT_TIMEOUT):
                async with await anyio.connect_tcp(self.host, self.port) as stream:
                    greeting = await _read_packet(BufferedByteReceiveStream(stream))
        except (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            # As the driver reports a server it cannot reach: retried while the server starts.
            raise pymysql.err.OperationalError(2003, f"Can't connect to MySQL server on {self.host!r} ({exc})") from exc
        if offers_tls(greeting) is False:
            raise self._no_tls()

    def check_tls(self, conn: aiomysql.Connection) -> None:
        """Refuse, closing it, a connection that :attr:`ssl_mode` wants encrypted and is not: the
        pool opens its connections itself, without :meth:`refuse_without_tls`. The driver goes on
        without TLS when the server does not offer it: a server without TLS (or something
        between that hides the offer) must not get the statements in the clear."""
        if self.ssl_mode != "disabled" and not conn._secure:
            conn.close()
            raise self._no_tls()

    def _no_tls(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"MySQL at {self.location} offered no TLS, and database.dsn's ssl_mode is"
            f" {self.ssl_mode}: enable TLS on the server, or check that database.dsn names it"
        )

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context :attr:`ssl_mode` asks for (None: no TLS), made once for every
        connection. Its files are read then: a missing or unreadable one is a
        :class:`ValueError` naming the DSN's option."""
        return self._tls

    @cached_property
    def _tls(self) -> ssl.SSLContext | None:
        if self.ssl_mode == "disabled":
            return None
        context = as_servers_clients_check(ssl.create_default_context())
        if self.ssl_mode == "required":
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context.check_hostname = self.ssl_mode == "verify_identity"
            if self.ssl_ca:
                _load(context.load_verify_locations, "ssl_ca", cafile=self.ssl_ca)
        if self.ssl_cert:
            _load(context.load_cert_chain, "ssl_cert and ssl_key", certfile=self.ssl_cert, keyfile=self.ssl_key)
        return context

    @property
    def location(self) -> str:
        """Where the server is, as messages name it: its socket file, or ``host:port``."""
        return self.unix_socket or host_and_port(self.host, self.port)

    def connect_kwargs(self, *session: str) -> dict[str, Any]:
        """aiomysql's parameters; the session's init statement sets :data:`SQL_MODE`,
        :data:`TIME_ZONE`, :data:`CHARACTER_SET`, :data:`UNGUARDED` and the assignments in
        ``session``."""
        init = ", ".join(
            (f"sql_mode = '{SQL_MODE}'", f"time_zone = '{TIME_ZONE}'", *CHARACTER_SET, *UNGUARDED, *session)
        )
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": driver_password(self.password),
            "charset": "utf8mb4",
            "autocommit": False,
            # Matched, not changed, rows: a fenced UPDATE then counts what it found.
            "client_flag": CLIENT.FOUND_ROWS,
            "init_command": f"SET SESSION {init}",
            "connect_timeout": CONNECT_TIMEOUT,
            "ssl": self.tls_context(),
            "unix_socket": self.unix_socket or None,
        }

    def session_kwargs(self, server_version: str, limits: SessionLimits) -> dict[str, Any]:
        """:meth:`connect_kwargs` for the store's pool: every session also gets ``limits``,
        in one statement at connect time. MariaDB and MySQL name two of the variables
        differently: the isolation level, and the statement time limit (MySQL's applies to
        SELECTs only, the claim's among them)."""
        return self.connect_kwargs(
            read_committed(server_version),
            f"wait_timeout = {limits.idle_seconds}",
            f"innodb_lock_wait_timeout = {limits.lock_wait_seconds}",
            f"lock_wait_timeout = {limits.lock_wait_seconds}",
            f"net_read_timeout = {limits.network_seconds}",
            f"net_write_timeout = {limits.network_seconds}",
            statement_time_limit(server_version, limits.statement_seconds),
        )


def driver_password(password: str) -> str:
    """``password`` as aiomysql must be given it for the server to receive its UTF-8 bytes, as
    MySQL's own client sends them (and as ``IDENTIFIED BY`` over a utf8mb4 session stored them):
    aiomysql encodes the password as Latin-1, which fails on a character outside it (CJK) and
    sends another byte for one inside it (``é``)."""
    return password.encode("utf-8").decode("latin-1")


async def _read_packet(stream: BufferedByteReceiveStream) -> bytes:
    """One packet of MySQL's protocol: its length (3 bytes, little-endian), a sequence number,
    then its payload."""
    header = await stream.receive_exactly(4)
    return await stream.receive_exactly(int.from_bytes(header[:3], "little"))


#: The protocol version a server's greeting starts with (every server since MySQL 3.21).
_HANDSHAKE_V10 = 10


def offers_tls(greeting: bytes) -> bool | None:
    """Whether a server's greeting (the first packet of a connection) offers TLS: its
    capability flags' CLIENT_SSL. None when it is no greeting: an error the server sends
    instead (too many connections, a blocked host), left for the login to report."""
    if not greeting or greeting[0] != _HANDSHAKE_V10:
        return None
    version_end = greeting.find(b"\0", 1)
    flags_at = version_end + 1 + 4 + 8 + 1  # then the thread id, the salt's first part, a filler
    if version_end < 0 or len(greeting) < flags_at + 2:
        return None
    return bool(int.from_bytes(greeting[flags_at : flags_at + 2], "little") & CLIENT.SSL)


def read_committed(server_version: str) -> str:
    """The session assignment to READ COMMITTED, as MariaDB or MySQL names the variable."""
    isolation = "tx_isolation" if is_mariadb(server_version) else "transaction_isolation"
    return f"{isolation} = 'READ-COMMITTED'"


class _NoLockWaits:
    """A cursor whose statements fail at once rather than wait for a row lock: each runs
    with MariaDB's ``SET STATEMENT``, which costs no statement of its own, and leaves the
    session as it was."""

    def __init__(self, cur: aiomysql.Cursor) -> None:
        self._cur = cur

    async def execute(self, sql: str, args: Any = None) -> int:
        return int(await self._cur.execute(f"SET STATEMENT innodb_lock_wait_timeout = 0 FOR {sql}", args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


def _load(load: Callable[..., None], option: str, **files: str) -> None:
    try:
        load(**files)
    except (OSError, ssl.SSLError) as exc:
        raise DsnOptionError(f"database.dsn: {option}: cannot be read ({exc.strerror or exc})") from None


def is_mariadb(server_version: str) -> bool:
    return "mariadb" in server_version.lower()


def mysql_dialect(server_version: str) -> Dialect:
    """MySQL's dialect for this server: MySQL before 8.0.12 cannot add a column instantly, but
    in place without blocking writes (MariaDB has had INSTANT since 10.3)."""
    if not is_mariadb(server_version) and _version(server_version) < (8, 0, 12):
        return replace(MYSQL, online_column=", ALGORITHM=INPLACE, LOCK=NONE")
    return MYSQL


def _version(server_version: str) -> tuple[int, ...]:
    """The version's numbers: (8, 0, 11) for "8.0.11-log"; one that says none is taken for recent."""
    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", server_version)
    return tuple(int(n) for n in numbers.groups()) if numbers else (99,)


def statement_time_limit(server_version: str, seconds: int) -> str:
    """The assignment capping a statement's run time (0: none), in the server's dialect."""
    if is_mariadb(server_version):
        return f"max_statement_time = {seconds}"
    return f"max_execution_time = {seconds * 1000}"


class MySQLStore(LeasedRows):
    """:class:`~room_outbox.store.OutboxStore` on MySQL/MariaDB: owns the pool and keeps the
    main lane's state in ``room_outbox`` itself.

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
        self.dialect = mysql_dialect(server_version)
        #: Where ``migrate`` says how its long statements are doing.
        self.report_progress: Callable[[str], None] = to_stderr

    @classmethod
    async def connect(
        cls,
        dsn: str,
        pool_size: int = 10,
        create_database: bool = False,
        query_timeout: float = DEFAULT_QUERY_TIMEOUT,
        idle_in_transaction: float = 0.0,
    ) -> MySQLStore:
        """Open the pool; each step ends within ``query_timeout`` or raises :class:`QueryTimeout`.
        ``idle_in_transaction``: see :meth:`SessionLimits.for_query_timeout`."""
        address = MySQLAddress.from_dsn(dsn)
        limits = SessionLimits.for_query_timeout(query_timeout, idle_in_transaction)
        with query_deadline(query_timeout):
            conn = await address.connect()
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
        store = cls(pool, address, query_timeout, server_version)
        store.limits = limits
        return store

    @property
    def writes_beside_claims(self) -> bool:
        # Only MariaDB lets a session wait for no row lock at all (MySQL waits a second at least).
        return bool(self._pool.maxsize >= 2) and is_mariadb(self.server_version)

    @asynccontextmanager
    async def _beside_transaction(self) -> AsyncIterator[_NoLockWaits]:
        async with self.transaction() as cur:
            yield _NoLockWaits(cur)

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
        ``timeout`` (default ``query_timeout``) or raises :class:`QueryTimeout`. A statement
        failing for a column or index of room-outbox's that the outbox table lacks raises
        :class:`SchemaError` naming the fix (:func:`.errors.named_fix`)."""
        with self._timeouts.call(timeout or self.query_timeout), named_fix(self.dialect, self.profile):
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
                try:
                    self.address.check_tls(conn)
                except StoreUnavailable:
                    self._pool.release(conn)
                    raise
                return conn
            conn.close()
            self._pool.release(conn)

    # -- schema ------------------------------------------------------------------------

    async def migrate(self) -> list[str]:
        """Bring the outbox table up to date, online (see :mod:`.mysql_online`)."""
        return await registry.migrate(self)

    async def run_migration(self, planner: Planner) -> list[str]:
        """Holding migrate's lock (a schema change an interrupted migrate left running waited
        for first), run the plan ``planner`` reads statement by statement, each on a connection
        of its own with no statement time limit; return its changes."""
        async with exclusive_migration(self.address, [self.table], self.report_progress):
            async with self.transaction() as cur:
                plan = await planner(cur)
            # READ COMMITTED as every session here: a step's INSERT … SELECT from room_outbox
            # (a lane switched back from tailing) then locks none of the rows it reads, and
            # waits for no producer's transaction.
            session = f"{statement_time_limit(self.server_version, 0)}, {read_committed(self.server_version)}"
            schema_change = OnlineSchemaChange(self.address, session, self.report_progress)
            await schema_change.rehearse(self.table, plan)
            return await schema_change.run(plan)

    async def migration_plan(self) -> list[Migration]:
        """The statements that bring the outbox table up to date, read from the catalogue; none
        when it is. ``migrate`` runs them; ``migrate --sql`` prints them."""
        return await registry.migration_plan(self)
