"""outbox_worker.lanes.<lane>: per-lane delivery settings merged over outbox_worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from room_outbox.attempt.retry import RetryPolicy
from room_outbox.cli.main import main
from room_outbox.config import ConfigError, Settings, describe_validation_error
from room_outbox.delivery.dispatcher import LaneOptions
from room_outbox.delivery.routing import build_lanes
from room_outbox.delivery.tail import LANE_TABLE_ONLY_SETTINGS
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


LANE_TABLE_ONLY = (
    "    kafka:\n      retry_strategy: exponential\n      parking: true\n      batch_size: 500\n"
    "      retry: {base: 1s, max_attempts: 20}\n      ordering: per_room\n      concurrency: 4\n      lease: 1m\n"
)


@pytest.mark.parametrize("as_json", [False, True])
def test_check_config_warns_of_lane_settings_a_tailing_lane_ignores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "database: {dsn: 'sqlite:///x.db'}\noutbox_worker:\n  poll_interval: 2s\n  lanes:\n" + LANE_TABLE_ONLY
        + "sinks:\n  tencent_im: {enabled: false}\n  kafka: {enabled: true, bootstrap_servers: '127.0.0.1:1'}\n"
    )  # fmt: skip
    assert main(["--config", str(path), "check-config", *(["--json"] if as_json else [])]) == 0
    out = capsys.readouterr().out
    (warning,) = json.loads(out)["warnings"] if as_json else [line for line in out.splitlines() if "warning" in line]
    keys = "retry_strategy, retry.base, retry.max_attempts, parking, ordering, concurrency, lease"
    named = ", ".join(f"outbox_worker.lanes.kafka.{key}" for key in keys.split(", "))
    assert warning == ("" if as_json else "warning: ") + (
        f"{named}: ignored while the kafka lane tails room_outbox (sinks.kafka.relay: tail);"
        " they take effect only with relay: lane_table"
    )
    # The relay reads batch_size (and poll_interval, publish_timeout); outbox_worker's own keys
    # are every lane's, the main lane's among them: neither is named.
    assert "batch_size" not in warning and "poll_interval" not in warning


def test_a_lane_table_lane_honours_those_settings_without_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "database: {dsn: 'sqlite:///x.db'}\noutbox_worker:\n  lanes:\n" + LANE_TABLE_ONLY + "sinks:\n"
        "  tencent_im: {enabled: false}\n  kafka: {enabled: true, bootstrap_servers: '127.0.0.1:1', relay: lane_table}\n"
    )  # fmt: skip
    assert main(["--config", str(path), "check-config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_the_kafka_only_config_sets_nothing_its_tailing_lane_ignores() -> None:
    config = yaml.safe_load((Path(__file__).parents[2] / "config" / "config.kafka-only.yaml").read_text())
    assert config["sinks"]["kafka"]["relay"] == "tail"
    assert set(config["outbox_worker"]) & set(LANE_TABLE_ONLY_SETTINGS) == set()


def test_option_defaults_are_the_configuration_defaults() -> None:
    defaults = Settings().outbox_worker
    assert LaneOptions() == LaneOptions.from_settings(defaults)
    assert RetryPolicy() == RetryPolicy.from_settings(defaults)
