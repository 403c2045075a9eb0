"""`room-outbox status` and `room-outbox inspect EVENT_ID`, through the CLI's main()."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from support import envelope, insert_events, insert_rows

from room_outbox.cli.inspect import describe_state
from room_outbox.cli.main import main
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio


@pytest.fixture
def keep_logging() -> Iterator[None]:
    """main() routes logging to JSON on stderr; give pytest its handlers back."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:], level = saved
    root.setLevel(level)


async def _cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, dsn: str, *args: str) -> tuple[int, str, str]:
    config = tmp_path / "config.yaml"
    config.write_text(f"mysql:\n  dsn: '{dsn}'\n")
    capsys.readouterr()
    code = await anyio.to_thread.run_sync(main, ["--config", str(config), *args])  # main() runs its own loop
    out, err = capsys.readouterr()
    return code, out, err


async def _populate(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"fresh{i}") for i in range(3)])
    await insert_events(store, [envelope(f"retry{i}") for i in range(4)] + [envelope("leased1"), envelope("leased2")])
    await insert_events(store, [envelope("done")])
    await insert_rows(store, [("", "broken", "RoomUserJoined", "r_1", "{not json")])
    await insert_events(store, [envelope(f"parked{i}") for i in range(3)])
    now = int(time.time() * 1000)
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET created_at_ms = %s WHERE event_id = 'fresh0'", (now - 3_600_000,))
        await cur.execute(
            "UPDATE room_outbox SET retry_count = 3, last_error = 'tencent_im: ErrorCode 10007 no permission',"
            " lock_until_ms = %s WHERE event_id IN ('retry0', 'retry1', 'retry2')",
            (now + 600_000,),
        )
        await cur.execute(
            "UPDATE room_outbox SET retry_count = 12, last_error = 'tencent_im: timeout' WHERE event_id = 'retry3'"
        )
        await cur.execute(
            "UPDATE room_outbox SET worker_id = 'node-a#7', lock_until_ms = %s WHERE event_id LIKE 'leased%%'",
            (now + 30_000,),
        )
        await cur.execute("UPDATE room_outbox SET status = 'published' WHERE event_id = 'done'")
        await cur.execute(  # parked: not retrying, but what an incident is about
            "UPDATE room_outbox SET status = 'failed', retry_count = 1, last_error = CONCAT('tencent_im: permanent:"
            " ErrorCode 10010: group gone (GroupId g', id, ')') WHERE event_id LIKE 'parked%%'"
        )


async def test_status_json_counts_backlog_retries_errors_and_leases(
    store: MySQLStore,
    database_dsn: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    keep_logging: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await _populate(store)
    code, out, _ = await _cli(capsys, tmp_path, database_dsn, "status", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["pending"] == 10  # everything but "done"
    assert 3_600_000 <= doc["oldest_pending_age_ms"] < 3_700_000
    assert doc["retry_histogram"] == {"0": 6, "1": 0, "2-4": 3, "5-9": 0, "10-99": 1, "100+": 0}
    assert doc["top_errors"][0] == {"last_error": "tencent_im: ErrorCode 10007 no permission", "rows": 3}
    assert doc["top_errors"][1] == {"last_error": "tencent_im: timeout", "rows": 1}
    gone = "tencent_im: permanent: ErrorCode 10010: group gone (GroupId <id>)"
    assert doc["top_parked_errors"] == [{"last_error": gone, "rows": 3}] and gone not in str(doc["top_errors"])
    assert doc["error_sample"] == 10_000
    assert doc["waiting_for_retry"] == 3
    assert doc["leased"] == 2
    assert [(h["node"], h["claims"], h["rows"]) for h in doc["holders"]] == [("node-a", 1, 2)]

    monkeypatch.setattr("room_outbox.store.operator.reports.STATUS_SAMPLE", 2)  # a bounded read per status
    doc = json.loads((await _cli(capsys, tmp_path, database_dsn, "status", "--json"))[1])
    assert (doc["top_parked_errors"], doc["error_sample"]) == ([{"last_error": gone, "rows": 2}], 2)
    assert sum(doc["retry_histogram"].values()) == 2 and doc["retry_histogram_sampled"]  # of the 10 pending


async def test_status_table_is_readable(
    store: MySQLStore, database_dsn: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, keep_logging: None
) -> None:
    await _populate(store)
    code, out, _ = await _cli(capsys, tmp_path, database_dsn, "status")
    assert code == 0
    assert "pending               10" in out
    assert re.search(r"^oldest pending        \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(1 h ago\)$", out, re.M)
    assert "node-a" in out and "tencent_im: ErrorCode 10007 no permission" in out
    parked = out.split("most frequent last_error of parked (failed) rows (among the latest 10,000)\n")[1]
    assert re.match(
        r"  rows +last_error\n +3 +tencent_im: permanent: ErrorCode 10010: group gone \(GroupId <id>\)", parked
    )
    code, out, _ = await _cli(capsys, tmp_path, database_dsn, "status")  # an empty outbox too
    assert code == 0


async def test_inspect_shows_row_envelope_and_state(
    store: MySQLStore, database_dsn: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, keep_logging: None
) -> None:
    await _populate(store)
    code, out, _ = await _cli(capsys, tmp_path, database_dsn, "inspect", "retry0", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["row"]["event_id"] == "retry0" and doc["row"]["retry_count"] == 3
    assert doc["envelope"]["event_id"] == "retry0" and doc["envelope"]["payload"] == {"user_id": "u1"}
    assert doc["state"].startswith("waiting: failed 3 time(s), next attempt in")

    code, out, _ = await _cli(capsys, tmp_path, database_dsn, "inspect", "broken")
    assert code == 0
    assert "envelope problem: malformed envelope" in out and "raw envelope: {not json" in out
    assert "state: due: the next scan claims it" in out

    code, out, _ = await _cli(capsys, tmp_path, database_dsn, "inspect", "leased1")
    assert "state: in flight: leased by node-a#7" in out

    async with store.transaction() as cur:  # a table whose envelope column allows NULL, and a row without one
        await cur.execute("ALTER TABLE room_outbox MODIFY envelope LONGTEXT NULL")
        await cur.execute("UPDATE room_outbox SET envelope = NULL WHERE event_id = 'broken'")
    code, out, _ = await _cli(capsys, tmp_path, database_dsn, "inspect", "broken")
    assert code == 0 and "envelope problem: no envelope: the column is NULL" in out and "raw envelope" not in out

    code, out, err = await _cli(capsys, tmp_path, database_dsn, "inspect", "nosuch")
    assert code == 1 and out == "" and "no row with event_id 'nosuch'" in err


def test_delivery_states_read_like_sentences() -> None:
    now = 1_000_000
    row = {"status": "pending", "retry_count": 2, "worker_id": "n#1", "lock_until_ms": now - 1}
    assert describe_state(row, now) == "due: the lease of n#1 expired; the next scan takes it over"
    assert describe_state({**row, "status": "published"}, now).startswith("published")
    assert describe_state({**row, "status": "failed"}, now).startswith("parked after 2 attempt(s)")
    assert describe_state({**row, "status": "cancelled"}, now).startswith("cancelled")
    assert describe_state({**row, "worker_id": None, "lock_until_ms": 0}, now) == (
        "due: the next scan claims it (failed 2 time(s) so far)"
    )


def _terminal_controls(text: str) -> list[str]:
    """Characters a terminal would act on or hide, other than the line breaks of the layout."""
    import unicodedata

    return [c for c in text if c != "\n" and unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") and c != "\u200d"]


async def test_human_output_escapes_control_characters_from_rows(
    store: MySQLStore, database_dsn: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, keep_logging: None
) -> None:
    evil_id = "evil\x1b[2J"
    evil = envelope(evil_id, room_id="r\u202egnp", payload={"nick": "\x9b31mred\u2028x", "gift": "🎁👨\u200d👩"})
    await insert_events(store, [evil])
    async with store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET retry_count = 2, last_error = %s, worker_id = %s, lock_until_ms = %s",
            ("\x1b]0;pwned\x07 line1\r\nline2", "node\x1b[1m#3", int(time.time() * 1000) + 60_000),
        )
    outputs = []
    for args in (("status",), ("inspect", evil_id)):
        code, out, err = await _cli(capsys, tmp_path, database_dsn, *args)
        assert code == 0, err
        outputs.append(out)
    async with store.transaction() as cur:  # lease gone, so requeue and cancel take the row
        await cur.execute("UPDATE room_outbox SET worker_id = NULL, lock_until_ms = 0")
    for args in (("requeue", "--error-contains", "pwned"), ("cancel", evil_id, "--yes"), ("cancel", evil_id, "--yes")):
        _, out, err = await _cli(capsys, tmp_path, database_dsn, *args)
        outputs.append(out + err)
    status, inspection, requeue, cancelled, again = outputs
    for out in outputs:
        assert _terminal_controls(out) == [], out
    assert "\\x1b]0;pwned\\x07 line1\\x0d\\x0aline2" in status and "node\\x1b[1m" in status
    assert "evil\\x1b[2J" in inspection and "r\\u202egnp" in inspection and "\\x9b31mred\\u2028x" in inspection
    assert "🎁👨\u200d👩" in inspection  # emoji sequences stay readable
    assert "evil\\x1b[2J" in requeue and "\\x1b]0;pwned" in requeue
    assert cancelled.startswith("cancelled evil\\x1b[2J:") and "room-outbox cancel: evil\\x1b[2J is cancelled" in again
