"""An A/B of bench/replay_inproc.py (the worker's Python per call of each replay role, in
process over a no-op backend) between code trees, alternated: each run its own process, a
variant's environment its own (e.g. ``PYTHONPATH`` of a base tree first), so two trees' figures
come from one host in one sitting (issue 14, ask 1 of session 28).

    python3 bench/replay_inproc_ab.py --variants "main:PYTHONPATH=/tmp/base new:" \
        --order main,new,new,main --seqs 8 --calls 400 --rounds 3 --out-dir out

Prints per run the roles' p50 wall (us), then per variant the median over its runs, and each
variant's layer (the four roles' sum) against the first variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROLES = ("q+k+v", "o", "gate+up", "down")


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for v in text.split():
        name, _, envs = v.partition(":")
        out[name] = dict(e.split("=", 1) for e in envs.split(",") if e)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", required=True, help="NAME:ENV=V,ENV=V ... (space-separated)")
    ap.add_argument("--order", required=True, help="variant names, comma-separated")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--extra", default="", help="more replay_inproc.py arguments")
    ap.add_argument("--bound", type=float, default=1e9, help="no run starts after S seconds")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    variants = parse_variants(a.variants)
    order = [o for o in a.order.split(",") if o]
    for o in order:
        if o not in variants:
            raise SystemExit(f"--order: {o!r} is not a variant")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs: list[tuple[str, dict[str, float]]] = []
    count: dict[str, int] = {}
    for name in order:
        if time.monotonic() - t0 > a.bound:
            print(f"# {name} skipped at {time.monotonic() - t0:.0f} s (bound {a.bound:.0f})")
            continue
        count[name] = count.get(name, 0) + 1
        run = f"{name}_{count[name]}"
        out = a.out_dir / f"inproc_{run}.json"
        env = dict(os.environ) | variants[name]
        cmd = [sys.executable, str(HERE / "replay_inproc.py"), "--seqs", str(a.seqs),
               "--calls", str(a.calls), "--rounds", str(a.rounds), "--json", str(out),
               *a.extra.split()]
        got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if got.returncode != 0 or not out.exists():
            print(f"# {run} failed rc={got.returncode}: {got.stderr[-600:]}")
            continue
        data = json.loads(out.read_text())
        walls = {r: float(data[r]["wall"]) for r in ROLES}
        runs.append((name, walls))
        print(f"{run:10s} " + "  ".join(f"{r} {walls[r]:6.1f}" for r in ROLES)
              + f"  layer {sum(walls.values()):6.1f}", flush=True)
    print(f"# replay_inproc A/B S={a.seqs}, {a.calls} calls x {a.rounds} rounds a run: "
          "per call p50 us, median of runs")
    table: dict[str, dict[str, float]] = {}
    for name in variants:
        mine = [w for n, w in runs if n == name]
        if not mine:
            continue
        med = {r: statistics.median(w[r] for w in mine) for r in ROLES}
        med["layer"] = statistics.median(sum(w.values()) for w in mine)
        table[name] = med
    first = next(iter(table.values()), None)
    for name, med in table.items():
        vs = (f" ({med['layer'] - first['layer']:+.1f} us, "
              f"{(med['layer'] / first['layer'] - 1) * 100:+.1f}%)") if first else ""
        n = sum(1 for v, _ in runs if v == name)
        print(f"# {name:6s} {n} runs: " + "  ".join(f"{r} {med[r]:6.1f}" for r in ROLES)
              + f"  layer {med['layer']:6.1f}{vs}")
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "median": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
