"""Lanes: which ones a configuration runs, what ``migrate`` creates for them, the store each
one of its own runs on, and the delivery settings of each.

The IM lane (``im``) lives in ``room_outbox.status`` and runs while any IM-lane sink is
enabled; a sink registered with ``own_lane=True`` gets ``room_outbox_lane_<name>`` (see
:mod:`room_outbox.store.lanes.store`) and its own dispatcher.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pluggy

from room_outbox.config import LanePlan, OutboxWorkerSettings, Settings
from room_outbox.delivery.routing import registered_sinks, section_enabled
from room_outbox.sink import SinkSpec
from room_outbox.store.dialect import PLUGIN_SCHEMA
from room_outbox.store.lanes.store import LaneStore, lanes_migration_plan, migrate_lanes
from room_outbox.store.lanes.tail import TailStore, migrate_tail, tail_migration_plan
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.outbox import Migration
from room_outbox.store.schema.plugins import run_plugin_statements, used_plugin_statements


def lane_plan(pm: pluggy.PluginManager, settings: Settings) -> LanePlan:
    specs = registered_sinks(pm)
    enabled = enabled_sinks(pm, settings)
    return LanePlan(
        main=any(not specs[name].own_lane for name in enabled),
        own=tuple(sorted(name for name in enabled if specs[name].own_lane)),
        tail=tuple(sorted(name for name in enabled if tails(specs[name], settings))),
    )


def tails(spec: SinkSpec[Any], settings: Settings) -> bool:
    """Whether the sink's lane tails ``room_outbox`` (see :mod:`room_outbox.delivery.tail`)."""
    return spec.own_lane and spec.ordered_log and settings.sinks.get(spec.name, {}).get("relay", "tail") == "tail"


def enabled_sinks(pm: pluggy.PluginManager, settings: Settings) -> set[str]:
    """Names of the registered sinks the configuration enables (``sinks.<name>.enabled``)."""
    specs = registered_sinks(pm)
    return {name for name, spec in specs.items() if section_enabled(settings.sinks.get(name), spec.enabled_by_default)}


async def plugins_migration_plan(
    store: SQLStore, pm: pluggy.PluginManager, settings: Settings, handlers: Collection[str] = ()
) -> list[Migration]:
    """What :func:`migrate_plugins` would run: the missing lane tables, then the statements of
    the plugins in use (they are idempotent, so all of them) where the store runs them."""
    plan = await lanes_migration_plan(store, own_lane_sinks(pm, settings))
    plan += await tail_migration_plan(store, list(lane_plan(pm, settings).tail))
    if PLUGIN_SCHEMA in store.dialect.capabilities:
        for owner, statements in used_plugin_statements(pm, enabled_sinks(pm, settings), handlers):
            plan.append(Migration(f"ran {len(statements)} schema statement(s) for {owner}", statements))
    return plan


def own_lane_sinks(pm: pluggy.PluginManager, settings: Settings) -> list[str]:
    """Names of the enabled sinks that keep a lane table of their own (not the tailing ones)."""
    plan = lane_plan(pm, settings)
    return [name for name in plan.own if name not in plan.tail]


def delivery_settings(settings: Settings, lane: str) -> OutboxWorkerSettings:
    """The settings ``lane`` delivers with: ``outbox_worker.lanes.<lane>`` over ``outbox_worker``."""
    return settings.outbox_worker.for_lane(lane)


async def migrate_plugins(
    store: SQLStore, pm: pluggy.PluginManager, settings: Settings, handlers: Collection[str] = ()
) -> list[str]:
    """Lane tables of enabled own-lane sinks, then the own statements of the plugins whose
    sinks, or ``handlers`` (the enabled handlers' names), are enabled."""
    changes = await migrate_lanes(store, own_lane_sinks(pm, settings))
    changes += await migrate_tail(store, list(lane_plan(pm, settings).tail))
    for owner, statements in used_plugin_statements(pm, enabled_sinks(pm, settings), handlers):
        if PLUGIN_SCHEMA not in store.dialect.capabilities:
            # Plugin statements are written in MySQL's dialect: elsewhere they are reported, not run.
            changes.append(f"skipped {len(statements)} schema statement(s) for {owner}: they are MySQL's")
            continue
        await run_plugin_statements(store, statements)
        changes.append(f"ran {len(statements)} schema statement(s) for {owner}")
    return changes


def tail_store(store: SQLStore, lane: str, settings: Settings) -> TailStore:
    return TailStore(
        owner=store,
        lane=lane,
        start=settings.sinks.get(lane, {}).get("start", "now"),
        gap_timeout=settings.lanes.gap_timeout,
        feed_batch=delivery_settings(settings, lane).batch_size,
        max_gaps=settings.lanes.max_gaps,
    )


def lane_store(store: SQLStore, lane: str, settings: Settings, start: str | int) -> LaneStore:
    return LaneStore(
        owner=store,
        lane=lane,
        start=start,
        gap_timeout=settings.lanes.gap_timeout,
        feed_batch=settings.lanes.feed_batch,
        max_gaps=settings.lanes.max_gaps,
    )
