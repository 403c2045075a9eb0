"""Real processes for fault tests: the fake Tencent IM and `room-outbox run` dispatchers.

Output goes to files, never to pipes nobody reads (a full pipe would stall the process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    env["ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY"] = DEV_KEY  # secrets through the environment
    return env


class FakeIMProcess:
    """`room-outbox fake-im --port 0` as a process, controlled over its HTTP endpoints."""

    def __init__(self, workdir: Path, faults: dict[str, Any] | None = None) -> None:
        self.log = workdir / "fake-im.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "room_outbox.cli",
                "fake-im",
                "--port",
                "0",
                "--faults",
                json.dumps(faults or {}),
            ],
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env=_env(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "fake Tencent IM on http://127.0.0.1:PORT (...)"
        if not line:
            raise RuntimeError(f"fake IM did not start: {self.log.read_text()}")
        self.base_url = line.split(" on ", 1)[1].split()[0]
        self.client = httpx.Client(base_url=self.base_url, timeout=10)

    def set_faults(self, **faults: Any) -> None:
        self.client.post("/_fake/faults", json=faults).raise_for_status()

    def messages(self) -> list[dict[str, Any]]:
        return list(self.client.get("/_fake/messages").json()["messages"])

    def stats(self) -> dict[str, Any]:
        return dict(self.client.get("/_fake/stats").json())

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)


def write_config(
    path: Path, dsn: str, fake: FakeIMProcess, sections: dict[str, dict[str, Any]] | None = None, **worker: Any
) -> Path:
    """A `room-outbox run` configuration; ``worker`` goes to outbox_worker (a key given None:
    left to its default), ``sections`` are merged into the other sections
    (``{"mysql": {"query_timeout": "1s"}}``). Rows are claimable at once (``claim_after`` 0):
    nothing here pushes them synchronously."""
    worker = {"poll_interval": "100ms", "publish_timeout": "1s", "lease": "3s", "claim_after": "0s", **worker}
    config: dict[str, Any] = {
        "mysql": {"dsn": dsn, "pool_size": 4},
        "outbox_worker": {key: value for key, value in worker.items() if value is not None},
        "sinks": {"tencent_im": {"base_url": fake.base_url, "sdkappid": DEV_SDKAPPID}},
        "log": {"level": "INFO"},
    }
    for name, values in (sections or {}).items():
        config[name] = {**config.get(name, {}), **values}
    path.write_text(yaml.safe_dump(config))
    return path


class DispatcherProcess:
    """`room-outbox run` as a process; its JSON log lines land in ``log``."""

    def __init__(self, config: Path, name: str) -> None:
        self.log = config.parent / f"{name}.log"
        env = _env()
        env["ROOM_OUTBOX__NODE_ID"] = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "run"],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
            env=env,
        )

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 30.0) -> float:
        """SIGTERM; return the seconds until the process exited."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=timeout)
        return time.monotonic() - started


@contextmanager
def dispatchers(config: Path, count: int = 1) -> Iterator[list[DispatcherProcess]]:
    procs = [DispatcherProcess(config, f"dispatcher-{n}") for n in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.alive():
                proc.kill()
