"""Configuration of the sink: required keys, secrets from the environment, redaction, routing."""

from __future__ import annotations

from pathlib import Path

import pytest

from room_outbox.config import ConfigError, Settings, load_settings
from room_outbox.delivery.routing import build_router, enabled_sink_settings
from room_outbox.envelope import KNOWN_EVENT_TYPES
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.tencent_im import TencentIMSettings

pytestmark = pytest.mark.anyio


def validate(section: dict[str, object] | None) -> dict[str, object]:
    settings = Settings(sinks={} if section is None else {"tencent_im": section})
    return dict(enabled_sink_settings(make_plugin_manager(), settings))


def test_enabled_without_a_secret_key_stops_start_up_naming_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        validate({"sdkappid": 1400000000})
    message = str(info.value)
    assert "sinks.tencent_im.secret_key" in message
    assert "ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY" in message


def test_enabled_by_default_so_no_section_means_credentials_are_required() -> None:
    with pytest.raises(ConfigError) as info:
        validate(None)
    assert "sinks.tencent_im.sdkappid" in str(info.value) and "sinks.tencent_im.secret_key" in str(info.value)


def test_disabled_needs_nothing() -> None:
    assert "tencent_im" not in validate({"enabled": False})


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"group_id_template": "{room}"}, "group_id_template"),
        ({"group_id_template": "fixed"}, "group_id_template"),
        ({"base_url": "console.tim.qq.com"}, "base_url"),
        ({"msg_priority": {"RoomGiftSent": "Urgent"}}, "msg_priority.RoomGiftSent"),
        ({"apps": {"game2": {"sdkappid": 5}}}, "apps.game2.secret_key"),
        (
            {"apps": {"default": {"sdkappid": 5, "secret_key": "k2k2k2"}}},
            "apps: app codes ['default'] are also in default_app_codes",
        ),
        ({"app_rate_limit": 0}, "app_rate_limit"),
        ({"usersig_ttl": "0s"}, "usersig_ttl: 0s is too short: at least 60s"),
        ({"usersig_ttl": "-5s"}, "usersig_ttl: -5s is too short"),
        ({"usersig_ttl": "0.5s"}, "usersig_ttl: 0.5s is too short"),
        ({"usersig_ttl": "59s"}, "usersig_ttl: 59s is too short"),
        ({"secret_kye": "x"}, "secret_kye"),
    ],
)
def test_bad_values_name_their_key(section: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate({"sdkappid": 1400000000, "secret_key": "dev-key-123", **section})
    assert f"sinks.tencent_im.{key}" in str(info.value)


def test_a_usersig_ttl_of_a_minute_or_more_is_accepted() -> None:
    (_, validated) = validate({"sdkappid": 1400000000, "secret_key": "dev-key-123", "usersig_ttl": "1m"})["tencent_im"]
    assert isinstance(validated, TencentIMSettings) and validated.usersig_ttl == 60


def test_secrets_and_app_entries_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "sinks:\n  tencent_im:\n    sdkappid: 1400000000\n    apps:\n      Game2:\n        sdkappid: 1400000002\n"
    )
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY", "default-key-from-env")
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__APPS__GAME2__SECRET_KEY", "game2-key-from-env")
    (_, validated) = enabled_sink_settings(make_plugin_manager(), load_settings(config))["tencent_im"]
    assert isinstance(validated, TencentIMSettings)
    assert validated.secret_key.get_secret_value() == "default-key-from-env"
    assert validated.apps["Game2"].secret_key.get_secret_value() == "game2-key-from-env"
    assert "default-key-from-env" not in repr(validated)


def test_a_config_error_never_echoes_the_key() -> None:
    with pytest.raises(ConfigError) as info:
        validate({"sdkappid": "not-a-number", "secret_key": "very-secret-key-value"})
    assert "very-secret-key-value" not in str(info.value)


async def test_router_sends_every_non_noop_type_to_tencent_and_registers_secrets() -> None:
    redactor = Redactor()
    settings = Settings(
        sinks={"tencent_im": {"sdkappid": 1400000000, "secret_key": "dev-key-123", "base_url": "http://127.0.0.1:9"}}
    )
    router = await build_router(make_plugin_manager(), settings, redactor)
    try:
        noop_types = {"RoomCreated", "RoomHeatChanged", "RoomRankChanged"}
        assert {t for t, s in router.routes.items() if s == "noop"} == noop_types
        assert {t for t, s in router.routes.items() if s == "tencent_im"} == KNOWN_EVENT_TYPES - noop_types
        assert redactor.redact("key=dev-key-123") == "key=[REDACTED]"
    finally:
        await router.aclose()


CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"


@pytest.mark.parametrize("name", ["config.yaml", "config.docker.yaml", "config.tencent.example.yaml"])
def test_shipped_sections_validate(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY", "key-from-the-environment")
    (_, validated) = enabled_sink_settings(make_plugin_manager(), load_settings(CONFIG_DIR / name))["tencent_im"]
    assert isinstance(validated, TencentIMSettings)


def test_local_config_matches_the_fake_im_defaults() -> None:
    """`scripts/run.sh` + `room-outbox fake-im --port 8090` work together out of the box."""
    from room_outbox.plugins.tencent_im.fake import DEV_KEY, DEV_SDKAPPID

    (_, local) = enabled_sink_settings(make_plugin_manager(), load_settings(CONFIG_DIR / "config.yaml"))["tencent_im"]
    assert isinstance(local, TencentIMSettings)
    assert (local.base_url, local.sdkappid, local.secret_key.get_secret_value()) == (
        "http://127.0.0.1:8090",
        DEV_SDKAPPID,
        DEV_KEY,
    )


def test_example_documents_every_key() -> None:
    import yaml

    section = yaml.safe_load((CONFIG_DIR / "config.tencent.example.yaml").read_text())["sinks"]["tencent_im"]
    # The sink's own keys plus the two every sink has; other base keys (own-lane options)
    # do not apply to the main lane.
    from room_outbox.sink import SinkSettings

    own = set(TencentIMSettings.model_fields) - set(SinkSettings.model_fields)
    assert set(section) == own | {"enabled", "event_types"}
    assert section["secret_key"] == ""  # secrets only through the environment
