"""room-service's synchronous push against a running worker (V1's hybrid deployment).

room-service commits each event's row, pushes it to IM itself, then runs
``UPDATE room_outbox SET status='published' WHERE event_id=?``. With the default settings the
worker claims none of those rows before they are marked (``outbox_worker.claim_after``), so
room-service's UPDATE never meets the worker's locks: no deadlock (MySQL error 1213), no
lock-wait timeout (1205), and no event pushed by room-service is sent again.

It runs for a minute: with ``claim_after`` 0 the same run saw 1 to 5 deadlocks a minute, so a
shorter one would often pass on the racing behaviour too.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import aiomysql
import anyio
import pymysql
import pytest
from processes import FakeIMProcess, dispatchers, write_config
from support import INSERT_V1, envelope, fetch_rows, wait_until

from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore

# Not serial: it asserts no deadlock, no lock-wait timeout and no event sent twice, none of which
# a busy machine makes more likely (the worker waits claim_after, seconds, where room-service's
# push and UPDATE take milliseconds); alone it would add its minute to the serial stage.
pytestmark = pytest.mark.anyio

#: The issue's scenario: 100 commands a second for a minute, each pushed for 30 ms.
COMMANDS_PER_SECOND = 100
SECONDS = 60
PUSH_MS = 30
#: Every tenth push "fails": the row stays pending and the worker must deliver it.
FAILED_PUSH_EVERY = 10
#: room-service's own bound on a lock wait (the server's default is 50 s, longer than the run).
LOCK_WAIT_SECONDS = 5
DEADLOCK, LOCK_WAIT_TIMEOUT = 1213, 1205


class RoomService:
    """room-service's outbox statements, on connections of its own at the server's default
    isolation level: INSERT and commit, the push (a pause: its duration is what matters
    here), then the UPDATE to published and commit."""

    def __init__(self, pool: aiomysql.Pool) -> None:
        self.pool = pool
        self.errors: Counter[int] = Counter()
        self.pushed: set[str] = set()
        self.not_pushed: set[str] = set()
        self.slowest_update = 0.0

    async def command(self, n: int) -> None:
        event_id = f"e{n:06d}"
        await self._execute(INSERT_V1, self._row(event_id))
        if n % FAILED_PUSH_EVERY == 0:
            self.not_pushed.add(event_id)
            return
        await anyio.sleep(PUSH_MS / 1000)  # the synchronous push to IM
        started = time.monotonic()
        if await self._execute("UPDATE room_outbox SET status = 'published' WHERE event_id = %s", (event_id,)):
            self.pushed.add(event_id)
        self.slowest_update = max(self.slowest_update, time.monotonic() - started)

    async def _execute(self, sql: str, params: tuple[object, ...]) -> bool:
        async with self.pool.acquire() as conn:
            try:
                async with conn.cursor() as cur:
                    await cur.execute(sql, params)
                await conn.commit()
                return True
            except pymysql.err.OperationalError as exc:
                await conn.rollback()
                if exc.args[0] not in (DEADLOCK, LOCK_WAIT_TIMEOUT):
                    raise
                self.errors[exc.args[0]] += 1
                return False

    @staticmethod
    def _row(event_id: str) -> tuple[object, ...]:
        now = int(time.time() * 1000)
        body = envelope(event_id, room_id=f"r_{int(event_id[1:]) % 50}")
        return ("default", event_id, "RoomUserJoined", body["room_id"], json.dumps(body), now, now)


async def run_commands(service: RoomService, commands: int, rate: float) -> None:
    """Start one command every 1/rate seconds, each in its own task (commands of different
    rooms overlap, as in room-service)."""
    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for n in range(commands):
            await anyio.sleep(max(0.0, started + n / rate - time.monotonic()))  # pacing, not waiting
            tg.start_soon(service.command, n)


@pytest.mark.slow
@pytest.mark.timeout(300)  # a minute of commands, then the worker's compensation
async def test_room_service_never_deadlocks_against_the_worker(
    tmp_path: Path, database_dsn: str, store: MySQLStore
) -> None:
    fake = FakeIMProcess(tmp_path)
    address = MySQLAddress.from_dsn(database_dsn)
    pool = await aiomysql.create_pool(
        minsize=4,
        maxsize=32,
        host=address.host,
        port=address.port,
        user=address.user,
        password=address.password,
        db=address.database,
        autocommit=False,
        connect_timeout=5,
        init_command=f"SET SESSION innodb_lock_wait_timeout = {LOCK_WAIT_SECONDS}",
    )
    try:
        config = write_config(tmp_path / "config.yaml", database_dsn, fake, claim_after=None)
        with dispatchers(config) as (worker,):
            await wait_until(lambda: "worker_started" in worker.log.read_text(), timeout=30)
            service = RoomService(pool)
            with anyio.fail_after(SECONDS * 2):
                await run_commands(service, COMMANDS_PER_SECOND * SECONDS, COMMANDS_PER_SECOND)

            async def compensated() -> bool:
                rows = await fetch_rows(store)
                return all(rows[e]["status"] == "published" for e in service.not_pushed)

            await wait_until(compensated, timeout=30)
            sent_again = {m["event_id"] for m in fake.messages()} & service.pushed
    finally:
        pool.close()
        await pool.wait_closed()
        fake.close()
    assert service.errors[DEADLOCK] == 0, service.errors
    assert service.errors[LOCK_WAIT_TIMEOUT] == 0, service.errors
    assert len(service.pushed) == COMMANDS_PER_SECOND * SECONDS * (FAILED_PUSH_EVERY - 1) // FAILED_PUSH_EVERY
    assert not sent_again, f"{len(sent_again)} events pushed by room-service were sent again"
