"""OTLP over gRPC is the `otlp-grpc` extra: asked for without it, start-up stops with one line
naming the extra, instead of an ImportError's traceback."""

from __future__ import annotations

import sys

import pytest

from room_outbox.config import ConfigError
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import telemetry_from_environment


def test_grpc_without_the_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc", None)  # not installed
    with pytest.raises(ConfigError, match=r"room-outbox\[otlp-grpc\]"):
        telemetry_from_environment(
            "n", Redactor(), environ={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        )
