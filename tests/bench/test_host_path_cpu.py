"""bench/host_path_cpu.py: this tree's cached call against a revision's, each on its own code
(the child asserts its launch.py is that tree's) and the host tests' fake device; a row per
cell with both trees' figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_trees_one_row_per_cell(tmp_path: Path) -> None:
    out = tmp_path / "hp.json"
    done = subprocess.run(
        [sys.executable, "bench/host_path_cpu.py", "--base", "HEAD", "--cells",
         "3584x18944:1,4096x14336:4", "--rounds", "2", "--calls", "20", "--repeat", "2",
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    said = done.stdout.splitlines()
    assert sum(line.startswith("# round ") for line in said) == 4  # 2 rounds x 2 trees
    assert [line.split()[0] for line in said[-2:]] == ["3584x18944:1", "4096x14336:4"]
    doc = json.loads(out.read_text())
    assert [r["cell"] for r in doc["rows"]] == ["3584x18944:1", "4096x14336:4"]
    for r in doc["rows"]:
        assert len(r["new"]) == len(r["base"]) == 2
        assert all(0 < v < 1e5 for v in r["new"] + r["base"])


def test_a_bad_revision_stops_it() -> None:
    done = subprocess.run([sys.executable, "bench/host_path_cpu.py", "--base", "no-such-rev"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--base 'no-such-rev'" in done.stderr, done.stderr
