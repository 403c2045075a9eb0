"""The ``room-outbox`` command line: one subcommand per task, each with a description and
examples in its ``--help``; errors as one line on stderr with a documented exit code."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import os
import sys
from collections.abc import Sequence

import anyio

from room_outbox.app import run_service
from room_outbox.cli import consume as consume_cli
from room_outbox.cli.cleanup import cleanup_command
from room_outbox.cli.demo import add_demo_parser, run_demo_command
from room_outbox.cli.fake_im import add_fake_im_parser, run_fake_im
from room_outbox.cli.lanes import LANES_COMMAND, add_lanes_parser, lanes_command
from room_outbox.cli.requeue import cancel_command, requeue_command, requeue_tail_command
from room_outbox.cli.run import check_config, migrate, translated_errors
from room_outbox.cli.status import inspect_command, status_command
from room_outbox.config import Settings, load_settings, parse_duration
from room_outbox.delivery.lanes import lane_plan
from room_outbox.errors import RoomOutboxError
from room_outbox.observability.logs import configure_logging
from room_outbox.observability.redaction import Redactor, redactor_for
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.startup import freeze_startup_heap, table_profile
from room_outbox.store.factory import open_store
from room_outbox.store.operator.changes import RequeueFilter
from room_outbox.store.operator.retention import RetentionOptions
from room_outbox.store.protocol import SQLStore

DESCRIPTION = """\
Guaranteed delivery of room events: room-outbox reads the room_outbox table that room-service
writes in its own transactions and delivers each event to Tencent Cloud IM and the other
configured sinks, at least once. `room-outbox COMMAND --help` describes each command."""

EPILOG = """\
examples:
  room-outbox check-config --config config/config.yaml
  room-outbox migrate --config config/config.yaml
  room-outbox run --config config/config.yaml
  room-outbox status --json | jq .pending

The configuration comes from --config FILE (default $ROOM_OUTBOX_CONFIG) and the environment
(ROOM_OUTBOX__SECTION__KEY, which wins over the file). Exit codes: 0 done, 1 unexpected error,
2 configuration, 3 database unreachable or not migrated, 141 output closed early."""

#: Every subcommand: (one-line summary for the command list, description, examples).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": (
        "run the dispatcher until SIGTERM/SIGINT",
        "Deliver events until SIGTERM or SIGINT. Before anything is claimed: the whole configuration\n"
        "is checked, the database is waited for (up to database.connect_wait) and its schema is checked.",
        "room-outbox run --config /etc/room-outbox/config.yaml\nROOM_OUTBOX__LOG__LEVEL=DEBUG room-outbox run",
    ),
    "check-config": (
        "validate the whole configuration offline: OK, or every error",
        "Validate the configuration file and environment as `run` would, sink sections, routes and\n"
        "OTEL_* exporters included, without connecting to anything. Prints OK or every problem.",
        "room-outbox check-config --config config/config.yaml\n"
        "ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY=... room-outbox check-config",
    ),
    "migrate": (
        "create room_outbox or upgrade a V1 table in place (idempotent)",
        "Create room_outbox (and the database) when missing, or add room-outbox's columns and indexes\n"
        "to room-service's V1 table in place; create the tables of lanes of their own. Running it\n"
        "again changes nothing. --sql prints the statements it would run instead of running them.",
        "room-outbox migrate --sql\nroom-outbox migrate --config config/config.yaml",
    ),
    "status": (
        "backlog, retries, frequent errors and leases at a glance",
        "The backlog (pending rows, the oldest one's time), rows waiting for a retry, the retry-count\n"
        "histogram, lease holders, lanes of their own and the most frequent last_error values.",
        "room-outbox status\nroom-outbox status --json | jq .oldest_pending_age_ms",
    ),
    "inspect": (
        "one event: its row, parsed envelope and delivery state",
        "One event by event_id: its row (times in local time, with how long ago), its parsed\n"
        "envelope or why it does not parse, and its state in every lane. --json keeps raw values.",
        "room-outbox inspect evt_01J9ZQ\nroom-outbox inspect evt_01J9ZQ --json | jq .row.last_error",
    ),
    "requeue": (
        "send pending or parked (failed) rows round again; shows them, applies only with --yes",
        "Make pending or parked (failed) rows due now with retry_count 0. Without --yes it only\n"
        "lists the rows it would change. At most 10,000 rows a run; it says so when more match.\n"
        "Published, cancelled and currently leased rows are never touched.",
        'room-outbox requeue --error-contains "group gone"\n'
        "room-outbox requeue --event-type RoomGiftSent --status failed --yes",
    ),
    "cancel": (
        "mark an event cancelled: never delivered, kept for audit",
        "Mark a pending or parked event cancelled: it is never delivered; the row is kept.",
        "room-outbox cancel evt_01J9ZQ",
    ),
    "cleanup": (
        "delete (or archive) published rows older than retention.older_than; previews without --yes",
        "Remove published rows older than retention.older_than (or --older-than), in small batches;\n"
        "with --archive move them to room_outbox_archive. The consumers' processed records older\n"
        "than retention.processed_older_than and their resolved retry rows go too. Without --yes\n"
        "nothing is removed: it counts what would be (as --dry-run does). On a terminal, a progress\n"
        "line per batch.",
        "room-outbox cleanup --older-than 30d\nroom-outbox cleanup --older-than 30d --yes\n"
        "room-outbox cleanup --archive --yes",
    ),
    "lanes": LANES_COMMAND,
    "demo": (
        "run the whole pipeline on SQLite with a fake Tencent IM and verify it (no services needed)",
        "Produce events into a SQLite outbox, deliver them through a fake Tencent IM that fails a\n"
        "share of requests, and check that every event arrived once, in order per room. Needs no\n"
        "configuration and no services (it ignores --config).",
        "room-outbox demo\nroom-outbox demo --events 5000 --failure-rate 0.3 --seed 7",
    ),
    "fake-im": (
        "serve a fake Tencent IM on loopback (tests, demos)",
        "Serve a fake Tencent IM REST API (send_group_msg and friends) with a control API for\n"
        "faults, for tests and local runs. Needs no configuration (it ignores --config).",
        "room-outbox fake-im --port 8090\nroom-outbox fake-im --port 0 --faults '{\"error_rate\": 0.2}'",
    ),
}

COMMANDS.update(consume_cli.HELP)

#: Commands that read no configuration.
SELF_CONTAINED = ("demo", "fake-im")

CONFIG_HELP = "YAML configuration file (default: $ROOM_OUTBOX_CONFIG; without one, defaults + environment)"

#: Exit codes, as the README documents them.
EXIT_CODES = {
    0: "done",
    1: "unexpected error (a bug: the traceback says where), or the command's own 'no' (no such event)",
    2: "configuration: a key, the DSN, a sink section, a command-line argument",
    3: "database: unreachable, refusing the login, missing, or not migrated",
    130: "interrupted (Ctrl-C) before the command finished",
    141: "standard output closed early (`room-outbox status --json | head`)",
}
EXIT_INTERRUPTED = 130  # what a shell reports for a process ended by SIGINT (128 + 2)
EXIT_CLOSED_PIPE = 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)


def version() -> str:
    try:
        return importlib.metadata.version("room-outbox")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="room-outbox",
        usage="room-outbox [--config FILE] COMMAND [options]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"room-outbox {version()}")
    parser.add_argument("--config", default=os.environ.get("ROOM_OUTBOX_CONFIG"), metavar="FILE", help=CONFIG_HELP)
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands", prog="room-outbox"
    )

    def command(name: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=COMMANDS[name][0])

    command("run")
    command("check-config")
    migrate = command("migrate")
    migrate.add_argument("--sql", action="store_true", help="print the statements it would run; change nothing")
    status = command("status")
    status.add_argument("--json", action="store_true", help="machine-readable output (raw values: epoch ms)")
    inspect = command("inspect")
    inspect.add_argument("event_id", help="the event's event_id")
    inspect.add_argument("--json", action="store_true", help="machine-readable output (raw values: epoch ms)")
    requeue = command("requeue")
    requeue.add_argument("--event-id", action="append", default=[], help="this event (repeatable)")
    requeue.add_argument("--event-type", help="events of this type")
    requeue.add_argument("--error-contains", help="events whose last_error contains this text")
    requeue.add_argument(
        "--older-than", type=_duration_ms, metavar="DURATION", help="events created at least this long ago (e.g. 10m)"
    )
    requeue.add_argument("--status", choices=("pending", "failed"), help="only rows in this status (default: both)")
    requeue.add_argument("--yes", action="store_true", help="apply the change (default: only show it)")
    requeue.add_argument(
        "--lane", help="a tailing lane (such as kafka): send its parked events again (with --event-id: only those)"
    )
    cancel = command("cancel")
    cancel.add_argument("event_id", help="the event's event_id")
    cleanup = command("cleanup")
    cleanup.add_argument(
        "--older-than", type=_duration, metavar="DURATION", help="override retention.older_than (e.g. 168h, 30d)"
    )
    cleanup.add_argument("--archive", action="store_true", help="move rows to room_outbox_archive instead")
    preview = cleanup.add_mutually_exclusive_group()
    preview.add_argument("--dry-run", action="store_true", help="count what would be removed; remove nothing (default)")
    preview.add_argument("--yes", action="store_true", help="remove the rows (without it, only a count)")
    add_lanes_parser(commands, COMMANDS["lanes"][0])
    add_fake_im_parser(commands)
    consume_cli.add_consumer_parsers(commands)
    add_demo_parser(commands)
    for name, sub in commands.choices.items():
        _summary, description, examples = COMMANDS[name]
        sub.description = description
        sub.epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples.splitlines())
        sub.formatter_class = argparse.RawDescriptionHelpFormatter
        # `room-outbox run --config FILE` too (the image's command); SUPPRESS keeps a --config
        # given before the command when none follows it.
        shown = "accepted, not used: this command needs no configuration" if name in SELF_CONTAINED else CONFIG_HELP
        sub.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help=shown)
    return parser


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration_ms(text: str) -> int:
    try:
        return int(parse_duration(text) * 1000)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (see :data:`EXIT_CODES`). An error room-outbox expects
    (configuration, database, schema) is one line on stderr, never a traceback."""
    # The process's one redactor: it learns the configuration's secrets as soon as they are
    # loaded, so even the one line a failing command prints is masked.
    redactor = Redactor()
    try:
        code = _command(build_parser().parse_args(argv), redactor)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:  # Ctrl-C before `run` handles signals itself (waiting for the database, say)
        print("room-outbox: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RoomOutboxError as exc:
        return _fail(exc, redactor)
    except BaseExceptionGroup as group:  # raised inside a task group: report ours the same way
        mine = _only_our_error(group)
        if mine is None:
            raise
        return _fail(mine, redactor)


def _command(args: argparse.Namespace, redactor: Redactor) -> int:
    if args.command == "fake-im":  # test tooling: needs no configuration
        return run_fake_im(args)
    if args.command == "demo":  # self-contained: its own store, fake IM and settings
        return run_demo_command(args)
    settings = load_settings(args.config)
    redactor.add_all(redactor_for(settings))  # logs, spans, last_error, sinks and failures share it
    if args.command == "check-config":
        return check_config(settings, args.config)
    configure_logging(
        settings.log.level,
        settings.node_id,
        redactor,
        library_level=settings.log.library_level,
        log_format=settings.log.format,
        spans_with_logs=settings.log.spans_with_logs,
    )
    if args.command == "migrate":
        return anyio.run(migrate, settings, args.sql)
    if args.command == "run":
        freeze_startup_heap()
        anyio.run(functools.partial(run_service, settings, redactor=redactor))
        return 0
    if args.command in consume_cli.COMMANDS:
        return consume_cli.run_consumer_command(settings, args, redactor)
    return anyio.run(_with_store, settings, args)


def _fail(exc: RoomOutboxError, redactor: Redactor) -> int:
    print(redactor.redact(f"room-outbox: {exc}"), file=sys.stderr)
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


async def _with_store(settings: Settings, args: argparse.Namespace) -> int:
    """Operator commands: one connection, one command, closed again (logic in admin, ops,
    retention)."""
    dsn = settings.database.dsn.get_secret_value()
    store = await open_store(
        dsn, pool_size=1, query_timeout=settings.database.query_timeout, profile=table_profile(settings)
    )
    try:
        with translated_errors(dsn):
            return await _operator_command(store, settings, args)
    finally:
        await store.aclose()


async def _operator_command(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    if args.command == "status":
        im_lane = lane_plan(make_plugin_manager(settings.plugins.disabled), settings).main
        return await status_command(store, args.json, sys.stdout, im_lane)
    if args.command == "inspect":
        return await inspect_command(store, args.event_id, args.json, sys.stdout, sys.stderr)
    if args.command == "requeue" and args.lane:
        return await requeue_tail_command(store, args.lane, tuple(args.event_id), args.yes, sys.stdout)
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
        return await cancel_command(store, args.event_id, sys.stdout, sys.stderr)
    if args.command == "cleanup":
        options = RetentionOptions.from_settings(settings.retention, args.older_than, args.archive)
        plan = lane_plan(make_plugin_manager(settings.plugins.disabled), settings)
        return await cleanup_command(store, options, args.yes, sys.stdout, sys.stderr, sys.stderr.isatty(), plan)
    if args.command == "lanes":
        plan = lane_plan(make_plugin_manager(settings.plugins.disabled), settings)
        return await lanes_command(store, plan, args, sys.stdout, sys.stderr)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
