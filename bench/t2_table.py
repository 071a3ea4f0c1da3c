"""One row per bench/t2_timeline.py run (its --json files in a folder, in the order they were
written): calls/s, p50 / p99 / p99.9, `up` at p50 and over the slowest 1%, the device process's
loop, the front ends' cores and busiest loop, each front end's callers and the front ends' p99
(lowest-highest), the load's and the machine's cores. The table the bench/gpu_dataplane_s*.sh
scripts print last.

    python3 bench/t2_table.py OUT_FOLDER
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(p: Path) -> str:
    r = json.loads(p.read_text())
    u = r.get("usage", {})
    dev = [v for k, v in u.items() if k.startswith("device")]
    fe = [v for k, v in u.items() if k.startswith("front")]
    fronts = sorted(r.get("per_front", {}).values(), key=lambda v: -v["callers"])
    return " | ".join([
        f"| {p.stem[3:]}", f"{r['calls_per_s']:,.0f}",
        f"{r['p50_us'] / 1e3:.2f} / {r['p99_us'] / 1e3:.2f} / {r['p999_us'] / 1e3:.2f}",
        f"{r['p50']['up']:,.0f} / {r['p99']['up']:,.0f}",
        f"{dev[0]['loop_busy']:.2f}" if dev else "-",
        f"{sum(v['cores'] for v in fe):.2f} ({max((v['loop_busy'] for v in fe), default=0):.2f})",
        "/".join(str(v["callers"]) for v in fronts),
        "-".join(f"{f(v.get('p99_us', 0) for v in fronts) / 1e3:.2f}" for f in (min, max))
        if fronts else "-",
        f"{sum(r.get('load_cores', [])):.2f}",
        f"{r.get('machine_cores', 0):.1f} of {r.get('machine_cpus')} |"])


def main(argv: list[str]) -> int:
    print("| variant | calls/s | p50 / p99 / p99.9 ms | up p50 / slow 1% us | device loop busy | "
          "front ends cores (loop busy max) | callers a front end | front ends' p99 ms (min-max) | "
          "load cores | machine busy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in sorted(Path(argv[0]).glob("t2_*.json"), key=lambda p: p.stat().st_mtime):
        print(row(p))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
