"""Delivery spans: attributes, the producer's trace, sink child spans, secrets kept out."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest
from opentelemetry.trace import SpanKind, StatusCode
from support import RecordingSink, envelope, fetch_rows, insert_events, insert_rows, make_dispatcher, wait_until
from telemetry_support import PRODUCER_SPAN, PRODUCER_TRACE, TRACEPARENT, capture

from bench.drive import run_until_empty
from room_outbox.observability.logs import configure_logging
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.tracing import http_client_span, producer_context, redact_url, sink_span
from room_outbox.sink import PermanentSinkError, RetryableSinkError, ThrottledSinkError
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio

DELIVER = "room_outbox.deliver "


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


async def test_a_published_event_is_one_span_in_the_producers_trace(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1", "RoomGiftSent", "r_9", traceparent=TRACEPARENT)])
    captured = capture()
    dispatcher = make_dispatcher(store, RecordingSink())
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)

    (span,) = captured.spans(DELIVER)
    assert span.name == "room_outbox.deliver RoomGiftSent"
    assert span.kind is SpanKind.PRODUCER
    assert dict(span.attributes or {}) == {
        "event_id": "e1", "event_type": "RoomGiftSent", "room_id": "r_9", "app_code": "default", "sink": "test",
        "retry_count": 0, "outcome": "published", "messaging.system": "test", "messaging.operation.type": "send",
        "messaging.message.id": "e1", "messaging.destination.name": "r_9",
    }  # fmt: skip
    assert span.status.status_code is StatusCode.UNSET
    assert _hex(span.context.trace_id, 32) == PRODUCER_TRACE
    assert span.parent is not None and _hex(span.parent.span_id, 16) == PRODUCER_SPAN and span.parent.is_remote


async def test_retry_then_success_puts_every_attempt_in_the_producers_trace(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1", traceparent=TRACEPARENT)])
    captured = capture()
    sink = RecordingSink(fail={"e1"})
    dispatcher = make_dispatcher(store, sink)
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)
    sink.fail.clear()

    async def published() -> bool:
        await run_until_empty(dispatcher)
        return (await fetch_rows(store))["e1"]["status"] == "published"

    await wait_until(published)
    first, second = sorted(captured.spans(DELIVER), key=lambda s: s.start_time or 0)
    assert {_hex(s.context.trace_id, 32) for s in (first, second)} == {PRODUCER_TRACE}
    assert {_hex(s.parent.span_id, 16) for s in (first, second) if s.parent} == {PRODUCER_SPAN}
    assert first.attributes is not None and second.attributes is not None
    assert (first.attributes["outcome"], first.attributes["error.type"], first.attributes["retry_count"]) == (
        "failed", "retryable", 0,
    )  # fmt: skip
    assert first.status.status_code is StatusCode.ERROR and first.status.description == "test: refused e1"
    assert (second.attributes["outcome"], second.attributes["retry_count"]) == ("published", 1)
    assert "error.type" not in second.attributes


async def test_a_permanent_failure_is_an_error_span_with_its_class(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1", traceparent=TRACEPARENT)])
    captured = capture()
    sink = RecordingSink(fail={"e1"}, error=PermanentSinkError("ErrorCode 10010 group dismissed"))
    dispatcher = make_dispatcher(store, sink)
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)
    (span,) = captured.spans(DELIVER)
    assert span.attributes is not None
    assert (span.attributes["outcome"], span.attributes["error.type"]) == ("failed", "permanent")
    assert span.status.description == "test: permanent: ErrorCode 10010 group dismissed"
    assert _hex(span.context.trace_id, 32) == PRODUCER_TRACE
    assert not span.events  # exceptions are never recorded: their text may hold secrets


async def test_a_throttled_delivery_is_a_span_without_error_and_counts_only_as_throttled(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1", traceparent=TRACEPARENT)])
    captured = capture()
    sink = RecordingSink(fail={"e1"}, error=ThrottledSinkError("own limit", retry_after=60))
    dispatcher = make_dispatcher(store, sink)
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)
    (span,) = captured.spans(DELIVER)
    assert span.attributes is not None and span.attributes["outcome"] == "throttled"
    assert span.status.status_code is not StatusCode.ERROR and "error.type" not in span.attributes
    assert captured.value("room_outbox.publish.throttled", sink="test", event_type="RoomUserJoined") == 1
    assert captured.value("room_outbox.publish.failure") == 0
    assert captured.histogram("room_outbox.publish.duration") == []


async def test_bad_input_still_gets_a_span_without_a_producer(store: MySQLStore) -> None:
    await insert_rows(store, [("", "bad", "RoomUserJoined", "r_1", "{not json")])
    await insert_events(store, [envelope("nosink", "RoomTeleported"), envelope("badtp", traceparent="00-zz-1-01")])
    captured = capture()
    dispatcher = make_dispatcher(store, RecordingSink(), event_types=["RoomUserJoined"])
    dispatcher.telemetry = captured.telemetry
    await run_until_empty(dispatcher)
    spans = {s.attributes["event_id"]: s for s in captured.spans(DELIVER) if s.attributes}
    assert spans["bad"].attributes is not None and spans["bad"].attributes["error.type"] == "bad_envelope"
    assert "messaging.system" not in spans["bad"].attributes and spans["bad"].attributes["sink"] == "-"
    assert spans["nosink"].attributes is not None and spans["nosink"].attributes["error.type"] == "no_route"
    assert spans["badtp"].attributes is not None and spans["badtp"].attributes["outcome"] == "published"
    assert all(s.parent is None for s in spans.values())  # a malformed traceparent starts a new trace


class TracingSink:
    """A sink that makes an HTTP-shaped child span with a secret in its URL."""

    def __init__(self, fail_with: str | None = None) -> None:
        self.fail_with = fail_with

    async def deliver(self, envelope: Any) -> None:
        url = "https://im.example:8443/v4/group_open_http_svc/send_group_msg?sdkappid=1&usersig=eJwSECRETSIG&random=9"
        with http_client_span("POST", url) as span:
            span.set_attribute("http.response.status_code", 200)
            span.set_attribute("leaky", "body mentions eJwSECRETSIG")  # caught by the exporter wrapper
            logging.getLogger("room_outbox.sink.test").warning("sending with eJwSECRETSIG")
            if self.fail_with:
                raise RetryableSinkError(self.fail_with)

    async def aclose(self) -> None:
        pass


async def test_sink_child_span_nests_and_secrets_stay_out_of_spans_logs_and_last_error(store: MySQLStore) -> None:
    await insert_events(store, [envelope("e1", traceparent=TRACEPARENT)])
    redactor = Redactor()
    redactor.add("eJwSECRETSIG")
    captured = capture(redactor)
    sink = TracingSink(fail_with="ErrorCode 70001 usersig eJwSECRETSIG expired")
    dispatcher = make_dispatcher(store, sink, redactor=redactor)
    dispatcher.telemetry = captured.telemetry
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "n1", redactor, stream)
        await run_until_empty(dispatcher)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)

    (attempt,) = captured.spans(DELIVER)
    (http,) = captured.spans("POST ")
    assert http.name == "POST /v4/group_open_http_svc/send_group_msg" and http.kind is SpanKind.CLIENT
    assert http.parent is not None and http.parent.span_id == attempt.context.span_id
    assert http.context.trace_id == attempt.context.trace_id
    assert http.attributes is not None
    assert http.attributes["url.full"] == (
        "https://im.example:8443/v4/group_open_http_svc/send_group_msg?sdkappid=1&usersig=[REDACTED]&random=9"
    )
    assert (http.attributes["server.address"], http.attributes["server.port"]) == ("im.example", 8443)
    assert http.status.status_code is StatusCode.ERROR and http.attributes["error.type"] == "RetryableSinkError"
    everything = json.dumps([json.loads(s.to_json()) for s in captured.spans()])
    assert "eJwSECRETSIG" not in everything and "[REDACTED]" in everything
    assert attempt.status.description == "test: ErrorCode 70001 usersig [REDACTED] expired"

    logs = stream.getvalue()
    assert "eJwSECRETSIG" not in logs
    sink_line = next(json.loads(line) for line in logs.splitlines() if "sending with" in line)
    assert sink_line["trace_id"] == PRODUCER_TRACE  # a sink's log line is tied to its attempt
    assert sink_line["span_id"] == _hex(http.context.span_id, 16)
    failed_line = next(json.loads(line) for line in logs.splitlines() if '"delivery failed' in line)
    # The dispatcher's line on the outcome too, written once the attempt ended: an SRE goes from it to the trace.
    assert (failed_line["trace_id"], failed_line["span_id"]) == (PRODUCER_TRACE, _hex(attempt.context.span_id, 16))
    assert "eJwSECRETSIG" not in (await fetch_rows(store))["e1"]["last_error"]


def test_redact_url_masks_credentials_and_keeps_the_rest() -> None:
    assert redact_url("https://h/p?usersig=abc&identifier=admin&UserSig=x") == (
        "https://h/p?usersig=[REDACTED]&identifier=admin&UserSig=[REDACTED]"
    )
    assert redact_url("https://user:pw@h:1/p?token=t#frag") == "https://user:[REDACTED]@h:1/p?token=[REDACTED]#frag"
    plain = "https://console.tim.qq.com/v4/x?sdkappid=1400000000&random=5"
    assert redact_url(plain) == plain


def test_sink_spans_outside_a_traced_attempt_cost_nothing() -> None:
    with sink_span("anything") as span:
        assert not span.is_recording()
    with http_client_span("GET", "https://h/?usersig=s") as span:
        assert not span.is_recording()


def test_producer_context_ignores_what_is_not_a_traceparent() -> None:
    assert producer_context(None) is None
    assert producer_context("garbage") is None
    assert producer_context("00-" + "0" * 32 + "-" + "1" * 16 + "-01") is None  # all-zero trace id is invalid
    assert producer_context(TRACEPARENT) is not None


async def test_the_tencent_call_is_a_child_span_with_usersig_masked(store: MySQLStore) -> None:
    from im_support import im_dispatcher, im_router

    from room_outbox.plugins.tencent_im.fake import serve_fake_im

    await insert_events(store, [envelope("e1", "RoomGiftSent", "r_9", traceparent=TRACEPARENT)])
    captured = capture()
    async with serve_fake_im() as fake:
        router = await im_router(fake, captured.redactor)
        dispatcher = im_dispatcher(store, router, captured.redactor)
        dispatcher.telemetry = captured.telemetry
        await run_until_empty(dispatcher)
        await router.aclose()
    (attempt,) = captured.spans(DELIVER)
    (http,) = captured.spans("POST ")
    assert http.kind is SpanKind.CLIENT and http.parent is not None
    assert http.parent.span_id == attempt.context.span_id and http.context.trace_id == attempt.context.trace_id
    attributes = dict(http.attributes or {})
    assert attributes["http.response.status_code"] == 200
    url = str(attributes["url.full"])
    assert "/v4/group_open_http_svc/send_group_msg?" in url and "sdkappid=" in url
    assert "usersig=" in url and "usersig=eJ" not in url  # the UserSig itself never reaches a span
