"""Secrets stay inside the process: the one redactor, its encodings, and a real dispatcher
whose every output channel is scanned for the Tencent key, the UserSig and the DB password."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus, urlencode

import anyio
import httpx
import pymysql
import pytest
import yaml
from support import envelope, execute, fetch_rows, insert_events, insert_rows, wait_until

from room_outbox.config import Settings
from room_outbox.observability.logs import LIBRARY_LOGGERS, configure_logging
from room_outbox.observability.redaction import REDACTED, Redactor, redactor_for
from room_outbox.plugins.tencent_im.fake import FakeTencentIM, serve_fake_im
from room_outbox.store.backends.errors import translate
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore

# -- the redactor ------------------------------------------------------------------------------

USERSIG = "eJwtzF0LgiAYBeD-8l4Hbza*Ylq-/a+2/k-_x"


def encoded_forms(secret: str) -> set[str]:
    """How a secret can travel: raw, in a URL query (both encoders, both hex cases), in JSON."""
    forms = {secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=True)[1:-1]}
    for encoded in (quote(secret, safe=""), quote(secret), quote_plus(secret, safe=""), quote_plus(secret)):
        forms |= {encoded, re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), encoded)}
    return forms


# The last two have no run of 4 letters or digits to search for first: the pattern runs on every text.
@pytest.mark.parametrize("secret", [USERSIG, 'pa ss"w\\rd+/=*', "k3y\twith\ncontrol", "密钥-key_12", "a*b/c+d=e%f g"])
def test_every_encoding_of_a_secret_is_masked(secret: str) -> None:
    redactor = Redactor()
    redactor.add(secret)
    for form in encoded_forms(secret):
        assert redactor.redact(f"GET /v4?usersig={form}&random=7 done") == f"GET /v4?usersig={REDACTED}&random=7 done"


def test_a_url_built_by_urlencode_is_masked_and_the_rest_kept() -> None:
    redactor = Redactor()
    redactor.add(USERSIG)
    url = "https://im.example/v4/x?" + urlencode({"sdkappid": "1", "usersig": USERSIG, "random": "7"})
    assert "%2A" in url  # the UserSig's * as httpx logs it
    assert redactor.redact(f"HTTP Request: POST {url}") == (
        f"HTTP Request: POST https://im.example/v4/x?sdkappid=1&usersig={REDACTED}&random=7"
    )


def test_blank_values_are_ignored_and_a_longer_secret_is_masked_whole() -> None:
    redactor = Redactor()
    for value in ("", "  "):
        redactor.add(value)
    assert redactor.redact("  abc def ") == "  abc def "
    redactor.add("sup3rsecret")
    redactor.add("sup3rsecretlonger")  # the longer one is masked whole, not in pieces
    assert redactor.redact("a sup3rsecretlonger b sup3rsecret") == f"a {REDACTED} b {REDACTED}"
    assert "sup3rsecret" in redactor and "" not in redactor


R = REDACTED


@pytest.mark.parametrize(
    ("password", "text", "expected"),
    [
        # A common word: masked as a whole token, never inside a longer one.
        ("room", '{"logger": "room_outbox.app", "msg": "room-service bedroom rooms"}', None),
        ("room", "mysql://root:room@db:3306/x", f"mysql://root:{R}@db:3306/x"),
        ("room", '{"password": "room"}', f'{{"password": "{R}"}}'),
        ("room", "Access denied: password room rejected", f"Access denied: password {R} rejected"),
        ("room", "GET /v4?sig=x%3Droom&y=1", f"GET /v4?sig=x%3D{R}&y=1"),
        # Short passwords: masked where they are a whole value, left alone in free text.
        ("a", "mysql://app:a@db/x", f"mysql://app:{R}@db/x"),
        ("a", "host=db password=a user=x", f"host=db password={R} user=x"),
        ("a", '{"password": "a", "msg": "a batch of a few"}', f'{{"password": "{R}", "msg": "a batch of a few"}}'),
        ("a", "https://im.example/v4?usersig=a&random=7", f"https://im.example/v4?usersig={R}&random=7"),
        ("abc", "Authorization: abc", f"Authorization: {R}"),
        ("abc", "mysql://app:abc@db/abcdef?password=abc", f"mysql://app:{R}@db/abcdef?password={R}"),
        ("abc", "abc def xabc abc_1", None),
        # Long secrets (16 characters or more): masked even glued to other characters, as an
        # error text may quote them (a gateway's "appkey_<key> mismatch"); shorter ones not.
        ("room-outbox-dev-key-x", "appkey_room-outbox-dev-key-x mismatch", f"appkey_{R} mismatch"),
        ("eJyrVgrxCdYrSy1S*abc", "sig_eJyrVgrxCdYrSy1S%2Aabc_end", f"sig_{R}_end"),
        ("sup3rsecret15chr", "x_sup3rsecret15chr_y", f"x_{R}_y"),
        ("sup3rsecret15ch", "x_sup3rsecret15ch_y sup3rsecret15ch", f"x_sup3rsecret15ch_y {R}"),
        # The special characters of the output-channel test below, percent-encoded in a DSN.
        ("Pw*0a1b/+=:@ %", "mysql://u:" + quote("Pw*0a1b/+=:@ %", safe="") + "@db/x", f"mysql://u:{R}@db/x"),
        ("Pw*0a1b/+=:@ %", '{"dsn_password": "Pw*0a1b/+=:@ %"}', f'{{"dsn_password": "{R}"}}'),
    ],
)
def test_a_secret_is_masked_by_its_length_as_a_token_or_value(password: str, text: str, expected: str | None) -> None:
    redactor = Redactor()
    redactor.add(password)
    assert redactor.redact(text) == (text if expected is None else expected)


@pytest.mark.parametrize(
    ("password", "expected"),
    [
        ("room", f"CREATE command denied to user '{R}'@'h' for table `qa_r7`.`room_outbox`"),
        ("r7", "CREATE command denied to user 'room'@'h' for table `qa_r7`.`room_outbox`"),
        ("outbox", "CREATE command denied to user 'room'@'h' for table `qa_r7`.`room_outbox`"),
    ],
)
def test_the_database_password_in_the_drivers_words_is_masked_as_the_redactor_masks_it(
    password: str, expected: str
) -> None:
    """The store masks the password in the database's words before the redactor sees them: by
    the same rule, so a password that is also a name leaves the longer names holding it whole."""
    refused = pymysql.err.OperationalError(
        1142, "CREATE command denied to user 'room'@'h' for table `qa_r7`.`room_outbox`"
    )
    message = str(translate(refused, "MySQL at h:3306 (database 'qa_r7', user 'room')", password))
    assert message.startswith(f"MySQL at h:3306 (database 'qa_r7', user 'room'): {expected}; grant it"), message
    redactor = Redactor()
    redactor.add(password)
    assert redactor.redact(expected) == expected


def test_a_common_word_as_the_database_password_leaves_log_lines_intact() -> None:
    stream = io.StringIO()
    redactor = redactor_for(Settings(mysql={"dsn": "mysql://root:room@db:3306/outbox"}))
    try:
        configure_logging("INFO", "n1", redactor, stream)
        logging.getLogger("room_outbox.app").info("room-service rows in room_outbox tables")
        logging.getLogger("room_outbox.app").warning("cannot connect to mysql://root:room@db:3306/outbox")
    finally:
        logging.captureWarnings(False)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(d["logger"], d["msg"]) for d in lines] == [
        ("room_outbox.app", "room-service rows in room_outbox tables"),
        ("room_outbox.app", f"cannot connect to mysql://root:{R}@db:3306/outbox"),
    ]


def test_the_process_redactor_knows_every_secret_in_the_configuration() -> None:
    settings = Settings(
        mysql={"dsn": "mysql://app:" + quote("p@ss/w:rd", safe="") + "@db:3306/room"},
        sinks={
            "tencent_im": {
                "secret_key": "tencent-key-1",
                "apps": {"b": {"secret_key": "tencent-key-2"}},
                "proxy": "http://relay:pr%40xy-pass@proxy.internal:3128",
            },
            "kafka": {"sasl_plain_password": "kafka-pass", "topic": "room-events", "bootstrap_servers": "k:9092"},
            "webhook": {
                "headers": {"Authorization": "Bearer abc123"},
                "api_token": "tok-123456",
                "tokens": ["tok-a-1", "tok-b-2"],
            },
        },
    )
    redactor = redactor_for(settings, environ={"OTEL_EXPORTER_OTLP_HEADERS": "api-key=otlp-key-9,x-tenant=acme"})
    expected = ("p@ss/w:rd", "tencent-key-1", "tencent-key-2", "pr@xy-pass", "pr%40xy-pass", "kafka-pass")
    expected += ("tok-123456", "tok-a-1", "Bearer abc123")
    for secret in (*expected, "otlp-key-9", "acme"):  # any OTLP header value may be a credential
        assert secret in redactor, secret
    for setting in ("room-events", "k:9092", "127.0.0.1", "relay", "proxy.internal"):
        assert setting not in redactor


def test_library_loggers_stay_at_warning_and_their_records_are_masked() -> None:
    stream = io.StringIO()
    redactor = Redactor()
    redactor.add(USERSIG)
    saved = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    try:
        configure_logging("DEBUG", "n1", redactor, stream)
        url = "https://im.example/v4?" + urlencode({"usersig": USERSIG})
        logging.getLogger("httpx").info("HTTP Request: POST %s", url)  # dropped: below WARNING
        logging.getLogger("aiokafka").warning("connection to %s failed", url)  # kept, masked
        logging.getLogger("room_outbox.dispatcher").debug("ours at DEBUG")
        assert {name: logging.getLogger(name).getEffectiveLevel() for name in LIBRARY_LOGGERS} == dict.fromkeys(
            LIBRARY_LOGGERS, logging.WARNING
        )
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
        logging.captureWarnings(False)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(d["logger"], d["msg"]) for d in lines] == [
        ("aiokafka", f"connection to https://im.example/v4?usersig={REDACTED} failed"),
        ("room_outbox.dispatcher", "ours at DEBUG"),
    ]


def test_an_uncaught_exception_is_one_redacted_log_line() -> None:
    stream = io.StringIO()
    redactor = Redactor()
    redactor.add(USERSIG)
    configure_logging("INFO", "n1", redactor, stream)
    try:
        raise RuntimeError(f"GET /v4?usersig={quote(USERSIG, safe='')}")
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)  # Ctrl-C: nothing to report
    (line,) = stream.getvalue().splitlines()
    doc = json.loads(line)
    assert (doc["level"], doc["msg"]) == ("critical", "uncaught exception: RuntimeError")
    assert f"RuntimeError: GET /v4?usersig={REDACTED}" in doc["exc"] and "Traceback" in doc["exc"]


def test_tencent_sink_registers_its_key_and_every_usersig_with_the_process_redactor() -> None:
    from room_outbox.plugins.tencent_im import TencentIMSettings
    from room_outbox.plugins.tencent_im.sink import TencentIMSink
    from room_outbox.sink import SinkContext

    redactor = Redactor()
    settings = TencentIMSettings(
        sdkappid=1400000001, secret_key="tencent-key-1", apps={"b": {"sdkappid": 2, "secret_key": "tencent-key-2"}}
    )
    sink = TencentIMSink(settings, SinkContext("n", logging.getLogger("t"), add_secret=redactor.add))
    assert "tencent-key-1" in redactor and "tencent-key-2" in redactor
    usersig = sink._apps_by_code["b"].usersig.get()
    assert usersig in redactor


# -- a real dispatcher, every output channel scanned ---------------------------------------------

SDKAPPID = 1400000777


class RecordingFakeIM(FakeTencentIM):
    """The fake Tencent IM, also keeping every UserSig it was sent (the secret to look for)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.usersigs: set[str] = set()

    async def handle(self, method: str, target: str, body: bytes) -> Any:
        from urllib.parse import parse_qs, urlsplit

        self.usersigs.update(parse_qs(urlsplit(target).query).get("usersig", []))
        return await super().handle(method, target, body)


@pytest.fixture
def password_dsn(database_dsn: str) -> Iterator[tuple[str, str]]:
    """A MariaDB user with a password (URL-encoded in the DSN) for the test database; dropped after."""
    import pymysql

    root = MySQLAddress.from_dsn(database_dsn)  # the test server's administrative account
    database = root.database
    user = f"ro_secret_{uuid.uuid4().hex[:8]}"
    password = f"Pw*{secrets.token_hex(8)}/+=:@ %"

    def admin(*statements: str) -> None:
        conn = pymysql.connect(
            host=root.host, port=root.port, user=root.user, password=root.password, connect_timeout=5, read_timeout=10
        )
        try:
            with conn.cursor() as cur:
                for statement in statements:
                    cur.execute(statement)
        finally:
            conn.close()

    escaped = password.replace("\\", "\\\\").replace("'", "\\'")
    admin(
        f"CREATE USER '{user}'@'%' IDENTIFIED BY '{escaped}'",
        f"GRANT ALL PRIVILEGES ON `{database}`.* TO '{user}'@'%'",
    )
    try:
        yield f"mysql://{user}:{quote(password, safe='')}@{root.host}:{root.port}/{database}", password
    finally:
        admin(f"DROP USER IF EXISTS '{user}'@'%'")


@pytest.fixture
async def fake_im() -> AsyncIterator[RecordingFakeIM]:
    # A long identifier makes a long UserSig: one without a * (a + before Tencent's alphabet)
    # becomes vanishingly unlikely. The test asserts the UserSigs it saw did contain one.
    identifier = "admin_" + secrets.token_urlsafe(600)
    fake = RecordingFakeIM(apps={SDKAPPID: "tencent-Secret/Key+42="}, admins={identifier})
    async with serve_fake_im(fake) as served:
        yield served


def _env(secret_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROOM_OUTBOX", "OTEL_"))}
    env.update(
        ROOM_OUTBOX__SINKS__TENCENT_IM__SECRET_KEY=secret_key,
        ROOM_OUTBOX__NODE_ID="secrets-test",
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="console",
        OTEL_METRIC_EXPORT_INTERVAL="300",
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    return env


async def _cli(config: Path, env: dict[str, str], *args: str) -> str:
    """A `room-outbox` command as an operator runs it: stdout and stderr, as text."""
    with anyio.fail_after(30):
        done = await anyio.run_process(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), *args], env=env, check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode() + done.stderr.decode()


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("log_format", ["json", "console"])
async def test_no_output_channel_carries_a_secret(
    store: MySQLStore, password_dsn: tuple[str, str], fake_im: RecordingFakeIM, tmp_path: Path, log_format: str
) -> None:
    """Both log formats are scanned: the console one formats fields its own way."""
    dsn, db_password = password_dsn
    (identifier,) = fake_im.admins
    secret_key = fake_im.apps[SDKAPPID]
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "mysql": {"dsn": dsn, "pool_size": 2},
                "outbox_worker": {"poll_interval": "100ms", "publish_timeout": "2s"},
                "sinks": {"tencent_im": {"base_url": fake_im.base_url, "sdkappid": SDKAPPID, "identifier": identifier}},
                "log": {"level": "DEBUG", "library_level": "DEBUG", "format": log_format},  # + the libraries' URLs
                "telemetry": {"http_listen": "127.0.0.1:0", "backlog_interval": "200ms"},
                "routing": {"main_default": "known"},  # so that RoomTeleported fails (no_route), parked
            }
        )
    )
    env = _env(secret_key)
    # 70001: the sink makes a new UserSig and retries at once; 10002: a failure in last_error.
    fake_im.set_faults(fail_next=[70001, 10002, 10002])
    good = [envelope(f"ok{i}", room_id=f"r_{i}") for i in range(4)]
    await insert_events(store, [*good, envelope("ghost_app", app_code="ghost")])
    await insert_rows(
        store,
        [
            ("default", "bad_json", "RoomUserJoined", "r_1", "{not json"),
            ("default", "mixed_app", "RoomUserJoined", "r_1", json.dumps(envelope("mixed_app", app_code="other_app"))),
            ("default", "unknown_type", "RoomTeleported", "r_1", json.dumps(envelope("unknown_type", "RoomTeleported"))),
        ],
    )  # fmt: skip
    bad = ("ghost_app", "bad_json", "mixed_app", "unknown_type")

    stdout, stderr = tmp_path / "run.stdout", tmp_path / "run.stderr"
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "run"],
            stdout=out,
            stderr=err,
            env=env,
        )
    last_errors: set[str] = set()
    try:

        async def delivered_and_failed() -> bool:
            assert proc.poll() is None, stderr.read_text()
            rows = await fetch_rows(store)
            last_errors.update(r["last_error"] for r in rows.values() if r["last_error"])
            return (
                all(rows[e["event_id"]]["status"] == "published" for e in good)
                and all(rows[e]["retry_count"] >= 2 for e in bad if e != "unknown_type")
                and rows["unknown_type"]["status"] == "failed"  # no route: parked after one attempt
            )

        await wait_until(delivered_and_failed, timeout=30)
        port = _http_port(stderr.read_text())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:

            async def metrics_text() -> str:
                text = (await client.get("/metrics")).text
                return text if 'event_type="other"' in text and "room_outbox_pending{" in text else ""

            await wait_until(metrics_text, timeout=10)
            metrics = await metrics_text()
            readiness = (await client.get("/readyz")).text
        operator = [await _cli(config, env, "status"), await _cli(config, env, "status", "--json")]
        for event_id in (*bad, "ok0"):
            operator.append(await _cli(config, env, "inspect", event_id))
        operator.append(await _cli(config, env, "inspect", "ghost_app", "--json"))
        operator.append(await _cli(config, env, "requeue", "--event-type", "RoomTeleported"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail("room-outbox run did not stop on SIGTERM")
    last_errors.update(r["last_error"] for r in (await fetch_rows(store)).values() if r["last_error"])

    # What was scanned really carried what a leak would ride on.
    assert fake_im.usersigs and all("*" in sig for sig in fake_im.usersigs), fake_im.usersigs
    logs = stderr.read_text()
    assert all(line.startswith("{") == (log_format == "json") for line in logs.splitlines()[:3]), logs[:500]
    assert "UserSig expired at Tencent (70001)" in logs
    spans = stdout.read_text()
    # The sink's HTTP client (httpx) logs each request URL at INFO; its client spans carry them.
    assert re.search(r"HTTP Request: POST \S+usersig=\[REDACTED\]&", logs), "no log line carried a request URL"
    assert re.search(r'"url.full": "[^"]+usersig=\[REDACTED\]&', spans), "no client span carried a request URL"
    assert '"name": "room_outbox.deliver RoomUserJoined"' in spans
    assert '"name": "room_outbox.deliver other"' in spans  # an unknown type mints no span name
    assert "room_outbox.publish.success" in spans  # console metrics
    assert 'event_type="other"' in metrics and "RoomTeleported" not in metrics
    assert any("ErrorCode 10002" in e for e in last_errors)
    assert any("envelope app_code 'other_app' differs from the row's 'default'" in e for e in last_errors)
    assert any("no Tencent IM credentials for app_code 'ghost'" in e for e in last_errors)

    channels = {
        "stderr logs": logs,
        "stdout spans and metrics": spans,
        "/metrics": metrics,
        "/readyz": readiness,
        "operator commands": "\n".join(operator),
        "last_error": "\n".join(sorted(last_errors)),
    }
    forbidden = {"secret key": secret_key, "database password": db_password}
    forbidden |= {f"UserSig {n}": sig for n, sig in enumerate(sorted(fake_im.usersigs))}
    for channel, text in channels.items():
        for name, secret in forbidden.items():
            for form in encoded_forms(secret):
                assert form not in text, f"{name} ({form[:12]}…) in {channel}"


def _http_port(logs: str) -> int:
    """The endpoint's port from its ``http_started`` line, in either log format."""
    (line,) = (line for line in logs.splitlines() if "http_started" in line)
    found = re.search(r'\bport"?[=:] ?(\d+)', line)
    assert found, line
    return int(found.group(1))


# -- a password that is also a name ------------------------------------------------------------


def _mysql_root(dsn: str, *statements: str) -> list[tuple[Any, ...]]:
    """Run ``statements`` as the test server's administrative account: the last one's rows."""
    import pymysql

    root = MySQLAddress.from_dsn(dsn)
    conn = pymysql.connect(host=root.host, port=root.port, user=root.user, password=root.password, connect_timeout=5)
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
            return list(cur.fetchall())
    finally:
        conn.close()


@pytest.fixture
def name_as_password(store: MySQLStore, database_dsn: str) -> Iterator[tuple[str, str, list[str]]]:
    """A user whose name and password are both the test database's name less its ``ro_test_``
    prefix (short: masked as a whole token only), allowed to write: its DSN, the password, and
    the statements that take away its writes (from the tables, where a running session feels it
    at its next statement; on the database it would wait for the session's next USE)."""
    database = MySQLAddress.from_dsn(database_dsn).database
    name = database.removeprefix("ro_test_")
    tables = [row[0] for row in _mysql_root(database_dsn, f"SHOW TABLES FROM `{database}`")]
    _mysql_root(
        database_dsn,
        f"CREATE USER '{name}'@'%' IDENTIFIED BY '{name}'",
        f"GRANT SELECT ON `{database}`.* TO '{name}'@'%'",
        *(f"GRANT INSERT, UPDATE, DELETE ON `{database}`.`{table}` TO '{name}'@'%'" for table in tables),
    )
    revoke = [f"REVOKE INSERT, UPDATE, DELETE ON `{database}`.`{table}` FROM '{name}'@'%'" for table in tables]
    try:
        yield f"mysql://{name}:{name}@127.0.0.1:3306/{database}", name, revoke
    finally:
        _mysql_root(database_dsn, f"DROP USER IF EXISTS '{name}'@'%'")


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("log_format", ["json", "console"])
async def test_a_password_that_is_also_a_name_is_masked_alike_on_every_channel(
    store: MySQLStore, database_dsn: str, name_as_password: tuple[str, str, list[str]], tmp_path: Path, log_format: str
) -> None:
    """The user's privileges to write are taken away under a running process: each heartbeat and
    round fails naming the user and the database, as an operator command does. Wherever the
    password stands alone (the user's name) it is masked; inside the database's name it is left
    alone, every channel the same: neither a mangled name nor a name shown once in clear and
    once masked tells the reader the password. The recurring lines name the fix, and the
    stopping process says why it does not leave the membership."""
    dsn, password, revoke_writes = name_as_password
    database = f"ro_test_{password}"
    await insert_events(store, [envelope("e1", "RoomCreated"), envelope("parked", "RoomCreated")])
    await execute(store, "UPDATE room_outbox SET status = 'failed' WHERE event_id = 'parked'")
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "database": {"dsn": dsn, "pool_size": 2},
                "outbox_worker": {"poll_interval": "100ms", "publish_timeout": "2s"},
                "sinks": {"tencent_im": {"enabled": False}, "noop": {"enabled": True}},
                "log": {"format": log_format},
                "telemetry": {"http_listen": "127.0.0.1:0"},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROOM_OUTBOX", "OTEL_"))}
    stderr = tmp_path / "run.stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "run"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    try:

        def logged(*lines: str) -> bool:
            """Whether each of ``lines`` was logged, for the privilege taken away."""
            assert proc.poll() is None, stderr.read_text()
            text = stderr.read_text().splitlines()
            return all(any(line in logged and "command denied" in logged for logged in text) for line in lines)

        await wait_until(lambda: "worker started" in stderr.read_text(), timeout=60)
        _mysql_root(database_dsn, *revoke_writes)
        await wait_until(lambda: logged("membership heartbeat failed", "outbox round failed"), timeout=30)
        port = _http_port(stderr.read_text())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            readiness = (await client.get("/readyz")).text
        with anyio.fail_after(30):
            requeue = await anyio.run_process(
                [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "requeue", "--status", "failed",
                 "--yes"],
                env=env, check=False,
            )  # fmt: skip
        assert requeue.returncode == 3, requeue.stderr.decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            pytest.fail("room-outbox run did not stop on SIGTERM")
    logs = stderr.read_text()

    fix = "grant it to the user in database.dsn"
    lines = logs.splitlines()
    for failing in ("membership heartbeat failed", "outbox round failed"):
        assert any(failing in line and "command denied" in line and fix in line for line in lines), logs
    (stopping,) = (line for line in lines if "not leaving the membership" in line)
    assert "the last heartbeat failed" in stopping and "command denied" in stopping, stopping
    channels = {"stderr logs": logs, "/readyz": readiness, "operator command": requeue.stderr.decode()}
    for channel, text in channels.items():
        assert not re.search(rf"(?<![\w.\-]){password}(?![\w.\-])", text), f"the password in clear in {channel}"
        assert text.count("ro_test_") == text.count(database), f"the database's name mangled in {channel}"
        assert not re.search(r"[\w\-]\[REDACTED\]|\[REDACTED\][\w\-]", text), f"a mask inside a name in {channel}"
    assert "command denied" in channels["operator command"] and database in channels["operator command"]
    assert f"'{REDACTED}'@" in channels["operator command"]  # the user, masked as its name in the prefix
