"""bench/t3_ab_table.py: one row per T3 run, the pairs' medians and ratio from their runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def t3(tmp: Path, name: str, rows_per_s: float, region: str = "cuda", frontends: int = 6) -> None:
    doc = {"runs": [{"kernel_p50_us": 47.5}, {"kernel_p50_us": 47.1}],
           "targets": [{"region": region, "frontends": frontends, "service_rows_per_s": rows_per_s,
                        "p99_us": 1500.0, "fraction": rows_per_s / 1.36e6}]}
    (tmp / f"t3_{name}.json").write_text(json.dumps(doc))


def test_rows_and_pair_medians(tmp_path: Path) -> None:
    for name, v in (("off_1", 300e3), ("on_1", 450e3), ("on_2", 510e3), ("off_2", 340e3),
                    ("on_3", 480e3)):
        t3(tmp_path, name, v)
    t3(tmp_path, "sys_1", 200e3, "system", 8)
    done = subprocess.run([sys.executable, str(ROOT / "bench/t3_ab_table.py"), str(tmp_path),
                           "--pair", "off:on:lean 0 / 1", "--pair", "off:nope:absent"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    runs = [ln for ln in lines if ln.startswith("# ") and "median" not in ln][1:]
    assert len(runs) == 6  # one row per file, the kernel the runs' fastest p50
    assert "# sys_1    system  8    200,000    1,500   47.1  0.147" in runs
    # medians: off 320,000 of 2 runs, on 480,000 of 3; a pair with a variant that did not run
    # prints nothing
    assert lines[-1] == "# median lean 0 / 1: 320,000 (2) / 480,000 (3) = 1.500"
    assert not any("absent" in ln for ln in lines)
