"""Metrics: names and labels per DESIGN.md, promtool-clean exposition, deferred device timings,
and a real Prometheus server scraping a running worker."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from svc_util import RunningWorker, backend_name, random_q6k

from q6serve.kernels.api import KernelTiming, Layout, MatmulResult, Precision
from q6serve.service.batcher import BatchStats
from q6serve.service.metrics import (
    LATENCY_BUCKETS,
    ROW_BUCKETS,
    Metrics,
    PlainCounter,
    PlainHistogram,
    n_bucket,
)

EXPECTED = {
    "q6serve_kernel_duration_seconds": {"kernel", "layout", "n_bucket"},
    "q6serve_request_duration_seconds": {"service", "method", "code"},
    "q6serve_queue_delay_seconds": set(),
    "q6serve_batch_rows": set(),
    "q6serve_requests": {"service", "method", "code"},  # exposed as q6serve_requests_total
    "q6serve_vram_budget_bytes": set(),
    "q6serve_vram_weights_bytes": set(),
    "q6serve_vram_scratch_bytes": set(),
    "q6serve_vram_staging_bytes": set(),
    "q6serve_vram_pool_bytes": set(),
    "q6serve_vram_device_used_bytes": set(),
    "q6serve_vram_device_total_bytes": set(),
    "q6serve_weights_loaded": set(),
    "q6serve_flag_enabled": {"flag"},
    "q6serve_build_info": {"version", "backend", "device"},
}


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _busy_worker(start_worker) -> RunningWorker:  # type: ignore[no-untyped-def]
    worker = start_worker(metrics_port=0)
    c = worker.client()
    c.upload("w", random_q6k(16, 256, 1), 16, 256)
    for n in (1, 2, 5, 40):
        c.matmul("w", np.ones((n, 256), np.float32))
    worker.client().health()
    return worker


def test_buckets_and_n_buckets() -> None:
    assert LATENCY_BUCKETS[0] == 5e-6 and LATENCY_BUCKETS[-1] == 1.0
    assert [n_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65, 1000)] == [
        "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "33-64", "65+", "65+"]


def test_exposition_names_labels_and_promtool(start_worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    worker = _busy_worker(start_worker)
    text = _scrape(f"http://127.0.0.1:{worker.worker.metrics_port}/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, labels in EXPECTED.items():
        assert name in families, name
        for s in families[name].samples:
            assert labels <= set(s.labels) <= labels | {"le"}, (name, s.labels)
    kernel = [s for s in families["q6serve_kernel_duration_seconds"].samples
              if s.name.endswith("_count")]
    assert {s.labels["layout"] for s in kernel} == {"soa"}
    assert all(s.labels["kernel"].startswith(backend_name()) for s in kernel)
    assert {s.labels["n_bucket"] for s in kernel} == {"1", "2", "5-8", "33-64"}
    ok = [s for s in families["q6serve_requests"].samples
          if s.labels == {"service": "q6serve.v1.Q6Serve", "method": "Matmul", "code": "OK"}
          and s.name.endswith("_total")]
    assert ok and ok[0].value == 4
    assert "q6serve_requests_total" in text and "q6serve_build_info{" in text
    flags = {s.labels["flag"]: s.value for s in families["q6serve_flag_enabled"].samples}
    assert flags == {"Q6SERVE_Q6K_SOA": 1, "Q6SERVE_DECODE_MMQ": 1,
                     "Q6SERVE_DYNAMIC_BATCHING": 1}
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; .ci/run installs it)")
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_error_codes_are_counted(start_worker) -> None:  # type: ignore[no-untyped-def]
    from q6serve.client.client import Q6ServeError

    worker = start_worker()
    c = worker.client()
    with pytest.raises(Q6ServeError):
        c.get("missing")
    text = worker.worker.metrics.exposition().decode()
    assert ('q6serve_requests_total{code="NOT_FOUND",method="GetWeight",'
            'service="q6serve.v1.Q6Serve"} 1.0') in text


class _Event:
    def __init__(self) -> None:
        self.done = False

    def synchronize(self) -> None:
        self.done = True


class _DeviceTiming(KernelTiming):
    """Stands in for CUDA events: not ready until ``finish``."""

    def __init__(self) -> None:
        super().__init__(_events=(_Event(), _Event()))
        self.value = 42e-6

    def finish(self) -> None:
        self._events[1].done = True

    def seconds(self, wait: bool = False) -> float | None:
        if wait:
            raise AssertionError("metrics must never wait for a device event")
        return self.value if self._events[1].done else None


def test_device_timings_are_read_after_the_fact() -> None:
    m = Metrics(CollectorRegistry(), version="t", backend="cuda", device="test")
    timing = _DeviceTiming()
    res = MatmulResult(np.zeros((3, 4), np.float32), "cuda.mmq.soa", Layout.SOA,
                       Precision.Q8_1, timing)
    m.observe_batch(BatchStats(res, 3, 2, (1e-5, 2e-5)))
    labels = {"kernel": "cuda.mmq.soa", "layout": "soa", "n_bucket": "3-4"}
    count = "q6serve_kernel_duration_seconds_count"
    assert m.registry.get_sample_value(count, labels) is None
    assert m.poll() == 1  # still parked: not ready, no sync forced
    timing.finish()
    assert m.poll() == 0
    assert m.registry.get_sample_value(count, labels) == 1
    assert m.registry.get_sample_value("q6serve_queue_delay_seconds_count") == 2
    assert m.registry.get_sample_value("q6serve_batch_rows_sum") == 3


def _exposition_of(registry: CollectorRegistry) -> list[str]:
    """The text exposition's lines, with each *_created series' time left out (made apart)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line.rpartition(" ")[0] if "_created" in line and not line.startswith("#")
            else line for line in lines]


def test_plain_families_expose_what_prometheus_client_does() -> None:
    """The worker's per-request families are plain series read at scrape time: for the same
    observations (bucket edges, above every bucket, +inf, NaN, zero, several label sets and
    a series made empty) the exposition is prometheus_client's Histogram's and Counter's."""
    ours, ref = CollectorRegistry(), CollectorRegistry()
    labels = ["service", "method", "code"]
    h = PlainHistogram("t_seconds", "A histogram.", labels, ours, LATENCY_BUCKETS)
    c = PlainCounter("t_requests", "A counter.", labels, ours)
    u = PlainHistogram("t_rows", "Unlabelled.", [], ours, ROW_BUCKETS)
    rh = Histogram("t_seconds", "A histogram.", labels, buckets=LATENCY_BUCKETS, registry=ref)
    rc = Counter("t_requests", "A counter.", labels, registry=ref)
    ru = Histogram("t_rows", "Unlabelled.", buckets=ROW_BUCKETS, registry=ref)
    values = [0.0, 5e-6, 5.0001e-6, 1e-4, 0.3, 1.0, 2.0, float("inf"), float("nan"), 1e-5]
    for i, v in enumerate(values):
        key = ("svc", "M", "OK" if i % 3 else "NOT_FOUND")
        h.labels(*key).observe(v)
        rh.labels(*key).observe(v)
        c.labels(*key).inc(i)
        rc.labels(*key).inc(i)
        u.observe(v * 100)
        ru.observe(v * 100)
    c.labels("svc", "Empty", "OK")
    rc.labels("svc", "Empty", "OK")
    assert _exposition_of(ours) == _exposition_of(ref)
    with pytest.raises(ValueError):
        c.labels("svc", "M", "OK").inc(-1)
    with pytest.raises(ValueError):
        h.labels("svc", "M")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(base: str, q: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    body = json.loads(_scrape(url))
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_real_prometheus_scrapes_kernel_histogram(start_worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus binary not installed (Debian package `prometheus`; "
                    ".ci/run installs it)")
    worker = _busy_worker(start_worker)
    port = _free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: q6serve\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{worker.worker.metrics_port}']}}]\n")
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        series: list[dict] = []
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                series = _query(base, 'q6serve_kernel_duration_seconds_bucket{job="q6serve"}')
            except OSError:
                series = []
            if series:
                break
            time.sleep(0.5)
        assert series, "Prometheus never returned the kernel histogram"
        labels = {(s["metric"]["kernel"], s["metric"]["layout"], s["metric"]["n_bucket"])
                  for s in series}
        assert any(k.startswith(backend_name()) and (lay, nb) == ("soa", "33-64")
                   for k, lay, nb in labels), labels
        assert {s["metric"]["le"] for s in series} >= {"5e-06", "1.0", "+Inf"}
        up = _query(base, 'up{job="q6serve"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
