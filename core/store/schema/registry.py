"""The schema registry: every table room-outbox keeps, per database, as one ordered list of
changes read from the catalogue. ``migrate`` runs it, ``migrate --sql`` prints it, and the
start-up check (:mod:`.check`) requires what it creates; plan and apply read the same list,
so they cannot drift (:func:`required_columns`: what the check requires of what it creates).

In order: the outbox table (:mod:`.outbox`: its columns, indexes and fixes), the processes'
membership and room buckets (on a server, :mod:`room_outbox.store.membership`), the lanes of
their own (:mod:`.lanes`) and the tailing lanes (:mod:`.tail`), the plugins' statements (MySQL only: elsewhere a step that says it
skipped them), the consumers' tables (:mod:`.consumers`) and the handlers' tables.

Each backend runs a plan through its one entry, ``run_migration(planner)``: it takes the
database's exclusive-migration lock, reads the plan in a transaction (``planner``) and runs it
its own way (online on MySQL/MariaDB and PostgreSQL, in one transaction on SQLite).
"""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from room_outbox.errors import SchemaError
from room_outbox.store.dialect import PLUGIN_SCHEMA, Dialect
from room_outbox.store.schema.access import check_readable, check_writable
from room_outbox.store.schema.buckets import BUCKET_TABLE, NODE_TABLE, bucket_plan
from room_outbox.store.schema.columns import schema_problems, sequence_problems
from room_outbox.store.schema.consumers import consumer_steps
from room_outbox.store.schema.handler_tables import check_handler_tables
from room_outbox.store.schema.lanes import CURSOR_TABLE, lane_steps, lane_table
from room_outbox.store.schema.outbox import (
    ROOM_INDEX,
    Migration,
    built_indexes,
    claim_index,
    concurrent_step,
    invalid_index_steps,
    plan_outbox,
    taken_index_names,
)
from room_outbox.store.schema.outbox import required_columns as outbox_columns
from room_outbox.store.schema.tail import (
    PARKED_TABLE,
    SKIPPED_TABLE,
    hand_back_steps,
    parked_while_tailing,
    tail_steps,
)

if TYPE_CHECKING:
    from room_outbox.handler import HandlerTable
    from room_outbox.store.protocol import SQLStore
    from room_outbox.store.schema.plugins import PluginStatements
    from room_outbox.store.schema.profiles import Profile

#: Reads a plan from the catalogue in the transaction of the cursor it is given.
Planner = Callable[[Any], Awaitable[list[Migration]]]


@dataclass(frozen=True)
class WantedSchema:
    """What a migration brings about. ``outbox``: the outbox table and, on a server, the
    membership and room buckets; ``lanes``: the lane cursor and skipped tables and the tables of
    these lanes of their own (None: no lane tables); ``tail_lanes``: the cursor, parked and
    skipped tables of the lanes that tail the outbox; ``plugin_statements`` and
    ``handler_statements``: ``(what for, statements)`` of the plugins (with the plugin, named
    by an error of its statements) and handlers in use (idempotent, so they run every time);
    ``consumers``: the consumers' tables;
    ``handler_tables``: the columns those handlers write, checked where their tables exist."""

    outbox: bool = True
    lanes: tuple[str, ...] | None = None
    tail_lanes: tuple[str, ...] = ()
    plugin_statements: tuple[PluginStatements, ...] = ()
    consumers: bool = False
    handler_statements: tuple[tuple[str, tuple[str, ...]], ...] = ()
    handler_tables: tuple[HandlerTable, ...] = ()


#: The outbox table with the membership and room buckets: what ``SQLStore.migrate`` brings about.
OUTBOX = WantedSchema()


async def plan_schema(cur: Any, dialect: Dialect, profile: Profile, wanted: WantedSchema) -> list[Migration]:
    """The changes ``wanted`` still needs, read from the catalogue in the caller's transaction."""
    plan: list[Migration] = []
    # Never a plan read from a catalogue that hides the tables from this user
    await check_readable(cur, dialect, profile.table)
    if wanted.outbox:
        wrong_schema = await schema_problems(cur, dialect, profile)
        if wrong_schema:  # before anything is made in the session's first schema
            raise SchemaError("\n".join(wrong_schema))
        if dialect.name == "postgresql":  # interrupted index builds first
            plan += await invalid_index_steps(cur, [profile.table])
        plan += await plan_outbox(cur, dialect, profile)
        if dialect.room_buckets:
            buckets = await bucket_plan(cur, dialect, [profile.table], profile=profile)
            plan += [concurrent_step(change, statements) for change, statements in buckets]
    if wanted.lanes or wanted.tail_lanes:
        refused = await sequence_problems(cur, dialect, profile)
        if refused:
            raise SchemaError("\n".join(refused))
    if wanted.lanes is not None:
        refused = await parked_while_tailing(cur, dialect, wanted.lanes, profile)
        if refused:
            raise SchemaError("\n".join(refused))
        # the outbox's room buckets above create the bucket function the lanes' indexes compute too
        plan += await lane_steps(cur, dialect, wanted.lanes, function_planned=wanted.outbox)
        # a lane back from tailing: what its new table takes over (the table made just above)
        plan += await hand_back_steps(cur, dialect, profile, wanted.lanes)
    plan += await tail_steps(cur, dialect, wanted.tail_lanes, cursor_planned=wanted.lanes is not None)
    for owner, statements, plugin in wanted.plugin_statements:
        if PLUGIN_SCHEMA in dialect.capabilities:
            plan.append(Migration(f"ran {len(statements)} schema statement(s) for {owner}", statements, author=plugin))
        else:  # plugin statements are written in MySQL's dialect
            plan.append(Migration(f"skipped {len(statements)} schema statement(s) for {owner}: they are MySQL's", ()))
    if wanted.consumers:
        plan += await consumer_steps(cur, dialect)
    # Tables made beforehand, which the handlers' CREATE TABLE IF NOT EXISTS keeps as they are
    handlers = await check_handler_tables(cur, dialect, wanted.handler_tables)
    if handlers.refused:
        raise SchemaError("\n".join(handlers.refused))
    plan += [Migration(f"left as it is: {warning}", ()) for warning in handlers.warnings]
    for owner, statements in wanted.handler_statements:
        plan.append(Migration(f"ran {len(statements)} schema statement(s) for {owner}", statements))
    # Refused before anything runs: IF NOT EXISTS would take another table's index for built
    built = built_indexes(plan)
    taken = await taken_index_names(cur, dialect, built)
    if taken:
        refused = [
            f"cannot build index {name} on table {table}: {taken[name]}" for name, table in built if name in taken
        ]
        raise SchemaError("\n".join(dict.fromkeys(refused)))
    await check_writable(cur, dialect, profile.table, plan)
    return plan


#: Columns of a lane's own table that its statements read or write.
LANE_COLUMNS = ("outbox_id", "status", "retry_count", "last_error", "worker_id", "lock_until_ms")


def required_columns(dialect: Dialect, profile: Profile, wanted: WantedSchema) -> dict[str, tuple[str, ...]]:
    """Table → the columns room-outbox reads or writes there, of what ``wanted`` creates (the
    start-up check requires them; plugins' and consumers' tables are checked by their users)."""
    # On a server: the processes' membership and the room buckets (SQLite runs without them).
    # No bucket column: a table that has none computes its rows' bucket (schema.buckets).
    server = dialect.room_buckets
    required: dict[str, tuple[str, ...]] = {}
    if wanted.outbox:
        required[profile.table] = outbox_columns(profile)
    if wanted.lanes is not None:
        required[CURSOR_TABLE] = ("lane", "fed_through_id")
        # where a feeder records the ids it gave up on (LaneStore._record_skipped)
        required[SKIPPED_TABLE] = ("lane", "low_id", "high_id", "skipped_at_ms")
        required.update({lane_table(lane): LANE_COLUMNS for lane in wanted.lanes})
    if wanted.tail_lanes:
        required[CURSOR_TABLE] = ("lane", "fed_through_id", "read_through_id", "open_gaps")
        required[PARKED_TABLE] = ("lane", "outbox_id", "status", "last_error")
        required[SKIPPED_TABLE] = ("lane", "low_id", "high_id", "skipped_at_ms")
    if wanted.outbox and server:
        required[NODE_TABLE] = ("node_id", "heartbeat_ms", "view", "view_since_ms", "orderings")
        required[BUCKET_TABLE] = ("bucket", "owner", "handing_over", "claimable_from_ms")
    return required


def required_indexes(profile: Profile) -> tuple[str, ...]:
    """The outbox table's indexes room-outbox's statements read by name (lower case), which
    ``migrate`` creates on every database: the claim's, and per-room order's look-back. MySQL
    and MariaDB refuse a statement that forces one the table lacks (the claim does, with
    ``claim_after`` or room buckets); elsewhere every claim would scan the table. A table
    swapped for a copy built without them (gh-ost, pt-online-schema-change) lacks them. By
    name: the claim's holds the room bucket last or not (:func:`.buckets.bucket_plan`)."""
    table = profile.table.lower()
    return claim_index(table)[0], ROOM_INDEX.format(table=table)


async def migration_plan(store: SQLStore, wanted: WantedSchema = OUTBOX) -> list[Migration]:
    """What :func:`migrate` would run now (``migrate --sql``); the catalogue is only read."""
    async with store.transaction() as cur:
        return await plan_schema(cur, store.dialect, store.profile, wanted)


async def schemas_looked_in(store: SQLStore) -> tuple[str, ...]:
    """The schemas this store's sessions look in, in order, each quoted where needed
    (PostgreSQL: the DSN's ``search_path``, else the role's default with ``"$user"`` made its
    name; elsewhere none). The statements of a plan name tables, indexes and functions without
    a schema, so a session that runs ``migrate --sql``'s script by hand sets this search path
    first: psql's own would put them elsewhere, or find nothing."""
    if store.dialect.name != "postgresql":
        return ()
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT quote_ident(schema) FROM unnest(current_schemas(false)) WITH ORDINALITY AS s(schema, position)"
            " ORDER BY position"
        )
        return tuple(str(schema) for (schema,) in await cur.fetchall())


async def migrate(store: SQLStore, wanted: WantedSchema = OUTBOX) -> list[str]:
    """Bring about ``wanted`` through the backend's one migration entry; return the changes."""

    async def planner(cur: Any) -> list[Migration]:
        return await plan_schema(cur, store.dialect, store.profile, wanted)

    with warnings.catch_warnings():  # "already exists" notes are the point of IF NOT EXISTS
        warnings.simplefilter("ignore")
        return await store.run_migration(planner)


def steps_of(owners: Iterable[tuple[str, Sequence[str]]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(what for, statements)`` pairs as :class:`WantedSchema` holds them."""
    return tuple((owner, tuple(statements)) for owner, statements in owners)
