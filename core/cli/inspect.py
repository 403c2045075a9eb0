"""``room-outbox inspect EVENT_ID``: one event's row (times in local time, with how long ago),
its parsed envelope or why it does not parse, and its state in every lane and consumer, as the
dispatcher sees them (the database's clock, ``claim_after``). Where event ids are unique per app
only, every app's row with that id, each under its app code."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection
from typing import IO, Any

from room_outbox.cli.command import Command, add_app_code_option, add_json_option
from room_outbox.cli.consumers import format_states
from room_outbox.cli.output import format_age, format_app, format_time, printable
from room_outbox.config import MAIN_LANE, Settings
from room_outbox.consume.ops import consumer_states
from room_outbox.delivery.lanes import claim_after_ms, delivery_settings, lane_plan, lease_ms
from room_outbox.envelope import EnvelopeError, EnvelopeTooLarge, parse_envelope
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.backends.leased import CREATED_AHEAD_MS
from room_outbox.store.clock import now_ms
from room_outbox.store.lanes.catalog import stored_lanes
from room_outbox.store.operator.reports import (
    earlier_open_rows,
    event_rows,
    first_young_row_before,
    lane_row,
    tail_parked_row,
    tail_skipped_range,
)
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.profiles import V1, Profile
from room_outbox.store.schema.tail import CANCELLED


def _now_ms() -> int:
    """The cluster's time: the leases and due times shown were written on it."""
    return now_ms()


async def inspect_events(
    store: SQLStore, event_id: str, app_code: str | None = None, per_room: bool = False, main_lane: bool = True
) -> list[dict[str, Any]]:
    """Every row of ``event_id`` (of ``app_code`` when given; several apps may each have one
    where event ids are unique per app), lowest id first: each with its parsed envelope (or
    why it does not parse) and a sentence on its delivery state, with the store's
    ``claim_after_ms`` and the main lane's ``per_room`` ordering; ``main_lane``: whether the
    configuration runs the main lane (else ``status`` is room-service's, and no scan claims
    the row). Its times are epoch ms (0 or None: none)."""
    rows = await event_rows(store, event_id, app_code)
    return [await _inspected(store, row, seen, per_room, main_lane) for row, seen in rows]


async def _inspected(
    store: SQLStore, row: dict[str, Any], seen: dict[str, Any], per_room: bool, main_lane: bool = True
) -> dict[str, Any]:
    """One row as :func:`inspect_events` shows it; ``seen``: what :func:`event_rows` read of it."""
    p = store.profile
    row.pop("envelope", None)  # shown parsed below
    raw = seen["envelope"]
    doc: dict[str, Any] = {"row": row}
    try:
        envelope = parse_envelope(raw)
    except EnvelopeError as exc:
        doc["envelope_error"] = str(exc)
        if not isinstance(exc, EnvelopeTooLarge):  # left unread: the error says all there is
            doc["envelope_raw"] = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else raw
    else:
        doc["envelope"] = envelope.model_dump(mode="json", exclude_none=True)
        mismatches = [
            f"envelope {name} {getattr(envelope, name)!r} differs from the row's {seen[name]!r}"
            for name in ("event_id", "event_type", "room_id", "app_code")
            if getattr(envelope, name) != seen[name] and not (name == "app_code" and seen[name] == "")
        ]
        if mismatches:
            doc["envelope_error"] = "; ".join(mismatches)
    now = _now_ms()
    if not main_lane:
        doc["state"] = (
            f"status {row['status']!r} is {p.producer}'s: the main lane is disabled here (no tencent_im or noop"
            " sink enabled), so no scan of room-outbox claims this row; its lanes below say what room-outbox does"
        )
    else:
        doc["state"] = describe_state(row, now, p, store.claim_after_ms, store.lease_ms)
    if main_lane and doc["state"].startswith("due"):
        doc["state"] = await _held_back(store, seen, now, per_room) or doc["state"]
    lanes = await _lane_states(store, int(seen["key"]), str(seen["event_id"]), now)
    if lanes:
        doc["lanes"] = lanes
    return doc


async def _lane_states(store: SQLStore, outbox_id: int, event_id: str, now: int) -> dict[str, str]:
    """The event's state in each lane of its own (same vocabulary as the main lane's), or the
    id range it skipped; a tailing lane's from its cursor and its parked entries too."""
    states: dict[str, str] = {}
    for lane in await stored_lanes(store):
        if lane.fed_through_id is None:
            continue  # never ran
        found = await lane_row(store, lane.name, outbox_id) if lane.has_table else None
        parked = await tail_parked_row(store, lane.name, outbox_id)
        if parked is not None and parked["status"] == CANCELLED:
            states[lane.name] = (
                f"cancelled by an operator: never sent by the tailing lane (parked: {parked['last_error']})"
            )
        elif parked is not None:  # a tailing lane passed over it
            states[lane.name] = (
                f"{parked['status']} by the tailing lane: {parked['last_error']}"
                f" (`room-outbox requeue --lane {lane.name}` sends it again)"
            )
        elif found is not None:
            states[lane.name] = describe_state(found, now, requeue=f"room-outbox requeue --lane {lane.name}")
        elif not lane.has_table and not lane.tailed_past(outbox_id):
            states[lane.name] = "not sent by the tailing lane yet"
        elif not lane.has_table:
            skipped = await tail_skipped_range(store, lane.name, outbox_id)
            states[lane.name] = (
                "sent by the tailing lane (or before the lane's start)"
                if skipped is None
                else "skipped by the tailing lane, never sent: its id was missing longer than lanes.gap_timeout (or"
                " beyond lanes.max_gaps) and taken as a rolled-back insert (ids"
                f" {skipped['low_id']}-{skipped['high_id']}, given up on {format_time(skipped['skipped_at_ms'], now)});"
                f" it committed later (`room-outbox requeue --lane {lane.name} --event-id {event_id} --yes` sends it)"
            )
        elif outbox_id > lane.fed_through_id:
            states[lane.name] = "not fed to this lane yet"
        elif (skipped := await tail_skipped_range(store, lane.name, outbox_id)) is not None:
            states[lane.name] = (
                "skipped by the lane, never fed to its table: its id was missing longer than lanes.gap_timeout (or"
                " beyond lanes.max_gaps) and taken as a rolled-back insert (ids"
                f" {skipped['low_id']}-{skipped['high_id']}, given up on {format_time(skipped['skipped_at_ms'], now)});"
                f" it committed later (`room-outbox requeue --lane {lane.name} --event-id {event_id} --yes` feeds it)"
            )
        else:
            # Its row is still here, and retention removes a lane's rows with it: it came before
            # the lane started (start: now), or a feeder recording no skipped ids passed it.
            states[lane.name] = (
                "not in this lane: written before the lane started, or skipped by an earlier version of"
                " room-outbox, whose feeder recorded no skipped ids"
            )
    return states


def describe_state(
    row: dict[str, Any],
    now: int,
    words: Profile = V1,
    claim_after: int = 0,
    lease: int = 0,
    requeue: str = "room-outbox requeue",
) -> str:
    """A sentence on a row's delivery state, in ``words``' vocabulary and columns (lanes speak
    ``v1``), its times in epoch ms, ``now`` by the database's clock; ``claim_after`` and
    ``lease``: the main lane's ``outbox_worker.claim_after`` and ``outbox_worker.lease`` in ms;
    ``requeue``: the command that sends a parked row again (a lane table's names its lane)."""
    status = row["status"]
    retries = row[words.attempts] or 0  # NULL where the producer leaves a nullable column out
    lock_until = int(row.get(words.lock) or 0)
    if status == words.delivered:
        return f"{status}: delivered (or pushed by room-service itself); nothing left to do"
    if status == words.parked:
        return f"parked after {retries} attempt(s): never retried until `{requeue}`"
    if status == words.cancelled:
        return "cancelled by an operator: never delivered"
    if status not in words.open:
        return f"status {status!r}: not a status of table profile {words.name}"
    if words.lock in row and row[words.lock] is None:
        # The claim's ``lock <= now`` never matches NULL: `migrate` and `run` refuse such a
        # column with its fix, but the rows written before it stay where they are.
        return (
            f"stuck: its {words.lock} is NULL, which no claim takes; `room-outbox migrate` sets it where"
            " it is NULL and makes the column NOT NULL, or names the statements that do"
        )
    if row.get("worker_id") and lock_until > now:
        return f"in flight: leased by {row['worker_id']} for another {format_age(lock_until - now)}"
    if words.producer_claims and status == words.in_flight and not row.get("worker_id"):
        # The claim's rule (Profile.producers_claim_ended): left to the producer's worker a lease.
        updated = row.get(words.updated)
        taken_over = max(lock_until, int(updated) + lease if updated is not None else 0)
        if taken_over > now:
            return (
                f"in flight: claimed by {words.producer}'s own worker; taken over from"
                f" {format_time(taken_over, now)} if still {status} then ({words.updated} a lease old)"
            )
    old_enough = _old_enough_at(row, words, claim_after)
    if old_enough > max(now, lock_until):
        return _young(int(row[words.created]), old_enough, now, claim_after)
    if lock_until > now and not retries:  # a rate limit's (last_error: the destination's refusal, if any)
        return f"waiting: held back without an attempt (a rate limit), next try in {format_age(lock_until - now)}"
    if lock_until > now:
        return f"waiting: failed {retries} time(s), next attempt in {format_age(lock_until - now)}"
    if row.get("worker_id"):
        return f"due: the lease of {row['worker_id']} expired; the next scan takes it over"
    return "due: the next scan claims it" + (f" (failed {retries} time(s) so far)" if retries else "")


def _old_enough_at(row: dict[str, Any], words: Profile, claim_after: int) -> int:
    """When the main lane's claim finds an open row old enough, as the claim decides it: a row
    the producer wrote that no claim has taken yet ``claim_after`` after its creation (the
    producer pushes it itself meanwhile), any other row at once (0). A row without a creation
    time counts as old: its age cannot be told."""
    created = row.get(words.created)
    if not claim_after or created is None:
        return 0
    # Taken before: a lease or a retry time set (v1, room_cell), or no longer the producer's status.
    taken = int(row.get(words.lock) or 0) > 0 if words.fresh_at_cleared_lock else row["status"] != words.fresh
    return 0 if taken else int(created) + claim_after


async def _held_back(store: SQLStore, seen: dict[str, Any], now: int, per_room: bool) -> str | None:
    """Why the claim does not take a row that is due by its own state, as the claim decides it;
    None when it takes it. ``per_room``: behind the first earlier open row of its room that the
    claim would not take (leased, waiting for its retry, young); where the claim takes the
    producer's rows up to the first young one (MySQL/MariaDB), behind that row."""
    key, p, claim_after = int(seen["key"]), store.profile, store.claim_after_ms
    if per_room:
        for earlier in await earlier_open_rows(store, key, seen["app_code"], seen["room_id"]):
            state = describe_state(earlier, now, p, claim_after, store.lease_ms)
            if not state.startswith("due"):
                return (
                    f"waiting: behind event {earlier['event_id']} (id {earlier['key']}), an earlier event of its"
                    f" room (outbox_worker.ordering: per_room), which is {state}"
                )
    young = await first_young_row_before(store, key)
    if young is not None:
        return (
            f"waiting: behind event {young['event_id']} (id {young['key']}), younger than outbox_worker.claim_after:"
            " this database's claim takes the producer's rows in id order up to the first young one; claimable"
            f" from {format_time(young['created'] + claim_after, now)}"
        )
    return None


def _young(created: int, old_enough: int, now: int, claim_after: int) -> str:
    """The state of a row younger than ``claim_after``: when the claim takes it, and why not yet."""
    state = (
        f"young: left to the producer's own push until {format_age(claim_after)} old"
        f" (outbox_worker.claim_after); claimable from {format_time(old_enough, now)}"
    )
    if created > now + CREATED_AHEAD_MS:  # its producer's clock runs ahead of the database's
        state += f"; created {format_age(created - now)} ahead of the database's clock, it counts from then"
    return state


def format_inspection(doc: dict[str, Any], times: Collection[str]) -> str:
    """One row's document for a person; ``times``: its columns holding an epoch-ms time."""
    row = doc["row"]
    width = max(len(name) for name in row)
    now = _now_ms()
    lines = [
        f"{name:<{width}}  {printable(value)}"
        + (f"  {format_time(int(value), now)}" if name in times and value else "")
        for name, value in row.items()
    ]
    lines += ["", f"state: {printable(doc['state'])}"]
    lines += [f"lane {printable(lane)}: {printable(state)}" for lane, state in doc.get("lanes", {}).items()]
    lines.append("")
    if "envelope" in doc:
        lines.append("envelope:")
        # JSON escapes C0 controls inside strings; C1 controls and format characters it keeps.
        lines.append(printable(json.dumps(doc["envelope"], indent=2, ensure_ascii=False), keep_newlines=True))
    if "envelope_error" in doc:
        lines.append(f"envelope problem: {printable(doc['envelope_error'])}")
    if doc.get("envelope_raw") is not None:  # None: the column is NULL
        lines.append(f"raw envelope: {printable(doc['envelope_raw'][:2000])}")
    return "\n".join(lines)


async def inspect_command(
    store: SQLStore,
    event_id: str,
    as_json: bool,
    out: IO[str],
    err: IO[str],
    app_code: str | None = None,
    per_room: bool = False,
    main_lane: bool = True,
) -> int:
    """Every row of ``event_id`` (of ``app_code`` when given) and the consumers' records of
    it. ``--json``: one row's document as it is, several rows' as ``events``."""
    docs = await inspect_events(store, event_id, app_code, per_room, main_lane)
    times = store.profile.time_columns
    consumers = [s for s in await consumer_states(store, event_id) if app_code is None or s["app_code"] == app_code]
    if not docs and not consumers:
        of_app = f" of app {format_app(app_code)}" if app_code is not None else ""
        print(f"room-outbox inspect: no row with event_id {printable(event_id)!r}{of_app}", file=err)
        return 1
    if as_json:
        shown: dict[str, Any] = {"events": docs} if len(docs) > 1 else docs[0] if docs else {}
        print(json.dumps({**shown, "consumers": consumers}, indent=2, default=str, ensure_ascii=False), file=out)
        return 0
    if not docs:
        lines = [f"event {printable(event_id)}: not in room_outbox"]
    elif len(docs) == 1:
        lines = [format_inspection(docs[0], times)]
    else:  # event ids unique per app: one section per app's row
        lines = [f"event {printable(event_id)}: {len(docs)} rows, of several apps (--app-code shows one)"]
        for doc in docs:
            lines += ["", f"== app {format_app(doc['row'].get('app_code', ''))} ==", format_inspection(doc, times)]
    print("\n".join([*lines, "", *format_states(consumers)] if consumers else lines), file=out)
    return 0


async def _run(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    store.claim_after_ms = claim_after_ms(settings)  # the dispatcher's, for the states told
    store.lease_ms = lease_ms(settings)
    per_room = delivery_settings(settings, MAIN_LANE).ordering == "per_room"
    main_lane = lane_plan(make_plugin_manager(settings.plugins.disabled), settings).main
    return await inspect_command(
        store, args.event_id, args.json, sys.stdout, sys.stderr, args.app_code, per_room, main_lane
    )


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_id", help="the event's event_id")
    add_app_code_option(parser, "only this app's row (default: every app's row with this event_id)")
    add_json_option(parser)


COMMAND = Command(
    description="One event by event_id: its row (times in local time, with how long ago), its parsed\n"
    "envelope or why it does not parse, and its state in every lane, as the dispatcher sees it\n"
    "(a row younger than outbox_worker.claim_after: when it becomes claimable). --json keeps raw\n"
    "values (times: epoch ms).\n"
    "Where event ids are unique per app, every app's row with that id, each under its app code\n"
    "(--json: an events list); --app-code shows one app's.",
    examples="room-outbox inspect evt_01J9ZQ\nroom-outbox inspect evt_01J9ZQ --json | jq .row.last_error\n"
    "room-outbox inspect evt_01J9ZQ --app-code appa",
    needs="store",
    arguments=_arguments,
    run=_run,
)
