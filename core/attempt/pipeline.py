"""One attempt, made the same way by every caller: the dispatcher delivering an event, the
producer pushing it right after its commit, the tailing relay publishing a batch, a consumer
handling a message.

:meth:`Attempts.run` bounds the call by its deadline, lets its :class:`Observer` (the span and
the metrics of that kind of attempt) watch it, turns what it raised into a :class:`Failure` of
one vocabulary (:class:`ErrorClass`, the text redacted, then cut), and reports the outcome to
the observer. The steps run in this order for everyone, so a timeout is classified, worded and
counted alike wherever it happens, and no error text reaches a span or a log unredacted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, TypeVar

import anyio

from room_outbox.attempt.failure import ErrorClass, Failure, PluginBaseException, error_text, plugins_own
from room_outbox.errors import PermanentSinkError, SinkError, ThrottledSinkError, describe_exception, exception_message
from room_outbox.observability.redaction import Redactor

T = TypeVar("T")

#: What an exception other than the deadline's means: its class, its text (unredacted) and,
#: for a throttled call, seconds until the limit may have room.
Explain = Callable[[str, Exception], tuple[ErrorClass, str, float | None]]


class Observer(Protocol):
    """Watches one attempt: its span and its metrics."""

    def current(self, name: str) -> AbstractContextManager[None]:
        """Around the call: the attempt's span is current, so the callee's spans nest."""
        ...

    def finish(self, failure: Failure | None) -> None:
        """The outcome: ``None`` on success."""
        ...


class _Unobserved:
    def current(self, name: str) -> AbstractContextManager[None]:
        return _NULL_CONTEXT

    def finish(self, failure: Failure | None) -> None:
        pass


_NULL_CONTEXT: AbstractContextManager[None] = nullcontext()
#: The observer of an attempt nobody watches.
UNOBSERVED: Observer = _Unobserved()


def explain_sink_error(sink: str, exc: Exception) -> tuple[ErrorClass, str, float | None]:
    """A sink's exception: the sink's own classes, and anything else as a bug in the sink
    (recorded as a failure, never lost)."""
    if isinstance(exc, ThrottledSinkError):  # never sent: not an attempt
        return ErrorClass.THROTTLED, f"{sink}: {exception_message(exc)}", exc.retry_after
    if isinstance(exc, PermanentSinkError):
        return ErrorClass.PERMANENT, f"{sink}: permanent: {exception_message(exc)}", None
    if isinstance(exc, SinkError):
        return ErrorClass.RETRYABLE, f"{sink}: {exception_message(exc)}", None
    raised = exc.raised if isinstance(exc, PluginBaseException) else exc
    return ErrorClass.SINK_BUG, f"{sink}: unexpected {describe_exception(raised)}", None


class Attempts:
    """Attempts of one kind: each call bounded by ``timeout`` seconds (named ``timeout_name``
    in the error text of a timeout), its exceptions explained by ``explain``."""

    __slots__ = ("explain", "rearm_slack", "redactor", "timeout", "timeout_name")

    def __init__(
        self,
        redactor: Redactor,
        timeout: float,
        timeout_name: str = "publish_timeout",
        explain: Explain = explain_sink_error,
    ) -> None:
        self.redactor = redactor
        self.timeout = timeout
        #: How much later than ``timeout`` a call may be cut when it shares a cancel scope
        #: with the calls before it (see :meth:`run`): a twentieth of it, at most 50 ms.
        self.rearm_slack = min(timeout / 20, 0.05)
        self.timeout_name = timeout_name
        self.explain = explain

    async def run(
        self,
        name: str,
        call: Callable[[T], Awaitable[object]],
        arg: T,
        observer: Observer = UNOBSERVED,
        scope: anyio.CancelScope | None = None,
        task: asyncio.Task[Any] | None = None,
    ) -> Failure | None:
        """``await call(arg)`` as attempt ``name`` (a sink's or a handler's); ``None`` on
        success. ``scope``: a cancel scope the caller keeps around many calls and disarms
        (deadline ``inf``) whenever it waits for anything else; a call it cancels ends outside
        this method, where the caller reports it with :meth:`timed_out`.

        The scope's deadline is moved on only when it would come before this call's
        ``timeout``, and then by ``timeout`` and a little more (``rearm_slack``): a call
        is cut between ``timeout`` and ``timeout`` plus that slack after it starts. Setting a
        deadline schedules and cancels a timer; calls that answer at once, one after the
        other, would otherwise pay for two per call.

        ``task``: the task making the call, which a caller making many (a delivery worker)
        looks up once; else it is looked up here (see :func:`plugins_own`)."""
        caller = task or asyncio.current_task()
        failure: Failure | None = None
        try:
            if scope is None:
                with anyio.fail_after(self.timeout), observer.current(name):
                    await call(arg)
            else:
                # The event loop's clock, which the scope's deadline is on: anyio's own
                # look-up of the running backend costs more than the rest of this method.
                # (aiomysql runs on asyncio only, so the process always does.)
                due = asyncio.get_running_loop().time() + self.timeout
                if not due <= scope.deadline <= due + self.rearm_slack:  # too soon, or disarmed
                    scope.deadline = due + self.rearm_slack
                with observer.current(name):
                    await call(arg)
                if scope.cancel_called:  # the deadline passed as the call returned: too late
                    raise TimeoutError
        except Exception as exc:
            failure = self.failure_of(name, exc)
        except BaseException as exc:  # caught here, not by a context manager around every call
            own = plugins_own(exc, caller)
            if own is None:
                raise
            failure = self.failure_of(name, own)
        observer.finish(failure)
        return failure

    def timed_out(self, name: str, observer: Observer = UNOBSERVED) -> Failure:
        """The call of attempt ``name`` overran the caller's scope (see :meth:`run`)."""
        return self.refused(name, ErrorClass.TIMEOUT, self._timeout_text(name), observer)

    def refused(self, name: str, error_class: ErrorClass, text: str, observer: Observer = UNOBSERVED) -> Failure:
        """An attempt that fails before any call: the event itself is unusable."""
        failure = Failure(name, error_class, error_text(self.redactor, text), error_class.permanent)
        observer.finish(failure)
        return failure

    def failure_of(self, name: str, exc: Exception) -> Failure:
        """What ``exc``, raised by the call of attempt ``name``, means."""
        if isinstance(exc, TimeoutError):  # the deadline's, or the callee's own
            error_class, text, retry_after = ErrorClass.TIMEOUT, self._timeout_text(name), None
        else:
            error_class, text, retry_after = self.explain(name, exc)
        refused = isinstance(exc, ThrottledSinkError) and exc.refused
        return Failure(name, error_class, error_text(self.redactor, text), error_class.permanent, retry_after, refused)

    def _timeout_text(self, name: str) -> str:
        return f"{name}: no answer within {self.timeout_name} {self.timeout:g}s"
