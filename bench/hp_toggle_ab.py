"""An A/B of two states of one worker on the decode replay (issue 14, hp, session 28): one
worker, started with bench/hp_site on its PYTHONPATH and ``HP_ALT_<NAME>=<INT>`` (launch.py
constants read per call, e.g. NT_FILL_MIN), is switched before each run by a signal: ``alt``
(SIGUSR1, the HP_ALT values) or ``def`` (SIGUSR2, the tree's values). Same calls, host and
figures as ``bench/replay_ab.py`` (bench/service_replay.run_replay; replay_ab's model upload,
give_model, and run, one_run), but no second worker: replay_ab's one-worker-per-variant A/Bs
read a worker's own speed (workers of one tree differed by 10-15% in every call kind in
session 28's bundle A), this one does not.

    PYTHONPATH=bench/hp_site python3 bench/hp_toggle_ab.py --alt NT_FILL_MIN=262144 \
        --order def,alt,alt,def --seqs 1,8 --seconds 1.0 --json out.json
    a CPU rehearsal: --backend numpy --layers 2 --scale 0.002

``--alt DMA_LAT=1`` (session 29; alone or beside constants): no constant, the machine's state:
in alt's runs this process holds /dev/cpu_dma_latency open with 0 written (the kernel's PM
QoS, system-wide: no CPU enters an idle state deeper than polling; needs root), let go in def's.

``--bound S``: no run starts after S seconds from the start; a table of what ran is printed
last (per S and state: each run's step p50, the median, the worker's window and device jobs a
step, per call kind the handler / device / kernel p50 us, medians of the runs).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from replay_ab import HOST_EE, give_model, one_run, saver, start, stop_all, worker_env
from service_replay import LAYERS, WARM_STEPS, ReplaySpec, run_replay, step_plan

SIGNALS = {"def": signal.SIGUSR2, "alt": signal.SIGUSR1}
DMA_PATH = "/dev/cpu_dma_latency"


class DmaHold:
    """/dev/cpu_dma_latency held at 0 while ``hold(True)``; a failure to open it is said once
    (printed) and the runs go on unheld."""

    def __init__(self, path: str = DMA_PATH) -> None:
        self.path, self.fd, self.said = path, -1, False

    def hold(self, on: bool) -> None:
        if on and self.fd < 0:
            try:
                fd = os.open(self.path, os.O_WRONLY)
            except OSError as e:
                if not self.said:
                    print(f"# DMA_LAT: {self.path} not held ({e})", flush=True)
                    self.said = True
                return
            os.write(fd, (0).to_bytes(4, sys.byteorder))
            self.fd = fd
        elif not on and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def table(doc: dict[str, Any]) -> str:
    by: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        by.setdefault((r["seqs"], r["state"]), []).append(r)
    lines = [f"# toggle A/B: alt {doc['alt']}, order {','.join(doc['order'])}"]
    for (s, v), runs in sorted(by.items()):
        steps = [r["step_p50_ms"] for r in runs]

        def part(k: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r["step_parts_p50_ms"].get(k, 0) for r in runs)

        roles: dict[str, list[dict[str, float]]] = {}
        for r in runs:
            for role, f in r["roles_p50_us"].items():
                roles.setdefault(role, []).append(f)
        med = ", ".join(
            f"{role} " + "/".join(f"{statistics.median(f.get(k, 0) for f in fs):.0f}"
                                  for k in ("handler", "device", "kernel"))
            for role, fs in roles.items())
        lines.append(f"S={s} {v} ({len(runs)} runs): step p50 median {statistics.median(steps):.2f}"
                     f" ms [{', '.join(f'{x:.2f}' for x in steps)}]; worker "
                     f"{part('handler'):.2f} (device {part('device'):.2f}) ms; per kind "
                     f"handler/device/kernel us: {med}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from q6serve.client.client import PRECISIONS, Client

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--alt", required=True, help="NAME=INT[,NAME=INT]: the alt state")
    ap.add_argument("--order", default="def,alt,alt,def")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--multi", default="on", choices=("on", "off"))
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--precision", default="f16")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=0.4)
    ap.add_argument("--bound", type=float, default=1e9)
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    order = [v for v in a.order.split(",") if v]
    if not order or any(v not in SIGNALS for v in order):
        ap.error(f"--order {a.order!r}: def and alt only")
    alt = {}
    dma_alt = False
    for kv in filter(None, a.alt.split(",")):
        k, sep, v = kv.partition("=")
        if not sep:
            ap.error(f"--alt {kv!r}: NAME=INT")
        if k == "DMA_LAT":
            dma_alt = bool(int(v))
            continue
        alt[f"HP_ALT_{k}"] = str(int(v))
    dma = DmaHold()
    if "hp_site" not in os.environ.get("PYTHONPATH", ""):
        ap.error("bench/hp_site must be on PYTHONPATH (the worker's switch)")
    seqs = [int(s) for s in a.seqs.split(",") if s]
    a.out_dir.mkdir(parents=True, exist_ok=True)
    shown = {**alt, **({"DMA_LAT": "1"} if dma_alt else {})}
    doc: dict[str, Any] = {"argv": sys.argv, "alt": shown, "order": order, "runs": [],
                           "errors": [], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                               time.gmtime())}

    save = saver(doc, a.json, t_start)
    w = start(a.backend, alt, a.out_dir / "worker_toggle.log")
    client = Client(w.target, timeout=600.0)
    doc["worker_env"] = worker_env(w)
    try:
        st = client.status()
        doc["backend"], doc["device"] = st.backend, st.device
        weights = give_model([client], a.layers, a.scale)
        client.flags({"Q6SERVE_DYNAMIC_BATCHING": True})
        rows = {name: r for name, r, _ in weights}
        plan = tuple(step_plan(a.layers, rows, a.multi == "on", a.topk))
        need: dict[int, float] = {}
        seen: dict[str, int] = {}
        for v in order:
            seen[v] = seen.get(v, 0) + 1
            if alt:  # (no HP_ALT_ constant: the worker has no handler, a signal would end it)
                os.kill(w.proc.pid, SIGNALS[v])  # type: ignore[union-attr]
            if dma_alt:
                dma.hold(v == "alt")
            time.sleep(0.05)
            for s in seqs:
                label = f"{v}_{seen[v]} S={s}"
                spec = ReplaySpec(w.target, plan, s, a.seconds, a.warmup, WARM_STEPS, "stream",
                                  "f16", PRECISIONS[a.precision], "f16", 0.0, "arrays", 0,
                                  "aio", (), 1, HOST_EE.get(""))
                fig = one_run(doc, label, s, need, t_start, a, save,
                              lambda spec=spec: run_replay(spec, 1, {}))
                if fig is None:
                    continue
                r = {"state": v, "round": seen[v], "calls_per_step": len(plan), **fig}
                doc["runs"].append(r)
                save()
                print(f"# {label}: step p50 {r['step_p50_ms']:.2f} ms ({r['steps']} steps, "
                      f"at {r['t']:.0f} s)", flush=True)
    finally:
        dma.hold(False)
        stop_all([client], [w], save)
    print(table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
