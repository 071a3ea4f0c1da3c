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
    python3 bench/replay_echo.py --seqs 8 --holds "8:q+k+v=86,o=36" --hold-sides server,client

``--holds-from``: a bench/replay_ab.py JSON of the same call; each role is held for the
median over that variant's runs of the worker's handler p50, and the replay's own round trip
(its rpc p50, same median) is printed beside the echo's: if the echo held for the worker's
window costs what the replay's call costs, the rest of the call is Python gRPC's own.
``--hold-fields kernel,device,handler`` holds each call, in turn, for the worker's kernel, its
device job and its whole window: what a step would cost through Python gRPC if the worker's
window were only its kernel (the least any worker can hold a call), only its device job, or
what it is. ``--hold-sides server,client``: each held kind also held by the caller before it
writes each call (the echo answering at once; the round trip timed after the hold): if the
caller-held round trip is the bare one, the surcharge is paid where the window is (the
server's side), else by the gap itself, on either side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cpu_hold import KINDS, SystemHold, idle_text
from replay_ab import ROLE_FIELDS, role_medians
from service_replay import CLIENT_HELD, LAYERS, ladder_echo, model_weights, step_plan
from svc_util_transport import TRANSPORTS


def parse_holds(text: str) -> dict[int, dict[str, float]]:
    """"S:role=us,role=us;S:..." -> {S: {role: us}}."""
    out: dict[int, dict[str, float]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        s, _, roles = part.partition(":")
        out[int(s)] = {k: float(v) for k, _, v in (kv.partition("=") for kv in roles.split(","))
                       if k}
    return out


def holds_from(doc: dict[str, Any], variant: str, seqs: list[int],
               fields: tuple[str, ...] = ("handler",),
               ) -> tuple[dict[int, dict[str, dict[str, float]]],
                          dict[int, dict[str, dict[str, float]]]]:
    """From a bench/replay_ab.py JSON: per S, per field of ``fields`` (a held kind named by
    it), each role's hold (the median over ``variant``'s runs of that field's p50, us), and
    the role's median figures themselves (rpc, ...). An S without a run is left out."""
    if variant not in doc.get("variants", {}):
        raise SystemExit(f"--holds-variant {variant!r} not in the A/B's variants "
                         f"{sorted(doc.get('variants', {}))}")
    per = {s: got for s in seqs if (got := role_medians(doc["runs"], variant, s))}
    if not per:
        raise SystemExit(f"--holds-from: no run of {variant!r} at S = {seqs}")
    return {s: {f: {role: got[f] for role, got in p.items()} for f in fields}
            for s, p in per.items()}, per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--multi", default="on",
                    help="on | off | mlp (each layer's MLP as one call, gate+up+down: its "
                         "hold, when not given, gate+up's and down's summed), or several "
                         "comma-separated: each plan in turn, on one echo")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--holds", default="", help='per S, each role\'s hold in us: '
                    '"1:q+k+v=207,o=89;8:..." (a role not named: held 0)')
    ap.add_argument("--holds-from", type=Path, help="a bench/replay_ab.py JSON: the holds are "
                    "its --holds-variant runs' p50s per role (replaces --holds)")
    ap.add_argument("--holds-variant", default="def")
    ap.add_argument("--hold-fields", default="handler",
                    help="with --holds-from: one held kind per figure, e.g. kernel,device,"
                    "handler (the window at its least: the kernel; the device job; all of it)")
    ap.add_argument("--hold-sides", default="server",
                    help="server, client or both (server,client): who holds each call, the "
                    "echo before it answers (a worker's window) or the caller before it writes "
                    "(the same gap on the other side of the wire; its round trip excludes the "
                    "hold): which side pays the surcharge a held call brings")
    ap.add_argument("--ahead", action="store_true",
                    help="the echo reads each next request before its reply's write completes "
                    "(service_load.start_now), not after it")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--spin", type=float, default=0.0, help="the caller's loop busy-polls (us)")
    ap.add_argument("--transport", default="aio", choices=TRANSPORTS,
                    help="the caller's gRPC (bench/svc_util_transport.py): as the replay's host")
    ap.add_argument("--mode", default="stream", choices=("stream", "unary"))
    ap.add_argument("--hold", default="", choices=KINDS,
                    help="a machine-wide hold kept while the echo runs (bench/cpu_hold.py: "
                    "dma = /dev/cpu_dma_latency at 0, idlespin = a SCHED_IDLE spinner a CPU)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    ss = [int(x) for x in a.seqs.split(",") if x]
    holds = {s: {"held": h} for s, h in parse_holds(a.holds).items()}
    replay: dict[int, dict[str, dict[str, float]]] = {}
    if a.holds_from is not None:
        fields = tuple(f for f in a.hold_fields.split(",") if f)
        if bad := [f for f in fields if f not in ROLE_FIELDS or f == "calls"]:
            ap.error(f"--hold-fields {bad}: not among {ROLE_FIELDS[:-1]}")
        holds, replay = holds_from(json.loads(a.holds_from.read_text()), a.holds_variant, ss,
                                   fields)
        if missing := [s for s in ss if s not in holds]:  # (an A/B cut by its bound)
            print(f"# no {a.holds_variant} run at S = {missing} in {a.holds_from}: not echoed",
                  flush=True)
            ss = [s for s in ss if s in holds]
    sides = [x for x in a.hold_sides.split(",") if x]
    if not sides or set(sides) - {"server", "client"}:
        ap.error(f"--hold-sides {a.hold_sides!r}: server, client or server,client")
    for s in list(holds):  # each held kind on either side: "k" (the echo's), "k@client"
        holds[s] = {f"{k}{'' if side == 'server' else CLIENT_HELD}": h
                    for side in sides for k, h in holds[s].items()}
    rows = {name: r for name, r, _ in model_weights(a.layers, a.scale)}
    doc: dict[str, Any] = {"argv": sys.argv, "runs": [], "replay_roles_p50_us": replay}
    styles = [m for m in a.multi.split(",") if m]
    if bad := [m for m in styles if m not in ("on", "off", "mlp")]:
        ap.error(f"--multi {bad}: on, off or mlp")
    for hs in holds.values():  # the MLP call holds gate+up's window and down's
        for h in hs.values():
            if "gate+up+down" not in h and "gate+up" in h and "down" in h:
                h["gate+up+down"] = h["gate+up"] + h["down"]
    plans = {m: step_plan(a.layers, rows, m != "off", a.topk, mlp=m == "mlp") for m in styles}
    cases = [(m, s) for m in styles for s in ss]
    # one echo and one caller process for every plan and sequence (their starts cost more
    # than a run)
    held = SystemHold(a.hold)
    with held:
        got = ladder_echo([(plans[m], s, holds.get(s, {"held": {}})) for m, s in cases], 2, 2,
                          a.mode, a.seconds, a.spin, a.transport, a.ahead)
    doc["hold"] = held.info
    print(f"# hold {held.info['kind']}: {held.info.get('message', '-')}; idle "
          f"{idle_text(held.info)}", flush=True)
    for (m, s), res in zip(cases, got, strict=True):
        plan = plans[m]
        hs = holds.get(s, {"held": {}})
        kinds = list(hs)
        doc["runs"].append({"seqs": s, "multi": m, "calls": len(plan), "holds_us": hs, **res})
        cells = [f"bare {res['bare']['step_ms']:.2f} ms"]
        for k in kinds:
            held_ms = sum(hs[k].get(c.role, 0) for c in plan) / 1e3
            cells.append(f"held {k} {res[k]['step_ms']:.2f} ms (holds {held_ms:.2f})")
        print(f"# replay echo S={s} multi {m} ({len(plan)} calls) step: " + ", ".join(cells),
              flush=True)
        if s in replay:  # the replay's step: calls in the same order, the same windows
            step = sum(replay[s].get(c.role, {}).get("rpc", float("nan")) for c in plan) / 1e3
            print(f"# replay S={s}: its calls' rpc p50s summed over the step {step:.2f} ms",
                  flush=True)
        print(f"# S={s} per call p50 us: role, bare RT, per held kind RT - hold = transport"
              + (", the replay's RT / the last kind's RT" if s in replay else ""), flush=True)
        for role, rt in res["bare"]["rt_us"].items():
            line = f"S={s:<3} {role:<12} bare {rt:7.1f}"
            for k in kinds:
                held, hold = res[k]["rt_us"][role], hs[k].get(role, 0)
                if k.endswith(CLIENT_HELD):  # the caller held it: its round trip is the
                    line += f" | {k} {held:7.1f} (held {hold:6.1f})"  # transport
                else:
                    line += f" | {k} {held:7.1f} - {hold:6.1f} = {held - hold:6.1f}"
            if role in replay.get(s, {}):  # against the last kind the echo held
                ref = next((k for k in reversed(kinds) if not k.endswith(CLIENT_HELD)), None)
                rpc = replay[s][role]["rpc"]
                line += f" | replay {rpc:7.1f}" + (
                    f" = x{rpc / res[ref]['rt_us'][role]:.2f}" if ref is not None else "")
            print(line, flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
