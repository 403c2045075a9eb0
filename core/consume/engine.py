"""One consumer (``consumers.<name>``) in one process: a Kafka consumer-group member handling
the partitions it is assigned, and a retry worker on the shared retry table.

**Settling a fetched batch.** Messages are grouped by key (a room): groups run in parallel up
to ``concurrency``, a group's messages one after another in offset order. Each message goes to
every handler that takes its type and ends *settled*: handled (its processed record committed
with the handler's writes), scheduled for a retry, or a dead letter, each durable in the
database. Handlers that take many events at once (``handle_batch``) get the whole batch, every
room in offset order, in one transaction per handler first; the rest runs per message. Only
when the whole batch is settled are its offsets committed, so a crash re-delivers and never
skips; what was handled before the crash finds its record and is not handled again.

**Reading ahead.** While a batch settles, the next one is taken from what the broker has sent
already, routed, and its rooms held back by retries looked up; what the settling batch puts in
the retry table is added to those once it has settled. It is only read ahead: when the batch
before is not settled it is dropped and its partitions sought back; when partitions were
revoked meanwhile it is dropped (the new assignment reads from the committed offsets).

**Rebalances.** The batch in progress holds a lock that the revocation callback waits for:
partitions move to another member only after this member's batch is settled and committed,
so no message is handled by two members at the same time.

**Broker errors mid-stream.** A fetch the broker or the group refuses is tried again after a
pause, said once while it lasts (:func:`.joining.fetch_trouble`): the client rejoins its group
or reconnects by itself. A session timeout the broker refuses stops the consumer, as it does at
the join. A client whose group routine ended on an error says that error at every fetch and is
no longer a member (no heartbeat goes out): the member leaves and joins again as a new one, the
join saying what refuses it.

**Stopping.** No further message is started; the handlings in progress end or time out. Every
broker operation (fetch, commit, dead-letter copy, leaving the group) gets STOP_BROKER_TIMEOUT
more once the stop is asked, then is abandoned (:mod:`.broker_calls`): an offset not committed
only makes the next owner read again.

Handling one message (:mod:`.handling`), the retry worker (:mod:`.retries`), dead letters
(:mod:`.dead_letters`) and routing (:mod:`.messages`) are parts the consumer owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Set as AbstractSet
from typing import Any

import anyio
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import InvalidSessionTimeoutError, KafkaError
from anyio.abc import TaskStatus

from room_outbox.attempt.failure import describe, error_text
from room_outbox.config import TelemetrySettings
from room_outbox.consume.broker_calls import STOP_BROKER_TIMEOUT, Abandoned, BrokerCalls, cancel_abandoned_commit
from room_outbox.consume.dead_letters import DLQ_SEND_TIMEOUT, DeadLetters
from room_outbox.consume.handling import Handling
from room_outbox.consume.joining import (
    broker_unavailable,
    client_broken,
    fetch_trouble,
    refusal_hint,
    session_timeout_refused,
)
from room_outbox.consume.messages import Fetched, Message, Router
from room_outbox.consume.offsets import LagWatch, high_watermarks
from room_outbox.consume.registry import BoundHandler
from room_outbox.consume.retries import RetryBacklogWatch, RetryWorker
from room_outbox.consume.settings import MAX_GROUP_TIMEOUT_MS, ConsumerSettings
from room_outbox.handler import BatchHandler
from room_outbox.observability.metrics import ConsumerMetrics
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import RepeatedFailure
from room_outbox.observability.telemetry import Telemetry
from room_outbox.store.consumers.protocol import NO_HANDLER, ConsumerBatch, ConsumerStore, RetryRow

log = logging.getLogger("room_outbox.consume")

FETCH_TIMEOUT_MS = 500
#: Pause after a batch could not be settled (the database is down, say) before it is tried again.
BATCH_RETRY_PAUSE = 1.0
#: The last offset commit, when the consumer stops.
COMMIT_TIMEOUT = 10.0
#: One attempt to reach the broker and join the group; then a pause before the next.
JOIN_TIMEOUT = 30.0
JOIN_RETRY_PAUSE = 2.0
#: Pause after a fetch the broker or the group refused, before the next one.
FETCH_RETRY_PAUSE = 1.0
#: The look, on each assignment, at where the partitions' committed offsets stand in their logs.
OFFSETS_CHECK_TIMEOUT = 5.0


class Consumer:
    def __init__(
        self,
        name: str,
        settings: ConsumerSettings,
        store: ConsumerStore,
        handlers: dict[str, BoundHandler],
        node_id: str,
        redactor: Redactor,
        telemetry: Telemetry,
        lag_interval: float = TelemetrySettings().backlog_interval,
    ) -> None:
        self.name = name
        self.settings = settings
        self.store = store
        self.handlers = handlers
        self.redactor = redactor
        self.metrics = ConsumerMetrics(telemetry.meter, name, handlers)
        self.ordered = settings.ordering == "per_room"
        self.running = False
        self._stop = anyio.Event()
        #: Every operation on the broker goes through it: a stop abandons them in bounded time.
        self._on_broker = BrokerCalls(self._stop)
        self.router = Router(name, handlers)
        self.dead_letters = DeadLetters(name, settings, self.metrics, redactor, self._on_broker)
        self.handling = Handling(name, settings, store, telemetry, self.metrics, redactor, self.dead_letters)
        self.retries = RetryWorker(
            name, f"{node_id}#{name}", settings, store, self.router, self.handling, self.dead_letters, redactor,
            self._stop,
        )  # fmt: skip
        self._batch_lock = anyio.Lock()
        #: Counts revocations; a batch fetched under an older count is not settled.
        self._generation = 0
        #: Offsets of batches settled and not committed yet, and where they are committed.
        self._settled: dict[TopicPartition, int] = {}
        self._kafka: AIOKafkaConsumer | None = None
        #: (handler, room) pairs the settling batch has put in the retry table.
        self._retrying: set[tuple[str, str]] = set()
        #: Set when the consumer stopped mid-batch and left some of it unsettled.
        self._left_unsettled = False
        #: A batch fails again after every BATCH_RETRY_PAUSE while the database is away: logged
        #: as a recurring failure, not once a pause.
        self.settle_failing = RepeatedFailure(
            log, "batch not settled; fetching it again", "batches settle again", consumer=name
        )
        self._batch_handlers = [h for h in handlers.values() if isinstance(h.handler, BatchHandler)]
        #: The lag metric, read from the broker every ``lag_interval`` (none without metrics).
        self.lag_watch = (
            LagWatch(name, settings, self.metrics, redactor, lag_interval) if telemetry.metrics_enabled else None
        )
        #: The retry table's size, read from the database as often (run only with the lag's).
        self.retry_backlog = RetryBacklogWatch(name, store, self.metrics, redactor, lag_interval)
        self._lag_interval = lag_interval
        #: ``time.monotonic()`` when the member last had an answer from the broker (None: never).
        self._broker_reached_at: float | None = None
        #: The error of the fetch read ahead, met by the next plain fetch (aiokafka says a group
        #: error once, to the first fetch after it).
        self._ahead_error: KafkaError | None = None
        #: The kind of the failed fetches said last, said once while they last (None: fetching).
        self._fetch_said: str | None = None

    def stop(self) -> None:
        self._stop.set()
        self._on_broker.stop()

    def assigned_partitions(self) -> int:
        """The partitions this member holds: none while it is out of the group (not joined
        yet, rebalancing, or out of touch with the group's coordinator)."""
        kafka = self._kafka
        if kafka is None:
            return 0
        coordinator = kafka._coordinator
        # aiokafka keeps its last assignment while it cannot reach the group's coordinator (the
        # broker down or unreachable): once its heartbeats have failed for session_timeout it
        # marks the coordinator unknown, and the broker has dropped the member from the group by
        # then. An unknown member id: the broker no longer knows it, and it rejoins.
        if coordinator is None or coordinator.coordinator_id is None or not coordinator.member_id:
            return 0
        return len(kafka.assignment())

    def broker_check(self) -> str:
        """``/readyz``'s check of this consumer's broker: "ok" while the member has had an
        answer from it within ``session_timeout`` (the time the broker gives a silent member
        before its partitions go to the others), else why not, naming the broker."""
        reached = self._broker_reached_at
        if not self.running or reached is None:
            return f"not in its group yet (broker {self.settings.bootstrap_servers})"
        silent = time.monotonic() - reached
        if silent <= self.settings.session_timeout:
            return "ok"
        return (
            f"no answer from the broker {self.settings.bootstrap_servers} for {silent:.0f}s"
            f" (session_timeout {self.settings.session_timeout:g}s)"
        )

    async def _watch_broker(self) -> None:
        """Ask the broker for the topic's metadata, through the member's own client, as often
        as the member heartbeats, until the consumer stops: each answer is the time of the
        broker's last answer :meth:`broker_check` reads. The client's own retries never say
        that the broker is gone (a member keeps its partitions while it cannot reach it)."""
        interval = heartbeat_interval_ms(self.settings) / 1000
        while not self._stop.is_set():
            kafka = self._kafka
            if kafka is not None:
                with anyio.move_on_after(interval), contextlib.suppress(KafkaError):
                    if await kafka._client.force_metadata_update():
                        self._broker_reached_at = time.monotonic()
            with anyio.move_on_after(interval):
                await self._stop.wait()

    async def _report_membership(self) -> None:
        """The assigned-partitions metric, every lag interval (nothing to read but the
        client's state), until the consumer stops."""
        labels = {"consumer": self.name}
        while not self._stop.is_set():
            self.metrics.assigned.set(self.assigned_partitions(), labels)
            with anyio.move_on_after(self._lag_interval):
                await self._stop.wait()
        self.metrics.assigned.set(0, labels)

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Join the group (again and again while the broker does not answer) and consume
        until :meth:`stop`; the retry worker and the metrics' readings run from the start,
        member or not."""
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self.retries.run)
                tasks.start_soon(self._watch_broker)
                if self.lag_watch is not None:
                    tasks.start_soon(self.lag_watch.run, self._stop)
                    tasks.start_soon(self.retry_backlog.run, self._stop)
                    tasks.start_soon(self._report_membership)
                started = False
                while (kafka := await self._join()) is not None:
                    self.running = True
                    if not started:
                        task_status.started()
                        started = True
                    try:
                        await self._live_loop(kafka)
                        break
                    except _StartOver as start_over:
                        log.warning(
                            f"the Kafka client cannot go on ({type(start_over.error).__name__}): leaving the group"
                            " and joining it again as a new member",
                            extra={"consumer": self.name, "group": self.settings.group(self.name),
                                   "error": error_text(self.redactor, describe(start_over.error))},
                        )  # fmt: skip
                    finally:
                        self.running = False
                        # Leaves the group: the others take over at once (or, when the broker does
                        # not answer, after session_timeout).
                        with anyio.CancelScope(shield=True), anyio.move_on_after(10), contextlib.suppress(Abandoned):
                            await self._on_broker(kafka.stop)
                tasks.cancel_scope.cancel()
        finally:
            await self.dead_letters.close(STOP_BROKER_TIMEOUT)
            log.info("consumer stopped", extra={"lifecycle": "consumer_stopped", "consumer": self.name})

    async def _join(self) -> AIOKafkaConsumer | None:
        """A started group member; None when stopped before the broker answered."""
        s = self.settings
        # The longest a batch may take: the group waits that long for this member in a
        # rebalance, and the client that long between two fetches. A fetch is not made while
        # a batch settles: past max_poll_interval_ms (aiokafka's default, 300 s) the client
        # would leave the group without the revocation callback, and another member would
        # handle the batch's messages while this one still does.
        batch_bound_ms = rebalance_timeout_ms(s, len(self._batch_handlers))
        refused: str | None = None  # the refusal of the join said last, said once while it lasts
        while not self._stop.is_set():
            kafka = AIOKafkaConsumer(
                bootstrap_servers=s.bootstrap_servers,
                group_id=s.group(self.name),
                client_id=s.client_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                session_timeout_ms=int(s.session_timeout * 1000),
                heartbeat_interval_ms=heartbeat_interval_ms(s),
                rebalance_timeout_ms=batch_bound_ms,
                max_poll_interval_ms=batch_bound_ms,
                max_poll_records=s.max_batch,
                **s.security.client_kwargs(),
            )
            kafka.subscribe([s.topic], listener=_SettleBeforeRevoke(self, kafka))
            try:
                await self._start(kafka)
            except (KafkaError, TimeoutError, OSError, Abandoned) as exc:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5), contextlib.suppress(Abandoned):
                    await self._on_broker(kafka.stop)
                if self._stop.is_set():
                    break
                if isinstance(exc, InvalidSessionTimeoutError):  # no join can ever succeed
                    raise await session_timeout_refused(s, self.name, exc) from None
                refused = self._join_refused(exc, refused)
                with anyio.move_on_after(JOIN_RETRY_PAUSE):
                    await self._stop.wait()
                continue
            log.info(
                "consumer started",
                extra={"lifecycle": "consumer_started", "consumer": self.name, "group": s.group(self.name),
                       "topic": s.topic, "handlers": list(self.handlers)},
            )  # fmt: skip
            self._broker_reached_at = time.monotonic()
            return kafka
        return None

    async def _start(self, kafka: AIOKafkaConsumer) -> None:
        """``kafka.start()``: the broker reached and the group joined. Past JOIN_TIMEOUT
        without the group's coordinator, the broker is unavailable (TimeoutError). With it,
        the join waits for a rebalance to complete, which waits for every member to rejoin,
        and a member rejoins only once its batch is settled (:class:`_SettleBeforeRevoke`):
        the join goes on, said every JOIN_TIMEOUT. A client started anew would join as a new
        member, one more for the rebalance to wait for, again and again while it is held."""
        starting = asyncio.ensure_future(kafka.start())
        try:
            while True:
                with anyio.move_on_after(JOIN_TIMEOUT):
                    await self._on_broker(lambda: asyncio.shield(starting))
                    return
                if not (_coordinator_found(kafka) or _member_id(kafka)):
                    raise TimeoutError
                if _coordinator_found(kafka):
                    log.warning(
                        "group rebalance did not complete (the broker answers; a member may be settling a long"
                        " batch, up to handler_timeout per message); still waiting, as the same member",
                        extra={"consumer": self.name, "group": self.settings.group(self.name), "waited": JOIN_TIMEOUT,
                               "member_id": _member_id(kafka)},
                    )  # fmt: skip
                else:
                    self._join_refused(TimeoutError(), None)
        finally:
            if not starting.done():
                starting.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(5), contextlib.suppress(BaseException):
                await starting  # its outcome was met above, or it is given up

    def _join_refused(self, exc: BaseException, said: str | None) -> str | None:
        """Log a failed join: the broker unavailable, every time; any other refusal by its
        Kafka error class and the fix, once while it lasts (``said``: the refusal logged
        last). Returns the refusal now logged."""
        if broker_unavailable(exc):
            log.warning(
                "broker unavailable; trying again",
                extra={
                    "consumer": self.name,
                    "bootstrap_servers": self.settings.bootstrap_servers,
                    "error": error_text(self.redactor, describe(exc)),
                },
            )
            return None
        kind = type(exc).__name__
        if kind != said:
            log.error(
                f"the broker refuses the group join ({kind}): {refusal_hint(exc, self.name)}; trying again",
                extra={"consumer": self.name, "group": self.settings.group(self.name),
                       "error": error_text(self.redactor, describe(exc))},
            )  # fmt: skip
        return kind

    async def _live_loop(self, kafka: AIOKafkaConsumer) -> None:
        """Fetch, settle, commit, one batch after another, the next read ahead while one
        settles (mostly a wait on the database), so its routing and look-up are off the
        critical path. A settled batch's offsets are committed while the next one settles,
        or at once when nothing more comes, partitions are revoked or the consumer stops."""
        ahead: Fetched | None = None
        retrying: set[tuple[str, str]] = set()  # what the batch before put in the retry table
        self._kafka = kafka
        self._ahead_error = None
        self._fetch_said = None
        try:
            while not self._stop.is_set():
                ahead, retrying = await self._next_batch(kafka, ahead, retrying)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(COMMIT_TIMEOUT):
                await self._commit_settled()
            self._kafka = None

    async def _next_batch(
        self, kafka: AIOKafkaConsumer, ahead: Fetched | None, retrying: set[tuple[str, str]]
    ) -> tuple[Fetched | None, set[tuple[str, str]]]:
        """Settle one batch (``ahead`` if read already); returns the batch read ahead
        meanwhile and what this one put in the retry table."""
        try:
            fetched = ahead or await self._fetch(kafka, FETCH_TIMEOUT_MS)
        except KafkaError as exc:
            await self._fetch_failed(kafka, exc)
            return None, retrying
        if self._fetch_said is not None:
            self._fetch_said = None
            log.info("fetching again", extra={"consumer": self.name})
        if fetched is None:
            async with self._batch_lock:
                await self._commit_settled()
            return None, retrying
        async with self._batch_lock:
            if fetched.generation != self._generation:
                return None, set()
            following: list[Fetched] = []
            error: Exception | None = None
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._fetch_ahead, kafka, following)
                tasks.start_soon(self._commit_settled)
                try:
                    retrying = await self._settle(fetched, retrying)
                except Exception as exc:
                    error = exc
            ahead = following[0] if following else None
            if error is None:
                self._settled.update(fetched.offsets)
                self.settle_failing.succeeded()
                return ahead, retrying
            if isinstance(error, _Stopping):
                log.info(
                    "stopping mid-batch: its offsets are not committed, and what it had not handled yet is"
                    " handled after (what it had is found processed)",
                    extra={"consumer": self.name, "lifecycle": "stop_requested"},
                )
                return None, set()
            # Nothing of this batch is committed: fetch it again from its first offsets after a
            # pause; what it settled already is found as processed.
            self.settle_failing.failed(error_text(self.redactor, describe(error)))
            for tp, offset in {**(ahead.first if ahead else {}), **fetched.first}.items():
                kafka.seek(tp, offset)
            with anyio.move_on_after(BATCH_RETRY_PAUSE):
                await self._stop.wait()
            return None, set()

    async def _commit_settled(self) -> None:
        """Commit the offsets of the batches settled since the last commit."""
        offsets, self._settled = self._settled, {}
        kafka = self._kafka
        if not offsets or kafka is None:
            return
        try:
            await self._on_broker(lambda: kafka.commit(offsets))
        except Abandoned:
            cancel_abandoned_commit(kafka)
            log.warning(
                "offset commit abandoned: the broker did not answer while the consumer stops; the"
                " partitions' next owner reads these messages again and finds them processed",
                extra={"consumer": self.name, "partitions": sorted(tp.partition for tp in offsets)},
            )
            return
        except KafkaError as exc:
            # The partitions moved on (a rebalance): their new owner re-reads from the last
            # commit and finds these messages processed.
            log.warning(
                "offset commit failed", extra={"consumer": self.name, "error": error_text(self.redactor, describe(exc))}
            )
            return

    async def _fetch_failed(self, kafka: AIOKafkaConsumer, exc: KafkaError) -> None:
        """A fetch the broker or the group refused (aiokafka's fetch says the errors of the
        group's background routines too): say it once while it lasts and pause before the next
        (the client rejoins or reconnects meanwhile). A session timeout the broker refuses stops
        the consumer, as at the join; a client that cannot go on starts over (:class:`_StartOver`)."""
        if self._stop.is_set():
            return  # the loop ends: nothing more is fetched
        if isinstance(exc, InvalidSessionTimeoutError):  # no join can ever succeed
            raise await session_timeout_refused(self.settings, self.name, exc) from None
        if client_broken(kafka):
            raise _StartOver(exc)
        kind = type(exc).__name__
        if kind != self._fetch_said:
            self._fetch_said = kind
            level, message = fetch_trouble(exc, self.name)
            log.log(
                level, message,
                extra={"consumer": self.name, "group": self.settings.group(self.name),
                       "bootstrap_servers": self.settings.bootstrap_servers,
                       "error": error_text(self.redactor, describe(exc))},
            )  # fmt: skip
        with anyio.move_on_after(FETCH_RETRY_PAUSE):
            await self._stop.wait()

    async def _fetch(self, kafka: AIOKafkaConsumer, timeout_ms: int) -> Fetched | None:
        """The next batch, routed; None when none came within ``timeout_ms`` (or the consumer
        stops and the broker does not answer). The error of the fetch read ahead, if any, is
        this one's."""
        if self._ahead_error is not None:
            error, self._ahead_error = self._ahead_error, None
            raise error
        try:
            batch = await self._on_broker(
                lambda: kafka.getmany(timeout_ms=timeout_ms, max_records=self.settings.max_batch)
            )
        except Abandoned:
            return None
        return await self.router.route_batch(batch, self._generation) if batch else None

    async def _fetch_ahead(self, kafka: AIOKafkaConsumer, into: list[Fetched]) -> None:
        """The next batch, routed, and its rooms held back by retries as they are now (what
        the settling batch puts in the retry table is added when it has settled)."""
        try:
            fetched = await self._fetch(kafka, 0)
        except KafkaError as exc:
            self._ahead_error = exc  # the next plain fetch says it (aiokafka says it only once)
            return
        if fetched is None:
            return
        into.append(fetched)
        if self.ordered:
            try:
                fetched.blocked = await self.store.blocked_rooms(self.name, set(fetched.rooms))
            except Exception:
                return  # settling it looks again

    # -- the live path ------------------------------------------------------------------------

    async def _settle(self, fetched: Fetched, retrying: set[tuple[str, str]]) -> set[tuple[str, str]]:
        """Settle the batch; ``retrying``: the (handler, room) pairs the batch before put in
        the retry table. Returns those this one put there."""
        rooms = fetched.rooms
        blocked: set[tuple[str, str]] = set()
        if self.ordered:
            looked_up = fetched.blocked
            if looked_up is None:
                looked_up = await self.store.blocked_rooms(self.name, set(rooms))
            blocked = looked_up | retrying
        self._retrying = set()
        self._left_unsettled = False
        done = await self._settle_batch_handlers(list(rooms.values()), blocked) if self._batch_handlers else set()
        # What is left (handlers one message at a time, dead letters, the batch handlers'
        # fallback): up to `concurrency` chunks of whole rooms, each settled in one transaction.
        if len(done) == fetched.handlings and not fetched.rejected:
            return self._retrying
        if self._stop.is_set():
            raise _Stopping
        groups = [room for room in rooms.values() if self._unsettled(room, done)]
        width = min(self.settings.concurrency, len(groups))
        async with anyio.create_task_group() as tasks:
            for n in range(width):
                tasks.start_soon(self._settle_chunk, groups[n::width], blocked, done)
        if self._left_unsettled:
            raise _Stopping
        return self._retrying

    @staticmethod
    def _unsettled(room: list[Message], done: AbstractSet[tuple[int, int, str]]) -> bool:
        return any(
            m.rejected is not None or any((m.partition, m.offset, h.name) not in done for h in m.handlers) for m in room
        )

    async def _settle_batch_handlers(
        self, rooms: list[list[Message]], blocked: set[tuple[str, str]]
    ) -> set[tuple[int, int, str]]:
        """Every room of the fetch for each batch handler: one ``handle_batch`` call and one
        transaction per handler, its processed records one multi-row statement. Parallel
        transactions would only add commits: the work is a few multi-row statements whatever
        the number of messages. Returns the (partition, offset, handler) handlings committed."""
        done: set[tuple[int, int, str]] = set()
        for handler in self._batch_handlers:
            messages = [
                m for room in rooms for m in room
                if m.rejected is None and handler in m.handlers and (handler.name, m.held_key) not in blocked
            ]  # fmt: skip
            done |= await self.handling.handle_many(messages, handler)
        return done

    async def _settle_chunk(
        self, rooms: list[list[Message]], blocked: set[tuple[str, str]], done: AbstractSet[tuple[int, int, str]]
    ) -> None:
        """The rooms' messages in one transaction (each handling in a savepoint), one room
        after another, but the handlings in ``done``. If that transaction cannot complete (a
        handler timed out, the connection broke), everything in it is rolled back and the
        messages are settled again one transaction each.

        Once the consumer is told to stop, no further message is started (what is settled is
        committed) and a chunk that failed is not settled again: the stop waits for the
        handlings in progress only, each at most ``handler_timeout``, and the rest waits in
        Kafka, its offsets not committed."""
        dead: list[tuple[RetryRow, str]] = []
        messages = sum(len(room) for room in rooms)
        limit = self.settings.handler_timeout * (messages + 1)
        try:
            with anyio.fail_after(limit):
                async with self.store.batch(limit) as batch:
                    for room in rooms:
                        await self._settle_room(room, blocked, batch, dead, done)
        except Exception as exc:
            if self._stop.is_set():
                self._left_unsettled = True
                return  # rolled back: its messages are handled again after
            log.warning(
                "chunk not settled in one transaction; settling its messages one by one",
                extra={"consumer": self.name, "messages": messages, "error": error_text(self.redactor, describe(exc))},
            )
            dead = []
            for room in rooms:
                await self._settle_room(room, blocked, None, dead, done)
        await self.dead_letters.announce(dead)

    async def _settle_room(
        self,
        messages: list[Message],
        blocked: set[tuple[str, str]],
        batch: ConsumerBatch | None,
        dead: list[tuple[RetryRow, str]],
        done: AbstractSet[tuple[int, int, str]] = frozenset(),
    ) -> None:
        """One room's messages in offset order (but the (partition, offset, handler) handlings
        in ``done``). A handler that fails on one of them holds back the room's later
        messages for that handler (with ``ordering: per_room``): they wait in the retry table
        behind it."""
        outcomes: ConsumerBatch | ConsumerStore = batch if batch is not None else self.store
        held: set[str] = {handler for handler, room in blocked if room == messages[0].held_key}
        for message in messages:
            if self._stop.is_set():
                self._left_unsettled = True  # the room's later messages too: its order holds
                return
            if message.rejected is not None:
                row = message.retry_row(self.name, NO_HANDLER, 1, message.rejected)
                row = await self.handling.write_row(outcomes, row, dead=True) or row
                dead.append((row, "rejected"))
                continue
            for handler in message.handlers:
                if (message.partition, message.offset, handler.name) in done:
                    continue
                if handler.name in held:
                    waiting = message.retry_row(
                        self.name, handler.name, 0, "waiting behind an earlier event of its room"
                    )
                    refused = await self.handling.write_row(outcomes, waiting)
                    if refused is not None:
                        dead.append((refused, "failed"))
                    else:
                        self._retrying.add((handler.name, message.held_key))
                    continue
                result = await self.handling.handle(message, handler, attempt=1, retry=None, batch=batch, dead=dead)
                if result == "retry":
                    self._retrying.add((handler.name, message.held_key))
                if result != "done" and self.ordered:
                    held.add(handler.name)


class _Stopping(Exception):
    """The consumer stopped while settling a batch, leaving some of it unsettled."""


class _StartOver(Exception):
    """The member's client cannot go on (:func:`.joining.client_broken`): it leaves and the
    consumer joins again with a new one."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(str(error))
        self.error = error


def heartbeat_interval_ms(settings: ConsumerSettings) -> int:
    """How often a member tells the broker it is alive: three times a session timeout."""
    return max(100, int(settings.session_timeout * 1000 / 3))


def rebalance_timeout_ms(settings: ConsumerSettings, batch_handlers: int) -> int:
    """How long the group waits for this member to rejoin in a rebalance, in milliseconds. A
    member gives up its partitions only once its batch is settled (:class:`_SettleBeforeRevoke`),
    so the wait must outlast the longest batch its own deadlines allow: each batch handler's
    call, every message twice (in its chunk's transaction, then alone if that one failed), the
    dead-letter copies and the commit. Shorter (aiokafka's default is ``session_timeout``), a
    slow batch would lose its partitions mid-way and its messages be handled again. It is the
    client's ``max_poll_interval_ms`` too: no fetch is made while a batch settles.

    Capped at what the protocol can carry rather than refused: only a batch whose handlings
    nearly all time out, twice, would take longer, and a long ``handler_timeout`` is a setting
    people need."""
    messages = batch_handlers + 2 * (settings.max_batch + 1)
    batch = settings.handler_timeout * messages + DLQ_SEND_TIMEOUT + COMMIT_TIMEOUT
    return min(MAX_GROUP_TIMEOUT_MS, math.ceil(max(settings.session_timeout, batch) * 1000))


def _member_id(kafka: AIOKafkaConsumer) -> str:
    """The member id the broker gave this client for its group ("" before it gave one)."""
    coordinator = kafka._coordinator
    return str(getattr(coordinator, "member_id", "") or "")


def _coordinator_found(kafka: AIOKafkaConsumer) -> bool:
    """Whether the client got as far as the group's coordinator: the broker answered its
    metadata and coordinator requests, and only the join itself was left. A join waits for
    the rebalance to complete, which waits for every member to rejoin, and a member rejoins
    only once its batch is settled (:class:`_SettleBeforeRevoke`)."""
    coordinator = kafka._coordinator  # made by start() once the metadata is read
    return coordinator is not None and coordinator.coordinator_id is not None


class _SettleBeforeRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
    """Partitions leave this member only once the batch in progress is settled and what is
    settled is committed."""

    def __init__(self, consumer: Consumer, kafka: AIOKafkaConsumer) -> None:
        self.consumer = consumer
        self.kafka = kafka

    async def on_partitions_revoked(self, revoked: Any) -> None:
        async with self.consumer._batch_lock:
            self.consumer._generation += 1
            await self.consumer._commit_settled()
            log.info(
                "partitions revoked",
                extra={"consumer": self.consumer.name, "partitions": sorted(tp.partition for tp in revoked)},
            )

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info(
            "partitions assigned",
            extra={"consumer": self.consumer.name, "partitions": sorted(tp.partition for tp in assigned)},
        )
        # It only informs: the fetch meets a broker that does not answer by itself.
        with anyio.move_on_after(OFFSETS_CHECK_TIMEOUT), contextlib.suppress(KafkaError):
            await self._report_offsets_out_of_range(sorted(assigned))

    async def _report_offsets_out_of_range(self, assigned: list[TopicPartition]) -> None:
        """Where a committed offset is outside its partition's log, say so and read from the
        log's beginning. Kafka's answer to such a fetch makes the client do that, saying so only
        at INFO; a broker that answers it with nothing at all would leave the partition unread.
        An offset past the looked-up end is confirmed with a fetch first (:func:`fetched_ends`)."""
        if not assigned:
            return
        first = await self.kafka.beginning_offsets(assigned)
        end = await self.kafka.end_offsets(assigned)
        committed = {tp: await self.kafka.committed(tp) for tp in assigned}
        beyond = [tp for tp in assigned if (committed[tp] or 0) > end[tp]]
        if beyond:
            end.update(await fetched_ends(self.consumer.settings, beyond, end))
        for tp in assigned:
            problem = offset_out_of_range(committed[tp], first[tp], end[tp])
            if problem is not None:
                level, message = problem
                log.log(level, message, extra={"consumer": self.consumer.name, "partition": tp.partition,
                                               "committed": committed[tp], "log_start": first[tp], "log_end": end[tp]})  # fmt: skip
                self.kafka.seek(tp, first[tp])


async def fetched_ends(
    settings: ConsumerSettings, partitions: list[TopicPartition], listed: dict[TopicPartition, int]
) -> dict[TopicPartition, int]:
    """Each partition's end as a fetch reports it (its high watermark), read from where the
    offsets lookup (``listed``) says the end is. The lookup alone can lag by the last batch on
    some brokers (seen on tansu): a caught-up consumer's committed offset would look past the
    end. A reader of its own, outside the group: the member's positions stay as they are. The
    caller bounds the wait."""
    reader = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, client_id=settings.client_id,
        enable_auto_commit=False, **settings.security.client_kwargs(),
    )  # fmt: skip
    try:
        await reader.start()
        return await high_watermarks(reader, partitions, listed)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await reader.stop()


def offset_out_of_range(committed: int | None, first: int, end: int) -> tuple[int, str] | None:
    """What a member is told where a partition's committed offset is not in its log
    (``first`` to ``end``, the next offset written), and at which level; None where it is, or
    where nothing is committed yet (a new group reads from the beginning)."""
    if committed is None or first <= committed <= end:
        return None
    if committed < first:
        return logging.ERROR, (
            f"{first - committed} messages were deleted by the topic's retention before this consumer"
            " handled them: it goes on from the oldest message left; keep messages longer than the"
            " consumer may fall behind (retention.ms)"
        )
    return logging.WARNING, (
        "the committed offset is past the end of the partition (the topic deleted and created"
        " again?): this consumer reads the partition from its beginning"
    )


__all__ = ["Consumer"]
