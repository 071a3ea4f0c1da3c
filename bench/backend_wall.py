"""Wall time vs kernel time of ``CudaBackend.matmul`` per call (no gRPC; run on a GPU).

Each call: host activations in (f16 by default, fresh arrays from a small pool, as the
service hands them over), host y out. ``wall`` = ``time.perf_counter`` around the call,
``kernel`` = the call's own reported kernel time (CUDA events around the kernels only), and
``host`` = wall - kernel: what the host path costs around the kernel (copies, launches, the
sync, Python). Modes:

- ``graph``: the backend as the service runs it (the launch sequence of a (weight, N) is a
  CUDA graph from its second call);
- ``direct``: the same host path with direct launches (``CudaBackend(graphs=False)``);
- ``staged``: ``graph`` with x built by the caller in ``CudaBackend.staging`` (the pinned
  upload buffer: what a batcher concatenating into it pays); the fill is not in ``wall`` and
  is printed beside it;
  ``staged`` also prints the GPU's span of each call (CUDA events recorded on the stream just
  before the launch and just after it: upload, kernels, download and the gaps between them), so
  ``wall - span`` is the host's own part (the launch before the GPU starts, the sync's wake-up),
  ``launch`` the host time of ``launch`` alone (the enqueueing), and ``loop`` the loop's own
  time per call with those bench events (their records, the span's read; up to session 12 the
  staged ``wall`` was this: since session 13 it is ``launch`` .. ``wait`` and the kernel time
  read, as in the other modes); ``pre`` / ``tail``: the span from its start to the reported
  kernel's start event (the graph launch's latency, x's upload) and from its end event to the
  span's end (y's download after the kernels); ``--parts``: also when a split call's (row
  chunks, token halves) first part's y has landed (an event on the y copy stream recorded after
  the launch: one more host call in the wall; with 4 parts, when the first three have);
  ``--fill concat`` writes it as the batcher does for a batch of one-row requests
  (``np.concatenate`` of N arrays into it) instead of one copy;
- ``naive``: the host path before issue 14 (``cupy.asarray(x)`` from pageable memory, events,
  the launches, ``y.get()``), for comparison.

    python bench/backend_wall.py [--shapes 4096x14336,...] [--ns 1,8,64] [--calls 200]
                                 [--dtype f16] [--modes graph,staged,direct,naive] [--topk K]
                                 [--json out.json]

``--topk K``: the calls ask for the top-k / log-sum-exp epilogue (graph, staged, direct), so
``host`` also holds the epilogue's kernel, which runs after the timed matmul kernel.

``--y-chunks C`` / a variant's ``Y_CHUNKS=C``: a large y computed and downloaded in up to C row
chunks (kernels/cuda/launch.py, point 8; by default a two-slab weight's own 2, ``Y_CHUNKS=0``
none), which needs weights of several slabs: ``--slab-rows R`` or a variant's ``SLAB_ROWS=R``
loads them in slabs of R rows (a value over the rows: one slab, as before session 13; -P: in P
slabs); the rows of the chunks used are printed after the row (e.g. ``--variants
'one:SLAB_ROWS=20000;new;two:SLAB_ROWS=-2,Y_CHUNKS=2'``).

``PRECISION=auto|f16|exact|q8_1`` in a variant: its calls go through ``api.launch_ieee`` at
that precision with one flags object, as the worker's batcher calls the backend (a variant
without it: ``CudaBackend.launch`` / ``matmul`` at AUTO, as before); e.g. ``--variants
'a:PRECISION=auto;f:PRECISION=f16;a0:PRECISION=auto,HOT_CALLS=0'`` (session 26: is a call at
AUTO dearer on the host than one at F16?).

``ASK_PLAN=1`` in a variant (with ``PRECISION=auto``): the backend's ``no_q8_1`` set back to
``api.Backend``'s, so launch_ieee asks plan() at AUTO as before session 26 (the A/B of that
change in one process).

``COPY_KERNEL_MAX=B`` in a variant: x's upload and a small y's download of at most B bytes by
a copy kernel on the kernels' engine instead of the copy engine (kernels/cuda/launch.py
COPY_SRC; unless Q6SERVE_COPY_KERNEL_MAX is set; every bound sequence rebinds at each variant
switch).

``STAGING_WC_MIN=B`` in a variant: x's pinned staging buffer write-combined from B bytes on
(kernels/cuda/launch.py; every bound sequence rebinds at each variant switch).

``NT_FILL_MIN=B`` in a variant: x's copy into the staging buffer (the staged fill here, the
backend's own in graph mode) by non-temporal stores from B bytes on (kernels/cuda/hostcopy.py;
0: NumPy's copy).

``X_SPLIT_MIN=B`` in a variant: an idle call whose x is B bytes or more runs in token halves
(kernels/cuda/launch.py, point 10: x's second half uploaded beside the first half's kernels,
the first half's y downloaded beside the second's); the halves used are printed after the row
(``tokens 32/32``); ``X_SPLIT_FIT=0``: the halves keep the full call's tile (every bound
sequence rebinds at each variant switch). ``X_SPLIT_Y_MIN=B``: an idle call of 16-64 tokens
whose f32 y is B bytes or more runs in token halves before row chunks; ``X_SPLIT_ROWS=1``: each
half in the weight's own row chunks (``tokens 32/32 x rows 7168/7168/7168/7168``).

``--floor``: beside each (shape, N), what the bus alone costs at the call's sizes: x's upload
and y's download between CUDA events from/into pinned memory (``h2d``, ``d2h``; y's also as two
2D copies of its column halves, the row chunks' way, and as two copies of its token halves), and
the wall of an empty stream sync (``sync``): the part of ``host`` no host code can remove without
overlapping the copies with the kernel.

Every row's y (a call on the first x after its timed calls) is compared bit for bit with the
defaults' (no top-k): a row that differs is marked and the exit status is 1.

``--many GROUPS``: multi-weight calls instead (one x, several weights of its K: ``qkv`` =
3584x3584 + 512x3584 + 512x3584, ``gateup`` = 2 x 18944x3584, or ``NAME=RxK+RxK...``; comma
separated), each (group, N) measured in three ways alternated over ``--rounds``: ``parts``
(each part's launch and wait in turn: the service's multi-weight direct path), ``pipe`` (the
parts launched behind each other, then waited for in order: ``Q6SERVE_MULTI_PIPELINE=1``) and
``many`` (``CudaBackend.launch_many``: one sequence, one download, one sync); ``kernel`` is the
parts' kernel times summed, ``host`` = wall - kernel; every way's y's are compared bit for bit
with ``parts``' (``equal``). x is a fresh host array per call (``--many-staged``: built in
``CudaBackend.staging``, the fill not in the wall).

Targets (issue 14): wall <= kernel + 30 us at N=1 and <= kernel + 100 us at N=64 on a 48 MB
weight.
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
from q6serve.kernels.api import KernelFlags, Layout, Precision, ResidentWeight, iter_aos_chunks
from q6serve.kernels.cuda_backend import CudaBackend

SHAPES = ((4096, 14336), (14336, 4096), (3584, 3584), (512, 3584))
# --variants keys that are not launch.py constants: SLAB_ROWS (the variant's own copy of the
# weight), PRECISION (auto, f16, ...: the calls through api.launch_ieee at it, the worker's way)
# ASK_PLAN=1: the backend's ``no_q8_1`` set back to api.Backend's (EXACT, F16): a call at AUTO
# through api.launch_ieee asks plan() first, as before session 26 (a tree whose api.launch_ieee
# does not read ``no_q8_1`` always asks)
LOCAL_KEYS = ("SLAB_ROWS", "PRECISION", "ASK_PLAN")
DTYPES = {"f16": np.float16, "f32": np.float32}


def random_blocks(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    return q6k.random_blocks(rows, k, rng)


def naive_call(be: CudaBackend, w: ResidentWeight, x: np.ndarray) -> tuple[np.ndarray, float]:
    """The pre-issue-14 host path: pageable copies, a fresh y, events around the launches."""
    import cupy as cp

    c = be.choose(x.shape[0], Precision.AUTO, KernelFlags(), w.rows, w.k)
    with be.ctx.dev, be.stream:
        xd = cp.asarray(x)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(be.stream)
        y = be.run(w, xd, x.dtype, c.path, c.cfg)
        end.record(be.stream)
        host = y.get(stream=be.stream)
    return host, cp.cuda.get_elapsed_time(start, end) / 1e3


class _Stamped:
    """A bound sequence's graph with the host's clock read around each launch (``--probe``)."""

    def __init__(self, graph: object, stamps: dict) -> None:
        self.graph, self.stamps = graph, stamps

    def launch(self, stream: object) -> None:
        self.stamps["g0"] = time.perf_counter()
        self.graph.launch(stream)
        self.stamps["g1"] = time.perf_counter()


class _StampedEvent:
    """A cached BoundCall's completion event with the host's clock read after its record
    (``--probe``: the end of the launch's enqueueing)."""

    def __init__(self, ev: object, stamps: dict) -> None:
        self.ev, self.stamps = ev, stamps

    def record(self, stream: object = None) -> None:
        self.ev.record(stream)
        self.stamps["f1"] = time.perf_counter()

    def synchronize(self) -> None:
        self.ev.synchronize()
        self.stamps["s1"] = time.perf_counter()


def _probe_call(call: object, stamps: dict | None) -> None:
    """A cached BoundCall (kernels/cuda/launch.py): f0 when y's way out starts (its pinned
    block: ``Workspace.y_block``, stamped on the call's workspace), f1 after its completion
    event's record; None: undo that."""
    ws = call.ws
    if stamps is None:
        if isinstance(call.done, _StampedEvent):
            call.done = call.done.ev
            ws.__dict__.pop("y_block", None)
        return
    if isinstance(call.done, _StampedEvent):
        return
    block = type(ws).y_block

    def stamped(n: int) -> object:
        stamps["f0"] = time.perf_counter()
        return block(ws, n)

    ws.y_block = stamped  # (an instance attribute over the method: removed to undo)
    call.done = _StampedEvent(call.done, stamps)


def _probe(be: CudaBackend, w: ResidentWeight, stamps: dict | None) -> None:
    """``stamps`` a dict: time-stamp the graph launches of ``w``'s bound sequences, the
    launcher's ``_finish`` (y's way out, enqueued after the launch) and the cached calls' way
    out (``_probe_call``); None: undo that."""
    from q6serve.kernels.cuda.launch import BoundCall

    lc = be.launcher
    for b in w.data.plans.values():
        if isinstance(b, BoundCall):
            _probe_call(b, stamps)
        elif stamps is not None and b.graph and not isinstance(b.graph, _Stamped):
            b.graph = _Stamped(b.graph, stamps)
        elif stamps is None and isinstance(b.graph, _Stamped):
            b.graph = b.graph.graph
    if stamps is None:
        lc.__dict__.pop("_finish", None)
        return
    orig = type(lc)._finish.__get__(lc)

    def finish(*args: object, **kw: object) -> object:
        stamps["f0"] = time.perf_counter()
        r = orig(*args, **kw)
        stamps["f1"] = time.perf_counter()
        return r

    lc._finish = finish


def _hook_events(be: CudaBackend, w: ResidentWeight, sink: dict | None) -> None:
    """``sink`` a dict: every kernel-time read of ``w``'s calls (a cached BoundCall's, the
    launcher's) leaves its (start, end) events in ``sink["ev"]``, so the staged mode can place
    them in the GPU's span of the call; None: undo that."""
    from q6serve.kernels.cuda.launch import BoundCall

    lc = be.launcher
    for b in w.data.plans.values():
        if not isinstance(b, BoundCall):
            continue
        orig = getattr(b._elapsed, "__wrapped__", b._elapsed)
        b._elapsed = orig if sink is None else _recording(orig, sink)
    if sink is None:
        lc.__dict__.pop("_seconds", None)
    elif "_seconds" not in lc.__dict__:
        lc._seconds = _recording(type(lc)._seconds.__get__(lc), sink)


def _recording(f: Any, sink: dict) -> Any:
    def rec(start: object, end: object) -> object:
        sink["ev"] = (start, end)
        return f(start, end)

    rec.__wrapped__ = f
    return rec


def load(be: CudaBackend, blocks: np.ndarray, rows: int, k: int,
         slab_rows: int = 0) -> ResidentWeight:
    """``blocks`` resident on ``be`` (SoA), in slabs of ``slab_rows`` rows (0: storage's
    default slabs, a tall weight of one slab's size in two: ``storage.TWO_SLAB_MIN_ROWS``;
    -P: P slabs of ceil(rows / P) rows rounded up to 16)."""
    from q6serve.kernels.cuda import storage

    old = storage.SLAB_BYTES, storage.TWO_SLAB_MIN_ROWS
    if slab_rows < 0:
        slab_rows = -(-rows // (-16 * slab_rows)) * 16
    if slab_rows:
        storage.SLAB_BYTES = slab_rows * q6k.aos_nbytes(1, k)
        storage.TWO_SLAB_MIN_ROWS = 0
    try:
        return be.load(iter_aos_chunks(blocks, rows, k, 64 << 20), rows, k, Layout.SOA,
                       64 << 20)
    finally:
        storage.SLAB_BYTES, storage.TWO_SLAB_MIN_ROWS = old


def chunks_of(be: CudaBackend, w: ResidentWeight, n: int,
              state: int) -> list[tuple[int, int]] | None:
    """The row chunks (launch.Y_CHUNKS, or the weight's own) of ``w``'s bound sequences at
    N = ``n`` under the chunk state ``state`` (Launcher.chunks_for: C > 1), if any."""
    if state < 2:
        return None
    want = ("rows", state)
    for key, b in w.data.plans.items():
        if (isinstance(key, tuple) and len(key) in (6, 7) and key[2] == n and key[4] == want
                and hasattr(b, "extra")):
            got = b.extra.get("chunks")
            if got:
                return [(r0, r1) for r0, r1, _ in got]
    return None


def tokens_of(w: ResidentWeight, n: int, state: int) -> dict | None:
    """The token halves (launch.X_SPLIT_MIN, X_SPLIT_Y_MIN) of ``w``'s bound sequences at
    N = ``n`` under the chunk state ``state`` (Launcher.chunks_for: -2 halves, -2 C halves in
    C row chunks each), if any: {"tokens": [(t0, t1)], "rows": [(t0, t1, r0, r1)] (the parts of
    X_SPLIT_ROWS; empty: halves whole), "graph": whether the sequence is a captured graph}."""
    if state > -2:
        return None
    want = ("tokens", 2) if state == -2 else ("tokens", 2, -state // 2)
    for key, b in w.data.plans.items():
        if (isinstance(key, tuple) and len(key) == 6 and key[2] == n and key[4] == want
                and hasattr(b, "extra") and b.extra.get("tokens")):
            return {"tokens": list(b.extra["tokens"]), "rows": b.extra.get("token_rows", []),
                    "graph": bool(b.graph)}
    return None


# the engine's kernel flags object (service/engine.py _FLAGS: one object per flag state, so a
# cached call's identity checks hold as in the worker)
ENGINE_FLAGS = KernelFlags()


def measure(be: CudaBackend, w: ResidentWeight, xs: list[np.ndarray], calls: int, mode: str,
            topk: int = 0, probe: bool = False, fill: str = "copy", parts: bool = False,
            precision: Precision | None = None, out: np.dtype | None = None) -> dict:
    """``precision`` given: every call goes through ``api.launch_ieee`` at that precision with
    one flags object, as the worker's batcher calls the backend (service/engine.py); None: the
    backend's ``launch`` / ``matmul`` at its default (AUTO), as before."""
    import cupy as cp

    from q6serve.kernels.api import launch_ieee
    from q6serve.kernels.cuda.launch import fill_x

    walls, kerns, fills, spans, lts, loops = [], [], [], [], [], []
    gpu: dict[str, list[float]] = {"pre": [], "tail": [], "y1": []}  # staged: the span's parts
    stamps: dict = {}
    seen: dict = {}  # the kernel time's events of the last call (_hook_events)
    ey = cp.cuda.Event()
    parts: dict[str, list[float]] = {"pre": [], "graph": [], "mid": [], "finish": [],
                                     "rest": [], "post": []}
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    rows_of = {id(x): [x[j : j + 1].copy() for j in range(len(x))] for x in xs}
    for i in range(calls + 5):
        x = xs[i % len(xs)]
        if probe and mode == "staged" and i == 5:  # bound and captured by now
            _probe(be, w, stamps)
        if mode == "staged" and i == 5:
            _hook_events(be, w, seen)
        t0 = time.perf_counter()
        if mode == "naive":
            _, ks = naive_call(be, w, x)
        elif mode == "staged":  # x built in the upload buffer by the caller (its concat)
            t0 = time.perf_counter()
            st = be.staging(*x.shape, x.dtype)
            if fill == "concat":  # the batcher's: one request a row, concatenated into it
                np.concatenate(rows_of[id(x)], out=st)
            else:  # (launch.NT_FILL_MIN: by non-temporal stores from that size on)
                fill_x(st.reshape(-1).view(np.uint8), x)
            fills.append((time.perf_counter() - t0) * 1e6)
            t00 = time.perf_counter()  # (the loop's own time, bench events included: ``loop``)
            e0.record(be.stream)  # the GPU's span of the call: from here to after its last copy
            t0 = time.perf_counter()  # the wall: launch .. the result (no bench event in it)
            launched = (be.launch(w, st, topk=topk, out_dtype=out) if precision is None else
                        launch_ieee(be, w, st, precision=precision, flags=ENGINE_FLAGS,
                                    topk=topk, out_dtype=out))
            t1 = time.perf_counter()  # the host's launch (its part before the GPU starts)
            e1.record(be.stream)
            ys = be.launcher._y_stream  # (a split call's first part's y goes down on it)
            if parts and ys is not None:
                ey.record(ys)
            res = launched.wait()
            ks = res.timing.seconds(wait=True)
            t2 = time.perf_counter()
            if i >= 5:
                lts.append((t1 - t0) * 1e6)
            if probe and i >= 5 and "g1" in stamps:  # (a small y: no _finish)
                f0, f1 = stamps.get("f0", stamps["g1"]), stamps.get("f1", stamps["g1"])
                for name, a_, b_ in (("pre", t0, stamps["g0"]),
                                     ("graph", stamps["g0"], stamps["g1"]),
                                     ("mid", stamps["g1"], f0), ("finish", f0, f1),
                                     ("rest", f1, t1)):
                    parts[name].append((b_ - a_) * 1e6)
                if "s1" in stamps:  # the wait's return from the sync to the result read
                    parts["post"].append((t2 - stamps["s1"]) * 1e6)
            stamps.clear()
            ks = float("nan") if ks is None else ks
            if i >= 5:
                e1.synchronize()  # (a launch's own wait may end before an event after it)
                spans.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
                loops.append((time.perf_counter() - t00) * 1e6)
                if "ev" in seen:  # launch .. the kernels' start, their end .. the last copy
                    start, end = seen.pop("ev")
                    gpu["pre"].append(cp.cuda.get_elapsed_time(e0, start) * 1e3)
                    gpu["tail"].append(cp.cuda.get_elapsed_time(end, e1) * 1e3)
                    if parts and ys is not None:  # launch .. the first part's y landed
                        ey.synchronize()
                        gpu["y1"].append(cp.cuda.get_elapsed_time(e0, ey) * 1e3)
            wall = t2 - t0
        else:
            res = (be.matmul(w, x, topk=topk, out_dtype=out) if precision is None else
                   launch_ieee(be, w, x, precision=precision, flags=ENGINE_FLAGS,
                               topk=topk, out_dtype=out).wait())
            ks = res.timing.seconds(wait=True)
            ks = float("nan") if ks is None else ks  # no figure: shows as nan, run goes on
            wall = time.perf_counter() - t0
        if i >= 5:  # warm-up: compile, bind, capture
            walls.append(wall * 1e6)
            kerns.append(ks * 1e6)
    if probe and mode == "staged":
        _probe(be, w, None)
    if mode == "staged":
        _hook_events(be, w, None)
    host = sorted(a - b for a, b in zip(walls, kerns, strict=True))
    return {"probe": {k: statistics.median(v) for k, v in parts.items() if v} or None,
            "wall_p50": statistics.median(walls), "kernel_p50": statistics.median(kerns),
            "host_p50": statistics.median(host), "host_p90": host[int(0.9 * (len(host) - 1))],
            "fill_p50": statistics.median(fills) if fills else None,
            "span_p50": statistics.median(spans) if spans else None,
            "launch_p50": statistics.median(lts) if lts else None,
            "loop_p50": statistics.median(loops) if loops else None,
            **{f"{k}_p50": statistics.median(v) if v else None for k, v in gpu.items()}}


MANY = {"qkv": ((3584, 3584), (512, 3584), (512, 3584)), "gateup": ((18944, 3584),) * 2}
MANY_WAYS = ("parts", "pipe", "many")


def many_groups(spec: str) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """``--many``'s groups: preset names or ``NAME=RxK+RxK...``, comma separated."""
    out = []
    for g in filter(None, spec.split(",")):
        name, _, shapes = g.partition("=")
        if not shapes:
            out.append((name, MANY[name]))
            continue
        out.append((name, tuple(tuple(map(int, sh.split("x"))) for sh in shapes.split("+"))))
    return out


def many_call(be: CudaBackend, ws: list[ResidentWeight], x: np.ndarray, way: str,
              out: np.dtype | None = None) -> list:
    """One multi-weight call ``way`` (MANY_WAYS; "many:LABEL" is "many"): the parts'
    MatmulResults, in order."""
    if way.startswith("many"):
        return be.launch_many(ws, x, out_dtype=out).wait()
    if way == "parts":
        return [be.launch(w, x, out_dtype=out).wait() for w in ws]
    slots, done, pending = be.now_slots, [], []  # "pipe": service/multi.py's _launch_parts
    for i, w in enumerate(ws):
        if len(pending) >= slots:
            done.append(pending.pop(0).wait())
        # (a staged x is the first part's upload buffer: the others copy it, as any x)
        pending.append(be.launch(w, x if i == 0 else x.view(), out_dtype=out))
    return done + [p.wait() for p in pending]


def measure_many(be: CudaBackend, ws: list[ResidentWeight], xs: list[np.ndarray], calls: int,
                 way: str, staged: bool, out: np.dtype | None = None) -> dict:
    walls, kerns = [], []
    for i in range(calls + 5):
        x = xs[i % len(xs)]
        if staged:
            st = be.staging(*x.shape, x.dtype)
            st[...] = x
            x = st
        t0 = time.perf_counter()
        res = many_call(be, ws, x, way, out)
        secs = [r.timing.seconds(wait=True) for r in res]
        wall = time.perf_counter() - t0
        if i >= 5:
            walls.append(wall * 1e6)
            kerns.append(sum(float("nan") if s is None else s for s in secs) * 1e6)
    host = sorted(a - b for a, b in zip(walls, kerns, strict=True))
    return {"wall_p50": statistics.median(walls), "kernel_p50": statistics.median(kerns),
            "host_p50": statistics.median(host), "host_p90": host[int(0.9 * (len(host) - 1))]}


def run_many(a: argparse.Namespace, variants: list[tuple[str, dict[str, int]]],
             apply: Any) -> int:
    """``--many``: per (group, N) the three ways alternated (``many`` once per variant of
    ``--variants``, its constants applied by ``apply``), then a summary table."""
    be = CudaBackend(0)
    out_dt = None if a.many_out == "f32" else DTYPES[a.many_out]
    many_ways = [f"many:{lb}" if lb else "many" for lb, _ in variants]
    sets_of = {w: sets for w, (_, sets) in zip(many_ways, variants, strict=True)}
    ways = ["parts", "pipe", *many_ways]
    rng = np.random.default_rng(0)
    out: list[dict] = []
    print(f"# device: {be.device_name()}  date: {time.strftime('%Y-%m-%d')}  multi-weight calls, "
          f"activations {a.dtype}, y {a.many_out}, {a.calls} calls per row, {a.rounds} rounds, x "
          f"{'staged' if a.many_staged else 'fresh'} (us)")
    print(f"{'group':>8} {'N':>3} {'way':>10} {'wall p50':>9} {'kernel p50':>10} {'host p50':>9} "
          f"{'host p90':>9} equal")
    for name, shapes in many_groups(a.many):
        ws = [load(be, random_blocks(rng, r, k), r, k) for r, k in shapes]
        k = shapes[0][1]
        for n in map(int, a.ns.split(",")):
            xs = [rng.standard_normal((n, k)).astype(DTYPES[a.dtype]) for _ in range(4)]
            ref = [r.y for r in many_call(be, ws, xs[0], "parts", out_dt)]
            for rnd in range(a.rounds):
                for way in (ways if rnd % 2 == 0 else ways[::-1]):
                    apply(sets_of.get(way, {}))
                    if any("COPY_KERNEL_MAX" in v for v in sets_of.values()):
                        be.launcher.ws.gen += 1  # (the copies' way is bound: rebind)
                    r = measure_many(be, ws, xs, a.calls, way, a.many_staged, out_dt)
                    # (after calls on other x: a copy that ran before its kernels would show)
                    got = [p.y for p in many_call(be, ws, xs[0], way, out_dt)]
                    apply({})
                    eq = all(np.array_equal(g, f) for g, f in zip(got, ref, strict=True))
                    r.update(group=name, n=n, way=way, round=rnd, equal=eq)
                    out.append(r)
                    print(f"{name:>8} {n:>3} {way:>10} {r['wall_p50']:9.1f} "
                          f"{r['kernel_p50']:10.1f} {r['host_p50']:9.1f} {r['host_p90']:9.1f} "
                          f"{'yes' if eq else 'NO'}",
                          flush=True)
        for w in ws:
            be.free(w)
    print("# multi-weight summary (median over rounds: wall / host p50, us; equal over all):")
    print(f"{'group':>8} {'N':>3} " + " ".join(f"{w:>15}" for w in ways) + "  many/parts each")
    keys = dict.fromkeys((r["group"], r["n"]) for r in out)
    for g, n in keys:
        cells, walls = [], {}
        for way in ways:
            rs = [r for r in out if (r["group"], r["n"], r["way"]) == (g, n, way)]
            walls[way] = statistics.median(r["wall_p50"] for r in rs)
            host = statistics.median(r["host_p50"] for r in rs)
            eq = "" if all(r["equal"] for r in rs) else "!"
            cells.append(f"{walls[way]:7.1f}/{host:6.1f}{eq}")
        print(f"{g:>8} {n:>3} " + " ".join(f"{c:>15}" for c in cells)
              + "  " + " ".join(f"{walls[w] / walls['parts']:.3f}" for w in many_ways), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": be.device_name(), "results": out}, fh, indent=1)
    return 0 if all(r["equal"] for r in out) else 1


def floor(be: CudaBackend, x_bytes: int, n: int, rows: int, calls: int) -> dict:
    """Median µs of an x-sized upload and a y-sized download (f32 [n, rows]; pinned, CUDA
    events), of the same y as two 2D copies of its column halves (``d2h_cols``: the row
    chunks' way out, point 8) and as two copies of its token halves (``d2h_toks``; as 2D
    copies of whole rows, ``d2h_toks2d``: the token halves' way out, point 10), each pair back
    to back on one stream, and of an empty
    ``stream.synchronize()`` (wall)."""
    import cupy as cp

    y_bytes = 4 * n * rows
    stream, rt = be.stream, cp.cuda.runtime
    with be.ctx.dev, stream:
        hx, hy = cp.cuda.alloc_pinned_memory(x_bytes), cp.cuda.alloc_pinned_memory(y_bytes)
        dx, dy = cp.empty(x_bytes, cp.uint8), cp.empty(y_bytes, cp.uint8)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        got: dict[str, list[float]] = {"h2d": [], "d2h": [], "d2h_cols": [], "d2h_toks": [],
                                       "d2h_toks2d": [], "sync": []}
        c0 = 4 * (rows // 2)  # the first column block's bytes per token
        th = n // 2 * 4 * rows  # the first token half's bytes
        cols = [(0, 0, c0), (c0, n * c0, 4 * rows - c0)]  # (host off, device off, width)
        for i in range(calls + 5):
            for name in got:
                if name == "sync":
                    continue
                start.record(stream)
                if name == "h2d":
                    rt.memcpyAsync(dx.data.ptr, hx.ptr, x_bytes, 1, stream.ptr)
                elif name == "d2h":
                    rt.memcpyAsync(hy.ptr, dy.data.ptr, y_bytes, 2, stream.ptr)
                elif name == "d2h_toks":
                    for off, nb in ((0, th), (th, y_bytes - th)):
                        rt.memcpyAsync(hy.ptr + off, dy.data.ptr + off, nb, 2, stream.ptr)
                elif name == "d2h_toks2d":  # the same as 2D copies of whole rows (point 10's)
                    for off, nb in ((0, th), (th, y_bytes - th)):
                        rt.memcpy2DAsync(hy.ptr + off, 4 * rows, dy.data.ptr + off, 4 * rows,
                                         4 * rows, nb // (4 * rows), 2, stream.ptr)
                else:  # [n, width] device blocks into their columns of the host [n, rows]
                    for hoff, doff, width in cols:
                        rt.memcpy2DAsync(hy.ptr + hoff, 4 * rows, dy.data.ptr + doff, width,
                                         width, n, 2, stream.ptr)
                end.record(stream)
                end.synchronize()
                if i >= 5:
                    got[name].append(cp.cuda.get_elapsed_time(start, end) * 1e3)
            t0 = time.perf_counter()
            stream.synchronize()
            if i >= 5:
                got["sync"].append((time.perf_counter() - t0) * 1e6)
    return {k: statistics.median(v) for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(f"{r}x{k}" for r, k in SHAPES))
    ap.add_argument("--ns", default="1,8,64")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--dtype", default="f16", choices=sorted(DTYPES))
    ap.add_argument("--modes", default="graph,staged,direct,naive")
    ap.add_argument("--topk", type=int, default=0, help="top-k epilogue k (0: y)")
    ap.add_argument("--floor", action="store_true",
                    help="also time x's upload, y's download and an empty sync alone")
    ap.add_argument("--small-y-f32", type=int, default=None,
                    help="launch.SMALL_Y_F32 for this run (bytes: an f32 y up to it is "
                    "downloaded by the launch sequence and copied out after the sync)")
    ap.add_argument("--variants", default="",
                    help="in-process A/B of the host path's constants: 'LABEL[:NAME=INT,...]' "
                    "separated by ';' (NAME a constant of kernels/cuda/launch.py, or SLAB_ROWS: "
                    "the variant's own copy of the weight in slabs of that many rows; or "
                    "PRECISION: its calls through api.launch_ieee at it), measured "
                    "in turn for every (shape, N), --rounds times")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--y-chunks", type=int, default=None,
                    help="launch.Y_CHUNKS for this run (row chunks of a large y, downloaded "
                    "while the next chunk computes; needs weights of several slabs: "
                    "--slab-rows or a variant's SLAB_ROWS)")
    ap.add_argument("--slab-rows", type=int, default=0,
                    help="rows per resident slab of the loaded weights (0: storage's "
                    "SLAB_BYTES); a variant may set its own SLAB_ROWS (each value its own "
                    "copy of the weight)")
    ap.add_argument("--probe", action="store_true",
                    help="staged: the host's clock around the graph launch and y's way out "
                    "(Launcher._finish: the full path only, a cached BoundCall has its own): "
                    "pre (to the graph launch), graph, mid, finish (y's way out and the "
                    "event), rest (to launch's return), post (a cached call's sync returned .. "
                    "the result read)")
    ap.add_argument("--parts", action="store_true",
                    help="staged: also an event on the y copy stream after the launch, read as "
                    "when a split call's first part's y has landed (one more host call in the "
                    "wall)")
    ap.add_argument("--fill", default="copy", choices=("copy", "concat"),
                    help="staged: how x is written into the staging buffer: one copy, or "
                    "np.concatenate of its rows as separate arrays (service/batcher.py's fill "
                    "of a batch of one-row requests)")
    ap.add_argument("--many", default="",
                    help="multi-weight calls: groups (qkv, gateup, NAME=RxK+RxK...), comma "
                    "separated; the parts' launches in turn, pipelined, and launch_many, "
                    "alternated (--ns, --calls, --rounds, --dtype apply)")
    ap.add_argument("--many-staged", action="store_true",
                    help="--many: x built in CudaBackend.staging (the fill not in the wall)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out-dtype", default="f32", choices=("f32", "f16"),
                    help="the single calls' y dtype (f16: a small y converted on the device, "
                    "launch.Y16_COPY's way out)")
    ap.add_argument("--many-out", default="f32", choices=("f32", "f16"),
                    help="--many: the calls' y dtype")
    a = ap.parse_args(argv)
    from q6serve.kernels.cuda import launch

    if a.small_y_f32 is not None:
        launch.SMALL_Y_F32 = a.small_y_f32
    if a.y_chunks is not None:
        launch.Y_CHUNKS = a.y_chunks
    variants: list[tuple[str, dict[str, int]]] = []
    precisions: dict[str, Precision | None] = {}  # a variant's PRECISION (None: not given)
    for spec in filter(None, a.variants.split(";")):
        label, _, sets = spec.partition(":")
        pairs = [kv.split("=") for kv in filter(None, sets.split(","))]
        prec = [v for k, v in pairs if k == "PRECISION"]
        try:
            precisions[label] = Precision(prec[-1]) if prec else None
        except ValueError:
            ap.error(f"--variants: PRECISION={prec[-1]!r}: one of "
                     f"{', '.join(p.value for p in Precision)}")
        variants.append((label, {k: int(float(v)) for k, v in pairs if k != "PRECISION"}))
    variants = variants or [("", {})]
    unknown = {k for _, sets in variants for k in sets
               if k not in LOCAL_KEYS and not hasattr(launch, k)}
    if unknown:
        ap.error(f"--variants: no constant {', '.join(sorted(unknown))} in kernels/cuda/launch.py")
    defaults = {k: getattr(launch, k) for _, sets in variants for k in sets
                if k not in LOCAL_KEYS}
    slab_sets = sorted({sets.get("SLAB_ROWS", a.slab_rows) for _, sets in variants})

    def apply(sets: dict[str, int]) -> None:
        for k, v in {**defaults, **sets}.items():
            if k not in LOCAL_KEYS:
                setattr(launch, k, v)

    if a.many:
        return run_many(a, variants, apply)
    modes = a.modes.split(",")
    ydt = None if a.out_dtype == "f32" else np.dtype(np.float16)
    bes = {"graph": CudaBackend(0), "direct": CudaBackend(0, graphs=False)}
    bes["naive"] = bes["direct"]
    bes["staged"] = bes["graph"]
    rng = np.random.default_rng(0)
    out = []
    print(f"# device: {bes['graph'].device_name()}  date: {time.strftime('%Y-%m-%d')}  "
          f"activations: {a.dtype}, {f'top-{a.topk}' if a.topk else 'y ' + a.out_dtype}, "
          f"{a.calls} calls per row (us), fill: {a.fill}")
    print(f"{'shape':>12} {'N':>3} {'mode':>7} {'wall p50':>9} {'kernel p50':>10} "
          f"{'host p50':>9} {'host p90':>9}")
    for shape_s in a.shapes.split(","):
        rows, k = map(int, shape_s.split("x"))
        blocks = random_blocks(rng, rows, k)
        ws = {}
        for m in modes:
            be = bes[m]
            for sr in slab_sets:
                if (id(be), sr) not in ws:
                    ws[id(be), sr] = load(be, blocks, rows, k, sr)
        for n in map(int, a.ns.split(",")):
            xs = [rng.standard_normal((n, k)).astype(DTYPES[a.dtype]) for _ in range(4)]
            b0 = bes[modes[0]]  # y of xs[0] under the defaults: each row's y is checked on it
            ref = (None if a.topk else
                   b0.matmul(ws[id(b0), variants[0][1].get("SLAB_ROWS", a.slab_rows)], xs[0],
                             out_dtype=ydt).y)
            # (the variants' order reversed every other round: a drift weighs on all alike)
            for rnd, (label, sets), m in ((i, v, m) for i in range(a.rounds)
                                          for v in (variants[::-1] if i % 2 else variants)
                                          for m in modes):
                apply(sets)
                be = bes[m]
                # bound per variant (x's buffer, the halves' tiles, the copies' way): rebind
                if {"STAGING_WC_MIN", "X_SPLIT_FIT", "COPY_KERNEL_MAX", "Y16_COPY"} & set(defaults):
                    be.launcher.ws.gen += 1
                w = ws[id(be), sets.get("SLAB_ROWS", a.slab_rows)]
                if sets.get("ASK_PLAN"):  # (an instance attribute over the class's: removed)
                    from q6serve.kernels.api import Backend
                    be.no_q8_1 = Backend.no_q8_1 if hasattr(Backend, "no_q8_1") else frozenset()
                r = measure(be, w, xs, a.calls, m, a.topk, a.probe, a.fill, a.parts,
                            precisions.get(label), ydt)
                be.__dict__.pop("no_q8_1", None)
                # the split this row's calls took (an idle launcher, the staging slot)
                state = be.launcher.chunks_for(w.data, 0, n * rows, xs[0].nbytes, n)
                # (after calls on other x: a copy that ran before its kernels would show)
                r["equal"] = None if ref is None else bool(np.array_equal(
                    be.matmul(w, xs[0], out_dtype=ydt).y, ref))
                r.update(shape=shape_s, n=n, mode=m, dtype=a.dtype, topk=a.topk, fill=a.fill,
                         variant=label, round=rnd, chunks=chunks_of(be, w, n, state),
                         tokens=tokens_of(w, n, state))
                out.append(r)
                fill = f" (fill {r['fill_p50']:.1f})" if r["fill_p50"] is not None else ""
                if r["span_p50"] is not None:  # GPU span of launch..last copy vs the wall
                    fill += (f" gpu span {r['span_p50']:.1f} launch {r['launch_p50']:.1f}"
                             f" loop {r['loop_p50']:.1f}")
                    if r["pre_p50"] is not None:  # the span around the reported kernel
                        fill += f" (pre {r['pre_p50']:.1f} tail {r['tail_p50']:.1f})"
                if r["probe"]:
                    fill += " [" + " ".join(f"{k} {v:.1f}" for k, v in r["probe"].items()) + "]"
                tag = f" {label}" if label else ""
                if r["chunks"]:
                    tag += " chunks " + "/".join(str(r1 - r0) for r0, r1 in r["chunks"])
                if r["tokens"]:
                    tok = r["tokens"]
                    tag += " tokens " + "/".join(str(t1 - t0) for t0, t1 in tok["tokens"])
                    if tok["rows"]:
                        tag += " x rows " + "/".join(str(r1 - r0) for _, _, r0, r1 in tok["rows"])
                    if not tok["graph"]:
                        tag += " (not a graph)"
                if (r["chunks"] or r["tokens"]) and r["y1_p50"] is not None:
                    tag += f" (the y stream's copies done at {r['y1_p50']:.1f})"
                if r["equal"] is False:
                    tag += " y DIFFERS from the defaults'"
                print(f"{shape_s:>12} {n:>3} {m:>7} {r['wall_p50']:9.1f} {r['kernel_p50']:10.1f} "
                      f"{r['host_p50']:9.1f} {r['host_p90']:9.1f}{fill}{tag}", flush=True)
            apply({})
            if a.floor:
                f = floor(bes["graph"], xs[0].nbytes, n, rows, a.calls)  # y f32
                out.append({"shape": shape_s, "n": n, "mode": "floor", **f})
                print(f"{shape_s:>12} {n:>3} {'floor':>7} h2d {f['h2d']:.1f} ({xs[0].nbytes} B) "
                      f"d2h {f['d2h']:.1f} (2 column blocks {f['d2h_cols']:.1f}, 2 token "
                      f"halves {f['d2h_toks']:.1f}, as 2D {f['d2h_toks2d']:.1f}) sync "
                      f"{f['sync']:.1f}: host beyond the bus "
                      f"{r['host_p50'] - f['h2d'] - f['d2h']:.1f}", flush=True)
        for (bid, _), w in ws.items():
            next(b for b in bes.values() if id(b) == bid).free(w)
    if len(variants) > 1:  # per (shape, N, mode): each variant's host p50, median of rounds
        print("# variants (host p50, median over rounds; wall p50, kernel p50):")
        rows_: dict[tuple, dict[str, list[dict]]] = {}
        for r in out:
            if "variant" in r:
                rows_.setdefault((r["shape"], r["n"], r["mode"]), {}).setdefault(
                    r["variant"], []).append(r)
        for (shape_s, n, m), by in rows_.items():
            cells = [f"{v} {statistics.median(x['host_p50'] for x in rs):.1f} "
                     f"({statistics.median(x['wall_p50'] for x in rs):.1f}, "
                     f"{statistics.median(x['kernel_p50'] for x in rs):.1f})"
                     for v, rs in by.items()]
            print(f"{shape_s:>12} {n:>3} {m:>7}  " + "  ".join(cells), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": bes["graph"].device_name(), "results": out}, fh, indent=1)
    return 1 if any(r.get("equal") is False for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
