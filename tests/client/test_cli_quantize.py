from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from q6serve.client.cli import main
from q6serve.kernels import gguf_io
from q6serve.kernels.quantize import quantize_q6_k


def test_quantize_single_and_pairs(tmp_path: Path, rng: np.random.Generator,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    a = rng.standard_normal((4, 512)).astype(np.float32)
    b = rng.standard_normal((2, 256)).astype(np.float16)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    out = tmp_path / "one.gguf"
    assert main(["quantize", str(tmp_path / "a.npy"), str(out), "--name", "w"]) == 0
    [t] = gguf_io.read_q6k_tensors(out)
    assert (t.name, t.rows, t.k) == ("w", 4, 512)
    assert np.array_equal(t.aos, quantize_q6_k(a))

    out2 = tmp_path / "two.gguf"
    assert main(["quantize", f"{tmp_path / 'a.npy'}:x.weight", f"{tmp_path / 'b.npy'}:y.weight",
                 str(out2)]) == 0
    got = {t.name: t for t in gguf_io.read_q6k_tensors(out2)}
    assert set(got) == {"x.weight", "y.weight"}
    assert np.array_equal(got["y.weight"].aos, quantize_q6_k(b))
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(("shape", "dtype", "message"), [
    ((4, 500), np.float32, "K=500"),
    ((4,), np.float32, "2-D"),
    ((4, 256), np.int32, "float32, float16 or bfloat16"),
])
def test_quantize_bad_inputs(tmp_path: Path, shape: tuple[int, ...], dtype: type,
                             message: str, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.ones(shape, dtype))
    assert main(["quantize", str(tmp_path / "x.npy"), str(tmp_path / "o.gguf"),
                 "--name", "w"]) == 2  # a usage error: the input cannot be used
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o.gguf").exists()


def test_quantize_needs_a_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.ones((1, 256), np.float32))
    assert main(["quantize", str(tmp_path / "x.npy"), str(tmp_path / "o.gguf")]) == 2
    assert "--name" in capsys.readouterr().err
