"""Rows whose producer wrote ``created_at_ms`` ahead of the database's clock (a host clock an
hour fast, microseconds for milliseconds): the claim leaves them young until then, as its rule
for the producer's rows says; ``requeue`` makes them due now, and ``status`` counts them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import INSERT_V1, RecordingSink, envelope, make_dispatcher, without_room_outbox_environment

from bench.drive import run_until_empty
from room_outbox.cli.main import main
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.operator.changes import RequeueFilter, find_requeue_candidates, requeue
from room_outbox.store.operator.reports import status_report
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.profiles import ROOM_CELL, SILK, V1, Profile

pytestmark = pytest.mark.anyio

CLAIM_AFTER_MS = 10_000
HOUR_MS = 3_600_000


@pytest.fixture(params=["mysql", "postgresql"])
def server_dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn"))


@pytest.fixture
async def store(server_dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(server_dsn)
    try:
        await store.migrate()
        store.claim_after_ms = CLAIM_AFTER_MS
        yield store
    finally:
        await store.aclose()


async def insert_created(store: SQLStore, created: dict[str, int]) -> None:
    """Rows as room-service inserts them, with these creation times (epoch ms as written)."""
    async with store.transaction() as cur:
        for room, (event_id, at) in enumerate(created.items()):
            body = json.dumps(envelope(event_id, room_id=f"r_{room}"))
            await cur.execute(INSERT_V1, ("default", event_id, "RoomUserJoined", f"r_{room}", body, at, at))


async def statuses(store: SQLStore) -> dict[str, str]:
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(f"SELECT {p.event_id}, status FROM {p.table}")
        return {str(event_id): str(status) for event_id, status in await cur.fetchall()}


async def ahead_rows(store: SQLStore) -> dict[str, int]:
    """An old row, a young one (in its producer's push), one an hour ahead and one in µs."""
    now = now_ms()
    created = {"old": now - 2 * CLAIM_AFTER_MS, "young": now - 1_000, "ahead-1h": now + HOUR_MS, "micros": now * 1000}
    await insert_created(store, created)
    return created


@pytest.mark.parametrize("profile", [V1, ROOM_CELL], ids=lambda p: p.name)
async def test_requeue_makes_rows_created_ahead_due_now_and_the_dispatcher_delivers_them(
    store: SQLStore, profile: Profile
) -> None:
    """They waited an hour, and 56,000 years; ``requeue`` said it requeued them and changed
    nothing (they stayed on the producer's path, young). Now they are delivered at once; the
    young row is still left to its producer's push."""
    store.use_profile(profile)
    await ahead_rows(store)
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink)
    await run_until_empty(dispatcher)
    assert sink.received == ["old"]
    candidates = await find_requeue_candidates(store, RequeueFilter(statuses=("pending",)))
    assert {row["event_id"] for row in candidates} == {"young", "ahead-1h", "micros"}
    assert await requeue(store, [row["id"] for row in candidates]) == 3
    await run_until_empty(dispatcher)
    assert sorted(sink.received) == ["ahead-1h", "micros", "old"]
    assert (await statuses(store))["young"] == profile.fresh


async def test_status_counts_rows_created_ahead_and_how_far(store: SQLStore) -> None:
    """``status`` showed the oldest pending row as created "0 s ago" and nothing else."""
    created = await ahead_rows(store)
    report = await status_report(store)
    now = now_ms()
    assert report.created_ahead == 2  # not the young row: it is behind the clock
    assert created["micros"] - now <= report.created_ahead_ms <= created["micros"] - now + 60_000
    assert report.oldest_pending_created_ms == created["old"]
    store.claim_after_ms = 0  # no row waits for its age: none is counted
    assert (await status_report(store)).created_ahead == 0


async def test_requeue_and_status_from_the_command_line(
    store: SQLStore,
    server_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With the default ``claim_after`` (5 s), as the commands read it from the configuration."""
    without_room_outbox_environment(monkeypatch)
    config = tmp_path / "config.yaml"
    config.write_text(f"database:\n  dsn: '{server_dsn}'\n")
    now = now_ms()
    await insert_created(store, {"ahead-1h": now + HOUR_MS, "micros": now * 1000})

    def run(*argv: str) -> str:
        assert main(["--config", str(config), *argv]) == 0
        return capsys.readouterr().out

    out = await anyio.to_thread.run_sync(run, "status")
    assert "(0 s ago)" not in out and "created ahead of the database's clock" in out, out
    line = next(line for line in out.splitlines() if line.startswith("created ahead"))
    assert line.startswith("created ahead         2  (up to ") and "unless requeued" in line, line
    doc = json.loads(await anyio.to_thread.run_sync(run, "status", "--json"))
    assert (doc["created_ahead"], doc["oldest_pending_created_ms"]) == (2, now + HOUR_MS)
    listed = await anyio.to_thread.run_sync(run, "requeue", "--status", "pending")
    assert "59 min ahead" in listed or "1 h ahead" in listed, listed
    assert "requeued 2 row(s)" in await anyio.to_thread.run_sync(run, "requeue", "--status", "pending", "--yes")
    assert (await status_report(store)).created_ahead == 0  # requeued: no longer held back
    sink = RecordingSink()
    await run_until_empty(make_dispatcher(store, sink))
    assert sorted(sink.received) == ["ahead-1h", "micros"]


async def test_requeue_makes_a_silk_row_created_ahead_due_now(postgresql_dsn: str) -> None:
    """silk's rows start at their own due time, not at a cleared one: a requeued row created
    ahead is written ``retry``, which the claim takes by its due time alone."""
    store: Any = await open_store(postgresql_dsn, profile=SILK)
    try:
        await store.migrate()
        store.claim_after_ms = CLAIM_AFTER_MS
        async with store.transaction() as cur:
            for event_id, created in (("ahead-1h", "now() + interval '1 hour'"), ("young", "now()")):
                await cur.execute(
                    "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id, payload, status,"
                    f" max_attempts, next_attempt_at, created_at, updated_at) VALUES (%s, 'x', 'user', %s, '{{}}',"
                    f" 'pending', 5, now(), {created}, now())",
                    (event_id, event_id),
                )
        assert (await status_report(store)).created_ahead == 1
        assert {row.event_id for row in (await store.claim("c#1", 10, now_ms() + 60_000)).rows} == set()
        candidates = await find_requeue_candidates(store, RequeueFilter(statuses=("pending",)))
        assert await requeue(store, [row["id"] for row in candidates]) == 2
        assert await statuses(store) == {"ahead-1h": SILK.retry, "young": SILK.fresh}
        assert {row.event_id for row in (await store.claim("c#2", 10, now_ms() + 60_000)).rows} == {"ahead-1h"}
    finally:
        await store.aclose()
