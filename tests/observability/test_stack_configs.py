"""Every config file the compose stack's observability services read: syntax and structure,
and that the files agree with each other and with docker-compose.yml.

Prometheus's config and rules go through the real ``promtool`` (Debian package prometheus;
scripts/test.sh installs it). The collector and Grafana cannot be installed here, so their
files are checked as YAML/JSON with the structure those programs require; every PromQL
expression of the dashboard goes through ``promtool`` too, as a recording rule.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from observability_stack import (
    ALERTS,
    COLLECTOR_CONFIG,
    DASHBOARDS,
    GRAFANA_PROVISIONING,
    PROMETHEUS_CONFIG,
    ROOT,
    alert_rules,
    dashboards,
    load_yaml,
    panel_queries,
)

from room_outbox.config import load_settings


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail(
            "promtool is not installed: install the Debian package prometheus (scripts/test.sh does so as root)",
            pytrace=False,
        )
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def assert_rule_tests(path: Path, tests: dict[str, Any]) -> None:
    """``promtool test rules`` on ``tests`` (a unit-test file's contents), written to ``path``:
    every case as expected."""
    path.write_text(yaml.safe_dump(tests))
    done = promtool("test", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker-compose.yml as written (paths relative to the repository)."""
    return dict(load_yaml(ROOT / "docker-compose.yml"))


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> repository path of the service's ``./...`` bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = ROOT / source
    return mounts


def test_every_bind_mounted_file_exists(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"service {name} mounts {source} at {target}, which does not exist"


# -- Prometheus ------------------------------------------------------------------------------


def test_promtool_accepts_the_prometheus_config_and_its_rules() -> None:
    checked = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    rules = promtool("check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout


def test_prometheus_loads_the_alerts_and_scrapes_the_services_on_their_ports(compose: dict[str, Any]) -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    prometheus = compose["services"]["prometheus"]
    mounts = bind_mounts(prometheus)
    assert mounts["/etc/prometheus"] == PROMETHEUS_CONFIG.parent
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert [PROMETHEUS_CONFIG.parent / f for f in config["rule_files"]] == [ALERTS]
    targets = {
        job["job_name"]: target
        for job in config["scrape_configs"]
        for s in job.get("static_configs", [])
        for target in s["targets"]
    }
    # Replicas of `consume` are found by name: one address per container.
    discovered = {
        job["job_name"]: f"{name}:{dns['port']}"
        for job in config["scrape_configs"]
        for dns in job.get("dns_sd_configs", [])
        for name in dns["names"]
    }
    # Each room-outbox process is scraped on the port its configuration serves /metrics on.
    listen = load_settings(ROOT / "config" / "config.docker.yaml").telemetry.http_listen
    assert targets["room-outbox"] == f"room-outbox:{listen.rsplit(':', 1)[1]}"
    consume_listen = load_settings(ROOT / "config" / "config.consume.docker.yaml").telemetry.http_listen
    assert discovered["room-outbox-consume"] == f"consume:{consume_listen.rsplit(':', 1)[1]}"
    targets.update(discovered)
    collector = load_yaml(COLLECTOR_CONFIG)
    assert (
        targets["otel-collector"] == "otel-collector:" + collector["exporters"]["prometheus"]["endpoint"].split(":")[1]
    )
    for target in targets.values():
        host = target.split(":")[0]
        assert host == "localhost" or host in compose["services"], f"scrape target {target}: no such service"


def test_every_alert_says_what_and_how_bad() -> None:
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("page", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_the_docs_show_the_alerts_of_the_rules_file() -> None:
    page = (ROOT / "docs" / "how-to" / "monitor.md").read_text()
    assert "docker/prometheus/alerts.yml" in page
    for rule in alert_rules():
        assert f"`{rule['alert']}`" in page, f"docs/how-to/monitor.md does not list {rule['alert']}"


# -- OpenTelemetry Collector -----------------------------------------------------------------


def test_the_collector_config_wires_every_pipeline_to_defined_components(compose: dict[str, Any]) -> None:
    config = load_yaml(COLLECTOR_CONFIG)
    assert set(config) <= {"receivers", "processors", "exporters", "extensions", "connectors", "service"}
    service = config["service"]
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in service["pipelines"].items():
        assert name.split("/")[0] in ("traces", "metrics", "logs"), f"pipeline {name}: unknown signal"
        assert pipeline["receivers"] and pipeline["exporters"], f"pipeline {name} needs receivers and exporters"
        for kind in used:
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"pipeline {name} uses undefined {kind[:-1]} {component}"
                used[kind].add(component)
    for kind, names in used.items():
        assert set(config[kind]) == names, f"{kind} defined but in no pipeline: {set(config[kind]) - names}"
    assert set(service.get("extensions", [])) == set(config.get("extensions", {}))
    # memory_limiter must run first in each pipeline (the collector's own rule).
    for pipeline in service["pipelines"].values():
        assert pipeline["processors"][0] == "memory_limiter"


def test_the_collector_sends_traces_to_jaeger_and_metrics_to_prometheus(compose: dict[str, Any]) -> None:
    config = load_yaml(COLLECTOR_CONFIG)
    pipelines = config["service"]["pipelines"]
    jaeger = config["exporters"][pipelines["traces"]["exporters"][0]]
    host, port = jaeger["endpoint"].split(":")
    assert host == "jaeger" and port == "4317" and jaeger["tls"]["insecure"] is True
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", compose["services"]["jaeger"]["image"])
    assert pipelines["metrics"]["exporters"] == ["prometheus"]
    collector = compose["services"]["otel-collector"]
    # The contrib image reads this path when started without arguments.
    assert bind_mounts(collector)["/etc/otelcol-contrib/config.yaml"] == COLLECTOR_CONFIG
    assert "command" not in collector
    receivers = config["receivers"]["otlp"]["protocols"]
    published = {int(p.split(":")[-1]) for p in collector["ports"]}
    for protocol, port in (("grpc", 4317), ("http", 4318)):
        # 0.0.0.0: the collector's default (localhost) would refuse the other containers.
        assert receivers[protocol]["endpoint"] == f"0.0.0.0:{port}" and port in published
    # The dispatcher's OTLP endpoint is this collector.
    env = compose["x-room-outbox-env"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"


# -- Grafana ---------------------------------------------------------------------------------


def test_grafana_provisions_the_data_sources_and_the_dashboards_folder(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == GRAFANA_PROVISIONING
    datasources = load_yaml(GRAFANA_PROVISIONING / "datasources" / "datasources.yaml")
    assert datasources["apiVersion"] == 1
    by_uid = {d["uid"]: d for d in datasources["datasources"]}
    assert by_uid["prometheus"]["type"] == "prometheus" and by_uid["prometheus"]["url"] == "http://prometheus:9090"
    assert by_uid["jaeger"]["type"] == "jaeger" and by_uid["jaeger"]["url"] == "http://jaeger:16686"
    assert sum(1 for d in by_uid.values() if d.get("isDefault")) == 1
    providers = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "dashboards.yaml")
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and mounts[provider["options"]["path"]] == DASHBOARDS
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (DASHBOARDS / home.rsplit("/", 1)[1]).is_file()


def test_the_dashboard_has_the_panels_an_operator_needs() -> None:
    datasources = {
        d["uid"] for d in load_yaml(GRAFANA_PROVISIONING / "datasources" / "datasources.yaml")["datasources"]
    }
    (dashboard,) = dashboards().values()
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] in datasources, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in (
        "room_outbox_pending",
        "room_outbox_oldest_pending_age_seconds",
        "room_outbox_publish_success_total",
        "room_outbox_publish_failure_total",
        "room_outbox_publish_duration_seconds_bucket",
        "room_outbox_lost_leases_total",
        "room_outbox_consumer_lag",
        "room_outbox_consumer_assigned_partitions",
        "room_outbox_consumer_retrying",
        "room_outbox_consumer_dead_total",
    ):
        assert metric in exprs, f"no panel shows {metric}"
    assert "by (lane)" in exprs and "by (sink, error_class)" in exprs


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    queries = panel_queries()
    rules = {
        "groups": [
            {"name": "panels", "rules": [{"record": f"panel:{n}", "expr": q.expr} for n, q in enumerate(queries)]}
        ]
    }
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(queries)} rules found" in checked.stdout


def test_a_few_events_failing_for_good_page_and_a_backlog_is_not_counted_once_a_process(tmp_path: Path) -> None:
    """Unit tests of alerts.yml's rules (promtool test rules). Twenty events parked at once (each
    fails for good once, then is parked): the page came only of failures lasting ten minutes,
    so it never did. Two processes each report the table's whole backlog: its growth is the
    lane's, not twice it."""
    rules = {rule.get("alert"): rule for rule in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]}
    labels = {"sink": "tencent_im", "error_class": "permanent"}
    annotations = {
        key: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], text)
        for key, text in rules["RoomOutboxDeliveryFailingForGood"]["annotations"].items()
    }
    tests = tmp_path / "alerts.test.yml"
    tests.write_text(
        f"rule_files: [{ALERTS}]\n"
        "evaluation_interval: 1m\n"
        "tests:\n"
        "  - interval: 1m\n"
        "    input_series:\n"
        '      - series: \'room_outbox_publish_failure_total{sink="tencent_im",error_class="permanent"}\'\n'
        "        values: '0 0 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20 20'\n"
        "    alert_rule_test:\n"
        "      - eval_time: 3m\n"
        "        alertname: RoomOutboxDeliveryFailingForGood\n"
        "        exp_alerts:\n"
        "          - exp_labels: {severity: page, sink: tencent_im, error_class: permanent}\n"
        f"            exp_annotations: {json.dumps(annotations)}\n"
        "      - eval_time: 20m\n"
        "        alertname: RoomOutboxDeliveryFailingForGood\n"
        "        exp_alerts: []\n"
    )
    done = promtool("test", "rules", str(tests))
    assert done.returncode == 0, done.stdout + done.stderr
    backlog = [rule for rule in rules.values() if "room_outbox_pending" in rule["expr"]]
    assert all("sum by (lane)" not in rule["expr"] for rule in backlog), backlog


def case_at(alertname: str, alert: dict[str, Any]) -> Callable[[int, bool], dict[str, Any]]:
    """A promtool case of ``alertname`` at a minute: firing as ``alert`` (:func:`expected_alert`),
    or not at all."""

    def at(minute: int, fires: bool) -> dict[str, Any]:
        return {"eval_time": f"{minute}m", "alertname": alertname, "exp_alerts": [alert] if fires else []}

    return at


def expected_alert(rule: dict[str, Any], **labels: str) -> dict[str, Any]:
    """What promtool must find for ``rule`` firing with ``labels``: its severity and its
    annotations with the labels filled in."""
    annotations = {
        key: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], text)
        for key, text in rule["annotations"].items()
    }
    return {"exp_labels": {"severity": rule["labels"]["severity"], **labels}, "exp_annotations": annotations}


def test_the_first_failure_for_good_of_a_label_set_never_exported_before_pages(tmp_path: Path) -> None:
    """Unit tests of RoomOutboxDeliveryFailingForGood (promtool test rules), one-minute samples,
    for a label set not exported at 0 beforehand (a tailing lane's bad envelope of a type the
    routing does not know, ``event_type="other"``), whose first sample is 1: increase() alone
    never saw it. It pages
    for 15 minutes when it appears in a process running for long, and when it appears again
    in a process restarted since (same instance: increase() saw 1 then 1). A process running
    since before Prometheus started, its counter above 0 from its first scrape, does not."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    target = 'job="room-outbox",instance="{}"'
    failure = (
        'room_outbox_publish_failure_total{{sink="kafka",error_class="bad_envelope",event_type="other",' + target + "}}"
    )
    zero = (
        'room_outbox_publish_failure_total{{sink="kafka",error_class="permanent",event_type="RoomCreated",'
        + target
        + "}}"
    )
    up = "up{{" + target + "}}"
    started = "process_start_time_seconds{{" + target + "}}"
    bad_envelope = expected_alert(rules["RoomOutboxDeliveryFailingForGood"], sink="kafka", error_class="bad_envelope")

    at = case_at("RoomOutboxDeliveryFailingForGood", bad_envelope)

    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {  # started at 0, scraped since; its first bad envelope at 20m
                "interval": "1m",
                "input_series": [
                    {"series": up.format("a:9464"), "values": "1x50"},
                    {"series": started.format("a:9464"), "values": "0x50"},
                    {"series": zero.format("a:9464"), "values": "0x50"},
                    {"series": failure.format("a:9464"), "values": "_x20 1x30"},
                ],
                "alert_rule_test": [at(19, False), at(20, True), at(30, True), at(34, True), at(36, False)],
            },
            {  # running for two hours when Prometheus starts, one bad envelope behind it;
                # restarted at 11m (same instance), a bad envelope again at 15m
                "interval": "1m",
                "input_series": [
                    {"series": up.format("b:9464"), "values": "1x9 0 1x40"},
                    {"series": started.format("b:9464"), "values": "-7200x9 stale 660x40"},
                    {"series": failure.format("b:9464"), "values": "1x9 stale _x4 1x35"},
                ],
                "alert_rule_test": [at(5, False), at(14, False), at(15, True), at(29, True), at(31, False)],
            },
        ],
    }
    assert_rule_tests(tmp_path / "first-failure.test.yml", tests)


def test_events_parked_once_their_retries_ran_out_page_once(tmp_path: Path) -> None:
    """Unit test of RoomOutboxRetriesExhausted (promtool test rules), one-minute samples: three
    events parked once their retries ran out page for 15 minutes; an event parked by a failure
    for good pages as RoomOutboxDeliveryFailingForGood only, not as this one too."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    target = 'job="room-outbox",instance="a:9464"'
    parked = 'room_outbox_parked_total{{sink="tencent_im",event_type="RoomGiftSent",error_class="{}",' + target + "}}"
    exhausted = expected_alert(rules["RoomOutboxRetriesExhausted"], sink="tencent_im", error_class="retryable")

    at = case_at("RoomOutboxRetriesExhausted", exhausted)

    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": "up{" + target + "}", "values": "1x60"},
                    {"series": "process_start_time_seconds{" + target + "}", "values": "-7200x60"},
                    {"series": parked.format("retryable"), "values": "0x20 3x40"},
                    {"series": parked.format("permanent"), "values": "0x5 1x55"},
                ],
                "alert_rule_test": [at(5, False), at(10, False), at(21, True), at(35, True), at(37, False)],
            },
        ],
    }
    assert_rule_tests(tmp_path / "retries-exhausted.test.yml", tests)


def test_a_dead_letter_of_a_label_set_never_exported_before_pages(tmp_path: Path) -> None:
    """Unit test of RoomOutboxConsumerDeadLetters (promtool test rules), one-minute samples: a
    retry row left by a handler no longer configured dies as a dead letter under that
    handler's name, a label set not exported at 0 beforehand, whose first sample is 1:
    increase() alone never saw it. It pages for 15 minutes."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    target = 'job="room-outbox-consume",instance="consume-1:9464"'
    dead = 'room_outbox_consumer_dead_total{consumer="feed",handler="gone",reason="rejected",' + target + "}"
    alert = expected_alert(rules["RoomOutboxConsumerDeadLetters"], consumer="feed", handler="gone", reason="rejected")

    at = case_at("RoomOutboxConsumerDeadLetters", alert)

    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": "up{" + target + "}", "values": "1x50"},
                    {"series": "process_start_time_seconds{" + target + "}", "values": "0x50"},
                    {"series": dead, "values": "_x20 1x30"},
                ],
                "alert_rule_test": [at(19, False), at(20, True), at(34, True), at(36, False)],
            }
        ],
    }
    assert_rule_tests(tmp_path / "first-dead-letter.test.yml", tests)


def test_a_table_without_the_indexes_pages_and_lost_leases_name_their_process(tmp_path: Path) -> None:
    """Unit tests (promtool test rules), one-minute samples. A process whose schema watch finds
    the outbox table without room-outbox's indexes pages after a minute, naming itself, and no
    more once they are built again; its neighbour, finding none missing, does not. Rows taken
    over from a process warn, naming that process."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    problems = 'room_outbox_schema_problems{{job="room-outbox",instance="{}"}}'
    taken = (
        'room_outbox_lost_leases_total{{detected_at="result_write",cause="taken_over",job="room-outbox",instance="{}"}}'
    )
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": problems.format("a:9464"), "values": "0x3 1x10 0x10"},
                    {"series": problems.format("b:9464"), "values": "0x23"},
                    {"series": taken.format("a:9464"), "values": "0x23"},
                    {"series": taken.format("b:9464"), "values": "0 0 3x21"},
                ],
                "alert_rule_test": [
                    {"eval_time": "4m", "alertname": "RoomOutboxIndexesMissing", "exp_alerts": []},
                    {
                        "eval_time": "5m",
                        "alertname": "RoomOutboxIndexesMissing",
                        "exp_alerts": [expected_alert(rules["RoomOutboxIndexesMissing"], instance="a:9464")],
                    },
                    {"eval_time": "15m", "alertname": "RoomOutboxIndexesMissing", "exp_alerts": []},
                    {
                        "eval_time": "3m",
                        "alertname": "RoomOutboxLostLeases",
                        "exp_alerts": [expected_alert(rules["RoomOutboxLostLeases"], instance="b:9464")],
                    },
                ],
            }
        ],
    }
    assert_rule_tests(tmp_path / "indexes.test.yml", tests)


def test_consumers_down_stuck_or_falling_behind_alert(tmp_path: Path) -> None:
    """Unit tests of the consumers' alerts (promtool test rules), one-minute samples. A consume
    process that stops answering pages. A partition whose lag stays above 0 without once going
    down (nothing committed) pages after 15 minutes, once though two replicas report it; a
    busy partition whose lag goes up and down does not. A lag growing for 30 minutes warns,
    a steady one does not."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    lag = 'room_outbox_consumer_lag{{consumer="{}",topic="room-events",partition="{}",instance="{}"}}'
    busy = " ".join(["5 2 6 3"] * 10)  # never 0, but committed every other minute: it goes down
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'up{job="room-outbox-consume",instance="consume-1:9464"}', "values": "1 1 0x10"},
                    {"series": 'up{job="room-outbox-consume",instance="consume-2:9464"}', "values": "1x12"},
                    {"series": lag.format("feed", 0, "consume-1:9464"), "values": "5x12 6x12 8x15"},
                    {"series": lag.format("feed", 0, "consume-2:9464"), "values": "5x12 6x12 8x15"},
                    {"series": lag.format("feed", 1, "consume-1:9464"), "values": busy},
                    {"series": lag.format("stats", 0, "consume-1:9464"), "values": "0+10x50"},
                    {"series": lag.format("audit", 0, "consume-1:9464"), "values": "7x50"},
                ],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "RoomOutboxConsumerDown", "exp_alerts": []},
                    {
                        "eval_time": "5m",
                        "alertname": "RoomOutboxConsumerDown",
                        "exp_alerts": [
                            expected_alert(
                                rules["RoomOutboxConsumerDown"], job="room-outbox-consume", instance="consume-1:9464"
                            )
                        ],
                    },
                    {"eval_time": "10m", "alertname": "RoomOutboxConsumerStuck", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "RoomOutboxConsumerStuck",
                        "exp_alerts": [
                            expected_alert(
                                rules["RoomOutboxConsumerStuck"], consumer=c, topic="room-events", partition="0"
                            )
                            for c in ("audit", "feed", "stats")
                        ],
                    },
                    {"eval_time": "20m", "alertname": "RoomOutboxConsumerLagGrowing", "exp_alerts": []},
                    {
                        "eval_time": "45m",
                        "alertname": "RoomOutboxConsumerLagGrowing",
                        "exp_alerts": [expected_alert(rules["RoomOutboxConsumerLagGrowing"], consumer="stats")],
                    },
                ],
            }
        ],
    }
    assert_rule_tests(tmp_path / "consumers.test.yml", tests)


def test_a_consumer_no_process_holds_partitions_of_or_making_dead_letters_pages(tmp_path: Path) -> None:
    """Unit tests of the consumers' membership and dead-letter alerts (promtool test rules),
    one-minute samples. No process of a consumer holding a partition for 5 minutes pages (its
    lag may well be 0); processes that join within 5 minutes of their start do not, nor one
    replica holding none while another holds them all (more replicas than partitions). One
    dead letter pages at once, and no more once 15 minutes have passed; a process restarting
    (its counter back to 0) does not page."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assigned = 'room_outbox_consumer_assigned_partitions{{consumer="{}",instance="{}"}}'
    dead = 'room_outbox_consumer_dead_total{{consumer="{}",handler="{}",reason="{}",instance="{}"}}'
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": assigned.format("feed", "consume-1:9464"), "values": "3x3 0x25"},
                    {"series": assigned.format("feed", "consume-2:9464"), "values": "0x29"},
                    {"series": assigned.format("stats", "consume-1:9464"), "values": "0x3 2x25"},
                    {"series": assigned.format("audit", "consume-1:9464"), "values": "0x29"},
                    {"series": assigned.format("audit", "consume-2:9464"), "values": "3x29"},
                    {"series": dead.format("feed", "audit", "permanent", "consume-1:9464"), "values": "0 0 1x27"},
                    {"series": dead.format("feed", "audit", "failed", "consume-1:9464"), "values": "0x29"},
                    {"series": dead.format("stats", "gift_stats", "failed", "consume-1:9464"), "values": "2x3 0x25"},
                ],
                "alert_rule_test": [
                    {"eval_time": "8m", "alertname": "RoomOutboxConsumerNoPartitions", "exp_alerts": []},
                    {
                        "eval_time": "10m",
                        "alertname": "RoomOutboxConsumerNoPartitions",
                        "exp_alerts": [expected_alert(rules["RoomOutboxConsumerNoPartitions"], consumer="feed")],
                    },
                    {"eval_time": "1m", "alertname": "RoomOutboxConsumerDeadLetters", "exp_alerts": []},
                    {
                        "eval_time": "3m",
                        "alertname": "RoomOutboxConsumerDeadLetters",
                        "exp_alerts": [
                            expected_alert(
                                rules["RoomOutboxConsumerDeadLetters"],
                                consumer="feed",
                                handler="audit",
                                reason="permanent",
                            )
                        ],
                    },
                    {"eval_time": "20m", "alertname": "RoomOutboxConsumerDeadLetters", "exp_alerts": []},
                ],
            }
        ],
    }
    assert_rule_tests(tmp_path / "consumers.test.yml", tests)


def test_the_backlog_alerts_leave_out_stale_gauges_and_say_they_are_stale(tmp_path: Path) -> None:
    """Unit tests of the backlog alerts (promtool test rules), one-minute samples. A process
    whose backlog samples fail keeps exporting its last values: a frozen "oldest pending 10
    minutes" does not page as a stuck backlog, and a frozen 0 does not hide another process's
    fresh one; the stale gauges warn on their own."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    oldest = 'room_outbox_oldest_pending_age_seconds{{job="room-outbox",instance="{}",lane="main"}}'
    sampled = 'room_outbox_backlog_sample_age_seconds{{job="room-outbox",instance="{}"}}'
    stuck = expected_alert(rules["RoomOutboxBacklogStuck"], lane="main")
    stuck["exp_annotations"]["summary"] = stuck["exp_annotations"]["summary"].replace("{{ $value }}", "600")
    unknown = expected_alert(rules["RoomOutboxBacklogUnknown"], job="room-outbox", instance="b:9464")
    unknown["exp_annotations"]["summary"] = unknown["exp_annotations"]["summary"].replace("{{ $value }}", "600")
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {  # b's samples fail from the start: its gauges stay at 600 s, stale
                "interval": "1m",
                "input_series": [
                    {"series": oldest.format("b:9464"), "values": "600x20"},
                    {"series": sampled.format("b:9464"), "values": "0+60x20"},
                ],
                "alert_rule_test": [
                    {"eval_time": "10m", "alertname": "RoomOutboxBacklogStuck", "exp_alerts": []},
                    {"eval_time": "10m", "alertname": "RoomOutboxBacklogUnknown", "exp_alerts": [unknown]},
                ],
            },
            {  # a samples a backlog growing old; b's stale gauge says 0
                "interval": "1m",
                "input_series": [
                    {"series": oldest.format("a:9464"), "values": "0+60x20"},
                    {"series": sampled.format("a:9464"), "values": "15x20"},
                    {"series": oldest.format("b:9464"), "values": "0x20"},
                    {"series": sampled.format("b:9464"), "values": "0+60x20"},
                ],
                "alert_rule_test": [
                    {"eval_time": "10m", "alertname": "RoomOutboxBacklogStuck", "exp_alerts": [stuck]},
                ],
            },
        ],
    }
    assert_rule_tests(tmp_path / "backlog.test.yml", tests)


def test_events_a_lane_skipped_page_unless_their_gauge_is_stale(tmp_path: Path) -> None:
    """Unit test of RoomOutboxLaneSkippedEvents (promtool test rules), one-minute samples: a
    lane's skipped events page a minute after they are counted, and stop once requeued; a
    process whose samples fail (its gauge frozen at its last value) pages for nothing."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    skipped = 'room_outbox_lane_skipped{{job="room-outbox",instance="{}",lane="{}"}}'
    sampled = 'room_outbox_backlog_sample_age_seconds{{job="room-outbox",instance="{}"}}'
    paged = expected_alert(rules["RoomOutboxLaneSkippedEvents"], lane="audit")
    paged["exp_annotations"]["summary"] = paged["exp_annotations"]["summary"].replace("{{ $value }}", "2")
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {  # a counts 2 of lane audit's events skipped from minute 3 until requeued at minute 8;
                # b's samples fail, its gauge of lane kafka frozen at 1
                "interval": "1m",
                "input_series": [
                    {"series": skipped.format("a:9464", "audit"), "values": "0x2 2x5 0x10"},
                    {"series": sampled.format("a:9464"), "values": "15x17"},
                    {"series": skipped.format("b:9464", "kafka"), "values": "1x17"},
                    {"series": sampled.format("b:9464"), "values": "120+60x17"},
                ],
                "alert_rule_test": [
                    {"eval_time": "3m", "alertname": "RoomOutboxLaneSkippedEvents", "exp_alerts": []},
                    {"eval_time": "5m", "alertname": "RoomOutboxLaneSkippedEvents", "exp_alerts": [paged]},
                    {"eval_time": "10m", "alertname": "RoomOutboxLaneSkippedEvents", "exp_alerts": []},
                ],
            },
        ],
    }
    assert_rule_tests(tmp_path / "skipped.test.yml", tests)
