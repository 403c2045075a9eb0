"""What the sink makes of every kind of answer (DESIGN.md §2.3), and what its errors say."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest
from aiohttp import web
from im_support import event, im_section, make_sink

from room_outbox.config import Settings
from room_outbox.delivery.routing import build_router
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.tencent_im.errors import (
    APP_RATE_CODES,
    ERROR_INFO_MAX,
    GROUP_RATE_CODES,
    PERMANENT_CODES,
    RETRYABLE_CODES,
)
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID, FakeTencentIM
from room_outbox.plugins.tencent_im.settings import TencentIMSettings
from room_outbox.plugins.tencent_im.sink import TencentIMSink
from room_outbox.sink import PermanentSinkError, RetryableSinkError, SinkContext, ThrottledSinkError

pytestmark = pytest.mark.anyio

DESIGN_RETRYABLE = [10002, 10006, 10023, 60007, 60008, 60011, 60014, 60018, 60019]
DESIGN_PERMANENT = [10003, 10004, 10007, 10010, 10015, 10016, 10017, 80001, 80002,
                    70003, 70009, 70013, 70014, 70016, 70020, 70051, 70107]  # fmt: skip


#: Tencent's rate limits: the app's requests (60007 REST calls, 60011 the SDKAppID's), the
#: group's messages (10023).
DESIGN_RATE = [10023, 60007, 60011]


def test_tables_match_design() -> None:
    assert set(DESIGN_RETRYABLE) | {70001} == RETRYABLE_CODES
    assert set(DESIGN_RATE) == APP_RATE_CODES | GROUP_RATE_CODES and set(DESIGN_RATE) <= RETRYABLE_CODES
    assert set(DESIGN_PERMANENT) == PERMANENT_CODES


@pytest.mark.parametrize(
    ("code", "kind"),
    [(c, RetryableSinkError) for c in [*DESIGN_RETRYABLE, 12345] if c not in DESIGN_RATE]  # unknown: retryable
    + [(c, ThrottledSinkError) for c in DESIGN_RATE]  # retryable, and no attempt
    + [(c, PermanentSinkError) for c in DESIGN_PERMANENT],
)
async def test_error_code_classification(fake: FakeTencentIM, code: int, kind: type[Exception]) -> None:
    secrets: list[str] = []
    sink = make_sink(fake, secrets)
    fake.set_faults(fail_next=[code])
    try:
        with pytest.raises(kind) as info:
            await sink.deliver(event("e1"))
    finally:
        await sink.aclose()
    assert type(info.value) is kind
    text = str(info.value)
    assert f"ErrorCode {code}" in text and "injected failure" in text  # code and ErrorInfo
    assert secrets and not any(secret in text for secret in secrets)  # neither key nor UserSig
    assert fake.messages == []


async def test_usersig_expired_is_regenerated_once_and_retried(fake: FakeTencentIM) -> None:
    secrets: list[str] = []
    sink = make_sink(fake, secrets)
    fake.set_faults(fail_next=[70001])
    try:
        await sink.deliver(event("e1"))
        assert fake.event_ids() == ["e1"]
        assert [a.error_code for a in fake.arrivals] == [70001, 0]
        # The key, then each distinct UserSig once: the regenerated one is the first again
        # when made within the same second (its issue time is in whole seconds).
        assert secrets[0] == DEV_KEY and len(secrets) == len(set(secrets)) in (2, 3)
        assert secrets[-1] == sink._apps_by_code["default"].usersig.get()

        fake.set_faults(fail_next=[70001, 70001])  # still expired after regenerating: retry later
        with pytest.raises(RetryableSinkError, match="ErrorCode 70001"):
            await sink.deliver(event("e2"))
        assert [a.error_code for a in fake.arrivals][-2:] == [70001, 70001]
    finally:
        await sink.aclose()


async def test_msg_drop_reason_is_a_retryable_failure(fake: FakeTencentIM) -> None:
    """MsgFreqCtrl (the group's rate control dropped it): throttled, as a 10023; any other
    reason: a plain retryable failure."""
    sink = make_sink(fake)
    fake.set_faults(drop_rate=1.0)
    try:
        with pytest.raises(ThrottledSinkError, match="MsgDropReason MsgFreqCtrl"):
            await sink.deliver(event("e1"))
        fake.set_faults(drop_reason="SomethingElse")
        with pytest.raises(RetryableSinkError, match="MsgDropReason SomethingElse") as info:
            await sink.deliver(event("e2", room_id="r_2"))
        assert type(info.value) is RetryableSinkError
        assert str(info.value).endswith("(GroupId r_2, app default)")  # room ids repeat across apps
    finally:
        await sink.aclose()
    assert fake.messages == []


async def test_http_5xx_is_retryable_and_never_quotes_the_body(fake: FakeTencentIM) -> None:
    sink = make_sink(fake)
    fake.set_faults(http_error_rate=1.0, http_status=503)
    try:
        with pytest.raises(RetryableSinkError) as info:
            await sink.deliver(event("e1"))
    finally:
        await sink.aclose()
    assert "HTTP 503" in str(info.value) and "html" not in str(info.value)
    assert str(info.value).endswith(", app default)")  # which app's endpoint failed


@asynccontextmanager
async def serving(
    handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
    context: SinkContext | None = None,
    **settings: Any,
) -> AsyncIterator[TencentIMSink]:
    """A sink (with these ``settings``, and ``context`` if given) whose Tencent IM is a loopback
    server answering every request with ``handle``."""
    app = web.Application()
    app.router.add_route("*", "/{path:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        validated = TencentIMSettings(base_url=base_url, sdkappid=DEV_SDKAPPID, secret_key=DEV_KEY, **settings)
        sink = TencentIMSink(validated, context or SinkContext("t", logging.getLogger("t")))
        try:
            yield sink
        finally:
            await sink.aclose()
    finally:
        await runner.cleanup()


def answering(status: int, body: bytes) -> AbstractAsyncContextManager[TencentIMSink]:
    """A sink whose Tencent IM gives every request this answer."""

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(status=status, body=body)

    return serving(handle)


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (200, b"<html>proxy says hi</html>"),  # not JSON
        (200, b'{"unexpected": true}'),  # JSON, but not Tencent's answer
        (200, b"[1, 2]"),
        (404, b'{"ActionStatus": "OK", "ErrorCode": 0}'),  # non-200, whatever the body
        (301, b""),  # a redirect is not followed
    ],
)
async def test_unexpected_answers_are_retryable(status: int, body: bytes) -> None:
    async with answering(status, body) as sink:
        with pytest.raises(RetryableSinkError) as info:
            await sink.deliver(event("e1"))
    assert "proxy says hi" not in str(info.value)
    assert f"HTTP {status}" in str(info.value) if status != 200 else "unexpected answer" in str(info.value)


async def test_error_info_is_bounded_and_masks_a_usersig() -> None:
    info = "bad usersig=eJyrVgrxCdYrSy1S&x " + "y" * 1000
    answer = {"ActionStatus": "FAIL", "ErrorCode": 70009, "ErrorInfo": info}
    async with answering(200, json.dumps(answer).encode()) as sink:
        with pytest.raises(PermanentSinkError) as error:
            await sink.deliver(event("e1"))
    text = str(error.value)
    assert "eJyrVgrxCdYrSy1S" not in text and "usersig=[REDACTED]" in text
    assert len(text) < 300


async def test_error_info_echoing_the_usersig_keeps_none_of_it() -> None:
    """An ErrorInfo quoting the request's UserSig (a gateway echoing the query) longer than the
    bound: the sink masks its own secrets before it cuts the text, so no prefix of the UserSig
    survives for the process's redactor (whole tokens only) to miss."""

    def quoting(usersig: str) -> str:
        """The UserSig behind words enough that the cut falls in its middle, whatever its length
        (it varies with the time it was made at)."""
        return "bad sig " + "pad " * max(0, (ERROR_INFO_MAX - 8 - len(usersig) // 2) // 4) + usersig

    async def echo(request: web.Request) -> web.Response:
        await request.read()
        answer = {"ActionStatus": "FAIL", "ErrorCode": 70009, "ErrorInfo": quoting(request.query["usersig"])}
        return web.Response(status=200, body=json.dumps(answer).encode(), content_type="application/json")

    async with serving(echo) as sink:
        usersig = sink._apps_by_code["default"].usersig.get()
        assert len(quoting(usersig)) - len(usersig) < ERROR_INFO_MAX < len(quoting(usersig))  # cut inside it
        with pytest.raises(PermanentSinkError) as error:
            await sink.deliver(event("e1"))
    process = Redactor()  # what the dispatcher masks with, told every secret of the sink
    process.add(usersig)
    text = process.redact(str(error.value))
    assert "ErrorCode 70009" in text and "bad sig" in text
    assert usersig[:16] not in text  # not even a prefix of it


async def test_timeouts_and_refused_connections_are_retryable(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, request_timeout="200ms")
    fake.set_faults(hang_rate=1.0)
    try:
        with pytest.raises(RetryableSinkError, match="timeout"):
            await sink.deliver(event("e1"))
    finally:
        await sink.aclose()
    closed = make_sink(fake, base_url="http://127.0.0.1:9")  # discard port: nothing listens
    try:
        with pytest.raises(RetryableSinkError, match="network error") as info:
            await closed.deliver(event("e1"))
    finally:
        await closed.aclose()
    assert "Timeout" not in str(info.value)  # named by its cause: the transport calls it ConnectTimeout


async def test_request_timeout_bounds_the_whole_request_not_each_read() -> None:
    """An answer trickling in a byte every 0.1 s is cut off at request_timeout (0.3 s), though
    no single read waits that long; left alone it would end in a valid OK."""
    answer = b'{"ActionStatus": "OK", "ErrorCode": 0}'.ljust(40)

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(answer)
        await response.prepare(request)
        for byte in answer:
            await anyio.sleep(0.1)
            await response.write(bytes([byte]))
        return response

    async with serving(trickle, request_timeout="300ms") as sink:
        with anyio.fail_after(10), pytest.raises(RetryableSinkError, match=r"^timeout \(TimeoutError\)"):
            await sink.deliver(event("e1"))


async def test_no_cookie_from_an_answer_is_sent_back() -> None:
    cookies: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        response = web.json_response({"ActionStatus": "OK", "ErrorCode": 0})
        response.set_cookie("session", "abc")
        return response

    async with serving(handle) as sink:
        await sink.deliver(event("e1"))
        await sink.deliver(event("e2"))
    assert cookies == [None, None]


async def test_an_answer_that_is_not_http_is_a_network_error() -> None:
    async def answer_garbage(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.receive()
            await stream.send(b"garbage\r\n\r\n")

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, answer_garbage)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        settings = TencentIMSettings(base_url=f"http://127.0.0.1:{port}", sdkappid=DEV_SDKAPPID, secret_key=DEV_KEY)
        secrets: list[str] = []
        sink = TencentIMSink(settings, SinkContext("t", __import__("logging").getLogger("t"), secrets.append))
        try:
            with anyio.fail_after(10), pytest.raises(RetryableSinkError, match=r"^network error") as info:
                await sink.deliver(event("e1"))
        finally:
            await sink.aclose()
            tg.cancel_scope.cancel()
    assert secrets and not any(secret in str(info.value) for secret in secrets)  # neither key nor UserSig


async def test_oversized_message_is_permanent_without_a_request(fake: FakeTencentIM) -> None:
    sink = make_sink(fake)
    try:
        with pytest.raises(PermanentSinkError, match=r"at most 8000"):
            await sink.deliver(event("big", payload={"blob": "x" * 8000}))
        await sink.deliver(event("fits", payload={"blob": "x" * 7700}))
    finally:
        await sink.aclose()
    assert [a.group_id for a in fake.arrivals] == ["r_1"]  # only the one that fits was sent
    assert fake.event_ids() == ["fits"]


async def test_the_fake_refuses_what_the_sink_would_have_refused(fake: FakeTencentIM) -> None:
    """The client-side size check matches Tencent's rule as the fake implements it."""
    sink = make_sink(fake, max_message_bytes=12000)
    try:
        with pytest.raises(PermanentSinkError, match="ErrorCode 80002"):
            await sink.deliver(event("big", payload={"blob": "x" * 8000}))
    finally:
        await sink.aclose()


async def test_an_empty_room_id_is_permanent_without_a_request(fake: FakeTencentIM) -> None:
    """A producer that wrote no room (silk's NULL aggregate_id, a V1 row's room_id '') gives no
    group: refused at once, naming the empty room_id, while the next event goes out."""
    sink = make_sink(fake)
    try:
        with pytest.raises(PermanentSinkError, match=r"^room_id is empty \(room_id holds no room\)"):
            await sink.deliver(event("no-room", room_id=""))
        await sink.deliver(event("roomed"))
    finally:
        await sink.aclose()
    assert fake.event_ids() == ["roomed"]
    assert [a.group_id for a in fake.arrivals] == ["r_1"]  # no request for the empty one


async def test_an_empty_group_id_is_permanent_without_a_request(fake: FakeTencentIM) -> None:
    sink = make_sink(fake, group_id_template="{app_code}")
    try:
        with pytest.raises(PermanentSinkError, match=r"app_code is empty: group_id_template '\{app_code\}'"):
            await sink.deliver(event("no-app", app_code=""))
    finally:
        await sink.aclose()
    assert fake.arrivals == []


async def test_an_empty_room_id_names_the_profiles_column(fake: FakeTencentIM) -> None:
    """The sink built for a run names the producer's column: silk's aggregate_id."""
    settings = Settings(
        node_id="test",
        database={"dsn": "postgresql://postgres@127.0.0.1:5432/room", "profile": "silk"},
        sinks={"tencent_im": im_section(fake)},
    )
    router = await build_router(make_plugin_manager(), settings, Redactor())
    try:
        _, sink = router.sink_for("RoomUserJoined") or pytest.fail("no sink for RoomUserJoined")
        with pytest.raises(PermanentSinkError, match=r"room_id is empty \(outbox_events\.aggregate_id holds no room\)"):
            await sink.deliver(event("no-aggregate", room_id=""))
    finally:
        await router.aclose()
    assert fake.arrivals == []


async def test_app_code_without_credentials_fails_clearly(fake: FakeTencentIM) -> None:
    sink = make_sink(fake)
    try:
        with pytest.raises(PermanentSinkError, match=r"no Tencent IM credentials for app_code 'game2'.*apps\.game2"):
            await sink.deliver(event("e1", app_code="game2"))
    finally:
        await sink.aclose()
    assert fake.arrivals == []


async def test_each_app_code_uses_its_own_credentials(fake: FakeTencentIM) -> None:
    fake.apps[1400000002] = "second-app-key"
    sink = make_sink(fake, apps={"game2": {"sdkappid": 1400000002, "secret_key": "second-app-key"}})
    try:
        await sink.deliver(event("a", app_code="default"))
        await sink.deliver(event("b", app_code=""))
        await sink.deliver(event("c", app_code="game2"))
    finally:
        await sink.aclose()
    assert [(m.event_id, m.sdkappid) for m in fake.messages] == [
        ("a", DEV_SDKAPPID),
        ("b", DEV_SDKAPPID),
        ("c", 1400000002),
    ]
    assert json.loads(fake.messages[2].data or "")["app_code"] == "game2"


async def test_usersigs_renewed_over_and_over_keep_the_secrets_masked_bounded(fake: FakeTencentIM) -> None:
    """This host's clock behind Tencent's by more than usersig_ttl: Tencent answers every
    UserSig 70001, and each delivery makes a new one. Each was registered as a secret for
    good, and every registration rebuilds one pattern over all of them: memory and CPU grew
    without bound (687 MB after 11 minutes in QA's run). The process masks the UserSig in use
    and the one before it; the rest are let go."""
    fake.wall_clock = lambda: time.time() + 2 * 86_400  # Tencent two days ahead of this host
    redactor = Redactor()
    context = SinkContext(
        "test", logging.getLogger("test.tencent_im"), add_secret=redactor.add, remove_secret=redactor.discard
    )
    sink = TencentIMSink(TencentIMSettings.model_validate(im_section(fake)), context)
    seconds = iter(range(1_700_000_000, 1_800_000_000, 7))  # each UserSig made in another second
    sink._apps_by_code["default"].usersig.clock = lambda: float(next(seconds))
    usersigs: list[str] = []
    made = sink._apps_by_code["default"].usersig.on_new
    sink._apps_by_code["default"].usersig.on_new = lambda sig: (usersigs.append(sig), made(sig))[1]
    try:
        for n in range(30):
            with pytest.raises(RetryableSinkError, match="70001"):
                await sink.deliver(event(f"e{n}"))
    finally:
        await sink.aclose()
    assert len(set(usersigs)) >= 30  # a new UserSig at least once a delivery
    masked = [sig for sig in usersigs if sig in redactor]
    assert masked == usersigs[-2:]  # the one in use and the one before it
    assert redactor.redact(f"usersig={usersigs[-1]}") == "usersig=[REDACTED]"
    assert len(redactor._secrets) == 3  # with the secret key


async def test_usersigs_renewed_at_once_by_concurrent_deliveries_stay_masked() -> None:
    """Three deliveries answered 70001 at once each renew the UserSig within one second: the
    same UserSig three times (its issue time is in whole seconds). Kept once per renewal, it
    pushed itself out of the kept UserSigs and was unmasked while still in use: the next
    error quoting it showed it in clear, in last_error and in the logs."""
    expired_answers = 3
    all_arrived = anyio.Event()
    arrived = 0

    async def handle(request: web.Request) -> web.Response:
        nonlocal arrived
        await request.read()
        arrived += 1
        if arrived <= expired_answers:  # held until all three are in flight together
            if arrived == expired_answers:
                all_arrived.set()
            await all_arrived.wait()
            answer = {"ActionStatus": "FAIL", "ErrorCode": 70001, "ErrorInfo": "UserSig expired"}
        else:  # a gateway quoting the UserSig it was sent, as a word of its own
            answer = {"ActionStatus": "FAIL", "ErrorCode": 10002, "ErrorInfo": f"error for {request.query['usersig']}"}
        return web.json_response(answer)

    process = Redactor()  # what the dispatcher's last_error and the log formatters mask with
    context = SinkContext("t", logging.getLogger("t"), add_secret=process.add, remove_secret=process.discard)
    async with serving(handle, context=context) as sink:
        cache = sink._apps_by_code["default"].usersig
        cache.clock = lambda: 1_700_000_000.5  # every UserSig made within one second
        errors: list[str] = []

        async def deliver(event_id: str) -> None:
            with pytest.raises(RetryableSinkError) as info:
                await sink.deliver(event(event_id, room_id=f"r_{event_id}"))
            errors.append(str(info.value))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for n in range(expired_answers):
                    tg.start_soon(deliver, f"e{n}")
        usersig = cache.get()
    assert arrived == 2 * expired_answers  # each retried once with the renewed UserSig
    assert len(errors) == expired_answers and all("ErrorCode 10002" in text for text in errors)
    assert not any(usersig in text for text in errors)  # the sink's own error texts
    assert usersig in process
    assert process.redact(f"delivery failed: error for {usersig}") == "delivery failed: error for [REDACTED]"


async def test_a_key_or_usersig_glued_to_other_characters_in_error_info_is_masked() -> None:
    """Tencent's ErrorInfo quoting a secret glued to a word (``appkey_<key>``,
    ``sig_<UserSig>_end``): masked in the sink's error text and by the process's redactor."""

    async def echo(request: web.Request) -> web.Response:
        await request.read()
        info = f"appkey_{DEV_KEY} mismatch, sig_{request.query['usersig']}_end"
        return web.json_response({"ActionStatus": "FAIL", "ErrorCode": 70009, "ErrorInfo": info})

    process = Redactor()
    context = SinkContext("t", logging.getLogger("t"), add_secret=process.add, remove_secret=process.discard)
    async with serving(echo, context=context) as sink:
        with pytest.raises(PermanentSinkError) as error:
            await sink.deliver(event("e1"))
        usersig = sink._apps_by_code["default"].usersig.get()
    text = str(error.value)
    assert "appkey_[REDACTED] mismatch, sig_[REDACTED]_end" in text
    assert DEV_KEY not in text and usersig not in text
    quoted = f"Tencent said: appkey_{DEV_KEY} mismatch, sig_{usersig}_end"
    assert process.redact(quoted) == "Tencent said: appkey_[REDACTED] mismatch, sig_[REDACTED]_end"
