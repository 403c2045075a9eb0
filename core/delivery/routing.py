"""From registered sinks and their configuration to routing tables: event type → sink.

Sinks registered with ``own_lane`` each get a router of their own (:class:`Lanes`), over
their own consumption table: there, events the sink does not take are passed over. The rest
share the main lane, where each event type goes to exactly one enabled sink. A sink lists the
types it takes (``event_types``) or, at most one per lane, is the lane's *default sink*
(``event_types`` left out), which takes every type nobody else listed. With
``routing.main_default: all`` (the default, as V1 sends every type to IM) that includes types
outside the built-in catalogue, so a type room-service adds later is delivered at once;
with ``known`` only catalogued types are, and a new type waits, parked, until it is routed.
An event no enabled sink takes is parked by the dispatcher (``last_error`` "no sink for
event_type X") whatever ``parking`` says: retrying cannot help until the configuration
changes, and a pending row would hold back its room under per-room ordering. Nothing is
lost: ``room-outbox requeue --event-type X --yes`` sends it round again once it has a route.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import pluggy
from pydantic import TypeAdapter, ValidationError

from room_outbox.cluster.quota import QuotaShare
from room_outbox.config import FORMER_MAIN_LANE, MAIN_LANE, ConfigError, Settings, describe_validation_error
from room_outbox.envelope import KNOWN_EVENT_TYPES, event_type_label
from room_outbox.errors import exception_message
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import specs_by_name
from room_outbox.sink import Sink, SinkContext, SinkSettings, SinkSpec
from room_outbox.store.schema.profiles import profile_named

log = logging.getLogger("room_outbox.routing")


@dataclass
class Router:
    """The sinks of one lane and which event type goes to which."""

    sinks: dict[str, Sink]
    routes: dict[str, str]  # event type → sink name
    #: The sink taking every event type not in ``routes``, catalogued or not: a lane of its
    #: own without ``event_types``, or the main lane's default sink under ``routing.main_default: all``.
    catch_all: str | None = None
    #: A lane of its own: an event its sink does not take is done, not an error.
    skip_unrouted: bool = False

    def event_label(self, event_type: str) -> str:
        """The event type as a metric label and span name: ``other`` unless the type is known
        or routed by name here (see :func:`~room_outbox.envelope.event_type_label`)."""
        return event_type_label(event_type, self.routes)

    def unrouted(self) -> list[str]:
        """The catalogued event types no sink of this lane takes (on the main lane, parked)."""
        if self.catch_all is not None:
            return []
        return sorted(KNOWN_EVENT_TYPES - self.routes.keys())

    def sink_for(self, event_type: str) -> tuple[str, Sink] | None:
        name = self.routes.get(event_type, self.catch_all)
        return (name, self.sinks[name]) if name is not None else None

    async def aclose(self) -> None:
        await close_sinks(self.sinks)


@dataclass
class Lanes:
    """The main lane's router (``room_outbox.status``) and one router per sink that keeps a
    lane of its own (``room_outbox_lane_<sink>``)."""

    main: Router
    own: dict[str, Router]
    #: The sinks whose attempts are not timed (their spec's ``timed`` is false).
    untimed: frozenset[str] = frozenset()

    def series(self) -> list[tuple[str, str]]:
        """(sink, event_type) pairs known at start-up: each sink with each catalogued type it
        takes (a sink taking every type is listed with the catalogue)."""
        pairs: set[tuple[str, str]] = set()
        for router in (self.main, *self.own.values()):
            pairs.update((sink, event_type) for event_type, sink in router.routes.items())
            if router.catch_all is not None:
                pairs.update((router.catch_all, t) for t in KNOWN_EVENT_TYPES if t not in router.routes)
        return sorted(pairs)

    async def aclose(self) -> None:
        await close_sinks(
            {name: sink for router in (self.main, *self.own.values()) for name, sink in router.sinks.items()}
        )


#: Seconds the sinks get to close, together, when the process stops.
SINK_CLOSE_TIMEOUT = 0.5


async def close_sinks(sinks: Mapping[str, Sink], timeout: float = SINK_CLOSE_TIMEOUT) -> None:
    """Close ``sinks`` side by side, within ``timeout``. A sink still closing then is logged,
    named, and abandoned: a close may wait on a sink's service (a Kafka producer flushing its
    queued batches to a hung broker, up to its request_timeout), and the process must stop
    within its bound whatever a close does. What it held was never acknowledged: sent again later."""
    closing = set(sinks)

    async def close(name: str, sink: Sink) -> None:
        try:
            await sink.aclose()
        except Exception:
            log.exception("sink %s failed to close", name, extra={"sink": name})
        closing.discard(name)

    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as closes:
            for name, sink in sinks.items():
                closes.start_soon(close, name, sink)
    for name in sorted(closing):
        log.error(
            "sink %s did not close within %gs; abandoned",
            name,
            timeout,
            extra={"sink": name, "lifecycle": "sink_abandoned"},
        )


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
    return specs_by_name(pm, pm.hook.room_outbox_register_sinks, "sink", SinkSpec)


def enabled_sink_settings(
    pm: pluggy.PluginManager, settings: Settings
) -> dict[str, tuple[SinkSpec[Any], SinkSettings]]:
    """Validate every enabled sink's section; raise one :class:`ConfigError` naming each bad key."""
    specs = registered_sinks(pm)
    problems = sink_name_problems(pm, specs, settings)
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


def sink_name_problems(pm: pluggy.PluginManager, specs: Mapping[str, SinkSpec[Any]], settings: Settings) -> list[str]:
    """Enabled sink sections no installed plugin provides (a typo, a plugin disabled), and lane
    overrides naming no lane."""
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
    return problems + lane_override_problems(specs, settings)


def validate_sinks(pm: pluggy.PluginManager, settings: Settings) -> dict[str, tuple[SinkSpec[Any], SinkSettings]]:
    """Every enabled sink's settings and the main lane's routes, checked without creating a sink
    (nothing connects): what :func:`build_lanes` would refuse, refused here first."""
    enabled = enabled_sink_settings(pm, settings)
    _main_routes({name: cfg for name, (spec, cfg) in enabled.items() if not spec.own_lane})
    return enabled


def lane_override_problems(specs: Mapping[str, SinkSpec[Any]], settings: Settings) -> list[str]:
    """``outbox_worker.lanes.<lane>`` must name a lane: ``main`` (or its former name ``im``) or a sink with a lane of its
    own (enabled or not, so an override may stay while its sink is switched off)."""
    problems = []
    own = sorted(name for name, spec in specs.items() if spec.own_lane)
    if MAIN_LANE in own:
        problems.append(
            f"sinks.{MAIN_LANE}: a sink with a lane of its own cannot be named {MAIN_LANE!r} (the main lane's name)"
        )
    for lane in settings.outbox_worker.lanes:
        if lane in (MAIN_LANE, FORMER_MAIN_LANE) or lane in own:
            continue
        if lane in specs:
            problems.append(
                f"outbox_worker.lanes.{lane}: sink {lane!r} shares the main lane; its settings are outbox_worker.lanes.{MAIN_LANE}"
            )
        else:
            problems.append(
                f"outbox_worker.lanes.{lane}: no lane named {lane!r} (lanes: {', '.join([MAIN_LANE, *own])})"
            )
    return problems


async def build_router(pm: pluggy.PluginManager, settings: Settings, redactor: Redactor) -> Router:
    """The main lane's router alone (for the producer side and tests)."""
    return (await build_lanes(pm, settings, redactor, include_own=False)).main


async def build_lanes(
    pm: pluggy.PluginManager,
    settings: Settings,
    redactor: Redactor,
    include_own: bool = True,
    quota: QuotaShare | None = None,
) -> Lanes:
    enabled = enabled_sink_settings(pm, settings)
    main = {name: entry for name, entry in enabled.items() if not entry[0].own_lane}
    own = {name: entry for name, entry in enabled.items() if entry[0].own_lane} if include_own else {}
    routes = _main_routes({name: cfg for name, (_, cfg) in main.items()})
    sinks: dict[str, Sink] = {}
    profile = profile_named(settings.database.profile, settings.database.table)
    for name, (spec, cfg) in {**main, **own}.items():
        context = SinkContext(
            node_id=settings.node_id,
            logger=logging.getLogger(f"room_outbox.sink.{name}"),
            add_secret=redactor.add,
            remove_secret=redactor.discard,
            quota=quota or QuotaShare(),
            room_column=f"{profile.table}.{profile.room_column}",
        )
        try:
            sinks[name] = spec.factory(cfg, context)
        except Exception as exc:
            await Router(sinks, {}).aclose()  # the caller never sees half-built lanes
            raise ConfigError(f"sinks.{name}: could not be created: {redactor.redact(exception_message(exc))}") from exc
    default_sink = next((name for name, (_, cfg) in main.items() if cfg.event_types is None), None)
    return Lanes(
        main=Router(
            {name: sinks[name] for name in main},
            routes,
            catch_all=default_sink if settings.routing.main_default == "all" else None,
        ),
        own={
            name: Router(
                {name: sinks[name]},
                {event_type: name for event_type in cfg.event_types or ()},
                catch_all=name if cfg.event_types is None else None,
                skip_unrouted=True,
            )
            for name, (_, cfg) in own.items()
        },
        untimed=frozenset(name for name, (spec, _) in {**main, **own}.items() if not spec.timed),
    )


def _main_routes(enabled: dict[str, SinkSettings]) -> dict[str, str]:
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
