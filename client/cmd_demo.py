"""``q6serve demo``: the main job on the embedded default (CPU until a worker is started).

Builds a small model file with realistic Q6_K shapes, loads it into the best backend, runs
batched-decode matmuls at several N, checks every result against the NumPy reference and
prints one table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

EXAMPLE = """example:
  q6serve demo                    # synthetic 7B-shaped tensors, best backend
  q6serve demo --backend numpy --n 1 8 64"""

# Real 7B-class shapes (rows x K); the demo scales rows down by --scale to stay quick on a CPU.
SHAPES = {"blk.0.attn_v.weight": (512, 3584), "blk.0.ffn_down.weight": (3584, 18944)}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="quantize, load and serve a synthetic model; print a table",
                       description=__doc__, epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"))
    p.add_argument("--gguf", type=Path, help="use this GGUF file's Q6_K tensors instead")
    p.add_argument("--n", type=int, nargs="+", default=[1, 4, 16, 64], help="batch rows")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per cell")
    p.set_defaults(func=run)


def synthetic_model(path: Path, seed: int = 0) -> None:
    """Quantize a small real matrix, and fill the large shapes with random valid blocks."""
    from q6serve.kernels import q6k
    from q6serve.kernels.gguf_io import write_q6k_gguf
    from q6serve.kernels.quantize import quantize_q6_k

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (rows, k) in SHAPES.items():
        if rows * k <= 512 * 3584:
            w = (rng.standard_normal((rows, k)) * 0.02).astype(np.float32)
            tensors[name] = (quantize_q6_k(w), rows, k)
            continue
        n = rows * k // q6k.QK_K
        blocks = rng.integers(0, 256, (n, q6k.BLOCK_BYTES), dtype=np.uint8)
        d = rng.uniform(1e-4, 4e-4, n).astype(np.float16)
        blocks[:, 208:210] = d.view(np.uint8).reshape(n, 2)
        tensors[name] = (blocks, rows, k)
    write_q6k_gguf(path, tensors)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from q6serve.kernels.api import Layout
    from q6serve.kernels.backends import make_backend
    from q6serve.kernels.gguf_io import read_q6k_tensors
    from q6serve.kernels.reference import matmul_exact

    console = Console()
    backend = make_backend(args.backend)
    console.print(f"[bold]q6serve demo[/] on backend [cyan]{backend.name}[/] "
                  f"({backend.device_name()})")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.gguf or Path(tmp) / "demo.gguf"
        if args.gguf is None:
            t0 = time.perf_counter()
            synthetic_model(path)
            console.print(f"wrote synthetic model {path.name} in {time.perf_counter() - t0:.1f}s")
        table = Table(title="y = x · Wᵀ per call (median)")
        for col in ("weight", "rows x K", "N", "kernel", "ms", "GB/s Q6_K", "rel err", "ok"):
            table.add_column(col, justify="right" if col not in ("weight", "kernel") else "left")
        ok = True
        rng = np.random.default_rng(1)
        for t in read_q6k_tensors(path):
            w = backend.load(t.iter_row_chunks(64 << 20), t.rows, t.k, Layout.SOA)
            for n in args.n:
                x = rng.standard_normal((n, t.k)).astype(np.float32)
                times = []
                for _ in range(max(1, args.repeat)):
                    t0 = time.perf_counter()
                    res = backend.matmul(w, x)
                    times.append(time.perf_counter() - t0)
                ref = matmul_exact(x, t.aos, t.rows)
                err = float(np.linalg.norm(res.y - ref) / np.linalg.norm(ref))
                good = err <= 1e-5
                ok &= good
                med = float(np.median(times))
                table.add_row(t.name, f"{t.rows}x{t.k}", str(n), res.kernel, f"{med * 1e3:.1f}",
                              f"{t.nbytes / med / 1e9:.2f}", f"{err:.1e}",
                              "[green]yes[/]" if good else "[red]NO[/]")
            backend.free(w)
        console.print(table)
    console.print("[green]all results match the reference[/]" if ok
                  else "[red]some results differ from the reference[/]")
    return 0 if ok else 1
