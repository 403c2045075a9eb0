"""From registered sinks and their configuration to routing tables: event type → sink.

Sinks registered with ``own_lane`` each get a router of their own (:class:`Lanes`), over
their own consumption table: there, events the sink does not take are passed over. The rest
share the IM lane, where each event type goes to exactly one enabled sink. A sink lists the types it
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
from pydantic import TypeAdapter, ValidationError

from room_outbox.config import ConfigError, Settings, describe_validation_error
from room_outbox.envelope import KNOWN_EVENT_TYPES, event_type_label
from room_outbox.redaction import Redactor
from room_outbox.sink import Sink, SinkContext, SinkSettings, SinkSpec

log = logging.getLogger("room_outbox.routing")


@dataclass
class Router:
    """The sinks of one lane and which event type goes to which."""

    sinks: dict[str, Sink]
    routes: dict[str, str]  # event type → sink name
    #: A lane of its own whose sink takes every event, known type or not.
    catch_all: str | None = None
    #: A lane of its own: an event its sink does not take is done, not an error.
    skip_unrouted: bool = False

    def event_label(self, event_type: str) -> str:
        """The event type as a metric label and span name: ``other`` unless the type is known
        or routed by name here (see :func:`~room_outbox.envelope.event_type_label`)."""
        return event_type_label(event_type, self.routes)

    def sink_for(self, event_type: str) -> tuple[str, Sink] | None:
        name = self.routes.get(event_type, self.catch_all)
        return (name, self.sinks[name]) if name is not None else None

    async def aclose(self) -> None:
        for name, sink in self.sinks.items():
            try:
                await sink.aclose()
            except Exception:
                log.exception("sink %s failed to close", name, extra={"sink": name})


@dataclass
class Lanes:
    """The IM lane's router (``room_outbox.status``) and one router per sink that keeps a
    lane of its own (``room_outbox_lane_<sink>``)."""

    im: Router
    own: dict[str, Router]

    async def aclose(self) -> None:
        for router in (self.im, *self.own.values()):
            await router.aclose()


def section_enabled(section: Mapping[str, Any] | None, default: bool) -> bool:
    """``sinks.<name>.enabled`` as configured ("false" from the environment included); no
    section: the sink's default; a section without the key: enabled."""
    if section is None:
        return default
    try:
        return _BOOL.validate_python(section.get("enabled", True))
    except ValidationError:
        return True  # not a boolean: enabled, so that validating the section reports it


_BOOL = TypeAdapter(bool)


def registered_sinks(pm: pluggy.PluginManager) -> dict[str, SinkSpec[Any]]:
    specs: dict[str, SinkSpec[Any]] = {}
    for plugin_specs in pm.hook.room_outbox_register_sinks():
        for spec in plugin_specs:
            if spec.name in specs:
                raise ConfigError(f"two plugins register a sink named {spec.name!r}")
            specs[spec.name] = spec
    return specs


def enabled_sink_settings(
    pm: pluggy.PluginManager, settings: Settings
) -> dict[str, tuple[SinkSpec[Any], SinkSettings]]:
    """Validate every enabled sink's section; raise one :class:`ConfigError` naming each bad key."""
    specs = registered_sinks(pm)
    problems: list[str] = []
    for name, configured in settings.sinks.items():
        if name in specs or not section_enabled(configured, default=True):
            continue
        if pm.is_blocked(name):
            problems.append(f"sinks.{name}: is enabled, but plugin {name!r} is listed in plugins.disabled")
        else:
            available = ", ".join(sorted(specs)) or "none"
            problems.append(
                f"sinks.{name}: no installed plugin provides a sink named {name!r} (available: {available})"
            )
    enabled: dict[str, tuple[SinkSpec[Any], SinkSettings]] = {}
    for name, spec in specs.items():
        raw: Mapping[str, Any] | None = settings.sinks.get(name)
        # No section: the sink's own default; a section: enabled unless it says otherwise.
        if not section_enabled(raw, default=spec.enabled_by_default):
            continue
        try:
            enabled[name] = (spec, spec.settings_model.model_validate({"enabled": True, **(raw or {})}))
        except ValidationError as exc:
            problems.extend(describe_validation_error(exc, prefix=f"sinks.{name}").splitlines()[1:])
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(p.strip() for p in problems))
    return enabled


def validate_sinks(pm: pluggy.PluginManager, settings: Settings) -> dict[str, tuple[SinkSpec[Any], SinkSettings]]:
    """Every enabled sink's settings and the IM lane's routes, checked without creating a sink
    (nothing connects): what :func:`build_lanes` would refuse, refused here first."""
    enabled = enabled_sink_settings(pm, settings)
    _im_routes({name: cfg for name, (spec, cfg) in enabled.items() if not spec.own_lane})
    return enabled


async def build_router(pm: pluggy.PluginManager, settings: Settings, redactor: Redactor) -> Router:
    """The IM lane's router alone (for the producer side and tests)."""
    return (await build_lanes(pm, settings, redactor, include_own=False)).im


async def build_lanes(
    pm: pluggy.PluginManager, settings: Settings, redactor: Redactor, include_own: bool = True
) -> Lanes:
    enabled = enabled_sink_settings(pm, settings)
    im = {name: entry for name, entry in enabled.items() if not entry[0].own_lane}
    own = {name: entry for name, entry in enabled.items() if entry[0].own_lane} if include_own else {}
    routes = _im_routes({name: cfg for name, (_, cfg) in im.items()})
    sinks: dict[str, Sink] = {}
    for name, (spec, cfg) in {**im, **own}.items():
        context = SinkContext(
            node_id=settings.node_id, logger=logging.getLogger(f"room_outbox.sink.{name}"), add_secret=redactor.add
        )
        try:
            sinks[name] = spec.factory(cfg, context)
        except Exception as exc:
            await Router(sinks, {}).aclose()  # the caller never sees half-built lanes
            raise ConfigError(f"sinks.{name}: could not be created: {redactor.redact(str(exc))}") from exc
    return Lanes(
        im=Router({name: sinks[name] for name in im}, routes),
        own={
            name: Router(
                {name: sinks[name]},
                {event_type: name for event_type in cfg.event_types or ()},
                catch_all=name if cfg.event_types is None else None,
                skip_unrouted=True,
            )
            for name, (_, cfg) in own.items()
        },
    )


def _im_routes(enabled: dict[str, SinkSettings]) -> dict[str, str]:
    routes: dict[str, str] = {}
    default_sinks = [name for name, cfg in enabled.items() if cfg.event_types is None]
    if len(default_sinks) > 1:
        raise ConfigError(
            f"sinks {', '.join(sorted(default_sinks))} all take the remaining event types; "
            "give all but one of them an explicit event_types list"
        )
    for name, cfg in enabled.items():
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
    return routes
