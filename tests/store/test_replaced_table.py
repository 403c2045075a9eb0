"""room_outbox swapped for a copy by gh-ost or pt-online-schema-change (``CREATE TABLE … LIKE``,
then ``RENAME TABLE``), built without room-outbox's indexes or from room-service's own schema
file (without room-outbox's columns): refused at start with the fix, and, under a running
store, each failing round names the fix instead of the database's bare words."""

from __future__ import annotations

import json
import logging
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pymysql
import pytest
from support import RecordingSink, envelope, fetch_rows, free_port, insert_events, make_dispatcher, running, wait_until

from room_outbox.app import run_service
from room_outbox.cli.main import main
from room_outbox.cluster.identity import longest_claim_id
from room_outbox.config import Settings
from room_outbox.errors import SchemaError
from room_outbox.observability import health as health_module
from room_outbox.observability import service as service_module
from room_outbox.observability.health import Health
from room_outbox.store.backends.errors import named_fix
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.dialect import MYSQL
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.check import check_indexes, check_schema
from room_outbox.store.schema.outbox import SILK_TABLE_DDL, V1_TABLE_DDL, built_indexes, concurrent_step
from room_outbox.store.schema.partitions import Partition, index_statements
from room_outbox.store.schema.profiles import SILK, V1

pytestmark = pytest.mark.anyio

MIGRATE = "run `room-outbox migrate`"
#: The columns room-service's own table has, which a swap copies.
V1_COLUMNS = "id, app_code, event_id, event_type, room_id, envelope, status, retry_count, created_at_ms, updated_at_ms"


@pytest.fixture(params=["mysql", "postgresql"])
async def server_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """A migrated store on MariaDB and on PostgreSQL."""
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    store = await open_store(dsn)
    await store.migrate()
    try:
        yield store
    finally:
        await store.aclose()


async def swap(store: SQLStore, shadow: str, keep_names: bool = False) -> None:
    """Build ``_room_outbox_gho`` (``like``: as room_outbox, without room-outbox's two indexes;
    ``v1``: from room-service's own CREATE TABLE), copy the rows over, swap it in atomically.
    ``keep_names`` (PostgreSQL): the old table keeps its indexes' names, as a hand-made swap does."""
    mysql = store.dialect.name == "mysql"
    async with store.transaction() as cur:
        if shadow == "v1":
            await cur.execute(V1_TABLE_DDL[store.dialect.name][0].format(table="_room_outbox_gho"))
            columns = V1_COLUMNS
        elif mysql:
            await cur.execute("CREATE TABLE _room_outbox_gho LIKE room_outbox")
            await cur.execute(
                "ALTER TABLE _room_outbox_gho DROP INDEX idx_room_outbox_claim, DROP INDEX idx_room_outbox_room"
            )
            columns = f"{V1_COLUMNS}, worker_id, lock_until_ms"
        else:  # LIKE without INCLUDING INDEXES: the columns and their defaults, no index
            await cur.execute("CREATE TABLE _room_outbox_gho (LIKE room_outbox INCLUDING DEFAULTS)")
            columns = f"{V1_COLUMNS}, worker_id, lock_until_ms"
        await cur.execute(f"INSERT INTO _room_outbox_gho ({columns}) SELECT {columns} FROM room_outbox")
        if mysql:
            await cur.execute("RENAME TABLE room_outbox TO _room_outbox_del, _room_outbox_gho TO room_outbox")
        else:  # index names are the schema's: the old table's give theirs up, as PostgreSQL's swap tools do
            await cur.execute("ALTER TABLE room_outbox RENAME TO _room_outbox_del")
            await cur.execute("ALTER TABLE _room_outbox_gho RENAME TO room_outbox")
            for index in () if keep_names else ("idx_room_outbox_claim", "idx_room_outbox_room"):
                await cur.execute(f"ALTER INDEX {index} RENAME TO _del_{index}")


async def test_start_refuses_a_table_swapped_for_one_without_room_outboxs_indexes(server_store: SQLStore) -> None:
    store = server_store
    await swap(store, "like")
    with pytest.raises(SchemaError) as refused:
        await check_schema(store, (), longest_claim_id("node-1"))
    assert str(refused.value) == (
        f"table room_outbox lacks the indexes idx_room_outbox_claim, idx_room_outbox_room: {MIGRATE}"
    )
    await store.migrate()  # builds them online
    await check_schema(store, (), longest_claim_id("node-1"))


async def test_a_claim_on_a_table_swapped_for_room_services_own_definition_names_the_fix(
    server_store: SQLStore,
) -> None:
    store = server_store
    await insert_events(store, [envelope("e1")])  # type: ignore[arg-type]
    assert len((await store.claim("c1", 10, 10**13)).rows) == 1  # its connections are open
    await swap(store, "v1")
    with pytest.raises(SchemaError) as failed:
        await store.claim("c2", 10, 10**13)
    mysql = store.dialect.name == "mysql"
    said = "Unknown column 'lock_until_ms' in 'WHERE'" if mysql else 'column "lock_until_ms" does not exist'
    assert str(failed.value) == (
        f"{said}: room_outbox lacks the column lock_until_ms (the table was replaced?): {MIGRATE}"
    )


async def test_an_unknown_column_of_no_table_of_room_outboxs_is_left_as_it_is(server_store: SQLStore) -> None:
    """A handler's own statement, say: the database's error, not room-outbox's fix."""
    with pytest.raises(Exception) as failed:
        async with server_store.transaction() as cur:
            await cur.execute("SELECT no_such_column FROM room_outbox")
    assert not isinstance(failed.value, SchemaError)


async def test_rounds_on_a_table_swapped_without_the_claim_index_name_the_fix_until_migrate_builds_it(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """MySQL/MariaDB refuse a statement forcing an index the table lacks: the claim forces the
    claim index once it waits for ``claim_after``. Each round fails; the failure is logged
    once, naming the fix; migrate, run beside the running process, ends it."""
    store.claim_after_ms = 1  # the claim index forced
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, poll_interval=0.05)
    health = Health(worker="running", unready_after_failed_rounds=3)
    dispatcher.health = health.lane("main")
    async with running(dispatcher):
        await wait_until(lambda: dispatcher.health.succeeded_at is not None)
        await swap(store, "like")
        await insert_events(store, [envelope("e1")])  # type: ignore[arg-type]
        await wait_until(lambda: dispatcher.health.failed_in_a_row >= 3)
        fix = (
            "SchemaError: Key 'idx_room_outbox_claim' doesn't exist in table 'room_outbox': room_outbox lacks"
            f" the index idx_room_outbox_claim (the table was replaced?): {MIGRATE}"
        )
        assert dispatcher.health.last_error == fix
        # /readyz says it too, not only that rounds fail
        ready, checks = health.readiness()
        assert not ready and re.fullmatch(
            r"\d+ rounds failed in a row, the last: " + re.escape(fix), checks["lane main"]
        )
        await store.migrate()

        async def published() -> bool:
            return (await fetch_rows(store))["e1"]["status"] == "published"

        await wait_until(published)
    assert sink.received == ["e1"]
    failed = [r for r in caplog.records if r.message.startswith("outbox round failed")]
    # The swap itself may fail a claim first (a deadlock with the RENAME): the fix follows at once.
    assert [(r.levelno, r.error) for r in failed][-1:] == [(logging.ERROR, fix)]  # type: ignore[attr-defined]
    assert all(r.error.startswith("OperationalError: (1213,") for r in failed[:-1]), failed  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("error", "fix"),
    [
        (
            pymysql.err.OperationalError(1054, "Unknown column 'o.worker_id' in 'field list'"),
            "Unknown column 'o.worker_id' in 'field list': room_outbox lacks the column worker_id",
        ),
        (
            sqlite3.OperationalError("no such column: lock_until_ms"),
            "no such column: lock_until_ms: room_outbox lacks the column lock_until_ms",
        ),
        # not room-outbox's: an index of another table, a column room-outbox never names
        (pymysql.err.OperationalError(1176, "Key 'idx_room_outbox_claim' doesn't exist in table 'other'"), None),
        (pymysql.err.OperationalError(1054, "Unknown column 'nickname' in 'field list'"), None),
    ],
)
def test_which_errors_name_the_fix(error: Exception, fix: str | None) -> None:
    with pytest.raises(Exception) as raised, named_fix(MYSQL, V1):
        raise error
    if fix is None:
        assert raised.value is error
    else:
        assert str(raised.value) == f"{fix} (the table was replaced?): {MIGRATE}"
        assert raised.value.__cause__ is error


# -- PostgreSQL: index names are the schema's ---------------------------------------------------


def taken(index: str, holder: str, renamed: str) -> str:
    return (
        f"the name {index} is taken by an index of table {holder} (PostgreSQL names indexes per schema, and a"
        f" table swapped out keeps its indexes' names): rename that index (ALTER INDEX {index} RENAME TO"
        f" {renamed}) or drop it, then run {MIGRATE.removeprefix('run ')}"
    )


async def indexes_of_the_schema(store: SQLStore) -> list[tuple[object, ...]]:
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT indexname, tablename, indexdef FROM pg_indexes WHERE schemaname = current_schema() ORDER BY 1"
        )
        return list(await cur.fetchall())


async def test_migrate_refuses_to_build_an_index_whose_name_the_swapped_out_table_still_holds(
    postgresql_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old table keeps idx_room_outbox_claim and idx_room_outbox_room: ``CREATE INDEX
    CONCURRENTLY IF NOT EXISTS`` on the new one did nothing, migrate said it added them, and
    ``run`` refused to start for want of them. Now migrate (and ``--sql``) refuses before any
    change, naming the table that holds each name and the fix; the start-up check says the
    same; once the operator renamed them, migrate builds them."""
    store = await open_store(postgresql_dsn)
    try:
        await store.migrate()
        await swap(store, "like", keep_names=True)
        before = await indexes_of_the_schema(store)
        refused = [
            "cannot build index idx_room_outbox_room on table room_outbox: "
            + taken("idx_room_outbox_room", "_room_outbox_del", "idx__room_outbox_del_room"),
            "cannot build index idx_room_outbox_claim on table room_outbox: "
            + taken("idx_room_outbox_claim", "_room_outbox_del", "idx__room_outbox_del_claim"),
        ]
        for plan_or_run in (store.migration_plan, store.migrate):
            with pytest.raises(SchemaError) as raised:
                await plan_or_run()
            assert str(raised.value).splitlines() == refused
        config = tmp_path / "config.yaml"
        config.write_text(f"database:\n  dsn: '{postgresql_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n")
        for argv in (["migrate", "--sql"], ["migrate"]):
            capsys.readouterr()
            code = await anyio.to_thread.run_sync(main, ["--config", str(config), *argv])
            assert (code, capsys.readouterr().err.splitlines()) == (3, [f"room-outbox: {line}" for line in refused])
        assert await indexes_of_the_schema(store) == before  # nothing changed
        with pytest.raises(SchemaError) as at_start:
            await check_schema(store, (), longest_claim_id("node-1"))
        assert str(at_start.value).splitlines() == [
            "table room_outbox lacks the index idx_room_outbox_claim: "
            + taken("idx_room_outbox_claim", "_room_outbox_del", "idx__room_outbox_del_claim"),
            "table room_outbox lacks the index idx_room_outbox_room: "
            + taken("idx_room_outbox_room", "_room_outbox_del", "idx__room_outbox_del_room"),
        ]
        async with store.transaction() as cur:  # the fix the message gives
            await cur.execute("ALTER INDEX idx_room_outbox_claim RENAME TO idx__room_outbox_del_claim")
            await cur.execute("ALTER INDEX idx_room_outbox_room RENAME TO idx__room_outbox_del_room")
        assert await store.migrate() == [
            "added index room_outbox.idx_room_outbox_room",
            "added index room_outbox.idx_room_outbox_claim",
        ]
        await check_schema(store, (), longest_claim_id("node-1"))
    finally:
        await store.aclose()


async def test_silks_partial_backfill_index_held_by_another_table_is_refused_before_any_change(
    postgresql_dsn: str,
) -> None:
    """The backfill's partial index (``WHERE outbox_seq IS NULL``), left on silk's table
    before it was swapped out: adding the key would number no row through it."""
    store = await open_store(postgresql_dsn, profile=SILK)
    try:
        async with store.transaction() as cur:
            for statement in SILK_TABLE_DDL:
                await cur.execute(statement.format(table="outbox_events"))
                await cur.execute(statement.format(table="outbox_events_old").replace("uk_outbox_events_old", "uk_old"))
            await cur.execute(
                "CREATE INDEX idx_outbox_events_outbox_seq_backfill ON outbox_events_old (created_at, id)"
                " WHERE status = 'pending'"
            )
        before = await indexes_of_the_schema(store)
        with pytest.raises(SchemaError) as raised:
            await store.migrate()
        assert str(raised.value) == (
            "cannot build index idx_outbox_events_outbox_seq_backfill on table outbox_events: "
            + taken(
                "idx_outbox_events_outbox_seq_backfill",
                "outbox_events_old",
                "idx_outbox_events_old_outbox_seq_backfill",
            )
        )
        assert await indexes_of_the_schema(store) == before
        async with store.transaction() as cur:
            await cur.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'outbox_events'")
            assert "outbox_seq" not in {row[0] for row in await cur.fetchall()}  # no step ran
    finally:
        await store.aclose()


def test_the_indexes_a_plan_builds_are_read_from_its_statements_as_postgresql_names_them() -> None:
    partitions = [
        Partition("Room_Outbox_Next", "room_outbox", False),
        Partition("room_outbox_a", "Room_Outbox_Next", True),
    ]
    plan = [
        concurrent_step(
            "added index", index_statements("room_outbox", "idx_room_outbox_room", "(room_id)", partitions)
        ),
        concurrent_step("added index", ("CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS UK_X ON T (a)",)),
        concurrent_step("a handler's", ("CREATE INDEX IF NOT EXISTS idx_y ON other_schema.t (a)",)),
    ]
    assert built_indexes(plan) == [
        ("idx_room_outbox_room", "room_outbox"),
        ("idx_Room_Outbox_Next_room", "Room_Outbox_Next"),
        ("idx_room_outbox_a_room", "room_outbox_a"),
        ("uk_x", "t"),
    ]


# -- the operator's reports say what run would refuse -----------------------------------------


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
async def test_status_and_lanes_say_that_run_cannot_start_for_a_missing_index(
    server: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the indexes missing, ``status`` showed a normal-looking report (exit 0) while no
    ``run`` could start. The report is still shown; start-up's line follows on stderr, exit 3."""
    dsn = request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn")
    config = tmp_path / "config.yaml"
    config.write_text(f"database:\n  dsn: '{dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n")

    async def cli(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await anyio.to_thread.run_sync(main, ["--config", str(config), *argv])  # its own event loop
        out, err = capsys.readouterr()
        return code, out, err

    store = await open_store(dsn)
    try:
        await store.migrate()
        await insert_events(store, [envelope("e1")])  # type: ignore[arg-type]
        await swap(store, "like")
    finally:
        await store.aclose()
    refused = (
        "room-outbox: `run` would refuse to start: table room_outbox lacks the indexes"
        f" idx_room_outbox_claim, idx_room_outbox_room: {MIGRATE}\n"
    )
    code, out, err = await cli("status")
    assert (code, err) == (3, refused)
    assert out.startswith("pending               1\n")  # the report, as it reads
    code, out, err = await cli("status", "--json")
    assert (code, err, json.loads(out)["pending"]) == (3, refused, 1)
    code, out, err = await cli("lanes")
    assert (code, err) == (3, refused)
    assert out.splitlines()[1].split()[:2] == ["main", "-"]
    assert (await cli("migrate"))[0] == 0
    for argv in (["status"], ["lanes"]):
        code, _, err = await cli(*argv)
        assert (code, err) == (0, "")


# -- a running process notices a swap that fails no statement ------------------------------------


@pytest.mark.parametrize(
    ("server", "claim_after", "rounds_say_it"),
    [("postgresql", "5s", False), ("mysql", "0s", False), ("mysql", "5s", True)],
)
async def test_a_running_process_notices_a_swap_without_the_indexes_until_migrate_builds_them(
    server: str,
    claim_after: str,
    rounds_say_it: bool,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PostgreSQL fails no claim on a table swapped for a copy without room-outbox's indexes,
    nor MariaDB one that forces no index (``claim_after`` 0, ordering ``none``): every claim
    read the whole table and ``/readyz`` stayed ready, with nothing in the log. The schema
    watch now says it (one ERROR line naming the indexes and the fix, ``/readyz`` unready with
    the same words, the gauge ``room_outbox_schema_problems`` an alert reads at 1: 0 before)
    until ``migrate`` builds them. Where the claim forces its index (MariaDB, ``claim_after``
    above 0) the rounds fail too, their own errors naming the fix."""
    dsn = request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn")
    monkeypatch.setattr(health_module, "SCHEMA_CHECK_INTERVAL", 0.05)
    monkeypatch.setenv("ROOM_OUTBOX__OUTBOX_WORKER__CLAIM_AFTER", claim_after)  # above 0: the claim forces its index
    checks = 0

    async def counted(store: SQLStore) -> None:
        nonlocal checks
        checks += 1
        await check_indexes(store)

    monkeypatch.setattr(service_module, "check_indexes", counted)
    port = free_port()
    settings = Settings(
        database={"dsn": dsn},
        node_id="watch-test",
        outbox_worker={"poll_interval": "50ms"},
        sinks={"tencent_im": {"enabled": False}, "noop": {"enabled": True}},
        telemetry={"http_listen": f"127.0.0.1:{port}"},
    )
    store = await open_store(dsn)
    stop = anyio.Event()
    try:
        await store.migrate()
        async with (
            anyio.create_task_group() as tasks,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http,
        ):
            tasks.start_soon(lambda: run_service(settings, stop, False))

            async def readiness() -> dict[str, object]:
                try:
                    return dict((await http.get("/readyz")).json())
                except httpx.TransportError:
                    return {}

            async def ready() -> bool:
                return (await readiness()).get("ready") is True

            async def schema_problems() -> str:
                found = re.search(r"^room_outbox_schema_problems (\S+)$", (await http.get("/metrics")).text, re.M)
                return found[1] if found else "(none)"

            await wait_until(ready, timeout=30)
            assert await schema_problems() == "0.0"
            await swap(store, "like")
            await insert_events(store, [envelope("e1")])  # type: ignore[arg-type]

            async def unready() -> bool:
                return (await readiness()).get("ready") is False

            await wait_until(unready)
            seen = checks
            await wait_until(lambda: checks >= seen + 3)  # the watch has looked again since
            body = await readiness()
            missing = f"table room_outbox lacks the indexes idx_room_outbox_claim, idx_room_outbox_room: {MIGRATE}"
            watch_lines = [r for r in caplog.records if r.name == "room_outbox.health"]
            round_lines = [r for r in caplog.records if r.message.startswith("outbox round failed")]
            assert body["schema"] == missing
            assert [(r.levelno, r.getMessage()) for r in watch_lines] == [
                (logging.ERROR, f"schema check failed: {missing}")
            ]
            if rounds_say_it:
                assert "lacks the index idx_room_outbox_claim" in str(body["lane main"])
                assert len(round_lines) == 1
            else:
                assert round_lines == []
            assert (await http.get("/readyz")).status_code == 503
            assert await schema_problems() == "1.0"
            await store.migrate()
            await wait_until(ready)
            assert "schema" not in await readiness()
            assert await schema_problems() == "0.0"
            stop.set()
    finally:
        await store.aclose()
    watch_lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "room_outbox.health"]
    assert watch_lines[1:] == [
        (logging.WARNING, "schema check passes again: the outbox table has room-outbox's indexes")
    ]
