"""Deadlines on database calls, the same rule for every store.

Client side: a store call (taking a connection, its statements, the commit) ends within
``query_timeout`` or fails with :class:`QueryTimeout`, and its connection is thrown away,
never handed back (:class:`TimeoutWatch`). Server side: a client that vanished cannot roll
back its transaction, so every session carries limits derived from ``query_timeout`` that end
it, its locks freed, once its client is gone (:class:`SessionLimits`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import anyio

from room_outbox.config import DEFAULT_QUERY_TIMEOUT
from room_outbox.errors import StoreError

__all__ = [
    "DEFAULT_QUERY_TIMEOUT",
    "LONGER_QUERY_TIMEOUT",
    "SCHEMA_CHANGE_TIMEOUT",
    "QueryTimeout",
    "SessionLimits",
    "TimeoutWatch",
    "database_deadline_paused",
    "query_deadline",
]

#: Client-side bound on ``migrate``'s transaction: adding a column or an index to a large
#: table may take long. Its lock waits stay bounded by the session's limits.
SCHEMA_CHANGE_TIMEOUT = 3600.0

#: How an operator command gets a longer database.query_timeout, for a message's advice. A
#: query_timeout must stay below a third of the lease, which is raised with it where needed.
LONGER_QUERY_TIMEOUT = (
    "such as ROOM_OUTBOX__DATABASE__QUERY_TIMEOUT=30s (below a third of outbox_worker.lease: raise it too"
    " for the command, such as ROOM_OUTBOX__OUTBOX_WORKER__LEASE=120s)"
)


class QueryTimeout(StoreError, TimeoutError):
    """A database call did not end within ``query_timeout``; its connection was discarded.
    ``message``: what is known of the cause, where the caller found out more (by default,
    only that nothing came back in time: a server gone or a statement still running)."""

    def __init__(self, seconds: float, message: str = "") -> None:
        super().__init__(
            message or f"the database did not answer within database.query_timeout {seconds:g}s; connection discarded"
        )
        self.seconds = seconds


@contextmanager
def query_deadline(seconds: float) -> Iterator[None]:
    """Cancel the block after ``seconds`` and raise :class:`QueryTimeout` instead.

    The block's own clean-up (closing its connection) runs before the error is raised; a
    ``TimeoutError`` of the block's own making passes through unchanged."""
    with anyio.move_on_after(seconds) as scope:
        token = _deadline.set(scope)
        try:
            yield
        finally:
            _deadline.reset(token)
    if scope.cancelled_caught:
        raise QueryTimeout(seconds)


#: The deadline of the database call the running task is in (None: none).
_deadline: ContextVar[anyio.CancelScope | None] = ContextVar("database_deadline", default=None)


@contextmanager
def database_deadline_paused() -> Iterator[None]:
    """Inside a database call (a transaction), a stretch where it waits for something else
    under a deadline of its own (a tailing round's publish, ``publish_timeout``): the call's
    ``query_timeout`` stops meanwhile and runs on afterwards with what was left of it. So a
    slow broker is never reported as the database's timeout, and the database's own work
    still gets ``query_timeout``. Outside a call (SQLite has none): nothing changes."""
    scope = _deadline.get()
    if scope is None:
        yield
        return
    left = scope.deadline - anyio.current_time()
    scope.deadline = math.inf
    try:
        yield
    finally:
        scope.deadline = anyio.current_time() + left


class TimeoutWatch:
    """A pool's memory of its last timeout: :meth:`call` bounds one call; connections last
    used before a call that timed out began are not to be trusted (:meth:`trusts`).

    The connection a timed-out call was using may have a statement half-sent or its answer
    half-read, and on a half-open network path (nothing answers, nothing closes) it would block
    the next caller for ever. Connections idle since before the call began share the path that
    just failed, and each would cost one more ``query_timeout`` to find dead."""

    def __init__(self) -> None:
        self._distrust_before = float("-inf")

    @contextmanager
    def call(self, seconds: float) -> Iterator[None]:
        """:func:`query_deadline`, remembering when a call that timed out began."""
        started = anyio.current_time()
        try:
            with query_deadline(seconds):
                yield
        except QueryTimeout:
            self._distrust_before = max(self._distrust_before, started)
            raise

    def trusts(self, last_used: float) -> bool:
        """Whether a connection last used at ``last_used`` (event-loop time) may be handed out."""
        return last_used >= self._distrust_before


@dataclass(frozen=True)
class SessionLimits:
    """Server-side bounds on one database session, derived from ``query_timeout``, that each
    store sets when it connects: a session whose client is gone ends (its transaction rolled
    back, its locks freed) within :attr:`idle_seconds`, and a pooled connection idle for
    :attr:`pool_recycle` is replaced before use, so the pool never hands out a connection the
    server is about to close."""

    #: A session idle this long (its client gone, or a transaction left open) is ended by the
    #: server: its transaction rolled back, its locks freed. Three query timeouts: the
    #: client gives up after one, so no live client leaves a session idle that long, in a
    #: transaction or not; plus the time a live client may deliberately keep a transaction
    #: idle between two statements (a consumer's handler runs inside its transaction).
    idle_seconds: int
    #: A statement waits this long for a row or metadata lock, then fails: no longer than
    #: the client would wait for it.
    lock_wait_seconds: int
    #: The server waits this long for the rest of a half-sent request, or for the client to
    #: take a result.
    network_seconds: int
    #: A statement running this long is stopped by the server (locks and all): its client,
    #: which waits one query timeout, is long gone.
    statement_seconds: int

    @classmethod
    def for_query_timeout(cls, query_timeout: float, idle_in_transaction: float = 0.0) -> SessionLimits:
        """``idle_in_transaction``: the longest a live client keeps a transaction idle between
        two statements on purpose (0: never)."""
        per_call = max(1, math.ceil(query_timeout))
        idle = max(3, math.ceil(3 * query_timeout + idle_in_transaction))
        return cls(idle_seconds=idle, lock_wait_seconds=per_call, network_seconds=per_call, statement_seconds=idle)

    @property
    def pool_recycle(self) -> float:
        """Seconds a pooled connection may sit idle before it is replaced: two thirds of the
        server's idle limit, so the server never closes a connection about to be used."""
        return self.idle_seconds * 2 / 3
