"""Row-range loads: row_range / shard load a slice of a tensor that reports its global rows."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scaleout_util import LoopWorker, assert_close, reference, write_gguf

from q6serve.client.client import Client, Q6ServeError
from q6serve.kernels import q6k
from q6serve.service.shards import RowRange, even_split

ROWS, K = 37, 512


def test_even_split_spreads_the_remainder() -> None:
    assert even_split(10, 3) == [RowRange(0, 4), RowRange(4, 7), RowRange(7, 10)]
    assert even_split(5, 5)[-1] == RowRange(4, 5)
    for rows, count in ((37, 3), (152064, 2), (7, 1)):
        parts = even_split(rows, count)
        assert parts[0].begin == 0 and parts[-1].end == rows
        assert all(a.end == b.begin for a, b in itertools.pairwise(parts))
        assert max(p.rows for p in parts) - min(p.rows for p in parts) <= 1


def test_row_range_and_shard_loads(start_worker: Callable[..., LoopWorker],
                                   model_dir: Path) -> None:
    blocks = write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 1), "v": (8, K, 2)})["w"]
    w = start_worker()
    x = np.random.default_rng(0).standard_normal((3, K)).astype(np.float32)
    want = reference(blocks, ROWS, K, x)
    with Client(w.target, timeout=10) as c:
        (got,) = c.load("m.gguf", ["w"], rows=(5, 17))
        assert (got.name, got.rows, got.row_begin, got.row_end, got.tensor_rows) == \
            ("w", 12, 5, 17, ROWS)
        assert c.get("w").row_begin == 5
        assert_close(c.matmul("w", x), want[:, 5:17])
        per_row = K // q6k.QK_K
        assert got.sha256 == hashlib.sha256(blocks[5 * per_row : 17 * per_row]).hexdigest()

        (s,) = c.load("m.gguf", ["w"], prefix="s2/", shard=(2, 3))  # [25, 37)
        assert (s.name, s.row_begin, s.row_end, s.rows) == ("s2/w", 25, 37, 12)
        assert_close(c.matmul("s2/w", x), want[:, 25:37])

        (whole,) = c.load("m.gguf", ["v"])
        assert (whole.row_begin, whole.row_end, whole.tensor_rows) == (0, 8, 8)
        listed = {x.name: (x.row_begin, x.row_end, x.tensor_rows) for x in c.list()}
        assert listed == {"w": (5, 17, ROWS), "s2/w": (25, 37, ROWS), "v": (0, 8, 8)}


@pytest.mark.parametrize("kw", [{"rows": (30, 40)}, {"rows": (9, 9)}, {"shard": (3, 3)},
                                {"shard": (0, 0)}, {"shard": (0, 40)}])
def test_bad_row_ranges_are_invalid_argument(start_worker: Callable[..., LoopWorker],
                                             model_dir: Path, kw: dict) -> None:
    write_gguf(model_dir / "m.gguf", {"w": (ROWS, K, 1)})
    w = start_worker()
    with Client(w.target, timeout=10) as c, pytest.raises(Q6ServeError) as e:
        c.load("m.gguf", ["w"], **kw)
    assert e.value.code.name == "INVALID_ARGUMENT", e.value
    with Client(w.target, timeout=10) as c:
        assert c.list() == []
