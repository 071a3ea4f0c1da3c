"""Is T1 slower on a worker that compiled its kernels (issue 14, session 29, hp's ask 1)?

Session 27's and 28's H200 runs read the first worker of a fresh machine, the one whose warm
calls compiled the kernels through NVRTC, 40-60 us slower on T1 for its whole life, in every
part, the caller's own encode and decode too. This tells "compiled in this process" from "the
first worker" and from "the machine's early minutes": a spare worker first compiles every
kernel into the CuPy cache directory ``ROOT/warm`` and stops; then the workers of ``--workers``
start together, each with ``CUPY_CACHE_DIR`` = ``ROOT/warm`` (``warm*``: they load the
compiled modules from disk) or a fresh ``ROOT/<name>`` (``cold*``: they compile, as the closing
check's first worker did); they are given ffn_down and warmed in ``--workers`` order (a warm
one first: the first warmed is not the compiling one). Then T1's load (one caller, N=1 f16 x on
ffn_down 3584x18944, MatmulStream, closed loop; bench/service_t1ab.py's spec and split) runs
on the workers in ``--order``, each run its own spawned caller.

Per worker, from /proc (after its warm-up and again at the end): threads (and any thread not
named as a Python / gRPC / CUDA one), RSS and its peak, the heap, anonymous huge pages, the
CPU time each thread used while the others' runs went on (a thread left spinning by the
compiler would read here), context switches. Per run: p50, kernel p50, p50 - kernel and the
mean of each part; per class (cold*, warm*) the medians.

    python3 bench/hp_cold_t1.py --backend cuda --workers warm1,cold1,warm2,cold2 \
        --order cold1,warm1,warm2,cold2,cold2,warm2,warm1,cold1 --seconds 1 --json out.json
    a CPU rehearsal: --backend numpy --row-scale 0.01
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from replay_ab import bounded, saver, start_all, stop_all  # bench/ is sys.path[0]
from service_load import run_load
from service_t1ab import WEIGHT, run_figures, spare_warm, t1_spec, table, warm

from service import PARTS, WEIGHTS, random_q6k

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_snapshot(pid: int) -> dict[str, Any]:
    """What /proc says of ``pid``: status fields, huge pages, maps, and per thread its name,
    CPU seconds and last CPU."""
    out: dict[str, Any] = {}
    base = Path(f"/proc/{pid}")
    try:
        for line in (base / "status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("Threads", "VmRSS", "VmHWM", "VmData", "RssAnon", "voluntary_ctxt_switches",
                     "nonvoluntary_ctxt_switches"):
                out[k] = int(v.split()[0])
        roll = (base / "smaps_rollup").read_text() if (base / "smaps_rollup").exists() else ""
        m = re.search(r"AnonHugePages:\s+(\d+)", roll)
        out["AnonHugePages"] = int(m.group(1)) if m else -1
        maps = (base / "maps").read_text().splitlines()
        out["maps"] = len(maps)
        heap = [ln for ln in maps if ln.endswith("[heap]")]
        if heap:
            a, b = heap[0].split()[0].split("-")
            out["heap_kb"] = (int(b, 16) - int(a, 16)) >> 10
        threads = {}
        for t in (base / "task").iterdir():
            try:
                comm = (t / "comm").read_text().strip()
                st = (t / "stat").read_text()
                f = st[st.rindex(")") + 2:].split()
                threads[t.name] = {"comm": comm, "cpu_s": (int(f[11]) + int(f[12])) / TICK,
                                   "psr": int(f[36])}
            except (OSError, ValueError, IndexError):
                continue
        out["threads"] = threads
    except OSError as e:
        out["error"] = repr(e)
    return out


def thread_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """CPU seconds each thread (name:tid) used between two snapshots, the busiest first."""
    ta, tb = a.get("threads", {}), b.get("threads", {})
    d = {f"{v['comm']}:{tid}": v["cpu_s"] - ta.get(tid, {}).get("cpu_s", 0.0)
         for tid, v in tb.items()}
    return dict(sorted(d.items(), key=lambda kv: -kv[1]))


def brief(s: dict[str, Any]) -> str:
    names: dict[str, int] = {}
    for t in s.get("threads", {}).values():
        names[t["comm"]] = names.get(t["comm"], 0) + 1
    return (f"threads {s.get('Threads', '?')} ({', '.join(f'{k} x{v}' for k, v in names.items())}"
            f"), rss {s.get('VmRSS', 0) >> 10} MiB (peak {s.get('VmHWM', 0) >> 10}), heap "
            f"{s.get('heap_kb', 0) >> 10} MiB, anon huge {s.get('AnonHugePages', 0) >> 10} MiB, "
            f"maps {s.get('maps', '?')}, ctxsw {s.get('voluntary_ctxt_switches', '?')}/"
            f"{s.get('nonvoluntary_ctxt_switches', '?')}")


def main(argv: list[str] | None = None) -> int:
    from q6serve.client.client import Client

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--workers", default="warm1,cold1,warm2,cold2",
                    help="cold*: a fresh kernel cache dir; warm*: the spare's (warm-up order)")
    ap.add_argument("--order", default="cold1,warm1,warm2,cold2,cold2,warm2,warm1,cold1")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--warmup", type=float, default=0.3)
    ap.add_argument("--row-scale", type=float, default=1.0)
    ap.add_argument("--bound", type=float, default=1e9)
    ap.add_argument("--root", type=Path, default=None, help="the cache dirs' parent (a temp dir)")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    names = [w for w in a.workers.split(",") if w]
    if any(not re.match(r"^(cold|warm)\d*$", w) for w in names) or len(set(names)) != len(names):
        ap.error("--workers: distinct names cold<N> / warm<N>")
    order = [v for v in a.order.split(",") if v]
    if unknown := [v for v in order if v not in names]:
        ap.error(f"--order names {unknown} not in --workers")
    root = a.root or Path(tempfile.mkdtemp(prefix="hp_cold_"))
    a.out_dir.mkdir(parents=True, exist_ok=True)
    cache = {w: root / ("warm" if w.startswith("warm") else w) for w in names}
    for d in {*cache.values(), root / "warm"}:
        d.mkdir(parents=True, exist_ok=True)
    rows, k = WEIGHTS[WEIGHT]
    rows = max(1, round(rows * a.row_scale))
    doc: dict[str, Any] = {"argv": sys.argv, "variants": {w: {"CUPY_CACHE_DIR": str(cache[w])}
                                                          for w in names},
                           "runs": [], "errors": [], "shape": [rows, k], "parts": PARTS,
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "warm_s": {}, "procs": {}}

    save = saver(doc, a.json, t_start)

    def files(d: Path) -> int:
        return sum(1 for p in d.rglob("*") if p.is_file())

    blocks = random_q6k(rows, k, 1)
    doc["spare_s"] = spare_warm(a.backend, {"CUPY_CACHE_DIR": str(root / "warm")}, a.out_dir,
                                blocks, rows, k)
    print(f"# spare: compiled into {root / 'warm'} ({files(root / 'warm')} files) and warmed in "
          f"{doc['spare_s']:.1f} s", flush=True)
    workers = start_all(a.backend, {w: {"CUPY_CACHE_DIR": str(cache[w])} for w in names},
                        a.out_dir)
    clients = {w: Client(p.target, timeout=600.0) for w, p in workers.items()}
    pids = {w: p.proc.pid for w, p in workers.items()}  # type: ignore[union-attr]
    snaps: dict[str, dict[str, Any]] = {}
    try:
        st = next(iter(clients.values())).status()
        doc["backend"], doc["device"] = st.backend, st.device
        for w, c in clients.items():
            before = files(cache[w])
            t0 = time.perf_counter()
            warm(c, blocks, rows, k)
            doc["warm_s"][w] = time.perf_counter() - t0
            print(f"# {w}: warmed in {doc['warm_s'][w]:.2f} s (cache {cache[w].name}: "
                  f"{before} -> {files(cache[w])} files)", flush=True)
        for w in names:
            snaps[w] = proc_snapshot(pids[w])
            print(f"# {w} after warm-up: {brief(snaps[w])}", flush=True)
        need: dict[int, float] = {}  # what a run takes (replay_ab.bounded)
        seen: dict[str, int] = {}
        for v in order:
            seen[v] = seen.get(v, 0) + 1
            label = f"{v}_{seen[v]}"
            spec = t1_spec(workers[v].target, rows, k, a)
            pre = {w: proc_snapshot(pids[w]) for w in names}
            got = bounded(doc, label, 1, need, t_start, a, save,
                          lambda spec=spec: run_load(spec, 1)[0][WEIGHT])
            if got is None:
                continue
            s, t_run = got
            post = {w: proc_snapshot(pids[w]) for w in names}
            idle = {w: round(sum(thread_delta(pre[w], post[w]).values()), 3)
                    for w in names if w != v}
            busy = {t: round(x, 3) for t, x in list(thread_delta(pre[v], post[v]).items())[:4]}
            r = {"variant": v, "round": seen[v], "label": label, **run_figures(s),
                 "others_cpu_s": idle, "threads_cpu_s": busy,
                 "t": time.perf_counter() - t_start, "run_s": time.perf_counter() - t_run}
            doc["runs"].append(r)
            save()
            print(f"# {label}: p50 {r['p50_us']:.1f} us, kernel {r['kernel_p50_us']:.1f}, "
                  f"p50 - kernel {r['gap_us']:.1f}"
                  f" ({r['calls']} calls); its busiest threads (cpu s) {busy}; the idle workers' "
                  f"cpu s {idle}", flush=True)
        for w in names:
            end = proc_snapshot(pids[w])
            doc["procs"][w] = {"after_warm": snaps[w], "end": end,
                               "threads_cpu_s": thread_delta({}, end)}
            print(f"# {w} at the end: {brief(end)}", flush=True)
    finally:
        stop_all(clients.values(), workers.values(), save)
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
