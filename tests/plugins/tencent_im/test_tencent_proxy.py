"""``sinks.tencent_im.proxy`` and ``ca_file``: every request to Tencent IM through an HTTP proxy on loopback (a
real forward proxy, in front of the fake Tencent IM: plain HTTP requests forwarded, HTTPS ones
tunnelled with CONNECT), its credentials sent to the proxy alone and never shown; proxies in the
environment are not used."""

from __future__ import annotations

import base64
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anyio
import pytest
from aiohttp import web
from anyio.abc import ByteReceiveStream, ByteSendStream, SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from im_support import make_sink
from pydantic import ValidationError
from support import envelope, free_port, loopback_certificate, make_ca

from room_outbox import EventEnvelope, RetryableSinkError
from room_outbox.config import describe_validation_error
from room_outbox.plugins.tencent_im import TencentIMSettings
from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID, FakeTencentIM, serve_fake_im

pytestmark = pytest.mark.anyio

PASSWORD = "pr0xy-s3cret"
AUTHORIZATION = "Basic " + base64.b64encode(f"relay:{PASSWORD}".encode()).decode()


@asynccontextmanager
async def forward_proxy() -> AsyncIterator[tuple[str, list[tuple[str, str | None]]]]:
    """An HTTP forward proxy: each request (its absolute URL and Proxy-Authorization) recorded,
    then sent on to where it names and answered with what came back."""
    seen: list[tuple[str, str | None]] = []

    async def forward(request: web.Request) -> web.Response:
        seen.append((str(request.url), request.headers.get("Proxy-Authorization")))
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method, request.url, data=await request.read(), headers={"Content-Type": "application/json"}
            ) as answer,
        ):
            return web.Response(status=answer.status, body=await answer.read(), content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://relay:{PASSWORD}@127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


@asynccontextmanager
async def tunnelling_proxy() -> AsyncIterator[tuple[str, list[tuple[str, str | None]]]]:
    """An HTTP proxy that tunnels (CONNECT), as one in front of Tencent's HTTPS endpoint does:
    each tunnel's request line and Proxy-Authorization recorded."""
    seen: list[tuple[str, str | None]] = []

    async def pipe(source: ByteReceiveStream, to: ByteSendStream, tunnel: anyio.CancelScope) -> None:
        try:
            async for chunk in source:
                await to.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        tunnel.cancel()  # one side is done: so is the tunnel

    async def serve(client: SocketStream) -> None:
        async with client:
            buffered = BufferedByteReceiveStream(client)
            request, *lines = (await buffered.receive_until(b"\r\n\r\n", 65_536)).decode().split("\r\n")
            headers = dict(line.split(": ", 1) for line in lines if line)
            seen.append((request, headers.get("Proxy-Authorization")))
            host, port = request.split(" ")[1].rsplit(":", 1)
            async with await anyio.connect_tcp(host, int(port)) as upstream:
                await client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
                async with anyio.create_task_group() as tunnel:
                    tunnel.start_soon(pipe, buffered, upstream, tunnel.cancel_scope)
                    tunnel.start_soon(pipe, upstream, client, tunnel.cancel_scope)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as proxies:
        proxies.start_soon(listener.serve, serve)
        yield f"http://relay:{PASSWORD}@127.0.0.1:{listener.extra(SocketAttribute.local_port)}", seen
        proxies.cancel_scope.cancel()


@pytest.fixture
def test_ca(tmp_path: Path) -> tuple[Path, ssl.SSLContext]:
    """A test CA's certificate, and a server context whose certificate it signed for loopback."""
    ca, ca_key = make_ca(tmp_path, "test-ca")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(*loopback_certificate(tmp_path, ca, ca_key))
    return ca, tls


@pytest.fixture
async def fake() -> AsyncIterator[FakeTencentIM]:
    async with serve_fake_im(FakeTencentIM(seed=5)) as fake:
        yield fake


async def test_every_request_goes_through_the_proxy_with_its_credentials(
    fake: FakeTencentIM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens: used, it would fail
    async with forward_proxy() as (proxy, seen):
        secrets: list[str] = []
        sink = make_sink(fake, secrets, proxy=proxy)
        try:
            await sink.deliver(EventEnvelope.model_validate(envelope("through-proxy")))
        finally:
            await sink.aclose()
    assert fake.event_ids() == ["through-proxy"]
    assert len(seen) == 1 and seen[0][0].startswith(f"{fake.base_url}/v4/group_open_http_svc/send_group_msg?")
    assert seen[0][1] == AUTHORIZATION
    assert PASSWORD in secrets  # masked wherever the process writes


async def test_https_requests_tunnel_through_the_proxy_with_its_credentials(
    test_ca: tuple[Path, ssl.SSLContext],
) -> None:
    ca, tls = test_ca
    async with serve_fake_im(FakeTencentIM(seed=5), tls=tls) as fake, tunnelling_proxy() as (proxy, seen):
        sink = make_sink(fake, proxy=proxy, ca_file=str(ca))  # Tencent's certificate chains to a public CA
        try:
            await sink.deliver(EventEnvelope.model_validate(envelope("through-tunnel")))
        finally:
            await sink.aclose()
    assert fake.base_url.startswith("https://")
    assert fake.event_ids() == ["through-tunnel"]
    assert seen == [(f"CONNECT {fake.base_url.removeprefix('https://')} HTTP/1.1", AUTHORIZATION)]


async def test_a_proxy_that_does_not_answer_fails_the_delivery_retryably_without_its_password(
    fake: FakeTencentIM,
) -> None:
    sink = make_sink(fake, proxy=f"http://relay:{PASSWORD}@127.0.0.1:{free_port()}")
    try:
        with pytest.raises(RetryableSinkError) as failure:
            await sink.deliver(EventEnvelope.model_validate(envelope("no-proxy")))
    finally:
        await sink.aclose()
    assert PASSWORD not in str(failure.value)
    assert fake.event_ids() == []


async def test_a_certificate_no_trusted_ca_signed_is_refused_without_ca_file(
    test_ca: tuple[Path, ssl.SSLContext], tmp_path: Path
) -> None:
    """The test CA is trusted only through ``ca_file``: without it the same endpoint is refused."""
    _ca, tls = test_ca
    async with serve_fake_im(FakeTencentIM(seed=5), tls=tls) as fake:
        sink = make_sink(fake)
        try:
            with pytest.raises(RetryableSinkError, match="certificate"):
                await sink.deliver(EventEnvelope.model_validate(envelope("untrusted")))
        finally:
            await sink.aclose()
    assert fake.event_ids() == []
    with pytest.raises(ValidationError, match=r"ca_file\n.*: not a usable CA bundle"):
        TencentIMSettings(sdkappid=DEV_SDKAPPID, secret_key=DEV_KEY, ca_file=str(tmp_path / "missing.pem"))


@pytest.mark.parametrize("proxy", [f"socks5://relay:{PASSWORD}@proxy:1080", f"relay:{PASSWORD}@proxy:3128"])
def test_a_proxy_that_is_not_an_http_url_is_refused_without_its_text(proxy: str) -> None:
    with pytest.raises(ValidationError) as refused:
        TencentIMSettings(sdkappid=DEV_SDKAPPID, secret_key=DEV_KEY, proxy=proxy)
    assert describe_validation_error(refused.value, "sinks.tencent_im").splitlines()[1:] == [
        "  sinks.tencent_im.proxy: is not an http:// proxy URL, e.g. http://proxy.internal:3128"
    ]
