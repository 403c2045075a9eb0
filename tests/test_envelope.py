"""The envelope: required fields, unknown fields kept, bad input named."""

from __future__ import annotations

import pytest

from room_outbox.envelope import EnvelopeError, parse_envelope


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
