"""The NumPy reference of the pair-stream order (pairs_ref.py), device-less: it is session 11's
kernel bit for bit (a digest of that kernel's output, taken from a host build of its code on
the VM in session 12) and its inverse restores ggml's bytes. test_cuda_pairs.py pins the
device repack to it."""

from __future__ import annotations

import hashlib

import numpy as np
from pairs_ref import pack_pairs, unpack_pairs

# sha256 of session 11's q6k_repack_pairs on 7 blocks of the bytes (37 i + 11) mod 256 (a SoA
# slab of 7 blocks: ql, qh, scales, d planes), built for the host from its source.
OLD_KERNEL_SHA = "7fd8bb7194ef6314b9418bbdb2612e6c76bd4153e125295426985aee160d0266"


def test_reference_is_session_11s_kernel():
    nb = 7
    slab = ((np.arange(nb * 210) * 37 + 11) & 255).astype(np.uint8)
    packed = pack_pairs(slab, nb)
    assert hashlib.sha256(packed.tobytes()).hexdigest() == OLD_KERNEL_SHA
    assert np.array_equal(packed[192 * nb:], slab[192 * nb:]), "scales and d stay"


def test_reference_round_trips_and_moves_every_bit_once(rng):
    nb = 50
    slab = rng.integers(0, 256, nb * 210, dtype=np.uint8)
    packed = pack_pairs(slab, nb)
    assert not np.array_equal(packed, slab)
    assert np.array_equal(unpack_pairs(packed, nb), slab)
    for bit in (0, 7, 8 * 128 * nb - 1, 8 * 128 * nb, 8 * 192 * nb - 1):  # a single bit moves
        one = np.zeros(nb * 210, np.uint8)
        one[bit >> 3] = 1 << (bit & 7)
        assert np.unpackbits(pack_pairs(one, nb)).sum() == 1, bit
