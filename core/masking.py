"""Where a secret is masked in a text: the one rule for every text that leaves the process,
whether the process's :class:`~room_outbox.observability.redaction.Redactor` masks it (a log
line, a span, ``last_error``) or the store masks the database password in the driver's words
(:func:`mask`) before anything else sees them.

A long secret is masked wherever it stands; a shorter one as a whole token only, never inside
a longer one, so a password that is also a name (a user's, a database's, part of a table's)
leaves the names that contain it whole, and is masked alike wherever it stands alone.
"""

from __future__ import annotations

import json
import re

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


def secret_pattern(secret: str) -> str:
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


ALNUM_RUN = re.compile(r"[A-Za-z0-9]+")


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


def mask(text: str, secret: str) -> str:
    """``text`` with ``secret`` masked as :func:`secret_pattern` finds it (nothing to mask: as it is)."""
    secret = secret.strip()
    return re.sub(secret_pattern(secret), REDACTED, text) if secret else text
