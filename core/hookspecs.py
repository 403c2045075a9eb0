"""The pluggy contract between the core and its plugins.

Hooks are synchronous and only *register* things; the core drives delivery itself. (pluggy
calls hooks synchronously, and one raising hookimpl would stop the rest, so nothing slow or
fallible belongs in a hook.) A plugin is a module or object with ``@hookimpl`` functions,
published under the entry-point group ``room_outbox.plugins``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from room_outbox.handler import HandlerSpec
    from room_outbox.sink import SinkSpec

PROJECT_NAME = "room_outbox"
ENTRY_POINT_GROUP = "room_outbox.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------------------------
# Sinks
# -------------------------------------------------------------------------------------------


@hookspec
def room_outbox_register_sinks() -> list[SinkSpec[Any]]:
    """Return the sinks this plugin provides.

    Called once per plugin manager, before configuration of the sinks is validated. Every
    implementation is called; the results are collected. A sink name may be registered by
    one plugin only: a second registration of the same name stops start-up.
    """
    raise NotImplementedError  # pragma: no cover - specification only


# -------------------------------------------------------------------------------------------
# Schema
# -------------------------------------------------------------------------------------------


@hookspec
def room_outbox_migrations() -> list[str]:
    """Return the SQL statements that create what this plugin stores (MySQL dialect).

    Called by ``room-outbox migrate`` after room-outbox's own tables and the lane tables of
    own-lane sinks. A plugin's statements run only while a sink or handler it registers is
    enabled (one registering neither has them run always). Each statement must be idempotent
    (``CREATE TABLE IF NOT EXISTS …``): migrate runs them every time, on MySQL only. A
    consumer handler's tables, on MySQL and PostgreSQL alike, come with its spec instead
    (``HandlerSpec.schema``).
    """
    raise NotImplementedError  # pragma: no cover - specification only


# -------------------------------------------------------------------------------------------
# Consumer handlers
# -------------------------------------------------------------------------------------------


@hookspec
def room_outbox_register_handlers() -> list[HandlerSpec[Any]]:
    """Return the consumer handlers this plugin provides (``room-outbox consume``).

    Called once per plugin manager when a consume process starts; every implementation is
    called and the results are collected. A handler name may be registered by one plugin
    only. A handler's tables come with its spec (``HandlerSpec.schema``, per database); on
    MySQL :func:`room_outbox_migrations` creates tables too.
    """
    raise NotImplementedError  # pragma: no cover - specification only
