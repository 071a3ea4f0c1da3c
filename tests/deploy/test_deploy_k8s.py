"""deploy/k8s: Kubernetes schema validation (kubernetes-validate's bundled schemas, offline),
a structural check of the PodMonitor CRD, and agreement with the image and the worker's CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from deploylib import (
    K8S,
    final_stage,
    image_entrypoint,
    k8s_objects,
    kustomize_files,
    last,
    load_yaml,
    load_yaml_all,
    one,
    sleep_seconds,
    worker_config,
)

# Oldest and newest Kubernetes the manifests must validate against (native gRPC probes: 1.27+).
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
CRD_KINDS = {"PodMonitor"}  # not in the bundled schemas; checked structurally below
NAME = {"app.kubernetes.io/name": "q6serve"}

OBJS = k8s_objects()
ALL_MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def deployment() -> dict[str, Any]:
    return one(OBJS, "Deployment")


def pod_spec() -> dict[str, Any]:
    return deployment()["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (c,) = pod_spec()["containers"]
    return c


def worker_cfg():
    """The pod's worker config: image ENTRYPOINT + the container's args, literal env values."""
    c = container()
    assert "command" not in c, "keep the image's ENTRYPOINT (it fixes host and ports)"
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    return worker_config(image_entrypoint() + c["args"], env)


def port_number(name: str) -> int:
    return next(p["containerPort"] for p in container()["ports"] if p["name"] == name)


# -- schemas ------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", ALL_MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates_strictly(path: Path, version: str) -> None:
    for doc in load_yaml_all(path):
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_a_typo() -> None:
    doc = json.loads(json.dumps(deployment()))
    doc["spec"]["template"]["spec"]["containers"][0]["securityContext"][
        "readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


# The PodMonitor fields used here, from monitoring.coreos.com/v1 (prometheus-operator API).
# Unknown fields fail, so a typo cannot pass silently.
PODMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {"type": "object"},
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object"},
                                   "matchExpressions": {"type": "array"}}},
                "podMetricsEndpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "portNumber": {"type": "integer"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                            "scrapeTimeout": {"type": "string",
                                              "pattern": r"^(\d+(ms|s|m|h))+$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        }}},
            }},
    },
}


def test_podmonitor_structure_and_target() -> None:
    pm = one(OBJS, "PodMonitor")
    jsonschema.validate(pm, PODMONITOR_SCHEMA)
    assert pm["spec"]["selector"]["matchLabels"].items() <= \
        deployment()["spec"]["template"]["metadata"]["labels"].items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert port_number(ep["port"]) == worker_cfg().metrics_port
    assert ep["path"] == "/metrics"


# -- kustomization ------------------------------------------------------------------------------
def test_kustomization_covers_every_manifest() -> None:
    # Each variant folder (replicated/, a sharded one, ...) is its own entry point; together they
    # must list every manifest except the examples, or a file was forgotten or renamed.
    kfiles = sorted(K8S.rglob("kustomization.yaml"))
    used = {f for k in kfiles for f in kustomize_files(k.parent)}
    examples = {p for p in ALL_MANIFESTS if "examples" in p.parts}
    orphans = set(ALL_MANIFESTS) - used - examples
    assert not orphans, f"manifests no kustomization lists: {sorted(map(str, orphans))}"
    for p in kfiles:
        assert load_yaml(p)["kind"] in ("Kustomization", "Component"), p


def test_images_transformer_matches_the_container_image() -> None:
    images = load_yaml(K8S / "kustomization.yaml")["images"]
    assert container()["image"].split(":")[0] in {i["name"] for i in images}


# -- agreement with the image and the CLI --------------------------------------------------------
def test_container_ports_are_the_worker_ports() -> None:
    cfg = worker_cfg()
    assert port_number("grpc") == cfg.port
    assert port_number("metrics") == cfg.metrics_port


def test_probes_are_native_grpc_on_the_grpc_port() -> None:
    c = container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == worker_cfg().port, probe


def test_termination_grace_covers_prestop_and_drain() -> None:
    pre = sleep_seconds(container()["lifecycle"]["preStop"])
    total = pod_spec()["terminationGracePeriodSeconds"]
    drain = worker_cfg().grace_period_s
    assert total >= pre + drain + 5, f"{total}s < preStop {pre}s + drain {drain}s + 5s margin"
    # ... and not absurdly long either: a stuck pod should go within a minute of its drain.
    assert total <= pre + drain + 60


def test_security_context() -> None:
    pod, c = pod_spec()["securityContext"], container()["securityContext"]
    uid = int(last(final_stage(), "USER").value.split(":")[0])
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid
    assert c["readOnlyRootFilesystem"] is True
    assert c["allowPrivilegeEscalation"] is False
    assert c["capabilities"]["drop"] == ["ALL"]
    assert pod_spec()["automountServiceAccountToken"] is False


def test_no_service_link_env() -> None:
    # A Service named q6serve would otherwise inject Q6SERVE_SERVICE_HOST, Q6SERVE_PORT, ... into
    # the worker's environment, the prefix its own configuration variables use.
    assert pod_spec()["enableServiceLinks"] is False


def test_one_gpu_and_resources() -> None:
    res = container()["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1
    assert res["requests"].get("nvidia.com/gpu", 1) == 1
    assert "memory" in res["requests"] and "memory" in res["limits"]


def test_volumes_cover_the_image_volumes_and_tmp() -> None:
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    image_vols = {v for i in final_stage() if i.cmd == "VOLUME" for v in json.loads(i.value)}
    assert image_vols | {"/tmp"} <= set(mounts)
    assert mounts[str(worker_cfg().model_dir)].get("readOnly") is True
    env = {e["name"]: e.get("value") for e in container()["env"]}
    assert env["CUPY_CACHE_DIR"].startswith("/cache/")
    declared = {v["name"] for v in pod_spec()["volumes"]}
    assert {m["name"] for m in mounts.values()} <= declared


def test_headless_service_selects_the_pods() -> None:
    svc = one(OBJS, "Service")
    assert svc["spec"]["clusterIP"] == "None", "client-side LB needs a headless Service"
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert NAME.items() <= labels.items()
    names = {p["name"] for p in container()["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in names
        assert p["port"] == port_number(p["targetPort"])


def test_pdb_selects_the_pods() -> None:
    pdb = one(OBJS, "PodDisruptionBudget")
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment()["spec"]["replicas"] > pdb["spec"].get("maxUnavailable", 0)
