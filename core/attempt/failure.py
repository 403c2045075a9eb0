"""Why an attempt failed, in one vocabulary, and the error text recorded for it.

The error class labels metrics (``error_class``) and spans (``error.type``); its values are
part of the metric contract, so they never change. Error texts are redacted before they are
cut at ``LAST_ERROR_MAX`` (the ``last_error`` column's size): a secret cut in two would no
longer be recognised.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from room_outbox.errors import describe_exception
from room_outbox.observability.redaction import Redactor, redact_and_shorten
from room_outbox.store.backends.errors import privilege_fix
from room_outbox.store.schema.columns import LAST_ERROR_MAX


class ErrorClass(enum.StrEnum):
    #: Found before any sink is called: the event itself is unusable.
    BAD_ENVELOPE = "bad_envelope"
    NO_ROUTE = "no_route"
    #: Raised by a sink (or its deadline).
    TIMEOUT = "timeout"
    PERMANENT = "permanent"
    RETRYABLE = "retryable"
    SINK_BUG = "sink_bug"
    #: The sink's own rate limit held the delivery back: it was no attempt at all.
    THROTTLED = "throttled"

    @property
    def permanent(self) -> bool:
        """Retrying cannot fix it."""
        return self in _PERMANENT


_PERMANENT = frozenset({ErrorClass.BAD_ENVELOPE, ErrorClass.NO_ROUTE, ErrorClass.PERMANENT})


@dataclass(frozen=True)
class Failure:
    """Why one attempt failed. ``error``: redacted and shortened; ``retry_after`` (throttled
    only): seconds until the limit may have room, ``None``: unknown; ``refused`` (throttled
    only): the destination refused it for its rate, rather than a limit of this process."""

    sink: str
    error_class: ErrorClass
    error: str
    permanent: bool = False
    retry_after: float | None = None
    refused: bool = False

    @property
    def throttled(self) -> bool:
        return self.error_class == ErrorClass.THROTTLED


def error_text(redactor: Redactor, text: str) -> str:
    """``text`` as recorded: secrets masked, then cut to ``LAST_ERROR_MAX`` characters."""
    return redact_and_shorten(redactor, text, LAST_ERROR_MAX)


def describe(exc: BaseException) -> str:
    """``"TypeName: message"``, or the type's name alone when the message is empty. A task
    group's exception group is described by what it holds (its first exception, and how many
    more), as its own text only says that a task failed; a :class:`PluginBaseException` by
    what the plugin raised."""
    if isinstance(exc, PluginBaseException):
        return describe(exc.raised)
    if isinstance(exc, BaseExceptionGroup):
        inner = exc.exceptions
        more = f" (and {len(inner) - 1} more)" if len(inner) > 1 else ""
        return describe(inner[0]) + more
    return describe_exception(exc)  # a plugin's exception whose message cannot be read included


def describe_round_failure(exc: BaseException) -> str:
    """:func:`describe`, and for a statement the database refused for a privilege its user
    lacks, what to grant (:func:`~room_outbox.store.backends.errors.privilege_fix`): a
    recurring round (a claim, a heartbeat) fails alike until someone does."""
    first = exc
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    fix = privilege_fix(first)
    return f"{describe(exc)}; {fix}" if fix else describe(exc)


class PluginBaseException(Exception):
    """A plugin's call raised a :class:`BaseException` that is no :class:`Exception`
    (``KeyboardInterrupt``, ``SystemExit``, its own ``CancelledError``...): a bug in the
    plugin, recorded as a failure of that call like any other. ``raised``: what it raised."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(describe(raised))
        self.raised = raised


def plugins_own(exc: BaseException, caller: asyncio.Task[Any] | None) -> PluginBaseException | None:
    """``exc``, raised by a call into a plugin (a sink's delivery, a handler's handling) that
    task ``caller`` made, and no :class:`Exception`, as the plugin's failure; None when it
    must go on.

    Left alone, such an exception would end far more than the call: asyncio lets
    ``KeyboardInterrupt`` and ``SystemExit`` out of the event loop (the whole process
    stops, every lane with it), and a ``CancelledError`` unwinds the task as if it were being
    stopped. room-outbox handles signals itself, so they can only come from the plugin. A
    cancellation of the task is real when something asked for it (``Task.cancelling()``,
    which anyio's cancel scopes and deadlines raise too) and then goes on; a plugin's own
    ``CancelledError``, with nobody cancelling, is the plugin's bug. A ``GeneratorExit``
    goes on when it closes the call's coroutine (``close()``): that is done by whoever holds
    the coroutine (another task, the garbage collector finalising an abandoned task's, the
    event loop's own code), never by the task running it; one raised while ``caller`` runs
    the call is the plugin's bug."""
    if isinstance(exc, Exception):
        return None
    if isinstance(exc, GeneratorExit):
        if caller is None or asyncio.current_task() is not caller:
            return None
    elif isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is None or task.cancelling():
            return None
    return PluginBaseException(exc)


@contextmanager
def plugin_call() -> Iterator[None]:
    """Around a call into a plugin: what it raises that is its own failure (:func:`plugins_own`)
    leaves as a :class:`PluginBaseException`, an :class:`Exception`."""
    caller = asyncio.current_task()
    try:
        yield
    except BaseException as exc:
        own = plugins_own(exc, caller)
        if own is None:
            raise
        raise own from exc
