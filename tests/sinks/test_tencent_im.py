"""The Tencent IM sink keeps the sink contract, against the fake Tencent IM on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from room_outbox import EventEnvelope
from room_outbox.plugins import tencent_im
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID, FakeTencentIM, serve_fake_im
from room_outbox.testing import SinkContract, event
from room_outbox.testing import SinkHarness as Harness

#: Groups that exist on the fake; any other is refused with ErrorCode 10010 (dismissed).
GROUPS = {"r_contract"}


@pytest.fixture
async def fake() -> AsyncIterator[FakeTencentIM]:
    async with serve_fake_im(FakeTencentIM(seed=5, groups=set(GROUPS))) as fake:
        yield fake


class TestTencentIMSink(SinkContract):
    plugin = tencent_im
    name = "tencent_im"

    @pytest.fixture
    def harness(self, fake: FakeTencentIM) -> Harness:
        section = {"base_url": fake.base_url, "sdkappid": DEV_SDKAPPID, "secret_key": DEV_KEY}

        async def delivered(sent: EventEnvelope) -> bool:
            return sent.event_id in fake.event_ids()

        @asynccontextmanager
        async def bad_gateway() -> AsyncIterator[dict[str, Any]]:
            fake.set_faults(http_error_rate=1.0)
            try:
                yield section
            finally:
                fake.set_faults(http_error_rate=0.0)

        @asynccontextmanager
        async def silent() -> AsyncIterator[dict[str, Any]]:
            fake.set_faults(hang_rate=1.0)
            try:
                yield {**section, "request_timeout": "30s"}  # the dispatcher's deadline comes first
            finally:
                fake.set_faults(hang_rate=0.0)

        return Harness(
            section=section,
            delivered=delivered,
            invalid=[
                ({"sdkappid": 0}, "sdkappid"),
                ({"base_url": "ftp://im.example"}, "base_url"),
                ({"base_url": "https://im.example?region=sgp"}, "base_url"),  # swallowed the API's path
                ({"group_id_template": "{room}"}, "group_id_template"),
                ({"request_timeout": "soon"}, "request_timeout"),
            ],
            outage=bad_gateway,
            hang=silent,
            permanent=(section, event("contract-dismissed", room_id="r_dismissed")),
            secrets=[DEV_KEY],
        )
