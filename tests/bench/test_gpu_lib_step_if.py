"""bench/gpu_lib.sh's ``step_if NEED NAME LIMIT CMD...``: ``step`` where NEED seconds are still
left in the bundle's bound; else the step is not started and recorded as ``step`` records one
with no time left (rc 124, "skipped" in steps.tsv, the table's STEPS and progress.txt)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
source bench/gpu_lib.sh
gpu_session /tmp/stepif
BOUND=1000 T0=$(($(date +%s) - 900))  # 100 s left (99 if the clock ticks meanwhile)
step_if 50 fits 30 sh -c 'echo ran; exit 3'
echo "rc $?"
step_if 200 late 30 sh -c 'echo must not run >&2'
echo "rc $?"
RESERVE=95 step_if 2 reserved 30 true
echo "rc $?"
unset BOUND
step_if 1000000 nobound 30 true
echo "rc $?"
steps
"""


def test_step_if_runs_what_fits_and_records_what_does_not(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(["bash", "-c", "set -uo pipefail\n" + SCRIPT], cwd=ROOT,
                          env={**os.environ, "DRY_RUN": "1", "OUT": str(out)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stdout + done.stderr
    said = [x.rsplit(" at ", 1)[0] for x in done.stdout.splitlines()]
    assert said[:8] == ["# fits rc=3", "rc 3", "# late rc=124", "rc 124",
                        "# reserved rc=0", "rc 0", "# nobound rc=0", "rc 0"], said
    tsv = [line.split("\t") for line in
           (out / "dry/tmp/stepif/steps.tsv").read_text().splitlines()]
    assert [(r[0], r[1], r[4]) for r in tsv] == [
        ("fits", "3", "ran"), ("late", "124", "skipped"), ("reserved", "0", "ran"),
        ("nobound", "0", "ran")], tsv
    assert 0 < int(tsv[2][3]) <= 5  # RESERVE cut its limit to what the bound leaves
    assert (out / "dry/tmp/stepif/fits.log").read_text() == "ran\n"
    assert (out / "dry/tmp/stepif/late.log").read_text().startswith("skipped:")
    assert "late" in (out / "progress.txt").read_text()
