"""NumPy backend A/B: this tree's kernels/numpy_backend.py against a git revision's, alternated.

Run: ``python bench/ab/numpy_ab.py --base REV [--n 1 2 4 ...] [--repeat 9]``. Both backends
load the same random valid Q6_K weights (bench/numpy_backend.py's shapes); each repeat times
both, which one goes first swapping each repeat, so a loaded machine slows both alike. Prints
GB/s of Q6_K streamed (min and median over the repeats) and max |y_new - y_base| /
max |y_base| per (shape, N).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from numpy_backend import SHAPES, random_weight  # noqa: E402

from q6serve.kernels import numpy_backend as new  # noqa: E402
from q6serve.kernels.api import Layout  # noqa: E402


def load_base(rev: str, tmp: Path):
    src = subprocess.run(["git", "show", f"{rev}:kernels/numpy_backend.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    path = tmp / "numpy_backend_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("q6serve.kernels._numpy_backend_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up there
    spec.loader.exec_module(mod)  # its relative imports resolve in q6serve.kernels
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", required=True)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = load_base(args.base, Path(tmp))
    rng = np.random.default_rng(0)
    print(f"# base {args.base} vs this tree; GB/s min/median of {args.repeat}, alternated")
    for label, (rows, k) in SHAPES.items():
        blocks = random_weight(rng, rows, k)
        backends = {"base": old.NumpyBackend(), "new": new.NumpyBackend()}
        weights = {m: b.load([blocks], rows, k, Layout.SOA) for m, b in backends.items()}
        for n in args.n:
            x = rng.standard_normal((n, k)).astype(np.float32)
            ys = {m: b.matmul(weights[m], x).y for m, b in backends.items()}  # + warm-up
            diff = float(np.abs(ys["new"] - ys["base"]).max() / np.abs(ys["base"]).max())
            times: dict[str, list[float]] = {m: [] for m in backends}
            for i in range(args.repeat):
                # which one goes first swaps each repeat: the second slot measured faster
                # (same code in both slots) on the loaded 2-core VM
                for m, b in list(backends.items())[:: 1 if i % 2 else -1]:
                    t0 = time.perf_counter()
                    b.matmul(weights[m], x)
                    times[m].append(time.perf_counter() - t0)
            cells = [f"{m} {blocks.nbytes / min(t) / 1e9:.2f}/"
                     f"{blocks.nbytes / float(np.median(t)) / 1e9:.2f}"
                     for m, t in times.items()]
            print(f"{label:22s} N={n:3d}  {'  '.join(cells)}  rel diff {diff:.1e}", flush=True)
        for b in backends.values():
            b.close()


if __name__ == "__main__":
    main()
