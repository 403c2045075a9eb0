"""The Tencent Cloud IM sink (``tencent_im``): room events as group custom messages.

Built in and enabled by default. It takes every known event type no other sink of the lane
takes (so not the noop sink's RoomCreated, RoomHeatChanged, RoomRankChanged). Settings:
:mod:`.settings`; the request: :mod:`.message`; errors: :mod:`.errors`; UserSig:
:mod:`.usersig`; rate limits: :mod:`.ratelimit`.
"""

from __future__ import annotations

from room_outbox import SinkSpec, hookimpl
from room_outbox.plugins.tencent_im.settings import SINK_NAME, TencentIMSettings
from room_outbox.plugins.tencent_im.sink import TencentIMSink

__all__ = ["TencentIMSettings", "TencentIMSink", "room_outbox_register_sinks"]


@hookimpl
def room_outbox_register_sinks() -> list[SinkSpec[TencentIMSettings]]:
    return [SinkSpec(SINK_NAME, TencentIMSink, settings_model=TencentIMSettings, enabled_by_default=True)]
