"""bench/kernels.py --ab-cells: --cfg-ab results into the dispatch table (no device)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from q6serve.kernels.api import KernelFlags, Precision
from q6serve.kernels.cuda.dispatch import Cfg, Dispatch, DispatchTable, load_default_table

ROOT = Path(__file__).resolve().parents[2]


def ab_row(shape: str, n: int, auto: str, auto_us: float, cand: str, cand_us: float,
           rel: float | None = 1e-7) -> dict:
    return {"shape": shape, "n": n, "auto": auto, "auto_us": auto_us, "cand": cand,
            "cand_us": cand_us, "rel": rel, "torch_us": None, "runs": {}, "mb": 48.2}


def label(rows: int, k: int, n: int, column: str = "auto") -> str:
    e = load_default_table().cells[(rows, k)][(n, column)]
    return f"{e.path}.{e.cfg.label()}"


def run(tmp: Path, *runs: list[dict], gain: str = "1.01",
        more: tuple[str, ...] = ()) -> tuple[DispatchTable, str]:
    files = []
    for i, rows in enumerate(runs):
        f = tmp / f"ab{i}.json"
        f.write_text(json.dumps({"device": "test GPU", "cfg_ab": rows}))
        files.append(str(f))
    out = tmp / "table.json"
    done = subprocess.run([sys.executable, "bench/kernels.py", "--ab-cells", ",".join(files),
                           "--gain", gain, "--table-out", str(out), "--note", "test cells",
                           *more],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return DispatchTable.load(out), done.stdout


def test_a_faster_candidate_takes_its_cells_and_the_rest_stay(tmp_path):
    a1 = label(4096, 14336, 1)
    a8 = label(18944, 3584, 8)
    win = "nt1.m1.w8.s2.k4"
    rows = [ab_row("4096x14336", 1, a1, 20.4, win, 19.6),  # 1.041x: taken
            ab_row("4096x14336", 1, a1, 20.4, "nt1.m1.w4.s2", 19.0, rel=0.9),  # wrong: ignored
            ab_row("18944x3584", 8, a8, 24.8, "nt1.m1.w16.s4.pf", 24.7)]  # 1.004x: kept
    # a second run: the candidate's best and AUTO's best over both runs decide
    again = [ab_row("4096x14336", 1, a1, 20.1, win, 19.9)]
    table, out = run(tmp_path, rows, again)
    d = Dispatch(table, 132)
    for prec in (Precision.AUTO, Precision.F16):
        c = d.choose(1, prec, KernelFlags(), 4096, 14336)
        assert c.cfg == Cfg(nt=1, ksplit=4) and c.source == "table"
    e = table.cells[(4096, 14336)][(1, "auto")]
    assert e.us == 19.6  # the candidate's best
    assert "x1.026" in out  # AUTO's best 20.1 over the candidate's 19.6
    assert table.cells[(18944, 3584)][(8, "auto")] == load_default_table().cells[
        (18944, 3584)][(8, "auto")]
    assert "kept" in out and table.meta["note"].endswith("; test cells")
    # every other cell is the committed table's
    old = load_default_table()
    changed = [key for shape, cells in old.cells.items() for key, e in cells.items()
               if table.cells[shape][key] != e]
    assert sorted(changed) == [(1, "auto"), (1, "f16")]


def test_a_column_that_held_another_pick_is_not_changed(tmp_path):
    # the A/B ran AUTO's launch shape; a column whose cell names another (exact here) stays
    a1 = label(4096, 14336, 1)
    table, _ = run(tmp_path, [ab_row("4096x14336", 1, a1, 20.4, "nt1.m1.w8.s2.k4", 19.0)])
    assert table.cells[(4096, 14336)][(1, "exact")] == load_default_table().cells[
        (4096, 14336)][(1, "exact")]
    assert table.cells[(4096, 14336)][(1, "q8_1")].path == "mmq_q8_1"


def test_below_the_gain_nothing_changes(tmp_path):
    a1 = label(4096, 14336, 1)
    table, out = run(tmp_path, [ab_row("4096x14336", 1, a1, 20.4, "nt1.m1.w8.s2.k4", 20.0)],
                     gain="1.05")
    assert table.cells == load_default_table().cells
    assert "kept" in out


def test_other_numerics_enter_only_below_ab_rel(tmp_path):
    """A candidate whose y differs from AUTO's by more than the default 1e-4 (session 20's src 8
    rounds A otherwise) is ignored, and taken with --ab-rel above its difference."""
    a64 = label(4096, 14336, 64)
    rows = [ab_row("4096x14336", 64, a64, 39.5, "nt8.m1.w12.s8.pf", 35.0, rel=4e-4)]
    table, out = run(tmp_path, rows)
    assert table.cells[(4096, 14336)][(64, "auto")] == load_default_table().cells[
        (4096, 14336)][(64, "auto")]
    table, out = run(tmp_path, rows, more=("--ab-rel", "1e-3"))
    e = table.cells[(4096, 14336)][(64, "auto")]
    assert e.cfg == Cfg(nt=8, warps=12, src=8, pf=True) and e.us == 35.0, out
