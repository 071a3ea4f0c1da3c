"""What a captured graph's launch costs the host, by the size of its x upload (issue 14 goal 1,
session 21; run on a GPU).

Bundle A (H200, d923d21): the unsplit staged N=64 call's ``CudaBackend.launch`` took 27-45 us of
host on 4096x14336 (x 1.8 MB, uploaded by a memcpy node of the call's graph) against 13 us on
14336x4096 (x 512 KiB, by the copy kernel), and the GPU starts x's upload only once the launch
returns. Two causes could make a launch grow with x: the driver's work for the graph's memcpy
node (by its size), or the fill of x into the pinned staging buffer just before (its dirty cache
lines slow whatever runs next: session 9's hypothesis). Per size, a graph of one H2D memcpy node
(pinned host -> device) and one of the launcher's copy kernel for the same bytes, each launched
``--calls`` times (median host time of ``Graph.launch`` alone, a stream sync between calls):

- ``clean``: the staging buffer not written since the last launch;
- ``filled``: the buffer written (``np.copyto`` from another array, as a staged fill) right
  before the launch;

and the GPU span of the graph (events around it).

    python bench/graph_launch_probe.py [--sizes 65536,262144,1048576,1835008,3670016]
                                       [--calls 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

_H2D = 1  # cudaMemcpyHostToDevice


def copy_kernel() -> tuple[Any, Any, Any, str]:
    """CuPy, the launcher's copy kernel (kernels/cuda/launch.py COPY_SRC) as a RawKernel, a
    non-blocking stream, and the head of a probe's first line (device, date); this probe's and
    bench/x_dma_probe.py's."""
    import cupy as cp

    from q6serve.kernels.cuda.launch import COPY_SRC

    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return (cp, cp.RawKernel(COPY_SRC, "q6_copy"), cp.cuda.Stream(non_blocking=True),
            f"# device: {name}  date: {time.strftime('%Y-%m-%d')}")


def copy_blocks(size: int) -> int:
    """The copy kernel's blocks for ``size`` bytes, as the launcher's (kernels/cuda/copies.py):
    16 bytes a thread, COPY_THREADS a block, at most COPY_MAX_BLOCKS (a larger copy loops)."""
    from q6serve.kernels.cuda.launch import COPY_MAX_BLOCKS, COPY_THREADS

    return max(1, min(COPY_MAX_BLOCKS, -(-(size >> 4) // COPY_THREADS)))


def graph_of(stream: Any, enqueue: Any) -> Any:
    """``enqueue()`` captured on ``stream`` as a graph (relaxed mode, as the launcher's)."""
    stream.begin_capture(2)  # cudaStreamCaptureModeRelaxed
    try:
        enqueue()
    finally:
        g = stream.end_capture()
    return g


def graphs(cp: Any, stream: Any, copy_fn: Any, src: int, dst: int, size: int,
           ) -> tuple[Any, Any]:
    """The two graphs of one upload of ``size`` bytes from ``src`` (pinned) to ``dst``: a
    memcpy node, and the copy kernel (loaded before the capture)."""
    from q6serve.kernels.cuda.launch import COPY_THREADS

    blocks = copy_blocks(size)
    args = (np.uint64(src), np.uint64(dst), np.int64(size))
    with stream:
        copy_fn((blocks,), (COPY_THREADS,), args, stream=stream)
        stream.synchronize()
        g_mem = graph_of(stream, lambda: cp.cuda.runtime.memcpyAsync(dst, src, size, _H2D,
                                                                     stream.ptr))
        g_ker = graph_of(stream, lambda: copy_fn((blocks,), (COPY_THREADS,), args,
                                                 stream=stream))
    return g_mem, g_ker


def time_launches(cp: Any, stream: Any, graph: Any, host: np.ndarray, src: np.ndarray,
                  calls: int, fill: bool) -> tuple[float, float]:
    """(median host us of graph.launch, median GPU span us of the graph)."""
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    hosts, spans = [], []
    for i in range(calls + 5):
        if fill:
            np.copyto(host, src)
        ev0.record(stream)
        t0 = time.perf_counter()
        graph.launch(stream)
        t1 = time.perf_counter()
        ev1.record(stream)
        ev1.synchronize()
        if i >= 5:
            hosts.append((t1 - t0) * 1e6)
            spans.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3)
    return statistics.median(hosts), statistics.median(spans)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="65536,262144,1048576,1835008,3670016")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cp, copy_fn, stream, head = copy_kernel()
    print(f"{head}  {a.calls} launches a row; us, median: host time of Graph.launch / GPU "
          "span")
    print(f"{'bytes':>9} {'memcpy clean':>15} {'memcpy filled':>15} {'kernel clean':>15} "
          f"{'kernel filled':>15}")
    out = []
    for size in map(int, a.sizes.split(",")):
        mem = cp.cuda.alloc_pinned_memory(size)
        host = np.frombuffer(mem, np.uint8, size)
        src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        host[...] = src
        dev = cp.empty(size, cp.uint8)
        g_mem, g_ker = graphs(cp, stream, copy_fn, host.ctypes.data, int(dev.data.ptr), size)
        row: dict[str, Any] = {"bytes": size}
        for name, g in (("memcpy", g_mem), ("kernel", g_ker)):
            for fill in (False, True):
                h, s = time_launches(cp, stream, g, host, src, a.calls, fill)
                row[f"{name}_{'filled' if fill else 'clean'}"] = {"host_us": h, "span_us": s}
        assert bytes(cp.asnumpy(dev)) == bytes(src), "the graphs' copies lost bytes"
        out.append(row)
        print(f"{size:>9} " + " ".join(
            f"{row[k]['host_us']:6.1f} / {row[k]['span_us']:6.1f}"
            for k in ("memcpy_clean", "memcpy_filled", "kernel_clean", "kernel_filled")),
            flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
