"""NumPy backend throughput: Q6_K weight bytes streamed per second, N = 1..64.

Run: ``make bench-numpy`` (or ``python bench/numpy_backend.py --json``). Prints one row per
(shape, N): median seconds per matmul and GB/s of Q6_K weight consumed. The figure the
foundation issue asks for is the GB/s column; record it in bench/RESULTS.md with the date,
machine and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import Layout
from q6serve.kernels.numpy_backend import NumpyBackend

SHAPES = {"attn_v 512x3584": (512, 3584), "ffn_down 3584x18944": (3584, 18944)}


def random_weight(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    n = rows * k // q6k.QK_K
    blocks = rng.integers(0, 256, (n, q6k.BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 4e-4, n).astype(np.float16).view(np.uint8).reshape(
        n, 2)
    return blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    backend = NumpyBackend(threads=args.threads)
    rows_out = []
    for label, (rows, k) in SHAPES.items():
        blocks = random_weight(rng, rows, k)
        w = backend.load([blocks], rows, k, Layout.SOA)
        for n in args.n:
            x = rng.standard_normal((n, k)).astype(np.float32)
            backend.matmul(w, x)  # warm-up: workspaces, BLAS threads
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                backend.matmul(w, x)
                times.append(time.perf_counter() - t0)
            med = float(np.median(times))
            rows_out.append({"shape": label, "n": n, "seconds": med,
                             "gb_per_s": blocks.nbytes / med / 1e9})
        backend.free(w)
    backend.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "numpy": np.__version__, "threads": backend.threads, "commit": commit,
            "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows_out}, indent=1))
        return
    print(f"# NumPy backend, {meta}")
    print(f"{'shape':22s} {'N':>3s} {'ms':>9s} {'GB/s':>6s}")
    for r in rows_out:
        print(f"{r['shape']:22s} {r['n']:3d} {r['seconds'] * 1e3:9.2f} {r['gb_per_s']:6.2f}")


if __name__ == "__main__":
    main()
