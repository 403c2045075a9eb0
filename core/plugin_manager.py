"""The plugin-manager factory (no module-level global: every caller gets a fresh manager).

Order matters: names in ``plugins.disabled`` are blocked *before* entry points load, so a
blocked plugin is never imported; then every ``room_outbox.plugins`` entry point (built-in
sinks are published there too); then built-ins the environment did not publish (running from
a source tree without installing); finally ``check_pending`` rejects a hookimpl that matches
no hookspec, which is how a misspelt hook name shows up.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable

import pluggy

from room_outbox import hookspecs
from room_outbox.config import ConfigError

#: Built-in plugins: entry-point name → module. Registered under these fixed names.
BUILTIN_PLUGINS = {
    "noop": "room_outbox.plugins.noop",
    "tencent_im": "room_outbox.plugins.tencent_im",
    "kafka": "room_outbox.plugins.kafka",
    "audit_log": "room_outbox.plugins.audit_log",
    "activity": "room_outbox.plugins.activity",
}


def make_plugin_manager(disabled: Iterable[str] = (), extra_plugins: Iterable[object] = ()) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)
    _load_entry_points(pm)
    for name, module in BUILTIN_PLUGINS.items():
        if not pm.is_blocked(name) and not pm.has_plugin(name):
            pm.register(importlib.import_module(module), name)
    for plugin in extra_plugins:
        pm.register(plugin)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise ConfigError(f"plugin {exc.plugin!r}: {exc}") from exc
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """pluggy's ``load_setuptools_entrypoints``, except that a plugin failing to import stops
    start-up with an error naming the plugin and its distribution instead of a bare traceback."""
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != hookspecs.ENTRY_POINT_GROUP or pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                raise ConfigError(
                    f"plugin {ep.name!r} (distribution {dist.metadata['Name']!r}, {ep.value}) failed to load: "
                    f"{type(exc).__name__}: {exc}; fix it or add {ep.name!r} to plugins.disabled"
                ) from exc
            pm.register(plugin, name=ep.name)
