"""The closing check's target table (bench/gpu_check.sh prints it last): one row per issue 14 /
15 target with the run's figure, its limit and met / missed, read from the JSON files the check
wrote into its output folder, ready to copy into bench/RESULTS.md.

    python3 bench/check_targets.py OUT [--kernels kernels.json] [--dataplane DIR]

A target without its figure in OUT is never read as met: its row says why, from the check's
OUT/steps.tsv (bench/gpu_lib.sh's `step`): "cut" (its step was killed at its limit or skipped
for want of time in the check's bound), "failed (rc N)" (its step ended with an error), "no
figure" (its steps ended well without it), or "not run" (no step of it ran, or an older check
without steps.tsv). A suite cut short says how far
it got. The kernel the host wall and the reply's kernel time are held to is bench/kernels.py's
(OUT/kernels_ref.json, or --kernels): AUTO, f16, same shape and N.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

# issue 14's 48 MB weights of the host wall target, and T1's weight (ffn_down)
WALL_SHAPES = ("4096x14336", "14336x4096")
T1_SHAPE = "3584x18944"
WALL_LIMIT_US = {1: 30.0, 64: 100.0}  # wall - kernel, per N
KERNEL_RATIO = 1.25  # the reply's kernel p50 / bench/kernels.py's
# the suites and the demo: the step's log and what its last line must say
SUITES = (("kernels_gpu", "GPU tests, tests/kernels"),
          ("dataplane_gpu", "GPU tests, tests/dataplane"),
          ("service_cuda", "service + issue-18 tests on CUDA"),
          ("launch_gpu", "GPU tests, tests/service/test_launch_split.py"),
          ("demo", "q6serve demo --backend cuda"))

Row = tuple[str, str, str, str]  # target, figure, limit, result
Steps = dict[str, tuple[int, str]]  # step name -> (rc, how: ran / cut / skipped)
# pytest -q's progress lines: one character a test, then the percentage
PROGRESS = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?$")


def load(path: Path) -> dict[str, Any]:
    """The JSON at ``path``, or {} when it is missing or cut short."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def verdict(met: bool | None) -> str:
    return "not run" if met is None else ("**met**" if met else "missed")


def read_steps(out: Path) -> Steps:
    """OUT/steps.tsv: each step's exit status and how it ended (the last line of a name
    wins); {} for a check that wrote none."""
    got: Steps = {}
    try:
        text = (out / "steps.tsv").read_text()
    except OSError:
        return got
    for line in text.splitlines():
        f = line.split("\t")
        if len(f) >= 5 and f[1].lstrip("-").isdigit():
            got[f[0]] = (int(f[1]), f[4])
    return got


def absent(steps: Steps, names: list[str]) -> str:
    """The result of a target whose figure is missing, from its steps ``names``: cut (one was
    killed at its limit or skipped for want of time), failed (one ended with an error), no
    figure (they ran and ended well: the run did not ask for it), or not run."""
    ran = [steps[n] for n in names if n in steps]
    if any(how in ("cut", "skipped") for _, how in ran):
        return "cut"
    bad = [rc for rc, _ in ran if rc != 0]
    return f"failed (rc {bad[0]})" if bad else ("no figure" if ran else "not run")


def progress(log: Path) -> str:
    """How far a pytest -q run got by its progress lines: "N passed, M failed" ('' if none)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    marks = "".join(m.group(1) for ln in lines if (m := PROGRESS.match(ln.strip())))
    if not marks:
        return ""
    return f"{marks.count('.')} passed, {marks.count('F') + marks.count('E')} failed"


def kernel_us(kern: dict[str, Any], shape: str, n: int) -> float | None:
    """bench/kernels.py's AUTO f16 time (us) for ``shape`` at ``n``."""
    for r in kern.get("results", []):
        if (r.get("shape") == shape and r.get("n") == n and r.get("dtype") == "f16"
                and str(r.get("path", "")).startswith("auto=") and "us" in r):
            return float(r["us"])
    return None


def last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def suite_rows(out: Path, steps: Steps) -> list[Row]:
    rows = []
    for step, what in SUITES:
        line = last_line(out / f"{step}.log")
        if steps.get(step, (0, ""))[1] in ("cut", "skipped"):
            got = progress(out / f"{step}.log") if step != "demo" else ""
            rows.append((what, f"cut after {got}" if got else "-", "all pass", "cut"))
            continue
        if not line or line.startswith("skipped:"):  # no log, or gpu_lib's step skipped it
            rows.append((what, line[:80] or "-", "all pass",
                         "cut" if line.startswith("skipped:") else absent(steps, [step])))
            continue
        if step == "demo":
            m = re.search(r"all (\d+) results match", line)
            ok = bool(m)
            fig = f"{m.group(1)}/{m.group(1)} match" if m else line[:80]
        else:  # a log without pytest's summary line: cut by its limit or crashed: missed
            m = re.search(r"(\d+) passed", line)
            bad = re.search(r"\d+ (failed|errors?)\b", line)
            ok = bool(m) and not bad
            fig = re.sub(r"\s*in [\d.]+s.*$", "", line.strip("= "))[:80]
        rows.append((what, fig, "all pass", verdict(ok)))
    return rows


def t1_rows(t1: dict[str, Any], kern: dict[str, Any], steps: Steps) -> list[Row]:
    tg = next((t for t in t1.get("targets", []) if t.get("target") == "T1"), None)
    if tg is None:
        row1: Row = ("T1, p50 - kernel (N=1 f16 ffn_down, stream)", "-", "echo + 100 us",
                     absent(steps, ["t1"]))
    else:
        row1 = ("T1, p50 - kernel (N=1 f16 ffn_down, stream)",
                f"{tg['p50_minus_kernel_us']:.0f} us (echo {tg['bare_grpc_p50_us']:.0f})",
                f"{tg['limit_us']:.0f} us (echo + 100)", verdict(bool(tg["met"])))
    run = next((r for r in t1.get("runs", []) if str(r.get("label", "")).startswith("T1")),
               None)
    ref = kernel_us(kern, T1_SHAPE, 1)
    what = f"kernel in the service (T1 p50) / bench/kernels.py ({T1_SHAPE} N=1 f16)"
    if run is None or run.get("kernel_p50_us") is None or ref is None:
        row2: Row = (what, "-", f"{KERNEL_RATIO}x", absent(steps, ["t1", "kernel_ref"]))
    else:
        ratio = run["kernel_p50_us"] / ref
        row2 = (what, f"{run['kernel_p50_us']:.2f} / {ref:.2f} us = {ratio:.2f}x",
                f"{KERNEL_RATIO}x", verdict(ratio <= KERNEL_RATIO))
    return [row1, row2]


def wall_rows(wall: dict[str, Any], kern: dict[str, Any], steps: Steps) -> list[Row]:
    rows = []
    for n, limit in WALL_LIMIT_US.items():
        figs, oks = [], []
        for shape in WALL_SHAPES:
            got = [r for r in wall.get("results", []) if r.get("shape") == shape
                   and r.get("n") == n and r.get("mode") == "staged" and not r.get("variant")]
            ref = kernel_us(kern, shape, n)
            if not got or ref is None:
                figs.append(f"{shape}: -")
                oks.append(None)
                continue
            w = float(got[-1]["wall_p50"])
            figs.append(f"{shape}: {w:.1f} - {ref:.1f} = {w - ref:.1f} us")
            oks.append(w - ref <= limit)
        res = absent(steps, ["wall", "kernel_ref"]) if None in oks else verdict(all(oks))
        rows.append((f"host wall (staged) - kernel, N={n}", "; ".join(figs),
                     f"{limit:.0f} us", res))
    return rows


def lm_rows(out: Path, steps: Steps) -> list[Row]:
    figs, oks = [], []
    for name, what in (("lm_head", "one process"), ("lm_head_nospin", "busy polling off"),
                       ("lm_head_fe4", "--frontends 4")):
        lm = load(out / f"{name}.json").get("lm_head")
        if not lm:
            figs.append(f"{what}: -")
            oks.append(None)
            continue
        figs.append(f"{what}: p50 {lm['p50_us'] / 1e3:.2f} ms, {lm['ratio']:,.0f}x")
        oks.append(bool(lm["met"]))
    # the target is one worker process; the other two are how it moves
    return [("lm-head N=64 x8 top-64: p50, reply smaller than f32 logits", "; ".join(figs),
             "5 ms, 100x", absent(steps, ["lm_head"]) if oks[0] is None else verdict(oks[0]))]


def replay_rows(rep: dict[str, Any], steps: Steps, step: str = "replay",
                how: str = "") -> list[Row]:
    """The replay's rows, S = 1, 8, 64; ``step``/``how``: another run of it (e.g. the worker
    with --keep-cpus-awake), named in each row, which has rows only for the S it was asked."""
    rows = []
    runs = rep.get("replay") or []
    argv = rep.get("argv") or []  # the S the run was asked for (bench/service.py's default)
    asked = next((argv[i + 1] for i, x in enumerate(argv[:-1]) if x == "--replay-seqs"),
                 "1,8,64")
    if how and not rep and absent(steps, [step]) == "not run":
        return []  # an extra run that was not asked for
    for s in (1, 8, 64):
        got = {("multi" if r.get("multi") else "single"): r for r in runs
               if r.get("seqs") == s and r.get("hosts", 1) == 1}
        what = f"replay S={s} step p50, multi / single{' (the target)' if s == 8 else ''}"
        what += f", {how}" if how else ""
        if not got:
            if how and str(s) not in asked.split(","):
                continue
            rows.append((what, "-", "1.5 x (floor + kernel)", absent(steps, [step])
                         if str(s) in asked.split(",") else "not run"))
            continue
        keys = [k for k in ("multi", "single") if k in got]
        fig = " / ".join(f"{got[k]['step_p50_ms']:.2f}" for k in keys) + " ms (floor " + \
            " / ".join(f"{got[k]['floor_step_ms']:.2f}" for k in keys) + ")"
        first = got[keys[0]]
        if "transport" in first:  # the caller's gRPC (the floor's echo caller the same)
            spin = first.get("caller_spin_us", first.get("host_spin_us", 0.0))
            fig += f"; caller {first['transport']}" + (f" spinning {spin:g} us" if spin else "")
        lim = " / ".join(f"{got[k]['limit_ms']:.1f}" for k in keys) + " ms"
        oks = [bool(got[k]["met"]) for k in keys]
        res = "**met**" if all(oks) else ("missed" if not any(oks) else
                                           " / ".join(verdict(o) for o in oks))
        if len(keys) == 1:  # the other style did not run (--multi on/off, or cut)
            fig = f"{keys[0]} {fig}"
            if absent(steps, [step]) == "cut":
                res += f"; {'single' if keys[0] == 'multi' else 'multi'} cut"
        rows.append((what, fig, lim, res))
    return rows


def dataplane_rows(docs: list[dict[str, Any]], steps: Steps) -> list[Row]:
    rows = []
    for doc in docs:
        for t in doc.get("targets", []):
            fe = f"{t.get('frontends', '?')} front ends, {t.get('region', '?')}"
            if t.get("target") == "T2":
                runs = t.get("runs") or []
                spread = "" if len(runs) < 2 else (
                    f" ({len(runs)} runs pooled; each p99 "
                    f"{min(r['p99_us'] for r in runs) / 1e3:.2f}-"
                    f"{max(r['p99_us'] for r in runs) / 1e3:.2f} ms, "
                    f"{min(r['rows_per_s'] for r in runs):,.0f}-"
                    f"{max(r['rows_per_s'] for r in runs):,.0f} rows/s)")
                rows.append((f"T2, 64 callers N=1 ({fe})",
                             f"{t['rows_per_s']:,.0f} rows/s, p99 {t['p99_us'] / 1e3:.2f} ms"
                             + spread,
                             f"{t['rows_per_s_min']:,.0f}; {t['p99_limit_us'] / 1e3:.0f} ms",
                             verdict(bool(t["met"]))))
            elif t.get("target") == "T3":
                rows.append((f"T3, N=64 x{t.get('hosts', '?')} hosts ({fe}), of the kernel "
                             "alone", f"{t['fraction']:.2f} ({t['service_rows_per_s']:,.0f} / "
                             f"{t['kernel_rows_per_s']:,.0f} rows/s)",
                             f"{t['fraction_min']:.2f}", verdict(bool(t["met"]))))
    if not rows:
        rows.append(("T2 / T3 (data plane)", "-", "20,000 rows/s p99 4 ms; 0.25 / 0.5",
                     absent(steps, [s for s in steps if s.startswith("dataplane_f")])))
    return rows


def lane_rows(lane: dict[str, Any]) -> list[Row]:
    """The stretch target's rows (bench/lane_latency.py): one lane run, or with ``--rings``
    the median p50 - kernel of the socket's runs and of the ring's (a lane's default since
    session 29; Q6SERVE_LANE_RING=0 or ring=False: the socket), alternated on one worker, a
    row each."""
    res = lane.get("results", {})
    med = res.get("rings_p50_minus_kernel_us")
    if med:
        runs = {v: sum(n.startswith(f"lane {v} #") for n in res) for v in med}
        how = {"sock": "over its socket", "ring": "over its shared-memory ring (the default)"}
        return [(f"stretch: one caller N=1 ffn_down on the lane {how.get(v, v)}, p50 - kernel "
                 f"(median of {runs[v]} runs)", f"{m:.1f} us", "50 us", verdict(m <= 50.0))
                for v, m in med.items()]
    got = res.get("lane")
    if not got:
        return []
    return [("stretch: one caller N=1 ffn_down on the lane, p50 - kernel",
             f"{got['p50_minus_kernel_us']:.1f} us", "50 us",
             verdict(got["p50_minus_kernel_us"] <= 50.0))]


def lane_t3_rows(out: Path, steps: Steps) -> list[Row]:
    """T3's shape through the fast lane (bench/gpu_dataplane_lane.sh, the check's LANE=1:
    OUT/lane/lane_fF_c1_job1_pipe0.json, 8 hosts x 1 caller of N=64, no gRPC a call, x and y in
    each caller's page-locked system region): issue 15's T3 with regions counts co-located
    callers on shared memory, and the lane is that path. A row per front-end count; none when
    the check ran no lane step (LANE unset), its absence's reason when it did."""
    rows = []
    for path in sorted((out / "lane").glob("lane_f*_c1_job1_pipe0.json")):
        doc = load(path)
        if not doc.get("kernel_fraction"):
            continue
        fe = doc.get("frontends", "?")
        where = "one process" if fe == 1 else f"{fe} front ends"
        rows.append((f"T3 through the fast lane (no gRPC a call), N=64 x{doc.get('hosts', '?')} "
                     f"hosts x{doc.get('callers', '?')} caller (system regions, {where}), of the "
                     "kernel alone",
                     f"{doc['kernel_fraction']:.2f} ({doc['rows_per_s']:,.0f} rows/s; kernel "
                     f"p50 {doc['kernel_p50_us']:.1f} us)", "0.50",
                     verdict(doc["kernel_fraction"] >= 0.5)))
    if not rows and "lane" in steps:
        rows.append(("T3 through the fast lane (no gRPC a call), N=64 x8 hosts x1 caller "
                     "(system regions), of the kernel alone", "-", "0.50",
                     absent(steps, ["lane"])))
    return rows


def table(out: Path, kernels: Path | None, dataplane: list[Path]) -> str:
    kern = load(kernels if kernels is not None else out / "kernels_ref.json")
    dp_docs = [load(p) for d in dataplane for p in sorted(d.glob("dataplane_f*.json"))]
    steps = read_steps(out)
    # the targets first, as the check runs them; the suites after
    rows = [*t1_rows(load(out / "t1.json"), kern, steps),
            *wall_rows(load(out / "wall.json"), kern, steps),
            *replay_rows(load(out / "replay.json"), steps),
            *replay_rows(load(out / "replay_awake.json"), steps, "replay_awake",
                         "the worker with --keep-cpus-awake"), *lm_rows(out, steps),
            *dataplane_rows(dp_docs, steps), *lane_t3_rows(out, steps),
            *lane_rows(load(out / "lane_latency.json")),
            *suite_rows(out, steps)]
    dev = next((d.get("device") for d in (load(out / "t1.json"), kern) if d.get("device")), "?")
    lines = [f"# targets ({dev}; kernel reference: "
             f"{'bench/kernels.py' if kern else 'none'})",
             "| target | figure | limit | result |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the check's output folder (bench/gpu_check.sh $OUT)")
    ap.add_argument("--kernels", type=Path, help="a bench/kernels.py --json (default "
                    "OUT/kernels_ref.json)")
    ap.add_argument("--dataplane", type=Path, action="append", default=[],
                    help="a folder of bench/service.py --dataplane JSONs (dataplane_f*.json; "
                    "repeatable; default OUT/dataplane)")
    a = ap.parse_args(argv)
    print(table(a.out, a.kernels, a.dataplane or [a.out / "dataplane"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
