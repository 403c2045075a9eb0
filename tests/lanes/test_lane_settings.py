"""outbox_worker.lanes.<lane>: per-lane delivery settings merged over outbox_worker."""

from __future__ import annotations

import pytest

from room_outbox.attempt.retry import RetryPolicy
from room_outbox.config import ConfigError, Settings, describe_validation_error
from room_outbox.delivery.dispatcher import LaneOptions
from room_outbox.delivery.routing import build_lanes
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager

pytestmark = pytest.mark.anyio


def test_a_lane_overrides_any_key_and_inherits_the_rest() -> None:
    settings = Settings(
        outbox_worker={
            "poll_interval": "2s",
            "retry": {"base": "3s", "cap": "1m"},
            "lanes": {"kafka": {"retry_strategy": "exponential", "parking": True, "batch_size": 500,
                                "concurrency": 4, "ordering": "per_room", "publish_timeout": "10s",
                                "retry": {"max_attempts": 5}}},
        }
    )  # fmt: skip
    kafka = settings.outbox_worker.for_lane("kafka")
    assert (kafka.retry_strategy, kafka.parking, kafka.batch_size, kafka.concurrency, kafka.ordering) == (
        "exponential", True, 500, 4, "per_room",
    )  # fmt: skip
    assert (kafka.poll_interval, kafka.publish_timeout, kafka.lease_seconds) == (2.0, 10.0, 100.0)
    assert (kafka.retry.base, kafka.retry.cap, kafka.retry.max_attempts) == (3.0, 60.0, 5)  # merged key by key
    im = settings.outbox_worker.for_lane("im")
    assert (im.retry_strategy, im.parking, im.batch_size, im.retry.max_attempts) == ("fixed_interval", False, 100, 0)


def test_every_bad_key_of_a_lane_is_named_with_its_dotted_path() -> None:
    with pytest.raises(Exception) as info:
        Settings(outbox_worker={"lanes": {
            "kafka": {"retry_strategy": "sometimes", "bacth_size": 5},
            "main": {"enabled": False, "retry": {"factor": 0.5}},
            "audit": {"retry": {"max_attempts": 3}},  # needs parking, here or in outbox_worker
        }})  # fmt: skip
    text = describe_validation_error(info.value)  # type: ignore[arg-type]
    assert "outbox_worker.lanes.kafka.retry_strategy: unknown retry strategy 'sometimes'" in text
    assert "outbox_worker.lanes.kafka.bacth_size: Extra inputs are not permitted" in text
    assert "outbox_worker.lanes.main.enabled: belongs to outbox_worker, not to one lane" in text
    assert "outbox_worker.lanes.main.retry.factor" in text
    assert "outbox_worker.lanes.audit: retry.max_attempts needs parking: true" in text


async def test_a_lane_that_does_not_exist_or_shares_the_main_lane_is_refused() -> None:
    settings = Settings(outbox_worker={"lanes": {"kafak": {}, "noop": {}}}, sinks={"tencent_im": {"enabled": False}})
    with pytest.raises(ConfigError) as info:
        await build_lanes(make_plugin_manager(), settings, Redactor())
    assert "outbox_worker.lanes.kafak: no lane named 'kafak' (lanes: main, " in str(info.value)
    assert (
        "outbox_worker.lanes.noop: sink 'noop' shares the main lane; its settings are outbox_worker.lanes.main"
        in str(info.value)
    )


def test_option_defaults_are_the_configuration_defaults() -> None:
    defaults = Settings().outbox_worker
    assert LaneOptions() == LaneOptions.from_settings(defaults)
    assert RetryPolicy() == RetryPolicy.from_settings(defaults)
