"""bench/kernels_table.py: issue 16's table and target verdicts from a kernels.py --json run."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "bench/kernels_table.py"


def row(shape: str, n: int, us: float, tbs: float, x_torch: float | None,
        dtype: str = "f16") -> dict:
    return {"shape": shape, "n": n, "path": f"auto=mma_f16.{dtype}", "dtype": dtype, "us": us,
            "tbs": tbs, "x_llama": None, "x_torch": x_torch,
            "torch_us": us * x_torch if x_torch else None}


def run(tmp: Path, results: list[dict], *args: str, base: list[dict] | None = None) -> str:
    (tmp / "k.json").write_text(json.dumps({"device": "test GPU", "results": results}))
    extra = []
    if base is not None:
        (tmp / "base.json").write_text(json.dumps({"device": "test GPU", "results": base}))
        extra = ["--base", str(tmp / "base.json")]
    done = subprocess.run([sys.executable, str(TABLE), str(tmp / "k.json"), *args, *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def verdicts(out: str) -> dict[str, str]:
    """target text -> the rest of its line."""
    got = {}
    for line in out.splitlines():
        if line.startswith("- "):
            text, _, rest = line[2:].partition(" (")
            got[text.split(":")[0]] = rest
    return got


def test_cells_and_verdicts(tmp_path: Path) -> None:
    results = [
        # 56 MB: faster than torch, 2.45 TB/s at N=1 but 2.2 at N=8, 2.6 at 16, 1.9 at 64
        row("18944x3584", 1, 22.8, 2.45, 1.6), row("18944x3584", 8, 25.4, 2.2, 1.5),
        row("18944x3584", 16, 21.5, 2.6, 1.4), row("18944x3584", 64, 29.4, 1.9, 1.01),
        # 11 MB: torch faster at N=64; 2 MB: slower than torch but under 10 MB
        row("3584x3584", 1, 11.8, 0.9, 1.12), row("3584x3584", 64, 18.0, 0.58, 0.68),
        row("512x3584", 1, 8.5, 0.18, 0.9),
        # an lm-head at 2.9 TB/s at N <= 8
        row("128256x4096", 1, 148.6, 2.9, 1.9), row("128256x4096", 8, 150.0, 2.87, 1.8),
        # f32 rows are not the f16 table's
        row("18944x3584", 1, 99.0, 0.5, 0.1, dtype="f32"),
        {"shape": "4096x4096", "n": 1, "path": "auto=mma_f16.f16", "error": "boom"},
    ]
    out = run(tmp_path, results)
    lines = out.splitlines()
    assert "| shape (MB) | N=1 | N=8 | N=16 | N=64 |" in lines
    assert "| 18944x3584 (56) | 22.8 · 2.45 · 1.60x | 25.4 · 2.20 · 1.50x | 21.5 · 2.60 · 1.40x" \
           " | 29.4 · 1.90 · 1.01x |" in lines
    assert "| 3584x3584 (11) | 11.8 · 0.90 · 1.12x | – | – | 18.0 · 0.58 · 0.68x |" in lines
    assert "| 4096x4096 (14) | FAILED | – | – | – |" in lines
    v = verdicts(out)
    assert v["faster than torch f16 at every N <= 64, every shape >= 10 MB"] == (
        "9 cells): **missed** in 2: 3584x3584 N=64: 0.680x; 4096x4096 N=1: failed")
    assert v[">= 2.5 TB/s at N = 16, every shape >= 48 MB"] == "1 cells): **met**"
    assert v[">= 2.0 TB/s at N = 64, every shape >= 48 MB"] == (
        "1 cells): **missed** in 1: 18944x3584 N=64: 1.90")
    assert v[">= 2.4 TB/s at N <= 8, every shape >= 48 MB"] == (
        "4 cells): **missed** in 1: 18944x3584 N=8: 2.20")
    assert v[">= 2.8 TB/s at N <= 8 on both lm-heads"] == "2 cells): **met**"
    f32 = run(tmp_path, results, "--dtype", "f32")
    assert "| 18944x3584 (56) | 99.0 · 0.50 · 0.10x |" in f32.splitlines()


def test_base_slower_by_more_than_3_percent(tmp_path: Path) -> None:
    base = [row("4096x14336", 1, 20.0, 2.4, 1.6), row("4096x14336", 8, 21.0, 2.3, 1.6),
            row("4096x14336", 64, 40.0, 1.2, 1.0)]
    now = [row("4096x14336", 1, 20.6, 2.33, 1.55), row("4096x14336", 8, 21.7, 2.22, 1.5),
           row("4096x14336", 64, 50.0, 0.96, 0.8)]  # N=64: not an N <= 8 cell
    v = verdicts(run(tmp_path, now, base=base))
    (text,) = [t for t in v if t.startswith("no N <= 8 cell")]
    assert v[text] == "2 cells): **missed** in 1: 4096x14336 N=8: 21.0 -> 21.7 us (1.033x)"


def test_session_15_closing_table_reproduced(tmp_path: Path) -> None:
    """The closing check of session 15 (bench/RESULTS.md): its kernels.json, kept in the check's
    archive, gives the table RESULTS holds (made by hand then), cell for cell."""
    archive = ROOT / "bench/results/2026-12-02_s15_closing_check_h200_b88f289.tgz"
    with tarfile.open(archive) as tf:
        doc = json.load(io.TextIOWrapper(tf.extractfile("C/m/kernels.json")))
    out = run(tmp_path, doc["results"])
    results_md = (ROOT / "bench/RESULTS.md").read_text()
    section = results_md[results_md.index("## Closing check, session 15"):]
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "x" in ln.split()[1]]
    assert len(rows) == 10
    for ln in rows:  # RESULTS wrote 3584x3584's 10.5 MB as "(10)"
        assert ln.replace("3584x3584 (11)", "3584x3584 (10)") in section, ln
