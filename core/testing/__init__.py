"""Testing a plugin: the contracts every sink and handler keeps, and harnesses that run one
against events without a database, a dispatcher or a broker.

A sink's tests subclass :class:`SinkContract` (with a :class:`SinkHarness` fixture); a
handler's, :class:`HandlerContract` (with a :class:`HandlerCase`). :func:`make_sink` with
:func:`deliver_events`, and :func:`make_handler` with :func:`handle_events`, run one directly.
Needs pytest with anyio's plugin (the contracts are test classes).
"""

from room_outbox.testing.handlers import (
    HandleOutcome,
    HandlerCase,
    HandlerContract,
    MemoryTransaction,
    consumed,
    handle_events,
    make_handler,
)
from room_outbox.testing.sinks import (
    SinkContract,
    SinkHarness,
    SinkOutcome,
    closed_port,
    deliver_events,
    event,
    make_sink,
)

__all__ = [
    "HandleOutcome",
    "HandlerCase",
    "HandlerContract",
    "MemoryTransaction",
    "SinkContract",
    "SinkHarness",
    "SinkOutcome",
    "closed_port",
    "consumed",
    "deliver_events",
    "event",
    "handle_events",
    "make_handler",
    "make_sink",
]
