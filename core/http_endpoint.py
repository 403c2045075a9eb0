"""The operator's HTTP endpoint: ``/healthz``, ``/readyz``, ``/metrics`` (off unless configured).

* ``GET /healthz``: 200 while the process is live, else 503 with a JSON body saying which
  lane stalled; ``GET /readyz``: 200 when ready, else 503, the JSON body saying which check
  failed. What live and ready mean: :mod:`room_outbox.health`.
* ``GET /metrics``: Prometheus text format.

A small HTTP/1.1 server on anyio and h11 (already a dependency): one request per connection,
bounded reads and a read timeout, so a slow or hostile client costs one task and nothing else.
It only ever binds the address it is given; bind it to loopback or a management network.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable

import anyio
import h11
from anyio.abc import SocketAttribute, SocketListener, SocketStream
from anyio.streams.stapled import MultiListener

from room_outbox.health import Health
from room_outbox.metrics import PROMETHEUS_CONTENT_TYPE

log = logging.getLogger("room_outbox.http")

READ_TIMEOUT = 5.0
MAX_REQUEST_BYTES = 16 * 1024

__all__ = ["Health", "HttpEndpoint", "parse_listen"]


def parse_listen(address: str) -> tuple[str, int]:
    """``host:port``, ``:port`` (all interfaces) or ``[v6]:port``; raises ``ValueError``."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not host:port (e.g. 127.0.0.1:9464)")
    return host.strip("[]") or "0.0.0.0", int(port)


class HttpEndpoint:
    def __init__(self, health: Health, metrics: Callable[[], str]) -> None:
        self.health = health
        self.metrics = metrics
        #: The bound port, once :meth:`bind` has run (useful with port 0).
        self.port = 0
        self._listener: MultiListener[SocketStream] | SocketListener | None = None

    async def bind(self, host: str, port: int) -> int:
        """Bind now, so a taken port fails start-up at once; returns the bound port."""
        self._listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        self.port = int(self._listener.extra(SocketAttribute.local_port))
        return self.port

    async def serve(self) -> None:
        """Answer requests until cancelled, then close the listener."""
        assert self._listener is not None, "bind() first"
        async with self._listener:
            await self._listener.serve(self._connection)

    async def _connection(self, stream: SocketStream) -> None:
        async with stream:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
            request: h11.Request | None = None
            try:
                with anyio.fail_after(READ_TIMEOUT):
                    request = await self._read_request(stream, conn)
                if request is None:
                    return
                status, content_type, body = await self._route(request)
            except (TimeoutError, h11.RemoteProtocolError, anyio.EndOfStream, OSError, anyio.BrokenResourceError):
                return  # a client that speaks no HTTP or goes away gets nothing
            except Exception:
                log.exception("http endpoint: handler failed")
                status, content_type, body = 500, "text/plain; charset=utf-8", b"internal error\n"
            headers = [
                ("Content-Type", content_type),
                ("Content-Length", str(len(body))),
                ("Connection", "close"),
                ("Cache-Control", "no-store"),
            ]
            data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
            if request is not None and request.method != b"HEAD":
                data += conn.send(h11.Data(data=body)) or b""
            data += conn.send(h11.EndOfMessage()) or b""
            with contextlib.suppress(anyio.BrokenResourceError, OSError):  # the client left: nothing to do
                await stream.send(data)

    @staticmethod
    async def _read_request(stream: SocketStream, conn: h11.Connection) -> h11.Request | None:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(await stream.receive(4096))
                except anyio.EndOfStream:
                    conn.receive_data(b"")
                continue
            if isinstance(event, h11.Request):
                return event
            if isinstance(event, h11.ConnectionClosed):
                return None

    async def _route(self, request: h11.Request) -> tuple[int, str, bytes]:
        path = request.target.split(b"?", 1)[0]
        if request.method not in (b"GET", b"HEAD"):
            return 405, "text/plain; charset=utf-8", b"method not allowed\n"
        if path == b"/healthz":
            live, checks = self.health.liveness()
            if live:
                return 200, "text/plain; charset=utf-8", b"ok\n"
            return 503, "application/json", json.dumps({"live": False, **checks}).encode() + b"\n"
        if path == b"/readyz":
            ready, checks = await self.health.readiness()
            body = json.dumps({"ready": ready, **checks}).encode() + b"\n"
            return (200 if ready else 503), "application/json", body
        if path == b"/metrics":
            text = await anyio.to_thread.run_sync(self.metrics)  # collection takes locks: off the loop
            return 200, PROMETHEUS_CONTENT_TYPE, text.encode()
        return 404, "text/plain; charset=utf-8", b"not found: try /healthz, /readyz or /metrics\n"
