"""The fake Tencent IM in a process of its own (so it never competes with the code under test
for the GIL), plus ``GET /_bench/receipts``: wall-clock receipt time of every accepted
event and the count of answers per ErrorCode. Prints its port on the first line."""

from __future__ import annotations

import collections
import json
import sys
import time
from typing import Any

import anyio

from room_outbox.plugins.tencent_im.fake import FakeTencentIM, serve_fake_im
from room_outbox.plugins.tencent_im.fake.im import Reply


class BenchFake(FakeTencentIM):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.receipts: dict[str, float] = {}

    async def handle(self, method: str, target: str, body: bytes) -> Reply:
        if target.startswith("/_bench/receipts"):
            codes = collections.Counter(str(a.error_code) for a in self.arrivals)
            doc: dict[str, Any] = {"receipts": self.receipts, "codes": codes, "requests": len(self.arrivals)}
            return Reply(200, json.dumps(doc).encode())
        if target.startswith("/_bench/clear"):
            self.reset()
            self.receipts = {}
            return Reply(200, b"{}")
        known = len(self.messages)
        reply = await super().handle(method, target, body)
        if len(self.messages) > known:
            event_id = self.messages[-1].event_id
            if event_id:
                self.receipts[event_id] = time.time()
        return reply


async def main() -> None:
    async with serve_fake_im(BenchFake()) as fake:
        print(fake.base_url, flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    try:
        anyio.run(main)
    except KeyboardInterrupt:
        sys.exit(0)
