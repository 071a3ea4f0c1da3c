"""An A/B of worker variants on T1 (issue 14: one caller, MatmulStream, N=1 f16 x on ffn_down
3584x18944, f32 y, closed loop), alternated in one call: one worker per variant (its
environment, e.g. ``PYTHONPATH`` to another tree's q6serve), all started first and each given
ffn_down once, then T1's load runs in ``--order``, each in its own spawned process (as
``bench/service.py --target-report --targets T1 --modes stream --weights ffn_down`` runs it:
the same LoadSpec, prewarm and per-call split), so a run costs its timed seconds and a process
start, not a worker start and an upload. No bare-gRPC floor (``--floor``: one busy-polling
echo of T1's sizes first, for scale). A spare worker first compiles the kernels and stops
(``--no-spare``: not): in both of session 27's H200 bundles the first measured worker, the
one whose warm calls compiled them (2.7-4.0 s against 0.3), read slower for its whole life
(bundle B: T1 +44 us against a second worker of the same code, in every part of the round
trip, the caller's own encode and decode too); why is not known.

    python3 bench/service_t1ab.py --backend cuda --variants "main:PYTHONPATH=/tmp/base new:" \
        --order main,new,new,main --seconds 0.8 --json out.json
    a CPU rehearsal: --backend numpy --row-scale 0.01

Per run: p50, kernel p50, p50 - kernel and the mean us of each part of bench/service.py's
split (client_encode, transport, server_decode, queue, kernel, device_other, server_other,
client_decode); last, per variant, the median over its runs of each, and per group of
variants whose names differ in trailing digits only (main, main2: two workers of one tree, an
A/A beside the A/B) the same over all their runs. A variant's ``sys.hold=dma|idlespin``: a
machine-wide hold kept around its runs only (bench/cpu_hold.py; not the worker's environment:
such a variant runs on the worker of the variant with its environment and no hold, worker_of).
``--bound S``: no run starts that would end past S seconds from the start (skipped, said so).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from cpu_hold import SystemHold, idle_text
from replay_ab import (  # bench/ is sys.path[0]
    bounded,
    saver,
    split_variant,
    start,
    start_all,
    stop_all,
    variants_and_order,
    worker_env,
)
from service_load import LoadSpec, grpc_floor, run_load

from service import PARTS, WARM_NS, WEIGHTS, parts, random_q6k

WEIGHT = "ffn_down"


def main(argv: list[str] | None = None) -> int:
    from q6serve.client.client import Client

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--variants", default="main: new:")
    ap.add_argument("--order", default="main,new,new,main")
    ap.add_argument("--seconds", type=float, default=0.8)
    ap.add_argument("--warmup", type=float, default=0.3)
    ap.add_argument("--row-scale", type=float, default=1.0)
    ap.add_argument("--bound", type=float, default=1e9)
    ap.add_argument("--floor", action="store_true",
                    help="the busy-polling bare echo of T1's sizes first (p50 us)")
    ap.add_argument("--floor-each", type=float, default=0.0, metavar="SECONDS",
                    help="after each run, inside its hold (sys.hold), the busy-polling bare "
                    "echo of T1's sizes for SECONDS: its floor beside its p50 - kernel (a "
                    "machine-wide hold moves the floor too)")
    ap.add_argument("--spare", action=argparse.BooleanOptionalAction, default=True,
                    help="first a spare worker compiles the kernels (warm calls) and stops: "
                    "the first measured worker would otherwise (H200, session 27: that "
                    "worker read T1 +44 us against a second worker of its code)")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    variants, order = variants_and_order(ap, a.variants, a.order)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    rows, k = WEIGHTS[WEIGHT]
    rows = max(1, round(rows * a.row_scale))
    doc: dict[str, Any] = {"argv": sys.argv, "variants": variants, "runs": [], "errors": [],
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "shape": [rows, k], "parts": PARTS}

    save = saver(doc, a.json, t_start)
    blocks = random_q6k(rows, k, 1)  # (bench/service.py's ffn_down: its seed)
    if a.spare:  # the kernels compiled by a worker of its own, gone before the measured ones
        print(f"# a spare worker compiled and warmed in "
              f"{spare_warm(a.backend, {}, a.out_dir, blocks, rows, k):.1f} s", flush=True)
    on = worker_of(variants)  # variant -> the worker it runs on
    names = list(dict.fromkeys(on.values()))
    workers = start_all(a.backend, {v: split_variant(variants[v])[0] for v in names},
                        a.out_dir)
    clients = {v: Client(w.target, timeout=600.0) for v, w in workers.items()}
    doc["worker_env"] = {v: worker_env(w) for v, w in workers.items()}
    print(f"# the workers' Q6SERVE_ variables: {doc['worker_env']}", flush=True)
    try:
        st = next(iter(clients.values())).status()
        doc["backend"], doc["device"] = st.backend, st.device
        for v, c in clients.items():
            t0 = time.perf_counter()
            warm(c, blocks, rows, k)
            print(f"# {v}: {WEIGHT} {rows}x{k} uploaded and warmed in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        if a.floor:
            try:
                doc["floor_spin_us"] = grpc_floor(k * 2 + 40, rows * 4 + 60, ["stream"],
                                                  min(a.seconds, 3.0), spin=True)["stream"]
                print(f"# bare gRPC round trip, echo busy-polling (p50 us): "
                      f"{doc['floor_spin_us']:.1f}", flush=True)
            except Exception as e:
                doc["errors"].append({"run": "floor", "error": repr(e)[:2000]})
        need: dict[int, float] = {}  # what a run takes (replay_ab.bounded)
        seen: dict[str, int] = {}
        for v in order:
            seen[v] = seen.get(v, 0) + 1
            label = f"{v}_{seen[v]}"
            spec = t1_spec(workers[on[v]].target, rows, k, a)
            held = SystemHold(split_variant(variants[v])[1].get("sys.hold", ""))

            def go(spec: LoadSpec = spec, held: SystemHold = held,
                   ) -> tuple[dict[str, np.ndarray], float | None]:
                with held:
                    samples, _ = run_load(spec, 1)
                    floor = (grpc_floor(k * 2 + 40, rows * 4 + 60, ["stream"], a.floor_each,
                                        spin=True)["stream"] if a.floor_each > 0 else None)
                return samples[WEIGHT], floor

            got = bounded(doc, label, 1, need, t_start, a, save, go)
            if got is None:
                continue
            (s, floor_us), t_run = got
            r = {"variant": v, "round": seen[v], "label": label, **run_figures(s),
                 "t": time.perf_counter() - t_start, "run_s": time.perf_counter() - t_run,
                 "hold": held.info, "floor_us": floor_us}
            doc["runs"].append(r)
            save()
            print(f"# {label}: p50 {r['p50_us']:.1f} us, kernel {r['kernel_p50_us']:.1f}, "
                  f"p50 - kernel {r['gap_us']:.1f}"
                  + (f", floor {floor_us:.1f}" if floor_us else "")
                  + f" ({r['calls']} calls; run {r['run_s']:.1f} s; hold "
                  f"{held.info['kind']}: {held.info.get('message', '-')}; idle "
                  f"{idle_text(held.info)})", flush=True)
    finally:
        stop_all(clients.values(), workers.values(), save)
    print(table(doc))
    return 0


def t1_spec(target: str, rows: int, k: int, a: argparse.Namespace) -> LoadSpec:
    """T1's load on ``target``: one caller, N=1 f16 x on ffn_down (``rows`` x ``k``),
    MatmulStream, ``a.seconds`` timed after ``a.warmup`` (bench/service.py's LoadSpec)."""
    from q6serve.client.client import PRECISIONS

    return LoadSpec(target, ((WEIGHT, k),), 1, 1, a.seconds, a.warmup, "stream", "f16",
                    PRECISIONS["f16"], 0, "", rows, False)


def spare_warm(backend: str, env: dict[str, str], out_dir: Path, blocks: np.ndarray,
               rows: int, k: int) -> float:
    """A spare worker (``env``; log ``out_dir/worker_spare.log``) given ffn_down (``blocks``,
    ``rows`` x ``k``) and warmed (warm: every kernel compiled), then stopped: its seconds."""
    from q6serve.client.client import Client

    t0 = time.perf_counter()
    spare = start(backend, env, out_dir / "worker_spare.log")
    try:
        with Client(spare.target, timeout=600.0) as c:
            warm(c, blocks, rows, k)
    finally:
        spare.stop()
    return time.perf_counter() - t0


def run_figures(s: dict[str, np.ndarray]) -> dict[str, Any]:
    """One T1 run's figures from its samples (bench/service_load's arrays, seconds): calls,
    p50, kernel p50, their gap, and each part's mean and median, in us."""
    pt = parts(s)
    kern = s["kernel"][~np.isnan(s["kernel"])]
    p50 = float(np.percentile(s["e2e"], 50) * 1e6)
    kp50 = float(np.percentile(kern, 50) * 1e6) if kern.size else 0.0
    return {"calls": int(s["e2e"].size), "p50_us": p50, "kernel_p50_us": kp50,
            "gap_us": p50 - kp50,
            "parts_mean_us": {p: float(np.mean(pt[p]) * 1e6) for p in PARTS},
            "parts_p50_us": {p: float(np.median(pt[p]) * 1e6) for p in PARTS}}


def worker_of(variants: dict[str, dict[str, str]]) -> dict[str, str]:
    """Variant -> the variant whose worker it runs on. Each variant has a worker of its own
    (main, main2: two workers of one tree, an A/A), but one with a machine-wide hold
    (``sys.hold``) runs on the worker of a variant with the same worker environment and no
    hold where there is one (else of the first such held variant): the hold alternates on one
    worker."""
    envs = {v: split_variant(env) for v, env in variants.items()}
    on: dict[str, str] = {}
    for v, (w, extra) in envs.items():
        if "sys.hold" not in extra:
            on[v] = v
            continue
        same = [u for u, (wu, _) in envs.items() if wu == w]
        on[v] = next((u for u in same if "sys.hold" not in envs[u][1]), same[0])
    return on


def warm(c: Any, blocks: np.ndarray, rows: int, k: int) -> None:
    """ffn_down uploaded to ``c``'s worker, dynamic batching on, a call at each N of WARM_NS
    (kernels compile on first use, never inside a run)."""
    c.upload(WEIGHT, blocks, rows, k)
    c.flags({"Q6SERVE_DYNAMIC_BATCHING": True})
    for m in WARM_NS:
        c.matmul_full(WEIGHT, np.ones((m, k), np.float16), precision="f16", timeout=600.0)


def table(doc: dict[str, Any]) -> str:
    short = {"client_encode": "enc", "transport": "tr", "server_decode": "dec", "queue": "q",
             "kernel": "k", "device_other": "dev", "server_other": "oth",
             "client_decode": "cdec"}
    lines = [f"# T1 A/B ({doc.get('device', '?')}; {doc['shape'][0]}x{doc['shape'][1]} N=1 "
             f"f16 stream): p50, kernel p50, p50 - kernel us; mean us of each part"
             + (f"; bare echo (busy-polling) {doc['floor_spin_us']:.1f} us"
                if "floor_spin_us" in doc else "")]
    for r in doc["runs"]:
        pm = r["parts_mean_us"]
        fl = r.get("floor_us")
        lines.append(f"{r['label']:<10} {r['p50_us']:7.1f} {r['kernel_p50_us']:6.1f} "
                     f"{r['gap_us']:7.1f}  " + " ".join(f"{short[p]} {pm[p]:.1f}"
                                                       for p in PARTS)
                     + (f"  floor {fl:.1f} margin {r['gap_us'] - fl:.1f}" if fl else ""))
    for v in doc["variants"]:
        rs = [r for r in doc["runs"] if r["variant"] == v]
        if not rs:
            continue
        med = {p: float(np.median([r["parts_mean_us"][p] for r in rs])) for p in PARTS}
        fls = [r["gap_us"] - r["floor_us"] for r in rs if r.get("floor_us")]
        lines.append(f"# {v} median of {len(rs)} runs: p50 - kernel "
                     f"{np.median([r['gap_us'] for r in rs]):.1f} us"
                     + (f", p50 - kernel - floor {np.median(fls):.1f}" if fls else "")
                     + " (each "
                     + ", ".join(f"{r['gap_us']:.0f}" for r in rs) + "); mean parts "
                     + " ".join(f"{short[p]} {med[p]:.1f}" for p in PARTS))
    groups: dict[str, list[dict[str, Any]]] = {}  # main, main2 -> main: the same code
    for r in doc["runs"]:
        groups.setdefault(re.sub(r"\d+$", "", r["variant"]), []).append(r)
    for g, rs in groups.items():
        if len({r["variant"] for r in rs}) > 1:
            med = {p: float(np.median([r["parts_mean_us"][p] for r in rs])) for p in PARTS}
            lines.append(f"# {g}* pooled, {len(rs)} runs: p50 - kernel "
                         f"{np.median([r['gap_us'] for r in rs]):.1f} us; mean parts "
                         + " ".join(f"{short[p]} {med[p]:.1f}" for p in PARTS))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
