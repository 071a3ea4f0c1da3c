"""What resident slab size costs the kernels: AUTO's kernel time with weights in the default
slabs (``storage.SLAB_BYTES``, 64 MB) against slabs of R rows, in one process (run on a GPU).

Row chunks of a large y (kernels/cuda/launch.py point 8, ``Q6SERVE_Y_CHUNKS``) need a weight
of several slabs; this measures whether smaller slabs slow the plain kernel. Per shape, each
slab setting gets its own resident copies (rotated, as bench/kernels.py, so the L2 cannot serve
the weight); per N the settings are timed in turn, ``--rounds`` times (CUDA events around each
call, bench/kernels.py's ``time_calls``: median of ``--iters``). Prints per (shape, N) each
setting's median over the rounds and its ratio to the first.

    python bench/slab_ab.py [--shapes 4096x14336,...] [--ns 1,8,64] [--slab-rows 0,512]
                            [--rounds 3] [--iters 30] [--json out.json]

``--slab-rows``: per setting, 0 storage's default (``SLAB_BYTES``, 64 MB), R slabs of R rows, or
``pP`` the weight in P slabs (ceil(rows / P) rows each, e.g. ``0,p2``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import numpy as np
from backend_wall import load  # bench/ is sys.path[0]: the weight in slabs of R rows

from q6serve.kernels import q6k
from q6serve.kernels.api import DEFAULT_FLAGS, Precision
from q6serve.kernels.cuda.launch import MATMUL_FILE, kernel_file, kernel_name
from q6serve.kernels.cuda_backend import CudaBackend

SHAPES = "4096x14336,14336x4096,18944x3584,3584x18944,152064x3584,3584x3584"
L2_BYTES = 60e6


def slab_rows(setting: str, rows: int) -> int:
    """A ``--slab-rows`` setting's rows a slab for a weight of ``rows`` (0: the default)."""
    if setting.startswith("p"):
        return -(-rows // int(setting[1:]))
    return int(setting)


def caller(be: CudaBackend, ws: list, xd: object, c: object):
    """``fn(i)``: AUTO's kernel on copy ``i`` of ``ws`` (enqueued, no sync)."""
    return lambda i: be.run(ws[i], xd, np.float16, c.path, c.cfg)


def main(argv: list[str] | None = None) -> int:
    import cupy as cp

    sys.path.insert(0, "bench")
    from kernels import time_calls  # bench/kernels.py's (this script's folder)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ns", default="1,8,64")
    ap.add_argument("--slab-rows", default="0,512",
                    help="settings: 0 storage's SLAB_BYTES, R rows a slab, pP P slabs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    be = CudaBackend(0)
    settings = a.slab_rows.split(",")
    ns = [int(v) for v in a.ns.split(",")]
    shapes = [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    names = set()
    for rows, k in shapes:  # AUTO's kernels up front, one NVRTC program on parallel threads
        for n in ns:
            c = be.choose(n, Precision.AUTO, DEFAULT_FLAGS, rows, k)
            if c.cfg is not None and c.path != "cublas_f16":
                tc = be.launcher.tile_cfg(c.path, c.cfg)
                if kernel_file(c.path, tc) == MATMUL_FILE:
                    names.add(kernel_name(c.path, tc, True, "InF16"))
    with be.ctx.dev:
        be.ctx.prefetch(MATMUL_FILE, sorted(names), threads=16)
    print(f"# device: {be.device_name()}  date: {time.strftime('%Y-%m-%d %H:%M')}  AUTO f16 "
          f"kernel us (median of {a.rounds} rounds x {a.iters} calls), slab rows "
          f"{' / '.join(v if v != '0' else 'default' for v in settings)}", flush=True)
    rng = np.random.default_rng(0)
    out = []
    for rows, k in shapes:
        blocks = q6k.random_blocks(rows, k, rng)
        copies = max(2, min(8, math.ceil(3 * L2_BYTES / q6k.aos_nbytes(rows, k))))
        ws = {s: [load(be, blocks, rows, k, slab_rows(s, rows)) for _ in range(copies)]
              for s in settings}
        del blocks
        for n in ns:
            c = be.choose(n, Precision.AUTO, DEFAULT_FLAGS, rows, k)
            xd = cp.asarray(rng.standard_normal((n, k)).astype(np.float16))
            got: dict[str, list[float]] = {s: [] for s in settings}
            with be.ctx.dev, be.stream:
                for _ in range(a.rounds):
                    for s in settings:
                        got[s].append(time_calls(cp, caller(be, ws[s], xd, c), copies,
                                                 iters=a.iters))
            med = {s: statistics.median(v) for s, v in got.items()}
            base = med[settings[0]]
            slabs = {s: len(ws[s][0].data.slabs) for s in settings}
            cells = "  ".join(f"{s if s != '0' else 'default'} ({slabs[s]} slabs) {med[s]:.1f}"
                              f" x{base / med[s]:.3f}" for s in settings)
            print(f"{rows:>6}x{k:<6} N={n:<3} {c.path} {c.cfg.label() if c.cfg else ''}: "
                  f"{cells}", flush=True)
            out.append({"shape": f"{rows}x{k}", "n": n, "us": got, "slabs": slabs})
        for lst in ws.values():
            for w in lst:
                be.free(w)
        cp.get_default_memory_pool().free_all_blocks()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": be.device_name(), "results": out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
