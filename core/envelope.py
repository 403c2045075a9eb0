"""The event envelope stored in ``room_outbox.envelope`` and its parse errors."""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, GetPydanticSchema, ValidationError, WithJsonSchema
from pydantic_core import core_schema

from room_outbox.errors import EnvelopeError

__all__ = [
    "KNOWN_EVENT_TYPES",
    "MAX_ENVELOPE_BYTES",
    "OTHER_EVENT_TYPE",
    "ROW_COLUMNS",
    "ROW_COLUMNS_SEPARATOR",
    "TOO_LARGE",
    "EnvelopeError",
    "EnvelopeTooLarge",
    "EventEnvelope",
    "columns_differ",
    "event_type_label",
    "joined_columns_differ",
    "parse_envelope",
]

#: Every event type room-service emits today. The main lane's default sink takes a type outside
#: this list too unless ``routing.main_default`` is ``known`` (see :mod:`room_outbox.delivery.routing`).
KNOWN_EVENT_TYPES: frozenset[str] = frozenset(
    {
        "RoomCreated",
        "RoomClosed",
        "RoomUserJoined",
        "RoomUserLeft",
        "RoomUserKicked",
        "RoomUserMuted",
        "RoomUserUnbanned",
        "RoomMicChanged",
        "RoomMicSeatLocked",
        "RoomGiftSent",
        "RoomProfileUpdated",
        "RoomBackgroundChanged",
        "RoomChatEnabledChanged",
        "RoomAdminChanged",
        "RoomHeatChanged",
        "RoomRankChanged",
        "RoomRocketFuelChanged",
        "RoomRocketIgnited",
        "RoomRocketLaunched",
    }
)


#: The metric label and span-name part for an event type nobody routes: rows must not mint
#: label values (each one a new time series) or span names without bound.
OTHER_EVENT_TYPE = "other"


def event_type_label(event_type: str, routed: Container[str] = frozenset()) -> str:
    """``event_type`` when it is a known type or one the routing names (``routed``), else
    :data:`OTHER_EVENT_TYPE`."""
    return event_type if event_type in KNOWN_EVENT_TYPES or event_type in routed else OTHER_EVENT_TYPE


#: The error of an integer field given anything else (see :data:`_Integer`).
_INTEGER_ERROR = "integer_type"

#: An integer field's value as JSON gives it: a JSON integer; a number with no fractional part
#: (JSON Schema's "integer" admits ``1.0`` and ``1.7648928e12``); or, so that a producer writing
#: it as a string keeps working, plain decimal digits with an optional leading minus, read as
#: that integer. Anything else (``true``, ``"5_000"``, ``" 7 "``, ``"+5"``, ``1.5``, ``"1e3"``)
#: is refused, never rewritten into a number the sinks would send on. Tried left to right, all
#: in pydantic-core, so that a JSON integer, the common case, costs what a plain ``int`` does.
_INTEGER_SCHEMA = core_schema.union_schema(
    [
        core_schema.int_schema(strict=True),
        # lax int of a float: its value when whole and within 64 bits, else an error
        core_schema.chain_schema([core_schema.float_schema(strict=True), core_schema.int_schema()]),
        # [0-9], not \d, which matches other scripts' digits; $ is the text's end (Rust regex)
        core_schema.chain_schema(
            [core_schema.str_schema(strict=True, pattern=r"^-?[0-9]+$"), core_schema.int_schema()]
        ),
    ],
    mode="left_to_right",
    custom_error_type=_INTEGER_ERROR,
    custom_error_message="Input should be an integer (a whole number, or its decimal digits in a string)",
    serialization=core_schema.simple_ser_schema("int"),
)
#: An ``int`` field that takes only what :data:`_INTEGER_SCHEMA` does; its JSON Schema says
#: integer (the digit strings are tolerated, not published).
_Integer = Annotated[
    int, GetPydanticSchema(lambda _source, _handler: _INTEGER_SCHEMA), WithJsonSchema({"type": "integer"})
]


class EventEnvelope(BaseModel):
    """One room event. Unknown fields are kept (``model_extra``) and otherwise ignored."""

    model_config = ConfigDict(extra="allow", frozen=True)

    event_id: str
    event_type: str
    room_id: str
    app_code: str = ""
    room_version: _Integer | None = None
    occurred_at_ms: _Integer | None = None
    request_id: str | None = None
    command_id: str | None = None
    traceparent: str | None = None
    payload: dict[str, Any] | None = None


#: The row's columns its envelope must agree with: a row whose columns differ from its envelope
#: is a bad envelope, never delivered (the sink goes by the envelope, ordering by the row).
ROW_COLUMNS = ("event_id", "event_type", "room_id", "app_code")
#: Joins :data:`ROW_COLUMNS`' values into one text (the unit separator: no id holds it), so
#: that a relay reads them as one column and compares them with one comparison.
ROW_COLUMNS_SEPARATOR = "\x1f"


def columns_differ(envelope: EventEnvelope, columns: Sequence[str]) -> str | None:
    """The error of a row whose columns (:data:`ROW_COLUMNS`' values, in order) differ from its
    envelope, naming the first that does; None when they agree. A row whose app_code is ''
    (the default of a column its producer never writes) has none of its own: the envelope's
    stands, and its rooms are ordered with the default app's."""
    for name, column in zip(ROW_COLUMNS, columns, strict=True):
        if name == "app_code" and column == "":
            continue
        value = getattr(envelope, name)
        if value != column:
            return f"envelope {name} {value!r} differs from the row's {column!r}"
    return None


def joined_columns_differ(envelope: EventEnvelope, joined: str | bytes) -> str | None:
    """:func:`columns_differ` for columns read as one text, joined by
    :data:`ROW_COLUMNS_SEPARATOR` (bytes where a column is binary): one comparison when they
    agree, as they do but for a bad row."""
    if joined == ROW_COLUMNS_SEPARATOR.join(
        (envelope.event_id, envelope.event_type, envelope.room_id, envelope.app_code)
    ):
        return None
    if not isinstance(joined, str):
        joined = bytes(joined).decode("utf-8", "replace")
    return columns_differ(envelope, joined.split(ROW_COLUMNS_SEPARATOR, len(ROW_COLUMNS) - 1))


#: The default of ``database.max_envelope_bytes``: the longest envelope the stores read. Room
#: events are a few hundred bytes (Tencent IM takes at most 8,000); a process holds about
#: twice a batch's envelopes while it reads and parses them, so that a batch of 100 this size
#: still fits the shipped Kubernetes memory limit (256 Mi). Kafka takes up to 1,000,000 bytes
#: by default: a lane that sends bigger events needs the bound raised, and the limit with it.
MAX_ENVELOPE_BYTES = 256 << 10

#: What the stores read in place of an envelope longer than ``database.max_envelope_bytes``,
#: followed by its size in bytes. It holds a token drawn when the process starts, so that no
#: text a producer wrote can pass for it, whatever it starts with: only this process's own
#: statements make it, and only for an envelope truly above the bound.
TOO_LARGE = f"room-outbox:too-large:{secrets.token_hex(16)}:"


class EnvelopeTooLarge(EnvelopeError):
    """The envelope was longer than ``database.max_envelope_bytes``: nothing of it was read."""


#: The model's validator itself: ``model_validate_json`` without its wrapper, once per row.
_validate_json: Callable[[str], EventEnvelope] = EventEnvelope.__pydantic_validator__.validate_json


def parse_envelope(raw: str | bytes | None) -> EventEnvelope:
    """Parse the envelope column (LONGTEXT, JSON or BLOB) or raise :class:`EnvelopeError`.

    The message names what is wrong without echoing the payload, which may be large.
    """
    if not isinstance(raw, str):
        if raw is None:
            raise EnvelopeError("no envelope: the column is NULL, or the row is gone from room_outbox")
        if not isinstance(raw, bytes | bytearray | memoryview):
            raise EnvelopeError(f"envelope is {type(raw).__name__}, not text or bytes")
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EnvelopeError(f"envelope is not valid UTF-8 (byte {exc.start})") from exc
    try:
        envelope = _validate_json(raw)
    except ValidationError as exc:
        if raw.startswith(TOO_LARGE):
            size = raw.removeprefix(TOO_LARGE)
            raise EnvelopeTooLarge(
                f"envelope too large: {size} bytes, above database.max_envelope_bytes (left unread)"
            ) from None
        # Refused as a whole (not a field of it): perhaps for a lone surrogate, which is worth naming.
        refused_whole = exc.errors(include_url=False, include_input=False)[0]["loc"] == ()
        problem = _lone_surrogate(raw) if refused_whole else None
        raise EnvelopeError(f"malformed envelope: {problem or _describe(exc)}") from exc
    # The event_id is what names the event wherever it goes (processed records, clients'
    # de-duplication): an empty or blank one names none, and a second would pass for the first.
    event_id = envelope.event_id
    if not event_id or event_id.isspace():
        raise EnvelopeError(f"malformed envelope: event_id: {'blank' if event_id else 'empty'}: it names no event")
    # The parser accepts NaN, Infinity and numbers out of range (1e999), which JSON has not:
    # they can only be floats in the payload or in unknown fields (the typed fields refuse them).
    extra = envelope.model_extra
    if not (_all_finite(envelope.payload) and (not extra or _all_finite(extra))):
        where = next(_non_finite({"payload": envelope.payload, **(extra or {})}))
        raise EnvelopeError(f"malformed envelope: {where}: not a finite number (NaN, Infinity or out of range)")
    return envelope


def _all_finite(value: Any) -> bool:
    """Whether every float in ``value`` (dicts and lists within dicts and lists) is finite: a
    loop over the parsed values, cheaper for a room event than any search of its text."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
        elif kind is float and not math.isfinite(item):
            return False
    return True


def _non_finite(value: Any, where: str = "") -> Iterator[str]:
    """The dotted path of each non-finite float in ``value``."""
    if isinstance(value, float) and not math.isfinite(value):
        yield where
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _non_finite(item, f"{where}.{index}")


#: Half of a UTF-16 pair: JSON may escape one (``"\\ud800"``), but it is no character.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(raw: str) -> str | None:
    """Where the first lone surrogate of ``raw`` is (escaped, or a code point of a Python
    caller's text), and which, when that is why the parser refused the document. The parser refuses the document without naming the field (and
    calls a trailing half a leading one); Python's own takes each as the code point it stands
    for, which no UTF-8 text, log line or sink can carry, so its place is found in what that
    one reads. Only an envelope already refused pays for this."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # not JSON for another reason: the parser's own message says why
    for where, text, is_key in _strings(document):
        found = _SURROGATE.search(text)
        if found:
            holder = "a key with a lone surrogate" if is_key else "a lone surrogate"
            return f"{where or 'document'}: {holder} (\\u{ord(found[0]):04x}), half of a UTF-16 pair: not a character"
    return None


def _strings(value: Any, where: str = "") -> Iterator[tuple[str, str, bool]]:
    """Each string in ``value``, in document order: ``(dotted path, text, whether a key)``; a
    key comes before what it holds, so the paths named hold no surrogate themselves."""
    if isinstance(value, str):
        yield where, value, False
    elif isinstance(value, dict):
        for key, item in value.items():
            yield where, key, True
            yield from _strings(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{where}.{index}")


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_url=False)[:3]:
        where = ".".join(str(part) for part in error["loc"]) or "document"
        given = f", not {_given(error['input'])}" if error["type"] == _INTEGER_ERROR else ""
        problems.append(f"{where}: {error['msg']}{given}")
    more = exc.error_count() - len(problems)
    return "; ".join(problems) + (f" (+{more} more)" if more > 0 else "")


def _given(value: Any) -> str:
    """What an integer field was given instead, in a few words: never the value of a string,
    which may be long."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "a number that is not finite"
        return "a number beyond 64 bits" if value.is_integer() else "a number with a fractional part"
    if isinstance(value, str):
        return "a string of too many digits" if _DIGITS.fullmatch(value) else "a string other than decimal digits"
    if isinstance(value, dict):
        return "an object"
    return "an array" if isinstance(value, list) else type(value).__name__


#: The digit strings :data:`_INTEGER_SCHEMA` takes (Python's ``$`` would take a trailing newline).
_DIGITS = re.compile(r"-?[0-9]+")
