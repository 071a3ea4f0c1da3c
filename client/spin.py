"""How long a caller polls for its reply before it blocks: the one rule of the client's spins
(the lane's, client/lane.py, and the blocking session's, client/session.py).

A spin is worth its core only where the process may run on ``SPIN_MIN_CPUS`` cores or more:
on fewer, a spinning caller takes the core the worker or gRPC's threads need (the 2-core CI
VM's replay step doubled). It is the worker's busy-polling rule (service/envvars.py
SPIN_MIN_CPUS), kept here as a copy: the client library never imports the service
(tests/client/test_layers.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

SPIN_MIN_CPUS = 8


def caller_spin_us(var: str, default_us: float, who: str,
                   env: Mapping[str, str] | None = None) -> float:
    """The spin in us: ``$var`` when set (a number >= 0; anything else is refused, naming the
    variable and ``who`` spins), else ``default_us`` on a process allowed SPIN_MIN_CPUS cores
    or more, else 0."""
    raw = (os.environ if env is None else env).get(var, "").strip()
    if not raw:
        return default_us if len(os.sched_getaffinity(0)) >= SPIN_MIN_CPUS else 0.0
    try:
        us = float(raw)
    except ValueError:
        us = math.nan
    if not (math.isfinite(us) and us >= 0):
        raise ValueError(f"{var}={raw!r}: give microseconds {who} polls for a reply before it "
                         "blocks (0: never), 0 or more")
    return us
