"""A Node.js client written from the .proto alone drives every RPC of a NumPy worker.

tests/protocol/client.js (@grpc/grpc-js + @grpc/proto-loader, locked in package-lock.json)
encodes tensors itself, so this checks the byte layouts, codes and limits the .proto states, as
a host in another language meets them (shared-memory regions too: it puts x into /dev/shm
and reads y from there). Inputs come from here; results are compared with a
float64 reference computed here. Without node the test skips, except under CI (CI=1), where
.ci/run installs Node and the npm packages and a missing node is a failure.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from q6serve.kernels.quantize import quantize_q6_k
from q6serve.service.config import Budget, WorkerConfig
from q6serve.v1 import q6serve_pb2 as pb
from tests.service.svc_util import RunningWorker, random_q6k, reference

HERE = Path(__file__).resolve().parent
K = 512  # the 'wrong-k' stream request sends K = 256
N = 3
MAX_REQUEST_ROWS = 256
OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, RESOURCE_EXHAUSTED = 0, 3, 5, 6, 8
BIG_ROWS = 4352  # a [256, 4352] f32 reply is 4.46 MB: over the 4 MiB default receive limit


def _node() -> str:
    node = shutil.which("node")
    if node is None or not (HERE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        what = ("node is not installed" if node is None
                else "npm packages missing: run `npm ci` in tests/protocol")
        if os.environ.get("CI"):
            pytest.fail(f"{what} (.ci/run installs Node and runs npm ci under CI)")
        pytest.skip(what)
    return node


def _close(y: dict[str, Any], want: np.ndarray, rtol: float) -> None:
    got = np.asarray(y["values"], np.float64).reshape(y["shape"])
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} x {scale:.3g}"


def test_node_client_drives_every_rpc(tmp_path: Path, rng: np.random.Generator) -> None:
    node = _node()
    from q6serve.kernels.gguf_io import write_q6k_gguf

    model_dir = tmp_path / "models"
    model_dir.mkdir()
    w_q6k = random_q6k(16, K, int(rng.integers(1 << 31)))
    w_gguf = random_q6k(8, K, int(rng.integers(1 << 31)))
    write_q6k_gguf(model_dir / "m.gguf", {"blk.0.ffn": (w_gguf, 8, K)})
    w_f32 = (rng.standard_normal((8, K)) * 0.05).astype(np.float32)
    w_big = random_q6k(BIG_ROWS, 256, int(rng.integers(1 << 31)))
    # Multiples of 1/64 in [-2, 2]: exact in f32, f16 and bf16, so every x dtype means the
    # same numbers and one reference serves all.
    x = (rng.integers(-128, 129, (N, K)) / 64).astype(np.float32)
    spec = {
        "target": "", "max_request_rows": MAX_REQUEST_ROWS,
        "q6k": {"name": "w-q6k", "rows": 16, "k": K,
                "data_b64": base64.b64encode(w_q6k.tobytes()).decode()},
        "f32w": {"name": "w-f32", "rows": 8, "k": K, "values": w_f32.ravel().tolist()},
        "gguf": {"path": "m.gguf", "tensor": "blk.0.ffn", "prefix": "g/"},
        "x": {"n": N, "k": K, "values": x.ravel().tolist()},
        "big": {"name": "w-big", "rows": BIG_ROWS, "k": 256, "n": MAX_REQUEST_ROWS,
                "data_b64": base64.b64encode(w_big.tobytes()).decode()},
    }
    worker = RunningWorker(WorkerConfig(
        host="127.0.0.1", port=0, model_dir=model_dir, vram_budget=Budget(nbytes=64 << 20),
        max_request_rows=MAX_REQUEST_ROWS, grace_period_s=5.0, allow_shm=True))
    stopper: threading.Thread | None = None
    try:
        spec["target"] = worker.target
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.Popen([node, str(HERE / "client.js"), str(tmp_path / "spec.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:  # results, then "watching" once Watch saw SERVING
                lines.append(json.loads(line))
                if lines[-1]["event"] == "watching":
                    break
            assert lines and lines[-1]["event"] == "watching", (lines, proc.stderr.read())
            stopper = threading.Thread(target=worker.stop, kwargs={"grace": 5.0})
            stopper.start()  # drain: health NOT_SERVING, which Watch must deliver
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        watch = json.loads(out.strip().splitlines()[-1])
    finally:
        if stopper is not None:
            stopper.join(30)
        worker.stop()
    r = lines[0]
    assert r["event"] == "results"
    assert watch == {"event": "watch", "statuses": ["SERVING", "NOT_SERVING"]}

    # health and reflection
    assert r["health_check"] == {"": {"code": OK, "status": "SERVING"},
                                 "q6serve.v1.Q6Serve": {"code": OK, "status": "SERVING"},
                                 "no.such.Service": {"code": NOT_FOUND}}
    assert r["health_list"]["code"] == 12  # UNIMPLEMENTED, as grpcio's own servicer
    assert {"q6serve.v1.Q6Serve", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(r["reflection"]["services"])
    assert [lk.get("files", 0) > 0 for lk in r["reflection"]["lookups"][:-1]] == [True] * 5
    assert r["reflection"]["lookups"][-1] == {"error_code": NOT_FOUND}
    methods = pb.DESCRIPTOR.services_by_name["Q6Serve"].methods_by_name
    assert set(r["reflected_methods"]) == set(methods)
    assert r["reflected_status"] == {"code": OK, "backend": "numpy"}
    assert r["status"]["backend"] == "numpy" and r["status"]["serving"] is True

    # uploads: the worker's sha256 of the stored Q6_K bytes is what either side computes
    assert r["upload_q6k"]["code"] == OK
    assert r["upload_q6k"]["res"]["weight"]["sha256"] == hashlib.sha256(w_q6k).hexdigest()
    q_f32 = quantize_q6_k(w_f32)
    assert r["upload_f32"]["code"] == OK
    assert r["upload_f32"]["res"]["weight"]["sha256"] == hashlib.sha256(q_f32).hexdigest()
    assert r["upload_bad_sha"]["code"] == INVALID_ARGUMENT
    assert "sha256" in r["upload_bad_sha"]["details"]
    assert r["upload_dup"]["code"] == ALREADY_EXISTS
    assert r["load"]["code"] == OK
    assert r["list"] == ["g/blk.0.ffn", "w-f32", "w-q6k"]
    assert (r["get"]["rows"], r["get"]["k"]) == (16, K)
    assert r["get_missing"]["code"] == NOT_FOUND

    # matmuls in every dtype against the float64 reference
    refs = {"w-q6k": reference(w_q6k, 16, K, x), "w-f32": reference(q_f32, 8, K, x),
            "g/blk.0.ffn": reference(w_gguf, 8, K, x)}
    out_rtol = {"DTYPE_F32": 1e-5, "DTYPE_F16": 2e-3, "DTYPE_BF16": 1e-2}
    assert len(r["matmul"]) == 15
    for key, got in r["matmul"].items():
        weight, _, out_dtype = key.rsplit("/", 2)
        assert "y" in got, (key, got)
        assert got["request_id"] == key and got["precision"] == "PRECISION_EXACT"
        assert got["y"]["dtype"] == out_dtype
        _close(got["y"], refs[weight], out_rtol[out_dtype])
    assert r["matmul_missing"]["code"] == NOT_FOUND

    # the stream: good replies right, bad ones with their numeric codes, nothing lost
    s = r["stream"]
    assert {rid: rep["code"] for rid, rep in s.items()} == {
        "ok-f32": OK, "no-weight": NOT_FOUND, "wrong-k": INVALID_ARGUMENT,
        "too-many-rows": INVALID_ARGUMENT, "short-bytes": INVALID_ARGUMENT,
        "no-x": INVALID_ARGUMENT, "ok-bf16": OK}
    for rid in ("ok-f32", "ok-bf16"):
        assert s[rid]["request_id"] == rid
        _close(s[rid]["y"], refs["w-q6k"], 1e-5)
    assert "K=256" in s["wrong-k"]["message"] and "missing" in s["no-weight"]["message"]

    # shared-memory regions: x read from /dev/shm, y written there, bounds checked
    assert r["region_register"]["code"] == OK and r["region_list"] == ["node-r"]
    assert r["region_matmul"]["code"] == OK and r["region_matmul"]["reply_bytes"] == 0
    _close(r["region_matmul"]["y"], refs["w-q6k"], 1e-5)
    assert r["region_out_of_bounds"]["code"] == INVALID_ARGUMENT
    assert r["region_unregister"] == OK

    flags = {f["name"]: f["enabled"] for f in r["flags_off"]}
    assert flags["Q6SERVE_DYNAMIC_BATCHING"] is False
    assert {f["name"]: f["enabled"] for f in r["flags_on"]}["Q6SERVE_DYNAMIC_BATCHING"] is True

    # message sizes: > 4 MiB refused by grpc-js defaults, fine with the limit raised
    assert r["upload_big"]["code"] == OK
    assert r["big_default_limit"]["code"] == RESOURCE_EXHAUSTED
    big = r["big_raised_limit"]
    assert big["code"] == OK and big["shape"] == [MAX_REQUEST_ROWS, BIG_ROWS]
    assert big["bytes"] == MAX_REQUEST_ROWS * BIG_ROWS * 4 > 4 << 20
    bx = ((np.arange(MAX_REQUEST_ROWS * 256) % 7 - 3) / 4).reshape(MAX_REQUEST_ROWS, 256)
    want = reference(w_big, BIG_ROWS, 256, bx)
    # EXACT's contract is an error relative to the output's scale (as _close), not per element:
    # an element that cancels to ~0.02 among outputs of ~15 carries the sum's f32 rounding
    # (~1e-6 absolute from the f32 summation order, which is not the reference's)
    _close({"values": big["first"], "shape": [8]}, want.ravel()[:8], 1e-5)
    assert abs(big["sum"] - want.sum()) <= 1e-4 * np.abs(want).sum()

    assert r["unload"] == [OK] * 4 and r["list_after"] == 0
