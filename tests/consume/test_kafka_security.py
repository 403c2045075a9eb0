"""Kafka security settings (shared by the Kafka sink and the consumers): validation,
redaction, and a real TLS connection with client certificates.

The tansu build the tests use lists ``--cert``/``--key`` but refuses the two together and
speaks plain TCP with either alone, so TLS is terminated by a proxy in front of it (Python's
``ssl``, a real handshake and certificate checks), with tansu advertising the proxy's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from lanes.conftest import tansu_binary
from pydantic import ValidationError
from support import free_port

from room_outbox import EventEnvelope, RetryableSinkError, SinkContext
from room_outbox.config import ConfigError, Settings
from room_outbox.consume.service import run_consumers
from room_outbox.consume.settings import consumer_settings
from room_outbox.kafka_security import KafkaSecurity
from room_outbox.observability.redaction import Redactor
from room_outbox.plugins.kafka import KafkaSettings
from room_outbox.plugins.kafka.sink import KafkaSink
from room_outbox.tls import as_servers_clients_check

pytestmark = pytest.mark.anyio


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"security_protocol": "SASL_SSL"}, "needs sasl_mechanism"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}, "needs sasl_username"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256", "sasl_username": "u"}, "needs sasl_password"),
        ({"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p4ss"}, "PLAIN sends the password in clear"),
        ({"sasl_username": "u"}, "SASL settings need security_protocol SASL_PLAINTEXT or SASL_SSL"),
        ({"ssl_cafile": "/etc/hostname"}, "ssl_cafile need security_protocol SSL or SASL_SSL"),
        ({"security_protocol": "SSL", "ssl_cafile": "/no/such/ca.pem"}, "ssl_cafile: no such file '/no/such/ca.pem'"),
        ({"security_protocol": "SSL", "ssl_certfile": "/etc/hostname"}, "ssl_certfile and ssl_keyfile go together"),
        ({"security_protocol": "TLS"}, "Input should be 'PLAINTEXT', 'SSL', 'SASL_PLAINTEXT' or 'SASL_SSL'"),
        ({"sasl_mechanism": "GSSAPI"}, "Input should be 'PLAIN', 'SCRAM-SHA-256' or 'SCRAM-SHA-512'"),
    ],
)  # fmt: skip
def test_inconsistent_security_settings_are_refused_with_the_reason(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        KafkaSecurity(**settings)
    assert message in str(info.value)


def test_sasl_settings_become_client_arguments_and_secrets_stay_secret() -> None:
    security = KafkaSecurity(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512", sasl_username="relay",
        sasl_password="s3cr3t-sasl",
    )  # fmt: skip
    assert security.client_kwargs() == {
        "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "relay",
        "sasl_plain_password": "s3cr3t-sasl",
    }  # fmt: skip
    assert "s3cr3t-sasl" not in repr(security) and "s3cr3t-sasl" not in str(security.model_dump())
    assert security.secrets() == ["s3cr3t-sasl"]


def test_the_kafka_sink_and_the_consumers_take_the_same_security_section() -> None:
    section = {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "PLAIN",
        "sasl_username": "u",
        "sasl_password": "pw-secret",
    }
    sink = KafkaSettings(security=section)
    redactor = Redactor()
    KafkaSink(sink, SinkContext("node", logging.getLogger("test"), redactor.add))
    assert redactor.redact("auth failed for pw-secret") == "auth failed for [REDACTED]"
    with pytest.raises(ValidationError, match=r"security\.sasl_mechanism"):
        KafkaSettings(security={**section, "sasl_mechanism": "MD5"})
    settings = Settings(consumers={"feed": {"handlers": ["audit"], "security": {**section, "sasl_password": ""}}})
    with pytest.raises(ConfigError, match=r"consumers\.feed\.security: .*needs sasl_password"):
        consumer_settings(settings)


async def test_an_unreadable_certificate_stops_consume_naming_the_file(tmp_path: Path) -> None:
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate")
    settings = Settings(
        consumers={"feed": {"handlers": ["audit"], "security": {"security_protocol": "SSL", "ssl_cafile": str(bogus)}}}
    )
    with pytest.raises(ConfigError, match=rf"consumers\.feed\.security\.ssl_cafile '{bogus}': not a usable CA bundle"):
        await run_consumers(settings, handle_signals=False)


# -- a real TLS connection ----------------------------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def certificates(tmp_path: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=room-outbox test CA", cwd=tmp_path)  # fmt: skip
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=tmp_path)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=tmp_path)  # fmt: skip
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other-ca.pem",
            "-days", "2", "-subj", "/CN=another CA", cwd=tmp_path)  # fmt: skip
    return tmp_path


@contextlib.asynccontextmanager
async def tls_broker(certs: Path, log: Path) -> AsyncIterator[str]:
    """tansu on a plain port behind a TLS proxy that requires a client certificate; yields
    the proxy's bootstrap address (which tansu advertises)."""
    tansu_port, proxy_port = free_port(), free_port()
    binary = tansu_binary()
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", f"tcp://127.0.0.1:{tansu_port}",
         "--advertised-listener-url", f"tcp://127.0.0.1:{proxy_port}", "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=log.open("a"),
    )  # fmt: skip
    # As a broker's own TLS checks the client's certificate: the test CA, made by hand, has no
    # key usage extension, which Python 3.13's strict default refuses.
    server_ctx = as_servers_clients_check(
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs / "ca.pem"))
    )
    server_ctx.load_cert_chain(str(certs / "server.pem"), str(certs / "server.key"))
    server_ctx.verify_mode = ssl.CERT_REQUIRED

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            broker_r, broker_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", tansu_port), 5)
        except (OSError, TimeoutError):
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, broker_w), pipe(broker_r, client_w))

    server = await asyncio.start_server(relay, "127.0.0.1", proxy_port, ssl=server_ctx)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(
            [str(binary), "topic", "create", "room-events", "--broker", f"tcp://127.0.0.1:{tansu_port}",
             "--partitions", "1"], capture_output=True, timeout=20,
        ).returncode:  # fmt: skip
            assert time.monotonic() < deadline, "tansu did not come up"
            await asyncio.sleep(0.1)
        yield f"127.0.0.1:{proxy_port}"
    finally:
        server.close()
        proc.kill()
        proc.wait(timeout=10)


def tls(certs: Path, ca: str = "ca.pem", client: bool = True) -> KafkaSecurity:
    extra = {"ssl_certfile": str(certs / "client.pem"), "ssl_keyfile": str(certs / "client.key")} if client else {}
    return KafkaSecurity(security_protocol="SSL", ssl_cafile=str(certs / ca), **extra)


async def test_the_kafka_sink_delivers_over_mutual_tls_and_a_consumer_reads_it_back(
    certificates: Path, tmp_path: Path
) -> None:
    async with tls_broker(certificates, tmp_path / "tansu.log") as bootstrap:
        settings = KafkaSettings(bootstrap_servers=bootstrap, idempotence="false", security=tls(certificates))
        sink = KafkaSink(settings, SinkContext("node", logging.getLogger("test")))
        try:
            await asyncio.wait_for(
                sink.deliver(EventEnvelope(event_id="e1", event_type="RoomUserJoined", room_id="r1")), 30
            )
        finally:
            await sink.aclose()
        consumer = AIOKafkaConsumer(
            "room-events",
            bootstrap_servers=bootstrap,
            auto_offset_reset="earliest",
            **tls(certificates).client_kwargs(),
        )
        await asyncio.wait_for(consumer.start(), 30)
        try:
            message = await asyncio.wait_for(consumer.getone(), 30)
        finally:
            await consumer.stop()
        assert EventEnvelope.model_validate_json(message.value).event_id == "e1"

        # The checks are real: a broker certificate from another CA, or no client
        # certificate, and nothing gets through.
        for security in (tls(certificates, ca="other-ca.pem"), tls(certificates, client=False)):
            refused = KafkaSink(
                KafkaSettings(bootstrap_servers=bootstrap, idempotence="false", request_timeout=2, security=security),
                SinkContext("node", logging.getLogger("test")),
            )
            try:
                with pytest.raises((RetryableSinkError, KafkaError, asyncio.TimeoutError)):
                    await asyncio.wait_for(
                        refused.deliver(EventEnvelope(event_id="e2", event_type="RoomUserJoined", room_id="r1")), 20
                    )
            finally:
                await refused.aclose()
