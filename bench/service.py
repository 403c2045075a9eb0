"""(c) latency and (e) memory: the real ``room-outbox run`` in a child process, configured by
a YAML file as an operator would, against the fake IM in another process."""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from bench import procs
from bench.db import IM_TYPE, load, pending, reset
from room_outbox.store.mysql import MySQLStore
from room_outbox.testing import DEV_KEY, DEV_SDKAPPID

INSERT = (
    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
)


def write_config(folder: str, dsn: str, base_url: str, **worker: object) -> str:
    config = {
        "mysql": {"dsn": dsn, "pool_size": 4},
        "node_id": "bench",
        "outbox_worker": {"batch_size": 100, **worker},
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


@dataclass
class LatencyResult:
    poll_interval: float
    events: int
    p50_ms: float
    p99_ms: float
    max_ms: float


async def run_latency(
    store: MySQLStore, dsn: str, poll_interval: float, rate: int, seconds: float, module: str = "room_outbox.cli"
) -> LatencyResult:
    await reset(store)
    with procs.fake_im_process() as base_url, tempfile.TemporaryDirectory() as folder:
        config = write_config(folder, dsn, base_url, poll_interval=f"{poll_interval}s")
        worker = procs.room_outbox("--config", config, "run", env={}, module=module)
        try:
            committed: dict[str, float] = {}
            tick = 0.01
            per_tick = max(1, round(rate * tick))
            started = next_tick = time.monotonic()
            n = 0
            while time.monotonic() - started < seconds:
                rows = []
                for _ in range(per_tick):
                    event_id = f"lat{n}"
                    envelope = {"event_id": event_id, "event_type": IM_TYPE, "app_code": "default",
                                "room_id": f"r_{n % 100}", "room_version": 1, "payload": {"user_id": "u1"}}  # fmt: skip
                    now = int(time.time() * 1000)
                    rows.append(("default", event_id, IM_TYPE, envelope["room_id"], json.dumps(envelope), now, now))
                    n += 1
                async with store.transaction() as cur:
                    await cur.executemany(INSERT, rows)
                done = time.time()
                for row in rows:
                    committed[row[1]] = done
                next_tick += tick
                await anyio.sleep(max(0.0, next_tick - time.monotonic()))
            deadline = time.monotonic() + 60
            while await pending(store) and time.monotonic() < deadline:
                await anyio.sleep(0.1)
            received: dict[str, float] = procs.receipts(base_url)["receipts"]  # type: ignore[assignment]
        finally:
            procs.stop(worker)
    latencies = sorted((received[e] - t) * 1000 for e, t in committed.items() if e in received)
    assert len(latencies) == len(committed), f"{len(committed) - len(latencies)} events not received"
    q = statistics.quantiles(latencies, n=100)
    return LatencyResult(poll_interval, len(latencies), q[49], q[98], latencies[-1])


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
