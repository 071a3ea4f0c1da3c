"""bench/client_decode.py on the NumPy backend: both variants run their calls on one worker,
and the client's threshold is back to its default afterwards (the tool switches it in
process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import client_decode

from q6serve.client import reply_bytes


def test_client_decode_alternates_views_and_whole(tmp_path: Path) -> None:
    before = reply_bytes.VIEW_MIN
    out = tmp_path / "cd.json"
    assert client_decode.main(["--backend", "numpy", "--rows", "512", "--k", "256", "--n", "2",
                               "--calls", "3", "--rounds", "2", "--log",
                               str(tmp_path / "w.log"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["y_bytes"] == 2 * 512 * 4
    assert {v: r["calls"] for v, r in doc["variants"].items()} == {"views": 4, "whole": 4}
    assert all(r["wall_p50_ms"] > r["handler_p50_ms"] > 0 for r in doc["variants"].values())
    assert before == reply_bytes.VIEW_MIN
