"""Live nodes and room buckets, kept in the database every process already shares.

Every room hashes to one of :data:`BUCKETS` buckets (:func:`bucket_of`; in SQL
:meth:`~room_outbox.store.protocol.SQLStore.row_bucket`), and every bucket has one owner among the
live nodes. With per-room ordering a process claims only the rows of its own buckets, so two
processes never compete for one room: claims never collide and a room's events go out from one
process, in order. A bucket changes hands through a fence (:func:`claimable_buckets`,
:func:`assign`): the former owner can take none of its rows once the move has committed, and
the new owner starts only when none of them is leased any more. The bucket column (where a
table has one) and the claim index each table gets are :mod:`room_outbox.store.schema.buckets`'s.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import Dialect, text
from room_outbox.store.dialect import marks as _marks
from room_outbox.store.protocol import ReadAlong
from room_outbox.store.schema.buckets import BUCKET_TABLE, BUCKETS, NODE_TABLE
from room_outbox.store.schema.profiles import Profile


def bucket_key(app_code: str, room_id: str) -> bytes:
    """What the bucket hashes: ``app_code:room_id`` in UTF-8 (a room is per app)."""
    return f"{app_code}:{room_id}".encode()


def bucket_of(app_code: str, room_id: str) -> int:
    """The room's bucket: CRC-32 (IEEE, as zlib and MySQL's ``CRC32()`` compute it) of
    :func:`bucket_key`, modulo :data:`BUCKETS`. Stable across processes, hosts and Python runs
    (unlike ``hash()``), and the same as the database computes."""
    return zlib.crc32(bucket_key(app_code, room_id)) % BUCKETS


async def claimable_buckets(cur: Any, dialect: Dialect, node_id: str, along: ReadAlong | None = None) -> list[int]:
    """The buckets ``node_id`` may claim now, read with a shared lock in the claim's own
    transaction. The fence: a reassignment updates these rows, so it waits until the claim has
    committed, and once it has committed the former owner's claims can no longer take the
    bucket's rows and every lease they took is visible to :func:`still_leased`.

    On MySQL/MariaDB they come as one row: every claim reads them, and the driver's cost per
    row read outweighs the statement's. A list cut short (``group_concat_max_len``) shows in
    its count or its last bucket, and is then read row by row. ``along`` (:class:`ReadAlong`)
    comes in the same row there, joined as a table of one row: the shared lock is taken on the
    bucket rows alone (the joined read, aggregated, is materialised first and locks nothing)."""
    claimable = "WHERE owner = %s AND handing_over = 0 AND claimable_from_ms <= %s"
    params = (node_id, now_ms())
    if dialect.name == "mysql":
        joined, carried, joined_params = "", "", ()
        if along is not None:
            joined = f" CROSS JOIN ({along.sql}) AS along"
            carried = "".join(f", MAX(along.{column})" for column in along.columns)
            joined_params = along.params
        await cur.execute(
            f"SELECT COUNT(*), MAX(bucket), GROUP_CONCAT(bucket ORDER BY bucket){carried}"
            f" FROM {BUCKET_TABLE}{joined} {claimable} LOCK IN SHARE MODE",
            (*joined_params, *params),
        )
        count, highest, listed, *row = await cur.fetchone()
        if along is not None:
            along.row = tuple(row)
        buckets = [int(b) for b in text(listed).split(",") if b] if listed else []
        if len(buckets) == count and (not buckets or buckets[-1] == highest):
            return buckets
    elif along is not None:
        await cur.execute(along.sql, along.params)
        along.row = tuple(await cur.fetchone())
    lock = " LOCK IN SHARE MODE" if dialect.name == "mysql" else " FOR SHARE"
    await cur.execute(f"SELECT bucket FROM {BUCKET_TABLE} {claimable} ORDER BY bucket{lock}", params)
    return [int(row[0]) for row in await cur.fetchall()]


@dataclass(frozen=True)
class NodeRow:
    """A row of ``room_outbox_node``: one per running process, its heartbeat renewed every
    heartbeat (older than the node timeout: dead). ``view`` is the set of live nodes the node
    applies to its quota share right now, ``view_since_ms`` when it started to
    (:mod:`room_outbox.cluster.quota`)."""

    node_id: str
    heartbeat_ms: int
    #: When the node joined (it may send, so it may own buckets); 0 while it joins. Older
    #: versions write their first heartbeat's time here: they count as joined from the start.
    joined_ms: int
    view: str
    view_since_ms: int
    #: Each lane the node runs with its ordering: ``main=per_room,kafka=none``.
    orderings: str = ""


@dataclass(frozen=True)
class BucketRow:
    """A row of ``room_outbox_bucket``: its ``owner`` (None: nobody) claims its rows only when
    ``handing_over`` is false (true: waiting for every other process's leases on it to end)
    and ``claimable_from_ms`` has come."""

    bucket: int
    owner: str | None
    handing_over: bool
    claimable_from_ms: int


async def heartbeat(
    cur: Any, dialect: Dialect, node_id: str, view: str, view_since_ms: int, orderings: str, joined_ms: int
) -> None:
    """Renew ``node_id``'s row; ``joined_ms``: when it joined (may send), 0 while it joins."""
    if dialect.name == "mysql":
        update = " ON DUPLICATE KEY UPDATE heartbeat_ms = VALUES(heartbeat_ms), joined_ms = VALUES(joined_ms),"
        update += " view = VALUES(view), view_since_ms = VALUES(view_since_ms), orderings = VALUES(orderings)"
    else:
        update = " ON CONFLICT (node_id) DO UPDATE SET heartbeat_ms = EXCLUDED.heartbeat_ms,"
        update += " joined_ms = EXCLUDED.joined_ms, view = EXCLUDED.view, view_since_ms = EXCLUDED.view_since_ms,"
        update += " orderings = EXCLUDED.orderings"
    await cur.execute(
        f"INSERT INTO {NODE_TABLE} (node_id, heartbeat_ms, joined_ms, view, view_since_ms, orderings)"
        " VALUES (%s, %s, %s, %s, %s, %s)" + update,
        (node_id, now_ms(), joined_ms, view, view_since_ms, orderings),
    )


async def read_nodes(cur: Any) -> list[NodeRow]:
    await cur.execute(f"SELECT node_id, heartbeat_ms, joined_ms, view, view_since_ms, orderings FROM {NODE_TABLE}")
    return [NodeRow(str(r[0]), int(r[1]), int(r[2]), str(r[3]), int(r[4]), str(r[5])) for r in await cur.fetchall()]


async def read_buckets(cur: Any, lock: bool = False) -> list[BucketRow]:
    await cur.execute(
        f"SELECT bucket, owner, handing_over, claimable_from_ms FROM {BUCKET_TABLE} ORDER BY bucket"
        + (" FOR UPDATE" if lock else "")
    )
    return [BucketRow(int(r[0]), r[1], bool(r[2]), int(r[3])) for r in await cur.fetchall()]


async def assign(cur: Any, moves: dict[int, str], unleased: Collection[int] = (), delay_ms: int = 0) -> None:
    """Give buckets new owners (the caller holds the bucket rows' locks). A bucket in
    ``unleased`` (no row leased in it, read under those locks: no claim of the former owner
    can take one any more) needs no handover: claimable ``delay_ms`` from now. The others start
    with ``handing_over``: the new owner checks each heartbeat (:func:`still_leased`) and opens
    them once no row is leased (:func:`open_buckets`). ``delay_ms``: one rate-limit window where a
    room's owner keeps a limit of the room's messages (the former owner's last requests for a
    group must leave the destination's window first), else 0. A killed owner's leases simply run
    out; a gracefully stopped one leaves none."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for bucket, owner in moves.items():
        groups.setdefault((owner, bucket in unleased), []).append(bucket)
    for (owner, free), buckets in sorted(groups.items()):
        await cur.execute(
            f"UPDATE {BUCKET_TABLE} SET owner = %s, handing_over = %s, claimable_from_ms = %s, updated_at_ms = %s"
            f" WHERE bucket IN ({_marks(buckets)})",
            (owner, 0 if free else 1, now_ms() + delay_ms if free else 0, now_ms(), *sorted(buckets)),
        )


async def still_leased(cur: Any, tables: Iterable[tuple[str, Profile, str]], buckets: Sequence[int]) -> set[int]:
    """Of ``buckets``, those with a row leased right now in any of ``tables`` (each with the
    profile its rows are shaped by, and its rows' bucket in SQL as its claims read it: an
    open row a claim holds until a time to come)."""
    if not buckets:
        return set()
    leased: set[int] = set()
    for table, p, bucket in tables:
        await cur.execute(
            f"SELECT DISTINCT {bucket} FROM {table} WHERE {p.is_open()} AND {p.lock} > {p.ms('%s')}"
            f" AND {bucket} IN ({_marks(buckets)}) AND worker_id IS NOT NULL",
            (now_ms(), *buckets),
        )
        leased.update(int(row[0]) for row in await cur.fetchall())
    return leased


async def open_buckets(cur: Any, node_id: str, buckets: Sequence[int], delay_ms: int) -> None:
    """End the handover of ``buckets`` (still owned by ``node_id``): claimable after ``delay_ms``."""
    if buckets:
        await cur.execute(
            f"UPDATE {BUCKET_TABLE} SET handing_over = 0, claimable_from_ms = %s, updated_at_ms = %s"
            f" WHERE owner = %s AND handing_over = 1 AND bucket IN ({_marks(buckets)})",
            (now_ms() + delay_ms, now_ms(), node_id, *buckets),
        )


async def leave(cur: Any, node_id: str) -> None:
    """A graceful stop: give up every bucket and the node row (the caller has written its
    results, so it leaves no lease behind)."""
    await cur.execute(
        f"UPDATE {BUCKET_TABLE} SET owner = NULL, handing_over = 0, updated_at_ms = %s WHERE owner = %s",
        (now_ms(), node_id),
    )
    await cur.execute(f"DELETE FROM {NODE_TABLE} WHERE node_id = %s", (node_id,))


async def forget_nodes(cur: Any, node_ids: Sequence[str]) -> None:
    """Drop the rows of dead nodes (their buckets were reassigned in the same transaction)."""
    if node_ids:
        await cur.execute(f"DELETE FROM {NODE_TABLE} WHERE node_id IN ({_marks(node_ids)})", tuple(node_ids))
