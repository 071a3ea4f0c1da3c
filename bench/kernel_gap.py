"""Why the service's kernel time is longer than bench/kernels.py's (issue 14, item 2; GPU only).

The service reports, per call, the time between the CUDA events its launch sequence records
around the kernels (kernels/cuda/launch.py point 3: event nodes inside the call's graph).
bench/kernels.py times the same kernel between stream events, 40 calls queued back to back
behind a spin kernel, the weight rotated over copies that the L2 cannot hold. On the H200 the
two differ: T1's kernel (3584x18944, N=1, f16) 28.9 us in the service against 23.0 alone
(session 16's closing check: 1.258x, limit 1.25x; session 14: 1.16x). This runs the same
weight and N in one process under each of the differences, one at a time, and prints per
phase the median (p10, p90) of the time each way reports:

- ``kpy``: bench/kernels.py's own timing (``time_calls``: ``CudaBackend.run`` between stream
  events, queued behind a spin kernel), rotated copies; ``kpy1``: the same on one copy;
- ``run-G``: ``CudaBackend.run`` between stream events, each call waited for, then a gap
  ``G`` on the host (``spinU``: busy for U us, the GPU idle; ``sleepU``; ``0``): the kernel
  launched onto an idle GPU, direct launches;
- ``svc-G``: the service's call (``CudaBackend.launch`` of a staged x, its graph, the time
  its event nodes report) with the same gaps, one copy as the service (``svc-rot-G``: rotated);
- ``svc-busy-G``: as ``svc-G`` but a spin kernel of ``--busy-us`` is enqueued on the stream
  just before the launch, so the graph lands on a busy GPU (its nodes queued, as kernels.py's);
- ``svc-outer-G``: ``svc-G``'s calls with stream events also recorded just before and after
  the graph launch: the whole sequence (x up, kernels, y down) on the GPU, ``outer``;
- ``svc-direct-G``: the same launches without a graph (``Launcher.graphs`` off: plain
  event records between direct launches);
- ``svc-anchor-G``: the service's call with ``Launcher.timing_anchor`` 1 (Q6SERVE_TIMING_ANCHOR):
  its graph launches an empty kernel between x's upload and the start event; ``svc-anchor2-G``:
  2, also one after the end event, before y's download.

Graphs built here from the service's bound sequence (its steps and events; bundle A showed
the graph's events read ~6 us over kernels.py's whatever the gap, copies or clocks):

- ``g-kern-G``: a graph of the start event node, the kernel(s) and the end event node only (no
  copies: x's upload before it is what the service's graph has and this lacks);
- ``g-bare-G``: a graph of the kernel(s) alone, timed by stream events recorded just before and
  after its launch (what a graph launch adds on the GPU around its kernels);
- ``g-fork-G``: the service's sequence with the start event on a side branch forked after x's
  upload (the kernel depends on the upload, not on the event node; bundle B: racy, the side
  node ran before or after the kernel's start: 28.1 us in process, 21 in the service);
- ``g-up-G`` / ``g-down-G``: the events-only graph with x's upload before it / y's download
  after it (which side of the kernel the service's extra time is on);
- ``g-svc-G``: the service's own captured graph launched the same way (its events, the GPU
  span ``outer`` of the launch between stream events, the host's ``wall`` from launch to sync);
- ``g-zc-G``: the service's sequence with x's upload and y's download done by a small copy
  kernel reading / writing the pinned buffers (no copy-engine nodes: every node on the
  kernels' engine), timed as ``g-svc`` (a small f32 y only);
- ``cupti``: the service's calls (with and without the anchor), ``g-kern`` and kernels.py's
  timing under torch's profiler (CUPTI): each q6k kernel's own GPU duration, beside what the
  events said.

``--smi``: ``nvidia-smi`` samples the SM and memory clocks, power and clock-event reasons
every 20 ms in the background; each phase prints the median SM / memory clock over its span.

    python bench/kernel_gap.py [--shape 3584x18944] [--n 1] [--calls 300]
                               [--gaps 0,spin300,sleep300] [--smi] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import Layout, Precision, iter_aos_chunks
from q6serve.kernels.cuda_backend import CudaBackend

# bench/kernels.py, loaded by its path (a bare ``import kernels`` could find the package's
# kernels/ folder): its timing is the figure the service's is compared against
_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name(
    "kernels.py"))
assert _spec is not None and _spec.loader is not None
_kpy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_kpy)
SPIN_SRC, time_calls = _kpy.SPIN_SRC, _kpy.time_calls
# g-zc's copies: 16-byte words from src to dst, one a thread (pinned host memory is the
# device's to read and write at the same address under unified addressing)
COPY_SRC = r"""extern "C" __global__ void q6_copy16(const int4* __restrict__ src,
                                                 int4* __restrict__ dst, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}"""
L2_BYTES = 60e6  # as bench/kernels.py: enough copies that the L2 cannot serve the weight


class Smi:
    """nvidia-smi sampling in the background: (unix time, SM MHz, mem MHz, W, reasons)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float, float, str]] = []
        try:
            self.p: subprocess.Popen | None = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,"
                 "clocks_event_reasons.active", "--format=csv,noheader,nounits", "-lms", "20"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.p = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p is not None and self.p.stdout is not None
        for line in self.p.stdout:
            f = [s.strip() for s in line.split(",")]
            try:  # (its timestamp is local time, as datetime's naive timestamp() reads it)
                t = datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.rows.append((t, float(f[1]), float(f[2]), float(f[3]), f[4]))
            except (ValueError, IndexError):
                continue

    def span(self, t0: float, t1: float) -> dict | None:
        got = [r for r in self.rows if t0 <= r[0] <= t1]
        if not got:
            return None
        return {"sm_mhz": statistics.median(r[1] for r in got),
                "sm_min": min(r[1] for r in got),
                "mem_mhz": statistics.median(r[2] for r in got),
                "watts": statistics.median(r[3] for r in got),
                "reasons": sorted({r[4] for r in got}), "samples": len(got)}

    def close(self) -> None:
        if self.p is not None:
            self.p.terminate()


def gap(g: str) -> None:
    """The host's pause between two calls: nothing, a busy spin or a sleep of U us."""
    if g == "0":
        return
    us = float(g[5:] if g.startswith("sleep") else g[4:])
    if g.startswith("sleep"):
        time.sleep(us * 1e-6)
        return
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def stats(v: list[float]) -> dict:
    s = sorted(v)
    return {"p50": statistics.median(s), "p10": s[int(0.1 * (len(s) - 1))],
            "p90": s[int(0.9 * (len(s) - 1))], "n": len(s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="3584x18944")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--gaps", default="0,spin300,sleep300")
    ap.add_argument("--busy-us", type=float, default=40.0,
                    help="svc-busy: the spin kernel enqueued before each launch (us)")
    ap.add_argument("--phases", default="kpy,kpy1,run,svc,svc-rot,svc-busy,svc-outer,"
                    "svc-direct,kpy")
    ap.add_argument("--smi", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import cupy as cp

    rows, k = map(int, a.shape.split("x"))
    be = CudaBackend(0)
    rng = np.random.default_rng(0)
    blocks = q6k.random_blocks(rows, k, rng)
    ncopy = max(2, min(16, math.ceil(3 * L2_BYTES / q6k.aos_nbytes(rows, k))))
    ws = [be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA, 64 << 20)
          for _ in range(ncopy)]
    x = rng.standard_normal((a.n, k)).astype(np.float16)
    xd = cp.asarray(x)
    c = be.choose(a.n, Precision.AUTO, be_flags(), rows, k)
    spin = cp.RawKernel(SPIN_SRC, "spin")
    clk = cp.cuda.Device(0).attributes["ClockRate"] * 1e3  # Hz (the spin's cycles per second)
    smi = Smi() if a.smi else None
    print(f"# {a.shape} N={a.n} f16: {c.path} {c.cfg}; {ncopy} copies; "
          f"{be.device_name()}", flush=True)
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    results: list[dict] = []

    def svc_call(w: Any, g: str, busy: bool, outer: list[float] | None) -> float:
        st = be.staging(a.n, k, np.float16)
        st[...] = x
        if busy:
            with be.ctx.dev, be.stream:
                spin((1,), (1,), (np.int64(a.busy_us * 1e-6 * clk),))
        if outer is not None:
            e0.record(be.stream)
        launched = be.launch(w, st)
        if outer is not None:
            e1.record(be.stream)
        res = launched.wait()
        ks = res.timing.seconds(wait=True)
        if outer is not None:
            e1.synchronize()
            outer.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
        gap(g)
        return float("nan") if ks is None else ks * 1e6

    def run_call(w: Any, g: str) -> float:
        with be.ctx.dev, be.stream:
            e0.record(be.stream)
            be.run(w, xd, np.float16, c.path, c.cfg)
            e1.record(be.stream)
        e1.synchronize()
        t = cp.cuda.get_elapsed_time(e0, e1) * 1e3
        gap(g)
        return t

    def phase(name: str, fn: Any) -> None:
        t0 = time.time()
        try:
            out = fn()
        except Exception as e:  # one phase that fails must not end the others
            print(f"{name:>22}  FAILED: {type(e).__name__}: {e}", flush=True)
            results.append({"phase": name, "error": repr(e)})
            return
        t1 = time.time()
        row = {"phase": name, **out}
        if smi is not None:
            time.sleep(0.05)  # (the last samples' lines)
            row["smi"] = smi.span(t0, t1)
        results.append(row)
        s = row.get("smi") or {}
        extra = "".join(f"  {key} {row[key]['p50']:7.2f}" for key in ("outer", "wall")
                        if key in row)
        print(f"{name:>22}  kernel p50 {row['kernel']['p50']:7.2f}  p10 {row['kernel']['p10']:7.2f}"
              f"  p90 {row['kernel']['p90']:7.2f} us{extra}"
              + (f"  sm {s['sm_mhz']:.0f} (min {s['sm_min']:.0f}) mem {s['mem_mhz']:.0f} MHz "
                 f"{s['watts']:.0f} W {','.join(s['reasons'])}" if s else ""), flush=True)

    gaps = a.gaps.split(",")
    for w in ws:  # compile, bind, capture (the service's graph from its second call)
        for _ in range(4):
            svc_call(w, "0", False, None)
        with be.ctx.dev, be.stream:
            be.run(w, xd, np.float16, c.path, c.cfg)
    be.stream.synchronize()
    for p in a.phases.split(","):
        if p.startswith("g-") or p == "cupti":
            continue  # (below, with the graphs built from the service's bound sequence)
        if p in ("kpy", "kpy1"):
            cw = ws if p == "kpy" else ws[:1]

            def kpy(cw: list = cw) -> dict:
                def call(i: int) -> None:
                    be.run(cw[i], xd, np.float16, c.path, c.cfg)

                with be.ctx.dev, be.stream:
                    v = [time_calls(cp, call, len(cw), iters=40) for _ in range(5)]
                return {"kernel": stats(v)}  # (each a median of 40 calls)

            phase(p, kpy)
            continue
        for g in gaps:
            if p == "run":
                phase(f"run-{g}", lambda g=g: {"kernel": stats(
                    [run_call(ws[0], g) for _ in range(a.calls)])})
            elif p in ("svc", "svc-rot", "svc-busy"):
                phase(f"{p}-{g}", lambda g=g, p=p: {"kernel": stats(
                    [svc_call(ws[i % len(ws)] if p == "svc-rot" else ws[0], g, p == "svc-busy",
                              None) for i in range(a.calls)])})
            elif p == "svc-outer":
                def outer_phase(g: str = g) -> dict:
                    o: list[float] = []
                    kv = [svc_call(ws[0], g, False, o) for _ in range(a.calls)]
                    return {"kernel": stats(kv), "outer": stats(o)}

                phase(f"{p}-{g}", outer_phase)
            elif p in ("svc-direct", "svc-anchor", "svc-anchor2"):
                def rebound_phase(g: str = g, p: str = p) -> dict:
                    with rebound(be, ws[0], *(("graphs", False) if p == "svc-direct"
                                              else ("timing_anchor", 2 if p[-1] == "2"
                                                    else 1))):
                        for _ in range(4):
                            svc_call(ws[0], "0", False, None)
                        return {"kernel": stats([svc_call(ws[0], g, False, None)
                                                 for _ in range(a.calls)])}

                phase(f"{p}-{g}", rebound_phase)
    late = [p for p in a.phases.split(",") if p.startswith("g-") or p == "cupti"]
    try:
        gv = GraphVariants(be, ws[0], spin, clk)
    except Exception as e:  # (the phases above still count)
        print(f"# graph variants: FAILED: {type(e).__name__}: {e}", flush=True)
        late = []
    for p in late:
        if p.startswith("g-"):
            for g in gaps:
                phase(f"{p}-{g}", lambda g=g, p=p: gv.run(p, g, a.calls, a.busy_us))
        elif p == "cupti":
            def cupti_phase() -> dict:
                out = {}
                for name, fn in (("svc", lambda: svc_call(ws[0], "spin300", False, None)),
                                 ("svc-anchor", lambda: svc_call(ws[0], "spin300", False, None)),
                                 ("g-kern", lambda: gv.one("g-kern", "spin300", 0.0)),
                                 ("kpy", None)):
                    if name == "svc-anchor":
                        with rebound(be, ws[0], "timing_anchor", 1):
                            for _ in range(4):
                                svc_call(ws[0], "0", False, None)
                            ev, kern = cupti(lambda fn=fn: [fn() for _ in range(60)], a.json)
                    elif fn is None:
                        def kcall(i: int) -> None:
                            be.run(ws[i % len(ws)], xd, np.float16, c.path, c.cfg)

                        def many() -> list[float]:
                            with be.ctx.dev, be.stream:
                                return [time_calls(cp, kcall, len(ws), iters=40)]
                        ev, kern = cupti(many, a.json)
                    else:
                        ev, kern = cupti(lambda fn=fn: [fn() for _ in range(60)], a.json)
                    out[name] = {"events": stats(ev) if ev else None,
                                 "cupti": stats(kern) if kern else None}
                    print(f"{'cupti ' + name:>22}  events p50 "
                          f"{stats(ev)['p50'] if ev else float('nan'):7.2f}  CUPTI kernel(s) "
                          f"p50 {stats(kern)['p50'] if kern else float('nan'):7.2f} us "
                          f"({len(kern)} launches)", flush=True)
                return {"kernel": out["svc"]["cupti"] or {"p50": float("nan"), "p10": 0,
                                                           "p90": 0}, "cupti": out}

            phase("cupti", cupti_phase)
    if smi is not None:
        smi.close()
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": a.shape, "n": a.n, "path": c.path,
                                            "cfg": str(c.cfg), "results": results}, indent=1))
    return 0


@contextlib.contextmanager
def rebound(be: CudaBackend, w: Any, attr: str, value: Any) -> Iterator[None]:
    """The launcher's ``attr`` set to ``value`` with ``w``'s bound sequences and cached calls
    dropped (rebound and recaptured by the next calls), both restored after."""
    lc = be.launcher
    old = getattr(lc, attr)
    setattr(lc, attr, value)
    saved = dict(w.data.plans)
    w.data.plans.clear()
    try:
        yield
    finally:
        setattr(lc, attr, old)
        w.data.plans.clear()
        w.data.plans.update(saved)


class GraphVariants:
    """Graphs built from the service's bound sequence of ``w`` (its steps, events, buffers):
    see the module docstring (``g-kern``, ``g-bare``, ``g-fork``)."""

    def __init__(self, be: CudaBackend, w: Any, spin: Any, clk: float) -> None:
        import cupy as cp

        self.cp, self.be, self.lc, self.spin, self.clk = cp, be, be.launcher, spin, clk
        bs = [v for v in w.data.plans.values() if type(v).__name__ == "Bound" and v.graph]
        if not bs:
            raise RuntimeError("no captured bound sequence on the weight")
        self.b = bs[0]
        self.e0, self.e1 = cp.cuda.Event(), cp.cuda.Event()
        self.graphs: dict[str, Any] = {}

    def graph(self, kind: str) -> Any:
        g = self.graphs.get(kind)
        if g is not None:
            return g
        cp, lc, b, st = self.cp, self.lc, self.b, self.be.stream
        host = lc.ws.host(b.x_bytes, 0).ctypes.data

        def kern(record: Any) -> None:
            lc._kernels(b, record)

        def bare(record: Any) -> None:
            for step in b.steps:
                step()

        side = cp.cuda.Stream(non_blocking=True)
        fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)

        def forked(record: Any) -> None:  # the start event beside the kernel, after x's upload
            lc._upload(b, host)
            fork.record(st)
            side.wait_event(fork)
            if lc._record_ext(b.start.ptr, side.ptr, 1) != 0:
                raise RuntimeError("external record on the side stream refused")
            join.record(side)
            for step in b.steps:
                step()
            record(b.end)
            st.wait_event(join)
            lc._download(b)

        y_host = b.extra["out"][1] if b.extra.get("out") else None

        def zc(record: Any) -> None:  # the copies as kernels reading/writing pinned memory
            if y_host is None or b.extra["out"][0]:
                raise RuntimeError("g-zc: only for a small f32 y downloaded in the graph")
            cin = cp.RawKernel(COPY_SRC, "q6_copy16")
            n_in, n_out = b.x_bytes // 16, y_host.nbytes // 16
            cin((-(-n_in // 256),), (256,), (np.uint64(host), np.uint64(b.extra["xd"]),
                                              np.int64(n_in)))
            lc._kernels(b, record)
            cin((-(-n_out // 256),), (256,), (np.uint64(b.extra["y"]),
                                               np.uint64(y_host.ctypes.data), np.int64(n_out)))

        def up(record: Any) -> None:  # x's upload before the events, no download after
            lc._upload(b, host)
            lc._kernels(b, record)

        def down(record: Any) -> None:  # y's download after the events, no upload before
            lc._kernels(b, record)
            lc._download(b)

        fn = {"g-kern": kern, "g-bare": bare, "g-fork": forked, "g-zc": zc, "g-up": up,
              "g-down": down}[kind]
        with self.be.ctx.dev, st:
            g = lc.capture(fn)
        if not g:
            raise RuntimeError(f"{kind}: capture refused")
        self.graphs[kind] = (g, side)
        return self.graphs[kind]

    def one(self, kind: str, g: str, busy_us: float, sink: dict | None = None) -> float:
        """One launch of ``kind``'s graph, waited for; its events' time (us). ``sink``: also
        the GPU span of the launch (stream events around it, ``outer``) and the host's wall
        from the launch to the sync's return (``wall``), appended."""
        graph = self.b.graph if kind == "g-svc" else self.graph(kind)[0]
        st = self.be.stream
        with self.be.ctx.dev:
            if busy_us:
                with st:
                    self.spin((1,), (1,), (np.int64(busy_us * 1e-6 * self.clk),))
            self.e0.record(st)
            t0 = time.perf_counter()
            graph.launch(st)
            self.e1.record(st)
            st.synchronize()
            wall = (time.perf_counter() - t0) * 1e6
        outer = self.cp.cuda.get_elapsed_time(self.e0, self.e1) * 1e3
        t = (outer if kind == "g-bare"
             else self.cp.cuda.get_elapsed_time(self.b.start, self.b.end) * 1e3)
        if sink is not None:
            sink.setdefault("outer", []).append(outer)
            sink.setdefault("wall", []).append(wall)
        gap(g)
        return t

    def run(self, kind: str, g: str, calls: int, busy_us: float) -> dict:
        busy = kind.endswith("-busy")
        kind = kind.removesuffix("-busy")
        for _ in range(3):
            self.one(kind, "0", 0.0)
        sink: dict[str, list[float]] = {}
        kern = [self.one(kind, g, busy_us if busy else 0.0, sink) for _ in range(calls)]
        return {"kernel": stats(kern), **{k: stats(v) for k, v in sink.items()}}


def cupti(fn: Any, json_path: str | None) -> tuple[list[float], list[float]]:
    """``fn()`` (returns the events' figures, us) under torch's profiler: (those figures, the
    CUPTI durations in us of every q6k kernel it ran, in launch order)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ev = fn()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    trace = json.loads(Path(path).read_text())
    Path(path).unlink()
    kern = [float(e["dur"]) for e in sorted(trace.get("traceEvents", []),
                                              key=lambda e: e.get("ts", 0))
            if e.get("cat") == "kernel" and "q6k" in e.get("name", "")]
    return ev, kern


def be_flags() -> Any:
    from q6serve.kernels.api import KernelFlags

    return KernelFlags()


if __name__ == "__main__":
    sys.exit(main())
