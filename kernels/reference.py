"""NumPy reference matmuls ``y = x · Wᵀ`` for Q6_K weights, one per precision.

x is ``[N, K]`` float32/float16/bfloat16; W is ``rows x K`` Q6_K given as AoS bytes/blocks
(``[rows*K/256, 210]`` uint8) or as a field dict (:func:`q6k.aos_fields` /
:func:`q6k.soa_fields`). Every function returns float32 ``[N, rows]`` (float64 for
:func:`matmul_float64`) and dequantizes at most ``chunk_rows`` weight rows at a time, so a
152064 x 3584 weight needs only a few MiB of scratch.

- :func:`matmul_exact`: x upcast to f32, f32 math on exactly dequantized weights (BLAS order).
- :func:`matmul_f16`: x rounded to f16 first, then as :func:`matmul_exact`.
- :func:`matmul_float64`: float64 on exact weights (the yardstick for tests).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from . import q6k
from .api import check_activations
from .errors import FormatError

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
