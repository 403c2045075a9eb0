"""Ways to drive a :class:`~room_outbox.delivery.dispatcher.Dispatcher` that only tests and
the bench need: the service runs it through ``run``."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from room_outbox.delivery.dispatcher import Dispatcher, Feed
from room_outbox.store.protocol import DeliveryResult, OutboxRow


async def run_until_empty(dispatcher: Dispatcher) -> int:
    """Rounds until a claim comes back short, then write the results ("burst" mode); return
    the rows claimed. Rows that failed wait for their retry time, so this terminates."""
    total = 0
    while True:
        round_ = await dispatcher.run_once()
        total += round_.claimed
        if round_.exhausted:
            await dispatcher.flush()
            return total


async def deliver_queues(dispatcher: Dispatcher, queues: Sequence[list[OutboxRow]]) -> list[DeliveryResult]:
    """Deliver ``queues`` with ``concurrency`` workers taking them in turn, and return their
    results: delivery alone, without the store."""
    results: list[DeliveryResult] = []
    feed = Feed()
    feed.put(queues, sum(len(queue) for queue in queues))
    feed.close()
    async with anyio.create_task_group() as deliveries:
        for _ in range(min(dispatcher.options.concurrency, len(queues))):
            deliveries.start_soon(dispatcher.deliver_in_turn, feed, results)
    return results
