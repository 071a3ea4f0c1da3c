"""bench/table_wall.py's CPU parts: the old table it builds from the committed one, its
variants' constants, and ``--write-old`` (the file bench/kernels.py --table-ab reads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from q6serve.kernels.cuda.dispatch import Cfg, DispatchTable, load_default_table

ROOT = Path(__file__).resolve().parents[2]
BENCH = str(ROOT / "bench")
sys.path.insert(0, BENCH)  # (bench/ names such as service.py stay off the path after this)
try:
    import table_wall
finally:
    # only the entry put there above: other test modules' (test_replay_tools: its spawned
    # echo children import service_load by name through the parent's sys.path) stay
    sys.path.remove(BENCH)

OLD = "14336x4096:64:nt8.m1.w8.s4.pf,18944x3584:64:nt4.m1.w12.s4.pf"


def test_old_table_replaces_only_the_given_cells() -> None:
    """The auto and f16 entries of each given (shape, N bucket) take the label's launch shape;
    every other entry (other columns, buckets, shapes) is the committed table's."""
    new = load_default_table()
    # (48: bucket 64's cell; 14336x4096's committed cell is src 4: src 8 there, to differ)
    old = table_wall.old_table(
        new, "14336x4096:48:nt8.m1.w12.s8.pf.k6,18944x3584:64:nt4.m1.w12.s4.pf"
    )
    changed = {}
    for shape, cells in new.cells.items():
        for key, e in cells.items():
            o = old.cells[shape][key]
            if o != e:
                changed[(*shape, *key)] = o.cfg
    assert changed == {
        (14336, 4096, 64, "auto"): Cfg(nt=8, warps=12, src=8, pf=True, ksplit=6),
        (14336, 4096, 64, "f16"): Cfg(nt=8, warps=12, src=8, pf=True, ksplit=6),
        (18944, 3584, 64, "auto"): Cfg(nt=4, warps=12, src=4, pf=True),
        (18944, 3584, 64, "f16"): Cfg(nt=4, warps=12, src=4, pf=True),
    }


def test_old_table_refuses_a_cell_it_lacks_or_a_bad_shape() -> None:
    new = load_default_table()
    with pytest.raises(SystemExit, match="no table cell"):
        table_wall.old_table(new, "1000x4096:64:nt8.m1.w8.s4.pf")
    with pytest.raises(ValueError, match="launch-shape label"):
        table_wall.old_table(new, "14336x4096:64:nt8.q1")
    with pytest.raises(Exception, match="launch shape"):
        table_wall.old_table(new, "14336x4096:64:nt8.m1.w16.s8.pf")  # (16 warps: no wgmma)


def test_labels_and_constants() -> None:
    for cfg in (
        Cfg(nt=8, warps=12, src=8, pf=True, ksplit=6),
        Cfg(nt=2, warps=16, src=4),
        Cfg(nt=1),
    ):
        assert table_wall.cfg_from_label(cfg.label()) == cfg
    assert table_wall.parse_sets("Y_CHUNKS=0,X_SPLIT_Y_SRCS=4/8") == {
        "Y_CHUNKS": 0,
        "X_SPLIT_Y_SRCS": (4, 8),
    }


def test_write_old_gives_a_table_file(tmp_path: Path) -> None:
    out = tmp_path / "old.json"
    done = subprocess.run(
        [sys.executable, "bench/table_wall.py", "--old", OLD, "--write-old", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    t = DispatchTable.load(out)
    assert t.cells[(18944, 3584)][(64, "auto")].cfg.src == 4
    assert (
        t.cells[(18944, 3584)][(32, "auto")]
        == load_default_table().cells[(18944, 3584)][(32, "auto")]
    )
