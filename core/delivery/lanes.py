"""Lanes: which ones a configuration runs, what ``migrate`` creates for them, the store each
one of its own runs on, and the delivery settings of each.

The main lane (``main``) lives in ``room_outbox.status`` and runs while any main-lane sink is
enabled; a sink registered with ``own_lane=True`` gets ``room_outbox_lane_<name>`` (see
:mod:`room_outbox.store.lanes.store`) and its own dispatcher.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pluggy

from room_outbox.config import MAIN_LANE, LanePlan, OutboxWorkerSettings, Settings
from room_outbox.delivery.routing import registered_sinks, section_enabled
from room_outbox.delivery.tail import LANE_TABLE_ONLY_SETTINGS
from room_outbox.sink import SinkSpec
from room_outbox.store.lanes.store import LaneStore
from room_outbox.store.lanes.tail import TailStore
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.plugins import used_plugin_statements
from room_outbox.store.schema.registry import WantedSchema, migrate


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


def unused_tail_settings(settings: Settings, lane: str) -> str | None:
    """A warning naming the ``outbox_worker.lanes.<lane>`` keys that a tailing lane ignores, or
    None. Only the lane's own overrides: ``outbox_worker``'s keys are every lane's, the main
    lane's among them. A warning, not an error: a configuration that starts today keeps starting."""
    overrides = settings.outbox_worker.lanes.get(lane, {})
    unused: list[str] = []
    for key in LANE_TABLE_ONLY_SETTINGS:
        value = overrides.get(key)
        if isinstance(value, dict):
            unused.extend(f"outbox_worker.lanes.{lane}.{key}.{inner}" for inner in value)
        elif key in overrides:
            unused.append(f"outbox_worker.lanes.{lane}.{key}")
    if not unused:
        return None
    return (
        f"{', '.join(unused)}: ignored while the {lane} lane tails room_outbox (sinks.{lane}.relay: tail);"
        f" they take effect only with relay: lane_table"
    )


def enabled_sinks(pm: pluggy.PluginManager, settings: Settings) -> set[str]:
    """Names of the registered sinks the configuration enables (``sinks.<name>.enabled``)."""
    specs = registered_sinks(pm)
    return {name for name, spec in specs.items() if section_enabled(settings.sinks.get(name), spec.enabled_by_default)}


def plugins_schema(pm: pluggy.PluginManager, settings: Settings, handlers: Collection[str] = ()) -> WantedSchema:
    """The tables of the enabled own-lane sinks' lanes (tailing lanes: the cursor and parked
    tables), then the own statements of the plugins
    whose sinks, or ``handlers`` (the enabled handlers' names), are enabled."""
    statements = used_plugin_statements(pm, enabled_sinks(pm, settings), handlers)
    plan = lane_plan(pm, settings)
    own = tuple(own_lane_sinks(pm, settings))
    return WantedSchema(outbox=False, lanes=own, tail_lanes=plan.tail, plugin_statements=tuple(statements))


def own_lane_sinks(pm: pluggy.PluginManager, settings: Settings) -> list[str]:
    """Names of the enabled sinks that keep a lane table of their own (not the tailing ones)."""
    plan = lane_plan(pm, settings)
    return [name for name in plan.own if name not in plan.tail]


def delivery_settings(settings: Settings, lane: str) -> OutboxWorkerSettings:
    """The settings ``lane`` delivers with: ``outbox_worker.lanes.<lane>`` over ``outbox_worker``."""
    return settings.outbox_worker.for_lane(lane)


def claim_after_ms(settings: Settings) -> int:
    """The age (ms) the main lane's claim waits for in a row the producer wrote
    (``claim_after``): what the dispatcher's store is given, and what ``inspect`` reports."""
    return int(delivery_settings(settings, MAIN_LANE).claim_after * 1000)


def lease_ms(settings: Settings) -> int:
    """The main lane's lease (ms): how long its claim leaves a row the producer's own worker
    holds (silk's) after that row's last change. Given to the dispatcher's store, and used by
    ``inspect``."""
    return int(delivery_settings(settings, MAIN_LANE).lease_seconds * 1000)


async def migrate_plugins(
    store: SQLStore, pm: pluggy.PluginManager, settings: Settings, handlers: Collection[str] = ()
) -> list[str]:
    """:func:`plugins_schema` brought about through the one migration path."""
    return await migrate(store, plugins_schema(pm, settings, handlers))


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
