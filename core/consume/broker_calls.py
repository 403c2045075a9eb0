"""A consumer's operations on the broker, which a stop may abandon.

aiokafka retries a fetch, a commit, a dead-letter copy or leaving the group for as long as the
broker does not answer. Once the consumer is told to stop, each operation in progress or
started after gets STOP_BROKER_TIMEOUT more, then is abandoned (:class:`Abandoned`): a stop
takes a bounded time whatever the broker does, and what was not done on the broker is done
again after (an offset not committed is read again and found processed; a dead letter not
copied stays in the retry table).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.group_coordinator import GroupCoordinator

T = TypeVar("T")

#: How much longer any one broker operation may take once the consumer is told to stop.
STOP_BROKER_TIMEOUT = 1.5


class Abandoned(Exception):
    """A broker operation did not end within STOP_BROKER_TIMEOUT of the consumer's stop."""

    def __init__(self) -> None:
        super().__init__(f"the broker did not answer within {STOP_BROKER_TIMEOUT} s of the stop")


class BrokerCalls:
    """The broker operations of one consumer (its group member and its dead-letter producer)."""

    def __init__(self, stopped: anyio.Event) -> None:
        self._stopped = stopped
        #: The operations in progress, whose deadline :meth:`stop` brings forward.
        self._calls: set[anyio.CancelScope] = set()

    def stop(self) -> None:
        """Give the operations in progress STOP_BROKER_TIMEOUT more (call once ``stopped`` is set)."""
        deadline = anyio.current_time() + STOP_BROKER_TIMEOUT
        for call in self._calls:
            call.deadline = min(call.deadline, deadline)

    async def __call__(self, operation: Callable[[], Awaitable[T]]) -> T:
        """``operation()``, abandoned (:class:`Abandoned`) STOP_BROKER_TIMEOUT after the stop."""
        with anyio.CancelScope() as scope:
            if self._stopped.is_set():
                scope.deadline = anyio.current_time() + STOP_BROKER_TIMEOUT
            self._calls.add(scope)
            try:
                return await operation()
            finally:
                self._calls.discard(scope)
        raise Abandoned


def cancel_abandoned_commit(kafka: AIOKafkaConsumer) -> None:
    """Cancel the offset commit request an abandoned ``kafka.commit`` left running. aiokafka
    sends it from a task of its own, shielded from its caller's cancellation, that nobody
    awaits once the caller is gone: it would fail when the client closes and asyncio would log
    that failure, with a traceback, as never retrieved. The commit is given up either way."""
    coordinator = getattr(kafka, "_coordinator", None)
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)  # None once the coroutine has ended
        if (
            getattr(coro, "cr_code", None) is GroupCoordinator._do_commit_offsets.__code__
            and frame is not None
            and frame.f_locals.get("self") is coordinator
        ):
            task.cancel()
