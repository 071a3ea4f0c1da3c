"""Machine-wide holds a bench run alternates (issue 14, session 29: the transport's surcharge
is paid by whichever process slept through a gap, on waking): what keeps the CPUs out of idle
is system-wide, so an A/B toggles it around each run, on whatever workers are up.

- ``dma``: /dev/cpu_dma_latency held at 0 us (the kernel's PM QoS contract: the request lasts
  while the fd is open; the cpuidle governor then picks only exit-latency-0 states, polling).
  Only a cpuidle driver reads it: the H200 VM of session 29 has none (idle is a halt), so
  there it changes nothing;
- ``idlespin``: one SCHED_IDLE busy-loop process per CPU, the worker's --keep-cpus-awake
  (q6serve.service.keep_awake; no cpuidle needed: a CPU running one never enters the idle
  loop, so on a VM its vCPU never halts; any other thread that wakes there preempts it at
  once; each dies with this process, PR_SET_PDEATHSIG);
- ``haltpoll``: the haltpoll cpuidle governor's poll ceiling (a KVM guest's;
  /sys/module/haltpoll/parameters/guest_halt_poll_ns) raised to HALTPOLL_NS for the hold, put
  back after: an idle CPU polls up to that long (grown adaptively from grow_start) before it
  halts its vCPU (the CI VM's ceiling is 0: every idle halts at once). Needs the haltpoll
  driver.

``SystemHold(kind)`` is a context manager; ``.info`` after it ends: what was held, its message
and the per-state cpuidle entries / time (summed over the CPUs) during the hold.

    python3 bench/cpu_hold.py            # what this machine shows (file, driver, states)
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any

from q6serve.service.keep_awake import KeepAwake

KINDS = ("", "dma", "idlespin", "haltpoll")
DEVICE = Path("/dev/cpu_dma_latency")
CPU_SYS = Path("/sys/devices/system/cpu")
HALTPOLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
HALTPOLL_NS = 1_000_000
# the CPUs this process may use as it starts (an A/B that pins its hosts later, replay_ab
# --pin, narrows its own affinity: the spinners still cover every CPU it was given)
CPUS = sorted(os.sched_getaffinity(0))


def _read(p: Path) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        return "-"


def idle_states(cpu: Path = CPU_SYS) -> dict[str, Any]:
    """cpuidle's driver and governor and cpu0's states: name, exit latency (us), usage so
    far, disabled. Missing files read "-"; no states: an empty list."""
    states = [{"name": _read(d / "name"), "latency_us": _read(d / "latency"),
               "usage": _read(d / "usage"), "disable": _read(d / "disable")}
              for d in sorted((cpu / "cpu0/cpuidle").glob("state[0-9]*"),
                              key=lambda p: int(p.name[5:]))]
    gov = cpu / "cpuidle/current_governor_ro"
    return {"driver": _read(cpu / "cpuidle/current_driver"),
            "governor": _read(gov if gov.exists() else cpu / "cpuidle/current_governor"),
            "states": states}


def usage_all(cpu: Path = CPU_SYS) -> dict[str, list[int]]:
    """Per state name, [entries, time us] summed over every CPU: the difference of two reads
    says which states the CPUs slept in between them."""
    out: dict[str, list[int]] = {}
    for d in cpu.glob("cpu[0-9]*/cpuidle/state[0-9]*"):
        got = out.setdefault(_read(d / "name"), [0, 0])
        for i, f in enumerate(("usage", "time")):
            v = _read(d / f)
            got[i] += int(v) if v.isdigit() else 0
    return out


def describe(cpu: Path = CPU_SYS, device: Path = DEVICE) -> str:
    """One line: the PM QoS file's presence and mode, cpuidle's driver, governor and states."""
    st = idle_states(cpu)
    dev = (f"{device} present, {'writable' if os.access(device, os.W_OK) else 'not writable'}"
           if device.exists() else f"{device} missing")
    states = ", ".join(f"{s['name']} (exit {s['latency_us']} us, used {s['usage']}"
                       + (", disabled" if s["disable"] not in ("0", "-") else "") + ")"
                       for s in st["states"]) or "none"
    return f"{dev}; cpuidle driver {st['driver']}, governor {st['governor']}; cpu0 states: {states}"


class SystemHold:
    def __init__(self, kind: str, device: Path = DEVICE, cpu: Path = CPU_SYS) -> None:
        if kind not in KINDS:
            raise SystemExit(f"cpu hold {kind!r}: one of {KINDS[1:]} or empty")
        self.kind, self.device, self.cpu = kind, device, cpu
        self.info: dict[str, Any] = {"kind": kind or "none"}
        self._fd: int | None = None
        self._spin: KeepAwake | None = None
        self._halt_was: str | None = None

    def __enter__(self) -> SystemHold:
        if self.kind == "dma":
            try:
                self._fd = os.open(self.device, os.O_WRONLY)
                os.write(self._fd, struct.pack("=i", 0))  # the binary form: a native s32
                msg = f"{self.device} holds 0 us"
                if idle_states(self.cpu)["driver"] in ("none", "-"):
                    msg += " (no cpuidle driver reads it: it changes nothing here)"
            except OSError as e:
                msg = f"{self.device}: {e.strerror or e}: nothing held"
            self.info["held"], self.info["message"] = self._fd is not None, msg
        elif self.kind == "idlespin":  # the worker's --keep-cpus-awake, on every CPU
            self._spin = KeepAwake(CPUS)
            time.sleep(0.3)  # started, each on its CPU
            self.info["held"] = True
            self.info["message"] = self._spin.message
        elif self.kind == "haltpoll":
            try:
                self._halt_was = HALTPOLL.read_text().strip()
                HALTPOLL.write_text(str(HALTPOLL_NS))
                self.info["held"] = True
                self.info["message"] = (f"haltpoll: guest_halt_poll_ns {self._halt_was} -> "
                                        f"{HALTPOLL.read_text().strip()}")
            except OSError as e:
                self.info["held"] = False
                self.info["message"] = f"haltpoll: {HALTPOLL}: {e.strerror or e}"
        self._u0 = usage_all(self.cpu)
        return self

    def __exit__(self, *exc: object) -> None:
        u1 = usage_all(self.cpu)
        self.info["idle_delta"] = {k: [u1[k][0] - v[0], u1[k][1] - v[1]]
                                   for k, v in self._u0.items() if k in u1}
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._halt_was is not None:
            HALTPOLL.write_text(self._halt_was)
            self._halt_was = None
        if self._spin is not None:
            self._spin.close()
            self._spin = None

    @property
    def pids(self) -> list[int]:
        return [] if self._spin is None else self._spin.pids


def idle_text(info: dict[str, Any]) -> str:
    """A hold's cpuidle deltas, short: "name entries/ms" per state."""
    d = info.get("idle_delta") or {}
    return " ".join(f"{k} {v[0]}/{v[1] / 1e3:.0f}ms" for k, v in d.items()) or "no cpuidle"


if __name__ == "__main__":
    print(describe())
