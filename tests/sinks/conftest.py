"""Fixtures of the sink contract tests: the Kafka lane tests' broker (tansu, memory only) and its message limit."""

from __future__ import annotations

from lanes.conftest import broker_message_limit, kafka_broker

__all__ = ["broker_message_limit", "kafka_broker"]
