"""``room-outbox consume``: the process around the consumers.

Start: database pool (waited for up to ``database.connect_wait``) → the handlers' tables checked
(as ``migrate`` checks them) → plugins and handlers →
telemetry and the HTTP endpoint (``/healthz``, ``/readyz``, ``/metrics`` on
``telemetry.http_listen``) → one group member per consumer. Stop (SIGTERM, SIGINT or ``stop``):
each consumer lets its handlings in progress end or time out (``handler_timeout``), starts no
further message, commits what is settled (the rest of its batch is read again later) and leaves
its group → handlers close → pool closes; a signal while it starts ends the start before any consumer joins. ``/readyz`` is
ready while the database answers and every consumer has joined its group and had an answer from
its broker within its ``session_timeout`` (the ``broker <name>`` checks).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import anyio
import pluggy

from room_outbox.cluster.identity import process_identity
from room_outbox.config import ConfigError, Settings, parse_listen
from room_outbox.consume.engine import Consumer
from room_outbox.consume.registry import NO_CONSUMER, BoundHandler, build_handlers, check_consumers, registered_handlers
from room_outbox.consume.settings import ConsumerSettings, consumer_settings
from room_outbox.errors import SchemaError
from room_outbox.observability.health import Health
from room_outbox.observability.http_endpoint import HttpEndpoint
from room_outbox.observability.redaction import Redactor, redactor_for
from room_outbox.observability.systemd import notify_systemd
from room_outbox.observability.telemetry import Telemetry, sdk_disabled, telemetry_from_environment
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.signals import stopped_by_signals
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.factory import consumer_store, open_store
from room_outbox.store.operator.reports import ping
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.columns import binlog_problems
from room_outbox.store.schema.consumers import inexact_tables
from room_outbox.store.schema.handler_tables import CheckedTables, check_handler_tables

log = logging.getLogger("room_outbox.consume")


async def run_consumers(
    settings: Settings,
    only: str | None = None,
    stop: anyio.Event | None = None,
    handle_signals: bool = True,
    plugins: Iterable[object] = (),
    redactor: Redactor | None = None,
) -> None:
    """Run the consumers until a signal (when ``handle_signals``, in the main thread) or
    ``stop`` is set. ``redactor``: the process's one (the log handler's); default: a new one
    from the configuration."""
    stop = stop or anyio.Event()
    chosen = consumer_settings(settings, only)
    if not chosen:
        raise ConfigError(NO_CONSUMER)
    redactor = redactor or redactor_for(settings)
    for options in chosen.values():
        for secret in options.security.secrets():
            redactor.add(secret)
    pm = make_plugin_manager(settings.plugins.disabled, plugins)
    # Before the wait for the database: a misspelt handler, a bad TLS file is named at once.
    check_consumers(pm, settings, only)
    if warning := sdk_disabled():
        log.warning(warning, extra={"lifecycle": "config_warning"})
    # Signals are handled from here on: one that comes while the process waits for the
    # database or opens what the consumers need ends the start, and no consumer joins a group.
    await stopped_by_signals(
        stop, handle_signals, lambda database_wait: _consume(settings, chosen, pm, redactor, stop, database_wait)
    )


async def _consume(
    settings: Settings,
    chosen: dict[str, ConsumerSettings],
    pm: pluggy.PluginManager,
    redactor: Redactor,
    stop: anyio.Event,
    database_wait: anyio.CancelScope,
) -> None:
    """Open the pool, the handlers and telemetry, run one group member per consumer until
    ``stop``, then close them in order. ``stop`` set before the consumers start: none starts;
    ``database_wait`` cancelled: the wait for the database ends."""
    # A handler runs inside its transaction: the session stays idle while it works, for up to
    # the slowest consumer's handler_timeout, and the server's session limits must allow that.
    handler_timeout = max(c.handler_timeout for c in chosen.values())
    opened: list[tuple[SQLConsumerStore, CheckedTables]] = []

    async def check(store: SQLStore) -> None:
        # Run within the wait for the database: a connection lost meanwhile is waited out too.
        # A handling's transaction may take as long as the slowest consumer's handler_timeout.
        consumers_store = consumer_store(store, handler_timeout)
        if consumers_store is None:
            raise ConfigError("consumers: need a MySQL or PostgreSQL database (database.dsn names SQLite)")
        async with store.transaction() as cur:
            refused = await binlog_problems(cur, store.dialect)  # every handling's write would fail
        if refused:
            raise SchemaError(refused[0])
        opened[:] = [(consumers_store, await _checked_tables(store, pm, chosen))]

    with database_wait:  # the one wait that may be long (database.connect_wait)
        store = await open_store(
            settings.database.dsn.get_secret_value(),
            settings.database.pool_size,
            query_timeout=settings.database.query_timeout,
            wait=settings.database.connect_wait,
            idle_in_transaction=handler_timeout,
            check=check,
        )
    if database_wait.cancelled_caught:
        log.info("stopped while waiting for the database", extra={"lifecycle": "stop_requested"})
        return
    handlers: list[BoundHandler] = []
    try:
        ((consumers_store, tables),) = opened
        async with _observed(settings, store, redactor) as (telemetry, health):
            # Retry leases are held by the identity, unique per start (see cluster.identity).
            identity = process_identity(settings.node_id)
            consumers = []
            lag_interval = settings.telemetry.backlog_interval
            for name, options in chosen.items():
                bound = build_handlers(pm, name, options, settings.node_id, redactor, tables.found)
                handlers.extend(bound.values())
                consumer = Consumer(name, options, consumers_store, bound, identity, redactor, telemetry, lag_interval)
                consumers.append(consumer)
                health.checks[f"broker {name}"] = consumer.broker_check
            if stop.is_set():  # signalled while starting: no consumer joins, and what opened closes
                log.info("stopping before the consumers started", extra={"lifecycle": "stop_requested"})
                return
            async with anyio.create_task_group() as tasks:
                for consumer in consumers:
                    tasks.start_soon(consumer.run)
                async with anyio.create_task_group() as watch:
                    watch.start_soon(_ready_once_joined, health, consumers)
                    await stop.wait()
                    watch.cancel_scope.cancel()
                log.info("stopping consumers", extra={"lifecycle": "stop_requested"})
                health.worker = "stopping"
                for consumer in consumers:
                    consumer.stop()
    finally:
        for each in handlers:
            with contextlib.suppress(Exception):
                await each.handler.aclose()
        await store.aclose()
        log.info("database pool closed", extra={"lifecycle": "pool_closed"})


async def _checked_tables(
    store: SQLStore, pm: pluggy.PluginManager, chosen: dict[str, ConsumerSettings]
) -> CheckedTables:
    """The tables of the chosen consumers' handlers as found, checked as ``migrate`` checks
    them: one that cannot hold what its handler writes stops the start (:class:`SchemaError`
    naming the column and the fix) rather than failing events one at a time. What ``migrate``
    only warns about (the consumers' own tables included) is logged as a warning."""
    specs = registered_handlers(pm)
    names = sorted({name for options in chosen.values() for name in options.handlers if name in specs})
    async with store.transaction() as cur:
        checked = await check_handler_tables(cur, store.dialect, [t for name in names for t in specs[name].tables])
        checked.warnings[:0] = await inexact_tables(cur, store.dialect)
    refused = [f"table {table} does not exist: run `room-outbox migrate`" for table in checked.missing]
    if refused or checked.refused:
        raise SchemaError("\n".join(refused + checked.refused))
    for warning in checked.warnings:
        log.warning(warning)
    return checked


@asynccontextmanager
async def _observed(settings: Settings, store: SQLStore, redactor: Redactor) -> AsyncIterator[tuple[Telemetry, Health]]:
    listen = parse_listen(settings.telemetry.http_listen) if settings.telemetry.http_listen else None
    telemetry = telemetry_from_environment(settings.node_id, redactor, prometheus=listen is not None)

    health = Health(functools.partial(ping, store), redactor=redactor)
    error: BaseException | None = None
    try:
        endpoint = None
        if listen is not None:
            endpoint = HttpEndpoint(health, telemetry.prometheus_text, telemetry.meter)
            try:
                port = await endpoint.bind(*listen)
            except OSError as exc:
                raise ConfigError(
                    f"telemetry.http_listen: cannot listen on {settings.telemetry.http_listen}: {exc}"
                ) from None
            log.info("http endpoint listening", extra={"lifecycle": "http_started", "port": port})
        async with anyio.create_task_group() as background:
            background.start_soon(notify_systemd, health)
            if endpoint is not None:
                background.start_soon(endpoint.serve)
                background.start_soon(health.watch_database)
            try:
                yield telemetry, health
            except BaseException as exc:
                error = exc  # re-raised below as itself, not inside this task group's ExceptionGroup
            background.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await telemetry.aclose()
    if error is not None:
        raise error


async def _ready_once_joined(health: Health, consumers: list[Consumer]) -> None:
    """``/readyz`` turns ready once every consumer has joined its group (and back while one
    re-joins after losing the broker)."""
    while True:
        health.worker = "running" if all(c.running for c in consumers) else "starting"
        await anyio.sleep(0.2)
