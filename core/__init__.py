"""room-outbox: guaranteed delivery of room events from a MySQL transactional outbox.

The public plugin API lives here: ``hookimpl`` marks a plugin's hook implementations,
``Sink`` and its errors are what a sink implements and raises, ``EventEnvelope`` is what it
receives.
"""

from __future__ import annotations

from room_outbox.envelope import EnvelopeError, EventEnvelope
from room_outbox.hookspecs import hookimpl
from room_outbox.sink import PermanentSinkError, RetryableSinkError, Sink, SinkContext, SinkError, SinkSpec

__all__ = [
    "EnvelopeError",
    "EventEnvelope",
    "PermanentSinkError",
    "RetryableSinkError",
    "Sink",
    "SinkContext",
    "SinkError",
    "SinkSpec",
    "hookimpl",
]
