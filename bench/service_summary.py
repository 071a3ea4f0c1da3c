"""The short table bench/gpu_service_run.sh prints last, from the JSON files bench/service.py
wrote into one output folder.

    python3 bench/service_summary.py run OUT   # clocks, T1, lm-head, replay
"""

from __future__ import annotations

import datetime as dt
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any


def load(out: Path, name: str) -> dict[str, Any]:
    """``out/name.json``, or {} when it is missing or cut short."""
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def parts(r: dict[str, Any]) -> str:
    return "     p50 us: " + " ".join(f"{k} {v:.0f}" for k, v in r["parts_p50_us"].items())


def lm_line(lm: dict[str, Any], what: str) -> str:
    return (f"{what}: reply {lm['reply_bytes']:,.0f} B vs f32 logits {lm['f32_logits_bytes']:,} B "
            f"= {lm['ratio']:,.0f}x; p50 {lm['p50_us'] / 1e3:.2f} ms p99 {lm['p99_us'] / 1e3:.2f} "
            f"ms (kernel p50 {(lm['kernel_p50_us'] or 0) / 1e3:.2f} ms, batch rows "
            f"{lm['batch_rows_mean']:.0f}) {'met' if lm['met'] else 'MISSED'}")


def clocks(out: Path, phases: tuple[str, ...]) -> None:
    """SM/memory clocks per phase (nvidia-smi samples in clocks.csv, marks in phases.txt)."""
    marks_file, csv = out / "phases.txt", out / "clocks.csv"
    if not marks_file.exists() or not csv.exists():
        return
    marks = {ln.split()[0]: float(ln.split()[1]) for ln in marks_file.read_text().splitlines()}
    rows = []
    for line in csv.read_text(errors="replace").splitlines():
        p = [x.strip() for x in line.split(",")]
        try:
            t = dt.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(p[1]), float(p[2])))
        except (ValueError, IndexError):
            pass
    for ph in phases:
        a, b = marks.get(ph + "_start"), marks.get(ph + "_end")
        sel = [r for r in rows if a is not None and b is not None and a <= r[0] <= b]
        if sel:
            sm = [r[1] for r in sel]
            print(f"# clocks {ph:8} n={len(sel):4} SM MHz min {min(sm):.0f} p50 "
                  f"{statistics.median(sm):.0f} max {max(sm):.0f}  mem MHz p50 "
                  f"{statistics.median(r[2] for r in sel):.0f}")


def run_summary(out: Path) -> None:
    clocks(out, ("idle", "kernels", "main", "yield0"))
    kern = None
    log = out / "kernels.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = re.match(r"\s*3584x18944\s+1\s+auto=\S+\s+([\d.]+)", line)
        if m:
            kern = float(m.group(1))
    print(f"# kernel alone (bench/kernels.py, ffn_down N=1 f16 AUTO): {kern} us")
    doc = load(out, "main")
    print(f"# {doc.get('device')}  commit {doc.get('commit')}  {doc.get('date')}")
    for name, d in (("T1 (yield on)", doc), ("T1 yield off", load(out, "yield0"))):
        for t in d.get("targets", []):
            r = next((x for x in d["runs"] if x["label"] == t["run"]), None)
            if r is None:
                continue
            k = r["kernel_p50_us"]
            ratio = f"{k / kern:.2f}x" if kern and k else "n/a"
            print(f"{name:14} p50 {r['p50_us']:.0f} us  p50-kernel "
                  f"{t['p50_minus_kernel_us']:.0f} (limit {t['limit_us']:.0f} = bare "
                  f"{t['bare_grpc_p50_us'] or 0:.0f} + 100)  kernel p50 {k or 0:.1f} us = "
                  f"{ratio} of kernels.py\n{parts(r)}")
    lm = doc.get("lm_head")
    if lm:
        print(lm_line(lm, f"lm-head N={lm['n']} x{lm['callers']} top-{lm['topk']}"))
    print(f"{'replay':18} {'calls':>5} {'steps/s':>7} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'kern ms':>7} {'bare ms':>7} {'limit':>6} {'transp':>6} {'worker':>6} "
          f"{'device':>6} {'queue':>6} {'client':>6}")
    for r in doc.get("replay", []):
        p = r["step_parts_p50_ms"]
        lim = "-" if r["limit_ms"] is None else f"{r['limit_ms']:.0f}"
        print(f"{r['label']:18} {r['calls_per_step']:5} {r['steps_per_s']:7.2f} "
              f"{r['step_p50_ms']:8.1f} {r['step_p99_ms']:8.1f} {r['kernel_step_ms'] or 0:7.2f} "
              f"{r['floor_step_ms']:7.1f} {lim:>6} {p['transport']:6.1f} {p['handler']:6.1f} "
              f"{p['device']:6.1f} {p['queue']:6.1f} {p['client']:6.1f}")
    for e in doc.get("errors", []):
        print(f"ERROR {e['run']}: {e['error'][:200]}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "run":
        sys.exit(__doc__)
    run_summary(Path(sys.argv[2]))
