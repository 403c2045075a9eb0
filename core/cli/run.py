"""``room-outbox run``: the dispatcher until SIGTERM, SIGINT or SIGHUP (:func:`room_outbox.app.run_service`)."""

from __future__ import annotations

import argparse
import functools

import anyio

from room_outbox.app import run_service
from room_outbox.cli.command import Command
from room_outbox.config import Settings
from room_outbox.errors import ConfigurationError
from room_outbox.observability.redaction import Redactor
from room_outbox.signals import exit_despite_threads
from room_outbox.startup import freeze_startup_heap


def _run(settings: Settings, _args: argparse.Namespace, redactor: Redactor) -> int:
    freeze_startup_heap()
    anyio.run(functools.partial(_serve, settings, redactor))
    return 0


async def _serve(settings: Settings, redactor: Redactor) -> None:
    await run_service(settings, redactor=redactor)
    exit_despite_threads()


def _invalid_config(exc: ConfigurationError, args: argparse.Namespace, redactor: Redactor) -> int:
    # Imported only for a configuration in error: a start that loads pays for every module.
    from room_outbox.cli.check_config import check_unloadable

    return check_unloadable(exc, args.config, redactor)


COMMAND = Command(
    description="Deliver events until SIGTERM, SIGINT or SIGHUP. Before anything is claimed: the whole configuration\n"
    "is checked, the database is waited for (up to database.connect_wait) and its schema is checked.",
    examples="room-outbox run --config /etc/room-outbox/config.yaml\nROOM_OUTBOX__LOG__LEVEL=DEBUG room-outbox run",
    needs="config",
    arguments=lambda _parser: None,
    run=_run,
    # Stopped by its configuration, run lists every problem, as check-config does.
    invalid_config=_invalid_config,
)
