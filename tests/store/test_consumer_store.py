"""The consumers' store (room_consumer_processed, room_consumer_retry) on MariaDB and
PostgreSQL: the same methods, the same outcomes."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from room_outbox.cli.consumers import redrive_command
from room_outbox.store.consumers.protocol import DeadLetters, LeaseLost, Processed, RetryRow
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.dialect import index_names
from room_outbox.store.factory import consumer_store, open_store
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.consumers import AGE_INDEX, PROCESSED, RETRY

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["mysql", "postgresql"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    opened = await open_store(dsn, pool_size=4)
    try:
        await opened.migrate()
        yield opened
    finally:
        await opened.aclose()


@pytest.fixture
async def consumers(store: SQLStore) -> SQLConsumerStore:
    found = consumer_store(store, handling_timeout=10)
    assert found is not None
    await found.migrate()
    return found


def record(event_id: str, handler: str = "audit") -> Processed:
    return Processed("feed", handler, "app1", event_id, "room-events", 0, 7)


def retry_row(event_id: str, room: str = "app1:room_1", handler: str = "audit", due: int = 0) -> RetryRow:
    return RetryRow(
        consumer="feed", handler=handler, app_code="app1", event_id=event_id, event_type="RoomUserJoined",
        room_key=room, topic="room-events", partition=0, offset=7, value=b'{"x": "\\u00e9"}\xff',
        headers={"traceparent": "00-abc"}, attempts=1, due_at_ms=due, last_error="boom",
    )  # fmt: skip


async def rows(store: SQLStore, sql: str) -> list[tuple[Any, ...]]:
    async with store.transaction() as cur:
        await cur.execute(sql)
        return [tuple(r) for r in await cur.fetchall()]


async def test_migrate_creates_the_tables_once_and_adds_the_age_index_to_an_older_table(store: SQLStore) -> None:
    found = consumer_store(store)
    assert found is not None and not await found.migrated()
    assert await found.migrate() == ["created table room_consumer_processed", "created table room_consumer_retry"]
    assert await found.migrated() and await found.migrate() == []
    async with store.transaction() as cur:  # a table made before retention needed the index
        drop = f"DROP INDEX {AGE_INDEX}" + (f" ON {PROCESSED}" if store.dialect.name == "mysql" else "")
        await cur.execute(drop)
    assert await found.migrate() == [f"added index {PROCESSED}.{AGE_INDEX}"]
    async with store.transaction() as cur:
        assert AGE_INDEX in await index_names(cur, store.dialect, PROCESSED)


async def test_sqlite_has_no_consumers_store(tmp_path: Any) -> None:
    sqlite = await open_store(f"sqlite:///{tmp_path / 'outbox.db'}")
    try:
        assert consumer_store(sqlite) is None
    finally:
        await sqlite.aclose()


async def test_a_processed_record_makes_the_second_handling_a_no_op(
    store: SQLStore, consumers: SQLConsumerStore
) -> None:
    async with store.transaction() as cur:
        await cur.execute("CREATE TABLE side_effect (event_id VARCHAR(64))")
    async with consumers.processing(record("e1")) as tx:
        assert tx is not None and tx.dialect == store.dialect.name
        await tx.execute("INSERT INTO side_effect (event_id) VALUES (%s)", ("e1",))
    async with consumers.processing(record("e1")) as again:
        assert again is None  # a redelivery: the handler is not called
    with pytest.raises(RuntimeError):
        async with consumers.processing(record("e2")) as tx:
            assert tx is not None
            await tx.execute("INSERT INTO side_effect (event_id) VALUES (%s)", ("e2",))
            raise RuntimeError("handler failed")
    assert await rows(store, "SELECT event_id FROM side_effect") == [("e1",)]
    assert await rows(store, f"SELECT event_id FROM {PROCESSED}") == [("e1",)]


async def test_a_batch_rolls_back_only_the_failing_handling(store: SQLStore, consumers: SQLConsumerStore) -> None:
    async with consumers.processing(record("old")):
        pass
    async with consumers.batch() as batch:
        async with batch.processing(record("m1")) as tx:
            assert tx is not None
        async with batch.processing(record("old")) as duplicate:
            assert duplicate is None
        with pytest.raises(RuntimeError):
            async with batch.processing(record("m4")):
                raise RuntimeError("handler failed")
        await batch.schedule(retry_row("m4"))
    assert sorted(await rows(store, f"SELECT event_id FROM {PROCESSED}")) == [("m1",), ("old",)]
    assert await rows(store, "SELECT event_id, status FROM room_consumer_retry") == [("m4", "retrying")]


async def test_processing_many_tells_new_records_from_those_handled_before(
    store: SQLStore, consumers: SQLConsumerStore
) -> None:
    """A redelivered batch: records that exist already, and the same event twice in the batch,
    are reported as not new; the others are inserted, each once; a failing block inserts none."""

    def at(event_id: str, offset: int) -> Processed:
        return Processed("feed", "audit", "app1", event_id, "room-events", 0, offset)

    async with consumers.processing_many([at("e1", 1), at("e3", 3)]) as (tx, fresh):
        assert fresh == [True, True] and tx.dialect == store.dialect.name
    batch = [at("e1", 1), at("e2", 2), at("e3", 3), at("e2", 4), at("e4", 5)]
    async with consumers.processing_many(batch) as (_tx, fresh):
        assert fresh == [False, True, False, False, True]
    with pytest.raises(RuntimeError):
        async with consumers.processing_many([at("e5", 6), at("e1", 1)]) as (_tx, fresh):
            assert fresh == [True, False]
            raise RuntimeError("handle_batch failed")
    assert sorted(await rows(store, f"SELECT event_id, kafka_offset FROM {PROCESSED}")) == [
        ("e1", 1),
        ("e2", 2),
        ("e3", 3),
        ("e4", 5),
    ]


async def test_processing_many_over_several_statements_tells_each_chunk_apart(
    store: SQLStore, consumers: SQLConsumerStore
) -> None:
    """More records than one INSERT takes, an existing one in the last statement: only that one
    is not new (the statements before it are not mistaken for records handled before)."""
    async with consumers.processing(record("e1004")):
        pass
    many = [record(f"e{n:04d}") for n in range(1005)]
    async with consumers.processing_many(many) as (_tx, fresh):
        assert [r.event_id for r, new in zip(many, fresh, strict=True) if not new] == ["e1004"]
    assert await rows(store, f"SELECT COUNT(*) FROM {PROCESSED}") == [(1005,)]


async def test_retries_are_claimed_per_room_in_order_fenced_and_become_dead_letters(
    consumers: SQLConsumerStore,
) -> None:
    await consumers.schedule(retry_row("r1"))
    await consumers.schedule(retry_row("r1"))  # already there: nothing changes
    await consumers.schedule(retry_row("r2"))  # same room, behind r1
    await consumers.schedule(retry_row("s1", room="app1:room_2"))
    assert await consumers.blocked_rooms("feed", {"app1:room_1", "app1:room_9"}) == {("audit", "app1:room_1")}
    claimed = await consumers.claim_retries("feed", "node-a", 10, 60_000, ordered=True)
    assert [r.event_id for r in claimed] == ["r1", "s1"]
    first = claimed[0]
    assert first.value == retry_row("r1").value and first.headers == {"traceparent": "00-abc"}
    assert await consumers.claim_retries("feed", "node-b", 10, 60_000, ordered=True) == []  # leased

    stale = RetryRow(**{**first.__dict__, "owner": "node-b"})
    assert not await consumers.retry_failed(stale, 2, 0, "late", dead=False)
    with pytest.raises(LeaseLost):
        async with consumers.processing(record("r1"), stale):
            pass
    async with consumers.processing(record("r1"), first) as tx:  # settles the retry row
        assert tx is not None
    assert await consumers.retry_failed(claimed[1], 5, 0, "gave up", dead=True)
    await consumers.dead_letter(retry_row("r2"))  # the waiting row becomes the dead letter
    assert [(s["consumer"], s["status"], s["rows"]) for s in await consumers.overview()] == [("feed", "dead", 2)]
    dead = await consumers.dead_letters(DeadLetters("feed"), 10)
    assert [(d["event_id"], d["last_error"]) for d in dead] == [("r2", "boom"), ("s1", "gave up")]
    states = await consumers.event_states("r1")
    assert [(s["handler"], s["state"]) for s in states] == [("audit", "consumed")]

    assert await consumers.redrive(DeadLetters("feed", "audit", ("s1",))) == 1
    again = await consumers.claim_retries("feed", "node-a", 10, 60_000, ordered=True)
    assert [(r.event_id, r.attempts) for r in again] == [("s1", 0)]
    await consumers.release(again)
    replaced = (await consumers.claim_retries("feed", "node-a", 10, 60_000, ordered=False))[0]
    assert await consumers.replace(replaced, [retry_row("s1", handler="activity")])
    assert [(s["handler"], s["state"]) for s in await consumers.event_states("s1")] == [("activity", "retrying")]


async def test_redrive_previews_exactly_what_it_changes_and_changes_it_in_batches(
    store: SQLStore, consumers: SQLConsumerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``consumers redrive``: the preview's count is the change's, beyond what it lists (it read
    at most ``MAX_DEAD_LETTERS`` rows and counted those, while the change took every one); the
    change goes in batches; a long event id (kept cut with its digest) is found by both; an
    event id two apps have is refused until ``--app-code`` names one."""
    long_id = "L" * 300
    for n in range(12):
        await consumers.dead_letter(retry_row(f"d{n}"))
    await consumers.dead_letter(retry_row(long_id))
    await consumers.dead_letter(RetryRow(**{**retry_row("twin").__dict__, "app_code": "app2"}))
    await consumers.dead_letter(retry_row("twin"))
    await consumers.schedule(retry_row("waiting", room="app1:room_2"))  # retrying: never redriven
    monkeypatch.setattr("room_outbox.cli.consumers.MAX_DEAD_LETTERS", 5)

    async def redrive(*event_ids: str, apply: bool = False, app_code: str | None = None) -> tuple[int, dict[str, Any]]:
        out, err = io.StringIO(), io.StringIO()
        code = await redrive_command(
            store, "feed", "audit", list(event_ids), apply, out, frozenset({"feed"}), True, app_code, err
        )
        return code, json.loads(out.getvalue()) if code == 0 else {"error": err.getvalue()}

    code, preview = await redrive()
    assert (code, preview["selected"], len(preview["dead_letters"])) == (0, 15, 5)
    code, by_id = await redrive(long_id)
    assert (code, by_id["selected"], by_id["redriven"]) == (0, 1, 0)
    code, refused = await redrive("twin", apply=True)
    assert code == 1 and refused["error"] == (
        "room-outbox consumers redrive: event id twin names rows of several apps (app1, app2): nothing changed;"
        " say which app's event with --app-code\n"
    )
    code, one_app = await redrive("twin", apply=True, app_code="app2")
    assert (code, one_app["selected"], one_app["redriven"]) == (0, 1, 1)

    monkeypatch.setattr("room_outbox.store.consumers.sql.REDRIVE_BATCH", 4)
    code, applied = await redrive(apply=True)
    assert (code, applied["selected"], applied["redriven"]) == (0, 14, 14)
    assert await rows(store, f"SELECT status, COUNT(*) FROM {RETRY} GROUP BY status") == [("retrying", 16)]
