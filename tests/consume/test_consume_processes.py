"""`room-outbox consume` as real processes in one consumer group, on tansu and MariaDB (and
PostgreSQL for the failures, dead letters and redrive).

What must hold through kills, rebalances, failing handlers and bad messages: every event's
side effects exactly once (the gift totals are increments: a second handling would show),
each room handled in order, nothing lost, and what could not be handled visible as dead
letters that a redrive sends round again.
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from consume.conftest import (
    TOPIC,
    ConsumeProcess,
    ConsumerBroker,
    cli,
    dlq_messages,
    encode,
    envelope,
    eventually,
    produce,
    query,
    write_config,
)

pytestmark = pytest.mark.slow

TYPES = ("RoomUserJoined", "RoomGiftSent", "RoomHeatChanged", "RoomMicChanged", "RoomUserLeft")
USER_FACING = {"RoomUserJoined", "RoomGiftSent", "RoomMicChanged", "RoomUserLeft"}


def room_events(prefix: str, count: int, rooms: int, versions: dict[str, int]) -> list[dict[str, Any]]:
    events = []
    for i in range(count):
        room = f"room_{i % rooms}"
        versions[room] = versions.get(room, 0) + 1
        events.append(envelope(f"{prefix}{i}", TYPES[i % len(TYPES)], room, versions[room], amount=i % 7 + 1))
    return events


def count(dsn: str, sql: str, *params: Any) -> int:
    return int(query(dsn, sql, params)[0][0])


def assert_room_order(dsn: str, table: str) -> None:
    """Within each room, rows were written (id order) in room_version order, without repeats."""
    by_room: dict[str, list[int]] = defaultdict(list)
    for room, version in query(dsn, f"SELECT room_id, room_version FROM {table} ORDER BY id"):
        by_room[room].append(int(version))
    assert by_room
    for room, versions in by_room.items():
        assert versions == sorted(set(versions)), f"{table}: room {room} handled out of order: {versions}"


def expected_gifts(events: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in events:
        if e["event_type"] == "RoomGiftSent":
            totals[e["room_id"]][0] += 1
            totals[e["room_id"]][1] += e["payload"]["amount"]
    return {room: (n, amount) for room, (n, amount) in totals.items()}


def gift_totals(dsn: str) -> dict[str, tuple[int, int]]:
    return {room: (int(n), int(a)) for room, n, a in query(dsn, "SELECT room_id, gifts, amount FROM room_gift_totals")}


def test_three_members_a_kill_and_a_rebalance_handle_every_event_once_in_room_order(
    tmp_path: Path, database_dsn: str, broker: ConsumerBroker, processes: list[ConsumeProcess]
) -> None:
    config = write_config(
        tmp_path / "config.yaml", database_dsn, broker,
        {"feed": {"handlers": ["audit", "activity", "gift_stats"], "max_batch": 50, "concurrency": 8}},
    )  # fmt: skip
    migrated = cli(config, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    versions: dict[str, int] = {}
    first, second = room_events("a", 1200, 30, versions), room_events("b", 1200, 30, versions)
    everything = first + second

    processes += [ConsumeProcess(config, "member-0"), ConsumeProcess(config, "member-1")]
    eventually(lambda: all(p.said("partitions assigned") for p in processes), 60, "both members joined")
    produce(broker.bootstrap, [encode(e) for e in first])
    eventually(lambda: count(database_dsn, "SELECT COUNT(*) FROM room_audit_log") >= 300, 60, "handling under way")
    processes[0].kill()  # mid-stream: its batch in progress was never committed
    processes.append(ConsumeProcess(config, "member-2"))  # joins: partitions move again
    # The second half goes out once the group has taken member-2 in, so that the rebalance
    # falls inside the stream rather than after a survivor has handled everything alone.
    eventually(lambda: processes[2].said("partitions assigned"), 60, "member-2 joined")
    produce(broker.bootstrap, [encode(e) for e in second])

    eventually(
        lambda: count(database_dsn, "SELECT COUNT(*) FROM room_audit_log") >= len(everything),
        120,
        "every event audited",
    )
    eventually(lambda: gift_totals(database_dsn) == expected_gifts(everything), 30, "gift totals complete")

    # Exactly once: one audit row and one processed record per event, activity rows for the
    # user-facing ones, and increments (gift totals) applied once each.
    assert count(database_dsn, "SELECT COUNT(*) FROM room_audit_log") == len(everything)
    audited = {row[0] for row in query(database_dsn, "SELECT event_id FROM room_audit_log")}
    assert audited == {e["event_id"] for e in everything}
    processed = dict(query(database_dsn, "SELECT handler, COUNT(*) FROM room_consumer_processed GROUP BY handler"))
    gifts = sum(1 for e in everything if e["event_type"] == "RoomGiftSent")
    assert processed == {
        "audit": len(everything),
        "activity": sum(1 for e in everything if e["event_type"] in USER_FACING),
        "gift_stats": gifts,
    }
    assert count(database_dsn, "SELECT COUNT(*) FROM room_activity") == processed["activity"]
    assert gift_totals(database_dsn) == expected_gifts(everything)
    # Each room in order, and nothing left over.
    assert_room_order(database_dsn, "room_audit_log")
    assert_room_order(database_dsn, "room_activity")
    assert count(database_dsn, "SELECT COUNT(*) FROM room_consumer_retry") == 0
    for proc in processes[1:]:
        assert proc.terminate() == 0


def rename_tables(dsn: str, renames: dict[str, str]) -> None:
    for old, new in renames.items():
        sql = f"ALTER TABLE {old} RENAME TO {new}" if dsn.startswith("postgresql") else f"RENAME TABLE {old} TO {new}"
        query(dsn, sql)


def test_failing_handlers_poison_and_unknown_types_retries_dead_letters_and_redrive(
    tmp_path: Path, server_dsn: str, broker: ConsumerBroker, processes: list[ConsumeProcess]
) -> None:
    """On MariaDB and PostgreSQL."""
    database_dsn = server_dsn
    quick = {"base": "100ms", "cap": "300ms", "poll_interval": "100ms"}
    config = write_config(
        tmp_path / "config.yaml", database_dsn, broker,
        {
            # retries until its table is back; activity goes on meanwhile
            "patient": {"handlers": ["audit", "activity"], "retry": {**quick, "max_attempts": 1000}},
            # gives up after two attempts: dead letters, to be redriven
            "strict": {"handlers": ["gift_stats"], "retry": {**quick, "max_attempts": 2}},
        },
    )  # fmt: skip
    assert cli(config, "migrate").returncode == 0
    processes.append(ConsumeProcess(config, "member-0"))
    eventually(lambda: processes[0].said("partitions assigned"), 60, "member joined")

    # A poison message and an unknown type: dead letters at once, in each consumer.
    unknown = envelope("unknown-1", "RoomTeleported", "room_9", 1)
    produce(broker.bootstrap, [(b"app1:room_9", b"\xff\xfe not json"), encode(unknown)])
    dead_sql = "SELECT consumer, event_id, last_error FROM room_consumer_retry WHERE status = 'dead' AND handler = ''"
    eventually(lambda: len(query(database_dsn, dead_sql)) == 4, 30, "four handler-less dead letters")
    dead = query(database_dsn, dead_sql)
    assert {(c, "unknown-1") for c in ("patient", "strict")} <= {(c, e) for c, e, _ in dead}
    assert sum("unparsable value" in error for _, _, error in dead) == 2
    assert sum("unknown event type 'RoomTeleported'" in error for _, _, error in dead) == 2
    copies = dlq_messages(broker.bootstrap, 4)
    headers = [dict(m.headers) for m in copies]
    assert sorted(h["dlq.consumer"].decode() for h in headers) == ["patient", "patient", "strict", "strict"]
    assert all(h["dlq.error"] and h["dlq.topic"] == TOPIC.encode() for h in headers)
    assert {m.value for m in copies} == {b"\xff\xfe not json", encode(unknown)[1]}

    # Handlers failing for a while: their tables are gone.
    rename_tables(database_dsn, {"room_audit_log": "room_audit_log_away", "room_gift_totals": "room_gift_totals_away"})
    events = room_events("f", 40, 4, {})
    produce(broker.bootstrap, [encode(e) for e in events])
    gifts = [e for e in events if e["event_type"] == "RoomGiftSent"]
    facing = [e for e in events if e["event_type"] in USER_FACING]
    # The partition is not held up: activity handles everything meanwhile.
    eventually(lambda: count(database_dsn, "SELECT COUNT(*) FROM room_activity") == len(facing), 30, "activity")
    eventually(
        lambda: count(database_dsn, "SELECT COUNT(*) FROM room_consumer_retry WHERE consumer = 'strict' AND status = 'dead' AND handler = 'gift_stats'") == len(gifts),
        30, "strict's gifts dead after two attempts",
    )  # fmt: skip
    eventually(
        lambda: count(database_dsn, "SELECT COUNT(*) FROM room_consumer_retry WHERE consumer = 'patient' AND status = 'retrying'") == len(events),
        30, "every audit retrying or waiting behind its room's first",
    )  # fmt: skip
    status = cli(config, "status")
    assert status.returncode == 0, status.stderr
    assert any(line.split()[:4] == ["patient", "audit", str(len(events)), "0"] for line in status.stdout.splitlines())
    assert any(
        line.split()[:4] == ["strict", "gift_stats", "0", str(len(gifts))] for line in status.stdout.splitlines()
    )
    inspected = cli(config, "inspect", gifts[0]["event_id"], "--json")
    states = {(s["consumer"], s["handler"]): s["state"] for s in json.loads(inspected.stdout)["consumers"]}
    assert states == {
        ("patient", "activity"): "consumed",
        ("patient", "audit"): "retrying",
        ("strict", "gift_stats"): "dead",
    }

    # Back: the audit catches up by itself, each room in order.
    rename_tables(database_dsn, {"room_audit_log_away": "room_audit_log", "room_gift_totals_away": "room_gift_totals"})
    eventually(lambda: count(database_dsn, "SELECT COUNT(*) FROM room_audit_log") == len(events), 60, "audit caught up")
    assert_room_order(database_dsn, "room_audit_log")
    assert gift_totals(database_dsn) == {}  # the dead letters wait for an operator

    preview = cli(config, "consumers", "redrive", "--consumer", "strict", "--handler", "gift_stats")
    assert f"{len(gifts)} dead letter(s) would be sent round again" in preview.stdout
    assert gift_totals(database_dsn) == {}
    redriven = cli(config, "consumers", "redrive", "--consumer", "strict", "--handler", "gift_stats", "--yes")
    assert f"{len(gifts)} dead letter(s) sent round again" in redriven.stdout
    eventually(lambda: gift_totals(database_dsn) == expected_gifts(events), 30, "redriven gifts counted")

    # Nothing lost, nothing twice; only the poison and the unknown type stay dead.
    assert count(database_dsn, "SELECT COUNT(*) FROM room_consumer_retry WHERE status = 'retrying'") == 0
    assert len(query(database_dsn, "SELECT id FROM room_consumer_retry")) == 4
    processed = dict(
        query(
            database_dsn,
            "SELECT CONCAT(consumer, '/', handler), COUNT(*) FROM room_consumer_processed GROUP BY consumer, handler",
        )
    )
    assert processed == {"patient/audit": len(events), "patient/activity": len(facing), "strict/gift_stats": len(gifts)}
    # Stopped as when the terminal it was started from goes away: as cleanly as by SIGTERM.
    assert processes[0].terminate(signum=signal.SIGHUP) == 0
    assert any(line.get("signal") == "SIGHUP" for line in processes[0].lines())
