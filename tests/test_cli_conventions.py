"""One CLI convention, checked command by command: the registry builds the parser, --config is
accepted anywhere, changes preview until --yes, every report has --json, filters combine,
tables follow their content, errors are grouped, durations are echoed as typed, completion
scripts are generated, and the error paths name their cause."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import envelope, fetch_rows, free_port, insert_events, without_room_outbox_environment
from test_cli import cli

from room_outbox.cli import cleanup as cleanup_cli
from room_outbox.cli.main import build_parser
from room_outbox.cli.registry import COMMANDS
from room_outbox.consume.registry import NO_CONSUMER
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import consumer_store
from room_outbox.store.operator.reports import error_pattern

pytestmark = pytest.mark.anyio

DAY_MS = 86_400_000


@pytest.fixture
def config(tmp_path: Path, database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    without_room_outbox_environment(monkeypatch)
    path = tmp_path / "config.yaml"
    path.write_text(
        f"mysql:\n  dsn: '{database_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n"
        "retention:\n  batch_size: 2\n  pause: 0s\n"
        "consumers:\n  feed:\n    handlers: [audit]\n"
    )
    return str(path)


async def park(store: MySQLStore, error: str, *event_ids: str) -> None:
    async with store.transaction() as cur:
        for event_id in event_ids:
            await cur.execute(
                "UPDATE room_outbox SET status = 'failed', retry_count = 5, last_error = %s WHERE event_id = %s",
                (error, event_id),
            )


# -- the registry -------------------------------------------------------------------------------


def test_the_parser_has_exactly_the_registered_commands_each_with_its_needs() -> None:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert list(action.choices) == [command.name for command in COMMANDS]
    assert all(listed.command().needs in ("none", "config", "store") for listed in COMMANDS)
    assert {c.name for c in COMMANDS if c.command().needs == "none"} == {"demo", "fake-im", "completion"}


def test_config_is_accepted_before_or_after_the_command_and_its_action() -> None:
    parser = build_parser()
    assert parser.parse_args(["lanes", "retire", "audit", "--config", "f.yaml"]).config == "f.yaml"
    assert parser.parse_args(["--config", "f.yaml", "lanes", "retire", "audit"]).config == "f.yaml"
    argv = ["consumers", "redrive", "--consumer", "feed", "--config", "f.yaml", "--yes"]
    assert parser.parse_args(argv).config == "f.yaml"
    assert parser.parse_args(["consumers", "describe", "--config", "f.yaml"]).config == "f.yaml"


def test_every_reporting_command_has_json_and_every_changing_one_has_yes() -> None:
    parser = build_parser(every_command=True)

    def options(*argv: str) -> set[str]:
        sub: argparse.ArgumentParser = parser
        for word in argv:
            action = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
            sub = action.choices[word]
        return {o for a in sub._actions for o in a.option_strings}

    reports = [("status",), ("inspect",), ("requeue",), ("cancel",), ("cleanup",), ("check-config",), ("migrate",),
               ("lanes",), ("consumers", "dead-letters"), ("consumers", "redrive"), ("consumers", "describe")]  # fmt: skip
    for argv in reports:
        assert "--json" in options(*argv), argv
    for argv in [("requeue",), ("cancel",), ("cleanup",), ("lanes", "retire"), ("consumers", "redrive")]:
        assert "--yes" in options(*argv), argv


# -- shell completion ---------------------------------------------------------------------------


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
async def test_completion_scripts_know_every_command_and_option(
    shell: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, script, err = await cli(capsys, "completion", shell)
    assert (code, err) == (0, "")
    for word in ("check-config", "requeue", "consumers", "describe", "older-than", "yes", "json"):
        assert word in script, (shell, word)  # (fish spells an option `-l older-than`)
    binary = shutil.which(shell)
    if binary is not None and shell in ("bash", "zsh"):  # the shell itself reads it without error
        (tmp_path / "script").write_text(script)
        checked = subprocess.run([binary, "-n", str(tmp_path / "script")], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr


# -- cancel previews ----------------------------------------------------------------------------


async def test_cancel_previews_and_changes_only_with_yes(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await insert_events(store, [envelope("c1"), envelope("c2")])
    code, out, err = await cli(capsys, "cancel", "c1", "--config", config)
    assert (code, out, err) == (0, "would cancel c1 (now pending); run again with --yes to cancel it\n", "")
    assert (await fetch_rows(store))["c1"]["status"] == "pending"
    code, out, _ = await cli(capsys, "cancel", "c1", "--yes", "--config", config)
    assert (code, out) == (0, "cancelled c1: it will never be delivered; the row is kept\n")
    assert (await fetch_rows(store))["c1"]["status"] == "cancelled"
    code, out, _ = await cli(capsys, "cancel", "c2", "--json", "--config", config)
    assert code == 0 and json.loads(out) == {
        "event_id": "c2", "app_code": None, "applied": False, "cancelled": False, "would_cancel": True,
        "status": "pending",
    }  # fmt: skip
    code, out, err = await cli(capsys, "cancel", "c1", "--config", config)  # already cancelled: says so, preview too
    assert (code, out, err) == (
        1,
        "",
        "room-outbox cancel: c1 is cancelled: only pending or failed events can be cancelled\n",
    )


# -- requeue: filters, hint, widths, --json ------------------------------------------------------


async def test_requeue_status_failed_alone_takes_every_parked_row_and_filters_combine(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await insert_events(store, [envelope("p1"), envelope("p2", "RoomGiftSent"), envelope("open")])
    await park(store, "tencent_im: gone", "p1", "p2")
    code, out, _ = await cli(capsys, "--config", config, "requeue", "--status", "failed", "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["applied"], doc["matched"], doc["requeued"]) == (False, 2, 0)
    assert sorted(r["event_id"] for r in doc["rows"]) == ["p1", "p2"]
    argv = ["--config", config, "requeue", "--status", "failed", "--event-type", "RoomGiftSent", "--yes", "--json"]
    code, out, _ = await cli(capsys, *argv)
    assert code == 0 and json.loads(out)["requeued"] == 1
    rows = await fetch_rows(store)
    assert (rows["p1"]["status"], rows["p2"]["status"], rows["open"]["status"]) == ("failed", "pending", "pending")


async def test_requeue_columns_follow_the_content(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    long_id = "evt_" + "x" * 60
    await insert_events(store, [envelope(long_id), envelope("short", "RoomGiftSentWithAVeryLongTypeName")])
    await park(store, "tencent_im: gone", long_id, "short")
    code, out, _ = await cli(capsys, "--config", config, "requeue", "--status", "failed")
    header, *rows, summary = out.splitlines()
    assert code == 0 and summary.startswith("2 row(s) would be requeued")
    start = header.index("app_code")
    assert start == len(long_id) + 2  # the event_id column is as wide as the longest id, plus the gap
    for row in rows:
        assert row[start - 2 : start] == "  " and row[start] != " "  # every app_code starts in the column
    types = header.index("event_type")
    assert header.index("status") == types + len("RoomGiftSentWithAVeryLongTypeName") + 2


# -- status groups errors ------------------------------------------------------------------------


async def test_status_groups_errors_that_differ_only_by_an_identifier(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await insert_events(store, [envelope(f"e{n}", room_id=f"r_{n}") for n in range(21)])
    async with store.transaction() as cur:
        for n in range(20):
            await cur.execute(
                "UPDATE room_outbox SET retry_count = 1, last_error = %s WHERE event_id = %s",
                (f"tencent_im: ErrorCode 10010 GroupId @TGS#2C5S{n:04d}EF group not found", f"e{n}"),
            )
        await cur.execute(
            "UPDATE room_outbox SET retry_count = 1, last_error = 'tencent_im: timeout' WHERE event_id = 'e20'"
        )
    code, out, _ = await cli(capsys, "--config", config, "status")
    section = out.split("most frequent last_error", 1)[1].splitlines()[1:]
    assert code == 0
    assert [line.split(None, 1) for line in section[1:3]] == [
        ["20", "tencent_im: ErrorCode 10010 GroupId <id> group not found"],
        ["1", "tencent_im: timeout"],
    ]
    code, out, _ = await cli(capsys, "--config", config, "status", "--json")
    assert json.loads(out)["top_errors"][0] == {
        "last_error": "tencent_im: ErrorCode 10010 GroupId <id> group not found", "rows": 20,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("error", "grouped"),
    [
        (  # Tencent's error for an empty group id: words after GroupId, kept as they are
            "tencent_im: permanent: ErrorCode 10004: parameter invalid: GroupId must be a non-empty string"
            " (GroupId , app default)",
            "tencent_im: permanent: ErrorCode 10004: parameter invalid: GroupId must be a non-empty string"
            " (GroupId , app default)",
        ),
        ("ErrorCode 10015: GroupId is invalid", "ErrorCode 10015: GroupId is invalid"),
        ("room_id must match the envelope's", "room_id must match the envelope's"),
        (
            "ErrorCode 10010: group gone (GroupId g_123, app default)",
            "ErrorCode 10010: group gone (GroupId <id>, app default)",
        ),
        ("GroupId 'my group' is gone", "GroupId <id> is gone"),
        ("room_id=lobby refused", "room_id=<id> refused"),
        ("event_id: dup", "event_id: <id>"),
    ],
)
def test_status_masks_only_what_looks_like_an_identifier(error: str, grouped: str) -> None:
    """After a name such as GroupId, a value holding a digit, quoted, or after ``=`` or ``:`` is
    an identifier; plain words are the error's own text, which the operator must read as sent."""
    assert error_pattern(error) == grouped


# -- cleanup: durations as typed, --json, an interrupted run -------------------------------------


async def add_published(store: MySQLStore, count: int, age_ms: int) -> None:
    await insert_events(store, [envelope(f"old{n}") for n in range(count)])
    async with store.transaction() as cur:
        created = now_ms() - age_ms
        await cur.execute(
            "UPDATE room_outbox SET status = 'published', created_at_ms = %s, updated_at_ms = %s", (created, created)
        )


async def test_cleanup_echoes_the_duration_as_typed_and_reports_json(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await add_published(store, 3, 10 * DAY_MS)
    code, out, _ = await cli(capsys, "--config", config, "cleanup", "--older-than", "168h")
    assert code == 0 and out.startswith("3 published row(s) older than 168h would be deleted (dry run")
    code, out, _ = await cli(capsys, "--config", config, "cleanup", "--older-than", "168h", "--yes", "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["applied"], doc["removed"], doc["older_than_seconds"]) == (True, 3, 604800.0)
    assert await fetch_rows(store) == {}


async def test_an_interrupted_cleanup_says_how_many_rows_it_had_deleted(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    await add_published(store, 6, 10 * DAY_MS)
    real_cleanup = cleanup_cli.cleanup

    async def interrupted_after_two_batches(*args: Any, progress: Any, **kwargs: Any) -> Any:
        def then_ctrl_c(report: Any) -> None:
            progress(report)
            if report.batches == 2:
                raise KeyboardInterrupt

        return await real_cleanup(*args, progress=then_ctrl_c, **kwargs)

    monkeypatch.setattr(cleanup_cli, "cleanup", interrupted_after_two_batches)
    code, out, err = await cli(capsys, "--config", config, "cleanup", "--yes")
    assert (code, out) == (130, "")
    assert err.splitlines() == [
        "room-outbox cleanup: interrupted after 4 row(s) deleted in 2 batch(es); run it again to finish",
        "room-outbox: interrupted",
    ]
    assert len(await fetch_rows(store)) == 2


# -- check-config and migrate --json --------------------------------------------------------------


async def test_check_config_and_migrate_report_json(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await cli(capsys, "check-config", "--json", "--config", config)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and "tencent_im" not in doc["main_sinks"] and doc["source"] == config
    code, out, _ = await cli(capsys, "migrate", "--json", "--config", config)
    assert code == 0 and isinstance(json.loads(out)["changes"], list)
    # Again: only the handler's own (idempotent) statements, which run every time.
    code, out, _ = await cli(capsys, "migrate", "--json", "--config", config)
    assert code == 0 and json.loads(out) == {"changes": ["ran 1 schema statement(s) for handler audit"]}
    code, out, _ = await cli(capsys, "migrate", "--sql", "--json", "--config", config)
    steps = json.loads(out)["steps"]
    assert code == 0 and [step["change"] for step in steps] == ["would run 1 schema statement(s) for handler audit"]
    assert all(isinstance(statement, str) for statement in steps[0]["statements"])


EVERY_ERROR = [
    "database.pool_sise: Extra inputs are not permitted",
    "sinks.tencent_im.sdkappid: is required: the SDKAppID of the Tencent IM app (console → app → SDKAppID)",
    "sinks.tencent_im.secret_key: is empty; set it through the environment as ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY",
]


@pytest.mark.parametrize("command", ["check-config", "run"])
def test_a_configuration_that_does_not_load_is_reported_with_every_other_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """A key the settings refuse stopped the check there: the sink's own errors showed only on
    the next run, once the key was fixed."""
    without_room_outbox_environment(monkeypatch)
    config = tmp_path / "config.yaml"
    config.write_text("database:\n  pool_sise: 3\nsinks:\n  tencent_im:\n    enabled: true\n")
    done = room_outbox(command, "--config", str(config))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == ["room-outbox: invalid configuration:", *(f"  {e}" for e in EVERY_ERROR)]


def test_check_config_json_reports_an_invalid_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--json printed nothing on stdout for an invalid configuration ("ok" was true, always)."""
    without_room_outbox_environment(monkeypatch)
    config = tmp_path / "config.yaml"
    config.write_text("database:\n  pool_sise: 3\nsinks:\n  tencent_im:\n    enabled: true\n")
    done = room_outbox("check-config", "--json", "--config", str(config))
    assert done.returncode == 2
    doc = json.loads(done.stdout)
    assert (doc["ok"], doc["errors"], doc["source"], doc["main_sinks"]) == (False, EVERY_ERROR, str(config), [])
    config.write_text("database:\n  pool_size: 3\nsinks:\n  tencent_im:\n    enabled: true\n")
    done = room_outbox("check-config", "--json", "--config", str(config))
    assert done.returncode == 2
    assert (json.loads(done.stdout)["ok"], json.loads(done.stdout)["errors"]) == (False, EVERY_ERROR[1:])
    config.write_text("database:\n  pool_size: 3\nsinks:\n  tencent_im:\n    enabled: false\n")
    done = room_outbox("check-config", "--json", "--config", str(config))
    assert done.returncode == 0
    assert (json.loads(done.stdout)["ok"], json.loads(done.stdout)["errors"]) == (True, [])


def test_check_config_for_consume_leaves_the_sinks_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumers' own file (the shipped compose one) configures no sink: checked as `run`
    would, the Tencent IM sink's missing credentials refused it, though `consume` runs it."""
    without_room_outbox_environment(monkeypatch)
    shipped = str(Path(__file__).resolve().parent.parent / "config" / "config.consume.docker.yaml")
    assert room_outbox("check-config", "--config", shipped).returncode == 2  # as `run` would: sinks unset
    done = room_outbox("check-config", "--for", "consume", "--config", shipped)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"configuration OK ({shipped}) for consume: database 'room'; consumers: feed\n"
    config = tmp_path / "config.yaml"
    config.write_text("consumers:\n  feed:\n    enabled: false\n    handlers: [audit]\n")
    done = room_outbox("check-config", "--for", "consume", "--json", "--config", str(config))
    assert done.returncode == 2
    doc = json.loads(done.stdout)
    assert (doc["ok"], doc["errors"]) == (False, [NO_CONSUMER])


# -- consumers redrive names an unknown consumer -------------------------------------------------


async def test_redrive_of_an_unknown_consumer_names_it(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    consumers = consumer_store(store)
    assert consumers is not None
    await consumers.migrate()
    code, out, err = await cli(capsys, "--config", config, "consumers", "redrive", "--consumer", "typo")
    assert (code, out) == (2, "")
    assert err == "room-outbox consumers redrive: no consumer 'typo' (known: feed)\n"
    code, out, _ = await cli(capsys, "--config", config, "consumers", "redrive", "--consumer", "feed", "--json")
    assert code == 0 and json.loads(out)["selected"] == 0


async def test_a_terminal_without_an_events_characters_shows_them_escaped(store: MySQLStore, config: str) -> None:
    """A locale whose encoding lacks some of an event's characters (an emoji in a GBK or
    Latin-1 terminal; ASCII here): the report is written with them escaped. It failed with a
    UnicodeEncodeError half-way through."""
    await insert_events(store, [envelope("emoji", payload={"t": "🎉 你好"})])
    shown = subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", config, "inspect", "emoji"],
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
        capture_output=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr.decode()
    assert '"t": "\\U0001f389 \\u4f60\\u597d"' in shown.stdout.decode("ascii")


# -- integer options out of range --------------------------------------------------------------


def room_outbox(*argv: str) -> subprocess.CompletedProcess[str]:
    """The command line as a process: what an operator sees, exit code and all."""
    return subprocess.run([sys.executable, "-m", "room_outbox.cli", *argv], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("limit", ["-1", "0", "99999999999999999999"])
async def test_dead_letters_refuses_a_limit_out_of_range_naming_it(store: MySQLStore, config: str, limit: str) -> None:
    """The limit went into SQL's LIMIT as typed: a traceback (exit 1) from the database."""
    consumers = consumer_store(store)
    assert consumers is not None
    await consumers.migrate()
    done = room_outbox("--config", config, "consumers", "dead-letters", f"--limit={limit}")
    assert (done.returncode, done.stdout) == (2, "")
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"room-outbox consumers dead-letters: error: argument --limit: {limit} is out of range (1 to 100000)"
    )


@pytest.mark.parametrize(("command", "age"), [("cleanup", "-1h"), ("cleanup", "0"), ("requeue", "-0")])
async def test_an_age_of_zero_or_less_is_refused_naming_it(
    store: MySQLStore, config: str, command: str, age: str
) -> None:
    """As retention.older_than refuses it: `cleanup --older-than=-1h --yes` deleted rows
    published a moment ago."""
    await add_published(store, 2, 0)
    done = room_outbox("--config", config, command, f"--older-than={age}", "--yes")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1] == (
        f"room-outbox {command}: error: argument --older-than: '{age}': must be a positive duration (e.g. 168h, 30d)"
    )
    assert len(await fetch_rows(store)) == 2


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_fake_im_refuses_a_port_out_of_range_naming_it(port: str) -> None:
    """A port beyond 0 to 65535 reached the socket: an OverflowError traceback (exit 1)."""
    done = room_outbox("fake-im", f"--port={port}")
    assert (done.returncode, done.stdout) == (2, "")
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"room-outbox fake-im: error: argument --port: {port} is out of range (0 to 65535)"
    )


@pytest.mark.parametrize(
    ("faults", "said"),
    [
        (
            '{"bogus": 1}',
            "bogus: no such fault (known: error_rate, error_codes, fail_next, http_error_rate, http_status,"
            " latency, hang_rate, drop_rate, drop_reason, app_qps_limit, group_qps_limit)",
        ),
        (
            '{"error_rate": 2, "latency": "x"}',
            "error_rate: Input should be less than or equal to 1;"
            " latency: Input should be a valid number, unable to parse string as a number",
        ),
        ("[1]", 'the faults: a JSON object is expected, e.g. {"error_rate": 0.2}'),
        ('{"error_rate', "not JSON: Unterminated string starting at: line 1 column 2 (char 1)"),
    ],
)
def test_fake_im_names_each_bad_fault_in_one_line(faults: str, said: str) -> None:
    """pydantic's own text took four lines a field, with the input and a web link."""
    done = room_outbox("fake-im", "--port", "0", "--faults", faults)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"room-outbox fake-im: --faults: {said}\n"


def test_consumers_on_sqlite_say_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The message carried the prefix the CLI adds to every error: it was printed twice."""
    without_room_outbox_environment(monkeypatch)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"database: {{dsn: 'sqlite:///{tmp_path}/outbox.db'}}\nsinks: {{tencent_im: {{enabled: false}}}}\n"
    )
    assert room_outbox("--config", str(config), "migrate").returncode == 0
    done = room_outbox("--config", str(config), "consumers", "dead-letters")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "room-outbox: consumers: needs a MySQL or PostgreSQL database; database.dsn names SQLite\n"


# -- a mistyped SQLite path ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "slashes"),
    [(["status"], "//"), (["inspect", "evt_1"], "//"), (["lanes"], "//"), (["run"], "//"), (["status"], "///")],
)
def test_a_missing_sqlite_file_is_named_and_not_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], slashes: str
) -> None:
    """Every command made the file's folders and an empty database there, then failed on its
    missing tables: a later migrate with the same typo would have migrated the wrong file."""
    without_room_outbox_environment(monkeypatch)
    path = tmp_path / "typo" / "deep" / "outbox.db"
    config = tmp_path / "config.yaml"
    # sqlite:///tmp/…: the path is absolute; sqlite:////tmp/… (SQLAlchemy's form) names it too.
    dsn = f"sqlite:{slashes}{path}"
    config.write_text(f"database: {{dsn: '{dsn}'}}\nsinks: {{tencent_im: {{enabled: false}}}}\n")
    done = room_outbox("--config", str(config), *command)
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr.splitlines()[-1] == (
        f"room-outbox: SQLite database file '{path}' does not exist: is database.dsn's path right?"
        " (`room-outbox migrate` creates it)"
    )
    assert not (tmp_path / "typo").exists()
    assert room_outbox("--config", str(config), "migrate").returncode == 0  # migrate creates it
    done = room_outbox("--config", str(config), "status", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["pending"] == 0


@pytest.mark.parametrize(
    ("command", "what", "reason"),
    [
        (["migrate"], "a folder", "unable to open database file; check database.dsn's file and its directory"),
        (["run"], "not a database", "file is not a database; does database.dsn's path name room-outbox's"
         " database, and is the file undamaged?"),
    ],
)  # fmt: skip
def test_a_sqlite_file_that_cannot_be_opened_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], what: str, reason: str
) -> None:
    """A path that is a folder failed in aiosqlite's connect, whose worker thread, left to stop
    on its own, then reported to the closed event loop ("Event loop is closed", a traceback); a
    file that is not a database failed untranslated, as a traceback. Each is one line, exit 3."""
    without_room_outbox_environment(monkeypatch)
    path = tmp_path / "outbox.db"
    if what == "a folder":
        path.mkdir()
    else:
        path.write_bytes(b"not a SQLite database, " * 512)
    config = tmp_path / "config.yaml"
    config.write_text(f"database: {{dsn: 'sqlite://{path}'}}\nsinks: {{tencent_im: {{enabled: false}}}}\n")
    done = room_outbox("--config", str(config), *command)
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr.splitlines() == [f"room-outbox: SQLite file '{path}': {reason}"], done.stderr[-3000:]


def test_no_commands_option_overwrites_which_command_runs() -> None:
    """The parser records the command typed in `args.command`: an option of a command with the
    same dest (`check-config --for` at first) made `check-config --for consume` run `consume`."""
    parser = build_parser(every_command=True)
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    clashes = [
        f"{name} {action.option_strings}"
        for name, sub in commands.choices.items()
        for nested in [
            sub,
            *(p for a in sub._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()),
        ]
        for action in nested._actions
        if action.dest == commands.dest
    ]
    assert commands.dest == "command" and clashes == []


def test_migrate_refuses_a_sink_or_handler_name_it_would_make_no_table_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """migrate made tables for the names it knew and passed over a misspelt sink or handler in
    silence (exit 0); run, consume and check-config refuse them. It names them, before it
    connects: nothing is created."""
    without_room_outbox_environment(monkeypatch)
    database = tmp_path / "outbox.db"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"database:\n  dsn: sqlite:///{database}\nsinks:\n  tencent_im:\n    enabled: false\n  jsnol:\n    enabled: true\n"
        "consumers:\n  stats:\n    handlers: [gift_stat]\n"
    )
    for sql in ([], ["--sql"]):
        done = room_outbox("migrate", *sql, "--config", str(config))
        assert (done.returncode, done.stdout) == (2, "")
        problems = done.stderr.splitlines()[1:]
        assert [line.split(" (")[0] for line in problems] == [
            "  sinks.jsnol: no installed plugin provides a sink named 'jsnol'",
            "  consumers.stats.handlers: unknown handler(s) gift_stat",
        ], problems
    assert not database.exists()


def test_consume_names_a_misspelt_handler_before_it_waits_for_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """consume waited connect_wait for an unreachable database and said only that; the
    handler's name, which needs no database, is named at once (exit 2)."""
    without_room_outbox_environment(monkeypatch)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"database:\n  dsn: mysql://root@127.0.0.1:{free_port()}/x\n  connect_wait: 60s\n"
        "consumers:\n  feed:\n    bootstrap_servers: 127.0.0.1:1\n    handlers: [audti]\n"
    )
    done = room_outbox("consume", "--config", str(config))  # within its 60 s timeout: not after connect_wait
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1].startswith("  consumers.feed.handlers: unknown handler(s) audti ("), done.stderr
