"""config/kubernetes.yaml: every object against Kubernetes' own schemas (kubernetes-validate,
which bundles them: no cluster, no network), strictly (an unknown or misspelt field fails), and
against what room-outbox and its image provide: the configuration loads and passes the start-up
check with the Secret's variables, the probes ask the endpoint the configuration opens, the
commands are the image's, and the pod is given the time a clean stop takes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from room_outbox.cli.main import build_parser
from room_outbox.config import load_settings, parse_listen
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.startup import check_configuration

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "config" / "kubernetes.yaml"
#: The oldest Kubernetes release the manifest is checked against (still in wide use).
KUBERNETES = "1.28.0"


@pytest.fixture(scope="module")
def objects() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def pod(objects: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = objects[kind]["spec"]["template"]["spec"]
    return spec


def test_every_object_is_valid_for_kubernetes(objects: dict[str, dict[str, Any]]) -> None:
    assert set(objects) == {"ConfigMap", "Secret", "Job", "Deployment"}
    for obj in objects.values():
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_the_configuration_passes_the_start_up_check_with_the_secrets(
    objects: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(objects["ConfigMap"]["data"]["config.yaml"])
    for name, value in objects["Secret"]["stringData"].items():
        monkeypatch.setenv(name, value)
    settings = load_settings(config)
    check_configuration(settings, make_plugin_manager(settings.plugins.disabled))
    assert settings.database.dsn.get_secret_value() == objects["Secret"]["stringData"]["ROOM_OUTBOX__DATABASE__DSN"]
    assert settings.sinks["tencent_im"]["secret_key"] == "CHANGE-ME"


def test_the_pods_run_the_images_commands_on_the_mounted_configuration(objects: dict[str, dict[str, Any]]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["room-outbox"]' in dockerfile
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user is not None
    for kind, command in (("Job", "migrate"), ("Deployment", "run")):
        spec = pod(objects, kind)
        [container] = spec["containers"]
        args = build_parser().parse_args(container["args"])  # the image's entrypoint takes them
        assert args.command == command
        [mount] = container["volumeMounts"]
        assert args.config == f"{mount['mountPath']}/config.yaml"
        assert spec["volumes"] == [
            {"name": mount["name"], "configMap": {"name": objects["ConfigMap"]["metadata"]["name"]}}
        ]
        assert container["envFrom"] == [{"secretRef": {"name": objects["Secret"]["metadata"]["name"]}}]
        security = spec["securityContext"]
        assert (str(security["runAsUser"]), str(security["runAsGroup"])) == user.groups()


def test_the_probes_ask_the_endpoint_and_the_pod_has_the_time_a_clean_stop_takes(
    objects: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(objects["ConfigMap"]["data"]["config.yaml"])
    settings = load_settings(config)
    host, port = parse_listen(settings.telemetry.http_listen)
    assert host == "0.0.0.0"  # the kubelet asks from outside the pod
    spec = pod(objects, "Deployment")
    [container] = spec["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": port}]
    assert f"EXPOSE {port}" in (ROOT / "Dockerfile").read_text()
    probes = {name: container[name]["httpGet"] for name in ("readinessProbe", "livenessProbe", "startupProbe")}
    assert probes == {
        "readinessProbe": {"path": "/readyz", "port": "http"},
        "livenessProbe": {"path": "/healthz", "port": "http"},
        "startupProbe": {"path": "/healthz", "port": "http"},
    }
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > settings.database.connect_wait
    stop_takes = settings.outbox_worker.publish_timeout + settings.database.query_timeout + 1
    assert spec["terminationGracePeriodSeconds"] > stop_takes
