"""A plugin package outside the repository, written as the sink guide shows it: built from the
guide's own code blocks, installed, found through its entry point, passing the shipped sink
contract (room_outbox.testing) and mypy --strict against room-outbox's wheel (its py.typed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "how-to" / "write-a-sink.md"


def guide_block(after: str) -> str:
    """The first fenced code block after the line that starts with ``after``."""
    text = GUIDE.read_text()
    start = text.index(after)
    block = re.compile(r"```\w*\n(.*?)```", re.DOTALL).search(text, start)
    assert block is not None, f"no code block after {after!r} in {GUIDE.name}"
    return block.group(1)


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command[:4])}…\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)  # builds and installs a package
def test_the_guides_sink_package_installs_and_passes_the_shipped_contract(tmp_path: Path) -> None:
    package = tmp_path / "room-outbox-jsonl"
    (package / "room_outbox_jsonl").mkdir(parents=True)
    (package / "tests").mkdir()
    (package / "room_outbox_jsonl" / "__init__.py").write_text(guide_block("`room_outbox_jsonl/__init__.py`:"))
    (package / "tests" / "test_jsonl_sink.py").write_text(guide_block("`tests/test_jsonl_sink.py`:"))
    (package / "pyproject.toml").write_text(guide_block("Its `pyproject.toml`"))
    # room-outbox as its wheel installs it (py.typed included), then the plugin beside it.
    site = tmp_path / "site"
    for source in (ROOT, package):
        run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(source)],
            tmp_path,
        )
    env = {**os.environ, "PYTHONPATH": str(site), "MYPYPATH": str(site)}

    # Installed, the entry point brings the sink to the core like any plugin.
    found = run(
        [sys.executable, "-c", "from room_outbox.plugin_manager import make_plugin_manager as m;"
         "print(sorted(s.name for specs in m().hook.room_outbox_register_sinks() for s in specs))"],
        tmp_path, env,
    )  # fmt: skip
    assert "'jsonl'" in found, found

    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")], package, env)
    assert re.search(r"\b8 passed, 2 skipped\b", tests), tests  # the contract's checks and the guide's own

    mypy = Path(sys.executable).with_name("mypy")
    run([str(mypy), "--strict", "--no-incremental", "room_outbox_jsonl", "tests"], package, env)
