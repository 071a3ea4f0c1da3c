"""NumPy reference of the pair-stream order (layout code 2; kernels/cuda/q6k_matmul.cu
``q6k_repack_pairs`` / ``q6k_unpack_pairs``), transcribed bit by bit from session 11's
one-thread-per-block kernels, for the tests that pin the device repack's bytes.

A SoA slab of ``nb`` blocks starts with its ql plane (128 bytes a block) and its qh plane (64
bytes a block); the pair order rewrites both per block, scales and d untouched."""

from __future__ import annotations

import numpy as np


def _codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """ggml's planes ([nb, 128], [nb, 64] uint8) -> the 256 6-bit codes of each block."""
    q = np.empty((ql.shape[0], 256), np.uint32)
    for h in range(2):
        a = ql[:, 64 * h:64 * h + 32].astype(np.uint32)
        c = ql[:, 64 * h + 32:64 * h + 64].astype(np.uint32)
        hh = qh[:, 32 * h:32 * h + 32].astype(np.uint32)
        q[:, 128 * h:128 * h + 32] = (a & 15) | ((hh & 3) << 4)
        q[:, 128 * h + 32:128 * h + 64] = (c & 15) | (((hh >> 2) & 3) << 4)
        q[:, 128 * h + 64:128 * h + 96] = (a >> 4) | (((hh >> 4) & 3) << 4)
        q[:, 128 * h + 96:128 * h + 128] = (c >> 4) | (((hh >> 6) & 3) << 4)
    return q


def _bit_map():
    """(quarter t, word wi, bit position, code index e, code bit k) of every one of a block's
    1536 code bits in the pair order (session 11's loop)."""
    out = []
    for t in range(4):
        for m in range(4):
            for p in range(8):
                for hf in range(2):
                    j, i = p >> 1, 2 * (p & 1) + hf
                    e = (m >> 1) * 128 + 32 * ((t >> 1) + 2 * (m & 1)) + 16 * (t & 1) + 4 * j + i
                    for k in range(6):
                        sb = 6 * p + k
                        word = sb >> 4
                        wi = 8 + m if word == 2 else 2 * m + word
                        out.append((t, wi, (sb & 15) + 16 * hf, e, k))
    return out


def pack_pairs(slab: np.ndarray, nb: int) -> np.ndarray:
    """A copy of SoA slab bytes (``nb`` blocks) with its code planes in pair-stream order."""
    out = slab.copy()
    q = _codes(slab[:128 * nb].reshape(nb, 128), slab[128 * nb:192 * nb].reshape(nb, 64))
    words = np.zeros((nb, 4, 12), np.uint32)
    for t, wi, pos, e, k in _bit_map():
        words[:, t, wi] |= ((q[:, e] >> k) & 1) << pos
    out[:128 * nb] = words[:, :, :8].astype("<u4").view(np.uint8).reshape(-1)
    out[128 * nb:192 * nb] = words[:, :, 8:].astype("<u4").view(np.uint8).reshape(-1)
    return out


def unpack_pairs(slab: np.ndarray, nb: int) -> np.ndarray:
    """The inverse of :func:`pack_pairs` (ggml's planes back)."""
    out = slab.copy()
    words = np.empty((nb, 4, 12), np.uint32)
    words[:, :, :8] = slab[:128 * nb].view("<u4").reshape(nb, 4, 8)
    words[:, :, 8:] = slab[128 * nb:192 * nb].view("<u4").reshape(nb, 4, 4)
    q = np.zeros((nb, 256), np.uint32)
    for t, wi, pos, e, k in _bit_map():
        q[:, e] |= ((words[:, t, wi] >> pos) & 1) << k
    ql = np.empty((nb, 128), np.uint8)
    qh = np.empty((nb, 64), np.uint8)
    for h in range(2):
        a, c = q[:, 128 * h:128 * h + 32], q[:, 128 * h + 32:128 * h + 64]
        e, f = q[:, 128 * h + 64:128 * h + 96], q[:, 128 * h + 96:128 * h + 128]
        ql[:, 64 * h:64 * h + 32] = (a & 15) | ((e & 15) << 4)
        ql[:, 64 * h + 32:64 * h + 64] = (c & 15) | ((f & 15) << 4)
        qh[:, 32 * h:32 * h + 32] = (a >> 4) | ((c >> 4) << 2) | ((e >> 4) << 4) | ((f >> 4) << 6)
    out[:128 * nb] = ql.reshape(-1)
    out[128 * nb:192 * nb] = qh.reshape(-1)
    return out
