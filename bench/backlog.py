"""(m) Memory with a backlog of 1,000,000 pending rows: the real ``room-outbox run`` drains part
of it while its resident memory (VmRSS) is sampled. Nothing that grows with the backlog may be
held in memory: the RSS after ``drain`` events must be that of the same process draining a
backlog of just ``drain`` rows, and must stay flat while it drains.

* **reference**: the noop lane over a backlog of ``drain`` rows;
* **noop lane**: the same over 1M rows: the main lane with the noop sink, the backlog gauges
  sampled every second (``telemetry.backlog_interval``) and the retention job running
  (``older_than`` 1 s: published rows are deleted while the lane drains);
* **noop lane, per_room**: the same with ``ordering: per_room`` (room buckets, head checks);
* **Kafka lane**: a lane table of its own fed from ``room_outbox`` from its first row (the
  feeder's watermark and gap bookkeeping over the whole backlog), delivering to tansu.

Each process runs until it has published ``drain`` events (its ``/metrics`` counter) or
``max_seconds`` have passed. "Flat" is judged on the second half of each drain: the first
tens of thousands of events fill bounded caches (pydantic-core's cache of short JSON strings,
about 0.9 MB once full), which is growth that stops, not growth with the backlog.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from bench import procs
from bench.consume import TOPIC, Tansu
from bench.db import load, reset
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.lanes.store import migrate_lanes

#: Samples this early in a drain are warm-up (bounded caches filling), not slope.
WARM_UP_SHARE = 0.5


@dataclass(frozen=True)
class Sample:
    seconds: float
    published: int
    rss_mb: float


@dataclass(frozen=True)
class BacklogRun:
    name: str
    backlog: int  # rows the lane owed when the process started
    samples: list[Sample]
    peak_mb: float  # VmHWM: the most the process ever held
    #: Backlog gauge samples that failed (:func:`failed_samples`).
    failed_samples: int

    @property
    def drained(self) -> int:
        return self.samples[-1].published

    @property
    def rate(self) -> float:
        return self.drained / self.samples[-1].seconds

    @property
    def start_mb(self) -> float:
        """RSS once the lane has published its first batch."""
        return next(s.rss_mb for s in self.samples if s.published > 0)

    @property
    def mid_mb(self) -> float:
        """RSS once half the drain is done: the warm-up is over."""
        return next(s.rss_mb for s in self.samples if s.published >= WARM_UP_SHARE * self.drained)

    @property
    def end_mb(self) -> float:
        return self.samples[-1].rss_mb

    @property
    def slope_mb_per_100k(self) -> float:
        """Least-squares slope of RSS against events published over the second half."""
        points = [s for s in self.samples if s.published >= WARM_UP_SHARE * self.drained]
        if len(points) < 3:
            return 0.0
        mean_x = sum(p.published for p in points) / len(points)
        mean_y = sum(p.rss_mb for p in points) / len(points)
        var = sum((p.published - mean_x) ** 2 for p in points)
        if var == 0:
            return 0.0
        cov = sum((p.published - mean_x) * (p.rss_mb - mean_y) for p in points)
        return cov / var * 100_000

    @property
    def flat(self) -> bool:
        """At most 2 MB more over the second half of the drain."""
        return self.end_mb - self.mid_mb <= 2.0


@dataclass(frozen=True)
class BacklogResult:
    backlog: int
    load_seconds: float
    reference: BacklogRun  # the noop lane over a backlog of ``drain`` rows
    runs: list[BacklogRun]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def config(dsn: str, port: int, sinks: dict[str, Any], **worker: object) -> dict[str, Any]:
    return {
        "mysql": {"dsn": dsn, "pool_size": 4},
        "node_id": "bench-backlog",
        "outbox_worker": {"batch_size": 100, "poll_interval": "0.5s", **worker},
        "sinks": {"tencent_im": {"enabled": False}, **sinks},
        "telemetry": {"http_listen": f"127.0.0.1:{port}", "backlog_interval": "1s"},
        "log": {"level": "WARNING"},
    }


def rss_mb(pid: int) -> float:
    """VmRSS: resident memory now (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc status")


def published(metrics: str) -> int:
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("room_outbox_publish_success_total{")
        )
    )


async def drain(
    name: str, settings: dict[str, Any], port: int, backlog: int, events: int, max_seconds: float
) -> BacklogRun:
    """``room-outbox run`` with ``settings`` until it has published ``events`` (or ``max_seconds``)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(json.dumps(settings))  # JSON is YAML
        log = (Path(folder) / "stderr.log").open("w+")
        worker = procs.room_outbox("--config", str(path), "run", env={}, stderr=log)
        samples: list[Sample] = []
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                with anyio.fail_after(60):  # start-up: the endpoint answers
                    while True:
                        try:
                            (await client.get(f"http://127.0.0.1:{port}/metrics")).raise_for_status()
                            break
                        except httpx.HTTPError:
                            assert worker.poll() is None, f"room-outbox run exited with {worker.returncode}"
                            await anyio.sleep(0.1)
                started = time.monotonic()
                while True:
                    done = published((await client.get(f"http://127.0.0.1:{port}/metrics")).text)
                    samples.append(Sample(time.monotonic() - started, done, rss_mb(worker.pid)))
                    if done >= events or time.monotonic() - started > max_seconds:
                        break
                    assert worker.poll() is None, f"room-outbox run exited with {worker.returncode}"
                    await anyio.sleep(0.5)
            peak = procs.peak_rss_mb(worker.pid)
        finally:
            procs.stop(worker)
            log.seek(0)
            said = log.read()
            failed = failed_samples(said)
            log.close()
    assert samples[-1].published > 0, f"{name}: nothing published in {max_seconds:g}s; it said: {said[-2000:]}"
    return BacklogRun(name, backlog, samples, peak, failed)


def failed_samples(log: str) -> int:
    """How many backlog samples failed, from the process's JSON log: a run of failures is logged
    at its first sample, then once a minute with ``failed_rounds`` so far, and once over with
    its total (a run still going at the end counts as its last line says)."""
    total = going = 0
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") == "backlog sample failed":
            going = int(record.get("failed_rounds", 1))
        elif record.get("msg") == "backlog samples succeed again":
            total, going = total + int(record["failed_rounds"]), 0
    return total + going


async def count(store: MySQLStore, sql: str) -> int:
    async with store.transaction() as cur:
        await cur.execute(sql)
        return int((await cur.fetchone())[0])


async def topped_up(store: MySQLStore, backlog: int, prefix: str) -> int:
    """Load rows until ``backlog`` are pending again, and return how many are: a small backlog
    may have been drained whole by the run before (it runs until its sample shows enough)."""
    pending = await count(store, "SELECT COUNT(*) FROM room_outbox WHERE status = 'pending'")
    if pending < backlog:
        await load(store, backlog - pending, prefix=prefix, rooms=1000)
    return max(pending, backlog)


async def run_backlog(store: MySQLStore, dsn: str, backlog: int, events: int, max_seconds: float) -> BacklogResult:
    port = free_port()
    retention = {"enabled": True, "older_than": "1s", "interval": "2s"}
    noop = {**config(dsn, port, {}), "retention": retention}
    await reset(store)
    await load(store, events, prefix="s", rooms=1000)
    reference = await drain("reference: noop lane", noop, port, events, events, max_seconds)
    await reset(store)
    started = time.monotonic()
    await load(store, backlog, prefix="b", rooms=1000)
    load_seconds = time.monotonic() - started
    runs = [await drain("noop lane, metrics, retention", noop, port, backlog, events, max_seconds)]
    per_room = config(dsn, port, {}, ordering="per_room")
    owed = await topped_up(store, backlog, prefix="p")
    runs.append(await drain("noop lane, per_room", per_room, port, owed, events, max_seconds))
    broker = Tansu()
    try:
        kafka = {"noop": {"enabled": False}, "kafka": {"bootstrap_servers": broker.bootstrap, "topic": TOPIC, "start": "beginning", "relay": "lane_table"}}  # fmt: skip
        await migrate_lanes(store, ["kafka"])
        owed = await count(store, "SELECT COUNT(*) FROM room_outbox")
        runs.append(await drain("Kafka lane (a lane table)", config(dsn, port, kafka), port, owed, events, max_seconds))
    finally:
        broker.stop()
    return BacklogResult(backlog, load_seconds, reference, runs)
