"""Structured logs: one JSON object per line on stderr, with seed 000's fields.

Every line carries ``worker`` ("room_outbox") and ``node_id``; event lines add ``event_id``,
``event_type``, ``room_id``, ``retry_count``, ``status``, ``error`` (passed as ``extra=``).
The whole line goes through the :class:`~room_outbox.redaction.Redactor` last, so a secret
that slipped into a message or an exception is still masked.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

from room_outbox.redaction import Redactor

WORKER = "room_outbox"
_RECORD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, node_id: str, redactor: Redactor) -> None:
        super().__init__()
        self.node_id = node_id
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "worker": WORKER,
            "node_id": self.node_id,
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return self.redactor.redact(json.dumps(doc, default=str, ensure_ascii=False))


def configure_logging(level: str, node_id: str, redactor: Redactor, stream: IO[str] | None = None) -> None:
    """Route every logger to JSON lines on ``stream`` (stderr by default)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(node_id, redactor))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
