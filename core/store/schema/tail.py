"""The tailing lanes' tables: rows that can never be delivered, parked with their error, and
the id ranges a lane skipped.

A tailing lane (a sink with ``ordered_log=True``, such as Kafka) keeps no per-row state: its
position is its row in the lanes' cursor table. The only rows it keeps are the ones it had to
pass over (too large, not serialisable; or its lane table had, before it tailed), so that
``status``, ``inspect`` and ``requeue`` see them: ``parked`` until an operator requeues them,
``requeued`` until the lane sends them again, or ``cancelled`` by an operator: never sent, the
entry kept as the record of it. One small table for every tailing lane, keyed by (lane,
outbox_id).

An id missing longer than ``lanes.gap_timeout`` (or beyond ``lanes.max_gaps``) is taken as a
rolled-back insert and skipped: the lane goes on without it and never reads it again. Its range
is recorded in ``room_outbox_tail_skipped``, one row per range however many ids it holds, so
that an insert that did commit after all (its transaction held longer than ``gap_timeout``) is
not lost from sight: ``inspect`` says it was skipped, ``status`` counts such events, and
``requeue --lane`` sends them (as ``requeued`` entries of the parked table). A lane of its own
records the ranges its feeder gives up on in the same table (created with the lanes' tables,
:func:`~.lanes.lane_steps`), its skipped events those its table does not hold (requeued: fed
into it). Retention drops a range once it is older than ``retention.older_than`` and no row
holds an id in it.

A lane switching relays carries the operator's decisions over in ``migrate``: to tailing, the
rows its table parked or cancelled move here (:func:`tail_steps`); back to a table, the
cancelled entries move into it, and what the lane sent above its cursor is recorded there as
sent (:func:`hand_back_steps`), while parked or skipped ones refuse the switch
(:func:`parked_while_tailing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import Dialect, column_names, table_names, text
from room_outbox.store.schema.lanes import (
    CURSOR_TABLE,
    KEPT_WIDTH,
    SKIPPED_TABLE,
    copied_columns,
    cursor_ddl,
    lane_table,
    skipped_ddl,
    tail_cursor_columns,
)
from room_outbox.store.schema.outbox import Migration, add_column_sql
from room_outbox.store.schema.profiles import V1, Profile

PARKED_TABLE = "room_outbox_tail_parked"
PARKED = "parked"
REQUEUED = "requeued"
#: An event in a skipped range (not an entry's status: what ``cancel`` found it as).
SKIPPED = "skipped"
CANCELLED = "cancelled"
#: What a skipped event's entry in the parked table says once an operator requeues or cancels it.
SKIPPED_ERROR = (
    "skipped by the tailing lane: its id was missing longer than lanes.gap_timeout (or beyond lanes.max_gaps),"
    " taken as a rolled-back insert; it committed later"
)
#: What a lane of its own says of an event it skipped (its feeder gave up on the id) and that
#: committed later: in ``requeue --lane``'s list, and its table's row once cancelled.
LANE_SKIPPED_ERROR = (
    "skipped by the lane's feeder: its id was missing longer than lanes.gap_timeout (or beyond lanes.max_gaps),"
    " taken as a rolled-back insert; it committed later"
)


def parked_ddl(dialect: Dialect) -> list[str]:
    return [
        f"""CREATE TABLE {PARKED_TABLE} (
  lane          VARCHAR(64)   NOT NULL,
  outbox_id     {dialect.id_type} NOT NULL,
  event_id      VARCHAR({KEPT_WIDTH})  NOT NULL,
  room_id       VARCHAR({KEPT_WIDTH})  NOT NULL,
  status        VARCHAR(16)   NOT NULL DEFAULT '{PARKED}',
  last_error    VARCHAR(1024) NULL,
  created_at_ms BIGINT        NOT NULL,
  updated_at_ms BIGINT        NOT NULL,
  PRIMARY KEY (lane, outbox_id)
){dialect.table_options}"""
    ]


def skipped_rows(profile: Profile, own_table: str | None = None) -> str:
    """SQL: ``FROM`` … ``WHERE`` the rows of the outbox (alias ``o``, of ``profile``) whose ids
    lie in a skipped range (alias ``s``) of the lane ``%s``, and which the lane does not hold:
    inserts that committed after the lane gave up on their ids, never sent. A tailing lane holds
    its rows in the parked table; a lane of its own in its table (``own_table``).
    Each range reads the outbox's primary key from ``low_id`` to ``high_id``: a few short reads."""
    p = profile
    held = (
        f"SELECT 1 FROM {PARKED_TABLE} e WHERE e.lane = s.lane AND e.outbox_id = o.{p.key}"
        if own_table is None
        else f"SELECT 1 FROM {own_table} e WHERE e.outbox_id = o.{p.key}"
    )
    return (
        f" FROM {SKIPPED_TABLE} s JOIN {p.table} o ON o.{p.key} BETWEEN s.low_id AND s.high_id WHERE s.lane = %s"
        f" AND NOT EXISTS ({held})"
    )


async def tail_steps(cur: Any, dialect: Dialect, lanes: Sequence[str], cursor_planned: bool = False) -> list[Migration]:
    """What tailing ``lanes`` need, read from the catalogue in the caller's transaction: the
    cursor table (unless an earlier step of the same plan creates it, with the skipped table:
    ``cursor_planned``, :func:`~.lanes.lane_steps`) with the columns where a tailing lane keeps
    what it has read (added to a cursor table made before them), the parked and the skipped
    tables; a lane that ran on its own table before hands over from it (:func:`_hand_over`)."""
    if not lanes:
        return []
    existing = await table_names(cur, dialect)
    wanted = [(PARKED_TABLE, parked_ddl(dialect))]
    if not cursor_planned:
        wanted = [(CURSOR_TABLE, cursor_ddl(dialect)), *wanted, (SKIPPED_TABLE, skipped_ddl(dialect))]
    plan = [Migration(f"created table {name}", tuple(ddl)) for name, ddl in wanted if name not in existing]
    if CURSOR_TABLE in existing:  # made before tailing lanes kept where they read to
        have = set(await column_names(cur, dialect, CURSOR_TABLE))
        plan += [
            Migration(
                f"added column {CURSOR_TABLE}.{name}",
                (add_column_sql(dialect, CURSOR_TABLE, f"{name} {definition}"),),
            )
            for name, definition in tail_cursor_columns(dialect).items()
            if name not in have
        ]
    for lane in lanes:
        if lane_table(lane) in existing:
            plan.append(await _hand_over(cur, lane, CURSOR_TABLE in existing, PARKED_TABLE in existing))
    return plan


async def _hand_over(cur: Any, lane: str, cursor_rows: bool, parked_rows: bool) -> Migration:
    """A lane switched from its own table to tailing: its cursor goes back to just below the
    table's first row still owed (``pending``: fresh, retrying or in flight), so nothing the
    table owed is lost (what it had sent beyond is sent once more); the rows it parked
    (``failed``) move to the parked table as ``parked``, their error and times kept, where
    ``status``, ``inspect`` and ``requeue --lane`` see them and the lane passes over them until
    an operator requeues them, instead of holding the cursor back to be sent again from there
    (months of events, perhaps), and the rows an operator cancelled as ``cancelled``, so that
    the lane never sends them (:func:`_carried_over`); then the table is dropped, in the
    same step. The cursor is the tailing lane's whole state, and a table left behind would still
    count as owed: its pending rows shown as the lane's backlog, holding back retention, and
    moving the cursor back again at every migrate. It is room-outbox's own table, not
    room-service's.

    The statements are written from what was read now, never from what the cursor holds when
    they run, so a lane-table process still running meanwhile only makes the lane send again
    what it sent. Where each statement commits on its own (MySQL: the DROP commits anyway), a
    step interrupted half-way is made whole by the next migrate: the rows already moved are
    not moved twice, and the cursor is worked out again to the same place."""
    table = lane_table(lane)
    await cur.execute(f"SELECT MIN(outbox_id) FROM {table} WHERE {V1.is_open()}")
    (first_owed,) = await cur.fetchone()
    cursor = None
    if cursor_rows:
        await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = %s", (lane,))
        cursor = await cur.fetchone()
    # ints from the database: safe to write into the statements
    tail_from: int | None = None
    statements: list[str] = []
    changes: list[str] = []
    if cursor is not None:
        fed = int(cursor[0])
        tail_from = fed if first_owed is None else min(fed, int(first_owed) - 1)
        # Where a tailing run before the table had read to is past: from fed_through_id alone.
        statements.append(
            f"UPDATE {CURSOR_TABLE} SET fed_through_id = {tail_from}, read_through_id = NULL, open_gaps = NULL"
            f" WHERE lane = '{lane}'"
        )
        if tail_from < fed:
            changes.append(
                f"moved lane {lane}'s cursor back to {tail_from}: it tails from {table}'s first row still owed"
            )
        else:
            changes.append(f"kept lane {lane}'s cursor at {tail_from}: {table} owed no row up to it")
    elif first_owed is not None:  # a table whose lane never wrote its cursor row
        tail_from = int(first_owed) - 1
        statements.append(
            f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, updated_at_ms) VALUES ('{lane}', {tail_from}, 0)"
        )
        changes.append(f"started lane {lane}'s cursor at {tail_from}: it tails from {table}'s first row still owed")
    carried = await _carried_over(cur, lane, table, parked_rows)
    if carried is not None:
        changes.insert(0, carried[0])
        statements.insert(0, carried[1])
    statements.append(f"DROP TABLE IF EXISTS {table}")
    changes.append(
        f"dropped {table} (room-outbox's own table): lane {lane} tails from its cursor now, which holds all it owes"
    )
    return Migration("; ".join(changes), tuple(statements))


async def _carried_over(cur: Any, lane: str, table: str, parked_rows: bool) -> tuple[str, str] | None:
    """What copies into the parked table every row ``table`` parked and every row it
    cancelled, wherever they are, and the statement that does; None when there are none. One
    INSERT … SELECT, however many rows: the statement's size does not grow with them. Those
    above the cursor are ones the tailing lane reads again: it passes over the rows its parked
    table holds, so a parked row is sent only once an operator requeues it, and a cancelled one
    never. A row the parked table has already (moved by an interrupted run of this step) is
    left as it is. ``parked_rows``: the parked table exists now (else an earlier step of the
    plan creates it, empty)."""
    rows = f"FROM {table} WHERE status IN ('{V1.parked}', '{V1.cancelled}')"
    not_moved = (
        f" AND NOT EXISTS (SELECT 1 FROM {PARKED_TABLE} p WHERE p.lane = '{lane}' AND p.outbox_id = {table}.outbox_id)"
    )
    await cur.execute(f"SELECT status, COUNT(*) {rows}{not_moved if parked_rows else ''} GROUP BY status")
    counts = {str(status): int(count) for status, count in await cur.fetchall()}
    if not counts:
        return None
    statement = (
        f"INSERT INTO {PARKED_TABLE} (lane, outbox_id, event_id, room_id, status, last_error,"
        " created_at_ms, updated_at_ms)"
        f" SELECT '{lane}', outbox_id, event_id, room_id,"
        f" CASE status WHEN '{V1.parked}' THEN '{PARKED}' ELSE '{CANCELLED}' END,"
        f" last_error, created_at_ms, updated_at_ms {rows}{not_moved}"
    )
    kinds = [
        f"{counts[status]} {name} row(s)"
        for status, name in ((V1.parked, PARKED), (V1.cancelled, CANCELLED))
        if status in counts
    ]
    return f"moved {table}'s {' and '.join(kinds)} to {PARKED_TABLE}", statement


def open_gap_ranges(open_gaps: str | None) -> list[tuple[int, int, int, tuple[int, int] | None]]:
    """A tailing cursor's ``open_gaps`` (ranges still waited for, ``low-high@since`` comma
    separated, ``/step:residue`` after it where the ids equal to ``residue`` modulo ``step``
    in the range were read already) as ``(low, high, since, (step, residue) or None)``;
    ValueError when it does not parse."""
    ranges = []
    for part in (open_gaps or "").split(","):
        if part:
            bounds, seen = part.split("@")
            low, high = (int(bound) for bound in bounds.split("-"))
            since, _, lattice = seen.partition("/")
            read = None
            if lattice:
                step, residue = (int(value) for value in lattice.split(":"))
                if step < 2 or not 0 <= residue < step:
                    raise ValueError(f"range {part} has no such step")
                read = (step, residue)
            if low > high:
                raise ValueError(f"range {part} is empty")
            ranges.append((low, high, int(since), read))
    return ranges


def _not_waited_for(key: str, low: int, high: int, read: tuple[int, int] | None) -> str:
    """SQL: ``key`` is not among the ids an open range waits for (:func:`open_gap_ranges`).
    A statement without parameters: ``%`` is the modulo as written."""
    if read is None:
        return f" AND {key} NOT BETWEEN {low} AND {high}"
    step, residue = read
    return f" AND NOT ({key} BETWEEN {low} AND {high} AND ({key} - {residue}) % {step} <> 0)"


async def hand_back_steps(cur: Any, dialect: Dialect, profile: Profile, lanes: Sequence[str]) -> list[Migration]:
    """What lanes switched back from tailing to a table of their own (``lanes``) carry over
    (:func:`_hand_back`), after the step that creates their table: for a lane whose table is
    missing (the switch) or whose entries the parked table still holds (a switch interrupted
    half-way, or made by a version that left them there)."""
    if not lanes:
        return []
    existing = await table_names(cur, dialect)
    if CURSOR_TABLE not in existing:
        return []
    cursor_columns = set(await column_names(cur, dialect, CURSOR_TABLE))
    plan = []
    for lane in lanes:
        step = await _hand_back(cur, profile, lane, existing, "read_through_id" in cursor_columns)
        if step is not None:
            plan.append(step)
    return plan


async def _hand_back(
    cur: Any, profile: Profile, lane: str, existing: set[str] | list[str], tail_columns: bool
) -> Migration | None:
    """A lane switched from tailing back to a table of their own, whose feeder goes on from the
    cursor's ``fed_through_id``. Two things the table would not know otherwise:

    - the events an operator cancelled (the parked table's ``cancelled`` entries) become the
      table's ``cancelled`` rows, so it never feeds them as ``pending`` and sends them; a row
      the table has already (an interrupted step) is kept, or made ``cancelled`` while it is
      still ``pending``; then the entries leave the parked table, last, so that a lane table
      is refused at start while they are still there (:func:`handed_back_problems`);
    - the events the tailing lane sent above ``fed_through_id`` (up to ``read_through_id``,
      but for the ranges still waited for, ``open_gaps``) become ``published`` rows, so the
      feeder does not send them again; then the cursor forgets where the tailing lane read to.

    Events parked or requeued while tailing are not here: :func:`parked_while_tailing` refuses
    the switch while there are any. The statements are written from what was read now; run
    again (their commits one by one), they change nothing twice."""
    table = lane_table(lane)
    cancelled = 0
    if PARKED_TABLE in existing:
        await cur.execute(f"SELECT COUNT(*) FROM {PARKED_TABLE} WHERE lane = %s AND status = %s", (lane, CANCELLED))
        (cancelled,) = await cur.fetchone()
    if table in existing and not cancelled:
        return None  # a lane table lane already, with nothing left to carry over
    sent = None  # (fed_through_id, read_through_id, the ranges still waited for) of a tailing cursor
    if tail_columns:
        await cur.execute(
            f"SELECT fed_through_id, read_through_id, open_gaps FROM {CURSOR_TABLE} WHERE lane = %s", (lane,)
        )
        found = await cur.fetchone()
        if found is not None and (found[1] is not None or found[2] is not None):
            fed = int(found[0])
            try:
                gaps = open_gap_ranges(None if found[2] is None else text(found[2]))
                read_through = fed if found[1] is None else int(found[1])
            except ValueError:  # the tailing lane itself would go on from fed_through_id
                gaps, read_through = [], fed
            sent = (fed, read_through, gaps)
    if not cancelled and sent is None:
        return None
    p, now = profile, now_ms()
    # ints and the lane's validated name from the database: safe to write into the statements
    not_there = f" AND NOT EXISTS (SELECT 1 FROM {table} l WHERE l.outbox_id = {{key}})"
    statements: list[str] = []
    changes: list[str] = []
    if cancelled:
        entries = f"SELECT outbox_id FROM {PARKED_TABLE} WHERE lane = '{lane}' AND status = '{CANCELLED}'"
        if table in existing:
            statements.append(
                f"UPDATE {table} SET status = '{V1.cancelled}', updated_at_ms = {now}"
                f" WHERE status = '{V1.fresh}' AND outbox_id IN ({entries})"
            )
        of_row = "(SELECT SUBSTR({column}, 1, " + str(KEPT_WIDTH) + f") FROM {p.table} o WHERE o.{p.key} = t.outbox_id)"
        statements.append(
            f"INSERT INTO {table} (outbox_id, event_id, event_type, room_id, app_code, status, last_error,"
            " created_at_ms, updated_at_ms)"
            f" SELECT t.outbox_id, t.event_id, COALESCE({of_row.format(column=p.event_type)}, ''), t.room_id,"
            f" COALESCE({of_row.format(column=p.app_code)}, ''), '{V1.cancelled}', t.last_error, t.created_at_ms,"
            f" t.updated_at_ms FROM {PARKED_TABLE} t WHERE t.lane = '{lane}' AND t.status = '{CANCELLED}'"
            + not_there.format(key="t.outbox_id")
        )
        changes.append(f"moved lane {lane}'s {cancelled} cancelled event(s) from {PARKED_TABLE} to {table}: never sent")
    if sent is not None:
        fed, read_through, gaps = sent
        if read_through > fed:
            waited = "".join(_not_waited_for(p.key, low, high, read) for low, high, _, read in gaps)
            statements.append(
                f"INSERT INTO {table} (outbox_id, event_id, event_type, room_id, app_code, status,"
                f" created_at_ms, updated_at_ms) SELECT {copied_columns(p)}, '{V1.delivered}', {now}, {now}"
                f" FROM {p.table} WHERE {p.key} > {fed} AND {p.key} <= {read_through}{waited}"
                + not_there.format(key=f"{p.table}.{p.key}")
            )
            changes.append(
                f"took the events lane {lane} sent while it tailed, above {fed} up to {read_through}"
                f" (but for {len(gaps)} range(s) still waited for), into {table} as {V1.delivered}: not sent again"
            )
        statements.append(f"UPDATE {CURSOR_TABLE} SET read_through_id = NULL, open_gaps = NULL WHERE lane = '{lane}'")
        changes.append(f"fed lane {lane}'s table from its cursor at {fed}")
    if SKIPPED_TABLE in existing:  # none holds an event still owed: the switch is refused while one does
        statements.append(f"DELETE FROM {SKIPPED_TABLE} WHERE lane = '{lane}'")
    if cancelled:  # last (see above)
        statements.append(f"DELETE FROM {PARKED_TABLE} WHERE lane = '{lane}' AND status = '{CANCELLED}'")
    return Migration("; ".join(changes), tuple(statements))


async def handed_back_problems(cur: Any, dialect: Dialect, lanes: Sequence[str]) -> list[str]:
    """Why lanes that run on a table of their own (``lanes``) cannot start: the parked table
    still holds entries of theirs from when they tailed room_outbox. Cancelled ones that the
    switch back has not carried over yet (its table would feed them and send them), parked or
    requeued ones that it refuses to leave behind (:func:`parked_while_tailing`)."""
    if not lanes or PARKED_TABLE not in await table_names(cur, dialect):
        return []
    held = ", ".join(["%s"] * len(lanes))
    await cur.execute(f"SELECT lane, COUNT(*) FROM {PARKED_TABLE} WHERE lane IN ({held}) GROUP BY lane", tuple(lanes))
    return [
        f"lane {lane} runs on its own table (relay: lane_table), but {PARKED_TABLE} still holds {count}"
        f" event(s) it parked or cancelled while it tailed room_outbox: run `room-outbox migrate` (it carries"
        " the cancelled ones over to the lane's table, and names what to do with any still parked)"
        for lane, count in sorted(await cur.fetchall())
    ]


async def parked_while_tailing(
    cur: Any, dialect: Dialect, lanes: Sequence[str], profile: Profile | None = None
) -> list[str]:
    """Why lanes switched back to a lane table (``lanes``) cannot be: events they parked while
    tailing, still parked or requeued, or skipped (committed after the lane gave up on their
    ids: with ``profile``, the outbox's), which a lane table would never see, count or send
    (its feeder goes on from the cursor). The operator requeues or cancels them first. A lane
    whose table exists already records its own skipped ranges there: those are its table's."""
    if not lanes:
        return []
    existing = await table_names(cur, dialect)
    held = ", ".join(["%s"] * len(lanes))
    counts: dict[str, int] = {}
    if PARKED_TABLE in existing:
        await cur.execute(
            f"SELECT lane, COUNT(*) FROM {PARKED_TABLE} WHERE lane IN ({held}) AND status IN (%s, %s) GROUP BY lane",
            (*lanes, PARKED, REQUEUED),
        )
        counts = {str(lane): int(count) for lane, count in await cur.fetchall()}
    if profile is not None and SKIPPED_TABLE in existing and PARKED_TABLE in existing:
        for lane in [lane for lane in lanes if lane_table(lane) not in existing]:
            await cur.execute(f"SELECT COUNT(*){skipped_rows(profile)}", (lane,))
            (skipped,) = await cur.fetchone()
            if skipped:
                counts[lane] = counts.get(lane, 0) + int(skipped)
    return [
        f"lane {lane} has {count} event(s) it parked or skipped while it tailed room_outbox (relay: tail), which"
        f" a lane table would never send: with relay: tail, requeue them (`room-outbox requeue --lane {lane}`) and"
        f" let the lane send them, or cancel them (`room-outbox cancel EVENT_ID --lane {lane}`); then migrate again"
        for lane, count in sorted(counts.items())
    ]


__all__ = [
    "LANE_SKIPPED_ERROR",
    "PARKED",
    "PARKED_TABLE",
    "REQUEUED",
    "SKIPPED",
    "SKIPPED_ERROR",
    "SKIPPED_TABLE",
    "hand_back_steps",
    "handed_back_problems",
    "open_gap_ranges",
    "parked_ddl",
    "parked_while_tailing",
    "skipped_ddl",
    "skipped_rows",
    "tail_steps",
]
