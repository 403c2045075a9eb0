"""The plugin-manager factory (no module-level global: every caller gets a fresh manager).

Order matters: names in ``plugins.disabled`` are blocked *before* entry points load, so a
blocked plugin is never imported; then every ``room_outbox.plugins`` entry point (built-in
sinks are published there too); then built-ins the environment did not publish (running from
a source tree without installing); finally ``check_pending`` rejects a hookimpl that matches
no hookspec, which is how a misspelt hook name shows up.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import pluggy

from room_outbox import hookspecs

#: Built-in plugins: entry-point name → module. Registered under these fixed names.
BUILTIN_PLUGINS = {
    "noop": "room_outbox.plugins.noop",
}


def make_plugin_manager(disabled: Iterable[str] = (), extra_plugins: Iterable[object] = ()) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)
    pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
    for name, module in BUILTIN_PLUGINS.items():
        if not pm.is_blocked(name) and pm.get_plugin(name) is None:
            pm.register(importlib.import_module(module), name)
    for plugin in extra_plugins:
        pm.register(plugin)
    pm.check_pending()
    return pm
