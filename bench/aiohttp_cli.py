"""``room-outbox`` with the proposed hot-path change: the Tencent IM sink's httpx client on
httpx-aiohttp's transport (a monkeypatch here; the proposal is to pass it in the sink)."""

from __future__ import annotations

import sys
from typing import Any

from bench.im import aiohttp_transport
from room_outbox.cli import main
from room_outbox.plugins.tencent_im import sink as sink_module

_original_init = sink_module.TencentIMSink.__init__


def _init(self: Any, settings: Any, context: Any, transport: Any = None) -> None:
    _original_init(self, settings, context, transport or aiohttp_transport())


sink_module.TencentIMSink.__init__ = _init  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
