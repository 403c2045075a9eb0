"""Helpers shared by the tests: room-service-style inserts, row reads, waiting on conditions."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc
import pytest

from room_outbox import SinkSpec, hookimpl
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.schema.outbox import TABLE, V1_TABLE_DDL

#: Set ROOM_OUTBOX_TEST_POSTGRESQL (postgresql://user:password@host:port) to use another server.
POSTGRESQL_SERVER_DSN = os.environ.get("ROOM_OUTBOX_TEST_POSTGRESQL", "postgresql://postgres@127.0.0.1:5432")

#: room-service's own V1 table on MySQL/MariaDB: the store's DDL, as migrate creates it.
V1_DDL = V1_TABLE_DDL["mysql"][0].format(table=TABLE)

INSERT_V1 = (
    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
)


def envelope(event_id: str, event_type: str = "RoomUserJoined", room_id: str = "r_1", **extra: Any) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "event_type": event_type,
        "app_code": "default",
        "room_id": room_id,
        "room_version": extra.pop("room_version", 1),
        "occurred_at_ms": int(time.time() * 1000),
        "payload": extra.pop("payload", {"user_id": "u1"}),
        **extra,
    }


async def insert_events(store: MySQLStore, envelopes: list[dict[str, Any]]) -> None:
    """Insert envelopes as room-service does: V1 columns only, status left to its default."""
    await insert_rows(
        store, [(e.get("app_code", ""), e["event_id"], e["event_type"], e["room_id"], json.dumps(e)) for e in envelopes]
    )


async def insert_rows(store: MySQLStore, rows: list[tuple[str, str, str, str, str | bytes | None]]) -> None:
    """Insert raw rows (app_code, event_id, event_type, room_id, envelope): for bad input."""
    now = int(time.time() * 1000)
    async with store.transaction() as cur:
        await cur.executemany(INSERT_V1, [(*row, now, now) for row in rows])


async def key_event_ids_per_app(store: Any) -> None:
    """room_outbox's event_id key swapped for ``UNIQUE (app_code, event_id)``, as room-service may
    key a Room Cell table when consumers keep their idempotency per app: one event id may then
    name rows of several apps."""
    drop = {
        "mysql": "ALTER TABLE room_outbox DROP INDEX uk_room_outbox_event_id",
        "postgresql": "ALTER TABLE room_outbox DROP CONSTRAINT uk_room_outbox_event_id",
        "sqlite": "DROP INDEX uk_room_outbox_event_id",
    }[store.dialect.name]
    async with store.transaction() as cur:
        await cur.execute(drop)
        await cur.execute("CREATE UNIQUE INDEX uk_room_outbox_app_event ON room_outbox (app_code, event_id)")


async def statuses_by_app(store: Any, event_id: str) -> dict[str, str]:
    """The status of each app's row of ``event_id``."""
    async with store.transaction() as cur:
        await cur.execute("SELECT app_code, status FROM room_outbox WHERE event_id = %s", (event_id,))
        return {str(app): str(status) for app, status in await cur.fetchall()}


@contextlib.asynccontextmanager
async def id_held_open(store: Any, event_id: str, room_id: str = "late-room") -> AsyncIterator[anyio.Event]:
    """An event inserted in a transaction that commits once the event yielded is set (or the
    block ends): its id is missing meanwhile, below every id inserted after it, as a
    room-service transaction still open leaves it."""
    commit = anyio.Event()

    async def hold(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with store.transaction(timeout=300) as cur:
            now = int(time.time() * 1000)
            row = json.dumps(envelope(event_id, room_id=room_id))
            await cur.execute(INSERT_V1, ("", event_id, "RoomUserJoined", room_id, row, now, now))
            task_status.started()
            await commit.wait()

    async with anyio.create_task_group() as holder:
        await holder.start(hold)
        try:
            yield commit
        finally:
            commit.set()


async def execute(store: Any, *statements: str) -> None:
    """Each of ``statements`` run in one transaction of ``store`` (a table's set-up)."""
    async with store.transaction() as cur:
        for statement in statements:
            await cur.execute(statement)


#: How ``migrate`` leaves the outbox table on MySQL/MariaDB: it created it (the room bucket a
#: STORED column, last in the claim index), it adopted room-service's table (no bucket column:
#: claims compute it on the row), or an earlier version adopted it (the bucket a VIRTUAL
#: column in the claim index, kept for that version's processes).
CREATED, ADOPTED, ADOPTED_EARLIER = "created", "adopted", "adopted_earlier"
TABLE_SHAPES = (CREATED, ADOPTED, ADOPTED_EARLIER)
#: What an earlier version's migrate changed in room-service's table (its own indexes aside).
EARLIER_ADOPTION = (
    "ALTER TABLE room_outbox ADD COLUMN worker_id VARCHAR(128) NULL DEFAULT NULL,"
    " ADD COLUMN lock_until_ms BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE room_outbox ADD COLUMN room_bucket SMALLINT UNSIGNED"
    " AS (CRC32(CONCAT(app_code, ':', room_id)) % 256) VIRTUAL",
    "ALTER TABLE room_outbox ADD INDEX idx_room_outbox_claim (status, lock_until_ms, id, room_bucket)",
)


async def migrated_in_shape(store: Any, shape: str) -> None:
    """Migrate ``store``'s (MySQL/MariaDB) fresh database, its outbox table left in ``shape``."""
    if shape != CREATED:
        await execute(store, V1_DDL, *(EARLIER_ADOPTION if shape == ADOPTED_EARLIER else ()))
    await store.migrate()


async def fetch_rows(store: MySQLStore) -> dict[str, dict[str, Any]]:
    """event_id → row (as a dict) for every row of room_outbox."""
    async with store.transaction() as cur:
        await cur.execute("SELECT * FROM room_outbox ORDER BY id")
        names = [d[0] for d in cur.description]
        return {row[names.index("event_id")]: dict(zip(names, row, strict=True)) for row in await cur.fetchall()}


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0, interval: float = 0.02
) -> None:
    """Poll ``predicate`` (sync or async) until it is true; fail after ``timeout`` seconds.
    This is how tests synchronise: on a condition with a deadline, never on a blind sleep."""
    deadline = time.monotonic() + timeout
    while not await _truth(predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        await anyio.sleep(interval)


def wait_until_sync(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    """:func:`wait_until` for code outside an event loop (a module-scoped fixture starting a
    server)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        time.sleep(interval)


def without_room_outbox_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset every ``ROOM_OUTBOX*`` variable for the test: only its own file configures it."""
    for name in list(os.environ):
        if name.startswith("ROOM_OUTBOX"):
            monkeypatch.delenv(name)


class Runner(Protocol):
    """A dispatcher or a consumer: ``run`` until ``stop``."""

    async def run(self, *, task_status: Any = ...) -> None: ...

    def stop(self) -> None: ...


@contextlib.asynccontextmanager
async def running(*runners: Runner) -> AsyncIterator[None]:
    """Run each of ``runners`` in a task group for the block, and stop them all on the way
    out whatever ended it: a test that fails midway ends at once, instead of its task group
    waiting for ever on loops nobody stopped."""
    async with anyio.create_task_group() as tg:
        try:
            for runner in runners:
                await tg.start(runner.run)
            yield
        finally:
            for runner in runners:
                runner.stop()


async def _truth(value: Awaitable[bool] | bool) -> bool:
    return await value if inspect.isawaitable(value) else bool(value)


class StatementLog:
    """The statements a store's transactions send from :meth:`watch` on: each one's number of
    parameters, and on MySQL/MariaDB its size as the server receives it (the driver puts the
    parameters in the text), which a server's ``max_allowed_packet`` bounds."""

    def __init__(self) -> None:
        self.parameters: list[int] = []
        self.sizes: list[int] = []

    def watch(self, store: Any, monkeypatch: pytest.MonkeyPatch) -> StatementLog:
        given = store.transaction

        @contextlib.asynccontextmanager
        async def watched(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            async with given(*args, **kwargs) as cur:
                yield _LoggingCursor(cur, self)

        monkeypatch.setattr(store, "transaction", watched)
        return self


class _LoggingCursor:
    def __init__(self, cur: Any, log: StatementLog) -> None:
        self._cur, self._log = cur, log

    async def execute(self, sql: str, args: Any = None) -> Any:
        self._log.parameters.append(len(args or ()))
        if hasattr(self._cur, "mogrify"):  # aiomysql's: the text it sends
            self._log.sizes.append(len(self._cur.mogrify(sql, args).encode()))
        return await self._cur.execute(sql, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class RecordingSink:
    """A sink that records what it received and can fail, hang or dawdle per event_id."""

    def __init__(
        self,
        fail: set[str] | None = None,
        hang: set[str] | None = None,
        delay: float = 0.0,
        error: BaseException | None = None,
    ) -> None:
        self.received: list[str] = []
        #: The last envelope received for each event_id.
        self.envelopes: dict[str, Any] = {}
        self.fail = fail or set()
        self.hang = hang or set()
        self.delay = delay
        self.error = error
        self.closed = False

    async def deliver(self, envelope: Any) -> None:
        from room_outbox.sink import RetryableSinkError

        self.received.append(envelope.event_id)
        self.envelopes[envelope.event_id] = envelope
        if envelope.event_id in self.hang:
            await anyio.sleep_forever()
        if self.delay:
            await anyio.sleep(self.delay)
        if envelope.event_id in self.fail:
            raise self.error or RetryableSinkError(f"refused {envelope.event_id}")

    async def aclose(self) -> None:
        self.closed = True


def make_dispatcher(
    store: MySQLStore, sink: Any, event_types: Any = None, node_id: str = "test", redactor: Any = None, **options: Any
) -> Any:
    """A dispatcher whose lane routes ``event_types`` (default: every known type) to ``sink``."""
    from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
    from room_outbox.delivery.routing import Router
    from room_outbox.envelope import KNOWN_EVENT_TYPES

    routes = {t: "test" for t in (event_types or KNOWN_EVENT_TYPES)}
    from room_outbox.attempt.retry import RetryPolicy

    options.setdefault("poll_interval", 0.05)
    options.setdefault("retry", RetryPolicy(interval=options["poll_interval"]))
    return Dispatcher(store, Router({"test": sink}, routes), LaneOptions(**options), node_id, redactor)


class SinkPlugin:
    """A plugin registering ``sink`` under ``name``: the plugin path, without an entry point."""

    def __init__(self, name: str, sink: Any) -> None:
        self.name = name
        self.sink = sink

    @hookimpl
    def room_outbox_register_sinks(self) -> list[SinkSpec]:
        return [SinkSpec(self.name, lambda _settings, _context: self.sink)]


def pg_admin(sql: str) -> None:
    import psycopg

    try:
        conn = psycopg.connect(f"{POSTGRESQL_SERVER_DSN}/postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:  # fail loudly: the suite needs this server
        pytest.fail(f"PostgreSQL at {POSTGRESQL_SERVER_DSN} does not answer ({exc}); start it first", pytrace=False)
    try:
        conn.execute(sql)  # type: ignore[arg-type]
    finally:
        conn.close()


@contextlib.contextmanager
def mysql_global(dsn: str, name: str, value: Callable[[Any], object]) -> Iterator[None]:
    """The global variable ``name`` of ``dsn``'s server set to ``value(its value before)`` for
    the block, as a server's default for the sessions opened meanwhile; restored afterwards.
    Tests that use it are serial: every session of the suite would see it."""
    import pymysql

    address = MySQLAddress.from_dsn(dsn)
    conn = pymysql.connect(
        host=address.host, port=address.port, user=address.user, password=address.password, connect_timeout=5
    )
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT @@GLOBAL.{name}")
            (before,) = cur.fetchone()
            cur.execute(f"SET GLOBAL {name} = %s", (value(before),))
            try:
                yield
            finally:
                cur.execute(f"SET GLOBAL {name} = %s", (before,))
    finally:
        conn.close()


def kill_if_running(proc: subprocess.Popen[Any]) -> None:
    """For a test's ``finally``: a process the test did not see end is killed, and reaped."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: its certificate and key."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
            "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return cert, key


def loopback_certificate(folder: Path, ca: Path, ca_key: Path) -> tuple[Path, Path]:
    """A server certificate signed by ``ca``, naming 127.0.0.1 and localhost: its file and key."""
    cert, key = folder / "server.pem", folder / "server.key"
    csr, ext = folder / "server.csr", folder / "server.ext"
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=server")
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return cert, key


#: A PostgreSQL producer as a process of its own (no share in the test's interpreter lock):
#: ``INSERT`` with ``ARGS(n)`` for the n-th row, every ``EVERY`` seconds until its standard
#: input closes; then every INSERT's latency, one a line.
_PG_PRODUCER = """
import json, sys, threading, time, psycopg
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies = []
with psycopg.connect(sys.argv[1], autocommit=True, connect_timeout=5) as conn:
    conn.execute("SET statement_timeout = '60s'")
    print("started", flush=True)
    while not stop.is_set():
        began = time.perf_counter()
        conn.execute(INSERT, ARGS(len(latencies)))
        latencies.append(time.perf_counter() - began)
        stop.wait(max(0.0, EVERY - (time.perf_counter() - began)))
print("\\n".join(map(str, latencies)), flush=True)
"""


@contextlib.contextmanager
def pg_producing(dsn: str, insert: str, args: str, every: float) -> Iterator[list[float]]:
    """A producer inserting into ``dsn`` for the block: ``insert`` with the parameters
    ``args`` (the source of a function of the row's number ``n``; ``json`` is imported) gives,
    every ``every`` seconds. The list holds each INSERT's latency once the block ends."""
    latencies: list[float] = []
    script = f"INSERT = {insert!r}\nARGS = {args}\nEVERY = {every!r}\n{_PG_PRODUCER}"
    process = subprocess.Popen(
        [sys.executable, "-c", script, dsn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        assert process.stdout.readline().strip() == "started"
        yield latencies
    finally:
        try:
            out, _ = process.communicate(timeout=30)
        finally:
            process.kill()
    assert process.returncode == 0, out
    latencies += [float(line) for line in out.split()]


class PrivateMariaDB:
    """A MariaDB server of the test's own (Debian's server package) on a loopback port, in
    ``folder``, started with ``options`` besides its data directory, port and socket: for server
    settings the suite's server must not change (TLS required, binary logging)."""

    def __init__(self, folder: Path, *options: str) -> None:
        self.folder = folder
        self.options = options
        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None

    def dsn(self, options: str = "", database: str = "room") -> str:
        return f"mysql://root:@127.0.0.1:{self.port}/{database}{'?' + options if options else ''}"

    def start(self, answers: Callable[[], bool] | None = None) -> None:
        """Start it and wait until ``answers`` (default: a plain login succeeds)."""
        import pymysql

        binaries = {name: shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin")
                    for name in ("mariadb-install-db", "mariadbd")}  # fmt: skip
        missing = [name for name, path in binaries.items() if path is None]
        if missing:
            pytest.fail(f"{', '.join(missing)} missing: install the Debian package mariadb-server")
        data = self.folder / "data"
        as_root = ["--user=root"] if os.geteuid() == 0 else []
        subprocess.run(
            [str(binaries["mariadb-install-db"]), "--no-defaults", f"--datadir={data}", *as_root,
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [str(binaries["mariadbd"]), "--no-defaults", *as_root, f"--datadir={data}", f"--port={self.port}",
             "--bind-address=127.0.0.1", f"--socket={self.folder / 'mysqld.sock'}",
             f"--log-error={self.folder / 'error.log'}", "--innodb-buffer-pool-size=32M", *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip

        def logs_in() -> bool:
            try:
                pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2).close()
            except pymysql.err.OperationalError:
                return False
            return True

        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, (self.folder / "error.log").read_text()[-2000:]
            return (answers or logs_in)()

        wait_until_sync(up, timeout=60.0, interval=0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def install_plugin(site: Path, module: str, source: str, name: str = "") -> dict[str, str]:
    """``source`` as the plugin module ``module`` of a distribution installed under ``site``,
    its entry point ``name`` (default: the module's) in ``room_outbox.plugins``; the
    environment variable that makes a process see it."""
    site.mkdir()
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[room_outbox.plugins]\n{name or module} = {module}\n")
    return {"PYTHONPATH": str(site)}
