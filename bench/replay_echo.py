"""A 28-layer replay step's calls in order against a bare echo, without a worker or a GPU
(issue 14's replay diagnostic): each call answered at once ("bare"), and each held a given
window per role ("held": the worker's handler p50 of a recorded replay run, busy-waited on the
echo's loop, GIL held, as the worker's inline job holds its loop). Per role the p50 round trip
and, held, the round trip less its hold: the transport a bare server with the worker's windows
pays, to set beside the replay's own transport (bench/service.py --replay; --replay-seq-echo
does the same after each run with that run's windows).

    python3 bench/replay_echo.py --seqs 1,8 \\
        --holds "1:q+k+v=207,o=89,gate+up=198,down=123,lm_head=258;8:q+k+v=288,o=130,..."
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from service_replay import LAYERS, held_echo, model_weights, step_plan


def parse_holds(text: str) -> dict[int, dict[str, float]]:
    """"S:role=us,role=us;S:..." -> {S: {role: us}}."""
    out: dict[int, dict[str, float]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        s, _, roles = part.partition(":")
        out[int(s)] = {k: float(v) for k, _, v in (kv.partition("=") for kv in roles.split(","))
                       if k}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--multi", default="on", choices=("on", "off"))
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--holds", default="", help='per S, each role\'s hold in us: '
                    '"1:q+k+v=207,o=89;8:..." (a role not named: held 0)')
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--spin", type=float, default=0.0, help="the caller's loop busy-polls (us)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    holds = parse_holds(a.holds)
    rows = {name: r for name, r, _ in model_weights(a.layers, a.scale)}
    doc: dict[str, Any] = {"argv": sys.argv, "runs": []}
    plan = step_plan(a.layers, rows, a.multi == "on", a.topk)
    kinds = ("bare", "held")
    ss = [int(x) for x in a.seqs.split(",") if x]
    # one echo and one caller process for every sequence (their starts cost more than a run)
    got = held_echo([(plan, s, holds.get(s, {})) for s in ss], 2, 2, "stream", a.seconds,
                    a.spin)
    for s, res in zip(ss, got, strict=True):
        hold = holds.get(s, {})
        doc["runs"].append({"seqs": s, "holds_us": hold, **res})
        held_ms = sum(hold.get(c.role, 0) for c in plan) / 1e3
        runs_ms = {k: "/".join(f"{v:.2f}" for v in res[k]["runs_step_ms"]) for k in kinds}
        print(f"# replay echo S={s} ({len(plan)} calls): step bare {res['bare']['step_ms']:.2f} "
              f"ms ({runs_ms['bare']}), held {res['held']['step_ms']:.2f} ms ({runs_ms['held']}; "
              f"holds {held_ms:.2f} ms)", flush=True)
        for role, rt in res["bare"]["rt_us"].items():
            held = res["held"]["rt_us"][role]
            print(f"S={s:<3} {role:<10} bare RT {rt:7.1f} us  held RT {held:7.1f} - hold "
                  f"{hold.get(role, 0):6.1f} = {held - hold.get(role, 0):7.1f} us", flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
