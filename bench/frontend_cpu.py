"""CPU seconds per call of a --frontends worker's device process and of its front ends, under
T2-shaped load (many callers of N=1 on a tiny weight, so the kernel costs ~nothing and what is
measured is the serving path). On the H200, T2 through front ends ran at ~4-5k calls/s (issue
15): one device process doing the IPC, the batchers and the device thread is one core's worth
of Python, so its CPU per call sets that ceiling. CPU time (from /proc) is robust on a shared
machine where wall-clock figures are not.

    python bench/frontend_cpu.py --frontends 2 --seconds 4      # NumPy backend, ~15 s
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from service_load import LoadSpec, run_load

from service import random_q6k  # bench/ is sys.path[0]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--hosts", type=int, default=2, help="load processes")
    ap.add_argument("--callers", type=int, default=16, help="callers per load process")
    ap.add_argument("--region", default="", choices=("", "system"),
                    help="x and y through each caller's region (default: bytes)")
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args(argv)
    from q6serve.client.client import Client

    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"frontend_cpu_{os.getpid()}.log"
    cmd = [sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0", "--backend",
           "numpy", "--allow-shm", "--max-regions", "1024"]
    if a.frontends > 1:
        cmd += ["--frontends", str(a.frontends)]
    with open(log, "w") as out:
        worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while not (m := re.search(r"listening on (\S+:\d+)", log.read_text())):
            if worker.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        target = m.group(1)
        with Client(target) as c:
            c.upload("w", random_q6k(16, 256, 1), 16, 256)
        spec = LoadSpec(target, (("w", 256),), a.callers, 1, a.seconds, 0.5, "stream", "f16",
                        0, 0, a.region, 16, True)
        fronts = children(worker.pid)
        before = {p: cpu_seconds(p) for p in [worker.pid, *fronts]}
        samples, wall = run_load(spec, a.hosts)  # the warm-up's CPU is in too (~1/9)
        used = {p: cpu_seconds(p) - t for p, t in before.items()}
        calls = int(samples["w"]["e2e"].size)
        print(f"frontends={a.frontends} {a.region or 'bytes'}: {calls} calls, "
              f"{calls / wall:,.0f}/s; CPU per call: device process "
              f"{used[worker.pid] / calls * 1e6:.0f} us, front ends "
              f"{sum(used[p] for p in fronts) / calls * 1e6:.0f} us", flush=True)
    finally:
        worker.terminate()
        worker.wait(60)
        log.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
