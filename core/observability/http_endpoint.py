"""The operator's HTTP endpoint: ``/healthz``, ``/readyz``, ``/metrics`` (off unless configured).

``/healthz`` and ``/readyz`` answer 200, or 503 with a JSON body naming the check that failed
(:mod:`room_outbox.observability.health`); ``/metrics`` is Prometheus text format 0.0.4
(:mod:`room_outbox.observability.metrics`). Served by ``aiohttp.web``: its parser bounds
header sizes and every connection is its own task, so a slow or hostile client costs that task
and nothing else. It has no authentication: bind it to loopback or a management network.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
from aiohttp import web
from opentelemetry.metrics import Meter, NoOpMeterProvider

from room_outbox.observability.health import Health
from room_outbox.observability.metrics import PROMETHEUS_CONTENT_TYPE

log = logging.getLogger("room_outbox.http")

#: A connection that sends no complete request within this long is closed (idle keep-alive too).
READ_TIMEOUT = 5.0
#: How long stopping waits for requests in progress (a scrape or a probe takes milliseconds).
SHUTDOWN_TIMEOUT = 2.0

__all__ = ["Health", "HttpEndpoint"]


class HttpEndpoint:
    def __init__(self, health: Health, metrics: Callable[[], str], meter: Meter | None = None) -> None:
        self.health = health
        self.metrics = metrics
        meter = meter or NoOpMeterProvider().get_meter("room_outbox")
        self._malformed = meter.create_counter(
            "room_outbox.http.malformed_requests",
            unit="{request}",
            description="Requests to the HTTP endpoint that could not be parsed.",
        )
        self._malformed.add(0)
        #: Malformed requests since start (what the counter counts, for embedders and tests).
        self.malformed_requests = 0
        #: The bound port, once :meth:`bind` has run (useful with port 0).
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def bind(self, host: str, port: int) -> int:
        """Bind now, so a taken port fails start-up at once; returns the bound port."""
        app = web.Application(middlewares=[_plain_errors])
        app.router.add_get("/healthz", self._healthz)  # GET routes answer HEAD too, without a body
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        # No access log: a scrape every few seconds would drown the service's own lines.
        runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=READ_TIMEOUT,
            shutdown_timeout=SHUTDOWN_TIMEOUT,
            logger=cast(logging.Logger, _CountingServerLog(self._count_malformed)),
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        return self.port

    async def serve(self) -> None:
        """Answer requests until cancelled, then close the listener."""
        assert self._runner is not None, "bind() first"
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await self._runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        live, checks = self.health.liveness()
        if live:
            return web.Response(text="ok\n")
        body = json.dumps({"live": False, **checks}) + "\n"
        return web.Response(status=503, text=body, content_type="application/json")

    def _count_malformed(self) -> None:
        self.malformed_requests += 1
        self._malformed.add(1)

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, checks = self.health.readiness()
        body = json.dumps({"ready": ready, **checks}) + "\n"
        return web.Response(status=200 if ready else 503, text=body, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        text = await anyio.to_thread.run_sync(self.metrics)  # collection takes locks: off the loop
        return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


class _CountingServerLog:
    """Stands in for aiohttp's server logger. Everything the server logs itself is about a
    request it could not parse or answer (a failing handler is caught by :func:`_plain_errors`
    first): each is counted once (``room_outbox.http.malformed_requests``), and nothing is
    logged, since the parser's traceback would echo the client's bytes (a port scan, TLS on a
    plain port) into the log, one ERROR per request."""

    def __init__(self, count: Callable[[], None]) -> None:
        self._count = count

    def exception(self, *args: Any, **kwargs: Any) -> None:
        self._count()

    def debug(self, message: object = "", *args: Any, **kwargs: Any) -> None:
        if str(message).startswith("Error handling request"):  # a non-HTTP first request
            self._count()

    def error(self, *args: Any, **kwargs: Any) -> None:
        self._count()

    def warning(self, *args: Any, **kwargs: Any) -> None:
        return None

    info = warning


@web.middleware
async def _plain_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Plain-text errors that say where to go, a logged 500 for a failing handler, and no
    caching anywhere (probes and scrapes must see the present)."""
    try:
        response = await handler(request)
    except web.HTTPNotFound:
        response = web.Response(status=404, text="not found: try /healthz, /readyz or /metrics\n")
    except web.HTTPMethodNotAllowed:
        response = web.Response(status=405, text="method not allowed\n")
    except web.HTTPException:
        raise
    except Exception:
        log.exception("http endpoint: handler failed")
        response = web.Response(status=500, text="internal error\n")
    response.headers["Cache-Control"] = "no-store"
    return response
