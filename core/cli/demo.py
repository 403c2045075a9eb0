"""``room-outbox demo``: the whole pipeline on a bare machine, checked end to end.

All in this process: an outbox (a SQLite file in a temporary folder, or the database ``--db``
names), the fake Tencent IM on a loopback port with faults injected, and a small room service
committing events and pushing them itself, some pushes failing and some never attempted (a
"restart" right after the commit), with the dispatcher compensating for both. A live table
shows the run; then it is verified (:func:`verify`) and the cost of the race with the room
service's own push is reported (:func:`race_report`). Exit code 0 only when every check holds,
1 when one does not, 2 for bad arguments. A ``--db`` holding rows the demo did not make is
refused unchanged (:func:`_refuse_rows_of_others`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import logging
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import anyio

from room_outbox.attempt.retry import RetryPolicy
from room_outbox.cli.command import Command
from room_outbox.config import ConfigError, OutboxWorkerSettings, Settings, parse_duration
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.routing import Router, build_router
from room_outbox.envelope import EventEnvelope
from room_outbox.observability.logs import configure_logging
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.tencent_im.fake import SINK_NAME, FakeTencentIM, Faults, serve_fake_im
from room_outbox.producer import OutboxProducer, StoreProducer, append_event
from room_outbox.sink import Sink
from room_outbox.store.backends.postgres_address import SCHEMES as POSTGRESQL_SCHEMES
from room_outbox.store.backends.sqlite import SQLiteAddress
from room_outbox.store.factory import describe, is_sqlite, open_store, store_address
from room_outbox.store.operator.reports import count_by_status, holds_rows_besides, status_by_event
from room_outbox.store.protocol import SQLStore

log = logging.getLogger("room_outbox.demo")

#: The sink the fake stands in for (the demo checks what reached it).
IM_SINK = SINK_NAME
#: Under this the fake IM would answer every request: the default makes compensation visible.
DEFAULT_FAILURE_RATE = 0.2
DEFAULT_EVENTS = 200
#: The room-outbox default (V1's hybrid deployment: the room service pushes every event).
DEFAULT_CLAIM_AFTER = OutboxWorkerSettings.model_fields["claim_after"].default
#: Every event_id the demo makes starts with this: rows without it are someone else's.
RUN_PREFIX = "demo-"


@dataclass(frozen=True)
class DemoOptions:
    #: ``mysql://…``, ``postgresql://…`` or ``sqlite:///…``; None: a SQLite file in a temporary folder.
    db: str | None = None
    events: int = DEFAULT_EVENTS
    #: Share of requests the fake IM fails (error codes, HTTP 502, rate-control drops); a
    #: quarter of it is also the share of commands whose synchronous push is never attempted.
    failure_rate: float = DEFAULT_FAILURE_RATE
    per_room: bool = True
    #: Keep the temporary folder (SQLite file, log) and print where it is.
    keep: bool = False
    seed: int | None = None
    #: Give up verifying after this long once the commands are done.
    timeout: float = 60.0
    #: Seconds over which the commands are spread (so the live table has something to show).
    produce_over: float = 3.0
    #: ``outbox_worker.claim_after``: the age a row must reach before the dispatcher claims it.
    claim_after: float = DEFAULT_CLAIM_AFTER


# -- the simulated room service ---------------------------------------------------------------


def plan_commands(events: int, rng: random.Random) -> dict[str, list[list[tuple[str, dict[str, Any]]]]]:
    """room_id → its commands in order, each command the events it commits together.

    Every room is created first and closed last; in between users join, send gifts (a gift
    also changes the room's heat), take and leave mic seats, and the heat changes on its own.
    """
    rooms = [f"r_{n:03d}" for n in range(max(2, events // 20))]
    plans: dict[str, list[list[tuple[str, dict[str, Any]]]]] = {
        room: [[("RoomCreated", {"owner": f"u_{room}"})]] for room in rooms
    }
    budget = events - 2 * len(rooms)  # each room: one RoomCreated and one RoomClosed
    members: dict[str, list[str]] = {room: [] for room in rooms}
    user_numbers = iter(range(1, 10**9))
    while budget > 0:
        room = rng.choice(rooms)
        choice = rng.random()
        command: list[tuple[str, dict[str, Any]]]
        if not members[room] or choice < 0.3:
            user = f"u{next(user_numbers)}"
            members[room].append(user)
            command = [("RoomUserJoined", {"user_id": user})]
        elif choice < 0.55 and budget >= 2:
            user = rng.choice(members[room])
            amount = rng.randint(1, 50)
            command = [
                ("RoomGiftSent", {"user_id": user, "gift": rng.choice(["rose", "rocket", "crown"]), "amount": amount}),
                ("RoomHeatChanged", {"delta": amount * 10}),
            ]
        elif choice < 0.9:
            command = [("RoomMicChanged", {"seat": rng.randint(0, 7), "user_id": rng.choice(members[room])})]
        else:
            command = [("RoomHeatChanged", {"delta": rng.randint(-20, 20)})]
        plans[room].append(command)
        budget -= len(command)
    for room in rooms:
        plans[room].append([("RoomClosed", {"reason": "demo over"})])
    return plans


@dataclass
class Tally:
    """What happened, for the live table and the verification."""

    committed: int = 0
    commands: int = 0
    pushed_ok: int = 0
    push_failed: int = 0
    push_skipped: int = 0
    produced_all: bool = False
    #: event_id → its envelope, for every event of the run.
    events: dict[str, EventEnvelope] = field(default_factory=dict)
    #: Dispatcher attempts: (room_id, room_version, event_id, succeeded), in order.
    attempts: list[tuple[str, int, str, bool]] = field(default_factory=list)
    #: Events the room service pushed to IM itself.
    pushed: set[str] = field(default_factory=set)
    #: Requests the dispatcher sent to IM, by event_id.
    im_requests: Counter[str] = field(default_factory=Counter)
    #: event_id → when it was committed, and when the dispatcher first delivered it (monotonic).
    committed_at: dict[str, float] = field(default_factory=dict)
    delivered_at: dict[str, float] = field(default_factory=dict)
    _numbers: Iterator[int] = field(default_factory=itertools.count)

    def next_event_id(self, run_id: str) -> str:
        return f"{run_id}-{next(self._numbers):05d}"

    @property
    def sent_again(self) -> int:
        """Requests the dispatcher sent for events the room service had pushed itself."""
        return sum(n for event_id, n in self.im_requests.items() if event_id in self.pushed)

    def not_pushed_delays(self) -> list[float]:
        """Seconds from commit to the dispatcher's delivery of each IM event the room service
        did not push (its push failed or was never tried), sorted."""
        return sorted(
            at - self.committed_at[event_id]
            for event_id, at in self.delivered_at.items()
            if event_id not in self.pushed and event_id in self.committed_at and self.im_requests[event_id]
        )


class _ObservedSink:
    """The dispatcher's view of a sink: records each attempt (for the live table and the
    per-room order check), delivers through the real sink, owns nothing."""

    def __init__(self, name: str, inner: Sink, tally: Tally) -> None:
        self._name = name
        self._inner = inner
        self._tally = tally

    async def deliver(self, envelope: EventEnvelope) -> None:
        if self._name == IM_SINK:
            self._tally.im_requests[envelope.event_id] += 1
        try:
            await self._inner.deliver(envelope)
        except BaseException:
            self._record(envelope, False)
            raise
        self._record(envelope, True)

    def _record(self, envelope: EventEnvelope, ok: bool) -> None:
        self._tally.attempts.append((envelope.room_id, envelope.room_version or 0, envelope.event_id, ok))
        if ok:
            self._tally.delivered_at.setdefault(envelope.event_id, time.monotonic())

    async def aclose(self) -> None:
        return None  # the shared router closes the real sink


async def run_room(
    room: str,
    commands: Sequence[list[tuple[str, dict[str, Any]]]],
    store: SQLStore,
    producer: OutboxProducer,
    tally: Tally,
    run_id: str,
    rng: random.Random,
    skip_rate: float,
    pause: float,
) -> None:
    """One room's commands, one after another (one Room Cell per room): state and events
    commit together, then the synchronous push, whose failure never fails the command."""
    version = 0
    for command in commands:
        events = []
        async with store.transaction() as cur:
            for event_type, payload in command:
                version += 1
                events.append(
                    await append_event(
                        cur,
                        EventEnvelope(
                            event_id=tally.next_event_id(run_id),
                            event_type=event_type,
                            app_code="default",
                            room_id=room,
                            room_version=version,
                            occurred_at_ms=int(time.time() * 1000),
                            command_id=f"cmd-{uuid.uuid4().hex[:12]}",
                            payload=payload,
                        ),
                        store.dialect,
                    )
                )
        committed = time.monotonic()
        for event in events:
            tally.events[event.event_id] = event
            tally.committed_at[event.event_id] = committed
        tally.commands += 1
        tally.committed += len(events)
        for event in events:
            if rng.random() < skip_rate:
                tally.push_skipped += 1  # the service "restarted" between commit and push
                continue
            outcome = await producer.publish_committed(event)
            if outcome.published:
                tally.pushed_ok += 1
                tally.pushed.add(event.event_id)
            else:
                tally.push_failed += 1
        await anyio.sleep(pause)  # pacing the simulation, not waiting for anything


# -- progress and verification ----------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    statuses: dict[str, int]
    retries: int
    im_requests: int
    im_rejected: int
    im_received: int
    im_duplicates: int

    @property
    def pending(self) -> int:
        return self.statuses.get("pending", 0)


async def snapshot(store: SQLStore, run_id: str, fake: FakeTencentIM, tally: Tally) -> Snapshot:
    statuses = await count_by_status(store, f"{run_id}-")
    rejected = sum(1 for a in fake.arrivals if a.http_status != 200 or a.error_code)
    return Snapshot(
        statuses=statuses,
        retries=sum(1 for *_, ok in tally.attempts if not ok),
        im_requests=len(fake.arrivals),
        im_rejected=rejected,
        im_received=len({m.event_id for m in fake.messages if (m.event_id or "").startswith(run_id)}),
        im_duplicates=fake.duplicates,
    )


def render(tally: Tally, snap: Snapshot, total: int, elapsed: float) -> list[str]:
    published = snap.statuses.get("published", 0)
    width = 30
    filled = int(width * published / total) if total else width
    return [
        f"  outbox     [{'#' * filled}{'.' * (width - filled)}] {published}/{total} published   {elapsed:5.1f}s",
        f"  commands   {tally.commands} committed, {tally.committed} events"
        + ("" if tally.produced_all else " (room service running)"),
        f"  sync push  {tally.pushed_ok} ok, {tally.push_failed} failed, {tally.push_skipped} never tried;"
        f" {tally.sent_again} sent again by the dispatcher",
        f"  outbox     {snap.pending} pending, {published} published, {snap.statuses.get('failed', 0)} parked",
        f"  dispatcher {sum(1 for *_, ok in tally.attempts if ok)} delivered, {snap.retries} failed attempts (retried)",
        f"  fake IM    {snap.im_requests} requests, {snap.im_rejected} failed on purpose, "
        f"{snap.im_received} events received, {snap.im_duplicates} duplicates discarded",
    ]


class LiveView:
    """On a terminal, redraws the table in place. Elsewhere (a pipe, a file, CI's log) a table
    redrawn is a table repeated, so it prints one plain progress line every few seconds and
    the table once, at the end."""

    PROGRESS_EVERY = 2.0

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tty = out.isatty()
        self._lines = 0
        self._last = time.monotonic()

    def show(self, lines: list[str], final: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            up = f"\x1b[{self._lines}F" if self._lines else ""
            self.out.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
            self._lines = len(lines)
        elif final:
            self.out.write("\n".join(lines) + "\n\n")
        elif now - self._last >= self.PROGRESS_EVERY:
            self.out.write(f"  progress: {progress(lines)}\n")
            self._last = now
        self.out.flush()


def progress(lines: list[str]) -> str:
    """The table's first line without its bar: ``120/200 published   3.1s``."""
    return " ".join(lines[0].split("]", 1)[-1].split())


@dataclass(frozen=True)
class Check:
    ok: bool
    text: str


def verify(
    events: Mapping[str, EventEnvelope],
    statuses: Mapping[str, str],
    received: Sequence[str | None],
    routes: Mapping[str, str],
    attempts: Sequence[tuple[str, int, str, bool]],
    per_room: bool,
) -> list[Check]:
    """The demo's acceptance: every event of the run ends ``published`` in the outbox; every
    IM-bound event_id reached the fake IM at least once; no event of a noop type (RoomCreated,
    RoomHeatChanged, RoomRankChanged) was sent to IM; with per-room ordering, each room's
    events were delivered in ``room_version`` order. Pure, so it is tested on its own."""
    checks = []
    not_published = sorted(e for e in events if statuses.get(e) != "published")
    checks.append(
        Check(
            not not_published,
            f"{len(events) - len(not_published)}/{len(events)} events published in the outbox"
            + (f"; not published: {', '.join(not_published[:5])}" if not_published else ""),
        )
    )
    got = Counter(e for e in received if e is not None)
    im_bound = sorted(e for e, env in events.items() if routes.get(env.event_type) == IM_SINK)
    missing = [e for e in im_bound if not got[e]]
    checks.append(
        Check(
            not missing,
            f"{len(im_bound) - len(missing)}/{len(im_bound)} IM-bound events received by the fake Tencent IM"
            + (f"; missing: {', '.join(missing[:5])}" if missing else ""),
        )
    )
    noop_types = sorted({t for t, sink in routes.items() if sink != IM_SINK})
    noop_events = [e for e, env in events.items() if routes.get(env.event_type) != IM_SINK]
    sent = [e for e in noop_events if got[e]]
    checks.append(
        Check(
            not sent,
            f"{len(sent)} of {len(noop_events)} noop-type events ({', '.join(noop_types)}) sent to IM"
            + (f": {', '.join(sent[:5])}" if sent else ""),
        )
    )
    if per_room:
        delivered: dict[str, list[int]] = {}
        for room, version, _event_id, ok in attempts:
            if ok:
                delivered.setdefault(room, []).append(version)
        disordered = sorted(room for room, versions in delivered.items() if versions != sorted(versions))
        checks.append(
            Check(
                not disordered,
                f"per-room order: the dispatcher delivered {len(delivered)} rooms' events in room_version order"
                if not disordered
                else f"per-room order broken in {', '.join(disordered)}",
            )
        )
    return checks


# -- the run ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    if keep:
        yield Path(tempfile.mkdtemp(prefix="room-outbox-demo-"))
        return
    with tempfile.TemporaryDirectory(prefix="room-outbox-demo-") as path:
        yield Path(path)


def im_faults(failure_rate: float) -> Faults:
    """Split the failure rate over the kinds of failure Tencent produces, all retryable."""
    return Faults(
        error_rate=failure_rate * 0.7,
        error_codes=[10002, 60008, 60018],
        http_error_rate=failure_rate * 0.15,
        drop_rate=failure_rate * 0.15,
    )


async def run_demo(options: DemoOptions, out: IO[str]) -> bool:
    """Run the demo, print the live table and the verification; True when verified."""
    rng = random.Random(options.seed)
    run_id = f"{RUN_PREFIX}{uuid.uuid4().hex[:8]}"
    if options.db and is_sqlite(options.db):
        folder = SQLiteAddress.from_dsn(options.db).path.parent
        if not folder.is_dir():
            raise ConfigError(f"--db: folder {folder} does not exist (the demo creates none; make it first)")
    with _workdir(options.keep) as workdir:
        dsn = options.db or f"sqlite:///{workdir / 'outbox.db'}"
        log_file = (workdir / "demo.log").open("w", encoding="utf-8")
        redactor = Redactor()
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        # The library logs every failed push and attempt as JSON; here they would drown the table.
        configure_logging("INFO", "demo", redactor, stream=log_file, log_format="json")
        try:
            return await _run(options, out, rng, run_id, dsn, workdir, redactor)
        finally:
            root.handlers[:] = handlers  # embedders (and tests) get their logging back
            root.setLevel(level)
            log_file.close()


async def _run(
    options: DemoOptions, out: IO[str], rng: random.Random, run_id: str, dsn: str, workdir: Path, redactor: Redactor
) -> bool:
    server = "PostgreSQL" if urlsplit(dsn).scheme in POSTGRESQL_SCHEMES else "MySQL"
    where = f"SQLite file {dsn.removeprefix('sqlite:///')}" if is_sqlite(dsn) else f"{server} (--db)"
    store = await open_store(dsn, pool_size=4, create_database=True)
    try:
        await _refuse_rows_of_others(store, dsn)
        out.write(
            f"room-outbox demo: {options.events} events, fake Tencent IM failing {options.failure_rate:.0%} of"
            f" requests, outbox in {where}\n\n"
        )
        await store.migrate()
        fake = FakeTencentIM(faults=im_faults(options.failure_rate), seed=rng.randrange(2**32))
        async with serve_fake_im(fake) as fake:
            settings = Settings(
                node_id="demo",
                sinks={IM_SINK: fake.sink_section()},
            )
            router = await build_router(make_plugin_manager(), settings, redactor)
            try:
                tally = Tally()
                lane_router = dataclasses.replace(
                    router, sinks={name: _ObservedSink(name, sink, tally) for name, sink in router.sinks.items()}
                )
                store.claim_after_ms = int(options.claim_after * 1000)
                dispatcher = Dispatcher(
                    store,
                    lane_router,
                    LaneOptions(
                        batch_size=50,
                        poll_interval=0.2,
                        publish_timeout=2.0,
                        lease=10.0,
                        retry=RetryPolicy(interval=0.2),
                        per_room=options.per_room,
                    ),
                    "demo",
                    redactor,
                )
                producer = StoreProducer(store, router, publish_timeout=2.0, redactor=redactor)
                verified = await _drive(options, out, rng, run_id, store, fake, tally, dispatcher, producer, router)
            finally:
                await router.aclose()
    finally:
        await store.aclose()
    if options.keep:
        out.write(f"\nkept {workdir} (demo.log: every push and attempt as JSON lines)\n")
        if is_sqlite(dsn):
            out.write(f"  ROOM_OUTBOX__DATABASE__DSN={dsn} room-outbox status\n")
    return verified


async def _refuse_rows_of_others(store: SQLStore, dsn: str) -> None:
    """The dispatcher claims every pending row: on a table holding rows the demo did not make
    it would deliver them to the fake IM and mark them published. Checked before the schema
    is migrated, so a refused database is left exactly as it was. (The demo's own event_ids
    start with ``demo-``; a row delivered to the fake IM would never reach the real one.)"""
    if await holds_rows_besides(store, RUN_PREFIX):
        raise ConfigError(
            f"--db: {store.profile.table} in {describe(store_address(dsn))} holds rows the demo did not make;"
            " it would deliver them to its fake IM: give it a database of its own"
        )


async def _drive(
    options: DemoOptions,
    out: IO[str],
    rng: random.Random,
    run_id: str,
    store: SQLStore,
    fake: FakeTencentIM,
    tally: Tally,
    dispatcher: Dispatcher,
    producer: OutboxProducer,
    router: Router,
) -> bool:
    plans = plan_commands(options.events, rng)
    total = sum(len(events) for commands in plans.values() for events in commands)
    longest = max(len(commands) for commands in plans.values())
    view = LiveView(out)
    started = time.monotonic()

    async def room_service() -> None:
        async with anyio.create_task_group() as rooms:
            for room, commands in plans.items():
                rooms.start_soon(
                    run_room,
                    room,
                    commands,
                    store,
                    producer,
                    tally,
                    run_id,
                    random.Random(rng.random()),
                    options.failure_rate / 4,
                    options.produce_over / longest,
                )
        tally.produced_all = True

    timed_out = False
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        tg.start_soon(room_service)
        deadline: float | None = None
        while True:
            snap = await snapshot(store, run_id, fake, tally)
            view.show(render(tally, snap, total, time.monotonic() - started))
            if tally.produced_all:
                deadline = deadline or time.monotonic() + options.timeout
                if snap.statuses.get("published", 0) + snap.statuses.get("failed", 0) >= total:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
            await anyio.sleep(0.1)  # the refresh rate of the live table
        dispatcher.stop()
    snap = await snapshot(store, run_id, fake, tally)
    view.show(render(tally, snap, total, time.monotonic() - started), final=True)

    statuses = await status_by_event(store, f"{run_id}-")
    checks = verify(tally.events, statuses, fake.event_ids(), router.routes, tally.attempts, options.per_room)
    out.write("\nverification\n")
    for check in checks:
        out.write(f"  {'ok    ' if check.ok else 'FAILED'} {check.text}\n")
    out.write(race_report(tally, options.claim_after, router.routes))
    verified = all(check.ok for check in checks) and not timed_out
    compensated = tally.push_failed + tally.push_skipped
    if verified:
        out.write(
            f"\nverified in {time.monotonic() - started:.1f}s: {compensated} of {tally.committed} events were not"
            f" pushed by the room service (push failed or never tried); the dispatcher delivered them"
            f" ({snap.retries} failed attempts retried on the way).\n"
        )
    else:
        reason = f"not all events were published within {options.timeout:g}s" if timed_out else "a check failed"
        out.write(f"\nNOT verified: {reason}\n")
    return verified


def race_report(tally: Tally, claim_after: float, routes: Mapping[str, str]) -> str:
    """What the race with the room service's own push cost, in two lines: the requests the
    dispatcher sent for events the room service had pushed itself (``claim_after`` keeps it
    from claiming younger rows), and how long after their commit the events the room service
    did not push reached IM."""
    pushed_im = sum(1 for event_id in tally.pushed if routes.get(tally.events[event_id].event_type) == IM_SINK)
    delays = tally.not_pushed_delays()
    waited = (
        f"delivered {_quantile(delays, 0.5):.2f}s (median) and {delays[-1]:.2f}s (at most) after their commit"
        if delays
        else "none to deliver"
    )
    return (
        f"\nclaim_after {claim_after:g}s: the dispatcher sent {tally.sent_again} requests for the {pushed_im} IM events"
        f" the room service had pushed itself\n"
        f"  {len(delays)} IM events the room service did not push: {waited}\n"
    )


def _quantile(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


# -- command line -----------------------------------------------------------------------------


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        help="run against this store instead, e.g. mysql://root:@127.0.0.1:3306/room_demo"
        " or postgresql://postgres@127.0.0.1:5432/room_demo: a database of its own (one whose outbox"
        " holds rows the demo did not make is refused, unchanged); a SQLite file's folder must exist",
    )
    parser.add_argument(
        "--events", type=int, default=DEFAULT_EVENTS, help=f"events to produce (default {DEFAULT_EVENTS})"
    )
    parser.add_argument(
        "--failure-rate",
        type=float,
        default=DEFAULT_FAILURE_RATE,
        help=f"share of fake IM requests that fail, 0 to 0.9 (default {DEFAULT_FAILURE_RATE})",
    )
    parser.add_argument(
        "--ordering", choices=("per_room", "none"), default="per_room", help="dispatcher ordering (default per_room)"
    )
    parser.add_argument(
        "--claim-after",
        default=f"{DEFAULT_CLAIM_AFTER:g}s",
        help="the age a row must reach before the dispatcher claims it (outbox_worker.claim_after;"
        f" default {DEFAULT_CLAIM_AFTER:g}s, 0 to race the room service's push)",
    )
    parser.add_argument("--seed", type=int, help="random seed, to repeat a run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (SQLite file, JSON log)")


def run_demo_command(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    if not 0 <= args.failure_rate <= 0.9:
        print("room-outbox demo: --failure-rate must be between 0 and 0.9", file=sys.stderr)
        return 2
    if not 10 <= args.events <= 100_000:
        print("room-outbox demo: --events must be between 10 and 100000", file=sys.stderr)
        return 2
    try:
        claim_after = parse_duration(args.claim_after)
    except ValueError as exc:
        print(f"room-outbox demo: --claim-after: {exc}", file=sys.stderr)
        return 2
    if claim_after < 0:
        print("room-outbox demo: --claim-after must not be negative", file=sys.stderr)
        return 2
    options = DemoOptions(
        claim_after=claim_after,
        db=args.db,
        events=args.events,
        failure_rate=args.failure_rate,
        per_room=args.ordering == "per_room",
        keep=args.keep,
        seed=args.seed,
    )
    try:
        return 0 if anyio.run(run_demo, options, out) else 1
    except ConfigError as exc:  # --db names a database or a folder the demo must not use
        print(f"room-outbox demo: {exc}", file=sys.stderr)
        return 2


COMMAND = Command(
    description="Produce events into a SQLite outbox, deliver them through a fake Tencent IM that fails a\n"
    "share of requests, and check that every event arrived once, in order per room. Needs no\n"
    "configuration and no services (it ignores --config).",
    examples="room-outbox demo\nroom-outbox demo --events 5000 --failure-rate 0.3 --seed 7",
    needs="none",
    arguments=add_demo_arguments,
    run=lambda args, _parser: run_demo_command(args),
)
