"""ggml's reference quantizers, in NumPy, byte-identical to the C code.

- :func:`quantize_q6_k` follows ``quantize_row_q6_K_ref`` (``make_qx_quants(16, 32, x, L,
  rmse_type=1)`` per 16-group, an int8 scale per group from the block's largest scale, an f16
  super-block ``d``, then a second pass that requantizes each group against its final scale).
- :func:`quantize_q8_1` follows ``quantize_row_q8_1_ref`` (32-value blocks ``d f16 | s f16 |
  qs[32] i8``), the activation format of the Q8_1 precision.

Bit-exactness rests on doing what the C code does in float32, op by op: every product and
quotient is a single rounded f32 operation (no FMA contraction), the per-group sums are
accumulated one element at a time in the C loop order (never NumPy's pairwise order), and
``nearest_int`` is ggml's magic-number rounding, emulated on the bits. Everything is vectorised
over groups and blocks; the only Python loops run over the 16 elements of a group or the 19
candidate scales.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import q6k
from .errors import Cancelled, FormatError

GROUP_MAX_EPS = np.float32(1e-15)  # ggml: groups/blocks below this are all zero
NMAX = 32  # make_qx_quants(n=16, nmax=32): 6-bit signed levels -32..31
QK8_1 = 32
Q8_1_BLOCK_BYTES = 36  # d f16 | s f16 | qs[32] i8
CHUNK_BLOCKS = 1024  # Q6_K blocks per step: bounds temporaries (~10 MiB) and cancel latency

_F32 = np.float32
_MAGIC = _F32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer in the low mantissa


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` (round half to even for |v| < 2**22), bit for bit, as int32."""
    with np.errstate(over="ignore", invalid="ignore"):
        bits = (v.astype(_F32, copy=False) + _MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _check_matrix(x: np.ndarray, multiple: int, what: str) -> None:
    """Shape and dtype of a quantizer's input ``[rows, K]``."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise FormatError(f"{what} input must be a 2-D array [rows, K], got "
                          f"{getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (np.float32, np.float16) and x.dtype.name != "bfloat16":
        raise FormatError(f"{what} input must be float32, float16 or bfloat16, got {x.dtype}")
    k = x.shape[1]
    if k <= 0 or k % multiple:
        raise FormatError(f"K={k} is not a positive multiple of {multiple}")


def _check_finite(x32: np.ndarray, what: str, first_row: int = 0) -> None:
    """Refuse NaN/Inf in ``x32 [rows, K]``, naming the first bad row, column and value."""
    ok = np.isfinite(x32)
    if not ok.all():
        r, c = (int(i[0]) for i in np.nonzero(~ok))
        bad = int(ok.size - np.count_nonzero(ok))
        raise FormatError(f"{what} input has {bad} non-finite values (first at row "
                          f"{first_row + r}, column {c}: {x32[r, c]})")


def _as_f32_matrix(x: np.ndarray, multiple: int, what: str) -> np.ndarray:
    _check_matrix(x, multiple, what)
    x32 = np.ascontiguousarray(x, dtype=_F32)  # f16/bf16 -> f32 is exact
    _check_finite(x32, what)
    return x32


# ---------------------------------------------------------------------------------------------
# Q6_K


def _sums(x: np.ndarray, w: np.ndarray, lf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sumlx += w*x[i]*l; suml2 += w*l*l`` over the 16 elements, in C's order, per group."""
    tx = w * x * lf  # (w*x)*l, left to right as in C
    t2 = w * lf * lf
    sumlx = np.zeros(x.shape[0], _F32)
    suml2 = np.zeros(x.shape[0], _F32)
    for i in range(q6k.GROUP):  # sequential: the C loop's rounding order
        sumlx += tx[:, i]
        suml2 += t2[:, i]
    return sumlx, suml2


def _levels(iscale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``MAX(-nmax, MIN(nmax-1, nearest_int(iscale*x)))`` as int32 ``[G, 16]``."""
    return np.clip(nearest_int(iscale[:, None] * x), -NMAX, NMAX - 1)


def make_qx_quants(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants(16, 32, x, L, rmse_type=1, NULL)`` for ``x`` ``[G, 16]`` f32.

    Returns ``(scale [G] f32, L [G, 16] uint8 in 0..63)``; all-zero groups get scale 0, L 0.
    """
    g = x.shape[0]
    ax = np.abs(x)
    imax = np.argmax(ax, axis=1)  # first index of the largest |x|, as C's strict '>'
    amax = ax[np.arange(g), imax]
    vmax = x[np.arange(g), imax]
    live = amax >= GROUP_MAX_EPS
    vmax = np.where(live, vmax, _F32(1))  # dead groups: any finite divisor, masked below
    w = x * x  # rmse_type 1 weights

    iscale = _F32(-NMAX) / vmax
    lv = _levels(iscale, x)
    sumlx, suml2 = _sums(x, w, lv.astype(_F32))
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        # -(nmax + 0.1f*is) / max: each op a rounded f32 operation
        num = -(_F32(NMAX) + _F32(0.1) * _F32(step))
        cand_iscale = num / vmax
        cl = _levels(cand_iscale, x)
        slx, sl2 = _sums(x, w, cl.astype(_F32))
        take = (sl2 > 0) & (slx * slx > best * sl2)
        if take.any():
            lv[take] = cl[take]
            with np.errstate(divide="ignore", invalid="ignore"):
                new_scale = slx / sl2
            scale = np.where(take, new_scale, scale)
            best = np.where(take, scale * slx, best)
    scale = np.where(live, scale, _F32(0))
    levels = np.where(live[:, None], lv + NMAX, 0).astype(np.uint8)
    return scale.astype(_F32, copy=False), levels


def _pack(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ql [n,128]``, ``qh [n,64]`` from 6-bit levels ``[n, 256]`` (ggml's bit layout)."""
    n = levels.shape[0]
    lv = levels.reshape(n, 2, 4, 32)  # [half, s, l]: element l + 32*s of each half
    lo = lv & 0x0F
    hi = lv >> 4
    ql = np.empty((n, 2, 2, 32), np.uint8)  # [half, ql[l] | ql[l+32], l]
    ql[:, :, 0] = lo[:, :, 0] | (lo[:, :, 2] << 4)
    ql[:, :, 1] = lo[:, :, 1] | (lo[:, :, 3] << 4)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return ql.reshape(n, 128), qh.reshape(n, 64)


def _quantize_q6_k_blocks(xb: np.ndarray) -> np.ndarray:
    """``[n, 256]`` f32 -> ``[n, 210]`` uint8 Q6_K blocks."""
    n = xb.shape[0]
    xg = xb.reshape(n * q6k.GROUPS_PER_BLOCK, q6k.GROUP)
    scales, levels = make_qx_quants(xg)
    scales = scales.reshape(n, q6k.GROUPS_PER_BLOCK)
    levels = levels.reshape(n, q6k.GROUPS_PER_BLOCK, q6k.GROUP)

    imax = np.argmax(np.abs(scales), axis=1)  # first largest |scale| (C's strict '>')
    max_scale = scales[np.arange(n), imax]
    live = np.abs(max_scale) >= GROUP_MAX_EPS
    max_scale = np.where(live, max_scale, _F32(1))
    iscale = _F32(-128.0) / max_scale
    d16 = (_F32(1) / iscale).astype(np.float16)
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)

    # Second pass: requantize each group against d16 * sc (groups with d == 0 keep L).
    dg = d16.astype(_F32)[:, None] * sc.astype(_F32)
    xg3 = xb.reshape(n, q6k.GROUPS_PER_BLOCK, q6k.GROUP)
    use = dg != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int(xg3 / dg[:, :, None]), -32, 31) + 32
    levels = np.where(use[:, :, None], requant, levels).astype(np.uint8)

    ql, qh = _pack(levels.reshape(n, q6k.QK_K))
    out = np.zeros((n, q6k.BLOCK_BYTES), np.uint8)
    f = q6k.aos_fields(out)  # views, except d (a copy): d is written as raw bytes below
    f["ql"][:] = ql
    f["qh"][:] = qh
    f["scales"][:] = sc
    off_d = {name: off for name, off, _ in q6k.FIELDS}["d"]
    out[:, off_d : off_d + 2] = d16.view(np.uint8).reshape(n, 2)
    out[~live] = 0  # ggml memsets zero blocks
    return out


def check_q6_k_representable(x: np.ndarray, blocks: np.ndarray, what: str = "Q6_K",
                             first_block: int = 0) -> None:
    """Refuse Q6_K blocks that do not represent their finite input ``x``.

    ``x`` holds the inputs of ``blocks`` (``[n, 256]`` or rows of whole blocks, any float
    dtype), ``first_block`` the index of ``blocks[0]`` in the whole matrix (row numbers in the
    message count from it). Two ways ggml's quantizer (and so this module's, byte for byte)
    fails on large finite values, both silently:

    - the block scale ``d`` is an f16 holding ``max|x| / ~4096``: from ``max|x|`` of about
      2.7e8 it overflows to Inf, and every dot product with that row becomes NaN;
    - from about 1e12 the f32 sums of the scale search overflow, the group scales come out
      NaN, and the block is written as all zeros (ggml memsets "dead" blocks).

    So a block is refused when its ``d`` is not finite, or when ``d == 0`` although its input
    holds a value of magnitude >= 1 (a ``d`` of 0 is only right for blocks whose values are
    all below about 2.4e-4, where the f16 scale underflows, or zero). The message names the
    row, the block in the row and the input value. Every f32/f16 upload path and
    ``q6serve quantize`` go through this one check (via :func:`quantize_q6_k`).
    """
    xb = np.asarray(x).reshape(-1, q6k.QK_K)
    b = np.asarray(blocks).reshape(-1, q6k.BLOCK_BYTES)
    if xb.shape[0] != b.shape[0]:
        raise FormatError(f"{what}: {xb.shape[0]} input blocks but {b.shape[0]} Q6_K blocks")
    off = {name: o for name, o, _ in q6k.FIELDS}["d"]
    d = np.ascontiguousarray(b[:, off : off + 2]).view("<f2").reshape(-1).astype(_F32)
    amax = np.max(np.abs(xb.astype(_F32, copy=False)), axis=1)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(d) | ((d == 0) & (amax >= 1))
    if not bad.any():
        return
    i = int(np.flatnonzero(bad)[0])
    g = first_block + i
    col = int(np.argmax(np.abs(xb[i].astype(_F32, copy=False))))
    per_row = x.shape[1] // q6k.QK_K if np.ndim(x) == 2 else 0
    where = (f"row {g // per_row}, column {(g % per_row) * q6k.QK_K + col}" if per_row
             else f"block {g}, element {col}")
    why = (f"its f16 scale overflows (d={d[i]})" if not np.isfinite(d[i])
           else "the scale search overflows and the block would be stored as all zeros")
    raise FormatError(f"{what}: the value {xb[i, col]:.6g} at {where} cannot be represented "
                      f"in Q6_K (|x| up to about {Q6K_MAX_ABS:.3g} fits): {why}; "
                      f"{int(np.count_nonzero(bad))} such blocks in this part")


# Largest |x| a Q6_K block can hold: f16 d (<= 65504) x int8 scale (-128) x level (-32).
Q6K_MAX_ABS = 65504.0 * 128 * 32


def quantize_q6_k(x: np.ndarray, what: str = "Q6_K",
                  cancelled: Callable[[], bool] | None = None, first_row: int = 0,
                  ) -> np.ndarray:
    """Q6_K blocks ``[rows * K/256, 210]`` uint8 for ``x [rows, K]`` (f32/f16/bf16), as ggml.

    Byte-identical to ggml's ``quantize_row_q6_K_ref`` (``quantize_q6_K`` without imatrix)
    wherever ggml's result represents the input. Raises :class:`FormatError` if K is not a
    multiple of 256, x holds non-finite values, or a block cannot be represented
    (:func:`check_q6_k_representable`); ``what`` starts those messages. Works in chunks of
    whole rows (temporaries bounded, f16 input converted chunk by chunk) and polls
    ``cancelled`` between them (raises :class:`Cancelled`): a draining worker can abandon it.
    ``first_row`` is the row number of ``x[0]`` in the messages (for a part of a matrix).
    """
    _check_matrix(x, q6k.QK_K, what)
    rows, k = x.shape
    per_row = k // q6k.QK_K
    out = np.empty((rows * per_row, q6k.BLOCK_BYTES), np.uint8)
    step = max(1, CHUNK_BLOCKS // per_row)
    for r0 in range(0, rows, step):
        if cancelled is not None and cancelled():
            raise Cancelled(f"{what}: quantizing abandoned at row {r0} of {rows}")
        x32 = np.ascontiguousarray(x[r0 : r0 + step], dtype=_F32)  # f16/bf16 -> f32: exact
        _check_finite(x32, what, first_row + r0)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # checked next
            blocks = _quantize_q6_k_blocks(x32.reshape(-1, q6k.QK_K))
        check_q6_k_representable(x32, blocks, what, (first_row + r0) * per_row)
        out[r0 * per_row : r0 * per_row + blocks.shape[0]] = blocks
    return out


# ---------------------------------------------------------------------------------------------
# q8_1


def roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: round half away from zero (exact; no ``trunc(v + 0.5)`` double rounding)."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= _F32(0.5), t + np.sign(v), t)


def quantize_q8_1(x: np.ndarray) -> np.ndarray:
    """q8_1 blocks ``[N * K/32, 36]`` uint8 for ``x [N, K]``, byte-identical to ggml's
    ``quantize_row_q8_1_ref``::

        d = amax / 127;  id = d ? 1/d : 0;  qs[j] = roundf(x[j] * id)
        s = (float)(sum of the int qs) * d        (f32 d, before its f16 rounding)
        stored: d -> f16, s -> f16
    """
    x32 = _as_f32_matrix(x, QK8_1, "q8_1")
    xb = x32.reshape(-1, QK8_1)
    d = np.max(np.abs(xb), axis=1) / _F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, _F32(1) / d, _F32(0))
    qs = roundf(xb * inv[:, None]).astype(np.int8)
    s = qs.sum(axis=1, dtype=np.int32).astype(_F32) * d  # integer sum: order-free
    out = np.empty((xb.shape[0], Q8_1_BLOCK_BYTES), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = s.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 4:] = qs.view(np.uint8)
    return out


def q8_1_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(d f32 [n], s f32 [n], qs int8 [n, 32])`` of q8_1 blocks ``[n, 36]`` (or raw bytes)."""
    b = np.asarray(blocks, dtype=np.uint8) if not isinstance(blocks, np.ndarray) else blocks
    flat = b.reshape(-1).view(np.uint8)
    if flat.size % Q8_1_BLOCK_BYTES:
        raise FormatError(f"q8_1 data of {flat.size} bytes is not a whole number of "
                          f"{Q8_1_BLOCK_BYTES}-byte blocks")
    b = flat.reshape(-1, Q8_1_BLOCK_BYTES)
    d = np.ascontiguousarray(b[:, 0:2]).view(np.float16).reshape(-1).astype(_F32)
    s = np.ascontiguousarray(b[:, 2:4]).view(np.float16).reshape(-1).astype(_F32)
    return d, s, b[:, 4:].view(np.int8)
