"""``room-outbox status``: the backlog, retries, frequent errors (grouped; of the rows retrying,
of the parked rows and of each lane's parked events), leases, lanes and consumers at a
glance. Its counts are exact (read in the status index); the retry histogram and the errors read
a sample of each status's rows, at most 10,000 however large the backlog, and say so. It is for a person at a terminal, not for a
timer (the metrics sample the backlog on an index instead)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import IO

from room_outbox.cli.command import Command, add_json_option, checked_report
from room_outbox.cli.consumers import format_overview
from room_outbox.cli.output import format_age, format_table, format_time
from room_outbox.config import Settings
from room_outbox.consume.ops import consumer_overview
from room_outbox.delivery.lanes import claim_after_ms, lane_plan
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.clock import now_ms
from room_outbox.store.operator.reports import STATUS_SAMPLE, StatusReport, status_report
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.profiles import V1, Profile

__all__ = ["COMMAND", "format_status", "status_command", "status_report"]


def _now_ms() -> int:
    """The cluster's time: the leases shown were written on it."""
    return now_ms()


def format_status(report: StatusReport, profile: Profile = V1) -> str:
    now = _now_ms()
    if not report.im_lane:
        lines = [f"main lane               disabled: {profile.status_owned}, not a backlog here"]
        lines += _format_lanes(report)
        return "\n".join(lines)
    lines = [
        f"pending               {report.pending}",
        f"oldest pending        {_oldest_pending(report, now)}",
        f"waiting for retry     {report.waiting_for_retry}",
        f"leased now            {report.leased}",
    ]
    if report.created_ahead:
        lines.append(
            f"created ahead         {report.created_ahead}  (up to {format_age(report.created_ahead_ms)} ahead of the"
            " database's clock, by more than outbox_worker.claim_after: claimed only once that old by their"
            f" {profile.created}, unless requeued; among the oldest {report.error_sample:,} not claimed yet)"
        )
    lines += [f"{status:<22}{count}" for status, count in report.other_statuses.items()]  # in the report's order
    sample = f"{report.error_sample:,}"
    lines += ["", "retries  pending rows"]
    if report.retry_histogram_sampled:  # the pending count above is exact; these rows are not all of them
        lines[-1] += f"  (a sample: the oldest {sample} of each status still to deliver, not all {report.pending:,})"
    lines += [f"{label:>7}  {rows}" for label, rows in report.retry_histogram.items()]
    lines += ["", "lease holders"]
    if report.holders:
        holders = [(h.node, h.claims, h.rows, format_time(h.lease_until_ms, now)) for h in report.holders]
        lines += format_table(("node", "claims", "rows", "lease ends"), holders, right=("claims", "rows"), indent="  ")
    else:
        lines.append("  (none)")
    lines += _format_lanes(report)
    lines += _format_errors(
        f"most frequent last_error of rows retrying (among the oldest {sample} still to deliver;"
        " identifiers such as a GroupId shown as <id>)",
        report.top_errors,
    )
    lines += _format_errors(
        f"most frequent last_error of parked (failed) rows (among the latest {sample})",
        report.top_parked_errors,
    )
    return "\n".join(lines)


def _oldest_pending(report: StatusReport, now: int) -> str:
    """When the oldest pending row was created; of one created ahead of the database's clock
    (its producer's clock runs ahead), that it was, rather than an age of 0 s."""
    if not report.pending:
        return "-"
    created = report.oldest_pending_created_ms
    if created is not None and created > now:
        return f"{format_time(created, now)}: created ahead of the database's clock"
    return format_time(now - report.oldest_pending_age_ms, now)


def _format_errors(title: str, top: list[tuple[str, int]]) -> list[str]:
    if not top:
        return ["", title, "  (none)"]
    errors = [(count, error) for error, count in top]
    return ["", title, *format_table(("rows", "last_error"), errors, right=("rows",), indent="  ")]


def _format_lanes(report: StatusReport) -> list[str]:
    if not report.lanes:
        return []
    # Skipped events: a column only when there are any (no round brings that figure down by itself).
    skipped = any(x.skipped for x in report.lanes)
    rows = [
        (x.lane, x.fed_through_id, x.unfed, x.pending, x.parked, *((x.skipped,) if skipped else ()))
        for x in report.lanes
    ]
    numbers: tuple[str, ...] = ("fed through id", "unfed", "pending", "parked", *(("skipped",) if skipped else ()))
    lines = ["", *format_table(("lane", *numbers), rows, right=numbers, indent="  ")]
    # The operator sends them (requeue) or drops them (cancel): say how.
    lines += [
        f"  lane {x.lane}: {x.skipped} event(s) skipped and never sent (their ids were missing longer than"
        f" lanes.gap_timeout, then they committed): `room-outbox requeue --lane {x.lane} --yes` sends them"
        for x in report.lanes
        if x.skipped
    ]
    for lane in report.lanes:
        if lane.top_parked_errors:  # `requeue --lane` / `cancel --lane` take them
            title = (
                f"most frequent last_error of lane {lane.lane}'s parked rows (among the latest {STATUS_SAMPLE:,};"
                f" requeue or cancel them with --lane {lane.lane})"
            )
            lines += _format_errors(title, lane.top_parked_errors)
    return lines


async def status_command(store: SQLStore, as_json: bool, out: IO[str], im_lane: bool = True) -> int:
    report = await status_report(store, im_lane=im_lane)
    consumers = await consumer_overview(store)
    if as_json:
        print(json.dumps({**report.to_json(), "consumers": consumers}, indent=2), file=out)
    else:
        print(
            format_status(report, store.profile) + "\n".join(["", *format_overview(consumers)] if consumers else []),
            file=out,
        )
    return 0


async def _run(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    plan = lane_plan(make_plugin_manager(settings.plugins.disabled), settings)
    store.claim_after_ms = claim_after_ms(settings)  # the dispatcher's: which rows it holds back as young
    report = functools.partial(status_command, store, args.json, sys.stdout, plan.main)
    return await checked_report(store, settings, plan, report, sys.stderr, "status")


COMMAND = Command(
    description="The backlog (pending rows, the oldest one's time), rows waiting for a retry, the retry-count\n"
    "histogram, lease holders, lanes of their own and the most frequent last_error values of the\n"
    "rows retrying and, apart, of the parked (failed) rows and of each lane's parked events\n"
    "(which requeue --lane and cancel --lane take), grouped (errors that differ only by an\n"
    "identifier such as a GroupId are one line, with their count). The histogram and the errors\n"
    "are read from at most 10,000 rows of a status: the oldest still to deliver, the latest parked;\n"
    "the histogram says when it is such a sample. Pending rows created more than\n"
    "outbox_worker.claim_after ahead of the database's clock (a producer's clock or unit gone\n"
    "wrong) are counted apart, with how far ahead: the main lane leaves them until then unless\n"
    "requeued (among the oldest 10,000 not claimed yet). The schema is checked as `run`\n"
    "checks it at start: what would stop `run` (a missing index, say) follows the report on stderr,\n"
    "with its fix, and the exit code is 3.",
    examples="room-outbox status\nroom-outbox status --json | jq .oldest_pending_age_ms",
    needs="store",
    arguments=add_json_option,
    run=_run,
)
