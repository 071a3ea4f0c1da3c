"""Compile-check every CUDA kernel source with nvcc for each target architecture (no GPU).

Every template instantiation the backend may request is built (``-DQ6SERVE_NVCC_CHECK``) into
a temporary object, so a typo, a bad inline-PTX instruction or an arch-specific feature fails
CI before any GPU sees it. Skips only where nvcc is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"
ARCHS = ("sm_80", "sm_89", "sm_90")  # the Docker image's targets
SOURCES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if os.access(cand, os.X_OK):
            return cand
    return None


NVCC = _nvcc()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    if NVCC is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("nvcc")

    def build(job: tuple[str, str]) -> subprocess.CompletedProcess:
        src, arch = job
        cmd = [NVCC, f"-arch={arch}", "-c", "-std=c++17", "-DQ6SERVE_NVCC_CHECK",
               "-Werror", "all-warnings", "-o", str(out / f"{src}.{arch}.o"), str(CUDA_DIR / src)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240)

    jobs = [(s, a) for s in SOURCES for a in ARCHS]
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return dict(zip(jobs, pool.map(build, jobs), strict=True))


def test_there_are_kernel_sources():
    assert "q6k_matmul.cu" in SOURCES and "q6k_repack.cu" in SOURCES


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES)
def test_kernel_compiles(compiled, src, arch):
    res = compiled[(src, arch)]
    assert res.returncode == 0, f"nvcc {src} for {arch} failed:\n{res.stdout}\n{res.stderr}"
