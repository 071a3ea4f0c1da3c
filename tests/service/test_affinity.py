"""``--cpus``: parsing, refusal of cores the process may not use, and a worker whose every
thread runs on the cores it was given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from q6serve.client.worker_process import WorkerProcess
from q6serve.kernels.errors import InvalidArgument
from q6serve.service.affinity import check_cpus, parse_cpus
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
    with pytest.raises(InvalidArgument, match="not available"):
        config_from({"cpus": f"{top + 1}"}, {})
    assert config_from({"cpus": str(top)}, {}).cpus == (top,)
    assert WorkerConfig().cpus == ()


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of ``pid``."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out.add(line.split(":", 1)[1].strip())
    return out


def test_every_thread_of_the_worker_runs_on_its_cores(tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    with WorkerProcess(["--backend", "numpy", "--cpus", str(core)],
                       tmp_path / "worker.log") as w:
        assert w.proc is not None
        assert _allowed(w.proc.pid) == {str(core)}
