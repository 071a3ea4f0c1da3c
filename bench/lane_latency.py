"""One caller, N=1, one weight: latency through the fast lane vs gRPC (issue 15 item 3).

Starts ``q6serve worker --allow-shm`` (``--frontends`` as given), uploads a synthetic weight,
then per path runs closed-loop calls for ``--seconds``: gRPC unary with the bytes in the
messages, gRPC unary with x and y in a region, and the fast lane (x and y in the same region;
once per ``--spins`` value: the caller's poll for its reply before it blocks, client/lane.py,
where the client has one). Prints p50/p99 and p50 minus the worker's device time and minus the
kernel per call (the stretch target: p50 - kernel <= 50 us on the H200; on the CPU the kernel
is NumPy's, so compare the paths).

``--stamps``: the worker stamps each lane request (bench/lane_stamps.py, through
bench/trips_site) and the caller its own write and read, on one clock, so each lane round trip
splits into: client pre (x into the region, the record packed), up (write -> the worker read
the bytes), pre-job (the worker's checks and queueing up to the job's launch), job (the device
job: host launch, kernel, wait), post-job (job done -> reply written), down (reply written ->
the caller's read returned), client post (the reply unpacked, y's view). ``--check``: the
lane's y (its first CHECK_ROWS outputs) against a NumPy reference (dequantized weight, f32),
in the F16 tolerance.

    python bench/lane_latency.py --backend numpy --rows 512 --k 3584 --seconds 3
    python bench/lane_latency.py --backend cuda --rows 3584 --k 18944 --json "$OUT/lane.json"
    python bench/lane_latency.py --backend cuda --paths lane --spins 0,1000 --stamps --check
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lane_stamps  # bench/ is sys.path[0]
import numpy as np

from service import random_q6k, start_worker

PARTS = ("client_pre", "up", "pre_job", "job", "post_job", "down", "client_post")
SITE = Path(__file__).resolve().parent / "trips_site"


def timed(fn: Any, seconds: float, warmup: float) -> tuple[np.ndarray, np.ndarray]:
    """Closed loop: (wall seconds per call, the worker's device seconds per call)."""
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        fn()
    walls, dev = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        d = fn()
        walls.append(time.perf_counter() - t0)
        dev.append(np.nan if d is None else d)
    return np.asarray(walls), np.asarray(dev)


CHECK_ROWS = 512  # outputs checked (the weight's first rows: dequantizing all is seconds)


def reference(blocks: np.ndarray, rows: int, k: int, x: np.ndarray) -> np.ndarray:
    """y's first min(rows, CHECK_ROWS) columns in f32 from the dequantized weight."""
    from q6serve.kernels import q6k

    r = min(rows, CHECK_ROWS)
    w = q6k.dequantize_aos(blocks[: r * (k // 256)], r, k).astype(np.float32)
    return x.astype(np.float32) @ w.T


def check(y: np.ndarray, ref: np.ndarray) -> dict[str, Any]:
    """y against the reference: the F16 tolerance of the service's tests (rtol 1e-2,
    atol 1e-1), and the largest error relative to the largest |ref|."""
    y = np.asarray(y, np.float32)
    ok = bool(np.allclose(y, ref, rtol=1e-2, atol=1e-1))
    rel = float(np.max(np.abs(y - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    return {"ok": ok, "max_rel_err": rel}


def switches(pid: int | str, main: bool = False) -> tuple[int, int]:
    """(voluntary, involuntary) context switches so far of every thread of process ``pid``
    ("self": this one), or (``main``) of its main thread only (a worker's event loop): a
    voluntary one is a thread that blocked (and was woken since)."""
    vol = inv = 0
    task = Path(f"/proc/{pid}/task")
    threads = [task / str(pid)] if main else (list(task.iterdir()) if task.exists() else [])
    for t in threads:
        try:
            text = (t / "status").read_text()
        except OSError:
            continue  # (a thread gone meanwhile)
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                inv += int(line.split()[1])
    return vol, inv


def lane_run(lane: Any, x: np.ndarray, y_off: int, seconds: float, warmup: float,
             stamps: bool, worker_pid: int | None = None) -> dict[str, Any]:
    """Closed-loop lane calls: walls, device and kernel seconds, and per call (seq) the
    caller's stamps (t0, send, wake, end); over the timed calls, the worker's and this
    process's context switches (``switches``) and this process's GC collections by
    generation (``gc``)."""
    import gc

    marks = lane_stamps.client_hooks(lane) if stamps else {}
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        lane.matmul("w", x, y_offset=y_off)
    gc0 = [g["collections"] for g in gc.get_stats()]
    me0, w0 = switches("self"), switches(worker_pid) if worker_pid else (0, 0)
    loop0 = switches(worker_pid, main=True) if worker_pid else (0, 0)
    wall0 = time.time()
    rows: list[tuple[float, ...]] = []
    now = time.perf_counter
    end = now() + seconds
    while now() < end:
        marks.clear()
        t0 = now()
        lane.matmul("w", x, y_offset=y_off)
        t1 = now()
        last = lane.last
        rows.append((lane._seq, t0, marks.get("send", np.nan), marks.get("wake", np.nan), t1,
                     np.nan if last.device_seconds is None else last.device_seconds,
                     np.nan if last.kernel_seconds is None else last.kernel_seconds))
    me1, w1 = switches("self"), switches(worker_pid) if worker_pid else (0, 0)
    loop1 = switches(worker_pid, main=True) if worker_pid else (0, 0)
    return {"calls": np.asarray(rows),
            "gc": [g["collections"] - c for g, c in zip(gc.get_stats(), gc0, strict=True)],
            "wall": (wall0, time.time()),  # (to match the worker's own logs)
            "caller_switches": (me1[0] - me0[0], me1[1] - me0[1]),
            "worker_switches": (w1[0] - w0[0], w1[1] - w0[1]) if worker_pid else None,
            "loop_switches": (loop1[0] - loop0[0], loop1[1] - loop0[1]) if worker_pid else None}


def summarize(name: str, run: dict[str, Any], worker_stamps: dict[int, Any] | None,
              ) -> dict[str, Any]:
    a = run["calls"]
    walls, dev, ker = a[:, 4] - a[:, 1], a[:, 5], a[:, 6]
    p50, p99, p999 = (float(np.percentile(walls, q) * 1e6) for q in (50, 99, 99.9))
    d50 = float(np.nanmedian(dev) * 1e6) if np.isfinite(dev).any() else 0.0
    k50 = float(np.nanmedian(ker) * 1e6) if np.isfinite(ker).any() else 0.0
    out: dict[str, Any] = {"calls": int(walls.size), "p50_us": p50, "p99_us": p99,
                           "p999_us": p999, "max_us": float(walls.max() * 1e6),
                           "device_p50_us": d50, "kernel_p50_us": k50,
                           "p50_minus_device_us": p50 - d50, "p50_minus_kernel_us": p50 - k50}
    line = (f"{name:<16} calls {walls.size:>7}  p50 {p50:8.1f} us  p99 {p99:8.1f} us  device "
            f"p50 {d50:7.1f}  kernel p50 {k50:6.1f}  p50 - device {p50 - d50:7.1f}  p50 - "
            f"kernel {p50 - k50:7.1f}  p99.9 {p999:8.1f}  max {out['max_us']:8.1f}")
    if "caller_switches" in run:  # per call: wake-ups (voluntary switches), preemptions
        n = max(walls.size, 1)
        cs, ws = run["caller_switches"], run.get("worker_switches")
        out["caller_switches_per_call"] = [cs[0] / n, cs[1] / n]
        out["gc_collections"] = run["gc"]
        out["wall"] = run["wall"]
        line += (f"\n{'':17}per call: caller wakes {cs[0] / n:.2f} preempted {cs[1] / n:.3f}")
        if ws is not None:
            ls = run["loop_switches"]
            out["worker_switches_per_call"] = [ws[0] / n, ws[1] / n]
            out["loop_switches_per_call"] = [ls[0] / n, ls[1] / n]
            line += (f"  worker wakes {ws[0] / n:.2f} preempted {ws[1] / n:.3f} (its loop "
                     f"{ls[0] / n:.2f} / {ls[1] / n:.3f})")
        line += f"  caller gc {'/'.join(map(str, run['gc']))} (gen 0/1/2 in the run)"
    for key in ("spun", "slept"):
        if key in run:
            out[key] = run[key]
    if worker_stamps:
        got = [(r, worker_stamps[int(r[0])]) for r in a if int(r[0]) in worker_stamps]
        if got:
            c = np.asarray([r for r, _ in got])
            w = np.asarray([s for _, s in got])
            t0, send, wake, t1, devs = c[:, 1], c[:, 2], c[:, 3], c[:, 4], c[:, 5]
            t_read, t_launch, t_write = w[:, 0], w[:, 1], w[:, 2]
            job = np.nan_to_num(devs)
            parts = {"client_pre": send - t0, "up": t_read - send,
                     "pre_job": t_launch - t_read, "job": job,
                     "post_job": t_write - (t_launch + job), "down": wake - t_write,
                     "client_post": t1 - wake}
            out["parts_p50_us"] = {k: float(np.nanmedian(v) * 1e6) for k, v in parts.items()}
            out["parts_mean_us"] = {k: float(np.nanmean(v) * 1e6) for k, v in parts.items()}
            # what the tail is made of: the slowest 1% of the stamped calls, each part's mean
            slow = (t1 - t0) >= np.percentile(t1 - t0, 99)
            out["parts_slow1_mean_us"] = {k: float(np.nanmean(v[slow]) * 1e6)
                                          for k, v in parts.items()}
            out["stamped_calls"] = len(got)
            line += "\n" + " " * 17 + "p50 us: " + "  ".join(
                f"{k} {out['parts_p50_us'][k]:.1f}" for k in PARTS)
            line += "\n" + " " * 17 + "slowest 1% mean us: " + "  ".join(
                f"{k} {out['parts_slow1_mean_us'][k]:.1f}" for k in PARTS)
    print(line, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--rows", type=int, default=3584)
    ap.add_argument("--k", type=int, default=18944)
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--paths", default="grpc,regions,lane",
                    help="comma-separated: grpc (bytes), regions (gRPC with regions), lane")
    ap.add_argument("--spins", default="",
                    help="the lane caller's spins to run, us, comma-separated (empty: the "
                         "client's default; ignored by a client without a spin)")
    ap.add_argument("--rings", default="",
                    help="the lane over the socket and over its shared-memory ring alternated "
                         "on one worker (started with Q6SERVE_LANE_RING=1), e.g. "
                         "sock,ring,ring,sock: one run of --seconds each")
    ap.add_argument("--stamps", action="store_true", help="per-stage breakdown of lane calls")
    ap.add_argument("--check", action="store_true", help="lane y vs the NumPy reference")
    ap.add_argument("--client-cpu", type=int, default=None,
                    help="pin this caller to that CPU (after starting the worker)")
    ap.add_argument("--worker-cpus", default="", help="the worker's --cpus (e.g. 0-6,8-14)")
    ap.add_argument("--caller-gc", choices=("on", "off"), default="on",
                    help="off: this process's cyclic GC disabled (gc.freeze, gc.disable) "
                    "while the lanes run")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    # `timeout` sends SIGTERM: leave through the finally blocks and the context managers, so
    # the worker is stopped and the caller's region unregistered and unlinked (session 26's
    # check cut this step and left its region to the resource tracker: "leaked shared_memory")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from q6serve.client.client import Client

    paths = [p for p in a.paths.split(",") if p]
    out_dir = a.json.parent if a.json else Path(tempfile.mkdtemp(prefix="q6lane-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    extra = ["--allow-shm"] + (["--frontends", str(a.frontends)] if a.frontends > 1 else [])
    extra += ["--cpus", a.worker_cpus] if a.worker_cpus else []
    stamp_file = out_dir / f"lane_stamps{'_' + a.label if a.label else ''}.json"
    if a.stamps:  # the worker (a child: it inherits this environment) stamps its lane
        stamp_file.unlink(missing_ok=True)
        os.environ["Q6SERVE_LANE_STAMPS"] = str(stamp_file)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(SITE), *filter(None, [os.environ.get("PYTHONPATH")])])
    rings = [r for r in a.rings.split(",") if r]
    if any(r not in ("sock", "ring") for r in rings):
        ap.error("--rings takes sock and ring")
    if rings:  # the worker (a child) takes ring lanes; each lane says which it is
        os.environ["Q6SERVE_LANE_RING"] = "1"
    worker = start_worker(a.backend, out_dir / f"worker{'_' + a.label if a.label else ''}.log",
                          extra)
    if a.client_cpu is not None:
        os.sched_setaffinity(0, {a.client_cpu})
    worker_pid = worker.proc.pid if worker.proc is not None else None
    if a.caller_gc == "off":
        import gc

        gc.freeze()
        gc.disable()
    results: dict[str, Any] = {}
    lane_runs: dict[str, dict[str, Any]] = {}
    blocks = random_q6k(a.rows, a.k, 1)
    x = np.random.default_rng(0).standard_normal((1, a.k)).astype(np.float16)
    try:
        with Client(worker.target) as c:
            c.upload("w", blocks, a.rows, a.k)
            # the lane: the caller's default (its ring where the worker takes one) or, with
            # --stamps and no --rings, the socket (the stamps' caller hooks are the socket's)
            ring = False if a.stamps and not rings else None
            with c.register_shm("io", 1 << 22) as region, c.open_lane(region, ring=ring) as lane:
                y_off = 1 << 21

                def rpc() -> float | None:
                    return c.matmul_full("w", x).device_seconds

                def rpc_region() -> float | None:
                    return c.matmul_full("w", x, x_region=region,
                                         y_region=(region, y_off)).device_seconds

                for key, name, fn in (("grpc", "grpc bytes", rpc),
                                      ("regions", "grpc regions", rpc_region)):
                    if key not in paths:
                        continue
                    walls, dev = timed(fn, a.seconds, a.warmup)
                    run = {"calls": np.stack([np.zeros_like(walls), np.zeros_like(walls),
                                              walls * 0, walls * 0, walls, dev,
                                              np.full_like(walls, np.nan)], axis=1)}
                    results[name] = summarize(name, run, None)
                ref = None
                if "lane" in paths and rings:
                    from q6serve.client import core as ccore
                    from q6serve.client.lane import Lane

                    region2 = c.register_shm("io2", 1 << 22)
                    path2, ticket2 = c._run(ccore.open_lane_call("io2"), 10)
                    # the lane opened above is the ring one (this process has the variable)
                    lanes = {"ring": lane, "sock": Lane(region2, path2, ticket2, ring=False)}
                    assert lanes["ring"].ring and not lanes["sock"].ring
                    # (the worker's stamps are by seq: the ring lane's from 2**40 on)
                    lanes["ring"]._seq = 1 << 40
                    try:
                        for r in rings:
                            ln = lanes[r]
                            i = sum(n.startswith(f"lane {r} ") for n in lane_runs) + 1
                            name = f"lane {r} #{i}"
                            spun0 = ln.spun, ln.slept
                            run = lane_run(ln, x, y_off, a.seconds, a.warmup, a.stamps,
                                           worker_pid)
                            run["spun"], run["slept"] = ln.spun - spun0[0], ln.slept - spun0[1]
                            run["spin_us"] = ln.spin_us
                            lane_runs[name] = run
                            if a.check:
                                y = np.array(ln.matmul("w", x, y_offset=y_off))
                                if ref is None:
                                    ref = reference(blocks, a.rows, a.k, x)
                                run["check"] = check(y[:, : ref.shape[1]], ref)
                    finally:
                        lanes["sock"].close()
                        region2.close()
                elif "lane" in paths:
                    has_spin = hasattr(lane, "spin_us")
                    spins = [float(s) for s in a.spins.split(",") if s] if has_spin else []
                    for spin in spins or [None]:
                        name = "lane" if spin is None else f"lane spin {spin:g}"
                        if name in lane_runs:  # a repeat (alternated spins)
                            name += f" #{sum(n.startswith(name) for n in lane_runs) + 1}"
                        if spin is not None:
                            lane.spin_us = spin
                        spun0 = getattr(lane, "spun", 0), getattr(lane, "slept", 0)
                        run = lane_run(lane, x, y_off, a.seconds, a.warmup, a.stamps,
                                       worker_pid)
                        if has_spin:
                            run["spun"] = lane.spun - spun0[0]
                            run["slept"] = lane.slept - spun0[1]
                        run["spin_us"] = getattr(lane, "spin_us", None)
                        lane_runs[name] = run
                        if a.check:
                            y = np.array(lane.matmul("w", x, y_offset=y_off))
                            if ref is None:
                                ref = reference(blocks, a.rows, a.k, x)
                            run["check"] = check(y[:, : ref.shape[1]], ref)
            st = c.status()
            results["device"] = st.device
    finally:
        worker.stop()
    ws = lane_stamps.load(str(stamp_file)) if a.stamps and stamp_file.exists() else None
    for name, run in lane_runs.items():
        results[name] = summarize(name, run, ws)
        results[name]["spin_us"] = run["spin_us"]
        if "check" in run:
            results[name]["check"] = run["check"]
            print(f"{'':17}check: y vs NumPy reference {run['check']}", flush=True)
    if rings:  # medians a variant, and the pairs (in order) the ring won
        by: dict[str, list[dict[str, Any]]] = {}
        for name, r in results.items():
            if name.startswith("lane "):
                by.setdefault(name.split()[1], []).append(r)
        for key in ("p50_us", "p50_minus_kernel_us", "p50_minus_device_us", "p99_us",
                    "p999_us"):
            med = {v: float(np.median([r[key] for r in rs])) for v, rs in by.items()}
            pairs = list(zip(by.get("sock", []), by.get("ring", []), strict=False))
            won = sum(r[key] < s_[key] for s_, r in pairs)
            print(f"rings {key:<20} " + "  ".join(f"{v} {m:7.1f}" for v, m in med.items())
                  + f"  (ring lower in {won} of {len(pairs)} runs paired in order)", flush=True)
            results[f"rings_{key}"] = med
    if a.json:
        a.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv,
                                      "label": a.label, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
