"""``room-outbox lanes`` and ``room-outbox lanes retire NAME``: the lanes an operator sees and
drops.

A lane is *enabled* when the configuration runs it (the main lane while an main-lane sink is
enabled; a lane of its own while its sink is). A lane of its own that was enabled once and is
not any more leaves its table and cursor behind; they hold back retention (its rows are
still owed to it, as far as the database can tell) until the lane runs again or is retired.
Retiring drops both. It refuses an enabled lane: stop running it first, on every process.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, dataclass
from typing import IO

from room_outbox.cli.command import Command, add_json_option, add_yes_option, checked_report
from room_outbox.cli.output import NONE, format_age, format_table
from room_outbox.config import MAIN_LANE, LanePlan, Settings
from room_outbox.delivery.lanes import lane_plan
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.lanes.catalog import (
    LaneBacklog,
    im_lane_backlog,
    own_lane_backlog,
    retire_lane,
    stored_lanes,
)
from room_outbox.store.protocol import SQLStore


@dataclass(frozen=True)
class LaneRow:
    lane: str
    #: ``enabled``, ``enabled, not started yet``, ``disabled``, or for IM ``disabled (...)``.
    state: str
    enabled: bool
    fed_through_id: int | None
    pending: int | None
    unfed: int | None
    parked: int | None
    oldest_owed_age_ms: int | None
    #: Events it skipped and never sent (committed after it gave up on their ids): sent once
    #: requeued (``requeue --lane``); None for the main lane, which skips none.
    skipped: int | None = None


async def lane_rows(store: SQLStore, plan: LanePlan) -> list[LaneRow]:
    rows: list[LaneRow] = []
    if plan.main:
        rows.append(_row(MAIN_LANE, "enabled", True, None, await im_lane_backlog(store), main=True))
    else:
        # The table's status is its producer's alone then: not a backlog of anyone's here.
        state = f"disabled ({store.profile.status_owned})"
        rows.append(LaneRow(MAIN_LANE, state, False, None, None, None, None, None))
    stored = {lane.name: lane for lane in await stored_lanes(store)}
    for name in sorted(stored.keys() | set(plan.own)):
        enabled = name in plan.own
        lane = stored.get(name)
        if lane is None or lane.fed_through_id is None:
            state = "enabled, not started yet" if enabled else "disabled, never ran"
        else:
            state = "enabled" if enabled else "disabled: holds back retention until retired"
        backlog = await own_lane_backlog(store, lane) if lane is not None else LaneBacklog(0, 0, 0, None)
        rows.append(_row(name, state, enabled, lane.fed_through_id if lane else None, backlog))
    return rows


def _row(name: str, state: str, enabled: bool, fed: int | None, backlog: LaneBacklog, main: bool = False) -> LaneRow:
    return LaneRow(
        name, state, enabled, fed, backlog.pending, backlog.unfed, backlog.parked, backlog.oldest_age_ms(),
        None if main else backlog.skipped,
    )  # fmt: skip


def format_lanes(rows: list[LaneRow]) -> str:
    def cell(value: int | None) -> object:
        return NONE if value is None else value

    cells = [
        (
            r.lane, cell(r.fed_through_id), cell(r.pending), cell(r.unfed), cell(r.parked), cell(r.skipped),
            NONE if r.oldest_owed_age_ms is None or not (r.pending or r.unfed) else format_age(r.oldest_owed_age_ms),
            r.state,
        )
        for r in rows
    ]  # fmt: skip
    numbers = ("fed through id", "pending", "unfed", "parked", "skipped", "oldest owed")
    return "\n".join(format_table(("lane", *numbers, "state"), cells, right=numbers))


async def lanes_command(store: SQLStore, plan: LanePlan, args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    if getattr(args, "lanes_action", None) == "retire":
        return await _retire(store, plan, args.name, args.yes, out, err)
    rows = await lane_rows(store, plan)
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else format_lanes(rows), file=out)
    return 0


async def _retire(store: SQLStore, plan: LanePlan, name: str, yes: bool, out: IO[str], err: IO[str]) -> int:
    if name == MAIN_LANE:
        print("room-outbox lanes retire: the main lane is room_outbox.status itself; it cannot be retired", file=err)
        return 2
    if name in plan.own:
        print(
            f"room-outbox lanes retire: lane {name} is enabled (sinks.{name}); set sinks.{name}.enabled: false"
            " and stop every process that runs it first",
            file=err,
        )
        return 2
    rows = {row.lane: row for row in await lane_rows(store, plan)}
    row = rows.get(name)
    if row is None:
        others = ", ".join(lane for lane in rows if lane != MAIN_LANE) or "none"
        print(
            f"room-outbox lanes retire: no lane named {name!r} in this database (lanes of their own: {others})",
            file=err,
        )
        return 1
    owed = f"{row.pending} pending, {row.unfed} unfed, {row.parked} parked"
    if not yes:
        print(
            f"would drop lane {name} (fed through id {row.fed_through_id}; {owed}): its cursor, and its table or its parked rows",
            file=out,
        )
        print("run again with --yes to drop it", file=out)
        return 0
    for change in await retire_lane(store, name):
        print(change, file=out)
    print(f"lane {name} retired ({owed} given up)", file=out)
    return 0


async def _run(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    plan = lane_plan(make_plugin_manager(settings.plugins.disabled), settings)
    command = functools.partial(lanes_command, store, plan, args, sys.stdout, sys.stderr)
    if getattr(args, "lanes_action", None) == "retire":  # a change, not a report
        return await command()
    return await checked_report(store, settings, plan, command, sys.stderr, "lanes")


def _arguments(parser: argparse.ArgumentParser) -> None:
    add_json_option(parser)
    actions = parser.add_subparsers(dest="lanes_action", metavar="ACTION")
    retire = actions.add_parser(
        "retire", help="drop a disabled lane's table and cursor; shows it, drops only with --yes"
    )
    retire.add_argument("name", help="the lane (the sink's name)")
    add_yes_option(retire, "drop it")


COMMAND = Command(
    description="Every lane: the main lane, each enabled sink with a lane of its own, and every lane table or\n"
    "cursor the database still holds, with its state, watermark (fed through id), pending, unfed,\n"
    "parked and skipped rows (committed after the lane gave up on their ids; `requeue --lane`\n"
    "sends them) and the age of the oldest event it owes. `lanes retire NAME` shows what a\n"
    "disabled lane leaves behind; with --yes it drops its table (a tailing lane: its parked\n"
    "rows), skipped ranges and cursor. The list checks the schema as `run` does at start: what would stop `run`\n"
    "follows it on stderr, with its fix, and the exit code is 3.",
    examples="room-outbox lanes\nroom-outbox lanes --json | jq '.[] | {lane, pending}'\n"
    "room-outbox lanes retire audit_table --yes\nroom-outbox lanes retire audit_table --config config/config.yaml",
    needs="store",
    arguments=_arguments,
    run=_run,
)
