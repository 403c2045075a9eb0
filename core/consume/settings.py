"""``consumers.<name>``: one Kafka consumer group running handlers.

Kept as plain mappings in :class:`~room_outbox.config.Settings` and validated here, by
:func:`consumer_settings`, the way sink sections are validated by their sinks: the handlers'
own sections (``handler_settings.<handler>``) need the plugins loaded first.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator

from room_outbox.config import ORDERINGS, ConfigError, Duration, Section, Settings, _one_of, describe_validation_error
from room_outbox.kafka_security import KafkaSecurity


class ConsumerRetrySettings(Section):
    """Failed handlings wait in ``room_consumer_retry`` (the partition moves on) and come back
    after ``base × factor^(attempts-1)`` (capped, ± jitter); after ``max_attempts`` they are
    dead letters."""

    base: Duration = 1.0
    factor: float = Field(default=2.0, ge=1.0)
    cap: Duration = 300.0
    jitter: float = Field(default=0.1, ge=0.0, le=1.0)
    max_attempts: int = Field(default=10, ge=1)
    #: How often the retry table is looked at when it had nothing due.
    poll_interval: Duration = 1.0

    @field_validator("base", "cap", "poll_interval")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be a positive duration")
        return value


#: Kafka's protocol carries a group's timeouts (session, rebalance) as signed 32-bit counts of
#: milliseconds, about 24.8 days: a larger one cannot be sent, and the member never joins.
MAX_GROUP_TIMEOUT_MS = 2**31 - 1


class ConsumerSettings(Section):
    enabled: bool = True
    bootstrap_servers: str = "127.0.0.1:9092"
    #: The topic the Kafka sink writes (``sinks.kafka.topic``).
    topic: str = "room-events"
    #: Kafka consumer group; default ``room-outbox.<consumer name>``. Processes with the same
    #: group share the topic's partitions.
    group_id: str = ""
    #: Handler names (``room_outbox_register_handlers``); each message goes to every handler
    #: here that takes its event type.
    handlers: list[str] = Field(min_length=1)
    #: ``handler_settings.<handler>``: validated by the handler's own settings model.
    handler_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: Messages handled at the same time (different keys: a room's events run one by one).
    concurrency: int = Field(default=16, ge=1, le=1024)
    #: Messages fetched per round; the round's offsets are committed once all are settled.
    max_batch: int = Field(default=500, ge=1, le=100_000)
    #: One handling (database transaction included) may take this long; then it is a failure.
    #: In a rebalance the group waits for a member's batch as long as its deadlines allow, this
    #: times about 2 × ``max_batch``, up to Kafka's limit of about 24.8 days (2^31 - 1 ms): a
    #: longer wait is capped there, the setting is not refused.
    handler_timeout: Duration = 10.0
    #: ``per_room``: a room's later events wait behind its event in retry (the room's order
    #: holds). ``none``: they go ahead.
    ordering: str = "per_room"
    retry: ConsumerRetrySettings = ConsumerRetrySettings()
    #: Dead letters always go to ``room_consumer_retry`` (status ``dead``); a copy goes to this
    #: topic (default ``<topic>.dlq``), the error in its headers. ``false``: no copy.
    dead_letter_topic: str | bool = True
    #: Kafka's group session timeout: a member silent this long (killed, stopped) loses its
    #: partitions to the others. At most about 24.8 days (2^31 - 1 ms, Kafka's limit); brokers
    #: refuse more than their ``group.max.session.timeout.ms`` (Kafka's default: 30 minutes).
    session_timeout: Duration = 10.0
    #: The client id the group's members give the broker (`consumers describe` lists it per member).
    client_id: str = "room-outbox-consumer"
    security: KafkaSecurity = KafkaSecurity()

    @field_validator("ordering")
    @classmethod
    def _known_ordering(cls, value: str) -> str:
        return _one_of(value, ORDERINGS, "ordering")

    @field_validator("handler_timeout", "session_timeout")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be a positive duration")
        return value

    @field_validator("session_timeout")
    @classmethod
    def _sendable(cls, value: float) -> float:
        if value * 1000 > MAX_GROUP_TIMEOUT_MS:
            raise ValueError(f"must be at most {MAX_GROUP_TIMEOUT_MS / 1000}s, about 24 days (Kafka's limit)")
        return value

    def group(self, name: str) -> str:
        return self.group_id.strip() or f"room-outbox.{name}"

    def dlq_topic(self) -> str | None:
        if self.dead_letter_topic is True:
            return f"{self.topic}.dlq"
        if self.dead_letter_topic is False or not str(self.dead_letter_topic).strip():
            return None
        return str(self.dead_letter_topic).strip()


#: The ``consumer`` column is VARCHAR(64) (and the lock owner ``<identity>#<consumer>``
#: must fit its 128 too: checked with the node_id, see ``check_consumers``).
MAX_CONSUMER_NAME = 63


def consumer_settings(settings: Settings, only: str | None = None) -> dict[str, ConsumerSettings]:
    """The enabled consumers (or ``only``, enabled or not), validated; :class:`ConfigError`
    names every bad key as ``consumers.<name>.<key>``."""
    if only is not None and only not in settings.consumers:
        known = ", ".join(sorted(settings.consumers)) or "none configured"
        raise ConfigError(f"consumers.{only}: no such consumer (configured: {known})")
    found: dict[str, ConsumerSettings] = {}
    problems: list[str] = []
    for name, section in sorted(settings.consumers.items()):
        if only is not None and name != only:
            continue
        if not name.strip() or len(name) > MAX_CONSUMER_NAME or not name.isprintable():
            problems.append(
                f"consumers.{name}: a consumer's name is 1 to {MAX_CONSUMER_NAME} printable characters"
                " (the consumer column's limit)"
            )
            continue
        try:
            consumer = ConsumerSettings.model_validate(section or {})
        except ValidationError as exc:
            problems.append(
                describe_validation_error(exc, f"consumers.{name}").removeprefix("invalid configuration:\n  ")
            )
            continue
        if consumer.enabled or only is not None:
            found[name] = consumer
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return found
