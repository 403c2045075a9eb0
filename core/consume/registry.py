"""Handlers from the plugins: which are registered, and building a consumer's handlers."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pluggy
from pydantic import ValidationError

from room_outbox.cluster.identity import process_identity
from room_outbox.config import ConfigError, Settings, describe_validation_error
from room_outbox.consume.settings import ConsumerSettings, consumer_settings
from room_outbox.envelope import KNOWN_EVENT_TYPES
from room_outbox.errors import exception_message
from room_outbox.handler import Handler, HandlerFactoryContext, HandlerSpec, HandlerTable
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import specs_by_name


@dataclass(frozen=True)
class BoundHandler:
    spec: HandlerSpec[Any]
    handler: Handler

    @property
    def name(self) -> str:
        return self.spec.name

    def takes(self, event_type: str) -> bool:
        if self.spec.event_types is None:
            return event_type in KNOWN_EVENT_TYPES
        return event_type in self.spec.event_types


def registered_handlers(pm: pluggy.PluginManager) -> dict[str, HandlerSpec[Any]]:
    return specs_by_name(pm, pm.hook.room_outbox_register_handlers, "handler", HandlerSpec)


#: What ``consume`` and ``check-config --for consume`` say when no consumer is enabled.
NO_CONSUMER = "consumers: no enabled consumer configured (consumers.<name> with enabled: true)"

#: A consumer's retry leases are owned by ``<identity>#<consumer>``, in a VARCHAR(128) column.
MAX_OWNER = 128


def check_consumers(pm: pluggy.PluginManager, settings: Settings, only: str | None = None) -> list[str]:
    """Validate every enabled consumer (``only``: that one) short of connecting
    (``check-config``, and ``consume`` before it waits for the database): its section, its
    handlers and their settings, its TLS files. Returns the consumers' names; one
    :class:`ConfigError` names every problem."""
    consumers = consumer_settings(settings, only)
    specs = registered_handlers(pm)
    problems: list[str] = []
    for name, consumer in consumers.items():
        where = f"consumers.{name}"
        owner = f"{process_identity(settings.node_id)}#{name}"
        if len(owner) > MAX_OWNER:
            problems.append(
                f"{where}: its lock owner <node_id>~<token>#<consumer> would be {len(owner)} characters,"
                f" at most {MAX_OWNER}: shorten the consumer's name or node_id"
            )
        for handler in consumer.handlers:
            if handler not in specs:
                problems.append(_not_registered(pm, where, [handler], specs))
                continue
            try:
                specs[handler].settings_model.model_validate(consumer.handler_settings.get(handler, {}))
            except ValidationError as exc:
                problems.extend(describe_validation_error(exc, f"{where}.handler_settings.{handler}").splitlines()[1:])
        for extra in sorted(set(consumer.handler_settings) - set(consumer.handlers)):
            problems.append(f"{where}.handler_settings: {extra} not in {where}.handlers")
        try:
            consumer.security.ssl_context()
        except ValueError as exc:
            problems.append(f"{where}.security.{exc}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(p.strip() for p in problems))
    return sorted(consumers)


def _not_registered(pm: pluggy.PluginManager, where: str, names: list[str], specs: dict[str, Any]) -> str:
    """The problem of handlers no plugin registers: those named after a plugin listed in
    ``plugins.disabled`` as such, the others as unknown."""
    blocked = [name for name in names if pm.is_blocked(name)]
    unknown = [name for name in names if name not in blocked]
    parts = [f"{', '.join(blocked)}: listed in plugins.disabled"] if blocked else []
    if unknown:
        known = ", ".join(sorted(specs)) or "none installed"
        disabled = sorted(name for name, plugin in pm.list_name_plugin() if plugin is None)
        also = f"; not loaded, in plugins.disabled: {', '.join(disabled)}" if disabled else ""
        parts.append(f"unknown handler(s) {', '.join(unknown)} (registered: {known}{also})")
    return f"{where}.handlers: " + "; ".join(parts)


def build_handlers(
    pm: pluggy.PluginManager,
    consumer: str,
    settings: ConsumerSettings,
    node_id: str,
    redactor: Redactor,
    tables: Mapping[str, HandlerTable] | None = None,
) -> dict[str, BoundHandler]:
    """The consumer's handlers, each built from its validated settings and given its tables as
    found at start (``tables``, by name); ConfigError names ``consumers.<name>.handlers`` or
    ``….handler_settings.<handler>.<key>``."""
    specs = registered_handlers(pm)
    where = f"consumers.{consumer}"
    unknown = [name for name in settings.handlers if name not in specs]
    if unknown:
        raise ConfigError(_not_registered(pm, where, unknown, specs))
    extra = sorted(set(settings.handler_settings) - set(settings.handlers))
    if extra:
        raise ConfigError(f"{where}.handler_settings: {', '.join(extra)} not in {where}.handlers")
    if len(set(settings.handlers)) != len(settings.handlers):
        raise ConfigError(f"{where}.handlers: a handler is named twice")
    bound: dict[str, BoundHandler] = {}
    for name in settings.handlers:
        spec = specs[name]
        try:
            handler_settings = spec.settings_model.model_validate(settings.handler_settings.get(name, {}))
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, f"{where}.handler_settings.{name}")) from None
        context = HandlerFactoryContext(
            consumer=consumer, node_id=node_id, logger=logging.getLogger(f"room_outbox.handler.{name}"),
            add_secret=redactor.add, tables=tables or {},
        )  # fmt: skip
        try:
            handler = spec.factory(handler_settings, context)
        except Exception as exc:
            raise ConfigError(
                redactor.redact(f"{where}: handler {name!r} failed to start: {exception_message(exc)}")
            ) from None
        bound[name] = BoundHandler(spec, handler)
    return bound
