"""What ``run`` checks before it delivers anything, in this order:

1. **The whole configuration, offline** (:func:`check_configuration`): the settings file and
   environment (already parsed into :class:`Settings`), the DSN, every enabled sink's section,
   the routes, lanes of their own, the ``OTEL_*`` exporters. Nothing connects, so
   ``room-outbox check-config`` runs the same check on a machine without a database.
2. **The database** (:func:`open_checked_store`): waited for up to ``database.connect_wait`` while
   it cannot be reached (a server still starting), then
3. **the user's privileges and the schema**: what ``run`` does on each table it uses, and
   that the server takes writes; every column and lane table room-outbox uses, or "run
   `room-outbox migrate`" (a table without its producer's columns: migrate's refusal). Within
   step 2's wait: a connection lost while they run (a session terminated, a server
   restarting) is waited out too, from a new pool; what they refuse ends the start at once.

Each failure is one :class:`~room_outbox.errors.RoomOutboxError` (a configuration error, exit 2;
the database unreachable or not migrated, exit 3).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field

import pluggy

from room_outbox.cluster.identity import MAX_NODE_ID_LENGTH, longest_claim_id, stored_node_id
from room_outbox.config import MAIN_LANE, Settings
from room_outbox.consume.registry import NO_CONSUMER, check_consumers
from room_outbox.delivery.lanes import delivery_settings, tails, unused_tail_settings
from room_outbox.delivery.routing import registered_sinks, sink_name_problems, validate_sinks
from room_outbox.errors import ConfigurationError
from room_outbox.observability.telemetry import check_environment, sdk_disabled
from room_outbox.store.factory import describe, open_store, store_address
from room_outbox.store.lanes.store import lane_table
from room_outbox.store.privileges import check_privileges, needed_by_run
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.profiles import Profile, profile_named


@dataclass(frozen=True)
class CheckedConfiguration:
    """What the configuration turns out to run."""

    #: Enabled sinks sharing the main lane, and those with a lane of their own.
    main_sinks: list[str]
    own_lanes: list[str]
    database: str
    #: Those of ``own_lanes`` that tail ``room_outbox`` (no lane table).
    tail_lanes: list[str] = field(default_factory=list)
    #: The enabled consumers (``consume``'s).
    consumers: list[str] = field(default_factory=list)
    #: What runs but deserves a word: settings that do nothing, former names. A line each.
    warnings: list[str] = field(default_factory=list)

    @property
    def lane_tables(self) -> list[str]:
        """Lanes of their own kept in a table (``room_outbox_lane_<name>``)."""
        return [lane for lane in self.own_lanes if lane not in self.tail_lanes]


def check_configuration(settings: Settings, pm: pluggy.PluginManager, command: str = "run") -> CheckedConfiguration:
    """Validate everything ``command`` (``run`` or ``consume``) needs short of connecting; one
    :class:`ConfigurationError` names every problem found. ``consume`` delivers to no sink: a
    consumers' file need not configure the sinks (their defaults want credentials), but it
    must enable a consumer."""
    problems: list[str] = []
    database = ""
    try:
        database = store_address(settings.database.dsn.get_secret_value()).database
    except ConfigurationError as exc:
        problems.append(str(exc))
    try:
        check_environment()
    except ConfigurationError as exc:
        problems.append(str(exc))
    stored = stored_node_id(settings.node_id)
    if len(stored) > MAX_NODE_ID_LENGTH:
        escaped = f" once its non-ASCII characters are escaped ({stored})" if stored != settings.node_id else ""
        problems.append(
            f"node_id: {len(stored)} characters{escaped}; at most {MAX_NODE_ID_LENGTH}"
            " (the process identity and claim ids made from it must fit the database columns)"
        )
    main_sinks: list[str] = []
    own_lanes: list[str] = []
    tail_lanes: list[str] = []
    consumers: list[str] = []
    try:
        enabled = validate_sinks(pm, settings) if command == "run" else {}
    except ConfigurationError as exc:
        problems.extend(_lines(exc))
    else:
        main_sinks = sorted(name for name, (spec, _) in enabled.items() if not spec.own_lane)
        own_lanes = sorted(name for name, (spec, _) in enabled.items() if spec.own_lane)
        tail_lanes = sorted(name for name, (spec, _) in enabled.items() if tails(spec, settings))
    for lane in own_lanes:
        try:
            lane_table(lane)
        except ConfigurationError as exc:
            problems.append(f"sinks.{lane}: {exc}")
    try:
        consumers = check_consumers(pm, settings)
    except ConfigurationError as exc:
        problems.extend(_lines(exc))
    else:
        if command == "consume" and not consumers:
            problems.append(NO_CONSUMER)
    if problems:
        raise ConfigurationError("invalid configuration:\n  " + "\n  ".join(problems))
    warnings = [
        *settings.deprecated_names,
        *filter(None, [sdk_disabled()]),
        *filter(None, (unused_tail_settings(settings, lane) for lane in tail_lanes)),
        *filter(None, (_batch_memory(settings, lane) for lane in [MAIN_LANE, *own_lanes])),
    ]
    return CheckedConfiguration(main_sinks, own_lanes, database, tail_lanes, consumers, warnings)


#: The memory limit the shipped Kubernetes manifest gives a process, in bytes.
SHIPPED_MEMORY_LIMIT = 256 << 20


def _batch_memory(settings: Settings, lane: str) -> str | None:
    """A warning when a batch of ``lane`` made of envelopes as long as the database reads
    (``database.max_envelope_bytes``) would not fit the shipped memory limit: a process holds
    about twice a batch's envelopes while it reads and parses them. None when it fits."""
    batch = delivery_settings(settings, lane).batch_size
    envelope = settings.database.max_envelope_bytes
    if 2 * batch * envelope <= SHIPPED_MEMORY_LIMIT:
        return None
    key = "outbox_worker.batch_size" if lane == MAIN_LANE else f"outbox_worker.lanes.{lane}.batch_size"
    return (
        f"{key} {batch} × database.max_envelope_bytes {envelope}: a batch of envelopes that long takes up to"
        f" {2 * batch * envelope >> 20} MiB while it is read and parsed, above the shipped memory limit (256 Mi),"
        " and more than one statement's database.query_timeout may allow to read it; room events are a few"
        " hundred bytes, but a backlog of long ones would get the process killed: lower either setting, or raise"
        " the memory limit (and query_timeout) to match"
    )


def check_migrate_configuration(settings: Settings, pm: pluggy.PluginManager) -> None:
    """What ``migrate`` reads of the configuration, checked before it connects: the names of
    the enabled sinks and of the consumers' handlers, whose tables it makes. A misspelt one
    would get no table, silently; a sink's other settings (credentials) are not its concern."""
    problems = sink_name_problems(pm, registered_sinks(pm), settings)
    try:
        check_consumers(pm, settings)
    except ConfigurationError as exc:
        problems.extend(_lines(exc))
    if problems:
        raise ConfigurationError("invalid configuration:\n  " + "\n  ".join(problems))


def table_profile(settings: Settings) -> Profile:
    """The outbox table's profile ``database.profile`` (and ``database.table``) name."""
    return profile_named(settings.database.profile, settings.database.table)


async def open_checked_store(
    settings: Settings, own_lanes: list[str], tail_lanes: Sequence[str] = (), main_lane: bool = True
) -> SQLStore:
    """The store, once reachable (waiting up to ``database.connect_wait``), migrated, and
    writable by its user as ``run`` needs (``main_lane``: the main lane runs). The checks run
    within that wait: a connection lost meanwhile is waited out, a refusal ends the start."""
    database = settings.database
    # A tailing round's transaction waits, idle, for its batch's publish: the server's session
    # limits must allow the longest publish_timeout besides query_timeout.
    publishing = max((delivery_settings(settings, lane).publish_timeout for lane in tail_lanes), default=0.0)
    return await open_store(
        database.dsn.get_secret_value(),
        database.pool_size,
        query_timeout=database.query_timeout,
        wait=database.connect_wait,
        profile=table_profile(settings),
        idle_in_transaction=publishing,
        max_envelope_bytes=database.max_envelope_bytes,
        existing_only=True,  # a SQLite file is migrate's to create: run would find no table in a new one
        check=lambda store: check_run_schema(store, settings, own_lanes, tail_lanes, main_lane),
    )


async def check_run_schema(
    store: SQLStore,
    settings: Settings,
    lane_tables: Sequence[str],
    tail_lanes: Sequence[str] = (),
    main_lane: bool = True,
    reader: str | None = None,
) -> None:
    """Start-up's schema check (step 3): raises :class:`~room_outbox.errors.PrivilegeError`
    or :class:`~room_outbox.errors.SchemaError` naming what ``run`` would refuse to start for.
    ``lane_tables``: the lanes of their own kept in a table, ``tail_lanes``: those tailing the
    outbox, ``main_lane``: the main lane runs. ``status`` and ``lanes`` make it too: a report
    that looks normal must not hide that no process can start. The user's privileges come
    first: the catalogue may hide a table the user holds none on (MySQL's does). A report
    (``reader``: its command's name) checks only what it needs itself, SELECT: its user may
    be a monitoring one, not ``run``'s, and a replica serves it."""
    claims = settings.outbox_worker.enabled and reader is None
    needed = needed_by_run(store, lane_tables, tail_lanes, main_lane, claims)
    where = describe(store_address(settings.database.dsn.get_secret_value()))
    await check_privileges(store, needed, where, reader or "run")
    await check_schema(store, lane_tables, longest_claim_id(settings.node_id), tail_lanes)


def _lines(exc: ConfigurationError) -> list[str]:
    """The problems of an error that may already be an "invalid configuration" list."""
    lines = str(exc).splitlines()
    return [line.strip() for line in lines[1:]] if lines[0] == "invalid configuration:" else lines


def freeze_startup_heap() -> None:
    """Put what the process has allocated so far (imported modules, plugins, configuration:
    about a hundred thousand objects that live as long as the process) beyond the cyclic
    garbage collector's reach, for a long-running service to call once before its loop.

    A full collection walks every tracked object and holds the event loop meanwhile. A relay
    allocates a few objects per message that outlive a young collection (a batch in flight
    spans many awaits), so full collections come several times a second under load, and each
    walking the startup heap stalls the delivery path. Frozen,
    they walk only what the service allocated since. Garbage made before the call is
    collected first, so nothing frozen is garbage."""
    gc.collect()
    gc.freeze()
