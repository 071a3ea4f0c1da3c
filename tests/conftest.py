"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import secrets
import zlib
from pathlib import Path

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


# Fresh random inputs every run; the run's seed is in pytest's header, and setting
# Q6SERVE_TEST_SEED to it replays a failure exactly.
SESSION_SEED = int(os.environ.get("Q6SERVE_TEST_SEED") or secrets.randbits(32))


def pytest_report_header() -> str:
    return f"q6serve test seed: Q6SERVE_TEST_SEED={SESSION_SEED}"


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator per test from the run's seed and the test's id (stable across processes)."""
    # Shown with a failure's report, so `pytest -q` output still says how to replay it.
    request.node.add_report_section("setup", "seed", f"Q6SERVE_TEST_SEED={SESSION_SEED}")
    return np.random.default_rng([SESSION_SEED, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """An empty model directory for a worker under test."""
    d = tmp_path / "models"
    d.mkdir()
    return d
