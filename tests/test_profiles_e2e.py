"""Table profiles end to end, with real processes: rows written the way the profile's producer
writes them are all delivered by `room-outbox run`, and failures end in the profile's words."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from processes import FakeIMProcess, dispatchers, write_config
from store.test_silk import SILK_INSERT, silk_rows
from support import INSERT_V1, envelope, fetch_rows, insert_events, wait_until

from room_outbox.store.factory import open_store
from room_outbox.store.schema.profiles import ROOM_CELL, SILK

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def room_outbox(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_room_cell_rows_are_all_delivered_and_failures_end_failed(database_dsn: str, tmp_path: Path) -> None:
    """room-service with the Room Cell vocabulary: it inserts ``pending`` rows and marks rows
    ``retryable`` after its own failed push. Two dispatchers on ``profile: room_cell`` deliver
    them all (``delivered``), retry IM's transient errors through ``retryable`` and park the
    event that can never be delivered as ``failed``; nothing is ever ``published``."""
    fake = FakeIMProcess(tmp_path, faults={"fail_next": [10002] * 8})
    try:
        config = write_config(tmp_path / "config.yaml", database_dsn, fake, batch_size=10, parking=True)
        settings = yaml.safe_load(config.read_text())
        settings["database"] = {"profile": "room_cell"}  # the dsn still comes from `mysql`
        config.write_text(yaml.safe_dump(settings))
        migrated = room_outbox(config, "migrate")
        assert migrated.returncode == 0, migrated.stderr
        store = await open_store(database_dsn, profile=ROOM_CELL)
        try:
            await insert_events(store, [envelope(f"e{i:02d}", room_id=f"r_{i % 5}") for i in range(50)])
            now = int(time.time() * 1000)
            async with store.transaction() as cur:  # room-service's own push failed: it left them retryable
                for i in range(5):
                    doc = json.dumps(envelope(f"rs{i}", room_id="r_9"))
                    await cur.execute(INSERT_V1, ("default", f"rs{i}", "RoomUserJoined", "r_9", doc, now, now))
                await cur.execute(
                    "UPDATE room_outbox SET status = 'retryable', retry_count = 1, last_error = 'room-service push failed'"
                    " WHERE event_id LIKE 'rs%%'"
                )
                await cur.execute(INSERT_V1, ("default", "broken", "RoomUserJoined", "r_8", "{not json", now, now))

            async def settled() -> bool:
                return {r["status"] for r in (await fetch_rows(store)).values()} <= {"delivered", "failed"}

            with dispatchers(config, count=2) as procs:
                await wait_until(settled, timeout=60.0, interval=0.1)
                for proc in procs:
                    proc.terminate()
            rows = await fetch_rows(store)
        finally:
            await store.aclose()
        assert Counter(r["status"] for r in rows.values()) == {"delivered": 55, "failed": 1}
        assert rows["broken"]["status"] == "failed" and rows["broken"]["last_error"]
        assert all(r["worker_id"] is None for r in rows.values())
        retried = [e for e, r in rows.items() if r["status"] == "delivered" and r["retry_count"] > 0]
        assert len(retried) >= 5  # room-service's retryable rows at least; IM's transient errors add more
        received = Counter(m["event_id"] for m in fake.messages())
        assert set(received) == set(rows) - {"broken"}
        status = room_outbox(config, "status")
        assert status.returncode == 0 and "failed                1" in status.stdout, status.stdout
    finally:
        fake.close()


async def test_silk_rows_are_all_sent_and_failures_end_failed_after_their_max_attempts(
    postgresql_dsn: str, tmp_path: Path
) -> None:
    """silk's outbox_events on PostgreSQL, written as silk's PublishTx writes them (duplicates
    skipped): two dispatchers on ``profile: silk`` send every row (``sent``) through IM's
    transient errors (``retry``), give up on the row that can never be sent once its own
    max_attempts are used (``failed``) and never touch a ``cancelled`` row."""
    fake = FakeIMProcess(tmp_path, faults={"fail_next": [10002] * 8})
    try:
        config = write_config(tmp_path / "config.yaml", postgresql_dsn, fake, batch_size=10)
        settings = yaml.safe_load(config.read_text())
        settings["database"] = {"profile": "silk"}
        # silk's default backoff is 15 s × attempts; the test's is 100 ms × attempts
        settings["outbox_worker"]["retry"] = {"base": "100ms"}
        settings["sinks"]["tencent_im"]["event_types"] = ["wechat.subscribe", "detection.task.create"]
        config.write_text(yaml.safe_dump(settings))
        migrated = room_outbox(config, "migrate")
        assert migrated.returncode == 0, migrated.stderr
        assert "created table outbox_events" in migrated.stdout
        store = await open_store(postgresql_dsn, profile=SILK)
        try:
            async with store.transaction() as cur:
                for i in range(40):
                    event_type = "wechat.subscribe" if i % 2 else "detection.task.create"
                    payload = json.dumps({"n": i})
                    for _attempt in range(2 if i % 10 == 0 else 1):  # a retried PublishTx: skipped
                        await cur.execute(SILK_INSERT, (f"s{i:02d}", event_type, "user", f"u{i % 4}", payload, 5))
                # a payload that is no object can never become an event: failed after 3 attempts
                await cur.execute(SILK_INSERT, ("broken", "wechat.subscribe", "user", "u9", "[1, 2]", 3))
                await cur.execute(
                    SILK_INSERT.replace("'pending'", "'cancelled'"), ("gone", "wechat.subscribe", "user", "u9", "{}", 5)
                )

            async def settled() -> bool:
                return {r["status"] for r in (await silk_rows(store)).values()} <= {"sent", "failed", "cancelled"}

            with dispatchers(config, count=2) as procs:
                await wait_until(settled, timeout=60.0, interval=0.1)
                for proc in procs:
                    proc.terminate()
            rows = await silk_rows(store)
        finally:
            await store.aclose()
        assert Counter(r["status"] for r in rows.values()) == {"sent": 40, "failed": 1, "cancelled": 1}
        assert (rows["broken"]["status"], rows["broken"]["attempts"]) == ("failed", 3)
        assert rows["gone"]["attempts"] == 0
        # silk's count: every attempt, the successful one too
        assert all(r["attempts"] >= 1 for r in rows.values() if r["status"] == "sent")
        assert any(r["attempts"] > 1 for r in rows.values() if r["status"] == "sent")  # went through retry
        received = Counter(m["event_id"] for m in fake.messages())
        assert set(received) == {f"s{i:02d}" for i in range(40)}
    finally:
        fake.close()
