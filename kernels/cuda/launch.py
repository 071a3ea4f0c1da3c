"""How a call runs: launch plans, the per-backend buffers, the launch sequence and its timing;
this module holds the design (below) and the launch path's settings.

The settings: every measured threshold and switch (the constants below, each with the
measurement that set it), the environment variables that set some of them where a backend is
built (``*_from_env``), and the small rules that read them per call (x's fill into staging,
:func:`fill_x` / :func:`stage_into`; y's way out, :func:`_small_out` / :func:`many_out`). The
code that runs a call lives in the modules beside this one and reads the settings here per call
(``launch.NAME``), so a bench or test that sets ``launch.NAME`` reaches every reader:

- launcher.py ``Launcher``: one device's launcher, the direct job (entry points, launch slots,
  the unbound paths), made of the parts below;
- plans.py: ``LaunchPlan``, ``Step``, kernel names and shared memory, ``Planner`` (grid, K
  split, row chunks, token halves, steps);
- sequence.py: ``Bound``, ``Sequences`` (binding, graph capture, timing events);
- copies.py: ``Copies`` (x in, y out: copy engine or copy kernel);
- workspace.py: ``Workspace`` (the per-backend buffers and launch slots);
- bound_call.py ``BoundCall``, region_call.py ``RegionCall``, many.py ``ManyBound`` /
  ``ManyCall`` / ``ManyLaunches``: the cached calls (points 6, 7, 9);
- driver.py: the CUDA driver entry points called through ctypes.

Their names are also this module's (``launch.Launcher``, ``from .launch import RegionCall``):
it imports them last, once its settings are defined (the package imports this module first, so
a part is never imported before it).

``Launcher.plan`` turns (shape, layout, activation dtype, path, launch shape, N) into a
:class:`LaunchPlan` - kernel handles, grid with its K split, shared memory, prepass sizes - by
host arithmetic only (tests build every plan without a device). ``Launcher.matmul`` is the
host path of one batch:

1. x is copied into a pinned host buffer (unless the caller built it there:
   ``CudaBackend.staging``) and from there to a device buffer; both, the output and every
   prepass/partial-sum scratch, are :class:`Workspace` buffers allocated once per backend and
   grown to the largest call (no allocation per call);
2. the launch sequence of a (weight, N, dtype, path, shape) - H2D copy, start event, prepass,
   kernel, end event - is bound once to the workspace's pointers and cached on the weight
   (``CudaWeight.plans``); from its second call on it is a captured CUDA graph, one host call
   instead of four or five (falls back to direct launches if capture is refused);
3. the events sit around the kernel(s) only (recorded as external graph event nodes), so the
   reported time is the kernel's, not the copies' or Python's;
4. y goes device -> host after **one** stream synchronisation; the kernel time is read then
   (the events are complete). A small y (f16 <= ``SMALL_Y`` bytes, f32 <= ``SMALL_Y_F32``)
   is converted and copied into a pinned buffer of the workspace by the bound sequence itself
   (so a graph call is one host call for everything), then copied out on the host; a larger
   y (or bf16) goes into a pinned block that becomes the returned array (no host copy). The
   top-k epilogue (group form) is bound in the same way: its launches after the end event,
   its packed rows into the pinned buffer (an lm-head call is one graph launch and one sync).

5. up to ``SLOTS`` launches may be in flight (launched, their wait not yet called): each takes
   a slot with its own pinned staging and small-y buffers, bound sequences (graphs, timing
   events) and completion event, so a second batch can be launched while the first runs (the
   GPU never idles between two long batches: service/batcher.py's ``Device``); a wait
   synchronises on its own launch's completion event, not the whole stream.

6. once a call's bound sequence is a captured graph, ``CudaBackend.launch`` caches the call
   itself (:class:`BoundCall`, on the weight, per x shape/dtype, precision, flags, out dtype,
   top-k and slot): the next such call is a dict lookup, the graph launch, y's way out and the
   slot's event, then the sync and the result, with nothing re-checked that binding settled.
   The lookup itself is by (x's shape, slot) and the identity of the call's arguments first
   (``HOT_CALLS``, :meth:`BoundCall.same`), the keyed one only where that misses.

7. a call whose x and y lie at fixed page-locked host addresses (a fast lane's region places)
   and whose route asks for it becomes a :class:`RegionCall`: x's DMA, the kernels and y's
   DMA as one graph per slot (``Q6SERVE_REGION_STREAMS=1``: the copies on streams of their
   own, beside the kernels).

8. row chunks of a large y (``CudaWeight.y_chunks``: 2 for storage's two-slab weights, else
   none; ``Q6SERVE_Y_CHUNKS=C`` sets C for every weight, 0 turns them off): a call whose f32 (or
   bf16) y is ``Y_CHUNK_MIN`` bytes or more, whose tile is the register K-slice tile or the
   wgmma tile (``Y_CHUNK_SRCS``; the grid's rows done in rounds of ``gx x warps x 16`` rows;
   the wgmma tile also where point 10's rule by y would halve it: ``X_SPLIT_Y_SRCS``) and that is
   launched while no other launch is in flight on the launcher (``Y_CHUNKS_IDLE``: under load
   the chunks' extra GPU time is throughput lost, and the calls beside it overlap its copies
   anyway) runs as up to C launches on row chunks of the weight - runs of whole slabs (a view
   of the slab table: no kernel change), each one round of the full call's grid, with the full
   call's K split, so every y value is the full call's, bit for bit - each chunk writing its
   own [N, chunk rows] block of the device y;
   after the graph launch each chunk's block is DMA'd (a 2D copy into its columns of the host
   y) on a copy stream as soon as an event recorded after its kernels fires, so the download of
   chunk i runs while chunk i + 1 computes (the last chunk's on the backend's stream, right
   after its kernels). Weights of one slab are never chunked. H200, session 12
   (bench/RESULTS.md): 14336x4096 N=64 in 2 chunks on 512-row slabs, wall 160.4 -> 143.5 us;
   but 512-row slabs cost 18944x3584 N=1 up to 2.5%; session 13: two slabs cost nothing, and
   14336x4096 N=64 in two slabs and 2 chunks took 141.7 us of wall against 158.4 (storage's
   ``TWO_SLAB_MIN_ROWS``: tall weights of one slab's size are kept in two). Not built, for
   the wgmma tile's calls (4096x14336 N=64, no chunks): x uploaded in K slices beside the
   kernel - its grid is one wave of CTAs that take the same time whenever they start (latency
   bound, ~1.1 TB/s), so the last slice's CTAs would still end at x's arrival + one CTA's time.

9. a multi-weight call (one x, several weights of its K: q/k/v, gate/up;
   ``CudaBackend.launch_many``) is one sequence (:class:`ManyBound`): x's one upload, each
   part's launches (the steps its own launch would take, so its y is the same bit for bit)
   between its own events (part i's kernel time is events i .. i + 1), every part's f32 y
   adjacent in the workspace's y, y's f16 conversion, and one download - in the sequence for a
   small y (``many_out``), else one copy into a pinned block whose views the parts' results
   are - then the slot's event: one launch slot, one sync. It is bound per (weights, launch
   shapes, N, dtype, y's way out, slot), captured from its second call, and then cached as a
   :class:`ManyCall` in every part's plans (a relayout clears them, a freed weight has none:
   either ends it). Its device y is N x (the parts' rows together) x 4 bytes. No row chunks;
   a top-k epilogue, a part on cuBLAS or x in a pinned region take each part's launch in turn.

10. token halves of a call with a large x (``X_SPLIT_MIN`` bytes or more; idle, as the row
   chunks; not row-chunked; a K-slice tile, ``X_SPLIT_SRCS``): two launches on the first and
   the last tokens (runs of whole 8-token columns), each with the full call's K split, so every
   y value is the full call's, bit for bit (tokens are independent columns of the same sums);
   the first half's x is uploaded on the stream, then the stream forks to an x copy stream
   that uploads the second half while the first half computes (the stream waits for it before
   the second half's kernels; all inside the captured graph), and the first half's y rows are
   DMA'd on the y copy stream while the second half computes (as point 8's chunks). Each half
   reads the whole weight: the GPU time grows (the reported kernel time is both halves'), the
   wall shrinks where the bus dominates: H200, session 15, 4096x14336 N=64 (1.8 MB of x up, 1
   MiB of y down around a 44 us kernel) staged wall 150.3 -> 138.4 us for 63 us of kernels.
   A call with a large f32 y (``X_SPLIT_Y_MIN``) on the register K-slice tile
   (``X_SPLIT_Y_SRCS``; on the wgmma tile: point 8's row chunks) takes the halves before them,
   and with ``X_SPLIT_ROWS`` each half in the weight's own row chunks (each part its [tokens,
   chunk rows] block of the device y, DMA'd by a 2D copy into its place while the next part
   computes): 4 parts on a two-slab weight, y's download started after a quarter of the work:
   H200, session 16, 14336x4096 N=64 (3.7 MB of y, 70 us of DMA) staged wall 152.8 -> 141.3 us,
   18944x3584 N=64 182.2 -> 157.7 (kernels 54 -> 76, 50 -> 86 us).
   (Tried with it and not kept: the backend's own copy of an unstaged x in 4 parts on a thread
   pool, as NumPy's copy releases the GIL: 4096x14336 N=64 unstaged host 269.6 -> 402.6 us,
   14336x4096 N=32 83.7 -> 284.5: the hand-offs cost more than the copy.)

cuBLAS calls (N > 256, or the kill switch) run their dequant+GEMM sequence directly each time.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import cuda_topk
from ..api import BFLOAT16, env_switch
from . import hostcopy

# The driver entry points the launcher calls through this module (launch._external_record() in
# sequence.py, launch._driver_launch_ex() in plans.py, launch._host_device_ptr() in copies.py),
# so that a test replaces one here for every caller (the fake device has no driver).
from .driver import _driver_launch_ex as _driver_launch_ex
from .driver import _external_record as _external_record
from .driver import _host_device_ptr as _host_device_ptr

MATMUL_FILE = "q6k_matmul.cu"
WG_FILE = "q6k_wgmma.cu"  # the wgmma tile (src 8), built for sm_90a on compute capability 9.0
IN_TYPES = {np.dtype(np.float32): "InF32", np.dtype(np.float16): "InF16", BFLOAT16: "InBF16"}
SMEM_LIMIT = 47 << 10  # staged activations per CTA: 48 KiB (no opt-in) minus static smem
KS_SMEM_MAX = 227 << 10  # K-slice tiles (src 4, 7, 8): dynamic shared memory per CTA (sm_90 opt-in)
# Bytes in flight per SM that keep its share of HBM busy (4.8 TB/s / 132 SMs x ~1.3 us of
# loaded latency): the K-slice grid model charges an SM with fewer a proportionally lower rate.
KS_INFLIGHT = 48 << 10
CUBLAS_TILE_BYTES = 64 << 20  # f16 scratch per cuBLAS tile
GROW_SLACK = 64 << 20  # a workspace buffer grows to 2x its size unless that wastes more than this
# y bytes at most that the bound sequence converts and downloads itself (then copied out on the
# host, ~1 us per 16 KiB): a CuPy conversion plus a pinned block per call cost ~70 us of host
# time on the H200 machine; past this size the host copy would cost more than they do
SMALL_Y = 64 << 10
# the same for an f32 y (no conversion): past it y is DMA'd into a pinned block that becomes the
# returned array (enqueued after the graph launch, while the kernel runs) instead of copied out
# of the slot's buffer after the sync. H200, session 9, in one process: 14336x4096 N=1 (57 KiB of
# y) 15 us less host time that way, 4096x14336 N=1 (16 KiB) no gain (bench/RESULTS.md)
SMALL_Y_F32 = 32 << 10
# a large y (past SMALL_Y / SMALL_Y_F32) is DMA'd into a pinned block that becomes the returned
# array. Up to Y_BLOCKS such blocks are kept per backend (``Workspace.y_block``), each grown to
# the largest y it held, and one is reused once no array of its last result is left (its base
# array's reference count back to the pool's own), so a call takes no pinned block from CuPy's
# pool: in situ that block, its array and the copy cost 21 us a call (H200, session 19, the
# replay's S=8 gate/up, 303 KB of f16 y; docs/SERVICE.md). 0: CuPy's pool per call, as before.
Y_BLOCKS = 8


def slots_from_env(env: Any = None) -> int:
    """``Q6SERVE_LAUNCH_SLOTS`` (unset or empty: 3), 1..4: launches in flight at once on one
    launcher (read once, at import: the workspace's and RegionCall's per-slot state follow
    it). A ``launch_now`` pipeline (the fast lane's full batches, service/lane.py) may fill
    them all: a lane plan's region call has three GPU stages (x in, kernels, y out) that
    three calls in flight overlap (H200, session 12: T3 through lanes +13-24% over two,
    alternated); the batcher's own pipelines keep at most ``BATCH_SLOTS``."""
    raw = (os.environ if env is None else env).get("Q6SERVE_LAUNCH_SLOTS", "").strip()
    if not raw:
        return 3
    if not raw.isdigit() or not 1 <= int(raw) <= 4:
        raise ValueError(f"Q6SERVE_LAUNCH_SLOTS={raw!r}: a number of launches, 1 to 4")
    return int(raw)


SLOTS = slots_from_env()  # launches in flight at once on one launcher (module docstring, 5)
# of which the batcher's pipelines (service/batcher.py ``Device.launch_slots``: batches launched
# behind each other) take at most two, as measured; a launch_now pipeline takes all SLOTS
BATCH_SLOTS = min(SLOTS, 2)
# y's download beside the kernels (module docstring, point 8): a large f32/bf16 y of a K-slice
# tile call is computed in up to Y_CHUNKS row chunks (runs of whole slabs, one launch round of
# the full call's grid each, the full call's K split: bit-identical), chunk i's rows DMA'd on a
# copy stream while chunk i+1 computes. None: each weight's own (CudaWeight.y_chunks: 2 for
# storage's two-slab weights, else 0); 0/1: off; C: C for every weight (Q6SERVE_Y_CHUNKS
# overrides it where a backend is built; the wall bench's variants set it); only for a y of
# Y_CHUNK_MIN bytes or more: H200, session 13 (bench/RESULTS.md), two chunks on two slabs:
# 18944x3584 N=16 (1.2 MB of f32 y) kept its wall (90.9 vs 89.9 us) for 5.8 us more of kernels;
# 14336x4096 N=32 (1.8 MB) took 8 us less wall, 18944x3584 N=32 (2.4 MB) 11, 14336x4096 N=64
# (3.7 MB) 16.
Y_CHUNKS: int | None = None
Y_CHUNK_MIN = 3 << 19  # 1.5 MiB
# x's pinned staging buffer is write-combined for an x of this many bytes or more (a buffer of its
# own per slot, ``Workspace.host``): the fill (the caller's, into ``CudaBackend.staging``, or the
# backend's copy of an unstaged x) leaves the CPU's caches clean and x's DMA reads memory, as a
# fill with non-temporal stores did in session 9 (GLIBC_TUNABLES, process-wide: -15 us staged and
# -53 us unstaged at 4096x14336 N=64). CPU reads of such an x are uncached (slow): an explicit
# q8_1 call's non-finite scan (api.launch_ieee) reads it. 0: off. H200, session 14 (bundle B,
# 256 KiB, alternated, bench/RESULTS.md): an unstaged x (the backend's own copy) 4096x14336 N=64
# host 272.1 -> 247.9 us, 14336x4096 N=64 134.0 -> 130.6; a staged x (the caller's fill) 105.5
# -> 104.7 and 95.2 -> 93.2, N=32 within 1 us: the staged N=64 target is not moved, so it stays
# off (a gain for large unstaged x only, against the read cliff).
STAGING_WC_MIN = 0
# chunks only for a launch with no other launch in flight on its launcher (1; 0: always)
Y_CHUNKS_IDLE = 1
# x's upload beside the kernels by token halves (module docstring, point 10): an idle call
# (Y_CHUNKS_IDLE's rule) whose x is X_SPLIT_MIN bytes or more, of at most X_SPLIT_MAX_N tokens
# and not row-chunked, on a K-slice tile (X_SPLIT_SRCS), runs as two launches on the first and
# the last tokens with the full call's K split: x's second half goes up on a copy stream while
# the first half computes, and the first half's y goes down while the second computes. 0: off.
# X_SPLIT_FIT: the halves' tile narrowed to their tokens (nt: 8 token columns each), else the
# full call's. H200, session 15 (bundle A, 3 rounds alternated, bench/RESULTS.md): 4096x14336
# N=64 (1.75 MiB of f16 x) staged wall 150.3 -> 138.4 us (graph, an unstaged x: 311.6 -> 299.0)
# for 43.7 -> 63.3 us of kernels; N=32 (0.875 MiB) 98.3 -> 111.7 (worse: two 16-token kernels
# cost more than the 21 us of x they overlap), hence 1.5 MiB; the full call's tile on the halves
# (X_SPLIT_FIT 0) 154.5; bits equal (GPU test, 4096x14336 and 3584x18944). Session 21 (bundle B,
# H200, b127232, 3 rounds alternated): with 4096x14336 N=64 on src 8 (36-38 us whole, its halves
# 74.9) and its 1.8 MB x by the copy kernel (COPY_KERNEL_MAX 2 MiB), whole 130.4 us against the
# halves' 139.0 (whole by the copy engine 135.0), hence 2 MiB: 3584x18944 N=64 (2.4 MB of x)
# keeps its halves (152.0-153.1, whole 149.1-151.4).
X_SPLIT_MIN = 2 << 20  # 2 MiB
# ... and an idle call of 16 to X_SPLIT_MAX_N tokens whose f32 y is X_SPLIT_Y_MIN bytes or more
# (0: off), on such a tile, runs in token halves even where row chunks would apply, with
# X_SPLIT_ROWS (0: off) each half in the weight's own row chunks (CudaWeight.y_chunks): four
# parts on a two-slab weight, each part's y block DMA'd while the next computes, so y starts
# down after a quarter of the work (point 10). For 14336x4096 and 18944x3584, whose y (3.7 /
# 4.8 MB at N=64) takes longer to come down (70 / 91 us) than their kernels take (47 / 50).
# H200, session 16 (bundle A, 3 rounds alternated, bench/RESULTS.md), staged wall: 14336x4096
# N=64 row chunks 152.8, halves 149.4, halves x rows 141.3 us (the unsplit kernel 47.2: 94.1 over
# it, the limit 100); 18944x3584 N=64 182.2 / 169.6 / 157.7; at N=32 (1.8 / 2.4 MB) both lose to
# the row chunks (99.9 -> 113.2 / 120.7; 107.2 -> 112.9 / 113.5): two 16-token kernels cost more
# than the download they hide, hence 3 MiB. Bits equal (GPU tests). The 2D copies are not what
# cost: y down as two column blocks took 72.4 us against 69.9 in one copy.
X_SPLIT_Y_MIN = 3 << 20  # 3 MiB
X_SPLIT_ROWS = 1
X_SPLIT_MAX_N = 64
X_SPLIT_FIT = 1
X_SPLIT_SRCS = (4, 8)
# The tiles whose calls X_SPLIT_Y_MIN sends to token halves: the register K-slice tile (src 4),
# whose halves run its tile narrowed to their tokens (X_SPLIT_FIT). A call on another tile that
# the rule sends to halves (not X_SPLIT_MIN's: x is small) takes its weight's row chunks instead
# (point 8; the whole call where the weight has none): the wgmma tile's halves would each run
# its full 64-token tile over the whole weight, twice the weight's reads for one 32-token
# column each. Session 25 (k): 18944x3584 N=64 on src 8 in its two slab chunks (H200, bundle A,
# staged wall against src 4's 4 parts 1.004 at N=64, 1.082 at N=48; kernel 46.3 -> 41.2 us);
# 14336x4096 N=64 on src 8 w8 k4 in its two slab chunks (bundle D: wall 0.986 / 1.048 at N = 64
# / 48 against src 4's parts, kernel 41.4 -> 37.3 us; w12 k6 lost 0.979 in bundle A).
X_SPLIT_Y_SRCS = (4,)
# The wgmma tile's source: src 8 (kernels/cuda/q6k_wgmma.cu; session 21 removed src 6 and 9,
# which no table cell picked, and then the ring K-slice tile src 5, whose one cell went to src 8).
WG_SRCS = (8,)
# The tiles whose calls are chunked: the register K-slice tile (src 4) and, since session 25, the
# wgmma tile (src 8) for the two-slab weights' N=64 cells (each chunk re-stages its CTAs' K slices
# of 3-4 blocks, 96-128 KB at N=64, by cp.async beside the first weight loads).
# Session 12 left the wgmma tile (then src 6) out: 4096x14336 N=64 (then of 512-row slabs; one
# slab since session 13, so never chunked) in two chunks kept its wall (149-157 vs 150 us) for
# 8-10 us more of kernels (each chunk staged its CTAs' activation slices, up to 192 KB, again).
Y_CHUNK_SRCS = (4, 8)
# The K-slice tiles whose split-K sum Launcher.pdl launches with PDL: the register tile (src 4;
# with the ring tile src 5, since removed, every AUTO cell with a sum ran 1.00-1.04x on the H200,
# session 10, bench/RESULTS.md); the wgmma tile (then src 6) was mixed (0.975-1.032x), so its
# sum stays plain.
PDL_SRCS = (4,)
# q6k_sum_parts' SUM_VEC_MIN (q6k_matmul.cu, the same figure): from this many outputs on the
# sum adds four per thread (H200, session 20, bench/sum_ab.py: 1.02-1.53x there; below it the
# quarter-size grid ran 0.85-0.97x, so one float per thread as before)
SUM_VEC_MIN = 1 << 18
# CudaBackend.launch finds a repeated call's BoundCall by (x's shape, slot) and the identity of
# its arguments before the keyed lookup (BoundCall.same: no key tuple built and hashed, no
# dataclass or enum hash in Python); 0: the keyed lookup only (a bench's A/B). H200, session 25
# bundle B (b818352, 4 rounds alternated): staged wall 4096x14336 N=64 114.4 -> 111.5 us (every
# round), N=1 36.7 -> 36.3, 14336x4096 N=1 42.2 -> 41.1; the host's part before the graph launch
# 6.0 -> 4.3 us at N=64 (it runs on caches the staging fill has just cooled).
# ``Q6SERVE_HOT_CALLS`` (hot_calls_from_env, read once at import) sets it for a process, so a
# worker can be A/B'd without a code edit.


def hot_calls_from_env(env: Any = None) -> int:
    """``Q6SERVE_HOT_CALLS`` (unset or empty: 1; 0: off): ``CudaBackend.launch`` looks a
    repeated call up by (x's shape, slot) and the identity of its arguments first (HOT_CALLS).
    Read once, at import (the module constant the benches set); a bad value is refused there,
    and by the worker's start check (service/envvars.py)."""
    return int(env_switch("Q6SERVE_HOT_CALLS", env=env))


HOT_CALLS = hot_calls_from_env()
GRAPH_AFTER = 1  # direct calls of a bound sequence before it is captured (first: lazy loads)
MAX_PLANS_PER_WEIGHT = 256  # bound sequences cached per weight (distinct N x dtype x path)


def pdl_from_env(env: Any = None) -> bool:
    """``Q6SERVE_PDL`` (unset or empty: on). A kernels-level variable, read where a backend is
    built (the worker builds its backends at start, so a bad value stops it there), because the
    backend runs without the service too (bench, tests, library use)."""
    return env_switch("Q6SERVE_PDL", env=env)


def region_streams_from_env(env: Any = None) -> bool:
    """``Q6SERVE_REGION_STREAMS`` (unset or empty: on): a :class:`RegionCall` launched beside
    another launch in flight moves x and y on copy streams of their own (per-slot device
    buffers), so its copies overlap the kernels of the call beside it. Read where a backend is
    built, as ``Q6SERVE_PDL``."""
    return env_switch("Q6SERVE_REGION_STREAMS", env=env)


def timing_anchor_from_env(env: Any = None) -> int:
    """``Q6SERVE_TIMING_ANCHOR`` (unset or empty: 1; 0: off): 1, a captured sequence launches an
    empty one-thread kernel between x's upload and its start event
    (:meth:`Launcher._anchor_step`), so the upload's hand-off to the kernels' engine lands
    before the start event, not inside the kernel time; 2, also one after its end event
    (before y's download). Read where a backend is built, as ``Q6SERVE_PDL``."""
    raw = (os.environ if env is None else env).get("Q6SERVE_TIMING_ANCHOR", "").strip()
    if not raw:
        return 1  # (H200, session 17, bundle C: docs/SERVICE.md "The kernel time a reply reports")
    if raw not in ("0", "1", "2"):
        raise ValueError(f"Q6SERVE_TIMING_ANCHOR={raw!r}: 0, 1 or 2")
    return int(raw)


ANCHOR_SRC = 'extern "C" __global__ void q6_timing_anchor() {}'

# x's upload and a small y's download by a kernel on the kernels' engine instead of a copy-engine
# node (COPY_KERNEL_MAX, Q6SERVE_COPY_KERNEL_MAX): page-locked host memory from cudaHostAlloc is
# the device's to read and write at the same address under unified addressing. H200, session 17
# (bench/kernel_gap.py g-zc, T1's 3584x18944 N=1 f16 graph): GPU span 40.8 -> 31.1 us, host wall
# 45.7 -> 36.3, and no copy engine's hand-off inside the kernel's events. 16-byte words (both
# addresses 16-byte aligned, else the copy engine), the last n % 16 bytes one a thread.
COPY_SRC = r"""extern "C" __global__ void q6_copy(const unsigned char* __restrict__ src,
                                        unsigned char* __restrict__ dst, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x, words = n >> 4;
    for (long long j = i; j < words; j += stride)
        reinterpret_cast<int4*>(dst)[j] = reinterpret_cast<const int4*>(src)[j];
    if (i < (n & 15)) dst[(words << 4) + i] = src[(words << 4) + i];
}"""
# A small f16 y's way out in one kernel (Y16_COPY): the workspace's f32 y converted to f16 (PTX
# cvt.rn.f16.f32: IEEE round to nearest even, CuPy's conversion's bits but a NaN's payload) and
# written straight into the pinned out buffer, 8 values (16 bytes) a thread and step, the last
# n % 8 one a thread; in place of CuPy's conversion kernel into "y16b" and then COPY_SRC's copy:
# one kernel node fewer in every small-f16-y graph (the decode's usual call), on the GPU after
# the end event (not kernel time), serial with the call's wait.
COPY_H_SRC = r"""__device__ __forceinline__ unsigned int q6_h2(float lo, float hi) {
    unsigned short l, h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(hi));
    return (unsigned int)l | ((unsigned int)h << 16);
}
extern "C" __global__ void q6_copy_h(const float* __restrict__ src,
                                     unsigned short* __restrict__ dst, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x, words = n >> 3;
    for (long long j = i; j < words; j += stride) {
        const float4 a = reinterpret_cast<const float4*>(src)[2 * j];
        const float4 b = reinterpret_cast<const float4*>(src)[2 * j + 1];
        uint4 o;
        o.x = q6_h2(a.x, a.y);
        o.y = q6_h2(a.z, a.w);
        o.z = q6_h2(b.x, b.y);
        o.w = q6_h2(b.z, b.w);
        reinterpret_cast<uint4*>(dst)[j] = o;
    }
    if (i < (n & 7)) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(src[(words << 3) + i]));
        dst[(words << 3) + i] = h;
    }
}"""
# 1: a small f16 y leaves by COPY_H_SRC where the copy kernel would copy it (copy_limit, 16-byte
# aligned addresses); 0: conversion kernel, then the copy. Read when a sequence is bound (a
# bench's variants rebind: bench/backend_wall.py, bench/layer_wall.py). H200, session 27 bundle
# B (bench/layer_wall.py, 3 layers S=1 f16, 4 rounds alternated, y bit-equal): the GPU's tail
# after the kernel 5.0 -> 3.6 us; host (wall - kernel) o 20.2 -> 18.9 / 22.2 -> 20.9 us (parts /
# launch_many), down 23.4 -> 22.0 / 25.5 -> 24.2, q+k+v 60.4 -> 54.7 / 32.6 -> 30.9, gate+up in
# parts 45.7 -> 41.2 (with 150 us of host work between calls 0-2 us, 9 of 10 cells less)
Y16_COPY = 1
COPY_THREADS = 256
COPY_MAX_BLOCKS = 264  # 2 a SM on the H200: a larger copy loops (reads of host memory in flight)
# copies of at most this many bytes go by COPY_SRC (0: none, the copy engine, as before session
# 18); Q6SERVE_COPY_KERNEL_MAX overrides it where a backend is built. H200, session 18 bundle A
# (ca37662, bench/gpu_hp_s18a.sh): 3584x18944 N=1 f16 host (wall - kernel) 30.0 -> 18.0 us
# staged, 31.6 -> 20.9 fresh x, GPU span 45.1 -> 33.6, the kernel 21.5 either way; N=64 unchanged
# (its x is in token halves, the copy engine's; its y is not small). Bundle C (ebf82f2,
# gpu_hp_s18c.sh): 1 MiB against 64 KiB, x of N=2..16 (76-606 KB) by the kernel too, staged host
# 3584x18944 N=2/4/8/16 36.2/48.5/51.3/74.1 -> 31.3/40.0/50.2/67.0 us, 4096x14336 N=4/8/16
# 44.1/48.5/60.9 -> 34.6/41.4/55.6, kernels unchanged, y equal. Session 21 (bundle B, b127232,
# with X_SPLIT_MIN 2 MiB): 2 MiB, x of N=64 at K=14336 (1.8 MB, now whole) and N=32 at K=18944
# (1.2 MB) by the kernel: staged wall 4096x14336 N=64 139.0 (halves) -> 130.4 us, 3584x18944 N=32
# 105.7 -> 101.0; bench/graph_launch_probe.py: Graph.launch's host time does not grow with a
# memcpy node's size (1.8 us clean), the copy's GPU span does after a fill of its source (1.8 MB
# 37.3 -> 55.8 us by the engine, 40.7 -> 54.8 by the kernel)
COPY_KERNEL_MAX = 2 << 20
# x's copy into the pinned staging buffer (a cached call's unstaged x, ``_stage_x``, and
# ``fill_x`` for callers that build a staged x) by non-temporal stores from this many bytes on
# (kernels/cuda/hostcopy.py: the device's read of lines just written and still modified in the
# CPU's cache is slower); 0: NumPy's copy for all. H200, session 22 bundle A (b41b232,
# bench/x_dma_probe.py): an upload's GPU span by the copy engine / the copy kernel after a NumPy
# fill, a non-temporal fill, an idle wait as long as the fill: 512 KiB 26.6 / 32.8, 15.1 /
# 22.3, 14.9 / 21.9 us; 1.8 MB 64.2 / 81.6, 49.2 / 70.4, 43.6 / 61.1 (write-combined staging:
# as the NumPy fill); bench/backend_wall.py N=64 wall, NumPy / non-temporal, 3 rounds
# alternated: 14336x4096 staged 140.4 -> 127.5 us, graph (the fill in the wall) 173.3 ->
# 165.1; 4096x14336 136.1 -> 132.8, 272.7 -> 270.5; y bit-equal. The non-temporal fill itself:
# 512 KiB 32 us against NumPy's 19 (NumPy's stays in the cache), 1.8 MB 134 against 152.
# 1 MiB since session 28 (256 KiB before): in the worker, between gRPC's work, the
# non-temporal fill of the replay's S=8 down x (303 KB) took 66 us of a 163 us device job
# against 34 by NumPy (H200, bundle A, 28-layer replay, job stamps), and bench/layer_wall.py
# read down's host time at S=8 120.3 -> 90.8 us with ~150 us of host work between calls,
# 70.2 -> 60.1 back to back (the GPU's part before the kernel shorter too: 100.4 -> 72.1 /
# 54.5 -> 44.0; y bit-equal); N=64's 1.8 MB x keeps the non-temporal fill (faster there).
NT_FILL_MIN = 1 << 20


def fill_x(dst: np.ndarray, src: np.ndarray) -> None:
    """``src``'s bytes into the start of ``dst`` (a pinned uint8 staging buffer): by
    non-temporal stores from ``NT_FILL_MIN`` bytes on (hostcopy.copy_into), else NumPy's."""
    if NT_FILL_MIN and src.nbytes >= NT_FILL_MIN:
        hostcopy.copy_into(dst, src)
        return
    dst[: src.nbytes] = src.reshape(-1).view(np.uint8)


def stage_into(call: Any, x: np.ndarray) -> None:
    """x into a cached call's (``BoundCall``, ``ManyCall``) pinned staging buffer ``call.host``:
    from ``NT_FILL_MIN`` bytes by :func:`fill_x` (non-temporal stores), else by one NumPy
    assignment into a typed view of x's place in the buffer made on the call's first such x
    (``call.xv``; the call's key holds x's shape and dtype, so it is checked, not assumed):
    no byte views, slices or reshapes of either per call (fake device, VM: 1.92 -> 0.70 us
    for a 7 KB x, 2.62 -> 1.59 for 37 KB, warm)."""
    if NT_FILL_MIN and call.x_bytes >= NT_FILL_MIN:
        fill_x(call.host, x)
        return
    xv = call.xv
    if xv is None or xv.shape != x.shape or xv.dtype is not x.dtype:
        xv = call.xv = call.host[: x.nbytes].view(x.dtype).reshape(x.shape)
    xv[...] = x


def copy_kernel_from_env(env: Any = None) -> int | None:
    """``Q6SERVE_COPY_KERNEL_MAX`` (unset or empty: None, the module's ``COPY_KERNEL_MAX``):
    x's upload and a small y's download of at most this many bytes are done by a copy kernel
    (:meth:`Launcher._copy`), 0: by the copy engine. Read where a backend is built, as
    ``Q6SERVE_PDL``."""
    return _env_int(env, "Q6SERVE_COPY_KERNEL_MAX", 0, None, "bytes, a whole number >= 0")


def _env_int(env: Any, name: str, lo: int, hi: int | None, expected: str) -> int | None:
    """A whole-number variable in ``lo..hi`` (``hi`` None: no upper bound); unset or empty:
    None; anything else raises ValueError naming the variable and what it expects."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return None
    try:
        v = int(raw)
    except ValueError:
        v = lo - 1
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return v


def y_chunks_from_env(env: Any = None) -> int | None:
    """``Q6SERVE_Y_CHUNKS`` (unset or empty: None, the module's ``Y_CHUNKS``, by default each
    weight's own): row chunks a large y is computed and downloaded in (0 or 1: off; at most
    16). Read where a backend is built, as ``Q6SERVE_PDL``."""
    return _env_int(env, "Q6SERVE_Y_CHUNKS", 0, 16, "a whole number 0..16")


def _small_out(n: int, rows: int, out_dtype: np.dtype | None, topk: int, y16: bool = False,
               chunks: int = 0) -> np.dtype | tuple[str, int] | str | None:
    """What the bound sequence downloads itself: ("topk", k) the top-k epilogue's packed rows
    (its launches bound in too: cuda_topk.group_launches), y's host dtype for a small y
    (SMALL_Y), else None (y's way out is enqueued per call: :meth:`Launcher._finish`), or with
    ``y16`` (Launcher.y16_graph) "y16" for a larger f16 y: its f16 conversion is bound into the
    sequence, only the copy into a pinned block is enqueued per call; ("rows", chunks) for an
    f32/bf16 y of ``Y_CHUNK_MIN`` bytes or more when ``chunks`` > 1 (the row-chunked sequence,
    module docstring point 8; its way out is enqueued per call, chunk by chunk); ("tokens", 2)
    for a larger f32/bf16 y of 16 tokens or more when ``chunks`` is -2 (the token halves,
    point 10; its way out likewise, half by half) for 16 to ``X_SPLIT_MAX_N`` tokens; ("tokens",
    2, C) when it is -2 C (each half in C row chunks: X_SPLIT_ROWS)."""
    if topk:
        return ("topk", topk) if cuda_topk.bindable() else None
    dt = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
    if dt in (np.float32, BFLOAT16):
        if dt == np.float32 and n * rows * 4 <= SMALL_Y_F32:
            return dt
        if chunks < -1:
            if not 16 <= n <= X_SPLIT_MAX_N:
                return None
            return ("tokens", 2) if chunks == -2 else ("tokens", 2, -chunks // 2)
        return ("rows", chunks) if chunks > 1 and n * rows * 4 >= Y_CHUNK_MIN else None
    if dt != np.float16:
        return None
    if n * rows * 2 > SMALL_Y:
        return "y16" if y16 else None
    return dt


def many_out(n: int, rows: int, out_dtype: np.dtype | None) -> np.dtype | str | None:
    """What a multi-weight sequence (:class:`ManyBound`, ``rows`` its parts' rows together)
    downloads itself, as :func:`_small_out`: y's host dtype for a small y (every part's y
    together at most ``SMALL_Y_F32`` bytes as f32, ``SMALL_Y`` as f16), "y16" for a larger
    f16 y (converted in the sequence, copied per call), else None (f32 or bf16: y copied per
    call into a pinned block whose views the parts' results are). (Each part's block copied on
    a copy stream as soon as its kernels were done, beside the next part's, was tried: H200,
    session 14, no change, gate/up N=64 wall 374.5 vs 376.1 us.)"""
    dt = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
    if dt == np.float32 and n * rows * 4 <= SMALL_Y_F32:
        return dt
    if dt == np.float16:
        return dt if n * rows * 2 <= SMALL_Y else "y16"
    return None





# The launch path's classes and functions, imported last: each of their modules reads this
# one's settings (all defined above) as ``launch.NAME`` per call, and this module must not
# define ``__getattr__`` (CPython 3.11 then leaves every ``launch.NAME`` read unspecialized:
# a cached call's chunk check, five reads, 185-199 -> 249-282 ns on the VM). Their names are
# also this module's, for the code that knew them here.
from .bound_call import BoundCall as BoundCall  # noqa: E402
from .copies import Copies as Copies  # noqa: E402
from .driver import clusters_fit as clusters_fit  # noqa: E402
from .driver import launch_pdl as launch_pdl  # noqa: E402
from .launcher import Launcher as Launcher  # noqa: E402
from .many import ManyBound as ManyBound  # noqa: E402
from .many import ManyCall as ManyCall  # noqa: E402
from .many import ManyLaunches as ManyLaunches  # noqa: E402
from .many import _many_split as _many_split  # noqa: E402
from .plans import LaunchPlan as LaunchPlan  # noqa: E402
from .plans import Planner as Planner  # noqa: E402
from .plans import Step as Step  # noqa: E402
from .plans import kernel_file as kernel_file  # noqa: E402
from .plans import kernel_name as kernel_name  # noqa: E402
from .plans import pair_cfg as pair_cfg  # noqa: E402
from .plans import smem_bytes as smem_bytes  # noqa: E402
from .region_call import RegionCall as RegionCall  # noqa: E402
from .region_call import _RegionSeq as _RegionSeq  # noqa: E402
from .sequence import Bound as Bound  # noqa: E402
from .sequence import Done as Done  # noqa: E402
from .sequence import Sequences as Sequences  # noqa: E402
from .workspace import _FREE_REFS as _FREE_REFS  # noqa: E402
from .workspace import Workspace as Workspace  # noqa: E402
from .workspace import _free_refs as _free_refs  # noqa: E402
from .workspace import _WriteCombined as _WriteCombined  # noqa: E402
