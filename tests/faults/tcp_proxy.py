"""A TCP proxy on loopback between the processes under test and the database, with two faults:

* :meth:`TcpProxy.cut` — an outage: open connections are reset, new ones closed at once, until
  :meth:`TcpProxy.restore`.
* :meth:`TcpProxy.partition` — a network partition, half-open: every byte either way is
  swallowed and nothing is closed. The database's sessions stay alive (and keep their locks)
  until the server gives up on them; a client that closes its end is not heard of upstream
  either (its FIN is lost too). New connections are accepted and then hear nothing.
  :meth:`TcpProxy.heal` lets new connections through again; a connection that lived through
  the partition stays dark for good (its lost bytes have desynchronised it).

Nothing leaks: every pipe closes both its sockets when it ends, and leaving the ``async with``
closes every socket the proxy still holds, so no server session outlives the test through it.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, field
from types import TracebackType

import anyio
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup

#: MySQL's COM_QUERY command byte, after the 4-byte packet header.
_COM_QUERY = 3


@dataclass(eq=False)
class Link:
    client: SocketStream
    upstream: SocketStream | None = None
    #: Everything is swallowed: the link lived through (or was born in) a partition.
    dark: bool = False
    #: The server's id of this session (``CONNECTION_ID()``), read from its greeting.
    server_thread_id: int | None = None
    #: The armed trigger's marker was seen in the transaction under way.
    marked: bool = False
    closed: anyio.Event = field(default_factory=anyio.Event)


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.links: set[Link] = set()
        self._mode = "open"  # open, cut, partition
        self._trigger: bytes | None = None
        #: Set when a partition starts; ``triggered_by`` is the link whose COMMIT started it.
        self.partitioned = anyio.Event()
        self.triggered_by: Link | None = None
        self._tg: TaskGroup | None = None
        self._listener: SocketListener | None = None

    async def __aenter__(self) -> TcpProxy:
        self._listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = self._listener.extra(SocketAttribute.local_port)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._listener.serve, self._pipe)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._tg is not None and self._listener is not None
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                await self._close_all()
                await self._listener.aclose()

    # -- faults -----------------------------------------------------------------------------

    async def cut(self) -> None:
        """Reset every open connection; close new ones at once until :meth:`restore`."""
        self._mode = "cut"
        await self._close_all()

    async def restore(self) -> None:
        self._mode = "open"

    def partition(self) -> None:
        """Swallow everything, close nothing (see the module docstring)."""
        self._mode = "partition"
        for link in self.links:
            link.dark = True
        self.partitioned.set()

    def partition_at_commit(self, marker: bytes) -> None:
        """Start a partition the moment a client sends COMMIT in a transaction that sent a
        statement containing ``marker``: that COMMIT is swallowed, so the server session
        stays in its transaction, holding every lock the transaction took."""
        self._trigger = marker

    def heal(self) -> None:
        self._mode = "open"

    # -- plumbing ---------------------------------------------------------------------------

    async def _close_all(self) -> None:
        for link in list(self.links):
            await self._close(link)

    async def _close(self, link: Link) -> None:
        for stream in (link.client, link.upstream):
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()
        self.links.discard(link)
        link.closed.set()

    async def _pipe(self, client: SocketStream) -> None:
        link = Link(client)
        self.links.add(link)
        try:
            if self._mode == "cut":
                return
            if self._mode == "partition":  # born dark: connected, then nothing, until the client leaves
                link.dark = True
                await self._swallow(client)
                return
            try:
                link.upstream = await anyio.connect_tcp(*self.upstream)
            except OSError:
                return
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._client_to_server, link, link.upstream)
                tg.start_soon(self._server_to_client, link, link.upstream)
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(link)

    @staticmethod
    async def _swallow(source: SocketStream) -> None:
        with contextlib.suppress(Exception):
            async for _ in source:
                pass

    async def _client_to_server(self, link: Link, upstream: SocketStream) -> None:
        with contextlib.suppress(Exception):
            async for chunk in link.client:
                if not link.dark and self._trigger is not None and self._triggers(link, chunk):
                    self._trigger = None
                    self.triggered_by = link
                    self.partition()
                if not link.dark:
                    await upstream.send(chunk)
        # The client left. Dark: its FIN is lost, the server's session lives on until the
        # server gives up on it (the other direction keeps reading until then).
        if not link.dark:
            await self._close(link)

    async def _server_to_client(self, link: Link, upstream: SocketStream) -> None:
        with contextlib.suppress(Exception):
            async for chunk in upstream:
                if link.server_thread_id is None:
                    link.server_thread_id = _thread_id_of_greeting(chunk)
                if not link.dark:
                    await link.client.send(chunk)
        # The server ended the session. Dark: the client never hears of it.
        if not link.dark:
            await self._close(link)

    def _triggers(self, link: Link, chunk: bytes) -> bool:
        """Whether ``chunk`` is the COMMIT of a transaction that sent the armed marker."""
        assert self._trigger is not None
        if len(chunk) < 5 or chunk[4] != _COM_QUERY:
            return False
        if self._trigger in chunk:
            link.marked = True
            return False
        return link.marked and chunk[5:].lstrip().upper().startswith(b"COMMIT")


def _thread_id_of_greeting(chunk: bytes) -> int | None:
    """The connection id in the server's greeting: after the 4-byte header, the protocol
    version byte (10) and the NUL-terminated server version."""
    end = chunk.find(b"\0", 5)
    if len(chunk) < 5 or chunk[4] != 10 or end < 0 or len(chunk) < end + 5:
        return None
    return int(struct.unpack("<I", chunk[end + 1 : end + 5])[0])
