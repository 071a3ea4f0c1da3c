"""The top-k / log-sum-exp epilogue alone on the GPU (kernels/cuda_topk.py): CUDA-event time of
its kernels on y already on the device, per shape and k: the group form (q6_topk_scan +
q6_topk_pick, with the scan's share; the split form it was measured against left the product in
session 14, its figures stay in bench/RESULTS.md); medians over --iters calls after a warm-up.
Each timed call is queued behind a spinning kernel, so the events time the device's work and
not the host's launches (a GPU idle between the start event and a late launch counted that
gap). ``warm``: the same y again and again (it stays in L2 when it fits, as a y the matmul just
wrote partly does); ``cold``: L2 refilled before each call by reading 256 MiB of other data
(clean lines: a memset's dirty lines slowed y's reads by their write-back).

    python bench/topk_epilogue.py [--iters 50] [--ks 64,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = [(64, 152064), (8, 152064), (1, 152064), (64, 128256), (8, 128256), (1, 128256),
          (64, 4096), (8, 18944), (256, 152064)]
SPIN_CYCLES = 400_000  # ~0.2 ms at H200 clocks: longer than the host's launches of one call
_AUX = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
extern "C" __global__ void flush_read(const float4* p, long long n, float* sink) {
    float s = 0.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float4 q = p[i];
        s += q.x + q.y + q.z + q.w;
    }
    if (s == 1.2345f) *sink = s;
}
"""


class _Marked:
    """A module whose q6_topk_scan* launches record ``event`` right after themselves."""

    def __init__(self, mod: Any, event: Any, stream: Any):
        self.mod, self.event, self.stream = mod, event, stream

    def function(self, name: str) -> Any:
        f = self.mod.function(name)
        if not name.startswith("q6_topk_scan"):
            return f

        def launch(*a: Any) -> None:
            f(*a)
            self.event.record(self.stream)

        return launch


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    from q6serve.kernels import cuda_topk
    from q6serve.kernels.cuda import loader

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ks", default="64,256")
    ap.add_argument("--shapes", default=",".join(f"{n}x{c}" for n, c in SHAPES))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    out = []
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    flush = cp.ones((256 << 20) // 4, cp.float32)
    sink = cp.zeros(1, cp.float32)
    aux = cp.RawModule(code=_AUX)
    spin, flush_read = aux.get_function("spin"), aux.get_function("flush_read")
    mod = loader.load(cuda_topk.TOPK_FILE, (), 0)
    print(f"{'shape':>14} {'k':>4} {'groups warm':>11} {'(scan)':>7} {'groups cold':>11} "
          f"{'(scan)':>7}")
    for shape in a.shapes.split(","):
        n, cols = (int(v) for v in shape.split("x"))
        y = cp.asarray((rng.standard_normal((n, cols)) * 4).astype(np.float32))
        # the upload is on the legacy stream, which `stream` (non-blocking) does not wait for,
        # and a pageable copy returns before its DMA ends: the 156 MB y of 256 x 152064 was
        # still arriving while the first calls read it (an illegal address in two runs)
        cp.cuda.Device().synchronize()
        for k in (int(v) for v in a.ks.split(",")):
            packed = cp.empty((n, 2 * k + 1), cp.int32)
            row: dict[str, float] = {}
            for cold in (False, True):
                with stream:
                    for _ in range(5):
                        cuda_topk._fused(cp, y, k, packed)
                    t, scan = [], []
                    for _ in range(a.iters):
                        if cold:
                            flush_read((1056,), (256,), (flush, np.int64(flush.size // 4),
                                                         sink))
                        spin((1,), (1,), (np.int64(SPIN_CYCLES),))
                        s, m, e = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
                        s.record(stream)
                        cuda_topk._groups(cp, _Marked(mod, m, stream), y, n, cols, k, packed)
                        e.record(stream)
                        e.synchronize()
                        t.append(cp.cuda.get_elapsed_time(s, e) * 1e3)
                        scan.append(cp.cuda.get_elapsed_time(s, m) * 1e3)
                tag = "cold" if cold else "warm"
                row[f"groups_{tag}_us"] = float(np.median(t))
                row[f"scan_{tag}_us"] = float(np.median(scan))
            print(f"{n:>5}x{cols:<8} {k:>4} {row['groups_warm_us']:>11.1f} "
                  f"{row['scan_warm_us']:>7.1f} {row['groups_cold_us']:>11.1f} "
                  f"{row['scan_cold_us']:>7.1f}")
            out.append({"n": n, "cols": cols, "k": k, **row})
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
