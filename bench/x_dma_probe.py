"""Why x's upload is slower right after the CPU wrote the staging buffer (issue 14 goal 1,
session 22; run on a GPU).

Session 21's bench/graph_launch_probe.py: a 1.8 MB upload from pinned memory took 37.3 us of
GPU span with the buffer untouched and 55.8 just after a fill (the copy kernel 40.7 / 54.8);
session 21's write-combined staging did not help, session 9's non-temporal fill (a glibc
tunable, process-wide) shortened the staged N=64 call's span by ~13 us. Between two timed
copies the "clean" row leaves the GPU idle a few us, the "filled" row for the fill's time, so
the fill's dirty lines and the GPU's idle time are confounded there. Here, per size, each
condition before each timed copy (after the previous copy's sync):

- ``clean``: nothing; ``idle``: a busy wait as long as the fill's median (no write);
- ``filled``: ``np.copyto`` of x into the staging buffer (the staged fill);
- ``other``: the same fill into another pinned buffer of that size (the caches as busy, the
  copied lines untouched);
- ``nt``: the fill by non-temporal stores (kernels/cuda/hostcopy.py; lines not left modified
  in the CPU's caches);
- ``late``: ``filled``, then a busy wait of 300 us before the copy;
- ``wc``: the fill into a write-combined pinned buffer (cudaHostAllocWriteCombined), copied
  from it;

and two ways to upload: ``engine`` (``cudaMemcpyAsync`` H2D, a copy-engine DMA) and ``kernel``
(the launcher's copy kernel, kernels/cuda/launch.py COPY_SRC, reading the mapped pinned
memory). The GPU span of one copy = CUDA events just before and after it on the stream; the
conditions alternate within each of ``--rounds`` rounds; medians over all calls of a cell.

    python bench/x_dma_probe.py [--sizes 524288,1835008,3670016] [--calls 60] [--rounds 3]
                                [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
from graph_launch_probe import copy_blocks, copy_kernel  # bench/ is sys.path[0]

_H2D = 1  # cudaMemcpyHostToDevice
CONDS = ("clean", "idle", "filled", "other", "nt", "late", "wc")
WAYS = ("engine", "kernel")


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class Size:
    """One size's buffers and its timed uploads."""

    def __init__(self, cp: Any, size: int, rng: np.random.Generator, copy_fn: Any,
                 stream: Any) -> None:
        from q6serve.kernels.cuda.launch import COPY_THREADS, _WriteCombined

        self.cp, self.size, self.copy_fn, self.stream = cp, size, copy_fn, stream
        self.host, self.other = (np.frombuffer(cp.cuda.alloc_pinned_memory(size), np.uint8, size)
                                 for _ in range(2))
        self._wcm = _WriteCombined(cp.cuda.runtime, size)
        self.wc = self._wcm.array()
        self.src = rng.integers(0, 255, size, dtype=np.uint8)
        for b in (self.host, self.other, self.wc):
            b[...] = self.src
        self.dev = cp.empty(size, cp.uint8)
        self.blocks = copy_blocks(size)
        self.threads = COPY_THREADS
        self.ev0, self.ev1 = cp.cuda.Event(), cp.cuda.Event()
        fills = []
        for _ in range(20):  # the fill's time: the idle row's wait
            t0 = time.perf_counter()
            np.copyto(self.host, self.src)
            fills.append((time.perf_counter() - t0) * 1e6)
        self.fill_us = statistics.median(fills)
        self.spans: dict[tuple[str, str], list[float]] = {(c, w): [] for c in CONDS for w in WAYS}
        self.ftimes: dict[str, list[float]] = {c: [] for c in CONDS}

    def one(self, cond: str, way: str) -> None:
        from q6serve.kernels.cuda import hostcopy

        cp, host, src = self.cp, self.host, self.src
        buf = self.wc if cond == "wc" else host
        t0 = time.perf_counter()
        if cond in ("filled", "late"):
            np.copyto(host, src)
        elif cond == "other":
            np.copyto(self.other, src)
        elif cond == "nt":
            hostcopy.copy_into(host, src)
        elif cond == "wc":
            np.copyto(self.wc, src)
        elif cond == "idle":
            spin(self.fill_us)
        self.ftimes[cond].append((time.perf_counter() - t0) * 1e6)
        if cond == "late":
            spin(300)
        stream, dev = self.stream, int(self.dev.data.ptr)
        with stream:
            self.ev0.record(stream)
            if way == "engine":
                cp.cuda.runtime.memcpyAsync(dev, buf.ctypes.data, self.size, _H2D, stream.ptr)
            else:
                self.copy_fn((self.blocks,), (self.threads,), (
                    np.uint64(buf.ctypes.data), np.uint64(dev), np.int64(self.size)))
            self.ev1.record(stream)
        self.ev1.synchronize()
        self.spans[cond, way].append(cp.cuda.get_elapsed_time(self.ev0, self.ev1) * 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="524288,1835008,3670016")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from q6serve.kernels.cuda import hostcopy

    cp, copy_fn, stream, head = copy_kernel()
    print(f"{head}  non-temporal fill: {hostcopy.available()}; "
          f"{a.calls} copies x {a.rounds} rounds a cell; GPU span of one upload, us, median "
          "(fill us after)")
    print(f"{'bytes':>8} {'cond':>7} " + " ".join(f"{w:>8}" for w in WAYS) + f" {'fill':>7}")
    out: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    for size in map(int, a.sizes.split(",")):
        sz = Size(cp, size, rng, copy_fn, stream)
        for way in WAYS:  # warm-up (the kernel's load)
            for _ in range(5):
                sz.one("clean", way)
        for v in sz.spans.values():
            v.clear()
        for _ in range(a.rounds):
            for cond in CONDS:
                for way in WAYS:
                    for _ in range(a.calls):
                        sz.one(cond, way)
        assert bytes(cp.asnumpy(sz.dev)) == bytes(sz.src), "the copies lost bytes"
        for cond in CONDS:
            row = {"bytes": size, "cond": cond,
                   **{w: statistics.median(sz.spans[cond, w]) for w in WAYS},
                   "fill_us": statistics.median(sz.ftimes[cond]), "idle_wait_us": sz.fill_us}
            out.append(row)
            print(f"{size:>8} {cond:>7} " + " ".join(f"{row[w]:8.1f}" for w in WAYS)
                  + f" {row['fill_us']:7.1f}", flush=True)
        del sz
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
