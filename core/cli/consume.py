"""``room-outbox consume``: the consumer-group members with their handlers until SIGTERM; and
the consumers' and handlers' tables that ``migrate`` creates."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Collection

import anyio
import pluggy

from room_outbox.cli.command import Command
from room_outbox.config import Settings
from room_outbox.consume.registry import registered_handlers
from room_outbox.consume.service import run_consumers
from room_outbox.consume.settings import consumer_settings
from room_outbox.observability.redaction import Redactor
from room_outbox.signals import exit_despite_threads
from room_outbox.startup import freeze_startup_heap
from room_outbox.store.factory import consumer_store
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.registry import WantedSchema, migrate, steps_of


def enabled_handlers(settings: Settings) -> set[str]:
    """Names of the handlers the enabled consumers run (``consumers.<name>.handlers``)."""
    return {handler for consumer in consumer_settings(settings).values() for handler in consumer.handlers}


def consumers_schema(store: SQLStore, pm: pluggy.PluginManager, handlers: Collection[str]) -> WantedSchema:
    """The consumers' tables, then the table statements of each of ``handlers`` (the enabled
    ones, ``HandlerSpec.schema``) for this database, and the columns they write, checked where
    their tables exist (``HandlerSpec.tables``); nothing where consumers keep no tables (SQLite)."""
    if consumer_store(store) is None:
        return WantedSchema(outbox=False)
    specs = [(name, spec) for name, spec in sorted(registered_handlers(pm).items()) if name in handlers]
    statements = [(f"handler {name}", tuple(spec.schema.get(store.dialect.name, ()))) for name, spec in specs]
    return WantedSchema(
        outbox=False,
        consumers=True,
        handler_statements=steps_of(s for s in statements if s[1]),
        handler_tables=tuple(table for _name, spec in specs for table in spec.tables),
    )


async def migrate_consumers(store: SQLStore, pm: pluggy.PluginManager, handlers: Collection[str]) -> list[str]:
    """The consumers' own tables (``migrate``), then the tables of ``handlers``, through the
    one migration path (:mod:`room_outbox.store.schema.registry`)."""
    return await migrate(store, consumers_schema(store, pm, handlers))


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--consumer", help="run only consumers.NAME (default: every enabled consumer)")


def _run(settings: Settings, args: argparse.Namespace, redactor: Redactor) -> int:
    """``redactor``: the process's one (its log handler uses it)."""
    freeze_startup_heap()
    anyio.run(functools.partial(_serve, settings, args.consumer, redactor))
    return 0


async def _serve(settings: Settings, consumer: str | None, redactor: Redactor) -> None:
    await run_consumers(settings, consumer, redactor=redactor)
    exit_despite_threads()


COMMAND = Command(
    description="Join the Kafka consumer group of every enabled consumers.<name> (or only --consumer NAME)\n"
    "and hand each message to the consumer's handlers: effectively once for their database\n"
    "writes, each room in order, failures retried from room_consumer_retry, dead letters kept.",
    examples="room-outbox consume --config config/config.consume.docker.yaml\nroom-outbox consume --consumer feed",
    needs="config",
    arguments=_arguments,
    run=_run,
)
