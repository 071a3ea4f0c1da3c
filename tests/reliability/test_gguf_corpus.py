"""Malformed GGUF files: each one is refused with a clear FormatError/NotFound carrying the
numbers, quickly and without large allocations -- through kernels.gguf_io and through the
worker's LoadWeights (INVALID_ARGUMENT / NOT_FOUND, accounting unchanged, still SERVING).

Non-finite Q6_K scales (d = NaN/+-Inf) are *rejected at load* (as llama.cpp's
ggml_validate_row_data does): such a scale would poison whole output rows for every caller.

Fuzzing: mutated valid files (byte flips, truncations, insertions, extreme u64 counts) must
parse or fail with FormatError -- never anything else. CI runs a bounded budget; set
Q6SERVE_FUZZ_EXAMPLES for a longer run (see docs/RELIABILITY.md).
"""

from __future__ import annotations

import os
import re
import struct
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from q6serve.client.client import Q6ServeError
from q6serve.kernels import gguf_io
from q6serve.kernels.errors import FormatError, NotFound
from q6serve.service.config import Budget, WorkerConfig
from tests.reliability.gguf_corpus import CASES, Case, valid_file
from tests.reliability.harness import RunningWorker, health, vram_figures
from tests.service.svc_util import assert_close

FUZZ_EXAMPLES = int(os.environ.get("Q6SERVE_FUZZ_EXAMPLES", "300"))
PEAK_BYTES = 4 << 20  # no case may allocate more than this while being refused
CASE_SECONDS = 2.0


def read_all(path: Path, names: tuple[str, ...] = ()) -> int:
    """What a load does: open, pick Q6_K tensors, stream every chunk. Returns the rows read."""
    rows = 0
    for t in gguf_io.read_q6k_tensors(path, list(names) or None):
        for chunk in t.iter_row_chunks(1 << 20):
            rows += chunk.shape[0] * 256 // t.k
    gguf_io.list_tensors(path)
    return rows


def test_corpus_is_large_and_distinct() -> None:
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({c.build() for c in CASES}) == len(CASES)


def test_valid_seed_reads(tmp_path: Path) -> None:
    p = tmp_path / "ok.gguf"
    p.write_bytes(valid_file().build())
    assert read_all(p) == 4 + 2
    assert [t.name for t in gguf_io.list_tensors(p)] == ["blk.0.w", "output.weight", "norm"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gguf_io_refuses(case: Case, tmp_path: Path) -> None:
    p = tmp_path / f"{case.id}.gguf"
    p.write_bytes(case.build())
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(case.error, match=case.match):
            read_all(p, case.tensors)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < CASE_SECONDS
    assert peak < PEAK_BYTES, f"{case.id}: {peak} bytes allocated while refusing"


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        read_all(tmp_path / "absent.gguf")
    with pytest.raises(NotFound, match="does not exist"):
        read_all(tmp_path)


# -- through the worker ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    models = tmp_path_factory.mktemp("models")
    for c in CASES:
        (models / f"{c.id}.gguf").write_bytes(c.build())
    (models / "ok.gguf").write_bytes(valid_file().build())
    w = RunningWorker(WorkerConfig(host="127.0.0.1", port=0, model_dir=models,
                                   vram_budget=Budget(nbytes=64 << 20)))
    # A resident weight first, so "unchanged" accounting is not trivially all zeros.
    w.client().load("ok.gguf", ["output.weight"])
    yield w
    w.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_load_weights_refuses(case: Case, corpus_worker: RunningWorker) -> None:
    c = corpus_worker.client()
    before = vram_figures(c)
    names_before = [w.name for w in c.list()]
    with pytest.raises(Q6ServeError) as info:
        c.load(f"{case.id}.gguf", case.tensors)
    assert info.value.code == grpc.StatusCode[case.error.grpc_code]
    assert re.search(case.match, info.value.message), info.value.message
    assert vram_figures(c) == before
    assert [w.name for w in c.list()] == names_before  # nothing half-loaded
    assert health(corpus_worker.target) == "SERVING"


def test_worker_still_loads_and_serves_after_corpus(corpus_worker: RunningWorker) -> None:
    c = corpus_worker.client()
    [w] = c.load("ok.gguf", ["blk.0.w"], prefix="after.")
    x = np.ones((2, 512), np.float32)
    y = c.matmul("after.blk.0.w", x)
    t = gguf_io.read_q6k_tensors(corpus_worker.engine.config.model_dir / "ok.gguf",
                                 ["blk.0.w"])[0]
    from q6serve.kernels import q6k

    want = x.astype(np.float64) @ q6k.dequantize_aos(np.asarray(t.aos), 4, 512).T
    assert_close(y, want, 1e-5)
    c.unload(w.name)


# -- fuzzing ---------------------------------------------------------------------------------
_EXTREMES = (0, 1, 255, 256, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 62, 1 << 63, (1 << 64) - 1)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(valid_file().build())
    for _ in range(draw(st.integers(1, 3))):
        n = len(data)
        op = draw(st.sampled_from(("flip", "truncate", "insert", "u64", "u32")))
        if n == 0:
            break
        pos = draw(st.integers(0, n - 1))
        if op == "flip":
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "u64" and pos + 8 <= n:
            data[pos : pos + 8] = struct.pack("<Q", draw(st.sampled_from(_EXTREMES)))
        elif op == "u32" and pos + 4 <= n:
            data[pos : pos + 4] = struct.pack("<I", draw(st.sampled_from(_EXTREMES[:6])))
    return bytes(data)


@settings(max_examples=FUZZ_EXAMPLES, deadline=5000,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=mutated())
def test_fuzz_mutated_files(data: bytes, tmp_path: Path) -> None:
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(data)
    try:
        read_all(p)
    except (FormatError, NotFound) as e:
        assert str(e)  # a message, never an empty one


def test_non_finite_scale_only_matters_in_the_rows_loaded(corpus_worker: RunningWorker,
                                                          ) -> None:
    """Row-range loads check the rows they hold: tensor b has a NaN scale in row 1."""
    c = corpus_worker.client()
    before = vram_figures(c)
    f = "scale-nan-second-tensor.gguf"
    assert [w.name for w in c.load(f, ["b"], prefix="r2.", rows=(2, 3))] == ["r2.b"]
    with pytest.raises(Q6ServeError) as info:
        c.load(f, ["b"], prefix="r1.", rows=(1, 3))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "non-finite scale d=nan" in info.value.message
    c.unload("r2.b")
    assert vram_figures(c) == before
