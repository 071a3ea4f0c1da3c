"""The one client core under Client, AsyncClient and ShardedClient: same call signatures, one
channel builder (keepalive, limits, TLS, target check), one codec table, one retry policy."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
from svc_util import random_q6k

from q6serve.client import channel, core
from q6serve.client.async_client import AsyncClient
from q6serve.client.client import Client
from q6serve.client.retry import RetryPolicy
from q6serve.client.sharded import ShardedClient
from q6serve.v1 import q6serve_pb2 as pb

CALLS = ("load", "upload", "list", "get", "unload", "matmul", "matmul_full", "matmul_multi",
         "matmul_topk", "matmul_stream",
         "status", "status_dict", "flags", "health")
# where the sharded client must differ, and why: its load splits rows over the shards
# (`ranges`, one per shard, instead of one worker's `rows`/`shard`), and an upload has no
# row range on the wire
SHARDED_LOAD_ONLY = {"ranges"}
SHARDED_LOAD_MISSING = {"rows", "shard"}
# shared-memory regions belong to one worker (a co-located caller's); a sharded client's calls
# span several, so it has no x_region/y_region
REGION_ARGS = {"x_region", "y_region"}
FAST = RetryPolicy(attempts=3, initial_backoff=0.01, jitter=False)


def params(cls: type, name: str) -> dict[str, tuple[Any, Any]]:
    sig = inspect.signature(getattr(cls, name))
    return {p.name: (p.kind, p.default) for p in sig.parameters.values()}


@pytest.mark.parametrize("name", CALLS)
def test_every_call_takes_the_same_arguments(name: str) -> None:
    sync = params(Client, name)
    assert params(AsyncClient, name) == sync, name
    assert inspect.iscoroutinefunction(getattr(AsyncClient, name)) or \
        inspect.isasyncgenfunction(getattr(AsyncClient, name)), name
    if name == "upload":
        assert not hasattr(ShardedClient, "upload")
        return
    sharded = params(ShardedClient, name)
    if name == "load":
        assert set(sharded) - set(sync) == SHARDED_LOAD_ONLY
        assert set(sync) - set(sharded) == SHARDED_LOAD_MISSING
        sharded = {k: v for k, v in sharded.items() if k not in SHARDED_LOAD_ONLY}
        sync = {k: v for k, v in sync.items() if k not in SHARDED_LOAD_MISSING}
    sync = {k: v for k, v in sync.items() if k not in REGION_ARGS}
    assert sharded == sync, name


def test_the_three_clients_are_exported() -> None:
    import q6serve.client as pkg

    assert (pkg.Client, pkg.AsyncClient, pkg.ShardedClient) == (Client, AsyncClient,
                                                                ShardedClient)


def test_constructors_take_the_same_keywords() -> None:
    sync = params(Client, "__init__")
    assert params(AsyncClient, "__init__") == sync
    sharded = params(ShardedClient, "__init__")
    for kw in ("token", "timeout", "retry", "channel_kw"):
        assert sharded[kw] == sync[kw], kw


def test_async_load_takes_placement(worker: Any, make_client: Callable[..., Any],
                                    model_dir: Any) -> None:
    from svc_util import write_gguf

    write_gguf(model_dir / "m.gguf", {"t": (64, 512, 2)})
    c = make_client(worker.target)
    (w,) = c.load("m.gguf", ["t"], placement="shard")
    assert (w.name, w.rows) == ("t", 64)
    with pytest.raises(ValueError, match="placement='sideways'"):
        c.load("m.gguf", ["t"], placement="sideways")


@pytest.mark.parametrize("aio", [False, True])
def test_one_channel_builder(monkeypatch: pytest.MonkeyPatch, aio: bool) -> None:
    """Sync and asyncio channels get the same options: message limits and keepalive (the sync
    client had no keepalive); round_robin adds the balancing policy."""
    seen: list[dict[str, Any]] = []
    mod = grpc.aio if aio else grpc
    monkeypatch.setattr(mod, "insecure_channel",
                        lambda target, options: seen.append(dict(options)) or "ch")
    channel.make_channel("h:1", aio=aio, max_message_bytes=123)
    channel.make_channel("h:1", aio=aio, round_robin=True)
    plain, rr = seen
    assert plain["grpc.max_receive_message_length"] == plain["grpc.max_send_message_length"] \
        == 123
    assert plain["grpc.keepalive_time_ms"] > 0 and plain["grpc.keepalive_timeout_ms"] > 0
    assert "grpc.lb_policy_name" not in plain and rr["grpc.lb_policy_name"] == "round_robin"
    assert rr["grpc.keepalive_time_ms"] == plain["grpc.keepalive_time_ms"]


def test_sharded_client_uses_the_shared_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, dict[str, Any]]] = []
    real = channel.make_channel

    def spy(target: str, **kw: Any) -> Any:
        made.append((target, kw))
        return real(target, **kw)

    import q6serve.client.sharded as sharded

    monkeypatch.setattr(sharded, "make_channel", spy)
    with ShardedClient(["127.0.0.1:1", "127.0.0.1:2"], max_message_bytes=77):
        pass
    assert [t for t, _ in made] == ["127.0.0.1:1", "127.0.0.1:2"]
    assert all(kw["round_robin"] and kw["max_message_bytes"] == 77 for _, kw in made)


@pytest.mark.parametrize("target", ["localhost", "10.0.0.5", "dns:///q6serve", "[::1]", "::1",
                                    "h:", "h:99999", "h:port", ""])
def test_a_target_without_a_valid_port_is_refused(target: str) -> None:
    with pytest.raises(ValueError, match=r"PORT|port|empty"):
        channel.check_target(target)
    with pytest.raises(ValueError):
        Client(target)


@pytest.mark.parametrize("target", ["localhost:50051", "10.0.0.5:1", "[::1]:50051",
                                    "dns:///q6serve-0.svc:50051", "dns://8.8.8.8/h:5",
                                    "ipv4:127.0.0.1:1,127.0.0.1:2", "unix:/tmp/q6.sock"])
def test_targets_with_a_port_pass(target: str) -> None:
    assert channel.check_target(target) == target


def test_one_codec_table() -> None:
    for name, dt in core.DTYPES.items():
        a = np.arange(6, dtype=np.float32).reshape(2, 3).astype(dt)
        t = core.encode_tensor(a)
        back = core.decode_tensor(t)
        assert back.dtype == dt and np.array_equal(back, a) and core.dtype_name(dt) == name
    assert core.DTYPES["bf16"] == np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="float64 is not one of f32, f16, bf16"):
        core.encode_tensor(np.zeros(2))
    with pytest.raises(ValueError, match="out_dtype='f64'"):
        core.matmul_request("w", np.zeros((1, 256), np.float32), out_dtype="f64")
    import q6serve.client.sharded as sharded

    source = inspect.getsource(sharded)
    assert "DTYPE_F32" not in source and "PRECISION_AUTO" not in source  # no second table


def test_status_dict_byte_counts_are_numbers(client: Any) -> None:
    client.upload("w", random_q6k(64, 512, 1), 64, 512)
    d = client.status_dict()
    vram = d["vram"]
    assert isinstance(vram["weights_bytes"], int) and vram["weights_bytes"] > 0  # type: ignore
    assert all(isinstance(v, int | float | str | bool) for v in vram.values())  # type: ignore


def test_sharded_client_retries_unavailable(flaky: Any) -> None:
    (a, sa), (b, sb) = flaky(0, grpc.StatusCode.UNAVAILABLE), flaky(2, grpc.StatusCode.UNAVAILABLE)
    with ShardedClient([a, b], retry=FAST, timeout=10) as c:
        assert [s.backend for s in c.status()] == ["fake", "fake"]
    assert (sa.calls["GetStatus"], sb.calls["GetStatus"]) == (1, 3)
    (d, sd) = flaky(5, grpc.StatusCode.UNAVAILABLE)
    with ShardedClient([a, d], retry=FAST, timeout=10) as c, \
            pytest.raises(core.Q6ServeError) as e:
        c.status()
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and f"shard 1 of 2 ({d})" in \
        e.value.message
    assert sd.calls["GetStatus"] == FAST.attempts


def test_sharded_matmul_stream(start_worker: Callable[..., Any], model_dir: Any) -> None:
    from svc_util import write_gguf

    blocks = write_gguf(model_dir / "m.gguf", {"t": (96, 512, 2)})
    a, b = start_worker(), start_worker()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((n, 512)).astype(np.float32) for n in (1, 3, 2)]
    with Client(a.target) as one:
        one.upload("whole", blocks["t"], 96, 512)
        want = [one.matmul("whole", x, precision="exact") for x in xs]
    with ShardedClient([a.target, b.target], timeout=10) as c:
        c.load("m.gguf", ["t"])
        reqs = [(f"r{i}", "t", x) for i, x in enumerate(xs)] + [("bad", "nope", xs[0])]
        got = {o.request_id: o for o in c.matmul_stream(reqs, precision="exact")}
    assert set(got) == {"r0", "r1", "r2", "bad"}
    assert isinstance(got["bad"], core.Q6ServeError) and got["bad"].code.name == "NOT_FOUND"
    for i, y in enumerate(want):
        # 1e-5: a coalesced launch takes the NumPy backend's GEMM path, a lone one GEMVs
        assert np.allclose(got[f"r{i}"].y, y, rtol=1e-5, atol=1e-5)  # type: ignore[union-attr]


# -- one Call per method: built and decoded in the core, run by every transport ---------------
def test_calls_are_built_and_decoded_in_the_core() -> None:
    get = core.get_call("w")
    assert (get.method, get.request.name, get.service, get.retry) == ("GetWeight", "w",
                                                                      "q6serve", True)
    assert get.decode(pb.GetWeightResponse(weight=pb.WeightInfo(name="w", rows=3))).rows == 3
    flags = [pb.Flag(name="a", enabled=True), pb.Flag(name="b")]
    setting, reading = core.flags_call({"a": True}), core.flags_call(None)
    assert (setting.method, reading.method) == ("SetFlags", "GetStatus")
    assert reading.decode(pb.GetStatusResponse(flags=flags)) == {"a": True, "b": False}
    assert core.status_call().then(lambda s: s.backend).decode(
        pb.GetStatusResponse(backend="numpy")) == "numpy"
    health = core.health_call()
    assert (health.method, health.service, health.retry) == ("Check", "health", False)
    # a client stream is a factory: every attempt sends the whole stream from its header
    up = core.upload_call("w", np.zeros(core.UPLOAD_CHUNK + 5, np.uint8), 1, 256)
    first, again = list(up.fresh_request()), list(up.fresh_request())
    assert [len(m.chunk) for m in first] == [0, core.UPLOAD_CHUNK, 5] and first == again
    assert first[0].header.total_bytes == core.UPLOAD_CHUNK + 5


def test_argument_rules_of_the_derived_matmul_calls() -> None:
    assert core.one_weight("w") == "w" and core.weight_list(("a", "b")) == ["a", "b"]
    with pytest.raises(ValueError, match="use matmul_multi"):
        core.one_weight(["w"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a list of weight names"):
        core.weight_list("ab")


class _DetailedError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED

    def details(self) -> str:
        return "no"


def test_rpc_errors_become_the_one_error_type() -> None:
    with pytest.raises(core.Q6ServeError) as e, core.rpc_errors():
        raise _DetailedError()
    assert (e.value.code, e.value.message) == (grpc.StatusCode.PERMISSION_DENIED, "no")
    with pytest.raises(KeyError), core.rpc_errors():
        raise KeyError("not a gRPC failure: left alone")


def test_a_calls_deadline_is_its_own_else_the_clients() -> None:
    t = core.Transport(token="t", timeout=7.0, retry=None)
    assert (t._deadline(None), t._deadline(2.0), t._metadata) == (
        7.0, 2.0, (("authorization", "Bearer t"),))
    assert t._policy(core.health_call()).attempts == 1 and t._policy(core.list_call()) is t.retry


def test_health_is_one_attempt_whatever_the_policy(flaky: Any,
                                                   make_client: Callable[..., Any]) -> None:
    target, servicer = flaky(1, grpc.StatusCode.UNAVAILABLE)
    c = make_client(target, retry=FAST)
    with pytest.raises(core.Q6ServeError) as e:
        c.health()
    assert e.value.code is grpc.StatusCode.UNAVAILABLE and servicer.calls["Check"] == 1
    assert c.health() is True and c.status().backend == "fake"
    assert servicer.calls["GetStatus"] == 2  # the same policy retries the other calls
    target, servicer = flaky(1, grpc.StatusCode.UNAVAILABLE)
    with ShardedClient([target], retry=FAST, timeout=10) as s, pytest.raises(core.Q6ServeError):
        s.health()
    assert servicer.calls["Check"] == 1


def test_every_client_sends_the_token_on_every_call(flaky: Any,
                                                    make_client: Callable[..., Any]) -> None:
    target, servicer = flaky(0, grpc.StatusCode.UNAVAILABLE)
    c = make_client(target, token="s3cret")
    c.status()
    c.upload("w", np.zeros(210, np.uint8), 1, 256)  # a client stream
    assert c.health()  # the health service's stub
    with ShardedClient([target], token="s3cret", timeout=10) as s:
        assert s.health() and s.status()[0].backend == "fake"
    assert servicer.tokens == ["Bearer s3cret"] * 5


def test_sharded_outputs_merge_to_the_slowest_shard() -> None:
    from q6serve.client.sharded import merged_output

    a = core.MatmulOutput(np.zeros((1, 2)), "gemv", "soa", "exact", 0.5, 1.0, 4, 2,
                          decode_seconds=0.1, device_seconds=None, handler_seconds=2.0)
    b = core.MatmulOutput(np.ones((1, 3)), "gemv", "soa", "exact", 0.7, 0.5, 3, 5,
                          decode_seconds=0.3, device_seconds=1.0, handler_seconds=1.0)
    m = merged_output([a, b])
    assert m.y is None and m.topk is None and m.outputs == ()  # the caller joins those
    assert (m.queue_seconds, m.kernel_seconds, m.decode_seconds, m.device_seconds,
            m.handler_seconds) == (0.7, 1.0, 0.3, None, 2.0)  # None: a shard did not send it
    assert (m.batch_rows, m.batch_requests, m.kernel, m.precision) == (3, 2, "gemv", "exact")


def test_the_names_map_to_their_own_wire_values() -> None:
    """client/names.py (the CLI's choices, stdlib only) keys the core's tables by position:
    each name must land on the enum value of the same name."""
    from q6serve.client import names

    for table, enum, prefix, keys in (
            (core._DTYPE_TO_PB, pb.DType, "DTYPE_", names.DTYPES),
            (core.PRECISIONS, pb.Precision, "PRECISION_", names.PRECISIONS),
            (core.PLACEMENTS, pb.Placement, "PLACEMENT_", names.PLACEMENTS)):
        assert [enum.Name(table[k]) for k in keys] == [prefix + k.upper() for k in keys]
    assert core.dtype_name(np.dtype(ml_dtypes.bfloat16)) == "bf16"
    assert core.dtype_name(np.dtype(np.float16)) == "f16"
