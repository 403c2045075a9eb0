"""One clock for the cluster: the process reads the database server's clock (offset measured
with the round trip halved) and runs on its monotonic clock in between; a host beyond
``cluster.max_clock_skew`` is logged once, shown by ``/readyz`` and the offset gauge."""

from __future__ import annotations

import datetime
import logging
import shutil
import subprocess
import time
import zoneinfo

import pytest
from support import mysql_global
from telemetry_support import capture

from room_outbox.config import Settings
from room_outbox.observability.health import CLOCK_SKEWED, Health
from room_outbox.store.clock import CLOCK, ClusterClock
from room_outbox.store.dialect import MYSQL
from room_outbox.store.factory import open_store

pytestmark = pytest.mark.anyio


class Clocks:
    """A host's wall and monotonic clocks, moved by hand."""

    def __init__(self, wall: float, monotonic: float = 1000.0) -> None:
        self.wall, self.monotonic = wall, monotonic

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.monotonic += seconds

    def clock(self, max_skew: float = 2.0) -> ClusterClock:
        clock = ClusterClock(wall=lambda: self.wall, monotonic=lambda: self.monotonic)
        clock.max_skew = max_skew
        return clock


def test_the_clock_is_the_hosts_until_measured_then_the_servers() -> None:
    host = Clocks(wall=1_000_000.0)
    clock = host.clock()
    assert clock.now_ms() == 1_000_000_000
    clock.observe(server_ms=999_990_000, monotonic_at=host.monotonic, wall_at=host.wall)  # host 10 s ahead
    assert clock.offset == pytest.approx(10.0) and clock.now_ms() == 999_990_000
    host.advance(2.5)
    assert clock.now_ms() == 999_992_500


def test_a_step_of_the_hosts_wall_clock_does_not_move_the_cluster_time() -> None:
    host = Clocks(wall=1_000_000.0)
    clock = host.clock()
    clock.observe(server_ms=1_000_000_000, monotonic_at=host.monotonic, wall_at=host.wall)
    host.wall += 3600  # a wall clock set an hour ahead between two measurements
    assert clock.now_ms() == 1_000_000_000


class SteppingCursor:
    """A cursor reading the server's time as ``server_ms`` while the host's wall clock is
    stepped (and 40 ms pass) in the middle of the round trip."""

    def __init__(self, host: Clocks, server_ms: int, step: float) -> None:
        self.host, self.server_ms, self.step = host, server_ms, step

    async def execute(self, statement: str) -> None:
        self.host.advance(0.02)
        self.host.wall += self.step

    async def fetchone(self) -> tuple[int]:
        self.host.advance(0.02)
        return (self.server_ms,)


async def test_a_step_of_the_hosts_clock_during_a_measurement_is_named_whole() -> None:
    """The offset is the host's clock after the step, not the mean of the readings around it
    (which named half the step in the one warning logged)."""
    host = Clocks(wall=1_000_000.0)
    clock = host.clock()
    await clock.measure(SteppingCursor(host, server_ms=1_000_000_020, step=3600.0), MYSQL)
    assert clock.offset == pytest.approx(3600.0, abs=0.001)
    assert clock.now_ms() == 1_000_000_040  # the server's time, 20 ms on


def test_a_skew_beyond_the_bound_logs_one_warning_naming_the_offset(caplog: pytest.LogCaptureFixture) -> None:
    host = Clocks(wall=1_000_000.0)
    clock = host.clock(max_skew=2.0)
    with caplog.at_level(logging.WARNING, logger="room_outbox.cluster"):
        clock.observe(1_000_000_000 - 1_500, host.monotonic, host.wall)  # 1.5 s: within the bound
        assert not clock.skewed and not caplog.records
        for _ in range(3):  # 10 s behind the host, at three heartbeats: one line
            clock.observe(1_000_000_000 - 10_000, host.monotonic, host.wall)
        assert clock.skewed
        assert [r.getMessage() for r in caplog.records] == [
            "this host's clock is +10.0s off the database's (cluster.max_clock_skew 2s);"
            " room-outbox keeps to the database's clock"
        ]
        clock.observe(1_000_000_000, host.monotonic, host.wall)  # back within the bound
        clock.observe(1_000_000_000 + 7_000, host.monotonic, host.wall)  # then 7 s behind it
    assert [getattr(r, "clock_offset", None) for r in caplog.records] == [10.0, -7.0]


def test_readyz_shows_a_skewed_clock_with_a_fixed_cause_and_stays_ready() -> None:
    host = Clocks(wall=1_000_000.0)
    clock = host.clock(max_skew=2.0)
    health = Health(clock=clock)
    health.worker = "running"
    health.lane("main").round_ended()  # a successful round: the database answered
    clock.observe(1_000_000_000 - 1_000, host.monotonic, host.wall)
    assert health.readiness() == (True, {"worker": "running", "database": "ok", "clock": "ok"})
    clock.observe(1_000_000_000 + 120_000, host.monotonic, host.wall)  # two minutes behind
    assert health.readiness() == (True, {"worker": "running", "database": "ok", "clock": CLOCK_SKEWED})


def test_the_offset_gauge_carries_the_last_measured_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    captured = capture()
    monkeypatch.setattr(CLOCK, "offset", -12.5)
    assert captured.value("room_outbox.clock.offset") == -12.5
    monkeypatch.setattr(CLOCK, "offset", 0.25)
    assert captured.value("room_outbox.clock.offset") == 0.25


def test_max_clock_skew_is_a_positive_duration() -> None:
    assert Settings().cluster.max_clock_skew == 2.0
    assert Settings.model_validate({"cluster": {"max_clock_skew": "30s"}}).cluster.max_clock_skew == 30.0
    with pytest.raises(ValueError, match="max_clock_skew must be a positive duration"):
        Settings.model_validate({"cluster": {"max_clock_skew": "0s"}})


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
async def test_the_offset_is_measured_against_the_real_server(
    server: str, database_dsn: str, postgresql_dsn: str
) -> None:
    """The server runs on this host: a host clock 10 s ahead of it reads as +10 s, and the
    cluster's time is still the server's."""
    store = await open_store(database_dsn if server == "mysql" else postgresql_dsn)
    try:
        clock = ClusterClock(wall=lambda: time.time() + 10)
        async with store.transaction() as cur:
            await clock.measure(cur, store.dialect)
        assert clock.offset == pytest.approx(10.0, abs=0.5)
        assert clock.now_ms() / 1000 == pytest.approx(time.time(), abs=0.5)
        assert abs(CLOCK.offset) < 0.5  # measured by open_store, against the real host clock
    finally:
        await store.aclose()


def load_time_zone(dsn: str, name: str) -> None:
    """Load the zone ``name`` from this host's tz database into ``dsn``'s server, unless it
    knows it already (MariaDB and MySQL know named zones only once their tables are loaded)."""
    import pymysql
    from pymysql.constants import CLIENT

    from room_outbox.store.backends.mysql import MySQLAddress

    tool = shutil.which("mariadb-tzinfo-to-sql") or shutil.which("mysql_tzinfo_to_sql")
    assert tool, "this test needs mariadb-tzinfo-to-sql or mysql_tzinfo_to_sql (the MariaDB/MySQL server package)"
    sql = subprocess.run(
        [tool, f"/usr/share/zoneinfo/{name}", name], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    address = MySQLAddress.from_dsn(dsn)
    conn = pymysql.connect(
        host=address.host, port=address.port, user=address.user, password=address.password,
        database="mysql", connect_timeout=5, client_flag=CLIENT.MULTI_STATEMENTS,
    )  # fmt: skip
    try:
        with conn.cursor() as cur:
            if cur.execute("SELECT 1 FROM time_zone_name WHERE Name = %s", (name,)):
                return
            cur.execute(sql)
            while cur.nextset():
                pass
        conn.commit()
    finally:
        conn.close()


@pytest.mark.serial  # the server's default time zone changes for every session opened meanwhile
async def test_the_mysql_clock_reads_true_time_in_the_hour_repeated_when_daylight_saving_ends(
    database_dsn: str,
) -> None:
    """A server in local time with daylight saving time: when the clocks go back, the local hour
    02:00–03:00 comes twice. The second time, the database's clock still reads the true time,
    not an hour early (which would hold every lease, retry and ``claim_after`` an hour more)."""
    berlin = zoneinfo.ZoneInfo("Europe/Berlin")
    second_pass = datetime.datetime(2026, 10, 25, 2, 30, tzinfo=berlin, fold=1).timestamp()
    load_time_zone(database_dsn, "Europe/Berlin")
    with mysql_global(database_dsn, "time_zone", lambda _before: "Europe/Berlin"):
        store = await open_store(database_dsn)
        try:
            async with store.transaction() as cur:
                await cur.execute(f"SET timestamp = {second_pass:.0f}")  # the server's NOW() from here
                await cur.execute(f"SELECT {store.dialect.now_ms}")
                (server_ms,) = await cur.fetchone()
                await cur.execute("SET timestamp = DEFAULT")
        finally:
            await store.aclose()
    assert server_ms == second_pass * 1000
