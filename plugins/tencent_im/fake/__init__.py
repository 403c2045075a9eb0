"""Test support shipped with the package: a fake Tencent Cloud IM over real HTTP.

In-process (async)::

    async with serve_fake_im() as fake:           # dev SDKAppID/key, a free port
        ...point the tencent_im sink at fake.base_url...
        fake.set_faults(error_rate=1.0, error_codes=[10002])
        assert fake.event_ids() == [...]

As a process: ``room-outbox fake-im --port 8090`` (see :mod:`.cli`); its control endpoints
are ``GET /_fake/messages``, ``GET /_fake/stats``, ``POST /_fake/faults`` (JSON of
:class:`Faults` fields) and ``POST /_fake/reset``.
"""

from __future__ import annotations

from room_outbox.plugins.tencent_im.fake.im import (
    DEFAULT_ADMIN,
    DEV_KEY,
    DEV_SDKAPPID,
    Arrival,
    FakeTencentIM,
    Faults,
    ReceivedMessage,
)
from room_outbox.plugins.tencent_im.fake.server import serve_fake_im
from room_outbox.plugins.tencent_im.settings import SINK_NAME

__all__ = [
    "DEFAULT_ADMIN",
    "DEV_KEY",
    "DEV_SDKAPPID",
    "SINK_NAME",
    "Arrival",
    "FakeTencentIM",
    "Faults",
    "ReceivedMessage",
    "serve_fake_im",
]
