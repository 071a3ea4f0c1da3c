"""Fixtures for the kernel tests: the ggml reference vectors and random Q6_K blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def testdata_dir() -> Path:
    """$Q6SERVE_TESTDATA, else ``<repo>/../shared/testdata/ggml-q6k``."""
    env = os.environ.get("Q6SERVE_TESTDATA")
    return Path(env) if env else REPO.parent / "shared" / "testdata" / "ggml-q6k"


@pytest.fixture(scope="session")
def ggml_dir() -> Path:
    d = testdata_dir()
    if not (d / "manifest.json").is_file():
        msg = f"ggml reference vectors not found at {d} (set Q6SERVE_TESTDATA)"
        if os.environ.get("CI"):  # CI always has shared/ beside the clone: never skip there
            pytest.fail(msg)
        pytest.skip(msg)
    return d


@pytest.fixture(scope="session")
def manifest(ggml_dir: Path) -> dict[str, dict]:
    return json.loads((ggml_dir / "manifest.json").read_text())


def _random_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """``[n, 210]`` random Q6_K blocks whose f16 ``d`` is finite (any sign and magnitude)."""
    blocks = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
    mag = rng.choice(np.array([1e-7, 1e-4, 1e-2, 1.0, 300.0]), size=n)
    d = (rng.standard_normal(n) * mag).astype(np.float16)
    blocks[:, 208:210] = d.view(np.uint8).reshape(n, 2)
    return blocks


@pytest.fixture(scope="session")
def random_blocks():
    """``random_blocks(rng, n)``: see :func:`_random_blocks` (a fixture: tests are no package)."""
    return _random_blocks


@pytest.fixture
def rng(request):
    """A freshly seeded generator per test; the seed is printed and recorded for a rerun."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
