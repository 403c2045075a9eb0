"""The noop sink keeps the sink contract. It has no destination, so nothing can be down,
silent or refuse an event: those three checks are skipped with that reason."""

from __future__ import annotations

import pytest

from room_outbox import EventEnvelope
from room_outbox.plugins import noop
from room_outbox.testing import SinkContract
from room_outbox.testing import SinkHarness as Harness


async def _returned(_event: EventEnvelope) -> bool:
    return True  # delivering is returning without an error: checked by deliver itself


class TestNoopSink(SinkContract):
    plugin = noop
    name = "noop"

    @pytest.fixture
    def harness(self) -> Harness:
        return Harness(
            section={},
            delivered=_returned,
            invalid=[({"event_types": "RoomCreated"}, "event_types"), ({"start": "yesterday"}, "start")],
            outage=None,
            hang=None,
            permanent=None,
        )
