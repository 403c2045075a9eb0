"""The operator commands as a user types them: `room-outbox requeue` and `room-outbox cancel`."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from support import envelope, fetch_rows, insert_events, without_room_outbox_environment

from room_outbox.cli.main import main
from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio


@pytest.fixture
def config(tmp_path: Path, database_dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    without_room_outbox_environment(monkeypatch)
    path = tmp_path / "config.yaml"
    path.write_text(f"mysql:\n  dsn: '{database_dsn}'\n")
    return str(path)


async def test_requeue_and_cancel_from_the_command_line(
    store: MySQLStore, config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await insert_events(store, [envelope("p1"), envelope("p2", "RoomGiftSent"), envelope("c1")])
    async with store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET status = 'failed', retry_count = 5, last_error = 'tencent_im: permanent: group gone'"
            " WHERE event_id IN ('p1', 'p2')"
        )
    assert await anyio.to_thread.run_sync(main, ["--config", config, "requeue", "--error-contains", "group gone"]) == 0
    assert "2 row(s) would be requeued" in capsys.readouterr().out
    assert {r["status"] for e, r in (await fetch_rows(store)).items() if e != "c1"} == {"failed"}
    argv = ["--config", config, "requeue", "--event-type", "RoomGiftSent", "--status", "failed", "--yes"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert "requeued 1 row(s)" in capsys.readouterr().out
    rows = await fetch_rows(store)
    assert (rows["p2"]["status"], rows["p2"]["retry_count"], rows["p1"]["status"]) == ("pending", 0, "failed")

    assert await anyio.to_thread.run_sync(main, ["--config", config, "cancel", "c1", "--yes"]) == 0
    assert (await fetch_rows(store))["c1"]["status"] == "cancelled"
    assert await anyio.to_thread.run_sync(main, ["--config", config, "cancel", "c1", "--yes"]) == 1
    assert "c1 is cancelled" in capsys.readouterr().err


async def test_requeue_without_a_filter_refuses(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert await anyio.to_thread.run_sync(main, ["--config", config, "requeue", "--yes"]) == 2
    assert "give at least one of" in capsys.readouterr().err
