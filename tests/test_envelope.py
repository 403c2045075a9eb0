"""The envelope: required fields, unknown fields kept, bad input named."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from room_outbox.consume.messages import Message, Router
from room_outbox.envelope import EnvelopeError, EventEnvelope, parse_envelope


def test_parses_the_design_example_and_keeps_unknown_fields() -> None:
    env = parse_envelope(
        '{"event_id": "evt_1", "event_type": "RoomUserJoined", "app_code": "default", "room_id": "r_10001",'
        ' "room_version": 42, "occurred_at_ms": 1764400000000, "request_id": "req-1", "command_id": "cmd-1",'
        ' "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "payload": {"user_id": "u1"},'
        ' "future_field": [1, 2]}'
    )
    assert (env.event_id, env.room_version, env.payload) == ("evt_1", 42, {"user_id": "u1"})
    assert env.model_extra == {"future_field": [1, 2]}


def test_bytes_are_decoded_as_utf8() -> None:
    assert parse_envelope('{"event_id": "é", "event_type": "T", "room_id": "r"}'.encode()).event_id == "é"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{", "malformed envelope: document: Invalid JSON"),
        ("[]", "malformed envelope: document: Input should be an object"),
        ('{"event_type": "T", "room_id": "r"}', "malformed envelope: event_id: Field required"),
        (
            '{"event_id": "e", "event_type": "T", "room_id": "r", "room_version": "x"}',
            "malformed envelope: room_version:",
        ),
        ('{"event_id": "", "event_type": "T", "room_id": "r"}', "malformed envelope: event_id: empty: it names no"),
        ('{"event_id": " \\t", "event_type": "T", "room_id": "r"}', "malformed envelope: event_id: blank: it names no"),
        (b"\xff", "envelope is not valid UTF-8 (byte 0)"),
        ({"event_id": "e"}, "envelope is dict, not text or bytes"),  # a driver's parsed JSON
        (None, "no envelope: the column is NULL, or the row is gone from room_outbox"),
    ],
)
def test_bad_envelopes_are_named(raw: object, message: str) -> None:
    with pytest.raises(EnvelopeError) as info:
        parse_envelope(raw)
    assert str(info.value).startswith(message), str(info.value)


ROW = '{"event_id": "e", "event_type": "T", "room_id": "r", %s}'


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ('"payload": {"gift": {"value": NaN}}', "payload.gift.value"),
        ('"payload": {"heat": Infinity}', "payload.heat"),
        ('"payload": {"heat": -Infinity}', "payload.heat"),
        ('"payload": {"scores": [1, 1e999]}', "payload.scores.1"),
        ('"payload": {"x": -1E+400}', "payload.x"),
        ('"payload": {"x": 2.5e1000}', "payload.x"),
        ('"future_field": {"y": NaN}', "future_field.y"),
    ],
)
def test_a_non_finite_number_is_a_bad_envelope(fields: str, where: str) -> None:
    """JSON has no NaN or Infinity, and an IM client must never receive them."""
    with pytest.raises(EnvelopeError) as info:
        parse_envelope(ROW % fields)
    assert str(info.value) == f"malformed envelope: {where}: not a finite number (NaN, Infinity or out of range)"


def test_text_and_large_finite_numbers_that_look_alike_still_parse() -> None:
    env = parse_envelope(ROW % '"payload": {"text": "NaN Infinity 1e999", "big": 1e308, "e": "e123"}')
    assert env.payload == {"text": "NaN Infinity 1e999", "big": 1e308, "e": "e123"}


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ('"payload": {"text": "\\ud800"}', "payload.text: a lone surrogate (\\ud800)"),
        ('"payload": {"text": "x\\ud800\\u0041"}', "payload.text: a lone surrogate (\\ud800)"),
        ('"payload": {"seats": [{"name": "\\udfff"}]}', "payload.seats.0.name: a lone surrogate (\\udfff)"),
        ('"payload": {"\\udc00": 1}', "payload: a key with a lone surrogate (\\udc00)"),
        ('"request_id": "\\ud83c"', "request_id: a lone surrogate (\\ud83c)"),
        ('"future_field": ["\\udc00"]', "future_field.0: a lone surrogate (\\udc00)"),
    ],
)
def test_a_lone_surrogate_is_a_bad_envelope_naming_its_field(fields: str, where: str) -> None:
    """Half of a UTF-16 pair is no character: no UTF-8 text, log line or sink could carry it."""
    with pytest.raises(EnvelopeError) as info:
        parse_envelope(ROW % fields)
    assert str(info.value) == f"malformed envelope: {where}, half of a UTF-16 pair: not a character"
    str(info.value).encode()  # the error itself holds none: it is written to the row and logged


def test_a_surrogate_pair_is_one_character() -> None:
    assert parse_envelope(ROW % '"payload": {"text": "\\ud83c\\udf89"}').payload == {"text": "🎉"}


def test_a_lone_surrogate_in_a_callers_text_is_named_too() -> None:
    """Not an escape but the code point itself, in text a Python caller hands over."""
    with pytest.raises(EnvelopeError, match=r"^malformed envelope: event_id: a lone surrogate \(\\ud800\)"):
        parse_envelope('{"event_id": "\ud800", "event_type": "T", "room_id": "r"}')


def test_other_invalid_json_keeps_the_parsers_message() -> None:
    with pytest.raises(EnvelopeError, match=r"^malformed envelope: document: Invalid JSON: EOF while parsing"):
        parse_envelope('{"event_id": "e", "payload": {"text": "x"')


@pytest.mark.parametrize(
    ("value", "read"),
    [
        ("17", 17),
        ("-3", -3),
        ("0", 0),
        ("123456789012345678901234567890", 123456789012345678901234567890),  # as before: no bound
        ("17.0", 17),  # JSON Schema's "integer" admits a number with no fractional part
        ("1.7648928e12", 1764892800000),
        ("-0.0", 0),
        ('"17"', 17),  # a producer writing it as a string keeps working
        ('"-3"', -3),
        ('"007"', 7),
        ("null", None),
    ],
)
@pytest.mark.parametrize("field", ["room_version", "occurred_at_ms"])
def test_an_integer_field_takes_an_integer_a_whole_number_or_a_digit_string(
    field: str, value: str, read: int | None
) -> None:
    assert getattr(parse_envelope(ROW % f'"{field}": {value}'), field) == read


@pytest.mark.parametrize(
    ("value", "given"),
    [
        ("true", "true"),
        ("false", "false"),
        ('"5_000"', "a string other than decimal digits"),
        ('" 7 "', "a string other than decimal digits"),
        ('"7\\n"', "a string other than decimal digits"),
        ('"+5"', "a string other than decimal digits"),
        ('"--5"', "a string other than decimal digits"),
        ('"-"', "a string other than decimal digits"),
        ('""', "a string other than decimal digits"),
        ('"5.0"', "a string other than decimal digits"),
        ('"1e3"', "a string other than decimal digits"),
        ('"0x10"', "a string other than decimal digits"),
        ('"\\u0663"', "a string other than decimal digits"),  # ARABIC-INDIC DIGIT THREE
        (f'"{"1" * 5000}"', "a string of too many digits"),
        ("1.5", "a number with a fractional part"),
        ("-0.25", "a number with a fractional part"),
        ("1e300", "a number beyond 64 bits"),
        ("NaN", "a number that is not finite"),
        ("-Infinity", "a number that is not finite"),
        ("[1]", "an array"),
        ('{"v": 1}', "an object"),
    ],
)
@pytest.mark.parametrize("field", ["room_version", "occurred_at_ms"])
def test_an_integer_field_refuses_anything_else_naming_the_field(field: str, value: str, given: str) -> None:
    """Never rewritten into a number the sinks would send on (``true`` as 1, ``"5_000"`` as 5000)."""
    with pytest.raises(EnvelopeError) as info:
        parse_envelope(ROW % f'"{field}": {value}')
    assert str(info.value) == (
        f"malformed envelope: {field}: Input should be an integer"
        f" (a whole number, or its decimal digits in a string), not {given}"
    )


def test_integers_read_from_other_forms_go_on_as_json_integers() -> None:
    """What the sinks send (the Kafka value, the IM message's data) holds the integer read."""
    env = parse_envelope(ROW % '"room_version": "17", "occurred_at_ms": 1.7648928e12')
    sent = json.loads(env.model_dump_json())
    assert (sent["room_version"], sent["occurred_at_ms"]) == (17, 1764892800000)


def test_a_producer_building_an_envelope_in_python_is_held_to_the_same_rule() -> None:
    assert EventEnvelope(event_id="e", event_type="T", room_id="r", room_version="17").room_version == 17
    with pytest.raises(ValidationError, match="room_version"):
        EventEnvelope(event_id="e", event_type="T", room_id="r", room_version=True)


def test_a_consumer_rejects_a_message_whose_integer_field_is_no_integer() -> None:
    """The consumer parses each Kafka value as the relays parse each row: a dead letter naming the field."""
    message = Message(
        topic="t", partition=0, offset=0, key="", value=(ROW % '"room_version": true').encode(), headers={}
    )
    Router.parse(message)
    assert message.rejected is not None and message.envelope is None
    assert message.rejected.startswith("unparsable value: malformed envelope: room_version: Input should be an integer")
