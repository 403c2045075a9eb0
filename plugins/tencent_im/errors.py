"""Which Tencent IM answers are worth retrying, and the error text we keep.

Tencent answers HTTP 200 for most failures; the verdict is in the body's ``ErrorCode``.
Codes not listed are treated as retryable: an unknown code is more likely a new transient
condition than a permanent one, and in doubt an event must not be given up on.
70001 (UserSig expired) is listed as retryable; the sink also regenerates the UserSig and
tries once more at once before reporting it.

Rate-limit answers are retryable too, but no attempt: Tencent refused the message for its rate
without delivering it, so the event must not lose a retry (or be parked) for it. The sink hands
it back throttled and slows down the limiter the answer names: the app's (60007, 60011) or the
group's (10023, and an OK answer with ``MsgDropReason`` ``MsgFreqCtrl``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from room_outbox import PermanentSinkError, RetryableSinkError, SinkError

USERSIG_EXPIRED = 70001
#: The app's request rate (60007: REST API calls, 60011: the SDKAppID's requests).
APP_RATE_CODES: frozenset[int] = frozenset({60007, 60011})
#: The group's message rate.
GROUP_RATE_CODES: frozenset[int] = frozenset({10023})
#: An OK answer's ``MsgDropReason`` when the group's rate control dropped the message.
GROUP_RATE_DROP = "MsgFreqCtrl"

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
