"""CPU seconds per call of a --frontends worker's device process and of its front ends, under
T2-shaped load (many callers of N=1 on a tiny weight, so the kernel costs ~nothing and what is
measured is the serving path). On the H200, T2 through front ends ran at ~4-5k calls/s (issue
15): one device process doing the IPC, the batchers and the device thread is one core's worth
of Python, so its CPU per call sets that ceiling. CPU time (from /proc) is robust on a shared
machine where wall-clock figures are not.

    python bench/frontend_cpu.py --frontends 2 --seconds 4      # NumPy backend, ~15 s
    python bench/frontend_cpu.py --frontends 2 --lane           # the same callers on lanes
    # T3 through lanes: 8 hosts of N=64 on ffn_down, x and y in each caller's region
    python bench/frontend_cpu.py --backend cuda --rows 3584 --k 18944 --n 64 --lane \
        --frontends 4 --hosts 8 --callers 1
    python bench/frontend_cpu.py --proxy 4       # a front end's own path alone, 4 calls/stack
    # T2 on the GPU with the device process profiled: its counters (Q6SERVE_DP_STATS, see
    # service/frontends.py), per-thread CPU, py-spy (the worker runs under it) into DIR
    python bench/frontend_cpu.py --backend cuda --rows 3584 --k 18944 --frontends 8 \
        --hosts 8 --callers 8 --seconds 8 --profile DIR

``--proxy C`` measures, in this process and without gRPC, sockets or a device process, what
a front end itself does per call (``service/frontends.py``): EngineProxy.start_matmul of C
callers' N=1 calls, their stack into a slot and its request frame, then the device's answer
frame read by the link, each caller's future resolved with its rows of y and its sink run.
What the front end's gRPC, interceptor and servicer cost on top is in the full run's figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from service_load import LoadSpec, run_load

from q6serve.client.client import PRECISIONS
from service import WARM_NS, parts, random_q6k  # bench/ is sys.path[0]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def batches(metrics_url: str) -> tuple[float, float]:
    """(batches, rows) the worker has run so far, from its /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    got = dict(re.findall(r"^q6serve_batch_rows_(count|sum) (\S+)$", text, re.M))
    return float(got.get("count", 0)), float(got.get("sum", 0))


def kernel_cpu(n: int, rows: int, k: int, calls: int = 1000) -> float:
    """CPU seconds of one NumPy-backend matmul of the bench's weight at ``rows`` rows, in this
    process (``n`` rows of x, a ``rows`` x ``k`` weight): the part of the device process's CPU
    per batch that is the kernel, not serving (on the GPU the CUDA host path takes its place)."""

    from q6serve.kernels.api import Layout
    from q6serve.kernels.numpy_backend import NumpyBackend

    backend = NumpyBackend()
    w = backend.load([random_q6k(rows, k, 1).tobytes()], rows, k, Layout.SOA)
    x = np.ones((max(n, 1), k), np.float16)
    for _ in range(100):
        backend.matmul(w, x)
    best = float("inf")
    for _ in range(3):  # the least of three: other processes' load only adds
        t0 = time.process_time()
        for _ in range(calls):
            backend.matmul(w, x)
        best = min(best, (time.process_time() - t0) / calls)
    return best


def summarize_stats(path: Path, t0: float, t1: float) -> dict[str, Any]:
    """The device process's counters (``Q6SERVE_DP_STATS`` lines) over the wall-clock window
    [t0, t1]: deltas of the first and last lines inside it, per call and per second."""
    import json

    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    inside = [x for x in lines if t0 <= x["wall"] <= t1] or lines[-2:]
    a, b = inside[0], inside[-1]
    d = {k: v - a.get(k, 0) for k, v in b.items() if isinstance(v, int | float)}
    # calls: rows of plain matmul messages and of region matmuls (device calls)
    span = max(d["t"], 1e-9)
    calls = max(d.get("mm_rows", 0) + d.get("region_rows", 0), 1)
    threads = {k: (v - a["threads_cpu_s"].get(k, 0.0)) / span
               for k, v in b["threads_cpu_s"].items()}
    return {"window_s": span, "calls": calls, "calls_per_s": calls / span,
            "cpu_us_per_call": d["cpu_s"] / calls * 1e6, "cpu_share": d["cpu_s"] / span,
            "loop_busy_share": 1 - d.get("select_s", 0) / span,
            "loop_busy_us_per_call": (span - d.get("select_s", 0)) / calls * 1e6,
            "inline_wall_us_per_call": d.get("inline_jobs_wall_s", 0) / calls * 1e6,
            "inline_cpu_us_per_call": d.get("inline_jobs_cpu_s", 0) / calls * 1e6,
            "rows_per_batch": d.get("batch_rows", 0) / max(d.get("batches", 0), 1),
            "calls_per_message": calls / max(d.get("msg_mm", 0) + d.get("msg_rm", 0), 1),
            "messages_per_read": (d.get("msg_mm", 0) + d.get("msg_rm", 0))
            / max(d.get("socket_reads", 0), 1),
            "per_call": {k: d.get(k, 0) / calls for k in (
                "loop_iterations", "wakeups", "socket_reads", "socket_writes", "msg_mm",
                "msg_rm", "call_region_matmul",
                "batches", "inline_jobs", "direct_jobs", "deferred_jobs", "merged_requests",
                "merged_calls",
                "voluntary_ctxt_switches",
                "nonvoluntary_ctxt_switches")},
            "threads_cpu_share": {k: v for k, v in sorted(threads.items()) if v > 0.005},
            # each front end's calls a second (by pid; the counters' window)
            "front_calls_per_s": {int(k.rsplit("_", 1)[1]): v / span
                                  for k, v in d.items() if k.startswith("front_rows_")}}


def print_stats(s: dict[str, Any]) -> None:
    print(f"# device process over {s['window_s']:.1f} s: {s['calls_per_s']:,.0f} calls/s, "
          f"CPU {s['cpu_share'] * 100:.0f}% = {s['cpu_us_per_call']:.1f} us/call; loop busy "
          f"(not in epoll) {s['loop_busy_share'] * 100:.0f}% = "
          f"{s['loop_busy_us_per_call']:.1f} us/call, of which inline jobs "
          f"{s['inline_wall_us_per_call']:.1f} us wall / {s['inline_cpu_us_per_call']:.1f} us "
          f"CPU; {s['rows_per_batch']:.1f} rows/batch, {s['calls_per_message']:.2f} "
          f"calls/message, {s['messages_per_read']:.2f} messages/read", flush=True)
    print("#   per call: " + ", ".join(f"{k} {v:.3f}" for k, v in s["per_call"].items()))
    print("#   threads (share of a core): " + ", ".join(
        f"{k} {v * 100:.0f}%" for k, v in s["threads_cpu_share"].items()), flush=True)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def front_sockets(port: int, pids: list[int]) -> dict[int, set[str]]:
    """The established TCP connections to ``port`` that each of ``pids`` holds (its accepted
    sockets' inodes: /proc/net/tcp{,6}, matched to the process's fds). SO_REUSEPORT's hash
    decides which front end takes a connection; in a closed loop a front end's callers wait
    in proportion to their count when its CPU is the limit (issue 15, session 9)."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f[9])
    got: dict[int, set[str]] = {}
    for p in pids:
        mine = got[p] = set()
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        mine.add(link[8:-1])
    return got


def bytes_sent(port: int) -> dict[str, int]:
    """Bytes sent so far on each established connection from ``port``, by socket inode (`ss`'s
    tcp_info; {} without `ss`): a front end's are its gRPC replies, so their rate over the
    reply's size is its calls a second."""
    try:
        out = subprocess.run(["ss", "-tieH", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    got, ino = {}, None
    for tok in out.split():
        if tok.startswith("ino:"):
            ino = tok[4:]
        elif tok.startswith("bytes_sent:") and ino is not None:
            got[ino] = int(tok[11:])
    return got


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine so far (/proc/stat's cpu line)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return sum(v) - idle, sum(v)


def cpu_snapshot(pids: list[int]) -> dict[int, float]:
    """CPU seconds of each of ``pids`` still alive."""
    got = {}
    for p in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            got[p] = cpu_seconds(p)
    return got


class CpuWindow(threading.Thread):
    """Per-process CPU shares (of one core) over a window in the middle of a load's timed
    part: the device process, each front end, each load process (this process's children but
    the worker) and the whole machine (busy share of all cores). It snapshots every 0.1 s from
    its start; :meth:`shares` picks the snapshots inside [t0, t1] (perf_counter) once known.
    ``port``: also each front end's connections to it (:func:`front_sockets`) and the bytes
    sent on them (:func:`bytes_sent`), every 0.2 s."""

    def __init__(self, device: int, fronts: list[int], skip: set[int], port: int = 0) -> None:
        super().__init__(daemon=True)
        self.device, self.fronts, self.skip, self.port = device, fronts, skip, port
        self.snaps: list[tuple[float, dict[int, float], tuple[int, int]]] = []
        # (time, each front end's connections, bytes sent on each connection by inode)
        self.conns: list[tuple[float, dict[int, set[str]], dict[str, int]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            load = [p for p in children(os.getpid()) if p not in self.skip]
            pids = [self.device, *self.fronts, *load]
            self.snaps.append((time.perf_counter(), cpu_snapshot(pids), machine_jiffies()))
            if self.port and i % 2 == 0:
                self.conns.append((time.perf_counter(), front_sockets(self.port, self.fronts),
                                   bytes_sent(self.port)))
            i += 1
            self.stop.wait(0.1)

    def shares(self, t0: float, t1: float) -> dict[str, Any]:
        self.stop.set()
        self.join(5)
        at = [i for i, s in enumerate(self.snaps) if t0 <= s[0] <= t1]
        if len(at) < 2:
            return {}
        (ta, a, ja), (tb, b, jb) = self.snaps[at[0]], self.snaps[at[-1]]
        span = tb - ta
        share = {p: (b[p] - a[p]) / span for p in b if p in a}
        load = sorted((v for p, v in share.items()
                       if p != self.device and p not in self.fronts and v > 0.02),
                      reverse=True)  # (the resource tracker and the like: ~0)
        fronts = sorted((share.get(p, 0.0) for p in self.fronts), reverse=True)
        cores = os.cpu_count() or 1
        # the callers' connections are open through the timed part: the window's fullest
        # look; each front end's bytes sent: from the window's first look to its last
        looks = [c for c in self.conns if t0 <= c[0] <= t1]
        socks = max((c[1] for c in looks), default=None,
                    key=lambda c: sum(len(v) for v in c.values()))
        rate: dict[int, float] = {}
        if len(looks) >= 2 and looks[0][2] and looks[-1][2]:
            (ca, _, sa), (cb, _, sb) = looks[0], looks[-1]
            for p, inos in (socks or {}).items():
                rate[p] = sum(sb.get(i, 0) - sa.get(i, 0) for i in inos) / (cb - ca)
        # each front end (by pid): its share of a core, its connections (the load
        # processes' own channels, idle in the timed part, are among them), bytes sent/s
        per_front = {p: {"cores": share.get(p, 0.0),
                         "conns": len(socks.get(p, ())) if socks else None,
                         "bytes_out_per_s": rate.get(p)}
                     for p in self.fronts}
        return {"window_s": span, "device": share.get(self.device, 0.0), "fronts": fronts,
                "per_front": per_front,
                "load": load, "machine_busy_cores": (jb[0] - ja[0]) / max(jb[1] - ja[1], 1)
                * cores}


def cpu_line(c: dict[str, Any]) -> str:
    """One line of CpuWindow.shares: cores of each part (1.00 = one core saturated)."""
    if not c:
        return "cpu: no window"
    f, ld = c["fronts"], c["load"]
    return (f"cpu (cores, {c['window_s']:.1f} s): device {c['device']:.2f}; front ends "
            f"sum {sum(f):.2f} max {max(f, default=0):.2f} min {min(f, default=0):.2f}; "
            f"load x{len(ld)} sum {sum(ld):.2f} max {max(ld, default=0):.2f}; "
            f"machine {c['machine_busy_cores']:.1f} of {os.cpu_count()}")


def per_front_line(c: dict[str, Any], calls_per_s: dict[int, float] | None = None,
                   reply_bytes: float = 0.0) -> str:
    """Each front end, busiest first: connections, cores and its calls a second (the device
    process's counters, ``calls_per_s``, or its bytes sent over ``reply_bytes``, marked
    ~), and the mean time of its callers' calls by Little's law (a closed loop, one call in
    flight a caller: connections / calls a second; each load process's own channel, idle in
    the timed part, is among the connections, so this is a little over)."""
    rows = []
    for pid, f in sorted(c["per_front"].items(), key=lambda kv: -kv[1]["cores"]):
        row = f"{f['conns']} conns {f['cores']:.2f} cores"
        r, approx = (calls_per_s or {}).get(pid), ""
        if r is None and reply_bytes and f.get("bytes_out_per_s"):
            r, approx = f["bytes_out_per_s"] / reply_bytes, "~"
        if r:
            row += f" {approx}{r:,.0f}/s"
            if f["conns"]:
                row += f" {f['conns'] / r * 1e3:.2f} ms"
        rows.append(row)
    return "per front end: " + "; ".join(rows)


def _lane_host(target: str, callers: int, seconds: float, warmup: float, n: int, k: int,
               rows: int, idx: int, out: Any, cuda: bool = False) -> None:
    """One load process of --lane: ``callers`` threads, each on its own region and lane, x of
    ``n`` x ``k`` f16 copied into the region every call (as a host producing it would), y f32
    read as the region's view; puts (calls, seconds, latencies) of the timed window.
    ``cuda`` (--region cuda): each caller's region is its device buffer on the worker's GPU
    (CUDA IPC), x written there once (a producer on the GPU leaves it there: no copy a call),
    y f32 left there (the reply's device view, not read)."""
    import threading

    from q6serve.client.client import Client

    counts = [0] * callers
    rings = [False] * callers  # (each lane: over its ring, or the socket)
    lat: list[list[float]] = [[] for _ in range(callers)]
    kern: list[list[float]] = [[] for _ in range(callers)]  # the replies' kernel seconds
    start = threading.Barrier(callers)
    xb = -(-n * k * 2 // 4096) * 4096
    size = xb + n * rows * 4 + 4096

    def caller(i: int) -> None:
        with Client(target) as c, (c.register_cuda_ipc(f"lane{idx}_{i}", size) if cuda else
                                   c.register_shm(f"lane{idx}_{i}", size)) as region, \
                c.open_lane(region) as lane:
            rings[i] = lane.ring
            x: Any = np.ones((n, k), np.float16)
            if cuda:
                import cupy

                region.ndarray(0, np.float16, (n, k)).set(x)
                cupy.cuda.get_current_stream().synchronize()
                x = None  # (in the region already: the record names its shape and dtype)
            start.wait()
            t0 = time.perf_counter() + warmup
            end = t0 + seconds
            while (t := time.perf_counter()) < end:
                lane.matmul("w", x, shape=(n, k), dtype=np.float16, y_offset=xb,
                            precision="f16")  # (as bench/service.py)
                if t >= t0:
                    counts[i] += 1
                    lat[i].append(time.perf_counter() - t)
                    kern[i].append(lane.last.kernel_seconds or np.nan)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((sum(counts), seconds, [v for li in lat for v in li],
             [v for li in kern for v in li], sum(rings)))


def _lane_load(target: str, hosts: int, callers: int, seconds: float, warmup: float, n: int,
               k: int, rows: int, cuda: bool = False,
               ) -> tuple[int, float, np.ndarray, np.ndarray, int]:
    """(calls in the timed window, its seconds, latencies, the replies' kernel seconds, the
    lanes over a ring) of ``hosts`` load processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_lane_host,
                         args=(target, callers, seconds, warmup, n, k, rows, i, q, cuda))
             for i in range(hosts)]
    for p in procs:
        p.start()
    got = [q.get(timeout=seconds + warmup + 120) for _ in procs]
    for p in procs:
        p.join(30)
    return (sum(g[0] for g in got), seconds, np.array([v for g in got for v in g[2]]),
            np.array([v for g in got for v in g[3]]), sum(g[4] for g in got))


def proxy_cpu(callers: int, calls: int = 20000) -> float:
    """CPU seconds per call of a front end's own path (module docstring: ``--proxy``)."""
    import asyncio
    import struct

    from q6serve.service import frontends_ipc as ipc
    from q6serve.service import frontends_proxy as fe
    from q6serve.service.engine_types import MatmulCall
    from q6serve.service.frontends_arena import Arena

    class Transport:  # what the link writes to: kept for the device's side of the bench
        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, b: bytes) -> None:
            self.data += b

        def is_closing(self) -> bool:
            return False

    async def run() -> float:
        arena = Arena.create(8, 1 << 16)
        arena.unlink()
        link, out = fe._Link(arena), Transport()
        link.connection_made(out)  # type: ignore[arg-type]
        proxy = fe.EngineProxy(link)
        x = np.ones((1, 256), np.float16)
        told = []

        async def stack() -> None:
            futs = [proxy.start_matmul(MatmulCall("w", x), told.append)
                    for _ in range(callers)]
            while not out.data:  # the proxy's flush
                await asyncio.sleep(0)
            (n,) = ipc.FRAME.unpack_from(out.data)
            msg = ipc._decode(bytes(out.data[8 : 8 + n]))
            out.data.clear()
            rows, slot = msg[8][1][0], msg[9]
            arena.array(slot, np.dtype("<f2"), (rows, 16), writable=True)[...] = 1
            answer = ipc._encode(("mmok", msg[1], ("numpy", "soa", "q8_1", 1e-4, 1e-5, rows,
                                                  1, 2e-5, None), [(0, "f16", (rows, 16))]))
            link.data_received(struct.pack("<Q", len(answer)) + answer)
            if len(told) < callers:  # sinks run as done callbacks (before 2026-12-01)
                await asyncio.sleep(0)
            assert all(f.done() for f in futs) and len(told) == callers
            told.clear()

        for _ in range(200):
            await stack()
        best = float("inf")
        for _ in range(3):  # the least of three: other processes' load only adds
            t0 = time.process_time()
            for _ in range(calls // callers):
                await stack()
            best = min(best, (time.process_time() - t0) / (calls // callers * callers))
        arena.close()
        return best

    return asyncio.run(run())


def one_load(a: argparse.Namespace, target: str, metrics_url: str, spawned: int,
             worker_pid: int, fronts: list[int], hosts: int, callers: int,
             stats: Path | None) -> dict[str, Any]:
    """One closed-loop load of ``hosts`` processes x ``callers`` on the running worker: calls/s,
    rows/s, latency, CPU per call of the device process and the front ends over the whole load
    (set-up and warm-up included), and each process's share of a core in the timed window's
    middle (:class:`CpuWindow`: who saturates)."""
    spec = LoadSpec(target, (("w", a.k),), callers, a.n, a.seconds, a.warmup, "stream",
                    "f16", PRECISIONS[a.precision], 0, a.region, a.rows, True)
    window = CpuWindow(worker_pid, fronts, {spawned, worker_pid}, int(target.rsplit(":", 1)[1]))
    window.start()
    t_load = time.time()
    before = {p: cpu_seconds(p) for p in [worker_pid, *fronts]}
    b0, r0 = batches(metrics_url)
    means: dict[str, float] = {}
    tail: dict[str, float] = {}
    reply_bytes = 0.0
    part_p99: dict[str, float] = {}
    kernel_p50 = float("nan")  # (--lane: the replies' kernel p50, as bench/service.py's T3)
    ring_lanes = -1  # (--lane: how many of the lanes went over their ring)
    if a.lane:  # calls/s of the timed window; CPU includes the setup and the warm-up
        calls, wall, lat, kern, ring_lanes = _lane_load(target, hosts, callers, a.seconds,
                                                        a.warmup, a.n, a.k, a.rows,
                                                        a.region == "cuda")
        if np.isfinite(kern).any():
            kernel_p50 = float(np.nanpercentile(kern, 50))
    else:
        samples, wall = run_load(spec, hosts)  # the warm-up's CPU is in too (~1/9)
        reply_bytes = float(np.mean(samples["w"]["reply_bytes"]))
        lat = samples["w"]["e2e"]
        calls = int(lat.size)
        by_part = parts(samples["w"])
        means = {k: float(np.mean(v) * 1e6) for k, v in by_part.items()}
        # what the tail is made of: the slowest 1% of calls' parts (mean), each part's p99
        slow = lat >= np.percentile(lat, 99)
        tail = {k: float(np.mean(v[slow]) * 1e6) for k, v in by_part.items()}
        tail["batch_rows"] = float(np.mean(samples["w"]["batch_rows"][slow]))
        part_p99 = {k: float(np.percentile(v, 99) * 1e6) for k, v in by_part.items()}
    t_ret = time.perf_counter()
    # the timed part ended just before run_load returned: its middle 70%
    cpu = window.shares(t_ret - 0.85 * wall - 0.1, t_ret - 0.15 * wall - 0.1)
    p50, p99 = np.percentile(lat, (50, 99)) * 1e6
    used = {p: cpu_seconds(p) - t for p, t in before.items()}
    t_end = time.time()
    b1, r1 = batches(metrics_url)
    path = ("lane" + ("/cuda" if a.region == "cuda" else "")) if a.lane else a.region or "bytes"
    n_batches = max(b1 - b0, 1.0)
    kernel = (kernel_cpu(round((r1 - r0) / n_batches), a.rows, a.k) * n_batches / calls
              if a.backend == "numpy" else 0.0)
    device = used[worker_pid] / calls
    # the device process's cores in the timed window's middle over its calls a second: its
    # CPU per call without the set-up and warm-up that ``device`` includes (--lane: all of
    # the lane's set-up, regions page-locked, is in that one)
    window = cpu["device"] / (calls / wall) if cpu and calls else float("nan")
    print(f"frontends={a.frontends} {path} load {hosts}x{callers}: {calls} calls, "
          f"{calls / wall:,.0f}/s; CPU per call: device process {device * 1e6:.0f} us "
          f"(in the window {window * 1e6:.0f}; "
          f"NumPy kernel {kernel * 1e6:.0f}, the rest {(device - kernel) * 1e6:.0f}), "
          f"front ends {sum(used[p] for p in fronts) / calls * 1e6:.0f} us; "
          f"{b1 - b0:.0f} batches of {(r1 - r0) / n_batches:.1f} rows; latency p50 "
          f"{p50:,.0f} us, p99 {p99:,.0f} us; {calls * a.n / wall:,.0f} rows/s"
          + (f"; ring lanes {ring_lanes} of {hosts * callers}" if ring_lanes >= 0 else ""),
          flush=True)
    if np.isfinite(kernel_p50):  # T3's fraction as bench/service.py counts it
        print(f"#   kernel p50 {kernel_p50 * 1e6:.1f} us: the kernel alone "
              f"{a.n / kernel_p50:,.0f} rows/s, this load {calls * kernel_p50 / wall:.3f} of it",
              flush=True)
    print("#   " + cpu_line(cpu), flush=True)
    if cpu:
        print("#   " + per_front_line(cpu, reply_bytes=reply_bytes), flush=True)
    if means:
        print("#   mean us: " + ", ".join(f"{k} {v:.0f}" for k, v in means.items()), flush=True)
        print("#   slowest 1% mean us: " + ", ".join(f"{k} {v:.0f}" for k, v in tail.items()),
              flush=True)
        print("#   p99 of each part us: " + ", ".join(f"{k} {v:.0f}"
                                                      for k, v in part_p99.items()), flush=True)
    result: dict[str, Any] = {
        "backend": a.backend, "frontends": a.frontends, "path": path, "hosts": hosts,
        "ring_lanes": ring_lanes,
        "callers": callers, "calls": calls, "calls_per_s": calls / wall,
        "device_cpu_us_per_call": device * 1e6, "device_window_cpu_us_per_call": window * 1e6,
        "frontends_cpu_us_per_call": sum(used[p] for p in fronts) / calls * 1e6,
        "rows_per_batch": (r1 - r0) / n_batches, "worker_args": a.worker_arg,
        "p50_us": p50, "p99_us": p99, "rows_per_s": calls * a.n / wall, "cpu": cpu,
        "parts_mean_us": means, "tail_mean_us": tail if means else {},
        "reply_bytes": reply_bytes, "kernel_p50_us": kernel_p50 * 1e6,
        # of the kernel alone (its p50 in these replies), as bench/service.py's T3 fraction
        "kernel_fraction": calls * kernel_p50 / wall,
        "parts_p99_us": part_p99 if means else {},
        "env": {k: v for k, v in os.environ.items() if k.startswith("Q6SERVE_")}}
    if stats is not None and stats.exists():  # (written by a --frontends device process)
        time.sleep(1.2)  # the counters' next line
        result["device"] = summarize_stats(stats, t_load + a.warmup, t_end)
        print_stats(result["device"])
        if cpu:
            print("#   " + per_front_line(cpu, result["device"]["front_calls_per_s"]),
                  flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--hosts", type=int, default=2, help="load processes")
    ap.add_argument("--callers", type=int, default=16, help="callers per load process")
    ap.add_argument("--region", default="", choices=("", "system", "cuda"),
                    help="x and y through each caller's region (default: bytes); cuda: only "
                         "with --lane (each caller's device buffer by CUDA IPC, x written once)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rows", type=int, default=16,
                    help="the weight's rows: more make each batch's kernel longer, so requests "
                         "queue behind a busy device as on the GPU under load")
    ap.add_argument("--k", type=int, default=256, help="the weight's K (a multiple of 256)")
    ap.add_argument("--n", type=int, default=1,
                    help="rows per call (T2: 1; T3-shaped: 64 with --hosts 8 --callers 1)")
    ap.add_argument("--lane", action="store_true",
                    help="the callers use the fast lane (a thread, region and lane each; x of "
                         "--n x --k f16, y f32 in the region)")
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="one more argument of the worker (repeat), e.g. "
                         "--worker-arg=--inline-device-us=0")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="profile the device process into DIR: its counters "
                         "(Q6SERVE_DP_STATS), per-thread CPU (top -H) and nvidia-smi mid-load, "
                         "and py-spy (the "
                         "worker runs under `py-spy record`, PYSPY: its path, PYSPY_ARGS: more "
                         "arguments)")
    ap.add_argument("--loads", default="",
                    help="several loads on one worker, HOSTSxCALLERS each (e.g. 8x8,4x16): "
                         "one row each (default: --hosts x --callers)")
    ap.add_argument("--precision", default="auto", choices=tuple(PRECISIONS),
                    help="the calls' precision (bench/service.py's T2: f16)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--proxy", type=int, default=0, metavar="C",
                    help="measure only a front end's own path, C calls per stack, in this "
                         "process (see above); no worker is started")
    a = ap.parse_args(argv)
    if a.region == "cuda" and not (a.lane and a.backend == "cuda"):
        ap.error("--region cuda: with --lane and --backend cuda (bytes and front ends' "
                 "CUDA regions: bench/service.py --cuda-regions)")
    try:
        a.loads = [tuple(int(v) for v in x.split("x")) for x in a.loads.split(",") if x] or [
            (a.hosts, a.callers)]
        assert all(len(x) == 2 and min(x) >= 1 for x in a.loads)
    except (ValueError, AssertionError):
        ap.error(f"--loads {a.loads!r}: HOSTSxCALLERS[,HOSTSxCALLERS...], each >= 1")
    if a.proxy:
        print(f"front end's own path, {a.proxy} calls/stack: "
              f"{proxy_cpu(a.proxy) * 1e6:.1f} us CPU per call", flush=True)
        return 0
    from q6serve.client.client import Client

    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"frontend_cpu_{os.getpid()}.log"
    cmd = [sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0", "--backend",
           a.backend, "--allow-shm", "--max-regions", "1024", "--metrics-port", "0",
           *a.worker_arg]
    if a.frontends > 1:
        cmd += ["--frontends", str(a.frontends)]
    env = dict(os.environ)
    stats = None
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
        stats = a.profile / "dpstats.jsonl"
        stats.unlink(missing_ok=True)
        env["Q6SERVE_DP_STATS"] = str(stats)
        if spy := os.environ.get("PYSPY"):  # the worker under py-spy: it may ptrace its child
            cmd = [spy, "record", "-o", str(a.profile / "pyspy.txt"), "-f", "raw",
                   *os.environ.get("PYSPY_ARGS", "").split(), "--", *cmd]
    with open(log, "w") as out:
        worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    worker_pid = worker.pid
    try:
        end = time.monotonic() + 120
        while not (m := re.search(r"listening on (\S+:\d+)", log.read_text())):
            if worker.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        target = m.group(1)
        while not (mp := re.search(r"metrics on (http://\S+)", log.read_text())):
            time.sleep(0.05)
        metrics_url = mp.group(1)
        with Client(target) as c:
            c.upload("w", random_q6k(a.rows, a.k, 1), a.rows, a.k)
            for m in sorted({a.n, *WARM_NS}):  # kernels load on first use, never in a run
                c.matmul_full("w", np.ones((m, a.k), np.float16), precision=a.precision,
                              timeout=600.0)
        if a.profile and os.environ.get("PYSPY"):
            worker_pid = children(worker.pid)[0]  # py-spy's child
        else:
            worker_pid = worker.pid
        fronts = children(worker_pid)
        if a.profile:  # mid-load: per-thread CPU of the device process, the GPU's state
            side = subprocess.Popen(
                ["bash", "-c", f"sleep {a.warmup + a.seconds / 2:.1f}; "
                 f"top -H -b -d 1 -n 2 -w 200 -p {worker_pid} > {a.profile}/top_threads.txt; "
                 f"top -b -d 1 -n 2 -w 200 > {a.profile}/top.txt; "
                 f"nvidia-smi > {a.profile}/nvidia_smi.txt 2>&1"])
        results = []
        for hosts, callers in a.loads:
            results.append(one_load(a, target, metrics_url, worker.pid, worker_pid, fronts,
                                    hosts, callers, stats))
        if a.profile:
            side.wait(30)
        if a.json:
            import json

            a.json.write_text(json.dumps(results[0] if len(results) == 1 else results,
                                         indent=1))
    finally:
        os.kill(worker_pid, signal.SIGTERM)  # (under py-spy: it writes its profile when the
        worker.wait(60)  # worker exits)
        if a.profile:
            log_copy = a.profile / "worker.log"
            log_copy.write_text(log.read_text())
        log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
