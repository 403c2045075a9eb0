"""Lanes of their own: what ``migrate`` creates for them and the store each one runs on.

The IM lane lives in ``room_outbox``; a sink registered with ``own_lane=True`` gets
``room_outbox_lane_<name>`` (see :mod:`room_outbox.store.mysql_lanes`) and its own dispatcher.
"""

from __future__ import annotations

import warnings

import pluggy

from room_outbox.config import ConfigError, Settings
from room_outbox.routing import registered_sinks, section_enabled
from room_outbox.store.mysql import Migration, MySQLStore
from room_outbox.store.mysql_lanes import LaneStore, lanes_migration_plan, migrate_lanes


def own_lane_sinks(pm: pluggy.PluginManager, settings: Settings) -> list[str]:
    """Names of the enabled sinks that keep a lane of their own (without validating their
    settings: migrate must not need, say, a Tencent key)."""
    return sorted(
        name
        for name, spec in registered_sinks(pm).items()
        if spec.own_lane and section_enabled(settings.sinks.get(name), spec.enabled_by_default)
    )


async def plugins_migration_plan(store: object, pm: pluggy.PluginManager, settings: Settings) -> list[Migration]:
    """What :func:`migrate_plugins` would run: the missing lane tables, then every plugin's
    own statements (they are idempotent, so all of them)."""
    lanes = own_lane_sinks(pm, settings)
    statements = tuple(ddl for plugin_ddl in pm.hook.room_outbox_migrations() for ddl in plugin_ddl)
    if not isinstance(store, MySQLStore):
        if lanes:
            raise ConfigError(f"sinks {', '.join(lanes)}: lanes of their own need a MySQL database (mysql.dsn)")
        return []
    plan = await lanes_migration_plan(store, lanes)
    if statements:
        plan.append(Migration(f"ran {len(statements)} plugin schema statement(s)", statements))
    return plan


async def migrate_plugins(store: object, pm: pluggy.PluginManager, settings: Settings) -> list[str]:
    """Lane tables of enabled own-lane sinks, then every plugin's own statements."""
    lanes = own_lane_sinks(pm, settings)
    statements = [ddl for plugin_ddl in pm.hook.room_outbox_migrations() for ddl in plugin_ddl]
    if not isinstance(store, MySQLStore):
        if lanes:
            raise ConfigError(f"sinks {', '.join(lanes)}: lanes of their own need a MySQL database (mysql.dsn)")
        # Plugin statements are MySQL's; an installed plugin whose sink does not run here
        # (the demo on SQLite, say) needs none of its tables.
        return [f"skipped {len(statements)} plugin schema statement(s): they need MySQL"] if statements else []
    changes = await migrate_lanes(store, lanes)
    if statements:
        async with store.transaction() as cur:
            with warnings.catch_warnings():  # "table already exists" notes are the point of IF NOT EXISTS
                warnings.simplefilter("ignore")
                for ddl in statements:
                    await cur.execute(ddl)
        changes.append(f"ran {len(statements)} plugin schema statement(s)")
    return changes


def lane_store(store: object, lane: str, settings: Settings, start: str | int) -> LaneStore:
    if not isinstance(store, MySQLStore):
        raise ConfigError(f"sinks.{lane}: a lane of its own needs a MySQL database (mysql.dsn)")
    return LaneStore(
        owner=store,
        lane=lane,
        start=start,
        gap_timeout=settings.lanes.gap_timeout,
        feed_batch=settings.lanes.feed_batch,
    )
