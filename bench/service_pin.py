"""``bench/service.py --pin`` specs from a machine probe (issue 14, T1's spread between hosts):
the worker on the cores whose pure-Python loop ran fastest, its caller on the next fastest, and
the same from the slow end. Session 24's probe saw 5-8 of a host's 16 cores run the loop at
47-75 ns an iteration against 32-38 on the others; T1's run-to-run spread followed where the
worker's loop and its caller ran.

    python3 bench/machine_probe.py --json probe.json
    python3 bench/service_pin.py probe.json 2,1      # prints "fastest 3,9:5" and "slowest ..."
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def pin_by_speed(per_core_ns: dict[int, float], w: int, ld: int) -> tuple[str, str] | None:
    """``--pin`` specs (WORKER_CPUS:LOAD_CPUS) from the cores' loop times: the ``w`` fastest
    cores for the worker and the ``ld`` next fastest for the load (ties by core number), and
    the same from the slowest end; None where there are fewer than w + ld cores."""
    if w < 1 or ld < 1 or len(per_core_ns) < w + ld:
        return None
    order = sorted(per_core_ns, key=lambda c: (per_core_ns[c], c))

    def spec(cores: list[int]) -> str:
        return (
            ",".join(map(str, sorted(cores[:w])))
            + ":"
            + ",".join(map(str, sorted(cores[w : w + ld])))
        )

    return spec(order), spec(order[::-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", type=Path, help="bench/machine_probe.py's --json")
    ap.add_argument(
        "cores",
        nargs="?",
        default="2,1",
        metavar="W,L",
        help="the worker's cores and the load's (default 2,1)",
    )
    a = ap.parse_args(argv)
    w, _, ld = a.cores.partition(",")
    per = {
        int(c): float(ns) for c, ns in json.loads(a.probe.read_text())["cpu"]["per_core_ns"].items()
    }
    pins = pin_by_speed(per, int(w), int(ld or 1))
    if pins is None:
        print(f"# {len(per)} cores: too few for {a.cores}", flush=True)
        return 0
    ns = {spec: [per[int(c)] for c in spec.replace(":", ",").split(",")] for spec in pins}
    for name, spec in zip(("fastest", "slowest"), pins, strict=True):
        print(f"{name} {spec}  # ns " + " ".join(f"{v:.1f}" for v in ns[spec]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
