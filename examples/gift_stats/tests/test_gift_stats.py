"""gift_stats keeps room-outbox's handler contract, and what it writes, with no database and
no broker: room-outbox's in-memory harness records the statements."""

from __future__ import annotations

import pytest
import room_outbox_gift_stats

from room_outbox.testing import HandlerCase, HandlerContract, event, handle_events, make_handler


class TestGiftStats(HandlerContract):
    plugin = room_outbox_gift_stats
    name = "gift_stats"

    @pytest.fixture
    def case(self) -> HandlerCase:
        return HandlerCase(
            settings={"amount_field": "amount"},
            events=[event("g1", event_type="RoomGiftSent", payload={"amount": 5})],
            invalid=[({"amount_field": 3}, "amount_field")],
        )


@pytest.mark.anyio
async def test_a_gift_adds_to_its_room_and_a_bad_amount_is_a_dead_letter() -> None:
    handler = make_handler(room_outbox_gift_stats, "gift_stats")
    try:
        good, bad = await handle_events(
            handler,
            [
                event("g1", event_type="RoomGiftSent", room_id="r_1", payload={"amount": 5}),
                event("g2", event_type="RoomGiftSent", payload={"amount": -1}),
            ],
        )
    finally:
        await handler.aclose()
    sql, params = good.statements[-1]
    assert "room_gift_totals" in sql and params == ("default", "r_1", 5)
    assert bad.dead_letter and bad.statements == []
