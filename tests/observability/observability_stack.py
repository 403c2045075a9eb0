"""The compose stack's observability files, read the way the services read them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
ALERTS = DOCKER / "prometheus" / "alerts.yml"
COLLECTOR_CONFIG = DOCKER / "otel-collector" / "config.yaml"
GRAFANA_PROVISIONING = DOCKER / "grafana" / "provisioning"
DASHBOARDS = DOCKER / "grafana" / "dashboards"

#: Grafana's range variables, as a query sent to Prometheus directly needs them.
GRAFANA_VARIABLES = {"$__rate_interval": "15s", "$__interval": "5s", "$__range": "5m"}

#: A comparison with a number at the end of an alert expression: the threshold.
_THRESHOLD = re.compile(r"\s*(>|<|>=|<=|==|!=)\s*-?[0-9.eE+]+\s*$")


@dataclass(frozen=True)
class Query:
    source: str  # "alert RoomOutboxBacklogStuck", "panel 'Backlog per lane' A"
    expr: str


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def alert_queries() -> list[Query]:
    """Each alert's expression without its threshold: what must return series for the alert
    to be able to fire at all (with the threshold, a healthy system rightly returns none)."""
    return [Query(f"alert {rule['alert']}", _THRESHOLD.sub("", rule["expr"])) for rule in alert_rules()]


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panel_queries() -> list[Query]:
    queries = []
    for dashboard in dashboards().values():
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                queries.append(Query(f"panel {panel['title']!r} {target['refId']}", expr))
    return queries


def metric_names(expr: str) -> set[str]:
    """The room_outbox_*, process_* and python_* metric names an expression reads."""
    return set(re.findall(r"\b((?:room_outbox|process|python)_[a-z0-9_]+)", expr))
