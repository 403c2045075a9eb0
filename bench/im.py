"""(b) The Tencent IM sink against the fake IM (in its own process) over HTTP.

* **overhead**: the client-side limits lifted out of the way; the sink alone and the whole
  lane (claim, deliver, record) against a bare loop of the sink's HTTP client (httpx on
  aiohttp's transport, made as the sink makes it) posting the same requests (same URL, query
  and body, built the same way) to the same fake, 16 in flight each, the same number of
  events. Beside them, the same bare loop on httpx's own transport (httpcore): the measure
  behind the sink's choice of transport. The events are split into many short rounds; the variants take turns
  within each round (the first one moves from round to round), the fake is emptied before
  each, and a variant's ratio is the median of its per-round ratios: neighbours in time
  share the machine's load, which on a shared machine moves the rates by tens of percent
  from one second to the next. Also this process's CPU time per event, which the load
  moves less.
* **quota**: the default 200 requests/s, the fake enforcing 200/s as Tencent does
  (ErrorCode 60011 above it): the share of the quota used, the rate-limit errors, and how
  long each app-limiter slot was busy (acquire to release), which bounds the share at
  ``1 / (1 + JITTER_MARGIN + busy)``, and the share of one core this process was busy.
"""

from __future__ import annotations

import json
import logging
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import anyio
import httpx

from bench import procs
from bench.db import IM_TYPE, load, pending, reset
from bench.drive import run_until_empty
from bench.noop import InTurnDispatcher
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router
from room_outbox.envelope import KNOWN_EVENT_TYPES, EventEnvelope
from room_outbox.plugins.noop import NoopSink
from room_outbox.plugins.tencent_im import TencentIMSettings
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID
from room_outbox.plugins.tencent_im.message import SEND_GROUP_MSG, group_id_for, msg_body, request_body
from room_outbox.plugins.tencent_im.ratelimit import JITTER_MARGIN, SlidingWindowLimiter
from room_outbox.plugins.tencent_im.sink import TencentIMSink, http_client
from room_outbox.plugins.tencent_im.usersig import gen_usersig
from room_outbox.sink import SinkContext
from room_outbox.store.backends.mysql import MySQLStore

CONCURRENCY = 16
ROOMS = 100
#: Rounds of the overhead measurement (each variant once per round, on its share of the events).
ROUNDS = 9


def envelopes(count: int, prefix: str) -> list[EventEnvelope]:
    return [
        EventEnvelope(
            event_id=f"{prefix}{n}",
            event_type=IM_TYPE,
            room_id=f"r_{n % ROOMS}",
            app_code="default",
            room_version=1,
            occurred_at_ms=int(time.time() * 1000),
            payload={"user_id": "u1", "note": "x" * 120},
        )
        for n in range(count)
    ]


def im_settings(base_url: str, **overrides: Any) -> TencentIMSettings:
    return TencentIMSettings.model_validate(
        {"base_url": base_url, "sdkappid": DEV_SDKAPPID, "secret_key": DEV_KEY, **overrides}
    )


def make_sink(base_url: str, **overrides: Any) -> TencentIMSink:
    context = SinkContext("tencent_im", logging.getLogger("bench.tencent_im"), add_secret=lambda _s: None)
    return TencentIMSink(im_settings(base_url, **overrides), context)


def unlimited(base_url: str) -> TencentIMSink:
    """The sink with its limits lifted and its UserSig made, as the bare loop's is before its
    measurement (a running sink makes one every 12 hours)."""
    sink = make_sink(base_url, app_rate_limit=1_000_000, group_rate_limit=1_000_000)
    for app in sink._apps_by_code.values():
        app.usersig.get()
    return sink


@dataclass
class Run:
    rate: float  # events per second
    cpu_us: float  # this process's CPU time per event, µs
    timeouts: int = 0  # requests cut off at request_timeout (bare loops only)


async def timed(count: int, work: Awaitable[None]) -> Run:
    """Wall-clock rate and this process's CPU time per event while ``work`` runs."""
    wall, cpu = time.perf_counter(), time.process_time()
    await work
    return Run(count / (time.perf_counter() - wall), (time.process_time() - cpu) / count * 1e6)


async def in_parallel(items: list[Any], work: Callable[[Any], Awaitable[None]]) -> None:
    """``work`` on every item, CONCURRENCY at once."""
    it = iter(items)

    async def worker() -> None:
        for item in it:
            await work(item)

    async with anyio.create_task_group() as tg:
        for _ in range(CONCURRENCY):
            tg.start_soon(worker)


def httpcore_client(settings: TencentIMSettings) -> httpx.AsyncClient:
    """:func:`http_client` on httpx's own transport (httpcore) instead of aiohttp's."""
    limits = httpx.Limits(max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections)
    return httpx.AsyncClient(
        limits=limits,
        timeout=httpx.Timeout(None, connect=settings.connect_timeout),
        headers={"Content-Type": "application/json"},
        trust_env=False,
    )


async def bare_loop(
    base_url: str, events: list[EventEnvelope], make_client: Callable[[TencentIMSettings], httpx.AsyncClient]
) -> Run:
    """The floor of any sink on this client: the same URL, query and body, the client made as
    the sink makes it (pool, timeouts, headers), one timeout per request, the same concurrency,
    the answer read and checked, and nothing else. Like the sink's, the client is made before
    the measurement and closed within it; like the sink, it sends each request's own
    ``random`` in one URL parsed per request."""
    settings = im_settings(base_url)
    usersig = gen_usersig(DEV_SDKAPPID, DEV_KEY, "administrator", 86400)
    query = {"sdkappid": DEV_SDKAPPID, "identifier": "administrator", "usersig": usersig, "contenttype": "json"}
    prefix = f"{base_url}{SEND_GROUP_MSG}?{urlencode(query)}&random="
    client = make_client(settings)
    timeouts = 0

    async def post(envelope: EventEnvelope) -> None:
        nonlocal timeouts
        content = request_body(group_id_for("{room_id}", envelope), envelope, msg_body(envelope), "Normal")
        url = httpx.URL(f"{prefix}{random.getrandbits(32)}")
        try:
            with anyio.fail_after(settings.request_timeout):
                response = await client.post(url, content=content)
        except TimeoutError:  # counted, not retried: a stalled request is part of what is measured
            timeouts += 1
            return
        assert json.loads(response.content)["ErrorCode"] == 0

    async def run() -> None:
        try:
            await in_parallel(events, post)
        finally:
            await client.aclose()

    done = await timed(len(events), run())
    done.timeouts = timeouts
    return done


async def sink_only(sink: TencentIMSink, events: list[EventEnvelope]) -> Run:
    async def run() -> None:
        try:
            await in_parallel(events, sink.deliver)
        finally:
            await sink.aclose()

    return await timed(len(events), run())


def im_router(sink: TencentIMSink) -> Router:
    routes = dict.fromkeys(KNOWN_EVENT_TYPES, "tencent_im")
    return Router({"tencent_im": sink, "noop": NoopSink()}, routes)


async def lane_drain(
    store: MySQLStore,
    sink: TencentIMSink,
    count: int,
    prefix: str,
    batch_size: int = 100,
    cls: type[Dispatcher] = Dispatcher,
) -> Run:
    """The whole lane (claim, deliver, record) with this sink, once ``count`` events are loaded."""
    await reset(store)
    await load(store, count, prefix=prefix, event_type=IM_TYPE, rooms=ROOMS)
    options = LaneOptions(batch_size=batch_size, poll_interval=0.05, concurrency=CONCURRENCY)
    dispatcher = cls(store, im_router(sink), options, "bench")

    async def run() -> None:
        try:
            while await pending(store):
                await run_until_empty(dispatcher)
        finally:
            await sink.aclose()

    return await timed(count, run())


@dataclass
class Variant:
    """One overhead variant's rounds: events/s and this process's CPU µs per event."""

    rates: list[float]
    cpu_us: list[float]
    timeouts: int = 0  # requests cut off at request_timeout, over every round

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_us)

    @property
    def busy(self) -> float:
        """The share of one core this process was busy: idle time is waiting on the fake, the
        database or a batch's slowest request."""
        return self.rate * self.cpu / 1e6

    def ratios(self, baseline: Variant) -> list[float]:
        """Per round: this variant's rate over the baseline's in the same round."""
        return [mine / theirs for mine, theirs in zip(self.rates, baseline.rates, strict=True)]

    def ratio(self, baseline: Variant) -> float:
        return statistics.median(self.ratios(baseline))


@dataclass
class OverheadResult:
    events: int
    rounds: int
    bare: Variant  # the bare loop of the sink's client: the baseline
    bare_httpcore: Variant  # the same on httpx's own transport
    sink: Variant  # TencentIMSink.deliver alone
    lane: Variant  # the whole lane: claim, deliver, record
    lane_in_turn: Variant  # the same with claims in turn with delivery (InTurnDispatcher)
    load: tuple[float, float]  # one-minute load average at the start and at the end


async def run_overhead(store: MySQLStore, events: int, rounds: int = ROUNDS) -> OverheadResult:
    """``events`` per variant, in ``rounds`` rounds."""
    load_before = os.getloadavg()[0]
    per_round = events // rounds
    with procs.fake_im_process() as base_url:
        # Each variant's events and sink are made before its measurement starts.
        runs: dict[str, Callable[[str], Awaitable[Run]]] = {
            "bare": lambda prefix: bare_loop(base_url, envelopes(per_round, prefix), http_client),
            "bare_httpcore": lambda prefix: bare_loop(base_url, envelopes(per_round, prefix), httpcore_client),
            "sink": lambda prefix: sink_only(unlimited(base_url), envelopes(per_round, prefix)),
            "lane": lambda prefix: lane_drain(store, unlimited(base_url), per_round, prefix),
            "lane_in_turn": lambda prefix: lane_drain(
                store, unlimited(base_url), per_round, prefix, cls=InTurnDispatcher
            ),
        }
        await runs["bare"]("w")  # warm-up: connections, caches
        await runs["sink"]("v")
        results = {name: Variant([], []) for name in runs}
        names = list(runs)
        for n in range(rounds):
            for name in names[n % len(names) :] + names[: n % len(names)]:
                procs.clear(base_url)
                run = await runs[name](f"{name}{n}_")
                results[name].rates.append(run.rate)
                results[name].cpu_us.append(run.cpu_us)
                results[name].timeouts += run.timeouts
    return OverheadResult(per_round * rounds, rounds, **results, load=(load_before, os.getloadavg()[0]))


class TimedLimiter(SlidingWindowLimiter):
    """The app limiter, also recording how long each slot stays busy (acquire to release).
    A slot is taken and released by the same task (one delivery), which pairs the two."""

    def __init__(self, rate: int) -> None:
        super().__init__(rate)
        self.taken: dict[int, float] = {}
        self.busy: list[float] = []

    def _take_free(self) -> bool:  # every slot taken, waited for or not, passes here
        taken = super()._take_free()
        if taken:
            self.taken[anyio.get_current_task().id] = time.monotonic()
        return taken

    def release(self, sent: bool = True) -> None:
        started = self.taken.pop(anyio.get_current_task().id, None)
        if sent and started is not None:
            self.busy.append(time.monotonic() - started)
        super().release(sent)


@dataclass
class QuotaResult:
    events: int
    quota: int
    rate: float  # events/s at the fake, steady: over whole limiter cycles
    rate_limit_errors: int  # 60011/10023 answers from the fake
    client_refusals: int  # deliveries our limiter turned away (retried later)
    busy_ms: float  # mean time an app-limiter slot was busy: request latency seen by the sink
    bound: float  # the share the limiter allows at that latency: 1 / (1 + margin + busy)
    cpu_share: float  # this process's CPU time over the drain's wall time: the share of a core


async def run_quota(store: MySQLStore, count: int) -> QuotaResult:
    with procs.fake_im_process() as base_url:
        procs.set_faults(base_url, app_qps_limit=200, group_qps_limit=40)
        sink = make_sink(base_url, reserved_share=0)  # the whole quota: one process, no room-service
        limiter = TimedLimiter(sink.settings.app_rate_limit)
        for app in {id(a): a for a in sink._apps_by_code.values()}.values():
            app.limiter = limiter
        drain = await lane_drain(store, sink, count, "q")
        answer = procs.receipts(base_url)
    times = sorted(answer["receipts"].values())  # type: ignore[union-attr,attr-defined,unused-ignore]
    codes: dict[str, int] = answer["codes"]  # type: ignore[assignment]
    errors = codes.get("60011", 0) + codes.get("10023", 0)
    async with store.transaction() as cur:
        await cur.execute("SELECT COALESCE(SUM(retry_count), 0) FROM room_outbox")
        refusals = int((await cur.fetchone())[0])
    busy = sum(limiter.busy) / len(limiter.busy)
    # The limiter lets the first 200 go at once, then each slot again one cycle after its
    # answer: the rate over whole cycles (200 m receipts) is the steady one, free of that burst.
    span = 200 * ((len(times) - 1) // 200)
    rate = span / (times[span] - times[0])
    cpu_share = drain.rate * drain.cpu_us / 1e6
    return QuotaResult(count, 200, rate, errors, refusals, busy * 1000, 1 / (1 + JITTER_MARGIN + busy), cpu_share)
