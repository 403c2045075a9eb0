"""One attempt as every caller makes it: the deadline, the observer, the failure vocabulary
(classification, redaction, the cut at LAST_ERROR_MAX)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest

from room_outbox.attempt.failure import ErrorClass, Failure, describe, error_text
from room_outbox.attempt.pipeline import Attempts
from room_outbox.errors import PermanentSinkError, RetryableSinkError, ThrottledSinkError
from room_outbox.observability.redaction import Redactor
from room_outbox.store.schema.columns import LAST_ERROR_MAX

SECRET = "s3cr3t-usersig-value"


def _redactor() -> Redactor:
    redactor = Redactor()
    redactor.add(SECRET)
    return redactor


@pytest.mark.parametrize(
    ("exc", "error_class", "permanent"),
    [
        (TimeoutError(), ErrorClass.TIMEOUT, False),
        (PermanentSinkError("group gone"), ErrorClass.PERMANENT, True),
        (RetryableSinkError("503"), ErrorClass.RETRYABLE, False),
        (ValueError("oops"), ErrorClass.SINK_BUG, False),
    ],
)
def test_failure_of_maps_each_sink_exception_to_its_error_class(
    exc: Exception, error_class: ErrorClass, permanent: bool
) -> None:
    got = Attempts(_redactor(), 2.5).failure_of("im", exc)
    assert (got.sink, got.error_class, got.permanent, got.throttled) == ("im", error_class, permanent, False)
    assert got.error.startswith("im: ")


class _Unprintable(Exception):
    """A plugin's exception whose message cannot be read."""

    def __str__(self) -> str:
        raise RuntimeError("str exploded")


@pytest.mark.parametrize(
    ("exc", "error_class", "error"),
    [
        (_Unprintable(), ErrorClass.SINK_BUG, "im: unexpected _Unprintable (its message could not be read: RuntimeError: str exploded)"),
        (RetryableSinkError(_Unprintable()), ErrorClass.RETRYABLE, "im: RetryableSinkError (its message could not be read: RuntimeError: str exploded)"),
        (PermanentSinkError(_Unprintable()), ErrorClass.PERMANENT, "im: permanent: PermanentSinkError (its message could not be read: RuntimeError: str exploded)"),
    ],
    ids=["bare", "retryable", "permanent"],
)  # fmt: skip
def test_failure_of_an_exception_whose_message_cannot_be_read_names_its_type(
    exc: Exception, error_class: ErrorClass, error: str
) -> None:
    """Its failure is recorded all the same (an error here would leave the event unrecorded,
    delivered again for ever), naming the type and why its message could not be read."""
    got = Attempts(_redactor(), 1).failure_of("im", exc)
    assert (got.error_class, got.error) == (error_class, error)


def test_describe_an_exception_whose_message_cannot_be_read() -> None:
    assert describe(_Unprintable()) == "_Unprintable (its message could not be read: RuntimeError: str exploded)"


def test_failure_of_names_the_deadline_of_a_timeout() -> None:
    got = Attempts(_redactor(), 2.5, "handler_timeout").failure_of("im", TimeoutError())
    assert got.error == "im: no answer within handler_timeout 2.5s"


def test_failure_of_keeps_a_throttled_delivery_apart_with_its_retry_after() -> None:
    got = Attempts(_redactor(), 1).failure_of("im", ThrottledSinkError("rate limit", retry_after=0.25))
    assert (got.error_class, got.throttled, got.permanent, got.retry_after) == (ErrorClass.THROTTLED, True, False, 0.25)


def test_error_classes_keep_their_metric_label_values() -> None:
    assert [str(c) for c in ErrorClass] == [
        "bad_envelope", "no_route", "timeout", "permanent", "retryable", "sink_bug", "throttled",
    ]  # fmt: skip
    assert {c for c in ErrorClass if c.permanent} == {
        ErrorClass.BAD_ENVELOPE,
        ErrorClass.NO_ROUTE,
        ErrorClass.PERMANENT,
    }


def test_error_text_redacts_then_cuts_at_last_error_max() -> None:
    # The secret straddles the cut: redacting after cutting would leave half of it.
    text = "x" * (LAST_ERROR_MAX - 5) + SECRET + "y" * 100
    got = error_text(_redactor(), text)
    assert len(got) == LAST_ERROR_MAX and got.endswith("…")
    assert SECRET[:5] not in got[LAST_ERROR_MAX - 10 :]


def test_error_text_keeps_a_short_text_whole_but_its_secrets() -> None:
    assert SECRET not in error_text(_redactor(), f"denied for {SECRET}")
    assert error_text(_redactor(), "short") == "short"


def test_failure_of_and_refused_redact_the_text() -> None:
    attempts = Attempts(_redactor(), 1)
    assert SECRET not in attempts.failure_of("im", RetryableSinkError(f"bad sig {SECRET}")).error
    assert SECRET not in attempts.refused("-", ErrorClass.BAD_ENVELOPE, f"bad {SECRET}").error


class _Watcher:
    """An observer that notes what it was told, and whether the call ran inside ``current``."""

    def __init__(self) -> None:
        self.inside = False
        self.seen_inside: list[bool] = []
        self.finished: list[Failure | None] = []

    @contextmanager
    def current(self, name: str) -> Iterator[None]:
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def finish(self, failure: Failure | None) -> None:
        self.finished.append(failure)


@pytest.mark.anyio
async def test_run_calls_inside_the_observer_and_reports_success() -> None:
    watcher = _Watcher()

    async def call(arg: int) -> None:
        watcher.seen_inside.append(watcher.inside and arg == 7)

    assert await Attempts(_redactor(), 1).run("im", call, 7, watcher) is None
    assert watcher.seen_inside == [True] and watcher.finished == [None]


@pytest.mark.anyio
async def test_run_ends_a_call_at_its_deadline_as_a_timeout() -> None:
    watcher = _Watcher()

    async def hangs(_: None) -> None:
        await anyio.sleep_forever()

    with anyio.fail_after(10):
        got = await Attempts(_redactor(), 0.05).run("im", hangs, None, watcher)
    assert got is not None and got.error_class is ErrorClass.TIMEOUT
    assert watcher.finished == [got]


@pytest.mark.anyio
async def test_run_classifies_and_reports_what_the_call_raised() -> None:
    watcher = _Watcher()

    async def fails(_: None) -> None:
        raise PermanentSinkError(f"group gone {SECRET}")

    got = await Attempts(_redactor(), 1).run("im", fails, None, watcher)
    assert got is not None and (got.error_class, got.permanent) == (ErrorClass.PERMANENT, True)
    assert SECRET not in got.error and watcher.finished == [got]


@pytest.mark.anyio
async def test_run_under_a_shared_scope_leaves_an_overrun_to_the_caller() -> None:
    """The caller's scope ends an overrunning call outside run (nothing reported yet); the
    caller reports it with timed_out."""
    watcher = _Watcher()

    async def hangs(_: None) -> None:
        await anyio.sleep_forever()

    attempts = Attempts(_redactor(), 0.05)
    with anyio.fail_after(10), anyio.CancelScope() as scope:
        await attempts.run("im", hangs, None, watcher, scope)
    assert scope.cancelled_caught and watcher.finished == []
    got = attempts.timed_out("im", watcher)
    assert got.error == "im: no answer within publish_timeout 0.05s" and watcher.finished == [got]


@pytest.mark.anyio
async def test_calls_under_a_shared_scope_each_have_their_whole_timeout_and_little_more() -> None:
    """The deadline is moved on only when it would come too soon: calls in a row that
    together outlast the timeout all succeed, each with a deadline between its own timeout
    and the timeout plus the slack; and far fewer moves than calls."""
    attempts = Attempts(_redactor(), 0.1)
    loop_time = asyncio.get_running_loop().time
    left: list[float] = []
    moves = 0

    async def quick(_: None) -> None:
        left.append(scope.deadline - loop_time())
        await anyio.sleep(0.001)

    with anyio.fail_after(10), anyio.CancelScope() as scope:
        last = scope.deadline
        for _ in range(250):  # 0.25 s at least: more than two timeouts
            assert await attempts.run("im", quick, None, scope=scope) is None
            moves, last = moves + (scope.deadline != last), scope.deadline
    assert all(0.1 - 0.002 <= t <= 0.1 + attempts.rearm_slack for t in left), left
    assert 2 <= moves <= 125  # the slack (5 ms) outlasts several calls (1 ms or a little more each)


@pytest.mark.anyio
async def test_a_disarmed_shared_scope_is_armed_again_by_the_next_call() -> None:
    attempts = Attempts(_redactor(), 0.05)

    async def hangs(_: None) -> None:
        await anyio.sleep_forever()

    with anyio.fail_after(10), anyio.CancelScope() as scope:
        scope.deadline = math.inf  # as a worker leaves it while it waits for rows
        await attempts.run("im", hangs, None, scope=scope)
    assert scope.cancelled_caught


@pytest.mark.anyio
@pytest.mark.parametrize("shared_scope", [False, True])
async def test_a_call_raising_its_own_cancelled_error_is_a_sink_bug(shared_scope: bool) -> None:
    """Nobody cancelled the call: its CancelledError is the sink's bug, not a cancellation."""
    watcher = _Watcher()

    async def leaks(_: None) -> None:
        raise asyncio.CancelledError

    with anyio.fail_after(10), anyio.CancelScope() as scope:
        got = await Attempts(_redactor(), 1).run("im", leaks, None, watcher, scope if shared_scope else None)
    assert got is not None and (got.error_class, got.error) == (ErrorClass.SINK_BUG, "im: unexpected CancelledError")
    assert watcher.finished == [got] and not scope.cancelled_caught


@pytest.mark.anyio
@pytest.mark.parametrize("shared_scope", [False, True])
async def test_a_call_raising_generator_exit_itself_is_a_sink_bug(shared_scope: bool) -> None:
    """Its coroutine was not being closed: the GeneratorExit is the sink's bug, failing the
    call, not something to let out of the task (it would end the whole process)."""
    watcher = _Watcher()

    async def exits(_: None) -> None:
        await anyio.sleep(0)
        raise GeneratorExit("sink bug")

    with anyio.fail_after(10), anyio.CancelScope() as scope:
        got = await Attempts(_redactor(), 1).run("im", exits, None, watcher, scope if shared_scope else None)
    assert got is not None and (got.error_class, got.error) == (
        ErrorClass.SINK_BUG,
        "im: unexpected GeneratorExit: sink bug",
    )
    assert watcher.finished == [got]


@pytest.mark.anyio
@pytest.mark.parametrize("closer", ["another task", "no task"])
async def test_a_call_whose_coroutine_is_closed_lets_generator_exit_out(closer: str) -> None:
    """Closing a coroutine in the middle of a call (``close()``, by whoever holds it, as the
    garbage collector closes an abandoned task's) is no failure of the call: the
    GeneratorExit goes on and the coroutine ends. (A dispatcher's shared scope: the only
    scope a closed coroutine can leave is one entered outside it.)"""
    watcher = _Watcher()
    started = anyio.Event()
    ended: list[str] = []

    async def waits(_: None) -> None:
        started.set()
        await anyio.sleep_forever()

    async def attempt() -> None:
        try:
            await Attempts(_redactor(), 5).run("im", waits, None, watcher, anyio.CancelScope())
        except GeneratorExit:
            ended.append("closed")
            raise
        ended.append("returned")

    coroutine = attempt()
    loop = asyncio.get_running_loop()
    task = loop.create_task(coroutine)
    with anyio.fail_after(10):
        await started.wait()
        if closer == "another task":
            coroutine.close()
        else:
            closed = anyio.Event()
            loop.call_soon(lambda: (coroutine.close(), closed.set()))
            await closed.wait()
    assert ended == ["closed"] and watcher.finished == []
    task.cancel()  # its coroutine is closed: stepping it again raises
    with pytest.raises((asyncio.CancelledError, RuntimeError)):
        await task


@pytest.mark.anyio
@pytest.mark.parametrize("shared_scope", [False, True])
async def test_a_real_cancellation_of_a_call_still_propagates(shared_scope: bool) -> None:
    """Cancelled from outside (the service stopping): the cancellation goes on, no failure."""
    watcher = _Watcher()
    started = anyio.Event()

    async def hangs(_: None) -> None:
        started.set()
        await anyio.sleep_forever()

    attempts = Attempts(_redactor(), 5)

    async def attempt() -> None:
        with anyio.CancelScope() as scope:
            await attempts.run("im", hangs, None, watcher, scope if shared_scope else None)
        raise AssertionError("the cancellation was swallowed")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(attempt)
            await started.wait()
            tg.cancel_scope.cancel()
    assert watcher.finished == []


def test_describe_names_the_exception_type() -> None:
    assert describe(KeyError()) == "KeyError"
    assert describe(ValueError("bad")) == "ValueError: bad"


def test_describe_names_what_a_task_group_raised() -> None:
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ExceptionGroup("inner", [ValueError("bad")])])
    assert describe(group) == "ValueError: bad"
    two = ExceptionGroup("unhandled errors in a TaskGroup", [KeyError("k"), ValueError("bad")])
    assert describe(two) == "KeyError: 'k' (and 1 more)"
