"""Client-side rate limits: never above the configured rates, and fair to quiet rooms."""

from __future__ import annotations

import random
import time

import anyio
import pytest
from im_support import event, im_dispatcher, im_router, make_sink
from support import envelope, fetch_rows, insert_events

from room_outbox.plugins.tencent_im.ratelimit import KeyedLimiter, SlidingWindowLimiter
from room_outbox.sink import RetryableSinkError
from room_outbox.store.mysql import MySQLStore
from room_outbox.testing import FakeTencentIM

pytestmark = pytest.mark.anyio


def test_sliding_window_never_admits_more_than_rate_in_any_window() -> None:
    now = [0.0]
    limiter = SlidingWindowLimiter(rate=7, window=1.0, clock=lambda: now[0])
    rng = random.Random(3)
    starts: list[float] = []
    for _ in range(500):
        now[0] += rng.expovariate(20.0)  # arrivals at ~20/s against a limit of 7/s
        wait = limiter.reserve(max_wait=100.0)
        assert wait is not None
        starts.append(now[0] + wait)
    assert starts == sorted(starts)  # first come, first served
    for i in range(len(starts) - 7):
        assert starts[i + 7] - starts[i] >= 1.0 - 1e-9  # so no 1 s window holds 8 (float rounding aside)
    assert starts[-1] - starts[0] < 500 / 7 + 1  # and the limit is used, not wasted


def test_a_wait_beyond_max_wait_reserves_nothing() -> None:
    limiter = SlidingWindowLimiter(rate=2, window=1.0, clock=lambda: 0.0)
    assert limiter.reserve(0.5) == 0.0
    assert limiter.reserve(0.5) == 0.0
    assert limiter.reserve(0.5) is None
    assert limiter.reserve(1.0) == 1.0  # the refusal did not take the slot


def test_idle_groups_are_forgotten() -> None:
    now = [0.0]
    limiter = KeyedLimiter(rate=1, window=1.0, clock=lambda: now[0])
    for i in range(KeyedLimiter._PRUNE_ABOVE):
        limiter.reserve(f"room-{i}", 0.0)
    now[0] = 5.0
    limiter.reserve("fresh", 0.0)
    assert len(limiter) == 1


async def _deliver_all(sink: object, events: list[object]) -> list[BaseException | None]:
    outcomes: list[BaseException | None] = []

    async def one(e: object) -> None:
        try:
            await sink.deliver(e)  # type: ignore[attr-defined]
        except RetryableSinkError as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)

    async with anyio.create_task_group() as tg:
        for e in events:
            tg.start_soon(one, e)
    return outcomes


async def test_app_limit_holds_at_the_server(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, app_rate_limit=10, rate_limit_max_wait="5s")
    started = time.monotonic()
    try:
        outcomes = await _deliver_all(sink, [event(f"e{i}", room_id=f"r_{i}") for i in range(15)])
    finally:
        await sink.aclose()
    assert outcomes == [None] * 15
    assert fake.max_in_window(1.0) == 10  # reached, never exceeded, as the server counts
    assert time.monotonic() - started >= 1.0


async def test_group_limit_holds_at_the_server(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, group_rate_limit=8, rate_limit_max_wait="5s")
    try:
        outcomes = await _deliver_all(sink, [event(f"e{i}", room_id="hot") for i in range(12)])
    finally:
        await sink.aclose()
    assert outcomes == [None] * 12
    assert fake.max_in_window(1.0, group_id="hot") == 8


async def test_a_hot_room_does_not_starve_the_others(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, group_rate_limit=5, rate_limit_max_wait="200ms")
    hot = [event(f"hot{i}", room_id="hot") for i in range(30)]
    quiet = [event(f"quiet{i}", room_id=f"r_{i}") for i in range(5)]
    started = time.monotonic()
    try:
        outcomes = await _deliver_all(sink, [*hot, *quiet])  # the hot room's backlog first
    finally:
        await sink.aclose()
    assert time.monotonic() - started < 0.5  # nobody waited behind the hot room
    assert {f"quiet{i}" for i in range(5)} <= set(fake.event_ids())
    refused = [o for o in outcomes if o is not None]
    assert len(refused) == 25 and all("client-side rate limit: group hot" in str(o) for o in refused)
    assert fake.max_in_window(1.0, group_id="hot") == 5


async def test_worker_keeps_quiet_rooms_flowing_and_publishes_the_hot_backlog(
    fake: FakeTencentIM, store: MySQLStore
) -> None:
    router = await im_router(fake, group_rate_limit=10, rate_limit_max_wait="100ms")
    await insert_events(store, [envelope(f"hot{i}", room_id="hot") for i in range(20)])
    await insert_events(store, [envelope(f"quiet{i}", room_id=f"r_{i}") for i in range(5)])
    dispatcher = im_dispatcher(store, router)
    try:
        await dispatcher.run_until_empty()  # one round
        rows = await fetch_rows(store)
        assert all(rows[f"quiet{i}"]["status"] == "published" for i in range(5))
        held = [r for r in rows.values() if r["status"] == "pending"]
        assert len(held) == 10 and all("client-side rate limit" in r["last_error"] for r in held)

        deadline = time.monotonic() + 10
        while any(r["status"] == "pending" for r in (await fetch_rows(store)).values()):
            assert time.monotonic() < deadline, "hot room backlog not drained"
            await dispatcher.run_until_empty()
            await anyio.sleep(0.05)  # the fixed retry interval of this lane
    finally:
        await router.aclose()
    assert sorted(fake.event_ids()) == sorted([f"hot{i}" for i in range(20)] + [f"quiet{i}" for i in range(5)])
    assert fake.max_in_window(1.0, group_id="hot") <= 10
