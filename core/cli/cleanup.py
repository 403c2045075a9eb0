"""``room-outbox cleanup``: retention's pass run by hand, previewed unless ``--yes``."""

from __future__ import annotations

from typing import IO

from room_outbox.config import LanePlan
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
) -> int:
    """``room-outbox cleanup``: one pass, removing rows only when ``apply`` (``--yes``), else
    counting them; a progress line per batch on ``err`` when ``show_progress`` (a terminal);
    then a one-line summary on ``out``, one for the consumers' records (where they are kept),
    and a line per lane that holds rows back."""
    archive = archive_table(store.profile.table)
    verb = ("moved to " + archive if options.archive else "deleted") if apply else "would be removed"

    def progress(report: CleanupReport) -> None:
        print(
            f"batch {report.batches}: {report.removed:,} row(s) {verb} so far (ids up to {report.last_id},"
            f" {report.seconds:.1f}s)",
            file=err,
            flush=True,
        )

    report = await cleanup(store, options, plan, dry_run=not apply, progress=progress if show_progress else None)
    older = f"older than {options.older_than:g}s"
    what = "published row(s)" if report.by_status else "row(s) every enabled lane has finished"
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
    consumers = await prune_consumer_records(store, options, dry_run=not apply)
    if consumers.present:
        done = "would be deleted (dry run)" if not apply else f"deleted in {consumers.batches} batch(es)"
        print(
            f"consumers: {consumers.processed} processed record(s) older than {options.processed_older_than:.0f}s"
            f" and {consumers.resolved} resolved retry row(s) {done}",
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
