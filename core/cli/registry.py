"""The command registry: every ``room-outbox`` command is one module declaring a
:class:`~room_outbox.cli.command.Command` (name, help, arguments, needs), and
:func:`room_outbox.cli.main.build_parser` builds the parser from :data:`COMMANDS` alone. A new
command is a new module and one line here; the order is the help's."""

from __future__ import annotations

from room_outbox.cli import (
    cancel,
    check_config,
    cleanup,
    completion,
    consume,
    consumers,
    demo,
    fake_im,
    inspect,
    lanes,
    migrate,
    requeue,
    run,
    status,
)
from room_outbox.cli.command import Command

COMMANDS: tuple[Command, ...] = (
    run.COMMAND,
    check_config.COMMAND,
    migrate.COMMAND,
    status.COMMAND,
    inspect.COMMAND,
    requeue.COMMAND,
    cancel.COMMAND,
    cleanup.COMMAND,
    lanes.COMMAND,
    consume.COMMAND,
    consumers.COMMAND,
    demo.COMMAND,
    fake_im.COMMAND,
    completion.COMMAND,
)
