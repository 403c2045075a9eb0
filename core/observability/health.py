"""Liveness and readiness: what ``/healthz`` and ``/readyz`` (and the Docker HEALTHCHECK) answer.

Live: every lane that should be running rounds has made progress lately
(:meth:`Health.liveness`): a lane blocked for good is cured by a restart, a database that is
down is not. Ready: the worker runs, the database answered lately, no lane keeps failing and
the outbox table has room-outbox's indexes (:meth:`Health.readiness`); sinks are not checked,
so a sink's jitter never takes the process out of service. Both are read from state the process
keeps, never from a query per request: background checks keep it (:meth:`Health.watch_database`,
:meth:`Health.watch_schema`).
A failed check says why: a short fixed cause, then the error behind it (secrets masked, cut to
:data:`CHECK_TEXT_MAX`), so that a probe's answer names what to fix without a log search. The
dispatchers report to their :class:`LaneHealth`; the lifecycle sets :attr:`Health.worker`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio

from room_outbox.config import UNREADY_AFTER_FAILED_ROUNDS
from room_outbox.errors import SchemaError
from room_outbox.observability.redaction import Redactor, redact_and_shorten
from room_outbox.store.clock import CLOCK, ClusterClock

log = logging.getLogger("room_outbox.health")

DATABASE_CHECK_TIMEOUT = 2.0
#: The watch pings the database when no query has succeeded for this long.
DATABASE_CHECK_INTERVAL = 5.0
#: Ready only while a query has succeeded within this long: a missed ping or two is tolerated.
DATABASE_FRESH_FOR = 3 * DATABASE_CHECK_INTERVAL
#: How often a running process checks that the outbox table still has the indexes its
#: statements read by name (a catalogue query): a table swapped for a copy without them is
#: noticed within this long.
SCHEMA_CHECK_INTERVAL = 30.0
#: Longest error text in a log line about a check, in a failed check's cause (``/readyz``) and
#: in a backlog-sample warning.
CHECK_TEXT_MAX = 300
#: ``/readyz``'s clock check when this host's clock is off the database's beyond the bound.
CLOCK_SKEWED = "off the database's clock by more than cluster.max_clock_skew"


@dataclass
class LaneHealth:
    """One lane's rounds, as its dispatcher reports them."""

    name: str
    #: ``time.monotonic()`` when a round or a delivery attempt last ended (or the lane started).
    last_progress: float = field(default_factory=time.monotonic)
    failed_in_a_row: int = 0
    last_error: str = ""
    #: ``time.monotonic()`` of the last successful round (its queries answered); None: none yet.
    succeeded_at: float | None = None
    #: Whether the last failed round failed for its sink (a tailing lane's broker down), not
    #: for the database: a failing sink never makes the process unready.
    sink_failing: bool = False

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    def round_ended(self, error: str | None = None, *, sink_failed: bool = False) -> None:
        """A round ended: successfully (``error`` None) or not; ``sink_failed``: for its sink."""
        self.progressed()
        if error is None:
            self.failed_in_a_row = 0
            self.succeeded_at = self.last_progress
        else:
            self.failed_in_a_row += 1
            self.last_error = error
        self.sink_failing = error is not None and sink_failed


async def _no_database_check() -> None:
    return None


@dataclass
class Health:
    """What liveness and readiness depend on. ``check_database`` raises when the database
    does not answer; ``check_schema`` raises :class:`SchemaError` naming the fix when the
    outbox table lacks an index room-outbox's statements need (None: no table to check)."""

    check_database: Callable[[], Awaitable[None]] = _no_database_check
    check_schema: Callable[[], Awaitable[None]] | None = None
    #: ``starting``, ``running``, ``stopping`` or ``disabled`` (by ``outbox_worker.enabled``).
    worker: str = "starting"
    redactor: Redactor = field(default_factory=Redactor)
    #: Seconds a running lane may go without progress before the process counts as not live.
    stalled_after: float = 30.0
    #: Failed rounds in a row (in any lane) that make the process not ready.
    unready_after_failed_rounds: int = UNREADY_AFTER_FAILED_ROUNDS
    lanes: dict[str, LaneHealth] = field(default_factory=dict)
    #: Further readiness checks by name (a consumer's broker): each says "ok" or why not.
    checks: dict[str, Callable[[], str]] = field(default_factory=dict)
    #: The watch's last successful ping and last failure (``time.monotonic()``), and that
    #: failure's cause (None once a ping succeeds again).
    _pinged_at: float | None = None
    _failed_at: float | None = None
    _failure: str | None = None
    #: What the schema watch finds missing (None: nothing), and whether it has logged it.
    _schema_problem: str | None = None
    _schema_logged: bool = False
    #: The process's reading of the database's clock (its offset is reported, not a cause of
    #: unreadiness: every time compared between processes is the database's).
    clock: ClusterClock = field(default_factory=lambda: CLOCK)

    @property
    def schema_failing(self) -> bool:
        """Whether the schema watch's last check found an index missing (the ``schema``
        check of :meth:`readiness`)."""
        return self._schema_problem is not None

    def lane(self, name: str) -> LaneHealth:
        """The record a lane's dispatcher reports to (created when first asked for)."""
        return self.lanes.setdefault(name, LaneHealth(name))

    def liveness(self) -> tuple[bool, dict[str, str]]:
        """Live while every running lane has made progress (a round ended, successfully or not,
        or a delivery attempt ended) within :attr:`stalled_after` (see :func:`stalled_after`).
        A lane blocked for good (on a database or a sink that never answers) fails it. A
        database that is down does not: rounds keep ending, each failed one within
        ``query_timeout``, and a restart would not help."""
        checks: dict[str, str] = {"worker": self.worker}
        live = True
        if self.worker == "running":  # starting, stopping or disabled: no rounds expected
            now = time.monotonic()
            for name, lane in sorted(self.lanes.items()):
                idle = now - lane.last_progress
                if idle > self.stalled_after:
                    live = False
                    checks[f"lane {name}"] = f"no round ended for {idle:.0f}s (limit {self.stalled_after:g}s)"
                else:
                    checks[f"lane {name}"] = "ok"
        return live, checks

    def readiness(self) -> tuple[bool, dict[str, str]]:
        """Ready when the worker runs (or is disabled by configuration), a query succeeded
        within the last ``DATABASE_FRESH_FOR`` seconds (a lane's successful round counts) and no
        lane has had ``unready_after_failed_rounds`` failed rounds in a row (but for its sink's:
        a broker down is the lane's alert, not the process's readiness) and the schema watch
        finds no index missing (the ``schema`` check, shown while it fails) and every further
        check of :attr:`checks` says "ok" (a consumer's broker answers). The ``clock`` check
        says whether this host's clock is off the database's by more than
        ``cluster.max_clock_skew``: shown, not a cause of unreadiness."""
        checks: dict[str, str] = {"worker": self.worker, "database": self._database_check()}
        ready = checks["database"] == "ok" and self.worker in ("running", "disabled")
        checks["clock"] = CLOCK_SKEWED if self.clock.skewed else "ok"
        if self._schema_problem is not None:
            ready = False
            checks["schema"] = self._schema_problem
        for name, lane in sorted(self.lanes.items()):
            if lane.failed_in_a_row >= self.unready_after_failed_rounds and not lane.sink_failing:
                ready = False
                why = check_text(self.redactor, lane.last_error)
                checks[f"lane {name}"] = f"{lane.failed_in_a_row} rounds failed in a row, the last: {why}"
        for name, check in sorted(self.checks.items()):
            checks[name] = check_text(self.redactor, check())
            ready = ready and checks[name] == "ok"
        return ready, checks

    def _last_success(self) -> float | None:
        times = [t for t in (self._pinged_at, *(lane.succeeded_at for lane in self.lanes.values())) if t is not None]
        return max(times, default=None)

    def _database_check(self) -> str:
        succeeded = self._last_success()
        if succeeded is not None and (self._failed_at is None or succeeded >= self._failed_at):
            age = time.monotonic() - succeeded
            return "ok" if age <= DATABASE_FRESH_FOR else f"no successful query for {age:.0f}s"
        return self._failure or "not checked yet"

    async def watch_database(self, interval: float = DATABASE_CHECK_INTERVAL) -> None:
        """Ping the database whenever no query has succeeded for ``interval``, until cancelled:
        only an idle or disabled worker, or a consumer, needs the ping."""
        while True:
            succeeded = self._last_success()
            if succeeded is None or time.monotonic() - succeeded >= interval:
                await self._ping()
            await anyio.sleep(interval)

    async def watch_schema(self, interval: float | None = None) -> None:
        """Check the outbox table's indexes every ``interval`` (default
        :data:`SCHEMA_CHECK_INTERVAL`), until cancelled. A table swapped under the running
        process for a copy without them fails no statement on PostgreSQL (nor on MySQL/MariaDB
        where no claim forces its index): every claim reads the whole table instead, slower as
        it grows, and nothing else would say so. A missing index is logged once per incident
        (and its end), and makes the process unready meanwhile."""
        if self.check_schema is None:
            return
        while True:  # start-up has just checked: the first check waits an interval too
            await anyio.sleep(SCHEMA_CHECK_INTERVAL if interval is None else interval)
            await self._check_schema_once(self.check_schema)

    async def _check_schema_once(self, check: Callable[[], Awaitable[None]]) -> None:
        try:
            await check()
        except SchemaError as exc:
            self._schema_problem = check_text(self.redactor, str(exc))
            if not self._schema_logged:
                log.error("schema check failed: %s", self._schema_problem)
                self._schema_logged = True
        except Exception:  # the database's trouble, not the schema's: the database check says it
            return
        else:
            if self._schema_logged:
                log.warning("schema check passes again: the outbox table has room-outbox's indexes")
            self._schema_problem = None
            self._schema_logged = False

    async def _ping(self) -> None:
        try:
            with anyio.fail_after(DATABASE_CHECK_TIMEOUT):
                await self.check_database()
        except Exception as exc:
            if self._failure is None:  # once per outage: the lanes log their own failures
                log.warning("readiness: the database check failed: %s", check_error(self.redactor, exc))
            timed_out = isinstance(exc, TimeoutError)
            why = f"no answer within {DATABASE_CHECK_TIMEOUT:g}s" if timed_out else "query failed"
            self._failure = f"{why}: {check_error(self.redactor, exc)}" if str(exc) else why
            self._failed_at = time.monotonic()
        else:
            self._pinged_at = time.monotonic()
            self._failure = None


def check_error(redactor: Redactor, exc: BaseException) -> str:
    """A failed check's exception as its log line and ``/readyz`` tell it: ``TypeName:
    message``, or the type's name alone when the message is empty (a timeout's, whose text is
    blank); secrets masked, cut to :data:`CHECK_TEXT_MAX` characters."""
    return check_text(redactor, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def check_text(redactor: Redactor, text: str) -> str:
    """An error's text as a check tells it: on one line (drivers' messages run over several),
    secrets masked, cut to :data:`CHECK_TEXT_MAX` characters."""
    return redact_and_shorten(redactor, " ".join(redactor.redact(text).split()), CHECK_TEXT_MAX)


def stalled_after(polls: int, poll_interval: float, query_timeout: float, publish_timeout: float) -> float:
    """Liveness's limit: ``polls`` × ``poll_interval``, but never less than the longest a
    healthy lane goes between two ends of a round or a delivery attempt (a wait, a claim, a
    delivery)."""
    return max(polls * poll_interval, poll_interval + query_timeout + publish_timeout)
