"""From registered sinks and their configuration to a routing table: event type → sink.

Each event type of the IM lane goes to exactly one enabled sink. A sink lists the types it
takes (``event_types``) or, at most one per lane, takes every *known* type nobody else
listed. An event type no enabled sink takes has no route: the dispatcher leaves such an event
pending with ``last_error`` "no sink for event_type X", so nothing is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pluggy
from pydantic import ValidationError

from room_outbox.config import ConfigError, Settings, describe_validation_error
from room_outbox.envelope import KNOWN_EVENT_TYPES
from room_outbox.redaction import Redactor
from room_outbox.sink import Sink, SinkContext, SinkSettings, SinkSpec

log = logging.getLogger("room_outbox.routing")


@dataclass
class Router:
    sinks: dict[str, Sink]
    routes: dict[str, str]  # event type → sink name

    def sink_for(self, event_type: str) -> tuple[str, Sink] | None:
        name = self.routes.get(event_type)
        return (name, self.sinks[name]) if name is not None else None

    async def aclose(self) -> None:
        for name, sink in self.sinks.items():
            try:
                await sink.aclose()
            except Exception:
                log.exception("sink %s failed to close", name, extra={"sink": name})


def registered_sinks(pm: pluggy.PluginManager) -> dict[str, SinkSpec]:
    specs: dict[str, SinkSpec] = {}
    for plugin_specs in pm.hook.room_outbox_register_sinks():
        for spec in plugin_specs:
            if spec.name in specs:
                raise ConfigError(f"two plugins register a sink named {spec.name!r}")
            specs[spec.name] = spec
    return specs


def enabled_sink_settings(pm: pluggy.PluginManager, settings: Settings) -> dict[str, tuple[SinkSpec, SinkSettings]]:
    """Validate every enabled sink's section; raise one :class:`ConfigError` naming each bad key."""
    specs = registered_sinks(pm)
    problems: list[str] = []
    for name, configured in settings.sinks.items():
        if name in specs or configured.get("enabled") is False:
            continue
        if pm.is_blocked(name):
            problems.append(f"sinks.{name}: is enabled, but plugin {name!r} is listed in plugins.disabled")
        else:
            available = ", ".join(sorted(specs)) or "none"
            problems.append(
                f"sinks.{name}: no installed plugin provides a sink named {name!r} (available: {available})"
            )
    enabled: dict[str, tuple[SinkSpec, SinkSettings]] = {}
    for name, spec in specs.items():
        raw: Mapping[str, Any] | None = settings.sinks.get(name)
        # No section: the sink's own default; a section: enabled unless it says otherwise.
        if not (spec.enabled_by_default if raw is None else raw.get("enabled", True)):
            continue
        try:
            enabled[name] = (spec, spec.settings_model.model_validate({"enabled": True, **(raw or {})}))
        except ValidationError as exc:
            problems.extend(describe_validation_error(exc, prefix=f"sinks.{name}").splitlines()[1:])
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(p.strip() for p in problems))
    return enabled


async def build_router(pm: pluggy.PluginManager, settings: Settings, redactor: Redactor) -> Router:
    enabled = enabled_sink_settings(pm, settings)
    routes: dict[str, str] = {}
    default_sinks = [name for name, (_, cfg) in enabled.items() if cfg.event_types is None]
    if len(default_sinks) > 1:
        raise ConfigError(
            f"sinks {', '.join(sorted(default_sinks))} all take the remaining event types; "
            "give all but one of them an explicit event_types list"
        )
    for name, (_, cfg) in enabled.items():
        for event_type in cfg.event_types or ():
            if event_type in routes:
                raise ConfigError(
                    f"sinks.{name}.event_types: {event_type} is already taken by sink {routes[event_type]!r}; "
                    "an event type goes to exactly one sink"
                )
            routes[event_type] = name
    for name in default_sinks:
        for event_type in KNOWN_EVENT_TYPES - routes.keys():
            routes[event_type] = name

    sinks: dict[str, Sink] = {}
    for name, (spec, cfg) in enabled.items():
        context = SinkContext(
            node_id=settings.node_id, logger=logging.getLogger(f"room_outbox.sink.{name}"), add_secret=redactor.add
        )
        try:
            sinks[name] = spec.factory(cfg, context)
        except Exception as exc:
            await Router(sinks, {}).aclose()  # the caller never sees a half-built router
            raise ConfigError(f"sinks.{name}: could not be created: {redactor.redact(str(exc))}") from exc
    return Router(sinks=sinks, routes=routes)
