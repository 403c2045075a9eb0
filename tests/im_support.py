"""Helpers for the Tencent IM tests: a sink, a router and a dispatcher wired to a fake IM."""

from __future__ import annotations

import logging
from typing import Any

from room_outbox.config import Settings
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router, build_router
from room_outbox.envelope import EventEnvelope
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.tencent_im import TencentIMSettings
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID, FakeTencentIM
from room_outbox.plugins.tencent_im.sink import TencentIMSink
from room_outbox.sink import SinkContext
from room_outbox.store.backends.mysql import MySQLStore


def im_section(fake: FakeTencentIM, **overrides: Any) -> dict[str, Any]:
    """The ``sinks.tencent_im`` section pointing at ``fake`` with the dev credentials."""
    return {"base_url": fake.base_url, "sdkappid": DEV_SDKAPPID, "secret_key": DEV_KEY, **overrides}


def make_sink(fake: FakeTencentIM, secrets: list[str] | None = None, **overrides: Any) -> TencentIMSink:
    settings = TencentIMSettings.model_validate(im_section(fake, **overrides))
    add = secrets.append if secrets is not None else (lambda _s: None)
    return TencentIMSink(settings, SinkContext("test", logging.getLogger("test.tencent_im"), add_secret=add))


async def im_router(fake: FakeTencentIM, redactor: Redactor | None = None, **overrides: Any) -> Router:
    """The production routing (tencent_im + noop) with the sink pointing at ``fake``."""
    settings = Settings(node_id="test", sinks={"tencent_im": im_section(fake, **overrides)})
    return await build_router(make_plugin_manager(), settings, redactor or Redactor())


def im_dispatcher(store: MySQLStore, router: Router, redactor: Redactor | None = None, **worker: Any) -> Dispatcher:
    """A dispatcher configured the way `room-outbox run` configures one (``outbox_worker`` keys)."""
    settings = Settings(node_id="acceptance", outbox_worker={"poll_interval": "50ms", **worker})
    return Dispatcher(store, router, LaneOptions.from_settings(settings.outbox_worker), "acceptance", redactor)


def event(event_id: str, event_type: str = "RoomUserJoined", room_id: str = "r_1", **extra: Any) -> EventEnvelope:
    return EventEnvelope(
        event_id=event_id,
        event_type=event_type,
        room_id=room_id,
        app_code=extra.pop("app_code", "default"),
        room_version=extra.pop("room_version", 1),
        occurred_at_ms=extra.pop("occurred_at_ms", 1764400000000),
        payload=extra.pop("payload", {"user_id": "u1"}),
        **extra,
    )
