"""A TCP proxy on loopback that can cut the line: the database becomes unreachable for the
processes behind it (connections reset, new ones refused) and reachable again on demand."""

from __future__ import annotations

import contextlib

import anyio
from anyio.abc import SocketStream, TaskGroup


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self._streams: set[SocketStream] = set()
        self._serving: anyio.CancelScope | None = None
        self._tg: TaskGroup | None = None

    async def start(self, tg: TaskGroup) -> None:
        self._tg = tg
        await self._listen()

    async def _listen(self) -> None:
        assert self._tg is not None
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        scope = anyio.CancelScope()
        self._serving = scope

        async def serve() -> None:
            with scope:
                async with listener:
                    await listener.serve(self._pipe)

        self._tg.start_soon(serve)

    async def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        if self._serving is not None:
            self._serving.cancel()
        for stream in list(self._streams):
            with contextlib.suppress(Exception):
                await stream.aclose()
        self._streams.clear()
        await anyio.sleep(0)

    async def restore(self) -> None:
        await self._listen()

    async def _pipe(self, client: SocketStream) -> None:
        try:
            upstream = await anyio.connect_tcp(*self.upstream)
        except OSError:
            await client.aclose()
            return
        self._streams |= {client, upstream}

        async def copy(source: SocketStream, sink: SocketStream) -> None:
            with contextlib.suppress(Exception):
                async for chunk in source:
                    await sink.send(chunk)
            with contextlib.suppress(Exception):
                await sink.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(copy, client, upstream)
            tg.start_soon(copy, upstream, client)
        self._streams -= {client, upstream}
