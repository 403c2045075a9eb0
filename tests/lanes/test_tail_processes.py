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

import anyio
import httpx
import pytest
from lanes.conftest import Broker
from lanes.test_lane_lifecycle import cli, write
from lanes.test_lanes import consume, event_ids
from processes import DispatcherProcess
from support import envelope, free_port, id_held_open, insert_events, wait_until

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


async def published(port: int) -> float:
    """The events a process's /metrics count as published to Kafka (0 while it does not answer)."""
    async with httpx.AsyncClient(timeout=5) as client:
        try:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        except httpx.TransportError:
            return 0.0
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("room_outbox_publish_success_total{") and 'sink="kafka"' in line)  # fmt: skip


async def test_a_broker_hanging_while_three_processes_run_the_lane_repeats_a_batch_once_at_most(
    store: MySQLStore, database_dsn: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    """The process whose batch the broker failed keeps the lane while it waits for the broker,
    so the others do not send that batch too, each copy queued in its own producer and
    written once the broker is back: one outage repeats a batch once, whatever the number of
    processes."""
    publish_timeout = 2.0
    ports = [free_port() for _ in range(3)]
    configs = [write(tmp_path / f"tail-{n}.yaml", {
        "mysql": {"dsn": database_dsn, "pool_size": 4},
        "outbox_worker": {"poll_interval": "50ms", "batch_size": 30, "publish_timeout": f"{publish_timeout:g}s"},
        "sinks": {
            "tencent_im": {"enabled": False},
            "kafka": {"bootstrap_servers": kafka_broker.bootstrap, "start": "beginning", "request_timeout": "2s"},
        },
        "telemetry": {"http_listen": f"127.0.0.1:{port}"},
    }) for n, port in enumerate(ports)]  # fmt: skip
    migrated = cli(configs[0], "migrate")
    assert migrated.returncode == 0, migrated.stderr
    procs = [DispatcherProcess(config, f"tail-{n}") for n, config in enumerate(configs)]
    assert kafka_broker.proc is not None
    sent: list[dict[str, object]] = []
    try:
        # Steady traffic until each process has owned the lane with events to send: each one's
        # producer is connected to the broker, as in a lane that has run for a while.
        async def everyone_published() -> bool:
            more = room_events("a", len(sent) // 10, 1)
            await insert_events(store, more)
            sent.extend(more)
            return all([await published(port) > 0 for port in ports])

        await wait_until(everyone_published, timeout=60, interval=0.05)
        await consume(kafka_broker, {str(e["event_id"]) for e in sent}, timeout=60)
        kafka_broker.proc.send_signal(signal.SIGSTOP)  # the broker hangs: the batch times out
        try:
            during = room_events("b", 0, 30)
            await insert_events(store, during)
            await wait_until(lambda: any(line.get("msg", "").startswith("tailing round failed")
                                         for proc in procs for line in proc.lines()), timeout=30)  # fmt: skip
            # The outage itself, not a synchronisation: long enough for every other process to
            # take the lane and send the batch, before the fix.
            await anyio.sleep(3 * publish_timeout)
        finally:
            kafka_broker.proc.send_signal(signal.SIGCONT)
        await consume(kafka_broker, {str(e["event_id"]) for e in during}, timeout=90)
        after = room_events("c", 0, 1)  # read last: after every copy the outage left in a producer
        await insert_events(store, after)
        messages = await consume(kafka_broker, {str(e["event_id"]) for e in sent + during + after}, timeout=60)
    finally:
        for proc in procs:
            if proc.alive():
                proc.terminate()
    copies = Counter(Counter(event_ids(messages)).values())
    assert max(copies) <= 2, copies


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
