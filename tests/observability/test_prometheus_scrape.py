"""A real Prometheus (Debian package prometheus) scraping a real `room-outbox run` under load,
with docker/prometheus/alerts.yml loaded: every alert expression and every dashboard query
must return series from that data, and the alerts that the traffic provokes must go active.

The traffic makes every series the dashboard and the alerts read: deliveries through the
fake Tencent IM (its own process) with injected retryable and permanent errors and HTTP 503s,
a row whose envelope does not parse, and rows that "the producer" publishes or another claim
takes over while the dispatcher has them in flight (lost leases at result write, by cause).

Set ROOM_OUTBOX_DASHBOARD_PNG=path to also run an IM outage and its recovery and draw the main
panels from Prometheus's range queries (scripts/dashboard-picture.sh, for docs/how-to/monitor.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pymysql
import pytest
import yaml
from observability_stack import ALERTS, Query, alert_queries, alert_rules, metric_names, panel_queries
from processes import DispatcherProcess, FakeIMProcess, write_config
from support import envelope, free_port, insert_events, insert_rows, wait_until

from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.producer import MARK_PUBLISHED

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SCRAPE_INTERVAL = "1s"
#: Queries of panels and alerts whose metrics come from another process than `room-outbox run`
#: (their promtool unit tests are in test_stack_configs), and that process's scrape job.
FROM_OTHER_PROCESSES = {
    name: "room-outbox consume"
    for name in (
        "room_outbox_consumer_lag",
        "room_outbox_consumer_assigned_partitions",
        "room_outbox_consumer_retrying",
        "room_outbox_consumer_dead_total",
    )
}
OTHER_JOBS = ('job="room-outbox-consume"',)
#: Alerts the traffic below must make active (pending while their `for` runs, or firing).
PROVOKED = {"RoomOutboxDeliveryFailing", "RoomOutboxDeliveryFailingForGood", "RoomOutboxLostLeases"}
DEADLOCK = 1213
IM_FAULTS = {"error_rate": 0.1, "error_codes": [10002, 10010], "http_error_rate": 0.03, "latency": 0.05}


class PrometheusProcess:
    """`prometheus` on a loopback port with a temporary data directory."""

    def __init__(self, workdir: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail(
                "prometheus is not installed: install the Debian package prometheus (scripts/test.sh does so as root)",
                pytrace=False,
            )
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "room-outbox", "static_configs": [{"targets": [target]}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    async def ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited: {self.log.read_text()[-2000:]}", pytrace=False)
        try:
            return (await self.client.get("/-/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def query(self, expr: str) -> list[dict[str, Any]]:
        answer = (await self.client.get("/api/v1/query", params={"query": expr})).json()
        assert answer["status"] == "success", f"{expr}: {answer}"
        return list(answer["data"]["result"])

    async def query_range(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": start, "end": end, "step": "1s"}
        answer = (await self.client.get("/api/v1/query_range", params=params)).json()
        assert answer["status"] == "success", f"{expr}: {answer}"
        return list(answer["data"]["result"])

    async def rules(self) -> dict[str, dict[str, Any]]:
        groups = (await self.client.get("/api/v1/rules")).json()["data"]["groups"]
        return {rule["name"]: rule for group in groups for rule in group["rules"]}

    async def aclose(self) -> None:
        await self.client.aclose()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@pytest.fixture
def fake_im(tmp_path: Path) -> Iterator[FakeIMProcess]:
    fake = FakeIMProcess(tmp_path, faults=IM_FAULTS)
    yield fake
    fake.close()


@pytest.fixture
async def dispatcher(database_dsn: str, fake_im: FakeIMProcess, tmp_path: Path) -> AsyncIterator[DispatcherProcess]:
    config = write_config(tmp_path / "c.yaml", database_dsn, fake_im, concurrency=32, lease="2s", parking=True)
    settings = yaml.safe_load(config.read_text())
    settings["telemetry"] = {"http_listen": "127.0.0.1:0", "backlog_interval": "250ms"}
    config.write_text(yaml.safe_dump(settings))
    proc = DispatcherProcess(config, "dispatcher-0")
    try:
        await wait_until(lambda: any(line.get("lifecycle") == "http_started" for line in proc.lines()), timeout=30)
        yield proc
    finally:
        proc.terminate()


def metrics_port(dispatcher: DispatcherProcess) -> int:
    return next(int(line["port"]) for line in dispatcher.lines() if line.get("lifecycle") == "http_started")


@pytest.fixture
async def prometheus(dispatcher: DispatcherProcess, tmp_path: Path) -> AsyncIterator[PrometheusProcess]:
    prometheus = PrometheusProcess(tmp_path, f"127.0.0.1:{metrics_port(dispatcher)}")
    try:
        await wait_until(prometheus.ready, timeout=60, interval=0.2)
        yield prometheus
    finally:
        await prometheus.aclose()


class Traffic:
    """Room events at a steady pace, plus "the producer" publishing some in-flight rows."""

    def __init__(self, store: MySQLStore) -> None:
        self.store = store
        self.inserted = 0

    async def run(self) -> None:
        await insert_rows(self.store, [("default", "broken", "RoomUserJoined", "r_x", "{not json")])
        while True:
            batch = [envelope(f"e{self.inserted + i:06}", room_id=f"r_{i % 16}") for i in range(40)]
            await insert_events(self.store, batch)
            self.inserted += len(batch)
            if self.inserted % 160 == 0:  # about once a second
                await self.producer_publishes_in_flight_rows(2)
                await self.another_claim_takes_in_flight_rows(1)
            await anyio.sleep(0.25)  # the pace of the load, not a synchronisation

    async def producer_publishes_in_flight_rows(self, count: int) -> None:
        """As room-service does when its synchronous push succeeded: status published by
        event_id, here for rows the dispatcher holds, so its result write finds them gone."""
        async with self.store.transaction() as cur:
            await cur.execute(
                "SELECT event_id FROM room_outbox WHERE status = 'pending' AND worker_id IS NOT NULL"
                " AND event_id <> 'broken' LIMIT %s",
                (count,),
            )
            leased = [row[0] for row in await cur.fetchall()]
        for event_id in leased:
            try:
                async with self.store.transaction() as cur:
                    await cur.execute(MARK_PUBLISHED, (event_id,))
            except pymysql.err.OperationalError as exc:
                if exc.args[0] != DEADLOCK:  # the producer retries a deadlock; here the next round does
                    raise

    async def another_claim_takes_in_flight_rows(self, count: int) -> None:
        """As a process whose lease ran out would find: another claim holds a row it is
        delivering, so its result write finds the row taken over."""
        try:
            async with self.store.transaction() as cur:
                await cur.execute(
                    "UPDATE room_outbox SET worker_id = 'other#1' WHERE status = 'pending' AND worker_id IS NOT NULL"
                    " AND worker_id <> 'other#1' AND event_id <> 'broken' LIMIT %s",
                    (count,),
                )
        except pymysql.err.OperationalError as exc:
            if exc.args[0] != DEADLOCK:  # the next round takes another
                raise


async def all_return_series(prometheus: PrometheusProcess, queries: list[Query], missing: list[str]) -> bool:
    missing[:] = [f"{q.source}: {q.expr}" for q in queries if not await prometheus.query(q.expr)]
    return not missing


async def provoked_alerts_active(prometheus: PrometheusProcess) -> bool:
    """Every rule of alerts.yml is loaded and evaluates cleanly; the provoked ones are active."""
    rules = await prometheus.rules()
    assert set(rules) == {rule["alert"] for rule in alert_rules()}
    assert all(rule["health"] == "ok" for rule in rules.values()), rules
    return all(rules[name]["state"] in ("pending", "firing") for name in PROVOKED)


@pytest.mark.timeout(300)  # its own deadlines (start-up 60 s, series 90 s, alerts 60 s) say what failed
async def test_every_alert_and_dashboard_query_returns_series_from_a_dispatcher_under_load(
    store: MySQLStore, fake_im: FakeIMProcess, dispatcher: DispatcherProcess, prometheus: PrometheusProcess
) -> None:
    started = time.time()
    queries = [q for q in alert_queries() + panel_queries() if the_dispatchers(q)]
    missing: list[str] = []
    async with anyio.create_task_group() as load:
        load.start_soon(Traffic(store).run)
        try:
            await wait_until(lambda: all_return_series(prometheus, queries, missing), timeout=90, interval=0.5)
        except pytest.fail.Exception:
            load.cancel_scope.cancel()
        else:
            await wait_until(lambda: provoked_alerts_active(prometheus), timeout=60, interval=0.5)
            if os.environ.get("ROOM_OUTBOX_DASHBOARD_PNG"):
                await outage_and_recovery(prometheus, fake_im)
            load.cancel_scope.cancel()
    assert not missing, f"no series for: {missing}"
    rules = await prometheus.rules()
    assert rules["RoomOutboxDown"]["state"] == "inactive"

    # The panels fed by other processes really are not the dispatcher's: if one ever is, it
    # belongs in the checks above.
    names = (await prometheus.client.get("/api/v1/label/__name__/values")).json()["data"]
    assert not set(FROM_OTHER_PROCESSES) & set(names)
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"} <= set(names)

    if path := os.environ.get("ROOM_OUTBOX_DASHBOARD_PNG"):
        from plot_dashboard import draw

        series = {q.source: await prometheus.query_range(q.expr, started, time.time()) for q in panel_queries()}
        draw(series, Path(path))


def the_dispatchers(query: Query) -> bool:
    """Whether ``query`` reads what a dispatcher reports (or its scrape job)."""
    return not metric_names(query.expr) & set(FROM_OTHER_PROCESSES) and not any(j in query.expr for j in OTHER_JOBS)


async def outage_and_recovery(prometheus: PrometheusProcess, fake_im: FakeIMProcess) -> None:
    """For the picture: steady delivery, Tencent IM answering 503 until the backlog is clearly
    up, recovery until it has drained, steady again."""

    async def value(expr: str) -> float:
        result = await prometheus.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    async def delivered_more(than: float) -> bool:
        return await value("sum(room_outbox_publish_success_total)") >= than + 3000

    async def backlog(above: float | None = None, below: float | None = None) -> bool:
        pending = await value("sum(room_outbox_pending)")
        return (above is None or pending > above) and (below is None or pending < below)

    delivered = await value("sum(room_outbox_publish_success_total)")
    await wait_until(lambda: delivered_more(delivered), timeout=120, interval=0.5)
    baseline = await value("sum(room_outbox_pending)")
    fake_im.set_faults(**{**IM_FAULTS, "http_error_rate": 1.0})
    await wait_until(lambda: backlog(above=baseline + 1500), timeout=120, interval=0.5)
    fake_im.set_faults(**IM_FAULTS)
    await wait_until(lambda: backlog(below=baseline + 60), timeout=180, interval=0.5)
    delivered = await value("sum(room_outbox_publish_success_total)")
    await wait_until(lambda: delivered_more(delivered), timeout=120, interval=0.5)
