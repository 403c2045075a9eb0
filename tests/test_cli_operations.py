"""The operator commands as a user types them: `room-outbox requeue` and `room-outbox cancel`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest
from support import StatementLog, envelope, fetch_rows, insert_events, without_room_outbox_environment

from room_outbox.cli.main import main
from room_outbox.cli.requeue import requeue_lane_command
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.dialect import KEYS_PER_STATEMENT
from room_outbox.store.lanes.store import CURSOR_TABLE, migrate_lanes
from room_outbox.store.lanes.tail import migrate_tail
from room_outbox.store.operator.changes import RequeueFilter
from room_outbox.store.schema.lanes import lane_table
from room_outbox.store.schema.tail import PARKED_TABLE, SKIPPED_TABLE

pytestmark = pytest.mark.anyio

LONG_ERROR = "tencent_im: permanent: ErrorCode 10010: group gone (GroupId room-with-a-long-name-1, app default)"


@pytest.fixture
def config(tmp_path: Path, database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    without_room_outbox_environment(monkeypatch)
    path = tmp_path / "config.yaml"
    path.write_text(f"mysql:\n  dsn: '{database_dsn}'\n")
    return str(path)


async def test_requeue_and_cancel_from_the_command_line(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await insert_events(store, [envelope("p1"), envelope("p2", "RoomGiftSent"), envelope("c1")])
    async with store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET status = 'failed', retry_count = 5, last_error = %s WHERE event_id IN ('p1', 'p2')",
            (LONG_ERROR,),
        )
    assert await anyio.to_thread.run_sync(main, ["--config", config, "requeue", "--error-contains", "group gone"]) == 0
    out = capsys.readouterr().out
    assert "2 row(s) would be requeued" in out and out.count(LONG_ERROR) == 2  # the whole error: its ids at the end
    assert {r["status"] for e, r in (await fetch_rows(store)).items() if e != "c1"} == {"failed"}
    argv = ["--config", config, "requeue", "--event-type", "RoomGiftSent", "--status", "failed", "--yes"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert "requeued 1 row(s)" in capsys.readouterr().out
    rows = await fetch_rows(store)
    assert (rows["p2"]["status"], rows["p2"]["retry_count"], rows["p1"]["status"]) == ("pending", 0, "failed")

    assert await anyio.to_thread.run_sync(main, ["--config", config, "cancel", "c1", "--yes"]) == 0
    assert (await fetch_rows(store))["c1"]["status"] == "cancelled"
    assert await anyio.to_thread.run_sync(main, ["--config", config, "cancel", "c1", "--yes"]) == 1
    assert "c1 is cancelled" in capsys.readouterr().err


async def test_requeue_without_a_filter_refuses(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert await anyio.to_thread.run_sync(main, ["--config", config, "requeue", "--yes"]) == 2
    assert "give at least one of" in capsys.readouterr().err


async def test_requeue_and_cancel_lane_from_the_command_line_take_their_filters(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``requeue --lane kafka`` passes its filters and ``--json`` on (it once requeued every
    parked event of the lane whatever the filter), refuses ``--status`` (a lane's entries are
    all parked), and ``cancel --lane`` takes ``--app-code``."""
    await migrate_tail(store, ["kafka"])
    await insert_events(store, [envelope("e1", "RoomGiftSent"), envelope("e2"), envelope("e3")])
    async with store.transaction() as cur:
        await cur.execute(
            f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, read_through_id, updated_at_ms)"
            " SELECT 'kafka', MAX(id), MAX(id), 0 FROM room_outbox"
        )
        await cur.execute(
            f"INSERT INTO {PARKED_TABLE} (lane, outbox_id, event_id, room_id, status, last_error, created_at_ms,"
            " updated_at_ms) SELECT 'kafka', id, event_id, room_id, 'parked', CASE WHEN event_id = 'e1'"
            " THEN 'MessageSizeTooLargeError' ELSE 'malformed envelope' END, 0, 0 FROM room_outbox"
        )

    def run(*argv: str) -> int:
        return main(["--config", config, *argv])

    chosen = ["requeue", "--lane", "kafka", "--error-contains", "MessageSizeTooLarge"]
    assert await anyio.to_thread.run_sync(run, *chosen, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["matched"], [r["event_id"] for r in doc["rows"]]) == (1, ["e1"])
    assert await anyio.to_thread.run_sync(run, "requeue", "--lane", "kafka", "--event-type", "NoSuchType") == 0
    assert capsys.readouterr().out == "no parked or skipped events in lane kafka match\n"
    assert await anyio.to_thread.run_sync(run, "requeue", "--lane", "kafka", "--status", "pending") == 2
    assert "--lane does not take --status" in capsys.readouterr().err
    assert await anyio.to_thread.run_sync(run, *chosen, "--yes") == 0
    assert capsys.readouterr().out.endswith("requeued 1 event(s) in lane kafka\n")
    assert await anyio.to_thread.run_sync(run, "cancel", "e2", "--lane", "kafka", "--app-code", "default", "--yes") == 0
    async with store.transaction() as cur:
        await cur.execute(f"SELECT event_id, status FROM {PARKED_TABLE} ORDER BY outbox_id")
        assert await cur.fetchall() == (("e1", "requeued"), ("e2", "cancelled"), ("e3", "parked"))


async def test_status_lists_a_tailing_lanes_parked_errors_and_the_commands_that_take_them(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tailing lane's parked events are in its own table, not ``room_outbox``'s failed rows:
    ``status`` lists their errors under the lane, grouped as the main lane's (in text and
    ``--json``), and names ``--lane``, which ``requeue`` and ``cancel`` take them by. Entries
    requeued or cancelled are no longer parked, and not counted."""
    await migrate_tail(store, ["kafka"])
    await insert_events(store, [envelope(f"e{n}") for n in range(5)])
    async with store.transaction() as cur:
        await cur.execute(
            f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, read_through_id, updated_at_ms)"
            " SELECT 'kafka', MAX(id), MAX(id), 0 FROM room_outbox"
        )
        await cur.execute(
            f"INSERT INTO {PARKED_TABLE} (lane, outbox_id, event_id, room_id, status, last_error, created_at_ms,"
            " updated_at_ms) SELECT 'kafka', id, event_id, room_id, CASE WHEN event_id = 'e4' THEN 'cancelled'"
            " ELSE 'parked' END, CASE WHEN event_id = 'e0' THEN 'malformed envelope'"
            " ELSE CONCAT('kafka: bad_envelope: event_id=', event_id, ' is 10200 bytes') END, 0, 0 FROM room_outbox"
        )

    def run(*argv: str) -> int:
        return main(["--config", config, *argv])

    assert await anyio.to_thread.run_sync(run, "status", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    (lane,) = doc["lanes"]
    assert (lane["lane"], lane["parked"]) == ("kafka", 4)
    assert lane["top_parked_errors"] == [
        {"last_error": "kafka: bad_envelope: event_id=<id> is 10200 bytes", "rows": 3},
        {"last_error": "malformed envelope", "rows": 1},
    ]
    assert doc["top_parked_errors"] == []  # the main lane's: none parked there
    assert await anyio.to_thread.run_sync(run, "status") == 0
    text = capsys.readouterr().out
    assert "most frequent last_error of lane kafka's parked rows" in text and "--lane kafka" in text
    assert "kafka: bad_envelope: event_id=<id> is 10200 bytes" in text


async def test_requeue_and_cancel_change_no_outbox_row_while_the_main_lane_is_off(
    store: MySQLStore, tmp_path: Path, database_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No sink writes room_outbox.status here (Kafka only): the status is room-service's, its own
    worker reads it. requeue reset a pending row of room-service's and cancel made one
    cancelled; both now refuse (exit 2) and point at --lane."""
    config = tmp_path / "off.yaml"
    config.write_text(
        f"mysql:\n  dsn: '{database_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n  noop:\n    enabled: false\n"
    )
    await insert_events(store, [envelope("p1"), envelope("c1")])
    before = await fetch_rows(store)
    for argv in (["requeue", "--event-id", "p1", "--yes"], ["cancel", "c1", "--yes"]):
        assert await anyio.to_thread.run_sync(main, ["--config", str(config), *argv]) == 2
        assert capsys.readouterr().err == (
            f"room-outbox {argv[0]}: the main lane is off in this configuration (room_outbox.status is"
            f" room-service's): {argv[0]} changes none of its rows; for a lane's events give --lane NAME"
            " (`room-outbox lanes` lists them)\n"
        )
    assert await fetch_rows(store) == before


#: Events of each kind (parked, skipped) in the test below: more than one statement's keys.
MANY = KEYS_PER_STATEMENT + 500


@pytest.mark.parametrize("relay", ["tail", "lane_table"])
async def test_requeue_lane_of_more_events_than_one_statement_holds_takes_them_all(
    store: MySQLStore, monkeypatch: pytest.MonkeyPatch, relay: str
) -> None:
    """``requeue --lane`` changes up to 10,000 parked and skipped events by their keys: every
    key in one statement passed a small max_allowed_packet with wide keys (see the main lane's
    requeue in test_cli), and nothing changed. Each statement now holds
    :data:`KEYS_PER_STATEMENT` keys at most, and every event is taken, on a tailing lane and on
    a lane table alike."""
    await insert_events(store, [envelope(f"e{n}") for n in range(2 * MANY)])
    parked_table = PARKED_TABLE if relay == "tail" else lane_table("k")
    async with store.transaction() as cur:
        await cur.execute("SELECT id FROM room_outbox ORDER BY id LIMIT 1 OFFSET %s", (MANY,))
        (first_skipped,) = await cur.fetchone()
    if relay == "tail":
        await migrate_tail(store, ["k"])
        copy = "'k', id, event_id, room_id, 'parked', 'too large', 0, 0"
        columns = "lane, outbox_id, event_id, room_id, status, last_error, created_at_ms, updated_at_ms"
    else:
        await migrate_lanes(store, ["k"])
        copy = "id, event_id, event_type, room_id, app_code, 'failed', 'too large', 0, 0"
        columns = "outbox_id, event_id, event_type, room_id, app_code, status, last_error, created_at_ms, updated_at_ms"
    async with store.transaction() as cur:
        await cur.execute(
            f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, updated_at_ms) SELECT 'k', MAX(id), 0 FROM room_outbox"
        )
        await cur.execute(
            f"INSERT INTO {parked_table} ({columns}) SELECT {copy} FROM room_outbox WHERE id < %s", (first_skipped,)
        )
        await cur.execute(
            f"INSERT INTO {SKIPPED_TABLE} (lane, low_id, high_id, skipped_at_ms) SELECT 'k', %s, MAX(id), 0 FROM room_outbox",
            (first_skipped,),
        )
    sent = StatementLog().watch(store, monkeypatch)
    out, err = io.StringIO(), io.StringIO()
    assert await requeue_lane_command(store, "k", RequeueFilter(), True, out, err, as_json=True) == 0, err.getvalue()
    assert json.loads(out.getvalue())["requeued"] == 2 * MANY
    assert max(sent.parameters) <= KEYS_PER_STATEMENT + 10, max(sent.parameters)  # keys, and a few of its own
    where = "lane = 'k'" if relay == "tail" else "1 = 1"
    async with store.transaction() as cur:
        await cur.execute(f"SELECT status, COUNT(*) FROM {parked_table} WHERE {where} GROUP BY status")
        assert await cur.fetchall() == (("requeued" if relay == "tail" else "pending", 2 * MANY),)
        await cur.execute(f"SELECT COUNT(*) FROM {SKIPPED_TABLE}")
        assert await cur.fetchone() == (0,)
