"""Which kernel instantiations the product can launch, and which ones the sources build that it
cannot (issue 16 item 2: "kernel variants the dispatch never picks leave the product code").

    python bench/kernels_reach.py [--check-list] [--json FILE]

No device: every ``Dispatch.choose`` (the committed table and the heuristics, both kill-switch
settings) of the ten model shapes, shapes near them (``table~``) and far from them (small, tall,
wide, odd), N = 1..300, every precision, planned by a device-less ``Launcher`` (132 SMs) on
compute capability 9.0 (the H200: the wgmma and cluster tiles) and 8.9 / 8.0 (their fallbacks),
for SoA, pair-stream SoA and AoS weights and every activation dtype, with the K-slice tiles'
token parts (``token_parts``: the narrowed tiles ``part_cfg`` names) and the storage kernels
(repack, pair streams, dequant for cuBLAS). The result is the set of (file, template name) the
backend can ask NVRTC for (the reachable set).

``--check-list``: the explicit instantiations of the nvcc compile check (``-DQ6SERVE_NVCC_CHECK``
builds of q6k_matmul.cu and q6k_wgmma.cu, read from nvcc's preprocessor output) against it:
which checked instantiations no call can reach, and which reachable names the check list does
not build. Prints per kernel template: reachable instantiations, and the unreachable checked
ones.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from q6serve.kernels.api import KernelFlags, Layout, Precision
from q6serve.kernels.cuda import dispatch as D
from q6serve.kernels.cuda import launch as L
from q6serve.kernels.errors import DeviceError, FailedPrecondition

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "kernels" / "cuda"
MODEL_SHAPES = ((3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (152064, 3584),
                (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
# near a table shape (table~), far from all (heuristics): small, tall (rows >= 128 SMs), wide
OTHER_SHAPES = ((3072, 3072), (5120, 5120), (11008, 4096), (13824, 5120), (4096, 11008),
                (32000, 4096), (32000, 5120), (256000, 2304), (256, 256), (300, 2304),
                (64, 1024), (2048, 512), (1100, 3328), (8192, 28672), (28672, 8192),
                (16384, 3584), (27648, 5120), (1000, 512), (33, 9472), (200000, 256))
CCS = ("90", "89", "80")


class _Fn:
    """A device-less kernel stand-in (as tests/kernels/test_cuda_backend.py's)."""

    num_regs = 128
    max_dynamic_shared_size_bytes = 48 << 10


def reachable(ccs: tuple[str, ...] = CCS, ns: range = range(1, 301)) -> dict[tuple[str, str], str]:
    """{(file, template name): the first call that asks for it}."""
    out: dict[tuple[str, str], str] = {}
    why = [""]  # the call being planned

    def fn(file: str, name: str) -> _Fn:
        out.setdefault((file, name), why[0])
        return _Fn()

    for cc in ccs:
        lc = L.Launcher(SimpleNamespace(sm_count=132, smem_sm=233472, cc=cc, fn=fn))
        d = D.Dispatch(D.load_default_table(), 132)
        seen: set = set()
        for rows, k in MODEL_SHAPES + OTHER_SHAPES:
            for n in ns:
                for p in Precision:
                    for flags in (KernelFlags(), KernelFlags(decode_mmq=False)):
                        try:
                            c = d.choose(n, p, flags, rows, k)
                        except FailedPrecondition:
                            continue  # Q8_1 without the MMQ tile: refused
                        if c.cfg is None:
                            continue
                        key = (rows, k, -(-n // 8) if c.path != "exact" else n, c.path, c.cfg)
                        if key in seen:
                            continue
                        seen.add(key)
                        for lay, pairs in ((Layout.SOA, False), (Layout.SOA, True),
                                           (Layout.AOS, False)):
                            for in_t in L.IN_TYPES.values():
                                why[0] = (f"cc {cc} {rows}x{k} N={n} {p.value} "
                                          f"{c.source} {c.path} {c.cfg.label()}")
                                try:
                                    lp = lc.plan(rows, k, lay, in_t, c.path, c.cfg, n, pairs)
                                except DeviceError:
                                    continue
                                for want in (2, 3, 4):
                                    lc.token_parts(lp, rows, k, lay, in_t, c.path, c.cfg, n,
                                                   want, pairs)
    # the storage kernels (kernels/cuda/storage.py) and the cuBLAS path's dequant
    for name in ("q6k_repack_pairs", "q6k_unpack_pairs"):
        out.setdefault((L.MATMUL_FILE, name), "storage: pair streams")
    for soa in ("true", "false", "2"):
        out.setdefault((L.MATMUL_FILE, f"q6k_dequant_f16<{soa}>"), "cublas_f16 path")
    out.setdefault(("q6k_repack.cu", "q6k_repack"), "storage: AoS <-> SoA in place")
    # the top-k epilogue (kernels/cuda_topk.py: the group form, its vector scan, the row form)
    for name in ("q6_topk_scan", "q6_topk_scan_v4", "q6_topk_pick", "q6_topk_rows"):
        out.setdefault(("q6_topk.cu", name), "top-k epilogue")
    return out


_GLOBAL = re.compile(r"__global__\s+void\s+(?:\w+\([^)]*\)\s+)*(\w+)\s*\(")


def entry_points() -> dict[str, str]:
    """{kernel (template) name: file} of every __global__ in kernels/cuda/*.cu."""
    out = {}
    for f in sorted(CUDA.glob("*.cu")):
        text = re.sub(r"#ifdef Q6SERVE_(NVCC|WG)_CHECK.*?#endif", "", f.read_text(), flags=re.S)
        for m in _GLOBAL.finditer(text):
            out.setdefault(m.group(1), f.name)
    return out


def norm(name: str) -> str:
    """A template name as NVRTC's name expression or the source writes it -> one spelling
    (bool arguments as 0 / 1, no spaces)."""
    name = name.replace(" ", "")
    return re.sub(r"\btrue\b", "1", re.sub(r"\bfalse\b", "0", name))


_INST = re.compile(r"\btemplate\b[^;]*?\bvoid\s+(q6k_\w+<[^<>]*>)\s*\(")


def checked(file: str, arch: str = "sm_90") -> set[str]:
    """The explicit instantiations of the nvcc check build of ``file``
    (``-DQ6SERVE_NVCC_CHECK``, its macros expanded by nvcc's preprocessor: no compile), as
    normalised template names."""
    r = subprocess.run(["nvcc", "-E", "-std=c++17", f"-arch={arch}", "-DQ6SERVE_NVCC_CHECK",
                        str(CUDA / file)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"nvcc -E {file} failed:\n{r.stderr[-2000:]}")
    return {norm(n) for n in _INST.findall(r.stdout)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-list", action="store_true",
                    help="compare with the nvcc check's instantiations (needs nvcc)")
    ap.add_argument("--json", default=None, help="write the reachable set here")
    a = ap.parse_args(argv)
    got = reachable()
    by_tpl: dict[str, list[str]] = {}
    for (file, name) in sorted(got):
        by_tpl.setdefault(f"{file}:{name.split('<')[0]}", []).append(name)
    print(f"# reachable: {len(got)} (file, name) over cc {', '.join(CCS)}")
    for tpl, names in sorted(by_tpl.items()):
        print(f"{tpl:32} {len(names):4}")
    names = {n.split("<")[0] for _, n in got}
    for ep, file in sorted(entry_points().items()):
        if ep not in names:
            print(f"  entry point never launched: {file}:{ep}")
    if a.json:
        Path(a.json).write_text(json.dumps(
            [{"file": f, "name": n, "first": w} for (f, n), w in sorted(got.items())], indent=0))
    if not a.check_list:
        return 0
    reach = {norm(n) for _, n in got}
    ok = True
    for file, arch in (("q6k_matmul.cu", "sm_90"), ("q6k_wgmma.cu", "sm_90a")):
        chk = checked(file, arch)
        dead = sorted(chk - reach)
        print(f"# {file}: {len(chk)} checked instantiations, {len(chk & reach)} reachable, "
              f"{len(dead)} not")
        for n in dead:
            print(f"  unreachable: {n}")
        ok = ok and not dead
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
