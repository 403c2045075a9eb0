"""Secrets never leave the process: every text bound for a log line, a span or ``last_error``
passes through :meth:`Redactor.redact`, which masks each registered secret.

One :class:`Redactor` serves the whole process. :func:`redactor_for` makes it from the
configuration (the DSN password, every sink or consumer setting named like a credential,
OTLP header values); both log formatters, the span exporters, the dispatcher's ``last_error``
and ``/readyz`` all use it, and sinks add what they create at run time (Tencent IM's UserSigs)
through ``SinkContext.add_secret``. A secret is masked however it travels: a long one
wherever it stands, even glued to other characters; a shorter one as a whole token, never
inside a longer one (:func:`_bounded`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from room_outbox.config import Settings

REDACTED = "[REDACTED]"

#: Shorter secrets are masked only where they are a whole value: as free-text words
#: (``a``, ``abc``) they would mask ordinary text.
MIN_SECRET_LENGTH = 4

#: Secrets at least this long are masked wherever they stand, even glued to other characters
#: (``appkey_<key>``, ``sig_<UserSig>_end``): a false match is no risk at that length, and
#: an error text often glues a value to a word. Shorter ones only as whole tokens.
GLUED_SECRET_LENGTH = 16

#: Characters that continue a token: a secret next to one is part of a longer word.
_TOKEN_CHAR = r"[\w.\-]"
#: What may stand just before a secret although it is a token character: the end of a
#: percent-escape (``%3D`` before a query value) or of a JSON escape (``\n``).
_ESCAPE_BEFORE = r"(?<=%[0-9A-Fa-f]{2})|(?<=\\[nrtbf])"
#: Where a short secret is a whole value: a quoted string (a JSON value, escaped quotes
#: too), or what follows ``=``, ``:`` or ``: `` (a URL's userinfo, a query or DSN field, a
#: header) up to the value's end (``@``, ``&``, ``#``, ``;``, ``,``, a quote, a space, a
#: slash, a closing bracket, a backslash or the end of the text). ``{}``: the secret.
_WHOLE_VALUE = (
    r"(?<=[\"'])(?:{})(?=\\?[\"'])"
    r"|(?:(?<=[=:])|(?<=: ))(?:{})(?=[@&#;,\"'\s/)\]}}\\]|$)"
)

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
        self.pattern = re.compile("|".join(_bounded(secret) for secret in ordered))
        anchors = [max(_ALNUM_RUN.findall(secret), key=len, default="") for secret in ordered]
        #: None when a secret has no anchor: then every text goes through the pattern.
        self.anchors = anchors if all(anchors) else None

    def redact(self, text: str) -> str:
        if self.anchors is not None and not any(anchor in text for anchor in self.anchors):
            return text
        return self.pattern.sub(REDACTED, text)


def _bounded(secret: str) -> str:
    """``secret``'s pattern: a long secret's anywhere, a shorter one's anchored on token
    boundaries (a short secret: on a value's). An edge that is itself a separator (``*`` in
    ``*abc``) needs no boundary, as ``\\b``.

    It matches the secret raw, percent-encoded as in a URL query (a UserSig's ``*`` goes out
    as ``%2A``, ``+``/``/``/``=`` as ``%2B``/``%2F``/``%3D``, a space as ``+`` or ``%20``, hex
    digits in either case) or escaped inside a JSON string. A shorter secret never inside a
    longer token: a password ``room`` leaves ``room_outbox.app``, ``room-service`` and
    ``bedroom`` alone. A secret of :data:`GLUED_SECRET_LENGTH` characters or more is masked wherever it stands,
    inside a longer token too; one of :data:`MIN_SECRET_LENGTH` or more wherever it stands
    between separators (spaces, quotes, ``:@=/?&,;`` and the like); a shorter one only where
    it is a whole value: after ``=`` or ``:`` (a URL's userinfo, a query or DSN field, a
    header) or inside quotes (a JSON string), up to the value's end."""
    if len(secret) >= GLUED_SECRET_LENGTH:
        return _encodings(secret)
    if len(secret) < MIN_SECRET_LENGTH:
        return _WHOLE_VALUE.format(_encodings(secret), _encodings(secret))
    before = f"(?:(?<!{_TOKEN_CHAR})|{_ESCAPE_BEFORE})" if _is_token_char(secret[0]) else ""
    after = f"(?!{_TOKEN_CHAR})" if _is_token_char(secret[-1]) else ""
    return f"{before}(?:{_encodings(secret)}){after}"


def _is_token_char(char: str) -> bool:
    return re.fullmatch(_TOKEN_CHAR, char) is not None


_ALNUM_RUN = re.compile(r"[A-Za-z0-9]+")


def _encodings(secret: str) -> str:
    """A regular expression matching ``secret`` raw, percent-encoded (``quote`` and
    ``quote_plus``, any safe set, either hex case) and JSON-escaped, character by character,
    so a text that encodes some characters and not others is matched too."""
    return "".join(_char_forms(char) for char in secret)


def _char_forms(char: str) -> str:
    if char.isascii() and char.isalnum():
        return char  # no encoder in use escapes letters or digits
    forms = [re.escape(char)]
    forms.append("".join(_percent(byte) for byte in char.encode()))
    if char == " ":
        forms.append(r"\+")
    for ensure_ascii in (False, True):
        escaped = json.dumps(char, ensure_ascii=ensure_ascii)[1:-1]
        if escaped != char:
            forms.append(re.escape(escaped))
    # Longest first: a secret ending in ``%`` is masked with its ``%25``, not only the ``%``.
    return "(?:" + "|".join(sorted(dict.fromkeys(forms), key=len, reverse=True)) + ")"


def _percent(byte: int) -> str:
    """``%XX`` for ``byte``, hex digits in either case."""
    return "%" + "".join(f"[{digit}{digit.lower()}]" for digit in f"{byte:02X}")


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
