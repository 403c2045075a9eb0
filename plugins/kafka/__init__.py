"""The Kafka sink: every room event to a topic, for downstream consumers.

It keeps a lane of its own (``room_outbox_lane_kafka``), so a Kafka outage never delays IM
delivery and an IM outage never delays Kafka. Messages: key ``{app_code}:{room_id}`` (one room
stays in one partition, in order — with ``outbox_worker.ordering: per_room`` the lane also
sends a room's events one after another), value the envelope as JSON, headers ``event_id``,
``event_type`` and ``traceparent``. An event counts as delivered only once the broker has
acknowledged it (``acks=all``); until then it is retried, so a broker outage loses nothing.

``idempotence``: ``auto`` (default) asks the broker for an idempotent producer and, when the
broker refuses (some Kafka-compatible brokers do not implement InitProducerId), logs it and
goes on without — duplicates after a retried send are then possible, as with any
at-least-once delivery; ``true`` refuses to run without it; ``false`` never asks.

``security``: TLS and SASL (:class:`room_outbox.kafka_security.KafkaSecurity`, the same
settings ``room-outbox consume`` takes); its secrets are registered for redaction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from room_outbox import Duration, KafkaSecurity, SinkContext, SinkSettings, SinkSpec, hookimpl

if TYPE_CHECKING:
    from room_outbox.plugins.kafka.sink import KafkaSink


class KafkaSettings(SinkSettings):
    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "room-events"
    client_id: str = "room-outbox"
    idempotence: Literal["auto", "true", "false"] = "auto"
    #: How long one send may wait for the broker's acknowledgement before failing (retryable).
    request_timeout: Duration = 5.0
    max_message_bytes: int = Field(default=1_000_000, ge=1024)
    security: KafkaSecurity = KafkaSecurity()


def kafka_sink(settings: KafkaSettings, context: SinkContext) -> KafkaSink:
    """The sink, its module imported here: a process without the Kafka lane never loads the
    Kafka client."""
    from room_outbox.plugins.kafka.sink import KafkaSink

    return KafkaSink(settings, context)


@hookimpl
def room_outbox_register_sinks() -> list[SinkSpec[KafkaSettings]]:
    return [SinkSpec("kafka", kafka_sink, settings_model=KafkaSettings, own_lane=True, ordered_log=True)]


__all__ = ["KafkaSettings", "kafka_sink"]
