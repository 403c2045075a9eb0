"""Plugin packages outside the repository, written as the guides show them: built from the
guides' own code blocks, installed beside room-outbox's wheel, found through their entry
points, passing the shipped contracts (room_outbox.testing) and mypy --strict against the
wheel's types (its py.typed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOW_TO = ROOT / "docs" / "how-to"
#: What room-outbox's wheel is built from.
PACKAGED = ("pyproject.toml", "README.md", "core", "plugins")


def guide_block(guide: Path, after: str) -> str:
    """The first fenced code block after the line that starts with ``after``."""
    text = guide.read_text()
    start = text.index(after)
    block = re.compile(r"```\w*\n(.*?)```", re.DOTALL).search(text, start)
    assert block is not None, f"no code block after {after!r} in {guide.name}"
    return block.group(1)


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command[:4])}…\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def from_guide(guide: Path, package: Path, files: dict[str, str]) -> None:
    """Write each file of ``files`` (path → the line its block follows) from the guide."""
    for path, after in files.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(guide_block(guide, after))


def installed(tmp_path: Path, package: Path) -> dict[str, str]:
    """room-outbox as its wheel installs it (py.typed included), then ``package`` beside it;
    the environment that sees both. The wheel is built from a copy of what it is made of:
    building in the checkout writes there, and two tests building at once collide."""
    room_outbox = tmp_path / "room-outbox"
    for part in PACKAGED:
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, room_outbox / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            room_outbox.mkdir(exist_ok=True)
            shutil.copy2(ROOT / part, room_outbox / part)
    site = tmp_path / "site"
    for source in (room_outbox, package):
        run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(source)],
            tmp_path,
        )
    return {**os.environ, "PYTHONPATH": str(site), "MYPYPATH": str(site)}


def registered(hook: str, tmp_path: Path, env: dict[str, str]) -> str:
    """The names the installed plugins register through ``hook``, as the core finds them."""
    return run(
        [sys.executable, "-c", "from room_outbox.plugin_manager import make_plugin_manager as m;"
         f"print(sorted(s.name for specs in m().hook.{hook}() for s in specs))"],
        tmp_path, env,
    )  # fmt: skip


def passes_its_tests_and_mypy(package: Path, module: str, env: dict[str, str], expected: str) -> None:
    tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")], package, env)
    assert re.search(rf"\b{expected}\b", tests), tests
    mypy = Path(sys.executable).with_name("mypy")
    run([str(mypy), "--strict", "--no-incremental", module, "tests"], package, env)


@pytest.mark.slow
@pytest.mark.timeout(600)  # builds and installs a package
def test_the_guides_sink_package_installs_and_passes_the_shipped_contract(tmp_path: Path) -> None:
    package = tmp_path / "room-outbox-jsonl"
    from_guide(
        HOW_TO / "write-a-sink.md",
        package,
        {
            "room_outbox_jsonl/__init__.py": "`room_outbox_jsonl/__init__.py`:",
            "tests/test_jsonl_sink.py": "`tests/test_jsonl_sink.py`:",
            "pyproject.toml": "Its `pyproject.toml`",
        },
    )
    env = installed(tmp_path, package)
    found = registered("room_outbox_register_sinks", tmp_path, env)
    assert "'jsonl'" in found, found
    # the contract's checks and the guide's own
    passes_its_tests_and_mypy(package, "room_outbox_jsonl", env, "8 passed, 2 skipped")


@pytest.mark.slow
@pytest.mark.timeout(600)  # builds and installs a package
def test_the_guides_handler_package_is_the_example_and_passes_the_shipped_contract(tmp_path: Path) -> None:
    package = tmp_path / "room-outbox-gift-stats"
    files = {
        "room_outbox_gift_stats/__init__.py": "`room_outbox_gift_stats/__init__.py`:",
        "tests/test_gift_stats.py": "`tests/test_gift_stats.py`:",
        "pyproject.toml": "Its `pyproject.toml`",
    }
    from_guide(HOW_TO / "write-a-handler.md", package, files)
    example = ROOT / "examples" / "gift_stats"
    for path in files:  # the page is the example the process tests run, file for file
        assert (package / path).read_text() == (example / path).read_text(), f"the guide's {path} is not the example's"
    env = installed(tmp_path, package)
    found = registered("room_outbox_register_handlers", tmp_path, env)
    assert "'gift_stats'" in found, found
    # the contract's six checks and the guide's own
    passes_its_tests_and_mypy(package, "room_outbox_gift_stats", env, "7 passed")
