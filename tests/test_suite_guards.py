"""The suite's own set-up: a test that fails inside a task group, leaving a loop that ignores
cancellation, ends its run at its timeout with the threads' stacks printed, instead of hanging CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HANGS_AFTER_FAILING = """
import anyio
import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_fails_inside_a_task_group():
    stop = anyio.Event()

    async def loop_that_finishes_its_work_first():  # as a dispatcher's graceful stop does
        with anyio.CancelScope(shield=True):
            await stop.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop_that_finishes_its_work_first)
        assert 1 == 2, "fails before stop.set()"
        stop.set()
"""


def test_a_test_failing_inside_a_task_group_ends_its_run_at_its_timeout(tmp_path: Path) -> None:
    test = tmp_path / "test_hangs_after_failing.py"
    test.write_text(HANGS_AFTER_FAILING)
    done = subprocess.run(
        # The project's pytest settings (its timeout method) with a 3 s deadline.
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-o", "timeout=3", "-v", str(test)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,  # far beyond the 3 s deadline: reaching it means the guard does not work
    )  # fmt: skip
    assert done.returncode != 0
    assert "Timeout" in done.stdout + done.stderr
    assert "test_fails_inside_a_task_group" in done.stdout  # the run names the test it ended in
