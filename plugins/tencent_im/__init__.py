"""The Tencent Cloud IM sink (``tencent_im``): room events as group custom messages.

Built in and enabled by default. It takes every known event type no other sink of the lane
takes (so not the noop sink's RoomCreated, RoomHeatChanged, RoomRankChanged). Settings:
:mod:`.settings`; the request: :mod:`.message`; errors: :mod:`.errors`; UserSig:
:mod:`.usersig`; rate limits: :mod:`.ratelimit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from room_outbox import SinkContext, SinkSpec, hookimpl
from room_outbox.plugins.tencent_im.settings import SINK_NAME, TencentIMSettings

if TYPE_CHECKING:
    from room_outbox.plugins.tencent_im.sink import TencentIMSink

__all__ = ["TencentIMSettings", "room_outbox_register_sinks", "tencent_im_sink"]


def tencent_im_sink(settings: TencentIMSettings, context: SinkContext) -> TencentIMSink:
    """The sink, its module imported here: a process with the sink disabled never loads the
    HTTP client."""
    from room_outbox.plugins.tencent_im.sink import TencentIMSink

    return TencentIMSink(settings, context)


@hookimpl
def room_outbox_register_sinks() -> list[SinkSpec[TencentIMSettings]]:
    return [SinkSpec(SINK_NAME, tencent_im_sink, settings_model=TencentIMSettings, enabled_by_default=True)]
