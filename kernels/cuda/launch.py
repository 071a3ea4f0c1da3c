"""How a call runs: launch plans, the per-backend buffers, the launch sequence and its timing.

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

import contextlib
import ctypes
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import cuda_topk, q6k
from ..api import (
    BFLOAT16,
    KernelTiming,
    Launched,
    LaunchedMany,
    Layout,
    MatmulResult,
    Precision,
    ResidentWeight,
    env_switch,
)
from ..epilogue import TopK
from ..errors import DeviceError, FormatError
from . import hostcopy
from .dispatch import Cfg
from .driver import _driver_launch_ex, _external_record, _host_device_ptr, clusters_fit, launch_pdl
from .loader import arch_specific
from .storage import CudaWeight

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


def _free_refs() -> int:
    """sys.getrefcount of a list's item nothing else holds, read as ``Workspace.y_block``
    reads it (measured, not assumed: interpreters count borrowed references differently)."""
    held = [np.empty(0)]
    return sys.getrefcount(held[0])


_FREE_REFS = _free_refs()


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
_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind
_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1
Done = tuple[np.ndarray | None, TopK | None, float | None]  # y, top-k, kernel seconds


def smem_bytes(path: str, cfg: Cfg, per: int) -> int:
    """Shared memory of one CTA that owns ``per`` K blocks."""
    if path == "mma_f16" and cfg.src in WG_SRCS:  # wg_stage_x: 16 k16 steps of 8*nt x 16 f16
        return 8 * cfg.nt * per * 512
    if path == "mma_f16" and cfg.src in (4, 7):  # stage_x_f16: 8*nt rows of per*32+4 uint4
        # src 7: the cluster's partial sums, a float per row and token of the CTA
        sums = cfg.warps * 16 * cfg.mt * 8 * cfg.nt * 4 if cfg.src == 7 else 0
        return 8 * cfg.nt * (per * 32 + 4) * 16 + sums
    if path == "mma_f16" and cfg.src == 3:
        return 2 * cfg.nt * 256 * 16
    if cfg.src != 2:
        return 0
    if path == "exact":
        return cfg.nt * per * 1024
    if path == "mma_f16":
        return 8 * cfg.nt * (per * 32 + 4) * 16
    return 0


def kernel_name(path: str, cfg: Cfg, soa: bool | int, in_t: str) -> str:
    """The template instantiation of a tile path (``soa`` picks the address arithmetic: False
    AoS, True SoA, 2 SoA in pair-stream order)."""
    lay = "2" if soa == 2 else "true" if soa else "false"
    pf = "true" if cfg.pf else "false"
    if path == "exact":
        return f"q6k_exact<{cfg.nt}, {lay}, {in_t}, {pf}>"
    if path == "mma_f16" and cfg.src == 4:
        return f"q6k_ks_f16<{cfg.nt}, {cfg.mt}, {lay}, {in_t}, {pf}, {cfg.warps}>"
    if path == "mma_f16" and cfg.src == 7:
        return (f"q6k_ksc_f16<{cfg.nt}, {cfg.mt}, {lay}, {in_t}, {pf}, {cfg.warps}, "
                f"{cfg.ksplit}>")
    if path == "mma_f16" and cfg.src == 8:
        return f"q6k_wg_f16<{cfg.nt}, {lay}, {in_t}, {cfg.warps // 4}>"
    if path == "mma_f16":
        t_in = "InF16" if cfg.src == 3 else in_t  # it reads only the prepass
        return f"q6k_mma_f16<{cfg.nt}, {cfg.mt}, {lay}, {cfg.src}, {t_in}, {pf}>"
    if path == "mmq_q8_1":
        return f"q6k_mmq_q8<{cfg.nt}, {cfg.mt}, {lay}>"
    raise DeviceError(f"unknown tile path {path!r}")


def pair_cfg(path: str, cfg: Cfg) -> Cfg:
    """The launch shape a pair-stream weight runs for ``cfg``: the f16 tile's two m-tiles per
    warp (src 2/3) become one m-tile per warp, with twice the warps where the CTA allows (the
    same rows per CTA), else twice the CTAs along rows (Launcher.plan), on the SoA twin's K
    split, so the same sums per output: the two-m-tile pair decode of ``q6k_mma_f16`` takes
    minutes to build (117-147 s for one name, nvcc 13.0 sm_90 on the CI VM; 1-3 s at one
    m-tile, and for the K-slice tile at two)."""
    if path == "mma_f16" and cfg.mt > 1 and cfg.src in (2, 3):
        wide = cfg.warps * cfg.mt
        return replace(cfg, mt=1, warps=wide if wide <= 8 else cfg.warps)
    return cfg


def kernel_file(path: str, cfg: Cfg) -> str:
    """The source file that holds a tile path's kernel."""
    return WG_FILE if path == "mma_f16" and cfg.src in WG_SRCS else MATMUL_FILE


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a tile-kernel call needs besides its buffers."""

    path: str
    fn: Any
    grid: tuple[int, int, int]
    threads: int
    smem: int
    ks: int  # K splits (partial sums when > 1)
    tickets: int  # split-K ticket counters
    bpr: int
    nz: int  # token chunks
    prep: Any  # activation prepass kernel (f16 fragments or q8_1), or None
    prep_grid: tuple[int]
    prep_sizes: tuple[int, int, int]  # prepass buffer elements
    post: Any = None  # K-slice tiles split along K: q6k_sum_parts adds the partial sums
    src: int = 2  # the launch shape's kernel family (Cfg.src; PDL_SRCS take PDL for the sum)


@dataclass(frozen=True)
class Step:
    """One kernel launch with its arguments bound (raw device pointers). ``pdl``: launched
    with programmatic stream serialization (:func:`launch_pdl`): its CTAs may start while the
    launch before it is still running, and the kernel waits for that one's results itself
    (``griddepcontrol.wait``)."""

    fn: Any
    grid: tuple[int, ...]
    block: int
    args: tuple
    smem: int = 0
    pdl: Any = None  # the driver's cuLaunchKernelEx (ctypes) when launched that way

    def __call__(self) -> None:
        if self.pdl is not None:
            launch_pdl(self.pdl, self.fn, self.grid, self.block, self.args, self.smem)
        else:
            self.fn(self.grid, (self.block,), self.args, shared_mem=self.smem)


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


@dataclass
class Bound:
    """A (weight, N, dtype, path, shape) launch sequence bound to one workspace generation."""

    gen: int
    x_bytes: int
    steps: list[Step]
    start: Any  # timing events, re-recorded every call (read right after the sync)
    end: Any
    calls: int = 0
    graph: Any = None  # cupy Graph once captured; False once capture was refused
    extra: dict = field(default_factory=dict)


class Workspace:
    """Per-backend device buffers by name and, per launch slot, a pinned host buffer for x and
    one for small outputs, grown to the largest call. Any growth bumps ``gen``: bound
    sequences hold raw pointers and rebind. Device buffers are shared by the slots: the
    stream orders every use of them."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.gen = 0
        self._dev: dict[str, Any] = {}
        self._host: list[Any] = [None] * SLOTS  # per slot: (pinned memory, numpy uint8 view)
        self._host_wc: list[Any] = [None] * SLOTS  # the same, write-combined (STAGING_WC_MIN)
        self._wc_min = STAGING_WC_MIN  # the setting the buffers handed out so far followed
        self._out: list[Any] = [None] * SLOTS  # the same for small outputs (SMALL_Y)
        self._yb: list[np.ndarray] = []  # large y's pinned blocks (Y_BLOCKS; uint8, whole)
        self._yb_ptr: list[int] = []  # their addresses (ndarray.ctypes costs ~4 us)
        self._held = [False] * SLOTS  # launched, its wait not yet called
        self._done: list[Any] = [None] * SLOTS  # per slot: event recorded after its launch
        self.staged: np.ndarray | None = None  # the last view CudaBackend.staging handed out
        self.staged_slot = 0

    def first_free(self) -> int:
        """The first slot whose wait was called, or -1 while every slot awaits its wait."""
        held = self._held
        for s in range(SLOTS):
            if not held[s]:
                return s
        return -1

    def free_slot(self) -> int:
        """The slot the next launch takes (the first whose wait was called)."""
        s = self.first_free()
        if s >= 0:
            return s
        raise DeviceError(f"more than {SLOTS} launches in flight on one device: wait for one "
                          "before launching another")

    def take(self, slot: int) -> None:
        self._held[slot] = True

    def held(self, slot: int) -> bool:
        """Whether a launch in ``slot`` still awaits its wait."""
        return self._held[slot]

    def release(self, slot: int) -> None:
        self._held[slot] = False

    def busy(self, slot: int) -> bool:
        """Whether a launch other than ``slot``'s is in flight (launched, not waited for)."""
        held = self._held
        return sum(held) > held[slot]

    def done_event(self, slot: int) -> Any:
        """The slot's completion event (recorded after each launch's last operation)."""
        ev = self._done[slot]
        if ev is None:
            ev = self._done[slot] = self.ctx.cp.cuda.Event(disable_timing=True)
        return ev

    @staticmethod
    def _grown(old: int, need: int) -> int:
        return 2 * old if need <= 2 * old <= need + GROW_SLACK else need

    def ptr(self, name: str, nbytes: int, zero: bool = False, bound: bool = True) -> int:
        """Device address of buffer ``name`` holding at least ``nbytes`` (call under the
        backend's device and stream: the pool is stream-ordered, so a replaced buffer is
        reused only after the work queued on it). ``bound``: bound sequences may hold it."""
        buf = self._dev.get(name)
        if buf is None or buf.nbytes < nbytes:
            size = self._grown(0 if buf is None else buf.nbytes, max(nbytes, 512))
            cp = self.ctx.cp
            buf = cp.zeros(size, cp.uint8) if zero else cp.empty(size, cp.uint8)
            self._dev[name] = buf
            self.gen += bound
        return int(buf.data.ptr)

    def array(self, name: str, shape: tuple[int, ...], dtype: Any, bound: bool = True) -> Any:
        """A CuPy view of buffer ``name`` (grown to fit)."""
        cp = self.ctx.cp
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.ptr(name, nbytes, bound=bound)
        return cp.ndarray(shape, dtype, memptr=self._dev[name].data)

    def host(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """The slot's pinned staging buffer for x (uint8, at least ``nbytes``): from
        ``STAGING_WC_MIN`` bytes on a write-combined one of its own."""
        wc = STAGING_WC_MIN
        if wc != self._wc_min:  # (a bench's variants: sequences bound to the other rebind)
            self._wc_min = wc
            self.gen += 1
        if wc and nbytes >= wc:
            self._host_wc[slot] = self._pinned(self._host_wc[slot], nbytes, True)
            return self._host_wc[slot][1]
        self._host[slot] = self._pinned(self._host[slot], nbytes)
        return self._host[slot][1]

    def host_out(self, nbytes: int, slot: int = 0) -> np.ndarray:
        """The slot's pinned buffer small outputs are downloaded into (uint8, >= ``nbytes``)."""
        self._out[slot] = self._pinned(self._out[slot], nbytes)
        return self._out[slot][1]

    def y_block(self, nbytes: int) -> tuple[int, np.ndarray]:
        """A pinned block for a large y of ``nbytes``: (its address, a uint8 array of exactly
        ``nbytes`` over it, to be viewed as y and handed out). The first kept block no array
        refers to any more (every view of a block has its whole array as base) and large
        enough; else a free one too small is replaced by one grown to ``nbytes``, or a new one
        is kept while fewer than ``Y_BLOCKS`` are; else (all in use) a block from CuPy's pool
        for this call only. Call under the backend's device."""
        blocks, free = self._yb, _FREE_REFS
        small = -1
        for i in range(len(blocks)):
            if sys.getrefcount(blocks[i]) == free:
                if blocks[i].size >= nbytes:
                    return self._yb_ptr[i], blocks[i][:nbytes]
                small = i if small < 0 else small
        if small < 0 and len(blocks) >= Y_BLOCKS:  # every kept block in use (or Y_BLOCKS 0)
            mem = self.ctx.cp.cuda.alloc_pinned_memory(nbytes)
            return int(mem.ptr), np.frombuffer(mem, np.uint8, nbytes)
        mem = self.ctx.cp.cuda.alloc_pinned_memory(nbytes)
        arr = np.frombuffer(mem, np.uint8, nbytes)
        if small < 0:
            blocks.append(arr)
            self._yb_ptr.append(int(mem.ptr))
        else:
            blocks[small], self._yb_ptr[small] = arr, int(mem.ptr)
        return int(mem.ptr), arr[:nbytes]

    def _pinned(self, have: Any, nbytes: int, wc: bool = False) -> tuple[Any, np.ndarray]:
        if have is not None and have[1].size >= nbytes:
            return have
        size = self._grown(0 if have is None else have[1].size, nbytes)
        self.gen += 1
        if wc:
            mem = _WriteCombined(self.ctx.cp.cuda.runtime, size)
            return mem, mem.array()
        mem = self.ctx.cp.cuda.alloc_pinned_memory(size)
        return mem, np.frombuffer(mem, np.uint8, size)

    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self._dev.values())

    def clear(self) -> None:
        self._dev.clear()
        self._host, self._out = [None] * SLOTS, [None] * SLOTS
        self._host_wc = [None] * SLOTS
        self._yb, self._yb_ptr = [], []
        self._held, self._done = [False] * SLOTS, [None] * SLOTS
        self.staged = None
        self.gen += 1


class _WriteCombined:
    """Page-locked, write-combined host memory (``cudaHostAlloc(..., WriteCombined |
    Portable)``) as a NumPy uint8 array: the CPU's stores to it bypass its caches (as
    non-temporal stores do) and the GPU's DMA reads it without snooping them; CPU reads of it
    are uncached (slow). Freed once neither it nor any array of it is left (the arrays keep it:
    their base holds it)."""

    def __init__(self, rt: Any, size: int) -> None:
        self._rt, self.size = rt, size
        self.ptr = int(rt.hostAlloc(size, 5))  # cudaHostAllocWriteCombined | Portable

    def array(self) -> np.ndarray:
        """A uint8 array of all of it, which keeps it (no reference back: NumPy's ``base``
        is not seen by the cycle collector, so a cycle through it would never be freed)."""
        raw = (ctypes.c_uint8 * self.size).from_address(self.ptr)
        raw._owner = self  # type: ignore[attr-defined]
        return np.frombuffer(raw, np.uint8)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (interpreter shutdown, a lost device)
            self._rt.freeHost(self.ptr)


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


class BoundCall:
    """A call's whole host path once its bound sequence is a captured graph
    (:meth:`Launcher.bound_call`; cached on the weight by ``CudaBackend.launch`` per (x's shape
    and dtype, precision, flags, out dtype, top-k, launch slot)): x into the slot's staging
    buffer unless built there, the graph launch, y's way out unless the graph downloads it,
    the slot's completion event; after the sync the kernel time and the result. The plan, the
    binding, the dispatch and the checks of the key were settled by the call that made it;
    :meth:`live` says whether the binding still holds (the workspace did not grow, the graph
    was not dropped)."""

    __slots__ = ("_elapsed", "_memcpy", "asked", "b", "bf16", "big", "chunked", "chunks",
                 "dev", "done", "dtype", "flags", "half", "host", "kernel", "layout", "lc", "n",
                 "nbytes", "out", "out_dtype", "precision", "rows", "slot", "stream", "topk",
                 "ws", "x_bytes", "xv", "y", "y16")

    def __init__(self, lc: Launcher, b: Bound, slot: int, n: int, rows: int,
                 out_dtype: np.dtype | None, topk: int, kernel: str, layout: Layout,
                 precision: Precision, dtype: np.dtype | None = None, chunks: int = 0) -> None:
        cp = lc.ctx.cp
        # what same() compares (hot() sets the caller's objects); the chunk state it was
        # launched with (Launcher.chunks_for, read again per call) and its x's bytes
        self.asked: Any = None
        self.flags: Any = None
        self.out_dtype, self.dtype, self.chunks = out_dtype, dtype, chunks
        self.x_bytes = b.x_bytes
        self.lc, self.b, self.ws, self.slot = lc, b, lc.ws, slot
        self.stream, self.dev = lc.ctx.stream, lc.ctx.dev
        self.done = lc.ws.done_event(slot)
        self.host = lc.ws.host(b.x_bytes, slot)
        self.xv: np.ndarray | None = None  # x's place in it, typed (stage_into)
        self.out = None if b.extra["out"] is None else b.extra["out"][1]  # in-graph download
        self.topk, self.rows, self.n, self.y = topk, rows, n, b.extra["y"]
        self.y16 = b.extra.get("y16")  # y's f16 conversion bound into the graph (y16_graph)
        dt = np.dtype(np.float32) if out_dtype is None else np.dtype(out_dtype)
        self.half, self.bf16 = dt == np.float16, dt == BFLOAT16
        self.big = self.out is None  # y DMA'd into a pinned block that becomes the result
        self.chunked = bool(b.extra.get("copies"))  # ... part by part (Launcher._chunks_out)
        self.nbytes = n * rows * (2 if self.half else 4)
        self.kernel, self.layout, self.precision = kernel, layout, precision
        self._memcpy = cp.cuda.runtime.memcpyAsync
        self._elapsed = cp.cuda.get_elapsed_time

    def live(self) -> bool:
        # (the row chunks' setting is part of its key: CudaBackend's _call_key)
        return (self.b.gen == self.ws.gen and bool(self.b.graph)
                and (not self.topk or cuda_topk.bindable()))

    def hot(self, precision: Precision, flags: Any, out_dtype: Any) -> BoundCall:
        """This call, to be found by (x's shape, slot) in its weight's plans
        (``CudaBackend.launch``): ``same`` holds for these very objects from now on (the call
        was found under its key with them, so they equal what made it)."""
        self.asked, self.flags, self.out_dtype = precision, flags, out_dtype
        return self

    def same(self, cw: CudaWeight, precision: Precision, flags: Any, out_dtype: Any,
             topk: int, dtype: np.dtype) -> bool:
        """Whether a call of this x shape in this slot is this one, by identity of its
        arguments (an equal but other object: False, and the keyed lookup decides), with the
        chunk state the launcher gives it now (``Launcher.chunks_for``, as the key holds it),
        while :meth:`live`."""
        b = self.b
        return (precision is self.asked and flags is self.flags and out_dtype is self.out_dtype
                and topk == self.topk and dtype is self.dtype and b.gen == self.ws.gen
                and bool(b.graph) and (not topk or cuda_topk.bindable())
                and self.lc.chunks_for(cw, self.slot, self.n * self.rows, self.x_bytes,
                                       self.n) == self.chunks)

    def launch(self, x: np.ndarray | None = None) -> Launched:
        """Launch (``x``: copied into the slot's staging buffer first; None: built there)."""
        ws, slot, stream = self.ws, self.slot, self.stream
        if ws._held[slot]:
            raise DeviceError("x was staged in a buffer a launch in flight still uses")
        if x is not None:
            stage_into(self, x)
        ws._held[slot] = True
        try:
            with self.dev:
                self.b.graph.launch(stream)
                y = None
                if self.big:
                    src = self.y
                    if self.y16 is not None:  # converted by the graph
                        src = self.y16
                    elif self.half:  # (a CuPy conversion: on the backend's stream)
                        with stream:
                            src = self.lc._y_out(src, self.n, self.rows, True)
                    ptr, blk = ws.y_block(self.nbytes)
                    y = blk.view(np.float16 if self.half else np.float32).reshape(
                        self.n, self.rows)
                    if self.chunked:
                        self.lc._chunks_out(self.b, ptr)
                    else:
                        self._memcpy(ptr, src, self.nbytes, _D2H, stream.ptr)
                self.done.record(stream)
        except BaseException:
            ws._held[slot] = False
            raise
        return Launched(lambda: self._wait(y))

    def _wait(self, y: np.ndarray | None) -> MatmulResult:
        top = None
        try:
            self.done.synchronize()
            try:
                seconds = self._elapsed(self.b.start, self.b.end) / 1e3
            except Exception:  # its event nodes did not record: direct launches from now
                seconds, self.b.graph = None, False
            if self.topk:  # (a copy: the buffer is the slot's, and unpack may return views)
                top = cuda_topk.unpack(self.out.copy(), self.topk)
            elif y is None:
                y = self.out.copy()  # the buffer is reused
            elif self.bf16:
                y = y.astype(BFLOAT16)
        finally:
            self.ws._held[self.slot] = False
        return MatmulResult(y, self.kernel, self.layout, self.precision,
                            KernelTiming(host_seconds=seconds), topk=top)


class _RegionSeq:
    """One launch slot's sequence of a :class:`RegionCall`: its pointers' generation, its
    timing events, its steps and, once captured, its graph (False: capture refused); with copy
    streams, the slot's own device buffers' names and the events that hand x and y between the
    streams."""

    __slots__ = ("calls", "end", "ev_x", "ev_y", "gen", "graph", "hx", "hy", "names", "start",
                 "steps", "xd", "y16", "yd")

    def __init__(self, gen: int, start: Any, end: Any, steps: list[Step], xd: int, yd: int,
                 y16: int, names: tuple[str, str, str]) -> None:
        self.gen, self.start, self.end, self.steps = gen, start, end, steps
        self.xd, self.yd, self.y16, self.names = xd, yd, y16, names
        self.graph: Any = None
        self.calls = 0
        self.ev_x: Any = None
        self.ev_y: Any = None
        # the region's x and y at the device's addresses, where the one-stream sequence copies
        # them by the copy kernel (Launcher.by_kernel; None: the copy engine)
        self.hx: int | None = None
        self.hy: int | None = None


class RegionCall:
    """A call whose x and y lie at fixed page-locked host addresses (a fast lane's region
    slots, kernels/hostio.py) repeated with its settled path: x's DMA from the region, the
    kernels between their timing events, y's f16 conversion and y's DMA into the region are
    ONE captured graph per launch slot, so a call is a free slot, one graph launch and the
    slot's completion event; the wait is the event's sync and the kernel time. The
    page-locked path of :meth:`Launcher.launch_host` enqueues the copies around its graph
    each call, and ``CudaBackend.launch`` re-runs the checks, the dispatch and the route
    lookups before it. Made by ``CudaBackend`` for a route that asked for it
    (``Route.want``), from a call it just launched that way (its modules loaded); valid
    while :meth:`live` (the caller checks it before each launch): the weight's data is the
    one bound, no page-locked range was unpinned since (``HostIO.epoch``) and the timing
    events recorded. Each slot's first ``GRAPH_AFTER`` + 1 calls run directly, the last of
    them captured; a refused capture keeps direct launches.

    With ``Launcher.region_streams`` (``Q6SERVE_REGION_STREAMS=1``) a call launched while
    another launch is in flight has x's DMA on a copy-in stream and y's on a copy-out stream,
    into and out of device buffers of the launch slot's own, handed over by events; only the
    kernels (and y's conversion) run on the backend's stream, as the slot's graph (each slot
    keeps a sequence of each kind). Two calls in flight (the lane's pipeline) then overlap:
    call i + 1's x DMA and call i's y DMA run beside the other's kernels, where one stream runs
    each call's copies and kernels one after the other. A call launched alone runs on the one
    stream (nothing to overlap; the streams' hand-offs cost a lone call ~20 us). A slot's
    buffers are reused only after its wait (the slot's completion event, recorded on the
    copy-out stream)."""

    __slots__ = ("_seqs", "_sseqs", "broken", "cfg", "cw", "epoch", "half", "in_t", "io",
                 "kernel", "layout", "lc", "n", "path", "precision", "rows", "streams", "w",
                 "x_addr", "x_bytes", "y", "y_addr", "y_bytes")

    def __init__(self, lc: Launcher, w: ResidentWeight, cw: CudaWeight, x: np.ndarray,
                 y: np.ndarray, path: str, cfg: Cfg, kernel: str, precision: Precision,
                 io: Any) -> None:
        self.lc, self.w, self.cw, self.io, self.epoch = lc, w, cw, io, io.epoch
        self.x_addr, self.x_bytes = int(x.ctypes.data), int(x.nbytes)
        self.in_t = IN_TYPES[x.dtype]
        self.y, self.y_addr, self.y_bytes = y, int(y.ctypes.data), int(y.nbytes)
        self.n, self.rows, self.half = int(x.shape[0]), w.rows, y.dtype == np.float16
        self.path, self.cfg = path, cfg
        self.kernel, self.layout, self.precision = kernel, w.layout, precision
        self._seqs: list[_RegionSeq | None] = [None] * SLOTS  # one stream
        self._sseqs: list[_RegionSeq | None] = [None] * SLOTS  # with the copy streams
        self.broken = False
        self.streams = lc.region_streams

    def live(self) -> bool:
        return not self.broken and self.io.epoch == self.epoch and self.w.data is self.cw

    def launch(self) -> Launched:
        lc = self.lc
        ws, stream = lc.ws, lc.ctx.stream
        slot = ws.free_slot()
        # the copy streams only beside another launch in flight: alone, there is nothing to
        # overlap and one stream's serialized copies and kernels cost less (H200, session 11:
        # a lone lane caller's p50 - kernel 71 us on one stream, 92 with the copy streams)
        streams = self.streams and any(ws.held(o) for o in range(SLOTS) if o != slot)
        ws.take(slot)
        try:
            with self.io.lock, lc.ctx.dev:
                s = self._seqs[slot]
                if streams:
                    s = self._run_streams(slot, self._sseqs[slot])
                elif s is not None and s.graph and s.gen == ws.gen:
                    s.graph.launch(stream)
                    ws.done_event(slot).record(stream)
                else:
                    s = self._run(slot, s)
                    ws.done_event(slot).record(stream)
        except BaseException:
            ws.release(slot)
            raise
        return Launched(lambda: self._wait(slot, s))

    def _wait(self, slot: int, s: _RegionSeq) -> MatmulResult:
        lc = self.lc
        try:
            lc.ws.done_event(slot).synchronize()
            seconds = lc._seconds(s.start, s.end)
            if seconds is None:  # its event nodes did not record: not this way again
                self.broken = True
        finally:
            lc.ws.release(slot)
        return MatmulResult(self.y, self.kernel, self.layout, self.precision,
                            KernelTiming(host_seconds=seconds))

    def _run(self, slot: int, s: _RegionSeq | None) -> _RegionSeq:
        """Slot ``slot``'s sequence launched directly (bound first if it is not, or its
        buffers moved), and captured as its graph once it ran ``GRAPH_AFTER`` times."""
        lc = self.lc
        ws, stream = lc.ws, lc.ctx.stream
        with stream:
            if s is None or s.gen != ws.gen:
                s = self._seqs[slot] = self._bind(("x", "y", "y16b"))
                s.hx, s.hy = self._mapped(s.xd, self.x_addr, self.x_bytes), self._mapped(
                    s.y16 if self.half else s.yd, self.y_addr, self.y_bytes)
            self._enqueue(s, lambda ev: ev.record(stream))
            s.calls += 1
            if lc.graphs and s.graph is None and s.calls > GRAPH_AFTER:
                self._capture(s)
        return s

    def _mapped(self, dev: int, host: int, nbytes: int) -> int | None:
        """The device's address of the region's ``host`` where the copy kernel is to move its
        ``nbytes`` to or from ``dev`` (``Launcher.by_kernel``), else None (the copy engine)."""
        lc = self.lc
        if not lc.by_kernel(nbytes, dev, host):
            return None
        d = lc.device_ptr(host)
        return d if d is not None and d % 16 == 0 else None

    def _bind(self, names: tuple[str, str, str]) -> _RegionSeq:
        """A sequence on the workspace's buffers ``names`` (x, f32 y, f16 y); call under the
        device and stream."""
        lc = self.lc
        ws, cp = lc.ws, lc.ctx.cp
        lp = lc.plan(self.rows, self.w.k, self.w.layout, self.in_t, self.path, self.cfg,
                     self.n, self.cw.pairs)
        n, rows = self.n, self.rows
        for _ in range(2):  # all buffers first (any growth bumps the generation)
            gen = ws.gen
            xd = ws.ptr(names[0], self.x_bytes)
            yd = ws.ptr(names[1], 4 * n * rows)
            y16 = ws.ptr(names[2], 2 * n * rows) if self.half else 0
            steps = lc.steps(lp, self.w, self.cw, xd, yd, n)
            if gen == ws.gen:
                break
        return _RegionSeq(ws.gen, cp.cuda.Event(), cp.cuda.Event(), steps, xd, yd, y16, names)

    def _run_streams(self, slot: int, s: _RegionSeq | None) -> _RegionSeq:
        """One call with its copies on the copy streams: x in on the copy-in stream, the
        kernels (the slot's graph, or direct launches captured after ``GRAPH_AFTER`` calls)
        on the backend's stream once x is in, y out on the copy-out stream once the kernels
        are done, the slot's completion event after it."""
        lc = self.lc
        ws, cp, stream = lc.ws, lc.ctx.cp, lc.ctx.stream
        rt = cp.cuda.runtime
        cin, cout = lc.copy_streams()
        if s is None or s.gen != ws.gen:
            with stream:
                s = self._bind((f"rx{slot}", f"ry{slot}", f"ry16{slot}"))
            s.ev_x, s.ev_y = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
            self._sseqs[slot] = s
        rt.memcpyAsync(s.xd, self.x_addr, self.x_bytes, _H2D, cin.ptr)
        s.ev_x.record(cin)
        stream.wait_event(s.ev_x)
        if s.graph:
            s.graph.launch(stream)
        else:
            with stream:  # (CuPy launches on the current stream: a capture's too)
                self._kernels(s, lambda ev: ev.record(stream))
                s.calls += 1
                if lc.graphs and s.graph is None and s.calls > GRAPH_AFTER:
                    s.graph = lc.capture(lambda record: self._kernels(s, record))
        s.ev_y.record(stream)
        cout.wait_event(s.ev_y)
        rt.memcpyAsync(self.y_addr, s.y16 if self.half else s.yd, self.y_bytes, _D2H, cout.ptr)
        ws.done_event(slot).record(cout)
        return s

    def _enqueue(self, s: _RegionSeq, record: Callable[[Any], None],
                 captured: bool = False) -> None:
        """The whole call on the stream: x in, the kernels between the events, y out. x and
        y by the copy kernel where ``Launcher.by_kernel`` takes them and the driver maps the
        region (``s.hx`` / ``s.hy``); ``captured``: the timing anchor after a copy engine's
        upload, as a bound sequence's (``Launcher._capture``)."""
        lc = self.lc
        rt, stream = lc.ctx.cp.cuda.runtime, lc.ctx.stream
        ysrc = s.y16 if self.half else s.yd
        if s.hx is not None:
            lc._kernel_copy(s.xd, s.hx, self.x_bytes)
        else:
            rt.memcpyAsync(s.xd, self.x_addr, self.x_bytes, _H2D, stream.ptr)
            if captured:
                lc._anchor_step()
        self._kernels(s, record)
        if s.hy is not None:
            lc._kernel_copy(s.hy, ysrc, self.y_bytes)
        else:
            rt.memcpyAsync(self.y_addr, ysrc, self.y_bytes, _D2H, stream.ptr)

    def _kernels(self, s: _RegionSeq, record: Callable[[Any], None]) -> None:
        """The kernels between the timing events, then y's f16 conversion where asked."""
        record(s.start)
        for st in s.steps:
            st()
        record(s.end)
        if self.half:  # (at the bound size: nothing grows)
            ws, shape = self.lc.ws, (self.n, self.rows)
            self.lc.ctx.cp.copyto(ws.array(s.names[2], shape, np.float16),
                                  ws.array(s.names[1], shape, np.float32), casting="same_kind")

    def _capture(self, s: _RegionSeq) -> None:
        """Capture ``s`` (:meth:`_enqueue`); on any refusal it keeps direct launches."""
        s.graph = self.lc.capture(lambda record: self._enqueue(s, record, True))


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


@dataclass
class ManyBound:
    """A multi-weight call's launch sequence (:meth:`Launcher.launch_many`) bound to one
    workspace generation: x's upload, each part's launches (:meth:`Launcher.steps`) with an
    event before the first part, between parts and after the last (part i's kernel time is
    events i .. i + 1), every part's f32 y adjacent in the workspace's "y" (part i at
    N x (rows of the parts before it)), then y's f16 conversion and, for a small y, its one
    download into the slot's pinned out buffer. Kept in every part's ``CudaWeight.plans``
    under its key: it holds no weight, and is live while each part's plans still hold it
    (a relayout or a freed weight ends it)."""

    gen: int
    x_bytes: int
    steps: list[Step]
    events: list[Any]
    xd: int
    y: int  # the workspace's f32 y of all parts
    y16: int  # its f16 conversion ("y16b"), 0 for none
    out: np.ndarray | None  # the slot's pinned out buffer (a small y), flat, host dtype
    rows: tuple[int, ...]
    n: int
    counts: tuple[int, ...]  # each part's steps, in order
    calls: int = 0
    graph: Any = None  # cupy Graph once captured; False once capture was refused


class ManyCall:
    """A multi-weight call's whole host path once its :class:`ManyBound` is a captured graph
    (cached by ``CudaBackend.launch_many`` in its first weight's plans per (weights, x's shape
    and dtype, precision, flags, out dtype, slot), and in every part's plans under itself): x
    into the slot's staging buffer unless built there, the graph launch, y's one copy into a
    pinned block (``Workspace.y_block``) unless the graph downloads it, the slot's completion
    event; after the sync each part's kernel time and result."""

    __slots__ = ("_elapsed", "_memcpy", "b", "bf16", "dev", "done", "host", "key",
                 "lc", "parts", "slot", "stream", "ws", "x_bytes", "xv")

    def __init__(self, lc: Launcher, b: ManyBound, slot: int, key: tuple,
                 parts: list[tuple[str, Layout, Precision]], out_dtype: np.dtype | None) -> None:
        cp = lc.ctx.cp
        self.lc, self.b, self.ws, self.slot, self.key = lc, b, lc.ws, slot, key
        self.stream, self.dev = lc.ctx.stream, lc.ctx.dev
        self.done = lc.ws.done_event(slot)
        self.host = lc.ws.host(b.x_bytes, slot)
        self.x_bytes, self.xv = b.x_bytes, None  # (stage_into)
        self.parts = parts
        self.bf16 = out_dtype is not None and np.dtype(out_dtype) == BFLOAT16
        self._memcpy = cp.cuda.runtime.memcpyAsync
        self._elapsed = cp.cuda.get_elapsed_time

    def live(self, weights: Any) -> bool:
        """Whether it still holds for ``weights`` (the call's, the first of which held it under
        its key): the workspace did not grow, the graph stands, and every part's plans still
        hold it under itself (a relayout clears them, a freed weight has none; an identity
        lookup: no key tuple hashed again per part)."""
        return (self.b.gen == self.ws.gen and bool(self.b.graph)
                and all(type(w.data) is CudaWeight and w.data.plans.get(self) is self
                        for w in weights))

    def launch(self, x: np.ndarray | None = None) -> LaunchedMany:
        """Launch (``x``: copied into the slot's staging buffer first; None: built there)."""
        ws, slot, stream, b = self.ws, self.slot, self.stream, self.b
        if ws._held[slot]:
            raise DeviceError("x was staged in a buffer a launch in flight still uses")
        if x is not None:
            stage_into(self, x)
        ws._held[slot] = True
        try:
            with self.dev:
                b.graph.launch(stream)
                flat = None if b.out is not None else self.lc._many_y_out(b)
                self.done.record(stream)
        except BaseException:
            ws._held[slot] = False
            raise
        return LaunchedMany(lambda: self._wait(flat))

    def _wait(self, flat: np.ndarray | None) -> list[MatmulResult]:
        b = self.b
        try:
            self.done.synchronize()
            secs = self.lc._many_seconds(b)
            if flat is None:
                flat = b.out.copy()  # the buffer is reused  # type: ignore[union-attr]
        finally:
            self.ws._held[self.slot] = False
        return [MatmulResult(y, kernel, layout, precision, KernelTiming(host_seconds=sec))
                for y, sec, (kernel, layout, precision) in zip(
                    _many_split(flat, b.n, b.rows, self.bf16), secs, self.parts, strict=True)]


def _many_split(flat: np.ndarray, n: int, rows: tuple[int, ...],
                bf16: bool = False) -> list[np.ndarray]:
    """Each part's [N, rows] y out of a multi-weight call's one flat y (views; bf16:
    converted copies)."""
    out, off = [], 0
    for r in rows:
        y = flat[n * off : n * (off + r)].reshape(n, r)
        out.append(y.astype(BFLOAT16) if bf16 else y)
        off += r
    return out


class Launcher:
    """Plans, binds and runs the kernels of one device (see the module docstring)."""

    def __init__(self, ctx: Any, graphs: bool = True, anchor: int = 0,
                 copy_max: int | None = 0) -> None:
        self.ctx = ctx
        self._grids: dict[tuple, tuple[int, int, int]] = {}
        self.ws = Workspace(ctx)
        self.graphs = graphs  # the wall bench compares both
        self._record_ext: Any = None
        # The split-K sum (q6k_sum_parts) of the PDL_SRCS tiles is launched with programmatic
        # stream serialization (launch_pdl), so its launch overlaps the tile's tail: on by
        # default (H200, session 10: 1.00-1.04x on every such AUTO cell, bits unchanged);
        # Q6SERVE_PDL=0 turns it off. Read when a call's steps are built: a bound sequence
        # keeps what it was bound with.
        self.pdl = pdl_from_env()
        # RegionCall's copies on streams of their own beside a launch in flight
        # (Q6SERVE_REGION_STREAMS; on by default)
        self.region_streams = region_streams_from_env()
        self._copy_streams: tuple[Any, Any] | None = None
        # A larger f16 y (> SMALL_Y) converted inside the bound sequence (its graph) instead
        # of by a CuPy launch per call: on the H200 (bench/device_gap.py, session 10) the
        # 18944-row gate at N=8 spent 47-76 instead of 89-218 us outside its kernel per call.
        # Part of the binding key (_small_out): flipping it binds new sequences.
        self.y16_graph = True
        self._launch_ex: Any = None
        # row chunks of a large y (module docstring, point 8): Q6SERVE_Y_CHUNKS, else the
        # module's Y_CHUNKS at each call (the wall bench's in-process variants set it), else
        # the weight's own
        self.y_chunks = y_chunks_from_env()
        self._y_stream: Any = None
        self._x_stream: Any = None
        # An empty kernel before a captured sequence's start event (anchor 1; 2: also after
        # its end event): compiled on first use. CudaBackend passes Q6SERVE_TIMING_ANCHOR's
        # value; a launcher built without one (the host tests' fake device) has none
        self.timing_anchor = anchor
        self._anchor: Any = None
        # x's upload / a small y's download by a kernel up to this many bytes (None: the
        # module's COPY_KERNEL_MAX at each binding; see COPY_SRC); compiled on first use.
        # CudaBackend passes Q6SERVE_COPY_KERNEL_MAX's value (unset: None); a launcher built
        # without one (the host tests' fake device) has none
        self.copy_kernel_max = copy_max
        self._copy_fn: Any = None
        self._copy_h_fn: Any = None
        self._dev_ptr: Any = None

    def chunks_wanted(self, cw: CudaWeight | None = None) -> int:
        """Row chunks ``cw``'s large y is computed and downloaded in (<= 1: off)."""
        v = Y_CHUNKS if self.y_chunks is None else self.y_chunks
        if v is None:
            return 0 if cw is None else cw.y_chunks
        return v

    def chunks_for(self, cw: CudaWeight, slot: int, ys: int | None = None,
                   xs: int = 0, n: int = 0) -> int:
        """The split of a launch in ``slot`` now: C > 1 row chunks (:meth:`chunks_wanted`),
        -2 token halves (``X_SPLIT_MIN``: an x of ``xs`` bytes or more, not row-chunked; or
        ``X_SPLIT_Y_MIN``: ``n`` tokens, 16 to ``X_SPLIT_MAX_N``, of an f32 y that large,
        before row chunks), -2 C token halves in C row chunks each (``X_SPLIT_ROWS``), 0
        none; none while another launch is in flight (``Y_CHUNKS_IDLE``). A y of ``ys``
        values (N x rows) under ``Y_CHUNK_MIN`` as f32 is never row-chunked, and with an x
        under ``X_SPLIT_MIN`` and a y under both the state is 0 with no look at the slots (a
        small call's cached BoundCall is keyed by it)."""
        rows = ys is None or 4 * ys >= Y_CHUNK_MIN
        by_y = (bool(X_SPLIT_Y_MIN) and ys is not None and 4 * ys >= X_SPLIT_Y_MIN
                and 16 <= n <= X_SPLIT_MAX_N)
        tokens = by_y or (bool(X_SPLIT_MIN) and xs >= X_SPLIT_MIN)
        if not rows and not tokens:
            return 0
        want = self.chunks_wanted(cw)
        v = want if rows and not by_y else 0
        if v <= 1:  # token halves: -2, or in C row chunks each (X_SPLIT_ROWS): -2 C
            v = (-2 * want if X_SPLIT_ROWS and want > 1 and rows else -2) if tokens else 0
        if v and Y_CHUNKS_IDLE and self.ws.busy(slot):
            return 0
        return v

    def y_stream(self) -> Any:
        """The copy stream of the row chunks' downloads (made on first use, under the
        device)."""
        if self._y_stream is None:
            self._y_stream = self.ctx.cp.cuda.Stream(non_blocking=True)
        return self._y_stream

    def x_stream(self) -> Any:
        """The copy stream of the token halves' second x upload (point 10; made on first use,
        under the device; a captured sequence forks onto it and joins back)."""
        if self._x_stream is None:
            self._x_stream = self.ctx.cp.cuda.Stream(non_blocking=True)
        return self._x_stream

    def copy_streams(self) -> tuple[Any, Any]:
        """The copy-in and copy-out streams of ``RegionCall`` (made on first use, under the
        device)."""
        if self._copy_streams is None:
            cp = self.ctx.cp
            self._copy_streams = (cp.cuda.Stream(non_blocking=True),
                                  cp.cuda.Stream(non_blocking=True))
        return self._copy_streams

    def sync(self) -> None:
        """Wait for everything queued on the backend's stream and the copy streams."""
        self.ctx.stream.synchronize()
        for s in (*(self._copy_streams or ()), self._y_stream, self._x_stream):
            if s is not None:
                s.synchronize()

    # -- planning (host arithmetic) ------------------------------------------------------------
    def grid(self, rows: int, k: int, rows_cta: int, nz: int, cfg: Cfg, fn: Any, n: int,
             path: str) -> tuple[int, int, int]:
        """(row tiles, K splits, token chunks): the split that finishes in the fewest
        block-steps per SM given the kernel's occupancy (registers, shared memory), charging
        split-K's partial sums. Depends only on the SoA twin, so both layouts sum alike."""
        key = (rows, k, rows_cta, nz, cfg, n, path)
        hit = self._grids.get(key)
        if hit is not None:
            return hit
        gx = -(-rows // rows_cta)
        bpr = k // q6k.QK_K
        threads = 32 * cfg.warps
        regs = -(-max(int(fn.num_regs), 1) // 8) * 8
        occ_regs = max(1, min(2048 // threads, 65536 // (threads * regs)))
        best: tuple[float, int] | None = None
        choices = [cfg.ksplit] if cfg.ksplit > 0 else range(1, min(bpr, 64) + 1)
        for ks in choices:
            per = -(-bpr // min(ks, bpr))
            ks_eff = -(-bpr // per)
            smem = smem_bytes(path, cfg, per)
            if smem > KS_SMEM_MAX or (smem > SMEM_LIMIT and cfg.src == 2 and cfg.ksplit <= 0):
                continue  # (a forced split may opt in past 48 KiB, never past the device's max)
            occ = min(occ_regs, self.ctx.smem_sm // (smem + 1024)) if smem else occ_regs
            slots = self.ctx.sm_count * max(1, occ)
            waves = -(-(gx * nz * ks_eff) // slots)
            extra = 0.0 if ks_eff == 1 else ks_eff * n * rows * 8 / (rows * bpr * 210)
            cost = waves * per * (1 + extra)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, ks_eff)
        if best is None:
            raise DeviceError(f"no K split fits {path} {cfg} in shared memory")
        if len(self._grids) > 4096:
            self._grids.clear()
        self._grids[key] = (gx, best[1], nz)
        return gx, best[1], nz

    def ks_grid(self, rows: int, k: int, nz: int, cfg: Cfg, fn: Any,
                n: int) -> tuple[int, int, int]:
        """(CTAs along rows, K slices, token chunks) of the K-slice tile: one wave of resident
        CTAs (registers and shared memory bound the occupancy). Per slice count ks, the
        cost of the busiest SM is its CTAs x (weight bytes + activation staging + partial
        sums written and re-read), divided by the fraction of ``KS_INFLIGHT`` its warps keep
        in flight (one block each with register prefetch); the cheapest wins, then fewer
        slices. SoA twin only, so both layouts cut and sum alike."""
        key = (rows, k, "ks", nz, cfg, n)
        hit = self._grids.get(key)
        if hit is not None:
            return hit
        bpr = k // q6k.QK_K
        sms = self.ctx.sm_count
        regs = -(-max(int(fn.num_regs), 1) // 8) * 8
        wpc = cfg.warps  # warps per CTA (K-slice tile 8/12/16, wgmma tile 4/8/12)
        occ_regs = max(1, min(64 // wpc, 65536 // (32 * wpc * regs)))
        wtiles = -(-rows // (16 * cfg.mt))
        toks = min(n, 8 * cfg.nt)
        best: tuple[float, int, int] | None = None
        choices = [cfg.ksplit] if cfg.ksplit > 0 else range(1, min(bpr, 64) + 1)
        for ks in choices:
            per = -(-bpr // min(ks, bpr))
            ks_eff = -(-bpr // per)
            smem = smem_bytes("mma_f16", cfg, per)
            if smem > KS_SMEM_MAX:
                continue
            occ = min(occ_regs, self.ctx.smem_sm // (smem + 1024))
            if occ < 1:
                continue
            gx = max(1, min(-(-wtiles // wpc), sms * occ // (ks_eff * nz)))
            rounds = -(-wtiles // (wpc * gx))
            gx = -(-wtiles // (wpc * rounds))  # as few CTAs as give the same rounds
            per_sm = -(-(gx * ks_eff * nz) // sms)
            wbytes = rounds * wpc * 16 * cfg.mt * per * 210
            xbytes = 8 * cfg.nt * per * 512 // 2  # L2 -> smem once, half a weight byte each
            # partial sums written, re-read by q6k_sum_parts, and that launch (~2 us of an SM)
            pbytes = 0 if ks_eff == 1 else 2 * rounds * wpc * 16 * cfg.mt * toks * 4 + (64 << 10)
            # blocks in flight per warp
            ahead = 1 if cfg.pf or cfg.src in WG_SRCS else 0.5  # (wgmma: always one ahead)
            inflight = min(occ, per_sm) * wpc * ahead * 16 * cfg.mt * 210
            cost = per_sm * (wbytes + xbytes + pbytes) / min(1.0, inflight / KS_INFLIGHT)
            if best is None or cost < best[0] * (1 - 1e-9):
                best = (cost, ks_eff, gx)
        if best is None:
            raise DeviceError(f"no K slice of mma_f16 {cfg.label()} fits shared memory (K={k})")
        if len(self._grids) > 4096:
            self._grids.clear()
        self._grids[key] = (best[2], best[1], nz)
        return best[2], best[1], nz

    def tile_cfg(self, path: str, cfg: Cfg) -> Cfg:
        """The launch shape a plan of ``cfg`` runs on this device."""
        if path == "mma_f16" and cfg.src in WG_SRCS and arch_specific(WG_FILE,
                                                                        self.ctx.cc) is None:
            # the wgmma tile builds for sm_90a only: elsewhere a table entry naming it (the
            # committed table was tuned on an H200) runs the K-slice tile of the same width
            return Cfg(nt=cfg.nt, src=4, pf=True)
        if path == "mma_f16" and cfg.src == 7 and int(self.ctx.cc) < 90:
            return replace(cfg, src=4)  # no clusters before sm_90: the sum as its own launch
        return cfg

    def row_chunks(self, lp: LaunchPlan, rows: int, k: int, layout: Layout, in_t: str,
                   path: str, cfg: Cfg, n: int, rps: int, want: int, pairs: bool = False,
                   ) -> list[tuple[int, int, LaunchPlan]] | None:
        """The row chunks of a K-slice tile call (module docstring, point 8): [(r0, r1, plan)],
        at most ``want``, each a run of whole slabs of ``rps`` rows as close as they allow to
        one launch round of ``lp``'s grid (gx CTAs x warps x 16 rows), each planned with
        ``lp``'s K split and token chunks (the in-kernel K slices follow gridDim.y, so every
        value is the full call's). None where it does not apply: not a ``Y_CHUNK_SRCS`` tile,
        one slab, one round, or a chunk whose plan would split K otherwise. ``pairs``: the
        weight's (CudaWeight.pairs), as for ``plan``."""
        if want < 2 or lp.path != "mma_f16" or lp.src not in Y_CHUNK_SRCS or rps >= rows:
            return None
        tc = self.tile_cfg(path, cfg)
        gx, ks, nz = lp.grid
        per_round = gx * tc.warps * 16 * tc.mt
        rounds = -(-rows // per_round)
        c = min(want, rounds)
        if c < 2:
            return None
        cuts = [0]
        for i in range(1, c):
            r = round(i * rounds / c) * per_round
            r = round(r / rps) * rps  # the nearest slab boundary
            if cuts[-1] < r < rows:
                cuts.append(r)
        cuts.append(rows)
        if len(cuts) < 3:
            return None
        forced = replace(cfg, ksplit=ks)
        out, total = [], 0
        for r0, r1 in itertools.pairwise(cuts):
            p = self.plan(r1 - r0, k, layout, in_t, path, forced, n, pairs)
            if p.grid[1] != ks or p.grid[2] != nz:
                return None
            total += -(-(r1 - r0) // (16 * tc.mt * tc.warps * p.grid[0]))  # its rounds
            out.append((r0, r1, p))
        # no more rounds than the full call's (a chunk past its round's rows would take two
        # rounds on fewer CTAs: slabs too coarse for this grid)
        return out if total <= rounds else None

    @staticmethod
    def part_cfg(cfg: Cfg, ks: int, m: int) -> Cfg:
        """The launch shape of a token part of ``m`` tokens of a ``cfg`` call split ``ks`` ways
        along K: that split, its tile narrowed to its tokens with ``X_SPLIT_FIT``."""
        c = replace(cfg, ksplit=ks)
        if X_SPLIT_FIT and cfg.src == 4:
            c = replace(c, nt=min(cfg.nt, 1 << (-(-m // 8) - 1).bit_length()))
        return c

    def token_parts(self, lp: LaunchPlan, rows: int, k: int, layout: Layout, in_t: str,
                    path: str, cfg: Cfg, n: int, want: int, pairs: bool = False,
                    ) -> list[tuple[int, int, LaunchPlan]] | None:
        """The token parts of a K-slice tile call (module docstring, point 10): [(t0, t1,
        plan)], ``want`` runs of whole 8-token columns, each planned with ``lp``'s K split (so
        every value is the full call's: tokens are independent columns of the same sums), its
        tile narrowed to its tokens with ``X_SPLIT_FIT``. None where it does not apply: not an
        ``X_SPLIT_SRCS`` tile, fewer than two parts, or a part whose plan would split K
        otherwise. ``pairs``: as for ``plan``."""
        if want < 2 or lp.path != "mma_f16" or lp.src not in X_SPLIT_SRCS:
            return None
        h = -(-n // (8 * want)) * 8
        cuts = [*range(0, n, h), n]
        if len(cuts) < 3:
            return None
        ks, out = lp.grid[1], []
        for t0, t1 in itertools.pairwise(cuts):
            p = self.plan(rows, k, layout, in_t, path, self.part_cfg(cfg, ks, t1 - t0),
                          t1 - t0, pairs)
            if p.grid[1] != ks:
                return None
            out.append((t0, t1, p))
        return out

    def plan(self, rows: int, k: int, layout: Layout, in_t: str, path: str, cfg: Cfg,
             n: int, pairs: bool = False) -> LaunchPlan:
        """``pairs``: the weight's SoA code planes are in pair-stream order (CudaWeight.pairs):
        the layout-2 instantiation on the SoA twin's grid (so the same results); a shape of
        two m-tiles per warp runs as one m-tile per warp with twice the warps (``pair_cfg``)."""
        bpr = k // q6k.QK_K
        tok_per_cta = cfg.nt if path == "exact" else 8 * cfg.nt
        nz = -(-n // tok_per_cta)
        rows_cta = cfg.warps * 16 * (1 if path == "exact" else cfg.mt)
        cfg = self.tile_cfg(path, cfg)
        file = kernel_file(path, cfg)
        run_cfg = pair_cfg(path, cfg) if pairs else cfg
        fn = self.ctx.fn(file, kernel_name(path, run_cfg, 2 if pairs else layout is Layout.SOA,
                                           in_t))
        soa_fn = self.ctx.fn(file, kernel_name(path, cfg, True, in_t))
        ks_tile = path == "mma_f16" and cfg.src in (4, 7, 8)
        if ks_tile:
            gx, ks, _ = self.ks_grid(rows, k, nz, cfg, soa_fn, n)
            if cfg.src == 7 and ks != cfg.ksplit:  # the cluster is the grid's ksplit slices
                raise DeviceError(f"mma_f16 {cfg.label()}: K={k} cuts into {ks} slices, "
                                  f"not {cfg.ksplit}")
        else:
            gx, ks, _ = self.grid(rows, k, rows_cta, nz, cfg, soa_fn, n, path)
            if run_cfg.warps * run_cfg.mt < cfg.warps * cfg.mt:  # pair_cfg: more CTAs
                gx = -(-rows // (run_cfg.warps * 16 * run_cfg.mt))
        smem = smem_bytes(path, cfg, -(-bpr // ks))
        for f in (fn, soa_fn):
            if smem > SMEM_LIMIT and int(f.max_dynamic_shared_size_bytes) < smem:
                f.max_dynamic_shared_size_bytes = smem
        if ks_tile and cfg.src == 7 and not clusters_fit(fn, (gx, ks, nz), 32 * run_cfg.warps,
                                                         smem, gx * nz):
            # the clusters would not all co-reside: the plain K-slice tile at the same split
            # (the same sums in the same order, so the same bits)
            return self.plan(rows, k, layout, in_t, path, replace(cfg, src=4), n, pairs)
        prep, prep_grid, sizes = None, (1,), (0, 0, 0)
        if path == "mma_f16" and cfg.src == 3:
            words = nz * bpr * cfg.nt * 8 * 32 * 4
            prep = self.ctx.fn(MATMUL_FILE, f"q6k_prep_f16<{cfg.nt}, {in_t}>")
            prep_grid, sizes = (min(65535, -(-(words // 4) // 256)),), (words, 0, 0)
        elif path == "mmq_q8_1":
            nt = cfg.nt
            total = nz * bpr * nt * 64
            prep = self.ctx.fn(MATMUL_FILE, f"q6k_prep_q8_1<{nt}, {in_t}>")
            prep_grid = (min(65535, -(-total // 256)),)
            sizes = (nz * bpr * nt * 4 * 32 * 4, nz * bpr * nt * 16 * 8, nz * bpr * nt * 8 * 8)
        post = (self.ctx.fn(MATMUL_FILE, "q6k_sum_parts") if ks_tile and ks > 1
                and cfg.src != 7 else None)
        return LaunchPlan(path, fn, (gx, ks, nz), 32 * run_cfg.warps, smem, ks, gx * nz, bpr,
                          nz, prep, prep_grid, sizes, post, cfg.src)

    def steps(self, lp: LaunchPlan, w: ResidentWeight, cw: CudaWeight, xd: int, y: int,
              n: int, r0: int = 0, r1: int | None = None) -> list[Step]:
        """The launches of one tile call, scratch from the workspace (call under the stream).
        ``r0``, ``r1``: a row chunk of whole slabs (:meth:`row_chunks`), its rows' own
        [N, r1 - r0] y at ``y``; the weight is the slab table's view from its first slab."""
        ws, u64, i32 = self.ws, np.uint64, np.int32
        rows = w.rows if r1 is None else r1 - r0
        table = int(cw.table.data.ptr) + 8 * (r0 // cw.rps)
        part = ws.ptr("part", lp.ks * n * rows * 4) if lp.ks > 1 else 0
        tickets = ws.ptr("tickets", 4 * max(lp.tickets, 1024), zero=True)
        wargs = (u64(table), i32(rows), i32(lp.bpr), i32(cw.rps))
        oargs = (u64(y), u64(part), u64(tickets), i32(n))
        pre = (u64(xd), i32(n), i32(w.k), i32(lp.nz))
        if lp.path == "exact":
            return [Step(lp.fn, lp.grid, lp.threads, (*wargs, u64(xd), i32(w.k), *oargs),
                         lp.smem)]
        if lp.path == "mma_f16":
            out, xp = [], 0
            if lp.prep is not None:
                xp = ws.ptr("xp", 4 * lp.prep_sizes[0])
                out.append(Step(lp.prep, lp.prep_grid, 256, (*pre, u64(xp))))
            out.append(Step(lp.fn, lp.grid, lp.threads,
                            (*wargs, u64(xd), i32(w.k), u64(xp), *oargs), lp.smem))
            if lp.post is not None:
                total = n * rows
                # a thread per four outputs where the sum reads and writes float4 (the kernel
                # also checks the pointers' alignment; its grid-stride loop covers any total)
                per = 4 if total >= SUM_VEC_MIN and total % 4 == 0 else 1
                out.append(Step(lp.post, (min(-(-total // (256 * per)), 4096),), 256,
                                (u64(part), u64(y), i32(lp.ks), np.int64(total)),
                                pdl=self._pdl_launcher() if lp.src in PDL_SRCS else None))
            return out
        xq = ws.ptr("xq", 4 * lp.prep_sizes[0])  # mmq_q8_1: quantize x, then the int8 tile
        corr = ws.ptr("corr", 4 * lp.prep_sizes[1])
        d8 = ws.ptr("d8", 4 * lp.prep_sizes[2])
        return [Step(lp.prep, lp.prep_grid, 256, (*pre, u64(xq), u64(corr), u64(d8))),
                Step(lp.fn, lp.grid, lp.threads, (*wargs, u64(xq), u64(corr), u64(d8), *oargs))]

    def _pdl_launcher(self) -> Any:
        """cuLaunchKernelEx when the split-K sum is to be launched with PDL (``pdl`` on, a
        device of compute capability 9.0 or newer, a driver that has it), else None."""
        if not self.pdl or int(self.ctx.cc) < 90:
            return None
        if self._launch_ex is None:
            self._launch_ex = _driver_launch_ex() or False
        return self._launch_ex or None

    # -- device-side call (bench, tests) -------------------------------------------------------
    def enqueue(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str, path: str,
                cfg: Cfg | None) -> Any:
        """``y = xd · Wᵀ`` (f32, a new device array) enqueued on the stream, no sync."""
        cp = self.ctx.cp
        n = int(xd.shape[0])
        y = cp.empty((n, w.rows), cp.float32)
        if path == "cublas_f16":
            self.cublas(w, cw, xd, in_t, y)
            return y
        if cfg is None:
            raise DeviceError(f"{path} needs a launch shape")
        lp = self.plan(w.rows, w.k, w.layout, in_t, path, cfg, n, cw.pairs)
        for s in self.steps(lp, w, cw, int(xd.data.ptr), int(y.data.ptr), n):
            s()
        return y

    def cublas(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str, y: Any) -> None:
        cp = self.ctx.cp
        from cupy_backends.cuda.libs import cublas

        n = int(xd.shape[0])
        if in_t == "InF16":
            x16 = xd
        elif in_t == "InF32":
            x16 = xd.astype(cp.float16)
        else:  # bf16 bits -> f32 (exact) -> f16
            x16 = (xd.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float16)
        x16 = cp.ascontiguousarray(x16)
        soa = "true" if w.layout is Layout.SOA else "false"
        tile_rows = max(16, min(w.rows, CUBLAS_TILE_BYTES // (2 * w.k)))
        w16 = cp.empty((tile_rows, w.k), cp.float16)
        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.ctx.stream.ptr)
        one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
        bpr = w.k // q6k.QK_K
        soa = "2" if cw.pairs else soa  # pair-stream slabs
        dequant = self.ctx.fn(MATMUL_FILE, f"q6k_dequant_f16<{soa}>")
        for r0 in range(0, w.rows, tile_rows):
            rt = min(tile_rows, w.rows - r0)
            total = rt * bpr * 4
            dequant((min(65535 * 8, -(-total // 256)),), (256,),
                    (cw.table, np.int32(w.rows), np.int32(bpr), np.int32(cw.rps),
                     np.int32(r0), np.int32(rt), w16))
            # column-major: C[rt, n] (ldc = rows) = W16[rt, K] (op T of [K, rt]) . X16[K, n]
            cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, rt, n, w.k,
                          one.ctypes.data, w16.data.ptr, _CUDA_R_16F, w.k,
                          x16.data.ptr, _CUDA_R_16F, w.k,
                          zero.ctypes.data, y.data.ptr + 4 * r0, _CUDA_R_32F, w.rows,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)

    # -- the host path of one batch ------------------------------------------------------------
    def matmul(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
               cfg: Cfg | None, out_dtype: np.dtype | None, topk: int = 0) -> Done:
        """Host x -> (host y, None, kernel seconds), one stream sync (see the module
        docstring); ``topk`` > 0: (None, the epilogue's result, kernel seconds), the epilogue
        run on the device y (kernels/cuda_topk.py). Call under the device and stream."""
        return self.launch(w, cw, x, path, cfg, out_dtype, topk)()

    def launch(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
               cfg: Cfg | None, out_dtype: np.dtype | None, topk: int = 0,
               chunks: int | None = None) -> Callable[[], Done]:
        """:meth:`matmul` up to its sync: everything is enqueued (upload, kernels, epilogue,
        download into pinned memory) in a free launch slot; the returned function waits for
        this launch's completion event and returns what :meth:`matmul` does (call it once,
        from any thread; at most ``SLOTS`` launches may await their wait). ``chunks``: the
        row chunks of a large y (None: :meth:`chunks_for` the slot now)."""
        in_t = IN_TYPES.get(x.dtype)
        if in_t is None:
            raise FormatError(f"unsupported activation dtype {x.dtype}")
        ws = self.ws
        staged = x is ws.staged  # built in place (CudaBackend.staging): by identity, as
        slot = ws.staged_slot if staged else ws.free_slot()  # ndarray.ctypes costs ~4 us
        host = self._stage_x(x, slot, staged)
        if chunks is None:
            chunks = self.chunks_for(cw, slot, int(x.shape[0]) * w.rows, x.nbytes,
                                     int(x.shape[0]))
        return self._in_slot(slot, lambda: self._launch_in(w, cw, x, in_t, path, cfg,
                                                           out_dtype, topk, slot, host,
                                                           chunks))

    def _stage_x(self, x: np.ndarray, slot: int, staged: bool) -> np.ndarray:
        """``slot``'s pinned staging buffer with x in it (``staged``: built there already, and
        refused while a launch in flight still uses it)."""
        ws = self.ws
        if staged and ws.held(slot):
            raise DeviceError("x was staged in a buffer a launch in flight still uses")
        xb = x.reshape(-1).view(np.uint8)
        host = ws.host(xb.size, slot)
        if not staged:
            fill_x(host, xb)
        return host

    def bound_call(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
                   cfg: Cfg | None, out_dtype: np.dtype | None, topk: int, slot: int,
                   kernel: str, precision: Precision, chunks: int = 0) -> BoundCall | None:
        """The :class:`BoundCall` of a call just launched by :meth:`launch` in ``slot`` (the
        same arguments; ``chunks``: the row chunks it was launched with, :meth:`chunks_for`),
        or None while its sequence is not a captured graph (or has none: cuBLAS, an epilogue
        that cannot be bound)."""
        if path == "cublas_f16" or cfg is None or x.dtype not in IN_TYPES:
            return None
        n = int(x.shape[0])
        small = _small_out(n, w.rows, out_dtype, topk, self.y16_graph, chunks)
        if topk and small is None:
            return None
        b = cw.plans.get((path, cfg, n, IN_TYPES[x.dtype], small, slot))
        if b is None or not b.graph or b.gen != self.ws.gen:
            return None
        return BoundCall(self, b, slot, n, w.rows, out_dtype, topk, kernel, w.layout, precision,
                         x.dtype, chunks)

    def _in_slot(self, slot: int, enqueue: Callable[[], Callable[[], Done]],
                 ) -> Callable[[], Done]:
        """``enqueue()`` (a launch's work, enqueued in ``slot``; returns its finish) with the
        slot held until the returned wait has run, and the slot's completion event after it."""
        ws = self.ws
        ws.take(slot)
        try:
            finish = enqueue()
            ws.done_event(slot).record(self.ctx.stream)
        except BaseException:
            ws.release(slot)
            raise

        def done() -> Done:
            try:
                return finish()
            finally:
                ws.release(slot)

        return done

    def _launch_in(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, in_t: str,
                   path: str, cfg: Cfg | None, out_dtype: np.dtype | None, topk: int,
                   slot: int, host: np.ndarray, chunks: int) -> Callable[[], Done]:
        """:meth:`launch`'s enqueueing in ``slot`` (x already in its staging buffer ``host``;
        ``chunks``: a large y's split, :meth:`chunks_for`)."""
        stream = self.ctx.stream
        n = int(x.shape[0])
        if path == "cublas_f16":
            return self._matmul_direct(w, cw, x, in_t, out_dtype, topk, slot)
        if cfg is None:
            raise DeviceError(f"{path} needs a launch shape")
        key = (path, cfg, n, in_t, _small_out(n, w.rows, out_dtype, topk, self.y16_graph,
                                               chunks), slot)
        b = cw.plans.get(key)
        if b is None or b.gen != self.ws.gen:
            b = self._bind(w, cw, key, x.nbytes)
        if b.graph:
            b.graph.launch(stream)
            finish = self._finish_bound(b, n, w.rows, out_dtype, topk, slot)

            def graph_done() -> Done:
                done = finish()
                if done[2] is None:
                    b.graph = False  # its event nodes did not record: direct launches from now
                return done

            return graph_done
        self._upload(b, host.ctypes.data)
        self._kernels(b, lambda ev: ev.record(stream))
        self._download(b)
        b.calls += 1
        if self.graphs and b.graph is None and b.calls > GRAPH_AFTER:
            self._capture(b, host)
        return self._finish_bound(b, n, w.rows, out_dtype, topk, slot)

    def launch_device(self, w: ResidentWeight, cw: CudaWeight, xd: Any, in_t: str,
                      path: str, cfg: Cfg, slot: int | None = None) -> tuple[Any, Any, Any]:
        """A tile call on activations already on the device (a caller's CUDA IPC region):
        ``xd`` is copied into the workspace's x, then the bound sequence runs (a graph from
        its second call), so the events around its kernels time the kernels only (events
        around direct launches also timed the Python between them: 272 vs 63 us at N=64).
        Returns (y, start, end): y a view of the workspace's f32 output [N, rows], valid until
        the next launch on this launcher. Call under the device and stream; no sync.
        ``slot``: the launch slot the caller holds (``Workspace.take``), whose own bound
        sequence and events this call uses, so that two calls can be in flight (None: one
        waited for before anything else launches)."""
        n = int(xd.shape[0])
        b = self.run_copied_x(w, cw, path, cfg, n, in_t, int(xd.data.ptr), int(xd.nbytes),
                              _D2D, slot)
        return self.ws.array("y", (n, w.rows), np.float32), b.start, b.end

    def run_copied_x(self, w: ResidentWeight, cw: CudaWeight, path: str, cfg: Cfg, n: int,
                     in_t: str, src: int, nbytes: int, kind: int, slot: int | None,
                     more: tuple[tuple[int, int], ...] = ()) -> Bound:
        """x copied from ``src`` (``kind``: device or page-locked host memory) into the
        workspace's x, then the kernels of the bound sequence that has no upload of its own
        (:meth:`launch_device`, :meth:`launch_host`): its graph, or direct launches between
        its events (captured from the call after ``GRAPH_AFTER``), of launch slot ``slot``
        (None: a call waited for before anything else launches). Returns the sequence, whose
        ``extra["y"]`` is the device address of its f32 y [N, rows] (valid until the next
        launch) and ``start`` / ``end`` the events around its kernels. Public: a caller that
        already chose the path and shape for a repeated call (service/cuda_regions.py's
        ``CudaSupport._launch_known``) runs it without the backend's checks. Call under the
        device and stream; no sync. ``more``: x's further pieces, (address, bytes) each, copied
        after ``src``'s ``nbytes`` in order (x's rows from several page-locked places:
        :meth:`launch_pieces`)."""
        key = (path, cfg, n, in_t, "device", slot)
        b = cw.plans.get(key)
        if b is None or b.gen != self.ws.gen:
            b = self._bind(w, cw, key, nbytes + sum(nb for _, nb in more))
            b.extra["device_x"] = True
        stream = self.ctx.stream
        copy = self.ctx.cp.cuda.runtime.memcpyAsync
        copy(b.extra["xd"], src, nbytes, kind, stream.ptr)
        if more:
            at = b.extra["xd"] + nbytes
            for p, nb in more:
                copy(at, p, nb, kind, stream.ptr)
                at += nb
        if b.graph:
            b.graph.launch(stream)
            return b
        b.start.record(stream)
        for s in b.steps:
            s()
        b.end.record(stream)
        b.calls += 1
        if self.graphs and b.graph is None and b.calls > GRAPH_AFTER:
            self._capture(b, self.ws.host(b.x_bytes, slot or 0))
        return b

    def launch_host(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
                    cfg: Cfg, out_dtype: np.dtype | None,
                    y_out: np.ndarray | None) -> Callable[[], Done]:
        """:meth:`launch` for an x in page-locked host memory (a caller's registered shm
        region, kernels/hostio.py): DMA'd straight from there into the workspace's x (no copy
        into the staging buffer), then :meth:`launch_device`'s bound sequence (its graph has no
        upload); ``y_out`` (page-locked, [N, rows] f32/f16): y is DMA'd straight into it and
        returned as the result (else the usual way out, :meth:`_finish`). Call under the
        device and stream; the returned function makes the one sync (a launch slot's, as
        :meth:`launch`)."""
        slot = self.ws.free_slot()
        return self._in_slot(slot, lambda: self._launch_host_in(w, cw, x, path, cfg, out_dtype,
                                                                y_out, slot))

    def launch_pieces(self, w: ResidentWeight, cw: CudaWeight,
                      pieces: tuple[tuple[int, int], ...], n: int, in_t: str, path: str,
                      cfg: Cfg, out_dtype: np.dtype | None, slot: int) -> Callable[[], Done]:
        """:meth:`launch_host` for an x of ``n`` rows whose pieces, (address, bytes) each in
        row order, lie in page-locked host memory (a merged batch's rows in the service's
        front-end arenas: ``CudaBackend.gathered``): each DMA'd straight into its rows of the
        workspace's x (no concatenation on the host), then :meth:`launch_device`'s bound
        sequence; y the usual way out (:meth:`_finish`). In launch slot ``slot`` (free). Call
        under the device and stream; the returned function makes the one sync."""
        def enqueue() -> Callable[[], Done]:
            b = self.run_copied_x(w, cw, path, cfg, n, in_t, pieces[0][0], pieces[0][1], _H2D,
                                  slot, pieces[1:])
            return self._finish(b.extra["y"], n, w.rows, out_dtype, b.start, b.end, 0, slot)

        return self._in_slot(slot, enqueue)

    def _launch_host_in(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, path: str,
                        cfg: Cfg, out_dtype: np.dtype | None, y_out: np.ndarray | None,
                        slot: int) -> Callable[[], Done]:
        n = int(x.shape[0])
        b = self.run_copied_x(w, cw, path, cfg, n, IN_TYPES[x.dtype], x.ctypes.data,
                              x.nbytes, _H2D, slot)
        cp, stream = self.ctx.cp, self.ctx.stream
        if y_out is None:
            return self._finish(b.extra["y"], n, w.rows, out_dtype, b.start, b.end, 0, slot)
        src = self._y_out(b.extra["y"], n, w.rows, y_out.dtype == np.float16)
        cp.cuda.runtime.memcpyAsync(y_out.ctypes.data, src, y_out.nbytes, _D2H, stream.ptr)
        start, end = b.start, b.end

        def done() -> Done:
            self._wait(slot)
            seconds = self._seconds(start, end)
            if seconds is None and b.graph:
                b.graph = False  # its event nodes did not record: direct launches from now
            return y_out, None, seconds

        return done

    def _wait(self, slot: int | None) -> None:
        """Block until the launch in ``slot`` is done (None: everything on the stream)."""
        if slot is None:
            self.ctx.stream.synchronize()
        else:
            self.ws.done_event(slot).synchronize()

    def _bind(self, w: ResidentWeight, cw: CudaWeight, key: tuple, x_bytes: int) -> Bound:
        path, cfg, n, in_t, small, slot = key
        small = small if small != "device" else None  # launch_device: y stays on the device
        slot = slot or 0  # (None: launch_device's, which has no host buffers of its own)
        cp = self.ctx.cp
        lp = self.plan(w.rows, w.k, w.layout, in_t, path, cfg, n, cw.pairs)
        # All buffers first (any growth bumps the generation), then the pointers.
        kind = small[0] if isinstance(small, tuple) else None
        if (kind == "tokens" and lp.src not in X_SPLIT_Y_SRCS
                and not (X_SPLIT_MIN and x_bytes >= X_SPLIT_MIN)):
            # halves by y's size on a tile whose halves re-read the weight on its full width
            # (src 8): the weight's own row chunks instead (X_SPLIT_Y_SRCS; none: whole). The
            # call's key keeps its state (Launcher.chunks_for knows no tile).
            want = small[2] if len(small) > 2 else self.chunks_wanted(cw)
            small = ("rows", want) if want > 1 else None
            kind = small[0] if small else None
        chunks = (self.row_chunks(lp, w.rows, w.k, w.layout, in_t, path, cfg, n, cw.rps,
                                  small[1], cw.pairs) if kind == "rows" else None)
        halves = (self.token_parts(lp, w.rows, w.k, w.layout, in_t, path, cfg, n, small[1],
                                   cw.pairs) if kind == "tokens" else None)
        sub = small[2] if kind == "tokens" and len(small) > 2 else 0  # X_SPLIT_ROWS's chunks
        # each half's row chunks (its own plan's rounds; None: the half whole)
        parts = [(t0, t1, tp, self.row_chunks(tp, w.rows, w.k, w.layout, in_t, path,
                                               self.part_cfg(cfg, tp.grid[1], t1 - t0), t1 - t0,
                                               cw.rps, sub, cw.pairs) if sub > 1 else None)
                 for t0, t1, tp in halves or ()]
        isz = x_bytes // (n * w.k)
        for _ in range(2):
            gen = self.ws.gen
            self.ws.host(x_bytes, slot)
            xd = self.ws.ptr("x", x_bytes)
            y = self.ws.ptr("y", 4 * n * w.rows)
            marks: dict[int, Any] = {}
            waits: dict[int, Any] = {}
            xparts: list[tuple[int, int, Any]] = []
            copies: list[tuple[int, int, int, int, int, int]] = []
            if chunks:  # point 8: each chunk's launches, then its event (not the last's)
                steps = []
                for r0, r1, cp_ in chunks:
                    steps += self.steps(cp_, w, cw, xd, y + 4 * n * r0, n, r0, r1)
                    if r1 < w.rows:
                        marks[len(steps) - 1] = cp.cuda.Event(disable_timing=True)
                    width = 4 * (r1 - r0)  # its [N, r1 - r0] block into its columns
                    copies.append((4 * r0, 4 * n * r0, 4 * w.rows, width, width, n))
            elif halves:  # point 10: each half's x, launches and y
                steps = []
                for t0, t1, tp, rcs in parts:
                    m, xh, yh = t1 - t0, xd + t0 * w.k * isz, y + 4 * t0 * w.rows
                    ev = cp.cuda.Event(disable_timing=True) if t0 else None
                    xparts.append((t0 * w.k * isz, m * w.k * isz, ev))
                    if ev is not None:  # its x uploaded on the x stream: waited for here
                        waits[len(steps)] = ev
                    row = 4 * w.rows
                    if not rcs:  # its tokens' rows of y, in place
                        steps += self.steps(tp, w, cw, xh, yh, m)
                        if t1 < n:
                            marks[len(steps) - 1] = cp.cuda.Event(disable_timing=True)
                        copies.append((4 * t0 * w.rows, 4 * t0 * w.rows, row, row, row, m))
                        continue
                    for r0, r1, rp in rcs:  # (X_SPLIT_ROWS) its [m, r1 - r0] blocks in turn
                        steps += self.steps(rp, w, cw, xh, yh + 4 * m * r0, m, r0, r1)
                        if t1 < n or r1 < w.rows:
                            marks[len(steps) - 1] = cp.cuda.Event(disable_timing=True)
                        width = 4 * (r1 - r0)  # into its tokens' rows, its columns
                        copies.append((4 * (t0 * w.rows + r0), 4 * (t0 * w.rows + m * r0), row,
                                       width, width, m))
            else:
                steps = self.steps(lp, w, cw, xd, y, n)
            out, post, y16big = None, [], None
            if kind in ("rows", "tokens"):  # y's way out enqueued per call (_chunks_out/_finish)
                pass
            elif small == "y16":  # a larger f16 y: converted in the sequence, copied per call
                y16big = self.ws.ptr("y16b", 2 * n * w.rows)
            elif kind == "topk":  # the top-k epilogue and its download, bound in
                k = small[1]
                packed = self.ws.ptr("topk_packed", cuda_topk.packed_bytes(n, k))
                scratch = self.ws.ptr("topk_scratch", cuda_topk.scratch_bytes(n, w.rows))
                post = [Step(self.ctx.fn(cuda_topk.TOPK_FILE, name), grid, threads, args)
                        for name, grid, threads, args in cuda_topk.group_launches(
                            y, n, w.rows, k, packed, scratch)]
                nbytes = cuda_topk.packed_bytes(n, k)
                out = (packed, self.ws.host_out(nbytes, slot)[:nbytes].view(np.int32)
                       .reshape(n, 2 * k + 1))
            elif small is not None:  # y's way out is part of the sequence (SMALL_Y)
                y16 = self.ws.ptr("y16b", 2 * n * w.rows) if small == np.float16 else 0
                nbytes = n * w.rows * small.itemsize
                out = (y16, self.ws.host_out(nbytes, slot)[:nbytes].view(small).reshape(n,
                                                                                     w.rows))
            if gen == self.ws.gen:
                break
        if len(cw.plans) >= MAX_PLANS_PER_WEIGHT:
            cw.plans.clear()
        b = Bound(self.ws.gen, x_bytes, steps, cp.cuda.Event(), cp.cuda.Event(),
                  extra={"xd": xd, "y": y, "out": out, "post": post, "y16": y16big,
                         "shape": (n, w.rows)})
        if copies:
            evs = [*marks.values(), None]  # (the last chunk's copy follows its kernels)
            b.extra.update(marks=marks, join=cp.cuda.Event(disable_timing=True),
                           copies=[(*c, ev) for c, ev in zip(copies, evs, strict=True)])
        if chunks:
            b.extra["chunks"] = [(r0, r1, ev) for (r0, r1, _), ev in zip(chunks, evs,
                                                                         strict=True)]
        if halves:
            b.extra.update(waits=waits, xparts=xparts, tokens=[(t0, t1) for t0, t1, _ in halves],
                           fork=cp.cuda.Event(disable_timing=True),
                           token_rows=[(t0, t1, r0, r1) for t0, t1, _, rcs in parts
                                       for r0, r1, _ in rcs or ()])
        cw.plans[key] = b
        return b

    def _download(self, b: Bound) -> None:
        """A small y's way out, enqueued after the kernels (a bound sequence's last part, in
        its graph too): f16 converted on the device, then copied into the pinned out buffer;
        or the top-k epilogue's launches and its packed rows' copy into that buffer."""
        out = b.extra["out"]
        cp = self.ctx.cp
        if out is None:
            if b.extra.get("y16") is not None:  # a larger f16 y: only its conversion here
                shape = b.extra["shape"]
                cp.copyto(self.ws.array("y16b", shape, np.float16),
                          self.ws.array("y", shape, np.float32), casting="same_kind")
            return
        if b.extra["post"]:  # the top-k epilogue (after the end event: not kernel time)
            for s in b.extra["post"]:
                s()
            packed, host = out
            self._copy(host.ctypes.data, packed, host.nbytes, _D2H)
            return
        y16, host = out
        src = b.extra["y"]
        if y16 and self._y16_out(host.ctypes.data, src, host.size):  # (one kernel: Y16_COPY)
            return
        if y16:  # ("y16b": bound, unlike _finish's "y16"; at the bound size: nothing grows)
            cp.copyto(self.ws.array("y16b", host.shape, np.float16),
                      self.ws.array("y", host.shape, np.float32), casting="same_kind")
            src = y16
        self._copy(host.ctypes.data, src, host.nbytes, _D2H)

    def _finish_bound(self, b: Bound, n: int, rows: int, out_dtype: np.dtype | None,
                      topk: int, slot: int) -> Callable[[], Done]:
        """:meth:`_finish` of a bound sequence: a small y is already on its way to the pinned
        out buffer (``_download``); the sync, then a copy of it, is all that is left."""
        out = b.extra["out"]
        if out is None and b.extra.get("y16") is not None:  # converted by the sequence
            return self._finish(b.extra["y16"], n, rows, out_dtype, b.start, b.end, topk, slot,
                                converted=True)
        if out is None:
            return self._finish(b.extra["y"], n, rows, out_dtype, b.start, b.end, topk, slot,
                                bound=b if b.extra.get("copies") else None)
        start, end, host = b.start, b.end, out[1]
        if topk:
            def top_done() -> Done:
                self._wait(slot)
                # (a copy: the buffer is the slot's, and unpack may return views of it)
                return None, cuda_topk.unpack(host.copy(), topk), self._seconds(start, end)

            return top_done

        def done() -> Done:
            self._wait(slot)
            return host.copy(), None, self._seconds(start, end)  # the buffer is reused

        return done

    def _capture(self, b: Bound, host: np.ndarray) -> None:
        """Capture b's sequence as a graph; on any refusal keep direct launches for it."""

        def enqueue(record: Callable[[Any], None]) -> None:
            # x from the host staging (else copied before); a copy kernel's upload has no
            # copy engine's hand-off to keep out of the events (no anchor)
            if not b.extra.get("device_x") and not self._upload(b, host.ctypes.data):
                self._anchor_step()
            self._kernels(b, record)
            self._anchor_step(after_end=True)
            self._download(b)

        b.graph = self.capture(enqueue)

    def copy_limit(self) -> int:
        """Bytes up to which :meth:`_copy` uses the copy kernel (0: never)."""
        return COPY_KERNEL_MAX if self.copy_kernel_max is None else self.copy_kernel_max

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> bool:
        """``nbytes`` from ``src`` to ``dst`` on the stream (a direct launch, or a node under
        capture): by the copy kernel (COPY_SRC; True) when it is at most :meth:`copy_limit`
        bytes and both addresses are 16-byte aligned, else by ``memcpyAsync`` (``kind``: its
        direction) on the copy engine (False). Host addresses must be the device's too
        (cudaHostAlloc'd, or mapped: :meth:`device_ptr`)."""
        if not self.by_kernel(nbytes, dst, src):
            self.ctx.cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, self.ctx.stream.ptr)
            return False
        self._kernel_copy(dst, src, nbytes)
        return True

    def by_kernel(self, nbytes: int, *ptrs: int) -> bool:
        """Whether :meth:`_copy` moves ``nbytes`` between ``ptrs`` by the copy kernel."""
        return 0 < nbytes <= self.copy_limit() and all(p % 16 == 0 for p in ptrs)

    def _kernel_copy(self, dst: int, src: int, nbytes: int) -> None:
        """The copy kernel (COPY_SRC) on the stream; both addresses the device's."""
        stream = self.ctx.stream
        if self._copy_fn is None:
            self._copy_fn = self.ctx.cp.RawKernel(COPY_SRC, "q6_copy")
        blocks = max(1, min(COPY_MAX_BLOCKS, -(-(nbytes >> 4) // COPY_THREADS)))
        self._copy_fn((blocks,), (COPY_THREADS,), (np.uint64(src), np.uint64(dst),
                                                    np.int64(nbytes)), stream=stream)

    def _y16_out(self, dst: int, src: int, count: int) -> bool:
        """A small f16 y's way out: ``count`` f32 values of the device y at ``src`` into the
        host buffer at ``dst`` as f16 by COPY_H_SRC (True), where ``Y16_COPY`` is on and the
        copy kernel would take those bytes (:meth:`by_kernel`); False: nothing done (convert,
        then :meth:`_copy`)."""
        if not Y16_COPY or not self.by_kernel(2 * count, dst, src):
            return False
        if self._copy_h_fn is None:
            self._copy_h_fn = self.ctx.cp.RawKernel(COPY_H_SRC, "q6_copy_h")
        blocks = max(1, min(COPY_MAX_BLOCKS, -(-(count >> 3) // COPY_THREADS)))
        self._copy_h_fn((blocks,), (COPY_THREADS,), (np.uint64(src), np.uint64(dst),
                                                      np.int64(count)),
                        stream=self.ctx.stream)
        return True

    def device_ptr(self, host: int) -> int | None:
        """The device's address of registered page-locked host memory at ``host`` (a region:
        ``cudaHostRegister``ed, whose device address need not be the host's), or None where
        the driver gives none."""
        if self._dev_ptr is None:
            self._dev_ptr = _host_device_ptr() or False
        if not self._dev_ptr:
            return None
        out = ctypes.c_uint64()
        with self.ctx.dev:
            if self._dev_ptr(ctypes.byref(out), ctypes.c_void_p(host), 0) != 0:
                return None
        return int(out.value)

    def _anchor_step(self, after_end: bool = False) -> None:
        """``timing_anchor`` (under capture, after x's upload): an empty one-thread kernel
        before the start event. H200, session 17 (bench/kernel_gap.py): the events around a
        graph's kernel read 22.7 us with no copy before them, 29.3 after x's upload, for a
        kernel of 20.2 us by CUPTI either way; the start event node after the copy node is
        recorded before the copy's hand-off to the kernels' engine. ``after_end``: the one after
        the end event (``timing_anchor`` 2), before y's download."""
        if self.timing_anchor < (2 if after_end else 1):
            return
        if self._anchor is None:
            self._anchor = self.ctx.cp.RawKernel(ANCHOR_SRC, "q6_timing_anchor")
        self._anchor((1,), (1,), ())

    def _kernels(self, b: Bound, record: Callable[[Any], None]) -> None:
        """b's launches between its timing events, with each row chunk's event after its
        launches (point 8; ``record``: a plain record, or a graph node under capture)."""
        record(b.start)
        marks, waits = b.extra.get("marks"), b.extra.get("waits")
        for i, s in enumerate(b.steps):
            if waits and i in waits:  # (point 10: the token half's x, uploaded on the x stream)
                self.ctx.stream.wait_event(waits[i])
            s()
            if marks and i in marks:
                record(marks[i])
        record(b.end)

    def _chunks_out(self, b: Bound, dst: int) -> None:
        """Enqueue a split y's way out into ``dst`` (host, [N, rows] f32): a 2D copy of each
        part (a row chunk's [N, r1 - r0] block into its columns, point 8; a token half's rows,
        point 10) - all but the last on the y copy stream, each once its part's event fired;
        the last on the backend's stream after its kernels (no hand-off between streams at the
        end of the call) once the copy stream's copies are done (the backend's stream orders
        everything after it: a later launch reuses the device y)."""
        rt, stream = self.ctx.cp.cuda.runtime, self.ctx.stream
        ys = self.y_stream()
        y = b.extra["y"]
        copies = b.extra["copies"]
        for i, (doff, soff, dpitch, spitch, width, height, ev) in enumerate(copies):
            last = i == len(copies) - 1
            if last:
                join = b.extra["join"]
                join.record(ys)
                stream.wait_event(join)
            else:
                ys.wait_event(ev)
            rt.memcpy2DAsync(dst + doff, dpitch, y + soff, spitch, width, height, _D2H,
                             stream.ptr if last else ys.ptr)

    def _upload(self, b: Bound, src: int) -> bool:
        """x's upload from the host at ``src`` into the sequence's device x, on the stream (by
        the copy kernel where :meth:`_copy` takes it: True); the token halves' (point 10): the
        first half's on the stream, then the stream forks to the x stream, which uploads the
        rest (each half's event after its copy: the stream waits for it before that half's
        kernels, ``_kernels``)."""
        rt, stream = self.ctx.cp.cuda.runtime, self.ctx.stream
        xd, xparts = b.extra["xd"], b.extra.get("xparts")
        if not xparts:
            return self._copy(xd, src, b.x_bytes, _H2D)
        xs = self.x_stream()
        for off, nbytes, ev in xparts:
            if ev is None:
                rt.memcpyAsync(xd + off, src + off, nbytes, _H2D, stream.ptr)
                b.extra["fork"].record(stream)
                xs.wait_event(b.extra["fork"])
            else:
                rt.memcpyAsync(xd + off, src + off, nbytes, _H2D, xs.ptr)
                ev.record(xs)
        return False

    def capture(self, enqueue: Callable[[Callable[[Any], None]], None]) -> Any:
        """``enqueue(record)`` captured on the stream as a graph, each ``record(event)`` an
        external event record node (so the events time the graph's kernels); False on any
        refusal (the caller keeps direct launches)."""
        if self._record_ext is None:
            self._record_ext = _external_record() or False
        if not self._record_ext:
            return False
        stream, rt = self.ctx.stream, self.ctx.cp.cuda.runtime
        try:
            stream.begin_capture(getattr(rt, "streamCaptureModeRelaxed", 2))
        except Exception:
            return False
        ok, graph = [True], None

        def record(ev: Any) -> None:
            ok[0] = ok[0] and self._record_ext(ev.ptr, stream.ptr, 1) == 0

        try:
            enqueue(record)
        except Exception:
            ok[0] = False
        finally:
            try:
                graph = stream.end_capture()
            except Exception:
                ok[0] = False
        return graph if ok[0] and graph is not None else False

    def _matmul_direct(self, w: ResidentWeight, cw: CudaWeight, x: np.ndarray, in_t: str,
                       out_dtype: np.dtype | None, topk: int, slot: int) -> Callable[[], Done]:
        cp, stream = self.ctx.cp, self.ctx.stream
        n = int(x.shape[0])
        xdt = np.dtype(np.uint16) if x.dtype == BFLOAT16 else x.dtype
        xd = self.ws.array("x", x.shape, xdt)
        cp.cuda.runtime.memcpyAsync(xd.data.ptr, self.ws.host(x.nbytes, slot).ctypes.data,
                                    x.nbytes, _H2D, stream.ptr)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        y = self.ws.array("y", (n, w.rows), np.float32)
        self.cublas(w, cw, xd, in_t, y)
        end.record(stream)
        return self._finish(int(y.data.ptr), n, w.rows, out_dtype, start, end, topk, slot)

    def _finish(self, y: int, n: int, rows: int, out_dtype: np.dtype | None, start: Any,
                end: Any, topk: int, slot: int | None = None,
                converted: bool = False, bound: Bound | None = None) -> Callable[[], Done]:
        """Enqueue y's way out: the workspace's f32 "y" at ``y`` -> a host array over a pinned
        block (``Workspace.y_block``: reused once no array of it is left; no host copy), or
        the top-k epilogue. The returned function makes the one sync and reads the kernel
        seconds (the events are complete by then). ``bound``: a row-chunked sequence's, y's
        way out chunk by chunk."""
        cp, stream = self.ctx.cp, self.ctx.stream
        if topk:
            from ..cuda_topk import topk_enqueue

            top = topk_enqueue(cp, self.ws.array("y", (n, rows), np.float32), topk, stream)

            def top_done() -> Done:
                self._wait(slot)  # (its own download is enqueued before the slot's event)
                return None, top(), self._seconds(start, end)

            return top_done
        half = out_dtype is not None and np.dtype(out_dtype) == np.float16
        if not converted:  # (converted: y is already the f16 conversion, bound in)
            y = self._y_out(y, n, rows, half)
        item, dt = (2, np.dtype(np.float16)) if half else (4, np.dtype(np.float32))
        nbytes = n * rows * item
        ptr, blk = self.ws.y_block(nbytes)
        out = blk.view(dt).reshape(n, rows)
        if bound is not None:
            self._chunks_out(bound, ptr)
        else:
            cp.cuda.runtime.memcpyAsync(ptr, y, nbytes, _D2H, stream.ptr)

        def done() -> Done:
            self._wait(slot)
            host = out
            if out_dtype is not None and np.dtype(out_dtype) == BFLOAT16:
                host = out.astype(BFLOAT16)
            return host, None, self._seconds(start, end)

        return done

    def _y_out(self, y: int, n: int, rows: int, half: bool) -> int:
        """The device address y leaves from: the workspace's f32 y at ``y``, or (``half``) its
        f16 conversion enqueued into the workspace's "y16" (half the bytes cross the bus)."""
        if not half:
            return y
        y16 = self.ws.array("y16", (n, rows), np.float16, bound=False)
        self.ctx.cp.copyto(y16, self.ws.array("y", (n, rows), np.float32), casting="same_kind")
        return int(y16.data.ptr)

    def _seconds(self, start: Any, end: Any) -> float | None:
        try:
            return self.ctx.cp.cuda.get_elapsed_time(start, end) / 1e3
        except Exception:  # an event a refused graph node never recorded: no figure
            return None

    # -- a multi-weight call: one x, several weights of its K, one sequence --------------------
    def launch_many(self, weights: list[ResidentWeight], cws: list[CudaWeight], x: np.ndarray,
                    parts: list[tuple[str, Cfg]], out_dtype: np.dtype | None,
                    slot: int, staged: bool) -> Callable[[], Any]:
        """A multi-weight call in ``slot`` (``CudaBackend.launch_many``; every part a tile path
        with its launch shape, x checked): x's one upload, every part's launches between its
        events on the stream, all y's in one device buffer and one download; the returned
        function waits for the slot's completion event and returns (y, kernel seconds) per
        part. A :class:`ManyBound` per (parts, N, dtype, y's way out, slot), captured as a
        graph from its second call (``GRAPH_AFTER``). Call under the device and stream."""
        in_t = IN_TYPES[x.dtype]
        host = self._stage_x(x, slot, staged)
        return self._in_slot(slot, lambda: self._many_in(weights, cws, x, in_t, parts,
                                                         out_dtype, slot, host))

    def many_key(self, cws: list[CudaWeight], parts: list[tuple[str, Cfg]], n: int, in_t: str,
                 small: Any, slot: int) -> tuple:
        return ("many", tuple(map(id, cws)), tuple(parts), n, in_t, small, slot)

    def _many_in(self, weights: list[ResidentWeight], cws: list[CudaWeight], x: np.ndarray,
                 in_t: str, parts: list[tuple[str, Cfg]], out_dtype: np.dtype | None,
                 slot: int, host: np.ndarray) -> Callable[[], Any]:
        stream = self.ctx.stream
        n = int(x.shape[0])
        rows = sum(w.rows for w in weights)
        key = self.many_key(cws, parts, n, in_t, many_out(n, rows, out_dtype), slot)
        b = cws[0].plans.get(key)
        if (b is None or b.gen != self.ws.gen
                or not all(cw.plans.get(key) is b for cw in cws)):
            b = self._bind_many(weights, cws, parts, key, x.nbytes)
        if b.graph:
            b.graph.launch(stream)
            flat = None if b.out is not None else self._many_y_out(b)
        else:
            self._copy(b.xd, host.ctypes.data, b.x_bytes, _H2D)
            self._many_kernels(b, lambda ev: ev.record(stream))
            flat = None if b.out is not None else self._many_y_out(b)  # (before a capture)
            b.calls += 1
            if self.graphs and b.graph is None and b.calls > GRAPH_AFTER:
                self._capture_many(b, host)
        bf16 = out_dtype is not None and np.dtype(out_dtype) == BFLOAT16

        def done() -> list[tuple[np.ndarray, float | None]]:
            self._wait(slot)
            secs = self._many_seconds(b)
            out = b.out.copy() if flat is None else flat  # (the slot's buffer is reused)
            return list(zip(_many_split(out, n, b.rows, bf16), secs, strict=True))

        return done

    def _many_y_out(self, b: ManyBound) -> np.ndarray:
        """Enqueue a multi-weight call's y's one copy into a new pinned block after the
        sequence and return the block (flat; f16 where the sequence converts y)."""
        half = bool(b.y16)
        size = b.n * sum(b.rows)
        ptr, blk = self.ws.y_block(size * (2 if half else 4))
        flat = blk.view(np.float16 if half else np.float32)
        self.ctx.cp.cuda.runtime.memcpyAsync(ptr, b.y16 if half else b.y, flat.nbytes, _D2H,
                                             self.ctx.stream.ptr)
        return flat

    def _many_seconds(self, b: ManyBound) -> list[float | None]:
        """Each part's kernel seconds (after the sync); a graph whose event nodes did not
        record is dropped (direct launches from then on) and its parts have no figure."""
        ev = b.events
        try:
            el = self.ctx.cp.cuda.get_elapsed_time
            return [el(ev[i], ev[i + 1]) / 1e3 for i in range(len(b.rows))]
        except Exception:
            if b.graph:
                b.graph = False
            return [None] * len(b.rows)

    def _bind_many(self, weights: list[ResidentWeight], cws: list[CudaWeight],
                   parts: list[tuple[str, Cfg]], key: tuple, x_bytes: int) -> ManyBound:
        n, in_t, small, slot = key[3], key[4], key[5], key[6]
        cp, ws = self.ctx.cp, self.ws
        lps = [self.plan(w.rows, w.k, w.layout, in_t, path, cfg, n, cw.pairs)
               for w, cw, (path, cfg) in zip(weights, cws, parts, strict=True)]
        rows = tuple(w.rows for w in weights)
        total = sum(rows)
        for _ in range(2):  # all buffers first (any growth bumps the generation)
            gen = ws.gen
            ws.host(x_bytes, slot)
            xd = ws.ptr("x", x_bytes)
            y = ws.ptr("y", 4 * n * total)
            steps: list[list[Step]] = []
            off = 0
            for lp, w, cw in zip(lps, weights, cws, strict=True):
                steps.append(self.steps(lp, w, cw, xd, y + 4 * n * off, n))
                off += w.rows
            half = small == "y16" or (not isinstance(small, str) and small is not None
                                      and small == np.float16)
            y16 = ws.ptr("y16b", 2 * n * total) if half else 0
            out = None
            if small is not None and not isinstance(small, str):  # a small y, downloaded here
                nbytes = n * total * small.itemsize
                out = ws.host_out(nbytes, slot)[:nbytes].view(small)
            if gen == ws.gen:
                break
        for cw in cws:
            if len(cw.plans) >= MAX_PLANS_PER_WEIGHT:
                cw.plans.clear()
        b = ManyBound(ws.gen, x_bytes, [s for st in steps for s in st],
                      [cp.cuda.Event() for _ in range(len(rows) + 1)], xd, y, y16, out, rows, n,
                      tuple(map(len, steps)))
        for cw in cws:
            cw.plans[key] = b
        return b

    def _many_kernels(self, b: ManyBound, record: Callable[[Any], None]) -> None:
        """Each part's launches after its event, the last event, then y's f16 conversion and a
        small y's download (``record``: a plain record, or a graph node under capture)."""
        cp, ws = self.ctx.cp, self.ws
        i = 0
        for ev, count in zip(b.events, b.counts, strict=False):  # (the last event: after)
            record(ev)
            for st in b.steps[i : i + count]:
                st()
            i += count
        record(b.events[-1])
        size = b.n * sum(b.rows)
        if (b.y16 and b.out is not None
                and self._y16_out(b.out.ctypes.data, b.y, size)):  # (one kernel: Y16_COPY)
            return
        if b.y16:  # ("y16b" at the bound size: nothing grows)
            cp.copyto(ws.array("y16b", (size,), np.float16),
                      ws.array("y", (size,), np.float32), casting="same_kind")
        if b.out is not None:
            self._copy(b.out.ctypes.data, b.y16 or b.y, b.out.nbytes, _D2H)

    def _capture_many(self, b: ManyBound, host: np.ndarray) -> None:
        def enqueue(record: Callable[[Any], None]) -> None:
            if not self._copy(b.xd, host.ctypes.data, b.x_bytes, _H2D):
                self._anchor_step()  # (a copy kernel's upload needs none: _capture)
            self._many_kernels(b, record)

        b.graph = self.capture(enqueue)

    def many_call(self, key: tuple, call_key: tuple, slot: int,
                  parts: list[tuple[str, Layout, Precision]], out_dtype: np.dtype | None,
                  cws: list[CudaWeight]) -> ManyCall | None:
        """The :class:`ManyCall` (cached under ``call_key``) of a multi-weight call just
        launched by :meth:`launch_many` in ``slot`` with bind key ``key``, or None while its
        sequence is not a captured graph."""
        b = cws[0].plans.get(key)
        if not isinstance(b, ManyBound) or not b.graph or b.gen != self.ws.gen:
            return None
        return ManyCall(self, b, slot, call_key, parts, out_dtype)
