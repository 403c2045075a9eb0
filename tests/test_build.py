"""Reproducible builds: requirements.lock (the image's dependencies, hashed) and
requirements-dev.lock (the same pins plus the test tools, hashed) agree with pyproject.toml, and
the version floors exclude releases with known vulnerabilities."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
DEV_LOCK = ROOT / "requirements-dev.lock"


def requirements(extra: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {Requirement(r).name.lower(): Requirement(r) for r in listed}


def locked(lock: Path = LOCK) -> dict[str, str]:
    return {name.lower(): version for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", lock.read_text(), re.M)}


def test_the_floors_exclude_known_vulnerable_releases() -> None:
    deps = {**requirements("test"), **requirements()}  # h11 (httpx's engine) is a test tool's
    for name, vulnerable, fixed in (
        ("h11", "0.15.0", "0.16.0"),  # CVE-2025-43859
        ("pymysql", "1.1.0", "1.1.1"),  # CVE-2024-36039
        ("aiohttp", "3.12.13", "3.12.14"),  # CVE-2025-53643
    ):
        assert not deps[name].specifier.contains(vulnerable), f"{name} admits {vulnerable}"
        assert deps[name].specifier.contains(fixed), f"{name} refuses {fixed}"
    assert not deps["pymysql"].specifier.contains("1.2.0")  # aiomysql breaks on 1.2


def test_test_tools_are_pinned() -> None:
    for name, requirement in requirements("test").items():
        assert re.fullmatch(r"==[\w.]+", str(requirement.specifier)), f"test extra {name} is not pinned"


def test_every_locked_file_is_hashed_and_every_dependency_locked_within_its_bounds() -> None:
    entries = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", LOCK.read_text().split("\n", 2)[2])
    assert entries and all("--hash=sha256:" in entry for entry in entries)
    pins = locked()
    for name, requirement in requirements().items():
        assert name in pins, f"{name} is not in requirements.lock: run scripts/lock.sh"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement}"


def test_the_dev_lock_holds_every_runtime_pin() -> None:
    """scripts/test.sh installs requirements-dev.lock: the tests run on the versions that ship."""
    dev = locked(DEV_LOCK)
    for name, version in locked().items():
        assert dev.get(name) == version, f"{name}: {version} ships, the tests run {dev.get(name)}: run scripts/lock.sh"
    entries = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", DEV_LOCK.read_text().split("\n", 2)[2])
    assert entries and all("--hash=sha256:" in entry for entry in entries)


@pytest.mark.timeout(400)  # a cold uv cache fetches every package's metadata
def test_the_locks_are_what_uv_resolves_from_pyproject(tmp_path: Path) -> None:
    """uv keeps the locks' pins while they satisfy pyproject.toml, so re-resolving copies
    changes nothing unless pyproject.toml changed without scripts/lock.sh."""
    for lock in (LOCK, DEV_LOCK):
        shutil.copy(lock, tmp_path / lock.name)
    done = subprocess.run(
        [str(ROOT / "scripts" / "lock.sh")],
        cwd=ROOT,
        env={**os.environ, "LOCK_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for lock in (LOCK, DEV_LOCK):
        # The dev lock's annotations name the runtime lock it was constrained by: here, the copy.
        resolved = (tmp_path / lock.name).read_text().replace(f"{tmp_path}/", "")
        assert resolved == lock.read_text(), f"{lock.name} is out of date: run scripts/lock.sh"


@pytest.mark.slow
@pytest.mark.timeout(900)  # downloads and installs every locked package
def test_the_images_install_steps_work_from_the_lock_alone(tmp_path: Path) -> None:
    """The Dockerfile's build stage, without Docker: a fresh virtualenv, the locked and
    hash-checked dependencies, then room-outbox without dependencies, then `pip check`."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    steps = [
        ["pip", "install", "--quiet", "--require-hashes", "--no-deps", "-r", str(LOCK)],
        ["pip", "install", "--quiet", "--no-deps", str(tmp_path / "src")],
        ["pip", "check"],
        ["room-outbox", "--help"],
    ]
    for step in ("pip install --require-hashes --no-deps -r requirements.lock", "pip install --no-deps .", "pip check"):
        assert f"/opt/room-outbox/bin/{step}" in dockerfile, f"the Dockerfile no longer runs {step!r}"
    # What the Dockerfile copies, so the build writes nothing into the repository.
    for name in ("pyproject.toml", "README.md"):
        (tmp_path / "src").mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / "src" / name)
    for folder in ("core", "plugins"):
        shutil.copytree(ROOT / folder, tmp_path / "src" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    for step in steps:
        done = subprocess.run(
            [str(venv / "bin" / step[0]), *step[1:]], capture_output=True, text=True, timeout=600, cwd=tmp_path
        )
        assert done.returncode == 0, f"{' '.join(step)}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
