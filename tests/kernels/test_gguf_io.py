from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from q6serve.kernels import gguf_io, q6k
from q6serve.kernels.errors import FormatError, NotFound
from tests.conftest import random_blocks


def write(path: Path, tensors: dict[str, tuple[np.ndarray, int, int]]) -> Path:
    gguf_io.write_q6k_gguf(path, tensors)
    return path


def test_round_trip_lists_and_reads(tmp_path: Path, rng: np.random.Generator) -> None:
    a = random_blocks(rng, 3 * 2)
    b = random_blocks(rng, 5 * 1)
    p = write(tmp_path / "m.gguf", {"a.weight": (a, 3, 512), "b.weight": (b, 5, 256)})
    infos = {t.name: t for t in gguf_io.list_tensors(p)}
    assert infos["a.weight"].shape == (3, 512) and infos["a.weight"].is_q6k
    assert infos["b.weight"].nbytes == 5 * 210
    got = {t.name: t for t in gguf_io.read_q6k_tensors(p)}
    assert np.array_equal(got["a.weight"].aos, a)
    assert np.array_equal(got["b.weight"].aos, b)
    only = gguf_io.read_q6k_tensors(p, ["b.weight"])
    assert [t.name for t in only] == ["b.weight"]


def test_reads_are_memory_mapped(tmp_path: Path, rng: np.random.Generator) -> None:
    p = write(tmp_path / "m.gguf", {"w": (random_blocks(rng, 8), 8, 256)})
    t = gguf_io.read_q6k_tensors(p)[0]
    assert isinstance(t.aos.base, np.memmap) or isinstance(t.aos, np.memmap) or \
        _is_memmap_view(t.aos)
    chunks = list(t.iter_row_chunks(3 * 210))
    assert [c.shape[0] for c in chunks] == [3, 3, 2]
    assert np.array_equal(np.concatenate(chunks), t.aos)


def _is_memmap_view(a: np.ndarray) -> bool:
    """A view of an np.memmap or of an mmap.mmap buffer (gguf_io maps files itself)."""
    import mmap

    while a is not None:
        if isinstance(a, np.memmap) or isinstance(getattr(a.base, "obj", None), mmap.mmap):
            return True
        a = a.base if isinstance(a.base, np.ndarray) else None
    return False


def test_gguf_dequantize_matches_ours(tmp_path: Path, rng: np.random.Generator) -> None:
    import gguf

    blocks = random_blocks(rng, 4 * 3)
    p = write(tmp_path / "m.gguf", {"w": (blocks, 4, 768)})
    reader = gguf.GGUFReader(p)
    theirs = gguf.quants.dequantize(reader.tensors[0].data, GGMLQuantizationType.Q6_K)
    assert np.array_equal(theirs, q6k.dequantize_aos(blocks, 4, 768))


def test_non_q6k_tensor_is_refused(tmp_path: Path) -> None:
    w = GGUFWriter(str(tmp_path / "f16.gguf"), "x")
    w.add_tensor("emb", np.zeros((4, 256), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FormatError, match="'emb' is F16, not Q6_K"):
        gguf_io.read_q6k_tensors(tmp_path / "f16.gguf", ["emb"])
    with pytest.raises(FormatError, match="no Q6_K tensors"):
        gguf_io.read_q6k_tensors(tmp_path / "f16.gguf")


def test_unknown_tensor_and_missing_file(tmp_path: Path, rng: np.random.Generator) -> None:
    p = write(tmp_path / "m.gguf", {"w": (random_blocks(rng, 1), 1, 256)})
    with pytest.raises(NotFound, match="no tensor named 'nope'"):
        gguf_io.read_q6k_tensors(p, ["nope"])
    with pytest.raises(NotFound, match="does not exist"):
        gguf_io.read_q6k_tensors(tmp_path / "absent.gguf")


def test_truncated_and_garbage_files(tmp_path: Path, rng: np.random.Generator) -> None:
    p = write(tmp_path / "m.gguf", {"w": (random_blocks(rng, 16), 16, 256)})
    data = p.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(FormatError, match=r"beyond the file.s|not a valid GGUF"):
        gguf_io.read_q6k_tensors(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"NOPE" + data[4:])
    with pytest.raises(FormatError, match="not a valid GGUF"):
        gguf_io.list_tensors(tmp_path / "junk.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(FormatError):
        gguf_io.list_tensors(tmp_path / "empty.gguf")


def test_k_not_multiple_of_256_is_refused() -> None:
    with pytest.raises(FormatError, match="K=1000 is not a positive multiple of 256"):
        q6k.check_k(1000)
