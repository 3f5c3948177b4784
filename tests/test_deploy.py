"""deploy/: the compose stack, the trainer image and the Kubernetes manifests hang together.

Docker has no engine on these machines, so nothing here starts a container: the files are
parsed and cross-checked (ports, paths, labels, selectors, the demo's command line against
the real CLI parser). ``promtool check config`` runs on deploy's Prometheus config for real,
and ``kubectl kustomize`` renders the manifests where kubectl is installed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO

from asyncckpt.cli import build_parser

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
METRICS_PORT = 9400


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    return dict(load_yaml(DEPLOY / "compose.yaml"))


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/trainer/Dockerfile, continuation lines joined."""
    text = (DEPLOY / "trainer" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def instruction(name: str) -> list[str]:
    return [args for op, args in dockerfile() if op == name]


def parse_demo(args: list[str]) -> argparse.Namespace:
    """Parse the deploy files' demo arguments with the real ``asyncckpt`` parser (exits on a bad flag)."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == "demo"
    return parsed


def k8s_documents() -> dict[tuple[str, str], dict[str, Any]]:
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted((K8S / "base").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path.name
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


# ---------------------------------------------------------------------------------------------- Prometheus
@pytest.mark.prometheus
def test_promtool_accepts_the_prometheus_config(promtool_binary: str) -> None:
    proc = subprocess.run([promtool_binary, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_prometheus_scrapes_the_trainer_service_on_its_metrics_port() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    assert static["targets"] == [f"trainer:{METRICS_PORT}"]
    assert "trainer" in compose()["services"]


# ---------------------------------------------------------------------------------------------- compose
def test_compose_services_and_pinned_images() -> None:
    services = compose()["services"]
    assert set(services) == {"trainer", "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        image = services[name]["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest", f"{name}: pin the image version, got {image}"
    assert services["prometheus"]["depends_on"] == ["trainer"] and services["grafana"]["depends_on"] == ["prometheus"]


def test_compose_bind_mounts_exist_and_named_volumes_are_declared() -> None:
    spec = compose()
    declared = set(spec["volumes"])
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            source, target, *_mode = volume.split(":")
            assert target.startswith("/"), f"{name}: {volume}"
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared"


def test_compose_prometheus_reads_the_mounted_config() -> None:
    service = compose()["services"]["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    config_flag = next(f for f in service["command"] if f.startswith("--config.file="))
    source = mounts[config_flag.split("=", 1)[1]]
    assert (DEPLOY / source).resolve() == DEPLOY / "prometheus" / "prometheus.yml"
    storage = next(f for f in service["command"] if f.startswith("--storage.tsdb.path="))
    assert storage.split("=", 1)[1] in mounts  # the TSDB lives on a volume
    assert "9090:9090" in service["ports"]


def test_compose_grafana_is_provisioned_and_opens_the_dashboard() -> None:
    service = compose()["services"]["grafana"]
    mounts = {v.split(":")[1]: (DEPLOY / v.split(":")[0]).resolve() for v in service["volumes"] if v.startswith(".")}
    assert mounts["/etc/grafana/provisioning"] == REPO / "grafana" / "provisioning"
    home = service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    mount_point = next(m for m in mounts if home.startswith(m + "/"))
    assert (mounts[mount_point] / home.removeprefix(mount_point + "/")).is_file()
    datasource = load_yaml(REPO / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"  # the compose service name and Prometheus's port


def test_compose_trainer_builds_from_the_dockerfile_and_exports_on_the_scraped_port() -> None:
    trainer = compose()["services"]["trainer"]
    context = (DEPLOY / trainer["build"]["context"]).resolve()
    assert context == REPO
    assert (context / trainer["build"]["dockerfile"]).resolve() == DEPLOY / "trainer" / "Dockerfile"
    assert trainer["environment"]["ASYNCCKPT_METRICS_PORT"] == str(METRICS_PORT)
    assert str(METRICS_PORT) in trainer["expose"]
    assert any(v.endswith(":/checkpoints") for v in trainer["volumes"])


def test_compose_gpu_override_reserves_nvidia_gpus_for_the_trainer() -> None:
    override = load_yaml(DEPLOY / "compose.gpu.yaml")
    assert set(override["services"]) == {"trainer"}
    (device,) = override["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == "all"
    assert "deploy" not in compose()["services"]["trainer"]  # the base stack still starts without GPUs


# ---------------------------------------------------------------------------------------------- trainer image
def test_dockerfile_copies_what_exists_and_runs_the_demo() -> None:
    for args in instruction("COPY"):
        *sources, _destination = shlex.split(args)
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the build context"
    assert instruction("EXPOSE") == [str(METRICS_PORT)]
    assert json.loads(instruction("ENTRYPOINT")[0]) == ["asyncckpt"]
    cmd = json.loads(instruction("CMD")[0])
    parsed = parse_demo(cmd)
    assert parsed.hold_seconds > 0 and parsed.metrics_port is None  # the port comes from ASYNCCKPT_METRICS_PORT
    env = " ".join(instruction("ENV"))
    assert f"ASYNCCKPT_METRICS_PORT={METRICS_PORT}" in env and "TMPDIR=/checkpoints" in env
    (user,) = instruction("USER")
    assert user.isdigit() and user != "0"  # numeric, so Kubernetes runAsNonRoot can check it


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    rules = [line.strip() for line in (DEPLOY / "trainer" / "Dockerfile.dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]  # fmt: skip

    def included(path: str) -> bool:
        keep = True
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                keep = negate
        return keep

    for args in instruction("COPY"):
        for source in shlex.split(args)[:-1]:
            assert included(source), f"{source} is excluded from the build context"
    assert not included("tests")


# ---------------------------------------------------------------------------------------------- Kubernetes
def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(K8S / "base" / "kustomization.yaml")
    files = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_job_serves_metrics_on_a_named_port_and_mounts_the_claim() -> None:
    docs = k8s_documents()
    job = docs[("Job", "asyncckpt-trainer")]
    assert job["apiVersion"] == "batch/v1"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": METRICS_PORT}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ASYNCCKPT_METRICS_PORT"] == str(METRICS_PORT)
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    parsed = parse_demo(container["args"])
    assert parsed.metrics_port is None and parsed.hold_seconds > 0
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= set(claims)
    assert ("PersistentVolumeClaim", claims["checkpoints"]) in docs
    (user,) = instruction("USER")
    assert pod["securityContext"]["runAsUser"] == int(user) and pod["securityContext"]["runAsNonRoot"] is True


def test_service_and_servicemonitor_select_the_trainer_metrics_port() -> None:
    docs = k8s_documents()
    job = docs[("Job", "asyncckpt-trainer")]
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    service = docs[("Service", "asyncckpt-trainer")]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] == "metrics" and port["port"] == METRICS_PORT
    monitor = docs[("ServiceMonitor", "asyncckpt-trainer")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar() -> None:
    configmap = k8s_documents()[("ConfigMap", "asyncckpt-grafana-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    embedded = json.loads(configmap["data"]["asyncckpt.json"])
    assert embedded == json.loads((REPO / "grafana" / "dashboards" / "asyncckpt.json").read_text())


def test_gpu_overlay_patch_applies_to_the_base_job() -> None:
    overlay = load_yaml(K8S / "gpu" / "kustomization.yaml")
    assert [(K8S / "gpu" / r).resolve() for r in overlay["resources"]] == [K8S / "base"]
    (patch,) = overlay["patches"]
    assert patch["target"]["kind"] == "Job" and patch["target"]["name"] == "asyncckpt-trainer"
    (operation,) = yaml.safe_load(patch["patch"])
    assert operation["op"] == "add" and operation["value"] == 1
    # Walk the JSON pointer through the real base Job: every parent of the added key must exist.
    node: Any = k8s_documents()[("Job", "asyncckpt-trainer")]
    *parents, leaf = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    assert isinstance(node, dict) and leaf == "nvidia.com/gpu" and leaf not in node


def test_kubectl_kustomize_renders_base_and_gpu_overlay() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the structural tests above still ran")
    rendered = {}
    for name in ("base", "gpu"):
        proc = subprocess.run([kubectl, "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        rendered[name] = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(proc.stdout)}
    assert set(rendered["base"]) == set(k8s_documents())
    gpu_job = rendered["gpu"][("Job", "asyncckpt-trainer")]
    assert gpu_job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    base_job = rendered["base"][("Job", "asyncckpt-trainer")]
    assert "nvidia.com/gpu" not in base_job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
