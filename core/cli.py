"""``room-outbox [--config FILE] COMMAND``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import anyio

from room_outbox.admin import cancel_command, requeue_command
from room_outbox.app import redactor_for, run_service
from room_outbox.config import ConfigError, Settings, load_settings, parse_duration
from room_outbox.demo import add_demo_parser, run_demo_command
from room_outbox.lanes import migrate_plugins
from room_outbox.ops import inspect_command, status_command
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.retention import RetentionOptions, cleanup_command
from room_outbox.store.factory import is_sqlite, open_store
from room_outbox.store.mysql import MySQLStore, RequeueFilter
from room_outbox.telemetry import configure_logging
from room_outbox.testing.cli import add_fake_im_parser, run_fake_im


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="room-outbox", description=__doc__)
    parser.add_argument(
        "--config",
        default=os.environ.get("ROOM_OUTBOX_CONFIG"),
        help="YAML configuration file (default: $ROOM_OUTBOX_CONFIG; without one, defaults + environment)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("run", help="run the dispatcher until SIGTERM/SIGINT")
    commands.add_parser("migrate", help="create room_outbox or upgrade a V1 table in place (idempotent)")
    requeue = commands.add_parser(
        "requeue", help="send pending or parked (failed) rows round again; shows them, applies only with --yes"
    )
    requeue.add_argument("--event-id", action="append", default=[], help="this event (repeatable)")
    requeue.add_argument("--event-type", help="events of this type")
    requeue.add_argument("--error-contains", help="events whose last_error contains this text")
    requeue.add_argument("--older-than", type=_duration_ms, help="events created at least this long ago (e.g. 10m)")
    requeue.add_argument("--status", choices=("pending", "failed"), help="only rows in this status (default: both)")
    requeue.add_argument("--yes", action="store_true", help="apply the change (default: only show it)")
    cancel = commands.add_parser("cancel", help="mark an event cancelled: never delivered, kept for audit")
    cancel.add_argument("event_id")
    status = commands.add_parser("status", help="backlog, retries, frequent errors and leases at a glance")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    inspect = commands.add_parser("inspect", help="one event: its row, parsed envelope and delivery state")
    inspect.add_argument("event_id")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    cleanup = commands.add_parser("cleanup", help="delete (or archive) published rows older than retention.older_than")
    cleanup.add_argument("--older-than", type=parse_duration, help="override retention.older_than (e.g. 168h)")
    cleanup.add_argument("--archive", action="store_true", help="move rows to room_outbox_archive instead")
    add_fake_im_parser(commands)
    add_demo_parser(commands)
    for command in commands.choices.values():  # `room-outbox run --config FILE` too (the image's command)
        command.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _duration_ms(text: str) -> int:
    try:
        return int(parse_duration(text) * 1000)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "fake-im":  # test tooling: needs no configuration
        return run_fake_im(args)
    if args.command == "demo":  # self-contained: its own store, fake IM and settings
        return run_demo_command(args)
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"room-outbox: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log.level, settings.node_id, redactor_for(settings))
    try:
        if args.command == "migrate":
            return anyio.run(_migrate, settings)
        if args.command == "run":
            anyio.run(run_service, settings)
            return 0
        return anyio.run(_with_store, settings, args)
    except ConfigError as exc:
        print(f"room-outbox: {exc}", file=sys.stderr)
        return 2


async def _migrate(settings: Settings) -> int:
    store = await open_store(settings.mysql.dsn.get_secret_value(), create_database=True)
    try:
        changes = await store.migrate()
        pm = make_plugin_manager(settings.plugins.disabled)
        changes += await migrate_plugins(store, pm, settings)  # own-lane sinks' tables, plugin tables
    finally:
        await store.aclose()
    for change in changes or ["schema already up to date"]:
        print(change)
    return 0


#: Operator commands whose statements are MySQL's for now.
MYSQL_ONLY = ("requeue", "cancel", "cleanup")


async def _with_store(settings: Settings, args: argparse.Namespace) -> int:
    """Operator commands: one connection, one command, closed again (logic in admin, ops,
    retention)."""
    dsn = settings.mysql.dsn.get_secret_value()
    if args.command in MYSQL_ONLY and is_sqlite(dsn):
        print(f"room-outbox {args.command}: needs a MySQL store; mysql.dsn names a SQLite file", file=sys.stderr)
        return 2
    store = await open_store(dsn, pool_size=1)
    try:
        if args.command == "status":
            return await status_command(store, args.json, sys.stdout)
        if args.command == "inspect":
            return await inspect_command(store, args.event_id, args.json, sys.stdout, sys.stderr)
        assert isinstance(store, MySQLStore)  # MYSQL_ONLY, checked above
        if args.command == "requeue":
            where = RequeueFilter(
                event_ids=tuple(args.event_id),
                event_type=args.event_type,
                error_contains=args.error_contains,
                older_than_ms=args.older_than,
                statuses=(args.status,) if args.status else ("pending", "failed"),
            )
            if where == RequeueFilter(statuses=where.statuses):
                print(
                    "room-outbox requeue: give at least one of --event-id, --event-type, --error-contains, --older-than",
                    file=sys.stderr,
                )
                return 2
            return await requeue_command(store, where, args.yes, sys.stdout)
        if args.command == "cancel":
            return await cancel_command(store, args.event_id, sys.stdout)
        if args.command == "cleanup":
            options = RetentionOptions.from_settings(settings.retention, args.older_than, args.archive)
            return await cleanup_command(store, options)
        raise AssertionError(f"unhandled command {args.command}")
    finally:
        await store.aclose()


if __name__ == "__main__":
    sys.exit(main())
