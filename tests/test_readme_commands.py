"""Every command the README and the docs site (docs/**/*.md) show exists and is exercised.

* ``room-outbox …`` lines: a synopsis (``[--config FILE] status [--json]``) must name a real
  command and real options; a concrete line must parse with the real CLI parser.
* ``scripts/…`` lines: the script exists, is executable, and what it runs is tested —
  ``demo.sh`` by tests/test_demo.py, ``test.sh`` by CI (.ci/run), ``run.sh`` by the process
  tests' `room-outbox run`.
* ``docker-compose …`` lines: the file they use is validated by tests/test_compose.py.

A command added to the README or a docs page that fits none of these fails here until a test covers it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest

from room_outbox.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: The README first (its first lines are the two commands), then every page of the docs site.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

#: Programs whose lines are examples of other tools, each with the reason it is not run here.
OTHER_TOOLS = {
    "curl": "talks to a running fake IM; the fake's control API is tested in tests/testing/test_fake_im.py",
    "export": "sets the environment for the next command",
    "docker": "Jaeger for local tracing; needs a Docker engine",
}
#: Scripts and the test or CI step that exercises them.
SCRIPTS = {
    "scripts/demo.sh": "tests/test_demo.py",
    "scripts/test.sh": ".ci/run",
    "scripts/run.sh": "tests/processes.py",
}


def shell_lines(pages: list[Path] = PAGES) -> list[str]:
    """Lines of the pages' shell blocks (```sh and bare ```), comments and blanks dropped."""
    lines: list[str] = []
    for page in pages:
        lines += _shell_lines(page.read_text())
    return lines


def _shell_lines(text: str) -> list[str]:
    lines, language = [], None
    for line in text.splitlines():
        fence = re.match(r"^```(\w*)", line)
        if fence:
            language = None if language is not None else fence.group(1)
            continue
        if language in ("sh", "bash", "") and line.strip() and not line.lstrip().startswith("#"):
            lines.append(re.split(r"\s+#\s", line, maxsplit=1)[0].strip())
    return lines


def program(line: str) -> tuple[str, list[str]]:
    """(program, arguments) with leading VAR=value assignments removed."""
    words = shlex.split(line.replace("…", "x").replace("'…'", "x"))
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    return (os.path.basename(words[0]) if words[0].endswith("room-outbox") else words[0]), words[1:]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser(every_command=True)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    """A command's options, its sub-commands' (``lanes retire --yes``) included."""
    options = {o for a in parser._actions for o in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= options_of(sub)
    return options


def test_the_readme_shows_the_two_commands_first() -> None:
    first = shell_lines([README])[:2]
    assert [program(line)[0] for line in first] == ["scripts/demo.sh", "scripts/test.sh"]


def test_every_room_outbox_command_in_the_readme_exists() -> None:
    commands = subcommands()
    seen = set()
    for line in shell_lines():
        name, args = program(line)
        if name != "room-outbox":
            continue
        # A synopsis (``[optional]``, ``{one,of,these}``): the command and its options must exist.
        if "[" in line or "{" in line or "FILTERS" in line:
            words = [w for w in re.sub(r"\[--config FILE\]", "", " ".join(args)).replace("[", " ").split()]
            command = words[0]
            assert command in commands, line
            known = options_of(commands[command])
            for option in (w.rstrip("]") for w in words if w.startswith("--")):
                assert option in known, f"{line}: {command} has no option {option}"
        else:
            try:
                parsed = build_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"the README or docs show a command the CLI refuses: {line}")
            command = parsed.command
        seen.add(command)
    # Every command of the CLI is documented, too.
    assert seen == set(commands), set(commands) ^ seen


def test_every_other_command_in_the_readme_is_accounted_for() -> None:
    for line in shell_lines():
        name, args = program(line)
        if name == "room-outbox":
            continue
        if name.startswith("scripts/"):
            assert name in SCRIPTS, f"{line}: say which test or CI step runs {name}"
            script = ROOT / name
            assert script.is_file() and os.access(script, os.X_OK), name
            assert (ROOT / SCRIPTS[name]).exists()
        elif name == "docker-compose":
            assert args and args[0] in ("up", "config", "down", "logs", "ps", "exec"), line
            if args[0] == "exec":  # the SQL it feeds is run by tests/test_compose.py
                assert line.endswith("< docker/sample-events.sql"), line
            assert (ROOT / "docker-compose.yml").is_file()  # validated by tests/test_compose.py
        else:
            assert name in OTHER_TOOLS, f"the docs run {name!r} ({line}); test it or list it with a reason"


def test_the_demo_script_runs_the_demo_command() -> None:
    text = (ROOT / "scripts" / "demo.sh").read_text()
    assert "scripts/install.sh" in text and "room-outbox demo" in text
