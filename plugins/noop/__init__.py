"""The noop sink: resolves event types that are not pushed to IM as delivered, without I/O.

RoomCreated, RoomHeatChanged and RoomRankChanged are durable facts for other consumers, not
room messages; resolving them here makes them ``published`` so they never linger as pending.
"""

from __future__ import annotations

from pydantic import Field

from room_outbox import EventEnvelope, SinkContext, SinkSettings, SinkSpec, hookimpl

DEFAULT_EVENT_TYPES = ["RoomCreated", "RoomHeatChanged", "RoomRankChanged"]


class NoopSettings(SinkSettings):
    event_types: list[str] | None = Field(default_factory=lambda: list(DEFAULT_EVENT_TYPES))


class NoopSink:
    async def deliver(self, envelope: EventEnvelope) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _create(settings: NoopSettings, context: SinkContext) -> NoopSink:
    return NoopSink()


@hookimpl
def room_outbox_register_sinks() -> list[SinkSpec[NoopSettings]]:
    # Not timed: an attempt here is the dispatcher's own microseconds, no I/O to watch.
    return [SinkSpec("noop", _create, settings_model=NoopSettings, enabled_by_default=True, timed=False)]
