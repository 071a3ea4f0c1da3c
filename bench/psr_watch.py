"""Where the busy threads of a run's Python processes ran, sampled from /proc (issue 14, T1's
run-to-run spread): every part of T1's call, the caller's own encode included, grows by one
factor between runs minutes apart (1.4-2.4x) while the kernel does not. One cause that would do
that is placement: the worker's loop busy-polls after each reply and the caller's session
spins for its reply, so two of them on one CPU take turns at it. This samples every thread of
every process whose command line matches ``--match`` each ``--interval`` ms for ``--seconds``
(or until SIGTERM / SIGINT), and prints per busy thread its CPU time, the CPUs it ran on and
its minor page faults a second, and per pair of busy threads of different processes the share
of samples in which both were running on the same CPU.

    python3 bench/psr_watch.py --seconds 60 --json psr.json & w=$!   # beside the run
    ...; kill -TERM $w; wait $w   # the report is printed at the end, however it ends

Only threads that used >= ``--min-busy`` of a core over their span in the window (first to
last seen, at least 0.5 s) are shown.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def _cmdline(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(raw.decode(errors="replace").replace("\0", " ").split())


def _stat(path: str) -> tuple[str, str, int, int, int] | None:
    """(comm, state, cpu, utime + stime ticks, minor faults) of /proc/PID/task/TID/stat."""
    try:
        raw = Path(path).read_text()
    except OSError:
        return None
    head, _, rest = raw.rpartition(")")
    comm = head.partition("(")[2]
    f = rest.split()  # f[0] is field 3 (state)
    return comm, f[0], int(f[36]), int(f[11]) + int(f[12]), int(f[7])


def sample(pids: dict[str, str]) -> dict[tuple[str, str], tuple[str, str, int, int, int]]:
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            got = _stat(f"/proc/{pid}/task/{tid}/stat")
            if got is not None:
                out[(pid, tid)] = got
    return out


def matching(match: str, me: int) -> dict[str, str]:
    """pid -> command line of every process whose command line contains ``match``."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != me and match in (cmd := _cmdline(pid)):
            out[pid] = cmd
    return out


_stop = False


def _on_signal(*_: object) -> None:
    global _stop
    _stop = True


def watch(match: str, seconds: float, interval: float) -> dict[str, Any]:
    me = os.getpid()
    t0 = time.perf_counter()
    # (when, CPU ticks, minor faults) first and last seen
    first: dict[tuple[str, str], tuple[float, int, int]] = {}
    last: dict[tuple[str, str], tuple[float, int, int]] = {}
    names: dict[tuple[str, str], str] = {}
    cpus: dict[tuple[str, str], Counter[int]] = {}
    fault_hist: dict[tuple[str, str], list[tuple[float, int]]] = {}
    running: list[dict[tuple[str, str], int]] = []  # per sample: thread -> its CPU (state R)
    cmds: dict[str, str] = {}
    next_scan = 0.0
    while (now := time.perf_counter() - t0) < seconds and not _stop:
        if now >= next_scan:  # new processes (a run's caller starts after this)
            cmds.update(matching(match, me))
            next_scan = now + 0.5
        snap = sample(cmds)
        run: dict[tuple[str, str], int] = {}
        for key, (comm, state, cpu, ticks, faults) in snap.items():
            first.setdefault(key, (now, ticks, faults))
            last[key] = (now, ticks, faults)
            fault_hist.setdefault(key, []).append((now, faults))
            names[key] = comm
            if state == "R":
                run[key] = cpu
                cpus.setdefault(key, Counter())[cpu] += 1
        running.append(run)
        time.sleep(interval)
    wall = time.perf_counter() - t0
    # over the thread's own span in the window (a run's caller lives a second of it)
    span = {k: max(last[k][0] - first[k][0], 0.5) for k in last}
    busy = {k: (last[k][1] - first[k][1]) / TICK / span[k] for k in last}
    # minor page faults a second over the second half of the thread's span (its start-up's
    # imports and allocations left out): pages mapped anew, which on a VM whose memory the host
    # backs lazily also cost the host's fault at the guest's first touch
    faults = {}
    for k, hist in fault_hist.items():
        t_mid = (hist[0][0] + hist[-1][0]) / 2
        later = [h for h in hist if h[0] >= t_mid]
        dt = later[-1][0] - later[0][0]
        faults[k] = (later[-1][1] - later[0][1]) / dt if dt > 0 else float("nan")
    return {
        "wall": wall,
        "samples": len(running),
        "cmds": cmds,
        "names": names,
        "busy": busy,
        "faults": faults,
        "cpus": cpus,
        "running": running,
    }


def report(w: dict[str, Any], min_busy: float) -> tuple[list[str], dict[str, Any]]:
    hot = sorted((k for k, b in w["busy"].items() if b >= min_busy), key=lambda k: -w["busy"][k])
    lines = [f"# psr_watch: {w['samples']} samples over {w['wall']:.1f} s; busy threads:"]
    doc: dict[str, Any] = {"threads": [], "pairs": []}
    for k in hot:
        c = w["cpus"].get(k, Counter())
        n = sum(c.values())
        top = ", ".join(f"cpu{cpu} {cnt / n:.0%}" for cpu, cnt in c.most_common(3)) if n else "-"
        cmd = w["cmds"].get(k[0], "").partition(" ")[2][:50]  # (the interpreter's path off)
        flt = w.get("faults", {}).get(k, float("nan"))
        lines.append(
            f"thread {k[0]}/{k[1]} {w['names'][k]:<15} busy {w['busy'][k]:.2f} core, faults "
            f"{flt:.0f}/s | on {top} | {cmd}"
        )
        doc["threads"].append(
            {
                "pid": k[0],
                "tid": k[1],
                "comm": w["names"][k],
                "busy": w["busy"][k],
                "faults_per_s": flt,
                "cpus": dict(c),
                "cmd": cmd,
            }
        )
    pairs = []
    for i, a in enumerate(hot):
        for b in hot[i + 1 :]:
            if a[0] == b[0]:
                continue
            both = [r for r in w["running"] if a in r and b in r]
            if both:
                pairs.append((a, b, len(both), sum(r[a] == r[b] for r in both)))
    for a, b, n, same in sorted(pairs, key=lambda p: -p[2]):  # most often running together
        doc["pairs"].append({"a": list(a), "b": list(b), "both": n, "same": same})
        lines.append(
            f"pair {a[0]}/{a[1]} {w['names'][a]} + {b[0]}/{b[1]} {w['names'][b]}: "
            f"both running in {n} samples, on one CPU in {same / n:.0%}"
        )
    return lines, doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", default="python", help="a command line's substring")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=20.0, help="ms between samples")
    ap.add_argument("--min-busy", type=float, default=0.2, help="of a core, over the window")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    w = watch(a.match, a.seconds, a.interval / 1e3)
    lines, doc = report(w, a.min_busy)
    print("\n".join(lines), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps({"wall": w["wall"], "samples": w["samples"], **doc}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
