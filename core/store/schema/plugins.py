"""Plugins' own schema statements (``room_outbox_migrations``) of the plugins the configuration
uses; the registry (:mod:`.registry`) runs them where the dialect has the ``plugin_schema``
capability."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import pluggy

from room_outbox.plugin_manager import hook_result, plugin_label


class PluginStatements(NamedTuple):
    """One plugin's statements: what for (``"sink audit"``), the statements, and the plugin as
    errors name it (with its distribution), for a statement the database refuses."""

    owner: str
    statements: tuple[str, ...]
    plugin: str


def used_plugin_statements(
    pm: pluggy.PluginManager, sinks: Collection[str], handlers: Collection[str]
) -> list[PluginStatements]:
    """The statements of each plugin whose tables the configuration needs, e.g. for ``"sink
    audit"``. A plugin's statements create what its sinks and handlers store, so they are
    asked for (its hook called) only while one of them is enabled (``sinks``, ``handlers``: the
    enabled names): an installed plugin left unused is not called at all. A plugin registering
    neither has nothing to tie them to, so its statements always run. A hook that raises or
    returns anything but a list of str stops ``migrate`` with an error naming the plugin."""
    used = []
    for impl in pm.hook.room_outbox_migrations.get_hookimpls():
        name = impl.plugin_name
        own_sinks = _registered_by(pm, pm.hook.room_outbox_register_sinks, name)
        own_handlers = _registered_by(pm, pm.hook.room_outbox_register_handlers, name)
        enabled = [f"sink {sink}" for sink in own_sinks if sink in sinks]
        enabled += [f"handler {handler}" for handler in own_handlers if handler in handlers]
        if not enabled and (own_sinks or own_handlers):
            continue
        statements = tuple(hook_result(pm, impl, "room_outbox_migrations", str))
        if statements:
            used.append(PluginStatements(", ".join(enabled) or f"plugin {name}", statements, plugin_label(pm, name)))
    return used


def _registered_by(pm: pluggy.PluginManager, hook: pluggy.HookCaller, plugin: str) -> list[str]:
    """Names of the specs (sinks, handlers) plugin ``plugin`` registers through ``hook``. The
    specs' types are checked where they are used (``registered_sinks``, ``registered_handlers``,
    which ``migrate`` checks first): here only their names count."""
    specs = (
        spec
        for impl in hook.get_hookimpls()
        if impl.plugin_name == plugin
        for spec in hook_result(pm, impl, hook.name, object)
    )
    return [name for name in (getattr(spec, "name", None) for spec in specs) if isinstance(name, str)]
