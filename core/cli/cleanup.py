"""``room-outbox cleanup``: retention's pass run by hand, previewed unless ``--yes``. Each batch
is its own transaction: an interrupted run keeps what it removed, and says how much."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import IO

import anyio

from room_outbox.cli.command import (
    Command,
    TypedDuration,
    add_json_option,
    add_yes_option,
    duration_argument,
    format_duration,
)
from room_outbox.config import LanePlan, Settings
from room_outbox.delivery.lanes import lane_plan
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.operator.retention import (
    CleanupReport,
    RetentionOptions,
    archive_table,
    cleanup,
    prune_consumer_records,
)
from room_outbox.store.protocol import SQLStore


async def cleanup_command(
    store: SQLStore,
    options: RetentionOptions,
    apply: bool,
    out: IO[str],
    err: IO[str],
    show_progress: bool,
    plan: LanePlan | None = None,
    older_than: str | None = None,
    as_json: bool = False,
) -> int:
    """``room-outbox cleanup``: one pass, removing rows only when ``apply`` (``--yes``), else
    counting them; a progress line per batch on ``err`` when ``show_progress`` (a terminal);
    then a one-line summary on ``out``, one for the consumers' records (where they are kept),
    and a line per lane that holds rows back. ``older_than``: the duration as typed, echoed."""
    archive = archive_table(store.profile.table)
    verb = ("moved to " + archive if options.archive else "deleted") if apply else "would be removed"
    so_far = CleanupReport()

    def progress(report: CleanupReport) -> None:
        nonlocal so_far
        so_far = report
        if show_progress:
            print(
                f"batch {report.batches}: {report.removed:,} row(s) {verb} so far (ids up to {report.last_id},"
                f" {report.seconds:.1f}s)",
                file=err,
                flush=True,
            )

    try:
        report = await cleanup(store, options, plan, dry_run=not apply, progress=progress)
    except (KeyboardInterrupt, anyio.get_cancelled_exc_class()):
        if apply:  # each batch committed on its own: what was removed stays removed
            print(
                f"room-outbox cleanup: interrupted after {so_far.removed:,} row(s) {verb}"
                f" in {so_far.batches} batch(es); run it again to finish",
                file=err,
                flush=True,
            )
        raise
    older = f"older than {older_than or format_duration(options.older_than)}"
    consumers = await prune_consumer_records(store, options, dry_run=not apply)
    if as_json:
        doc = {
            "applied": apply,
            "older_than_seconds": options.older_than,
            "archive": options.archive,
            **{k: v for k, v in asdict(report).items()},
            "consumers": asdict(consumers) if consumers.present else None,
        }
        print(json.dumps(doc, indent=2), file=out)
        return 0
    what = f"{store.profile.delivered} row(s)" if report.by_status else "row(s) every enabled lane has finished"
    if not apply:
        target = f"moved to {archive}" if options.archive else "deleted"
        print(
            f"{report.removed} {what} {older} would be {target} (dry run: nothing changed;"
            " run again with --yes to remove them)",
            file=out,
        )
    else:
        print(
            f"{report.removed} {what} {older} {verb}"
            f" in {report.batches} batch(es) of at most {options.batch_size}, {report.seconds:.1f}s",
            file=out,
        )
    if consumers.present:
        done = "would be deleted (dry run)" if not apply else f"deleted in {consumers.batches} batch(es)"
        print(
            f"consumers: {consumers.processed} processed record(s) older than"
            f" {format_duration(options.processed_older_than)} and {consumers.resolved} resolved retry row(s) {done}",
            file=out,
        )
    for lane in report.waiting_for:
        print(
            f"lane {lane} is enabled but has never run; nothing is removed until it has (`room-outbox run`)", file=out
        )
    for lane in report.held_back_by:
        print(
            f"lane {lane} is not enabled, but its leftovers hold rows back; "
            f"`room-outbox lanes retire {lane} --yes` drops them",
            file=out,
        )
    return 0


async def _run(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    typed: TypedDuration | None = args.older_than
    options = RetentionOptions.from_settings(settings.retention, typed.seconds if typed else None, args.archive)
    plan = lane_plan(make_plugin_manager(settings.plugins.disabled), settings)
    return await cleanup_command(
        store, options, args.yes, sys.stdout, sys.stderr, sys.stderr.isatty(), plan, str(typed) if typed else None,
        args.json,
    )  # fmt: skip


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--older-than",
        type=duration_argument,
        metavar="DURATION",
        help="override retention.older_than (e.g. 168h, 30d)",
    )
    parser.add_argument("--archive", action="store_true", help="move rows to room_outbox_archive instead")
    preview = parser.add_mutually_exclusive_group()
    preview.add_argument("--dry-run", action="store_true", help="count what would be removed; remove nothing (default)")
    add_yes_option(preview, "remove the rows")
    add_json_option(parser)


COMMAND = Command(
    description="Remove published rows older than retention.older_than (or --older-than), in small batches;\n"
    "with --archive move them to room_outbox_archive. The consumers' processed records older\n"
    "than retention.processed_older_than and their resolved retry rows go too. Without --yes\n"
    "nothing is removed: it counts what would be (as --dry-run does). On a terminal, a progress\n"
    "line per batch; interrupted, it says how many rows it had already removed.",
    examples="room-outbox cleanup --older-than 30d\nroom-outbox cleanup --older-than 30d --yes\n"
    "room-outbox cleanup --archive --yes",
    needs="store",
    arguments=_arguments,
    run=_run,
)
