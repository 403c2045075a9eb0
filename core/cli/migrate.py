"""``room-outbox migrate``: the schema created or upgraded in place (idempotent), or with
``--sql`` the statements it would run printed as a script, changing nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from collections.abc import Awaitable
from typing import TypeVar

import anyio
import pluggy

from room_outbox.cli import consume as consume_cli
from room_outbox.cli.command import Command, add_json_option, translated_errors
from room_outbox.config import Settings
from room_outbox.delivery.lanes import plugins_schema
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.signals import STOP_SIGNALS
from room_outbox.startup import check_migrate_configuration, table_profile
from room_outbox.store.backends.sqlite import SQLiteAddress
from room_outbox.store.factory import describe, open_store, store_address
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema import registry
from room_outbox.store.schema.outbox import Migration
from room_outbox.store.schema.registry import WantedSchema

T = TypeVar("T")


async def migrate(settings: Settings, sql_only: bool, as_json: bool = False) -> int:
    dsn = settings.database.dsn.get_secret_value()
    pm = make_plugin_manager(settings.plugins.disabled)
    check_migrate_configuration(settings, pm)
    if sql_only:
        return await print_migration(settings, pm, as_json)
    database = settings.database
    store = await open_store(
        dsn,
        create_database=True,
        query_timeout=database.query_timeout,
        wait=database.connect_wait,
        profile=table_profile(settings),
    )
    try:
        with translated_errors(dsn):
            changes = await stopped_by_signals(migrate_all(store, pm, settings))
    finally:
        await store.aclose()
    if changes is None:
        print(
            "room-outbox migrate: interrupted; its running statement was stopped: run it again to finish",
            file=sys.stderr,
        )
        raise KeyboardInterrupt
    if as_json:
        print(json.dumps({"changes": changes}, indent=2))
        return 0
    for change in changes or ["schema already up to date"]:
        print(change)
    return 0


def wanted_schema(store: SQLStore, pm: pluggy.PluginManager, settings: Settings) -> WantedSchema:
    """Everything ``migrate`` brings about for this configuration: the outbox table, the
    enabled sinks' lanes and plugin tables, the consumers' and the enabled handlers' tables.
    An installed plugin may be unused: only the enabled sinks' and handlers' tables count."""
    handlers = consume_cli.enabled_handlers(settings)
    plugins = plugins_schema(pm, settings, handlers)
    consumers = consume_cli.consumers_schema(store, pm, handlers)
    return dataclasses.replace(
        plugins,
        outbox=True,
        consumers=consumers.consumers,
        handler_statements=consumers.handler_statements,
        handler_tables=consumers.handler_tables,
    )


async def migrate_all(store: SQLStore, pm: pluggy.PluginManager, settings: Settings) -> list[str]:
    return await registry.migrate(store, wanted_schema(store, pm, settings))


async def stopped_by_signals(work: Awaitable[T]) -> T | None:
    """``work``'s result, or its error; None when one of :data:`STOP_SIGNALS` cancelled it (a
    statement it was running on a server is stopped there: see
    :mod:`room_outbox.store.backends.mysql_online`)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        return await work
    results: list[T] = []
    errors: list[Exception] = []  # raised here, not wrapped in the task group's ExceptionGroup
    async with anyio.create_task_group() as group:

        async def cancel_on_signal() -> None:
            with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
                async for _ in signals:
                    group.cancel_scope.cancel()

        group.start_soon(cancel_on_signal)
        try:
            results.append(await work)
        except Exception as exc:
            errors.append(exc)
        group.cancel_scope.cancel()
    if errors:
        raise errors[0]
    return results[0] if results else None


async def print_migration(settings: Settings, pm: pluggy.PluginManager, as_json: bool = False) -> int:
    """``migrate --sql``: the statements ``migrate`` would run on this database, as a script
    to read or hand to a DBA; nothing is changed (the catalogue is only read)."""
    dsn = settings.database.dsn.get_secret_value()
    address = store_address(dsn)
    if isinstance(address, SQLiteAddress) and not address.path.exists():
        # Opening a SQLite file creates it: plan against an empty in-memory database instead.
        store = await open_store("sqlite::memory:", profile=table_profile(settings))
    else:
        store = await open_store(
            dsn,
            query_timeout=settings.database.query_timeout,
            wait=settings.database.connect_wait,
            profile=table_profile(settings),
        )
    try:
        with translated_errors(dsn):
            plan = await registry.migration_plan(store, wanted_schema(store, pm, settings))
            schemas = await registry.schemas_looked_in(store)
    finally:
        await store.aclose()
    if as_json:
        steps = [
            {"change": would(step.change), "statements": [s.strip().rstrip(";") for s in step.statements]}
            | {"autocommit": step.autocommit, "repeat": step.repeat}
            for step in plan
        ]
        print(json.dumps({"database": describe(address), "search_path": list(schemas), "steps": steps}, indent=2))
        return 0
    print(f"-- room-outbox migrate for {describe(address)}: nothing has been run")
    if not plan:
        print("-- schema already up to date: no statement to run")
    if any(step.autocommit for step in plan):
        print("-- run statement by statement, outside a transaction (psql's default): CONCURRENTLY refuses one")
    if plan and schemas:
        # The statements name no schema: run by hand, they must find and make what migrate would
        print("-- in the schemas room-outbox's sessions look in, whatever this session's search path")
        print(f"SET search_path = {', '.join(schemas)};")
    for step in plan:
        print("\n" + "\n".join(script_lines(step, store.dialect.name == "postgresql")))
    return 0


def script_lines(step: Migration, transactional_ddl: bool) -> list[str]:
    """One step of ``migrate --sql``'s script. Where ``migrate`` runs a step of several
    statements as one transaction (``transactional_ddl``: PostgreSQL, whose schema changes take
    part in transactions; MySQL/MariaDB commit each one), the script wraps it in one too, so that
    a DBA running it by hand gets all of it or none."""
    lines = [f"-- {would(step.change)}"]
    if step.repeat:
        lines.append("-- (a batch: run it again, each time on its own, until it changes no row)")
    statements = [statement.strip().rstrip(";") + ";" for statement in step.statements]
    if transactional_ddl and not step.autocommit and not step.repeat and len(statements) > 1:
        statements = ["BEGIN;", *statements, "COMMIT;"]
    return lines + statements


#: A step's change says what ``migrate`` did ("created table …"); the script says what it would do.
_WOULD = {
    "created": "would create",
    "added": "would add",
    "ran": "would run",
    "rebuilt": "would rebuild",
    "set": "would set",
    "made": "would make",
    "left": "would leave",
}


def would(change: str) -> str:
    """``created table x`` → ``would create table x``; a change in other words keeps them,
    after ``would apply:``."""
    verb, _, rest = change.partition(" ")
    return f"{_WOULD[verb]} {rest}" if verb in _WOULD else f"would apply: {change}"


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sql", action="store_true", help="print the statements it would run; change nothing")
    add_json_option(parser)


def _run(settings: Settings, args: argparse.Namespace, _redactor: Redactor) -> int:
    return anyio.run(migrate, settings, args.sql, args.json)


COMMAND = Command(
    description="Create room_outbox (and the database) when missing, or add room-outbox's columns and indexes\n"
    "to room-service's V1 table in place; create the tables of lanes of their own. Running it\n"
    "again changes nothing. --sql prints the statements it would run instead of running them.",
    examples="room-outbox migrate --sql\nroom-outbox migrate --config config/config.yaml\nroom-outbox migrate --json",
    needs="config",
    arguments=_arguments,
    run=_run,
)
