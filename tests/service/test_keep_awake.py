"""service/keep_awake.py: the worker's --keep-cpus-awake - a SCHED_IDLE spinner pinned on each
CPU asked for, gone when closed and when its parent dies however it dies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from svc_util import process_tree

from q6serve.service import keep_awake


def _policy_and_cpus(pid: int) -> tuple[int, set[int]]:
    return os.sched_getscheduler(pid), os.sched_getaffinity(pid)


def test_keep_awake_runs_an_idle_class_spinner_on_each_cpu_until_closed() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with keep_awake.KeepAwake(cpus) as k:
        assert len(k.pids) == len(cpus) and f"{len(cpus)} CPUs" in k.message
        import time

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # each sets its class and CPU first thing
            got = [_policy_and_cpus(p) for p in k.pids]
            if all(pol == os.SCHED_IDLE for pol, _ in got):
                break
            time.sleep(0.05)
        assert got == [(os.SCHED_IDLE, {c}) for c in cpus]
        pids = k.pids
    for p in pids:  # killed and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(p, 0)


def test_keep_awake_spinners_die_with_their_parent(tmp_path: Path) -> None:
    """A parent that is killed (no close) takes its spinners with it (PR_SET_PDEATHSIG)."""
    import subprocess
    import sys
    import time

    code = ("import os, sys, time\nfrom q6serve.service import keep_awake\n"
            "k = keep_awake.KeepAwake([sorted(os.sched_getaffinity(0))[0]])\n"
            "print(k.pids[0], flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    spinner = int(parent.stdout.readline())
    time.sleep(0.3)
    os.kill(spinner, 0)  # running
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(spinner, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{spinner}/stat") as f:  # a zombie (reaped by init) counts as gone
            if f.read().split(")")[-1].split()[0] == "Z":
                return
        time.sleep(0.05)
    pytest.fail(f"spinner {spinner} outlived its parent")


def test_span() -> None:
    assert keep_awake._span([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert keep_awake._span([5]) == "5"


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("frontends", [0, 2])
def test_a_worker_killed_with_sigkill_takes_its_spinners_along(tmp_path: Path,
                                                               frontends: int) -> None:
    """``q6serve worker --keep-cpus-awake`` (alone, and with front-end processes) killed with
    SIGKILL - no drain, no close - leaves no spinner and no front end behind."""
    import signal
    import time

    from q6serve.client.worker_process import WorkerProcess

    args = ["--backend", "numpy", "--keep-cpus-awake"]
    args += ["--frontends", str(frontends)] if frontends else []
    w = WorkerProcess(args, tmp_path / "worker.log").start()
    assert w.proc is not None
    kids: list[int] = []
    try:
        want = len(os.sched_getaffinity(0)) + frontends  # a spinner per CPU, the front ends
        deadline = time.monotonic() + 20
        while len(kids := process_tree(w.proc.pid)) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(kids) >= want, (kids, w.log()[-2000:])
        assert "keep awake: a SCHED_IDLE spinner on each of" in w.log()
        os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.wait()
        deadline = time.monotonic() + 10
        while (left := [k for k in kids if not _gone(k)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"outlived the worker's SIGKILL: {left}"
    finally:  # (a failed test's leftovers: only the processes this worker started)
        for k in kids:
            if not _gone(k):
                os.kill(k, signal.SIGKILL)
        w.stop()
