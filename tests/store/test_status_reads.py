"""The operator's and the backlog timer's reads of some statuses' rows read those rows, never
the published rows below them: the table's newest rows pending behind many published ones,
with and without room-service's (status, id) index, as the database itself counts the rows
each statement read (MariaDB's ANALYZE, PostgreSQL's EXPLAIN ANALYZE), or, on SQLite, whether
its plan scans the whole table."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from support import INSERT_V1

from room_outbox.cli.requeue import requeue_command
from room_outbox.cli.status import format_status
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.catalog import im_lane_backlog
from room_outbox.store.operator.changes import RequeueFilter, find_requeue_candidates
from room_outbox.store.operator.reports import RETRY_BUCKETS, sample_backlog, status_report
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

PUBLISHED, PENDING, FAILED = 4000, 60, 20


#: The statements of each transaction a store ran, with their parameters.
Transactions = list[list[tuple[str, Any]]]


class Recording:
    """A cursor that keeps the statements it runs."""

    def __init__(self, cur: Any, statements: list[tuple[str, Any]]) -> None:
        self._cur, self._statements = cur, statements

    async def execute(self, sql: str, params: Any = None) -> Any:
        self._statements.append((sql, params))
        return await self._cur.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


@asynccontextmanager
async def recorded(store: SQLStore) -> AsyncIterator[Transactions]:
    """The statements ``store`` runs inside the block, by transaction."""
    transactions: Transactions = []
    original = store.transaction

    @asynccontextmanager
    async def transaction(*timeout: float | None) -> AsyncIterator[Any]:
        transactions.append([])
        async with original(*timeout) as cur:
            yield Recording(cur, transactions[-1])

    store.transaction = transaction  # type: ignore[method-assign]
    try:
        yield transactions
    finally:
        del store.transaction


@pytest.fixture(params=["mysql", "postgresql", "sqlite"])
def server(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[True, False], ids=["status-index", "claim-index-only"])
async def table(server: str, request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """PUBLISHED published rows, then PENDING pending and FAILED parked ones above them, with
    errors; room-service's (status, id) index dropped for the second parameter."""
    if server == "sqlite":
        dsn = f"sqlite:///{request.getfixturevalue('tmp_path') / 'outbox.db'}"
    else:
        dsn = str(request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn"))
    if server == "postgresql":
        await plan_as_for_a_large_table(dsn)
    store = await open_store(dsn)
    try:
        await store.migrate()
        async with store.transaction() as cur:
            rows = [(f"p{i}", 1) for i in range(PUBLISHED)] + [(f"q{i}", 2) for i in range(PENDING + FAILED)]
            await cur.executemany(
                INSERT_V1,
                [("default", e, "RoomUserJoined", f"r_{i % 50}", "{}", c, c) for i, (e, c) in enumerate(rows)],
            )
            await cur.execute("UPDATE room_outbox SET status = 'published' WHERE event_id LIKE 'p%%'")
            await cur.execute(
                "UPDATE room_outbox SET last_error = 'ErrorCode 10010: group gone' WHERE event_id LIKE 'q%%'"
            )
            failed = [f"q{i}" for i in range(FAILED)]
            await cur.execute(
                f"UPDATE room_outbox SET status = 'failed' WHERE event_id IN ({', '.join(['%s'] * FAILED)})", failed
            )
            if not request.param:
                await cur.execute(
                    "DROP INDEX idx_room_outbox_status_id" + (" ON room_outbox" if server == "mysql" else "")
                )
        async with store.transaction() as cur:
            # SQLite's ANALYZE finds two statuses over the rows: its planner then prefers a scan.
            await cur.execute("ANALYZE TABLE room_outbox" if server == "mysql" else "ANALYZE room_outbox")
            if server == "mysql":
                await cur.fetchall()
        yield store
    finally:
        await store.aclose()


async def plan_as_for_a_large_table(dsn: str) -> None:
    """The database's sessions plan as if reading the pending rows by their index cost more
    than reading the whole table, as PostgreSQL may find on a large table (there, with parallel
    workers): the read must stay on the index all the same."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        name = (await (await conn.execute("SELECT current_database()")).fetchone())[0]
        await conn.execute(f'ALTER DATABASE "{name}" SET random_page_cost = 100')


async def rows_read(
    store: SQLStore, transactions: Transactions, counted_in_index: bool = True
) -> list[tuple[int, str]]:
    """The rows of ``room_outbox`` the database read to run each of the SELECTs on it, by its
    own count, each run again in its transaction after the statements before it; without
    ``counted_in_index``, the entries of an index read alone (a count in the status index,
    which never reads the rows) are left out."""
    reads = []
    for statements in transactions:
        async with store.transaction() as cur:
            for sql, params in statements:
                if "room_outbox" not in sql or not sql.lstrip().upper().startswith("SELECT"):
                    await cur.execute(sql, params)  # the catalogue, the session's settings
                    if cur.description:
                        await cur.fetchall()
                elif store.dialect.name == "sqlite":
                    await cur.execute("EXPLAIN QUERY PLAN " + sql, params)
                    scans = [row for row in await cur.fetchall() if str(row[-1]).startswith("SCAN room_outbox")]
                    reads.append((PUBLISHED if scans else 0, sql))  # a scan reads every published row
                elif store.dialect.name == "mysql":
                    await cur.execute("ANALYZE FORMAT=JSON " + sql, params)
                    plan = json.loads((await cur.fetchone())[0])
                    reads.append((round(sum(_mariadb_reads(plan, counted_in_index))), sql))
                else:
                    await cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
                    (plan,) = json.loads((await cur.fetchone())[0])
                    reads.append((round(sum(_postgresql_reads(plan["Plan"], counted_in_index))), sql))
    return reads


def _mariadb_reads(node: Any, counted_in_index: bool = True) -> Iterator[float]:
    """Each access to room_outbox's rows read (``r_rows`` per loop times its loops; a derived
    table's rows are not read again from the table); without ``counted_in_index``, not those
    of an index read alone (``using_index``)."""
    if isinstance(node, dict):
        read = node.get("table_name") == "room_outbox" and "r_rows" in node
        if read and (counted_in_index or not node.get("using_index")):
            yield float(node["r_rows"] or 0) * float(node.get("r_loops") or 1)
        for value in node.values():
            yield from _mariadb_reads(value, counted_in_index)
    elif isinstance(node, list):
        for value in node:
            yield from _mariadb_reads(value, counted_in_index)


def _postgresql_reads(node: dict[str, Any], counted_in_index: bool = True) -> Iterator[float]:
    """Each scan's rows read: those it returned and those its filters removed, times its loops
    (a bitmap index scan's entries are counted by the heap scan above it); without
    ``counted_in_index``, an index-only scan's rows are those it fetched from the table."""
    if node.get("Relation Name") == "room_outbox":
        if not counted_in_index and node["Node Type"] == "Index Only Scan":
            yield float(node["Heap Fetches"]) * node["Actual Loops"]
        else:
            removed = node.get("Rows Removed by Filter", 0) + node.get("Rows Removed by Index Recheck", 0)
            yield float(node["Actual Rows"] + removed) * node["Actual Loops"]
    for child in node.get("Plans", []):
        yield from _postgresql_reads(child, counted_in_index)


async def assert_bounded(
    store: SQLStore, transactions: Transactions, bound: int, counted_in_index: bool = True
) -> None:
    reads = await rows_read(store, transactions, counted_in_index)
    assert reads
    over = [f"{read} rows: {sql}" for read, sql in reads if read > bound]
    assert not over, "\n".join(over)


async def test_the_backlog_reads_the_pending_rows_only(table: SQLStore) -> None:
    async with recorded(table) as statements:
        backlog = await sample_backlog(table)
        lane = await im_lane_backlog(table)
    assert backlog.pending == lane.pending == PENDING
    assert lane.oldest_created_ms == 2 and lane.parked == FAILED
    await assert_bounded(table, statements, PENDING + FAILED)


async def test_the_status_report_reads_the_rows_of_its_statuses_only(table: SQLStore) -> None:
    async with recorded(table) as statements:
        report = await status_report(table)
    assert report.top_errors == [("ErrorCode 10010: group gone", PENDING)]
    assert report.top_parked_errors == [("ErrorCode 10010: group gone", FAILED)]
    await assert_bounded(table, statements, PENDING + FAILED)


@pytest.mark.parametrize(
    "where",
    [
        RequeueFilter(error_contains="group gone"),
        RequeueFilter(older_than_ms=0),
        RequeueFilter(event_type="RoomUserJoined"),
    ],
    ids=["error", "age", "type"],
)
async def test_requeue_selects_among_the_rows_of_its_statuses_only(table: SQLStore, where: RequeueFilter) -> None:
    async with recorded(table) as statements:
        found = await find_requeue_candidates(table, where, limit=30)
    assert [row["event_id"] for row in found] == [f"q{i}" for i in range(30)]  # the lowest keys, of both statuses
    await assert_bounded(table, statements, PENDING + FAILED)


#: Rows of each status in a backlog far beyond the samples (cut to SAMPLE rows): a read of every
#: row of a status reads BIG rows, a sample at most SAMPLE.
BIG, SAMPLE = 3000, 50


@pytest.fixture(params=["mysql", "postgresql"])
async def backlog(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[SQLStore]:
    """A few published rows, then BIG pending rows (retry counts 0 to 6, a timeout each), then
    BIG parked ones (the latest an error of their own), on room-service's (status, id) index;
    the status report's samples cut to SAMPLE rows."""
    monkeypatch.setattr("room_outbox.store.operator.reports.STATUS_SAMPLE", SAMPLE)
    server = str(request.param)
    dsn = str(request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn"))
    if server == "postgresql":
        await plan_as_for_a_large_table(dsn)
    store = await open_store(dsn)
    try:
        await store.migrate()
        async with store.transaction(120) as cur:
            events = [f"p{i}" for i in range(100)] + [f"q{i}" for i in range(BIG)] + [f"f{i}" for i in range(BIG)]
            await cur.executemany(
                INSERT_V1, [("default", e, "RoomUserJoined", f"r_{i % 50}", "{}", 1, 1) for i, e in enumerate(events)]
            )
            await cur.execute("UPDATE room_outbox SET status = 'published' WHERE event_id LIKE 'p%%'")
            await cur.execute(
                "UPDATE room_outbox SET last_error = 'timeout', retry_count = MOD(id, 7) WHERE event_id LIKE 'q%%'"
            )
            await cur.execute(
                "UPDATE room_outbox SET status = 'failed', last_error = 'ErrorCode 10010: group gone' WHERE event_id LIKE 'f%%'"
            )
            await cur.execute(
                "UPDATE room_outbox SET last_error = 'ErrorCode 10007: no permission' WHERE id > %s",
                (100 + 2 * BIG - SAMPLE,),
            )
        if server == "mysql":
            async with store.transaction() as cur:
                await cur.execute("ANALYZE TABLE room_outbox")
                await cur.fetchall()
        else:  # statistics, and the visibility map that lets a count stay in the index
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await conn.execute("VACUUM ANALYZE room_outbox")
        yield store
    finally:
        await store.aclose()


async def test_a_large_backlog_is_counted_in_the_index_and_sampled(backlog: SQLStore) -> None:
    async with recorded(backlog) as statements:
        report = await status_report(backlog)
    # Counts are exact, read in the status index alone.
    assert (report.pending, report.other_statuses) == (BIG, {"failed": BIG})
    # The retry counts and errors are those of the oldest SAMPLE pending rows, the latest SAMPLE parked.
    first_ids = range(101, 101 + SAMPLE)
    retries = [key % 7 for key in first_ids]
    expected = {
        label: sum(low <= r and (high is None or r <= high) for r in retries) for label, low, high in RETRY_BUCKETS
    }
    assert report.retry_histogram == expected and report.retry_histogram_sampled
    assert report.top_errors == [("timeout", SAMPLE)]
    assert report.top_parked_errors == [("ErrorCode 10007: no permission", SAMPLE)]
    text = format_status(report)
    assert (
        f"retries  pending rows  (a sample: the oldest {SAMPLE} of each status still to deliver, not all {BIG:,})"
        in text
    )
    assert f"parked (failed) rows (among the latest {SAMPLE})" in text
    await assert_bounded(backlog, statements, SAMPLE, counted_in_index=False)


async def test_requeue_previews_read_as_many_rows_as_they_show(backlog: SQLStore) -> None:
    out = io.StringIO()
    async with recorded(backlog) as statements:
        await requeue_command(backlog, RequeueFilter(statuses=("failed",)), apply=False, out=out, limit=SAMPLE)
    assert (
        f"{SAMPLE} row(s) would be requeued; more than {SAMPLE} rows match: only the first {SAMPLE}" in out.getvalue()
    )
    assert [line.split()[0] for line in out.getvalue().splitlines()[1:-1]] == [f"f{i}" for i in range(SAMPLE)]
    await assert_bounded(backlog, statements, SAMPLE + 1, counted_in_index=False)  # one more: are there more?
    assert (await im_lane_backlog(backlog)).parked == BIG  # a preview changes nothing


async def test_the_backlog_gauges_count_in_the_index(backlog: SQLStore) -> None:
    async with recorded(backlog) as statements:
        pending = (await sample_backlog(backlog)).pending
        lane = await im_lane_backlog(backlog)
    assert pending == lane.pending == BIG and lane.parked == BIG
    await assert_bounded(backlog, statements, 1, counted_in_index=False)  # the oldest row, by its key
