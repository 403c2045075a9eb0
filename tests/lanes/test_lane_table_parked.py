"""Events a lane table parked (a sink with ``own_lane``, ``relay: lane_table``, ``parking:
true``): ``status`` lists their errors, ``inspect`` names the command, ``requeue --lane`` sends
them again and ``cancel --lane`` drops them, changing only that lane's rows, never
``room_outbox.status``. A real sink in a plugin run by the service, the commands through the
CLI, on MariaDB and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from lanes.test_lanes import lane_rows
from support import envelope, fetch_rows, insert_events, wait_until

from room_outbox import EventEnvelope, PermanentSinkError, SinkContext, SinkSettings, SinkSpec, hookimpl
from room_outbox.app import run_service
from room_outbox.cli.inspect import inspect_events
from room_outbox.cli.main import main
from room_outbox.config import load_settings
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import migrate_lanes
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

LANE = "lines"
TOO_LONG = "is longer than max_line_bytes"


class LinesSettings(SinkSettings):
    path: str
    max_line_bytes: int


class LinesSink:
    """Appends each event to a file, one line each; a line longer than ``max_line_bytes`` can
    never be written: the event is parked (as docs/how-to/write-a-sink.md's jsonl sink does)."""

    def __init__(self, settings: LinesSettings, context: SinkContext) -> None:
        self.path = Path(settings.path)
        self.max_line_bytes = settings.max_line_bytes

    async def deliver(self, envelope: EventEnvelope) -> None:
        line = envelope.model_dump_json() + "\n"
        if len(line.encode()) > self.max_line_bytes:
            raise PermanentSinkError(f"event {envelope.event_id} {TOO_LONG}")
        async with await anyio.open_file(self.path, "a", encoding="utf-8") as file:
            await file.write(line)

    async def aclose(self) -> None:
        pass


class LinesPlugin:
    @hookimpl
    def room_outbox_register_sinks(self) -> list[SinkSpec[LinesSettings]]:
        return [SinkSpec(LANE, LinesSink, settings_model=LinesSettings, own_lane=True)]


@pytest.fixture(params=["mariadb", "postgresql"])
async def dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("database_dsn" if request.param == "mariadb" else "postgresql_dsn"))


@pytest.fixture
async def any_store(dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(dsn)
    await store.migrate()
    await migrate_lanes(store, [LANE])
    try:
        yield store
    finally:
        await store.aclose()


def config(dsn: str, tmp_path: Path, max_line_bytes: int | None = None) -> Path:
    """The service's configuration: the lines sink alone, parking (``max_line_bytes``: with it);
    without: the commands' (the sink's plugin is not installed where they run)."""
    settings: dict[str, Any] = {"database": {"dsn": dsn}, "sinks": {"tencent_im": {"enabled": False}}}
    if max_line_bytes is not None:
        settings["outbox_worker"] = {"poll_interval": "50ms", "lanes": {LANE: {"parking": True}}}
        settings["sinks"] |= {
            "noop": {"enabled": False},
            LANE: {"path": str(tmp_path / "lines.jsonl"), "max_line_bytes": max_line_bytes, "start": "beginning"},
        }
    path = tmp_path / ("service.yaml" if max_line_bytes is not None else "commands.yaml")
    path.write_text(yaml.safe_dump(settings))
    return path


async def serve_until(path: Path, done: Any) -> None:
    """Run the service with the lines sink until ``done()`` holds (within a deadline)."""
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_service(load_settings(path), stop, handle_signals=False, plugins=[LinesPlugin()]))
        try:
            await wait_until(done, timeout=30)
        finally:
            stop.set()


async def cli(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await anyio.to_thread.run_sync(main, ["--config", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


async def statuses(store: SQLStore) -> dict[str, str]:
    return {event_id: row["status"] for event_id, row in (await lane_rows(store, LANE)).items()}


async def test_a_lane_tables_parked_events_are_listed_requeued_and_cancelled(
    any_store: SQLStore, dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = {"note": "x" * 400}
    await insert_events(
        any_store,
        [envelope("small"), envelope("big-0001", payload=big), envelope("big-0002", payload=big, room_id="r_2")],
    )

    async def parked() -> bool:
        return await statuses(any_store) == {"small": "published", "big-0001": "failed", "big-0002": "failed"}

    await serve_until(config(dsn, tmp_path, max_line_bytes=300), parked)
    commands = config(dsn, tmp_path)
    outbox_before = {event_id: row["status"] for event_id, row in (await fetch_rows(any_store)).items()}

    # status: the lane's parked errors, grouped (the event id is an identifier)
    code, out, _ = await cli(capsys, commands, "status", "--json")
    (lane,) = json.loads(out)["lanes"]
    assert (code, lane["lane"], lane["parked"]) == (0, LANE, 2)
    assert lane["top_parked_errors"] == [{"last_error": f"{LANE}: permanent: event <id> {TOO_LONG}", "rows": 2}]
    code, out, _ = await cli(capsys, commands, "status")
    assert f"most frequent last_error of lane {LANE}'s parked rows" in out and f"--lane {LANE}" in out

    # inspect names the command that sends it again, and that command does
    (doc,) = await inspect_events(any_store, "big-0001")
    assert doc["lanes"][LANE] == f"parked after 1 attempt(s): never retried until `room-outbox requeue --lane {LANE}`"

    # cancel --lane: a preview, then the lane's row alone is cancelled
    assert await cli(capsys, commands, "cancel", "big-0002", "--lane", LANE) == (
        0, f"would cancel big-0002 in lane {LANE} (now failed); run again with --yes to cancel it\n", "")  # fmt: skip
    assert (await statuses(any_store))["big-0002"] == "failed"
    assert await cli(capsys, commands, "cancel", "big-0002", "--lane", LANE, "--yes") == (
        0, f"cancelled big-0002 in lane {LANE}: it will never be sent there; its row there is kept\n", "")  # fmt: skip
    code, _, err = await cli(capsys, commands, "cancel", "small", "--lane", LANE, "--yes")
    assert (code, err) == (
        1, f"room-outbox cancel: small is published in lane {LANE}: only parked (failed) events can be cancelled\n")  # fmt: skip

    # requeue --lane: a preview (filters as everywhere), then the lane's parked row is due again
    code, out, _ = await cli(capsys, commands, "requeue", "--lane", LANE, "--error-contains", "LONGER")
    assert code == 0 and out.splitlines()[1].split()[:4] == ["big-0001", "default", "RoomUserJoined", "r_1"]
    assert out.splitlines()[-1] == "1 event(s) would be requeued; run again with --yes to apply"
    assert (await statuses(any_store))["big-0001"] == "failed"
    code, out, _ = await cli(capsys, commands, "requeue", "--lane", LANE, "--yes", "--json")
    assert code == 0 and {k: v for k, v in json.loads(out).items() if k != "rows"} == {
        "lane": LANE, "applied": True, "matched": 1, "more": False, "requeued": 1}  # fmt: skip
    row = (await lane_rows(any_store, LANE))["big-0001"]
    assert (row["status"], row["retry_count"], row["worker_id"], row["lock_until_ms"]) == ("pending", 0, None, 0)
    assert await cli(capsys, commands, "requeue", "--lane", LANE) == (
        0,
        f"no parked or skipped events in lane {LANE} match\n",
        "",
    )
    code, _, err = await cli(capsys, commands, "requeue", "--lane", "nowhere")
    assert (code, err) == (
        1, f"room-outbox requeue: nowhere is not a lane here (tailing lanes: none; lane tables: {LANE})\n")  # fmt: skip

    # the lane sends the requeued event (the line allowed now); the cancelled one never
    async def sent() -> bool:
        return (await statuses(any_store))["big-0001"] == "published"

    await serve_until(config(dsn, tmp_path, max_line_bytes=10_000), sent)
    lines = (tmp_path / "lines.jsonl").read_text().splitlines()
    assert [json.loads(line)["event_id"] for line in lines] == ["small", "big-0001"]
    assert await statuses(any_store) == {"small": "published", "big-0001": "published", "big-0002": "cancelled"}
    assert {event_id: row["status"] for event_id, row in (await fetch_rows(any_store)).items()} == outbox_before
