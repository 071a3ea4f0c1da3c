"""bench/wg_ab.py's CPU parts (session 22): variant specs, the trace points and their summary,
and (where nvcc is) that the traced kernels compile for sm_90a, so a broken A/B kernel fails
here rather than in a bundle's device time. (The ring and cluster-sum variant files and their
tests left in session 28 with the files: bench/wg_ab.py's docstring names their commits.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import wg_ab  # noqa: E402

from q6serve.kernels.cuda import loader  # noqa: E402

NVCC = next((p for p in ("nvcc", "/usr/local/cuda/bin/nvcc")
             if subprocess.run(["which", p], capture_output=True).returncode == 0
             or Path(p).exists()), None)


def test_variant_spec_forms() -> None:
    lab, text = wg_ab.variant_text("w3|wg_wait<2>();|wg_wait<3>();")
    assert lab == "w3" and "wg_wait<3>();" in text and "wg_wait<2>();" not in text
    lab, text = wg_ab.variant_text("c0||")
    assert lab == "c0" and text == (loader.CUDA_DIR / "q6k_wgmma.cu").read_text()
    with pytest.raises(SystemExit):
        wg_ab.variant_text("bad|no such text|x")
    with pytest.raises(ValueError):  # (session 28: no FILE|EXTRA form any more)
        wg_ab.variant_text("r3|||bench/ab/x.cu|10224")


def test_trace_points_go_in_once_each() -> None:
    text = (loader.CUDA_DIR / "q6k_wgmma.cu").read_text()
    out = wg_ab.traced(text, 0x7F0000001000)
    for anchor, add in wg_ab.TRACE_POINTS:
        assert text.count(anchor) == 1, anchor  # one kernel, one place per point
        assert out.count(anchor + add) == 1
    assert "#define WG_TRACE_PTR 139637976731648ull" in out
    # the definitions follow the include (the kernels' helpers exist there), before the kernel
    assert out.index("WG_TRACE_PTR") > out.index('#include "q6k_matmul.cu"')
    assert out.index("WG_TRACE_PTR") < out.index("q6k_wg_f16(")
    with pytest.raises(SystemExit):
        wg_ab.traced(text.replace(wg_ab.TRACE_POINTS[1][0], ""), 1)


def test_trace_summary_reads_clocks_and_phases() -> None:
    rec = np.zeros((8, wg_ab.TRACE_WORDS), np.uint64)
    # six warps on two SMs: start 100 ns apart, 3 blocks per slice; staging 2000 clocks, the
    # first tile ends at 5000, warps 0-3 run two tiles, 4-5 one; globaltimer at 2 GHz clocks
    for i in range(6):
        tiles = 2 if i < 4 else 1
        end = 8000 if tiles == 2 else 5000
        rec[i] = [10_000 + 100 * i, 3, 2000, 5000, end, tiles, i % 2, 10_000 + 100 * i + end // 2]
    line = wg_ab.trace_summary(rec)
    assert "warps 6 on 2 SMs" in line
    assert "start spread 0.50 us" in line
    assert "staging med 1.00 max 1.00" in line  # 2000 clocks at 2 GHz
    assert "1st tile med 1.50" in line
    assert "busy med 4.00 max 4.00" in line
    assert "span 4.30 us" in line  # last end (warp 3: 10300 + 4000) - first start
    assert "per block med 0.500 us" in line  # (8000 - 2000) / (2 tiles x 3 blocks) clocks
    assert "tiles 1-2 blocks 3-3" in line and "clock 2.00 GHz" in line
    assert wg_ab.trace_summary(np.zeros((4, wg_ab.TRACE_WORDS), np.uint64)) == "no records"


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_traced_wgmma_kernel_compiles_unspilled(tmp_path: Path) -> None:
    """Today's wgmma tile with the trace points builds for sm_90a, the timed instantiation (nt
    8, pair streams, 3 warpgroups) without spills (its traces read the timed kernel)."""
    text = wg_ab.traced((loader.CUDA_DIR / "q6k_wgmma.cu").read_text(), 0x7F0000001000)
    src = tmp_path / "now_traced.cu"
    src.write_text(text)
    done = subprocess.run(
        [NVCC, "-cubin", "-std=c++17", "-DQ6SERVE_NVCC_CHECK", "-arch", "sm_90a",
         "-I", str(loader.CUDA_DIR), "-Xptxas", "-v", "-o", str(tmp_path / "now.cubin"),
         str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    at = done.stderr.index("_Z10q6k_wg_f16ILi8ELi2E5InF16Li3E")
    assert "0 bytes spill stores" in done.stderr[at:at + 400], done.stderr[at:at + 400]


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_ks_trace_points_compile(tmp_path: Path) -> None:
    """The K-slice tiles' trace points (session 23: ``traced(ks=True)``, the cells of src 4 / 7)
    go in once each and the traced q6k_ks_f16 / q6k_ksc_f16 build for sm_90a."""
    text = (loader.CUDA_DIR / "q6k_wgmma.cu").read_text()
    out = wg_ab.traced(text, 0x7F0000001000, ks=True)
    for anchor, add in wg_ab.TRACE_POINTS_KS:
        assert out.count(anchor + add) == 1, anchor
    sig = ("(const u64*, int, int, int, const InF16::T*, int, const uint4*, float*, float*, u32*,"
           " int);")
    out += (f"\ntemplate __global__ void q6k_ks_f16<2, 1, 2, InF16, true, 16>{sig}\n"
            f"template __global__ void q6k_ksc_f16<2, 1, 2, InF16, true, 16, 2>{sig}\n")
    src = tmp_path / "ks_traced.cu"
    src.write_text(out)
    done = subprocess.run([NVCC, "-cubin", "-std=c++17", "-arch", "sm_90a", "-o",
                           str(tmp_path / "ks.cubin"), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with pytest.raises(SystemExit):
        wg_ab.traced(text.replace('#include "q6k_matmul.cu"', ""), 1, ks=True)


def test_plan_for_drops_the_sum_or_takes_pdl() -> None:
    """--nopost runs a variant without the split-K sum launch (session 24's fused sum adds its
    partials itself); --pdl launches its sum with PDL (the plan's src picks that)."""
    from types import SimpleNamespace

    from q6serve.kernels.cuda.launch import PDL_SRCS, LaunchPlan

    lp = LaunchPlan(path="mma_f16", fn=None, grid=(11, 12, 1), threads=384, smem=0, ks=12,
                    tickets=11, bpr=56, nz=1, prep=None, prep_grid=(1,), prep_sizes=(0, 0, 0),
                    post=SimpleNamespace(name="q6k_sum_parts"), src=8)
    assert wg_ab.plan_for("fz", lp, "fz,ns", "").post is None
    assert wg_ab.plan_for("c", lp, "fz,ns", "") == lp
    pd = wg_ab.plan_for("pd", lp, "fz", "pd")
    assert pd.post is lp.post and pd.src == PDL_SRCS[0] and 8 not in PDL_SRCS
