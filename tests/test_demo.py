"""`room-outbox demo`: the README's first command, on SQLite and on MySQL, and its verdicts."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from support import V1_DDL, envelope, fetch_rows, insert_events

from room_outbox.cli.demo import DemoOptions, Tally, plan_commands, race_report, run_demo, verify
from room_outbox.cli.main import main
from room_outbox.envelope import EventEnvelope
from room_outbox.store.factory import open_store

NOOP = {"RoomCreated": "noop", "RoomHeatChanged": "noop", "RoomUserJoined": "tencent_im", "RoomClosed": "tencent_im"}


@pytest.mark.serial
def test_the_default_demo_runs_on_a_bare_machine_verified_and_short(tmp_path: Path) -> None:
    """No arguments, no services: the command a newcomer types first."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},  # nothing of this machine's config
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verified in" in done.stdout and "FAILED" not in done.stdout
    assert "200/200 events published" in done.stdout
    # claim_after's default leaves the rows the room service pushed itself to it
    assert "the dispatcher sent 0 requests for the" in done.stdout
    assert took < 20, f"the default demo took {took:.1f}s"
    assert done.stderr == ""  # log lines go to the demo's own log file, not over the table
    # Not a terminal: the table once, at the end; before it only plain progress lines.
    assert done.stdout.count("  sync push ") == 1 and "\x1b[" not in done.stdout
    table = done.stdout.index("  outbox     [")
    before = [line for line in done.stdout[:table].splitlines() if line.strip()]
    assert all(line.startswith("  progress: ") or not line.startswith("  ") for line in before), before


@pytest.mark.parametrize(("server", "name"), [("mysql", "MySQL"), ("postgresql", "PostgreSQL")])
def test_the_demo_runs_against_a_server_with_its_options(
    server: str, name: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = str(request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn"))
    code = main(["demo", "--db", dsn, "--events", "60", "--failure-rate", "0.5", "--seed", "7"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "60/60 events published" in out and f"outbox in {name}" in out
    assert "per-room order: the dispatcher delivered" in out


def test_without_ordering_the_order_check_is_left_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--events", "30", "--failure-rate", "0", "--ordering", "none"]) == 0
    out = capsys.readouterr().out
    assert "per-room order" not in out and "30/30 events published" in out


def test_the_race_report_counts_requests_for_pushed_events_and_the_wait_of_the_others() -> None:
    tally = Tally()
    for event_id, event_type in (("a", "RoomUserJoined"), ("b", "RoomUserJoined"), ("c", "RoomCreated")):
        tally.events[event_id] = EventEnvelope(event_id=event_id, event_type=event_type, room_id="r_1")
        tally.committed_at[event_id] = 10.0
    tally.pushed |= {"a", "c"}
    tally.im_requests.update({"a": 2, "b": 1})
    tally.delivered_at.update({"a": 10.1, "b": 11.5, "c": 10.0})
    report = race_report(tally, 5.0, NOOP)
    assert "claim_after 5s: the dispatcher sent 2 requests for the 1 IM events the room service had pushed" in report
    assert "1 IM events the room service did not push: delivered 1.50s (median) and 1.50s (at most)" in report


@pytest.mark.parametrize(
    "args",
    [
        ["--failure-rate", "1"],
        ["--failure-rate", "-0.1"],
        ["--events", "5"],
        ["--claim-after", "soon"],
        ["--claim-after=-1s"],
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *args]) == 2
    assert "room-outbox demo: --" in capsys.readouterr().err


@pytest.mark.anyio
async def test_a_database_holding_rows_of_others_is_refused_and_left_unchanged(
    database_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """room-service's live V1 table with pending rows: the demo would deliver them to its fake
    IM and mark them published. Refused in one line, before the schema or a row is touched."""
    store = await open_store(database_dsn)
    try:
        async with store.transaction() as cur:
            await cur.execute(V1_DDL)
        await insert_events(store, [envelope(f"evt-{n:04d}", room_id=f"r_{n % 40}") for n in range(1000)])
        rows_before, plan_before = await fetch_rows(store), await store.migration_plan()
        code = await anyio.to_thread.run_sync(main, ["demo", "--db", database_dsn, "--events", "20"])
        out, err = capsys.readouterr()
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and "room_outbox in MySQL at " in err and "holds rows the demo did not make" in err
        rows_after = await fetch_rows(store)
        assert rows_after == rows_before  # every column: status and updated_at_ms included
        assert {row["status"] for row in rows_after.values()} == {"pending"}
        assert await store.migration_plan() == plan_before  # not migrated either
    finally:
        await store.aclose()


def test_a_sqlite_path_whose_folder_is_missing_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such"
    assert main(["demo", "--db", f"sqlite:///{missing / 'outbox.db'}", "--events", "20"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("room-outbox demo: --db: folder /") and err.endswith(
        f"{missing} does not exist (the demo creates none; make it first)\n"
    )
    assert not (tmp_path / "no").exists()


def test_an_unknown_ordering_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit) as raised:
        main(["demo", "--ordering", "global"])
    assert raised.value.code == 2


@pytest.mark.anyio
async def test_a_run_that_cannot_finish_is_not_verified(database_dsn: str) -> None:
    """A table whose event_id column cannot hold the demo's ids would be a store bug; here the
    timeout makes the same point cheaply: unpublished events mean exit code 1, never 0."""
    out = io.StringIO()
    options = DemoOptions(db=database_dsn, events=20, failure_rate=0.9, timeout=0.0, seed=3)
    assert await run_demo(options, out) is False
    assert "NOT verified" in out.getvalue()


def test_the_plan_opens_and_closes_every_room_and_has_every_command_kind() -> None:
    import random

    plans = plan_commands(200, random.Random(1))
    types = {t for commands in plans.values() for command in commands for t, _ in command}
    assert {"RoomCreated", "RoomUserJoined", "RoomGiftSent", "RoomMicChanged", "RoomHeatChanged", "RoomClosed"} <= types
    for commands in plans.values():
        assert commands[0][0][0] == "RoomCreated" and commands[-1][0][0] == "RoomClosed"
    assert sum(len(c) for commands in plans.values() for c in commands) == 200


def _events(*spec: tuple[str, str, str, int]) -> dict[str, EventEnvelope]:
    return {e: EventEnvelope(event_id=e, event_type=t, room_id=r, room_version=v) for e, t, r, v in spec}


EVENTS = _events(("e1", "RoomCreated", "A", 1), ("e2", "RoomUserJoined", "A", 2), ("e3", "RoomClosed", "A", 3))
ALL_PUBLISHED = {"e1": "published", "e2": "published", "e3": "published"}


def test_verify_passes_a_good_run() -> None:
    attempts = [("A", 1, "e1", True), ("A", 2, "e2", False), ("A", 2, "e2", True), ("A", 3, "e3", True)]
    checks = verify(EVENTS, ALL_PUBLISHED, ["e2", "e3", "e2"], NOOP, attempts, per_room=True)
    assert [c.ok for c in checks] == [True, True, True, True]


@pytest.mark.parametrize(
    ("statuses", "received", "attempts", "failing"),
    [
        ({**ALL_PUBLISHED, "e3": "pending"}, ["e2", "e3"], [], "events published"),
        (ALL_PUBLISHED, ["e2"], [], "IM-bound events received"),
        (ALL_PUBLISHED, ["e1", "e2", "e3"], [], "noop-type events"),
        (ALL_PUBLISHED, ["e2", "e3"], [("A", 3, "e3", True), ("A", 2, "e2", True)], "per-room order broken"),
    ],
)
def test_verify_fails_each_broken_promise(
    statuses: dict[str, str], received: list[str], attempts: list[tuple[str, int, str, bool]], failing: str
) -> None:
    checks = verify(EVENTS, statuses, received, NOOP, attempts, per_room=True)
    assert [c.text for c in checks if not c.ok] and all(failing in c.text for c in checks if not c.ok)


@pytest.mark.anyio
async def test_operator_commands_run_on_the_sqlite_file_the_demo_keeps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the demo's --keep prints: `ROOM_OUTBOX__DATABASE__DSN=sqlite:///… room-outbox status`;
    the row-changing commands work on that file too."""
    monkeypatch.setenv("ROOM_OUTBOX__DATABASE__DSN", f"sqlite:///{tmp_path / 'outbox.db'}")
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__ENABLED", "false")
    store = await open_store(f"sqlite:///{tmp_path / 'outbox.db'}")
    try:
        await store.migrate()
        await insert_events(store, [envelope("evt_1")])
    finally:
        await store.aclose()
    assert await anyio.to_thread.run_sync(main, ["status", "--json"]) == 0
    assert '"pending": 1' in capsys.readouterr().out
    assert await anyio.to_thread.run_sync(main, ["cancel", "evt_1", "--yes"]) == 0
    assert "cancelled evt_1" in capsys.readouterr().out
    assert await anyio.to_thread.run_sync(main, ["cleanup", "--older-than", "1s"]) == 0
    assert "0 published row(s)" in capsys.readouterr().out
