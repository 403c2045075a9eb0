"""The Tencent Cloud IM sink (``tencent_im``): room events as group custom messages.

Built in and enabled by default. It takes every known event type no other sink of the lane
takes (so not the noop sink's RoomCreated, RoomHeatChanged, RoomRankChanged). Settings:
:mod:`.settings`; the request: :mod:`.message`; errors: :mod:`.errors`; UserSig:
:mod:`.usersig`; rate limits: :mod:`.ratelimit`.
"""

from __future__ import annotations

from room_outbox import SinkContext, SinkSpec, hookimpl
from room_outbox.plugins.tencent_im.settings import TencentIMSettings
from room_outbox.plugins.tencent_im.sink import TencentIMSink
from room_outbox.sink import SinkSettings

__all__ = ["TencentIMSettings", "TencentIMSink", "room_outbox_register_sinks"]


def _create(settings: SinkSettings, context: SinkContext) -> TencentIMSink:
    assert isinstance(settings, TencentIMSettings)  # the core validated it with our model
    return TencentIMSink(settings, context)


@hookimpl
def room_outbox_register_sinks() -> list[SinkSpec]:
    return [SinkSpec(name="tencent_im", settings_model=TencentIMSettings, factory=_create, enabled_by_default=True)]
