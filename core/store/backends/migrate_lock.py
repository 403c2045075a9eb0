"""migrate's lock, kept while migrate runs: either server's (MySQL's named lock, PostgreSQL's
advisory lock) lives on a session of its own, and goes with that session. The session idles
while other sessions make the changes, so a server's idle limit (MySQL's ``wait_timeout``,
PostgreSQL's ``idle_session_timeout``), a DBA's ``KILL`` or a restart of a proxy may end it,
and a second migrate would then run beside the first. So the lock's session is asked for a
trivial answer every :data:`CHECK_EVERY` seconds, which also keeps it from idling; when it no
longer answers, the lock is gone, and migrate stops its running change (as when interrupted)
and says so (:class:`MigrateLockLost`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio

from room_outbox.errors import SchemaError

#: Seconds between two checks of the lock's session: well below any idle limit a server may
#: set, and short enough that a second migrate, once the lock is free, finds this one stopped.
CHECK_EVERY = 1.0


class MigrateLockLost(SchemaError):
    """The session holding migrate's lock ended while migrate ran: migrate stopped."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"migrate stopped: the database session holding its lock (which keeps a second migrate out) ended"
            f" ({reason}); the change it was making was stopped, the changes before it are kept: run migrate"
            " again to finish"
        )


@asynccontextmanager
async def lock_kept(answers: Callable[[], Awaitable[object]], timeout: float) -> AsyncIterator[None]:
    """Run the block while the lock's session answers ``answers`` (a trivial query on it)
    within ``timeout`` every :data:`CHECK_EVERY` seconds; when it does not, cancel the block (its
    running statement stopped as on an interrupted migrate) and raise :class:`MigrateLockLost`.
    The block's own error is raised as it is, not wrapped in a task group's."""
    lost: list[str] = []
    errors: list[BaseException] = []
    async with anyio.create_task_group() as checks:
        checks.start_soon(_check, answers, timeout, lost, checks.cancel_scope)
        try:
            yield
        except Exception as exc:
            errors.append(exc)
        finally:
            checks.cancel_scope.cancel()
    if lost:
        raise MigrateLockLost(lost[0]) from (errors[0] if errors else None)
    if errors:
        raise errors[0]


async def _check(
    answers: Callable[[], Awaitable[object]], timeout: float, lost: list[str], migrate: anyio.CancelScope
) -> None:
    """Ask the lock's session every :data:`CHECK_EVERY` seconds; the first failure, in ``lost``,
    cancels ``migrate``. Each question shielded: cancelled half-way, it would end the session
    (and with it the lock) while migrate still runs."""
    while True:
        await anyio.sleep(CHECK_EVERY)
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(timeout):
                    await answers()
            except TimeoutError:
                lost.append(f"it did not answer within {timeout:g}s")
            except Exception as exc:  # the driver's error for a session gone
                lost.append(" ".join(str(exc).split()) or type(exc).__name__)
        if lost:
            migrate.cancel()
            return
