"""Child processes of a benchmark: started, watched and ended by their own pid only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def fake_im_process() -> Iterator[str]:
    """The fake IM in a child process; yields its base URL."""
    with fake_im_child() as (base_url, _pid):
        yield base_url


@contextmanager
def fake_im_child() -> Iterator[tuple[str, int]]:
    """The fake IM in a child process; yields its base URL and pid (to read its CPU time)."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.fake_server"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip(), proc.pid
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def room_outbox(*args: str, env: dict[str, str], **popen: object) -> subprocess.Popen[str]:
    """``room-outbox ARGS`` as an operator runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "room_outbox.cli", *args],
        env={**os.environ, **env},
        cwd=ROOT,
        text=True,
        **popen,  # type: ignore[call-overload]
    )


def receipts(base_url: str) -> dict[str, object]:
    return httpx.get(f"{base_url}/_bench/receipts", timeout=30).json()  # type: ignore[no-any-return]


def clear(base_url: str) -> None:
    httpx.post(f"{base_url}/_bench/clear", timeout=30)


def set_faults(base_url: str, **faults: object) -> None:
    httpx.post(f"{base_url}/_fake/faults", json=faults, timeout=30).raise_for_status()


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the most resident memory the process ever had (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """Busy and total CPU seconds of the whole machine, all cores, so far (Linux)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(values[:8]) - idle) / ticks, sum(values[:8]) / ticks
