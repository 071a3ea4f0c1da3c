"""Whether a kernel change keeps every kept kernel's code and every call's launch (CPU only).

    python bench/code_same.py [--base main] [--skip-ptx] [--skip-plans] [--keep DIR]

A removal (a variant no table cell picks, issue 16 item 2) should leave what the table runs
untouched. Against ``--base`` (a git revision; its ``kernels/`` is archived into a temporary
tree) this checks, with no GPU:

1. PTX: ``nvcc -ptx -DQ6SERVE_NVCC_CHECK`` of q6k_matmul.cu (sm_90) and q6k_wgmma.cu (sm_90a)
   in both trees, and the template names this tree's backend requests
   (tests/kernels/test_cuda_backend.requested_kernels, as test_nvcc_compile.py builds them)
   compiled from each tree's loader text: every ``.entry`` present in both must be equal but for
   its label and local-depot numbers (which shift with the entries before it). Entries only in
   the base are the removed ones (listed by template).
2. Plans: every ``Dispatch.choose`` and device-less ``Launcher.plan`` (a 132-SM sm_90 stand-in,
   as tests/kernels/test_dispatch.py uses) of 20 shapes x 18 N x every precision x two flag
   sets x three layouts x three activation dtypes, and the token parts' launch shape, dumped
   by each tree (a subprocess whose ``q6serve.kernels`` is that tree's, through the editable
   install's mapping) and compared line for line.

Equal PTX and equal plans mean every call runs the same instructions on the same grid: the
same bits and, up to noise, the same time; the GPU run then only has to confirm it. Exit 0
when both hold. (After session 21: the ring tile src 5's removal, docs/KERNELS.md.)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PTX_JOBS = (("q6k_matmul.cu", "sm_90"), ("q6k_wgmma.cu", "sm_90a"))
_ENTRY = re.compile(r"^(?:\.visible |\.weak )?\.entry (\S+)\(")


def entries(ptx: str) -> tuple[str, dict[str, str]]:
    """The module header and each .entry's text, label and depot numbers normalised."""
    head: list[str] = []
    out: dict[str, list[str]] = {}
    cur: str | None = None
    for ln in ptx.splitlines():
        m = _ENTRY.match(ln)
        if m:
            cur = m.group(1)
            out[cur] = []
        if ln.lstrip().startswith("// .globl"):
            continue  # the next entry's marker, printed before it
        (out[cur] if cur else head).append(ln)

    def norm(lines: list[str]) -> str:
        s = "\n".join(lines)
        return re.sub(r"\$L__BB\d+_", "$L__BB_", re.sub(r"__local_depot\d+", "__local_depot", s))

    return norm(head), {k: norm(v) for k, v in out.items()}


def requested_names() -> list[str]:
    """The q6k_matmul.cu template names this tree's backend asks NVRTC for."""
    import importlib.util

    path = ROOT / "tests" / "kernels" / "test_cuda_backend.py"
    spec = importlib.util.spec_from_file_location("_q6_cuda_tests", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(mod)
    return sorted(n for f, n in mod.requested_kernels() if f == "q6k_matmul.cu")


def source_text(cuda_dir: Path, name: str, seen: frozenset[str] = frozenset()) -> str:
    """kernels/cuda/loader.source_text of another tree (its includes inlined)."""
    from q6serve.kernels.cuda import loader

    old = loader.CUDA_DIR
    loader.CUDA_DIR = cuda_dir
    try:
        return loader.source_text(name, seen)
    finally:
        loader.CUDA_DIR = old


def compare_ptx(base: Path, work: Path) -> bool:
    names = requested_names()
    refs = "".join(f"    (void*)&{n},\n" for n in names)
    jobs = []
    for tag, tree in (("base", base), ("new", ROOT)):
        cuda = tree / "kernels" / "cuda"
        for src, arch in PTX_JOBS:
            jobs.append((tag, f"{src}.{arch}", ["-DQ6SERVE_NVCC_CHECK", f"-arch={arch}"],
                         cuda / src))
        tu = work / f"requested.{tag}.cu"
        tu.write_text(f"{source_text(cuda, 'q6k_matmul.cu')}\n"
                      f"void* q6serve_requested[] = {{\n{refs}}};\n")
        jobs.append((tag, "requested.sm_90", ["-arch=sm_90"], tu))

    def build(job: tuple) -> tuple[str, str, str]:
        tag, key, opts, src = job
        out = work / f"{key}.{tag}.ptx"
        r = subprocess.run(["nvcc", "-ptx", "-std=c++17", *opts, "-o", str(out), str(src)],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"nvcc {key} ({tag}) failed:\n{r.stderr[-2000:]}")
        return tag, key, out.read_text()

    with ThreadPoolExecutor(2) as pool:
        got = {(t, k): p for t, k, p in pool.map(build, jobs)}
    ok = True
    for key in sorted({k for _, k in got}):
        hb, b = entries(got[("base", key)])
        hn, n = entries(got[("new", key)])
        changed = sorted(k for k in n if k in b and n[k] != b[k])
        gone = [k for k in b if k not in n]
        kinds = sorted({re.sub(r"^_Z\d+", "", k).split("I")[0] for k in gone})  # template names
        added = sorted(k for k in n if k not in b)
        ok = ok and not changed and hb == hn
        equal = len(n) - len(changed) - len(added)
        print(f"{key:24} base {len(b):4} new {len(n):4} equal {equal:4} changed {len(changed):3}"
              f" added {len(added):3} gone {len(gone):3}"
              + ("" if hb == hn else " HEADER DIFFERS")
              + (f" ({', '.join(kinds)})" if gone else ""))
        for k in changed[:5]:
            print(f"  changed: {k[:120]}")
    return ok


PLAN_DUMP = r'''
import sys
import __editable___q6serve_0_1_0_finder as finder
finder.MAPPING["q6serve.kernels"] = sys.argv[1]
from types import SimpleNamespace
from q6serve.kernels.api import KernelFlags, Layout, Precision
from q6serve.kernels.cuda import dispatch as D
from q6serve.kernels.cuda import launch as L
assert L.__file__.startswith(sys.argv[1]), L.__file__
asked = []
def fn(file, name):
    asked.append((file, name))
    return SimpleNamespace(name=name, num_regs=128, max_dynamic_shared_size_bytes=48 << 10)
lc = L.Launcher(SimpleNamespace(sm_count=132, smem_sm=233472, cc="90", fn=fn))
d = D.Dispatch(D.load_default_table(), 132)
shapes = sorted({(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (152064, 3584),
                 (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096),
                 (2048, 512), (32000, 5120), (27648, 5120), (11008, 4096), (8192, 8192),
                 (5120, 13824), (256, 256), (300, 2304), (1100, 3328), (16384, 3584)})
ns = (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33, 48, 64, 65, 128, 256, 300)
for rows, k in shapes:
    for n in ns:
        for p in Precision:
            for flags in (KernelFlags(), KernelFlags(soa=True)):
                try:
                    c = d.choose(n, p, flags, rows, k)
                except Exception as e:
                    print(f"{rows}x{k} {n} {p} {flags} ERR {type(e).__name__}")
                    continue
                print(f"{rows}x{k} {n} {p} {flags} -> {c}")
                if c.cfg is None:
                    continue
                for lay, pairs in ((Layout.SOA, False), (Layout.SOA, True), (Layout.AOS, False)):
                    for in_t in L.IN_TYPES.values():
                        asked.clear()
                        lp = lc.plan(rows, k, lay, in_t, c.path, c.cfg, n, pairs)
                        f = {a: getattr(v, "name", v) for a, v in vars(lp).items()}
                        print(f"  {lay} {pairs} {in_t} {f} asked={asked}")
                if c.path == "mma_f16":
                    for ks in (1, 2, 3):
                        print(f"  part_cfg {ks}: {lc.part_cfg(c.cfg, ks, max(1, n // 2))}")
'''


def compare_plans(base: Path) -> bool:
    outs = []
    for tree in (base, ROOT):
        r = subprocess.run([sys.executable, "-c", PLAN_DUMP, str(tree / "kernels")],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"plan dump of {tree} failed:\n{r.stderr[-2000:]}")
        outs.append(r.stdout.splitlines())
    b, n = outs
    diff = [i for i, (x, y) in enumerate(zip(b, n, strict=False)) if x != y]
    same = len(b) == len(n) and not diff
    print(f"plans: base {len(b)} lines, new {len(n)}, {'equal' if same else 'DIFFER'}"
          + (f"; first at line {diff[0] + 1}:\n  base {b[diff[0]][:400]}\n  new  {n[diff[0]][:400]}"
             if diff else ""))
    return same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main", help="git revision to compare against")
    ap.add_argument("--skip-ptx", action="store_true")
    ap.add_argument("--skip-plans", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the base tree and PTX in this folder")
    a = ap.parse_args(argv)
    work = Path(a.keep or tempfile.mkdtemp(prefix="code_same_"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    arc = subprocess.run(["git", "-C", str(ROOT), "archive", a.base, "kernels"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(base)], input=arc, check=True)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", a.base],
                         capture_output=True, text=True).stdout.strip()
    print(f"# base {a.base} = {rev}", flush=True)
    ok = True
    try:
        if not a.skip_plans:
            ok = compare_plans(base) and ok
        if not a.skip_ptx:
            if shutil.which("nvcc") is None:
                raise SystemExit("nvcc not found (--skip-ptx to compare the plans only)")
            ok = compare_ptx(base, work) and ok
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("same code and plans" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
