"""Process lifecycle.

Start: configuration (already loaded) checked whole, sinks included → database pool (waited
for up to ``database.connect_wait``) → schema checked → plugins and sinks → telemetry and the
HTTP endpoint → worker. Stop (SIGTERM, SIGINT or the ``stop`` event): stop claiming new
batches → in-flight deliveries finish within ``publish_timeout`` and their results are
written → worker exits → telemetry flushes (bounded: exporters still sending after
``EXPORT_AT_STOP`` are abandoned), the endpoint stops → sinks close (bounded: one that does not
close in time is abandoned) → pool closes.
The pool closes last because the worker needs it to write results. A killed process leaves its rows pending (leased until the lease expires).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

import anyio
import pluggy

from room_outbox.cluster.identity import process_identity
from room_outbox.cluster.membership import Membership
from room_outbox.cluster.quota import QuotaShare
from room_outbox.config import MAIN_LANE, Settings
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.lanes import claim_after_ms, delivery_settings, lane_plan, lane_store, lease_ms, tail_store
from room_outbox.delivery.routing import Lanes, build_lanes
from room_outbox.delivery.tail import TailRelay
from room_outbox.observability.health import Health
from room_outbox.observability.redaction import Redactor, redactor_for
from room_outbox.observability.service import observability
from room_outbox.observability.telemetry import Telemetry
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.signals import stopped_by_signals
from room_outbox.startup import CheckedConfiguration, check_configuration, open_checked_store
from room_outbox.store.clock import CLOCK
from room_outbox.store.lanes.store import lane_table
from room_outbox.store.operator.retention import run_retention_job
from room_outbox.store.protocol import SQLStore

log = logging.getLogger("room_outbox.app")


async def run_service(
    settings: Settings,
    stop: anyio.Event | None = None,
    handle_signals: bool = True,
    plugins: Iterable[object] = (),
    redactor: Redactor | None = None,
) -> None:
    """Run until a signal (when ``handle_signals``, in the main thread) or ``stop`` is set, then
    shut down in order.
    ``plugins`` are registered besides the installed ones (for embedding and tests).
    ``redactor``: the one the process's log handler uses (sinks register their secrets with
    it); default: a new one from :func:`~room_outbox.observability.redaction.redactor_for`."""
    stop = stop or anyio.Event()
    CLOCK.max_skew = settings.cluster.max_clock_skew
    redactor = redactor or redactor_for(settings)
    pm = make_plugin_manager(settings.plugins.disabled, plugins)
    checked = check_configuration(settings, pm)  # all of it, before anything connects
    for line in checked.warnings:
        log.warning(line, extra={"lifecycle": "config_warning"})
    # Signals are handled from here on, never left to their default action (which would kill
    # the process holding its buckets and, once it delivers, its leases): one that comes while
    # the process starts ends its waits (for the database, to join the membership), no worker
    # starts, and what it opened is closed in order, as after a run.
    await stopped_by_signals(
        stop, handle_signals, lambda database_wait: _serve(settings, stop, pm, checked, redactor, database_wait)
    )


async def _serve(
    settings: Settings,
    stop: anyio.Event,
    pm: pluggy.PluginManager,
    checked: CheckedConfiguration,
    redactor: Redactor,
    database_wait: anyio.CancelScope,
) -> None:
    """Start every part, run until ``stop``, then shut them down in order. ``stop`` set while
    they start: no worker starts; ``database_wait`` cancelled: the wait for the database ends."""
    # Parts are pushed in the reverse of their shutdown order, and the stack runs them
    # whatever ends the run: once the workers have stopped, telemetry flushes and the HTTP
    # endpoint stops (it answers for the whole life of the workers), then the sinks close,
    # then the pool (last: the workers need it to write results).
    async with contextlib.AsyncExitStack() as lifecycle:
        with database_wait:  # the one wait that may be long (database.connect_wait)
            store = await open_checked_store(
                settings, checked.lane_tables, checked.tail_lanes, bool(checked.main_sinks)
            )
        if database_wait.cancelled_caught:
            log.info("stopped while waiting for the database", extra={"lifecycle": "stop_requested"})
            return
        lifecycle.push_async_callback(_close, store.aclose, "database pool closed", "pool_closed")
        log.info("database pool opened", extra={"lifecycle": "pool_opened", "database": store.address.database})
        quota = QuotaShare()
        lanes = await build_lanes(pm, settings, redactor, quota=quota)
        lifecycle.push_async_callback(_close, lanes.aclose, "sinks closed", "sinks_closed")
        obs = await lifecycle.enter_async_context(observability(settings, store, redactor))
        plan = lane_plan(pm, settings)
        obs.telemetry.metrics.start_at_zero(lanes.series(), [*([MAIN_LANE] if plan.main else []), *plan.own])
        obs.telemetry.untimed_sinks = lanes.untimed
        obs.watch(plan)
        log.info(
            "sinks loaded",
            extra={
                "lifecycle": "sinks_loaded",
                "sinks": sorted(lanes.main.sinks),
                "routes": dict(sorted(lanes.main.routes.items())),
                "own_lanes": sorted(lanes.own),
            },
        )
        unrouted = lanes.main.unrouted() if lanes.main.sinks else []
        if unrouted:  # the Tencent IM sink disabled, the noop sink left on: most rows parked
            table = store.profile.table
            log.warning(
                f"no enabled sink takes these event types: their rows will be parked in {table} (status"
                f" {store.profile.parked}, no sink for event_type); enable a sink for them or, where {table}.status"
                " is not this process's to write (Kafka only), disable the main lane's sinks too"
                " (sinks.noop.enabled: false)",
                extra={"lifecycle": "unrouted_event_types", "event_types": unrouted, "sinks": sorted(lanes.main.sinks)},
            )
        # Unique per start, even where two processes share a node_id (see cluster.identity).
        identity = process_identity(settings.node_id)
        if settings.outbox_worker.enabled:  # leaves once the dispatchers have stopped
            claimed_lanes = [*([MAIN_LANE] if lanes.main.sinks else []), *checked.lane_tables]
            orderings = {lane: delivery_settings(settings, lane).ordering for lane in claimed_lanes}
            main = lanes.main  # "*": the sink taking every event type it does not name
            routes = {**main.routes, **({"*": main.catch_all} if main.catch_all else {})} if main.sinks else None
            await _join_cluster(
                lifecycle, settings, identity, store, checked.lane_tables, quota, stop, orderings, routes
            )
        if stop.is_set():  # signalled while starting: no worker starts, and what opened closes
            log.info("stopping before the workers started", extra={"lifecycle": "stop_requested"})
            return
        dispatchers = _dispatchers(
            settings, identity, store, lanes, set(checked.tail_lanes), redactor, obs.telemetry, obs.health
        )
        async with anyio.create_task_group() as workers:
            if settings.outbox_worker.enabled:
                for dispatcher in dispatchers:
                    await workers.start(dispatcher.run)
                obs.health.worker = "running"
            else:
                obs.health.worker = "disabled"
                log.info("outbox worker disabled by outbox_worker.enabled", extra={"lifecycle": "worker_disabled"})
            if settings.retention.enabled:  # stops by itself once `stop` is set, between two batches
                await workers.start(run_retention_job, store, settings.retention, stop, plan)
            await stop.wait()
            log.info("stopping: no new batches", extra={"lifecycle": "stop_requested"})
            obs.health.worker = "stopping"
            for dispatcher in dispatchers:
                dispatcher.stop()


async def _close(aclose: Callable[[], Awaitable[None]], message: str, lifecycle: str) -> None:
    await aclose()
    log.info(message, extra={"lifecycle": lifecycle})


def _dispatchers(
    settings: Settings,
    identity: str,
    store: SQLStore,
    lanes: Lanes,
    tail_lanes: set[str],
    redactor: Redactor,
    telemetry: Telemetry,
    health: Health,
) -> list[Dispatcher | TailRelay]:
    """One dispatcher per lane: the main lane's (when any of its sinks is enabled), then one per
    sink with a lane of its own (a tailing relay for those in ``tail_lanes``), each with its own
    scan loop so none waits for another."""
    dispatchers: list[Dispatcher | TailRelay] = []
    if lanes.main.sinks:
        options = _options(settings, MAIN_LANE)
        store.claim_after_ms = claim_after_ms(settings)
        store.lease_ms = lease_ms(settings)
        dispatchers.append(
            Dispatcher(store, lanes.main, options, identity, redactor, telemetry, health=health.lane(MAIN_LANE))
        )
    for name, router in lanes.own.items():
        if name in tail_lanes:
            worker = delivery_settings(settings, name)
            relay = TailRelay(
                tail_store(store, name, settings),
                router,
                poll_interval=worker.poll_interval,
                publish_timeout=worker.publish_timeout,
                redactor=redactor,
                health=health.lane(name),
                telemetry=telemetry,
            )
            dispatchers.append(relay)
            continue
        start = settings.sinks.get(name, {}).get("start", "now")
        lane = lane_store(store, name, settings, start)
        dispatchers.append(
            Dispatcher(
                lane,
                router,
                _options(settings, name),
                identity,
                redactor,
                telemetry,
                lane=name,
                health=health.lane(name),
            )
        )
    return dispatchers


def _options(settings: Settings, lane: str) -> LaneOptions:
    """The lane's delivery options: ``outbox_worker.lanes.<lane>`` over ``outbox_worker``."""
    return LaneOptions.from_settings(delivery_settings(settings, lane), settings.database.query_timeout)


async def _join_cluster(
    stack: contextlib.AsyncExitStack,
    settings: Settings,
    identity: str,
    store: SQLStore,
    lane_tables: list[str],
    quota: QuotaShare,
    stop: anyio.Event,
    orderings: dict[str, str],
    routes: dict[str, str] | None = None,
) -> None:
    """On a database server (MySQL/MariaDB, PostgreSQL): heartbeats in the membership, room
    buckets for per-room claims, and this process's quota share, until ``stack`` closes. SQLite
    is one box: every process there claims every room and uses whole limits. ``orderings``:
    each lane this process claims rows of, with its ordering (the others are told); ``routes``:
    the main lane's event types with their sinks, where this process claims it (likewise)."""
    if not store.dialect.room_buckets:
        return
    # Before the first heartbeat: it decides how long a bucket that changes hands waits.
    quota.rooms_owned = delivery_settings(settings, MAIN_LANE).ordering == "per_room"
    membership = Membership(
        store,
        identity,
        [store.profile.table, *(lane_table(name) for name in lane_tables)],
        settings.cluster.heartbeat_interval,
        settings.cluster.node_timeout,
        quota,
        orderings,
        routes,
    )
    await stack.enter_async_context(membership.running())
    store.room_buckets = membership.room_buckets
    # Start delivering once the others have made room in the quota (a heartbeat and a rate-limit
    # window), unless stopped meanwhile.
    if not await membership.wait_joined(settings.cluster.node_timeout * 2, stop) and not stop.is_set():
        log.warning("membership not settled yet; delivering once it is", extra={"nodes": membership.live})
