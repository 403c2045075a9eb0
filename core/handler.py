"""What a handler plugin implements and what the consumer hands it.

A handler is registered like a sink (``room_outbox_register_handlers`` returns
:class:`HandlerSpec` s) and shaped like one: ``handle`` does the work, ``aclose`` releases
what the handler owns. Its database writes go through the transaction the consumer gives it
(:meth:`HandleContext.transaction`), in which the consumer also records the event as processed
by this handler: both commit together or roll back together, so a message delivered again is
not handled again. Side effects outside that transaction (an HTTP call) are at-least-once.
:class:`PermanentHandlerError` makes the message a dead letter at once; anything else
(including :class:`RetryableHandlerError`) schedules a retry with backoff.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, overload, runtime_checkable

from pydantic import BaseModel, ConfigDict

from room_outbox.envelope import EventEnvelope

# The handler's errors live in the one error tree; handlers import them from here.
from room_outbox.errors import HandlerError as HandlerError
from room_outbox.errors import PermanentHandlerError as PermanentHandlerError
from room_outbox.errors import RetryableHandlerError as RetryableHandlerError


class Transaction(Protocol):
    """A database transaction, the same surface on every store: ``%s`` placeholders (both
    aiomysql and psycopg use them), results as tuples. ``dialect`` (``mysql`` or
    ``postgresql``) lets a handler pick its upsert syntax."""

    @property
    def dialect(self) -> str: ...

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; returns the number of rows it affected (matched, for UPDATE)."""
        ...

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int: ...

    async def fetchone(self) -> tuple[Any, ...] | None: ...

    async def fetchall(self) -> list[tuple[Any, ...]]: ...


@dataclass(frozen=True)
class ConsumedEvent:
    """One message as a handler sees it."""

    envelope: EventEnvelope
    consumer: str
    topic: str
    partition: int
    offset: int
    key: str
    headers: dict[str, str]
    #: 1 on the first try; more on retries.
    attempt: int = 1
    #: The message value as received (the envelope's JSON).
    value: bytes = b""


class HandleContext:
    """Per handling: the transaction the processed-event record commits in."""

    def __init__(self, tx: Transaction, logger: logging.Logger) -> None:
        self._tx = tx
        self.logger = logger

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """The handling's transaction (the same one however often it is entered). It commits
        after ``handle`` returns, not when this block ends::

            async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
                async with ctx.transaction() as tx:
                    await tx.execute("INSERT INTO my_table (app_code, event_id) VALUES (%s, %s)",
                                     (event.envelope.app_code, event.envelope.event_id))

        The consumer opened it and, inside it, recorded the event as processed by this handler
        (``room_consumer_processed``, keyed by consumer, handler, app_code and event_id): a
        message delivered again (a crash before the offset commit, a rebalance) finds its
        record and is not handled again."""
        yield self._tx


@runtime_checkable
class Handler(Protocol):
    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        """Handle one event; return on success, raise on failure."""

    async def aclose(self) -> None:
        """Release what the handler owns. Called once, at shutdown."""


@runtime_checkable
class BatchHandler(Handler, Protocol):
    """A handler that can also take many events at once (optional: a throughput gain).

    ``handle_batch`` gets events of several rooms, each room's in offset order, none handled
    before, and must have the effect of ``handle`` on each in that order — typically one
    multi-row statement. It runs in the same kind of transaction, with the events' processed
    records. If it raises, nothing of it stays and the consumer calls ``handle`` for each
    event instead, so one bad event costs only itself.
    """

    async def handle_batch(self, events: list[ConsumedEvent], ctx: HandleContext) -> None: ...


class HandlerSettings(BaseModel):
    """Base of a handler's settings (``consumers.<name>.handler_settings.<handler>``)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class HandlerFactoryContext:
    """What the consumer hands a handler factory besides its settings."""

    consumer: str
    node_id: str
    logger: logging.Logger
    #: Register a secret so the core redacts it wherever it might leak.
    add_secret: Callable[[str], None] = field(default=lambda _secret: None)


#: A handler's own settings model: what :attr:`HandlerSpec.factory` receives, already validated.
SettingsT = TypeVar("SettingsT", bound=HandlerSettings)


@dataclass(frozen=True, init=False)
class HandlerSpec(Generic[SettingsT]):
    """A handler as a plugin registers it: a name, a factory and, keyword-only, the event types
    it takes, its settings model and its tables.

    The factory receives an instance of ``settings_model`` (the core validates
    ``consumers.<name>.handler_settings.<handler>`` with it), so
    ``HandlerSpec("stats", make_stats, settings_model=StatsSettings)`` type-checks only when
    ``make_stats`` takes ``StatsSettings``; a factory never needs to check the type. Without
    ``settings_model`` the handler takes no settings (:class:`HandlerSettings`).

    ``event_types``: the types it takes; ``None``: every type of the built-in catalogue
    (:data:`room_outbox.envelope.KNOWN_EVENT_TYPES`). A message whose type no handler of a
    consumer names and that is not in the catalogue is a dead letter (unknown type); a
    catalogued type that no handler takes is skipped.

    ``schema``: per database (``"mysql"``, ``"postgresql"``: the :class:`Transaction`'s
    ``dialect``), the statements that create the handler's tables, each idempotent
    (``CREATE TABLE IF NOT EXISTS …``): ``room-outbox migrate`` runs those of its database
    every time, for each handler an enabled consumer of its configuration lists.
    """

    name: str
    factory: Callable[[SettingsT, HandlerFactoryContext], Handler]
    event_types: frozenset[str] | None
    settings_model: type[SettingsT]
    schema: Mapping[str, Sequence[str]]

    # Without settings_model, the factory must take HandlerSettings (what it will get)...
    @overload
    def __init__(
        self: HandlerSpec[HandlerSettings],
        name: str,
        factory: Callable[[HandlerSettings, HandlerFactoryContext], Handler],
        *,
        event_types: frozenset[str] | None = None,
        schema: Mapping[str, Sequence[str]] | None = None,
    ) -> None: ...

    # ... with it, what settings_model makes.
    @overload
    def __init__(
        self,
        name: str,
        factory: Callable[[SettingsT, HandlerFactoryContext], Handler],
        *,
        event_types: frozenset[str] | None = None,
        settings_model: type[SettingsT],
        schema: Mapping[str, Sequence[str]] | None = None,
    ) -> None: ...

    # Deprecated: event_types as the third positional argument (warns; to be removed).
    @overload
    def __init__(
        self: HandlerSpec[HandlerSettings],
        name: str,
        factory: Callable[[HandlerSettings, HandlerFactoryContext], Handler],
        event_types: frozenset[str] | None,
        /,
        *,
        schema: Mapping[str, Sequence[str]] | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        name: str,
        factory: Callable[[SettingsT, HandlerFactoryContext], Handler],
        event_types: frozenset[str] | None,
        /,
        *,
        settings_model: type[SettingsT],
        schema: Mapping[str, Sequence[str]] | None = None,
    ) -> None: ...

    def __init__(
        self,
        name: str,
        factory: Any,
        *former: Any,
        event_types: frozenset[str] | None = None,
        settings_model: Any = HandlerSettings,
        schema: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        if former:  # the former order: (name, factory, event_types, settings_model, schema)
            warnings.warn(
                "HandlerSpec(name, factory, event_types, ...) is deprecated; "
                "write HandlerSpec(name, factory, event_types=..., ...)",
                DeprecationWarning,
                stacklevel=2,
            )
            keywords: tuple[Any, ...] = (event_types, settings_model, schema)
            event_types, settings_model, schema = (*former, *keywords[len(former) :])
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "factory", factory)
        object.__setattr__(self, "event_types", event_types)
        object.__setattr__(self, "settings_model", settings_model)
        object.__setattr__(self, "schema", {} if schema is None else schema)
