"""``room-outbox run``: the dispatcher until SIGTERM, SIGINT or SIGHUP (:func:`room_outbox.app.run_service`)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import threading

import anyio

from room_outbox.app import run_service
from room_outbox.cli.command import Command
from room_outbox.config import Settings
from room_outbox.errors import ConfigurationError
from room_outbox.observability.redaction import Redactor
from room_outbox.startup import freeze_startup_heap

#: Seconds the process may take to exit once the service has stopped, before threads left
#: running hold it no longer (see :func:`_exit_despite_threads`).
EXIT_WAIT = 2.0

log = logging.getLogger("room_outbox.app")


def _run(settings: Settings, _args: argparse.Namespace, redactor: Redactor) -> int:
    freeze_startup_heap()
    anyio.run(functools.partial(_serve, settings, redactor))
    return 0


async def _serve(settings: Settings, redactor: Redactor) -> None:
    await run_service(settings, redactor=redactor)
    _exit_despite_threads(EXIT_WAIT)


def _exit_despite_threads(wait: float) -> None:
    """Once the service has stopped: exit within ``wait`` seconds whatever threads still run.
    A sink's blocking call in a worker thread (``asyncio.to_thread``) that never returns is
    cut by ``publish_timeout``, but its thread runs on, and the interpreter waits for such
    threads at exit, for ever: the stop would never end, past any grace period. Said at
    WARNING, then the process exits 0 without them (the stop itself was clean)."""

    def exit_now() -> None:
        stuck = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon)
        log.warning(
            f"threads still running {wait:g}s after the stop (a sink's blocking call?): exiting without them",
            extra={"lifecycle": "exit_forced", "threads": stuck},
        )
        logging.shutdown()
        os._exit(0)

    watchdog = threading.Timer(wait, exit_now)
    watchdog.daemon = True  # the process exiting in time ends it unused
    watchdog.start()


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
