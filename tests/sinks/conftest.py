"""Fixtures of the sink contract tests: the Kafka lane tests' broker (tansu, memory only)."""

from __future__ import annotations

from lanes.conftest import kafka_broker

__all__ = ["kafka_broker"]
