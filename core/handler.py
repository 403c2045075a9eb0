"""What a handler plugin implements and what the consumer hands it.

A handler is registered like a sink (``room_outbox_register_handlers`` returns
:class:`HandlerSpec` s) and shaped like one: ``handle`` does the work, ``aclose`` releases
what the handler owns. Its database writes go through the transaction the consumer gives it
(:meth:`HandleContext.transaction`), in which the consumer also records the event as processed
by this handler: both commit together or roll back together, so a message delivered again is
not handled again. Side effects outside that transaction (an HTTP call) are at-least-once.
:class:`PermanentHandlerError` makes the message a dead letter at once; anything else
(including :class:`RetryableHandlerError`) schedules a retry with backoff. A handler that
declares the columns it writes (:class:`HandlerTable`) has its tables checked by ``migrate``
and at start, and its rows checked before they are written.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, overload, runtime_checkable

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


#: The kinds of column a handler declares: text, and integers of 4 and 8 bytes.
ColumnType = Literal["text", "int", "bigint"]

#: The collation of MySQL/MariaDB text compared exactly, as PostgreSQL and SQLite compare all
#: text: byte for byte, so that ids differing only in letter case or accents are two ids (the
#: default collations take them for one). It still ignores trailing spaces, as every collation
#: MySQL and MariaDB share does.
EXACT_COLLATION = "utf8mb4_bin"

#: The range of each integer type.
_INTEGER_RANGES = {"int": range(-(1 << 31), 1 << 31), "bigint": range(-(1 << 63), 1 << 63)}


@dataclass(frozen=True)
class HandlerColumn:
    """A column a handler writes (:class:`HandlerTable`)."""

    type: ColumnType
    #: Text: the characters a value may have (its ``VARCHAR(n)``); None: any, a document such as
    #: the envelope (LONGTEXT on MySQL, whose TEXT holds 64 KB only; TEXT on PostgreSQL).
    length: int | None = None
    #: Whether the handler writes NULL there.
    nullable: bool = False
    #: Text that identifies what the handler keeps (an event's ``event_id`` and ``app_code``, in
    #: a unique key): compared exactly (:data:`EXACT_COLLATION` on MySQL/MariaDB), so that two
    #: events whose ids differ only in letter case are two rows, never one taken for the other.
    exact: bool = False
    #: Text, as found in the table at start: the bytes it holds where the server counts bytes
    #: (MySQL's TEXT types); None: no such bound. The check at start sets it, never the handler.
    max_bytes: int | None = None

    def declaration(self, dialect: str) -> str:
        """Its type and nullability in a CREATE TABLE (or ADD COLUMN) of ``dialect``."""
        if self.type != "text":
            sql = self.type.upper()
        elif self.length is not None:
            sql = f"VARCHAR({self.length})"
            if self.exact and dialect == "mysql":
                sql += f" CHARACTER SET utf8mb4 COLLATE {EXACT_COLLATION}"
        else:
            sql = "LONGTEXT" if dialect == "mysql" else "TEXT"
        return f"{sql:<12} {'NULL' if self.nullable else 'NOT NULL'}"


@dataclass(frozen=True)
class HandlerTable:
    """A table a handler writes and the columns it writes there, given in
    :attr:`HandlerSpec.tables`. A ``CREATE TABLE IF NOT EXISTS`` keeps a table made beforehand
    as it is, so ``migrate`` and ``consume`` (at start) check the table found against these
    columns and refuse one that cannot hold what the handler writes, naming the column and the
    fix; ``consume`` then hands the handler the table as found
    (:meth:`HandlerFactoryContext.table`).

    :meth:`row` refuses a value its column cannot hold as a :class:`PermanentHandlerError`
    naming the column: a retry cannot make it fit, PostgreSQL's own error names no column, and
    MySQL outside strict mode would cut the value short."""

    name: str
    columns: Mapping[str, HandlerColumn]
    #: Columns found narrower than the handler asks where the check only warns (a document
    #: column that MySQL widens only by copying the table): the statement that widens each.
    widen: Mapping[str, str] = field(default_factory=dict)

    def definitions(self, dialect: str) -> str:
        """The columns' lines of a CREATE TABLE of ``dialect`` (no trailing comma)."""
        width = max(map(len, self.columns)) + 1
        return ",\n".join(f"  {name:<{width}}{column.declaration(dialect)}" for name, column in self.columns.items())

    @property
    def insert_columns(self) -> str:
        """The column list of an INSERT of :meth:`row`'s values: ``a, b, c``."""
        return ", ".join(self.columns)

    def row(self, values: Mapping[str, object], dialect: str) -> tuple[object, ...]:
        """``values`` (by column) in the columns' order, or :class:`PermanentHandlerError` for
        the first that its column cannot hold (``dialect``: the transaction's)."""
        for name, column in self.columns.items():
            refused = _refusal(f"{self.name}.{name}", column, values[name], dialect)
            if refused:
                fix = f": run {self.widen[name]}" if name in self.widen else ""
                raise PermanentHandlerError(f"{name} {refused}{fix}")
        return tuple(values[name] for name in self.columns)


def _refusal(where: str, column: HandlerColumn, value: object, dialect: str) -> str:
    """Why the column ``where`` (``table.column``) cannot hold ``value``, or ``""``."""
    if isinstance(value, str):
        if column.length is not None and len(value) > column.length:
            return f"is {len(value)} characters; {where} holds {column.length}"
        if column.max_bytes is not None:
            size = len(value.encode("utf-8", "surrogatepass"))
            if size > column.max_bytes:
                return f"is {size} bytes; {where} holds {column.max_bytes}"
        if dialect == "postgresql" and "\x00" in value:
            return f"holds a NUL character, which PostgreSQL cannot store in {where}"
    elif isinstance(value, int) and column.type in _INTEGER_RANGES and value not in _INTEGER_RANGES[column.type]:
        return f"is {value}, out of the range of {where} ({column.type.upper()})"
    return ""


@dataclass(frozen=True)
class HandlerFactoryContext:
    """What the consumer hands a handler factory besides its settings."""

    consumer: str
    node_id: str
    logger: logging.Logger
    #: Register a secret so the core redacts it wherever it might leak.
    add_secret: Callable[[str], None] = field(default=lambda _secret: None)
    #: The handler's tables as ``consume`` found them at start, by name (:meth:`table`).
    tables: Mapping[str, HandlerTable] = field(default_factory=dict)

    def table(self, declared: HandlerTable) -> HandlerTable:
        """``declared`` as found at start: its text columns hold what the table's do (a wider
        column takes longer values; a narrower document column is refused beyond its size,
        the fix named). Not checked (a test's factory call): ``declared`` itself."""
        return self.tables.get(declared.name, declared)


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

    ``tables``: the tables it writes and their columns (:class:`HandlerTable`), which
    ``migrate`` and ``consume`` check the tables found against before anything is written.
    """

    name: str
    factory: Callable[[SettingsT, HandlerFactoryContext], Handler]
    event_types: frozenset[str] | None
    settings_model: type[SettingsT]
    schema: Mapping[str, Sequence[str]]
    tables: Sequence[HandlerTable]

    # Without settings_model, the factory must take HandlerSettings (what it will get)...
    @overload
    def __init__(
        self: HandlerSpec[HandlerSettings],
        name: str,
        factory: Callable[[HandlerSettings, HandlerFactoryContext], Handler],
        *,
        event_types: frozenset[str] | None = None,
        schema: Mapping[str, Sequence[str]] | None = None,
        tables: Sequence[HandlerTable] = (),
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
        tables: Sequence[HandlerTable] = (),
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
        tables: Sequence[HandlerTable] = (),
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
        tables: Sequence[HandlerTable] = (),
    ) -> None: ...

    def __init__(
        self,
        name: str,
        factory: Any,
        *former: Any,
        event_types: frozenset[str] | None = None,
        settings_model: Any = HandlerSettings,
        schema: Mapping[str, Sequence[str]] | None = None,
        tables: Sequence[HandlerTable] = (),
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
        object.__setattr__(self, "tables", tuple(tables))
