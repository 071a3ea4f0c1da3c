"""NumPy reference matmuls ``y = x · Wᵀ`` for Q6_K weights, one per precision.

x is ``[N, K]`` float32/float16/bfloat16; W is ``rows x K`` Q6_K given as AoS bytes/blocks
(``[rows*K/256, 210]`` uint8) or as a field dict (:func:`q6k.aos_fields` /
:func:`q6k.soa_fields`). Every function returns float32 ``[N, rows]`` (float64 for
:func:`matmul_float64`) and dequantizes at most ``chunk_rows`` weight rows at a time, so a
152064 x 3584 weight needs only a few MiB of scratch.

- :func:`matmul_exact`: x upcast to f32, f32 math on exactly dequantized weights (BLAS order).
- :func:`matmul_f16`: x rounded to f16 first, then as :func:`matmul_exact`.
- :func:`matmul_q8_1`: x quantized to q8_1, integer dots per 16-group, f32 rescales (below).
- :func:`matmul_float64`: float64 on exact weights (the yardstick for tests).

Q8_1 numerics (the contract the CUDA MMQ kernels reproduce)
-----------------------------------------------------------
x row ``n`` is quantized with :func:`quantize.quantize_q8_1` into 32-wide blocks ``j``
(``dx[n, j]`` = the block's f16 ``d`` read as f32; ``qx`` int8; the ``s`` field is unused
because the weight side is centered). Weight row ``r`` has, per 16-group ``g`` (``g = 2j`` and
``2j+1`` are the two halves of k-chunk ``j``), the int8 scale ``sc[r, g]``, its block's f16
``dw[r, g // 16]`` and 6-bit quants ``q``. With every operation a single rounded f32 op::

    isum[n, r, g] = sum_{i < 16} (q[r, 16g+i] - 32) * qx[n, 16g+i]         int32, exact
    dsc[r, g]     = dw[r, g // 16] * (float)sc[r, g]           (as q6k.group_scales)
    t[n, r, g]    = (dx[n, g // 2] * dsc[r, g]) * (float)isum[n, r, g]
    y[n, r]       = t[n, r, 0] + t[n, r, 1] + ... + t[n, r, K/16 - 1]      f32

i.e. each 32-k chunk contributes two k16 integer dots, each rescaled on its own
(``acc += (dx*dsc0)*isum0; acc += (dx*dsc1)*isum1``) -- never ``dx*(dsc0*isum0 + dsc1*isum1)``,
whose different rounding broke the seed's parity gate. The terms ``t`` are bit-exact
targets; the reference adds them left to right, in increasing k. A GPU kernel may add them in
any order (per-warp partials, split-K, tree reductions) in f32: reordering moves ``y`` by
about ``sqrt(K/16) * 2**-24 * sum|t|``, far inside the parity gate of 1e-6 relative
Frobenius error against :func:`matmul_q8_1`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from . import q6k
from .api import check_activations
from .errors import FormatError
from .quantize import QK8_1, q8_1_fields, quantize_q8_1

ROW_CHUNK = 256  # weight rows dequantized per step (256 x 3584 f32 = 3.5 MiB)

Weight = np.ndarray | bytes | memoryview | Mapping[str, np.ndarray]


def _fields(w: Weight, k: int, rows: int | None) -> tuple[dict[str, np.ndarray], int]:
    """Field arrays of ``w`` and its row count (checked against ``rows`` when given)."""
    per_row = q6k.check_k(k)
    if isinstance(w, Mapping):
        f = {name: w[name] for name, _, _ in q6k.FIELDS}
        n_blocks = f["ql"].shape[0]
        for name, _, width in q6k.FIELDS:
            if name != "d" and f[name].shape != (n_blocks, width):
                raise FormatError(f"field {name} has shape {f[name].shape}, "
                                  f"want ({n_blocks}, {width})")
        if f["d"].shape != (n_blocks,):
            raise FormatError(f"field d has shape {f['d'].shape}, want ({n_blocks},)")
    else:
        buf = np.frombuffer(w, np.uint8) if not isinstance(w, np.ndarray) else w.reshape(-1)
        if rows is None:  # infer; as_blocks still checks the byte count exactly
            rows = max(1, buf.size // (per_row * q6k.BLOCK_BYTES))
        f = q6k.aos_fields(q6k.as_blocks(buf, rows, k))
        n_blocks = f["ql"].shape[0]
    if n_blocks % per_row or (rows is not None and n_blocks != rows * per_row):
        want = "a multiple of" if rows is None else f"{rows} rows x"
        raise FormatError(f"weight has {n_blocks} blocks, want {want} {per_row} blocks per row "
                          f"(K={k})")
    return f, n_blocks // per_row


def iter_weight_rows(w: Weight, k: int, rows: int | None = None,
                     chunk_rows: int = ROW_CHUNK) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Yield ``(first_row, fields)`` for consecutive chunks of at most ``chunk_rows`` rows."""
    f, n_rows = _fields(w, k, rows)
    per_row = k // q6k.QK_K
    for r0 in range(0, n_rows, chunk_rows):
        r1 = min(n_rows, r0 + chunk_rows)
        yield r0, {name: a[r0 * per_row : r1 * per_row] for name, a in f.items()}


def weight_rows(w: Weight, k: int, rows: int | None = None) -> int:
    return _fields(w, k, rows)[1]


def _dense_matmul(x: np.ndarray, w: Weight, rows: int | None, chunk_rows: int,
                  dtype: type[np.floating]) -> np.ndarray:
    k = x.shape[1]
    n_rows = weight_rows(w, k, rows)
    y = np.empty((x.shape[0], n_rows), dtype=dtype)
    for r0, f in iter_weight_rows(w, k, rows, chunk_rows):
        wd = q6k.dequantize_fields(f).reshape(-1, k)
        np.matmul(x, wd.T.astype(dtype, copy=False), out=y[:, r0 : r0 + wd.shape[0]])
    return y


def _x(x: np.ndarray) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise FormatError(f"activations must be a 2-D numpy array [N, K], got "
                          f"{getattr(x, 'shape', type(x).__name__)}")
    return check_activations(x, x.shape[1])


def matmul_exact(x: np.ndarray, w: Weight, rows: int | None = None, *,
                 chunk_rows: int = ROW_CHUNK) -> np.ndarray:
    """float32 ``[N, rows]``: x upcast to f32 times the exactly dequantized weight, f32 math."""
    x32 = _x(x).astype(np.float32)
    return _dense_matmul(x32, w, rows, chunk_rows, np.float32)


def matmul_f16(x: np.ndarray, w: Weight, rows: int | None = None, *,
               chunk_rows: int = ROW_CHUNK) -> np.ndarray:
    """As :func:`matmul_exact` after rounding x to float16 (what the f16 MMA path sees)."""
    # bf16 -> f32 is exact, so going through f32 rounds to f16 exactly once.
    x16 = _x(x).astype(np.float32).astype(np.float16).astype(np.float32)
    return _dense_matmul(x16, w, rows, chunk_rows, np.float32)


def matmul_float64(x: np.ndarray, w: Weight, rows: int | None = None, *,
                   chunk_rows: int = ROW_CHUNK) -> np.ndarray:
    """float64 ``[N, rows]`` on exact weights and exact (upcast) activations."""
    x64 = _x(x).astype(np.float64)
    return _dense_matmul(x64, w, rows, chunk_rows, np.float64)


def _q8_1_terms_sum(xq: np.ndarray, dxg: np.ndarray, f: dict[str, np.ndarray],
                    k: int) -> np.ndarray:
    """f32 ``[N, r]`` for one weight chunk: the documented terms, summed in increasing k."""
    n_groups = k // q6k.GROUP
    r = f["ql"].shape[0] // (k // q6k.QK_K)
    wq = q6k.unpack_q(f["ql"], f["qh"]).astype(np.float32) - np.float32(32)
    wq = wq.reshape(r, n_groups, q6k.GROUP).transpose(1, 2, 0)  # [G, 16, r]
    # [G, N, 16] @ [G, 16, r]: products <= 32*127 and 16-term sums < 2**24, so f32 BLAS
    # returns the int32 dots exactly.
    isum = np.matmul(xq, wq)
    dsc = q6k.group_scales(f["scales"], f["d"]).reshape(r, n_groups).T  # [G, r]
    t = dxg[:, :, None] * dsc[:, None, :]  # dx * dsc
    t *= isum  # (dx * dsc) * isum
    acc = t[0].copy()
    for g in range(1, n_groups):  # sequential: the documented order
        acc += t[g]
    return acc


def matmul_q8_1(x: np.ndarray, w: Weight, rows: int | None = None, *,
                chunk_rows: int = ROW_CHUNK) -> np.ndarray:
    """float32 ``[N, rows]`` with q8_1 activations: the numerics in this module's docstring."""
    x = _x(x)
    n, k = x.shape
    n_rows = weight_rows(w, k, rows)
    dx, _, qx = q8_1_fields(quantize_q8_1(x))
    n_groups = k // q6k.GROUP
    xq = qx.reshape(n, n_groups, q6k.GROUP).transpose(1, 0, 2).astype(np.float32)  # [G, N, 16]
    dxg = np.repeat(dx.reshape(n, k // QK8_1), 2, axis=1).T.copy()  # [G, N]: group g -> j=g//2
    # Bound the [G, N, rows] temporaries to ~16 MiB each whatever N is.
    step = max(1, min(chunk_rows, (1 << 22) // (n_groups * n)))
    y = np.empty((n, n_rows), dtype=np.float32)
    for r0, f in iter_weight_rows(w, k, rows, step):
        part = _q8_1_terms_sum(xq, dxg, f, k)
        y[:, r0 : r0 + part.shape[1]] = part
    return y
