"""Client-side rate limits: never above the configured rates, and fair to quiet rooms."""

from __future__ import annotations

import logging
import math
import random
import time

import anyio
import pytest
from im_support import event, im_dispatcher, im_router, im_section, make_sink
from support import envelope, fetch_rows, insert_events

from bench.drive import run_until_empty
from room_outbox import QuotaShare
from room_outbox.plugins.tencent_im import TencentIMSettings
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID, FakeTencentIM
from room_outbox.plugins.tencent_im.ratelimit import KeyedLimiter, SlidingWindowLimiter
from room_outbox.plugins.tencent_im.sink import TencentIMSink
from room_outbox.sink import RetryableSinkError, SinkContext, ThrottledSinkError
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = [pytest.mark.anyio, pytest.mark.serial]


async def test_a_slot_is_busy_from_start_until_a_window_after_the_answer() -> None:
    """Whatever the latency, no request starts while `rate` others started before it and
    answered less than a window ago (or are still in flight): the server-side guarantee."""
    limiter = SlidingWindowLimiter(rate=3, window=0.2)
    rng = random.Random(5)
    spans: list[tuple[float, float]] = []

    async def request() -> None:
        assert await limiter.acquire(max_wait=10.0)
        start = time.monotonic()
        await anyio.sleep(rng.uniform(0.0, 0.03))  # the request's own latency
        spans.append((start, time.monotonic()))
        limiter.release()

    async with anyio.create_task_group() as tg:
        for _ in range(15):
            tg.start_soon(request)
    for start, _ in spans:
        busy = [s for s, e in spans if s < start and e + 0.2 > start]
        assert len(busy) < 3
    first, last = min(s for s, _ in spans), max(s for s, _ in spans)
    assert last - first < 15 / 3 * (0.2 + 0.03) + 0.2  # the limit is used, not wasted


async def test_a_wait_beyond_max_wait_gets_no_slot() -> None:
    limiter = SlidingWindowLimiter(rate=2, window=0.2)
    assert await limiter.acquire(0.5) and await limiter.acquire(0.5)
    started = time.monotonic()
    assert not await limiter.acquire(0.1)  # both in flight: cannot free within 0.1 s
    assert time.monotonic() - started < 0.05  # refused at once, not after waiting
    limiter.release()
    assert not await limiter.acquire(0.1)  # free again only 0.2 s after the answer
    assert await limiter.acquire(0.5)
    assert time.monotonic() - started >= 0.2
    limiter.release(sent=False)  # never sent: free at once
    assert await limiter.acquire(0.0)


async def test_idle_groups_are_forgotten() -> None:
    limiter = KeyedLimiter(rate=1, window=1.0)
    for i in range(KeyedLimiter._PRUNE_ABOVE):
        group = limiter.get(f"room-{i}")
        assert await group.acquire(0.0)
        group.release(sent=False)
    busy = limiter.get("room-0")
    assert await busy.acquire(0.0)
    limiter.get("fresh")
    assert len(limiter) == 2  # the busy one and the new one
    busy.release()


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
    sink = make_sink(fake, app_rate_limit=10, rate_limit_max_wait="5s", reserved_share=0)
    started = time.monotonic()
    try:
        outcomes = await _deliver_all(sink, [event(f"e{i}", room_id=f"r_{i}") for i in range(15)])
    finally:
        await sink.aclose()
    assert outcomes == [None] * 15
    assert fake.max_in_window(1.0) == 10  # reached, never exceeded, as the server counts
    assert time.monotonic() - started >= 1.0


async def test_group_limit_holds_at_the_server(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, group_rate_limit=8, rate_limit_max_wait="5s", reserved_share=0)
    try:
        outcomes = await _deliver_all(sink, [event(f"e{i}", room_id="hot") for i in range(12)])
    finally:
        await sink.aclose()
    assert outcomes == [None] * 12
    assert fake.max_in_window(1.0, group_id="hot") == 8


async def test_a_hot_room_does_not_starve_the_others(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, group_rate_limit=5, rate_limit_max_wait="200ms", reserved_share=0)
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
    assert all(isinstance(o, ThrottledSinkError) for o in refused)  # never sent: not attempts
    assert all(o.retry_after is not None and 0 < o.retry_after <= 1.1 for o in refused)  # type: ignore[union-attr]
    assert fake.max_in_window(1.0, group_id="hot") == 5


async def test_worker_keeps_quiet_rooms_flowing_and_publishes_the_hot_backlog(
    fake: FakeTencentIM, store: MySQLStore
) -> None:
    router = await im_router(fake, group_rate_limit=10, rate_limit_max_wait="100ms", reserved_share=0)
    await insert_events(store, [envelope(f"hot{i}", room_id="hot") for i in range(20)])
    await insert_events(store, [envelope(f"quiet{i}", room_id=f"r_{i}") for i in range(5)])
    dispatcher = im_dispatcher(store, router)
    try:
        await run_until_empty(dispatcher)  # one round
        rows = await fetch_rows(store)
        assert all(rows[f"quiet{i}"]["status"] == "published" for i in range(5))
        held = [r for r in rows.values() if r["status"] == "pending"]
        assert len(held) == 10  # throttled: no attempt counted, no error recorded
        assert all(r["retry_count"] == 0 and r["last_error"] is None for r in held)

        deadline = time.monotonic() + 10
        while any(r["status"] == "pending" for r in (await fetch_rows(store)).values()):
            assert time.monotonic() < deadline, "hot room backlog not drained"
            await run_until_empty(dispatcher)
            await anyio.sleep(0.05)  # the fixed retry interval of this lane
    finally:
        await router.aclose()
    assert sorted(fake.event_ids()) == sorted([f"hot{i}" for i in range(20)] + [f"quiet{i}" for i in range(5)])
    assert fake.max_in_window(1.0, group_id="hot") <= 10


async def test_a_shrinking_rate_applies_at_once_and_zero_sends_nothing() -> None:
    """A rate given as a function (this process's share) is read at every take: once it
    shrinks, no slot is handed out until fewer than the new rate are busy."""
    rate = [4]
    limiter = SlidingWindowLimiter(lambda: rate[0], window=0.3)
    assert all([await limiter.acquire(0.0) for _ in range(3)])
    rate[0] = 2
    assert not await limiter.acquire(0.0)  # 3 busy, share now 2
    for _ in range(3):
        limiter.release()  # busy for a window after the answers
    assert not await limiter.acquire(0.1)
    rate[0] = 0
    started = time.monotonic()
    assert not await limiter.acquire(0.5)  # nothing, however long the window is over
    assert time.monotonic() - started >= 0.45
    rate[0] = 2
    assert await limiter.acquire(0.2)


async def test_the_reserved_share_is_left_to_room_service(fake: FakeTencentIM) -> None:
    fake.set_faults(app_qps_limit=10)
    sink = make_sink(fake, app_rate_limit=10, rate_limit_max_wait="5s", reserved_share=0.3)
    try:
        outcomes = await _deliver_all(sink, [event(f"e{i}", room_id=f"r_{i}") for i in range(14)])
    finally:
        await sink.aclose()
    assert outcomes == [None] * 14
    assert fake.max_in_window(1.0) == 7  # 10 less 30 %


async def test_slowing_down_holds_a_window_halves_the_rate_once_a_window_and_recovers() -> None:
    """The destination refused for its rate: no slot for a window, then half the rate, growing
    back by a sixteenth of it per window; refusals within the hold (answers to requests sent
    before it) change nothing."""
    now = [0.0]
    limiter = SlidingWindowLimiter(rate=32, window=1.0, clock=lambda: now[0])
    assert limiter.slow_down() == 1
    assert limiter.slow_down() == 0  # the same burst's other refusals
    assert not limiter.try_acquire() and limiter.next_slot_in() == 1.0
    assert not await limiter.acquire(0.0)
    now[0] = 1.0  # the hold is over
    assert limiter.rate == 16
    assert all(limiter.try_acquire() for _ in range(16)) and not limiter.try_acquire()
    for _ in range(16):
        limiter.release(sent=False)
    assert limiter.slow_down() == 2  # refused again after the hold: halved again, the burst's other one told
    now[0] = 2.0
    assert limiter.rate == 8 and limiter.slowed_down and not limiter.idle()
    now[0] = 6.0  # four windows without a refusal: 1/4 + 4/16 of the rate
    assert limiter.rate == 16
    now[0] = 14.0
    assert limiter.rate == 32 and not limiter.slowed_down and limiter.idle()


async def test_a_rate_limit_answer_is_no_attempt_and_slows_down_the_limiter_it_names(fake: FakeTencentIM) -> None:
    """60011 (the app's rate): throttled, due again after the hold, and the app sends nothing
    more for a while, whatever the group; 10023 (the group's): only that group holds back."""
    sink = make_sink(fake, rate_limit_max_wait="100ms", reserved_share=0)
    try:
        fake.set_faults(fail_next=[60011])
        with pytest.raises(ThrottledSinkError, match="ErrorCode 60011") as app_refusal:
            await sink.deliver(event("a1", room_id="r_1"))
        assert app_refusal.value.retry_after is not None and app_refusal.value.retry_after > 0.5
        assert app_refusal.value.refused  # Tencent's refusal: recorded in last_error
        with pytest.raises(ThrottledSinkError, match="client-side rate limit: app") as held_back:
            await sink.deliver(event("a2", room_id="r_2"))  # another group, the same app
        assert not held_back.value.refused  # this process's own limit: not
        assert [a.error_code for a in fake.arrivals] == [60011]  # held back without a request
    finally:
        await sink.aclose()

    fake.reset()
    sink = make_sink(fake, rate_limit_max_wait="100ms", reserved_share=0)
    try:
        fake.set_faults(fail_next=[10023])
        with pytest.raises(ThrottledSinkError, match="ErrorCode 10023") as group_refusal:
            await sink.deliver(event("g1", room_id="hot"))
        assert group_refusal.value.refused
        await sink.deliver(event("g2", room_id="quiet"))  # another group: unaffected
        with pytest.raises(ThrottledSinkError, match="client-side rate limit: group hot"):
            await sink.deliver(event("g3", room_id="hot"))
        fake.set_faults(drop_rate=1.0)  # MsgFreqCtrl: the group's rate control dropped it
        with pytest.raises(ThrottledSinkError, match="MsgFreqCtrl") as dropped:
            await sink.deliver(event("g4", room_id="quiet"))
        assert dropped.value.refused
        fake.set_faults(drop_rate=0.0)
        with pytest.raises(ThrottledSinkError, match="client-side rate limit: group quiet"):
            await sink.deliver(event("g5", room_id="quiet"))
    finally:
        await sink.aclose()
    assert [a.error_code for a in fake.arrivals] == [10023, 0, 0]
    assert fake.event_ids() == ["g2"]


async def test_the_rate_refusal_line_says_how_many_were_refused_since_the_last(
    fake: FakeTencentIM, caplog: pytest.LogCaptureFixture
) -> None:
    """A burst Tencent refuses for the app's rate is one warning when the first refusal comes
    (the others answer requests sent before the slow-down, and change nothing); the next
    warning counts them, so the scale shows, and names one refused event."""
    sink = make_sink(fake, reserved_share=0, rate_limit_max_wait="10s")
    caplog.set_level(logging.WARNING, logger="test.tencent_im")
    fake.set_faults(error_rate=1.0, error_codes=[60011], latency=0.3)  # a burst in flight at once
    refused: list[str] = []

    async def deliver(event_id: str, room_id: str) -> None:
        with pytest.raises(ThrottledSinkError, match="ErrorCode 60011") as refusal:
            await sink.deliver(event(event_id, room_id=room_id))
        assert refusal.value.refused
        refused.append(event_id)

    def said() -> list[tuple[int, str]]:
        lines = [r for r in caplog.records if r.getMessage().startswith("Tencent IM refused for its rate limit")]
        return [(getattr(r, "refused", None), r.event_id) for r in lines]  # type: ignore[attr-defined]

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as burst:
                for i in range(5):
                    burst.start_soon(deliver, f"b{i}", f"r_{i}")
        assert len(fake.arrivals) == 5 and len(said()) == 1
        assert said()[0] == (1, refused[0])
        with anyio.fail_after(10):
            await deliver("later", "r_9")  # sent once the hold is over: refused again
    finally:
        await sink.aclose()
    assert said() == [(1, refused[0]), (5, "later")]  # the burst's four others, and itself


async def test_app_codes_on_one_sdkappid_share_its_limit(fake: FakeTencentIM) -> None:
    """Tencent counts requests per SDKAppID: two app codes with the same one (an `apps` entry
    and the default app's codes) share one limiter, not one each."""
    sink = make_sink(
        fake,
        app_rate_limit=10,
        reserved_share=0,
        rate_limit_max_wait="100ms",
        default_app_codes=["game1"],
        apps={"game2": {"sdkappid": DEV_SDKAPPID, "secret_key": DEV_KEY}},
    )
    events = [event(f"{code}-{i}", room_id=f"r_{i}", app_code=code) for i in range(15) for code in ("game1", "game2")]
    try:
        outcomes = await _deliver_all(sink, events)
    finally:
        await sink.aclose()
    assert sum(o is None for o in outcomes) == 10  # the rest throttled within the first window
    assert fake.max_in_window(1.0, sdkappid=DEV_SDKAPPID) == 10


async def test_a_group_fed_by_two_app_codes_is_shared_by_their_room_owners(fake: FakeTencentIM) -> None:
    """Per-room ordering, two processes (two sinks, each with its own quota share of two
    nodes), each owning one of the room buckets (game1, r_1) and (game2, r_1), which the
    template "{room_id}" sends to one Tencent group: each keeps half the group limit, not all
    of it (each owner sent the whole limit, twice the group's limit between them)."""
    sinks = []
    for _ in range(2):
        quota = QuotaShare()
        quota.apply(2, math.inf)
        quota.rooms_owned = True
        settings = TencentIMSettings.model_validate(
            im_section(
                fake,
                group_rate_limit=10,
                reserved_share=0,
                rate_limit_max_wait="100ms",
                group_id_template="{room_id}",
                default_app_codes=["game1", "game2"],
            )
        )
        sinks.append(TencentIMSink(settings, SinkContext("n", logging.getLogger("test"), quota=quota)))
    try:
        async with anyio.create_task_group() as tg:
            for sink, code in zip(sinks, ("game1", "game2"), strict=True):
                tg.start_soon(
                    _deliver_all, sink, [event(f"{code}-{i}", room_id="r_1", app_code=code) for i in range(10)]
                )
    finally:
        for sink in sinks:
            await sink.aclose()
    assert fake.max_in_window(1.0, group_id="r_1") == 10  # 5 each
