"""``--cpus``: the CPU cores every thread of the worker may run on (its front-end processes
inherit them).

Why: one MatmulStream round trip crosses four threads (gRPC's socket thread, its completion
poller, the event loop, and back), each hand-off a wake-up. On the H200 machine (16 cores) a
wake-up that lands on another core costs ~30 µs and finds that core's caches cold for the
Python that runs next. With the worker and its one caller each on a core of their own, a
one-caller N=1 call went from 1066 to 619 µs (p50 minus kernel; bare gRPC echo 307 -> 144
µs); with the load spread over eight cores the same call went 853 -> 801 µs and the 7B
replay at S=8 got slower (195 -> 243 ms per step), and under many callers it gains nothing
(bench/RESULTS.md, "Pinning", "Run 5" and the closing check). It is a deployment choice to
measure, like Docker's ``--cpuset-cpus`` or Kubernetes' static CPU manager; front ends
(``--frontends``) want a core each on top (:func:`cores_of` gives each process of such a
worker its part of ``--cpus``).
"""

from __future__ import annotations

import contextlib
import os

from q6serve.kernels.errors import InvalidArgument


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"2"``, ``"2,3"``, ``"8-11"``, ``"0,4-5"`` -> sorted core numbers."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise InvalidArgument(f"--cpus {text!r}: use core numbers and ranges, e.g. 2,3 or "
                              "8-11") from None
    return tuple(sorted(cpus))


def check_cpus(cpus: tuple[int, ...]) -> None:
    """Refuse cores this process may not use (cgroup cpuset, taskset) by name."""
    allowed = os.sched_getaffinity(0)
    if missing := sorted(set(cpus) - allowed):
        raise InvalidArgument(f"--cpus: core(s) {missing} are not available to this process "
                              f"(it may use {show_cpus(allowed)})")


def pin_process(cpus: tuple[int, ...] | set[int], pid: int | str = "self") -> None:
    """Every thread of process ``pid`` (this one by default) onto ``cpus``; threads and
    processes started later inherit it (affinity is per thread in Linux: threads already
    running are moved too)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


def cores_of(cpus: tuple[int, ...], slot: int, frontends: int) -> tuple[int, ...]:
    """The cores of process ``slot`` of a worker with ``frontends`` front ends (the device
    process is slot 0, front end i slot i + 1; one process with --frontends 1, which takes
    all of ``cpus``): given a core for each, one core each (the device
    process's event loop runs busy, each front end's loop has its own wake-ups); given fewer,
    the device process keeps one and the front ends share the rest; given one, all share it."""
    slots = frontends + 1 if frontends > 1 else 1
    if len(cpus) <= 1 or slots <= 1:
        return cpus
    if slot == 0:
        return cpus[:1]
    rest = cpus[1:]
    if len(rest) >= slots - 1:
        return (rest[slot - 1],)
    return rest


def show_cpus(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5" (as taskset and cpusets write them)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(run)
            run = []
        run.append(c)
    if run:
        out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)
