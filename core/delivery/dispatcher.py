"""One lane of delivery: claim a batch, route each event to its sink, deliver, record.

A round (:meth:`Dispatcher.run_once`) claims rows in short transactions that also record the
results so far, and delivers outside any transaction, many at once, each bounded by
``publish_timeout``: a failing or hanging event never stops the rest of its batch, and a kill
repeats at most one batch. Nothing kills the loop: a failed round is logged and tried again
after ``poll_interval`` (:meth:`Dispatcher.run`), and stopping is bounded whatever the database
does (:meth:`Dispatcher.stop`). Failures back off (:mod:`room_outbox.attempt.retry`); a row
failing again and again is logged once, then summarised (:mod:`.delivery.failure_log`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus

from room_outbox.attempt.failure import ErrorClass, Failure, describe_round_failure, error_text
from room_outbox.attempt.pipeline import Attempts
from room_outbox.attempt.retry import RetryPolicy
from room_outbox.config import MAIN_LANE, OutboxWorkerSettings
from room_outbox.delivery.failure_log import FailureLog
from room_outbox.delivery.routing import Router
from room_outbox.envelope import EnvelopeError, EventEnvelope, columns_differ, parse_envelope
from room_outbox.observability.health import LaneHealth
from room_outbox.observability.metrics import LEASE_LOSS_CAUSES
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import RepeatedFailure
from room_outbox.observability.telemetry import NO_ATTEMPT, DeliveryAttempt, Telemetry
from room_outbox.store.clock import now_ms
from room_outbox.store.deadline import DEFAULT_QUERY_TIMEOUT
from room_outbox.store.protocol import (
    Claimed,
    ClaimFailedAfterResults,
    DeliveryResult,
    OutboxRow,
    OutboxStore,
    Outcome,
)

log = logging.getLogger("room_outbox.dispatcher")


#: The defaults of every lane option: those of the configuration, never a second copy.
_DEFAULTS = OutboxWorkerSettings()


@dataclass(frozen=True)
class LaneOptions:
    """How one lane delivers: its ``outbox_worker`` settings (``outbox_worker.lanes.<lane>``
    merged over them, see :meth:`~room_outbox.config.DeliverySettings.for_lane`)."""

    batch_size: int = _DEFAULTS.batch_size
    poll_interval: float = _DEFAULTS.poll_interval
    publish_timeout: float = _DEFAULTS.publish_timeout
    concurrency: int = _DEFAULTS.concurrency
    lease: float = _DEFAULTS.lease_seconds
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    per_room: bool = _DEFAULTS.ordering == "per_room"
    #: The store's bound on one database call (``database.query_timeout``): here, it bounds shutdown.
    query_timeout: float = DEFAULT_QUERY_TIMEOUT
    #: How often repeated failures of the same rows are summarised in one log line.
    failure_summary_interval: float = 60.0

    @classmethod
    def from_settings(cls, worker: OutboxWorkerSettings, query_timeout: float = DEFAULT_QUERY_TIMEOUT) -> LaneOptions:
        return cls(
            query_timeout=query_timeout,
            batch_size=worker.batch_size,
            poll_interval=worker.poll_interval,
            publish_timeout=worker.publish_timeout,
            concurrency=worker.concurrency,
            lease=worker.lease_seconds,
            retry=RetryPolicy.from_settings(worker),
            per_room=worker.ordering == "per_room",
        )


class Dispatcher:
    def __init__(
        self,
        store: OutboxStore,
        router: Router,
        options: LaneOptions,
        node_id: str,
        redactor: Redactor | None = None,
        telemetry: Telemetry | None = None,
        lane: str = MAIN_LANE,
        health: LaneHealth | None = None,
    ) -> None:
        self.store = store
        #: Which lane this is, in every log line: "im" or the sink with a lane of its own.
        self.lane = lane
        self.router = router
        self.options = options
        #: The process identity (room_outbox.cluster.identity): claims are "<identity>#<n>",
        #: unique per process start even where two processes share a node_id.
        self.node_id = node_id
        self.redactor = redactor or Redactor()
        #: Each sink call: its deadline, what its failure means, its span and metrics.
        self.attempts = Attempts(self.redactor, options.publish_timeout)
        #: Spans and metrics; the default records nothing and costs next to nothing.
        self.telemetry = telemetry or Telemetry()
        #: Where rounds are reported for liveness and readiness.
        self.health = health or LaneHealth(lane)
        self._claim_numbers = itertools.count(1)
        #: Results not yet written. Delivery workers append to this very list while a claim
        #: writes its head, so it is only ever changed in place.
        self._unrecorded: list[DeliveryResult] = []
        #: Per claim, the rows whose results are not yet written (id: room): the rows whose
        #: leases are renewed and, with per-room ordering, those a claim made ahead may follow.
        self._held: dict[str, dict[int, tuple[str, str]]] = {}
        #: The last claims that failed after handing their rows over: those rows never got a
        #: lease, so their results cannot be written (told apart from rows taken over).
        self._failed_claims: deque[str] = deque(maxlen=16)
        #: Per claim, the rows a lease renewal found taken over and counted whose results are
        #: not written yet. Their results come back stale: a lost lease is counted once, where
        #: it is first seen, not again at the result write.
        self._lost_at_renewal: dict[str, int] = {}
        #: Claims and lease renewals take turns, so that a renewal never counts as lost a row
        #: whose result a claim has just written.
        self._store_turn = anyio.Lock()
        self._stopping = anyio.Event()
        #: Until :meth:`stop`: none. Then the time by which the lane must have ended.
        self._stop_deadline = float("inf")
        self._round_scope: anyio.CancelScope | None = None
        #: A row failing again and again is logged once, then in a summary per interval.
        self.failures = FailureLog(log, options.failure_summary_interval, lane=lane)
        #: Rounds failing one after another (the database unreachable): the same, for rounds.
        self.failing_rounds = RepeatedFailure(
            log,
            "outbox round failed; retrying after poll_interval",
            "outbox rounds succeed again",
            options.failure_summary_interval,
            lane=lane,
        )

    # -- control -------------------------------------------------------------------------

    def stop(self) -> None:
        """Claim no new batch; in-flight deliveries finish (within ``publish_timeout``), the
        events of the batch not yet started are released, results are written, ``run`` returns:
        all within ``publish_timeout`` + ``query_timeout``, whatever the database does. What is
        still unwritten then stays leased until its lease expires: delivered again later, never
        lost."""
        if not self._stopping.is_set():
            self._stop_deadline = anyio.current_time() + self.options.publish_timeout + self.options.query_timeout
            if self._round_scope is not None:
                self._round_scope.deadline = self._stop_deadline
        self._stopping.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The scan loop, until :meth:`stop`. Store errors (a call that outlived
        ``query_timeout`` included) fail the round: it is counted for readiness, logged with
        its lane (while rounds keep failing, once per ``failure_summary_interval``) and tried
        again after ``poll_interval``. Results that could not be written are
        kept for the next successful transaction (fenced on their claim, so writing them late
        is safe)."""
        log.info("worker started", extra={"lifecycle": "worker_started", **self._describe()})
        task_status.started()
        try:
            while not self._stopping.is_set():
                scan_started = anyio.current_time()
                with anyio.CancelScope(deadline=self._stop_deadline) as self._round_scope:
                    try:
                        round_ = await self.run_once()
                        if round_.exhausted:
                            await self.flush()
                        self.health.round_ended()
                        self.failing_rounds.succeeded()
                        if not round_.exhausted:
                            continue  # a backlog drains at full speed: no wait after a full batch
                    except Exception as exc:
                        error = self._short(describe_round_failure(exc))
                        self.health.round_ended(error)
                        self.telemetry.round_failed(self.lane)
                        self.failing_rounds.failed(error, unrecorded=len(self._unrecorded))
                self._round_scope = None
                # A ticker: the next scan is due poll_interval after this
                # one began, so the round's own time does not add to the wait of what arrived
                # during it. A round that took longer is followed at once (it did work).
                elapsed = anyio.current_time() - scan_started
                with anyio.move_on_after(max(0.0, self.options.poll_interval - elapsed)):
                    await self._stopping.wait()
        finally:
            self._round_scope = None
            if self._stopping.is_set():
                flush_by = self._stop_deadline
            else:  # cancelled from outside: still try to write what was delivered
                flush_by = anyio.current_time() + self.options.query_timeout
            with anyio.CancelScope(shield=True, deadline=flush_by) as flushing:
                await self._final_flush()
            if flushing.cancelled_caught:
                log.error(
                    "results not written by the shutdown deadline; their rows stay leased until the lease expires",
                    extra={"lane": self.lane, "unrecorded": len(self._unrecorded)},
                )
            log.info("worker stopped", extra={"lifecycle": "worker_stopped", "lane": self.lane})

    async def run_once(self) -> Round:
        """Claim and deliver until a claim comes back short, :meth:`stop` is called or a claim
        fails (raised once the deliveries under way have ended). The last results are written
        by the next claim or :meth:`flush`.

        Each claim takes up to ``batch_size`` rows and records the results in since the last
        one (a batch at a time, not row by row; see
        :meth:`~room_outbox.store.protocol.OutboxStore.claim`), and hands its rows to the
        workers as soon as the store has them locked. ``concurrency`` workers deliver, and the
        held rows' leases are renewed meanwhile, so they never expire under a live process. Once
        every claimed row has a worker, the next claim is made while the last rows are still in
        flight, for as many rows as keep those held within ``batch_size``
        (:meth:`_outstanding_before_next_claim`): the database and the sink are not idle in
        turn. With per-room ordering such a claim may take the next rows of rooms still in
        flight, which follow those rows (:class:`Feed`)."""
        feed = Feed(chained=self.options.per_room)
        claimed = await self._claim(self.options.batch_size, feed)
        if not claimed.rows:
            return Round(0, claimed.exhausted)
        total, exhausted, failure = len(claimed.rows), claimed.exhausted, None
        wait_for = self._outstanding_before_next_claim()
        async with anyio.create_task_group() as renewal:
            renewal.start_soon(self._keep_leases)
            async with anyio.create_task_group() as deliveries:
                # No more workers than rows a round holds at once: more would wait for nothing.
                for _ in range(min(self.options.concurrency, self.options.batch_size)):
                    deliveries.start_soon(self.deliver_in_turn, feed, self._unrecorded)
                try:
                    while not exhausted and not self._stopping.is_set():
                        await feed.taken_and_outstanding_at_most(wait_for)
                        if self._stopping.is_set():
                            break
                        limit = self.options.batch_size - feed.outstanding
                        claimed = await self._claim(limit, feed)
                        total, exhausted = total + len(claimed.rows), claimed.exhausted
                except Exception as exc:  # the store failed: let what is in flight finish first
                    failure = exc
                finally:
                    feed.close()
            renewal.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return Round(total, exhausted)

    def _outstanding_before_next_claim(self) -> int:
        """How many claimed rows may still be without a result when the next claim is made
        (every claimed row with a worker by then): it claims what keeps the rows held within
        a batch, so at least half a batch."""
        return self.options.batch_size // 2

    async def _claim(self, limit: int, feed: Feed) -> Claimed:
        """Claim up to ``limit`` rows, writing the results in so far. The rows go into
        ``feed`` as soon as the store has them locked, so that the workers deliver them while
        the claim writes their leases and commits (``on_locked``)."""
        # Before every claim, as a round under a steady backlog goes on claiming for as long
        # as the backlog lasts: a no-op but once per interval.
        self.failures.summarise()
        self.telemetry.flush_counts()
        claim = f"{self.node_id}#{next(self._claim_numbers)}"
        lease_until = now_ms() + int(self.options.lease * 1000)
        fed = False

        async def feed_early(rows: list[OutboxRow]) -> None:
            nonlocal fed
            self._put(feed, rows, in_flight)
            fed = True

        async with self._store_turn:
            written = self._unrecorded[:]  # workers may append more while the claim runs
            in_flight = self._in_flight(written) if self.options.per_room else {}
            try:
                claimed = await self.store.claim(
                    claim,
                    limit,
                    lease_until,
                    written,
                    per_room=self.options.per_room,
                    hold_back_ms=int(self.options.poll_interval * 1000),
                    in_flight=in_flight,
                    on_locked=feed_early,
                )
            except Exception as exc:
                if fed:
                    self._failed_claims.append(claim)
                if not isinstance(exc, ClaimFailedAfterResults):
                    raise
                self._report_stale(self._forget(written, exc.stale))
                raise exc.__cause__ or exc from None
            # In this turn: the stale rows have left the rows held, so a renewal must not
            # find them gone before the counts they were seen under are settled.
            self._report_stale(self._forget(written, claimed.stale))
            if claimed.rows:
                self._held[claim] = {row.id: (row.app_code, row.room_id) for row in claimed.rows}
                if not fed:
                    self._put(feed, claimed.rows, in_flight)
        # A successful claim counts as a round ended for readiness: after an outage, a round
        # draining the backlog it left may go on for minutes.
        self.health.round_ended()
        self.telemetry.claimed(len(claimed.rows))
        return claimed

    async def flush(self) -> None:
        """Write the results not yet written."""
        self.telemetry.flush_counts()
        if self._unrecorded:
            written = self._unrecorded[:]
            self._report_stale(self._forget(written, await self.store.record(written)))

    def _in_flight(self, written: Sequence[DeliveryResult]) -> dict[int, tuple[str, str]]:
        """The rows held whose results are not among ``written`` (id: room): rows being
        delivered or waiting for a worker, or delivered with their results not yet in hand."""
        settled = {result.row_id for result in written}
        return {row_id: room for rows in self._held.values() for row_id, room in rows.items() if row_id not in settled}

    def _put(self, feed: Feed, rows: Sequence[OutboxRow], in_flight: dict[int, tuple[str, str]]) -> None:
        """Hand claimed rows to the workers. With per-room ordering, a room's rows follow its rows
        ``in_flight`` when claimed, and are released at once if one of those has ended
        unpublished since (its result is not written yet: it was not among the claim's)."""
        after: dict[tuple[str, str], list[int]] = {}
        for row_id, room in in_flight.items():
            after.setdefault(room, []).append(row_id)
        unpublished = {r.row_id for r in self._unrecorded if r.outcome is not Outcome.PUBLISHED} if after else set()
        self._release_queues(feed, feed.put(self._queues(rows), len(rows), after, unpublished), self._unrecorded)

    def _forget(self, written: Sequence[DeliveryResult], unwritten: Sequence[DeliveryResult]) -> list[DeliveryResult]:
        """These results, the head of ``_unrecorded``, were written but for ``unwritten``:
        their rows are no longer held. Those whose row another session held locked
        (``row_locked``) stay, first in line for the next write, their rows still held; the
        others are stale, returned."""
        waiting = {(r.row_id, r.claim) for r in unwritten if r.row_locked}
        if not waiting:
            del self._unrecorded[: len(written)]
        else:
            self._unrecorded[: len(written)] = [r for r in written if (r.row_id, r.claim) in waiting]
        for result in written:
            if waiting and (result.row_id, result.claim) in waiting:
                continue
            rows = self._held.get(result.claim)
            if rows is not None:
                rows.pop(result.row_id, None)
                if not rows:
                    del self._held[result.claim]
        return [r for r in unwritten if not r.row_locked] if waiting else list(unwritten)

    # -- delivery ------------------------------------------------------------------------

    async def deliver_in_turn(self, feed: Feed, results: list[DeliveryResult]) -> None:
        """Deliver queues from ``feed`` one after another, adding their results to ``results``,
        until the feed is closed and empty. (A fixed pool of workers taking queues, not a task
        and a limiter per queue: the faster of the two.) A queue's rows go one after
        another (one row, or one room's rows in id order): a row that is not published
        releases the rest of its queue, and once :meth:`stop` is called the rows not yet
        attempted are released.

        Each sink call is bounded by ``publish_timeout`` through one cancel scope for all the
        queues, its deadline set per call (a ``fail_after`` per row cost about twice as much); a call
        that overran ends the scope, is recorded as a timeout, and a new scope goes on with
        the next queue."""
        current = _InFlight()
        while True:
            with anyio.CancelScope() as current.scope:
                while True:
                    queue = feed.take()
                    if queue is None:
                        if feed.closed:
                            return
                        current.scope.deadline = math.inf  # waiting for rows is no sink call
                        await feed.more()
                        continue
                    current.queue = queue
                    published = True
                    for position, row in enumerate(queue):
                        current.position = position
                        result = self._release(row) if self._stopping.is_set() else await self._attempt(row, current)
                        results.append(result)
                        if result.outcome is not Outcome.PUBLISHED:
                            feed.settled(self._release_rest(queue, position, results) + 1)
                            published = False
                            break
                        feed.settled(1)
                    if feed.chained:
                        self._queue_done(feed, queue, published, results)
                    if current.scope.cancel_called:
                        break  # the deadline passed as the sink answered (a timeout): a new scope
            if not current.scope.cancelled_caught:
                continue
            # Only an overrun ends the scope here (a cancellation from outside goes on up).
            row = current.queue[current.position]
            results.append(self._result(row, self.attempts.timed_out(current.sink, current.attempt)))
            feed.settled(self._release_rest(current.queue, current.position, results) + 1)
            if feed.chained:
                self._queue_done(feed, current.queue, False, results)

    def _queue_done(
        self, feed: Feed, queue: Sequence[OutboxRow], published: bool, results: list[DeliveryResult]
    ) -> None:
        """A room's queue has ended, ``published`` if every row was: if not, release the queues
        that were to follow it (:meth:`Feed.done`)."""
        self._release_queues(feed, feed.done(queue, published), results)

    def _release_queues(self, feed: Feed, queues: Sequence[Sequence[OutboxRow]], results: list[DeliveryResult]) -> None:
        """Release every row of ``queues``, untried, into ``results``."""
        for queue in queues:
            results.extend(map(self._release, queue))
            feed.settled(len(queue))

    def _release_rest(self, queue: Sequence[OutboxRow], position: int, results: list[DeliveryResult]) -> int:
        """Release the rows of ``queue`` after ``position``; return how many."""
        later = queue[position + 1 :]
        results.extend(self._release(row) for row in later)
        return len(later)

    def _queues(self, rows: Sequence[OutboxRow]) -> list[list[OutboxRow]]:
        """Rows that must go one after another: one queue per room with per-room ordering,
        else one queue per row."""
        if not self.options.per_room:
            return [[row] for row in rows]
        rooms: dict[tuple[str, str], list[OutboxRow]] = {}
        for row in sorted(rows, key=lambda r: r.id):
            rooms.setdefault((row.app_code, row.room_id), []).append(row)
        return list(rooms.values())

    @staticmethod
    def _release(row: OutboxRow) -> DeliveryResult:
        return DeliveryResult(row.id, row.event_id, row.claim, Outcome.RELEASED)

    async def _attempt(self, row: OutboxRow, current: _InFlight) -> DeliveryResult:
        """Deliver one event and turn what happened into the result to record."""
        telemetry = self.telemetry
        # The event label and the attempt's context only when something records them.
        current.attempt = (
            telemetry.attempt(row, self.router.event_label(row.event_type)) if telemetry.recording else NO_ATTEMPT
        )
        failure = await self._deliver_one(row, current)
        if failure is None:
            return self._result(row, None)
        with current.attempt.ended():  # the failure's log lines carry the attempt's trace
            return self._result(row, failure)

    def _result(self, row: OutboxRow, failure: Failure | None) -> DeliveryResult:
        self.health.progressed()
        if failure is not None and failure.throttled:
            return self._throttled(row, failure)
        if failure is None:
            if log.isEnabledFor(logging.DEBUG):  # the fields cost more than the rest of a row
                log.debug("published", extra=self._event_fields(row, self.store.profile.delivered))
            self.failures.forget(row.event_id)
            return DeliveryResult(row.id, row.event_id, row.claim, Outcome.PUBLISHED)
        attempts, words = row.retry_count + 1, self.store.profile  # the row's status, in its table's words
        if self._parks(row, attempts, failure):
            outcome, status, retry_at = Outcome.PARKED, words.parked, 0
        else:
            outcome, status = Outcome.FAILED, words.retry
            retry_at = now_ms() + int(self.options.retry.delay(attempts, failure.permanent) * 1000)
        fields = self._event_fields(
            row, status, sink=failure.sink, error=failure.error, error_class=failure.error_class
        )
        fields["retry_count"] = attempts
        if outcome is Outcome.PARKED:
            log.warning("delivery failed; event parked", extra=fields)
            self.failures.forget(row.event_id)
            if self.telemetry.metrics_enabled:
                labels = {"sink": failure.sink, "event_type": self.router.event_label(row.event_type)}
                self.telemetry.count(self.telemetry.metrics.parked, {**labels, "error_class": str(failure.error_class)})
        else:
            self.failures.failed(row.event_id, "delivery failed", fields, failure.error)
        return DeliveryResult(row.id, row.event_id, row.claim, outcome, failure.error, retry_at)

    def _throttled(self, row: OutboxRow, failure: Failure) -> DeliveryResult:
        """A rate limit held the event back: this process's own (no request left) or the
        destination's (it refused the request for its rate): no attempt either way (no
        retry_count, no parking, no failure). Claimable again once the limit may have a slot
        for it, or at once when the sink cannot tell. A refusal by the destination is written
        to ``last_error`` by the same statement that releases the row: an event it keeps
        refusing shows why in ``inspect`` and ``status``."""
        if log.isEnabledFor(logging.DEBUG):
            back = self.store.profile.fresh if row.retry_count == 0 else self.store.profile.retry  # as released
            log.debug("throttled", extra=self._event_fields(row, back, sink=failure.sink, error=failure.error))
        due = 0 if failure.retry_after is None else now_ms() + math.ceil(failure.retry_after * 1000)
        error = f"throttled (not counted as an attempt): {failure.error}" if failure.refused else None
        return DeliveryResult(row.id, row.event_id, row.claim, Outcome.THROTTLED, error, due)

    def _parks(self, row: OutboxRow, attempts: int, failure: Failure) -> bool:
        """Whether this failure ends the event's retries. Even without `parking`: an event no
        sink takes (no retry can route it before the configuration changes), with per-room
        ordering any failure retrying cannot fix (a bad envelope, a permanent sink error), as
        left pending it would hold back every later event of its room for ever, and a row
        whose own limit of attempts this one reaches (silk's ``max_attempts``)."""
        if failure.error_class is ErrorClass.NO_ROUTE or (self.options.per_room and failure.permanent):
            return True
        if row.attempts_limit is not None and attempts >= row.attempts_limit:
            return True
        return self.options.retry.parks(attempts, failure.permanent)

    async def _deliver_one(self, row: OutboxRow, current: _InFlight) -> Failure | None:
        """Parse, route and deliver; ``None`` on success. A sink call that overruns
        ``publish_timeout`` is cancelled by ``current.scope`` (see :meth:`deliver_in_turn`)."""
        current.sink = "-"
        attempt = current.attempt
        route = self.router.sink_for(row.event_type)
        if route is None and self.router.skip_unrouted:
            attempt.finish(None)  # a lane whose sink does not take this type: handled, nothing to send
            return None
        try:
            envelope = self._envelope_of(row)
        except _BadEvent as exc:  # the event itself is unusable: retrying will not help
            return self.attempts.refused("-", exc.error_class, str(exc), attempt)
        attempt.parsed(envelope)  # its traceparent makes the attempt part of the producer's trace
        if route is None:
            no_route = f"no sink for event_type {row.event_type}"
            return self.attempts.refused("-", ErrorClass.NO_ROUTE, no_route, attempt)
        current.sink, sink = route
        return await self.attempts.run(current.sink, sink.deliver, envelope, attempt, current.scope, current.task)

    @staticmethod
    def _envelope_of(row: OutboxRow) -> EventEnvelope:
        try:
            envelope = parse_envelope(row.envelope)
        except EnvelopeError as exc:
            raise _BadEvent(str(exc), ErrorClass.BAD_ENVELOPE) from exc
        # app_code too: the sink picks credentials by the envelope's, ordering goes by the row's.
        mismatch = columns_differ(envelope, (row.event_id, row.event_type, row.room_id, row.app_code))
        if mismatch is not None:
            raise _BadEvent(mismatch, ErrorClass.BAD_ENVELOPE)
        return envelope

    async def _keep_leases(self) -> None:
        """Renew the leases of the rows held every third of the lease's length until cancelled."""
        interval = self.options.lease / 3
        while True:
            await anyio.sleep(interval)
            async with self._store_turn:
                # Claims settled since (their stale results reported with another cause, say) count no more.
                self._lost_at_renewal = {c: n for c, n in self._lost_at_renewal.items() if c in self._held}
                for claim, rows in list(self._held.items()):
                    row_ids = sorted(rows)
                    try:
                        held = await self.store.renew(claim, row_ids, now_ms() + int(self.options.lease * 1000))
                    except Exception as exc:
                        log.error(
                            "lease renewal failed",
                            extra={"lane": self.lane, "claim": claim, "error": self._short(str(exc))},
                        )
                        continue
                    if held < len(row_ids):
                        # Rows counted by an earlier renewal are still held (their results
                        # unwritten), and found gone again: only the rest are new.
                        gone = len(row_ids) - held
                        self.telemetry.leases_lost(max(0, gone - self._lost_at_renewal.get(claim, 0)), "renewal")
                        self._lost_at_renewal[claim] = gone
                        log.warning(
                            "lease lost on some rows (taken over by another claim)",
                            extra={"claim": claim, "rows": len(row_ids), "held": held},
                        )

    # -- helpers -------------------------------------------------------------------------

    async def _final_flush(self) -> None:
        try:
            await self.flush()
            if self._unrecorded:
                log.warning(
                    "results not written at shutdown: another session holds their rows locked;"
                    " their rows stay leased until the lease expires",
                    extra={"lane": self.lane, "unrecorded": len(self._unrecorded)},
                )
        except Exception as exc:
            log.error(
                "could not write results at shutdown; their rows stay leased until the lease expires",
                extra={"lane": self.lane, "unrecorded": len(self._unrecorded), "error": self._short(str(exc))},
            )

    def _report_stale(self, stale: Sequence[DeliveryResult]) -> None:
        """Results not written. A row the producer published itself meanwhile is the normal
        end of a race with its own push (INFO); a row another claim took over is a fault: a
        paused process or a lease too short for its batch (WARNING); so is a row whose claim
        failed after handing it over, before taking its lease (a database fault). One line per
        cause, not per row (one failed claim of a 10,000-row batch would be 10,000 lines): how
        many rows, their outcomes, and a few of their event ids and claims."""
        lines = {
            "published_by_producer": (logging.INFO, "results not recorded: the producer already published their rows"),
            "claim_failed": (
                logging.WARNING,
                "results not recorded: their claim failed before taking the rows' leases"
                " (claimable again: delivered twice at worst)",
            ),
            "taken_over": (
                logging.WARNING,
                "results not recorded: the claim no longer holds their rows (leases taken over)",
            ),
        }
        by_cause: dict[str, list[DeliveryResult]] = {cause: [] for cause in LEASE_LOSS_CAUSES}
        for result in stale:
            by_cause[self._stale_cause(result)].append(result)
        for cause, results in by_cause.items():
            first_seen = self._not_counted_at_renewal(results) if cause == "taken_over" else len(results)
            self.telemetry.leases_lost(first_seen, "result_write", cause)
            if not results:
                continue
            level, message = lines[cause]
            fields = {
                "lane": self.lane,
                "rows": len(results),
                "outcomes": dict(Counter(result.outcome.value for result in results)),
                "event_ids": [result.event_id for result in results[:5]],  # a sample
                "claims": sorted({result.claim for result in results})[:5],
            }
            log.log(level, message, extra=fields)

    def _not_counted_at_renewal(self, taken_over: Sequence[DeliveryResult]) -> int:
        """How many of these taken-over rows no renewal has counted. A row a renewal counted
        stays held until its result comes back stale here, so a claim's count is used up by
        its stale results (which of its rows they are does not change the total)."""
        new = 0
        for claim, rows in Counter(result.claim for result in taken_over).items():
            counted = self._lost_at_renewal.pop(claim, 0)
            if counted > rows:
                self._lost_at_renewal[claim] = counted - rows
            new += max(0, rows - counted)
        return new

    def _stale_cause(self, result: DeliveryResult) -> str:
        if result.published_by_producer:
            return "published_by_producer"
        return "claim_failed" if result.claim in self._failed_claims else "taken_over"

    def _short(self, text: str) -> str:
        return error_text(self.redactor, text)

    def _event_fields(self, row: OutboxRow, status: str, **more: object) -> dict[str, object]:
        return {
            "lane": self.lane,
            "event_id": row.event_id,
            "app_code": row.app_code,  # event ids are unique per app only, room ids repeat across apps
            "event_type": row.event_type,
            "room_id": row.room_id,
            "retry_count": row.retry_count,
            "status": status,
            **more,
        }

    def _describe(self) -> dict[str, object]:
        o = self.options
        return {
            "lane": self.lane,
            "batch_size": o.batch_size,
            "poll_interval": o.poll_interval,
            "publish_timeout": o.publish_timeout,
            "concurrency": o.concurrency,
            "retry_strategy": o.retry.strategy,
            "parking": o.retry.parking,
            "ordering": "per_room" if o.per_room else "none",
        }


@dataclass(frozen=True)
class Round:
    #: Rows claimed in the round, over all its claims.
    claimed: int
    #: Its last claim found fewer rows than it asked for: wait ``poll_interval`` before the next.
    exhausted: bool


class _BadEvent(Exception):
    """The event itself is unusable (envelope, routing): recorded as a failure."""

    def __init__(self, message: str, error_class: ErrorClass) -> None:
        super().__init__(message)
        self.error_class = error_class


class Feed:
    """The queues claimed in a round that no delivery worker has taken yet, and the number of
    claimed rows whose result is not in yet. Workers take queues without waiting while there
    are any. A worker with nothing to take waits for more; the claimer waits for every queue to
    be taken and the rows outstanding to fall to what it needs. Each waits on its own event,
    made only while somebody waits and set only when what it waits for may have come.

    ``chained`` (per-room ordering): a claim made ahead may take the next rows of a room whose
    earlier rows are still in flight in this process. Such a room's queue waits behind the
    room's queue being delivered and is taken once that one has ended with every row
    published; if one was not, the queues waiting behind it are released (the room's order
    holds: its later rows are claimed again once the one that failed is due)."""

    __slots__ = (
        "_chains",
        "_for_claimer",
        "_for_workers",
        "_wanted",
        "closed",
        "outstanding",
        "queues",
    )

    def __init__(self, chained: bool = False) -> None:
        self.queues: deque[Sequence[OutboxRow]] = deque()
        self.outstanding = 0
        #: No queue will be added any more: a worker finding none left ends.
        self.closed = False
        self._wanted = -1  # the claimer waits for outstanding <= this
        self._for_workers: anyio.Event | None = None
        self._for_claimer: anyio.Event | None = None
        #: Per room with a queue taken or ready: the queues waiting to follow it.
        self._chains: dict[tuple[str, str], deque[Sequence[OutboxRow]]] | None = {} if chained else None

    @property
    def chained(self) -> bool:
        return self._chains is not None

    def put(
        self,
        queues: Iterable[Sequence[OutboxRow]],
        rows: int,
        after: dict[tuple[str, str], list[int]] | None = None,
        unpublished: AbstractSet[int] = frozenset(),
    ) -> list[Sequence[OutboxRow]]:
        """Add ``queues`` (``rows`` rows). Chained, each room's queue follows the rows ``after``
        lists for its room, the rows of the room that were in flight when it was claimed.
        Return the queues to release at once: those following a row among ``unpublished``
        (ended without being published)."""
        self.outstanding += rows
        chains = self._chains
        if chains is None:
            self.queues.extend(queues)
            self._wake_workers()
            return []
        released = []
        for queue in queues:
            room = (queue[0].app_code, queue[0].room_id)
            follows = after.get(room) if after else None
            if follows and not unpublished.isdisjoint(follows):
                released.append(queue)
            elif room in chains:
                chains[room].append(queue)
            else:
                chains[room] = deque()
                self.queues.append(queue)
        self._wake_workers()
        return released

    def done(self, queue: Sequence[OutboxRow], published: bool) -> list[Sequence[OutboxRow]]:
        """A chained room's ``queue`` has ended, ``published`` if every row was: the next queue
        of its room becomes ready; if not, the queues waiting are returned, to be released."""
        assert self._chains is not None
        room = (queue[0].app_code, queue[0].room_id)
        waiting = self._chains[room]
        if not published:
            del self._chains[room]
            return list(waiting)
        if waiting:
            self.queues.append(waiting.popleft())
            self._wake_workers()
        else:
            del self._chains[room]
        return []

    def close(self) -> None:
        self.closed = True
        self._wake_workers()

    def take(self) -> Sequence[OutboxRow] | None:
        if not self.queues:
            return None
        queue = self.queues.popleft()
        if not self.queues:
            self._wake_claimer()
        return queue

    def settled(self, rows: int) -> None:
        self.outstanding -= rows
        if self.outstanding <= self._wanted:
            self._wake_claimer()

    async def more(self) -> None:
        """Until a queue is added or the feed closed."""
        if self._for_workers is None:
            self._for_workers = anyio.Event()
        await self._for_workers.wait()

    async def taken_and_outstanding_at_most(self, rows: int) -> None:
        """Until every queue has been taken by a worker and at most ``rows`` rows are
        outstanding."""
        self._wanted = rows
        try:
            while self.queues or self.outstanding > rows:
                self._for_claimer = anyio.Event()
                await self._for_claimer.wait()
        finally:
            self._wanted = -1
            self._for_claimer = None

    def _wake_workers(self) -> None:
        if self._for_workers is not None:
            self._for_workers.set()
            self._for_workers = None

    def _wake_claimer(self) -> None:
        if self._for_claimer is not None:
            self._for_claimer.set()


class _InFlight:
    """What one delivery worker is doing: the cancel scope that bounds its sink calls, and the
    row being attempted (its queue and position), its sink and its attempt, so that an
    overrun can be recorded once the scope has ended."""

    __slots__ = ("attempt", "position", "queue", "scope", "sink", "task")

    def __init__(self) -> None:
        #: The worker's task, which makes every call (see :func:`~room_outbox.attempt.failure.plugins_own`).
        self.task = asyncio.current_task()
        self.scope = anyio.CancelScope()
        self.queue: Sequence[OutboxRow] = ()
        self.position = 0
        self.sink = "-"
        self.attempt: DeliveryAttempt = NO_ATTEMPT
