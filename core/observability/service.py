"""The observability side of the lifecycle: telemetry, the backlog timer, the HTTP endpoint,
systemd's notifications, the check that the outbox table keeps its indexes.

:func:`observability` is entered right after the database pool opens and left after the
worker has stopped (before the pool closes): the endpoint answers ``/healthz`` and
``/metrics`` for the whole life of the worker, and ``/readyz`` turns ready only once the
lifecycle marks the worker running. On the way out it flushes the span and metric exporters.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio

from room_outbox.config import MAIN_LANE, ConfigError, LanePlan, Settings, parse_listen
from room_outbox.observability.health import Health, check_error, stalled_after
from room_outbox.observability.http_endpoint import HttpEndpoint
from room_outbox.observability.metrics import BacklogSamples, export_schema_problems
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.repeated import RepeatedFailure
from room_outbox.observability.systemd import notify_systemd
from room_outbox.observability.telemetry import Telemetry, telemetry_from_environment
from room_outbox.store.lanes.catalog import own_lane_backlog, stored_lanes
from room_outbox.store.operator.reports import ping, sample_backlog
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.check import check_indexes

log = logging.getLogger("room_outbox.observability")


@dataclass
class Observability:
    telemetry: Telemetry
    health: Health
    endpoint: HttpEndpoint | None = None
    #: The lanes whose backlog the timer samples, known once the sinks are loaded (:meth:`watch`).
    lanes: LanePlan | None = None
    _lanes_known: anyio.Event = field(default_factory=anyio.Event)

    def watch(self, plan: LanePlan) -> None:
        """Sample the backlog of ``plan``'s lanes from now on."""
        self.lanes = plan
        self._lanes_known.set()


@asynccontextmanager
async def observability(settings: Settings, store: SQLStore, redactor: Redactor) -> AsyncIterator[Observability]:
    options = settings.telemetry
    listen = None
    if options.http_listen.strip():
        try:
            listen = parse_listen(options.http_listen)
        except ValueError as exc:  # the settings model checks this too; kept for embedders
            raise ConfigError(f"telemetry.http_listen: {exc}") from None
    telemetry = telemetry_from_environment(settings.node_id, redactor, prometheus=listen is not None)

    # One limit for every lane: the slowest lane's (outbox_worker.lanes may lengthen one lane's
    # poll interval or publish timeout).
    workers = [
        settings.outbox_worker,
        *(settings.outbox_worker.for_lane(lane) for lane in settings.outbox_worker.lanes),
    ]
    health = Health(
        functools.partial(ping, store),
        check_schema=functools.partial(check_indexes, store),
        redactor=redactor,
        stalled_after=max(
            stalled_after(
                options.stalled_after_polls,
                worker.poll_interval,
                settings.database.query_timeout,
                worker.publish_timeout,
            )
            for worker in workers
        ),
        unready_after_failed_rounds=options.unready_after_failed_rounds,
    )
    export_schema_problems(telemetry.meter, lambda: health.schema_failing)
    obs = Observability(telemetry, health)
    error: BaseException | None = None
    try:
        if listen is not None:
            obs.endpoint = HttpEndpoint(obs.health, telemetry.prometheus_text, telemetry.meter)
            try:
                port = await obs.endpoint.bind(*listen)
            except OSError as exc:
                raise ConfigError(f"telemetry.http_listen: cannot listen on {options.http_listen}: {exc}") from None
            log.info(
                "http endpoint listening",
                extra={"lifecycle": "http_started", "address": f"{listen[0]}:{port}", "port": port},
            )
        async with anyio.create_task_group() as background:
            background.start_soon(notify_systemd, obs.health)
            background.start_soon(obs.health.watch_schema)  # with or without the endpoint: it logs too
            if obs.endpoint is not None:
                background.start_soon(obs.endpoint.serve)
                background.start_soon(obs.health.watch_database)
            if telemetry.metrics_enabled:
                background.start_soon(_sample_backlog, store, obs, options.backlog_interval, redactor)
            try:
                yield obs
            except BaseException as exc:
                # Kept aside and re-raised below, so the caller sees its own exception and not
                # an ExceptionGroup of this task group.
                error = exc
            background.cancel_scope.cancel()
        if obs.endpoint is not None:
            log.info("http endpoint stopped", extra={"lifecycle": "http_stopped"})
    finally:
        with anyio.CancelScope(shield=True):
            await telemetry.aclose()
    if error is not None:
        raise error


async def _sample_backlog(store: SQLStore, obs: Observability, interval: float, redactor: Redactor) -> None:
    """Each running lane's backlog, every ``interval`` (index range counts, see
    :mod:`room_outbox.store.lanes.catalog`)."""
    await obs._lanes_known.wait()
    # A failure lasts as long as what causes it (the database down): the first sample that
    # fails is logged in full, then a line a minute, then the first that succeeds again.
    failing = RepeatedFailure(log, "backlog sample failed", "backlog samples succeed again", level=logging.WARNING)
    samples = BacklogSamples(obs.telemetry.meter)
    while True:
        if obs.lanes is not None:
            try:
                await _sample_lanes(store, obs.telemetry, obs.lanes)
            except Exception as exc:
                samples.failed()
                failing.failed(check_error(redactor, exc))
            else:
                samples.succeeded()
                failing.succeeded()
        await anyio.sleep(interval)


async def _sample_lanes(store: SQLStore, telemetry: Telemetry, plan: LanePlan) -> None:
    if plan.main:  # while it is off, room_outbox.status is room-service's: no backlog here
        backlog = await sample_backlog(store)
        telemetry.backlog(backlog.pending, backlog.oldest_pending_age_ms, MAIN_LANE)
    if plan.own:
        stored = {lane.name: lane for lane in await stored_lanes(store)}
        for name in plan.own:
            lane = stored.get(name)
            if lane is not None:
                owed = await own_lane_backlog(store, lane)
                telemetry.backlog(owed.backlog, owed.oldest_age_ms(), name, owed.skipped)
