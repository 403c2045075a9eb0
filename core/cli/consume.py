"""The consumers' subcommands of ``room-outbox``: ``consume`` and ``consumers …``."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Collection
from typing import Any

import anyio
import pluggy

from room_outbox.config import ConfigError, Settings
from room_outbox.consume.ops import dead_letters_command, redrive_command
from room_outbox.consume.registry import registered_handlers
from room_outbox.consume.service import run_consumers
from room_outbox.consume.settings import consumer_settings
from room_outbox.observability.redaction import Redactor
from room_outbox.startup import freeze_startup_heap
from room_outbox.store.factory import consumer_store, open_store
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.registry import WantedSchema, migrate, steps_of

#: The consumers' subcommands: (one-line summary, description, examples), as room_outbox.cli's.
HELP: dict[str, tuple[str, str, str]] = {
    "consume": (
        "run Kafka consumer-group members with their handlers until SIGTERM",
        "Join the Kafka consumer group of every enabled consumers.<name> (or only --consumer NAME)\n"
        "and hand each message to the consumer's handlers: effectively once for their database\n"
        "writes, each room in order, failures retried from room_consumer_retry, dead letters kept.",
        "room-outbox consume --config config/config.consume.docker.yaml\nroom-outbox consume --consumer feed",
    ),
    "consumers": (
        "operate the consumers: list dead letters, send them round again (redrive)",
        "Dead letters of the consumers, from the database: `dead-letters` lists them, `redrive`\n"
        "makes them due again (a running consume takes them up); redrive applies only with --yes.",
        "room-outbox consumers dead-letters --consumer feed\n"
        "room-outbox consumers redrive --consumer feed --handler audit --yes",
    ),
}
COMMANDS = tuple(HELP)


def add_consumer_parsers(commands: Any) -> None:
    consume = commands.add_parser("consume", help=HELP["consume"][0])
    consume.add_argument("--consumer", help="run only consumers.NAME (default: every enabled consumer)")
    consumers = commands.add_parser("consumers", help=HELP["consumers"][0])
    actions = consumers.add_subparsers(dest="consumers_command", required=True, metavar="ACTION")
    dead = actions.add_parser("dead-letters", help="list dead letters")
    dead.add_argument("--consumer", help="only this consumer's")
    dead.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    dead.add_argument("--json", action="store_true", help="machine-readable output")
    redrive = actions.add_parser(
        "redrive", help="send dead letters round again (retried by a running consume); shows them, applies with --yes"
    )
    redrive.add_argument("--consumer", required=True, help="the consumer whose dead letters to send")
    redrive.add_argument("--handler", help="only this handler's dead letters")
    redrive.add_argument("--event-id", action="append", default=[], help="only this event (repeatable)")
    redrive.add_argument("--yes", action="store_true", help="apply (default: only show what would be sent)")
    for parser in (dead, redrive):
        parser.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def run_consumer_command(settings: Settings, args: argparse.Namespace, redactor: Redactor) -> int:
    """``redactor``: the process's one (its log handler uses it)."""
    if args.command == "consume":
        freeze_startup_heap()
        anyio.run(functools.partial(run_consumers, settings, args.consumer, redactor=redactor))
        return 0
    return anyio.run(_operate, settings, args)


def enabled_handlers(settings: Settings) -> set[str]:
    """Names of the handlers the enabled consumers run (``consumers.<name>.handlers``)."""
    return {handler for consumer in consumer_settings(settings).values() for handler in consumer.handlers}


def consumers_schema(store: SQLStore, pm: pluggy.PluginManager, handlers: Collection[str]) -> WantedSchema:
    """The consumers' tables, then the table statements of each of ``handlers`` (the enabled
    ones, ``HandlerSpec.schema``) for this database; nothing where consumers keep no tables
    (SQLite)."""
    if consumer_store(store) is None:
        return WantedSchema(outbox=False)
    statements = [
        (f"handler {name}", tuple(spec.schema.get(store.dialect.name, ())))
        for name, spec in sorted(registered_handlers(pm).items())
        if name in handlers
    ]
    return WantedSchema(outbox=False, consumers=True, handler_statements=steps_of(s for s in statements if s[1]))


async def migrate_consumers(store: SQLStore, pm: pluggy.PluginManager, handlers: Collection[str]) -> list[str]:
    """The consumers' own tables (``migrate``), then the tables of ``handlers``, through the
    one migration path (:mod:`room_outbox.store.schema.registry`)."""
    return await migrate(store, consumers_schema(store, pm, handlers))


async def _operate(settings: Settings, args: argparse.Namespace) -> int:
    store = await open_store(settings.database.dsn.get_secret_value(), pool_size=1)
    try:
        if consumer_store(store) is None:
            raise ConfigError("room-outbox consumers: needs a MySQL or PostgreSQL database; database.dsn names SQLite")
        if args.consumers_command == "dead-letters":
            return await dead_letters_command(store, args.consumer, args.limit, args.json, sys.stdout)
        return await redrive_command(store, args.consumer, args.handler, args.event_id, args.yes, sys.stdout)
    finally:
        await store.aclose()
