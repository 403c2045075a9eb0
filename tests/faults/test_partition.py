"""A network partition between `room-outbox run` and the database, half-open: the proxy
swallows every byte and closes nothing, so the process's connections hang (nothing answers,
nothing fails) and the server's sessions live on with their locks.

The bounds under test (docs/explanation/database-deadlines.md):

* the running process resumes within ``query_timeout`` + ``poll_interval`` of the heal;
* rows a dead session had claimed are delivered by a fresh process once the server has ended
  that session (``SessionLimits.idle_seconds``) and the lease has passed;
* SIGTERM during a partition ends the process within ``publish_timeout`` + ``query_timeout`` + 1 s;
* on PostgreSQL, after an outage (connections refused) of any length, the running process resumes
  within ``query_timeout`` + ``poll_interval`` of the database answering again.

Each test prints the figure it measured (``pytest -s`` shows them).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from faults.tcp_proxy import TcpProxy
from faults.test_faults import all_published, received_ids
from processes import DispatcherProcess, FakeIMProcess, dispatchers, write_config
from support import envelope, fetch_rows, insert_events, wait_until

from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.backends.postgres_address import PostgresAddress
from room_outbox.store.deadline import SessionLimits
from room_outbox.store.factory import open_store

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.serial]

QUERY_TIMEOUT = 1.0
POLL_INTERVAL = 0.1
PUBLISH_TIMEOUT = 1.0
LEASE = 4.0  # query_timeout must stay below a third of it
#: How long the server keeps a session whose client vanished.
SERVER_BOUND = SessionLimits.for_query_timeout(QUERY_TIMEOUT).idle_seconds
#: Room for a loaded test machine: process scheduling, the fake IM, the test's own polling.
SLACK = 1.0


@pytest.fixture
def fake_im(tmp_path: Path):  # type: ignore[no-untyped-def]
    fake = FakeIMProcess(tmp_path)
    yield fake
    fake.close()


def config(path: Path, dsn: str, fake: FakeIMProcess, **worker: Any) -> Path:
    return write_config(
        path,
        dsn,
        fake,
        sections={
            "mysql": {"query_timeout": f"{QUERY_TIMEOUT:g}s"},
            "telemetry": {"http_listen": "127.0.0.1:0"},
            # A fresh process sends to IM once the killed one's heartbeat has expired.
            "cluster": {"heartbeat_interval": "300ms", "node_timeout": "3s"},
        },
        poll_interval=f"{POLL_INTERVAL * 1000:g}ms",
        publish_timeout=f"{PUBLISH_TIMEOUT:g}s",
        lease=f"{LEASE:g}s",
        **worker,
    )


def proxied(dsn: str, proxy: TcpProxy) -> str:
    real = MySQLAddress.from_dsn(dsn)
    return f"mysql://{real.user}:{real.password}@127.0.0.1:{proxy.port}/{real.database}"


def failed_rounds(proc: DispatcherProcess) -> list[dict[str, Any]]:
    return [line for line in proc.lines() if line["msg"].startswith("outbox round failed")]


async def rounds_failed(http: httpx.AsyncClient, base: str, more_than: int = 0) -> int:
    """Lane main's failed rounds in a row as ``/readyz`` counts them (shown once they make the
    process unready), when more than ``more_than``; else 0."""
    answer = await http.get(f"{base}/readyz")
    check = answer.json().get("lane main", "") if answer.status_code == 503 else ""
    counted = re.match(r"(\d+) rounds failed in a row, the last: ", check)
    failed = int(counted[1]) if counted else 0
    return failed if failed > more_than else 0


async def endpoint_of(proc: DispatcherProcess) -> str:
    def listening() -> bool:
        return any(line.get("lifecycle") == "http_started" for line in proc.lines())

    await wait_until(listening, timeout=30)
    port = next(line["port"] for line in proc.lines() if line.get("lifecycle") == "http_started")
    return f"http://127.0.0.1:{port}"


def figure(name: str, seconds: float, bound: float) -> None:
    print(f"\nFIGURE {name}: {seconds:.2f}s (bound {bound:g}s)")


async def test_the_running_process_resumes_after_a_partition_heals(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    real = MySQLAddress.from_dsn(database_dsn)
    async with TcpProxy(real.host, real.port) as proxy, httpx.AsyncClient(timeout=10) as http:
        await insert_events(store, [envelope(f"a{i}") for i in range(20)])
        with dispatchers(config(tmp_path / "c.yaml", proxied(database_dsn, proxy), fake_im)) as (proc,):
            base = await endpoint_of(proc)
            await wait_until(lambda: all_published(store, 20), timeout=60)

            proxy.partition()
            await insert_events(store, [envelope(f"b{i}") for i in range(20)])  # room-service keeps writing
            # Rounds fail, each within query_timeout: the process turns unready, counting them,
            # yet stays live (its rounds keep ending). The log has the first failure, with its
            # lane, not a line per round.
            await wait_until(lambda: rounds_failed(http, base), timeout=10 * QUERY_TIMEOUT)
            [failure] = failed_rounds(proc)
            assert failure["lane"] == "main" and "query_timeout" in failure["error"], failure
            assert (await http.get(f"{base}/healthz")).status_code == 200
            assert not {f"b{i}" for i in range(20)} & set(received_ids(fake_im))

            # Heal just after a round failed: the next one has just begun on a dark connection
            # and must run out its query_timeout first, the worst case of the bound.
            failures = await rounds_failed(http, base)
            await wait_until(lambda: rounds_failed(http, base, more_than=failures), timeout=5 * QUERY_TIMEOUT)
            healed = time.monotonic()
            proxy.heal()
            await wait_until(lambda: {f"b{i}" for i in range(20)} <= set(received_ids(fake_im)), timeout=30)
            recovery = time.monotonic() - healed

            async def ready() -> bool:
                return (await http.get(f"{base}/readyz")).status_code == 200

            await wait_until(ready, timeout=10)
            await wait_until(lambda: all_published(store, 40), timeout=10)
            assert proc.alive()

            def recovery_lines() -> list[dict[str, Any]]:
                return [line for line in proc.lines() if line["msg"] == "outbox rounds succeed again"]

            # Logged just after the round that succeeded: it may reach the reader a moment later.
            await wait_until(lambda: bool(recovery_lines()), timeout=10)
            [recovered] = recovery_lines()
            assert recovered["lane"] == "main" and recovered["failed_rounds"] > failures, recovered
            # Every failed round counted for the alert, though logged once
            metrics = (await http.get(f"{base}/metrics")).text
            counted = re.search(r'^room_outbox_round_failures_total\{lane="main"\} (\S+)$', metrics, re.M)
            assert counted and float(counted.group(1)) >= recovered["failed_rounds"], metrics
    assert not proxy.links  # every proxied session closed with the proxy
    figure("recovery after heal", recovery, QUERY_TIMEOUT + POLL_INTERVAL)
    assert recovery <= QUERY_TIMEOUT + POLL_INTERVAL + SLACK, recovery


async def test_a_fresh_process_delivers_rows_claimed_by_a_dead_session(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    real = MySQLAddress.from_dsn(database_dsn)
    ids = {f"d{i}" for i in range(20)}
    await insert_events(store, [envelope(event_id) for event_id in sorted(ids)])
    async with TcpProxy(real.host, real.port) as proxy:
        # The partition starts on the COMMIT of the victim's claim: its session keeps the
        # claimed rows locked, in a transaction that will never end on the client's word. (The
        # claim writes its worker id; start-up's privilege check sets the column to NULL.)
        proxy.partition_at_commit(b"SET worker_id = '")
        victim_dir = tmp_path / "victim"
        victim_dir.mkdir()
        with dispatchers(config(victim_dir / "c.yaml", proxied(database_dsn, proxy), fake_im)) as (victim,):
            await wait_until(proxy.partitioned.is_set, timeout=30)
            partitioned = time.monotonic()
            victim.kill()
        assert proxy.triggered_by is not None and proxy.triggered_by.server_thread_id is not None
        dead_session = proxy.triggered_by.server_thread_id
        assert await rows_locked_by(store, dead_session) >= len(ids)
        assert all(row["worker_id"] is None for row in (await fetch_rows(store)).values())  # lease never committed

        fresh = DispatcherProcess(config(tmp_path / "c.yaml", database_dsn, fake_im), "fresh")
        try:
            await wait_until(lambda: all_published(store, len(ids)), timeout=30)
            delivered = time.monotonic() - partitioned
        finally:
            fresh.kill()
        assert not await session_alive(store, dead_session)  # the server ended it
    assert set(received_ids(fake_im)) == ids  # the victim delivered nothing: only the fresh process did
    figure("rows of a dead session delivered after", delivered, SERVER_BOUND)
    # The server ends the session SERVER_BOUND after its last word; the fresh process, started
    # meanwhile, claims the freed rows within a poll or two.
    assert delivered <= SERVER_BOUND + QUERY_TIMEOUT + POLL_INTERVAL + 2 * SLACK, delivered


async def test_sigterm_during_a_partition_ends_the_process_in_time(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    fake_im.set_faults(latency=0.3)
    await insert_events(store, [envelope(f"s{i:03}", room_id=f"r_{i % 10}") for i in range(200)])
    real = MySQLAddress.from_dsn(database_dsn)
    async with TcpProxy(real.host, real.port) as proxy:
        with dispatchers(config(tmp_path / "c.yaml", proxied(database_dsn, proxy), fake_im, batch_size=20)) as (proc,):
            await wait_until(lambda: len(fake_im.messages()) >= 30, timeout=60)
            proxy.partition()
            await wait_until(lambda: len(failed_rounds(proc)) >= 1, timeout=10 * QUERY_TIMEOUT)  # stuck on it now
            took = await anyio.to_thread.run_sync(proc.terminate)
            assert proc.proc.returncode == 0
    figure("SIGTERM during a partition", took, PUBLISH_TIMEOUT + QUERY_TIMEOUT + 1)
    assert took <= PUBLISH_TIMEOUT + QUERY_TIMEOUT + 1.0, took


async def test_the_running_process_resumes_after_a_long_postgresql_outage(
    postgresql_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    """The database unreachable (every connection refused) for longer than the connection pool's
    own retry delays would grow to: once it answers again, the process resumes within the
    bound, not when the pool's next attempt comes due (seconds later, minutes after a longer
    outage)."""
    store = await open_store(postgresql_dsn)
    real = PostgresAddress.from_dsn(postgresql_dsn)
    try:
        await store.migrate()
        async with TcpProxy(real.host, real.port) as proxy, httpx.AsyncClient(timeout=10) as http:
            via_proxy = f"postgresql://{real.user}@127.0.0.1:{proxy.port}/{real.database}"
            await insert_events(store, [envelope(f"a{i}") for i in range(20)])
            with dispatchers(config(tmp_path / "c.yaml", via_proxy, fake_im)) as (proc,):
                base = await endpoint_of(proc)
                await wait_until(lambda: all_published(store, 20), timeout=60)

                await proxy.cut()
                cut = time.monotonic()
                await insert_events(store, [envelope(f"b{i}") for i in range(20)])
                await wait_until(lambda: rounds_failed(http, base), timeout=10 * QUERY_TIMEOUT)
                # The outage itself, not a sync: long enough for the pool's retry delays, doubling
                # from 1 s, to run past its end (psycopg_pool's own: 1, 2, 4, 8 s …).
                await anyio.sleep(max(0.0, 8.0 - (time.monotonic() - cut)))
                await proxy.restore()
                restored = time.monotonic()
                await wait_until(lambda: {f"b{i}" for i in range(20)} <= set(received_ids(fake_im)), timeout=60)
                recovery = time.monotonic() - restored

                async def ready() -> bool:
                    return (await http.get(f"{base}/readyz")).status_code == 200

                await wait_until(ready, timeout=10)
                assert proc.alive()
                # The pool tried again every second or so; its failures make one line, not one each.
                pool_lines = [line["msg"] for line in proc.lines() if line["logger"] == "psycopg.pool"]
                assert len(pool_lines) == 1 and pool_lines[0].startswith("error connecting"), pool_lines
        assert not proxy.links
    finally:
        await store.aclose()
    figure("recovery after a PostgreSQL outage", recovery, QUERY_TIMEOUT + POLL_INTERVAL)
    assert recovery <= QUERY_TIMEOUT + POLL_INTERVAL + SLACK, recovery


async def rows_locked_by(store: MySQLStore, session: int) -> int:
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT trx_rows_locked FROM information_schema.INNODB_TRX WHERE trx_mysql_thread_id = %s", (session,)
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def session_alive(store: MySQLStore, session: int) -> bool:
    async with store.transaction() as cur:
        await cur.execute("SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = %s", (session,))
        return await cur.fetchone() is not None
