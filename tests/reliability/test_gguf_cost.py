"""Loading cost is bounded by the tensors asked for (issue 18, item 8).

A llama.cpp-like file carries ~1 M tokenizer items in its metadata. Reading its tensor table
must not materialise them (gguf's GGUFReader built a numpy array per item: 70 s and 3 GB for
4 Mi items), and a load costs about the bytes of the tensors it loads.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from q6serve.kernels import gguf_io
from q6serve.kernels.backends import make_backend
from q6serve.kernels.errors import Cancelled
from q6serve.service.config import Budget, WorkerConfig
from q6serve.service.engine import Engine
from tests.reliability.gguf_corpus import (
    ARR,
    STR,
    U32,
    File,
    Tensor,
    gstr,
    kv,
    q6k_blocks,
    u32,
    u64,
)

N_TOKENS = 1 << 20  # a 256k-vocab tokenizer's tokens, scores, types and merges, roughly
N_MERGES = 1 << 19
ROWS, K, N_TENSORS = 128, 4096, 24
LOAD_ROWS = 512  # 41 MiB of tensors for the load's cost
I32, F32V = 5, 6


def string_array(key: str, prefix: str, n: int) -> bytes:
    items = b"".join(gstr(f"{prefix}{i}") for i in range(n))
    return kv(key, ARR, u32(STR) + u64(n) + items)


def scalar_array(key: str, itype: int, values: np.ndarray) -> bytes:
    return kv(key, ARR, u32(itype) + u64(values.size) + values.tobytes())


def llama_like(path: Path, n_tokens: int, n_merges: int, rows: int) -> Path:
    blocks = q6k_blocks(rows, K, 1)
    f = File(tensors=[Tensor(f"blk.{i}.ffn_down.weight", [K, rows], data=blocks)
                      for i in range(N_TENSORS)],
             kvs=[kv("general.architecture", STR, gstr("llama")),
                  kv("general.alignment", U32, u32(32)),
                  string_array("tokenizer.ggml.tokens", "tok", n_tokens),
                  scalar_array("tokenizer.ggml.scores", F32V, np.arange(n_tokens, dtype="<f4")),
                  scalar_array("tokenizer.ggml.token_type", I32, np.ones(n_tokens, "<i4")),
                  string_array("tokenizer.ggml.merges", "a b", n_merges)])
    path.write_bytes(f.build())
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Full-size tokenizer metadata (1.5 M items, 30 MB), small tensors."""
    return llama_like(tmp_path_factory.mktemp("big") / "llama-like.gguf", N_TOKENS, N_MERGES,
                      ROWS)


def tensor_bytes(rows: int) -> int:
    return N_TENSORS * rows * K // 256 * 210


def test_a_full_size_tokenizer_is_skipped(model):
    infos = gguf_io.list_tensors(model)
    ts = gguf_io.read_q6k_tensors(model)
    assert len(infos) == len(ts) == N_TENSORS
    assert model.stat().st_size > 20 << 20
    assert np.array_equal(ts[-1].aos.reshape(-1)[:420],
                          np.frombuffer(q6k_blocks(ROWS, K, 1)[:420], np.uint8))


@pytest.mark.parametrize("n_tokens", [1 << 12, 1 << 16])
def test_reading_the_tensor_table_allocates_nothing_per_metadata_item(n_tokens, tmp_path):
    """Python allocations (traced; tracemalloc is slow per allocation, hence the smaller
    files) do not grow with the metadata: GGUFReader made one array per item."""
    p = llama_like(tmp_path / "m.gguf", n_tokens, n_tokens // 2, ROWS)
    tracemalloc.start()
    try:
        ts = gguf_io.read_q6k_tensors(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(ts) == N_TENSORS
    assert peak < 256 << 10, f"{peak / 2**10:.0f} KiB to read a table of {N_TENSORS} tensors"


def test_parsing_can_be_abandoned(model):
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) > 3  # after the first few polls (inside the tokens array)

    with pytest.raises(Cancelled, match="parsing abandoned at byte"):
        gguf_io.read_q6k_tensors(model, cancelled=cancelled)


def test_a_load_costs_about_the_bytes_of_its_tensors(tmp_path):
    """Through the engine (no gRPC): host memory allocated while loading every tensor of the
    file stays under 2x their bytes (the NumPy backend holds them in host memory)."""
    model = llama_like(tmp_path / "m.gguf", 1 << 10, 1 << 9, LOAD_ROWS)

    async def go() -> int:
        engine = Engine(make_backend("numpy"), WorkerConfig(
            port=0, model_dir=model.parent, vram_budget=Budget(nbytes=1 << 30)))
        try:
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            views = await engine.load_gguf(model.name, [])
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
            assert len(views) == N_TENSORS
            return peak
        finally:
            await engine.close()

    peak = asyncio.run(go())
    assert peak < 2 * tensor_bytes(LOAD_ROWS), (
        f"loading {tensor_bytes(LOAD_ROWS) / 2**20:.1f} MiB of tensors allocated "
        f"{peak / 2**20:.1f} MiB at the peak")


def test_a_scan_yields_the_gil_by_time_not_per_nested_array(tmp_path, monkeypatch):
    """The scan hands the GIL over (sleep(0)) at most every YIELD_S: polling once per inner
    array of an array of 100 k one-string arrays must not sleep 100 k times (a first version
    yielded on every poll: 1 M inner arrays took 87 s instead of 1.7)."""
    from tests.reliability.gguf_corpus import ARR, STR, File, Tensor, gstr, kv, q6k_blocks, u32, u64

    n = 100_000
    inner = u32(STR) + u64(1) + gstr("a")
    path = tmp_path / "nested.gguf"
    path.write_bytes(File(tensors=[Tensor("t", [K, 1], data=q6k_blocks(1, K, 1))],
                          kvs=[kv("x", ARR, u32(ARR) + u64(n) + inner * n)]).build())
    sleeps = [0]
    real_sleep = gguf_io.time.sleep

    def counting(s: float) -> None:
        sleeps[0] += 1
        real_sleep(s)

    monkeypatch.setattr(gguf_io.time, "sleep", counting)
    assert [t.name for t in gguf_io.read_q6k_tensors(path)] == ["t"]
    assert sleeps[0] < n // 16, f"{sleeps[0]} GIL hand-overs for {n} inner arrays"
