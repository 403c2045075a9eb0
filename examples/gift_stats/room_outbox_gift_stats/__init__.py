"""A consumer handler as a third-party package would write it, using only room-outbox's
public API: running gift totals per room (``room_gift_totals``).

Adding to a total is not idempotent: handled twice, a gift would count twice. The handler
needs no de-duplication of its own because it writes through the consumer's transaction,
which also holds the event's processed record: a redelivered gift finds that record and the
handler is not called again. Run it with::

    consumers:
      stats:
        handlers: [gift_stats]
        handler_settings:
          gift_stats: {amount_field: amount}
"""

from __future__ import annotations

from room_outbox import (
    ConsumedEvent,
    HandleContext,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
    PermanentHandlerError,
    hookimpl,
)

_TABLE = """CREATE TABLE IF NOT EXISTS room_gift_totals (
  app_code VARCHAR(64) NOT NULL,
  room_id  VARCHAR(64) NOT NULL,
  gifts    BIGINT      NOT NULL,
  amount   BIGINT      NOT NULL,
  PRIMARY KEY (app_code, room_id)
)"""
#: The table, per database (the transaction's ``dialect``); ``room-outbox migrate`` creates it.
SCHEMA = {"mysql": (_TABLE + " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4",), "postgresql": (_TABLE,)}

#: Add one gift to a room's totals, per database dialect.
UPSERT = {
    "mysql": "INSERT INTO room_gift_totals (app_code, room_id, gifts, amount) VALUES (%s, %s, 1, %s)"
    " ON DUPLICATE KEY UPDATE gifts = gifts + 1, amount = amount + VALUES(amount)",
    "postgresql": "INSERT INTO room_gift_totals (app_code, room_id, gifts, amount) VALUES (%s, %s, 1, %s)"
    " ON CONFLICT (app_code, room_id) DO UPDATE SET gifts = room_gift_totals.gifts + 1,"
    " amount = room_gift_totals.amount + EXCLUDED.amount",
}


class GiftStatsSettings(HandlerSettings):
    #: The payload field holding the gift's value.
    amount_field: str = "amount"


class GiftStats:
    def __init__(self, settings: GiftStatsSettings) -> None:
        self.amount_field = settings.amount_field

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        e = event.envelope
        amount = (e.payload or {}).get(self.amount_field, 0)
        if not isinstance(amount, int) or isinstance(amount, bool) or amount < 0:
            # Retrying cannot fix a bad amount: a dead letter at once, for a person to look at.
            raise PermanentHandlerError(f"payload.{self.amount_field} is not a non-negative integer")
        async with ctx.transaction() as tx:
            await tx.execute(UPSERT[tx.dialect], (e.app_code, e.room_id, amount))

    async def aclose(self) -> None:
        pass


def _create(settings: GiftStatsSettings, context: HandlerFactoryContext) -> GiftStats:
    return GiftStats(settings)


@hookimpl
def room_outbox_register_handlers() -> list[HandlerSpec[GiftStatsSettings]]:
    return [
        HandlerSpec(
            "gift_stats",
            _create,
            event_types=frozenset({"RoomGiftSent"}),
            settings_model=GiftStatsSettings,
            schema=SCHEMA,
        )
    ]
