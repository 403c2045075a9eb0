"""Structured logs: JSON lines with seed 000's fields, secrets masked."""

from __future__ import annotations

import io
import json
import logging

from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import configure_logging


def test_json_lines_carry_seed_000_fields_and_mask_secrets() -> None:
    stream = io.StringIO()
    redactor = Redactor()
    redactor.add("sup3rsecret")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "node-7", redactor, stream)
        logging.getLogger("room_outbox.dispatcher").warning(
            "delivery failed",
            extra={"event_id": "e1", "event_type": "RoomGiftSent", "room_id": "r_1", "retry_count": 2,
                   "status": "pending", "error": "usersig=sup3rsecret rejected"},
        )  # fmt: skip
        logging.getLogger("room_outbox.dispatcher").debug("not shown at INFO")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    (line,) = stream.getvalue().splitlines()
    doc = json.loads(line)
    assert doc["worker"] == "room_outbox" and doc["node_id"] == "node-7" and doc["level"] == "warning"
    assert {k: doc[k] for k in ("event_id", "event_type", "room_id", "retry_count", "status")} == {
        "event_id": "e1", "event_type": "RoomGiftSent", "room_id": "r_1", "retry_count": 2, "status": "pending",
    }  # fmt: skip
    assert doc["error"] == "usersig=[REDACTED] rejected"
    assert "sup3rsecret" not in line
