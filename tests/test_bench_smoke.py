"""The benchmark harness runs end to end (tiny sizes: parts a and d only, a few seconds)."""

from __future__ import annotations

import pytest

from bench.run import main


def test_bench_quick_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--only", "a,d", "--events", "300", "--seed-events", "100", "--published", "2000"]
    assert main([*argv, "--claim-rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "a. dispatcher noop lane, batch 100" in out
    assert "a. same, former per-row tasks + limiter, batch 100" in out
    assert "d. same behind 2,000 published" in out
