"""The top-k / log-sum-exp epilogue on the CUDA device (see kernels/epilogue.py).

Implementations of the contract, all on the backend's stream, all writing one packed int32 row
per row of y ([values bits | columns | lse bits]) so that only N x (8k + 4) bytes are downloaded
(instead of N x rows x 4), in one copy and one synchronisation:

- ``cuda/q6_topk.cu``, group form (``FUSED``, the default): y is read
  once. ``q6_topk_scan`` runs one CTA per (chunk of ``SCAN_CHUNK`` columns, row), every SM
  streaming: each thread keeps 16 columns in registers, each quad of threads writes the largest
  order key of its 64 columns (a group), each CTA its chunk's max / f64 sum of exp / NaN flag.
  ``q6_topk_pick`` (one CTA per row) takes tau = the top 16 bits of the k-th largest group key
  (a lower bound of the row's k-th largest value: the k largest group maxima are k distinct
  columns), re-reads only the groups whose maximum is >= tau (~k of them), ranks their columns
  >= tau in shared memory (a bitonic sort past 512) and writes the first k, with the lse from
  the chunks' sums. A row with more than 1024 such groups or ``CAND_CAP`` such columns (heavy
  ties) runs the one-CTA-per-row passes (max, f64 sum of exp, a 4-pass radix select of the
  k-th largest value, a gather and a bitonic sort) inside the same kernel; rows known to (at
  most k groups, :func:`rows_only`) run them alone (q6_topk_rows). (The previous "split" form,
  rows cut into column chunks + a merge kernel, 140 us against these 37 at N=64 x 152064 on
  the H200, left in session 14: nothing in the product picked it; bench/RESULTS.md keeps its
  figures.)
- :func:`epilogue.topk_xp` on CuPy ops (the same code CI runs with NumPy): group maxima bound
  the candidates, one 64-bit key sort. Rows in chunks of at most ``CHUNK_ELEMS`` elements of
  y (~5 x 4 bytes of transient memory per chunk element: ~40 MiB) whatever N and the rows.

The GPU test (tests/kernels/test_epilogue.py) checks every form against the NumPy reference.
Transient memory is CuPy-pool memory freed on return, like the matmul's own split-K partials,
and not part of the accountant's per-weight scratch (service/engine.py): for the group form
about y / 64 (a key per 64 columns) plus 16 bytes per 4096 columns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .epilogue import TopK, topk_xp

FUSED = True  # the kernels of cuda/q6_topk.cu; False: topk_xp on CuPy ops
TOPK_FILE = "q6_topk.cu"
THREADS = 1024  # per CTA (Q6_TOPK_THREADS in the kernel's __launch_bounds__)
SCAN_THREADS = 256  # group form: q6_topk_scan's CTA (Q6_TOPK_SCAN_THREADS)
SCAN_CHUNK = SCAN_THREADS * 16  # its columns per CTA (Q6_TOPK_CHUNK)
CAND_CAP = 2048  # q6_topk_pick: most staged columns >= tau (<= Q6_TOPK_CAND_CAP; 0: all rows
#                 take the one-CTA-per-row passes, as the tests force)
CHUNK_ELEMS = 2 << 20  # topk_xp path: elements of y per chunk (8 MiB f32, ~40 MiB transient)


def topk_on_device(cp: Any, y: Any, k: int, stream: Any, fused: bool | None = None) -> TopK:
    """Top-k of device ``y`` f32 [N, cols] (C-contiguous) on ``stream``; host arrays out.
    ``fused``: the one-kernel path (default ``FUSED``)."""
    return topk_enqueue(cp, y, k, stream, fused)()


def topk_enqueue(cp: Any, y: Any, k: int, stream: Any,
                 fused: bool | None = None) -> Callable[[], TopK]:
    """:func:`topk_on_device` without the wait: the kernels and the packed result's download
    into pinned host memory are enqueued on ``stream``; the returned function waits for that
    download (an event after it: not for whatever is enqueued on the stream later, such as the
    next launched batch) and unpacks (call it once, from any thread)."""
    with stream:
        packed = _packed(cp, y, k, fused)
        mem = cp.cuda.alloc_pinned_memory(packed.nbytes)
        host = np.frombuffer(mem, np.int32, packed.size).reshape(packed.shape)
        cp.cuda.runtime.memcpyAsync(mem.ptr, packed.data.ptr, packed.nbytes, _D2H, stream.ptr)
        done = cp.cuda.Event(disable_timing=True)
        done.record(stream)

    def finish() -> TopK:
        done.synchronize()
        return unpack(host, k)

    return finish


_D2H = 2  # cudaMemcpyDeviceToHost


def _packed(cp: Any, y: Any, k: int, fused: bool | None) -> Any:
    """The epilogue's packed rows on the device (enqueued on the current stream). ``cp``: the
    array module (CuPy; a test passes NumPy to check the chunked path's packing)."""
    n, cols = (int(d) for d in y.shape)
    # one row per input row: values [k] | indices [k] | lse [1], all as int32 bits (an
    # integer copy never touches the bits; an f32 copy could flush denormal patterns)
    packed = cp.empty((n, 2 * k + 1), dtype=cp.int32)
    if FUSED if fused is None else fused:
        _fused(cp, y, k, packed)
    else:
        step = max(1, CHUNK_ELEMS // max(cols, 1))
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            v, i, s = topk_xp(y[r0:r1], k, cp)
            packed[r0:r1, :k] = v.view(cp.int32)
            packed[r0:r1, k : 2 * k] = i
            packed[r0:r1, 2 * k] = s.view(cp.int32)
    return packed


def unpack(host: np.ndarray, k: int) -> TopK:
    return TopK(np.ascontiguousarray(host[:, :k]).view(np.float32),
                np.ascontiguousarray(host[:, k : 2 * k]),
                np.ascontiguousarray(host[:, 2 * k]).view(np.float32))


def _fused(cp: Any, y: Any, k: int, packed: Any) -> None:
    """cuda/q6_topk.cu's group form on the current stream."""
    from .cuda import loader

    if y.dtype != cp.float32 or not y.flags.c_contiguous:
        y = cp.ascontiguousarray(y, dtype=cp.float32)
    n, cols = (int(d) for d in y.shape)
    mod = loader.load(TOPK_FILE, (), int(y.device.id))
    _groups(cp, mod, y, n, cols, k, packed)


def rows_only(cols: int, k: int) -> bool:
    """Whether the group form would stage a whole row and find it too big (at most k groups of
    64 columns bound nothing; more than ``CAND_CAP`` columns then take q6_topk_pick's row
    passes): such rows go to q6_topk_rows (the same passes) without the scan first. H200:
    64 x 4096, k=64: 19.3 us one CTA per row, 24.9 the group form (bench/RESULTS.md)."""
    return -(-cols // SCAN_CHUNK) * (SCAN_CHUNK // 64) <= k and cols > CAND_CAP


def _groups(cp: Any, mod: Any, y: Any, n: int, cols: int, k: int, packed: Any) -> None:
    """q6_topk_scan (one CTA per (chunk, row)) then q6_topk_pick (one per row); their
    intermediates in one pool block (see :func:`group_launches`)."""
    block = cp.empty(scratch_bytes(n, cols), cp.uint8)
    for name, grid, threads, args in group_launches(int(y.data.ptr), n, cols, k,
                                                    int(packed.data.ptr), int(block.data.ptr)):
        mod.function(name)(grid, (threads,), args)


Launch = tuple[str, tuple[int, ...], int, tuple]  # (kernel name, grid, threads, arguments)


def scratch_bytes(n: int, cols: int) -> int:
    """The group form's intermediates: per (row, chunk) the f64 sum, the max and the NaN
    flag, per group (64 columns) its largest order key."""
    slots = n * -(-cols // SCAN_CHUNK)
    return slots * 16 + slots * (SCAN_CHUNK // 64) * 4


def packed_bytes(n: int, k: int) -> int:
    """The packed result (:func:`_packed`): per row k values, k columns and the lse."""
    return n * (2 * k + 1) * 4


def bindable() -> bool:
    """Whether :func:`group_launches` is the epilogue the settings name (the group form:
    fixed launches on raw pointers, so a caller may bind them once and capture them)."""
    return FUSED


def group_launches(y: int, n: int, cols: int, k: int, packed: int, scratch: int,
                   ) -> list[Launch]:
    """The group form's launches (all in TOPK_FILE) on raw device pointers: y f32 [n, cols]
    (C-contiguous), ``packed`` (:func:`packed_bytes`) and ``scratch`` (:func:`scratch_bytes`).
    kernels/cuda/launch.py binds these into a launch sequence (its CUDA graph), _groups runs
    them at once."""
    u64, i32 = np.uint64, np.int32
    if rows_only(cols, k):
        return [("q6_topk_rows", (n,), THREADS, (u64(y), i32(cols), i32(k), u64(packed)))]
    chunks = -(-cols // SCAN_CHUNK)
    slots = n * chunks
    csum, cmax, cnan = scratch, scratch + slots * 8, scratch + slots * 12
    gkey = scratch + slots * 16
    vec = cols % 4 == 0 and y % 16 == 0  # float4 loads: every row 16-byte aligned
    return [("q6_topk_scan_v4" if vec else "q6_topk_scan", (chunks, n), SCAN_THREADS,
             (u64(y), i32(cols), u64(gkey), u64(cmax), u64(csum), u64(cnan))),
            ("q6_topk_pick", (n,), THREADS,
             (u64(y), i32(cols), i32(chunks), i32(k), i32(CAND_CAP), u64(gkey), u64(cmax),
              u64(csum), u64(cnan), u64(packed)))]
