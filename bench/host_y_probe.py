"""Where a large f32 y should be written: the device's y then a DMA, or the host's pinned y
directly by the kernel (issue 14 goal 1, session 21; run on a GPU).

The N=64 host wall on the tall weights (14336x4096: 3.7 MB of f32 y, 70 us of DMA against a
43 us kernel) is mostly y's way down after its kernels (row chunks and token halves overlap
part of it, for 20-36 us more of kernels). A kernel of one K slice (``ksplit`` 0: ``emit``
stores each y value once, no read-back) can store into page-locked host memory through its
device address instead: the stores cross the bus while the kernel runs. Whether that is faster
depends on what the SMs' 32-byte scattered stores get out of PCIe, which only the device says.

Per (shape, N), the table's own launch (path and shape from the dispatch), x on the device,
``--iters`` calls each way, alternated, GPU time between CUDA events on the stream (median):

- ``kernel``: the launch with y on the device (what the service reports as the kernel);
- ``dev+d2h``: the same, then y's DMA into pinned host memory (the unchunked service path);
- ``host``: the launch with y = the pinned block's device address (no DMA);
- ``dev+copyk``: the launch, then y moved by the launcher's copy kernel (16-byte stores) into
  the pinned block's device address;

each also as host wall (``perf_counter`` around the enqueue and the event's synchronize), and
each way's y compared bit for bit with ``dev+d2h``'s.

    python bench/host_y_probe.py [--shapes 14336x4096,18944x3584,4096x14336] [--ns 64,32]
                                 [--iters 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import KernelFlags, Layout, Precision, iter_aos_chunks
from q6serve.kernels.cuda.launch import IN_TYPES
from q6serve.kernels.cuda.storage import weight_data
from q6serve.kernels.cuda_backend import CudaBackend

WAYS = ("kernel", "dev+d2h", "host", "dev+copyk")
_D2H = 2  # cudaMemcpyDeviceToHost


def one_way(be: CudaBackend, steps_dev: list, steps_host: list, way: str, yd: int,
            yh_ptr: int, yh_dev: int, nbytes: int) -> tuple[float, float]:
    """One call the ``way`` given: (GPU span between events on the stream, host wall), us."""
    cp = be.ctx.cp
    stream = be.ctx.stream
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    t0 = time.perf_counter()
    ev0.record(stream)
    for s in (steps_host if way == "host" else steps_dev):
        s()
    if way == "dev+d2h":
        cp.cuda.runtime.memcpyAsync(yh_ptr, yd, nbytes, _D2H, stream.ptr)
    elif way == "dev+copyk":
        be.launcher._kernel_copy(yh_dev, yd, nbytes)
    ev1.record(stream)
    ev1.synchronize()
    wall = time.perf_counter() - t0
    return cp.cuda.get_elapsed_time(ev0, ev1) * 1e3, wall * 1e6


def probe(be: CudaBackend, rows: int, k: int, n: int, iters: int,
          rng: np.random.Generator) -> dict[str, Any]:
    cp = be.ctx.cp
    blocks = q6k.random_blocks(rows, k, rng)
    w = be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA, 64 << 20)
    try:
        cw = weight_data(w)
        c = be.choose(n, Precision.AUTO, KernelFlags(), rows, k)
        in_t = IN_TYPES[np.dtype(np.float16)]
        lc = be.launcher
        x = rng.standard_normal((n, k)).astype(np.float16)
        nbytes = 4 * n * rows
        pinned = cp.cuda.alloc_pinned_memory(nbytes)
        yh = np.frombuffer(pinned, np.float32, n * rows).reshape(n, rows)
        with be.ctx.dev, be.ctx.stream:
            xd = cp.asarray(x)
            yd = cp.empty((n, rows), cp.float32)
            lp = lc.plan(rows, k, w.layout, in_t, c.path, c.cfg, n, cw.pairs)
            yh_dev = lc.device_ptr(yh.ctypes.data)
            if yh_dev is None:
                raise SystemExit("no device address for the pinned y (cuMemHostGetDevicePointer)")
            steps_dev = lc.steps(lp, w, cw, int(xd.data.ptr), int(yd.data.ptr), n)
            steps_host = lc.steps(lp, w, cw, int(xd.data.ptr), yh_dev, n)
            got: dict[str, list[tuple[float, float]]] = {wy: [] for wy in WAYS}
            ys: dict[str, np.ndarray] = {}
            for i in range(iters + 3):  # the first 3 rounds warm up (kernel builds, clocks)
                for wy in WAYS:
                    yh.fill(np.nan)
                    r = one_way(be, steps_dev, steps_host, wy, int(yd.data.ptr),
                                yh.ctypes.data, yh_dev, nbytes)
                    if i >= 3:
                        got[wy].append(r)
                    if i == 0 and wy != "kernel":
                        ys[wy] = yh.copy()
        ref = ys["dev+d2h"]
        row: dict[str, Any] = {"shape": f"{rows}x{k}", "n": n, "path": c.path,
                               "cfg": c.cfg.label() if c.cfg is not None else "-",
                               "ksplit": lp.ks, "y_bytes": nbytes}
        for wy in WAYS:
            row[wy] = {"gpu_us": statistics.median(g for g, _ in got[wy]),
                       "wall_us": statistics.median(h for _, h in got[wy])}
            if wy in ys:
                row[wy]["equal"] = bool(np.array_equal(ys[wy], ref))
        return row
    finally:
        be.free(w)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="14336x4096,18944x3584,4096x14336")
    ap.add_argument("--ns", default="64,32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    be = CudaBackend(0)
    rng = np.random.default_rng(0)
    print(f"# device: {be.device_name()}  date: {time.strftime('%Y-%m-%d')}  x f16, y f32, "
          f"{a.iters} calls a way, alternated; us, median (gpu span / host wall)")
    print(f"{'shape':>12} {'N':>3} {'cfg':>18} ks " + " ".join(f"{w:>17}" for w in WAYS)
          + "  equal")
    rows_out = []
    bad = False
    for shape_s in a.shapes.split(","):
        rows, k = map(int, shape_s.split("x"))
        for n in map(int, a.ns.split(",")):
            r = probe(be, rows, k, n, a.iters, rng)
            rows_out.append(r)
            eq = {wy: r[wy].get("equal") for wy in WAYS if "equal" in r[wy]}
            bad |= not all(eq.values())
            print(f"{r['shape']:>12} {n:>3} {r['cfg']:>18} {r['ksplit']:>2} "
                  + " ".join(f"{r[wy]['gpu_us']:7.1f} / {r[wy]['wall_us']:7.1f}" for wy in WAYS)
                  + "  " + ",".join(f"{wy}={int(v)}" for wy, v in eq.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
