"""The statements of the operator commands that change rows: ``requeue`` and ``cancel``, in
SQL all three stores speak and the words of the table's profile (see :mod:`room_outbox.cli.requeue` for the commands themselves),
and the selection of ``requeue --lane`` among a lane's parked rows (a tailing lane's entries, a
lane table's rows) and the events it skipped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from room_outbox.errors import SchemaError
from room_outbox.store.backends.errors import refused_value
from room_outbox.store.by_status import status_read
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import key_chunks, marks, table_names
from room_outbox.store.lanes.store import LaneStore
from room_outbox.store.operator.reports import matching_event
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.columns import column_problems, printed_name, read_columns
from room_outbox.store.schema.lanes import PARKED_ORDER, lane_table
from room_outbox.store.schema.profiles import V1, Profile, in_list
from room_outbox.store.schema.tail import (
    LANE_SKIPPED_ERROR,
    PARKED,
    PARKED_TABLE,
    SKIPPED,
    SKIPPED_ERROR,
    SKIPPED_TABLE,
    skipped_rows,
)


@dataclass(frozen=True)
class RequeueFilter:
    """Which rows ``room-outbox requeue`` selects; every given criterion must hold."""

    event_ids: tuple[str, ...] = ()
    #: Rows of this app only (event ids may be unique per app only: see :func:`matching_event`).
    app_code: str | None = None
    event_type: str | None = None
    error_contains: str | None = None
    older_than_ms: int | None = None  # created at least this long ago
    #: ``pending``: rows still to deliver (in the profile's words: pending, retryable, a
    #: claim run out...); ``failed``: parked rows.
    statuses: tuple[str, ...] = ("pending", "failed")


def _statuses(words: Profile, wanted: Sequence[str]) -> list[str]:
    """The table's status words for the command line's ``pending`` and ``failed``."""
    found: list[str] = []
    if "pending" in wanted:
        found += words.open
    if "failed" in wanted:
        found.append(words.parked)
    return found


async def find_requeue_candidates(store: SQLStore, where: RequeueFilter, limit: int = 10_000) -> list[dict[str, Any]]:
    """Rows the filter selects, lowest key first, leaving out rows leased right now (their
    in-flight result would be lost) and rows neither pending nor failed (published, cancelled).

    Event ids lead to their rows by the event id's index. Without them, the rows are read a
    status at a time on a status index (:mod:`room_outbox.store.by_status`), each up to
    ``limit``, and the lowest keys of all of them kept: the selection reads the rows of the
    statuses it selects, never the published ones."""
    statuses = list(dict.fromkeys(_statuses(store.profile, where.statuses)))
    if not statuses:
        return []
    p = store.profile
    clauses = [f"NOT (worker_id IS NOT NULL AND {p.lock} > {p.ms('%s')})"]
    params: list[Any] = [now_ms()]
    _id_and_error_clauses(store, where, p.event_id, clauses, params)
    of_row, of_row_params = _row_clauses(store, where)
    columns = (
        f"{p.key} AS id, {p.event_id} AS event_id, {p.app_code} AS app_code, {p.event_type} AS event_type,"
        f" {p.room_id} AS room_id, status, {p.attempts_made} AS retry_count, last_error,"
        f" {p.as_ms(p.created)} AS created_at_ms"
    )
    conditions = [*clauses, *of_row]
    found: list[dict[str, Any]] = []
    async with store.transaction() as cur:
        if where.event_ids:
            of_statuses = in_list("status", tuple(statuses))
            selects = [
                f"SELECT {columns} FROM {p.table} WHERE {' AND '.join([of_statuses, *conditions])} ORDER BY {p.key} LIMIT %s"
            ]
        else:
            read = await status_read(cur, store)
            selects = [read.first_rows(columns, status, conditions) for status in statuses]
        for select in selects:
            await cur.execute(select, (*params, *of_row_params, limit))
            names = [d[0] for d in cur.description]
            found += [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]
    return sorted(found, key=lambda row: int(row["id"]))[:limit]


def _id_and_error_clauses(
    store: SQLStore, where: RequeueFilter, event_id: str, clauses: list[str], params: list[Any]
) -> None:
    """Add to ``clauses`` and ``params`` the filter's event ids (in the column ``event_id``) and
    error text: what an outbox row and a parked entry both answer themselves."""
    if where.event_ids:
        clauses.append(f"{event_id} IN ({marks(where.event_ids)})")
        params.extend(where.event_ids)
    if where.error_contains:
        clauses.append(store.dialect.text_contains("last_error"))
        params.append(where.error_contains)


def _row_clauses(store: SQLStore, where: RequeueFilter) -> tuple[list[str], list[Any]]:
    """SQL and parameters: the criteria an outbox row answers itself (its app, its event type,
    its age), on the outbox table's columns unqualified."""
    p = store.profile
    clauses: list[str] = []
    params: list[Any] = []
    if where.app_code is not None:
        clauses.append(f"{p.app_code} = %s")
        params.append(where.app_code)
    if where.event_type:
        clauses.append(f"{p.event_type} = %s")
        params.append(where.event_type)
    if where.older_than_ms is not None:
        clauses.append(f"{p.created} <= {p.ms('%s')}")
        params.append(now_ms() - where.older_than_ms)
    return clauses, params


async def find_parked_in_lane(
    store: SQLStore, lane: str, where: RequeueFilter, limit: int = 10_000
) -> list[dict[str, Any]]:
    """A tailing lane's parked entries the filter selects (``requeue --lane``), lowest outbox id
    first, each with its row's app, event type and creation time (None: the row is gone). The
    entry answers the event id and the error, its row the app, the event type and the age: an
    entry whose row is gone matches none of those. ``statuses`` is not the lane's to answer
    (its entries are all parked), nor is a lease (a lane's round holds no row)."""
    return await _parked_entries(store, PARKED_TABLE, ["lane = %s", "status = %s"], [lane, PARKED], where, limit)


async def find_parked_in_lane_table(
    store: SQLStore, lane: str, where: RequeueFilter, limit: int = 10_000
) -> list[dict[str, Any]]:
    """A lane table's parked (``failed``) rows the filter selects (``requeue --lane``), shaped
    and matched as :func:`find_parked_in_lane`'s entries (its row's copies answer the event id,
    room_outbox's row the app, the event type and the age: the lane's ``created_at_ms`` is when
    it was fed), lowest outbox id first."""
    parked = f"status = '{V1.parked}'"  # a lane table speaks v1
    return await _parked_entries(store, lane_table(lane), [parked], [], where, limit, ", ".join(PARKED_ORDER))


async def _parked_entries(
    store: SQLStore,
    table: str,
    clauses: list[str],
    params: list[Any],
    where: RequeueFilter,
    limit: int,
    order: str = "outbox_id",
) -> list[dict[str, Any]]:
    """The rows of ``table`` (a lane's: keyed by ``outbox_id``) that meet ``clauses`` and the
    filter, in ``order``, each with its outbox row's app, event type and creation time."""
    p = store.profile
    clauses, params = [*clauses], [*params]
    _id_and_error_clauses(store, where, "event_id", clauses, params)  # the event id as the lane keeps it
    of_row, of_row_params = _row_clauses(store, where)
    if of_row:  # each entry's one row, by its key: the lane's few entries lead, never a scan of the outbox
        clauses.append(f"EXISTS (SELECT 1 FROM {p.table} WHERE {p.key} = {table}.outbox_id AND {' AND '.join(of_row)})")
        params.extend(of_row_params)
    async with store.transaction() as cur:
        await cur.execute(
            f"SELECT outbox_id, event_id, room_id, status, last_error FROM {table}"
            f" WHERE {' AND '.join(clauses)} ORDER BY {order} LIMIT %s",
            (*params, limit),
        )
        names = [d[0] for d in cur.description]
        entries = [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]
        keys = [int(entry["outbox_id"]) for entry in entries]
        rows: dict[int, tuple[Any, ...]] = {}
        for chunk in key_chunks(keys):
            await cur.execute(
                f"SELECT {p.key}, {p.app_code}, {p.event_type}, {p.as_ms(p.created)} FROM {p.table}"
                f" WHERE {p.key} IN ({marks(chunk)})",
                chunk,
            )
            rows.update(
                (int(key), (app, event_type, None if created is None else int(created)))  # a nullable creation time
                for key, app, event_type, created in await cur.fetchall()
            )
    for entry in entries:
        app_code, event_type, created = rows.get(int(entry["outbox_id"]), (None, None, None))
        entry.update(app_code=app_code, event_type=event_type, created_at_ms=created)
    return sorted(entries, key=lambda entry: int(entry["outbox_id"]))


async def find_skipped_in_lane(
    store: SQLStore, lane: str, where: RequeueFilter, limit: int = 10_000
) -> list[dict[str, Any]]:
    """A lane's skipped events (rows in the id ranges it gave up on, committed after all:
    :func:`~room_outbox.store.schema.tail.skipped_rows`; a tailing lane's or a lane of its own's)
    the filter selects, lowest outbox id first, shaped as :func:`find_parked_in_lane`'s entries
    (``status`` ``skipped``, the error :data:`~room_outbox.store.schema.tail.SKIPPED_ERROR` or
    :data:`~room_outbox.store.schema.tail.LANE_SKIPPED_ERROR`, which ``error_contains`` is
    matched against)."""
    p = store.profile
    clauses: list[str] = []
    params: list[Any] = []
    if where.event_ids:
        clauses.append(f"o.{p.event_id} IN ({marks(where.event_ids)})")
        params.extend(where.event_ids)
    of_row, of_row_params = _row_clauses(store, where)  # unqualified: the ranges' table has none of them
    async with store.transaction() as cur:
        tables = await table_names(cur, store.dialect)
        own = lane_table(lane) if lane_table(lane) in tables else None
        error = SKIPPED_ERROR if own is None else LANE_SKIPPED_ERROR
        if SKIPPED_TABLE not in tables or (where.error_contains and where.error_contains.lower() not in error.lower()):
            return []
        await cur.execute(
            f"SELECT o.{p.key} AS outbox_id, o.{p.event_id} AS event_id, o.{p.room_id} AS room_id,"
            f" o.{p.app_code} AS app_code, o.{p.event_type} AS event_type, {p.as_ms('o.' + p.created)} AS created_at_ms"
            f"{skipped_rows(p, own)}{''.join(f' AND {clause}' for clause in [*clauses, *of_row])}"
            f" ORDER BY o.{p.key} LIMIT %s",
            (lane, *params, *of_row_params, limit),
        )
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]
    for row in rows:
        created = row["created_at_ms"]
        row.update(status=SKIPPED, last_error=error, created_at_ms=None if created is None else int(created))
    return rows


async def requeue(store: SQLStore, row_ids: Sequence[int]) -> int:
    """Make rows pending and due now, with a fresh attempt count (``max_attempts`` starts
    over); ``last_error`` is kept until the next attempt. Returns rows changed.

    A row created ahead of the database's clock (:func:`_created_ahead`) would be left young
    until then, by the claim's rule for the producer's rows: it is written as a row already
    taken once (:func:`_taken_now`), which the claim takes by ``lock`` alone. The operator
    asked for it; its producer's push, if any, ended long ago."""
    if not row_ids:
        return 0
    words = store.profile
    now = now_ms()
    status, lock, params = f"'{words.fresh}'", words.lock_cleared, list[Any]()
    ahead = _created_ahead(store, now)
    if ahead is not None:
        status, lock, params = _taken_now(words, ahead[0], now, ahead[1])
    return await _changed_in_chunks(
        store,
        row_ids,
        lambda chunk: (
            f"UPDATE {words.table} SET status = {status}, {words.attempts} = 0,"
            f" {words.lock} = {lock}, worker_id = NULL, {words.updated} = {words.ms('%s')}"
            f" WHERE {words.key} IN ({marks(chunk)}) AND {in_list('status', (*words.open, words.parked))}"
            f" AND NOT (worker_id IS NOT NULL AND {words.lock} > {words.ms('%s')})",
            [*params, now, *chunk, now],
        ),
    )


async def _changed_in_chunks(
    store: SQLStore, keys: Sequence[int], statement: Callable[[list[int]], tuple[str, list[Any]]]
) -> int:
    """Rows changed by ``statement`` (SQL and parameters for a chunk of ``keys``), run once per
    chunk (:func:`key_chunks`), all in one transaction: all or none applied."""
    changed = 0
    async with store.transaction() as cur:
        for chunk in key_chunks(keys):
            changed += int(await cur.execute(*statement(chunk)))
    return changed


def _created_ahead(store: SQLStore, now: int) -> tuple[str, int] | None:
    """SQL and its parameter: the row was created more than ``claim_after`` ahead of the
    database's clock (``now``), so the claim's rule for the producer's rows holds it back
    until that time and more; None without ``claim_after`` (no row is held back then). A row
    up to ``claim_after`` ahead is left to that rule: it is claimable within twice
    ``claim_after``, and may still be in its producer's own push."""
    if store.claim_after_ms <= 0:
        return None
    p = store.profile
    return f"{p.created} > {p.ms('%s')}", now + store.claim_after_ms


def _taken_now(words: Profile, ahead: str, now: int, ahead_param: int) -> tuple[str, str, list[Any]]:
    """SQL of a requeued row's status and ``lock`` with their parameters: where ``ahead``
    holds, those of a row a claim has taken before and that is due now, which the claim takes
    whatever its creation time; else the producer's fresh row. Where the producer's rows sit
    at a constant cleared ``lock`` (v1, room_cell), that is ``lock`` at ``now`` (the status
    stays the producer's, as a rate limit's hold leaves it); elsewhere (silk, whose cleared
    ``lock`` is the time itself) the retry status, its due time now."""
    if words.fresh_at_cleared_lock:
        lock = f"CASE WHEN {ahead} THEN {words.ms('%s')} ELSE {words.lock_cleared} END"
        return f"'{words.fresh}'", lock, [ahead_param, now]
    status = f"CASE WHEN {ahead} THEN '{words.retry}' ELSE '{words.fresh}' END"
    return status, words.lock_cleared, [ahead_param]


async def requeue_in_lane_table(store: SQLStore, lane: str, outbox_ids: Sequence[int]) -> int:
    """Make a lane table's parked rows ``outbox_ids`` pending and due now with a fresh attempt
    count, as :func:`requeue` makes the main lane's: the lane's next claim takes them. Only
    rows still parked change (never room_outbox's); returns how many did."""
    if not outbox_ids:
        return 0
    now = now_ms()
    return await _changed_in_chunks(
        store,
        outbox_ids,
        lambda chunk: (
            f"UPDATE {lane_table(lane)} SET status = '{V1.fresh}', retry_count = 0, lock_until_ms = 0,"
            f" worker_id = NULL, updated_at_ms = %s WHERE outbox_id IN ({marks(chunk)})"
            f" AND status = '{V1.parked}'",
            [now, *chunk],
        ),
    )


async def cancel_in_lane_table(
    store: SQLStore, lane: str, event_id: str, apply: bool, app_code: str | None = None
) -> str | None:
    """The status of ``event_id``'s row in a lane table, or ``skipped`` (None: it is neither);
    with ``apply`` a parked one is made ``cancelled`` and ``failed`` returned, or a skipped one
    is fed into the table as ``cancelled`` (:meth:`LaneStore.take_skipped`): the lane never
    claims it, and requeue, the backlog and retention no longer count it, as a tailing lane's
    ``cancel`` does. The row is found through room_outbox's row (:func:`matching_event`, by its
    event id index), then by key: the lane table has no index on its copy of the event id."""
    p, table, feeder = store.profile, lane_table(lane), LaneStore(owner=store, lane=lane)
    where, params = matching_event(store, event_id, app_code)
    skipped: list[int] = []
    async with store.transaction() as cur:
        await cur.execute(f"SELECT {p.key} FROM {p.table} WHERE {where}", params)
        keys = [int(key) for (key,) in await cur.fetchall()]
        if not keys:
            return None
        if apply:
            await cur.execute(
                f"UPDATE {table} SET status = '{V1.cancelled}', updated_at_ms = %s"
                f" WHERE outbox_id IN ({marks(keys)}) AND status = '{V1.parked}'",
                (now_ms(), *keys),
            )
            if cur.rowcount:
                return V1.parked
        await cur.execute(f"SELECT status FROM {table} WHERE outbox_id IN ({marks(keys)})", keys)
        found = await cur.fetchone()
        if found is None:  # skipped, perhaps: an insert that committed after the feeder gave up on its id
            skipped = await feeder.skipped_keys(cur, f"o.{p.key} IN ({marks(keys)})", keys)
    if found is not None:
        return str(found[0])
    if not skipped:
        return None
    if apply:
        await feeder.take_skipped(skipped, V1.cancelled)
    return SKIPPED


#: :func:`cancel`'s status for an event leased right now: its delivery may be under way.
IN_FLIGHT = "in flight"
#: :func:`cancel`'s status for an event id that names rows of several apps (no app given):
#: nothing is changed, the operator must say which app's event is meant.
SEVERAL_APPS = "several apps"


async def cancel(store: SQLStore, event_id: str, app_code: str | None = None) -> tuple[bool, str | None]:
    """Mark a pending or failed event ``cancelled`` (never delivered, kept for audit): the row
    of ``event_id`` (of ``app_code`` when given). Returns whether it was cancelled and the
    status it has now (None: no such event; :data:`IN_FLIGHT`: leased right now;
    :data:`SEVERAL_APPS`: the id names rows of several apps, none changed). A leased row is
    left alone, as ``requeue`` leaves it: its delivery may already have reached the sink, and
    cancelling it would leave an event delivered yet ``cancelled``. A status column that
    cannot hold ``cancelled`` is one line (:class:`SchemaError`)."""
    try:
        return await _cancel(store, event_id, app_code)
    except Exception as exc:
        cause = refused_value(exc)
        if cause is None:
            raise
        raise SchemaError(await _status_problem(store, cause)) from exc


async def _cancel(store: SQLStore, event_id: str, app_code: str | None) -> tuple[bool, str | None]:
    words = store.profile
    leased = f"worker_id IS NOT NULL AND {words.lock} > {words.ms('%s')}"
    where, params = matching_event(store, event_id, app_code)
    async with store.transaction() as cur:
        await cur.execute(f"SELECT {words.key} FROM {words.table} WHERE {where}", params)
        keys = [key for (key,) in await cur.fetchall()]
        if len(keys) != 1:  # the one row by its key: never another app's row with the same id
            return False, SEVERAL_APPS if keys else None
        now = now_ms()
        changed = await cur.execute(
            f"UPDATE {words.table} SET status = '{words.cancelled}', worker_id = NULL,"
            f" {words.lock} = {words.lock_cleared}, {words.updated} = {words.ms('%s')}"
            f" WHERE {words.key} = %s AND {in_list('status', (*words.open, words.parked))} AND NOT ({leased})",
            (now, keys[0], now),
        )
        await cur.execute(
            f"SELECT status, CASE WHEN {leased} THEN 1 ELSE 0 END FROM {words.table} WHERE {words.key} = %s",
            (now, keys[0]),
        )
        found = await cur.fetchone()
    if found is None:  # removed meanwhile
        return bool(changed), None
    status, in_flight = found
    return bool(changed), IN_FLIGHT if in_flight and not changed and status != words.cancelled else status


async def _status_problem(store: SQLStore, cause: str) -> str:
    """Why the table refused a status: the schema check's line for its status column (the
    fix included), else the database's words."""
    table = store.profile.table
    async with store.transaction() as cur:
        columns = await read_columns(cur, store.dialect, table)
        named = await printed_name(cur, store.dialect, table)
    refused, _fixable = column_problems(columns, store.profile, store.dialect, named=named)
    lines = [line for line in refused if line.startswith(f"{table}.status ")]
    return lines[0] if lines else f"{table}.status refused '{store.profile.cancelled}': {cause}"
