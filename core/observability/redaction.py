"""Secrets never leave the process: every text bound for a log line, a span or ``last_error``
passes through :meth:`Redactor.redact`, which masks each registered secret.

One :class:`Redactor` serves the whole process. :func:`redactor_for` makes it from the
configuration (the DSN password, every sink or consumer setting named like a credential,
OTLP header values); both log formatters, the span exporters, the dispatcher's ``last_error``
and ``/readyz`` all use it, and sinks add what they create at run time (Tencent IM's UserSigs)
through ``SinkContext.add_secret``. A secret is masked however it travels: a long one
wherever it stands, even glued to other characters; a shorter one as a whole token, never
inside a longer one (:func:`~room_outbox.masking.secret_pattern`, the one rule every
error text the store builds follows too).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from room_outbox.masking import ALNUM_RUN, REDACTED, secret_pattern

if TYPE_CHECKING:
    from room_outbox.config import Settings

__all__ = ["REDACTED", "Redactor", "redact_and_shorten", "redactor_for"]

#: Setting names (in any sink section, at any depth) whose values are credentials.
SECRET_SETTING = re.compile(
    r"(secret|password|passwd|token|credential|private_key|api_key|authorization|sasl_plain)", re.I
)

#: OpenTelemetry variables whose values are ``key=value`` headers, typically an API token.
OTLP_HEADER_VARIABLES = (
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
)


class Redactor:
    """Masks registered secrets in any text. Thread-safe: :meth:`add` swaps in a new
    matcher in one assignment, so an exporter thread redacting meanwhile sees the old or
    the new one, both valid."""

    def __init__(self) -> None:
        self._secrets: set[str] = set()
        self._matcher: _Matcher | None = None

    def add(self, secret: str) -> None:
        secret = secret.strip()
        if not secret or secret in self._secrets:
            return
        self._secrets.add(secret)
        self._matcher = _Matcher(self._secrets)

    def discard(self, secret: str) -> None:
        """Mask ``secret`` no more (a signature replaced: nothing sends it any longer). Each
        secret costs every later :meth:`add` (one pattern holds them all), so those made over
        and over must be let go."""
        secret = secret.strip()
        if secret in self._secrets:
            self._secrets.discard(secret)
            self._matcher = _Matcher(self._secrets) if self._secrets else None

    def add_all(self, other: Redactor) -> None:
        for secret in other._secrets:
            self.add(secret)

    def redact(self, text: str) -> str:
        matcher = self._matcher
        return text if matcher is None else matcher.redact(text)

    def __contains__(self, secret: str) -> bool:
        return secret.strip() in self._secrets


class _Matcher:
    """One pattern for every secret, and each secret's anchor: its longest run of ASCII
    letters and digits, which no encoding changes. A text holding no anchor holds no secret,
    and a substring search is several times cheaper than the pattern (most log lines)."""

    def __init__(self, secrets: set[str]) -> None:
        # Longest first: a secret that contains another is masked whole, not in pieces.
        ordered = sorted(secrets, key=len, reverse=True)
        self.pattern = re.compile("|".join(secret_pattern(secret) for secret in ordered))
        anchors = [max(ALNUM_RUN.findall(secret), key=len, default="") for secret in ordered]
        #: None when a secret has no anchor: then every text goes through the pattern.
        self.anchors = anchors if all(anchors) else None

    def redact(self, text: str) -> str:
        if self.anchors is not None and not any(anchor in text for anchor in self.anchors):
            return text
        return self.pattern.sub(REDACTED, text)


def redactor_for(settings: Settings, environ: Mapping[str, str] | None = None) -> Redactor:
    """The process's redactor, knowing every secret in the configuration before any
    connection is made: the DSN password, each sink setting whose name says it is a
    credential (``secret_key``, ``password``, ``sasl_plain_password``, ``token``...) and the
    password of any URL among them (a ``proxy``), and the values of the OTLP header variables."""
    from room_outbox.store.factory import dsn_password

    redactor = Redactor()
    redactor.add(dsn_password(settings.database.dsn.get_secret_value()))  # any database's DSN
    for secret in _secret_settings(settings.sinks):
        redactor.add(secret)
    for secret in _secret_settings(settings.consumers):  # their Kafka SASL and key passwords
        redactor.add(secret)
    env = os.environ if environ is None else environ
    for variable in OTLP_HEADER_VARIABLES:
        for header in env.get(variable, "").split(","):
            redactor.add(header.partition("=")[2])
    return redactor


def _secret_settings(section: Any, secret: bool = False) -> Iterator[str]:
    if isinstance(section, Mapping):
        for key, value in section.items():
            yield from _secret_settings(value, secret or bool(SECRET_SETTING.search(str(key))))
    elif isinstance(section, list | tuple):
        for value in section:
            yield from _secret_settings(value, secret)
    elif section is not None:
        text = str(section.get_secret_value() if hasattr(section, "get_secret_value") else section)
        if secret:
            yield text
        elif "://" in text and "@" in text:  # a URL's own password (a proxy's: http://user:password@host)
            with contextlib.suppress(ValueError):
                password = urlsplit(text.strip()).password
                if password:
                    yield from (password, unquote(password))


def redact_and_shorten(redactor: Redactor, text: str, limit: int) -> str:
    """``text`` with its secrets masked, then cut to at most ``limit`` characters (the last
    one "…"). Masked first: a secret cut in two would no longer be recognised."""
    text = redactor.redact(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"
