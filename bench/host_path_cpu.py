"""The host path of a cached call on the CPU, this tree against another revision (no GPU).

    python bench/host_path_cpu.py [--base main] [--cells 3584x18944:1,4096x14336:8]
        [--rounds 3] [--calls 2000] [--repeat 15] [--json out.json]

A sessions-without-a-GPU check of what a change to the launch path (kernels/cuda/, issue 14)
costs the Python of a call: the host tests' fake device (tests/kernels/test_cuda_backend_host.py
``fake_backend``: CuPy's calls run on the host, the copies as memmoves) under
``CudaBackend.launch(w, x).wait()`` of a staged f16 x, repeated until the call is the cached
``BoundCall`` (its graph replayed), then timed: ``--repeat`` means of ``--calls`` calls, their
minimum. Each tree runs in a subprocess of its own (``q6serve.kernels`` mapped to that tree's
``kernels/`` as bench/code_same.py does, with that tree's fake device), the trees alternated
``--rounds`` times (the order reversed every round). Prints per cell each tree's minimum and
median over the rounds and the difference of the minima. These are CPU figures of a fake
device: the host part of a call on the H200 adds the driver's calls and the real copies.
Session 30 (the launch.py split): a module ``__getattr__`` on launch.py read +0.1 us a call.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, statistics, sys, time
tree, cells, calls, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import __editable___q6serve_0_1_0_finder as finder
finder.MAPPING["q6serve.kernels"] = tree + "/kernels"
sys.path.insert(0, tree)
import numpy as np
from _pytest.monkeypatch import MonkeyPatch
from tests.kernels.test_cuda_backend_host import fake_backend, fake_weight
import q6serve.kernels.cuda.launch as L
assert L.__file__.startswith(tree), L.__file__
be, _ = fake_backend(MonkeyPatch())
out = {}
for cell in cells.split(","):
    shape, n = cell.split(":")
    rows, k = map(int, shape.split("x"))
    w = fake_weight(be, rows, k)
    x = be.staging(int(n), k, np.float16)
    x[...] = np.random.default_rng(0).standard_normal((int(n), k)).astype(np.float16)
    for _ in range(5):  # bound, captured, cached
        be.launch(w, x).wait()
    means = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            be.launch(w, x).wait()
        means.append((time.perf_counter() - t0) / calls * 1e6)
    out[cell] = min(means)
print(json.dumps(out))
'''


def run_tree(tree: Path, cells: str, calls: int, repeat: int) -> dict[str, float]:
    """One subprocess's minimum of means (us) per cell on ``tree``'s code."""
    r = subprocess.run([sys.executable, "-c", CHILD, str(tree), cells, str(calls), str(repeat)],
                       capture_output=True, text=True, cwd=tree, timeout=900)
    if r.returncode:
        raise SystemExit(f"{tree}: the timed child failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def archive(rev: str, dest: Path) -> str:
    """``rev``'s kernels/ and tests/ into ``dest``; its short name."""
    got = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels", "tests"],
                         capture_output=True)
    if got.returncode:
        raise SystemExit(f"--base {rev!r}: {got.stderr.decode(errors='replace').strip()}")
    arc = got.stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=arc, check=True)
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev],
                          capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main", help="git revision to compare against")
    ap.add_argument("--cells", default="3584x18944:1,4096x14336:8",
                    help="ROWSxK:N, comma separated (staged f16 x, f32 y)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="host_path_cpu_"))
    try:
        rev = archive(a.base, work)
        trees = {"new": ROOT, "base": work}
        got: dict[str, list[dict[str, float]]] = {"new": [], "base": []}
        for i in range(a.rounds):
            for name in (("new", "base") if i % 2 == 0 else ("base", "new")):
                got[name].append(run_tree(trees[name], a.cells, a.calls, a.repeat))
                print(f"# round {i + 1} {name}: " + ", ".join(
                    f"{c} {v:.2f}" for c, v in got[name][-1].items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# cached call launch + wait on the fake device (CPU), us: new (this tree) vs base "
          f"{a.base} = {rev}; min / median over {a.rounds} rounds, each the min of "
          f"{a.repeat} means of {a.calls} calls")
    rows = []
    for cell in a.cells.split(","):
        new = [r[cell] for r in got["new"]]
        base = [r[cell] for r in got["base"]]
        rows.append({"cell": cell, "new": new, "base": base})
        print(f"{cell:>14}  new {min(new):6.2f} / {statistics.median(new):6.2f}  base "
              f"{min(base):6.2f} / {statistics.median(base):6.2f}  new - base "
              f"{min(new) - min(base):+5.2f}")
    if a.json:
        a.json.write_text(json.dumps({"base": a.base, "rev": rev, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
