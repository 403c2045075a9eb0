"""How room-outbox talks to Kafka securely: one settings model for everything that connects
to a broker (the Kafka sink, ``room-outbox consume``), so both accept the same keys.

``security_protocol``:

* ``PLAINTEXT``: no TLS, no authentication (the default; loopback and test set-ups).
* ``SSL``: TLS. ``ssl_cafile`` is the CA that signed the broker's certificate (empty: the
  system's trust store); ``ssl_certfile`` + ``ssl_keyfile`` add a client certificate (mutual TLS).
* ``SASL_PLAINTEXT`` / ``SASL_SSL``: SASL authentication (``PLAIN``, ``SCRAM-SHA-256`` or
  ``SCRAM-SHA-512``) without / with TLS. ``PLAIN`` sends the password as it is: use it over
  ``SASL_SSL`` only, which is why ``SASL_PLAINTEXT`` with ``PLAIN`` is refused.

Secrets (``sasl_password``, ``ssl_key_password``) are ``SecretStr``: they never print, and
:meth:`KafkaSecurity.secrets` hands them to the redactor.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SecretStr, model_validator

from room_outbox.tls import as_servers_clients_check

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


class KafkaSecurity(BaseModel):
    """The ``security`` section of ``sinks.kafka`` and of every ``consumers.<name>``."""

    model_config = ConfigDict(extra="forbid")

    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str = ""
    sasl_password: SecretStr = SecretStr("")
    #: CA bundle (PEM) the broker's certificate must chain to; empty: the system's trust store.
    ssl_cafile: str = ""
    #: Client certificate and its private key (PEM), for brokers that authenticate clients by TLS.
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_key_password: SecretStr = SecretStr("")
    #: Check that the broker's certificate names the host connected to. Turn off only for
    #: test brokers whose certificate names another host.
    ssl_check_hostname: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        problems: list[str] = []
        sasl = self.security_protocol.startswith("SASL_")
        tls = self.security_protocol.endswith("SSL")
        if sasl:
            if self.sasl_mechanism is None:
                problems.append(f"security_protocol {self.security_protocol} needs sasl_mechanism")
            if not self.sasl_username:
                problems.append(f"security_protocol {self.security_protocol} needs sasl_username")
            if not self.sasl_password.get_secret_value():
                problems.append(f"security_protocol {self.security_protocol} needs sasl_password")
            if self.sasl_mechanism == "PLAIN" and not tls:
                problems.append("sasl_mechanism PLAIN sends the password in clear: use security_protocol SASL_SSL")
        elif self.sasl_mechanism or self.sasl_username or self.sasl_password.get_secret_value():
            problems.append(
                f"SASL settings need security_protocol SASL_PLAINTEXT or SASL_SSL (not {self.security_protocol})"
            )
        tls_files = {"ssl_cafile": self.ssl_cafile, "ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile}
        if not tls and any(tls_files.values()):
            given = ", ".join(name for name, value in tls_files.items() if value)
            problems.append(f"{given} need security_protocol SSL or SASL_SSL (not {self.security_protocol})")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            problems.append("ssl_certfile and ssl_keyfile go together (a client certificate and its key)")
        for name, value in tls_files.items():
            if value and not Path(value).is_file():
                problems.append(f"{name}: no such file {value!r}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def secrets(self) -> list[str]:
        """Values to register with the redactor."""
        return [s.get_secret_value() for s in (self.sasl_password, self.ssl_key_password) if s.get_secret_value()]

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for ``SSL`` / ``SASL_SSL`` (``None`` otherwise). Raises
        ``ValueError`` naming the file when a certificate or key cannot be loaded."""
        if not self.security_protocol.endswith("SSL"):
            return None
        try:
            context = as_servers_clients_check(ssl.create_default_context(cafile=self.ssl_cafile or None))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"ssl_cafile {self.ssl_cafile!r}: not a usable CA bundle ({exc})") from None
        context.check_hostname = self.ssl_check_hostname
        if self.ssl_certfile:
            try:
                context.load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile, self.ssl_key_password.get_secret_value() or None
                )
            except (OSError, ssl.SSLError) as exc:
                # the message of a wrong key password names no secret; keep only its reason
                raise ValueError(
                    f"ssl_certfile {self.ssl_certfile!r} / ssl_keyfile {self.ssl_keyfile!r}: cannot load ({type(exc).__name__}: {getattr(exc, 'reason', None) or exc.args[-1]})"
                ) from None
        return context

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AIOKafkaProducer`` / ``AIOKafkaConsumer``."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        context = self.ssl_context()
        if context is not None:
            kwargs["ssl_context"] = context
        if self.security_protocol.startswith("SASL_"):
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password.get_secret_value()
        return kwargs
