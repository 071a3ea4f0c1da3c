"""A 28-layer replay step's calls in order against a bare echo, without a worker or a GPU
(issue 14's replay diagnostic): each call answered at once ("bare"), and each held a given
window per role ("held": the worker's handler p50 of a recorded replay run, busy-waited on the
echo's loop, GIL held, as the worker's inline job holds its loop). Per role the p50 round trip
and, held, the round trip less its hold: the transport a bare server with the worker's windows
pays, to set beside the replay's own transport (bench/service.py --replay; --replay-seq-echo
does the same after each run with that run's windows).

    python3 bench/replay_echo.py --seqs 1,8 \\
        --holds "1:q+k+v=207,o=89,gate+up=198,down=123,lm_head=258;8:q+k+v=288,o=130,..."
    python3 bench/replay_echo.py --seqs 1,8 --holds-from replay_ab.json --holds-variant def

``--holds-from``: a bench/replay_ab.py JSON of the same call; each role is held for the
median over that variant's runs of the worker's handler p50, and the replay's own round trip
(its rpc p50, same median) is printed beside the echo's: if the echo held for the worker's
window costs what the replay's call costs, the rest of the call is Python gRPC's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from replay_ab import role_medians
from service_replay import LAYERS, held_echo, model_weights, step_plan


def parse_holds(text: str) -> dict[int, dict[str, float]]:
    """"S:role=us,role=us;S:..." -> {S: {role: us}}."""
    out: dict[int, dict[str, float]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        s, _, roles = part.partition(":")
        out[int(s)] = {k: float(v) for k, _, v in (kv.partition("=") for kv in roles.split(","))
                       if k}
    return out


def holds_from(doc: dict[str, Any], variant: str, seqs: list[int],
               ) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, dict[str, float]]]]:
    """From a bench/replay_ab.py JSON: per S, each role's hold (the median over ``variant``'s
    runs of the handler p50, us) and the role's median figures themselves (rpc, ...)."""
    if variant not in doc.get("variants", {}):
        raise SystemExit(f"--holds-variant {variant!r} not in the A/B's variants "
                         f"{sorted(doc.get('variants', {}))}")
    per = {s: got for s in seqs if (got := role_medians(doc["runs"], variant, s))}
    if not per:
        raise SystemExit(f"--holds-from: no run of {variant!r} at S = {seqs}")
    return {s: {role: got["handler"] for role, got in p.items()} for s, p in per.items()}, per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--multi", default="on", choices=("on", "off"))
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--holds", default="", help='per S, each role\'s hold in us: '
                    '"1:q+k+v=207,o=89;8:..." (a role not named: held 0)')
    ap.add_argument("--holds-from", type=Path, help="a bench/replay_ab.py JSON: the holds are "
                    "its --holds-variant runs' handler p50 per role (replaces --holds)")
    ap.add_argument("--holds-variant", default="def")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--spin", type=float, default=0.0, help="the caller's loop busy-polls (us)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    ss = [int(x) for x in a.seqs.split(",") if x]
    holds, replay = parse_holds(a.holds), {}
    if a.holds_from is not None:
        holds, replay = holds_from(json.loads(a.holds_from.read_text()), a.holds_variant, ss)
        if missing := [s for s in ss if s not in holds]:  # (an A/B cut by its bound)
            print(f"# no {a.holds_variant} run at S = {missing} in {a.holds_from}: not echoed",
                  flush=True)
            ss = [s for s in ss if s in holds]
    rows = {name: r for name, r, _ in model_weights(a.layers, a.scale)}
    doc: dict[str, Any] = {"argv": sys.argv, "runs": [], "replay_roles_p50_us": replay}
    plan = step_plan(a.layers, rows, a.multi == "on", a.topk)
    kinds = ("bare", "held")
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
        if s in replay:  # the replay's step: calls in the same order, the same windows
            step = sum(replay[s].get(c.role, {}).get("rpc", float("nan")) for c in plan) / 1e3
            print(f"# replay S={s}: its calls' rpc p50s summed over the step {step:.2f} ms "
                  f"against the held echo's {res['held']['step_ms']:.2f} ms", flush=True)
        for role, rt in res["bare"]["rt_us"].items():
            held = res["held"]["rt_us"][role]
            line = (f"S={s:<3} {role:<10} bare RT {rt:7.1f} us  held RT {held:7.1f} - hold "
                    f"{hold.get(role, 0):6.1f} = {held - hold.get(role, 0):7.1f} us")
            if role in replay.get(s, {}):
                rpc = replay[s][role]["rpc"]
                line += f"  replay RT {rpc:7.1f} us = held x {rpc / held:.2f}"
            print(line, flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
