"""The Sink protocol and the errors a sink raises.

A sink is shaped like an httpx transport: one coroutine that does the work (``deliver``) and
``aclose`` for the connections it owns. It translates errors once, at its boundary, keeping the
original exception as ``__cause__``: :class:`RetryableSinkError` (try again later),
:class:`ThrottledSinkError` (its own rate limit held the event back: no attempt) or
:class:`PermanentSinkError` (retrying will not help); the tree is :mod:`room_outbox.errors`'.
Anything else escaping ``deliver`` is a bug in the sink, recorded as a retryable failure
naming its class, so nothing is lost. A sink's error message ends up in
``room_outbox.last_error`` and in logs: it never holds a secret nor a whole remote response.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, overload, runtime_checkable

from pydantic import BaseModel, ConfigDict, field_validator

from room_outbox.cluster.quota import QuotaShare
from room_outbox.envelope import EventEnvelope
from room_outbox.errors import PermanentSinkError, RetryableSinkError, SinkError, ThrottledSinkError

__all__ = [
    "OrderedLogSink",
    "PermanentSinkError",
    "RetryableSinkError",
    "Sink",
    "SinkContext",
    "SinkError",
    "SinkSettings",
    "SinkSpec",
    "ThrottledSinkError",
]


@runtime_checkable
class Sink(Protocol):
    """Delivers envelopes to one destination."""

    async def deliver(self, envelope: EventEnvelope) -> None:
        """Deliver one event; return on success, raise a :class:`SinkError` on failure. The
        dispatcher applies ``publish_timeout`` around every call; a sink need not (but may)
        time out by itself."""

    async def aclose(self) -> None:
        """Release connections and clients the sink owns. Called once, at shutdown."""


class SinkSettings(BaseModel):
    """Base of every sink's configuration section (``sinks.<name>``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    #: Event types this sink takes. ``None`` means "every known event type that no other
    #: sink in the lane takes" (at most one sink of a lane may say so).
    event_types: list[str] | None = None

    @field_validator("event_types")
    @classmethod
    def _event_types_are_names(cls, value: list[str] | None) -> list[str] | None:
        """Each entry is an event type's exact name: one that could never match a row (a
        pattern, a blank) would leave the types it was meant for without a sink."""
        for name in value or ():
            if not name.strip() or name != name.strip() or any(c in name for c in "*?[],"):
                raise ValueError(
                    f"{name!r} is not an event type's name (exact names only, no patterns); a sink"
                    " that takes every type no other sink lists leaves event_types out"
                )
        return value

    #: Sinks with a lane of their own: where the lane starts the first time it runs —
    #: ``now`` (events committed from now on, those whose transaction is open at the start
    #: included), ``beginning`` (every row in room_outbox) or an outbox id.
    start: Literal["now", "beginning"] | int = "now"
    #: Sinks that keep order by themselves (``ordered_log``, such as Kafka): ``tail`` reads
    #: ``room_outbox`` after a cursor, without a row per event; ``lane_table`` keeps a row per
    #: event in ``room_outbox_lane_<name>`` (per-row status). Other sinks ignore it.
    relay: Literal["tail", "lane_table"] = "tail"


@dataclass(frozen=True)
class SinkContext:
    """What the core hands a sink factory besides its own settings."""

    node_id: str
    logger: logging.Logger
    #: Register a secret (a key, a signature) so the core redacts it wherever it might leak.
    add_secret: Callable[[str], None] = field(default=lambda _secret: None)
    #: Unregister a secret no output can hold any more (a signature long replaced): a sink that
    #: makes secrets at run time keeps their number bounded.
    remove_secret: Callable[[str], None] = field(default=lambda _secret: None)
    #: This process's share of rate limits the deployment's processes share (one process: all).
    quota: QuotaShare = field(default_factory=QuotaShare)
    #: The outbox column (``table.column``) envelopes' ``room_id`` comes from, for a sink's
    #: error about an event without a room to name what the producer left empty.
    room_column: str = "room_id"


#: A sink's own settings model: what :attr:`SinkSpec.factory` receives, already validated.
SettingsT = TypeVar("SettingsT", bound=SinkSettings)


@dataclass(frozen=True, init=False)
class SinkSpec(Generic[SettingsT]):
    """A sink as a plugin registers it: a name, a factory and, keyword-only, the rest.

    The factory receives an instance of ``settings_model`` (the core validates
    ``sinks.<name>`` with it), so ``SinkSpec("kafka", KafkaSink, settings_model=KafkaSettings)``
    type-checks only when ``KafkaSink`` takes ``KafkaSettings``; a factory never needs to check
    the type. Without ``settings_model`` the sink takes only the common settings
    (:class:`SinkSettings`).

    ``enabled_by_default`` decides whether the sink runs when the configuration has no
    ``sinks.<name>`` section; built-in sinks say yes, third-party sinks are opt-in.

    ``own_lane``: the sink keeps its own consumption state (``room_outbox_lane_<name>``, made
    by ``room-outbox migrate``) and its own scan loop, instead of sharing the main lane, whose
    state is ``room_outbox.status``. Every sink besides IM's should say yes: then a slow or
    broken sink never holds back IM delivery, nor IM it. An own-lane sink with
    ``event_types`` None takes every event; events it does not take are passed over.

    ``ordered_log``: the destination keeps order by itself (a Kafka topic: order per key). Its
    lane then *tails* ``room_outbox`` (:mod:`room_outbox.delivery.tail`) instead of keeping a
    row per event: the sink must also offer ``publish`` (:class:`OrderedLogSink`). Implies
    ``own_lane``.

    ``timed``: each attempt's duration goes into the ``room_outbox.publish.duration``
    histogram. A sink that answers without I/O (the noop sink) says no: its attempts are the
    dispatcher's own work, which a duration would add to (the SDK records each one) without
    telling an operator anything. Its attempts are still counted and traced.
    """

    name: str
    factory: Callable[[SettingsT, SinkContext], Sink]
    settings_model: type[SettingsT]
    enabled_by_default: bool
    own_lane: bool
    ordered_log: bool
    timed: bool

    # Without settings_model, the factory must take SinkSettings (what it will get)...
    @overload
    def __init__(
        self: SinkSpec[SinkSettings],
        name: str,
        factory: Callable[[SinkSettings, SinkContext], Sink],
        *,
        enabled_by_default: bool = False,
        own_lane: bool = False,
        ordered_log: bool = False,
        timed: bool = True,
    ) -> None: ...

    # ... with it, what settings_model makes.
    @overload
    def __init__(
        self,
        name: str,
        factory: Callable[[SettingsT, SinkContext], Sink],
        *,
        settings_model: type[SettingsT],
        enabled_by_default: bool = False,
        own_lane: bool = False,
        ordered_log: bool = False,
        timed: bool = True,
    ) -> None: ...

    # Deprecated: the former order, settings model before factory (warns; to be removed).
    @overload
    def __init__(
        self,
        name: str,
        settings_model: type[SettingsT],
        factory: Callable[[SettingsT, SinkContext], Sink],
        /,
        enabled_by_default: bool = False,
        own_lane: bool = False,
        ordered_log: bool = False,
        *,
        timed: bool = True,
    ) -> None: ...

    def __init__(
        self,
        name: str,
        factory: Any,
        *former: Any,
        settings_model: Any = SinkSettings,
        enabled_by_default: bool = False,
        own_lane: bool = False,
        ordered_log: bool = False,
        timed: bool = True,
    ) -> None:
        if former:  # the former order: (name, settings_model, factory, enabled_by_default, ...)
            warnings.warn(
                "SinkSpec(name, settings_model, factory, ...) is deprecated; "
                "write SinkSpec(name, factory, settings_model=..., ...)",
                DeprecationWarning,
                stacklevel=2,
            )
            settings_model, factory = factory, former[0]
            flags: tuple[Any, ...] = (enabled_by_default, own_lane, ordered_log)
            enabled_by_default, own_lane, ordered_log = (*former[1:], *flags[len(former) - 1 :])
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "factory", factory)
        object.__setattr__(self, "settings_model", settings_model)
        object.__setattr__(self, "enabled_by_default", enabled_by_default)
        object.__setattr__(self, "own_lane", own_lane)
        object.__setattr__(self, "ordered_log", ordered_log)
        object.__setattr__(self, "timed", timed)


@runtime_checkable
class OrderedLogSink(Sink, Protocol):
    """A sink that keeps order by itself and takes a batch at a time."""

    async def publish(self, envelopes: Sequence[EventEnvelope]) -> list[PermanentSinkError | None]:
        """Send ``envelopes`` in order (many in flight; order kept per key); return once every
        one is acknowledged or failed for good: per envelope, None (sent) or the
        :class:`PermanentSinkError` it can never get past. Raise :class:`RetryableSinkError`
        when the batch must be sent again (broker down): the caller repeats it, in order.

        Optional, besides: ``async def reachable(self) -> None``, one cheap round trip to the
        destination, raising when it fails. After a batch failed as a whole, the relay calls it
        (each call bounded by ``publish_timeout``) before its next round, with the round rolled
        back, so that an outage does not keep ``room_outbox`` held round after round: first
        while it keeps the lane from the other processes, which would send the batch again,
        then outside any transaction."""
        ...
