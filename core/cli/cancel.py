"""``room-outbox cancel EVENT_ID``: a pending or parked event marked ``cancelled``: never
delivered, the row kept for audit. Like every command that changes rows it previews by
default and changes the row only with ``--yes``. A leased row is refused (its delivery may
already have reached the sink)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from room_outbox.cli.command import (
    Command,
    add_app_code_option,
    add_json_option,
    add_yes_option,
    lane_named,
    main_lane_off,
    several_apps,
)
from room_outbox.cli.inspect import describe_state
from room_outbox.cli.output import format_app, printable
from room_outbox.config import Settings
from room_outbox.store.clock import now_ms
from room_outbox.store.lanes.tail import TailStore
from room_outbox.store.operator.changes import IN_FLIGHT, SEVERAL_APPS, cancel, cancel_in_lane_table
from room_outbox.store.operator.reports import event_apps, event_rows
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.profiles import V1
from room_outbox.store.schema.tail import PARKED, SKIPPED


async def cancel_command(
    store: SQLStore,
    event_id: str,
    out: Any,
    err: Any,
    apply: bool = True,
    as_json: bool = False,
    app_code: str | None = None,
) -> int:
    """Result on ``out``; why nothing was (or would be) cancelled on ``err`` (exit code 1). An
    event id that names rows of several apps is refused unless ``app_code`` says which."""
    if apply:
        cancelled, status = await cancel(store, event_id, app_code)
    else:
        cancelled, status = False, await _status_now(store, event_id, app_code)
    would = not apply and status not in (None, IN_FLIGHT, SEVERAL_APPS) and _cancellable(store, str(status))
    apps = await event_apps(store, event_id) if status == SEVERAL_APPS else []
    if as_json:
        doc = {"event_id": event_id, "app_code": app_code, "applied": apply, "cancelled": cancelled,
               "would_cancel": would, "status": status}  # fmt: skip
        print(json.dumps({**doc, "app_codes": apps} if apps else doc, indent=2), file=out)
        return 0 if cancelled or would else 1
    shown = printable(event_id) + (f" of app {format_app(app_code)}" if app_code is not None else "")
    if cancelled:
        print(f"cancelled {shown}: it will never be delivered; the row is kept", file=out)
        return 0
    if would:
        print(f"would cancel {shown} (now {printable(status)}); run again with --yes to cancel it", file=out)
        return 0
    if status is None:
        print(f"room-outbox cancel: no event {shown}", file=err)
    elif status == SEVERAL_APPS:
        print(several_apps("cancel", event_id, apps), file=err)
    elif status == IN_FLIGHT:
        print(
            f"room-outbox cancel: {shown} is being delivered right now; try again once its attempt has ended",
            file=err,
        )
    else:
        words = store.profile
        print(
            f"room-outbox cancel: {shown} is {printable(status)}: only {', '.join(words.open)} or {words.parked}"
            " events can be cancelled",
            file=err,
        )
    return 1


async def cancel_lane_command(
    store: SQLStore,
    lane: str,
    event_id: str,
    out: Any,
    err: Any,
    apply: bool = True,
    as_json: bool = False,
    app_code: str | None = None,
) -> int:
    """``cancel --lane``: the event parked or skipped in a lane of its own made ``cancelled``
    there (the lane never sends it; the row in room_outbox is left as it is): a lane table's
    row (:func:`cancel_in_lane_table`), a tailing lane's parked entry (:meth:`TailStore.cancel`).
    Result on ``out``; why nothing was (or would be) cancelled on ``err`` (exit code 1). An
    event id that names rows of several apps is refused unless ``app_code`` says which."""
    stored = await lane_named(store, lane, "cancel", err)
    if stored is None:
        return 1
    apps = await event_apps(store, event_id) if app_code is None else []
    if len(apps) > 1:
        print(several_apps("cancel", event_id, apps), file=err)
        return 1
    if stored.has_table:
        status = await cancel_in_lane_table(store, lane, event_id, apply, app_code)
        parked, kept = V1.parked, "its row there is kept"
    else:
        status = await TailStore(owner=store, lane=lane).cancel(event_id, apply, app_code)
        parked, kept = PARKED, "its parked entry is kept"
    done = status in (parked, SKIPPED)
    if as_json:
        doc = {"event_id": event_id, "app_code": app_code, "lane": lane, "applied": apply,
               "cancelled": apply and done, "would_cancel": not apply and done, "status": status}  # fmt: skip
        print(json.dumps(doc, indent=2), file=out)
        return 0 if done else 1
    shown = printable(event_id) + (f" of app {format_app(app_code)}" if app_code is not None else "")
    where = f"lane {printable(lane)}"
    if done and apply:
        print(f"cancelled {shown} in {where}: it will never be sent there; {kept}", file=out)
    elif done:
        print(f"would cancel {shown} in {where} (now {status}); run again with --yes to cancel it", file=out)
    elif status is None:
        print(f"room-outbox cancel: {shown} is neither parked nor skipped in {where}", file=err)
    else:
        named = PARKED if parked == PARKED else f"{PARKED} ({parked})"  # a lane table's word for it: failed
        print(
            f"room-outbox cancel: {shown} is {printable(status)} in {where}: only {named} events can be cancelled",
            file=err,
        )
    return 0 if done else 1


async def _status_now(store: SQLStore, event_id: str, app_code: str | None) -> str | None:
    """The event's status as :func:`cancel` would report it, read without changing it."""
    found = await event_rows(store, event_id, app_code)
    if len(found) != 1:
        return SEVERAL_APPS if found else None
    ((row, _),) = found
    if describe_state(row, now_ms(), store.profile).startswith("in flight"):
        return IN_FLIGHT
    return str(row["status"])


def _cancellable(store: SQLStore, status: str) -> bool:
    words = store.profile
    return status in (*words.open, words.parked)


async def _run(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    if args.lane:
        return await cancel_lane_command(
            store, args.lane, args.event_id, sys.stdout, sys.stderr, args.yes, args.json, args.app_code
        )
    if main_lane_off(store, settings, "cancel", sys.stderr):
        return 2
    return await cancel_command(store, args.event_id, sys.stdout, sys.stderr, args.yes, args.json, args.app_code)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("event_id", help="the event's event_id")
    add_app_code_option(parser, "the app whose event it is; needed where several apps have an event with this id")
    parser.add_argument(
        "--lane",
        help="a lane of its own (a lane table, or a tailing lane such as kafka): cancel the event that lane"
        " parked or skipped instead (that lane never sends it; the row in room_outbox is left as it is)",
    )
    add_yes_option(parser, "cancel it")
    add_json_option(parser)


COMMAND = Command(
    description="Mark a pending or parked event cancelled: it is never delivered; the row is kept.\n"
    "With --lane, an event a lane of its own parked or skipped: that lane never sends it; its row\n"
    "(a lane table's) or entry (a tailing lane's) there is kept as cancelled, room_outbox's row is\n"
    "left as it is. Without --yes it only says what it would do. An event id that several\n"
    "apps' rows have (event ids unique per app) is refused until --app-code names the app.\n"
    "Without --lane it is refused while the configuration runs no main lane: room_outbox.status\n"
    "is then room-service's.",
    examples="room-outbox cancel evt_01J9ZQ\nroom-outbox cancel evt_01J9ZQ --yes\n"
    "room-outbox cancel evt_01J9ZQ --app-code appa --yes\n"
    "room-outbox cancel evt_01J9ZQ --lane kafka --yes\n"
    "room-outbox cancel evt_01J9ZQ --lane audit_table --yes\n"
    "room-outbox cancel evt_01J9ZQ --lane kafka --app-code appa --yes",
    needs="store",
    arguments=_arguments,
    run=_run,
)
