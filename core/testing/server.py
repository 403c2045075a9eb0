"""HTTP/1.1 for the fake Tencent IM: anyio TCP listener + h11, keep-alive, no TLS.

Small on purpose: one request at a time per connection (as HTTP/1.1 clients send them),
``Content-Length`` or chunked bodies (h11 handles both), a 1 MiB body cap. A hanging reply
holds the connection open until the client gives up and disconnects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anyio
import h11
from anyio.abc import SocketAttribute, SocketStream

from room_outbox.testing.fake_im import FakeTencentIM, Reply

MAX_BODY = 1 << 20
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 413: b"Payload Too Large"}


@asynccontextmanager
async def serve_fake_im(
    fake: FakeTencentIM | None = None, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[FakeTencentIM]:
    """Serve ``fake`` (default: a fresh one with the dev key) until the block exits.

    ``port=0`` picks a free port; ``fake.base_url`` says which.
    """
    fake = fake or FakeTencentIM()
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    async with listener, anyio.create_task_group() as tg:
        fake.base_url = f"http://{host}:{listener.extra(SocketAttribute.local_port)}"
        tg.start_soon(listener.serve, partial(_serve_connection, fake=fake))
        try:
            yield fake
        finally:
            tg.cancel_scope.cancel()


async def _serve_connection(stream: SocketStream, fake: FakeTencentIM) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    async with stream:
        try:
            while True:
                request = await _read_request(conn, stream)
                if request is None:
                    return
                method, target, body = request
                if body is None:
                    reply = Reply(413, b'{"error":"body too large"}')
                else:
                    reply = await fake.handle(method, target, body)
                if reply.hang:
                    await _wait_until_closed(stream)
                    return
                await _send(conn, stream, reply)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            return
        except h11.ProtocolError:
            return  # a client speaking something else: drop the connection


async def _read_request(conn: h11.Connection, stream: SocketStream) -> tuple[str, str, bytes | None] | None:
    """(method, target, body) of the next request, body ``None`` when above MAX_BODY;
    ``None`` when the client closed the connection."""
    method = target = ""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive(65536))
            except anyio.EndOfStream:
                conn.receive_data(b"")
        elif isinstance(event, h11.Request):
            method, target = event.method.decode("ascii"), event.target.decode("ascii")
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size <= MAX_BODY:  # beyond it, read on (to keep the connection usable) but drop
                chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return method, target, b"".join(chunks) if size <= MAX_BODY else None
        elif isinstance(event, h11.ConnectionClosed):
            return None
        else:  # pragma: no cover - h11 yields nothing else on the server side
            return None


async def _send(conn: h11.Connection, stream: SocketStream, reply: Reply) -> None:
    headers = [("Content-Type", reply.content_type), ("Content-Length", str(len(reply.body)))]
    parts = [
        conn.send(h11.Response(status_code=reply.status, headers=headers, reason=_REASONS.get(reply.status, b""))),
        conn.send(h11.Data(data=reply.body)),
        conn.send(h11.EndOfMessage()),
    ]
    await stream.send(b"".join(part for part in parts if part))


async def _wait_until_closed(stream: SocketStream) -> None:
    try:
        while True:
            await stream.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
        return
