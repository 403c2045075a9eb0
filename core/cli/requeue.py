"""Operator commands that change rows: ``requeue`` and ``cancel`` (status ``cancelled``).

``requeue`` shows what it would change and changes it only with ``--yes``. It is how rows that
were parked, or whose envelope did not parse, are sent round again once the cause is fixed.
"""

from __future__ import annotations

import time
from typing import Any

from room_outbox.cli.status import format_age, printable
from room_outbox.store.lanes.tail import TailStore
from room_outbox.store.operator.changes import IN_FLIGHT, RequeueFilter, cancel, find_requeue_candidates, requeue
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.tail import PARKED

#: Rows one ``requeue`` changes at most: one statement, a list a person can still read.
REQUEUE_LIMIT = 10_000


async def requeue_command(
    store: SQLStore, where: RequeueFilter, apply: bool, out: Any, limit: int = REQUEUE_LIMIT
) -> int:
    rows = await find_requeue_candidates(store, where, limit + 1)  # one more: are there more?
    more = len(rows) > limit
    rows = rows[:limit]
    if not rows:
        print("no rows match (published, cancelled and currently leased rows are never requeued)", file=out)
        return 0
    now = time.time() * 1000
    print(f"{'event_id':<40} {'event_type':<24} {'status':<8} {'retries':>7} {'age':>8}  last_error", file=out)
    for row in rows:
        age = format_age(now - row["created_at_ms"])
        error = printable((row["last_error"] or "")[:60])
        event_id, event_type, status = (printable(row[name]) for name in ("event_id", "event_type", "status"))
        print(f"{event_id:<40} {event_type:<24} {status:<8} {row['retry_count']:>7} {age:>8}  {error}", file=out)
    beyond = f"; more than {limit:,} rows match: only the first {limit:,} (lowest ids) are taken" if more else ""
    if not apply:
        print(f"{len(rows)} row(s) would be requeued{beyond}; run again with --yes to apply", file=out)
        return 0
    changed = await requeue(store, [row["id"] for row in rows])
    note = ""
    if changed < len(rows):  # claimed, published or cancelled since they were listed
        note = f"; {len(rows) - changed} of the {len(rows)} listed changed meanwhile (leased, published or cancelled)"
    # Requeued rows are pending and may match again: the rest is reached by a narrower filter
    # (with --status failed, the rows just requeued no longer match).
    again = (
        f"; more than {limit:,} rows matched: only the first {limit:,} (lowest ids) were taken;"
        " narrow the filter (--status failed, --event-type, --older-than) to reach the rest"
        if more
        else ""
    )
    print(f"requeued {changed} row(s){note}{again}", file=out)
    return 0


async def requeue_tail_command(store: SQLStore, lane: str, event_ids: tuple[str, ...], apply: bool, out: Any) -> int:
    """A tailing lane's parked events (all, or those of ``event_ids``): listed, and with ``apply``
    marked to be sent again by the lane's next round."""
    tail = TailStore(owner=store, lane=lane)
    rows = [r for r in await tail.parked() if r["status"] == PARKED and (not event_ids or r["event_id"] in event_ids)]
    if not rows:
        print(f"no parked events in lane {printable(lane)}", file=out)
        return 0
    print(f"{'event_id':<40} {'room_id':<24}  last_error", file=out)
    for row in rows:
        error = printable((row["last_error"] or "")[:60])
        print(f"{printable(row['event_id']):<40} {printable(row['room_id']):<24}  {error}", file=out)
    if not apply:
        print(f"{len(rows)} event(s) would be requeued; run again with --yes to apply", file=out)
        return 0
    changed = await tail.requeue([int(row["outbox_id"]) for row in rows])
    print(f"requeued {changed} event(s) in lane {printable(lane)}", file=out)
    return 0


async def cancel_command(store: SQLStore, event_id: str, out: Any, err: Any) -> int:
    """Result on ``out``; why nothing was cancelled on ``err`` (exit code 1)."""
    cancelled, status = await cancel(store, event_id)
    shown = printable(event_id)
    if cancelled:
        print(f"cancelled {shown}: it will never be delivered; the row is kept", file=out)
        return 0
    if status is None:
        print(f"room-outbox cancel: no event {shown}", file=err)
    elif status == IN_FLIGHT:
        print(
            f"room-outbox cancel: {shown} is being delivered right now; try again once its attempt has ended",
            file=err,
        )
    else:
        print(
            f"room-outbox cancel: {shown} is {printable(status)}: only pending or failed events can be cancelled",
            file=err,
        )
    return 1
