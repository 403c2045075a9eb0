"""The benchmark harness runs end to end (tiny sizes: parts a, p and d only, a few seconds)."""

from __future__ import annotations

import pytest

from bench.run import main


def test_bench_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--only", "a,p,d", "--events", "300", "--seed-events", "100", "--published", "2000"]
    assert main([*argv, "--claim-rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "a. dispatcher noop lane, batch 100" in out
    assert "a. same, former per-row tasks + limiter, batch 100" in out
    assert "d. same behind 2,000 published" in out
    assert "p. PostgreSQL dispatcher noop lane, batch 100" in out


@pytest.mark.slow
def test_bench_ordered_processes_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Part o: 1, 2 and 3 `room-outbox run` processes, per-room and unordered, ratio to one."""
    argv = ["--quick", "--only", "o", "--ordered-events", "300", "--ordered-rooms", "50", "--batches", "100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "o. per_room, batch 100, 50 rooms, 1 process(es)" in out
    assert "o. per_room, batch 100, 50 rooms, 3 process(es)" in out and "× 1 process" in out
    assert "o. none, batch 100, 50 rooms, 3 process(es)" in out  # the unordered lane beside it
