"""Fixtures shared by every test package."""

from __future__ import annotations

import numpy as np
import pytest

from q6serve.kernels import q6k


def random_blocks(rng: np.random.Generator, n_blocks: int, d_lo: float = 1e-4,
                  d_hi: float = 1e-2) -> np.ndarray:
    """Random Q6_K AoS blocks ``[n, 210]`` with valid (finite, positive) f16 scales ``d``."""
    blocks = rng.integers(0, 256, (n_blocks, q6k.BLOCK_BYTES), dtype=np.uint8)
    d = rng.uniform(d_lo, d_hi, n_blocks).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A fresh generator per test, seeded from its name so failures reproduce."""
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))
