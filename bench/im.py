"""(b) The Tencent IM sink against the fake IM (in its own process) over HTTP.

* **overhead**: the client-side limits raised out of the way; our sink (and the whole lane:
  claim, deliver, record) against a bare httpx loop posting the same requests with the same
  16 in flight. Also the sink with httpx-aiohttp's transport (DESIGN §4: httpx's default
  transport slows down as concurrency rises).
* **quota**: the default 200 requests/s, the fake enforcing 200/s as Tencent does
  (ErrorCode 60011 above it): the share of the quota used, and the rate-limit errors.
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
from room_outbox.dispatcher import Dispatcher, LaneOptions
from room_outbox.envelope import KNOWN_EVENT_TYPES, EventEnvelope
from room_outbox.plugins.noop import NoopSink
from room_outbox.plugins.tencent_im import TencentIMSettings, TencentIMSink
from room_outbox.plugins.tencent_im.message import group_id_for, msg_body, request_body
from room_outbox.plugins.tencent_im.ratelimit import SlidingWindowLimiter
from room_outbox.plugins.tencent_im.usersig import gen_usersig
from room_outbox.routing import Router
from room_outbox.sink import SinkContext
from room_outbox.store.mysql import MySQLStore
from room_outbox.testing import DEV_KEY, DEV_SDKAPPID

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


def aiohttp_transport() -> httpx.AsyncBaseTransport:
    from httpx_aiohttp import AiohttpTransport  # the bench extra

    return AiohttpTransport(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


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


async def bare_httpx(base_url: str, events: list[EventEnvelope]) -> float:
    """The floor of any httpx-based sink: same URL, query, body and concurrency, no sink."""
    usersig = gen_usersig(DEV_SDKAPPID, DEV_KEY, "administrator", 86400)
    params = {"sdkappid": str(DEV_SDKAPPID), "identifier": "administrator", "usersig": usersig, "contenttype": "json"}
    url = f"{base_url}/v4/group_open_http_svc/send_group_msg"
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)) as client:

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
    bare_httpx: float
    sink: float
    sink_aiohttp: float
    lane: float
    lane_aiohttp: float


async def run_overhead(store: MySQLStore, events: int) -> OverheadResult:
    with procs.fake_im_process() as base_url:
        items = envelopes(events, "w")
        await bare_httpx(base_url, items[: events // 4])  # warm-up: connections, caches
        procs.clear(base_url)
        bare = await bare_httpx(base_url, envelopes(events, "b"))
        sink = await sink_only(unlimited(base_url), envelopes(events, "s"))
        sink_aio = await sink_only(unlimited(base_url, aiohttp_transport()), envelopes(events, "a"))
        lane = await lane_drain(store, unlimited(base_url), events, "l")
        lane_aio = await lane_drain(store, unlimited(base_url, aiohttp_transport()), events, "m")
        bare = max(bare, await bare_httpx(base_url, envelopes(events, "b2")))  # the baseline at its best
    return OverheadResult(events, bare, sink, sink_aio, lane, lane_aio)


@dataclass
class QuotaResult:
    events: int
    quota: int
    rate: float  # events/s at the fake, first to last receipt
    rate_limit_errors: int  # 60011/10023 answers from the fake
    client_refusals: int  # deliveries our limiter turned away (retried later)
    tight_rate: float  # variant: limiter window margin 10 ms instead of 50 ms


async def quota_run(
    store: MySQLStore, base_url: str, count: int, prefix: str, margin: float | None
) -> tuple[float, int, int]:
    procs.clear(base_url)
    procs.set_faults(base_url, app_qps_limit=200, group_qps_limit=40)
    sink = make_sink(base_url)
    if margin is not None:  # the variant: the same limiter with a narrower safety margin
        for app in {id(a): a for a in sink._apps_by_code.values()}.values():
            app.limiter = SlidingWindowLimiter(sink.settings.app_rate_limit, window=1.0 + margin)
    await lane_drain(store, sink, count, prefix)
    answer = procs.receipts(base_url)
    times = sorted(answer["receipts"].values())  # type: ignore[union-attr]
    codes: dict[str, int] = answer["codes"]  # type: ignore[assignment]
    errors = codes.get("60011", 0) + codes.get("10023", 0)
    async with store.transaction() as cur:
        await cur.execute("SELECT COALESCE(SUM(retry_count), 0) FROM room_outbox")
        refusals = int((await cur.fetchone())[0])
    return (len(times) - 1) / (times[-1] - times[0]), errors, refusals


async def run_quota(store: MySQLStore, events: int) -> QuotaResult:
    with procs.fake_im_process() as base_url:
        rate, errors, refusals = await quota_run(store, base_url, events, "q", None)
        tight, tight_errors, _ = await quota_run(store, base_url, events, "t", 0.01)
    return QuotaResult(events, 200, rate, errors, refusals, tight if tight_errors == 0 else -tight)
