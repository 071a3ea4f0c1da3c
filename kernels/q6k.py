"""Q6_K block format: constants, AoS field views, packed SoA planes, dequantization.

One Q6_K block holds 256 weights in 210 bytes (ggml's ``block_q6_K``)::

    ql[128] u8 | qh[64] u8 | scales[16] i8 | d f16        value = d * scales[j // 16] * (q - 32)

``q`` is 6 bits: 4 low bits from ``ql`` and 2 high bits from ``qh``. Within each half of the
block (128 weights; ql[64], qh[32] per half) element ``l + 32*s`` (l < 32, s < 4) takes the
low nibble of ``ql[l]`` (s=0), of ``ql[l+32]`` (s=1), the high nibble of ``ql[l]`` (s=2) and
of ``ql[l+32]`` (s=3), and bits ``2s..2s+1`` of ``qh[l]``.

Packed SoA (the resident layout): the same bytes split into four planes, ``ql`` (128 B per
block), ``qh`` (64 B), ``scales`` (16 B) and ``d`` (2 B), each plane starting on a 16-byte
boundary. Blocks are row-major inside each plane (block ``b`` of row ``r`` at index
``r * blocks_per_row + b``), so a warp walking one row reads every plane with contiguous,
16-byte-aligned loads. The byte count equals AoS plus at most 14 bytes of padding, so the
repack costs no memory. Every function here is vectorised over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError

QK_K = 256  # weights per block
BLOCK_BYTES = 210
GROUP = 16  # weights sharing one int8 scale
GROUPS_PER_BLOCK = QK_K // GROUP
BYTES_PER_WEIGHT = BLOCK_BYTES / QK_K  # 0.8203125

# (field, offset in the AoS block, byte width) -- the one table every other module reads.
FIELDS: tuple[tuple[str, int, int], ...] = (
    ("ql", 0, 128),
    ("qh", 128, 64),
    ("scales", 192, 16),
    ("d", 208, 2),
)
FIELD_WIDTH = {name: width for name, _, width in FIELDS}
PLANE_ALIGN = 16


def check_k(k: int) -> int:
    """Return blocks per row for a row length ``k``; raise if it is not a whole block count."""
    if k <= 0 or k % QK_K:
        raise FormatError(f"K={k} is not a positive multiple of {QK_K}")
    return k // QK_K


def aos_nbytes(rows: int, k: int) -> int:
    return rows * check_k(k) * BLOCK_BYTES


def random_blocks(rows: int, k: int, rng: np.random.Generator, d_low: float = 1e-4,
                  d_high: float = 1.1e-3) -> np.ndarray:
    """Random valid AoS blocks ``[rows * k / 256, 210]``: random quants and int8 sub-scales,
    super-scales ``d`` uniform in ``[d_low, d_high)`` as f16 (finite and positive). The one
    generator of weights whose values do not matter, only their validity: the demo's synthetic
    model, the service tests and the benchmarks."""
    n = rows * check_k(k)
    blocks = rng.integers(0, 256, size=(n, BLOCK_BYTES), dtype=np.uint8)
    d = rng.uniform(d_low, d_high, n).astype(np.float16)
    _, off, width = FIELDS[-1]
    blocks[:, off : off + width] = d.view(np.uint8).reshape(n, width)
    return blocks


def _align(n: int) -> int:
    return (n + PLANE_ALIGN - 1) // PLANE_ALIGN * PLANE_ALIGN


@dataclass(frozen=True)
class SoaLayout:
    """Byte offsets of the four planes inside one packed SoA buffer of ``n_blocks`` blocks."""

    n_blocks: int
    offsets: dict[str, int]
    nbytes: int

    @classmethod
    def for_blocks(cls, n_blocks: int) -> SoaLayout:
        offsets: dict[str, int] = {}
        pos = 0
        for name, _, width in FIELDS:
            offsets[name] = pos
            pos = _align(pos + n_blocks * width)
        return cls(n_blocks, offsets, pos)

    @classmethod
    def for_shape(cls, rows: int, k: int) -> SoaLayout:
        return cls.for_blocks(rows * check_k(k))


def as_blocks(aos: np.ndarray | bytes | memoryview, rows: int, k: int) -> np.ndarray:
    """View AoS bytes as ``[rows * K/256, 210]`` uint8, checking the size."""
    buf = np.frombuffer(aos, dtype=np.uint8) if not isinstance(aos, np.ndarray) else aos
    buf = buf.reshape(-1)
    want = aos_nbytes(rows, k)
    if buf.size != want:
        raise FormatError(
            f"Q6_K data for {rows}x{k} must be {want} bytes "
            f"({rows} rows x {k // QK_K} blocks x {BLOCK_BYTES}), got {buf.size}"
        )
    return buf.view(np.uint8).reshape(-1, BLOCK_BYTES)


def check_scales_finite(blocks: np.ndarray, what: str, first_block: int = 0,
                        blocks_per_row: int | None = None) -> None:
    """Refuse AoS blocks whose f16 scale ``d`` is NaN or +-Inf (llama.cpp's load-time check).

    Such a scale turns whole output rows into NaN for every caller, so it is a malformed
    weight, not a value to propagate. ``first_block``/``blocks_per_row`` only locate it.
    """
    off = next(o for name, o, _ in FIELDS if name == "d")
    d = np.ascontiguousarray(blocks.reshape(-1, BLOCK_BYTES)[:, off : off + 2])
    d = d.view("<f2").reshape(-1)
    bad = np.flatnonzero(~np.isfinite(d))
    if bad.size:
        b = first_block + int(bad[0])
        where = f" (row {b // blocks_per_row})" if blocks_per_row else ""
        raise FormatError(f"{what}: Q6_K block {b}{where} has a non-finite scale d={d[bad[0]]}"
                          f" ({bad.size} such blocks in this chunk)")


def aos_fields(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Views of each field of ``[n, 210]`` AoS blocks, typed (scales int8, d float16)."""
    out = {name: blocks[:, off : off + width] for name, off, width in FIELDS}
    out["scales"] = out["scales"].view(np.int8)
    out["d"] = np.ascontiguousarray(out["d"]).view(np.float16).reshape(-1)
    return out


def soa_fields(soa: np.ndarray, n_blocks: int) -> dict[str, np.ndarray]:
    """Views of the planes of a packed SoA buffer (same dtypes and shapes as aos_fields)."""
    layout = SoaLayout.for_blocks(n_blocks)
    flat = soa.reshape(-1).view(np.uint8)
    if flat.size != layout.nbytes:
        raise FormatError(f"SoA buffer for {n_blocks} blocks must be {layout.nbytes} bytes, "
                          f"got {flat.size}")
    out = {}
    for name, _, width in FIELDS:
        off = layout.offsets[name]
        out[name] = flat[off : off + n_blocks * width].reshape(n_blocks, width)
    out["scales"] = out["scales"].view(np.int8)
    out["d"] = out["d"].view(np.float16).reshape(-1)
    return out


def aos_to_soa(blocks: np.ndarray) -> np.ndarray:
    """Repack ``[n, 210]`` AoS blocks into one packed SoA uint8 buffer."""
    n = blocks.shape[0]
    layout = SoaLayout.for_blocks(n)
    out = np.zeros(layout.nbytes, dtype=np.uint8)
    for name, off, width in FIELDS:
        start = layout.offsets[name]
        out[start : start + n * width].reshape(n, width)[:] = blocks[:, off : off + width]
    return out


def soa_to_aos(soa: np.ndarray, n_blocks: int) -> np.ndarray:
    """Inverse of :func:`aos_to_soa`: ``[n_blocks, 210]`` AoS blocks."""
    layout = SoaLayout.for_blocks(n_blocks)
    flat = soa.reshape(-1).view(np.uint8)
    out = np.empty((n_blocks, BLOCK_BYTES), dtype=np.uint8)
    for name, off, width in FIELDS:
        start = layout.offsets[name]
        out[:, off : off + width] = flat[start : start + n_blocks * width].reshape(n_blocks, width)
    return out


def unpack_q(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """6-bit quants ``[n, 256]`` uint8 (0..63) from ``ql [n,128]`` and ``qh [n,64]``."""
    n = ql.shape[0]
    lo = np.empty((n, 2, 2, 64), dtype=np.uint8)  # [half, nibble, 64]
    ql4 = ql.reshape(n, 2, 64)
    np.bitwise_and(ql4, 0x0F, out=lo[:, :, 0])
    np.right_shift(ql4, 4, out=lo[:, :, 1])
    hi = np.empty((n, 2, 4, 32), dtype=np.uint8)  # [half, shift, 32]
    qh4 = qh.reshape(n, 2, 32)
    for s in range(4):
        np.right_shift(qh4, 2 * s, out=hi[:, :, s])
    hi &= 0x03
    hi <<= 4
    q = lo.reshape(n, 2, 128)
    q |= hi.reshape(n, 2, 128)
    return q.reshape(n, QK_K)


def group_scales(scales: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Per-16-weight scale ``d * scales[j]`` as float32 ``[n, 16]`` (ggml's order of ops)."""
    return d.astype(np.float32)[:, None] * scales.astype(np.float32)


def dequantize_fields(f: dict[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[n, 256]`` weights from field arrays; bit-identical to gguf's dequantize."""
    n = f["ql"].shape[0]
    q = unpack_q(f["ql"], f["qh"])
    if out is None:
        out = np.empty((n, QK_K), dtype=np.float32)
    w = out.reshape(n, GROUPS_PER_BLOCK, GROUP)
    np.subtract(q.reshape(n, GROUPS_PER_BLOCK, GROUP), np.float32(32), out=w, dtype=np.float32)
    w *= group_scales(f["scales"], f["d"])[:, :, None]
    return out


def dequantize_aos(aos: np.ndarray | bytes, rows: int, k: int) -> np.ndarray:
    """float32 ``[rows, k]`` from AoS Q6_K bytes."""
    blocks = as_blocks(aos, rows, k)
    return dequantize_fields(aos_fields(blocks)).reshape(rows, k)


def dequantize_soa(soa: np.ndarray, rows: int, k: int) -> np.ndarray:
    """float32 ``[rows, k]`` from a packed SoA buffer."""
    n = rows * check_k(k)
    return dequantize_fields(soa_fields(soa, n)).reshape(rows, k)
