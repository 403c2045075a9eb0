"""(c) latency and (e) memory: the real ``room-outbox run`` in a child process, configured by
a YAML file as an operator would, against the fake IM in another process."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from bench import procs
from bench.db import IM_TYPE, load, pending, reset
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID
from room_outbox.store.backends.mysql import MySQLStore

INSERT = (
    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
)


def write_config(folder: str, dsn: str, base_url: str, **worker: object) -> str:
    config = {
        "mysql": {"dsn": dsn, "pool_size": 4},
        "node_id": "bench",
        # claim_after 0: the latency measured is the worker's, for events no producer pushes
        # itself; at the shipped 5 s the worker leaves each young row to that push first.
        "outbox_worker": {"batch_size": 100, "claim_after": "0s", **worker},
        # 500 events/s is above one app's 200 requests/s: the limit is raised so the
        # latency measured is the lane's, not the quota's.
        "sinks": {
            "tencent_im": {
                "base_url": base_url,
                "sdkappid": DEV_SDKAPPID,
                "secret_key": DEV_KEY,
                "app_rate_limit": 5000,
            }
        },
        "log": {"level": "WARNING"},
    }
    path = Path(folder) / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def event_row(event_id: str, n: int) -> tuple[object, ...]:
    envelope = {"event_id": event_id, "event_type": IM_TYPE, "app_code": "default",
                "room_id": f"r_{n % 100}", "room_version": 1, "payload": {"user_id": "u1"}}  # fmt: skip
    now = int(time.time() * 1000)
    return ("default", event_id, IM_TYPE, envelope["room_id"], json.dumps(envelope), now, now)


async def insert(store: MySQLStore, rows: list[tuple[object, ...]]) -> None:
    async with store.transaction() as cur:
        await cur.executemany(INSERT, rows)


@dataclass
class LatencyResult:
    poll_interval: float
    events: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    delivered_rate: float  # events/s from the first commit to the last receipt
    # CPU while the load ran, as a share of one core: the fake IM, the worker, this process
    # (the load generator), and the whole machine (all cores, so 2 cores busy = 2.0)
    fake_cpu: float
    worker_cpu: float
    generator_cpu: float
    machine_cpu: float


async def run_latency(
    store: MySQLStore, dsn: str, poll_interval: float, rate: int, seconds: float, batch_size: int = 100
) -> LatencyResult:
    await reset(store)
    with procs.fake_im_child() as (base_url, fake_pid), tempfile.TemporaryDirectory() as folder:
        config = write_config(folder, dsn, base_url, poll_interval=f"{poll_interval}s", batch_size=batch_size)
        worker = procs.room_outbox("--config", config, "run", env={})
        try:
            committed: dict[str, float] = {}
            tick = 0.01
            per_tick = max(1, round(rate * tick))
            # the worker's start-up is not part of the measurement: one event through first
            await insert(store, [event_row("warm-up", 0)])
            deadline = time.monotonic() + 60
            while await pending(store) and time.monotonic() < deadline:
                await anyio.sleep(0.05)
            procs.clear(base_url)
            cpu_before = (procs.cpu_seconds(fake_pid), procs.cpu_seconds(worker.pid), time.process_time())
            machine_before = procs.machine_cpu()
            started = next_tick = time.monotonic()
            n = 0
            while time.monotonic() - started < seconds:
                rows = [event_row(f"lat{n + i}", n + i) for i in range(per_tick)]
                n += per_tick
                await insert(store, rows)
                done = time.time()
                for row in rows:
                    committed[str(row[1])] = done
                next_tick += tick
                await anyio.sleep(max(0.0, next_tick - time.monotonic()))
            elapsed = time.monotonic() - started
            cpu_after = (procs.cpu_seconds(fake_pid), procs.cpu_seconds(worker.pid), time.process_time())
            machine_after = procs.machine_cpu()
            deadline = time.monotonic() + 60
            while await pending(store) and time.monotonic() < deadline:
                await anyio.sleep(0.1)
            received: dict[str, float] = procs.receipts(base_url)["receipts"]  # type: ignore[assignment]
        finally:
            procs.stop(worker)
    latencies = sorted((received[e] - t) * 1000 for e, t in committed.items() if e in received)
    assert len(latencies) == len(committed), f"{len(committed) - len(latencies)} events not received"
    q = statistics.quantiles(latencies, n=100)
    delivered_rate = len(latencies) / (max(received.values()) - min(committed.values()))
    fake, worker_cpu, generator = ((a - b) / elapsed for a, b in zip(cpu_after, cpu_before, strict=True))
    machine = (machine_after[0] - machine_before[0]) / (machine_after[1] - machine_before[1]) * (os.cpu_count() or 1)
    return LatencyResult(
        poll_interval, len(latencies), q[49], q[98], latencies[-1], delivered_rate, fake, worker_cpu, generator, machine
    )


@dataclass
class RssResult:
    events: int
    idle_mb: float
    peak_mb: float
    seconds: float


async def run_rss(store: MySQLStore, dsn: str, events: int) -> RssResult:
    """Peak RSS of ``room-outbox run`` draining a backlog of noop events (the lane's own
    memory: the IM sink's would add its HTTP pool, the same whatever the backlog)."""
    await reset(store)
    await load(store, events, prefix="m")
    with procs.fake_im_process() as base_url, tempfile.TemporaryDirectory() as folder:
        config = write_config(folder, dsn, base_url, poll_interval="1s")
        # started with the worker off, to read the footprint of an idle process first
        idle = procs.room_outbox(
            "--config", config, "run", env={"ROOM_OUTBOX__OUTBOX_WORKER__ENABLED": "false"}, stderr=subprocess.PIPE
        )
        try:
            await anyio.sleep(3)
            idle_mb = procs.peak_rss_mb(idle.pid)
        finally:
            procs.stop(idle)
        worker = procs.room_outbox("--config", config, "run", env={})
        try:
            started = time.monotonic()
            peak = 0.0
            while await pending(store):
                peak = max(peak, procs.peak_rss_mb(worker.pid))
                await anyio.sleep(0.2)
            seconds = time.monotonic() - started
            peak = max(peak, procs.peak_rss_mb(worker.pid))
        finally:
            procs.stop(worker)
    return RssResult(events, idle_mb, peak, seconds)
