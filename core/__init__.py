"""room-outbox: guaranteed delivery of room events from a transactional outbox (MySQL/MariaDB,
PostgreSQL or SQLite).

The public plugin API lives here (``__all__``): ``hookimpl`` marks a plugin's hooks;
``SinkSpec``, ``SinkSettings``, ``Sink`` and its errors are what a sink registers, implements
and raises; ``HandlerSpec``, ``HandlerSettings``, ``Handler`` and its kin are a consumer
handler's (``HandlerTable`` and ``HandlerColumn``: the columns it writes); ``EventEnvelope`` is what both receive; and the helpers a plugin shares with the
service (``Duration``, ``http_client_span``, ``sink_span``, ``Redactor``, ``QuotaShare``,
``KafkaSecurity``...). Plugins import only from here: the subpackages (``delivery``,
``store``, ``observability``, ``cli``...) are the service's inside and may change between
releases.
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
    HandlerColumn,
    HandlerError,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
    HandlerTable,
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
    "HandlerColumn",
    "HandlerError",
    "HandlerFactoryContext",
    "HandlerSettings",
    "HandlerSpec",
    "HandlerTable",
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
