"""UserSig, Tencent IM's admin credential (TLSSigAPIv2), and a cache that renews it.

A UserSig is an HMAC-SHA256 of a fixed text (identifier, sdkappid, issue time, lifetime)
under the app's secret key, wrapped as JSON, zlib-compressed and base64-encoded with
Tencent's URL-safe alphabet (``+``→``*``, ``/``→``-``, ``=``→``_``). :func:`decode_usersig` and
:func:`verify_usersig` are the inverse; the fake Tencent IM uses them to check what the sink
sends.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TO_TENCENT = str.maketrans({"+": "*", "/": "-", "=": "_"})
_FROM_TENCENT = str.maketrans({"*": "+", "-": "/", "_": "="})


class UserSigError(ValueError):
    """A UserSig that fails verification; ``code`` is the ErrorCode Tencent answers with."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def hmac_sig(key: str, identifier: str, sdkappid: int, issued_at: int, expire: int) -> str:
    content = f"TLS.identifier:{identifier}\nTLS.sdkappid:{sdkappid}\nTLS.time:{issued_at}\nTLS.expire:{expire}\n"
    digest = hmac.new(key.encode("utf-8"), content.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def gen_usersig(sdkappid: int, key: str, identifier: str, expire: int, issued_at: int | None = None) -> str:
    """A TLSSigAPIv2 UserSig valid for ``expire`` seconds from ``issued_at`` (default: now)."""
    issued_at = int(time.time()) if issued_at is None else issued_at
    doc = {
        "TLS.ver": "2.0",
        "TLS.identifier": identifier,
        "TLS.sdkappid": sdkappid,
        "TLS.expire": expire,
        "TLS.time": issued_at,
        "TLS.sig": hmac_sig(key, identifier, sdkappid, issued_at, expire),
    }
    compressed = zlib.compress(json.dumps(doc, separators=(",", ":")).encode("utf-8"))
    return base64.b64encode(compressed).decode("ascii").translate(_TO_TENCENT)


def decode_usersig(usersig: str) -> dict[str, Any]:
    """The JSON document inside a UserSig; :class:`UserSigError` (70003) when it is not one."""
    try:
        raw = zlib.decompress(base64.b64decode(usersig.translate(_FROM_TENCENT), validate=True))
        doc = json.loads(raw)
    except (binascii.Error, zlib.error, ValueError) as exc:
        raise UserSigError(70003, "UserSig cannot be decoded") from exc
    if not isinstance(doc, dict):
        raise UserSigError(70003, "UserSig is not a JSON object")
    return doc


def verify_usersig(
    usersig: str, *, sdkappid: int, identifier: str, key: str, now: float | None = None
) -> dict[str, Any]:
    """Check a UserSig as Tencent does, raising :class:`UserSigError` with Tencent's code."""
    doc = decode_usersig(usersig)
    try:
        signed_id = str(doc["TLS.identifier"])
        signed_app = int(doc["TLS.sdkappid"])
        issued_at = int(doc["TLS.time"])
        expire = int(doc["TLS.expire"])
        sig = str(doc["TLS.sig"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserSigError(70003, "UserSig lacks a TLS field") from exc
    if signed_app != sdkappid:
        raise UserSigError(70014, "sdkappid in the request differs from the one the UserSig was made for")
    if signed_id != identifier:
        raise UserSigError(70013, "identifier in the request differs from the one the UserSig was made for")
    if not hmac.compare_digest(sig, hmac_sig(key, signed_id, signed_app, issued_at, expire)):
        raise UserSigError(70009, "UserSig verification failed (made with another key?)")
    if (time.time() if now is None else now) >= issued_at + expire:
        raise UserSigError(70001, "UserSig expired")
    return doc


@dataclass
class UserSigCache:
    """One app's UserSig, generated on first use and renewed at half its lifetime.

    Renewing at half-life (not just before expiry) means a clock difference of up to half
    the lifetime between this host and Tencent still never presents an expired signature.
    Every new signature goes to ``on_new`` so the core can redact it.
    """

    sdkappid: int
    identifier: str
    key: str
    ttl: int
    on_new: Callable[[str], None] = lambda _sig: None
    clock: Callable[[], float] = time.time
    _sig: str = ""
    _issued_at: float = 0.0

    def get(self) -> str:
        now = self.clock()
        if not self._sig or now - self._issued_at >= self.ttl / 2:
            self._issued_at = now
            self._sig = gen_usersig(self.sdkappid, self.key, self.identifier, self.ttl, int(now))
            self.on_new(self._sig)
        return self._sig

    def invalidate(self) -> None:
        """Forget the signature (Tencent said 70001: expired); the next :meth:`get` makes one."""
        self._sig = ""
