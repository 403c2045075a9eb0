"""Spans: one per delivery attempt, child spans for sinks, secrets kept out of both.

Every attempt to deliver an event is one span (:class:`AttemptSpan`); when the envelope
carries a W3C ``traceparent`` it is a child of the producer's span, so the trace of a room
command holds every delivery attempt of its event, retries included. The tailing relay, which
sends a batch at a time, traces only the events whose ``traceparent`` is sampled
(:func:`sent_in_batch_span`). A sink traces its own I/O
inside that span with :func:`sink_span` or :func:`http_client_span`, which use the attempt's
tracer and cost nothing when tracing is off. No span ever records an exception's text (it
may carry a secret), and as a last line of defence every exporter is wrapped in
:class:`RedactingSpanExporter`, which masks the process's registered secrets in every string a
span carries before it leaves the process.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from room_outbox.observability.redaction import REDACTED, Redactor

if TYPE_CHECKING:
    from room_outbox.envelope import EventEnvelope
    from room_outbox.store.protocol import OutboxRow

#: Instrumentation scope of every span and metric room-outbox emits.
SCOPE = "room_outbox"

#: Query parameters whose values are credentials. ``usersig`` is Tencent IM's; the rest are
#: common enough in other sinks' URLs to mask by default.
SECRET_QUERY_PARAMS = frozenset(
    {"usersig", "sig", "signature", "key", "secret", "secret_key", "token", "access_token", "password", "auth"}
)

# The tracer of the attempt the current task is delivering, so a sink's child spans go to
# the same provider without a global: tests and embedders each keep their own provider.
_active_tracer: contextvars.ContextVar[trace.Tracer | None] = contextvars.ContextVar(
    "room_outbox_active_tracer", default=None
)
_propagator = TraceContextTextMapPropagator()


def redact_url(url: str, secret_params: frozenset[str] = SECRET_QUERY_PARAMS) -> str:
    """``url`` with credential query parameters and any userinfo password masked.

    >>> redact_url("https://im.example/v4/x?sdkappid=1&usersig=eJw-abc&random=7")
    'https://im.example/v4/x?sdkappid=1&usersig=[REDACTED]&random=7'
    """
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{REDACTED}@{host}" if ":" in userinfo else netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(name.lower() in secret_params for name, _ in pairs):
            masked = [(name, REDACTED if name.lower() in secret_params else value) for name, value in pairs]
            # The brackets of the marker stay readable: only what a query needs is escaped.
            query = urlencode(masked, safe="[]")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def producer_context(traceparent: str | None) -> otel_context.Context | None:
    """The producer's span context from a W3C ``traceparent``; ``None`` when absent or
    malformed (a bad header must never fail a delivery: the attempt starts a new trace)."""
    if not traceparent:
        return None
    ctx = _propagator.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


@contextmanager
def sink_span(
    name: str, *, kind: SpanKind = SpanKind.CLIENT, attributes: Mapping[str, AttributeValue] | None = None
) -> Iterator[Span]:
    """A child span of the current delivery attempt, for a sink's own I/O; a non-recording
    span when tracing is off. An exception leaving the block marks the span ERROR with
    ``error.type`` set to the exception's class name only.

    Attribute values must not carry secrets; URLs go through :func:`redact_url` first.
    """
    tracer = _active_tracer.get()
    if tracer is None:
        yield trace.INVALID_SPAN
        return
    with tracer.start_as_current_span(
        name, kind=kind, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR))
            raise


@contextmanager
def http_client_span(
    method: str, url: str | Callable[[], str], attributes: Mapping[str, AttributeValue] | None = None
) -> Iterator[Span]:
    """An HTTP client child span (semantic conventions: ``http.request.method``,
    ``url.full`` redacted, ``server.address``); name ``"<METHOD> <path>"``. Set
    ``http.response.status_code`` on the yielded span once the answer is in::

        with http_client_span("POST", url) as span:
            response = await client.post(url, json=body)
            span.set_attribute("http.response.status_code", response.status_code)

    ``url`` may be a function building it: it is then called only when a span is recorded
    (building and redacting a URL per request was a tenth of the IM sink's CPU time)."""
    if _active_tracer.get() is None:
        yield trace.INVALID_SPAN
        return
    if callable(url):
        url = url()
    parts = urlsplit(url)
    attrs: dict[str, AttributeValue] = {
        "http.request.method": method.upper(),
        "url.full": redact_url(url),
        "server.address": parts.hostname or "",
    }
    if parts.port:
        attrs["server.port"] = parts.port
    attrs.update(attributes or {})
    with sink_span(f"{method.upper()} {parts.path or '/'}", kind=SpanKind.CLIENT, attributes=attrs) as span:
        yield span


class AttemptSpan:
    """The span of one delivery attempt, started once the envelope is known (so it can be a
    child of the producer's span) but timed from the start of the attempt.

    Named ``room_outbox.deliver <EventType>``, kind PRODUCER (the outbox relays the producer's
    message onward); a type the routing does not know is ``other`` in the name, since span
    names must stay a small set (the ``event_type`` attribute keeps the row's value). Its
    attributes: ``event_id``, ``event_type``, ``room_id``, ``app_code`` as in the logs;
    ``sink`` (``-`` when none); ``retry_count`` (failures before this attempt); ``outcome``
    (``published``, ``failed`` or ``throttled``); on failure ``error.type``, the dispatcher's
    error class, and status ERROR with the already redacted ``last_error`` text; and
    ``messaging.system`` (the sink), ``messaging.message.id`` (the event id),
    ``messaging.destination.name`` (the room id)."""

    __slots__ = ("_event_label", "_parent", "_row", "_span", "_start_ns", "_tracer", "app_code")

    def __init__(self, tracer: trace.Tracer, row: OutboxRow, event_label: str) -> None:
        self._tracer = tracer
        self._start_ns = time.time_ns()
        self._parent: otel_context.Context | None = None
        self._span: Span | None = None
        self._row = row
        #: The span name's event type: ``other`` for one the routing does not know.
        self._event_label = event_label
        self.app_code = row.app_code

    def parsed(self, envelope: EventEnvelope) -> None:
        self._parent = producer_context(envelope.traceparent)
        self.app_code = envelope.app_code or self.app_code

    @contextmanager
    def delivering(self, sink: str) -> Iterator[None]:
        """Make the attempt span current while the sink runs, so its child spans nest."""
        span = self._start(sink)
        token = _active_tracer.set(self._tracer)
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                yield
        finally:
            _active_tracer.reset(token)

    def ended(self) -> AbstractContextManager[Any]:
        """The ended span current again (:meth:`DeliveryAttempt.ended`); none before it began."""
        if self._span is None:
            return nullcontext()
        return trace.use_span(self._span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    def finish(self, sink: str, error_class: str | None, error: str | None) -> None:
        end_attempt_span(self._span or self._start(sink), error_class, error)

    def throttled(self, sink: str) -> None:
        """Held back by the sink's own rate limit: no request was sent, not an error."""
        span = self._span or self._start(sink)
        span.set_attribute("outcome", "throttled")
        span.end()

    def _start(self, sink: str) -> Span:
        row = self._row
        attributes = _attempt_attributes(row.event_id, row.event_type, row.room_id, self.app_code, sink)
        attributes["retry_count"] = row.retry_count
        self._span = self._tracer.start_span(
            f"room_outbox.deliver {self._event_label}",
            context=self._parent,
            kind=SpanKind.PRODUCER,
            start_time=self._start_ns,
            record_exception=False,
            set_status_on_exception=False,
            attributes=attributes,
        )
        return self._span


def sent_in_batch_span(tracer: trace.Tracer, envelope: EventEnvelope, event_label: str, sink: str) -> Span | None:
    """The span of one event a batch sends (the tailing relay's), named and attributed as an
    :class:`AttemptSpan` but for ``retry_count`` (a batch counts no retries): a child of the
    envelope's ``traceparent``. ``None`` when the envelope carries none, or the sampler drops
    it: a span for every event would cost the relay more than the rest of an event's path, so
    only the events a producer traced get one. End it with :func:`end_attempt_span`."""
    parent = producer_context(envelope.traceparent)
    if parent is None:
        return None
    span = tracer.start_span(
        f"room_outbox.deliver {event_label}",
        context=parent,
        kind=SpanKind.PRODUCER,
        record_exception=False,
        set_status_on_exception=False,
        attributes=_attempt_attributes(
            envelope.event_id, envelope.event_type, envelope.room_id, envelope.app_code, sink
        ),
    )
    return span if span.is_recording() else None


def end_attempt_span(span: Span, error_class: str | None, error: str | None) -> None:
    """End a delivery attempt's span with its outcome: ``published`` when ``error_class`` is
    None, else ``failed`` with ``error.type`` and status ERROR carrying ``error`` (redacted)."""
    if error_class is None:
        span.set_attribute("outcome", "published")
    else:
        span.set_attributes({"outcome": "failed", "error.type": error_class})
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def _attempt_attributes(
    event_id: str, event_type: str, room_id: str, app_code: str, sink: str
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "event_id": event_id,
        "event_type": event_type,
        "room_id": room_id,
        "app_code": app_code,
        "sink": sink,
        "messaging.operation.type": "send",
        "messaging.message.id": event_id,
        "messaging.destination.name": room_id,
    }
    if sink != "-":  # bad input never reached a sink: no messaging system to name
        attributes["messaging.system"] = sink
    return attributes


class RedactingSpanExporter(SpanExporter):
    """Wraps an exporter; masks registered secrets in every string a span carries."""

    def __init__(self, inner: SpanExporter, redactor: Redactor) -> None:
        self.inner = inner
        self.redactor = redactor

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export([self._redacted(span) for span in spans])

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def _redacted(self, span: ReadableSpan) -> ReadableSpan:
        status = span.status
        if status.description:
            status = Status(status.status_code, self.redactor.redact(status.description))
        return ReadableSpan(
            name=self.redactor.redact(span.name),
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=self._attributes(span.attributes),
            events=[Event(e.name, self._attributes(e.attributes), e.timestamp) for e in span.events],
            links=[Link(link.context, self._attributes(link.attributes)) for link in span.links],
            kind=span.kind,
            status=status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )

    def _attributes(self, attributes: Mapping[str, Any] | None) -> dict[str, Any]:
        return {key: self._value(value) for key, value in (attributes or {}).items()}

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.redactor.redact(value)
        if isinstance(value, tuple | list):
            return tuple(self._value(v) for v in value)
        return value
