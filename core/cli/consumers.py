"""``room-outbox consumers …``: the consumers operated from any host. ``dead-letters`` and
``redrive`` read and change the database's retry rows; ``describe`` asks the broker for the
group's members, partitions, committed and end offsets and lag, as
``kafka-consumer-groups --describe`` does. The printing of every consumer report is here."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import IO, Any

import anyio
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import KafkaError

from room_outbox.attempt.failure import describe
from room_outbox.cli.command import (
    Command,
    add_app_code_option,
    add_json_option,
    add_yes_option,
    int_argument,
    several_apps,
    with_store,
)
from room_outbox.cli.output import NONE, format_age, format_app, format_table, printable
from room_outbox.config import ConfigError, Settings
from room_outbox.consume.offsets import group_offsets
from room_outbox.consume.ops import migrated_consumer_store
from room_outbox.consume.settings import ConsumerSettings, consumer_settings
from room_outbox.errors import BrokerUnavailable
from room_outbox.observability.redaction import Redactor
from room_outbox.store.clock import now_ms
from room_outbox.store.consumers.protocol import DeadLetters
from room_outbox.store.factory import consumer_store
from room_outbox.store.protocol import SQLStore

#: Dead letters a redrive preview lists (the count covers them all).
SHOWN = 20

#: The most dead letters ``dead-letters --limit`` lists (and ``redrive --json``) at once.
MAX_DEAD_LETTERS = 100_000

#: How long ``describe`` waits for the broker's answers.
BROKER_TIMEOUT = 15.0


# -- lines for status and inspect ---------------------------------------------------------------


def format_overview(rows: list[dict[str, Any]]) -> list[str]:
    """Lines for ``status``: per consumer and handler, rows retrying and dead."""
    if not rows:
        return []
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        entry = table.setdefault((row["consumer"], row["handler"] or "(none)"), {"retrying": 0, "dead": 0})
        entry[row["status"]] = row["rows"]
        if row["status"] == "dead":
            entry["oldest_dead_ms"] = row["oldest_created_at_ms"]
    cells = []
    for (consumer, handler), entry in sorted(table.items()):
        oldest = entry.get("oldest_dead_ms")
        age = f"{format_age(now_ms() - oldest)} ago" if oldest else NONE
        cells.append((consumer, handler, entry["retrying"], entry["dead"], age))
    headers = ("consumer", "handler", "retrying", "dead", "oldest dead letter")
    return ["", *format_table(headers, cells, right=("retrying", "dead"), indent="  ")]


def format_states(states: list[dict[str, Any]]) -> list[str]:
    """Lines for ``inspect``: the event in each consumer (consumed / retrying / dead), with the app
    whose event it was (event ids may be unique per app only)."""
    lines = []
    for s in states:
        where = f"{s['topic']}[{s['partition']}]@{s['offset']}"
        if s["state"] == "consumed":
            detail = f"consumed from {where}"
        elif s["state"] == "retrying":
            due = max(0, int(s["due_at_ms"]) - now_ms()) / 1000
            detail = f"retrying after {s['attempts']} attempt(s), next in {due:.1f}s: {s['last_error']} ({where})"
        else:
            detail = f"dead after {s['attempts']} attempt(s): {s['last_error']} ({where})"
        lines.append(printable(f"consumer {s['consumer']} / {s['handler']}, app {format_app(s['app_code'])}: {detail}"))
    return lines


# -- dead-letters and redrive --------------------------------------------------------------------


async def dead_letters_command(store: SQLStore, consumer: str | None, limit: int, as_json: bool, out: IO[str]) -> int:
    consumers = await migrated_consumer_store(store)
    rows = await consumers.dead_letters(DeadLetters(consumer), limit) if consumers is not None else []
    if as_json:
        print(json.dumps(rows, indent=2, default=str), file=out)
        return 0
    if not rows:
        print("no dead letters", file=out)
        return 0
    cells = [
        (
            r["consumer"],
            r["handler"] or "(none)",
            r["event_id"],
            r["event_type"] or NONE,
            f"{r['topic']}[{r['kafka_partition']}]@{r['kafka_offset']}",
            r["attempts"],
            r["last_error"],
        )
        for r in rows
    ]
    headers = ("consumer", "handler", "event_id", "event_type", "from", "attempts", "last_error")
    print("\n".join(format_table(headers, cells, right=("attempts",))), file=out)
    return 0


async def redrive_command(
    store: SQLStore,
    consumer: str,
    handler: str | None,
    event_ids: list[str],
    apply: bool,
    out: IO[str],
    configured: frozenset[str] = frozenset(),
    as_json: bool = False,
    app_code: str | None = None,
    err: IO[str] | None = None,
) -> int:
    """Dead letters of ``consumer`` (optionally one handler's, these events', one app's) back to
    ``retrying``, due now, attempts from 0: a running ``consume`` process takes them up. The
    preview counts what ``apply`` changes (one selection for both); the listing shows the first
    :data:`SHOWN` (``--json``: :data:`MAX_DEAD_LETTERS`). A consumer neither ``configured`` nor in
    the retry table is a typo: exit 2, naming it. An event id that names dead letters of several
    apps is refused (exit 1, nothing changed) unless ``app_code`` says which, as ``requeue`` and
    ``cancel`` refuse it; why on ``err`` (default: standard error)."""
    err = err or sys.stderr
    consumers = await migrated_consumer_store(store)
    if consumers is None:
        print("no consumer tables here: run `room-outbox migrate`", file=err)
        return 1
    known = configured | {row["consumer"] for row in await consumers.overview()}
    if consumer not in known:
        names = ", ".join(sorted(known)) or "none"
        print(f"room-outbox consumers redrive: no consumer {consumer!r} (known: {names})", file=err)
        return 2
    several = False
    for event_id in event_ids if app_code is None else []:
        apps = await consumers.dead_letter_apps(DeadLetters(consumer, handler, (event_id,)))
        if len(apps) > 1:
            print(several_apps("consumers redrive", event_id, apps), file=err)
            several = True
    if several:
        return 1
    dead = DeadLetters(consumer, handler, tuple(event_ids), app_code)
    selected = await consumers.count_dead_letters(dead)
    listed = await consumers.dead_letters(dead, MAX_DEAD_LETTERS if as_json else SHOWN)
    changed = await consumers.redrive(dead) if apply and selected else 0
    if as_json:
        doc = {"consumer": consumer, "applied": apply, "selected": selected, "redriven": changed}
        print(json.dumps(doc | {"dead_letters": listed}, indent=2, default=str), file=out)
        return 0
    if listed:
        cells = [(r["handler"] or "(none)", format_app(r["app_code"]), r["event_id"], r["last_error"]) for r in listed]
        print("\n".join(format_table(("handler", "app_code", "event_id", "last_error"), cells, indent="  ")), file=out)
    if selected > len(listed):
        print(f"  … and {selected - len(listed)} more", file=out)
    if not apply:
        print(f"{selected} dead letter(s) would be sent round again; add --yes to do it", file=out)
    else:
        print(f"{changed} dead letter(s) sent round again", file=out)
    return 0


# -- describe -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    member_id: str
    client_id: str
    host: str
    #: ``topic[partition]`` of each partition assigned to it (empty when the broker does not
    #: report assignments).
    partitions: list[str]


@dataclass(frozen=True)
class PartitionState:
    topic: str
    partition: int
    #: The group's committed offset (None: nothing committed yet).
    committed: int | None
    end: int
    #: Messages not yet committed: end - committed (or end when nothing was committed).
    lag: int
    #: The member the partition is assigned to, when the broker says.
    member: str | None


@dataclass(frozen=True)
class GroupState:
    consumer: str
    group: str
    #: The broker's word: Stable, PreparingRebalance, CompletingRebalance, Empty, Dead.
    state: str
    members: list[Member]
    partitions: list[PartitionState]

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)


async def describe_group(name: str, consumer: ConsumerSettings) -> GroupState:
    """The group's state, its members and a row per partition of the consumer's topic."""
    group = consumer.group(name)
    client = {"bootstrap_servers": consumer.bootstrap_servers, **consumer.security.client_kwargs()}
    admin = AIOKafkaAdminClient(**client)
    reader = AIOKafkaConsumer(enable_auto_commit=False, fetch_max_wait_ms=100, **client)
    # Every failure of the talk is the broker's (down, refusing the login, not answering):
    # one error naming the broker and the key that sets it, not a driver's traceback.
    try:
        with anyio.fail_after(BROKER_TIMEOUT):
            await admin.start()
            await reader.start()
            (response,) = await admin.describe_consumer_groups([group])
            described = response.to_object()["groups"][0]
            offsets = await group_offsets(admin, reader, group, consumer.topic)
    except (KafkaError, OSError, TimeoutError) as exc:
        said = str(exc)  # aiokafka's text often starts with its class's name already
        reason = said if said.startswith(type(exc).__name__) else describe(exc)
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {BROKER_TIMEOUT:g}s"
        raise BrokerUnavailable(
            f"consumers describe: cannot reach the Kafka broker {consumer.bootstrap_servers} of consumer {name}"
            f" ({reason}); is it running, and is consumers.{name}.bootstrap_servers right?"
        ) from exc
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await reader.stop()
            await admin.close()
    members, owners = [], {}
    for m in described["members"]:
        raw = m["member_assignment"]
        assigned = ConsumerProtocolMemberAssignment.decode(raw).partitions() if raw else []
        owners.update({(tp.topic, tp.partition): m["member_id"] for tp in assigned})
        shown = [f"{tp.topic}[{tp.partition}]" for tp in assigned]
        members.append(Member(m["member_id"], m["client_id"], m["client_host"], shown))
    rows = [
        PartitionState(tp.topic, tp.partition, at.committed, at.end, at.lag, owners.get((tp.topic, tp.partition)))
        for tp, at in offsets.items()
    ]
    return GroupState(name, group, described["state"] or "Empty", members, rows)


@contextlib.contextmanager
def _driver_logs_quiet() -> Iterator[None]:
    """aiokafka's own records held back (all but CRITICAL) while ``describe`` talks to the
    broker: a broker it cannot reach is reported once, as the command's error; the driver
    would log it first as an ERROR line of its own."""
    driver = logging.getLogger("aiokafka")
    level = driver.level
    driver.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        driver.setLevel(level)


async def describe_command(settings: Settings, only: str | None, as_json: bool, out: IO[str]) -> int:
    found = consumer_settings(settings, only)
    if not found:  # (the CLI prefixes "room-outbox: " to every error it prints)
        raise ConfigError("consumers describe: no enabled consumer in the configuration (consumers.<name>)")
    with _driver_logs_quiet():
        groups = [await describe_group(name, consumer) for name, consumer in found.items()]
    if as_json:
        print(json.dumps([asdict(g) | {"lag": g.lag} for g in groups], indent=2), file=out)
        return 0
    for g in groups:
        print(f"consumer {g.consumer}: group {g.group} ({g.state}), {len(g.members)} member(s), lag {g.lag}", file=out)
        cells = [
            (p.topic, p.partition, NONE if p.committed is None else p.committed, p.end, p.lag, p.member or NONE)
            for p in g.partitions
        ]
        numbers = ("partition", "committed", "end", "lag")
        print("\n".join(format_table(("topic", *numbers, "member"), cells, right=numbers, indent="  ")), file=out)
        if g.members:
            members = [
                (m.member_id, m.client_id or NONE, m.host or NONE, ", ".join(m.partitions) or NONE) for m in g.members
            ]
            print(
                "\n".join(format_table(("member", "client_id", "host", "partitions"), members, indent="  ")), file=out
            )
    return 0


# -- the command --------------------------------------------------------------------------------


def _arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="consumers_command", required=True, metavar="ACTION")
    dead = actions.add_parser("dead-letters", help="list dead letters")
    dead.add_argument("--consumer", help="only this consumer's")
    dead.add_argument(
        "--limit",
        type=int_argument(1, MAX_DEAD_LETTERS),
        default=100,
        help=f"at most this many, 1 to {MAX_DEAD_LETTERS} (default 100)",
    )
    add_json_option(dead)
    redrive = actions.add_parser(
        "redrive", help="send dead letters round again (retried by a running consume); shows them, applies with --yes"
    )
    redrive.add_argument("--consumer", required=True, help="the consumer whose dead letters to send")
    redrive.add_argument("--handler", help="only this handler's dead letters")
    redrive.add_argument("--event-id", action="append", default=[], help="only this event (repeatable)")
    add_app_code_option(redrive, "only this app's dead letters; needed with an --event-id that several apps have")
    add_yes_option(redrive, "send them round again")
    add_json_option(redrive)
    describe = actions.add_parser(
        "describe", help="members, partitions, committed and end offsets and lag of each consumer group"
    )
    describe.add_argument("--consumer", help="only this consumer (default: every enabled one)")
    add_json_option(describe)


def _run(settings: Settings, args: argparse.Namespace, _redactor: Redactor) -> int:
    if args.consumers_command == "describe":  # the broker only
        return anyio.run(describe_command, settings, args.consumer, args.json, sys.stdout)
    return anyio.run(with_store, settings, lambda store: _operate(store, settings, args))


async def _operate(store: SQLStore, settings: Settings, args: argparse.Namespace) -> int:
    if consumer_store(store) is None:
        raise ConfigError("consumers: needs a MySQL or PostgreSQL database; database.dsn names SQLite")
    if args.consumers_command == "dead-letters":
        return await dead_letters_command(store, args.consumer, args.limit, args.json, sys.stdout)
    configured = frozenset(settings.consumers)
    return await redrive_command(
        store, args.consumer, args.handler, args.event_id, args.yes, sys.stdout, configured, args.json, args.app_code
    )


COMMAND = Command(
    description="Dead letters of the consumers, from the database: `dead-letters` lists them, `redrive`\n"
    "makes them due again (a running consume takes them up); redrive applies only with --yes,\n"
    "counts exactly what --yes changes and changes it in batches of 1,000 rows. An --event-id\n"
    "that several apps' dead letters have is refused until --app-code names the app.\n"
    "`describe` asks the broker for each group's members, partitions, committed and end offsets\n"
    "and lag, as kafka-consumer-groups --describe does.",
    examples="room-outbox consumers dead-letters --consumer feed\n"
    "room-outbox consumers redrive --consumer feed --handler audit --yes\n"
    "room-outbox consumers describe --consumer feed",
    needs="config",
    arguments=_arguments,
    run=_run,
)
