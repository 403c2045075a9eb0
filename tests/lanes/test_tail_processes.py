"""The tailing Kafka lane with real processes on the real broker: two `room-outbox run`
processes, the owner killed with SIGKILL, the broker stopped with SIGSTOP for a while, and an id
below every event missing until after the kill (a producer's transaction still open). Every event
reaches the topic, each room's events in order in one partition, duplicates bounded by a batch
per incident, and an oversize event parked and counted by `room-outbox status`."""

from __future__ import annotations

import json
import signal
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from lanes.conftest import Broker
from lanes.test_lane_lifecycle import cli, write
from lanes.test_lanes import consume, event_ids
from processes import DispatcherProcess
from support import envelope, id_held_open, insert_events, wait_until

from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio

BATCH = 50


def room_events(prefix: str, start: int, count: int) -> list[dict[str, object]]:
    return [envelope(f"{prefix}{v:03}-r{r}", room_id=f"r{r}", room_version=v)
            for v in range(start, start + count) for r in range(10)]  # fmt: skip


def last_takeover(proc: DispatcherProcess) -> str:
    """When ``proc`` last took the lane over (it logs each time it starts from the cursor);
    "" if it never did."""
    return max(
        (line["ts"] for line in proc.lines() if line.get("msg") == "tailing the lane from its cursor"), default=""
    )


async def test_two_processes_a_kill_and_a_broker_stop_deliver_everything_in_room_order(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    config = write(tmp_path / "tail.yaml", {
        "mysql": {"dsn": database_dsn, "pool_size": 4},
        "outbox_worker": {"poll_interval": "50ms", "batch_size": BATCH, "publish_timeout": "3s"},
        "sinks": {
            "tencent_im": {"enabled": False},
            "kafka": {"bootstrap_servers": kafka_broker.bootstrap, "start": "beginning",
                      "request_timeout": "1s", "max_message_bytes": 2048},
        },
    })  # fmt: skip
    migrated = cli(config, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    first = room_events("a", 0, 20)
    procs = [DispatcherProcess(config, "tail-0"), DispatcherProcess(config, "tail-1")]
    try:
        # The cursor stays below "late" until after the kill, while both processes send what is
        # above it and take the lane from each other: neither sends again what the other sent.
        async with id_held_open(store, "late", room_id="r_late") as commit_late:
            await insert_events(store, [*first[:100], envelope("huge", room_id="r_big", payload={"blob": "x" * 4000}),
                                        *first[100:]])  # fmt: skip
            await consume(kafka_broker, {str(e["event_id"]) for e in first}, timeout=60)
            # A round belongs to whoever locks the cursor row for it, so both may have owned the
            # lane between rounds: the one that took it over last is killed.
            owner = max(procs, key=last_takeover)
            other = procs[1 - procs.index(owner)]
            second = room_events("b", 20, 20)
            await insert_events(store, second)
            owner.kill()  # SIGKILL, maybe mid-batch: the other one goes on from where it read
            await consume(kafka_broker, {str(e["event_id"]) for e in second}, timeout=60)
            commit_late.set()

        assert kafka_broker.proc is not None
        kafka_broker.proc.send_signal(signal.SIGSTOP)  # the broker hangs: sends time out
        try:
            third = room_events("c", 40, 20)
            await insert_events(store, third)
            await wait_until(lambda: any(line.get("msg", "").startswith("tailing round failed")
                                         for line in other.lines()), timeout=30)  # fmt: skip
        finally:
            kafka_broker.proc.send_signal(signal.SIGCONT)
        everything = {str(e["event_id"]) for e in first + second + third} | {"late"}
        messages = await consume(kafka_broker, everything, timeout=90)
        status = cli(config, "status")
        assert status.returncode == 0, status.stderr
        inspected = cli(config, "inspect", "huge")
        assert "parked by the tailing lane: message of" in inspected.stdout, inspected.stdout + inspected.stderr
        requeue = cli(config, "requeue", "--lane", "kafka")  # without --yes: shows, changes nothing
        assert "1 event(s) would be requeued" in requeue.stdout, requeue.stdout + requeue.stderr
    finally:
        for proc in procs:
            if proc.alive():
                proc.terminate()
    ids = event_ids(messages)
    assert "huge" not in ids
    (kafka_line,) = [line.split() for line in status.stdout.splitlines() if line.strip().startswith("kafka ")]
    assert kafka_line[-1] == "1", status.stdout  # the parked column: the oversize event
    duplicates = sum(n - 1 for n in Counter(ids).values())
    assert duplicates <= 2 * BATCH, duplicates  # one kill and one outage: at most a batch each
    versions: dict[bytes, list[int]] = defaultdict(list)
    partitions: dict[bytes, set[int]] = defaultdict(set)
    seen: set[str] = set()
    for message, event_id in zip(messages, ids, strict=True):
        partitions[message.key].add(message.partition)
        # A repeated batch repeats what came before: first copies are in order.
        if event_id not in seen and event_id != "late":
            seen.add(event_id)
            versions[message.key].append(json.loads(message.value)["room_version"])
    assert all(len(p) == 1 for p in partitions.values()), partitions
    assert all(v == list(range(60)) for v in versions.values()), versions


@pytest.mark.serial  # a bound on time
async def test_sigterm_while_the_broker_hangs_stops_within_the_bound_abandoning_the_producer(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    """A failed round leaves its record batches in the Kafka producer, which would wait up to
    request_timeout (30 s) for them when closed. SIGTERM must stop the process within
    publish_timeout + query_timeout + 1 s all the same: the sink is abandoned, and says so."""
    config = write(tmp_path / "tail.yaml", {
        "mysql": {"dsn": database_dsn, "pool_size": 4, "query_timeout": "2s"},
        "outbox_worker": {"poll_interval": "50ms", "batch_size": BATCH, "publish_timeout": "1s", "lease": "10s"},
        "sinks": {
            "tencent_im": {"enabled": False},
            "kafka": {"bootstrap_servers": kafka_broker.bootstrap, "start": "beginning", "request_timeout": "30s"},
        },
    })  # fmt: skip
    migrated = cli(config, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    proc = DispatcherProcess(config, "tail-0")
    assert kafka_broker.proc is not None
    try:
        first = room_events("a", 0, 2)
        await insert_events(store, first)
        await consume(kafka_broker, {str(e["event_id"]) for e in first}, timeout=60)
        kafka_broker.proc.send_signal(signal.SIGSTOP)
        try:
            await insert_events(store, room_events("b", 2, 2))
            await wait_until(lambda: any(line.get("msg", "").startswith("tailing round failed")
                                         for line in proc.lines()), timeout=30)  # fmt: skip
            took = proc.terminate(timeout=60)
        finally:
            kafka_broker.proc.send_signal(signal.SIGCONT)
    finally:
        if proc.alive():
            proc.kill()
    assert took <= 1 + 2 + 1, took
    assert any(line.get("msg") == "sink kafka did not close within 0.5s; abandoned" for line in proc.lines())
