"""Whether a kernel-source change keeps every kernel's SASS (CPU only: nvcc and cuobjdump).

    python bench/ab/sass_same.py [--base main] [--jobs matmul,wgmma,...] [--cache DIR] [--show N]

A refactor of the kernel sources (a repeated piece folded into a ``__forceinline__`` helper)
that leaves the machine code of every kernel the same cannot change a result or a time, so it
needs no GPU run. Against ``--base`` (a git revision; its ``kernels/`` and ``bench/ab/`` are
archived into a temporary tree) each job is built in both trees with the product's options as
nvcc's stand-in for NVRTC (``-cubin -std=c++17 -ftz=true``, the loader's ``--std=c++17`` and
CuPy's ``-ftz=true``, ``-arch`` of the H200: ``sm_90``, ``sm_90a`` for the wgmma file), each
cubin disassembled (``cuobjdump -sass``) and its resource usage read (``-res-usage``: registers,
stack, shared, local), and every kernel present in both compared instruction by instruction with
its encoding and control bits (branch targets are offsets in the function: equal code, equal
text). Jobs:

- ``matmul``: q6k_matmul.cu with ``-DQ6SERVE_NVCC_CHECK`` (its explicit instantiations), sm_90;
- ``wgmma``: q6k_wgmma.cu likewise (the wgmma tile and q6k_matmul.cu inlined), sm_90a;
- ``requested``: the loader's inlined q6k_matmul.cu with every template name this tree's
  backend asks NVRTC for (tests/kernels/test_cuda_backend.requested_kernels), sm_90;
- ``topk``, ``repack``: q6_topk.cu, q6k_repack.cu, sm_90;
- ``sk``: bench/ab/q6k_wgmma_sk.cu (bench/sk_ab.py's sk2 source, its instantiations), sm_90a.

Prints one line a job (kernels in each tree, equal, changed, added, gone) and, for the first
``--show`` changed kernels, the first differing instructions. Exit 0 when every kernel in both
trees is the same (added and gone kernels are listed, not failed: a removal is its own check,
bench/code_same.py). ``cuobjdump`` is looked up on PATH, in ``$Q6SERVE_CUOBJDUMP``, and in the
``nvidia-cuda-cuobjdump`` wheel's folder when that is importable (it needs ``nvdisasm`` beside
it or on PATH: the ``nvidia-cuda-nvdisasm`` wheel).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ("-cubin", "-std=c++17", "-ftz=true")
JOBS = ("matmul", "wgmma", "requested", "topk", "repack", "sk")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$")
_RES = re.compile(r"^\s*Function\s+(\S+):\s*$")
_REG = re.compile(r"\bR\d+\b|/\* 0x[0-9a-f]{16} \*/")  # registers, and the encodings naming them


def find_cuobjdump() -> str | None:
    """cuobjdump from $Q6SERVE_CUOBJDUMP, PATH, the CUDA folders or the PyPI wheel's folder."""
    env = os.environ.get("Q6SERVE_CUOBJDUMP")
    if env and os.access(env, os.X_OK):
        return env
    found = shutil.which("cuobjdump")
    if found:
        return found
    cands = [Path("/usr/local/cuda/bin/cuobjdump")]
    for p in sys.path:
        cands += sorted(Path(p).glob("nvidia/cu*/bin/cuobjdump")) if p else []
    return next((str(c) for c in cands if os.access(c, os.X_OK)), None)


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for c in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if os.access(c, os.X_OK):
            return c
    return None


def _tool_env(cuobjdump: str) -> dict:
    """cuobjdump runs nvdisasm: its own folder first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(cuobjdump).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def functions(sass: str) -> dict[str, str]:
    """``cuobjdump -sass`` text -> {mangled kernel name: its instructions and encodings}."""
    out: dict[str, list[str]] = {}
    cur: str | None = None
    for ln in sass.splitlines():
        m = _FUNC.match(ln)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        if cur is not None and ln.strip() and not ln.lstrip().startswith((".headerflags",
                                                                           "code for", ".target")):
            out[cur].append(ln.strip())
    return {k: "\n".join(v) for k, v in out.items()}


def resources(text: str) -> dict[str, str]:
    """``cuobjdump -res-usage`` text -> {kernel: 'REG:.. STACK:.. SHARED:.. LOCAL:..'}."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        m = _RES.match(ln)
        if m and i + 1 < len(lines):
            out[m.group(1)] = " ".join(f for f in lines[i + 1].split()
                                       if f.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))
    return out


@dataclass
class Dump:
    sass: dict[str, str]
    res: dict[str, str]


def dump(cubin: Path, cuobjdump: str) -> Dump:
    env = _tool_env(cuobjdump)
    s = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    r = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True,
                       env=env)
    if s.returncode or r.returncode:
        raise SystemExit(f"cuobjdump {cubin} failed:\n{(s.stderr + r.stderr)[-2000:]}")
    return Dump(functions(s.stdout), resources(r.stdout))


def build(nvcc: str, src: Path, arch: str, out: Path, defines: tuple[str, ...] = ()) -> None:
    cmd = [nvcc, *OPTIONS, f"-arch={arch}", *defines, "-o", str(out), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")


def first_difference(a: str, b: str, context: int = 3) -> str:
    """The first differing instruction lines of two kernels' SASS, with a few before them."""
    la, lb = a.splitlines(), b.splitlines()
    i = next((j for j, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y),
             min(len(la), len(lb)))
    lo = max(0, i - context)
    pa = "\n".join(f"    - {x}" for x in la[lo:i + context])
    pb = "\n".join(f"    + {x}" for x in lb[lo:i + context])
    return f"  at instruction line {i} of {len(la)} / {len(lb)}:\n{pa}\n{pb}"


@dataclass
class Verdict:
    equal: list[str]
    changed: list[str]
    added: list[str]
    gone: list[str]

    @property
    def same(self) -> bool:
        return not self.changed


def compare(base: Dump, new: Dump) -> Verdict:
    both = sorted(set(base.sass) & set(new.sass))
    changed = [k for k in both if base.sass[k] != new.sass[k]
               or base.res.get(k) != new.res.get(k)]
    return Verdict([k for k in both if k not in changed], changed,
                   sorted(set(new.sass) - set(base.sass)), sorted(set(base.sass) - set(new.sass)))


def _source_text(cuda_dir: Path, name: str) -> str:
    """kernels/cuda/loader.source_text of the tree whose kernels/cuda is ``cuda_dir``."""
    from q6serve.kernels.cuda import loader

    old = loader.CUDA_DIR
    loader.CUDA_DIR = cuda_dir
    try:
        return loader.source_text(name)
    finally:
        loader.CUDA_DIR = old


def _requested_names() -> list[str]:
    sys.path.insert(0, str(ROOT / "bench"))
    import code_same

    return code_same.requested_names()


def job_source(job: str, tree: Path) -> tuple[str, str, tuple[str, ...]]:
    """(translation unit text, arch, defines) of ``job`` in ``tree``: the loader's inlined text
    (what NVRTC compiles), so the text alone keys the build cache."""
    cuda = tree / "kernels" / "cuda"
    if job in ("matmul", "wgmma"):
        file = {"matmul": "q6k_matmul.cu", "wgmma": "q6k_wgmma.cu"}[job]
        return (_source_text(cuda, file), "sm_90a" if job == "wgmma" else "sm_90",
                ("-DQ6SERVE_NVCC_CHECK",))
    if job in ("topk", "repack"):
        return _source_text(cuda, {"topk": "q6_topk.cu", "repack": "q6k_repack.cu"}[job]), \
            "sm_90", ()
    if job == "requested":
        refs = "".join(f"    (void*)&{n},\n" for n in _requested_names())
        return (f"{_source_text(cuda, 'q6k_matmul.cu')}\n"
                f"void* q6serve_requested[] = {{\n{refs}}};\n"), "sm_90", ()
    if job == "sk":  # bench/sk_ab.py's sk2 text of this tree, its explicit instantiations
        sk = (tree / "bench" / "ab" / "q6k_wgmma_sk.cu").read_text()
        return ("#define Q6SERVE_SK_CHECK\n#define Q6SERVE_SK_STAGES 6\n#define Q6SERVE_SK_DU 2\n"
                + sk.replace('#include "q6k_wgmma.cu"', _source_text(cuda, "q6k_wgmma.cu")),
                "sm_90a", ())
    raise SystemExit(f"unknown job {job!r} ({', '.join(JOBS)})")


def cached_dump(text: str, arch: str, defines: tuple[str, ...], nvcc: str, cuobjdump: str,
                cache: Path) -> Dump:
    """Build ``text`` (or find its cubin in ``cache``, keyed by text, arch, options and nvcc)
    and disassemble it."""
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join((text, arch, *defines, *OPTIONS, ver)).encode()).hexdigest()
    cubin = cache / f"{key[:32]}.{arch}.cubin"
    if not cubin.is_file():
        tag = f"{key[:32]}.{os.getpid()}.{threading.get_ident()}"
        src = cache / f"{tag}.cu"
        src.write_text(text)
        tmp = cache / f"{tag}.cubin"
        try:
            build(nvcc, src, arch, tmp, defines)
            tmp.replace(cubin)
        finally:
            src.unlink(missing_ok=True)
    return dump(cubin, cuobjdump)


def run(base: Path, new: Path, jobs: list[str], cache: Path, show: int = 3) -> bool:
    nvcc, cuobjdump = find_nvcc(), find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        raise SystemExit(f"needs nvcc and cuobjdump (nvcc={nvcc}, cuobjdump={cuobjdump})")
    srcs = {(job, tag): job_source(job, tree) for job in jobs
            for tag, tree in (("base", base), ("new", new))}
    unique = list(dict.fromkeys(srcs.values()))  # an unchanged source is built once

    with ThreadPoolExecutor(2) as pool:
        dumps = dict(zip(unique, pool.map(
            lambda s: cached_dump(*s, nvcc, cuobjdump, cache), unique), strict=True))
    got = {k: dumps[s] for k, s in srcs.items()}
    ok = True
    for job in jobs:
        v = compare(got[(job, "base")], got[(job, "new")])
        ok = ok and v.same
        print(f"{job:10} base {len(got[(job, 'base')].sass):4} new {len(got[(job, 'new')].sass):4}"
              f" equal {len(v.equal):4} changed {len(v.changed):3} added {len(v.added):3}"
              f" gone {len(v.gone):3}", flush=True)
        for k in v.changed[:show]:
            b, n = got[(job, "base")], got[(job, "new")]
            renamed = _REG.sub("R", b.sass[k]) == _REG.sub("R", n.sass[k])
            print(f"  changed: {k[:140]}\n    res {b.res.get(k)} -> {n.res.get(k)}"
                  + (" (only registers renumbered)" if renamed else ""))
            print(first_difference(b.sass[k], n.sass[k]))
        for k in v.gone[:show]:
            print(f"  gone: {k[:140]}")
        for k in v.added[:show]:
            print(f"  added: {k[:140]}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main", help="git revision to compare against")
    ap.add_argument("--jobs", default="matmul,wgmma,requested,topk,repack",
                    help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "q6serve_sass_cache"),
                    help="cubins by source text, arch and options (reused across runs)")
    ap.add_argument("--show", type=int, default=3, help="changed kernels to show a diff of")
    a = ap.parse_args(argv)
    jobs = [j for j in a.jobs.split(",") if j]
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sass_same_") as work:
        base = Path(work)
        arc = subprocess.run(["git", "-C", str(ROOT), "archive", a.base, "kernels", "bench/ab"],
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "x", "-C", str(base)], input=arc, check=True)
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", a.base],
                             capture_output=True, text=True).stdout.strip()
        print(f"# base {a.base} = {rev}; nvcc {' '.join(OPTIONS)}", flush=True)
        ok = run(base, ROOT, jobs, cache, a.show)
    print("same SASS" if ok else "DIFFERENT SASS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
