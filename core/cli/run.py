"""``room-outbox check-config`` and ``migrate``: the configuration checked offline, the schema
created or upgraded (or, with ``--sql``, printed). ``run`` itself is :func:`room_outbox.app.run_service`."""

from __future__ import annotations

import contextlib

import pluggy

from room_outbox.cli import consume as consume_cli
from room_outbox.config import Settings
from room_outbox.delivery.lanes import migrate_plugins, plugins_migration_plan
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.startup import check_configuration, table_profile
from room_outbox.store.errors import translated
from room_outbox.store.factory import describe, open_store, store_address
from room_outbox.store.sqlite import SQLiteAddress


def check_config(settings: Settings, source: str | None) -> int:
    """``check-config``: the whole configuration, as ``run`` would check it, offline."""
    checked = check_configuration(settings, make_plugin_manager(settings.plugins.disabled))
    print(
        f"configuration OK ({source or 'defaults and environment'}): database {checked.database!r};"
        f" IM lane sinks: {', '.join(checked.im_sinks) or 'none'};"
        f" lanes of their own: {', '.join(checked.own_lanes) or 'none'}"
    )
    return 0


async def migrate(settings: Settings, sql_only: bool) -> int:
    dsn = settings.database.dsn.get_secret_value()
    pm = make_plugin_manager(settings.plugins.disabled)
    if sql_only:
        return await print_migration(settings, pm)
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
            changes = await store.migrate()
            changes += await migrate_plugins(store, pm, settings)  # own-lane sinks' tables, plugin tables
            changes += await consume_cli.migrate_consumers(store, pm)  # consumers' and handlers' tables
    finally:
        await store.aclose()
    for change in changes or ["schema already up to date"]:
        print(change)
    return 0


async def print_migration(settings: Settings, pm: pluggy.PluginManager) -> int:
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
            plan = await store.migration_plan() + await plugins_migration_plan(store, pm, settings)
            plan += await consume_cli.consumers_migration_plan(store, pm)
    finally:
        await store.aclose()
    print(f"-- room-outbox migrate for {describe(address)}: nothing has been run")
    if not plan:
        print("-- schema already up to date: no statement to run")
    if any(step.autocommit for step in plan):
        print("-- run statement by statement, outside a transaction (psql's default): CONCURRENTLY refuses one")
    for step in plan:
        print(f"\n-- {step.change}")
        if step.repeat:
            print("-- a batch: run it again until it changes no row")
        for statement in step.statements:
            print(statement.strip().rstrip(";") + ";")
    return 0


def translated_errors(dsn: str) -> contextlib.AbstractContextManager[None]:
    """Driver errors of the block as room-outbox's own, naming the store (not the password)."""
    address = store_address(dsn)
    return translated(describe(address), getattr(address, "password", ""))
