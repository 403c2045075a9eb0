"""`scripts/run.sh`: with the shipped local config it starts the fake Tencent IM that config
points at, delivers through it, and stops it when the dispatcher ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from support import envelope, insert_events, kill_if_running, wait_until

from room_outbox.store.backends.mysql import MySQLStore

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def _published(store: MySQLStore, event_id: str) -> bool:
    async with store.transaction() as cur:
        await cur.execute("SELECT status FROM room_outbox WHERE event_id = %s", (event_id,))
        row = await cur.fetchone()
    return row is not None and row[0] == "published"


@pytest.mark.serial  # the fake IM's port is the shipped config's fixed 8090
@pytest.mark.timeout(120)
async def test_run_sh_starts_the_fake_im_its_config_points_at(database_dsn: str, store: MySQLStore) -> None:
    assert not _answers(8090), "something already answers on 127.0.0.1:8090, the shipped config's fake IM"
    env = {**os.environ, "ROOM_OUTBOX__MYSQL__DSN": database_dsn, "ROOM_OUTBOX__OUTBOX_WORKER__POLL_INTERVAL": "100ms"}
    env.pop("ROOM_OUTBOX_CONFIG", None)
    script = subprocess.Popen(
        ["scripts/run.sh"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        await wait_until(lambda: _answers(8090), timeout=60)
        await insert_events(store, [envelope("run-sh-1")])
        await wait_until(lambda: _published(store, "run-sh-1"), timeout=30)
        script.send_signal(signal.SIGTERM)
        _, stderr = script.communicate(timeout=30)
        assert script.returncode == 0, stderr[-2000:]
        assert "starting the fake Tencent IM" in stderr
        await wait_until(lambda: not _answers(8090), timeout=10)
    finally:
        kill_if_running(script)
