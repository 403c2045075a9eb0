"""What every ``room-outbox`` command declares (:class:`Command`) and the options and argument
types the commands share, so that each convention has one place: ``--config`` anywhere,
``--json`` on reports, ``--yes`` on changes, durations echoed as typed."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from room_outbox.config import LanePlan, Settings, parse_duration
from room_outbox.errors import ConfigurationError, PrivilegeError, SchemaError
from room_outbox.observability.redaction import Redactor
from room_outbox.startup import check_run_schema, table_profile
from room_outbox.store.backends.errors import translated
from room_outbox.store.deadline import LONGER_QUERY_TIMEOUT, QueryTimeout
from room_outbox.store.factory import describe, open_store, store_address
from room_outbox.store.operator.reports import lock_blockers, ping
from room_outbox.store.protocol import SQLStore

if TYPE_CHECKING:
    from room_outbox.store.lanes.catalog import StoredLane

#: What a command's ``run`` is given:
#: ``none``: ``run(args, parser)``, no configuration read;
#: ``config``: ``run(settings, args, redactor)``, the configuration loaded and checked;
#: ``store``: ``await run(store, settings, args)``, one database connection, closed after.
Needs = Literal["none", "config", "store"]

CONFIG_HELP = "YAML configuration file (default: $ROOM_OUTBOX_CONFIG; without one, defaults + environment)"


@dataclass(frozen=True)
class Command:
    """One command's help and behaviour; its name and one-line summary are in the registry
    (:data:`room_outbox.cli.registry.COMMANDS`), so that listing the commands imports none."""

    #: The paragraph of ``COMMAND --help``.
    description: str
    #: One example command line a line.
    examples: str
    needs: Needs
    #: Adds the command's own arguments (and actions) to its parser.
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[..., Any]
    #: ``needs`` config or store: what the command does when the configuration does not load,
    #: given the error, its arguments and the process's redactor (``check-config`` and ``run``
    #: report it with every other problem); None: the error stops the command as it is.
    invalid_config: Callable[[ConfigurationError, argparse.Namespace, Redactor], int] | None = None


def add_config_option(parser: argparse.ArgumentParser, needs: Needs) -> None:
    """``--config FILE`` on ``parser`` and every action under it, so that it may follow the
    command anywhere (``lanes retire NAME --config FILE``). SUPPRESS keeps a ``--config``
    given before the command when none follows it."""
    shown = "accepted, not used: this command needs no configuration" if needs == "none" else CONFIG_HELP
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help=shown)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                add_config_option(sub, needs)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """Every reporting command's ``--json``: the same fields, raw values (epoch ms, seconds)."""
    parser.add_argument("--json", action="store_true", help="machine-readable output (raw values: epoch ms, seconds)")


def add_yes_option(parser: argparse._ActionsContainer, what: str) -> None:
    """Every command that changes rows previews by default: ``--yes`` applies."""
    parser.add_argument("--yes", action="store_true", help=f"{what} (default: only show what would change)")


def add_app_code_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--app-code`` of the commands that take events by their id: where event ids are unique
    per app only (``UNIQUE (app_code, event_id)``), one id may name rows of several apps."""
    parser.add_argument("--app-code", metavar="APP", help=f"{what} ('': the default app)")


def several_apps(
    command: str, event_id: str, app_codes: list[str], fix: str = "say which app's event with --app-code"
) -> str:
    """Why ``command`` changed nothing: ``event_id`` names rows of several apps, and changing
    them all would change other apps' events unasked; ``fix``: what the operator can do."""
    # Imported here: only the commands that take an event id need them.
    from room_outbox.cli.output import format_app, printable

    apps = ", ".join(map(format_app, app_codes))
    return (
        f"room-outbox {command}: event id {printable(event_id)} names rows of several apps ({apps}): nothing"
        f" changed; {fix}"
    )


@dataclass(frozen=True)
class TypedDuration:
    """A duration from the command line: its seconds, and the text typed, echoed as is."""

    text: str
    seconds: float

    def __str__(self) -> str:
        return self.text


def duration_argument(text: str) -> TypedDuration:
    """An age (``--older-than``): above zero, as ``retention.older_than`` must be. Zero or
    less would take rows written a moment ago (``cleanup`` deleting just-published ones)."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive duration (e.g. 168h, 30d)")
    return TypedDuration(text, seconds)


def int_argument(low: int, high: int) -> Callable[[str], int]:
    """An integer option's type that takes only ``low`` to ``high``: a value outside them goes
    on into SQL, a socket or a loop and fails there with a traceback, so argparse refuses it
    instead (exit 2, naming the option)."""

    def parsed(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is out of range ({low} to {high})")
        return value

    return parsed


def format_duration(seconds: float) -> str:
    """A configured duration in the largest unit that divides it (``168h`` stays ``7d``,
    ``90`` is ``90s``): configuration values are echoed in words a person would type."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and float(seconds / size).is_integer():
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def error_lines(message: object) -> str:
    """An error as a command prints it on stderr: each problem (a line not indented) said by
    ``room-outbox:``, as the first is, so that every problem of several reads as one and a log
    scanner keyed on the prefix finds them all; indented lines continue the problem above."""
    return "\n".join(line if line[:1].isspace() else f"room-outbox: {line}" for line in str(message).split("\n"))


def main_lane_off(store: SQLStore, settings: Settings, command: str, err: Any) -> bool:
    """Whether ``settings`` run no main lane (no enabled sink writes the outbox's status): then
    the status is its producer's, and ``command`` (``requeue``, ``cancel``) must change none of
    its rows, room-service's own worker reading them; said on ``err``, with the way to a lane's."""
    # Imported here: only these two commands need them, and every command imports this module.
    from room_outbox.delivery.lanes import lane_plan
    from room_outbox.plugin_manager import make_plugin_manager

    if lane_plan(make_plugin_manager(settings.plugins.disabled), settings).main:
        return False
    print(
        f"room-outbox {command}: the main lane is off in this configuration ({store.profile.status_owned}):"
        f" {command} changes none of its rows; for a lane's events give --lane NAME (`room-outbox lanes` lists them)",
        file=err,
    )
    return True


async def lane_named(store: SQLStore, lane: str, command: str, err: Any) -> StoredLane | None:
    """``lane`` as the database holds it (``--lane`` of ``requeue`` and ``cancel``): a lane
    table (``relay: lane_table``) or a tailing lane; None when it holds no such lane, after
    saying so on ``err``, naming those there are of each kind."""
    # Imported here: only these two commands need them, and every command imports this module.
    from room_outbox.cli.output import printable
    from room_outbox.store.lanes.catalog import stored_lanes

    stored = await stored_lanes(store)
    for found in stored:
        if found.name == lane:
            return found
    tailing = ", ".join(x.name for x in stored if not x.has_table) or "none"
    tables = ", ".join(x.name for x in stored if x.has_table) or "none"
    print(
        f"room-outbox {command}: {printable(lane)} is not a lane here (tailing lanes: {tailing};"
        f" lane tables: {tables})",
        file=err,
    )
    return None


async def checked_report(
    store: SQLStore, settings: Settings, plan: LanePlan, report: Callable[[], Awaitable[int]], err: Any, command: str
) -> int:
    """A report (``status``, ``lanes``) checked as ``run`` checks the schema at start (for the
    lanes of ``plan``): a normal-looking report must not hide that no process can start. The
    report is still printed (what it reads is true), then that problem and its fix on ``err``
    as start-up words it, with start-up's exit code (3). A report the problem keeps from
    being read fails with the problem itself, which names the fix. Privileges are the
    report's own (``command``'s user reads: SELECT), not ``run``'s."""
    lane_tables = [lane for lane in plan.own if lane not in plan.tail]
    try:
        await check_run_schema(store, settings, lane_tables, plan.tail, plan.main, reader=command)
    except (SchemaError, PrivilegeError) as exc:
        problem = exc
    else:
        return await report()
    try:
        await report()
    except Exception as exc:  # a missing table or column, say: the driver's words name no fix
        raise problem from exc
    said = problem if isinstance(problem, PrivilegeError) else f"`run` would refuse to start: {problem}"
    print(error_lines(said), file=err)
    return problem.exit_code


async def with_store(settings: Settings, work: Callable[[SQLStore], Awaitable[int]]) -> int:
    """``work`` given one connection to the configured database, closed again after."""
    dsn = settings.database.dsn.get_secret_value()
    store = await open_store(
        dsn,
        pool_size=1,
        query_timeout=settings.database.query_timeout,
        profile=table_profile(settings),
        max_envelope_bytes=settings.database.max_envelope_bytes,
        existing_only=True,  # only migrate (and the demo) create a SQLite file
    )
    try:
        with translated_errors(dsn):
            try:
                return await work(store)
            except QueryTimeout as exc:
                raise await _timed_out(store, exc) from exc
    finally:
        await store.aclose()


async def _timed_out(store: SQLStore, exc: QueryTimeout) -> QueryTimeout:
    """A command's database call past ``query_timeout``: when the database answers a ping now
    it is up, and one of the command's statements was too slow or waited for a lock another
    session holds (a DBA's ``LOCK TABLE``, ``VACUUM FULL``, ``ALTER TABLE``, a long
    transaction). The operator's fix differs, so the sessions that hold others up are looked
    up (:func:`lock_blockers`) and named; a longer timeout helps only when none is. Both exit
    3, as the bare timeout would."""
    try:
        await ping(store)
    except Exception:  # no answer now either: the timeout's own words stand
        return exc
    abandoned = (
        f"a statement of this command ran longer than database.query_timeout ({exc.seconds:g}s) and was abandoned"
    )
    blockers = await lock_blockers(store)
    if blockers:
        return QueryTimeout(
            exc.seconds,
            f"the database answers, but {abandoned}, most likely waiting for a lock another session holds on"
            f" {store.profile.table} or its rows: {'; '.join(blockers)}; let that transaction end (or end the"
            " session), then run the command again",
        )
    return QueryTimeout(
        exc.seconds,
        f"the database answers, but {abandoned}: run the command again with a longer one, {LONGER_QUERY_TIMEOUT},"
        " and find the statement in the database's slow query log; or it waited for a lock another session held"
        f" on {store.profile.table} ({_open_transactions(store)})",
    )


def _open_transactions(store: SQLStore) -> str:
    """Where the database lists the sessions and the locks they hold, for an operator."""
    if store.dialect.name == "postgresql":
        return "pg_stat_activity and pg_locks list the sessions and their locks"
    if store.dialect.name == "mysql":
        return "information_schema.INNODB_TRX lists the open transactions, with their start"
    return "another process writing the file"


def translated_errors(dsn: str) -> contextlib.AbstractContextManager[None]:
    """Driver errors of the block as room-outbox's own, naming the store (not the password)."""
    address = store_address(dsn)
    return translated(describe(address), getattr(address, "password", ""))


def default_config() -> str | None:
    return os.environ.get("ROOM_OUTBOX_CONFIG") or None  # set empty (compose's ${VAR:-}): none
