"""Membership and room buckets on MySQL/MariaDB and PostgreSQL, in-process: the bucket function in SQL and Python,
rebalancing, and the fence of a handover (the new owner waits for the old owner's leases)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from support import CREATED, INSERT_V1, TABLE_SHAPES, envelope, insert_events, migrated_in_shape, wait_until

from room_outbox.cluster.membership import Membership
from room_outbox.cluster.quota import QuotaShare
from room_outbox.errors import SchemaError
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import LaneStore, migrate_lanes
from room_outbox.store.membership import bucket_of, claimable_buckets, read_buckets, still_leased
from room_outbox.store.protocol import ReadAlong, SQLStore
from room_outbox.store.schema.buckets import BUCKET_TABLE, BUCKETS, row_bucket
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.profiles import ROOM_CELL, V1

pytestmark = pytest.mark.anyio


@pytest.fixture(params=[*(f"mysql-{shape}" for shape in TABLE_SHAPES), "postgresql"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """A migrated store on a fresh database of each server the membership runs on; on
    MySQL/MariaDB with each shape of the outbox table (support.TABLE_SHAPES)."""
    mysql = request.param.startswith("mysql")
    dsn = str(request.getfixturevalue("database_dsn" if mysql else "postgresql_dsn"))
    store = await open_store(dsn)
    try:
        await migrated_in_shape(store, request.param.removeprefix("mysql-")) if mysql else await store.migrate()
        yield store
    finally:
        await store.aclose()


async def owners(store: SQLStore) -> dict[int, tuple[str | None, bool]]:
    async with store.transaction() as cur:
        return {b.bucket: (b.owner, b.handing_over) for b in await read_buckets(cur)}


def room_limits() -> QuotaShare:
    """The quota of a process whose sink limits each room's messages, a limit the room's owner
    keeps whole (Tencent IM's group per room, with per-room ordering): a bucket that changes
    hands is claimable a rate-limit window later."""
    quota = QuotaShare()
    quota.rooms_owned = quota.limits_rooms = True
    return quota


async def owned_by(store: SQLStore, node_id: str) -> list[int]:
    return sorted(bucket for bucket, (owner, _) in (await owners(store)).items() if owner == node_id)


async def pass_window(cur: object) -> None:
    """As if the rate-limit window after a handover had passed."""
    await cur.execute(f"UPDATE {BUCKET_TABLE} SET claimable_from_ms = 0 WHERE handing_over = 0")  # type: ignore[attr-defined]


async def test_the_database_computes_the_same_bucket_as_python(store: SQLStore) -> None:
    rooms = [("default", f"r_{n}") for n in range(300)] + [("app2", "r_1"), ("", "房间-7"), ("default", "é" * 60)]
    await insert_events(store, [envelope(f"e{i}", room_id=room, app_code=app) for i, (app, room) in enumerate(rooms)])
    async with store.transaction() as cur:
        await cur.execute(f"SELECT app_code, room_id, {row_bucket(store.dialect)} FROM room_outbox")
        found = await cur.fetchall()
    assert len(found) == len(rooms)
    assert all(bucket == bucket_of(app, room) for app, room, bucket in found)
    assert len({bucket for _, _, bucket in found}) > 160  # spread (303 rooms fill ~178 of 256)


def room_in(bucket: int) -> str:
    return next(f"r_{n}" for n in range(100_000) if bucket_of("default", f"r_{n}") == bucket)


async def lease_rows_in(store: SQLStore, buckets: list[int]) -> None:
    """A row in each of ``buckets``, leased to node-a for a minute."""
    await insert_events(store, [envelope(f"leased-{b}", room_id=room_in(b)) for b in buckets])
    async with store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET worker_id = 'node-a#1', lock_until_ms = %s WHERE event_id LIKE 'leased-%%'",
            (now_ms() + 60_000,),
        )


async def test_buckets_are_split_and_handed_over_only_after_the_leases_end(store: SQLStore) -> None:
    """Every bucket busy: the joining node's half is handed over, each bucket once its lease ends."""
    a = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0, quota=room_limits())
    await a.beat()
    await a.beat()  # no lease anywhere: every bucket claimable by the only node, a window later
    async with store.transaction() as cur:
        assert await a.room_buckets(cur) == []
        await pass_window(cur)
        assert await a.room_buckets(cur) is None  # all of them: the claim needs no filter

    await lease_rows_in(store, list(range(BUCKETS)))  # node-a holds a lease in every bucket
    moving = BUCKETS - 1  # a bucket that moves to node-b (the upper half, by plan's order)
    b = Membership(store, "node-b", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0, quota=room_limits())
    await b.beat()
    await b.beat()
    after = await owners(store)
    assert sum(owner == "node-b" for owner, _ in after.values()) == BUCKETS // 2  # half moved, no more
    assert after[moving] == ("node-b", True)  # moved, but handing over: node-a's lease still runs
    async with store.transaction() as cur:
        assert moving not in (await a.room_buckets(cur) or [])  # the former owner: fenced at once
        assert moving not in (await b.room_buckets(cur) or [])  # the new one: not while the lease runs
    async with store.transaction() as cur:  # the lease ends (node-a wrote its result)
        await cur.execute("UPDATE room_outbox SET worker_id = NULL, lock_until_ms = 0, status = 'published'")
    await b.beat()
    assert (await owners(store))[moving] == ("node-b", False)  # claimable one rate-limit window later


async def own_every_third_bucket(cur: Any) -> list[int]:
    """Buckets 0, 3, …, 255 to node "me" (their list is 305 characters), the others to another."""
    mine = [b for b in range(BUCKETS) if b % 3 == 0]
    await cur.execute(f"UPDATE {BUCKET_TABLE} SET owner = 'other', claimable_from_ms = 0")
    await cur.execute(f"UPDATE {BUCKET_TABLE} SET owner = 'me' WHERE bucket IN ({', '.join(map(str, mine))})")
    return mine


async def test_the_claimable_buckets_are_the_nodes_own(store: SQLStore) -> None:
    async with store.transaction() as cur:
        mine = await own_every_third_bucket(cur)
        assert await claimable_buckets(cur, store.dialect, "me") == mine
        assert await claimable_buckets(cur, store.dialect, "nobody") == []


async def test_the_claimable_buckets_carry_a_read_along_in_their_statement(store: SQLStore) -> None:
    """A claim's key bound comes in the buckets' read (one statement on MySQL/MariaDB)."""
    along = ReadAlong("SELECT 7 AS seven, 'x' AS letter", (), ("seven", "letter"))
    async with store.transaction() as cur:
        mine = await own_every_third_bucket(cur)
        assert await claimable_buckets(cur, store.dialect, "me", along) == mine
    assert along.row == (7, "x")


async def test_the_fence_read_with_the_key_bound_locks_the_buckets_and_no_outbox_row(store: SQLStore) -> None:
    """The key bound read with the buckets' shared lock takes no lock on the rows it reads: the
    producer's own update of one goes through at once, while a reassignment of a bucket still
    waits for the claim's commit (the fence)."""
    await insert_events(store, [envelope("e1", room_id="A")])
    bound = store._fresh_bound_read(100, None)  # type: ignore[attr-defined]  # every bucket: no bucket read
    wait_at_most_a_second = (
        "SET SESSION innodb_lock_wait_timeout = 1" if store.dialect.name == "mysql" else "SET lock_timeout = '1s'"
    )
    async with store.transaction() as cur:
        mine = await own_every_third_bucket(cur)
    async with store.transaction() as claim:
        assert await claimable_buckets(claim, store.dialect, "me", bound) == mine
        assert bound.row is not None and bound.row[0] is not None  # it read e1's key
        async with store.transaction() as producer:
            await producer.execute(wait_at_most_a_second)
            await producer.execute("UPDATE room_outbox SET status = 'published' WHERE event_id = 'e1'")
        with pytest.raises(Exception, match=r"(?i)lock"):
            async with store.transaction() as reassignment:
                await reassignment.execute(wait_at_most_a_second)
                await reassignment.execute(f"UPDATE {BUCKET_TABLE} SET owner = 'other' WHERE bucket = %s", (mine[0],))


async def test_a_bucket_gained_between_claims_is_taken_once_the_key_bound_counts_it(store: SQLStore) -> None:
    """The key bound read with the buckets counts the buckets the claim before found: a bucket
    gained since is left to the next claim, so a young row of it below that bound is not taken
    (it would race room-service's own push)."""
    store.claim_after_ms = 10_000

    async def mine(cur: Any, along: ReadAlong | None = None) -> list[int]:
        return await claimable_buckets(cur, store.dialect, "me", along)

    store.room_buckets = mine
    gained, kept = 7, (0, 1)
    async with store.transaction() as cur:
        await cur.execute(f"UPDATE {BUCKET_TABLE} SET owner = 'me', handing_over = 0, claimable_from_ms = 0")
        await cur.execute(f"UPDATE {BUCKET_TABLE} SET owner = 'other' WHERE bucket = %s", (gained,))
        await cur.execute(f"SELECT {store.dialect.now_ms}")
        now = int((await cur.fetchone())[0])

    async def insert(event_id: str, room_id: str, age_ms: int) -> None:
        body = json.dumps(envelope(event_id, room_id=room_id))
        created = now - age_ms
        async with store.transaction() as cur:
            await cur.execute(INSERT_V1, ("default", event_id, "RoomUserJoined", room_id, body, created, created))

    await insert("old-1", room_in(kept[0]), 60_000)
    first = await store.claim("me#1", 10, now_ms() + 60_000, per_room=True)
    assert [row.event_id for row in first.rows] == ["old-1"]
    await insert("young", room_in(gained), 0)
    await insert("old-2", room_in(kept[1]), 60_000)  # after the young row, in a bucket kept
    async with store.transaction() as cur:
        await cur.execute(f"UPDATE {BUCKET_TABLE} SET owner = 'me' WHERE bucket = %s", (gained,))
    second = await store.claim("me#2", 10, now_ms() + 60_000, per_room=True)
    assert [row.event_id for row in second.rows] == ["old-2"]
    third = await store.claim("me#3", 10, now_ms() + 60_000, per_room=True)
    assert third.rows == []  # the young row waits for claim_after, its bucket now counted


@pytest.mark.parametrize("cut_short_at", [41, 42])
async def test_claimable_buckets_cut_short_by_group_concat_max_len_are_read_row_by_row(
    database_dsn: str, cut_short_at: int
) -> None:
    """MySQL/MariaDB read them as one list; cut short (at 41 characters just after a separator,
    at 42 within one), it is read again row by row: a claim never misses one of its buckets,
    nor what its first statement read along."""
    store = await open_store(database_dsn)
    try:
        await store.migrate()
        async with store.transaction() as cur:
            mine = await own_every_third_bucket(cur)
            await cur.execute(f"SET SESSION group_concat_max_len = {cut_short_at}")
            try:
                assert await claimable_buckets(cur, store.dialect, "me") == mine
                along = ReadAlong("SELECT 7 AS seven", (), ("seven",))
                assert await claimable_buckets(cur, store.dialect, "me", along) == mine
                assert along.row == (7,)
            finally:
                await cur.execute("SET SESSION group_concat_max_len = DEFAULT")
    finally:
        await store.aclose()


async def test_a_joining_node_takes_idle_buckets_at_once_and_leaves_the_busy_ones(store: SQLStore) -> None:
    """A node joining while the owner delivers: it takes its fair count from the buckets
    without a leased row, claimable a window later with no handover; the busy ones stay."""
    a = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0, quota=room_limits())
    await a.beat()
    busy = [BUCKETS // 2 + n for n in range(10)]  # buckets a plan blind to leases would move
    await lease_rows_in(store, busy)
    b = Membership(store, "node-b", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0, quota=room_limits())
    await b.beat()
    after = await owners(store)
    taken = [bucket for bucket, (owner, _) in after.items() if owner == "node-b"]
    assert len(taken) == BUCKETS // 2  # its fair count, in one heartbeat
    assert all(after[bucket] == ("node-a", False) for bucket in busy)  # the busy ones stay where they are
    assert not any(handing_over for _, handing_over in after.values())  # nothing waits for a lease
    async with store.transaction() as cur:
        assert await b.room_buckets(cur) == []  # the rate-limit window first
        await pass_window(cur)
        assert sorted(await b.room_buckets(cur) or []) == sorted(taken)
        assert set(await a.room_buckets(cur) or []) == set(range(BUCKETS)) - set(taken)


async def test_buckets_go_to_a_starting_node_once_it_may_send_and_are_claimable_at_once(store: SQLStore) -> None:
    """A node starting up takes no bucket until it has joined (may send): the rooms stay with
    the owner delivering them meanwhile. Then it takes its fair count, claimable at once where
    no sink limits a room's messages over a window."""
    a = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0)
    async with a.running():
        assert await a.wait_joined(10)
        await wait_until(lambda: joined_ms(store, "node-a"))  # its heartbeat shows it
        b = Membership(store, "node-b", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0)
        await b.beat()
        await wait_until(lambda: views_agree(store))  # node-a has seen node-b and counts it
        await b.beat()
        assert await owned_by(store, "node-b") == []  # it may not send yet
        assert await owned_by(store, "node-a") == list(range(BUCKETS))
        async with b.running():
            assert await b.wait_joined(10)
            await wait_until(lambda: has_fair_count(store, "node-b"))
            taken = await owned_by(store, "node-b")
            async with store.transaction() as cur:
                assert sorted(await b.room_buckets(cur) or []) == taken  # no window to wait


async def joined_ms(store: SQLStore, node_id: str) -> int:
    async with store.transaction() as cur:
        await cur.execute("SELECT joined_ms FROM room_outbox_node WHERE node_id = %s", (node_id,))
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def views_agree(store: SQLStore) -> bool:
    async with store.transaction() as cur:
        await cur.execute("SELECT DISTINCT view FROM room_outbox_node")
        return len(await cur.fetchall()) == 1


async def has_fair_count(store: SQLStore, node_id: str) -> bool:
    return len(await owned_by(store, node_id)) == BUCKETS // 2


async def test_a_node_joins_as_its_view_turns_a_window_old_not_a_heartbeat_later(store: SQLStore) -> None:
    """A node alone may send once its first view is a rate-limit window old: the heartbeat
    that lets it comes then, not a whole (here far longer) heartbeat interval later."""
    a = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=30.0, node_timeout=90.0)
    async with a.running():
        assert await a.wait_joined(10)  # a heartbeat later would be 30 s after the first
        assert a.quota.nodes == 1


async def test_a_process_that_leaves_alone_gives_its_buckets_up(store: SQLStore) -> None:
    a = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0)
    async with a.running():
        await a.wait_joined(10)
    assert {owner for owner, _ in (await owners(store)).values()} == {None}


async def test_a_process_that_leaves_hands_its_buckets_to_the_one_that_stays_claimable_at_once(
    store: SQLStore,
) -> None:
    """The one that stays claims the leaver's rooms at once, before its own next heartbeat; the
    leaver's row is gone. (Heartbeats made by hand: each node beats only when told.)"""
    a = Membership(store, "node-a", ["room_outbox"], node_timeout=180.0)
    b = Membership(store, "node-b", ["room_outbox"], node_timeout=180.0)
    await wait_until(lambda: beaten_until_joined(b))
    await wait_until(lambda: beaten_until_joined(a, b))  # b sees a; a joins a window later
    await a.beat()  # its row shows it joined: it takes its half
    assert len(await owned_by(store, "node-a")) == BUCKETS // 2
    await a.leave()
    assert await owned_by(store, "node-b") == list(range(BUCKETS))
    async with store.transaction() as cur:
        assert await b.room_buckets(cur) is None  # every bucket, claimable now
        await cur.execute("SELECT node_id FROM room_outbox_node")
        assert [row[0] for row in await cur.fetchall()] == ["node-b"]


async def beaten_until_joined(node: Membership, *others: Membership) -> bool:
    """One heartbeat of each of ``others``, then of ``node``: whether ``node`` has joined."""
    for member in [*others, node]:
        await member.beat()
    return await node.wait_joined(0)


async def test_per_room_claims_take_only_the_own_buckets_in_every_lane(store: SQLStore) -> None:
    """The main lane (room_outbox) and a lane of its own claim the rows of their process's buckets
    only, with per-room ordering; unordered claims take every room."""
    await migrate_lanes(store, ["audit"])
    lane = LaneStore(owner=store, lane="audit", start="beginning")
    a = Membership(store, "node-a", ["room_outbox", lane.table], heartbeat_interval=0.1, node_timeout=3.0)
    b = Membership(store, "node-b", ["room_outbox", lane.table], heartbeat_interval=0.1, node_timeout=3.0)
    for member in (a, b, a, b):
        await member.beat()
    async with store.transaction() as cur:
        await pass_window(cur)
    rooms = [f"r_{n}" for n in range(40)]
    await insert_events(store, [envelope(f"e{n}", room_id=room) for n, room in enumerate(rooms)])
    store.room_buckets = a.room_buckets
    mine = {room for room in rooms if bucket_of("default", room) < BUCKETS // 2}
    assert 0 < len(mine) < len(rooms)
    for lease_store in (store, lane):
        claimed = await lease_store.claim("node-a#1", 100, now_ms() + 30_000, per_room=True)
        assert {row.room_id for row in claimed.rows} == mine, lease_store
        unordered = await lease_store.claim("node-a#2", 100, now_ms() + 30_000)
        assert {row.room_id for row in unordered.rows} == set(rooms) - mine  # the rest, unfiltered


async def test_a_found_row_another_transaction_holds_holds_its_room_back(store: SQLStore) -> None:
    """A per-room claim on the process's own buckets reads without locks, then locks what it
    found: a found row that another transaction holds (the lock skips it) holds the later
    rows of its room back, as any earlier open row does."""
    await insert_events(store, [envelope("a1", room_id="A"), envelope("b1", room_id="B"), envelope("a2", room_id="A")])
    used = {bucket_of("default", "A"), bucket_of("default", "B")}
    spare = next(bucket for bucket in range(BUCKETS) if bucket not in used)

    async def all_but_a_spare_bucket(cur: Any, along: ReadAlong | None = None) -> list[int]:
        return [bucket for bucket in range(BUCKETS) if bucket != spare]  # a list: the claim reads, then locks

    store.room_buckets = all_but_a_spare_bucket
    async with store.transaction() as holder:
        await holder.execute("SELECT id FROM room_outbox WHERE event_id = %s FOR UPDATE", ("a1",))
        claimed = await store.claim("me#1", 10, now_ms() + 60_000, per_room=True, hold_back_ms=5_000)
    assert [row.event_id for row in claimed.rows] == ["b1"]  # a2 waits behind a1


async def test_a_row_another_transaction_holds_holds_its_room_back_in_a_claim_of_every_room(
    store: SQLStore,
) -> None:
    """Claiming every room, the scan locks what it reads and skips what another transaction
    holds: a row skipped so still holds the later rows of its room back."""
    await insert_events(store, [envelope("a1", room_id="A"), envelope("b1", room_id="B"), envelope("a2", room_id="A")])
    async with store.transaction() as holder:
        await holder.execute("SELECT id FROM room_outbox WHERE event_id = %s FOR UPDATE", ("a1",))
        claimed = await store.claim("me#1", 10, now_ms() + 60_000, per_room=True, hold_back_ms=5_000)
    assert [row.event_id for row in claimed.rows] == ["b1"]  # a2 waits behind a1


async def test_the_fence_sees_leases_in_the_profiles_words(store: SQLStore) -> None:
    """A handover waits for a lease however the table's profile names a held row: room_cell's
    'delivering' counts as leased, V1's words alone would miss it."""
    room = "r_fenced"
    await insert_events(store, [envelope("held", room_id=room)])
    async with store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET status = 'delivering', worker_id = 'node-a#1', lock_until_ms = %s",
            (now_ms() + 60_000,),
        )
        bucket = bucket_of("default", room)
        read = await store.row_bucket(cur, "room_outbox", V1)
        assert await still_leased(cur, [("room_outbox", ROOM_CELL, read)], [bucket]) == {bucket}
        assert await still_leased(cur, [("room_outbox", V1, read)], [bucket]) == set()


async def test_migrate_upgrades_an_earlier_install_of_the_buckets(
    store: SQLStore, request: pytest.FixtureRequest
) -> None:
    """An install from before: the claim's index without the bucket (here also on a lane), on
    MySQL the bucket column VIRTUAL in one table and STORED in the other. ``migrate`` rebuilds
    the index with the bucket where the claims read it from the index (the STORED column,
    PostgreSQL's expression), leaves the VIRTUAL column's index without it (no online column
    change of room-service's would be refused), and each column as it is; rows already there
    keep their data and their buckets, and each table's claims read them."""
    if request.node.callspec.params["store"] not in (f"mysql-{CREATED}", "postgresql"):
        pytest.skip("the earlier install is made from the tables migrate creates")
    await migrate_lanes(store, ["kafka"])
    mysql = store.dialect.name == "mysql"
    await insert_events(store, [envelope(f"e{n}", room_id=f"r_{n}") for n in range(20)])
    async with store.transaction() as cur:
        for table, key in (("room_outbox", "id"), ("room_outbox_lane_kafka", "outbox_id")):
            index = f"idx_{table}_claim"
            await cur.execute(f"DROP INDEX {index} ON {table}" if mysql else f"DROP INDEX {index}")
            await cur.execute(f"CREATE INDEX {index} ON {table} (status, lock_until_ms, {key})")
        if mysql:
            await cur.execute(
                "ALTER TABLE room_outbox DROP COLUMN room_bucket, ADD COLUMN room_bucket SMALLINT UNSIGNED"
                " AS (CRC32(CONCAT(app_code, ':', room_id)) % 256) VIRTUAL"
            )
    bucket = "room_bucket" if mysql else "the room bucket"  # PostgreSQL: the bucket's expression
    assert await store.migrate() == (
        [] if mysql else [f"rebuilt index room_outbox.idx_room_outbox_claim with {bucket}"]
    )
    lane = "room_outbox_lane_kafka"
    assert await migrate_lanes(store, ["kafka"]) == [f"rebuilt index {lane}.idx_{lane}_claim with {bucket}"]
    assert await store.migrate() == [] and await migrate_lanes(store, ["kafka"]) == []
    async with store.transaction() as cur:
        if mysql:
            await cur.execute(
                "SELECT TABLE_NAME, EXTRA FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()"
                " AND COLUMN_NAME = 'room_bucket' ORDER BY TABLE_NAME"
            )
            kinds = {table: extra.split()[0].upper() for table, extra in await cur.fetchall()}
            assert kinds == {"room_outbox": "VIRTUAL", lane: "STORED"}
            assert await store.row_bucket(cur, lane, V1) == "room_bucket"  # read in the index
            assert await store.row_bucket(cur, "room_outbox", V1) == row_bucket(store.dialect)  # computed
        await cur.execute(f"SELECT app_code, room_id, {row_bucket(store.dialect)}, envelope FROM room_outbox")
        rows = await cur.fetchall()
    assert len(rows) == 20 and all(bucket == bucket_of(app, room) and body for app, room, bucket, body in rows)


async def test_processes_that_disagree_on_a_lanes_ordering_say_so(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """One process per room, another left with an old configuration claiming any room's rows:
    each says so once, naming the lane and the other's ordering; a lane only one of them runs
    is no disagreement, and the end of it is said once too."""
    a = Membership(store, "node-a", ["room_outbox"], orderings={"main": "per_room", "audit": "none"})
    b = Membership(store, "node-b", ["room_outbox"], orderings={"main": "none"})
    caplog.set_level("INFO", logger="room_outbox.cluster")

    def disagreements() -> list[Any]:
        return [r for r in caplog.records if r.getMessage().startswith("processes disagree")]

    for _ in range(2):
        await a.beat()
        await b.beat()
        await a.beat()
    said = disagreements()
    assert [(r.name, r.lane, r.ordering, r.others) for r in said] == [  # type: ignore[attr-defined]
        ("room_outbox.cluster", "main", "none", {"node-a": "per_room"}),  # b sees a first
        ("room_outbox.cluster", "main", "per_room", {"node-b": "none"}),
    ]
    agreeing = Membership(store, "node-b", ["room_outbox"], orderings={"main": "per_room"})
    await agreeing.beat()
    await a.beat()
    await a.beat()
    ended = [r for r in caplog.records if r.getMessage().startswith("every live process runs its lanes")]
    assert len(disagreements()) == 2 and len(ended) == 1


async def test_processes_that_route_the_main_lanes_events_differently_say_so(
    store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A rolling deploy that enables the Tencent IM sink: a process still without it parks
    RoomUserJoined (no sink), which the others deliver. Each says so once, naming its routes and
    the others; a process that does not claim the main lane (routes None) is no disagreement,
    and the end of it is said once too."""
    im = {"RoomUserJoined": "tencent_im", "RoomCreated": "noop"}
    a = Membership(store, "node-a", ["room_outbox"], orderings={"main": "none"}, routes=im)
    b = Membership(store, "node-b", ["room_outbox"], orderings={"main": "none"}, routes={"RoomCreated": "noop"})
    kafka_only = Membership(store, "node-k", ["room_outbox"], orderings={"kafka": "none"}, routes=None)
    caplog.set_level("INFO", logger="room_outbox.cluster")

    def disagreements() -> list[Any]:
        return [r for r in caplog.records if r.getMessage().startswith("processes disagree on the main lane's routes")]

    for _ in range(2):
        await kafka_only.beat()
        await a.beat()
        await b.beat()
        await a.beat()
    assert [(r.routes, r.others) for r in disagreements()] == [  # type: ignore[attr-defined]
        ({"RoomCreated": "noop"}, ["node-a"]),  # b sees a first
        (im, ["node-b"]),
    ]
    upgraded = Membership(store, "node-b", ["room_outbox"], orderings={"main": "none"}, routes=dict(im))
    await upgraded.beat()
    await a.beat()
    await a.beat()
    ended = [r for r in caplog.records if r.getMessage().startswith("every live process routes")]
    assert len(disagreements()) == 2 and len(ended) == 1


async def test_a_heartbeat_shows_what_fits_in_its_column_and_still_beats(store: SQLStore) -> None:
    """Ten lanes with long names do not fit in room_outbox_node.orderings (255 characters) with
    the routes: the lanes that do not fit are left out, and the heartbeat goes through."""
    lanes = {f"lane_{n:02d}_{'x' * 40}": "per_room" for n in range(10)}
    many = Membership(store, "node-a", ["room_outbox"], orderings=lanes, routes={"RoomCreated": "noop"})
    await many.beat()
    async with store.transaction() as cur:
        await cur.execute("SELECT orderings FROM room_outbox_node WHERE node_id = 'node-a'")
        (shown,) = await cur.fetchone()
    assert shown.startswith("@routes=") and len(shown) <= 255 and shown.count("=per_room") == 4


async def test_migrate_adds_the_orderings_column_to_an_earlier_node_table(store: SQLStore) -> None:
    async with store.transaction() as cur:
        await cur.execute("ALTER TABLE room_outbox_node DROP COLUMN orderings")
    assert await store.migrate() == ["added column room_outbox_node.orderings"]
    assert await store.migrate() == []
    await Membership(store, "node-a", ["room_outbox"], orderings={"main": "none"}).beat()


async def test_a_bucket_table_left_without_its_rows_is_refused_at_start_and_filled_by_migrate(store: SQLStore) -> None:
    """A migrate stopped between creating the bucket table and filling it (a user without
    INSERT): no process would ever own those rooms, and per-room delivery stalled silently."""
    async with store.transaction() as cur:
        await cur.execute(f"DELETE FROM {BUCKET_TABLE} WHERE bucket >= 200")
    with pytest.raises(SchemaError) as refused:
        await check_schema(store)
    assert str(refused.value) == (
        f"table {BUCKET_TABLE} lacks the rows of 56 of its {BUCKETS} room buckets (a migrate stopped half-way):"
        " no process would ever take those rooms' events; run `room-outbox migrate`, which adds them"
    )
    planned = await store.migration_plan()
    assert [step.change for step in planned] == [f"added 56 missing row(s) to table {BUCKET_TABLE}"]
    assert (
        planned[0].statements[0].startswith(f"INSERT INTO {BUCKET_TABLE} (bucket, owner, updated_at_ms) VALUES (200,")
    )
    assert await store.migrate() == [f"added 56 missing row(s) to table {BUCKET_TABLE}"]
    assert sorted(await owners(store)) == list(range(BUCKETS))
    await check_schema(store)
    assert await store.migrate() == []


async def test_a_node_that_just_joined_keeps_its_heartbeats_pace_while_they_fail(database_dsn: str) -> None:
    """Right after joining, a node beats again at once to show it; while its heartbeats fail
    (the database unreachable) it waits its interval between them, as before joining, instead
    of trying again at once in a loop."""
    store = await open_store(database_dsn)
    await store.migrate()
    await store.aclose()  # every heartbeat fails from now on
    member = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=0.2, node_timeout=3.0)
    member._joined_ms = now_ms()  # joined, not shown yet
    beats = 0
    beat = member.beat

    async def counted() -> None:
        nonlocal beats
        beats += 1
        await beat()

    member.beat = counted  # type: ignore[method-assign]
    with anyio.move_on_after(1.0):
        await member._loop()
    assert 1 <= beats <= 7, beats


async def test_buckets_handed_over_open_as_soon_as_their_leases_end_not_a_heartbeat_later(store: SQLStore) -> None:
    """While buckets handed over to a node wait for the former owner's leases, the node looks
    again every few tens of ms: their rooms are claimed by nobody meanwhile."""
    a = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=0.1, node_timeout=10.0)
    b = Membership(store, "node-b", ["room_outbox"], heartbeat_interval=3.0, node_timeout=10.0)
    async with a.running():
        assert await a.wait_joined(10)
        await lease_rows_in(store, list(range(BUCKETS)))  # node-a delivers a row of every bucket
        async with b.running():
            assert await b.wait_joined(10)
            await wait_until(lambda: handing_over_to(store, "node-b"))
            async with store.transaction() as cur:  # the leases end (node-a wrote its results)
                await cur.execute("UPDATE room_outbox SET worker_id = NULL, lock_until_ms = 0, status = 'published'")
            await wait_until(lambda: has_fair_count_claimable(b), timeout=1.0)  # b's heartbeat: 3 s away


async def handing_over_to(store: SQLStore, node_id: str) -> bool:
    handed = [bucket for bucket, (owner, handing) in (await owners(store)).items() if owner == node_id and handing]
    return len(handed) == BUCKETS // 2


async def has_fair_count_claimable(member: Membership) -> bool:
    async with member.store.transaction() as cur:
        return len(await member.room_buckets(cur) or []) == BUCKETS // 2


async def test_a_process_whose_share_ran_out_sends_again_only_once_the_others_have_seen_it(store: SQLStore) -> None:
    """A process frozen past node_timeout (SIGSTOP, a VM paused): the other counted it dead and
    grew into its share. Resumed, it must not send at a share of its own before the other has
    seen it again and shrunk, or the two together exceed the limit."""
    a = Membership(store, "node-a", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0)
    b = Membership(store, "node-b", ["room_outbox"], heartbeat_interval=0.1, node_timeout=3.0)

    async def a_beats_until(done: Callable[[], bool]) -> bool:
        await a.beat()
        return done()

    async with b.running():
        await wait_until(lambda: a_beats_until(lambda: a.quota.split(200) == 100), timeout=15.0, interval=0.1)
        await wait_until(lambda: b.quota.split(200) == 100, timeout=15.0, interval=0.05)
        # a frozen: no heartbeat until b has counted it dead and grown to the whole limit
        await wait_until(lambda: b.quota.split(200) == 200, timeout=20.0, interval=0.05)
        assert a.quota.split(200) == 0  # its share ran out meanwhile
        await a.beat()  # resumed
        assert (a.quota.split(200), b.quota.split(200)) == (0, 200)
        await wait_until(lambda: a_beats_until(lambda: a.quota.split(200) == 100), timeout=15.0, interval=0.1)
        assert b.quota.split(200) == 100  # b shrank before a sent at its share
