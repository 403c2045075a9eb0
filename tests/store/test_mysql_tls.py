"""MySQL/MariaDB over TLS, as managed servers require it: a MariaDB of the test's own (Debian's
server package) started with a certificate from a test CA and ``require_secure_transport``, and
the suite's MariaDB, which offers no TLS."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pymysql
import pytest
from anyio.abc import SocketAttribute, SocketStream
from support import PrivateMariaDB, envelope, insert_events, loopback_certificate, make_ca

from room_outbox.errors import ConfigurationError, StoreUnavailable
from room_outbox.kafka_security import KafkaSecurity
from room_outbox.plugins.tencent_im.settings import TencentIMSettings
from room_outbox.plugins.tencent_im.sink import http_client
from room_outbox.store.backends.mysql import MySQLAddress, offers_tls
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import DeliveryResult, Outcome

pytestmark = pytest.mark.anyio


class TlsServer(PrivateMariaDB):
    """A MariaDB requiring TLS on a loopback port, its certificate naming 127.0.0.1 and localhost."""

    def __init__(self, folder: Path) -> None:
        self.ca, ca_key = make_ca(folder, "test-ca")
        self.other_ca, _ = make_ca(folder, "other-ca")
        self.cert, self.key = loopback_certificate(folder, self.ca, ca_key)
        super().__init__(
            folder, "--skip-log-bin", f"--ssl-ca={self.ca}", f"--ssl-cert={self.cert}", f"--ssl-key={self.key}",
            "--require-secure-transport=ON",
        )  # fmt: skip

    def start(self, answers: Callable[[], bool] | None = None) -> None:
        def over_tls() -> bool:
            try:
                pymysql.connect(host="127.0.0.1", port=self.port, user="root", connect_timeout=2,
                                ssl={"ca": str(self.ca)}).close()  # fmt: skip
            except pymysql.err.OperationalError:
                return False
            return True

        super().start(answers or over_tls)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    server = TlsServer(tmp_path_factory.mktemp("tls-mariadb"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["ssl_mode=required", "ssl_mode=verify_identity&ssl_ca={ca}", "ssl_ca={ca}"])
async def test_a_server_that_requires_tls_is_migrated_and_served_over_it(tls_server: TlsServer, mode: str) -> None:
    """migrate's own connections and the pool's all go over TLS: the table is made, an event is
    claimed and recorded, and the session's cipher is not empty."""
    dsn = tls_server.dsn(mode.format(ca=tls_server.ca))
    store = await open_store(dsn, create_database=True)
    try:
        await store.migrate()
        event = f"e-{mode[:12]}"
        await insert_events(store, [envelope(event)])
        claimed = await store.claim("a#1", 10, now_ms() + 60_000)
        assert [r.event_id for r in claimed.rows] == [event]
        assert await store.record([DeliveryResult(claimed.rows[0].id, event, "a#1", Outcome.PUBLISHED)]) == []
        async with store.transaction() as cur:
            await cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            assert (await cur.fetchone())[1]
            await cur.execute("DELETE FROM room_outbox")
    finally:
        await store.aclose()


async def test_without_ssl_mode_the_refused_login_points_at_it(tls_server: TlsServer) -> None:
    with pytest.raises(StoreUnavailable, match="refused the login") as info:
        await open_store(tls_server.dsn())
    assert "ssl_mode" in str(info.value)


async def test_a_certificate_of_another_ca_is_refused_naming_the_options(tls_server: TlsServer) -> None:
    with pytest.raises(StoreUnavailable, match=r"TLS failed: .*CERTIFICATE_VERIFY_FAILED") as info:
        await open_store(tls_server.dsn(f"ssl_mode=verify_identity&ssl_ca={tls_server.other_ca}"))
    assert "ssl_mode and ssl_ca" in str(info.value)


@asynccontextmanager
async def recording_relay(host: str, port: int) -> AsyncIterator[tuple[int, bytearray]]:
    """A loopback port relaying connections to ``host:port``, and every byte the clients sent."""
    sent = bytearray()

    async def pump(source: SocketStream, sink: SocketStream, record: bool) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in source:
                if record:
                    sent.extend(chunk)
                await sink.send(chunk)
            await sink.send_eof()

    async def relay(client: SocketStream) -> None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            async with client, await anyio.connect_tcp(host, port) as server, anyio.create_task_group() as pumps:
                pumps.start_soon(pump, client, server, True)
                pumps.start_soon(pump, server, client, False)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as serving:
        serving.start_soon(listener.serve, relay)
        yield listener.extra(SocketAttribute.local_port), sent
        serving.cancel_scope.cancel()


@pytest.mark.parametrize("password", ["", "wrong"])
async def test_ssl_mode_refuses_a_server_that_offers_no_tls_before_the_login(database_dsn: str, password: str) -> None:
    """The driver would log in and go on in the clear with a server that does not offer TLS
    (the suite's MariaDB offers none): the store refuses first, having sent nothing at all,
    whether the login would have succeeded or not (a wrong password, a user that requires TLS
    would be refused in a wrong password's words)."""
    server = MySQLAddress.from_dsn(database_dsn)
    async with recording_relay(server.host, server.port) as (port, sent):
        dsn = f"mysql://{server.user}:{password}@127.0.0.1:{port}/{server.database}?ssl_mode=required"
        with anyio.fail_after(20), pytest.raises(StoreUnavailable) as info:
            await open_store(dsn)
    assert str(info.value).startswith(
        f"MySQL at 127.0.0.1:{port} offered no TLS, and database.dsn's ssl_mode is required"
    ), info.value
    assert sent == b"", bytes(sent)


def test_a_greeting_that_is_an_error_is_left_for_the_login_to_report() -> None:
    """A server sends an error instead of its greeting when it takes no connection (too many,
    a blocked host): the login reports it in its own words."""
    assert offers_tls(b"\xff\x10\x04#08004Too many connections") is None
    assert offers_tls(b"") is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("ssl_mode=sometimes", "ssl_mode='sometimes' is not one of disabled, required, verify_ca, verify_identity"),
        ("ssl_mode=disabled&ssl_ca=/etc/ca.pem", "ssl_ca given with ssl_mode=disabled"),
        ("ssl_mode=required&ssl_cert=/etc/c.pem", "ssl_cert and ssl_key go together"),
        ("ssl_ca=/nowhere/ca.pem", "ssl_ca: cannot be read (No such file or directory)"),
        (
            "sslmode=require",
            "unsupported options ['sslmode'] (allowed: ssl_mode, ssl_ca, ssl_cert, ssl_key, unix_socket)",
        ),
    ],
)
async def test_tls_options_that_cannot_work_are_refused_naming_the_option(options: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        await open_store(f"mysql://u:hunter22@127.0.0.1:3306/room?{options}")
    assert message in str(info.value) and "hunter22" not in str(info.value)
    assert "expected mysql://" not in str(info.value)  # the form is right: only the option is named


def test_ssl_mode_is_read_case_blind_and_an_ssl_ca_alone_means_verify_ca(tmp_path: Path) -> None:
    ca, _ = make_ca(tmp_path, "ca")
    assert MySQLAddress.from_dsn(f"mysql://u@h/db?ssl_ca={ca}").ssl_mode == "verify_ca"
    assert MySQLAddress.from_dsn("mysql://u@h/db?ssl_mode=REQUIRED").ssl_mode == "required"
    assert MySQLAddress.from_dsn("mysql://u@h/db").tls_context() is None


async def test_a_ca_without_key_usage_is_trusted_as_the_servers_own_clients_trust_it(
    tls_server: TlsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test CA, made by hand as many are, has no key usage extension. Python 3.13 checks
    certificates strictly by default and refuses it, where MySQL's, Kafka's and curl's clients
    accept it: that default, set here on any Python, is lifted for the database's, the
    broker's and a private CA's contexts, and the server is reached over TLS."""
    make_default = ssl.create_default_context

    def strict_by_default(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        context = make_default(*args, **kwargs)
        context.verify_flags |= ssl.VERIFY_X509_STRICT
        return context

    monkeypatch.setattr(ssl, "create_default_context", strict_by_default)
    strict = ssl.create_default_context(cafile=str(tls_server.ca))
    with pytest.raises(pymysql.err.OperationalError):  # what Python 3.13's default does
        pymysql.connect(host="127.0.0.1", port=tls_server.port, user="root", ssl=strict, connect_timeout=5)
    store = await open_store(tls_server.dsn(f"ssl_ca={tls_server.ca}"), create_database=True)
    try:
        async with store.transaction() as cur:
            await cur.execute("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
            assert (await cur.fetchone())[1]
    finally:
        await store.aclose()
    broker = KafkaSecurity(security_protocol="SSL", ssl_cafile=str(tls_server.ca)).ssl_context()
    im = http_client(TencentIMSettings(sdkappid=1400000000, secret_key="k", ca_file=str(tls_server.ca)))
    try:
        verify = im._transport.ssl_context  # type: ignore[attr-defined]
        for context in (broker, verify):
            assert isinstance(context, ssl.SSLContext) and not context.verify_flags & ssl.VERIFY_X509_STRICT
    finally:
        await im.aclose()
