"""docker-compose.yml, the Dockerfile and the compose MySQL's init SQL.

There is no Docker engine in CI, so: the compose file is validated by ``docker-compose config``
(the Debian package ``docker-compose``; scripts/test.sh installs it when it runs as root and
it is missing — without it this test fails, it never skips), its services are checked
against what the image and the configuration provide, the Dockerfile's promises are read
from it, and the init SQL is run against MariaDB and then upgraded by ``migrate``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from support import INSERT_V1, fetch_rows

from room_outbox.cli.main import build_parser
from room_outbox.config import load_settings
from room_outbox.consume.settings import consumer_settings
from room_outbox.envelope import parse_envelope
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import telemetry_from_environment
from room_outbox.store.backends.mysql import MySQLStore

ROOT = Path(__file__).resolve().parent.parent
IMAGE_CONFIG = "/etc/room-outbox/config.yaml"


def resolve_compose_file(name: str) -> dict[str, Any]:
    """A compose file as ``docker-compose config`` resolves it."""
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail(
            "docker-compose is not installed: install the Debian package docker-compose "
            "(scripts/test.sh does so when run as root)",
            pytrace=False,
        )
    done = subprocess.run(
        [tool, "-f", str(ROOT / name), "config"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, f"docker-compose config rejects {name}:\n{done.stderr}"
    resolved: dict[str, Any] = yaml.safe_load(done.stdout)
    return resolved


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return resolve_compose_file("docker-compose.yml")


def test_compose_has_every_service(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) >= {
        "mysql",
        "migrate",
        "room-outbox",
        "migrate-consume",
        "consume",
        "fake-im",
        "kafka",
        "otel-collector",
        "jaeger",
        "prometheus",
        "grafana",
    }


COMPOSE_FILES = sorted(p.name for p in ROOT.glob("docker-compose*.yml"))


def test_both_compose_files_are_checked() -> None:
    assert {"docker-compose.yml", "docker-compose.postgres.yml"} <= set(COMPOSE_FILES)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_port_is_published_on_loopback_only(name: str) -> None:
    # The stacks carry development passwords: nothing they publish may be reachable off this host.
    published = 0
    for service_name, service in resolve_compose_file(name)["services"].items():
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else port.split(":")[0]
            assert host_ip == "127.0.0.1", f"{name}: service {service_name} publishes {port} beyond loopback"
            published += 1
    assert published >= 3


def test_kafka_keeps_its_data_in_the_volume(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]
    mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in kafka["volumes"]]
    data = [m.split(":")[1] for m in mounts if m.startswith("kafka-data:")]
    # The image writes to log.dirs (its default: /tmp/kraft-combined-logs); the volume must be there.
    assert data == [kafka["environment"]["KAFKA_LOG_DIRS"]]


def test_mysql_is_84_and_initialised_with_the_v1_table(compose: dict[str, Any]) -> None:
    mysql = compose["services"]["mysql"]
    assert mysql["image"] == "mysql:8.4"
    mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in mysql["volumes"]]
    init = [m for m in mounts if "/docker-entrypoint-initdb.d" in m]
    assert init and Path(init[0].split(":")[0]).resolve() == (ROOT / "docker" / "mysql-init").resolve()
    assert mysql["environment"]["MYSQL_DATABASE"] == "room"


def test_the_dispatcher_runs_the_docker_config_after_migrate(compose: dict[str, Any]) -> None:
    services = compose["services"]
    dispatcher, migrate = services["room-outbox"], services["migrate"]
    assert dispatcher["command"] == ["run", "--config", IMAGE_CONFIG]
    assert migrate["command"] == ["migrate", "--config", IMAGE_CONFIG]
    assert dispatcher["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert migrate["depends_on"]["mysql"]["condition"] == "service_healthy"
    env = dispatcher["environment"]
    assert env["ROOM_OUTBOX__SINKS__TENCENT_IM__BASE_URL"] == "http://fake-im:8090"
    # Traces to the collector; metrics only by scrape (pushed too, they would reach a backend
    # that takes none, or be counted twice).
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    assert env["OTEL_METRICS_EXPORTER"] == "none" and env["OTEL_TRACES_EXPORTER"] == "otlp"
    # The commands the compose file gives the image are commands the CLI takes.
    for service in ("room-outbox", "migrate", "fake-im"):
        build_parser().parse_args(services[service]["command"])


def test_the_docker_config_with_the_compose_environment_is_valid(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in compose["services"]["room-outbox"]["environment"].items():
        monkeypatch.setenv(name, str(value))
    settings = load_settings(ROOT / "config" / "config.docker.yaml")
    assert settings.mysql.dsn.get_secret_value() == "mysql://root:room@mysql:3306/room"
    assert settings.sinks["tencent_im"]["base_url"] == "http://fake-im:8090"
    assert settings.sinks["tencent_im"]["secret_key"]
    # Prometheus scrapes it from another container: every interface, chosen in the compose file.
    assert settings.telemetry.http_listen == "0.0.0.0:9464"


def test_the_compose_environment_pushes_traces_and_no_metrics(compose: dict[str, Any]) -> None:
    env = {k: str(v) for k, v in compose["services"]["room-outbox"]["environment"].items()}
    telemetry = telemetry_from_environment("compose", Redactor(), prometheus=False, environ=env)
    try:
        # No metric reader at all without /metrics: nothing is pushed over OTLP (the collector's
        # Jaeger takes traces only, and Prometheus scrapes /metrics instead).
        assert telemetry.tracer is not None and not telemetry.metrics_enabled
    finally:
        anyio.run(telemetry.aclose)


def test_kafka_runs_in_kraft_mode_and_jaeger_is_v2(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]["environment"]
    assert "controller" in kafka["KAFKA_PROCESS_ROLES"] and "KAFKA_ZOOKEEPER_CONNECT" not in kafka
    jaeger = compose["services"]["jaeger"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"])
    collector = compose["services"]["otel-collector"]
    assert {_container_port(p) for p in collector["ports"]} >= {4317, 4318}


def _container_port(port: str | dict[str, Any]) -> int:
    """The container side of a published port, in either of docker-compose's notations."""
    return int(port["target"]) if isinstance(port, dict) else int(port.split(":")[-1].split("/")[0])


def test_every_image_is_pinned_to_a_version(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        image = service.get("image", "")
        if "build" not in service:
            assert re.search(r":v?\d+\.\d+", image), f"service {name}: image {image!r} has no version tag"


def test_the_dockerfile_is_multi_stage_non_root_with_a_healthcheck_on_healthz() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2 and "COPY --from=build" in text
    assert "-slim" in text
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in ("root", "0")
    health = re.search(r"^HEALTHCHECK .*?(?<!\\)$", text, re.M | re.S)
    assert health and "/healthz" in health.group(0)
    port = re.search(r"127\.0\.0\.1:(\d+)/healthz", health.group(0))
    assert port and load_settings(ROOT / "config" / "config.docker.yaml").telemetry.http_listen.endswith(
        f":{port.group(1)}"
    )
    # The image turns the endpoint on by environment, so a mounted config (where http_listen is
    # off by default) still answers the HEALTHCHECK.
    assert re.search(rf"ROOM_OUTBOX__TELEMETRY__HTTP_LISTEN=\S*:{port.group(1)}\b", text)
    # A patch-level base image, and the locked dependencies installed before the code is copied.
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+\.\d+-slim", text, re.M)
    lock = text.index("--require-hashes --no-deps -r requirements.lock")
    assert text.index("COPY requirements.lock") < lock < text.index("COPY core")
    assert 'ENTRYPOINT ["room-outbox"]' in text and f'CMD ["run", "--config", "{IMAGE_CONFIG}"]' in text
    assert f"COPY config/config.docker.yaml {IMAGE_CONFIG}" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


@pytest.mark.anyio
async def test_the_init_sql_creates_room_services_table_and_migrate_upgrades_it(database_dsn: str) -> None:
    sql = (ROOT / "docker" / "mysql-init" / "01-room-outbox-v1.sql").read_text()
    statements = [s.strip() for s in re.sub(r"--[^\n]*", "", sql).split(";") if s.strip()]
    store = await MySQLStore.connect(database_dsn)
    try:
        async with store.transaction() as cur:
            for statement in statements:
                if not statement.upper().startswith("USE "):  # the test's own database instead of `room`
                    await cur.execute(statement)
            await cur.execute(INSERT_V1, ("default", "e_v1", "RoomUserJoined", "r_1", "{}", 1, 1))
        changes = await store.migrate()
        assert "created table room_outbox" not in changes and "added column room_outbox.worker_id" in changes
        assert (await fetch_rows(store))["e_v1"]["status"] == "pending"
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_the_sample_events_parse_as_the_dispatcher_reads_them(database_dsn: str) -> None:
    """docker/sample-events.sql, docs/tutorial/compose.md's way to feed the compose stack's dashboard."""
    sql = (ROOT / "docker" / "sample-events.sql").read_text()
    store = await MySQLStore.connect(database_dsn)
    try:
        await store.migrate()
        async with store.transaction() as cur:
            for statement in [s.strip() for s in re.sub(r"--[^\n]*", "", sql).split(";") if s.strip()]:
                await cur.execute(statement)
        rows = await fetch_rows(store)
        async with store.transaction() as cur:
            await cur.execute("SELECT event_id, event_type, room_id, envelope FROM room_outbox")
            envelopes = await cur.fetchall()
    finally:
        await store.aclose()
    assert len(rows) == 1000 and all(r["status"] == "pending" for r in rows.values())
    for event_id, event_type, room_id, raw in envelopes:
        parsed = parse_envelope(raw)
        assert (parsed.event_id, parsed.event_type, parsed.room_id) == (event_id, event_type, room_id)
    assert {e[1] for e in envelopes} == {"RoomUserJoined", "RoomGiftSent", "RoomMicChanged", "RoomHeatChanged"}


@pytest.fixture(scope="module")
def compose_postgres() -> dict[str, Any]:
    return resolve_compose_file("docker-compose.postgres.yml")


def test_the_postgresql_variant_migrates_and_runs_against_postgres(
    compose_postgres: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose_postgres["services"]
    assert set(services) == {"postgres", "migrate", "room-outbox", "fake-im"}
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["room-outbox"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    for service in ("room-outbox", "migrate", "fake-im"):
        build_parser().parse_args(services[service]["command"])
    # The image's config (which names MySQL under `mysql:`) with this environment: PostgreSQL.
    for name, value in services["room-outbox"]["environment"].items():
        monkeypatch.setenv(name, str(value))
    settings = load_settings(ROOT / "config" / "config.docker.yaml")
    assert settings.database.dsn.get_secret_value() == "postgresql://postgres:room@postgres:5432/room"
    env = services["postgres"]["environment"]
    assert (
        f"postgres:{env['POSTGRES_PASSWORD']}@postgres:5432/{env['POSTGRES_DB']}"
        in settings.database.dsn.get_secret_value()
    )


def test_the_consumers_read_the_kafka_lanes_topic(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    consume, migrate = compose["services"]["consume"], compose["services"]["migrate-consume"]
    build_parser().parse_args(consume["command"])
    # migrate creates the tables of the handlers its configuration enables: consume's own config.
    assert migrate["command"] == ["migrate", "--config", consume["command"][-1]]
    assert migrate["volumes"] == consume["volumes"]
    assert migrate["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert consume["depends_on"]["migrate-consume"]["condition"] == "service_completed_successfully"
    mounts = [v.split(":")[:2] if isinstance(v, str) else (v["source"], v["target"]) for v in consume["volumes"]]
    mounted = {target: Path(source) for source, target in mounts}
    config = mounted[consume["command"][-1]]
    assert config.resolve() == (ROOT / "config" / "config.consume.docker.yaml").resolve()
    for name, value in consume["environment"].items():
        monkeypatch.setenv(name, str(value))
    settings = load_settings(config)
    (feed,) = consumer_settings(settings).values()
    lane = load_settings(ROOT / "config" / "config.docker.yaml").sinks["kafka"]
    assert (feed.bootstrap_servers, feed.topic) == (lane["bootstrap_servers"], lane["topic"])
    assert feed.handlers == ["audit", "activity"] and settings.telemetry.http_listen.endswith(":9464")
