"""deploy/docker-compose.yml and deploy/prometheus: the Compose spec, promtool, and agreement
with the image and the worker's CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from deploylib import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    PROMETHEUS_DIR,
    REPO,
    compose,
    container_ports,
    duration_s,
    final_stage,
    image_entrypoint,
    interpolate,
    load_yaml,
    mount_targets,
    worker_config,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def worker_cfg():
    """The worker's effective config in compose: image ENTRYPOINT + command, and environment."""
    svc = compose()["services"]["worker"]
    env = {k: str(v) for k, v in svc["environment"].items()}
    return worker_config(image_entrypoint() + svc["command"], env)


# -- the Compose spec ---------------------------------------------------------------------------
def test_compose_file_is_valid_compose_spec() -> None:
    from compose_spec import PyCompose  # strict Compose-spec parser (dev extra)

    PyCompose.from_yaml(interpolate(COMPOSE.read_text()))
    with pytest.raises(ValueError, match="readonly"):  # negative control: unknown keys fail
        PyCompose.from_yaml(interpolate(COMPOSE.read_text()).replace("read_only:", "readonly:"))


def test_stack_has_worker_prometheus_grafana() -> None:
    assert set(compose()["services"]) == {"worker", "prometheus", "grafana"}


def test_worker_builds_this_dockerfile() -> None:
    build = compose()["services"]["worker"]["build"]
    ctx = (COMPOSE.parent / build["context"]).resolve()
    assert ctx == REPO
    assert (ctx / build["dockerfile"]).resolve() == DOCKERFILE


def test_worker_reserves_an_nvidia_gpu() -> None:
    devices = compose()["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_worker_ports_agree_with_the_cli() -> None:
    cfg = worker_cfg()
    assert cfg.host == "0.0.0.0"
    assert container_ports(compose()["services"]["worker"]) == {cfg.port, cfg.metrics_port}


def test_worker_volumes_agree_with_the_image() -> None:
    svc = compose()["services"]["worker"]
    mounts = mount_targets(svc)
    image_vols = {v for i in final_stage() if i.cmd == "VOLUME" for v in json.loads(i.value)}
    assert image_vols <= set(mounts), f"image volumes {image_vols} not all mounted: {mounts}"
    assert str(worker_cfg().model_dir) in mounts
    models = next(v for v in svc["volumes"] if isinstance(v, str) and ":/models" in v)
    assert models.endswith(":ro"), "mount the model dir read-only"
    cache_dir = svc["environment"]["CUPY_CACHE_DIR"]
    assert any(cache_dir.startswith(t + "/") for t in mounts), cache_dir
    assert mounts["/cache"] in compose()["volumes"], "kernel cache should be a named volume"


def test_worker_is_read_only_with_writable_tmp() -> None:
    svc = compose()["services"]["worker"]
    assert svc["read_only"] is True
    assert "/tmp" in svc["tmpfs"]
    assert svc["cap_drop"] == ["ALL"]


def test_stop_grace_covers_the_drain() -> None:
    grace = duration_s(compose()["services"]["worker"]["stop_grace_period"])
    assert grace >= worker_cfg().grace_period_s + 5, "Docker would SIGKILL mid-drain"


def test_flags_are_passed_through() -> None:
    env = compose()["services"]["worker"]["environment"]
    for flag in ("Q6SERVE_Q6K_SOA", "Q6SERVE_DECODE_MMQ", "Q6SERVE_DYNAMIC_BATCHING"):
        assert str(env[flag]) in ("0", "1")


def test_published_ports_default_to_loopback() -> None:
    for name, svc in compose()["services"].items():
        for p in svc.get("ports", []):
            assert str(p).startswith("127.0.0.1:"), f"{name} publishes {p} beyond loopback"


# -- Prometheus ---------------------------------------------------------------------------------
def test_prometheus_scrapes_the_worker_metrics_port() -> None:
    cfg = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "q6serve")
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"worker:{worker_cfg().metrics_port}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    prom = compose()["services"]["prometheus"]
    mounts = mount_targets(prom)
    assert (COMPOSE.parent / mounts["/etc/prometheus"]).resolve() == PROMETHEUS_DIR
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]


@needs_promtool
def test_promtool_check_config() -> None:
    r = promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr, "rules/*.yml not picked up"


@needs_promtool
def test_promtool_check_rules() -> None:
    rules = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
    assert rules
    r = promtool("check", "rules", *map(str, rules))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    r = promtool("test", "rules", str(PROMETHEUS_DIR / "tests" / "q6serve.test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    # Negative control: a typo'd key fails the same check.
    bad = tmp_path / "prometheus.yml"
    bad.write_text((PROMETHEUS_DIR / "prometheus.yml").read_text()
                   .replace("scrape_interval", "scrape_intervall").replace("rules/*.yml", "x"))
    assert promtool("check", "config", str(bad)).returncode != 0


# -- Grafana ------------------------------------------------------------------------------------
def test_grafana_provisioning_mounts_and_paths() -> None:
    graf = compose()["services"]["grafana"]
    mounts = {t: (COMPOSE.parent / s).resolve() for t, s in mount_targets(graf).items()
              if s.startswith(".")}
    prov = mounts["/etc/grafana/provisioning"]
    assert prov == DEPLOY / "grafana" / "provisioning"
    ds = load_yaml(prov / "datasources" / "prometheus.yml")["datasources"]
    assert [d["url"] for d in ds] == ["http://prometheus:9090"]
    providers = load_yaml(prov / "dashboards" / "q6serve.yml")["providers"]
    for p in providers:
        path = p["options"]["path"]
        assert path in mounts, f"dashboard provider path {path} is not mounted"
        assert list(mounts[path].glob("*.json")), f"no dashboards in {mounts[path]}"
    home = graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    folder, name = home.rsplit("/", 1)
    assert (mounts[folder] / name).is_file()
