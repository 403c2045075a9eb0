"""PostgreSQL behind PgBouncer, as many deployments reach it: a real PgBouncer (Debian's
package) in session pooling, its default, with its default handling of startup parameters,
between the store and the suite's PostgreSQL."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest
from support import envelope, free_port, insert_events, wait_until

from room_outbox.store.backends.postgres import PostgresAddress, PostgresStore
from room_outbox.store.clock import now_ms
from room_outbox.store.protocol import DeliveryResult, Outcome

pytestmark = pytest.mark.anyio


@pytest.fixture
async def pgbouncer(postgresql_dsn: str, tmp_path: Path) -> AsyncIterator[str]:
    """A PgBouncer in front of the suite's PostgreSQL; yields the DSN of ``postgresql_dsn``'s
    database through it."""
    binary = shutil.which("pgbouncer", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    if binary is None:
        pytest.fail("pgbouncer is missing: install the Debian package pgbouncer (scripts/test.sh does)")
    server = PostgresAddress.from_dsn(postgresql_dsn)
    port = free_port()
    config = tmp_path / "pgbouncer.ini"
    config.write_text(
        "[databases]\n"
        f"* = host={server.host} port={server.port} user={server.user}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = any\npool_mode = session\n"
    )
    # PgBouncer refuses to run as root: it reads its configuration, then becomes nobody.
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    process = subprocess.Popen(
        [binary, *as_user, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    dsn = f"postgresql://{server.user}@127.0.0.1:{port}/{server.database}"
    try:

        def answers() -> bool:
            assert process.poll() is None, f"pgbouncer exited: {process.stderr.read() if process.stderr else ''}"
            try:
                psycopg.connect(dsn, connect_timeout=2).close()
            except psycopg.OperationalError:
                return False
            return True

        await wait_until(answers, timeout=10.0, interval=0.05)
        yield dsn
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


async def test_the_store_works_through_pgbouncer_with_its_session_bounds(pgbouncer: str) -> None:
    """PgBouncer refuses libpq's startup parameter ``options`` unless told to ignore it, and
    then drops it: the store sets its sessions' bounds and isolation with statements instead,
    so it connects, migrates, claims and records through PgBouncer with every bound in place."""
    store = await PostgresStore.connect(pgbouncer, query_timeout=1.5)
    try:
        await store.migrate()
        async with store.transaction() as cur:
            settings = {}
            for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout",
                         "transaction_isolation"):  # fmt: skip
                await cur.execute(f"SHOW {name}")
                settings[name] = (await cur.fetchone())[0]
        assert settings == {
            "statement_timeout": "5s",
            "lock_timeout": "2s",
            "idle_in_transaction_session_timeout": "5s",
            "transaction_isolation": "read committed",
        }
        await insert_events(store, [envelope(f"e{i}") for i in range(3)])
        claimed = await store.claim("a#1", 10, now_ms() + 60_000)
        assert [r.event_id for r in claimed.rows] == ["e0", "e1", "e2"]
        stale = await store.record([DeliveryResult(r.id, r.event_id, "a#1", Outcome.PUBLISHED) for r in claimed.rows])
        assert stale == []
        assert (await store.claim("a#2", 10, now_ms() + 60_000)).rows == []
    finally:
        await store.aclose()
