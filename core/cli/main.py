"""The ``room-outbox`` command line: one subcommand per task, each with a description and
examples in its ``--help``; errors as one line on stderr with a documented exit code."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from room_outbox.cli.command import CONFIG_HELP, add_config_option, default_config, error_lines, with_store
from room_outbox.cli.registry import COMMANDS
from room_outbox.config import load_settings
from room_outbox.errors import ConfigurationError, RoomOutboxError
from room_outbox.observability.logs import configure_logging, flush_logs
from room_outbox.observability.redaction import Redactor, redactor_for
from room_outbox.version import package_version

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
2 configuration, 3 database (or a broker asked) unreachable, too slow (database.query_timeout) or
not migrated, 141 output closed early."""

#: Exit codes, as docs/reference/errors.md documents them.
EXIT_CODES = {
    0: "done",
    1: "unexpected error (a bug: the traceback says where), or the command's own 'no' (no such event)",
    2: "configuration: a key, the DSN, a sink section, a command-line argument",
    3: "a dependency: the database unreachable, too slow (a statement past database.query_timeout), refusing the"
    " login, missing, or not migrated; a broker asked unreachable",
    130: "interrupted (Ctrl-C) before the command finished",
    141: "standard output closed early (`room-outbox status --json | head`)",
}
BY_NAME = {listed.name: listed for listed in COMMANDS}

EXIT_INTERRUPTED = 130  # what a shell reports for a process ended by SIGINT (128 + 2)
EXIT_CLOSED_PIPE = 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)


def build_parser(every_command: bool = False) -> argparse.ArgumentParser:
    """The whole command line, from :data:`room_outbox.cli.registry.COMMANDS`. A command's own
    parser is filled in (its module imported) once argparse reaches the command typed, or at
    once for ``every_command`` (shell completion, which reads them all)."""
    parser = argparse.ArgumentParser(
        prog="room-outbox",
        usage="room-outbox [--config FILE] COMMAND [options]",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"room-outbox {package_version()}")
    parser.add_argument("--config", default=default_config(), metavar="FILE", help=CONFIG_HELP)
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        title="commands",
        prog="room-outbox",
        action=_CommandsFilledOnUse,
    )
    for listed in COMMANDS:
        sub = commands.add_parser(
            listed.name, help=listed.summary, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        if every_command:
            _fill(sub, listed.name)
    return parser


class _CommandsFilledOnUse(argparse._SubParsersAction):  # type: ignore[type-arg]
    """The subcommands' action: the command typed gets its parser filled in before argparse
    hands it the rest of the command line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        _fill(self.choices[values[0]], values[0])
        super().__call__(parser, namespace, values, option_string)


def _fill(sub: argparse.ArgumentParser, name: str) -> None:
    """``name``'s description, examples and arguments on its parser ``sub``, once."""
    if sub.description is not None:
        return
    command = BY_NAME[name].command()
    sub.description = command.description
    sub.epilog = "examples:\n" + "\n".join(f"  {line}" for line in command.examples.splitlines())
    command.arguments(sub)
    add_config_option(sub, command.needs)


def _escape_what_the_terminal_cannot_show() -> None:
    """Standard output in a locale without some characters an event may hold (an emoji in a
    GBK or Latin-1 terminal): those characters are written escaped (``\\U0001f389``), as
    standard error already writes them, instead of the command failing half-way."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code (see :data:`EXIT_CODES`). An error room-outbox expects
    (configuration, database, schema) is one line on stderr, never a traceback."""
    # The process's one redactor: it learns the configuration's secrets as soon as they are
    # loaded, so even the one line a failing command prints is masked.
    redactor = Redactor()
    _escape_what_the_terminal_cannot_show()
    try:
        parser = build_parser()
        code = _command(parser.parse_args(argv), parser, redactor)
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


def _command(args: argparse.Namespace, parser: argparse.ArgumentParser, redactor: Redactor) -> int:
    command = BY_NAME[args.command].command()
    if command.needs == "none":
        return int(command.run(args, parser))
    try:
        settings = load_settings(args.config)
    except ConfigurationError as exc:
        if command.invalid_config is None:
            raise
        return int(command.invalid_config(exc, args, redactor))
    redactor.add_all(redactor_for(settings))  # logs, spans, last_error, sinks and failures share it
    configure_logging(
        settings.log.level,
        settings.node_id,
        redactor,
        library_level=settings.log.library_level,
        log_format=settings.log.format,
        spans_with_logs=settings.log.spans_with_logs,
    )
    if command.needs == "config":
        return int(command.run(settings, args, redactor))
    # An operator command's failure is its one line on stderr, naming the cause and the fix.
    # psycopg warns as it closes a connection whose statement query_timeout cancelled, which that
    # line says better; its errors still show, and the services (run, consume) keep its warnings.
    psycopg = logging.getLogger("psycopg")
    psycopg.setLevel(max(logging.ERROR, psycopg.getEffectiveLevel()))
    return anyio.run(with_store, settings, lambda store: command.run(store, settings, args))


def _fail(exc: RoomOutboxError, redactor: Redactor) -> int:
    flush_logs()  # the log lines before it come first
    print(redactor.redact(error_lines(exc)), file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
