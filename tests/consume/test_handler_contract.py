"""The built-in handlers keep the shipped handler contract (room_outbox.testing), and the
in-memory harness shows what each writes, with no database and no broker."""

from __future__ import annotations

import pytest

from room_outbox.plugins import activity, audit_log
from room_outbox.testing import HandlerCase, HandlerContract, event, handle_events, make_handler


class TestAuditHandler(HandlerContract):
    plugin = audit_log
    name = "audit"

    @pytest.fixture
    def case(self) -> HandlerCase:
        return HandlerCase(settings={}, events=[event("a1"), event("a2", event_type="RoomCreated")])


class TestActivityHandler(HandlerContract):
    plugin = activity
    name = "activity"

    @pytest.fixture
    def case(self) -> HandlerCase:
        return HandlerCase(settings={}, events=[event("j1"), event("g1", event_type="RoomGiftSent")])


@pytest.mark.anyio
async def test_the_harness_shows_the_statements_a_handler_runs() -> None:
    handler = make_handler(activity, "activity")
    try:
        (joined,) = await handle_events(handler, [event("j1", room_id="r_9")])
    finally:
        await handler.aclose()
    assert joined.handled and not joined.dead_letter
    (sql, params) = joined.statements[-1]
    assert "room_activity" in sql and "r_9" in params and "joined" in params
