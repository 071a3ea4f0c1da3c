"""Keep every CPU from idling while a worker serves (issue 14, session 29; the worker's
``--keep-cpus-awake`` / ``Q6SERVE_KEEP_CPUS_AWAKE``, opt-in).

Session 28 found the transport's surcharge paid by whichever process slept through a gap, on
waking; on a VM, a CPU with nothing to run halts its vCPU, and a wake-up there waits for the
host to resume it. The H200 VM has no cpuidle driver (idle is a halt, whatever
/dev/cpu_dma_latency asks), so the lever inside the guest is to leave no CPU idle: a spinner
process of the lowest scheduling class on each CPU. Bundle B (H200): the held echo's
surcharge 9.98 -> 5.05 ms a step, the replay S=8 84.3 -> 77.2 ms (docs/SERVICE.md, T1
section). It burns every CPU the worker's threads leave idle.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterable

log = logging.getLogger("q6serve.keep_awake")

# One process per CPU, pinned there, of the lowest scheduling class (SCHED_IDLE): it runs only
# when nothing else would (any other thread waking on its CPU preempts it at once, and the
# scheduler counts its CPU as idle when placing a woken thread), so the CPU never enters the idle
# loop and, on a VM, its vCPU never halts: a wake-up there is a preemption, not a halted vCPU's
# resumption by the host. It dies with its parent (PR_SET_PDEATHSIG), however that ends - with
# the parent's *thread* that started it, in fact (the kernel's rule): start it from a thread that
# lives as long as it should (the worker's main thread does).
_SPINNER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):
    sys.exit(0)
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


class KeepAwake:
    """A SCHED_IDLE spinner process on each of ``cpus`` (default: every CPU this process may
    run on) until :meth:`close`; ``message``: one line saying what runs."""

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self.cpus = cpus
        self._procs = [subprocess.Popen([sys.executable, "-c", _SPINNER, str(c),
                                         str(os.getpid())], stdin=subprocess.DEVNULL)
                       for c in cpus]
        self.message = (f"keep awake: a SCHED_IDLE spinner on each of {len(cpus)} CPUs "
                        f"({_span(cpus)}) while this process runs")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()

    def __enter__(self) -> KeepAwake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _span(cpus: list[int]) -> str:
    """0-3,8 for [0, 1, 2, 3, 8]."""
    out, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def keep_awake(cpus: Iterable[int] | None = None) -> KeepAwake:
    """A :class:`KeepAwake`, its line logged."""
    k = KeepAwake(cpus)
    log.info("%s", k.message)
    return k
