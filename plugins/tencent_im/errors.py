"""Which Tencent IM answers are worth retrying, and the error text we keep.

Tencent answers HTTP 200 for most failures; the verdict is in the body's ``ErrorCode``.
Codes not listed are treated as retryable: an unknown code is more likely a new transient
condition than a permanent one, and in doubt an event must not be given up on.
70001 (UserSig expired) is listed as retryable; the sink also regenerates the UserSig and
tries once more at once before reporting it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from room_outbox import PermanentSinkError, RetryableSinkError, SinkError

USERSIG_EXPIRED = 70001

RETRYABLE_CODES: frozenset[int] = frozenset(
    {10002, 10006, 10023, 60007, 60008, 60011, 60014, 60018, 60019, USERSIG_EXPIRED}
)
PERMANENT_CODES: frozenset[int] = frozenset(
    {
        10003, 10004, 10007, 10010, 10015, 10016, 10017,
        80001, 80002,
        70003, 70009, 70013, 70014, 70016, 70020, 70051, 70107,
    }
)  # fmt: skip

#: ErrorInfo is Tencent's text; keep enough to diagnose, never a whole body.
ERROR_INFO_MAX = 200
_USERSIG_IN_TEXT = re.compile(r"(usersig=)[^&\s\"']+", re.IGNORECASE)


def is_retryable(code: int) -> bool:
    return code not in PERMANENT_CODES


def _unchanged(text: str) -> str:
    return text


def error_for_code(code: int, info: str, context: str, redact: Callable[[str], str] = _unchanged) -> SinkError:
    """The sink error for a Tencent ``ErrorCode``; the text carries code and ErrorInfo only."""
    kind = RetryableSinkError if is_retryable(code) else PermanentSinkError
    return kind(f"ErrorCode {code}: {short_info(info, redact)} ({context})")


def short_info(info: str, redact: Callable[[str], str] = _unchanged) -> str:
    """ErrorInfo on one line, bounded, with anything that looks like a UserSig masked.
    ``redact`` (the sink's own secrets) runs before the cut: a secret cut in two, its tail
    beyond the bound, would no longer be recognised by any later redaction."""
    text = redact(" ".join(str(info).split())) or "no ErrorInfo"
    text = _USERSIG_IN_TEXT.sub(r"\1[REDACTED]", text)
    return text if len(text) <= ERROR_INFO_MAX else text[: ERROR_INFO_MAX - 1] + "…"
