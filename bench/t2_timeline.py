"""Where T2's tail comes from: a per-call timeline of many callers of N=1 through a
``--frontends`` worker, split by part, at p50 and at p99 (issue 15; T2 = 64 callers of N=1,
whose p99 is 6.2-6.5 ms on the H200 against the 4 ms asked).

Each caller (a MatmulStream on its own connection, one request in flight, as
bench/frontend_cpu.py's T2 load) stamps when it writes a request and when its reply is read;
the worker runs with bench/frontend_stamps.py (bench/timeline_site on its PYTHONPATH), so every
reply carries its front end's pid and its stamps in the front end (perf_counter, one clock for
the host's processes). A call's round trip is then cut into parts that add up to it:

    up        the caller's write -> the front end took the request's bytes (gRPC's way up:
              the caller's loop and HTTP/2, the front end's gRPC threads and loop)
    decode    -> the call handed to the EngineProxy (interceptor, servicer, decoding)
    stack     -> its stack written to the device process (the proxy's flush; waits for an
              answer while ``stacks_in_flight`` stacks of the weight are out)
    device    -> the front end reads the device process's answer (IPC both ways, the device
              process's loop and batch; ``batch`` is the reply's device_seconds + queue)
    fanout    -> this caller's future settled (the answer's earlier callers' sinks first)
    encode    -> its reply encoded (the sink)
    writer    -> the stream's writer task handed it to gRPC (a loop trip or more)
    down      -> the caller has read it (gRPC's way down, the caller's loop)

and printed as the mean of each part over the calls around the median (p45-p55) and over the
slowest 1%, with where those slow calls were (each front end's callers and share of the slow
calls), and how much of them overlapped a stall of their front end (a GC pause or a loop
iteration of 0.5 ms or more; bench/frontend_stamps.py logs them) or of the device process.

    python bench/t2_timeline.py --frontends 2 --hosts 2 --callers 8 --seconds 4   # the VM
    python bench/t2_timeline.py --backend cuda --rows 3584 --k 18944 --frontends 4 \\
        --hosts 8 --callers 8 --seconds 2 --json t2.json                            # T2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from frontend_stamps import FIELDS
from frontend_stamps import parse as parse_stamps
from service_load import MATMUL_STREAM, request_bytes, spawn_hosts

from service import WARM_NS, random_q6k  # bench/ is sys.path[0]

HERE = Path(__file__).resolve().parent
PARTS = ("up", "decode", "stack", "device", "fanout", "encode", "writer", "down")


# -- the callers (spawned load processes) -------------------------------------------------------
async def _caller(target: str, idx: int, k: int, precision: int, until: list[float],
                  out: list[list[Any]] | None) -> None:
    import grpc

    from q6serve.client.channel import channel_options
    from q6serve.v1 import q6serve_pb2 as pb

    opts = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]  # its own connection
    async with grpc.aio.insecure_channel(target, options=opts) as ch:
        stream = ch.stream_stream(MATMUL_STREAM)()
        x = np.random.default_rng(idx).standard_normal((1, k)).astype(np.float16)
        got = []
        while time.perf_counter() < until[0]:
            req = request_bytes(pb, ("w",), x, precision)
            t0 = time.perf_counter()
            await stream.write(req)
            raw = await stream.read()
            t1 = time.perf_counter()
            got.append((t0, t1, raw))
        await stream.done_writing()
    if out is None:
        return
    for t0, t1, raw in got:  # decoded after the timed part
        msg = pb.MatmulStreamResponse.FromString(raw)
        if msg.WhichOneof("outcome") != "result":
            raise RuntimeError(f"stream error: {msg.error.code} {msg.error.message}")
        t = msg.result.timing
        pid, stamps = parse_stamps(msg.request_id) or (0, [float("nan")] * len(FIELDS))
        out.append([idx, t0, t1, t.queue_seconds, t.device_seconds, t.batch_rows, pid,
                    *stamps])


async def _host(spec: dict[str, Any], barrier: Any) -> dict[str, Any]:
    until = [time.perf_counter() + spec["warmup"]]
    base = spec["host"] * 1000
    await asyncio.gather(*(_caller(spec["target"], base + i, spec["k"], spec["precision"],
                                   until, None) for i in range(spec["callers"])))
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 120)
    out: list[list[Any]] = []
    until[0] = time.perf_counter() + spec["seconds"]
    cpu, wall, machine = time.process_time(), time.perf_counter(), _machine_busy()
    await asyncio.gather(*(_caller(spec["target"], base + 500 + i, spec["k"],
                                   spec["precision"], until, out)
                           for i in range(spec["callers"])))
    wall = time.perf_counter() - wall
    return {"rows": out, "cores": (time.process_time() - cpu) / wall,
            "machine": (_machine_busy() - machine) / wall}


def _machine_busy() -> float:
    """The host's busy CPU seconds so far, all cores (/proc/stat: all but idle and iowait)."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def _host_numbered(spec: dict[str, Any], barrier: Any) -> Any:
    """Each spawned host its own numbers (its pid: callers' indices differ between hosts)."""
    return _host({**spec, "host": os.getpid() % 100000}, barrier)


# -- the analysis ------------------------------------------------------------------------------
COLS = ("caller", "t0", "t1", "queue", "device_s", "batch_rows", "pid", *FIELDS)


def timeline(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Each call's parts (seconds; they add up to its round trip) from its stamps."""
    c = {name: rows[:, i] for i, name in enumerate(COLS)}
    return {"e2e": c["t1"] - c["t0"], "up": c["start"] - c["t0"],
            "decode": c["in"] - c["start"], "stack": c["sent"] - c["in"],
            "device": c["read"] - c["sent"], "fanout": c["resolved"] - c["read"],
            "encode": c["end"] - c["resolved"], "writer": c["send"] - c["end"],
            "down": c["t1"] - c["send"], "batch": c["queue"] + c["device_s"]}


def load_stalls(folder: Path) -> dict[str, list[tuple[int, np.ndarray]]]:
    """{"front"/"device": [(pid, array of [start, length, kind, CPU] seconds)]} (kind 0: a
    loop iteration, 1: a young GC collection, 2: a full one): the
    worker's logged GC pauses and long loop iterations (CPU: the thread's in it). The
    processes' cumulative counters (kind "cpu") are under "usage-front"/"usage-device": arrays
    of [when, loop busy, loop in select, process CPU, loop thread CPU] seconds."""
    got: dict[str, list[tuple[int, np.ndarray]]] = {"front": [], "device": []}
    for p in sorted(folder.glob("stalls-*.jsonl")):
        _, role, pid = p.stem.split("-")
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        arr = np.array([(r[0] * 1e-6, r[1] * 1e-6, {"loop": 0, "gc2": 2}.get(r[2], 1),
                         r[3] * 1e-6) for r in rows if r[2] != "cpu"],
                       np.float64).reshape(-1, 4)
        got.setdefault(role, []).append((int(pid), arr))
        use = np.array([(r[0], r[1], r[3], r[4], r[5]) for r in rows if r[2] == "cpu"],
                       np.float64).reshape(-1, 5) * 1e-6
        got.setdefault(f"usage-{role}", []).append((int(pid), use))
    return got


def usage(use: np.ndarray, span: tuple[float, float]) -> dict[str, float] | None:
    """A process's shares over ``span`` from its cumulative counters (rows of [when, loop
    busy, in select, process CPU, loop thread CPU], every ~0.5 s), each read at the span's
    start and end by linear interpolation between the samples around them (a sample's
    bracket would add up to 0.5 s of warm-up before and of idle after; None: not bracketed)."""
    if use.shape[0] < 2 or use[0, 0] > span[0] or use[-1, 0] < span[1]:
        return None
    wall = span[1] - span[0]

    def share(col: int) -> float:
        return float((np.interp(span[1], use[:, 0], use[:, col])
                      - np.interp(span[0], use[:, 0], use[:, col])) / wall)

    return {"seconds": float(wall), "loop_busy": share(1), "cores": share(3),
            "loop_thread": share(4)}


def overlap(t0: np.ndarray, t1: np.ndarray, stalls: np.ndarray) -> np.ndarray:
    """Seconds of each interval [t0, t1] covered by ``stalls`` (start, length rows)."""
    if stalls.size == 0:
        return np.zeros_like(t0)
    s0, s1 = stalls[:, 0], stalls[:, 0] + stalls[:, 1]
    lo = np.maximum(t0[:, None], s0[None, :])
    hi = np.minimum(t1[:, None], s1[None, :])
    return np.clip(hi - lo, 0, None).sum(axis=1)


def analyse(rows: np.ndarray, stalls: dict[str, list[tuple[int, np.ndarray]]],
            ) -> dict[str, Any]:
    ok = ~np.isnan(rows[:, COLS.index("start")])
    stamped = rows[ok]
    if not stamped.size:
        raise RuntimeError("no reply carried the front ends' stamps (bench/frontend_stamps.py)")
    tl = timeline(stamped)
    e2e = tl["e2e"]
    lo, mid, hi = np.percentile(e2e, (45, 50, 55))
    p99, p999 = np.percentile(e2e, (99, 99.9))
    bands = {"p50": (e2e >= lo) & (e2e <= hi), "p99": e2e >= p99}
    t0, t1 = stamped[:, COLS.index("t0")], stamped[:, COLS.index("t1")]
    pids = stamped[:, COLS.index("pid")].astype(int)
    fronts = {pid: arr for pid, arr in stalls.get("front", [])}
    front_stall = np.zeros_like(t0)
    front_gc = np.zeros_like(t0)
    for pid, arr in fronts.items():
        m = pids == pid
        if m.any() and arr.size:
            front_stall[m] = overlap(t0[m], t1[m], arr[:, :2])
            front_gc[m] = overlap(t0[m], t1[m], arr[arr[:, 2] > 0, :2])
    dev = np.concatenate([a for _, a in stalls.get("device", [])] or [np.zeros((0, 4))])
    dev_stall = overlap(t0, t1, dev[:, :2])
    out: dict[str, Any] = {"calls": int(rows.shape[0]), "stamped": int(ok.sum()),
                           "p50_us": float(mid * 1e6), "p99_us": float(p99 * 1e6),
                           "p999_us": float(p999 * 1e6), "max_us": float(e2e.max() * 1e6),
                           "mean_us": float(e2e.mean() * 1e6)}
    for name, m in bands.items():
        out[name] = {**{p: float(tl[p][m].mean() * 1e6) for p in (*PARTS, "batch")},
                     "e2e": float(e2e[m].mean() * 1e6), "calls": int(m.sum()),
                     "front_stalls": float(front_stall[m].mean() * 1e6),
                     "front_gc": float(front_gc[m].mean() * 1e6),
                     "device_stalls": float(dev_stall[m].mean() * 1e6),
                     "batch_rows": float(stamped[m, COLS.index("batch_rows")].mean())}
    callers = stamped[:, COLS.index("caller")].astype(int)
    per_front = {}
    for pid in sorted(set(pids.tolist())):
        m = pids == pid
        per_front[pid] = {"callers": len(set(callers[m].tolist())), "calls": int(m.sum()),
                          "mean_us": float(e2e[m].mean() * 1e6),
                          "p99_us": float(np.percentile(e2e[m], 99) * 1e6),
                          "slow_share": float((m & bands["p99"]).sum()
                                              / max(bands["p99"].sum(), 1))}
    out["per_front"] = per_front
    # stall totals per process over the timed part
    span = (t0.min(), t1.max())
    totals = {}
    for role, procs in stalls.items():
        if role.startswith("usage-"):
            continue
        for pid, arr in procs:
            inside = arr[(arr[:, 0] >= span[0]) & (arr[:, 0] <= span[1])] if arr.size else arr
            totals[f"{role}-{pid}"] = {
                "gc_n": int((inside[:, 2] > 0).sum()) if inside.size else 0,
                "gc_ms": float(inside[inside[:, 2] > 0, 1].sum() * 1e3) if inside.size else 0.0,
                "gc_max_ms": float(inside[inside[:, 2] > 0, 1].max() * 1e3)
                if inside.size and (inside[:, 2] > 0).any() else 0.0,
                "loop_n": int((inside[:, 2] == 0).sum()) if inside.size else 0,
                "gc2_n": int((inside[:, 2] == 2).sum()) if inside.size else 0,
                "gc2_max_ms": float(inside[inside[:, 2] == 2, 1].max() * 1e3)
                if inside.size and (inside[:, 2] == 2).any() else 0.0,
                "gc2_cpu_ms": float(inside[inside[:, 2] == 2, 3].sum() * 1e3)
                if inside.size else 0.0,
                "loop_max_ms": float(inside[inside[:, 2] == 0, 1].max() * 1e3)
                if inside.size and (inside[:, 2] == 0).any() else 0.0,
                "loop_ms": float(inside[inside[:, 2] == 0, 1].sum() * 1e3)
                if inside.size else 0.0,
                "loop_cpu_ms": float(inside[inside[:, 2] == 0, 3].sum() * 1e3)
                if inside.size else 0.0}
    out["stalls"] = totals
    out["usage"] = {f"{role[6:]}-{pid}": u for role, procs in stalls.items()
                    if role.startswith("usage-") for pid, use in procs
                    if (u := usage(use, span)) is not None}
    return out


def report(r: dict[str, Any], label: str = "") -> None:
    print(f"{label}{r['calls']} calls ({r['stamped']} stamped): p50 {r['p50_us']:,.0f} us, "
          f"p99 {r['p99_us']:,.0f} us, p99.9 {r['p999_us']:,.0f} us, max {r['max_us']:,.0f} us, "
          f"mean {r['mean_us']:,.0f} us", flush=True)
    head = ["band", "e2e", *PARTS, "batch", "rows", "fe stall", "fe gc", "dev stall"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for band in ("p50", "p99"):
        b = r[band]
        cells = [f"{band} ({b['calls']})", f"{b['e2e']:,.0f}",
                 *(f"{b[p]:,.0f}" for p in PARTS), f"{b['batch']:,.0f}",
                 f"{b['batch_rows']:.1f}", f"{b['front_stalls']:,.0f}",
                 f"{b['front_gc']:,.0f}", f"{b['device_stalls']:,.0f}"]
        print("| " + " | ".join(cells) + " |")
    print("per front end (callers, mean / p99 us, share of the slowest 1%): " + "; ".join(
        f"{v['callers']}c {v['mean_us']:,.0f} / {v.get('p99_us', 0):,.0f} us "
        f"{v['slow_share'] * 100:.0f}%"
        for v in sorted(r["per_front"].values(), key=lambda v: -v["callers"])))
    print("stalls in the timed part: " + "; ".join(
        f"{k} gc {v['gc_n']} ({v['gc_ms']:.1f} ms, max {v['gc_max_ms']:.1f}; full "
        f"{v['gc2_n']}, max {v['gc2_max_ms']:.1f}, CPU {v['gc2_cpu_ms']:.1f}) loop>=0.5ms "
        f"{v['loop_n']} ({v['loop_ms']:.0f} ms, of it CPU {v['loop_cpu_ms']:.0f}; max "
        f"{v['loop_max_ms']:.1f})" for k, v in r["stalls"].items()),
        flush=True)
    if use := r.get("usage"):
        print("cores (loop busy, loop thread) over the timed part: " + "; ".join(
            f"{k} {v['cores']:.2f} ({v['loop_busy']:.2f}, {v['loop_thread']:.2f})"
            for k, v in sorted(use.items())), flush=True)
    if load := r.get("load_cores"):
        print(f"load processes: {sum(load):.2f} cores, max {max(load):.2f}; the machine "
              f"{r.get('machine_cores', 0):.1f} of {r.get('machine_cpus')} busy", flush=True)


# -- the worker --------------------------------------------------------------------------------
def start_worker(a: argparse.Namespace, folder: Path, log: Path) -> tuple[subprocess.Popen[Any],
                                                                           str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "timeline_site"),
                                                      env.get("PYTHONPATH", "")]))
    env["Q6SERVE_FE_STAMPS"] = str(folder)
    cmd = [sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0", "--backend",
           a.backend, "--frontends", str(a.frontends), *a.worker_arg]
    with open(log, "w") as f:
        worker = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    end = time.monotonic() + 120
    while not (m := re.search(r"listening on (\S+:\d+)", log.read_text())):
        if worker.poll() is not None or time.monotonic() > end:
            raise RuntimeError(f"worker did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    return worker, m.group(1)


def _spy(worker_pid: int, a: argparse.Namespace) -> subprocess.Popen[Any] | None:
    """py-spy on the worker's first front end (its first child running frontend_main) from
    about the load's warm-up end for the timed part less a second (whole seconds), C frames
    included (--native: it stops the process for each sample); None (and a line) if there
    is no py-spy."""
    exe = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
    kids = subprocess.run(["pgrep", "-P", str(worker_pid)], capture_output=True,
                          text=True).stdout.split()
    fronts = [k for k in kids if "frontend_main" in Path(f"/proc/{k}/cmdline").read_text()]
    if not fronts or not os.path.exists(exe):
        print(f"# no profile: py-spy {exe} front ends {fronts}", flush=True)
        return None
    d = max(1, int(a.seconds) - 1)
    print(f"# py-spy on front end {fronts[0]} for {d} s", flush=True)
    return subprocess.Popen(
        ["sh", "-c", f"sleep {a.warmup + 1.0}; exec {exe} record -p {fronts[0]} -d {d} "
                     f"-r 200 --native -t -f raw -o {a.spy}"],
        stdout=subprocess.DEVNULL, stderr=open(f"{a.spy}.log", "w"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frontends", type=int, default=2, help="2 or more")
    ap.add_argument("--hosts", type=int, default=2, help="load processes")
    ap.add_argument("--callers", type=int, default=8, help="callers per load process")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--rows", type=int, default=16, help="the weight's rows")
    ap.add_argument("--k", type=int, default=256, help="the weight's K (a multiple of 256)")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--precision", default="f16", help="the calls' precision (T2: f16)")
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="one more argument of the worker (repeat)")
    ap.add_argument("--runs", type=int, default=1, help="loads on one worker, one row each")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the stall logs and calls in this folder")
    ap.add_argument("--spy", type=Path, help="py-spy (--native, raw) one front end's threads "
                    "through the first run's timed part into this file")
    a = ap.parse_args(argv)
    if a.frontends < 2:
        ap.error("--frontends 2 or more (one is the one-process worker: no front ends)")
    from q6serve.client.client import PRECISIONS, Client

    folder = Path(tempfile.mkdtemp(prefix="t2_timeline_")) if a.keep is None else a.keep
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "worker.log"
    worker, target = start_worker(a, folder, log)
    results = []
    try:
        with Client(target) as c:
            c.upload("w", random_q6k(a.rows, a.k, 1), a.rows, a.k)
            for m in WARM_NS:  # kernels load on first use, never in a run
                c.matmul_full("w", np.ones((m, a.k), np.float16), precision=a.precision,
                              timeout=600.0)
        spec = {"target": target, "k": a.k, "precision": PRECISIONS[a.precision],
                "callers": a.callers, "seconds": a.seconds, "warmup": a.warmup}
        for run in range(a.runs):
            spy = _spy(worker.pid, a) if a.spy is not None and run == 0 else None
            got = spawn_hosts(_host_numbered, spec, a.hosts, a.warmup + a.seconds + 150)
            rows = np.array([r for g in got for r in g["rows"]], np.float64)
            if spy is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.wait(5)
            time.sleep(0.7)  # the stall logs' next write
            r = analyse(rows, load_stalls(folder))
            r["calls_per_s"] = rows.shape[0] / a.seconds
            r["load_cores"] = [g["cores"] for g in got]
            r["machine_cores"] = float(np.mean([g["machine"] for g in got]))
            r["machine_cpus"] = os.cpu_count()
            r["config"] = {k: v for k, v in vars(a).items() if k not in ("json", "keep")}
            r["env"] = {k: v for k, v in os.environ.items() if k.startswith("Q6SERVE_")}
            report(r, f"run {run}: {r['calls_per_s']:,.0f} calls/s; ")
            results.append(r)
            if a.keep is not None:
                np.save(folder / f"calls-{run}.npy", rows)
            for p in folder.glob("stalls-*.jsonl"):  # each run its own stalls
                if a.keep is not None:
                    p.rename(p.with_suffix(f".run{run}"))
                else:
                    p.unlink()
        if a.json:
            a.json.write_text(json.dumps(results[0] if len(results) == 1 else results,
                                         indent=1, default=str))
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
