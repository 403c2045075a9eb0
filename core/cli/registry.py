"""The command registry: every ``room-outbox`` command is listed here by name, with its one-line
summary and the module that declares the rest (a :class:`~room_outbox.cli.command.Command`:
help, arguments, needs, what it runs). :func:`room_outbox.cli.main.build_parser` builds the
parser from :data:`COMMANDS` alone, importing a command's module only once that command is
the one typed: ``room-outbox run`` pays for no other command's imports (the consumers' Kafka
client, the demo's fake server). A new command is a new module and one line here; the order
is the help's."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from room_outbox.cli.command import Command


@dataclass(frozen=True)
class Listed:
    name: str
    #: One line, in the command list.
    summary: str
    #: Where its :class:`Command` is, as ``COMMAND``.
    module: str

    def command(self) -> Command:
        command: Command = importlib.import_module(self.module).COMMAND
        return command


COMMANDS: tuple[Listed, ...] = (
    Listed("run", "run the dispatcher until SIGTERM, SIGINT or SIGHUP", "room_outbox.cli.run"),
    Listed(
        "check-config", "validate the whole configuration offline: OK, or every error", "room_outbox.cli.check_config"
    ),
    Listed("migrate", "create room_outbox or upgrade a V1 table in place (idempotent)", "room_outbox.cli.migrate"),
    Listed("status", "backlog, retries, frequent errors and leases at a glance", "room_outbox.cli.status"),
    Listed("inspect", "one event: its row, parsed envelope and delivery state", "room_outbox.cli.inspect"),
    Listed(
        "requeue",
        "send pending or parked (failed) rows round again; shows them, applies only with --yes",
        "room_outbox.cli.requeue",
    ),
    Listed(
        "cancel",
        "mark an event cancelled: never delivered, kept for audit; shows it, applies only with --yes",
        "room_outbox.cli.cancel",
    ),
    Listed(
        "cleanup",
        "delete (or archive) published rows older than retention.older_than; previews without --yes",
        "room_outbox.cli.cleanup",
    ),
    Listed(
        "lanes",
        "each lane: enabled, watermark, backlog, parked; `lanes retire NAME` drops a disabled one",
        "room_outbox.cli.lanes",
    ),
    Listed("consume", "run Kafka consumer-group members with their handlers until SIGTERM", "room_outbox.cli.consume"),
    Listed(
        "consumers",
        "operate the consumers: dead letters, redrive, describe the groups (lag per partition)",
        "room_outbox.cli.consumers",
    ),
    Listed(
        "demo",
        "run the whole pipeline on SQLite with a fake Tencent IM and verify it (no services needed)",
        "room_outbox.cli.demo",
    ),
    Listed("fake-im", "serve a fake Tencent IM on loopback (tests, demos)", "room_outbox.cli.fake_im"),
    Listed("completion", "print a shell completion script (bash, zsh or fish)", "room_outbox.cli.completion"),
)
