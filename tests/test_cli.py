"""The command line as an operator meets it: --version, help with a description and examples
for every command, --config everywhere, human times next to raw ones, requeue's limit, and
migrate --sql."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import time
from pathlib import Path

import anyio
import psycopg
import pytest
from support import V1_DDL, StatementLog, envelope, insert_events, key_event_ids_per_app, statuses_by_app

from room_outbox.cli.main import EXIT_CODES, build_parser, main
from room_outbox.cli.migrate import script_lines
from room_outbox.cli.output import format_relative, format_time
from room_outbox.cli.registry import COMMANDS
from room_outbox.cli.requeue import requeue_command
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import table_names
from room_outbox.store.factory import consumer_store, open_store
from room_outbox.store.membership import bucket_of
from room_outbox.store.operator.changes import RequeueFilter
from room_outbox.store.schema.outbox import Migration
from room_outbox.version import package_version

pytestmark = pytest.mark.anyio

HUMAN_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \((\d+ (s|min|h|d) ago|in \d+ (s|min|h|d))\)"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ROOM_OUTBOX"):
            monkeypatch.delenv(name)


@pytest.fixture
def config(tmp_path: Path, database_dsn: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"mysql:\n  dsn: '{database_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n")
    return str(path)


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await anyio.to_thread.run_sync(main, list(argv))  # main() runs its own event loop
    out, err = capsys.readouterr()
    return code, out, err


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


# -- the services' start -------------------------------------------------------------------------


def test_freezing_the_startup_heap_puts_what_exists_beyond_the_collector() -> None:
    import gc

    from room_outbox.startup import freeze_startup_heap

    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 10_000  # the imported modules at least
        assert gc.get_count()[0] < 100  # and nothing was left for a young collection
    finally:
        gc.unfreeze()


def test_run_and_consume_freeze_the_startup_heap_and_the_one_off_commands_do_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The two long-running services freeze the heap they start with (each then stops on a
    configuration error found inside: an unknown sink, no consumer); a one-off command never
    does."""
    import room_outbox.cli.consume as consume_cli
    import room_outbox.cli.run as run_cli

    frozen: list[str] = []
    monkeypatch.setattr(run_cli, "freeze_startup_heap", lambda: frozen.append("run"))
    monkeypatch.setattr(consume_cli, "freeze_startup_heap", lambda: frozen.append("consume"))
    path = tmp_path / "config.yaml"
    path.write_text("database:\n  dsn: 'sqlite:///x.db'\nsinks:\n  no_such_sink:\n    enabled: true\n")
    assert main(["--config", str(path), "check-config"]) == 2
    assert frozen == []
    assert main(["--config", str(path), "run"]) == 2
    assert frozen == ["run"]
    path.write_text("database:\n  dsn: 'sqlite:///x.db'\n")
    assert main(["--config", str(path), "consume"]) == 2
    assert frozen == ["run", "consume"]


# -- version and help ---------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"room-outbox {package_version()}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", package_version())


def test_top_level_help_describes_the_tool_and_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys)
    assert text.startswith("usage: room-outbox [--config FILE] COMMAND [options]\n\nGuaranteed delivery of room events")
    assert "``" not in text  # no raw docstring markup
    for name in (command.name for command in COMMANDS):
        assert re.search(rf"^    {re.escape(name)}\b", text, re.M), name
    assert "examples:\n  room-outbox check-config" in text and "Exit codes: 0 done" in text


def test_every_command_has_a_description_an_example_and_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert subcommands is not None and set(subcommands) == {command.name for command in COMMANDS}
    for listed in COMMANDS:
        name, command = listed.name, listed.command()
        text = help_of(capsys, name)
        assert text.startswith(f"usage: room-outbox {name} "), name
        assert command.description.splitlines()[0] in text, name
        examples = text.split("examples:\n", 1)[1].splitlines()
        assert examples and all(line.startswith("  ") and "room-outbox " in line for line in examples), name
        assert "--config FILE" in text, name
        if command.needs != "none":
            assert "$ROOM_OUTBOX_CONFIG" in text, name
        for example in examples:  # every example parses
            words = shlex.split(example.split(" | ")[0])
            build_parser().parse_args(words[words.index("room-outbox") + 1 :])


def test_config_after_the_command_wins_and_before_it_is_kept() -> None:
    parser = build_parser()
    assert parser.parse_args(["--config", "a.yaml", "status"]).config == "a.yaml"
    assert parser.parse_args(["status", "--config", "b.yaml"]).config == "b.yaml"


# -- errors on stderr -----------------------------------------------------------------------------


async def test_cancel_errors_go_to_stderr(store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await cli(capsys, "--config", config, "cancel", "nosuch")
    assert (code, out, err) == (1, "", "room-outbox cancel: no event nosuch\n")


# -- event ids unique per app --------------------------------------------------------------------


async def test_an_event_id_several_apps_have_is_shown_per_app_and_changed_only_for_the_app_named(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where event ids are unique per app only, ``cancel`` and ``requeue --event-id`` refuse an id
    that names rows of several apps (previews as the change itself) and take ``--app-code``;
    ``inspect`` shows each app's row and labels the consumers' records by app."""
    await key_event_ids_per_app(store)
    await insert_events(store, [envelope("x0", app_code="appa"), envelope("x0", app_code="appb")])
    consumers = consumer_store(store)
    assert consumers is not None
    await consumers.migrate()
    async with store.transaction() as cur:
        await cur.execute(
            "INSERT INTO room_consumer_processed (consumer, handler, app_code, event_id, topic, kafka_partition,"
            " kafka_offset, processed_at_ms) VALUES ('feed', 'audit', 'appa', 'x0', 'room.events', 0, 7, %s)",
            (now_ms(),),
        )
    refused = (
        "room-outbox {}: event id x0 names rows of several apps (appa, appb): nothing changed;"
        " say which app's event with --app-code\n"
    )
    previews_and_changes = (["cancel", "x0"], ["cancel", "x0", "--yes"], ["requeue", "--event-id", "x0"],
                            ["requeue", "--event-id", "x0", "--yes"])  # fmt: skip
    for argv in previews_and_changes:
        assert await cli(capsys, "--config", config, *argv) == (1, "", refused.format(argv[0])), argv
    assert await statuses_by_app(store, "x0") == {"appa": "pending", "appb": "pending"}

    code, out, _ = await cli(capsys, "--config", config, "inspect", "x0")
    assert code == 0 and out.startswith("event x0: 2 rows, of several apps (--app-code shows one)\n\n== app appa ==\n")
    assert re.search(r"^== app appb ==\nid +2\napp_code +appb$", out, re.M)
    assert "consumer feed / audit, app appa: consumed from room.events[0]@7" in out
    code, out, _ = await cli(capsys, "--config", config, "inspect", "x0", "--json")
    assert [doc["row"]["app_code"] for doc in json.loads(out)["events"]] == ["appa", "appb"]
    code, out, _ = await cli(capsys, "--config", config, "inspect", "x0", "--app-code", "appb", "--json")
    assert (json.loads(out)["row"]["app_code"], json.loads(out)["consumers"]) == ("appb", [])

    code, out, _ = await cli(capsys, "--config", config, "cancel", "x0", "--app-code", "appb")
    assert (code, out) == (0, "would cancel x0 of app appb (now pending); run again with --yes to cancel it\n")
    code, out, _ = await cli(capsys, "--config", config, "cancel", "x0", "--app-code", "appb", "--yes")
    assert (code, out) == (0, "cancelled x0 of app appb: it will never be delivered; the row is kept\n")
    code, out, _ = await cli(capsys, "--config", config, "requeue", "--event-id", "x0", "--app-code", "appa")
    assert code == 0 and re.search(r"^x0 +appa +RoomUserJoined +pending ", out, re.M) and "appb" not in out
    assert await statuses_by_app(store, "x0") == {"appa": "pending", "appb": "cancelled"}


async def test_requeue_of_thousands_of_event_ids_finds_the_one_several_apps_have_however_it_is_cased(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ids are checked in statements of many ids each, grouped by the table's own comparison:
    an id listed past the first statement's ids, naming rows of two apps that differ only in
    case under the table's case-insensitive collation, is refused as ``=`` would find it."""
    await key_event_ids_per_app(store)
    await insert_events(store, [envelope("x0", app_code="appa"), envelope("X0", app_code="appb"),
                                envelope("y1", app_code="appa")])  # fmt: skip
    listed = [f"none{n}" for n in range(1500)] + ["x0"] + [f"none{n}" for n in range(1500, 2500)]
    argv = [arg for event_id in listed for arg in ("--event-id", event_id)]
    code, out, err = await cli(capsys, "--config", config, "requeue", *argv)
    assert (code, out) == (1, "") and "event id x0 names rows of several apps (appa, appb)" in err
    code, out, err = await cli(capsys, "--config", config, "requeue", *argv[:3000], "--event-id", "y1")
    assert code == 0 and re.search(r"^y1 +appa +RoomUserJoined +pending ", out, re.M), (out, err)
    assert await statuses_by_app(store, "X0") == {"appa": "pending", "appb": "pending"}


# -- human times ----------------------------------------------------------------------------------


def test_human_times_read_like_the_clock_and_say_how_long_ago() -> None:
    now = 1_764_579_662_000
    assert format_relative(-180_000) == "3 min ago" and format_relative(25_000) == "in 25 s"
    assert format_relative(-2 * 86_400_000) == "2 d ago" and format_relative(0) == "0 s ago"
    assert re.fullmatch(HUMAN_TIME, format_time(now - 180_000, now))
    assert format_time(now - 180_000, now).endswith(" (3 min ago)")


async def test_inspect_shows_human_times_and_json_keeps_raw_ones(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await insert_events(store, [envelope("e1")])
    async with store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET created_at_ms = created_at_ms - 180000, lock_until_ms = %s", (now_ms() + 60_000,)
        )
    code, out, _ = await cli(capsys, "--config", config, "inspect", "e1")
    assert code == 0
    created = next(line for line in out.splitlines() if line.startswith("created_at_ms"))
    assert re.fullmatch(rf"created_at_ms\s+\d{{13}}  {HUMAN_TIME}", created) and "(3 min ago)" in created
    lock = next(line for line in out.splitlines() if line.startswith("lock_until_ms"))
    assert re.search(r"\(in (59|60) s\)$", lock)
    code, out, _ = await cli(capsys, "--config", config, "inspect", "e1", "--json")
    row = json.loads(out)["row"]
    assert isinstance(row["created_at_ms"], int) and isinstance(row["lock_until_ms"], int)


async def test_inspect_says_when_a_row_younger_than_claim_after_becomes_claimable(
    store: MySQLStore, tmp_path: Path, database_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row room-service just wrote waits for the configuration's ``outbox_worker.claim_after``
    before the dispatcher claims it: inspect says so and when, where it said "due: the next
    scan claims it"."""
    await insert_events(store, [envelope("justnow")])  # created now, by the database's clock
    config = tmp_path / "config.yaml"
    config.write_text(f"mysql:\n  dsn: '{database_dsn}'\noutbox_worker:\n  claim_after: 2m\n")
    code, out, _ = await cli(capsys, "--config", str(config), "inspect", "justnow")
    (state,) = [line for line in out.splitlines() if line.startswith("state: ")]
    assert code == 0 and re.fullmatch(
        r"state: young: left to the producer's own push until 2 min old \(outbox_worker.claim_after\);"
        rf" claimable from {HUMAN_TIME}",
        state,
    ), state
    assert re.search(r"\(in (1|2) min\)$", state), state


async def test_status_shows_the_oldest_pending_time(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await insert_events(store, [envelope("e1")])
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET created_at_ms = created_at_ms - 7200000")
    code, out, _ = await cli(capsys, "--config", config, "status")
    assert code == 0
    assert re.search(rf"^oldest pending        {HUMAN_TIME}$", out, re.M) and "(2 h ago)" in out
    code, out, _ = await cli(capsys, "--config", config, "status", "--json")
    assert 7_200_000 <= json.loads(out)["oldest_pending_age_ms"] < 7_300_000


async def test_requeue_ages_rows_on_the_databases_clock_not_the_hosts(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host whose clock runs 8 h ahead: a row created 2 minutes ago (the database's clock) is
    2 minutes old in requeue's list, as status and inspect say, not 8 hours."""
    await insert_events(store, [envelope("e1")])
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET created_at_ms = %s", (now_ms() - 120_000,))
    host_clock = time.time
    monkeypatch.setattr(time, "time", lambda: host_clock() + 8 * 3600)
    code, out, _ = await cli(capsys, "--config", config, "requeue", "--event-id", "e1")
    assert code == 0 and re.search(r"^e1 +default +RoomUserJoined +pending +0 +2 min\b", out, re.M), out


async def test_requeue_lists_a_row_without_a_creation_time(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A nullable creation time the producer left empty: listed with no age, not a TypeError."""
    await insert_events(store, [envelope("e1")])
    async with store.transaction() as cur:
        await cur.execute("ALTER TABLE room_outbox MODIFY created_at_ms BIGINT NULL")
        await cur.execute("UPDATE room_outbox SET created_at_ms = NULL")
    code, out, _ = await cli(capsys, "--config", config, "requeue", "--event-id", "e1")
    assert code == 0 and re.search(r"^e1 +default +RoomUserJoined +pending +0 +-$", out, re.M), out


# -- requeue's limit ------------------------------------------------------------------------------


async def test_requeue_says_when_more_rows_match_than_it_changes(store: MySQLStore) -> None:
    await insert_events(store, [envelope(f"e{n}") for n in range(5)])
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'failed', last_error = 'gone'")
    where = RequeueFilter(error_contains="gone", statuses=("failed",))
    out = io.StringIO()
    assert await requeue_command(store, where, False, out, limit=3) == 0
    assert out.getvalue().splitlines()[-1] == (
        "3 row(s) would be requeued; more than 3 rows match: only the first 3 (lowest ids) are taken;"
        " run again with --yes to apply"
    )
    out = io.StringIO()
    assert await requeue_command(store, where, True, out, limit=3) == 0
    assert out.getvalue().splitlines()[-1] == (  # the hint never suggests the --status failed given
        "requeued 3 row(s); more than 3 rows matched: only the first 3 (lowest ids) were taken;"
        " run it again to reach the rest (the rows just requeued no longer match --status failed)"
    )
    out = io.StringIO()  # the rows just requeued are pending now: --status failed reaches the rest
    assert await requeue_command(store, where, True, out, limit=3) == 0
    assert out.getvalue().splitlines()[-1] == "requeued 2 row(s)"  # nothing more to say


#: A key of BIGINT's widest: nineteen digits.
WIDE_KEY = 9_000_000_000_000_000_000


async def test_requeue_of_thousands_of_wide_keys_sends_statements_a_small_max_allowed_packet_takes(
    store: MySQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every key in one UPDATE: 10,000 keys of ten digits made 120 kB, 4,000 of nineteen digits
    84 kB; a server whose max_allowed_packet is 64 kB refused it, and the command changed
    nothing. (The setting is global, not one a test on a shared server may lower: the
    statements' sizes are what is checked.) The keys now go a chunk per statement, in one
    transaction, and every row is requeued."""
    async with store.transaction() as cur:
        await cur.execute(f"ALTER TABLE room_outbox AUTO_INCREMENT = {WIDE_KEY}")
    await insert_events(store, [envelope(f"e{n}") for n in range(4000)])
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'failed', retry_count = 3, last_error = 'gone'")
    sent = StatementLog().watch(store, monkeypatch)
    out = io.StringIO()
    assert await requeue_command(store, RequeueFilter(statuses=("failed",)), True, out) == 0
    assert out.getvalue().splitlines()[-1] == "requeued 4000 row(s)"
    assert max(sent.sizes) < 64 * 1024, max(sent.sizes)
    async with store.transaction() as cur:
        await cur.execute("SELECT status, retry_count, MIN(id), COUNT(*) FROM room_outbox GROUP BY 1, 2")
        assert await cur.fetchall() == (("pending", 0, WIDE_KEY, 4000),)


# -- migrate --sql --------------------------------------------------------------------------------


async def test_migrate_sql_prints_what_migrate_would_run_and_runs_nothing(
    database_dsn: str, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = await open_store(database_dsn)
    try:
        async with store.transaction() as cur:
            await cur.execute(V1_DDL)
        code, out, _ = await cli(capsys, "--config", config, "migrate", "--sql")
        assert code == 0
        assert "-- would add column room_outbox.lock_until_ms\nALTER TABLE room_outbox ADD COLUMN lock_until_ms" in out
        assert "-- would create table room_outbox_lane_cursor" in out  # the kafka sink's lane is enabled here
        assert "-- ran" not in out and "-- created" not in out and "-- added" not in out
        assert await store.migration_plan() != []  # nothing was run
        # The script is what migrate would run: run it, and migrate has nothing left to do.
        async with store.transaction() as cur:
            for statement in out.split(";\n"):
                sql = "\n".join(line for line in statement.splitlines() if not line.startswith("--")).strip()
                if sql:
                    await cur.execute(sql)
        assert await store.migration_plan() == []
        # No plugin's sink or handler is enabled here: none of their statements is left.
        code, out, _ = await cli(capsys, "--config", config, "migrate", "--sql")
        assert code == 0 and out.splitlines()[1:] == ["-- schema already up to date: no statement to run"]
        code, out, _ = await cli(capsys, "--config", config, "migrate")
        assert (code, out) == (0, "schema already up to date\n")
    finally:
        await store.aclose()


#: The tables of the example audit sink, the audit and activity handlers and the example gift_stats handler.
PLUGIN_TABLES = {"room_outbox_audit_log", "room_audit_log", "room_activity", "room_gift_totals"}


async def test_migrate_creates_tables_only_for_the_enabled_sinks_and_handlers(
    database_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every one of them is installed; only what the configuration enables gets its tables,
    and migrate names what it ran statements for (--sql: what it would run them for)."""
    config = tmp_path / "config.yaml"
    sinks = f"mysql:\n  dsn: '{database_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n"
    handlers = "    handlers: [audit, activity, gift_stats]\n"
    config.write_text(f"{sinks}  audit_table:\n    enabled: false\nconsumers:\n  feed:\n    enabled: false\n{handlers}")
    code, out, _ = await cli(capsys, "--config", str(config), "migrate")
    assert code == 0 and "schema statement" not in out, out
    store = await open_store(database_dsn)
    try:
        async with store.transaction() as cur:
            assert not PLUGIN_TABLES & await table_names(cur, store.dialect)
        config.write_text(f"{sinks}  audit_table:\n    enabled: true\nconsumers:\n  feed:\n{handlers}")
        code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql")
        assert code == 0 and "\n-- would run 1 schema statement(s) for sink audit_table\n" in out
        async with store.transaction() as cur:
            assert not PLUGIN_TABLES & await table_names(cur, store.dialect)  # --sql ran nothing
        code, out, _ = await cli(capsys, "--config", str(config), "migrate")
        assert code == 0 and {
            "ran 1 schema statement(s) for sink audit_table",
            "ran 1 schema statement(s) for handler audit",
            "ran 1 schema statement(s) for handler activity",
            "ran 1 schema statement(s) for handler gift_stats",
        } <= set(out.splitlines()), out
        async with store.transaction() as cur:
            assert await table_names(cur, store.dialect) >= PLUGIN_TABLES
    finally:
        await store.aclose()


def sql_statements(script: str) -> list[str]:
    """A script's statements, as psql splits them: at a ``;`` ending a line outside ``$$``."""
    statements, lines = [], []
    for line in script.splitlines():
        if line.startswith("--") and not lines:
            continue
        lines.append(line)
        if line.endswith(";") and "\n".join(lines).count("$$") % 2 == 0:
            statements.append("\n".join(lines))
            lines = []
    return [s for s in statements if s.strip()]


async def test_migrate_sql_on_postgresql_prints_the_bucket_function_and_index(
    postgresql_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The printed script, run statement by statement outside a transaction (as psql would),
    leaves migrate nothing to do (the consumers' and the enabled handlers' tables included);
    the bucket it computes is Python's."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"database:\n  dsn: '{postgresql_dsn}'\n"
        "sinks:\n  tencent_im:\n    enabled: false\n  kafka:\n    enabled: false\n"
        "consumers:\n  feed:\n    handlers: [audit, activity, gift_stats]\n"
    )
    code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql")
    assert code == 0
    assert "-- would create function room_outbox_crc32\nCREATE OR REPLACE FUNCTION room_outbox_crc32" in out
    bucket = "mod(room_outbox_crc32(app_code || ':' || room_id), 256)"
    assert (
        f"CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_room_outbox_claim ON room_outbox (status, lock_until_ms, id, ({bucket}))"
        in out
    )
    assert "-- would create table room_consumer_retry\nBEGIN;\nCREATE TABLE IF NOT EXISTS room_consumer_retry" in out
    assert "-- would run 2 schema statement(s) for handler audit\n" in out
    assert "CREATE TABLE IF NOT EXISTS room_audit_log" in out and "CREATE TABLE IF NOT EXISTS room_activity" in out
    async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True) as conn:
        for statement in sql_statements(out):
            await conn.execute(statement)
    store = await open_store(postgresql_dsn)
    try:
        assert await store.migration_plan() == []
        consumers = consumer_store(store)
        assert consumers is not None and await consumers.migration_plan() == []
        async with store.transaction() as cur:
            assert {"room_audit_log", "room_activity", "room_gift_totals"} <= await table_names(cur, store.dialect)
        await insert_events(store, [envelope("e1", room_id="房间-9")])
        async with store.transaction() as cur:
            await cur.execute(f"SELECT {bucket} FROM room_outbox")
            assert (await cur.fetchone())[0] == bucket_of("default", "房间-9")
    finally:
        await store.aclose()


async def test_migrate_sql_on_postgresql_sets_the_dsns_search_path_first(
    postgresql_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The DSN names ``search_path=app``: the script's statements name no schema, so it sets
    that search path before them; run as printed in a session of the default search path (a
    plain psql), it makes the tables in app and leaves migrate nothing to do. --json says it."""
    async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True) as conn:
        await conn.execute("CREATE SCHEMA app")
    dsn = f"{postgresql_dsn}?search_path=app"
    config = tmp_path / "config.yaml"
    config.write_text(f"database:\n  dsn: '{dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n")
    code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql")
    assert code == 0
    statements = sql_statements(out)
    assert statements[0] == "SET search_path = app;"
    code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql", "--json")
    assert code == 0 and json.loads(out)["search_path"] == ["app"]
    async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True) as conn:
        for statement in statements:
            await conn.execute(statement)
        cur = await conn.execute("SELECT DISTINCT schemaname FROM pg_tables WHERE tablename LIKE 'room_%'")
        assert await cur.fetchall() == [("app",)]
    store = await open_store(dsn)
    try:
        assert await store.migration_plan() == []
    finally:
        await store.aclose()


async def test_migrate_on_postgresql_creates_the_bucket_function_once(
    postgresql_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The outbox's and the lanes' room buckets both need the CRC-32 function: the plan creates
    it once, the script prints it once."""
    config = tmp_path / "config.yaml"
    config.write_text(f"database:\n  dsn: '{postgresql_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n")
    code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql")
    assert code == 0 and out.count("CREATE OR REPLACE FUNCTION room_outbox_crc32") == 1
    code, out, _ = await cli(capsys, "--config", str(config), "migrate")
    assert code == 0 and out.count("created function room_outbox_crc32") == 1


async def test_migrate_sql_on_sqlite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        f"mysql:\n  dsn: 'sqlite:///{tmp_path / 'outbox.db'}'\n"
        "sinks:\n  tencent_im:\n    enabled: false\n  kafka:\n    enabled: false\n"
    )
    code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql")
    assert code == 0
    assert "CREATE TABLE room_outbox (\n  id            INTEGER PRIMARY KEY AUTOINCREMENT" in out
    assert not (tmp_path / "outbox.db").exists()  # not even the file was created
    store = await open_store(f"sqlite:///{tmp_path / 'outbox.db'}")
    try:
        assert next(step.change for step in await store.migration_plan()) == "created table room_outbox"
    finally:
        await store.aclose()


def test_the_docs_document_every_exit_code() -> None:
    from room_outbox.errors import ConfigurationError, RoomOutboxError, SchemaError, StoreUnavailable

    page = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "errors.md").read_text()
    documented = {int(code) for code in re.findall(r"^\| (\d+) \| ", page, re.M)}
    assert documented == set(EXIT_CODES)
    for error in (RoomOutboxError, ConfigurationError, StoreUnavailable, SchemaError):
        assert error.exit_code in EXIT_CODES


# -- fake-im ----------------------------------------------------------------------------------------


def test_fake_im_on_a_busy_port_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        capsys.readouterr()
        code = main(["fake-im", "--port", str(port)])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == f"room-outbox fake-im: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_migrate_sql_wraps_a_step_migrate_runs_as_one_transaction_in_one() -> None:
    """PostgreSQL runs a step of several statements (a lane's hand-over to tailing: its parked
    rows moved, its cursor set, its table dropped) as one transaction: the script wraps it in
    one, so a DBA running it by hand gets all of it or none. Not a step of one statement, nor
    one outside any transaction (CONCURRENTLY), nor a batch repeated, nor on MySQL/MariaDB,
    whose schema changes each commit."""
    hand_over = Migration("moved lane kafka's cursor back to 7", ("INSERT INTO p SELECT 1", "UPDATE c SET x = 7;"))
    assert script_lines(hand_over, transactional_ddl=True) == [
        "-- would apply: moved lane kafka's cursor back to 7",
        "BEGIN;",
        "INSERT INTO p SELECT 1;",
        "UPDATE c SET x = 7;",
        "COMMIT;",
    ]
    assert "BEGIN;" not in script_lines(hand_over, transactional_ddl=False)
    for step in (
        Migration(
            "added index t.i", ("CREATE INDEX CONCURRENTLY i ON t (a)", "DROP INDEX CONCURRENTLY j"), autocommit=True
        ),
        Migration("set t.a to 0 where it was NULL", ("UPDATE t SET a = 0 WHERE a IS NULL LIMIT 10",), repeat=True),
        Migration("created table t", ("CREATE TABLE t (a INT)",)),
    ):
        assert "BEGIN;" not in script_lines(step, transactional_ddl=True)
