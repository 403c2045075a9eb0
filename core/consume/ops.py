"""What ``status``, ``inspect``, ``consumers dead-letters`` and ``consumers redrive`` show and
do about the consumers (read from the database: any host can run them)."""

from __future__ import annotations

import json
from typing import IO, Any

from room_outbox.store.clock import now_ms
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.factory import consumer_store
from room_outbox.store.protocol import SQLStore


async def _consumer_store(store: SQLStore) -> SQLConsumerStore | None:
    """The consumers' tables, when this database has them (none on SQLite)."""
    consumers = consumer_store(store)
    return consumers if consumers is not None and await consumers.migrated() else None


async def consumer_overview(store: SQLStore) -> list[dict[str, Any]]:
    consumers = await _consumer_store(store)
    return await consumers.overview() if consumers is not None else []


async def consumer_states(store: SQLStore, event_id: str) -> list[dict[str, Any]]:
    consumers = await _consumer_store(store)
    return await consumers.event_states(event_id) if consumers is not None else []


def format_overview(rows: list[dict[str, Any]]) -> list[str]:
    """Lines for ``status``: per consumer and handler, rows retrying and dead."""
    if not rows:
        return []
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        entry = table.setdefault((row["consumer"], row["handler"] or "(none)"), {"retrying": 0, "dead": 0})
        entry[row["status"]] = row["rows"]
        if row["status"] == "dead":
            entry["oldest_dead_ms"] = row["oldest_created_at_ms"]
    lines = ["", f"  {'consumer':<20} {'handler':<16} {'retrying':>8} {'dead':>6}  oldest dead letter"]
    for (consumer, handler), entry in sorted(table.items()):
        oldest = entry.get("oldest_dead_ms")
        age = f"{(now_ms() - oldest) / 1000:.0f}s ago" if oldest else "-"
        lines.append(f"  {consumer:<20} {handler:<16} {entry['retrying']:>8} {entry['dead']:>6}  {age}")
    return lines


def format_states(states: list[dict[str, Any]]) -> list[str]:
    """Lines for ``inspect``: the event in each consumer (consumed / retrying / dead)."""
    lines = []
    for s in states:
        where = f"{s['topic']}[{s['partition']}]@{s['offset']}"
        if s["state"] == "consumed":
            detail = f"consumed from {where}"
        elif s["state"] == "retrying":
            due = max(0, int(s["due_at_ms"]) - now_ms()) / 1000
            detail = f"retrying after {s['attempts']} attempt(s), next in {due:.1f}s: {s['last_error']} ({where})"
        else:
            detail = f"dead after {s['attempts']} attempt(s): {s['last_error']} ({where})"
        lines.append(f"consumer {s['consumer']} / {s['handler']}: {detail}")
    return lines


async def dead_letters_command(store: SQLStore, consumer: str | None, limit: int, as_json: bool, out: IO[str]) -> int:
    consumers = await _consumer_store(store)
    rows = await consumers.dead_letters(consumer, limit) if consumers is not None else []
    if as_json:
        print(json.dumps(rows, indent=2, default=str), file=out)
        return 0
    if not rows:
        print("no dead letters", file=out)
    for row in rows:
        print(
            f"{row['consumer']} / {row['handler'] or '(none)'}  {row['event_id']}  {row['event_type'] or '-'}"
            f"  {row['topic']}[{row['kafka_partition']}]@{row['kafka_offset']}  attempts {row['attempts']}"
            f"  {row['last_error']}",
            file=out,
        )
    return 0


async def redrive_command(
    store: SQLStore, consumer: str, handler: str | None, event_ids: list[str], apply: bool, out: IO[str]
) -> int:
    """Dead letters of ``consumer`` (optionally one handler's, or these events) back to
    ``retrying``, due now, attempts from 0: a running ``consume`` process takes them up."""
    consumers = await _consumer_store(store)
    if consumers is None:
        print("no consumer tables here: run `room-outbox migrate`", file=out)
        return 1
    selected = [
        row
        for row in await consumers.dead_letters(consumer, 100_000)
        if (handler is None or row["handler"] == handler) and (not event_ids or row["event_id"] in event_ids)
    ]
    for row in selected[:20]:
        print(f"  {row['handler'] or '(none)'}  {row['event_id']}  {row['last_error']}", file=out)
    if len(selected) > 20:
        print(f"  … and {len(selected) - 20} more", file=out)
    if not apply:
        print(f"{len(selected)} dead letter(s) would be sent round again; add --yes to do it", file=out)
        return 0
    changed = await consumers.redrive(consumer, handler, event_ids)
    print(f"{changed} dead letter(s) sent round again", file=out)
    return 0
