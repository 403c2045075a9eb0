"""``room-outbox [--config FILE] COMMAND``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

import anyio

from room_outbox.admin import cancel_command, requeue_command
from room_outbox.app import redactor_for, run_service
from room_outbox.config import Settings, load_settings, parse_duration
from room_outbox.demo import add_demo_parser, run_demo_command
from room_outbox.errors import ConfigurationError, RoomOutboxError
from room_outbox.lanes import migrate_plugins
from room_outbox.ops import inspect_command, status_command
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.retention import RetentionOptions, cleanup_command
from room_outbox.startup import check_configuration
from room_outbox.store.errors import translated
from room_outbox.store.factory import SQLStore, describe, is_sqlite, open_store, store_address
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
    commands.add_parser(
        "check-config", help="validate the whole configuration, sink sections included, without connecting"
    )
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
    """Run one command; its exit code (see :data:`EXIT_CODES`). An error room-outbox expects
    (configuration, database, schema) is one line on stderr, never a traceback."""
    try:
        code = _command(build_parser().parse_args(argv))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except RoomOutboxError as exc:
        return _fail(exc)
    except BaseExceptionGroup as group:  # raised inside a task group: report ours the same way
        mine = _only_our_error(group)
        if mine is None:
            raise
        return _fail(mine)


#: Exit codes, as the README documents them.
EXIT_CODES = {
    0: "done",
    1: "unexpected error (a bug: the traceback says where), or the command's own 'no' (no such event)",
    2: "configuration: a key, the DSN, a sink section, a command-line argument",
    3: "database: unreachable, refusing the login, missing, or not migrated",
    141: "standard output closed early (`room-outbox status --json | head`)",
}
EXIT_CLOSED_PIPE = 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)


def _command(args: argparse.Namespace) -> int:
    if args.command == "fake-im":  # test tooling: needs no configuration
        return run_fake_im(args)
    if args.command == "demo":  # self-contained: its own store, fake IM and settings
        return run_demo_command(args)
    settings = load_settings(args.config)
    if args.command == "check-config":
        return _check_config(settings, args.config)
    configure_logging(settings.log.level, settings.node_id, redactor_for(settings))
    if args.command == "migrate":
        return anyio.run(_migrate, settings)
    if args.command == "run":
        anyio.run(run_service, settings)
        return 0
    return anyio.run(_with_store, settings, args)


def _fail(exc: RoomOutboxError) -> int:
    print(f"room-outbox: {exc}", file=sys.stderr)
    return exc.exit_code


def _only_our_error(group: BaseExceptionGroup[BaseException]) -> RoomOutboxError | None:
    """The one room-outbox error a task group raised, if that is all it raised."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 and isinstance(leaves[0], RoomOutboxError) else None


def _closed_pipe() -> int:
    """The reader went away (``| head``): end quietly. Further writes, including the
    interpreter's own flush at exit, go to /dev/null instead of raising again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a stdout with no descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_CLOSED_PIPE


def _check_config(settings: Settings, source: str | None) -> int:
    """``check-config``: the whole configuration, as ``run`` would check it, offline."""
    checked = check_configuration(settings, make_plugin_manager(settings.plugins.disabled))
    print(
        f"configuration OK ({source or 'defaults and environment'}): database {checked.database!r};"
        f" IM lane sinks: {', '.join(checked.im_sinks) or 'none'};"
        f" lanes of their own: {', '.join(checked.own_lanes) or 'none'}"
    )
    return 0


async def _migrate(settings: Settings) -> int:
    dsn = settings.mysql.dsn.get_secret_value()
    store = await open_store(dsn, create_database=True, wait=settings.mysql.connect_wait)
    try:
        with _translated(dsn):
            changes = await store.migrate()
            pm = make_plugin_manager(settings.plugins.disabled)
            changes += await migrate_plugins(store, pm, settings)  # own-lane sinks' tables, plugin tables
    finally:
        await store.aclose()
    for change in changes or ["schema already up to date"]:
        print(change)
    return 0


def _translated(dsn: str) -> contextlib.AbstractContextManager[None]:
    """Driver errors of the block as room-outbox's own, naming the store (not the password)."""
    address = store_address(dsn)
    return translated(describe(address), getattr(address, "password", ""))


#: Operator commands whose statements are MySQL's for now.
MYSQL_ONLY = ("requeue", "cancel", "cleanup")


async def _with_store(settings: Settings, args: argparse.Namespace) -> int:
    """Operator commands: one connection, one command, closed again (logic in admin, ops,
    retention)."""
    dsn = settings.mysql.dsn.get_secret_value()
    if args.command in MYSQL_ONLY and is_sqlite(dsn):
        raise ConfigurationError(f"{args.command} needs a MySQL store; mysql.dsn names a SQLite file")
    store = await open_store(dsn, pool_size=1)
    try:
        with _translated(dsn):
            return await _operator_command(store, settings, args)
    finally:
        await store.aclose()


async def _operator_command(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
