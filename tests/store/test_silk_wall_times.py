"""silk's table with its times as ``timestamp`` without time zone (what GORM makes of a
``time.Time`` on some set-ups), in a database whose time zone is Asia/Shanghai (as deployments in
China set it): wall times, which room-outbox reads and writes in the database's zone, the one its
producer's sessions write them in, whatever its own sessions' zone would have been."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import psycopg
import pytest
from support import pg_admin, wait_until

from room_outbox.cli.inspect import inspect_events
from room_outbox.cli.main import main
from room_outbox.errors import SchemaError
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.operator.reports import sample_backlog, status_report
from room_outbox.store.protocol import DeliveryResult, Outcome, SQLStore
from room_outbox.store.schema.outbox import SILK_TABLE_DDL
from room_outbox.store.schema.profiles import SILK

pytestmark = pytest.mark.anyio

ZONE = "Asia/Shanghai"
#: How far a time read back may be from the one expected (ms): the process's and the server's
#: clocks, a slow machine.
SLACK_MS = 5_000
#: A time as inspect shows it, in local time with how long ago.
HUMAN_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \((\d+ (s|min|h|d) ago|in \d+ (s|min|h|d))\)"


def silk_table(dsn: str, time_type: str = "TIMESTAMP") -> None:
    """silk's table with its times in ``time_type``, made in ``dsn``'s database."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        for statement in SILK_TABLE_DDL:
            conn.execute(statement.format(table="outbox_events").replace("TIMESTAMPTZ", time_type))  # type: ignore[arg-type]


def in_zone(dsn: str, zone: str) -> str:
    """``dsn``'s database, its time zone set to ``zone`` (ALTER DATABASE … SET timezone)."""
    pg_admin(f"ALTER DATABASE \"{dsn.rsplit('/', 1)[1]}\" SET timezone = '{zone}'")
    return dsn


@contextmanager
def producer(dsn: str) -> Iterator[psycopg.Connection]:
    """A session of the producer's, in the zone the database gives it (opened before a test sets
    PGTZ for the relay)."""
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5, options="-c statement_timeout=10000") as conn:
        assert conn.execute("SHOW timezone").fetchone() == (ZONE,)
        yield conn


def publish(conn: psycopg.Connection, event_id: str, age: str = "0 s") -> None:
    """silk's PublishTx: times from the producer session's now(), ``age`` ago."""
    conn.execute(
        "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id, payload, next_attempt_at,"
        " created_at, updated_at) VALUES (%s, 'wechat.subscribe', 'user', %s, '{}', now() - %s::interval,"
        " now() - %s::interval, now() - %s::interval)",
        (event_id, f"u-{event_id}", age, age, age),
    )


def next_attempt_ms(conn: psycopg.Connection, event_id: str) -> int:
    """The row's next attempt as the producer's session reads it (its wall time in its zone)."""
    row = conn.execute(
        "SELECT CAST(EXTRACT(EPOCH FROM next_attempt_at::timestamptz) * 1000 AS BIGINT) FROM outbox_events"
        " WHERE event_id = %s",
        (event_id,),
    ).fetchone()
    assert row is not None
    return int(row[0])


@asynccontextmanager
async def relay(dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(dsn, profile=SILK)
    try:
        await store.migrate()
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def shanghai_dsn(postgresql_dsn: str) -> str:
    """A database in Asia/Shanghai holding silk's table, its times timestamp without time zone."""
    silk_table(in_zone(postgresql_dsn, ZONE))
    return postgresql_dsn


async def test_wall_times_are_read_and_written_in_the_zone_the_producer_writes_them_in(
    shanghai_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Ages (status, the oldest-pending metric, the envelope's occurred_at), the wait inspect
    reports, claim_after and retries are right: EXTRACT(EPOCH …) alone read the producer's wall
    times as UTC, 8 h off (a 10-minute-old row 0 s old, a retry in 30 s "in 8 h")."""
    with producer(shanghai_dsn) as conn, caplog.at_level(logging.WARNING, logger="room_outbox.store"):
        async with relay(shanghai_dsn) as store:
            publish(conn, "old", "10 min")
            publish(conn, "young")
            ten_minutes_ago = now_ms() - 600_000
            assert abs((await sample_backlog(store)).oldest_pending_age_ms - 600_000) < SLACK_MS
            assert abs((await status_report(store)).oldest_pending_age_ms - 600_000) < SLACK_MS

            store.claim_after_ms = 60_000  # the young row is room-service's to push yet
            (old,) = (await store.claim("a#1", 10, now_ms() + 60_000)).rows
            assert old.event_id == "old"
            assert abs(json.loads(old.envelope)["occurred_at_ms"] - ten_minutes_ago) < SLACK_MS

            retry_at = now_ms() + 30_000
            await store.record([DeliveryResult(old.id, "old", "a#1", Outcome.FAILED, "timeout", retry_at)])
            assert abs(next_attempt_ms(conn, "old") - retry_at) < SLACK_MS  # the producer reads what was meant
            (doc,) = await inspect_events(store, "old")
            wait = re.fullmatch(r"waiting: failed 1 time\(s\), next attempt in (\d+) s", doc["state"])
            assert wait is not None and 30 - SLACK_MS // 1000 <= int(wait[1]) <= 30, doc["state"]
            assert (await store.claim("a#2", 10, now_ms() + 60_000)).rows == []  # neither early ...

            due_at = now_ms() + 1_000
            async with store.transaction() as cur:
                await cur.execute(
                    "UPDATE outbox_events SET next_attempt_at = to_timestamp(%s / 1000.0) WHERE event_id = 'old'",
                    (due_at,),
                )
            claimed: list[str] = []

            async def claims_it() -> bool:
                claimed.extend(row.event_id for row in (await store.claim("a#3", 10, now_ms() + 60_000)).rows)
                return bool(claimed)

            await wait_until(claims_it, timeout=10.0)  # ... nor 8 h late
            assert claimed == ["old"] and now_ms() >= due_at
    (warning,) = [r.getMessage() for r in caplog.records if "without time zone" in r.getMessage()]
    assert warning.startswith(
        "outbox_events.created_at, outbox_events.updated_at, outbox_events.next_attempt_at are timestamp without"
        " time zone: room-outbox reads and writes them as wall times in Asia/Shanghai, the database's time zone;"
    )
    assert "ALTER COLUMN created_at TYPE timestamptz USING created_at AT TIME ZONE 'Asia/Shanghai'" in warning


async def test_a_relay_whose_sessions_would_be_in_another_zone_takes_the_databases(
    shanghai_dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay's environment says PGTZ=UTC (as a container may), its producer writes in the
    database's zone: the relay's sessions take the database's zone, so the producer's rows are
    due when written (not 8 h later) and its retry times mean the same to the producer."""
    with producer(shanghai_dsn) as conn, caplog.at_level(logging.WARNING, logger="room_outbox.store"):
        monkeypatch.setenv("PGTZ", "UTC")
        async with relay(shanghai_dsn) as store:
            publish(conn, "due")
            (row,) = (await store.claim("a#1", 10, now_ms() + 60_000)).rows
            retry_at = now_ms() + 30_000
            await store.record([DeliveryResult(row.id, "due", "a#1", Outcome.FAILED, "timeout", retry_at)])
            assert abs(next_attempt_ms(conn, "due") - retry_at) < SLACK_MS
            publish(conn, "young")
            publish(conn, "old", "10 min")
            store.claim_after_ms = 60_000
            assert [r.event_id for r in (await store.claim("a#2", 10, now_ms() + 60_000)).rows] == ["old"]
            async with store.transaction() as cur:
                await cur.execute("SHOW timezone")
                assert await cur.fetchone() == (ZONE,)
    (warning,) = [r.getMessage() for r in caplog.records if "without time zone" in r.getMessage()]
    assert (
        "wall times in Asia/Shanghai, the database's time zone (this process's sessions, in UTC from the client"
        " (PGTZ or PGOPTIONS in this process's environment), are set to it)" in warning
    )


async def test_wall_times_in_a_database_that_names_no_zone_are_refused_where_the_session_has_its_own(
    postgresql_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database sets no zone and the relay's session has its own (PGTZ): the server's zone,
    the producer's, cannot be read there, so no command starts; the error names the fixes."""
    silk_table(postgresql_dsn)
    monkeypatch.setenv("PGTZ", "UTC")
    with pytest.raises(SchemaError) as refused:
        await open_store(postgresql_dsn, profile=SILK)
    database = postgresql_dsn.rsplit("/", 1)[1]
    assert str(refused.value).startswith(
        "outbox_events.created_at, outbox_events.updated_at, outbox_events.next_attempt_at are timestamp without"
        " time zone: wall times, which room-outbox takes in the zone the database gives its producers' sessions;"
        " the database names none, and this session's (UTC) comes from the client (PGTZ or PGOPTIONS in this"
        f" process's environment), which hides the server's: name the producers' zone (SHOW timezone in their"
        f" sessions) with ALTER DATABASE {database} SET timezone = '<that zone>', or make them timestamptz"
    )
    monkeypatch.delenv("PGTZ")
    store = await open_store(postgresql_dsn, profile=SILK)  # the server's own zone: taken
    await store.aclose()


async def test_timestamptz_sessions_keep_their_own_zone(
    postgresql_dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """timestamptz holds instants: nothing is set or said, whatever the zones."""
    silk_table(in_zone(postgresql_dsn, ZONE), "TIMESTAMPTZ")
    monkeypatch.setenv("PGTZ", "UTC")
    with caplog.at_level(logging.WARNING, logger="room_outbox.store"):
        async with relay(postgresql_dsn) as store, store.transaction() as cur:
            await cur.execute("SHOW timezone")
            assert await cur.fetchone() == ("UTC",)
    assert not [r for r in caplog.records if "time zone" in r.getMessage()]


async def test_inspect_shows_wall_times_as_instants_like_every_profiles_times(
    shanghai_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``inspect`` reads silk's times as the claim does, in the database's zone: in local time
    with how long ago, epoch ms in ``--json``, as the other profiles' ``*_ms`` columns (as
    stored they were the producer's wall times, hours off for a host in another zone, with no
    age and, in ``--json``, no epoch ms); a row younger than the configuration's claim_after
    is said to wait for it, as the claim does, not to be due."""
    with producer(shanghai_dsn) as conn:
        async with relay(shanghai_dsn):  # migrated
            pass
        publish(conn, "old", "10 min")
        conn.execute("UPDATE outbox_events SET next_attempt_at = now() + interval '30 minutes' WHERE event_id = 'old'")
        publish(conn, "young")
    config = tmp_path / "config.yaml"
    config.write_text(f"database:\n  dsn: '{shanghai_dsn}'\n  profile: silk\noutbox_worker:\n  claim_after: 60s\n")
    capsys.readouterr()
    assert await anyio.to_thread.run_sync(main, ["--config", str(config), "inspect", "old"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert lines["created_at"].endswith(" (10 min ago)") and lines["updated_at"].endswith(" (10 min ago)")
    assert re.search(r" \(in (29|30) min\)$", lines["next_attempt_at"]), lines["next_attempt_at"]
    assert await anyio.to_thread.run_sync(main, ["--config", str(config), "inspect", "old", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["row"]
    assert abs(row["created_at"] - (now_ms() - 600_000)) < SLACK_MS
    assert abs(row["next_attempt_at"] - (now_ms() + 1_800_000)) < SLACK_MS
    monkeypatch.delenv("ROOM_OUTBOX__OUTBOX_WORKER__CLAIM_AFTER")  # the configuration's, then
    assert await anyio.to_thread.run_sync(main, ["--config", str(config), "inspect", "young"]) == 0
    (state,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("state:")]
    young = r"state: young: left to the producer's own push until 1 min old \(outbox_worker.claim_after\);"
    assert re.fullmatch(rf"{young} claimable from {HUMAN_TIME}", state) and re.search(r"\(in (5\d s|1 min)\)$", state)
    async with relay(shanghai_dsn) as store:
        store.claim_after_ms = 60_000
        assert (await store.claim("a#1", 10, now_ms() + 60_000)).rows == []  # as said
