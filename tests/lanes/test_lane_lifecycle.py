"""Lanes with real processes: per-lane delivery settings, seed 003's Kafka-only deployment
through retention, and retiring a lane an operator switched off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from lanes.conftest import Broker
from lanes.test_lanes import consume, lane_rows
from processes import DispatcherProcess, FakeIMProcess, _env
from support import envelope, fetch_rows, free_port, insert_events, wait_until

from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio

CONFIG_DIR = Path(__file__).parents[2] / "config"


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``room-outbox --config CONFIG ARGS`` as a process."""
    return subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )


def write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


async def test_im_retries_at_a_fixed_interval_while_kafka_backs_off_and_parks(
    store: MySQLStore, database_dsn: str, tmp_path: Path
) -> None:
    """outbox_worker keeps V1's fixed interval, retry for ever, for IM; outbox_worker.lanes.kafka
    gives the Kafka lane exponential backoff with parking after 2 attempts."""
    fake = FakeIMProcess(tmp_path, faults={"error_rate": 1.0, "error_codes": [10002]})  # IM always fails, retryably
    try:
        config = write(
            tmp_path / "c.yaml",
            {
                "mysql": {"dsn": database_dsn, "pool_size": 4},
                "outbox_worker": {
                    "poll_interval": "100ms",
                    "publish_timeout": "1s",
                    "retry_strategy": "fixed_interval",
                    "lanes": {
                        "kafka": {"retry_strategy": "exponential", "parking": True,
                                  "retry": {"base": "200ms", "max_attempts": 2}},
                    },
                },
                "sinks": {
                    "tencent_im": {"base_url": fake.base_url, "sdkappid": 1400000000},
                    # nothing listens there: every send fails, retryably
                    "kafka": {"bootstrap_servers": f"127.0.0.1:{free_port()}", "start": "beginning",
                              "request_timeout": "300ms", "relay": "lane_table"},
                },
            },
        )  # fmt: skip
        assert cli(config, "migrate").returncode == 0
        await insert_events(store, [envelope(f"e{n}", room_id=f"r_{n}") for n in range(3)])
        proc = DispatcherProcess(config, "lanes-settings")
        try:

            async def settled() -> bool:
                kafka = await lane_rows(store, "kafka")
                im = await fetch_rows(store)
                return (
                    len(kafka) == 3
                    and all(r["status"] == "failed" for r in kafka.values())
                    and all(r["retry_count"] >= 6 for r in im.values())
                )

            await wait_until(settled, timeout=60)
        finally:
            proc.terminate()
        kafka = await lane_rows(store, "kafka")
        assert {r["retry_count"] for r in kafka.values()} == {2}  # parked after max_attempts
        im = await fetch_rows(store)
        assert {r["status"] for r in im.values()} == {"pending"}  # IM: never given up on
        started = {line["lane"]: line for line in proc.lines() if line.get("lifecycle") == "worker_started"}
        assert (started["main"]["retry_strategy"], started["main"]["parking"]) == ("fixed_interval", False)
        assert (started["kafka"]["retry_strategy"], started["kafka"]["parking"]) == ("exponential", True)
    finally:
        fake.close()


async def test_kafka_only_deployment_rows_live_until_kafka_has_them_then_retention_removes_them(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    """config/config.kafka-only.yaml: room-service pushes IM itself (some rows published by it,
    some left pending); room-outbox runs only the Kafka lane. Once Kafka has a row, retention
    removes it whatever its status; status and /metrics count no IM backlog."""
    config = yaml.safe_load((CONFIG_DIR / "config.kafka-only.yaml").read_text())
    config["mysql"]["dsn"] = database_dsn
    config["sinks"]["kafka"].update(bootstrap_servers=kafka_broker.bootstrap, start="beginning")
    config["outbox_worker"]["poll_interval"] = "100ms"
    port = free_port()
    config["telemetry"] = {"http_listen": f"127.0.0.1:{port}", "backlog_interval": "100ms"}
    config["retention"] = {**config.get("retention", {}), "enabled": True, "older_than": "1s", "interval": "200ms",
                           "pause": "0s"}  # fmt: skip
    path = write(tmp_path / "kafka-only.yaml", config)
    assert cli(path, "migrate").returncode == 0
    await insert_events(store, [envelope(f"k{n}", room_id=f"r_{n % 3}") for n in range(12)])
    async with store.transaction() as cur:  # room-service's own push succeeded for some rows
        await cur.execute("UPDATE room_outbox SET status = 'published' WHERE event_id IN ('k0', 'k1', 'k2')")
        await cur.execute("UPDATE room_outbox SET status = 'failed' WHERE event_id = 'k3'")

    proc = DispatcherProcess(path, "kafka-only")
    try:
        await consume(kafka_broker, {f"k{n}" for n in range(12)})

        async def metrics() -> str:
            async with httpx.AsyncClient(timeout=5) as client:
                try:
                    return (await client.get(f"http://127.0.0.1:{port}/metrics")).text
                except httpx.TransportError:
                    return ""

        async def kafka_gauge_seen() -> bool:
            return 'room_outbox_pending{lane="kafka"}' in await metrics()

        await wait_until(kafka_gauge_seen, timeout=30)
        text = await metrics()
        assert 'lane="main"' not in text  # the main lane does not run: no IM backlog
        assert (
            'room_outbox_publish_failure_total{error_class="timeout",event_type="RoomUserJoined",sink="kafka"} 0.0'
            in text
        )

        async def all_removed() -> bool:
            return not await fetch_rows(store)  # the Kafka lane tails: no lane table to empty

        await wait_until(all_removed, timeout=30)  # pending, published and failed rows alike
        await insert_events(store, [envelope("fresh")])  # younger than older_than: stays for now
        await consume(kafka_broker, {"fresh"})
        status = cli(path, "status")
        assert status.returncode == 0, status.stderr
        assert "main lane               disabled" in status.stdout
        lanes = cli(path, "lanes")
        assert lanes.returncode == 0, lanes.stderr
        (im_line,) = [line for line in lanes.stdout.splitlines() if line.startswith("main ")]
        assert "disabled" in im_line
        await wait_until(all_removed, timeout=30)  # once old enough, it goes too
    finally:
        proc.terminate()
    lines = proc.lines()
    assert any(line.get("msg") == "retention pass done" and line.get("removed", 0) > 0 for line in lines)


async def test_a_retired_lane_is_named_while_it_holds_retention_back_and_retire_drops_it(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    base: dict[str, Any] = {
        "mysql": {"dsn": database_dsn, "pool_size": 4},
        "outbox_worker": {"poll_interval": "100ms"},
        "sinks": {
            "tencent_im": {"enabled": False},  # the main lane: noop takes RoomCreated
            "kafka": {"bootstrap_servers": kafka_broker.bootstrap, "start": "beginning", "relay": "lane_table"},
        },
        "retention": {"older_than": "1s", "pause": "0s"},
    }
    with_kafka = write(tmp_path / "with-kafka.yaml", base)
    assert cli(with_kafka, "migrate").returncode == 0
    await insert_events(store, [envelope(f"c{n}", "RoomCreated") for n in range(5)])
    proc = DispatcherProcess(with_kafka, "with-kafka")
    try:
        await consume(kafka_broker, {f"c{n}" for n in range(5)})

        async def im_done() -> bool:
            return {r["status"] for r in (await fetch_rows(store)).values()} == {"published"}

        await wait_until(im_done, timeout=30)
    finally:
        proc.terminate()

    refused = cli(with_kafka, "lanes", "retire", "kafka", "--yes")
    assert refused.returncode == 2 and "lane kafka is enabled (sinks.kafka)" in refused.stderr

    base["sinks"]["kafka"]["enabled"] = False  # the operator switches Kafka off
    without = write(tmp_path / "without-kafka.yaml", base)
    await insert_events(store, [envelope(f"d{n}", "RoomCreated") for n in range(5)])
    proc = DispatcherProcess(without, "without-kafka")
    try:
        await wait_until(im_done, timeout=30)  # published in the main lane, never fed to Kafka
    finally:
        proc.terminate()
    async with store.transaction() as cur:  # everything is old now
        await cur.execute("UPDATE room_outbox SET created_at_ms = created_at_ms - 3600000")

    listing = cli(without, "lanes")
    assert listing.returncode == 0, listing.stderr
    (kafka_line,) = [line for line in listing.stdout.splitlines() if line.startswith("kafka ")]
    assert "disabled: holds back retention until retired" in kafka_line and " 5 " in kafka_line  # 5 unfed
    preview = cli(without, "cleanup")  # without --yes: counts, names the lane, removes nothing
    assert preview.returncode == 0, preview.stderr
    assert preview.stdout.startswith("5 published row(s)") and "would be deleted" in preview.stdout
    assert "lane kafka is not enabled, but its leftovers hold rows back" in preview.stdout
    cleanup = cli(without, "cleanup", "--yes")
    assert cleanup.returncode == 0, cleanup.stderr
    assert cleanup.stdout.startswith("5 published row(s)")  # Kafka had c0..c4; d0..d4 are held
    assert "lane kafka is not enabled, but its leftovers hold rows back" in cleanup.stdout
    assert "lanes retire kafka --yes" in cleanup.stdout
    assert sorted(await fetch_rows(store)) == [f"d{n}" for n in range(5)]

    shown = cli(without, "lanes", "retire", "kafka")  # without --yes: shows, drops nothing
    assert shown.returncode == 0 and "would drop lane kafka" in shown.stdout
    assert await lane_rows(store, "kafka") == {}  # the table is still there (empty: c-rows went)
    retired = cli(without, "lanes", "retire", "kafka", "--yes")
    assert retired.returncode == 0, retired.stderr
    assert "dropped table room_outbox_lane_kafka" in retired.stdout
    assert "kafka" not in cli(without, "lanes").stdout
    unknown = cli(without, "lanes", "retire", "kafka", "--yes")
    assert unknown.returncode == 1 and "no lane named 'kafka'" in unknown.stderr

    cleanup = cli(without, "cleanup", "--yes")
    assert cleanup.stdout.startswith("5 published row(s)") and "leftovers" not in cleanup.stdout
    assert await fetch_rows(store) == {}
    assert json.loads(cli(without, "lanes", "--json").stdout)[0]["lane"] == "main"
