"""A result the database refuses for one row (a trigger guarding the status words, a CHECK
constraint) leaves the rest of the lane's results written and its later events delivered: the
refused row is released with the database's words in ``last_error`` and one ERROR naming it,
once while the refusal lasts. On MariaDB, PostgreSQL and SQLite."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import psycopg
import psycopg_pool  # noqa: F401  (loaded, so that psycopg's errors are known to the store)
import pymysql
import pytest
from support import RecordingSink, envelope, fetch_rows, insert_events, make_dispatcher

from room_outbox.attempt.retry import RetryPolicy
from room_outbox.sink import PermanentSinkError
from room_outbox.store.backends.errors import refused_value
from room_outbox.store.clock import now_ms
from room_outbox.store.protocol import DeliveryResult, Outcome, SQLStore

pytestmark = pytest.mark.anyio

GUARD_MESSAGE = "room_outbox: status must be pending or published"
#: A table whose owner allows room-service's own two statuses only, as a trigger enforces them.
STATUS_GUARD = {
    "mysql": [
        "CREATE TRIGGER guard_status BEFORE UPDATE ON room_outbox FOR EACH ROW BEGIN"
        " IF NEW.status NOT IN ('pending', 'published') THEN"
        f" SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{GUARD_MESSAGE}'; END IF; END"
    ],
    "postgresql": [
        "CREATE FUNCTION guard_status() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        f" IF NEW.status NOT IN ('pending', 'published') THEN RAISE EXCEPTION '{GUARD_MESSAGE}'; END IF;"
        " RETURN NEW; END $$",
        "CREATE TRIGGER guard_status BEFORE UPDATE ON room_outbox FOR EACH ROW EXECUTE FUNCTION guard_status()",
    ],
    "sqlite": [
        "CREATE TRIGGER guard_status BEFORE UPDATE ON room_outbox FOR EACH ROW"
        f" WHEN NEW.status NOT IN ('pending', 'published') BEGIN SELECT RAISE(ABORT, '{GUARD_MESSAGE}'); END"
    ],
}
#: The same rule as a CHECK constraint (SQLite cannot add one to a table).
STATUS_CHECK = "ALTER TABLE room_outbox ADD CONSTRAINT status_words CHECK (status IN ('pending', 'published'))"


@pytest.fixture
async def guarded(bare_store: SQLStore) -> SQLStore:
    """A migrated outbox whose trigger refuses every status but 'pending' and 'published'."""
    await bare_store.migrate()
    await execute(bare_store, STATUS_GUARD[bare_store.dialect.name])
    return bare_store


async def execute(store: SQLStore, statements: Sequence[str]) -> None:
    async with store.transaction() as cur:
        for statement in statements:
            await cur.execute(statement)


def refusals(caplog: pytest.LogCaptureFixture, level: int = logging.ERROR) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and r.getMessage().startswith("result refused")]


async def parks_bad_and_delivers_the_rest(store: SQLStore, caplog: pytest.LogCaptureFixture, why: str) -> None:
    """One event fails for good with parking on, its park refused with ``why``: the batch's other
    results, written by the next round's claim, and the events after them go through."""
    sink = RecordingSink(fail={"bad"}, error=PermanentSinkError("group gone"))
    dispatcher = make_dispatcher(store, sink, retry=RetryPolicy(interval=0.05, parking=True))
    await insert_events(store, [envelope(event_id) for event_id in ("a1", "bad", "a2", "a3")])
    with caplog.at_level(logging.DEBUG, logger="room_outbox.store"):
        assert (await dispatcher.run_once()).claimed == 4
        await insert_events(store, [envelope(event_id) for event_id in ("late1", "late2")])
        assert (await dispatcher.run_once()).claimed == 2  # its claim writes the first round's results
        await dispatcher.flush()
    rows = await fetch_rows(store)
    assert {e: r["status"] for e, r in rows.items()} == {
        "a1": "published",
        "bad": "pending",
        "a2": "published",
        "a3": "published",
        "late1": "published",
        "late2": "published",
    }
    bad = rows["bad"]
    assert bad["worker_id"] is None and bad["retry_count"] == 1
    assert bad["last_error"].startswith("its parked result was refused by the database: ")
    assert why in bad["last_error"] and bad["last_error"].endswith("; test: permanent: group gone")
    assert "Failing row" not in bad["last_error"]  # PostgreSQL's detail: the whole row, its envelope too
    assert bad["lock_until_ms"] > int(time.time() * 1000)  # not retried at once
    [refusal] = refusals(caplog)
    fields = {name: getattr(refusal, name) for name in ("table", "row", "event_id", "outcome", "status")}
    assert fields == {
        "table": "room_outbox",
        "row": bad["id"],
        "event_id": "bad",
        "outcome": "parked",
        "status": "failed",
    }
    assert why in refusal.error


async def test_a_park_a_trigger_refuses_leaves_the_other_results_written_and_the_lane_moving(
    guarded: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    await parks_bad_and_delivers_the_rest(guarded, caplog, GUARD_MESSAGE)


async def test_a_park_a_check_constraint_refuses_leaves_the_other_results_written_and_the_lane_moving(
    bare_store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    if bare_store.dialect.name == "sqlite":
        pytest.skip("SQLite adds no constraint to a table")
    await bare_store.migrate()
    await execute(bare_store, [STATUS_CHECK])
    await parks_bad_and_delivers_the_rest(bare_store, caplog, "status_words")


async def test_a_refusal_that_lasts_is_logged_once_per_row_until_the_row_is_written(
    guarded: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The refused row comes back (due again) and is refused again: one ERROR, then DEBUG. A
    result of the row written meanwhile ends the refusal: the next one is an ERROR again."""
    await insert_events(guarded, [envelope("bad")])

    async def claim_and_record(claim: str, outcome: Outcome) -> None:
        async with guarded.transaction() as cur:  # due again now, not in a minute
            await cur.execute("UPDATE room_outbox SET lock_until_ms = 0 WHERE event_id = 'bad'")
        [row] = (await guarded.claim(claim, 10, now_ms() + 30_000)).rows
        assert await guarded.record([DeliveryResult(row.id, "bad", claim, outcome, "group gone")]) == []

    with caplog.at_level(logging.DEBUG, logger="room_outbox.store"):
        await claim_and_record("t#1", Outcome.PARKED)
        await claim_and_record("t#2", Outcome.PARKED)
        assert (len(refusals(caplog)), len(refusals(caplog, logging.DEBUG))) == (1, 1)
        await claim_and_record("t#3", Outcome.FAILED)  # stays pending: the trigger lets it through
        await claim_and_record("t#4", Outcome.PARKED)
        assert (len(refusals(caplog)), len(refusals(caplog, logging.DEBUG))) == (2, 1)
    row = (await fetch_rows(guarded))["bad"]
    assert (row["status"], row["retry_count"], row["worker_id"]) == ("pending", 4, None)


def test_a_trigger_refusing_a_row_is_one_rows_problem_and_a_lost_connection_or_deadlock_is_not() -> None:
    assert refused_value(pymysql.err.OperationalError(1644, GUARD_MESSAGE)) == GUARD_MESSAGE
    assert refused_value(pymysql.err.IntegrityError(1452, "a foreign key constraint fails")) is not None
    for code, words in ((1213, "Deadlock found"), (2013, "Lost connection"), (1205, "Lock wait timeout")):
        assert refused_value(pymysql.err.OperationalError(code, words)) is None
    assert refused_value(psycopg.errors.RaiseException(GUARD_MESSAGE)) is not None
    assert refused_value(psycopg.errors.DeadlockDetected("deadlock detected")) is None
    assert refused_value(psycopg.errors.AdminShutdown("terminating connection")) is None
