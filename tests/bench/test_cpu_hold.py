"""bench/cpu_hold.py: the machine-wide holds a bench A/B toggles around its runs (issue 14,
session 29) - the PM QoS fd open for the hold only and its value the kernel's binary s32, a
line (never an error) where it cannot be held or nothing reads it, the SCHED_IDLE spinners per
CPU gone with the hold or with their parent, cpuidle read from sysfs (fake trees here)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cpu_hold


def _fake_cpu(root: Path, driver: str = "haltpoll") -> Path:
    (root / "cpuidle").mkdir(parents=True)
    (root / "cpuidle" / "current_driver").write_text(f"{driver}\n")
    (root / "cpuidle" / "current_governor_ro").write_text("haltpoll\n")
    for cpu in (0, 1):
        for i, (name, lat, use) in enumerate((("POLL", 0, 5), ("haltpoll idle", 1, 100 + cpu))):
            d = root / f"cpu{cpu}" / "cpuidle" / f"state{i}"
            d.mkdir(parents=True)
            for f, v in (("name", name), ("latency", lat), ("usage", use), ("time", 10 * use),
                         ("disable", 0)):
                (d / f).write_text(f"{v}\n")
    return root


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_dma_holds_the_fd_for_the_hold_only(tmp_path: Path) -> None:
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    cpu = _fake_cpu(tmp_path / "cpu")
    before = _fds()
    with cpu_hold.SystemHold("dma", dev, cpu) as h:
        assert dev.read_bytes() == struct.pack("=i", 0)
        assert len(_fds() - before) == 1  # the request lasts while this fd is open
    assert _fds() == before
    assert h.info["held"] and h.info["message"] == f"{dev} holds 0 us"
    assert h.info["idle_delta"] == {"POLL": [0, 0], "haltpoll idle": [0, 0]}


def test_dma_says_why_it_holds_nothing_or_changes_nothing(tmp_path: Path) -> None:
    cpu = _fake_cpu(tmp_path / "cpu", driver="none")
    with cpu_hold.SystemHold("dma", tmp_path / "missing", cpu) as h:
        pass
    assert not h.info["held"] and "nothing held" in h.info["message"]
    dev = tmp_path / "dev"
    dev.write_bytes(b"")
    with cpu_hold.SystemHold("dma", dev, cpu) as h:
        pass
    assert h.info["held"] and "it changes nothing here" in h.info["message"]


def test_idlespin_runs_an_idle_class_spinner_per_cpu_for_the_hold() -> None:
    with cpu_hold.SystemHold("idlespin") as h:
        pids = h.pids
        cpus = sorted(os.sched_getaffinity(0))  # (a CI container may allow a few of many)
        assert len(pids) == len(cpus)
        deadline = time.monotonic() + 10  # (each sets its class and CPU first thing)
        while time.monotonic() < deadline and any(
                os.sched_getscheduler(p) != os.SCHED_IDLE for p in pids):
            time.sleep(0.05)
        assert [(os.sched_getscheduler(p), os.sched_getaffinity(p)) for p in pids] == [
            (os.SCHED_IDLE, {c}) for c in cpus]
    for p in pids:  # killed and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)


def test_a_spinner_dies_with_its_parent() -> None:
    code = ("import sys, time\nsys.path.insert(0, 'bench')\nimport cpu_hold\n"
            "h = cpu_hold.SystemHold('idlespin').__enter__()\n"
            "print(h.pids[0], flush=True)\ntime.sleep(60)\n")
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=root)
    assert parent.stdout is not None
    spinner = int(parent.stdout.readline())
    os.kill(spinner, 0)  # running
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{spinner}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # a zombie: gone
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    pytest.fail(f"spinner {spinner} outlived its parent")


def test_idle_states_usage_and_describe_from_sysfs(tmp_path: Path) -> None:
    cpu = _fake_cpu(tmp_path)
    st = cpu_hold.idle_states(cpu)
    assert st["driver"] == "haltpoll" and st["governor"] == "haltpoll"
    assert [(s["name"], s["latency_us"], s["usage"]) for s in st["states"]] == [
        ("POLL", "0", "5"), ("haltpoll idle", "1", "100")]
    assert cpu_hold.usage_all(cpu) == {"POLL": [10, 100], "haltpoll idle": [201, 2010]}
    line = cpu_hold.describe(cpu, tmp_path / "missing")
    assert line.startswith(f"{tmp_path / 'missing'} missing; cpuidle driver haltpoll")
    assert "haltpoll idle (exit 1 us, used 100)" in line
    empty = cpu_hold.idle_states(tmp_path / "none")
    assert empty == {"driver": "-", "governor": "-", "states": []}
    assert cpu_hold.idle_text({"idle_delta": {}}) == "no cpuidle"


def test_an_unknown_hold_is_refused() -> None:
    with pytest.raises(SystemExit, match="cpu hold 'warm'"):
        cpu_hold.SystemHold("warm")
