"""Read-only queries over the outbox table (its profile's names) for health checks, metrics,
operators and the demo: what the tables say, never a change. Every statement is one all
stores speak.

Queries that run often stay on an index: :func:`sample_backlog` (the metrics timer) reads the
open rows' index range once, plus one row by primary key (:mod:`room_outbox.store.by_status`).
The status report counts rows in the status index (exact counts) and reads rows themselves
only from a sample of at most :data:`STATUS_SAMPLE` rows of each status, which it says it is."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from room_outbox.store.backends.leased import CREATED_AHEAD_MS, bounded_by_key
from room_outbox.store.by_status import open_rows, status_read
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import column_names, index_names, key_chunks, marks, table_names, text
from room_outbox.store.lanes.catalog import own_lane_backlog, stored_lanes
from room_outbox.store.lanes.store import lane_table
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.lanes import PARKED_ORDER
from room_outbox.store.schema.outbox import claim_index
from room_outbox.store.schema.profiles import V1
from room_outbox.store.schema.tail import PARKED, PARKED_TABLE, SKIPPED_TABLE


async def ping(store: SQLStore) -> None:
    """One round trip: raises when the database does not answer (the readiness check)."""
    async with store.transaction() as cur:
        await cur.execute("SELECT 1")


#: PostgreSQL's table lock modes that hold up a write (a row lock's RowExclusiveLock): a DBA's
#: ``LOCK TABLE``, ``VACUUM FULL``, ``ALTER TABLE``, ``CREATE INDEX`` without CONCURRENTLY.
_PG_WRITE_BLOCKING = ("ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock")
#: At most this many blocking sessions are named.
_BLOCKERS_NAMED = 3


async def lock_blockers(store: SQLStore) -> list[str]:
    """The sessions most likely holding this command up with a lock, each in a few words (the
    session's id, what it runs, since when), for a statement abandoned at query_timeout: on
    PostgreSQL those holding a lock on the outbox table that holds up writes, and those any
    session of this database waits for; on MariaDB the transactions others wait for on a lock
    of the outbox table (InnoDB's lock waits: row locks). One query, run once the command has failed; [] where nothing is
    known (no blocker, SQLite, or the catalogue not readable: no PROCESS privilege, MySQL 8)."""
    try:
        async with store.transaction() as cur:
            if store.dialect.name == "postgresql":
                await cur.execute(
                    "SELECT a.pid, a.usename, a.application_name, a.xact_start, a.query FROM pg_stat_activity a"
                    " WHERE a.pid <> pg_backend_pid() AND a.datname = current_database() AND (a.pid IN"
                    " (SELECT l.pid FROM pg_locks l WHERE l.granted AND l.relation = to_regclass(%s) AND l.mode = ANY(%s))"
                    " OR a.pid IN (SELECT unnest(pg_blocking_pids(w.pid)) FROM pg_stat_activity w"
                    " WHERE w.datname = current_database() AND w.wait_event_type = 'Lock'))"
                    " ORDER BY a.xact_start LIMIT %s",
                    (store.profile.table, list(_PG_WRITE_BLOCKING), _BLOCKERS_NAMED),
                )
                found = await cur.fetchall()
                return [_session(f"session {pid} ({user}, {app or 'no application name'})", since, query)
                        for pid, user, app, since, query in found]  # fmt: skip
            if store.dialect.name == "mysql":
                # Only the waits for a lock on the outbox table: the server's other databases
                # have lock waits of their own, which hold nothing of this command's up.
                await cur.execute(
                    "SELECT t.trx_mysql_thread_id, t.trx_started, t.trx_query FROM information_schema.INNODB_TRX t"
                    " WHERE t.trx_id IN (SELECT w.blocking_trx_id FROM information_schema.INNODB_LOCK_WAITS w"
                    " JOIN information_schema.INNODB_LOCKS l ON l.lock_id = w.blocking_lock_id"
                    " WHERE l.lock_table = CONCAT('`', DATABASE(), '`.`', %s, '`'))"
                    " ORDER BY t.trx_started LIMIT %s",
                    (store.profile.table, _BLOCKERS_NAMED),
                )
                found = await cur.fetchall()
                return [_session(f"connection {thread}", since, query) for thread, since, query in found]
    except Exception:  # the command's own error says what is known: this only adds to it
        return []
    return []


def _session(who: str, since: object, query: object) -> str:
    """A blocking session in a few words: its transaction's start and its last statement."""
    statement = " ".join(str(query or "").split())[:80] or "idle"
    started = since.isoformat(sep=" ", timespec="seconds") if isinstance(since, datetime) else since
    return f"{who}, in a transaction since {started}: {statement}"


async def count_by_status(store: SQLStore, event_id_prefix: str) -> dict[str, int]:
    """How many rows whose event_id starts with the prefix are in each status."""
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT status, COUNT(*) FROM {p.table} WHERE {p.event_id} LIKE %s GROUP BY status",
            (f"{event_id_prefix}%",),
        )
        return {str(status): int(count) for status, count in await cur.fetchall()}


async def status_by_event(store: SQLStore, event_id_prefix: str) -> dict[str, str]:
    """The status of every row whose event_id starts with the prefix, by event_id."""
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT {p.event_id}, status FROM {p.table} WHERE {p.event_id} LIKE %s", (f"{event_id_prefix}%",)
        )
        return {str(event_id): str(status) for event_id, status in await cur.fetchall()}


@dataclass(frozen=True)
class Backlog:
    pending: int
    #: Age of the lowest-id pending row (ids rise with inserts, so it is the oldest but for
    #: transactions that committed late); 0 when nothing is pending or it was created ahead
    #: of the database's clock.
    oldest_pending_age_ms: int
    #: That row's creation time (epoch ms); None: none is pending, or it has none.
    oldest_pending_created_ms: int | None = None


async def sample_backlog(store: SQLStore) -> Backlog:
    """Pending count and oldest pending age: both read only the index range of pending rows
    and one row by primary key, however many published rows the table holds."""
    async with store.transaction() as cur:
        pending, oldest = await open_rows(cur, store)
    return Backlog(pending, 0 if oldest is None else max(0, now_ms() - oldest), oldest)


#: Retry-count histogram buckets of the status report: (label, lowest, highest).
RETRY_BUCKETS = (("0", 0, 0), ("1", 1, 1), ("2-4", 2, 4), ("5-9", 5, 9), ("10-99", 10, 99), ("100+", 100, None))


@dataclass(frozen=True)
class LeaseHolder:
    node: str
    claims: int
    rows: int
    #: Latest lease end among its rows (epoch ms).
    lease_until_ms: int


@dataclass(frozen=True)
class LaneStatus:
    """A lane of its own (Kafka, audit...): how far it is fed and what it still owes."""

    lane: str
    fed_through_id: int
    #: room_outbox rows not in the lane's table yet (above its watermark).
    unfed: int
    pending: int
    parked: int
    #: The lane's events skipped and never sent: rows in the ranges it (a lane table's feeder,
    #: or a tailing lane) gave up on as rolled back (missing longer than ``gap_timeout``), which
    #: committed after all.
    skipped: int = 0
    #: The lane's parked rows' most frequent errors, grouped as the main lane's
    #: (:func:`grouped_errors`), among its latest :data:`STATUS_SAMPLE`.
    top_parked_errors: list[tuple[str, int]] = field(default_factory=list)


@dataclass(frozen=True)
class StatusReport:
    pending: int
    oldest_pending_age_ms: int
    #: Pending rows not claimable now: waiting for their retry time.
    waiting_for_retry: int
    #: Parked (``failed``) and ``cancelled`` rows, when the lane has them, in that order: the
    #: order of a row's life, after the pending ones (leased among them), which ``status`` keeps.
    other_statuses: dict[str, int]
    #: Rows still to deliver by retry count, among the oldest :data:`STATUS_SAMPLE` of each
    #: status: all of them unless :attr:`retry_histogram_sampled`.
    retry_histogram: dict[str, int]
    #: The most frequent errors (grouped: :func:`grouped_errors`) of the rows still to deliver
    #: that have failed (retrying), among the oldest :data:`STATUS_SAMPLE` of each status.
    top_errors: list[tuple[str, int]]
    leased: int
    holders: list[LeaseHolder] = field(default_factory=list)
    lanes: list[LaneStatus] = field(default_factory=list)
    #: False when no main-lane sink is enabled: ``room_outbox.status`` is then room-service's
    #: alone, and its pending rows are nobody's backlog here (the IM figures above are 0).
    im_lane: bool = True
    #: The same for the parked (``failed``) rows, among the latest :data:`STATUS_SAMPLE`.
    top_parked_errors: list[tuple[str, int]] = field(default_factory=list)
    #: The rows of each status the error counts and the retry histogram read at most.
    error_sample: int = 0
    #: Whether the retry histogram counts a sample (more rows are still to deliver than it read).
    retry_histogram_sampled: bool = False
    #: The oldest pending row's creation time (epoch ms; None: none pending or it has none):
    #: ahead of now where its producer's clock is (``oldest_pending_age_ms`` is 0 then).
    oldest_pending_created_ms: int | None = None
    #: The producer's rows no claim has taken that were created more than ``claim_after``
    #: ahead of the database's clock, among the oldest :data:`STATUS_SAMPLE` of them: the
    #: claim leaves them until they are that old by their creation time, unless requeued.
    created_ahead: int = 0
    #: How far the furthest of them is ahead of the database's clock (ms); 0: none.
    created_ahead_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for name in ("top_errors", "top_parked_errors"):
            doc[name] = [{"last_error": error, "rows": rows} for error, rows in getattr(self, name)]
        for lane, entry in zip(self.lanes, doc["lanes"], strict=True):
            entry["top_parked_errors"] = [{"last_error": error, "rows": rows} for error, rows in lane.top_parked_errors]
        return doc


async def status_report(store: SQLStore, top: int = 10, im_lane: bool = True) -> StatusReport:
    if not im_lane:
        empty = {label: 0 for label, _, _ in RETRY_BUCKETS}
        return StatusReport(0, 0, 0, {}, empty, [], 0, lanes=await lane_statuses(store), im_lane=False)
    now = now_ms()
    backlog = await sample_backlog(store)
    words = store.profile
    table = words.table
    async with store.transaction() as cur:
        lock, after = words.lock, words.ms("%s")
        by_retries = await _retries_sampled(store, cur)
        # Rows still to deliver: the oldest, the head of the backlog, where the failing rows wait;
        # parked rows: the latest, what failed last (in an incident, the incident).
        top_errors = (await _frequent_errors(store, cur, words.open, latest=False))[:top]
        top_parked_errors = (await _frequent_errors(store, cur, (words.parked,), latest=True))[:top]
        await cur.execute(
            f"SELECT worker_id, COUNT(*), MAX({words.as_ms(lock)}) FROM {table}"
            f" WHERE status = '{words.in_flight}' AND worker_id IS NOT NULL AND {lock} > {after} GROUP BY worker_id",
            (now,),
        )
        claims = await cur.fetchall()
        await cur.execute(
            f"SELECT COUNT(*) FROM {table} WHERE {words.is_waiting()} AND worker_id IS NULL AND {lock} > {after}",
            (now,),
        )
        (waiting,) = await cur.fetchone()
        ahead, ahead_ms = await _created_ahead(store, cur, now)
        other: dict[str, int] = {}
        for status in (words.parked, words.cancelled):  # each an index range count; absent statuses cost nothing
            await cur.execute(f"SELECT COUNT(*) FROM {table} WHERE status = %s", (status,))
            (count,) = await cur.fetchone()
            if count:
                other[status] = int(count)
    histogram = {
        label: sum(rows for retries, rows in by_retries.items() if low <= retries and (high is None or retries <= high))
        for label, low, high in RETRY_BUCKETS
    }
    holders: dict[str, list[int]] = {}
    for worker_id, rows, until in claims:
        node = str(worker_id).rsplit("#", 1)[0]  # claims are "<identity>#<n>", the identity "<node_id>~<token>"
        entry = holders.setdefault(node, [0, 0, 0])
        entry[0] += 1
        entry[1] += int(rows)
        entry[2] = max(entry[2], int(until))
    return StatusReport(
        pending=backlog.pending,
        oldest_pending_age_ms=backlog.oldest_pending_age_ms,
        waiting_for_retry=int(waiting),
        other_statuses=other,
        retry_histogram=histogram,
        retry_histogram_sampled=sum(histogram.values()) < backlog.pending,
        oldest_pending_created_ms=backlog.oldest_pending_created_ms,
        created_ahead=ahead,
        created_ahead_ms=ahead_ms,
        top_errors=top_errors,
        top_parked_errors=top_parked_errors,
        error_sample=STATUS_SAMPLE,
        leased=sum(entry[1] for entry in holders.values()),
        holders=[LeaseHolder(node, c, r, u) for node, (c, r, u) in sorted(holders.items())],
        lanes=await lane_statuses(store),
    )


#: Distinct last_error values the status report groups (the most frequent first).
ERRORS_READ = 1000

#: Rows of each status whose retry counts and errors the status report counts, the oldest (or
#: latest) by key: read on the (status, id) index, a status with millions of rows costs the
#: report no more than this many row reads; on a table without it, that status's rows (see
#: :mod:`room_outbox.store.by_status`), never the other statuses'. Counts of rows are exact
#: (the status index counts them without reading the rows).
STATUS_SAMPLE = 10_000


async def _created_ahead(store: SQLStore, cur: Any, now: int) -> tuple[int, int]:
    """How many of the producer's rows no claim has taken were created more than
    ``claim_after`` ahead of the database's clock (``now``), and how far the furthest is (ms):
    the claim holds them back until then (see
    :meth:`~room_outbox.store.backends.leased.LeasedRows._due_by_age`). No index holds the
    creation time: the oldest :data:`STATUS_SAMPLE` of those rows are read, where such rows
    stay while the others are claimed, on an exact index range (:func:`_unclaimed_rows`).
    (0, 0) without ``claim_after``."""
    if store.claim_after_ms <= 0:
        return 0, 0
    sample = await _unclaimed_rows(store, cur, f"{store.profile.as_ms(store.profile.created)} AS created")
    await cur.execute(
        f"SELECT COUNT(*), MAX(created) FROM ({sample}) AS sample WHERE created > %s",
        (STATUS_SAMPLE, now + store.claim_after_ms),
    )
    count, furthest = await cur.fetchone()
    return int(count), 0 if furthest is None else int(furthest) - now


async def _unclaimed_rows(store: SQLStore, cur: Any, columns: str) -> str:
    """SQL: ``columns`` of the first rows no claim has taken (the producer's status and, where
    its rows sit at the cleared ``lock``, that ``lock``: v1, room_cell), in key order, as many as
    its one ``%s``. Those of v1 and room_cell are the claim index's range (status, the cleared
    ``lock``) where the table has it: the status index would also pass over the rows waiting for
    a retry, which share the status there (v1), however many."""
    p = store.profile
    read = await status_read(cur, store)
    if not p.fresh_at_cleared_lock:
        return read.first_rows(columns, p.fresh)
    unclaimed = [f"{p.lock} = {p.lock_cleared}"]
    claim = claim_index(p.table)[0]
    if claim.lower() not in await index_names(cur, store.dialect, p.table):
        return read.first_rows(columns, p.fresh, unclaimed)
    conditions = " AND ".join([f"status = '{p.fresh}'", *unclaimed])
    return (
        f"SELECT {columns} FROM {p.table}{store.dialect.index_hint.format(index=claim)}"
        f" WHERE {conditions} ORDER BY {p.key} LIMIT %s"
    )


async def _retries_sampled(store: SQLStore, cur: Any) -> dict[int, int]:
    """Rows still to deliver by retry count, among the oldest :data:`STATUS_SAMPLE` of each
    open status (a status at a time: one index range each)."""
    read = await status_read(cur, store)
    attempts = store.profile.attempts_made
    by_retries: dict[int, int] = {}
    for status in store.profile.open:
        sample = read.first_rows(f"{attempts} AS retries", status)
        await cur.execute(f"SELECT retries, COUNT(*) FROM ({sample}) AS sample GROUP BY retries", (STATUS_SAMPLE,))
        for retries, rows in await cur.fetchall():
            by_retries[int(retries)] = by_retries.get(int(retries), 0) + int(rows)
    return by_retries


async def _frequent_errors(store: SQLStore, cur: Any, statuses: Sequence[str], latest: bool) -> list[tuple[str, int]]:
    """The errors of :data:`STATUS_SAMPLE` rows of each of ``statuses`` (the ``latest``: highest
    keys, else the oldest), grouped (:func:`grouped_errors`), the most frequent first. A status
    at a time: one index range each, where an IN list would sort all of their rows first."""
    read = await status_read(cur, store)
    counts: list[tuple[str, int]] = []
    for status in dict.fromkeys(statuses):
        sample = read.first_rows("last_error", status, descending=latest)
        await cur.execute(
            f"SELECT last_error, COUNT(*) AS n FROM ({sample}) AS sample WHERE last_error IS NOT NULL"
            " GROUP BY last_error ORDER BY n DESC, last_error LIMIT %s",
            (STATUS_SAMPLE, ERRORS_READ),
        )
        counts += [(str(error), int(rows)) for error, rows in await cur.fetchall()]
    return grouped_errors(counts)


#: An identifier inside an error: the value after a name such as ``GroupId`` or ``room_id`` that
#: looks like one (after ``=`` or ``:``, quoted, or holding a digit: "GroupId must be ..." keeps
#: its words), or a token of 8+ characters mixing letters and digits. Error codes (digits alone) stay.
_IDENTIFIER = re.compile(
    r"(?P<key>\b(?:group_?id|room_?id|event_?id|msg_?id|to_account|id)\b"
    r"(?:\s*[=:]\s*|\s+(?=['\"]|[^\s,;)\]]*\d)))"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s,;)\]]+)"
    r"|(?P<token>\b(?=[\w#@-]*\d)(?=[\w#@-]*[A-Za-z])[\w#@-]{8,}\b)",
    re.IGNORECASE,
)


def error_pattern(error: str) -> str:
    """``error`` with its identifiers written ``<id>``: errors that differ only by the group
    or room they hit are one line in a report."""
    return _IDENTIFIER.sub(lambda m: f"{m['key']}<id>" if m["key"] is not None else "<id>", error)


def grouped_errors(counts: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Errors by :func:`error_pattern`, with their summed counts, the most frequent first."""
    groups: dict[str, int] = {}
    for error, rows in counts:
        pattern = error_pattern(error)
        groups[pattern] = groups.get(pattern, 0) + rows
    return sorted(groups.items(), key=lambda item: (-item[1], item[0]))


async def lane_statuses(store: SQLStore, top: int = 10) -> list[LaneStatus]:
    """One line per lane of its own that has run, with its parked rows' errors."""
    lanes = []
    for lane in await stored_lanes(store):
        if lane.fed_through_id is None:
            continue
        owed = await own_lane_backlog(store, lane)
        errors = [] if not owed.parked else (await _parked_errors(store, lane.name, lane.has_table))[:top]
        lanes.append(
            LaneStatus(lane.name, lane.fed_through_id, owed.unfed, owed.pending, owed.parked, owed.skipped, errors)
        )
    return lanes


async def _parked_errors(store: SQLStore, lane: str, has_table: bool) -> list[tuple[str, int]]:
    """The errors of a lane's latest :data:`STATUS_SAMPLE` parked rows, grouped as the main
    lane's (:func:`grouped_errors`), the most frequent first: from its own table (``relay:
    lane_table``) or the tailing lanes' parked table."""
    if has_table:
        return await _lane_table_parked_errors(store, lane)
    return await _tail_parked_errors(store, lane)


async def _lane_table_parked_errors(store: SQLStore, lane: str) -> list[tuple[str, int]]:
    """The errors of a lane table's latest :data:`STATUS_SAMPLE` parked rows: a backward walk of
    its claim index (:data:`~room_outbox.store.schema.lanes.PARKED_ORDER`)."""
    order = ", ".join(f"{column} DESC" for column in PARKED_ORDER)
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT last_error, COUNT(*) AS n FROM (SELECT last_error FROM {lane_table(lane)}"
            f" WHERE status = '{V1.parked}' ORDER BY {order} LIMIT %s) AS sample"
            " WHERE last_error IS NOT NULL GROUP BY last_error ORDER BY n DESC, last_error LIMIT %s",
            (STATUS_SAMPLE, ERRORS_READ),
        )
        return grouped_errors([(str(error), int(rows)) for error, rows in await cur.fetchall()])


async def _tail_parked_errors(store: SQLStore, lane: str) -> list[tuple[str, int]]:
    """The errors of a tailing lane's latest :data:`STATUS_SAMPLE` parked rows, grouped as the
    main lane's (:func:`grouped_errors`), the most frequent first: an index range of the parked
    table's primary key (lane, outbox_id)."""
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT last_error, COUNT(*) AS n FROM (SELECT last_error FROM {PARKED_TABLE}"
            " WHERE lane = %s AND status = %s ORDER BY outbox_id DESC LIMIT %s) AS sample"
            " WHERE last_error IS NOT NULL GROUP BY last_error ORDER BY n DESC, last_error LIMIT %s",
            (lane, PARKED, STATUS_SAMPLE, ERRORS_READ),
        )
        return grouped_errors([(str(error), int(rows)) for error, rows in await cur.fetchall()])


def matching_event(store: SQLStore, event_id: str, app_code: str | None = None) -> tuple[str, list[Any]]:
    """SQL and parameters: the rows of ``event_id``, of app ``app_code`` only when given. Event
    ids may be unique per app only (``UNIQUE (app_code, event_id)``): one id may name rows of
    several apps, and the operator commands that change a row refuse such an id without the app."""
    p = store.profile
    if app_code is None:
        return f"{p.event_id} = %s", [event_id]
    return f"{p.event_id} = %s AND {p.app_code} = %s", [event_id, app_code]


async def event_rows(
    store: SQLStore, event_id: str, app_code: str | None = None
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every row of ``event_id`` (of ``app_code`` when given), lowest key first: each as stored
    (every column by name but ``envelope``), its times (:attr:`~.profiles.Profile.time_columns`)
    in epoch ms, and what room-outbox reads of it under the profile's column names (``key``,
    ``event_id``, ``event_type``, ``room_id``, ``app_code``, ``envelope``)."""
    p = store.profile
    read = {
        "key": p.key, "event_id": p.event_id, "event_type": p.event_type, "room_id": p.room_id,
        "app_code": p.app_code, "envelope": store.envelope_column,
    }  # fmt: skip
    where, params = matching_event(store, event_id, app_code)
    async with store.transaction() as cur:
        # Every column but the raw envelope: ``envelope`` reads it as the store does (as bytes
        # where the server cannot send it as text, a marker where it is too large: see
        # LeasedRows.read_envelope). Times as epoch ms, whatever the table keeps: a timestamp
        # without time zone is a wall time, an instant only in the zone the claim takes it in.
        columns = [
            f"{p.as_ms(name)} AS {name}" if name in p.time_columns else name
            for name in await column_names(cur, store.dialect, p.table)
            if name != "envelope"
        ]
        # The catalogue lists only the columns the user holds a privilege on: with none, the
        # statement reads the rest alone, and the server's refusal names the privilege.
        reads = [*columns, *(f"{sql} AS read_{name}" for name, sql in read.items())]
        await cur.execute(f"SELECT {', '.join(reads)} FROM {p.table} WHERE {where} ORDER BY {p.key}", params)
        found = await cur.fetchall()
        names = [d[0] for d in cur.description]
    rows = [dict(zip(names, values, strict=True)) for values in found]
    return [(row, {name: row.pop(f"read_{name}") for name in read}) for row in rows]


async def event_apps(store: SQLStore, event_id: str) -> list[str]:
    """The app code of each row of ``event_id`` (the rows the table's own comparison matches,
    as :func:`event_rows` and ``cancel`` find them), in order."""
    where, params = matching_event(store, event_id)
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT {store.profile.app_code} FROM {store.profile.table} WHERE {where} ORDER BY 1", params
        )
        return [text(app_code) for (app_code,) in await cur.fetchall()]


#: Event ids looked up per statement by :func:`any_event_of_several_apps`: ids of up to a
#: hundred-odd characters, so fewer than row keys (:data:`KEYS_PER_STATEMENT`) to keep a
#: statement within a 64 kB ``max_allowed_packet``.
EVENT_IDS_PER_LOOKUP = 250


async def any_event_of_several_apps(store: SQLStore, event_ids: Sequence[str]) -> bool:
    """Whether one of ``event_ids`` names rows of several apps, in a statement per
    :data:`EVENT_IDS_PER_LOOKUP` ids. The rows are grouped by the column itself, so the table's
    own comparison decides which ids are one (as ``=`` does in :func:`event_apps`)."""
    p = store.profile
    for chunk in key_chunks(event_ids, EVENT_IDS_PER_LOOKUP):
        async with store.transaction() as cur:
            await cur.execute(
                f"SELECT 1 FROM {p.table} WHERE {p.event_id} IN ({marks(chunk)})"
                f" GROUP BY {p.event_id} HAVING COUNT(DISTINCT {p.app_code}) > 1 LIMIT 1",
                chunk,
            )
            if await cur.fetchone() is not None:
                return True
    return False


async def lane_row(store: SQLStore, lane: str, outbox_id: int) -> dict[str, Any] | None:
    """Outbox row ``outbox_id``'s row in a lane of its own; ``None`` when the lane has none
    (or keeps no table: a tailing lane, see :func:`tail_parked_row`)."""
    async with store.transaction() as cur:
        if lane_table(lane) not in await table_names(cur, store.dialect):
            return None
        await cur.execute(f"SELECT * FROM {lane_table(lane)} WHERE outbox_id = %s", (outbox_id,))
        found = await cur.fetchone()
        names = [d[0] for d in cur.description]
    return None if found is None else dict(zip(names, found, strict=True))


async def tail_parked_row(store: SQLStore, lane: str, outbox_id: int) -> dict[str, Any] | None:
    """Outbox row ``outbox_id`` as a tailing lane parked it; ``None`` when it is not parked there."""
    async with store.transaction() as cur:
        if PARKED_TABLE not in await table_names(cur, store.dialect):
            return None
        await cur.execute(
            f"SELECT status, last_error FROM {PARKED_TABLE} WHERE lane = %s AND outbox_id = %s", (lane, outbox_id)
        )
        found = await cur.fetchone()
    return None if found is None else {"status": found[0], "last_error": found[1]}


async def tail_skipped_range(store: SQLStore, lane: str, outbox_id: int) -> dict[str, int] | None:
    """The range ``lane`` (tailing, or a lane of its own's feeder) skipped that holds
    ``outbox_id`` (``low_id``, ``high_id``, ``skipped_at_ms``); None when no skipped range
    holds it."""
    async with store.transaction() as cur:
        if SKIPPED_TABLE not in await table_names(cur, store.dialect):
            return None
        await cur.execute(
            f"SELECT low_id, high_id, skipped_at_ms FROM {SKIPPED_TABLE}"
            " WHERE lane = %s AND low_id <= %s AND high_id >= %s",
            (lane, outbox_id, outbox_id),
        )
        found = await cur.fetchone()
    return (
        None if found is None else {"low_id": int(found[0]), "high_id": int(found[1]), "skipped_at_ms": int(found[2])}
    )


async def earlier_open_rows(store: SQLStore, key: int, app_code: str, room_id: str) -> list[dict[str, Any]]:
    """The open rows of room ``room_id`` of app ``app_code`` before row ``key``, lowest key first,
    with what a row's delivery state is told from: its key, event id, status, attempts, lease
    or retry time and creation time (epoch ms, under the profile's column names) and worker_id.
    Per-room ordering holds row ``key`` back behind the first of them a claim would not take."""
    p = store.profile
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT {p.key}, {p.event_id}, status, {p.attempts}, {p.as_ms(p.lock)}, {p.as_ms(p.created)}, worker_id"
            f" FROM {p.table} WHERE {p.room_id} = %s AND {p.app_code} = %s AND {p.is_open()} AND {p.key} < %s"
            f" ORDER BY {p.key}",
            (room_id, app_code, key),
        )
        names = ("key", "event_id", "status", p.attempts, p.lock, p.created, "worker_id")
        return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]


async def first_young_row_before(store: SQLStore, key: int) -> dict[str, Any] | None:
    """Where the claim takes the producer's rows that no claim has taken yet only up to the
    first one younger than ``claim_after`` (:func:`bounded_by_key`) and row ``key`` is such a
    row: that first young row before it (its key, event id and creation time in epoch ms),
    which holds it back, of whatever room. None otherwise."""
    p = store.profile
    if not bounded_by_key(store.claim_after_ms, store.dialect, p):
        return None
    now, unclaimed = store.dialect.now_ms, f"status = '{p.fresh}' AND {p.lock} = {p.lock_cleared}"
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT {p.key}, {p.event_id}, {p.as_ms(p.created)} FROM {p.table} WHERE {unclaimed} AND {p.key} < %s"
            f" AND {p.created} > {now} - %s AND {p.created} <= {now} + {CREATED_AHEAD_MS}"
            f" AND EXISTS (SELECT 1 FROM {p.table} r WHERE r.{p.key} = %s AND {unclaimed})"
            f" ORDER BY {p.key} LIMIT 1",
            (key, store.claim_after_ms, key),
        )
        found = await cur.fetchone()
    return None if found is None else {"key": int(found[0]), "event_id": text(found[1]), "created": int(found[2])}


async def holds_rows_besides(store: SQLStore, event_id_prefix: str) -> bool:
    """Whether the outbox table exists and holds a row whose event_id does not start with the
    prefix; it stops at the first such row, however large the table."""
    p = store.profile
    async with store.transaction() as cur:
        if p.table.lower() not in await table_names(cur, store.dialect):
            return False
        await cur.execute(f"SELECT 1 FROM {p.table} WHERE {p.event_id} NOT LIKE %s LIMIT 1", (f"{event_id_prefix}%",))
        return await cur.fetchone() is not None
