"""``--cpus``: parsing, refusal of cores the process may not use, and a worker whose every
thread runs on the cores it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from q6serve.client.worker_process import WorkerProcess
from q6serve.kernels.errors import InvalidArgument
from q6serve.service.affinity import check_cpus, cores_of, parse_cpus, show_cpus
from q6serve.service.config import WorkerConfig, config_from


def test_parse_cpus_lists_and_ranges() -> None:
    assert parse_cpus("2") == (2,)
    assert parse_cpus("3,2") == (2, 3)
    assert parse_cpus("0,4-6") == (0, 4, 5, 6)
    for bad in ("", "x", "3-1", "-1", "1,,2"):
        with pytest.raises(InvalidArgument, match="--cpus"):
            parse_cpus(bad)


def test_cores_the_process_may_not_use_are_refused_by_name() -> None:
    top = max(os.sched_getaffinity(0))
    with pytest.raises(InvalidArgument, match=rf"\[{top + 1}\] are not available"):
        check_cpus((top + 1,))
    assert config_from({"cpus": f"{top},{top - 1 if top else top}"}, {}).cpus == tuple(
        sorted({top, top - 1 if top else top}))
    assert WorkerConfig().cpus == ()


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of ``pid``."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out.add(line.split(":", 1)[1].strip())
    return out


def test_the_cli_refuses_unavailable_cores_in_one_line(tmp_path: Path) -> None:
    top = max(os.sched_getaffinity(0))
    got = subprocess.run([sys.executable, "-m", "q6serve.client.cli", "worker", "--backend",
                          "numpy", "--port", "0", "--cpus", str(top + 1)],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [
        f"q6serve worker: error: --cpus: core(s) [{top + 1}] are not available to this "
        f"process (it may use {show_cpus(os.sched_getaffinity(0))})"]


def test_every_thread_of_the_worker_runs_on_its_cores(tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    with WorkerProcess(["--backend", "numpy", "--cpus", str(core)],
                       tmp_path / "worker.log") as w:
        assert w.proc is not None
        assert _allowed(w.proc.pid) == {str(core)}


def test_cores_of_gives_each_process_of_a_frontends_worker_its_cores() -> None:
    cpus = (2, 3, 4, 5, 6)
    assert cores_of(cpus, 0, 4) == (2,)  # the device process of --frontends 4
    assert [cores_of(cpus, i, 4) for i in range(1, 5)] == [(3,), (4,), (5,), (6,)]
    assert cores_of((2, 3, 4), 0, 4) == (2,)
    assert cores_of((2, 3, 4), 3, 4) == (3, 4)  # fewer cores than front ends: they share
    assert cores_of((2,), 3, 4) == (2,)
    assert cores_of(cpus, 0, 1) == cpus  # one process: all of them


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_front_ends_take_their_own_part_of_the_cores(tmp_path: Path) -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    with WorkerProcess(["--backend", "numpy", "--frontends", "2", "--cpus", f"{a},{b}"],
                       tmp_path / "worker.log") as w:
        assert w.proc is not None
        assert _allowed(w.proc.pid) == {str(a)}  # the device process
        fronts = [c for c in _children(w.proc.pid)
                  if b"frontend_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(fronts) == 2
        for pid in fronts:  # one core left for two front ends: they share it
            assert _allowed(pid) == {str(b)}
