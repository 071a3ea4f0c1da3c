"""The direct job's host path after a gap (issue 14 T1: why is ``device_other`` in the service
3x what ``CudaBackend.matmul`` costs around its kernel in bench/backend_wall.py?).

backend_wall.py calls back to back: the host thread, its caches and the GPU never rest. In
the service one caller's closed loop leaves a gap of a few hundred us between two jobs, in
which the loop's thread sleeps in epoll and gRPC's code runs. Here the job the worker runs on
its direct path (``launch_ieee`` + the wait, T1's call: ffn_down 3584x18944, N=1, f16 in and
out, f16 precision) is timed after a gap of GAP us spent:

  back    no gap (backend_wall.py's loop)
  spin    the thread busy-waiting (CPU awake and hot, the GPU idle)
  sleep   the thread asleep (time.sleep: the core may idle; the GPU idle)
  evict   asleep, then EVICT_MB of memory read (the caches cold, as after gRPC's and the
          servicer's code)

Per mode: p50 of the job's wall minus its kernel (``host``), of the launch part alone (host
enqueue: ``launch``) and of the wait part minus the kernel (``wait``).

    python bench/loop_gap.py [--gap 300] [--calls 400] [--modes back,spin,sleep,evict]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import KernelFlags, Layout, Precision, iter_aos_chunks, launch_ieee
from q6serve.kernels.cuda_backend import CudaBackend

MODES = ("back", "spin", "sleep", "evict")


def gap(mode: str, seconds: float, junk: np.ndarray) -> None:
    if mode == "spin":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    elif mode in ("sleep", "evict"):
        time.sleep(seconds)
        if mode == "evict":
            junk.sum()  # read through the whole buffer: the caches hold it, not the job's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="3584x18944", help="ROWSxK (default ffn_down)")
    ap.add_argument("--gap", type=float, default=300.0, help="us between jobs")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--evict-mb", type=float, default=32.0)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the modes")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    rows, k = map(int, a.shape.split("x"))
    be = CudaBackend(0)
    rng = np.random.default_rng(0)
    w = be.load(iter_aos_chunks(q6k.random_blocks(rows, k, rng), rows, k, 64 << 20), rows, k,
                Layout.SOA, 64 << 20)
    flags = KernelFlags(soa=True)
    xs = [rng.standard_normal((1, k)).astype(np.float16) for _ in range(4)]
    junk = np.ones(int(a.evict_mb * (1 << 20) / 8))
    got: dict[str, dict[str, list[float]]] = {m: {"host": [], "launch": [], "wait": []}
                                              for m in modes}
    for _ in range(a.rounds):
        for m in modes:
            for i in range(a.calls + 10):
                gap(m, a.gap * 1e-6, junk)
                x = xs[i % len(xs)]
                t0 = time.perf_counter()
                launched = launch_ieee(be, w, x, precision=Precision.F16, flags=flags,
                                       out_dtype=np.dtype(np.float16))
                t1 = time.perf_counter()
                res = launched.wait()
                t2 = time.perf_counter()
                ks = res.timing.seconds()
                if i < 10 or ks is None:  # warm-up: compile, bind, capture
                    continue
                got[m]["host"].append((t2 - t0 - ks) * 1e6)
                got[m]["launch"].append((t1 - t0) * 1e6)
                got[m]["wait"].append((t2 - t1 - ks) * 1e6)
    print(f"# {be.device_name()}  {time.strftime('%Y-%m-%d %H:%M')}  {rows}x{k} N=1 f16, gap "
          f"{a.gap:.0f} us, {a.calls} calls x {a.rounds} rounds per mode; p50 us")
    print(f"{'mode':>6} {'host':>7} {'launch':>7} {'wait':>7}")
    for m in modes:
        med = {p: statistics.median(v) for p, v in got[m].items()}
        print(f"{m:>6} {med['host']:7.1f} {med['launch']:7.1f} {med['wait']:7.1f}")
    be.free(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
