"""bench/ab/sass_same.py, the SASS comparison a kernel-source refactor lands on (session 30):
its parsing of cuobjdump's text (no tools needed) and, where nvcc and cuobjdump are, that a
loop folded into a ``__forceinline__`` helper compiles to the same SASS while a changed
constant does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "ab"))
import sass_same  # noqa: E402

SASS = """
	code for sm_90
		Function : _Z1kPf
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */
                                                            /* 0x000fe20000000800 */
        /*0010*/              @!P0 BRA 0x30 ;               /* 0x0000000000188947 */
		Function : _Z1gPf
        /*0000*/                   EXIT ;                   /* 0x000000000000794d */
"""
RES = """Resource usage:
 Common:
  GLOBAL:0 CONSTANT[3]:8
 Function _Z1kPf:
  REG:35 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z1gPf:
  REG:8 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:528 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_functions_and_resources_are_parsed() -> None:
    f = sass_same.functions(SASS)
    assert sorted(f) == ["_Z1gPf", "_Z1kPf"]
    assert f["_Z1kPf"].splitlines()[0].startswith("/*0000*/")
    assert "headerflags" not in f["_Z1kPf"] and "BRA 0x30" in f["_Z1kPf"]
    r = sass_same.resources(RES)
    assert r == {"_Z1kPf": "REG:35 STACK:0 SHARED:1024 LOCAL:0",
                 "_Z1gPf": "REG:8 STACK:0 SHARED:0 LOCAL:0"}


def test_compare_sorts_kernels() -> None:
    a = sass_same.Dump({"k": "X", "g": "Y", "old": "Z"}, {"k": "REG:8", "g": "REG:8"})
    b = sass_same.Dump({"k": "X", "g": "Y2", "new": "Z"}, {"k": "REG:8", "g": "REG:8"})
    v = sass_same.compare(a, b)
    assert (v.equal, v.changed, v.added, v.gone) == (["k"], ["g"], ["new"], ["old"])
    assert not v.same
    # the same instructions with other registers counted is a change too
    v = sass_same.compare(a, sass_same.Dump(dict(a.sass), {"k": "REG:9", "g": "REG:8"}))
    assert v.changed == ["k"]
    assert sass_same.compare(a, a).same
    assert "- Y" in sass_same.first_difference("X\nY", "X\nY2")


INLINE = """
extern "C" __global__ void k(const float* x, float* y, int n) {
    float acc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += x[4 * j + i] * SCALE;
#pragma unroll
    for (int i = 0; i < 4; ++i) y[4 * threadIdx.x + i] = acc[i];
}
"""
HELPER = """
__device__ __forceinline__ void zero4(float (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = 0.f;
}
__device__ __forceinline__ void put4(float* y, const float (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) y[4 * threadIdx.x + i] = a[i];
}
extern "C" __global__ void k(const float* x, float* y, int n) {
    float acc[4];
    zero4(acc);
    for (int j = threadIdx.x; j < n; j += blockDim.x)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += x[4 * j + i] * SCALE;
    put4(y, acc);
}
"""


@pytest.mark.skipif(sass_same.find_nvcc() is None or sass_same.find_cuobjdump() is None,
                    reason="needs nvcc and cuobjdump")
def test_a_helper_keeps_the_sass_and_a_constant_does_not(tmp_path) -> None:
    nvcc, cuobjdump = sass_same.find_nvcc(), sass_same.find_cuobjdump()

    def sass(text: str) -> sass_same.Dump:
        return sass_same.cached_dump(text, "sm_90", (), nvcc, cuobjdump, tmp_path)

    a = sass("#define SCALE 2.f\n" + INLINE)
    b = sass("#define SCALE 2.f\n" + HELPER)
    c = sass("#define SCALE 3.f\n" + HELPER)
    assert list(a.sass) == ["k"] and a.res["k"].startswith("REG:")
    assert sass_same.compare(a, b).same
    assert sass_same.compare(b, c).changed == ["k"]
    assert len(list(tmp_path.glob("*.cubin"))) == 3  # one cubin a source text, kept
