"""HTTP/1.1 for the fake Tencent IM on ``aiohttp.web``: keep-alive, TLS when given a context.

Every request, whatever its method and path, goes to :meth:`FakeTencentIM.handle`; bodies
(``Content-Length`` or chunked) are capped at 1 MiB and answered 413 beyond. A hanging reply
holds the connection open until the client gives up and disconnects.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from aiohttp import web

from room_outbox.plugins.tencent_im.fake.im import FakeTencentIM, Reply

MAX_BODY = 1 << 20
#: How long stopping waits for requests in progress; hanging ones are cut off after it.
SHUTDOWN_TIMEOUT = 0.5


@asynccontextmanager
async def serve_fake_im(
    fake: FakeTencentIM | None = None, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None
) -> AsyncIterator[FakeTencentIM]:
    """Serve ``fake`` (default: a fresh one with the dev key) until the block exits, over
    HTTPS when ``tls`` (a server context) is given.

    ``port=0`` picks a free port; ``fake.base_url`` says which.
    """
    fake = fake or FakeTencentIM()
    served = fake

    async def handle(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            reply = Reply(413, b'{"error":"body too large"}')
        else:
            reply = await served.handle(request.method, request.raw_path, body)
        if reply.hang:
            # handler_cancellation (below) cancels this when the client disconnects.
            await anyio.sleep_forever()
        return web.Response(status=reply.status, body=reply.body, headers={"Content-Type": reply.content_type})

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_route("*", "/{path:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
        fake.base_url = f"{'https' if tls else 'http'}://{host}:{runner.addresses[0][1]}"
        yield fake
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
