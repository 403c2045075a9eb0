"""Processes that share a ``node_id`` (a copied configuration, a fixed pod name, a restart
after kill -9) are told apart by an identity drawn at each start, with real processes: the
fake Tencent IM as its own process, MariaDB as the database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from faults.test_cluster import all_published, cluster_config, joined, messages_received
from processes import DispatcherProcess, FakeIMProcess
from support import envelope, insert_events, wait_until

from room_outbox.cli.main import main
from room_outbox.cluster.identity import MAX_NODE_ID_LENGTH, node_id_of, process_identity
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def fake_im(tmp_path: Path):  # type: ignore[no-untyped-def]
    fake = FakeIMProcess(tmp_path)
    yield fake
    fake.close()


NAMESAKE = "another running process has this node_id; both run as separate members sharing the quota:"


def test_every_start_draws_its_own_identity_from_the_node_id() -> None:
    identities = {process_identity("pod-0") for _ in range(100)}
    assert len(identities) == 100
    assert {node_id_of(i) for i in identities} == {"pod-0"}
    assert node_id_of("host~with~tildes~0123abcd") == "host~with~tildes"
    assert node_id_of("plain") == "plain" and node_id_of("a~notatoken") == "a~notatoken"


def test_check_config_refuses_a_node_id_its_identity_would_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    quiet = "sinks:\n  tencent_im:\n    enabled: false\n  noop:\n    enabled: true\n"
    path.write_text(f"database:\n  dsn: 'sqlite:///x.db'\n{quiet}node_id: '{'n' * MAX_NODE_ID_LENGTH}'\n")
    assert main(["--config", str(path), "check-config"]) == 0
    path.write_text(f"database:\n  dsn: 'sqlite:///x.db'\n{quiet}node_id: '{'n' * (MAX_NODE_ID_LENGTH + 1)}'\n")
    capsys.readouterr()
    assert main(["--config", str(path), "check-config"]) == 2
    assert "  node_id: 101 characters; at most 100 (the process identity and claim ids" in capsys.readouterr().err


def process(tmp_path: Path, folder: str, dsn: str, fake: FakeIMProcess, im: dict[str, Any], node_id: str) -> Any:
    """A ``run`` process with its own folder (its log file) and the given ``node_id``."""
    (tmp_path / folder).mkdir()
    config = cluster_config(tmp_path / folder / "c.yaml", dsn, fake, im, batch_size=100, concurrency=32)
    return DispatcherProcess(config, node_id)


def identity(proc: DispatcherProcess) -> str:
    (line,) = [line for line in proc.lines() if line.get("lifecycle") == "membership_joined"]
    return str(line["identity"])


def warned_about(proc: DispatcherProcess) -> list[str]:
    return [line["other"] for line in proc.lines() if str(line.get("msg", "")).startswith(NAMESAKE)]


@pytest.mark.serial
async def test_two_processes_with_one_node_id_share_the_quota_as_two_members(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    """A fake IM enforcing 200/s per app: no request over quota, every event sent once, and
    each process warns that the other runs with its node_id."""
    app_limit, group_limit, events, rooms = 200, 40, 1500, 20
    fake_im.set_faults(app_qps_limit=app_limit, group_qps_limit=group_limit)
    im = {"app_rate_limit": app_limit, "group_rate_limit": group_limit, "reserved_share": 0,
          "rate_limit_max_wait": "2s"}  # fmt: skip
    procs = [process(tmp_path, folder, database_dsn, fake_im, im, "copied-config") for folder in ("a", "b")]
    try:
        await wait_until(lambda: all(joined(p) for p in procs), timeout=60)
        await insert_events(store, [envelope(f"q{i:05}", room_id=f"r_{i % rooms}") for i in range(events)])
        await wait_until(lambda: all_published(store, events), timeout=120, interval=0.25)
        await wait_until(lambda: all(warned_about(p) for p in procs), timeout=10)
    finally:
        for proc in procs:
            if proc.alive():
                proc.kill()
    stats = fake_im.stats()
    assert stats["over_quota"] == {"app": 0, "group": 0}, stats
    assert messages_received(fake_im) == events  # nothing sent twice: claims never collided
    first, second = identity(procs[0]), identity(procs[1])
    assert first != second and node_id_of(first) == node_id_of(second) == "copied-config"
    assert warned_about(procs[0]) == [second] and warned_about(procs[1]) == [first]  # once each


@pytest.mark.serial  # joining within the membership's own wait is a bound on time
async def test_a_restart_after_kill_9_joins_beside_its_previous_run_and_takes_its_rows_over(
    store: MySQLStore, database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path
) -> None:
    """A fixed pod name restarted at once: the killed run's heartbeat is still fresh, yet the
    new run joins within the membership's own wait (no "not settled" warning), is not warned
    about a namesake (the dead run's heartbeat never moves), and delivers every event, those
    the killed run held leased included."""
    fake_im.set_faults(latency=0.05)  # slow enough that the kill finds deliveries in flight
    im = {"app_rate_limit": 100_000, "group_rate_limit": 100_000}
    events = 400
    first = process(tmp_path, "a", database_dsn, fake_im, im, "pod-0")
    second = None
    try:
        await wait_until(lambda: joined(first), timeout=60)
        await insert_events(store, [envelope(f"k{i:04}", room_id=f"r_{i % 40}") for i in range(events)])
        await wait_until(lambda: messages_received(fake_im) >= 50, timeout=60, interval=0.05)
        first.kill()
        second = process(tmp_path, "b", database_dsn, fake_im, im, "pod-0")
        await wait_until(lambda: joined(second), timeout=60)
        await wait_until(lambda: all_published(store, events), timeout=120, interval=0.25)
    finally:
        for proc in (first, second):
            if proc is not None and proc.alive():
                proc.kill()
    lines = second.lines()
    assert identity(second) != identity(first)
    assert not [line for line in lines if line.get("msg", "").startswith("membership not settled")]
    assert warned_about(second) == []
