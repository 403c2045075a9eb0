"""Databases whose text is not UTF-8: room-service's table in latin1 (the default character set
of MariaDB and of MySQL before 8.0) or GBK (a Chinese legacy table), PostgreSQL databases in
SQL_ASCII (what initdb makes in a C locale), LATIN1 or EUC_CN. Events are delivered as on UTF-8,
and a failure whose text holds characters the table cannot store is still recorded (counted,
parked), with those characters escaped. (SQL_ASCII stores any byte: there the text is kept as it
is; GBK and EUC_CN keep Chinese, not emoji.) A ``node_id`` in Chinese claims rows there too:
claim ids carry it escaped."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from support import (
    INSERT_V1,
    POSTGRESQL_SERVER_DSN,
    envelope,
    fetch_rows,
    insert_events,
    insert_rows,
    make_dispatcher,
    pg_admin,
)

from bench.drive import run_until_empty
from room_outbox.attempt.retry import RetryPolicy
from room_outbox.cli.inspect import inspect_events
from room_outbox.cluster.identity import process_identity
from room_outbox.delivery.routing import Router
from room_outbox.delivery.tail import TailRelay
from room_outbox.observability.redaction import Redactor
from room_outbox.sink import PermanentSinkError, RetryableSinkError
from room_outbox.store.backends import mysql_online
from room_outbox.store.backends.leased import open_rows_of_rooms_sql
from room_outbox.store.backends.mysql import CLAIM_SQL, MySQLAddress, MySQLStore
from room_outbox.store.backends.postgres import PostgresStore
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.tail import TailStore, migrate_tail
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

#: Tencent IM answers in Chinese at times; the room event's own text may hold any character.
ERRORS = {
    "retried": RetryableSinkError("ErrorCode 10010: 群组不存在"),
    "parked": PermanentSinkError("ErrorCode 10015: group 🎤 gone"),
}


class ErringSink:
    """Fails the events named in :data:`ERRORS` with their error; records each payload."""

    def __init__(self) -> None:
        self.payloads: dict[str, Any] = {}

    async def deliver(self, event: Any) -> None:
        self.payloads[event.event_id] = event.payload
        if event.event_id in ERRORS:
            raise ERRORS[event.event_id]

    async def aclose(self) -> None:
        pass


@dataclass(frozen=True)
class Narrow:
    """A database whose text is not UTF-8."""

    #: ``mysql-<charset>`` (room-service's table converted to it) or a PostgreSQL database encoding.
    encoding: str
    #: Text an envelope written there may hold.
    text: str
    #: The events whose error text holds a character the column cannot: written with the
    #: text's other characters escaped (SQL_ASCII stores any byte, GBK and EUC_CN Chinese).
    escaped: tuple[str, ...]


NARROW = [
    Narrow("mysql-latin1", "Grüße, 1€", escaped=("retried", "parked")),  # MySQL's latin1 is cp1252: it has €
    Narrow("mysql-gbk", "你好, 1€", escaped=("parked",)),  # a Chinese legacy table: no emoji
    Narrow("SQL_ASCII", "你好 🎉", escaped=()),
    Narrow("LATIN1", "Grüße", escaped=("retried", "parked")),
    Narrow("EUC_CN", "你好", escaped=("parked",)),  # PostgreSQL's Simplified Chinese (GB2312)
]


@asynccontextmanager
async def pg_database_in(encoding: str) -> AsyncIterator[tuple[PostgresStore, str]]:
    """A migrated store on a new PostgreSQL database in ``encoding``, and its DSN; dropped after."""
    name = f"ro_test_{uuid.uuid4().hex[:12]}"
    pg_admin(f"CREATE DATABASE {name} ENCODING '{encoding}' TEMPLATE template0 LC_COLLATE 'C' LC_CTYPE 'C'")
    dsn = f"{POSTGRESQL_SERVER_DSN}/{name}"
    try:
        store = await PostgresStore.connect(dsn)
        try:
            await store.migrate()
            yield store, dsn
        finally:
            await store.aclose()
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=NARROW, ids=lambda narrow: narrow.encoding)
async def narrow_store(request: pytest.FixtureRequest, database_dsn: str) -> AsyncIterator[tuple[SQLStore, Narrow]]:
    narrow: Narrow = request.param
    if narrow.encoding.startswith("mysql-"):
        mysql = await MySQLStore.connect(database_dsn)
        try:
            await mysql.migrate()
            async with mysql.transaction() as cur:
                await cur.execute(f"ALTER TABLE room_outbox CONVERT TO CHARACTER SET {narrow.encoding[6:]}")
            yield mysql, narrow
        finally:
            await mysql.aclose()
        return
    async with pg_database_in(narrow.encoding) as (postgres, _dsn):
        yield postgres, narrow


async def test_events_are_delivered_and_failures_recorded_escaped(
    narrow_store: tuple[SQLStore, Narrow], caplog: pytest.LogCaptureFixture
) -> None:
    store, narrow = narrow_store
    sink = ErringSink()
    dispatcher = make_dispatcher(store, sink, retry=RetryPolicy(interval=60, parking=True))
    events = [envelope(event_id, payload={"text": narrow.text}) for event_id in ("first", "retried", "parked", "last")]
    await insert_events(store, events)
    with caplog.at_level(logging.WARNING, logger="room_outbox.store"):
        assert (await dispatcher.run_once()).claimed == 4
        await dispatcher.flush()
    assert sink.payloads == {e["event_id"]: {"text": narrow.text} for e in events}
    rows = await fetch_rows(store)
    assert {e: (r["status"], r["retry_count"]) for e, r in rows.items()} == {
        "first": ("published", 0),
        "retried": ("pending", 1),
        "parked": ("failed", 1),
        "last": ("published", 0),
    }
    escaped = {
        "retried": r"ErrorCode 10010: \u7fa4\u7ec4\u4e0d\u5b58\u5728",
        "parked": r"ErrorCode 10015: group \U0001f3a4 gone",
    }
    expected = {e: escaped[e] if e in narrow.escaped else str(error) for e, error in ERRORS.items()}
    for event_id, text in expected.items():
        assert rows[event_id]["last_error"].endswith(text), rows[event_id]["last_error"]
    assert not [r for r in caplog.records if "refused" in r.getMessage()]  # nothing released uncounted


async def test_a_node_id_the_table_cannot_hold_claims_and_delivers(narrow_store: tuple[SQLStore, Narrow]) -> None:
    """Claim ids go into room-service's ``worker_id``: with the node_id as it is, a latin1
    table refused every claim, and nothing was ever delivered."""
    store, _narrow = narrow_store
    identity = process_identity("节点-1")
    assert identity.startswith(r"\u8282\u70b9-1~")
    sink = ErringSink()
    dispatcher = make_dispatcher(store, sink, node_id=identity)
    await insert_events(store, [envelope("claimed")])
    assert (await dispatcher.run_once()).claimed == 1
    await dispatcher.flush()
    assert {e: r["status"] for e, r in (await fetch_rows(store)).items()} == {"claimed": "published"}


async def test_an_envelope_in_another_encoding_in_a_sql_ascii_database_is_its_rows_error() -> None:
    """SQL_ASCII stores whatever bytes a producer sends: here GBK, from a producer whose session
    sends its text as it is (client_encoding SQL_ASCII). The server refuses to send such a row as UTF-8, so
    read as text it failed every claim that reached it, and the rows after it waited. Read as
    bytes, it fails alone, naming the cause; the rows around it are delivered."""
    async with pg_database_in("SQL_ASCII") as (store, dsn):
        await insert_events(store, [envelope("before", payload={"text": "你好"})])
        gbk = json.dumps(envelope("gbk", payload={"text": "你好"}), ensure_ascii=False).encode("gbk")
        with psycopg.connect(dsn, autocommit=True, client_encoding="SQL_ASCII", connect_timeout=10) as raw:
            raw.cursor().execute(
                b"INSERT INTO room_outbox (event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
                b" VALUES ('gbk', 'RoomUserJoined', 'r_1', '" + gbk + b"', 0, 0)"
            )
        await insert_events(store, [envelope("after", payload={"text": "你好"})])
        sink = ErringSink()
        dispatcher = make_dispatcher(store, sink)
        assert (await dispatcher.run_once()).claimed == 3
        await dispatcher.flush()
        assert sink.payloads == {"before": {"text": "你好"}, "after": {"text": "你好"}}
        async with store.transaction() as cur:  # every column but the envelope, which the server cannot send
            await cur.execute("SELECT event_id, status, last_error FROM room_outbox")
            rows = {event_id: (status, error) for event_id, status, error in await cur.fetchall()}
        assert {e: status for e, (status, _) in rows.items()} == {
            "before": "published", "gbk": "pending", "after": "published"
        }  # fmt: skip
        assert "envelope is not valid UTF-8" in rows["gbk"][1], rows["gbk"]
        (inspected,) = await inspect_events(store, "gbk")  # the operator sees it too
        assert inspected["envelope_error"].startswith("envelope is not valid UTF-8")


async def test_an_oversized_envelope_in_a_sql_ascii_database_is_left_unread() -> None:
    """SQL_ASCII's envelopes are read as bytes: one above ``database.max_envelope_bytes`` in
    bytes (not in characters) is left unread there too, and its row fails alone."""
    async with pg_database_in("SQL_ASCII") as (_, dsn):
        store = await open_store(dsn, max_envelope_bytes=4096)
        try:
            huge = envelope("huge", payload={"text": "你好" * 1024})  # 2,048 characters, 6,144 bytes
            huge_text = json.dumps(huge, ensure_ascii=False)
            await insert_rows(store, [("", "huge", huge["event_type"], huge["room_id"], huge_text)])
            await insert_events(store, [envelope("after", payload={"text": "你好"})])
            sink = ErringSink()
            await run_until_empty(make_dispatcher(store, sink, retry=RetryPolicy(interval=0.05, parking=True)))
            assert sink.payloads == {"after": {"text": "你好"}}
            rows = await fetch_rows(store)
            assert (rows["huge"]["status"], rows["after"]["status"]) == ("failed", "published")
            size = len(huge_text.encode())
            assert rows["huge"]["last_error"].endswith(
                f"envelope too large: {size} bytes, above database.max_envelope_bytes (left unread)"
            ), rows["huge"]["last_error"]
            (inspected,) = await inspect_events(store, "huge")  # the operator sees why, not the envelope
            assert inspected["envelope_error"].startswith(f"envelope too large: {size}")
            assert "envelope_raw" not in inspected  # nothing of it was read
        finally:
            await store.aclose()


class OrderedLog:
    """An ordered-log sink in memory: ``refuse`` fails for good, with its error, the events
    named there."""

    def __init__(self, refuse: dict[str, str]) -> None:
        self.refuse = refuse
        self.sent: list[str] = []

    async def deliver(self, event: Any) -> None:
        raise AssertionError("a tailing lane publishes batches")

    async def publish(self, envelopes: Sequence[Any]) -> list[PermanentSinkError | None]:
        self.sent += [e.event_id for e in envelopes if e.event_id not in self.refuse]
        return [PermanentSinkError(self.refuse[e.event_id]) if e.event_id in self.refuse else None for e in envelopes]

    async def aclose(self) -> None:
        pass


async def test_a_tailing_lane_parks_an_error_its_table_cannot_hold_escaped_and_goes_on() -> None:
    """On a LATIN1 database, errors naming Chinese text: a bad envelope (a Chinese key holding a
    number JSON has not) and a sink's own refusal. Each was refused by the parked table, which
    failed the round, so the lane read the same rows again for ever and sent nothing after them."""
    async with pg_database_in("LATIN1") as (store, _dsn):
        await migrate_tail(store, ["kafka"])
        bad = json.dumps(envelope("bad", payload={"金额": 1})).replace("1}", "NaN}")
        await insert_rows(store, [("default", "bad", "RoomUserJoined", "r_1", bad)])
        await insert_events(store, [envelope("refused"), envelope("after")])
        sink = OrderedLog({"refused": "ErrorCode 10010: 群组不存在"})
        tail = TailStore(owner=store, lane="kafka", start="beginning", feed_batch=10, gap_timeout=30.0)
        router = Router({"kafka": sink}, {}, catch_all="kafka", skip_unrouted=True)
        relay = TailRelay(tail, router, poll_interval=0.05, publish_timeout=5.0, redactor=Redactor())
        await relay.run_once()
        assert sink.sent == ["after"]
        parked = {row["event_id"]: row["last_error"] for row in await tail.parked()}
    assert parked == {
        "bad": r"malformed envelope: payload.\u91d1\u989d: not a finite number (NaN, Infinity or out of range)",
        "refused": r"ErrorCode 10010: \u7fa4\u7ec4\u4e0d\u5b58\u5728",
    }, parked


#: What a session reads its character set variables as.
SESSION_CHARACTER_SET = (
    "SELECT @@character_set_client, @@character_set_connection, @@character_set_results, @@collation_connection"
)
UTF8MB4 = ("utf8mb4", "utf8mb4", "utf8mb4", "utf8mb4_general_ci")


def log_in_as_utf8mb3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every session room-outbox opens from here on logs in as utf8mb3: the state a server's
    ``init_connect='SET NAMES utf8'`` or ``skip-character-set-client-handshake`` leaves a
    session in before room-outbox's first statement, reached through the handshake's
    character set (the server's own settings are shared by every test). Every kind of session
    takes its parameters from :meth:`MySQLAddress.connect_kwargs`: the pool, migrate's and the
    operator commands' connections of their own."""
    given = MySQLAddress.connect_kwargs

    def in_utf8mb3(self: MySQLAddress, *session: str) -> dict[str, Any]:
        return {**given(self, *session), "charset": "utf8mb3"}

    monkeypatch.setattr(MySQLAddress, "connect_kwargs", in_utf8mb3)


@pytest.fixture
def utf8mb3_logins(monkeypatch: pytest.MonkeyPatch) -> None:
    log_in_as_utf8mb3(monkeypatch)


async def _character_set(conn: Any) -> tuple[str, ...]:
    async with conn.cursor() as cur:
        await cur.execute(SESSION_CHARACTER_SET)
        return tuple(await cur.fetchone())


async def test_every_mysql_session_reads_and_writes_utf8mb4_whatever_the_login_left(
    database_dsn: str, utf8mb3_logins: None
) -> None:
    """A session left in utf8mb3 at login read every emoji as ``?``; each kind of session
    room-outbox opens sets utf8mb4 itself, in the statement that sets its other variables."""
    address = MySQLAddress.from_dsn(database_dsn)
    bare = await address.connect(init_command=None)  # the login alone: what the server left
    try:
        assert (await _character_set(bare))[:3] == ("utf8mb3", "utf8mb3", "utf8mb3")
    finally:
        bare.close()
    own = await address.connect()  # migrate's lock, progress and KILL connections, the store's first
    ddl = await mysql_online.connect(address, "max_statement_time = 0")  # migrate's schema changes
    try:
        assert await _character_set(own) == UTF8MB4
        assert await _character_set(ddl) == UTF8MB4
    finally:
        own.close()
        ddl.close()
    store = await MySQLStore.connect(database_dsn, pool_size=2)  # the pool: claims, results, operator commands
    try:
        async with store.transaction() as first, store.transaction() as second:
            assert await _character_set(first.connection) == UTF8MB4
            assert await _character_set(second.connection) == UTF8MB4
    finally:
        await store.aclose()


async def test_emoji_room_ids_and_payloads_are_delivered_intact_whatever_the_login_left(
    database_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """room-service writes in utf8mb4; room-outbox's sessions log in as utf8mb3
    (:func:`log_in_as_utf8mb3`). Rooms whose ids differ by an emoji alone stay apart (they read as
    one, ``room-?``), and the payload reaches the sink as written, as ``inspect`` shows it."""
    rooms = {"party": "room-🎉", "smile": "room-😀"}
    writer = await MySQLStore.connect(database_dsn)  # room-service: a utf8mb4 session
    try:
        await writer.migrate()
        events = [
            envelope(event_id, room_id=room, payload={"text": f"hi {room[-1]}"}) for event_id, room in rooms.items()
        ]
        await insert_rows(
            writer,
            [
                ("default", e["event_id"], e["event_type"], e["room_id"], json.dumps(e, ensure_ascii=False))
                for e in events
            ],
        )
    finally:
        await writer.aclose()
    log_in_as_utf8mb3(monkeypatch)
    store = await MySQLStore.connect(database_dsn)
    try:
        rooms_seen: dict[str, str] = {}

        class Rooms(ErringSink):
            async def deliver(self, event: Any) -> None:
                rooms_seen[event.event_id] = event.room_id
                await super().deliver(event)

        sink = Rooms()
        dispatcher = make_dispatcher(store, sink)
        assert (await dispatcher.run_once()).claimed == 2
        await dispatcher.flush()
        assert rooms_seen == rooms
        assert sink.payloads == {"party": {"text": "hi 🎉"}, "smile": {"text": "hi 😀"}}
        (inspected,) = await inspect_events(store, "party")
        assert inspected["envelope"]["room_id"] == "room-🎉", inspected
        assert "envelope_error" not in inspected, inspected  # its room_id column reads the same
    finally:
        await store.aclose()


@pytest.mark.parametrize("charset", ["utf8mb4", "utf8mb3", "latin1"])
async def test_the_claim_and_the_per_room_look_up_read_their_indexes_whatever_the_tables_character_set(
    database_dsn: str, utf8mb3_logins: None, charset: str
) -> None:
    """The session's collation is utf8mb4's, the table's may be narrower: a literal compared
    with a column takes the column's collation, so the status and room literals still lead
    the claim and the per-room look-up into their indexes (a conversion of the column would
    read every row)."""
    store = await MySQLStore.connect(database_dsn)
    try:
        await store.migrate()
        async with store.transaction() as cur:
            await cur.execute(f"ALTER TABLE room_outbox CONVERT TO CHARACTER SET {charset}")
            rows = [("default", f"p{i}", "RoomUserJoined", f"r_{i % 300}", "{}", 1, 1) for i in range(3000)]
            await cur.executemany(INSERT_V1, rows)
            await cur.execute("UPDATE room_outbox SET status = 'published'")
            await cur.executemany(INSERT_V1, [(app, f"q{event}", *rest) for app, event, *rest in rows[:20]])
            await cur.execute("ANALYZE TABLE room_outbox")
            await cur.fetchall()
            plans = {}
            for name, sql, args in (
                ("claim", CLAIM_SQL, (10**13, 100)),
                ("rooms", open_rows_of_rooms_sql("room_outbox", "id", 2), ("r_1", "r_2", 10**13)),
            ):
                await cur.execute("EXPLAIN " + sql, args)
                plan = dict(zip([d[0] for d in cur.description], await cur.fetchone(), strict=True))
                plans[name] = (plan["key"], plan["type"])
    finally:
        await store.aclose()
    assert plans == {"claim": ("idx_room_outbox_claim", "range"), "rooms": ("idx_room_outbox_room", "range")}
