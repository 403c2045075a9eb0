"""From an :class:`EventEnvelope` to a ``send_group_msg`` request body.

One ``TIMCustomElem`` whose ``Data`` is the compact JSON of the envelope's client-facing
fields; clients de-duplicate by its ``event_id``.

``Random`` and Tencent's de-duplication
---------------------------------------
Tencent discards a message whose ``Random`` equals that of a message sent in the last
5 minutes (we assume per group, which is how the fake behaves). ``Random`` is the first
32 bits of SHA-256 of ``app_code``, a NUL byte and ``event_id`` (UTF-8), so every retry of an
event, from this worker or from room-service's synchronous push (when it uses the same rule),
is discarded by Tencent too. ``event_id`` is unique only within its app: several app codes can
share one Tencent app (``default_app_codes``) and one group, and two of them reusing an
``event_id`` must not have one message discarded as the other's copy. The NUL byte keeps the
pair unambiguous (``("a", "bc")`` and ``("ab", "c")`` hash differently).

The price is that two *different* events can share a ``Random``. For ``n`` distinct events
in one group within 5 minutes the chance of any collision is ``1 − exp(−n² / 2³³)``
(≈ ``n² / 2³³`` while small):

====================  ============  ====================
rate in one group     n in 5 min    P(collision)
====================  ============  ====================
1 message/s           300           1.0e-5
5 messages/s          1,500         2.6e-4
40/s (the cap)        12,000        1.7e-2
====================  ============  ====================

A collision loses the later event silently (Tencent answers OK), so busy groups carry a
small real risk; were the window per app rather than per group, ``n`` would be the app's
rate × 300 s (200/s → 60,000 → ≈ 34 %). A 32-bit field cannot do better with a hash: any
derivation that is a pure function of opaque identifiers has the same birthday bound. If
that is ever unacceptable, room-service must mint event_ids carrying a per-room sequence,
from which Random can be taken without collisions.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from room_outbox import EventEnvelope, PermanentSinkError

#: The REST path of Tencent IM's send-to-group call (the sink calls it, the fake serves it).
SEND_GROUP_MSG = "/v4/group_open_http_svc/send_group_msg"

#: Envelope fields a client sees, in this order.
CLIENT_FIELDS = ("event_id", "event_type", "app_code", "room_id", "room_version", "occurred_at_ms", "payload")


def random_for(app_code: str, event_id: str) -> int:
    """Tencent's ``Random`` (u32) for an event: stable across retries, processes and releases
    (a hash of the bytes, never Python's per-process ``hash()``)."""
    digest = hashlib.sha256(f"{app_code}\0{event_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


#: Compact JSON, non-ASCII kept as is (Tencent counts UTF-8 bytes). One encoder for every call:
#: ``json.dumps`` with options builds a new one each time.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def compact_json(value: Any) -> str:
    return _COMPACT.encode(value)


def message_data(envelope: EventEnvelope) -> str:
    return compact_json({name: getattr(envelope, name) for name in CLIENT_FIELDS})


def msg_body(envelope: EventEnvelope) -> str:
    """The compact JSON of ``MsgBody``: one ``TIMCustomElem`` carrying :func:`message_data`.
    Serialised once per request: the size check counts it, the request body embeds it."""
    return f'[{{"MsgType":"TIMCustomElem","MsgContent":{{"Data":{compact_json(message_data(envelope))}}}}}]'


def body_size(body: str) -> int:
    """Bytes Tencent counts against the message size limit (compact JSON of ``MsgBody``)."""
    return len(body.encode("utf-8"))


def group_id_for(template: str, envelope: EventEnvelope, room_column: str = "room_id") -> str:
    """The event's ``GroupId``. An event whose ``room_id`` is empty (its producer wrote no room
    in ``room_column``, the outbox column it comes from) names no group when the template uses
    it; nor does an empty group id. Both are refused as permanent, before any request: Tencent
    would answer with a code we cannot count on knowing, and an unknown one is retried for ever."""
    group_id = template.format(room_id=envelope.room_id, app_code=envelope.app_code)
    if not envelope.room_id and "{room_id}" in template:
        raise PermanentSinkError(
            f"room_id is empty ({room_column} holds no room): no Tencent IM group to send to"
            f" (group_id_template {template!r})"
        )
    if not group_id:
        raise PermanentSinkError(f"app_code is empty: group_id_template {template!r} makes an empty GroupId of it")
    return group_id


def request_body(group_id: str, envelope: EventEnvelope, body: str, priority: str) -> bytes:
    """The ``send_group_msg`` request: ``body`` is :func:`msg_body`'s JSON, embedded as is."""
    head = compact_json(
        {"GroupId": group_id, "Random": random_for(envelope.app_code, envelope.event_id), "MsgPriority": priority}
    )
    return f'{head[:-1]},"MsgBody":{body}}}'.encode()  # MsgBody goes in before head's closing brace
