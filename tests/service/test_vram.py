"""VRAM accounting: budget enforcement, rollback on failure, exact figures after unload."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from svc_util import InstrumentedBackend, RunningWorker, backend_name, random_q6k, write_gguf

from q6serve.client.client import Q6ServeError
from q6serve.kernels.api import Layout, MemoryInfo
from q6serve.kernels.errors import ResourceExhausted
from q6serve.service.config import Budget
from q6serve.service.vram import VramAccountant


def _figures(worker: RunningWorker) -> dict[str, int]:
    """The accountant's figures (plus, on NumPy, the backend's exact holdings; a CUDA pool
    keeps freed blocks cached, so its size is reported but not ours to return)."""
    v = worker.client().status().vram
    out = {"weights": v.weights_bytes, "scratch": v.scratch_bytes,
           "staging": v.staging_bytes, "reserved": v.reserved_bytes}
    if backend_name() == "numpy":
        out["pool"] = v.pool_used_bytes
    return out


def test_accountant_reserve_keep_rollback() -> None:
    acct = VramAccountant(1000, lambda: MemoryInfo(free=5000, total=8000))
    with acct.reserve(weights=600, staging=100) as res:
        res.keep("weights", 590)  # the exact figure the backend reported
    assert (acct.used("weights"), acct.used("staging")) == (590, 0)
    with pytest.raises(ResourceExhausted, match="need 500 bytes"):
        acct.reserve(weights=500)
    with pytest.raises(RuntimeError), acct.reserve(weights=300):
        raise RuntimeError("allocation failed")
    assert acct.used("weights") == 590  # rolled back
    acct.check(weights=410)  # fits exactly: nothing is held by a check
    with pytest.raises(ResourceExhausted):
        acct.check(weights=411)
    assert acct.used("weights") == 590
    acct.release({"weights": 590})
    s = acct.stats()
    assert (s.reserved, s.device_used, s.budget) == (0, 3000, 1000)


def test_budget_parse() -> None:
    assert Budget.parse("8GiB").nbytes == 8 << 30
    assert Budget.parse("500M").nbytes == 500_000_000
    assert Budget.parse("0.5").resolve(1000) == 500
    assert Budget.parse("123").resolve(10) == 123
    assert Budget().resolve(1000) == 900  # nothing given: 0.9 of free
    for bad in ("1.5", "lots", "-3"):
        with pytest.raises(Exception, match="vram-budget"):
            Budget.parse(bad)


def test_load_beyond_budget_fails_and_changes_nothing(start_worker, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    worker = start_worker(vram_budget=Budget(nbytes=400_000), max_request_rows=64)
    write_gguf(model_dir / "m.gguf", {"small": (16, 256, 1), "big": (512, 1024, 2)})
    c = worker.client()
    base = _figures(worker)
    with pytest.raises(Q6ServeError) as e:
        c.load("m.gguf")  # small fits, big does not: neither may stay
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "budget" in e.value.message
    assert c.list() == [] and _figures(worker) == base
    (w,) = c.load("m.gguf", ["small"])
    after = _figures(worker)
    assert after["weights"] == w.nbytes == worker.engine.backend.weight_nbytes(16, 256,
                                                                               Layout.SOA)
    assert after["reserved"] == after["weights"] + after["scratch"]
    if backend_name() == "numpy":
        assert after["pool"] == w.nbytes  # the NumPy backend holds exactly what we accounted
    c.unload("small")
    assert _figures(worker) == base


def test_injected_allocation_failure_rolls_back(start_worker, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    backend = InstrumentedBackend(fail_load_call=3)
    worker = start_worker(backend=backend)
    write_gguf(model_dir / "m.gguf", {"a": (8, 256, 1), "b": (8, 256, 2), "c": (8, 256, 3)})
    c = worker.client()
    base = _figures(worker)
    with pytest.raises(Q6ServeError) as e:
        c.load("m.gguf")
    assert e.value.code == grpc.StatusCode.INTERNAL
    assert c.list() == [] and _figures(worker) == base
    if backend_name() == "numpy":
        assert worker.engine.backend.memory().pool_used == 0
    assert {w.name for w in c.load("m.gguf")} == {"a", "b", "c"}
    assert c.health()


def test_figures_return_after_many_loads(worker: RunningWorker) -> None:
    c = worker.client()
    base = _figures(worker)
    for i in range(5):
        c.upload(f"w{i}", random_q6k(8 * (i + 1), 256 * (i + 1), i), 8 * (i + 1), 256 * (i + 1))
    loaded = _figures(worker)
    assert loaded["weights"] == sum(w.nbytes for w in c.list())
    assert loaded["scratch"] == worker.engine._workspace(40, 1280)  # sized for the largest
    for i in (4, 0, 2, 1, 3):
        c.unload(f"w{i}")
    assert _figures(worker) == base


def test_fraction_budget_resolves_from_free_memory(start_worker) -> None:  # type: ignore[no-untyped-def]
    worker = start_worker(vram_budget=Budget(fraction=0.01))
    s = worker.client().status().vram
    assert 0 < s.budget_bytes <= s.device_free_bytes
