"""``room-outbox completion bash|zsh|fish``: a shell completion script, generated from the
argparse parser itself, so that it always knows every command and option.

shtab rather than argcomplete or click: it writes a static script once (argcomplete runs
Python on every Tab press, a second-long start here), it reads our argparse parser as it is
(click would mean rewriting the CLI), it is small and has no dependencies, and nothing of it
runs unless this command is called."""

from __future__ import annotations

import argparse
import sys

from room_outbox.cli.command import Command
from room_outbox.cli.main import build_parser

SHELLS = ("bash", "zsh", "fish")


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    import shtab  # here, not at the top: every other command starts without it

    return str(shtab.complete(parser, shell=shell))


def _run(args: argparse.Namespace, _parser: argparse.ArgumentParser) -> int:
    sys.stdout.write(completion_script(build_parser(every_command=True), args.shell))
    return 0


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=SHELLS, help="the shell the script is for")


COMMAND = Command(
    description="Print the completion script for a shell, generated from the command line itself: every\n"
    "command, action and option. Load it from the shell's start-up file.",
    examples="room-outbox completion bash | sudo tee /etc/bash_completion.d/room-outbox >/dev/null\n"
    "room-outbox completion zsh | tee ~/.zfunc/_room-outbox >/dev/null\n"
    "room-outbox completion fish | tee ~/.config/fish/completions/room-outbox.fish >/dev/null",
    needs="none",
    arguments=_arguments,
    run=_run,
)
