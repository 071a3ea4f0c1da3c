"""client/matmul_bytes.py: the spliced request is byte for byte protobuf's serialization of
the same MatmulRequest, for every argument combination a caller can pass; the cache never lets
a refused argument through."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from q6serve.client import core
from q6serve.client import matmul_bytes as mb
from q6serve.v1 import q6serve_pb2 as pb

RNG = np.random.default_rng(7)


def _x(shape: tuple[int, int], dtype: object) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("weight,dtype,shape", list(itertools.product(
    ("w", "ffn_down.weight.ü", ["q", "k", "v"]),
    (np.float32, np.float16, ml_dtypes.bfloat16),
    ((1, 256), (3, 512), (64, 18944)))))
def test_bytes_equal_protobufs_serialization(weight: object, dtype: object,
                                             shape: tuple[int, int]) -> None:
    x = _x(shape, dtype)
    for precision, out_dtype, rid, topk in itertools.product(
            ("auto", "f16"), ("f32", "bf16"), ("", "7.3", "a" * 127, "a" * 128, "é" * 200),
            (None, 0, 5)):
        want = core.matmul_request(weight, x, precision, out_dtype, rid,  # type: ignore[arg-type]
                                   topk=topk).SerializeToString()
        got = core.matmul_request_bytes(weight, x, precision, out_dtype, rid,  # type: ignore[arg-type]
                                        topk=topk)
        assert got == want
        back = pb.MatmulRequest.FromString(got)
        assert back.x.data == x.tobytes() and back.request_id == rid


def test_views_are_written_as_rows() -> None:
    base = _x((4, 512), np.float32)
    for x in (base[:, ::2], np.asfortranarray(base), base[::2]):
        want = core.matmul_request("w", x).SerializeToString()
        assert core.matmul_request_bytes("w", x) == want
        assert np.array_equal(core.decode_tensor(pb.MatmulRequest.FromString(want).x), x)


def test_the_cache_lets_no_refused_argument_through() -> None:
    x = _x((1, 256), np.float16)
    core.matmul_request_bytes("w", x, topk=1)  # cached for topk=1 ...
    with pytest.raises(ValueError, match="topk=True"):  # ... and True == 1 is still refused
        core.matmul_request_bytes("w", x, topk=True)
    with pytest.raises(ValueError, match="precision"):
        core.matmul_request_bytes("w", x, "fast")
    for bad in (x.astype(np.float64), x.astype(">f2")):  # as matmul_request refuses them
        with pytest.raises(ValueError, match="is not one of"):
            core.matmul_request_bytes("w", bad)
    with pytest.raises(ValueError, match="must be names"):
        core.matmul_request_bytes(["w", 3], x)  # type: ignore[list-item]


def test_the_cache_is_bounded() -> None:
    x = _x((1, 256), np.float32)
    for i in range(mb.MAX_CACHED + 5):
        core.matmul_request_bytes(f"w{i}", x)
    assert len(mb._splices) <= mb.MAX_CACHED


def test_stream_outcome_reads_a_result_and_an_error_from_bytes() -> None:
    r = pb.MatmulStreamResponse(request_id="a")
    r.result.y.dtype = pb.DTYPE_F16
    r.result.y.shape.extend([2, 3])
    y = np.arange(6, dtype=np.float16).reshape(2, 3)
    r.result.y.data = y.tobytes()
    r.result.timing.kernel_seconds = 2e-5
    out = core.stream_outcome(r.SerializeToString(), {})
    assert isinstance(out, core.MatmulOutput)
    assert np.array_equal(out.y, y) and out.kernel_seconds == 2e-5 and out.decode_seconds is None
    e = pb.MatmulStreamResponse(request_id="b")
    e.error.code = 3
    e.error.message = "bad x"
    err = core.stream_outcome(e.SerializeToString(), {})
    assert isinstance(err, core.Q6ServeError) and err.request_id == "b"


def test_a_reply_whose_shape_does_not_match_its_bytes_is_refused() -> None:
    t = pb.Tensor(dtype=pb.DTYPE_F32, shape=[2, 3], data=np.zeros(3, np.float32).tobytes())
    with pytest.raises(ValueError):
        core.decode_tensor(t)
