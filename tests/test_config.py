"""Configuration: seed 000's defaults and normalisation rules, durations, YAML + environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from room_outbox.cli.command import default_config
from room_outbox.config import ConfigError, load_settings, parse_duration
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.startup import check_configuration


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ROOM_OUTBOX__"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_seed_000_defaults_without_any_file() -> None:
    worker = load_settings().outbox_worker
    assert (worker.enabled, worker.poll_interval, worker.batch_size, worker.publish_timeout, worker.retry_strategy) == (
        True, 1.0, 100, 3.0, "fixed_interval",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        # seed 000: <= 0 falls back to the default (no busy loop, no full scan, no unbounded publish)
        ("poll_interval", '"0s"', 1.0),
        ("poll_interval", '"-5s"', 1.0),
        ("batch_size", "0", 100),
        ("batch_size", "-1", 100),
        ("publish_timeout", "0", 3.0),
        ("publish_timeout", '"-1ms"', 3.0),
        ("concurrency", "0", 16),
        # positive values are kept
        ("poll_interval", '"500ms"', 0.5),
        ("batch_size", "500", 500),
        ("publish_timeout", '"2m"', 120.0),
        # empty retry_strategy means the default
        ("retry_strategy", '""', "fixed_interval"),
        ("retry_strategy", '"fixed_interval"', "fixed_interval"),
        ("enabled", "false", False),
    ],
)
def test_outbox_worker_normalisation(tmp_path: Path, key: str, value: str, expected: object) -> None:
    settings = load_settings(write(tmp_path, f"outbox_worker:\n  {key}: {value}\n"))
    assert getattr(settings.outbox_worker, key) == expected


def test_unknown_retry_strategy_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "outbox_worker:\n  retry_strategy: exponentail\n"))
    assert "outbox_worker.retry_strategy" in str(info.value)
    assert "exponentail" in str(info.value)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("1s", 1.0),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("7d", 604800.0),
        ("1.5s", 1.5),
        (2, 2.0),
        ("3", 3.0),
        (0.25, 0.25),
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "1 fortnight", "", "1sm", True, float("inf"), float("nan"), "3651d", 1e300])
def test_bad_durations_are_rejected(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_bad_duration_in_file_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "outbox_worker:\n  poll_interval: soon\n"))
    assert "outbox_worker.poll_interval" in str(info.value)


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        ("outbox_worker:\n  lease: .inf\n", "outbox_worker.lease", "longer than any wait"),
        ("outbox_worker:\n  publish_timeout: .inf\n", "outbox_worker.publish_timeout", "longer than any wait"),
        ("outbox_worker:\n  lease: 999999999999d\n", "outbox_worker.lease", "longer than any wait"),
        ("outbox_worker:\n  lease: 100ms\n", "outbox_worker.lease", "below 1s"),
        ("outbox_worker:\n  poll_interval: 1ms\n", "outbox_worker.poll_interval", "below 50ms"),
        ("outbox_worker:\n  concurrency: 100000\n", "outbox_worker.concurrency", "less than or equal to 10000"),
        ("outbox_worker:\n  lanes:\n    kafka:\n      poll_interval: 1ms\n", "lanes.kafka.poll_interval", "50ms"),
    ],
)
def test_worker_settings_that_could_never_deliver_are_refused_naming_the_key(
    tmp_path: Path, text: str, key: str, says: str
) -> None:
    """Accepted before, they started a process that never delivered: an infinite or overlong
    wait (a lease no millisecond column holds), a lease shorter than the statements' timeout
    allows, a poll that keeps an idle process busy, a million delivery tasks a round."""
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert key in str(info.value) and says in str(info.value)


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path, "outbox_worker:\n  batch_size: 50\n  poll_interval: 2s\nsinks:\n  noop:\n    enabled: true\n"
    )
    monkeypatch.setenv("ROOM_OUTBOX__OUTBOX_WORKER__BATCH_SIZE", "500")
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__NOOP__ENABLED", "false")
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY", "k" * 16)
    settings = load_settings(path)
    assert settings.outbox_worker.batch_size == 500
    assert settings.outbox_worker.poll_interval == 2.0  # from the file, untouched
    assert settings.sinks["noop"]["enabled"] == "false"  # validated later by the sink's own model
    assert settings.sinks["tencent_im"]["secret_key"] == "k" * 16


def test_claim_after_defaults_to_five_seconds_and_takes_a_duration(tmp_path: Path) -> None:
    assert load_settings().outbox_worker.claim_after == 5.0
    assert load_settings(write(tmp_path, "outbox_worker:\n  claim_after: 0s\n")).outbox_worker.claim_after == 0.0
    lane = load_settings(write(tmp_path, "outbox_worker:\n  lanes: {main: {claim_after: 1500ms}}\n"))
    assert lane.outbox_worker.for_lane("main").claim_after == 1.5


def test_the_main_lanes_former_names_still_work_with_a_deprecation_line(tmp_path: Path) -> None:
    """``im`` was the main lane's name: files that use it keep working, and say so."""
    former = load_settings(
        write(tmp_path, "outbox_worker:\n  lanes: {im: {claim_after: 1500ms}}\nrouting:\n  im_default: known\n")
    )
    assert former.outbox_worker.for_lane("main").claim_after == 1.5
    assert former.routing.main_default == "known"
    assert former.deprecated_names == [
        "outbox_worker.lanes.im is deprecated: call it outbox_worker.lanes.main",
        "routing.im_default is deprecated: call it routing.main_default",
    ]
    assert load_settings().deprecated_names == []
    with pytest.raises(ConfigError, match="give main_default alone"):
        load_settings(write(tmp_path, "routing:\n  im_default: known\n  main_default: all\n"))
    with pytest.raises(ConfigError, match=r"give lanes\.main alone"):
        load_settings(write(tmp_path, "outbox_worker:\n  lanes: {im: {}, main: {}}\n"))


def test_a_negative_claim_after_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"outbox_worker\.claim_after"):
        load_settings(write(tmp_path, "outbox_worker:\n  claim_after: -1s\n"))


def test_batch_size_is_bounded(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"outbox_worker\.batch_size"):
        load_settings(write(tmp_path, "outbox_worker:\n  batch_size: 50000\n"))


def test_misspelt_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "outbox_worker:\n  poll_intervall: 1s\n"))
    assert "outbox_worker.poll_intervall" in str(info.value)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "outbox_worker:\n  retry_strategy: nope\n  batch_size: many\n"))
    message = str(info.value)
    assert "outbox_worker.retry_strategy" in message and "outbox_worker.batch_size" in message


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file .*missing\.yaml"):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(write(tmp_path, "outbox_worker: [\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("outbox_worker:\n  batch_size: 100\n  batch_size: 500\n", "line 3, column 3: the key batch_size appears twice in one mapping (lines 2 and 3)"),
        ("mysql:\n  pool_size: 2\nlog:\n  level: INFO\nmysql:\n  dsn: 'mysql://u:hunter22@h/db'\n", "the key mysql appears twice in one mapping (lines 1 and 5)"),
    ],
)  # fmt: skip
def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path: Path, text: str, where: str) -> None:
    """PyYAML keeps the last of two equal keys silently: half of such a configuration would be
    ignored without a word."""
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert where in str(info.value) and "hunter22" not in str(info.value)


def test_a_merged_key_may_be_overridden(tmp_path: Path) -> None:
    """A key a merge (``<<``) brings in is a default the mapping may override, as YAML means."""
    text = (
        "outbox_worker:\n  retry: &r\n    base: 2s\n    cap: 1m\n"
        "  lanes:\n    kafka:\n      retry:\n        <<: *r\n        base: 5s\n"
    )
    lanes = load_settings(write(tmp_path, text)).outbox_worker.lanes
    assert lanes == {"kafka": {"retry": {"base": "5s", "cap": "1m"}}}


def test_an_environment_variable_whose_json_breaks_is_named_not_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A section or list given whole in the environment is JSON; broken, it was a traceback."""
    monkeypatch.setenv("ROOM_OUTBOX__OUTBOX_WORKER__LANES", '{"kafka": {"retry": {"base": "hunter22"}}')
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert message == (
        "invalid environment: ROOM_OUTBOX__OUTBOX_WORKER__LANES: not valid JSON"
        " (Expecting ',' delimiter at character 41)"
    )


@pytest.mark.parametrize(
    ("name", "value", "line"),
    [
        (
            "ROOM_OUTBOX__SINKS__NOOP__EVENT_TYPES",
            '["RoomCreated", "hunter22',
            "sinks.noop.event_types: Input should be a valid list; ROOM_OUTBOX__SINKS__NOOP__EVENT_TYPES is not"
            " valid JSON (Unterminated string starting at character 16)",
        ),
        (
            "ROOM_OUTBOX__SINKS__TENCENT_IM__APPS",
            '{"main": {"sdkappid": 1400000000, "secret_key": "hunter22"}',
            "sinks.tencent_im.apps: Input should be a valid dictionary; ROOM_OUTBOX__SINKS__TENCENT_IM__APPS is not"
            " valid JSON (Expecting ',' delimiter at character 59)",
        ),
        (
            "ROOM_OUTBOX__CONSUMERS__FEED__HANDLERS",
            "[audit, hunter22]",
            "consumers.feed.handlers: Input should be a valid list; ROOM_OUTBOX__CONSUMERS__FEED__HANDLERS is not"
            " valid JSON (Expecting value at character 1)",
        ),
        (
            "ROOM_OUTBOX__OUTBOX_WORKER__LANES__MAIN__RETRY",
            '{"base": "hunter22"',
            "outbox_worker.lanes.main.retry: Input should be a valid dictionary or instance of RetrySettings;"
            " ROOM_OUTBOX__OUTBOX_WORKER__LANES__MAIN__RETRY is not valid JSON (Expecting ',' delimiter at"
            " character 19)",
        ),
    ],
)
def test_a_plugin_sections_variable_whose_json_breaks_is_named_with_where(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, line: str
) -> None:
    """The plugins' sections keep text that is not JSON as text (a template), so a list or a
    mapping whose JSON broke was reported only as "Input should be a valid list", the variable
    and the break unnamed. The value is never shown (it may hold a secret)."""
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__SDKAPPID", "1400000000")
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY", "k")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        check_configuration(load_settings(), make_plugin_manager())
    message = str(info.value)
    assert f"  {line}" in message.splitlines() and "hunter22" not in message


def test_an_environment_variable_naming_no_setting_is_refused_with_the_name_meant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An underscore short at the top, the variable was ignored silently and the DSN left at the
    file's; its value is never shown. Variables not meant as settings are left alone."""
    monkeypatch.setenv("ROOM_OUTBOX__DATABASE_DSN", "mysql://u:hunter22@db/room")
    monkeypatch.setenv("ROOM_OUTBOX_OUTBOX_WORKER__BATCH_SIZE", "500")
    monkeypatch.setenv("ROOM_OUTBOX__DATBASE__DSN", "mysql://u:hunter22@db/room")
    monkeypatch.setenv("ROOM_OUTBOX_CONFIG", "/etc/room-outbox/config.yaml")
    monkeypatch.setenv("ROOM_OUTBOX__NODE_ID", "relay-1")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value).splitlines() == [
        "invalid environment:",
        "  ROOM_OUTBOX_OUTBOX_WORKER__BATCH_SIZE: names no setting; did you mean ROOM_OUTBOX__OUTBOX_WORKER__BATCH_SIZE?",
        "  ROOM_OUTBOX__DATABASE_DSN: names no setting; did you mean ROOM_OUTBOX__DATABASE__DSN?",
        "  ROOM_OUTBOX__DATBASE__DSN: names no setting (the keys at the top: cluster, consumers, database, lanes, log,"
        " mysql, node_id, outbox_worker, plugins, retention, routing, sinks, telemetry)",
    ]
    for name in ("ROOM_OUTBOX__DATABASE_DSN", "ROOM_OUTBOX_OUTBOX_WORKER__BATCH_SIZE", "ROOM_OUTBOX__DATBASE__DSN"):
        monkeypatch.delenv(name)
    assert load_settings().node_id == "relay-1"


def test_a_variable_naming_no_setting_and_a_key_in_error_are_both_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variables naming no setting stopped the load before the file's keys were looked at."""
    monkeypatch.setenv("ROOM_OUTBOX__DATBASE__DSN", "mysql://u:hunter22@db/room")
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "database:\n  pool_sise: 3\n"))
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid configuration:" and lines[1].startswith("  ROOM_OUTBOX__DATBASE__DSN: names no setting")
    assert lines[2:] == ["  database.pool_sise: Extra inputs are not permitted"]


def test_a_plugins_list_or_mapping_comes_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sinks', consumers' and lanes' keys are the plugins' own, so no type decodes their JSON:
    a list or a mapping given in one variable is decoded as the typed sections' are; text that
    is not JSON stays text."""
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__NOOP__EVENT_TYPES", '["RoomCreated", "RoomUserJoined"]')
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__GROUP_ID_TEMPLATE", "{room_id}")
    monkeypatch.setenv("ROOM_OUTBOX__OUTBOX_WORKER__LANES__MAIN__RETRY", '{"base": "3s"}')
    settings = load_settings()
    assert settings.sinks["noop"]["event_types"] == ["RoomCreated", "RoomUserJoined"]
    assert settings.sinks["tencent_im"]["group_id_template"] == "{room_id}"
    assert settings.outbox_worker.lanes["main"]["retry"] == {"base": "3s"}


def test_node_id_defaults_to_host_and_pid(tmp_path: Path) -> None:
    import os

    assert load_settings().node_id.endswith(f"-{os.getpid()}")
    assert load_settings(write(tmp_path, "node_id: dispatcher-a\n")).node_id == "dispatcher-a"


def test_dsn_password_is_not_echoed_in_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, "mysql:\n  dsn: 'mysql://u:hunter22@h/db'\n  pool_size: 0\n"))
    assert "hunter22" not in str(info.value)
    assert "mysql.pool_size" in str(info.value)


@pytest.mark.parametrize("name", ["config.yaml", "config.docker.yaml", "config.tencent.example.yaml"])
def test_shipped_config_files_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY", "k" * 16)
    settings = load_settings(Path(__file__).parent.parent / "config" / name)
    assert settings.outbox_worker.retry_strategy == "fixed_interval"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("mysql:\n  dsn: 'mysql://u:hunter22@h/db'\n  pool_size: 2\n   bad: indent\n", "line 4, column 7"),
        ("sinks:\n  tencent_im:\n    secret_key: *hunter22Key\n", "line 3, column 17: found undefined alias '…'"),
        ("mysql:\n  dsn: 'mysql://u:hunter22@h/db\nlog: {level: INFO\n", "(while scanning a quoted scalar at line 2, column 8)"),
        ("sinks:\n  tencent_im: {secret_key: hunter22, sdkappid: [1, 2}\n", "line 2, column 53: expected ',' or ']', but got '}'"),
    ],
)  # fmt: skip
def test_yaml_errors_say_where_and_what_but_never_echo_the_line(tmp_path: Path, text: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    message = str(info.value)
    assert message.startswith(f"config file {tmp_path / 'config.yaml'}: not valid YAML: line "), message
    assert where in message, message
    assert "hunter22" not in message and "\n" not in message


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ("database:\n  dsn: 'sqlite:///x.db'  # 数据库\n".encode("gbk"), "line 2 holds byte 0xca"),  # a GBK comment
        ("log:\n  level: INFO\n".encode("utf-16"), "line 1 holds byte 0xff"),  # a Windows editor's UTF-16
    ],
)
def test_a_config_file_not_in_utf8_is_named_with_the_line_not_a_traceback(
    tmp_path: Path, content: bytes, where: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert (
        str(info.value) == f"config file {path}: not UTF-8: {where}, which UTF-8 has not there; save the file as UTF-8"
    )


def test_a_utf8_config_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """What Windows' Notepad saves as UTF-8."""
    path = tmp_path / "config.yaml"
    path.write_bytes("log:\n  level: debug  # 日志\n".encode("utf-8-sig"))
    assert load_settings(path).log.level == "DEBUG"


def test_library_log_level_defaults_to_warning_and_is_checked(tmp_path: Path) -> None:
    assert load_settings().log.library_level == "WARNING"
    assert load_settings(write(tmp_path, "log:\n  library_level: debug\n")).log.library_level == "DEBUG"
    with pytest.raises(ConfigError, match=r"log\.library_level: unknown log level 'CHATTY'"):
        load_settings(write(tmp_path, "log:\n  library_level: chatty\n"))


def test_the_database_section_names_any_store_and_mysql_stays_its_alias(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = load_settings(
        write(tmp_path, "database:\n  dsn: postgresql://u@h/db\n  pool_size: 3\n  query_timeout: 500ms\n")
    ).database
    assert (database.dsn.get_secret_value(), database.pool_size, database.query_timeout) == (
        "postgresql://u@h/db",
        3,
        0.5,
    )
    assert (database.profile, database.table) == ("v1", "")
    old = load_settings(write(tmp_path, "mysql:\n  dsn: mysql://u@h/old\n  pool_size: 4\n")).database
    assert (old.dsn.get_secret_value(), old.pool_size) == ("mysql://u@h/old", 4)
    # Both given: a key of `database` wins, the rest still comes from `mysql`.
    both = load_settings(
        write(tmp_path, "mysql:\n  dsn: mysql://u@h/old\n  pool_size: 4\ndatabase:\n  dsn: sqlite:///x.db\n")
    )
    assert (both.database.dsn.get_secret_value(), both.database.pool_size) == ("sqlite:///x.db", 4)
    monkeypatch.setenv("ROOM_OUTBOX__MYSQL__DSN", "mysql://u@h/from_env")
    assert load_settings().database.dsn.get_secret_value() == "mysql://u@h/from_env"
    # The environment wins over the file, whichever name each gives the section: the shipped
    # compose files set ROOM_OUTBOX__MYSQL__DSN, the reference writes `database:`.
    new_file = load_settings(write(tmp_path, "database:\n  dsn: mysql://u@h/file\n  pool_size: 4\n")).database
    assert (new_file.dsn.get_secret_value(), new_file.pool_size) == ("mysql://u@h/from_env", 4)
    monkeypatch.setenv("ROOM_OUTBOX__DATABASE__DSN", "mysql://u@h/database_env")
    assert load_settings().database.dsn.get_secret_value() == "mysql://u@h/database_env"  # its own name first
    monkeypatch.delenv("ROOM_OUTBOX__MYSQL__DSN")
    old_file = load_settings(write(tmp_path, "mysql:\n  dsn: mysql://u@h/file\n"))
    assert old_file.database.dsn.get_secret_value() == "mysql://u@h/database_env"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("database:\n  profile: v9\n", "database.profile: unknown table profile 'v9' (allowed: v1, room_cell, silk)"),
        ("database:\n  table: 'outbox; DROP'\n", "database.table: 'outbox; DROP' is not a plain table name"),
    ],
)
def test_bad_database_settings_name_their_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_settings(write(tmp_path, text))


def test_a_batch_of_envelopes_too_long_for_the_shipped_memory_limit_is_warned_of(tmp_path: Path) -> None:
    """A batch of 1,000 envelopes of max_envelope_bytes each (256 KiB) takes about 500 MiB to
    read and parse: the start says so, naming both keys and the lane; 500 fit, and so do 1,000
    with a lower max_envelope_bytes."""

    def warnings(text: str) -> list[str]:
        config = "database: {dsn: 'sqlite:///x.db'}\nsinks:\n  tencent_im: {enabled: false}\n" + text
        return check_configuration(load_settings(write(tmp_path, config)), make_plugin_manager()).warnings

    (warning,) = warnings("outbox_worker:\n  batch_size: 1000\n")
    assert warning.startswith(
        "outbox_worker.batch_size 1000 × database.max_envelope_bytes 262144: a batch of envelopes that long takes"
        " up to 500 MiB"
    )
    assert warnings("outbox_worker:\n  batch_size: 500\n") == []
    small = "database: {dsn: 'sqlite:///x.db', max_envelope_bytes: 65536}\noutbox_worker:\n  batch_size: 1000\n"
    small += "sinks:\n  tencent_im: {enabled: false}\n"
    assert check_configuration(load_settings(write(tmp_path, small)), make_plugin_manager()).warnings == []


def test_an_empty_room_outbox_config_is_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set empty, as `-e ROOM_OUTBOX_CONFIG=` and compose's `${VAR:-}` leave it: no file, the
    defaults and the environment (it was read as the file ".": "Is a directory", exit 2)."""
    monkeypatch.setenv("ROOM_OUTBOX_CONFIG", "")
    assert default_config() is None
