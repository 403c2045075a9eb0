"""(b) The Tencent IM sink against the fake IM (in its own process) over HTTP.

* **overhead**: the client-side limits raised out of the way; our sink (and the whole lane:
  claim, deliver, record) against bare httpx loops posting the same requests with the same
  16 in flight: on httpx's default transport (the baseline) and on httpx-aiohttp's
  transport, the sink's default (the practical limit of any sink on it). Also the sink forced
  back onto httpx's default transport (which slows down as concurrency rises).
* **quota**: the default 200 requests/s, the fake enforcing 200/s as Tencent does
  (ErrorCode 60011 above it): the share of the quota used, the rate-limit errors, and how
  long each app-limiter slot was busy (acquire to release), which bounds the share at
  ``1 / (1 + JITTER_MARGIN + busy)``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from bench import procs
from bench.db import IM_TYPE, load, pending, reset
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router
from room_outbox.envelope import KNOWN_EVENT_TYPES, EventEnvelope
from room_outbox.plugins.noop import NoopSink
from room_outbox.plugins.tencent_im import TencentIMSettings, TencentIMSink
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID
from room_outbox.plugins.tencent_im.message import group_id_for, msg_body, request_body
from room_outbox.plugins.tencent_im.ratelimit import JITTER_MARGIN, SlidingWindowLimiter
from room_outbox.plugins.tencent_im.usersig import gen_usersig
from room_outbox.sink import SinkContext
from room_outbox.store.mysql import MySQLStore

CONCURRENCY = 16
ROOMS = 100


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


def make_sink(base_url: str, transport: httpx.AsyncBaseTransport | None = None, **overrides: Any) -> TencentIMSink:
    settings = TencentIMSettings.model_validate(
        {"base_url": base_url, "sdkappid": DEV_SDKAPPID, "secret_key": DEV_KEY, **overrides}
    )
    context = SinkContext("tencent_im", logging.getLogger("bench.tencent_im"), add_secret=lambda _s: None)
    return TencentIMSink(settings, context, transport=transport)


def unlimited(base_url: str, transport: httpx.AsyncBaseTransport | None = None) -> TencentIMSink:
    return make_sink(base_url, transport, app_rate_limit=1_000_000, group_rate_limit=1_000_000)


LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=64)  # the sink's default


def httpx_transport() -> httpx.AsyncBaseTransport:
    """httpx's own transport, which the sink used before httpx-aiohttp's became its default."""
    return httpx.AsyncHTTPTransport(limits=LIMITS)


def aiohttp_transport() -> httpx.AsyncBaseTransport:
    from httpx_aiohttp import AiohttpTransport

    return AiohttpTransport(limits=LIMITS)


async def in_parallel(items: list[Any], work: Callable[[Any], Awaitable[None]]) -> float:
    """``work`` on every item, CONCURRENCY at once; items per second."""
    it = iter(items)

    async def worker() -> None:
        for item in it:
            await work(item)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(CONCURRENCY):
            tg.start_soon(worker)
    return len(items) / (time.perf_counter() - started)


async def bare_loop(
    base_url: str, events: list[EventEnvelope], transport: Callable[[], httpx.AsyncBaseTransport]
) -> float:
    """The floor of any sink on this client and transport: same URL, query, body and
    concurrency, no sink."""
    usersig = gen_usersig(DEV_SDKAPPID, DEV_KEY, "administrator", 86400)
    params = {"sdkappid": str(DEV_SDKAPPID), "identifier": "administrator", "usersig": usersig, "contenttype": "json"}
    url = f"{base_url}/v4/group_open_http_svc/send_group_msg"
    async with httpx.AsyncClient(limits=LIMITS, transport=transport()) as client:

        async def post(envelope: EventEnvelope) -> None:
            content = request_body(group_id_for("{room_id}", envelope), envelope, msg_body(envelope), "Normal")
            response = await client.post(url, params={**params, "random": "1"}, content=content)
            assert json.loads(response.content)["ErrorCode"] == 0

        return await in_parallel(events, post)


async def sink_only(sink: TencentIMSink, events: list[EventEnvelope]) -> float:
    try:
        return await in_parallel(events, sink.deliver)
    finally:
        await sink.aclose()


def im_router(sink: TencentIMSink) -> Router:
    routes = dict.fromkeys(KNOWN_EVENT_TYPES, "tencent_im")
    return Router({"tencent_im": sink, "noop": NoopSink()}, routes)


async def lane_drain(store: MySQLStore, sink: TencentIMSink, count: int, prefix: str, batch_size: int = 100) -> float:
    """Events/s through the whole lane (claim, deliver, record) with this sink."""
    await reset(store)
    await load(store, count, prefix=prefix, event_type=IM_TYPE, rooms=ROOMS)
    options = LaneOptions(batch_size=batch_size, poll_interval=0.05, concurrency=CONCURRENCY)
    dispatcher = Dispatcher(store, im_router(sink), options, "bench")
    started = time.perf_counter()
    try:
        while await pending(store):
            await dispatcher.run_until_empty()
    finally:
        await sink.aclose()
    return count / (time.perf_counter() - started)


@dataclass
class OverheadResult:
    events: int
    bare_httpx: float  # bare loop, httpx's default transport: the baseline
    bare_aiohttp: float  # bare loop, httpx-aiohttp's transport: the practical limit
    sink: float  # the sink as shipped (httpx-aiohttp's transport)
    sink_httpx: float  # the sink forced onto httpx's default transport
    lane: float
    lane_httpx: float


async def run_overhead(store: MySQLStore, events: int) -> OverheadResult:
    with procs.fake_im_process() as base_url:
        await bare_loop(base_url, envelopes(events // 4, "w"), httpx_transport)  # warm-up
        await bare_loop(base_url, envelopes(events // 4, "v"), aiohttp_transport)
        procs.clear(base_url)
        bare = await bare_loop(base_url, envelopes(events, "b"), httpx_transport)
        bare_aio = await bare_loop(base_url, envelopes(events, "c"), aiohttp_transport)
        sink = await sink_only(unlimited(base_url), envelopes(events, "s"))
        sink_httpx = await sink_only(unlimited(base_url, httpx_transport()), envelopes(events, "h"))
        procs.clear(base_url)
        lane = await lane_drain(store, unlimited(base_url), events, "l")
        lane_httpx = await lane_drain(store, unlimited(base_url, httpx_transport()), events, "m")
        procs.clear(base_url)
        # the baselines again, each at its best: drift on a noisy machine favours no variant
        bare = max(bare, await bare_loop(base_url, envelopes(events, "b2"), httpx_transport))
        bare_aio = max(bare_aio, await bare_loop(base_url, envelopes(events, "c2"), aiohttp_transport))
    return OverheadResult(events, bare, bare_aio, sink, sink_httpx, lane, lane_httpx)


class TimedLimiter(SlidingWindowLimiter):
    """The app limiter, also recording how long each slot stays busy (acquire to release)."""

    def __init__(self, rate: int) -> None:
        super().__init__(rate)
        self.taken: dict[int, float] = {}
        self.busy: list[float] = []

    async def acquire(self, max_wait: float) -> int | None:
        slot = await super().acquire(max_wait)
        if slot is not None:
            self.taken[slot] = time.monotonic()
        return slot

    def release(self, slot: int, sent: bool = True) -> None:
        if sent and slot in self.taken:
            self.busy.append(time.monotonic() - self.taken.pop(slot))
        super().release(slot, sent)


@dataclass
class QuotaResult:
    events: int
    quota: int
    rate: float  # events/s at the fake, steady: over whole limiter cycles
    rate_limit_errors: int  # 60011/10023 answers from the fake
    client_refusals: int  # deliveries our limiter turned away (retried later)
    busy_ms: float  # mean time an app-limiter slot was busy: request latency seen by the sink
    bound: float  # the share the limiter allows at that latency: 1 / (1 + margin + busy)


async def run_quota(store: MySQLStore, count: int) -> QuotaResult:
    with procs.fake_im_process() as base_url:
        procs.set_faults(base_url, app_qps_limit=200, group_qps_limit=40)
        sink = make_sink(base_url, reserved_share=0)  # the whole quota: one process, no room-service
        limiter = TimedLimiter(sink.settings.app_rate_limit)
        for app in {id(a): a for a in sink._apps_by_code.values()}.values():
            app.limiter = limiter
        await lane_drain(store, sink, count, "q")
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
    return QuotaResult(count, 200, rate, errors, refusals, busy * 1000, 1 / (1 + JITTER_MARGIN + busy))
