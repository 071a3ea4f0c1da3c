"""bench/frontend_cpu.py's CPU window (issue 15, session 9): each process's share of a core over
a window, which the T2 probe reads to say who saturates; a busy process reads near one core, a
sleeping one near none, and a child of this process that is neither the device process nor a
front end counts as a load process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_cpu_window_tells_a_busy_process_from_an_idle_one() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import frontend_cpu
    finally:
        sys.path.remove(str(BENCH))
    spin = "import time\nend = time.time() + 5\nwhile time.time() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    load = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # (the interpreters started)
        window = frontend_cpu.CpuWindow(busy.pid, [idle.pid], {busy.pid, idle.pid})
        window.start()
        t0 = time.perf_counter()
        time.sleep(1.0)
        got = window.shares(t0 + 0.1, time.perf_counter())
    finally:
        for p in (busy, idle, load):
            p.kill()
            p.wait()
    assert got["window_s"] > 0.5
    # (a shared 2-core CI machine may give each spinner a fraction of a core; the sleeper
    # takes none)
    assert got["device"] > 0.1 and got["fronts"][0] < 0.02, got
    assert len(got["load"]) == 1 and got["load"][0] > 0.1, got
    assert 0.2 < got["machine_busy_cores"] <= (os.cpu_count() or 1) + 0.01, got
    assert frontend_cpu.cpu_line(got).startswith("cpu (cores, ")
