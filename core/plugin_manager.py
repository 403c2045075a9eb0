"""The plugin-manager factory (no module-level global: every caller gets a fresh manager).

Order matters: names in ``plugins.disabled`` are blocked *before* entry points load, so a
blocked plugin is never imported; then every ``room_outbox.plugins`` entry point (built-in
sinks are published there too); then built-ins the environment did not publish (running from
a source tree without installing); finally ``check_pending`` rejects a hookimpl that matches
no hookspec, which is how a misspelt hook name shows up.

A plugin's name is its entry point's, and one name is one plugin: a name two distributions
publish, or a built-in's name published for another module, stops start-up (whichever
loaded first would otherwise replace the other without a word).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar, cast

import pluggy

from room_outbox import hookspecs
from room_outbox.config import ConfigError
from room_outbox.errors import describe_exception

#: Built-in plugins: entry-point name → module. Registered under these fixed names.
T = TypeVar("T")

BUILTIN_PLUGINS = {
    "noop": "room_outbox.plugins.noop",
    "tencent_im": "room_outbox.plugins.tencent_im",
    "kafka": "room_outbox.plugins.kafka",
    "audit_log": "room_outbox.plugins.audit_log",
    "activity": "room_outbox.plugins.activity",
}

#: What a plugin raising at start-up may raise that is no ``Exception``: its own doing (an
#: ``exit()`` in its module, say), named like any other failure of the plugin; but not the
#: operator's Ctrl-C (see :func:`_ctrl_c_told_apart`).
_PLUGIN_ABORTS = (Exception, SystemExit, KeyboardInterrupt)


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, knowing where each plugin comes from (for the errors naming it)."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        #: Plugin name → the distribution that published it, for plugins loaded from entry points.
        self.distributions: dict[str, str] = {}


def make_plugin_manager(disabled: Iterable[str] = (), extra_plugins: Iterable[object] = ()) -> PluginManager:
    pm = PluginManager()
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


def plugin_label(pm: pluggy.PluginManager, name: str) -> str:
    """How errors name plugin ``name``: with its distribution when it came from one."""
    distribution = pm.distributions.get(name) if isinstance(pm, PluginManager) else None
    return f"plugin {name!r} (distribution {distribution!r})" if distribution else f"plugin {name!r}"


def registered_specs(pm: pluggy.PluginManager, hook: pluggy.HookCaller, spec_type: type[T]) -> list[tuple[str, T]]:
    """``(plugin name, spec)`` for each spec the plugins register through ``hook`` (one taking
    no arguments and returning a list of ``spec_type``), in the order pluggy would call them.
    A plugin whose hook raises, or returns anything else, stops start-up with an error naming
    it."""
    found = []
    for impl in reversed(hook.get_hookimpls()):
        found += [(impl.plugin_name, spec) for spec in hook_result(pm, impl, hook.name, spec_type)]
    return found


def specs_by_name(pm: pluggy.PluginManager, hook: pluggy.HookCaller, kind: str, spec_type: type[T]) -> dict[str, T]:
    """Each spec the plugins register through ``hook`` (:func:`registered_specs`) by its name;
    a name two plugins register stops start-up, naming both (``kind``: "sink", "handler")."""
    found: dict[str, T] = {}
    owners: dict[str, str] = {}
    for plugin, spec in registered_specs(pm, hook, spec_type):
        name = cast("Any", spec).name
        if name in found:
            raise ConfigError(
                f"two plugins register a {kind} named {name!r}: {plugin_label(pm, owners[name])} "
                f"and {plugin_label(pm, plugin)}; add one of them to plugins.disabled"
            )
        found[name], owners[name] = spec, plugin
    return found


def hook_result(pm: pluggy.PluginManager, impl: pluggy.HookImpl, hook: str, item_type: type[T]) -> list[T]:
    """What plugin ``impl`` answers to ``hook`` (taking no arguments, returning a list of
    ``item_type``): a hook that raises, or returns anything but such a list, stops start-up
    with an error naming the plugin and its distribution."""
    name = impl.plugin_name
    return _plugins_own(
        functools.partial(_listed, impl.function, item_type), f"{plugin_label(pm, name)} failed in {hook}", name
    )


def _load_entry_points(pm: PluginManager) -> None:
    """pluggy's ``load_setuptools_entrypoints``, except that a plugin failing to import stops
    start-up with an error naming the plugin and its distribution instead of a bare traceback,
    and a name two distributions publish stops it too (see the module's docstring)."""
    published: dict[str, tuple[str, importlib.metadata.EntryPoint]] = {}
    for dist in importlib.metadata.distributions():
        distribution = dist.metadata["Name"]
        for ep in dist.entry_points:
            if ep.group != hookspecs.ENTRY_POINT_GROUP or pm.is_blocked(ep.name):
                continue
            if ep.name in published:
                first, _ = published[ep.name]
                if _canonical(first) != _canonical(distribution):  # the same one found twice on the path is fine
                    raise ConfigError(
                        f"plugin {ep.name!r} is published by two distributions, {first!r} and {distribution!r}: "
                        f"uninstall one, or add {ep.name!r} to plugins.disabled to load neither"
                    )
                continue
            builtin = BUILTIN_PLUGINS.get(ep.name)
            if builtin is not None and ep.module != builtin:
                raise ConfigError(
                    f"plugin {ep.name!r} (distribution {distribution!r}, {ep.value}) has the name of a built-in "
                    f"plugin: rename its entry point, uninstall it, or add {ep.name!r} to plugins.disabled "
                    f"to load neither"
                )
            published[ep.name] = (distribution, ep)
    for name, (distribution, ep) in published.items():
        plugin = _plugins_own(
            ep.load, f"plugin {name!r} (distribution {distribution!r}, {ep.value}) failed to load", name
        )
        same = pm.get_name(plugin)
        if same is not None:
            raise ConfigError(
                f"plugin {name!r} (distribution {distribution!r}, {ep.value}) is the module of plugin {same!r} "
                f"already: a plugin loads once; add {name!r} to plugins.disabled"
            )
        pm.register(plugin, name=name)
        pm.distributions[name] = distribution


def _plugins_own(call: Callable[[], T], what: str, name: str) -> T:
    """``call()``, plugin ``name``'s code at start-up: whatever it raises stops start-up with a
    :class:`ConfigError` (``what`` failed, why, and the way out), but the operator's Ctrl-C,
    which stops it as any Ctrl-C does."""
    with _ctrl_c_told_apart() as ctrl_c:
        try:
            return call()
        except _PLUGIN_ABORTS as exc:
            if ctrl_c:
                raise KeyboardInterrupt from exc
            raise ConfigError(f"{what}: {describe_exception(exc)}; fix it or add {name!r} to plugins.disabled") from exc


def _listed(function: Callable[..., object], item_type: type[T]) -> list[T]:
    """What a hook returns, as a list (a generator's errors raised while listing), checked:
    a list of ``item_type``, never a str taken for its characters. A wrong value is named by
    its type only (it may be long, or hold a secret)."""
    returned = function()
    wanted = f"where a list of {item_type.__name__} is expected"
    if isinstance(returned, str | bytes) or not isinstance(returned, Iterable):
        raise TypeError(f"it returned a value of type {type(returned).__name__}, {wanted}")
    items = list(returned)
    for position, item in enumerate(items):
        if not isinstance(item, item_type):
            raise TypeError(f"item {position} of what it returned is of type {type(item).__name__}, {wanted}")
    return items


@contextmanager
def _ctrl_c_told_apart() -> Iterator[list[int]]:
    """While the block runs, a SIGINT (the operator's Ctrl-C) is recorded in the list yielded,
    then raises ``KeyboardInterrupt`` as Python's own handler does: a plugin importing when it
    comes is not to blame, while one raising ``KeyboardInterrupt`` itself is. Only where that
    handler is in place (the main thread, no event loop's handler instead: ``asyncio``'s turns
    Ctrl-C into a cancellation, which no plugin's import catches)."""
    received: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield received
        return

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, record)
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _canonical(distribution: str) -> str:
    """A distribution's name as packaging compares them (``Room_Outbox`` is ``room-outbox``)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()
