"""Compile-check every CUDA kernel source with nvcc for each target architecture (no GPU).

Every template instantiation the backend may request is built (``-DQ6SERVE_NVCC_CHECK``) into
a temporary object, so a typo, a bad inline-PTX instruction or an arch-specific feature fails
CI before any GPU sees it. The template names the backend actually asks NVRTC for (its launch
plans, built without a device: the tests' and bench's shapes, and every name a dispatch choice
can reach, bench/kernels_reach.py) are also compiled from the loader's inlined text, q6k_matmul.cu
for sm_90 and q6k_wgmma.cu for sm_90a, so the explicit instantiation list cannot drift from the
dispatch; and that list names only reachable kernels (issue 16 item 2: a variant the dispatch
never picks leaves the product code). Skips only where nvcc is absent.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

from q6serve.kernels.cuda import loader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernels_reach

CUDA_DIR = Path(__file__).resolve().parents[2] / "kernels" / "cuda"
ARCHS = ("sm_80", "sm_89", "sm_90")  # the Docker image's targets
SOURCES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
# Files the loader builds for an architecture-specific target (sm_90a: wgmma) where the device
# is that compute capability: compiled for it here too (elsewhere their kernels are traps).
ARCH_JOBS = sorted((src, f"sm_{cc}a") for src, ccs in loader.ARCH_SPECIFIC.items() for cc in ccs)
# the backend's own template names: q6k_matmul.cu for sm_90, q6k_wgmma.cu for sm_90a (PTX)
REQUESTED = {"requested:q6k_matmul.cu": "sm_90", "requested:q6k_wgmma.cu": "sm_90a"}


@cache
def _reachable() -> frozenset[tuple[str, str]]:
    return frozenset(kernels_reach.reachable())


def _requested_names(file: str) -> list[str]:
    """The tests' and bench's launch shapes' names (requested_kernels) and every reachable one."""
    path = Path(__file__).with_name("test_cuda_backend.py")
    spec = importlib.util.spec_from_file_location("_q6_cuda_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = {n for f, n in mod.requested_kernels() if f == file}
    names |= {n for f, n in _reachable() if f == file and "<" in n}
    return sorted(names)


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if os.access(cand, os.X_OK):
            return cand
    return None


NVCC = _nvcc()
# nvcc of every instantiation is minutes of CPU on a 2-core CI machine, more when other work
# shares it (all jobs timed out at pytest's default 300 s with three other compiles running):
# this module's fixture and each compile get their own bounds
NVCC_TIMEOUT_S = 900
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    if NVCC is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("nvcc")

    def build(job: tuple[str, str]) -> subprocess.CompletedProcess:
        src, arch = job
        if src in REQUESTED:
            file = src.split(":", 1)[1]
            refs = "".join(f"    (void*)&{n},\n" for n in _requested_names(file))
            tu = out / f"requested.{file}"
            tu.write_text(f"{loader.source_text(file)}\n"
                          f"void* q6serve_requested[] = {{\n{refs}}};\n")
            cmd = [NVCC, f"-arch={arch}", "-ptx", "-std=c++17", "-o",
                   str(out / f"req.{file}.ptx"), str(tu)]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        cmd = [NVCC, f"-arch={arch}", "-c", "-std=c++17", "-DQ6SERVE_NVCC_CHECK",
               "-Werror", "all-warnings", "-o", str(out / f"{src}.{arch}.o"), str(CUDA_DIR / src)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)

    jobs = list(REQUESTED.items()) + [(s, a) for s in SOURCES for a in ARCHS] + ARCH_JOBS
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return dict(zip(jobs, pool.map(build, jobs), strict=True))


def test_there_are_kernel_sources():
    assert {"q6k_matmul.cu", "q6k_repack.cu"} <= set(SOURCES)


@pytest.mark.parametrize("job", sorted(REQUESTED.items()), ids=sorted(REQUESTED))
def test_requested_instantiations_compile(compiled, job):
    file = job[0].split(":", 1)[1]
    assert len(_requested_names(file)) >= (40 if file == "q6k_matmul.cu" else 9)
    res = compiled[job]
    assert res.returncode == 0, f"backend-requested names:\n{res.stdout}\n{res.stderr}"


def test_every_kernel_entry_point_is_reachable():
    """Every __global__ of kernels/cuda/*.cu is launched by some dispatch choice, load or
    epilogue (bench/kernels_reach.py; no nvcc needed)."""
    names = {n.split("<")[0] for _, n in _reachable()}
    eps = kernels_reach.entry_points()
    assert {"q6k_ks_f16", "q6k_wg_f16", "q6_topk_pick", "q6k_repack"} <= set(eps)
    assert not sorted(set(eps) - names)


@pytest.mark.parametrize(("file", "arch"), [("q6k_matmul.cu", "sm_90"),
                                            ("q6k_wgmma.cu", "sm_90a")])
def test_check_lists_name_only_reachable_kernels(file, arch):
    """The explicit instantiations (Q6SERVE_NVCC_CHECK) are launch shapes some call can take:
    a variant no dispatch choice reaches leaves the list (and its code, the product)."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    reach = {kernels_reach.norm(n) for f, n in _reachable() if f == file}
    listed = kernels_reach.checked(file, arch)
    assert len(listed) >= (100 if file == "q6k_matmul.cu" else 9)
    assert not sorted(listed - reach)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES)
def test_kernel_compiles(compiled, src, arch):
    res = compiled[(src, arch)]
    assert res.returncode == 0, f"nvcc {src} for {arch} failed:\n{res.stdout}\n{res.stderr}"


@pytest.mark.parametrize("job", ARCH_JOBS, ids=[f"{s}-{a}" for s, a in ARCH_JOBS])
def test_arch_specific_kernels_compile_without_serialised_wgmma(compiled, job):
    """The wgmma tile for sm_90a, where ptxas must keep wgmma asynchronous (it serialises the
    whole pipeline, with a 'Potential Performance Loss' note, when it cannot prove the
    fence/commit/wait pattern safe)."""
    res = compiled[job]
    assert res.returncode == 0, f"nvcc {job} failed:\n{res.stdout}\n{res.stderr}"
    assert "serialized" not in res.stdout + res.stderr, res.stdout + res.stderr
    assert job[0] in SOURCES
