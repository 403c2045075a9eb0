"""``room-outbox requeue``: pending or parked (``failed``) rows made due now with retry_count 0,
shown first and changed only with ``--yes``. It is how rows that were parked, or whose
envelope did not parse, are sent round again once the cause is fixed. Filters combine freely;
``--status failed`` alone is a filter (everything parked)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from room_outbox.cli.command import (
    Command,
    add_app_code_option,
    add_json_option,
    add_yes_option,
    duration_argument,
    lane_named,
    main_lane_off,
    several_apps,
)
from room_outbox.cli.output import NONE, format_age, format_app, format_table, printable
from room_outbox.config import Settings
from room_outbox.delivery.lanes import claim_after_ms
from room_outbox.store.clock import now_ms
from room_outbox.store.lanes.store import LaneStore
from room_outbox.store.lanes.tail import TailStore
from room_outbox.store.operator.changes import (
    RequeueFilter,
    find_parked_in_lane,
    find_parked_in_lane_table,
    find_requeue_candidates,
    find_skipped_in_lane,
    requeue,
    requeue_in_lane_table,
)
from room_outbox.store.operator.reports import any_event_of_several_apps, event_apps
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.tail import REQUEUED, SKIPPED

#: Rows one ``requeue`` changes at most (in one transaction): a list a person can still read.
REQUEUE_LIMIT = 10_000


async def requeue_command(
    store: SQLStore,
    where: RequeueFilter,
    apply: bool,
    out: Any,
    limit: int = REQUEUE_LIMIT,
    as_json: bool = False,
    err: Any = None,
) -> int:
    """The rows ``where`` selects, listed, and requeued with ``apply``. An ``--event-id`` that
    names rows of several apps is refused (exit code 1, nothing changed) unless the filter
    names the app: the operator meant one event; why on ``err`` (default: standard error)."""
    if await _ids_of_several_apps(store, where.event_ids if where.app_code is None else (), err or sys.stderr):
        return 1
    rows = await find_requeue_candidates(store, where, limit + 1)  # one more: are there more?
    more = len(rows) > limit
    rows = rows[:limit]
    changed = await requeue(store, [row["id"] for row in rows]) if apply and rows else 0
    if as_json:
        doc = {"applied": apply, "matched": len(rows), "more": more, "requeued": changed, "rows": rows}
        print(json.dumps(doc, indent=2, default=str), file=out)
        return 0
    if not rows:
        words = store.profile
        print(
            f"no rows match ({words.delivered}, {words.cancelled} and currently leased rows are never requeued)",
            file=out,
        )
        return 0
    now = now_ms()  # the database's clock, which wrote created_at_ms: not this host's
    cells = [
        (r["event_id"], format_app(r["app_code"]), r["event_type"], r["status"], r["retry_count"],
         _age(r["created_at_ms"], now), r["last_error"] or "")
        for r in rows
    ]  # fmt: skip
    headers = ("event_id", "app_code", "event_type", "status", "retries", "age", "last_error")
    print("\n".join(format_table(headers, cells, right=("retries", "age"))), file=out)
    beyond = f"; more than {limit:,} rows match: only the first {limit:,} (lowest ids) are taken" if more else ""
    if not apply:
        print(f"{len(rows)} row(s) would be requeued{beyond}; run again with --yes to apply", file=out)
        return 0
    note = ""
    if changed < len(rows):  # claimed, delivered or cancelled since they were listed
        words = store.profile
        note = (
            f"; {len(rows) - changed} of the {len(rows)} listed changed meanwhile"
            f" (leased, {words.delivered} or {words.cancelled})"
        )
    print(f"requeued {changed} row(s){note}{_reaching_the_rest(where, limit) if more else ''}", file=out)
    return 0


def _age(created: int | None, now: int) -> str:
    """A row's age for the list; of a row created ahead of the database's clock, how far."""
    if created is None:
        return NONE
    return format_age(now - created) if created <= now else f"{format_age(created - now)} ahead"


async def _ids_of_several_apps(store: SQLStore, event_ids: Sequence[str], err: Any) -> bool:
    """Whether one of ``event_ids`` names rows of several apps; then says so on ``err``, for
    each such id (looked up one by one only then: the operator may list thousands)."""
    if not await any_event_of_several_apps(store, event_ids):
        return False
    several = False
    for event_id in event_ids:
        apps = await event_apps(store, event_id)
        if len(apps) > 1:
            print(several_apps("requeue", event_id, apps), file=err)
            several = True
    return several


def _reaching_the_rest(where: RequeueFilter, limit: int) -> str:
    """How to reach the rows beyond ``limit``. Requeued rows are pending and may match again;
    with ``--status failed`` they no longer do, so running it again reaches the rest. The hint
    names only the filters not given already."""
    taken = f"; more than {limit:,} rows matched: only the first {limit:,} (lowest ids) were taken;"
    if where.statuses == ("failed",):
        return f"{taken} run it again to reach the rest (the rows just requeued no longer match --status failed)"
    narrower = [
        option
        for option, given in (("--event-type", where.event_type), ("--older-than", where.older_than_ms))
        if given is None
    ]
    return f"{taken} narrow the filter ({', '.join(['--status failed', *narrower])}) to reach the rest"


def requeue_filter(args: argparse.Namespace) -> RequeueFilter:
    """The rows the arguments select."""
    return RequeueFilter(
        event_ids=tuple(args.event_id),
        app_code=args.app_code,
        event_type=args.event_type,
        error_contains=args.error_contains,
        older_than_ms=int(args.older_than.seconds * 1000) if args.older_than else None,
        statuses=(args.status,) if args.status else ("pending", "failed"),
    )


def _filtered(args: argparse.Namespace) -> bool:
    """Whether a filter narrows the main lane's rows: every open row is too wide a net to be
    cast by accident (``--app-code`` alone still takes all of an app's)."""
    return bool(args.event_id or args.event_type or args.error_contains or args.older_than or args.status)


async def requeue_lane_command(
    store: SQLStore,
    lane: str,
    where: RequeueFilter,
    apply: bool,
    out: Any,
    err: Any,
    limit: int = REQUEUE_LIMIT,
    as_json: bool = False,
) -> int:
    """A lane's parked events and skipped ones (committed after the lane gave up on their ids)
    that ``where`` selects (:func:`find_parked_in_lane_table` for a lane table,
    :func:`find_parked_in_lane` for a tailing lane, :func:`find_skipped_in_lane`; all of them
    when it names nothing), listed together, and with ``apply`` made to be sent: the listed
    ones and no other, at most ``limit``, as :func:`requeue_command` takes rows. A lane table's
    parked rows become pending, due now, there (:func:`requeue_in_lane_table`) and its skipped
    ones are fed into it, pending; a tailing lane's next round sends them (a skipped one becomes
    a requeued entry of the parked table). room_outbox's rows are left as they are. An event id
    that names rows of several apps is refused as :func:`requeue_command` refuses it."""
    stored = await lane_named(store, lane, "requeue", err)
    if stored is None:
        return 1
    if await _ids_of_several_apps(store, where.event_ids if where.app_code is None else (), err):
        return 1
    # One more of each: are there more? Skipped events are sent as requeued parked ones are.
    find_parked = find_parked_in_lane_table if stored.has_table else find_parked_in_lane
    found = await find_parked(store, lane, where, limit + 1)
    found += await find_skipped_in_lane(store, lane, where, limit + 1)
    rows = sorted(found, key=lambda row: int(row["outbox_id"]))
    more = len(rows) > limit
    rows = rows[:limit]
    changed = 0
    if apply and rows:
        parked = [int(row["outbox_id"]) for row in rows if row["status"] != SKIPPED]
        skipped = [int(row["outbox_id"]) for row in rows if row["status"] == SKIPPED]
        if stored.has_table:
            changed = await requeue_in_lane_table(store, lane, parked)
            changed += await LaneStore(owner=store, lane=lane).take_skipped(skipped)
        else:
            tail = TailStore(owner=store, lane=lane)
            changed = await tail.requeue(parked)
            changed += await tail.take_skipped(skipped, REQUEUED)
    if as_json:
        doc = {"lane": lane, "applied": apply, "matched": len(rows), "more": more, "requeued": changed, "rows": rows}
        print(json.dumps(doc, indent=2, default=str), file=out)
        return 0
    if not rows:
        print(f"no parked or skipped events in lane {printable(lane)} match", file=out)
        return 0
    now = now_ms()  # the database's clock, which wrote created_at_ms
    cells = [
        (r["event_id"], NONE if r["app_code"] is None else format_app(r["app_code"]), r["event_type"] or NONE,
         r["room_id"], NONE if r["created_at_ms"] is None else format_age(now - r["created_at_ms"]),
         r["last_error"] or "")
        for r in rows
    ]  # fmt: skip
    headers = ("event_id", "app_code", "event_type", "room_id", "age", "last_error")
    print("\n".join(format_table(headers, cells, right=("age",))), file=out)
    beyond = f"; more than {limit:,} events match: only the first {limit:,} (lowest ids) are taken" if more else ""
    if not apply:
        print(f"{len(rows)} event(s) would be requeued{beyond}; run again with --yes to apply", file=out)
        return 0
    note = f"; {len(rows) - changed} of the {len(rows)} listed changed meanwhile" if changed < len(rows) else ""
    rest = (
        f"; more than {limit:,} events matched: only the first {limit:,} (lowest ids) were taken; run it again to"
        " reach the rest (the events just requeued are no longer parked or skipped)"
    )
    print(f"requeued {changed} event(s) in lane {printable(lane)}{note}{rest if more else ''}", file=out)
    return 0


async def _run(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    if args.lane:
        if args.status:  # a lane's entries are all to be sent: a status there would select nothing or everything
            print(
                "room-outbox requeue: --lane does not take --status (it takes a lane's parked and skipped events)",
                file=sys.stderr,
            )
            return 2
        return await requeue_lane_command(
            store, args.lane, requeue_filter(args), args.yes, sys.stdout, sys.stderr, as_json=args.json
        )
    if not _filtered(args):
        print(
            "room-outbox requeue: give at least one of --event-id, --event-type, --error-contains, --older-than,"
            " --status",
            file=sys.stderr,
        )
        return 2
    if main_lane_off(store, settings, "requeue", sys.stderr):
        return 2
    store.claim_after_ms = claim_after_ms(settings)  # the dispatcher's: which rows it holds back as young
    return await requeue_command(store, requeue_filter(args), args.yes, sys.stdout, as_json=args.json)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--event-id", action="append", default=[], help="this event (repeatable)")
    add_app_code_option(parser, "only this app's rows; needed with an --event-id that several apps have")
    parser.add_argument("--event-type", help="events of this type")
    parser.add_argument("--error-contains", help="events whose last_error contains this text (whatever the case)")
    parser.add_argument(
        "--older-than",
        type=duration_argument,
        metavar="DURATION",
        help="events created at least this long ago (e.g. 10m)",
    )
    parser.add_argument(
        "--status",
        choices=("pending", "failed"),
        help="only rows in this status (default: both); a filter on its own; not with --lane",
    )
    parser.add_argument(
        "--lane",
        help="a lane of its own (a lane table, or a tailing lane such as kafka): send its parked events again,"
        " and the events it skipped (ids missing longer than lanes.gap_timeout that committed later): those the"
        " other filters select; without one: all. The lane's rows alone change",
    )
    add_yes_option(parser, "apply the change")
    add_json_option(parser)


COMMAND = Command(
    description="Make pending or parked (failed) rows due now with retry_count 0. Without --yes it only\n"
    "lists the rows it would change. Filters combine freely; --status failed alone takes every\n"
    "parked row. Rows created more than outbox_worker.claim_after ahead of the database's clock\n"
    "(a producer's clock or unit gone wrong), which the main lane would leave until then, are made\n"
    "due now too. At most 10,000 rows a run; it says so when more match. Published, cancelled\n"
    "and currently leased rows are never touched. An --event-id that several apps' rows have\n"
    "(event ids unique per app) is refused until --app-code names the app. With --lane, a lane's\n"
    "parked events (a lane table's parked rows, a tailing lane's parked entries) and the events it\n"
    "skipped (committed after lanes.gap_timeout), listed together, made to be sent again there\n"
    "(room_outbox's row is left as it is); selected by the same filters (but --status) and capped\n"
    "the same way. Without --lane it is refused while the configuration runs no main lane:\n"
    "room_outbox.status is then room-service's.",
    examples='room-outbox requeue --error-contains "group gone"\n'
    "room-outbox requeue --status failed\n"
    "room-outbox requeue --event-type RoomGiftSent --status failed --yes\n"
    'room-outbox requeue --lane kafka --error-contains "too large" --yes\n'
    "room-outbox requeue --lane audit_table --yes",
    needs="store",
    arguments=_arguments,
    run=_run,
)
