"""Readers for the deploy/ artefacts, shared by the deploy tests (no Docker or cluster needed).

Everything the tests compare is derived from one source each: ports and grace from the
Dockerfile's ENTRYPOINT/CMD as parsed by the worker's own argparse parser, metric names from
the worker's metrics module, manifests from the kustomization tree.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from q6serve.service.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "q6serve.json"
PROMETHEUS_DIR = DEPLOY / "prometheus"


# -- Dockerfile -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    cmd: str  # upper-case keyword
    value: str  # the rest, continuation lines joined
    line: int

    def exec_form(self) -> list[str]:
        """The JSON (exec) form's argument list; fails loudly on the shell form."""
        v = self.value
        for flag in re.findall(r"^(?:--\S+\s+)*", v)[:1]:
            v = v[len(flag):]
        if v.startswith("CMD "):  # HEALTHCHECK [options] CMD [...]
            v = v[4:]
        args = json.loads(v)
        assert isinstance(args, list) and all(isinstance(a, str) for a in args), self
        return args


def parse_dockerfile(path: Path = DOCKERFILE) -> list[list[Instruction]]:
    """Instructions grouped by stage (index 0: before the first FROM, i.e. global ARGs)."""
    stages: list[list[Instruction]] = [[]]
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment inside a continuation
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, value = buf.partition(" ")
        ins = Instruction(cmd.upper(), " ".join(value.split()), start)
        if ins.cmd == "FROM":
            stages.append([])
        stages[-1].append(ins)
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return stages


def docker_args() -> dict[str, str]:
    """Global ARG defaults (the ones FROM may use)."""
    out = {}
    for ins in parse_dockerfile()[0]:
        if ins.cmd == "ARG" and "=" in ins.value:
            k, v = ins.value.split("=", 1)
            out[k] = v
    return out


def final_stage() -> list[Instruction]:
    return parse_dockerfile()[-1]


def last(stage: list[Instruction], cmd: str) -> Instruction:
    found = [i for i in stage if i.cmd == cmd]
    assert found, f"final stage has no {cmd}"
    return found[-1]


def image_argv() -> list[str]:
    """ENTRYPOINT + CMD of the final image, as the container runs them by default."""
    st = final_stage()
    return last(st, "ENTRYPOINT").exec_form() + last(st, "CMD").exec_form()


def image_entrypoint() -> list[str]:
    return last(final_stage(), "ENTRYPOINT").exec_form()


# -- the worker's CLI -------------------------------------------------------------------------
def worker_parser() -> argparse.ArgumentParser:
    """The `q6serve worker` subparser from the real CLI."""
    from q6serve.client.cli import build_parser

    parser = build_parser()
    for action in parser._actions:  # argparse keeps subparsers here; no public accessor
        if isinstance(action, argparse._SubParsersAction) and "worker" in action.choices:
            return action.choices["worker"]
    raise AssertionError("`q6serve worker` is not registered in q6serve.client.cli")


def worker_config(argv: list[str], env: dict[str, str] | None = None) -> WorkerConfig:
    """The worker's effective configuration for a full `q6serve worker ...` argv (as in
    ENTRYPOINT + CMD/args) and environment: the real parser, then the real config builder, so
    defaults the parser leaves to WorkerConfig are resolved exactly as the worker does."""
    from q6serve.client.cmd_worker import CONFIG_KEYS
    from q6serve.service.config import config_from

    assert argv[:2] == ["q6serve", "worker"], argv
    ns = worker_parser().parse_args(argv[2:])
    return config_from({k: getattr(ns, k) for k in CONFIG_KEYS}, env or {})


def cli_defaults() -> WorkerConfig:
    """What a bare `q6serve worker` runs with."""
    return worker_config(["q6serve", "worker"])


# -- YAML / compose ---------------------------------------------------------------------------
def load_yaml(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list[Any]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


_INTERP = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose-style ${VAR} / ${VAR:-default} substitution (defaults unless env names it)."""
    env = env or {}
    return _INTERP.sub(lambda m: env.get(m.group(1), m.group(2) or ""), text)


def compose() -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE.read_text()))


def duration_s(text: str) -> float:
    """Compose durations: 40s, 1m30s, 1h."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|s|m|h)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), text
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def container_ports(service: dict[str, Any]) -> set[int]:
    """Container-side ports of a compose service's `ports` (short or long syntax)."""
    out = set()
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out.add(int(p["target"]))
        else:
            out.add(int(str(p).split("/")[0].rsplit(":", 1)[-1]))
    return out


def mount_targets(service: dict[str, Any]) -> dict[str, str]:
    """target -> source for a compose service's volumes (short or long syntax)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out[v["target"]] = v.get("source", "")
        else:
            parts = v.split(":")
            out[parts[1]] = parts[0]
    return out


# -- Kubernetes -------------------------------------------------------------------------------
def kustomize_files(root: Path = K8S) -> list[Path]:
    """Manifest files a `kubectl apply -k root` would read (resources + components, recursive).

    A stand-in for `kustomize build` (no binary offline): follows the same lists and fails on
    entries that do not exist, so a renamed or forgotten file breaks the test.
    """
    kfile = root / "kustomization.yaml"
    assert kfile.is_file(), f"{root} has no kustomization.yaml"
    k = load_yaml(kfile)
    files: list[Path] = []
    for entry in [*k.get("resources", []), *k.get("components", [])]:
        p = (root / entry).resolve()
        assert p.exists(), f"{kfile}: {entry} does not exist"
        files += kustomize_files(p) if p.is_dir() else [p]
    return files


def k8s_objects(root: Path = K8S) -> list[tuple[Path, dict[str, Any]]]:
    return [(f, d) for f in kustomize_files(root) for d in load_yaml_all(f)]


def one(objs: list[tuple[Path, dict[str, Any]]], kind: str) -> dict[str, Any]:
    found = [d for _, d in objs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def sleep_seconds(handler: dict[str, Any]) -> float:
    """Seconds a preStop handler waits: exec `sleep N` or the native sleep action."""
    if "sleep" in handler:
        return float(handler["sleep"]["seconds"])
    cmd = handler["exec"]["command"]
    if len(cmd) >= 3 and cmd[-2] == "-c":  # sh -c "sleep N"
        cmd = shlex.split(cmd[-1])
    assert cmd[0] in ("sleep", "/bin/sleep", "/usr/bin/sleep"), cmd
    return float(cmd[1])


# -- PromQL -----------------------------------------------------------------------------------
# Keywords that are not followed by "(" (functions and aggregations are, and are skipped).
PROMQL_WORDS = frozenset({"and", "or", "unless", "atan2", "bool", "offset", "inf", "nan", "by",
                          "without", "on", "ignoring", "group_left", "group_right"})


def promql_metrics(expr: str) -> set[str]:
    """Metric names an expression (or Grafana variable query) selects.

    Strips Grafana variables, strings, label matchers, ranges and grouping label lists, then
    keeps identifiers that are not PromQL words (and not function calls).
    """
    e = re.sub(r"\$__\w+|\$\{\w+(?::\w+)?\}|\$\w+", "1m", expr)
    e = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', e)
    e = re.sub(r"\{[^{}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    # label_values(metric, label): the trailing label name is not a metric
    e = re.sub(r"\blabel_values\s*\(([^,()]*),\s*\w+\s*\)", r"(\1)", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d\w*", word):
            continue
        names.add(word)
    return names



def dashboard_queries(dash: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(where, expr) for every panel target (rows nested too) and templating query."""
    dash = dash if dash is not None else json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"panel {p.get('id')} {p.get('title')!r} {t.get('refId')}",
                            t["expr"]))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            out.append((f"variable ${v['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def grafana_to_promql(expr: str) -> str:
    """Substitute Grafana's variables so Prometheus' own parser can check the expression."""
    e = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    return re.sub(r"\$\{?\w+\}?", ".*", e)


def exported_metric_names() -> set[str]:
    """Every sample name the worker's metrics module exports, suffixes included.

    Built on a fresh registry, exactly as the worker builds it; families with labels have no
    samples until first use, so names are expanded from the family type as the exposition
    format does (counter -> _total, histogram -> _bucket/_sum/_count, info -> _info, ...).
    """
    from prometheus_client import CollectorRegistry

    from q6serve.service.metrics import Metrics

    registry = CollectorRegistry()
    Metrics(registry, version="test", backend="numpy", device="cpu")
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
        "gauge": ("",), "stateset": ("",), "enum": ("",), "unknown": ("",),
    }
    names = set()
    for family in registry.collect():
        names |= {family.name + s for s in suffixes[family.type]}
        names |= {s.name for s in family.samples}
    return names
