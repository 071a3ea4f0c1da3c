"""The top-k / log-sum-exp epilogue alone on the GPU (kernels/cuda_topk.py): CUDA-event time of
its kernels on y already on the device, one CTA per row (``rows``) against the column-chunk
split (``split``), per shape and k; medians over --iters calls after a warm-up.

    python bench/topk_epilogue.py [--iters 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SHAPES = [(64, 152064), (8, 152064), (1, 152064), (64, 128256), (64, 4096), (8, 18944)]


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    from q6serve.kernels import cuda_topk

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--ks", default="64,256")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    out = []
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    print(f"{'shape':>14} {'k':>4} {'rows us':>9} {'split us':>9} {'chunks':>6}  speed-up")
    for n, cols in SHAPES:
        y = cp.asarray((rng.standard_normal((n, cols)) * 4).astype(np.float32))
        for k in (int(v) for v in a.ks.split(",")):
            packed = cp.empty((n, 2 * k + 1), cp.int32)
            row: dict[str, float] = {}
            for path, min_chunk in (("rows", 1 << 40), ("split", cuda_topk.MIN_CHUNK)):
                saved = cuda_topk.MIN_CHUNK
                cuda_topk.MIN_CHUNK = min_chunk
                try:
                    with stream:
                        for _ in range(5):
                            cuda_topk._fused(cp, y, k, packed)
                        t = []
                        for _ in range(a.iters):
                            s, e = cp.cuda.Event(), cp.cuda.Event()
                            s.record(stream)
                            cuda_topk._fused(cp, y, k, packed)
                            e.record(stream)
                            e.synchronize()
                            t.append(cp.cuda.get_elapsed_time(s, e) * 1e3)
                    row[path] = float(np.median(t))
                finally:
                    cuda_topk.MIN_CHUNK = saved
            sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
            ch = cuda_topk.chunks_for(n, cols, k, sms)
            print(f"{n:>5}x{cols:<8} {k:>4} {row['rows']:>9.1f} {row['split']:>9.1f} {ch:>6}"
                  f"  {row['rows'] / row['split']:.2f}x")
            out.append({"n": n, "cols": cols, "k": k, "chunks": ch, **{f"{p}_us": v
                                                                         for p, v in row.items()}})
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
