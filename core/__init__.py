"""room-outbox: guaranteed delivery of room events from a transactional outbox (MySQL/MariaDB,
PostgreSQL or SQLite).

The public plugin API lives here: ``hookimpl`` marks a plugin's hook implementations,
``SinkSpec`` registers a sink with its ``SinkSettings`` model, ``Sink`` and its errors are
what a sink implements and raises (``ThrottledSinkError``: held back by its own rate limit,
not an attempt), ``EventEnvelope`` is what it receives. ``Duration`` reads
``"500ms"``/``"2s"``/``"1m"`` in a settings model as room-outbox's own settings do.
``http_client_span`` and ``sink_span`` trace a sink's own I/O under the current attempt;
``Redactor`` masks a sink's own secrets in the texts it builds. ``QuotaShare`` (the
context's ``quota``) is this process's part of a rate limit the deployment's processes
share; a sink's own limiter counts its window with ``JITTER_MARGIN`` added.

``HandlerSpec`` registers a consumer handler (``room_outbox_register_handlers``) with its
``HandlerSettings``; ``Handler``/``BatchHandler``, ``ConsumedEvent``, ``HandleContext``,
``Transaction`` and the handler errors are what a handler implements, receives and raises.
``KafkaSecurity`` is the Kafka connection's security settings (SASL, TLS).

Plugins import only from here: the subpackages (``delivery``, ``store``, ``observability``,
``cli``...) are the service's inside and may change between releases.
"""

from __future__ import annotations

from room_outbox.cluster.quota import JITTER_MARGIN, QuotaShare
from room_outbox.config import Duration
from room_outbox.envelope import EnvelopeError, EventEnvelope
from room_outbox.handler import (
    BatchHandler,
    ConsumedEvent,
    HandleContext,
    Handler,
    HandlerError,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
    PermanentHandlerError,
    RetryableHandlerError,
    Transaction,
)
from room_outbox.hookspecs import hookimpl
from room_outbox.kafka_security import KafkaSecurity
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.tracing import http_client_span, sink_span
from room_outbox.sink import (
    OrderedLogSink,
    PermanentSinkError,
    RetryableSinkError,
    Sink,
    SinkContext,
    SinkError,
    SinkSettings,
    SinkSpec,
    ThrottledSinkError,
)

__all__ = [
    "JITTER_MARGIN",
    "BatchHandler",
    "ConsumedEvent",
    "Duration",
    "EnvelopeError",
    "EventEnvelope",
    "HandleContext",
    "Handler",
    "HandlerError",
    "HandlerFactoryContext",
    "HandlerSettings",
    "HandlerSpec",
    "KafkaSecurity",
    "OrderedLogSink",
    "PermanentHandlerError",
    "PermanentSinkError",
    "QuotaShare",
    "Redactor",
    "RetryableHandlerError",
    "RetryableSinkError",
    "Sink",
    "SinkContext",
    "SinkError",
    "SinkSettings",
    "SinkSpec",
    "ThrottledSinkError",
    "Transaction",
    "hookimpl",
    "http_client_span",
    "sink_span",
]
