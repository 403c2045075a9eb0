"""The contract every consumer handler keeps, and a harness that runs a handler against
events in memory: no database, no broker.

The harness hands the handler a :class:`MemoryTransaction`, which records the statements the
handler runs instead of running them; a test asserts on those, or on what the handler did
elsewhere. The consumer's guarantees (one processed record per event, committed with the
handler's writes; retries; dead letters) are the consumer's and are tested there, not here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from room_outbox.config import describe_validation_error
from room_outbox.envelope import KNOWN_EVENT_TYPES, EventEnvelope
from room_outbox.handler import (
    ConsumedEvent,
    HandleContext,
    Handler,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
    PermanentHandlerError,
)

#: How long one ``handle`` and ``aclose`` may take in the contract.
HANDLE_TIMEOUT = 10.0


@dataclass
class MemoryTransaction:
    """A :class:`~room_outbox.handler.Transaction` that records statements instead of running
    them. ``rows`` is what the next ``fetchone``/``fetchall`` return."""

    dialect: str = "mysql"
    statements: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    rows: list[tuple[Any, ...]] = field(default_factory=list)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        self.statements.append((sql, tuple(params)))
        return 1

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        for row in rows:
            self.statements.append((sql, tuple(row)))
        return len(rows)

    async def fetchone(self) -> tuple[Any, ...] | None:
        return self.rows.pop(0) if self.rows else None

    async def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self.rows = self.rows, []
        return rows


def handler_spec(plugin: ModuleType, name: str) -> HandlerSpec[Any]:
    """The :class:`HandlerSpec` named ``name`` that ``plugin`` (a module with the hook) registers."""
    specs: dict[str, HandlerSpec[Any]] = {spec.name: spec for spec in plugin.room_outbox_register_handlers()}
    if name not in specs:
        raise LookupError(
            f"{plugin.__name__} registers no handler {name!r} (it registers: {', '.join(specs) or 'none'})"
        )
    return specs[name]


def make_handler(plugin: ModuleType, name: str, settings: Mapping[str, Any] | None = None) -> Handler:
    """The handler as the consumer builds it, ``settings`` (its ``handler_settings`` section)
    validated by its model."""
    spec = handler_spec(plugin, name)
    validated = spec.settings_model.model_validate(dict(settings or {}))
    context = HandlerFactoryContext("testing", "testing", logging.getLogger(f"room_outbox.handler.{name}"))
    return spec.factory(validated, context)


def consumed(envelope: EventEnvelope | Mapping[str, Any], offset: int = 0, attempt: int = 1) -> ConsumedEvent:
    """``envelope`` as the consumer hands it over (a mapping is validated as an envelope)."""
    event = envelope if isinstance(envelope, EventEnvelope) else EventEnvelope.model_validate(envelope)
    value = event.model_dump_json().encode()
    return ConsumedEvent(event, "testing", "room-events", 0, offset, event.room_id, {}, attempt, value)


@dataclass(frozen=True)
class HandleOutcome:
    """What one ``handle`` did: the statements it ran, and the error it raised, if any."""

    event_id: str
    statements: list[tuple[str, tuple[Any, ...]]]
    error: Exception | None

    @property
    def handled(self) -> bool:
        return self.error is None

    @property
    def dead_letter(self) -> bool:
        """The consumer makes it a dead letter at once; any other error is retried."""
        return isinstance(self.error, PermanentHandlerError)


async def handle_events(
    handler: Handler, events: Iterable[EventEnvelope | Mapping[str, Any]], dialect: str = "mysql"
) -> list[HandleOutcome]:
    """Hand each event to ``handler`` in turn, each in a transaction of its own, and say what
    each did."""
    outcomes = []
    for offset, item in enumerate(events):
        event = consumed(item, offset)
        tx = MemoryTransaction(dialect)
        try:
            with anyio.fail_after(HANDLE_TIMEOUT):
                await handler.handle(event, HandleContext(tx, logging.getLogger("room_outbox.handler")))
        except Exception as exc:  # what the consumer would classify: see HandleOutcome
            outcomes.append(HandleOutcome(event.envelope.event_id, tx.statements, exc))
        else:
            outcomes.append(HandleOutcome(event.envelope.event_id, tx.statements, None))
    return outcomes


@dataclass
class HandlerCase:
    """A handler's settings and events it must handle."""

    #: ``handler_settings.<name>`` for a handler that works ({} for one without settings).
    settings: dict[str, Any]
    #: Envelopes (or mappings) of types the handler takes: each must be handled without error.
    events: list[EventEnvelope | Mapping[str, Any]]
    #: Bad values of the handler's own keys: (overrides of ``settings``, the key the error names).
    invalid: list[tuple[dict[str, Any], str]] = field(default_factory=list)


class HandlerContract:
    """Subclass as ``TestXHandler`` with ``plugin`` (the module registering the handler),
    ``name`` and a ``case`` fixture returning a :class:`HandlerCase`."""

    pytestmark = pytest.mark.anyio

    plugin: ModuleType
    name: str

    def spec(self) -> HandlerSpec[Any]:
        return handler_spec(self.plugin, self.name)

    async def test_settings_model_takes_the_section(self, case: HandlerCase) -> None:
        assert issubclass(self.spec().settings_model, HandlerSettings)
        self.spec().settings_model.model_validate(case.settings)

    async def test_an_unknown_key_or_a_bad_value_is_named(self, case: HandlerCase) -> None:
        prefix = f"handler_settings.{self.name}"
        for overrides, key in [({"no_such_key": 1}, "no_such_key"), *case.invalid]:
            with pytest.raises(ValidationError) as caught:
                self.spec().settings_model.model_validate({**case.settings, **overrides})
            assert f"{prefix}.{key}" in describe_validation_error(caught.value, prefix=prefix)

    async def test_the_case_events_are_of_types_it_takes(self, case: HandlerCase) -> None:
        taken = self.spec().event_types
        assert taken is None or taken, "event_types: None (every catalogued type) or a non-empty set"
        types = {consumed(item).envelope.event_type for item in case.events}
        assert types <= (KNOWN_EVENT_TYPES if taken is None else taken), "the consumer never hands these over"

    async def test_handles_its_events(self, case: HandlerCase) -> None:
        assert case.events, "give at least one event the handler takes"
        handler = make_handler(self.plugin, self.name, case.settings)
        try:
            outcomes = await handle_events(handler, case.events)
        finally:
            with anyio.fail_after(HANDLE_TIMEOUT):
                await handler.aclose()
        assert [o.error for o in outcomes if not o.handled] == []

    async def test_schema_statements_are_idempotent(self, case: HandlerCase) -> None:
        for dialect, statements in self.spec().schema.items():
            assert dialect in ("mysql", "postgresql"), f"schema: unknown database {dialect!r}"
            for sql in statements:
                assert "IF NOT EXISTS" in sql.upper(), f"schema[{dialect}]: not idempotent: {sql[:80]}"

    async def test_aclose_without_handling(self, case: HandlerCase) -> None:
        handler = make_handler(self.plugin, self.name, case.settings)
        with anyio.fail_after(HANDLE_TIMEOUT):
            await handler.aclose()
