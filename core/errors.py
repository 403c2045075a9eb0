"""Every error room-outbox raises on purpose, in one tree::

    RoomOutboxError                 root: the CLI prints its message as one line and exits
    ├── ConfigurationError          bad configuration (exit 2); ``config.ConfigError`` is this class
    ├── BrokerUnavailable           a Kafka broker an operator command asks (exit 3)
    ├── StoreError                  the database (exit 3)
    │   ├── StoreUnavailable        cannot connect, log in, or find the database
    │   ├── SchemaError             connected, but the tables are not migrated
    │   ├── PrivilegeError          connected, but the user may not do what the command does there,
    │   │                           or the server takes no writes
    │   └── QueryTimeout            a statement outlived mysql.query_timeout (also a ``TimeoutError``;
    │                               in :mod:`room_outbox.store.deadline`)
    ├── EnvelopeError               a row's envelope does not parse (also a ``ValueError``)
    ├── SinkError                   raised by a sink on purpose
    │   ├── RetryableSinkError      may go away: the event is tried again
    │   │   └── ThrottledSinkError  not sent: this process's own rate limit held it back
    │   └── PermanentSinkError      retrying will not help
    └── HandlerError                raised by a consumer's handler on purpose
        ├── RetryableHandlerError   may go away: retried with backoff
        └── PermanentHandlerError   retrying will not help: a dead letter at once

Driver errors (PyMySQL, aiomysql, sqlite3) are translated once, at the store's boundary
(:mod:`room_outbox.store.backends.errors`), with the driver's exception kept as ``__cause__``.

A message is one line that names the cause and, where there is one, the fix ("table
room_outbox lacks lock_until_ms: run `room-outbox migrate`"). It never holds a secret: a DSN
password, a key, a signature.
"""

from __future__ import annotations


class RoomOutboxError(Exception):
    """Root of room-outbox's own errors. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigurationError(RoomOutboxError):
    """Configuration that must stop start-up; the message names every offending key."""

    exit_code = 2


class BrokerUnavailable(RoomOutboxError):
    """A Kafka broker a one-off command asks (``consumers describe``) cannot be reached, or
    refuses or does not answer it: an unreachable dependency, exit 3 as for the database."""

    exit_code = 3


class StoreError(RoomOutboxError):
    """The database is unreachable or not usable as it stands."""

    exit_code = 3


class StoreUnavailable(StoreError):
    """Cannot connect to, log in to or open the database. ``transient``: the kind of failure
    that goes away by itself (server down or starting); start-up waits for those."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class SchemaError(StoreError):
    """Connected, but a table or column room-outbox needs is missing: ``room-outbox migrate``."""


class PrivilegeError(StoreError):
    """Connected, but the database user lacks privileges the command needs on tables that are
    there, or the server takes no writes (a standby, a database set read-only): the message
    names what is missing and the fix."""


class EnvelopeError(RoomOutboxError, ValueError):
    """The stored envelope cannot be turned into an event envelope."""


class SinkError(RoomOutboxError):
    """Base of the errors a sink raises deliberately."""


class RetryableSinkError(SinkError):
    """Delivery failed for a reason that may go away: the event is tried again."""


class ThrottledSinkError(RetryableSinkError):
    """Not sent at all: this process's own rate limit (or its share of a deployment-wide one)
    held the delivery back. Not an attempt: the event keeps its retry count, is never parked
    for it, and is claimable again after ``retry_after`` seconds (``None``: at once), when a
    slot may have opened. Raise it only when nothing was delivered for a rate limit: no
    request left the process, or the destination answered that it refused the request for
    its own rate limit. Any other request that may have reached the destination is an attempt
    (:class:`RetryableSinkError`).

    ``refused``: the destination answered that it refused it (rather than a limit of this
    process holding it back). Still no attempt, but the row's ``last_error`` records the
    message: an event the destination keeps refusing must show why it is still pending."""

    def __init__(self, message: str, retry_after: float | None = None, *, refused: bool = False) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.refused = refused


class PermanentSinkError(SinkError):
    """Delivery can never succeed as the event stands (bad target, message too large...)."""


class HandlerError(RoomOutboxError):
    """Base of the errors a consumer's handler raises deliberately."""


class RetryableHandlerError(HandlerError):
    """Handling failed for a reason that may go away: retried with backoff."""


class PermanentHandlerError(HandlerError):
    """Handling can never succeed for this message: it becomes a dead letter at once."""


def exception_message(exc: BaseException) -> str:
    """``str(exc)``, or, where that raises (a plugin's exception whose ``__str__`` fails), its
    type's name and why its message could not be read. Turning a failure into text must never
    fail in turn: the failure would go unrecorded (no attempt counted, no error kept, the event
    delivered again for ever) and the error raised instead would name neither the plugin nor
    the event."""
    text = _read(exc)
    return text if isinstance(text, str) else _unreadable(exc, text)


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"``, the type's name alone when the message is empty, or its name
    and why its message could not be read (:func:`exception_message`). The text is read once:
    an exception may make it at a cost, or differently each time."""
    text = _read(exc)
    if not isinstance(text, str):
        return _unreadable(exc, text)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _read(exc: BaseException) -> str | Exception:
    """``str(exc)``, or what it raised."""
    try:
        return str(exc)
    except Exception as failed:
        return failed


def _unreadable(exc: BaseException, failed: Exception) -> str:
    why = _read(failed)
    reason = f"{type(failed).__name__}: {why}" if isinstance(why, str) and why else type(failed).__name__
    return f"{type(exc).__name__} (its message could not be read: {reason})"
