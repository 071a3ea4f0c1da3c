"""deploy/grafana dashboard and the Prometheus alert rules: every query names a metric the
worker exports (names taken from the metrics module itself), and Prometheus' own parser accepts
every expression."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploylib import (
    DASHBOARD,
    DEPLOY,
    PROMETHEUS_DIR,
    dashboard_queries,
    exported_metric_names,
    grafana_to_promql,
    load_yaml,
    promql_metrics,
)

EXPORTED = exported_metric_names()
DASH = json.loads(DASHBOARD.read_text())
QUERIES = dashboard_queries(DASH)
# Series Prometheus itself adds to every target; allowed in alert rules, not in the dashboard.
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def rule_exprs() -> list[tuple[str, str]]:
    out = []
    for f in sorted((PROMETHEUS_DIR / "rules").glob("*.yml")):
        for g in load_yaml(f)["groups"]:
            for r in g["rules"]:
                out.append((f"{f.name}:{r.get('alert') or r.get('record')}", r["expr"]))
    return out


def test_exported_names_come_with_suffixes() -> None:
    # Sanity of the derivation itself: histogram, counter and info families expand.
    for name in ("q6serve_kernel_duration_seconds_bucket", "q6serve_requests_total",
                 "q6serve_build_info", "q6serve_vram_budget_bytes"):
        assert name in EXPORTED


def test_metric_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (kernel, le) (rate(a_bucket{kernel=~"$k", '
            'x="by (y)"}[$__rate_interval]))) / on (instance) group_left b + 1e-3 * c offset 5m')
    assert promql_metrics(expr) == {"a_bucket", "b", "c"}
    assert promql_metrics('label_values(q6serve_build_info{job="x"}, instance)') == {
        "q6serve_build_info"}


@pytest.mark.parametrize(("where", "expr"), QUERIES, ids=[w for w, _ in QUERIES])
def test_dashboard_query_names_exported_metrics(where: str, expr: str) -> None:
    names = promql_metrics(expr)
    assert names, f"{where}: no metric in {expr!r}"
    unknown = names - EXPORTED
    assert not unknown, f"{where}: {sorted(unknown)} not exported by the worker"


@pytest.mark.parametrize(("where", "expr"), rule_exprs(), ids=[w for w, _ in rule_exprs()])
def test_alert_rule_names_exported_metrics(where: str, expr: str) -> None:
    unknown = promql_metrics(expr) - EXPORTED - SCRAPE_SERIES
    assert not unknown, f"{where}: {sorted(unknown)} not exported by the worker"


def test_histogram_quantiles_keep_le() -> None:
    for where, expr in [*QUERIES, *rule_exprs()]:
        for m in re.finditer(r"histogram_quantile\(", expr):
            inner = expr[m.end():]
            assert "_bucket" in inner, f"{where}: histogram_quantile over a non-bucket series"
            by = re.search(r"\bby\s*\(([^)]*)\)", inner)
            assert by and "le" in [x.strip() for x in by.group(1).split(",")], \
                f"{where}: histogram_quantile must aggregate `by (le, ...)`"


def test_dashboard_covers_the_required_views() -> None:
    exprs = " ".join(e for _, e in QUERIES)
    for needle in ("histogram_quantile(0.5, sum by (kernel, le)",
                   "histogram_quantile(0.99, sum by (kernel, le)",
                   "q6serve_kernel_duration_seconds_bucket", "q6serve_requests_total",
                   'code!="OK"', "q6serve_batch_rows", "q6serve_queue_delay_seconds_bucket",
                   "q6serve_vram_budget_bytes", "q6serve_vram_device_used_bytes",
                   "q6serve_flag_enabled"):
        assert needle in exprs, f"dashboard lacks {needle}"


def test_dashboard_structure() -> None:
    ids = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            ids.append(p["id"])
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}", p["title"]
                assert p["targets"], p["title"]
                for t in p["targets"]:
                    assert t["datasource"]["uid"] == "${datasource}", p["title"]
            walk(p.get("panels", []))

    walk(DASH["panels"])
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert DASH["uid"] == "q6serve"
    ds_var = next(v for v in DASH["templating"]["list"] if v["name"] == "datasource")
    assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"
    prov = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
    assert [d["type"] for d in load_yaml(prov)["datasources"]] == ["prometheus"]


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package `prometheus`; .ci/run "
                           "installs it)")
def test_prometheus_parses_every_dashboard_query(tmp_path: Path) -> None:
    # Each query becomes a recording rule, so Prometheus' own PromQL parser checks it.
    rules = [{"record": f"q6serve:dashboard_{i}", "expr": grafana_to_promql(e)}
             for i, (_, e) in enumerate(QUERIES) if not e.startswith("label_values(")]
    f = tmp_path / "dashboard.rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "bad.rules.yml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum by (le (rate(x[1m]))"}]}]}))
    assert subprocess.run(["promtool", "check", "rules", str(bad)], capture_output=True,
                          timeout=60).returncode != 0
