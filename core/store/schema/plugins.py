"""Plugins' own schema statements (``room_outbox_migrations``) of the plugins the configuration
uses; the registry (:mod:`.registry`) runs them where the dialect has the ``plugin_schema``
capability."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, cast

import pluggy


def used_plugin_statements(
    pm: pluggy.PluginManager, sinks: Collection[str], handlers: Collection[str]
) -> list[tuple[str, tuple[str, ...]]]:
    """``(what for, statements)`` of each plugin whose tables the configuration needs, e.g.
    ``("sink audit", (…,))``. A plugin's statements create what its sinks and handlers store,
    so they run only while one of them is enabled (``sinks``, ``handlers``: the enabled names);
    a plugin registering neither has nothing to tie them to, so its statements always run."""
    used = []
    for impl in pm.hook.room_outbox_migrations.get_hookimpls():
        statements = tuple(str(ddl) for ddl in _called(impl))
        own_sinks = _registered_by(pm.hook.room_outbox_register_sinks, impl.plugin)
        own_handlers = _registered_by(pm.hook.room_outbox_register_handlers, impl.plugin)
        enabled = [f"sink {name}" for name in own_sinks if name in sinks]
        enabled += [f"handler {name}" for name in own_handlers if name in handlers]
        if statements and (enabled or not (own_sinks or own_handlers)):
            used.append((", ".join(enabled) or f"plugin {pm.get_name(impl.plugin)}", statements))
    return used


def _registered_by(hook: pluggy.HookCaller, plugin: object) -> list[str]:
    """Names of the specs (sinks, handlers) ``plugin`` registers through ``hook``."""
    return [str(spec.name) for impl in hook.get_hookimpls() if impl.plugin is plugin for spec in _called(impl)]


def _called(impl: pluggy.HookImpl) -> list[Any]:
    """One plugin's answer to a hook; these hooks take no arguments and return lists."""
    return list(cast("Iterable[Any]", impl.function()))
