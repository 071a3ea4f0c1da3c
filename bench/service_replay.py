"""The decode replay of bench/service.py --replay (issue 14 item 6): hosts stepping a 28-layer
7B-class model through the worker, and the bare-gRPC floor of the same call sizes.

A decode step of one host (S sequences batched: N = S per call) is, per layer, the attention
projections q, k, v (one multi-weight call when ``multi``, else three calls), o, the MLP's gate
and up (one multi-weight call, else two) and down; then the lm-head (with the top-k epilogue
when ``topk`` > 0, else the full f32 logits). Calls of a step are sequential, as in a real
decode where each matmul needs the previous one's output; each host runs closed-loop steps on
one MatmulStream (or unary calls). Every step records its end-to-end time and the sums over
its calls of the kernel time, the worker's handler, device and queue times (from the replies'
timing), the transport (RPC minus handler) and the client's encode/decode.

Runs in spawned processes (like service_load.py): everything here imports by name.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

MATMUL = "/q6serve.v1.Q6Serve/Matmul"
MATMUL_STREAM = "/q6serve.v1.Q6Serve/MatmulStream"
# (role, rows, K) of one layer of a 7B-class model (Qwen2-7B shapes), and the lm-head
LAYER: tuple[tuple[str, int, int], ...] = (
    ("q", 3584, 3584), ("k", 512, 3584), ("v", 512, 3584), ("o", 3584, 3584),
    ("gate", 18944, 3584), ("up", 18944, 3584), ("down", 3584, 18944))
LM_HEAD = ("lm_head", 152064, 3584)
LAYERS = 28
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # multi-weight calls of a layer
STEP_FIELDS = ("e2e", "kernel", "device", "queue", "handler", "transport", "client",
               "kernel_missing")


def layer_name(layer: int, role: str) -> str:
    return f"blk.{layer}.{role}"


def model_weights(layers: int, scale: float) -> list[tuple[str, int, int]]:
    """(name, rows, K) of every weight: rows scaled (>= 1), K real (message sizes stay real)."""
    out = [(layer_name(i, role), max(1, round(rows * scale)), k)
           for i in range(layers) for role, rows, k in LAYER]
    return [*out, (LM_HEAD[0], max(1, round(LM_HEAD[1] * scale)), LM_HEAD[2])]


@dataclass(frozen=True)
class Call:
    weights: tuple[str, ...]  # one name, or several (a multi-weight call)
    k: int
    topk: int  # > 0 on the lm-head with the epilogue
    out_cols: int  # reply payload per row: sum of the weights' rows (or the top-k bytes)

    def reply_bytes(self, n: int) -> int:
        """Payload of the reply (y as f32, or top-k values + indices + lse), for the floor."""
        if self.topk:
            return n * (8 * self.topk + 4)
        return 4 * n * self.out_cols


def step_plan(layers: int, rows: dict[str, int], multi: bool, topk: int) -> list[Call]:
    """The calls of one decode step, in order."""
    ks = {role: k for role, _, k in LAYER}
    plan: list[Call] = []
    for i in range(layers):
        for group in GROUPS:
            parts = [group] if multi else [(r,) for r in group]
            for g in parts:
                names = tuple(layer_name(i, r) for r in g)
                plan.append(Call(names, ks[g[0]], 0, sum(rows[n] for n in names)))
    lm = LM_HEAD[0]
    plan.append(Call((lm,), LM_HEAD[2], min(topk, rows[lm]), rows[lm]))
    return plan


@dataclass(frozen=True)
class ReplaySpec:
    target: str
    plan: tuple[Call, ...]
    n: int  # rows per call (the host's S sequences)
    seconds: float
    warmup: float
    warm_steps: int  # at least this many untimed steps (kernels compile on first use)
    mode: str  # stream | unary
    dtype: str  # f16 | f32
    precision: int  # pb Precision value


def _request(pb: Any, spec: ReplaySpec, call: Call, x: np.ndarray) -> bytes:
    req = pb.MatmulRequest(precision=spec.precision, out_dtype=pb.DTYPE_F32)
    if len(call.weights) == 1:
        req.weight = call.weights[0]
    else:
        req.weights.extend(call.weights)
    if call.topk:
        req.topk.k = call.topk
    req.x.dtype = pb.DTYPE_F16 if spec.dtype == "f16" else pb.DTYPE_F32  # in place (upb)
    req.x.shape.extend(x.shape)
    req.x.data = x.tobytes()
    return req.SerializeToString()


def _reply(pb: Any, raw: bytes, stream: bool) -> tuple[Any, list[Any]]:
    """The MatmulResponse and its per-weight timings (outputs' for a multi-weight reply)."""
    if stream:
        msg = pb.MatmulStreamResponse.FromString(raw)
        if msg.WhichOneof("outcome") != "result":
            raise RuntimeError(f"stream error: {msg.error.code} {msg.error.message}")
        r = msg.result
    else:
        r = pb.MatmulResponse.FromString(raw)
    outs = list(r.outputs) if len(r.outputs) else [r]
    for o in outs:  # what a host would do with the reply: view y or the top-k arrays
        if o.HasField("topk"):
            np.frombuffer(o.topk.values, np.float32)
            np.frombuffer(o.topk.indices, np.int32)
        else:
            np.frombuffer(o.y.data, np.float32)
    return r, [o.timing for o in outs]


def _opt(t: Any, name: str) -> float:
    return getattr(t, name) if t.HasField(name) else float("nan")


async def _host(spec: ReplaySpec, barrier: Any) -> dict[str, list[float]]:
    import asyncio

    import grpc

    from q6serve.client.channel import channel_options
    from q6serve.v1 import q6serve_pb2 as pb

    rng = np.random.default_rng(0)
    dt = np.float16 if spec.dtype == "f16" else np.float32
    xs = {k: rng.standard_normal((spec.n, k)).astype(dt) for k in {c.k for c in spec.plan}}
    async with grpc.aio.insecure_channel(spec.target, options=channel_options()) as ch:
        await ch.channel_ready()
        unary = ch.unary_unary(MATMUL)
        stream = ch.stream_stream(MATMUL_STREAM)() if spec.mode == "stream" else None

        async def step(rec: dict[str, list[float]] | None) -> None:
            sums = dict.fromkeys(STEP_FIELDS, 0.0)
            t_step = time.perf_counter()
            for call in spec.plan:
                t0 = time.perf_counter()
                req = _request(pb, spec, call, xs[call.k])
                t1 = time.perf_counter()
                if stream is None:
                    raw = await unary(req, timeout=120.0)
                else:
                    await stream.write(req)
                    raw = await stream.read()
                t2 = time.perf_counter()
                r, timings = _reply(pb, raw, stream is not None)
                t3 = time.perf_counter()
                handler = _opt(r.timing, "handler_seconds")
                sums["handler"] += handler
                sums["transport"] += (t2 - t1) - handler
                sums["client"] += (t1 - t0) + (t3 - t2)
                for tm in timings:
                    kern = _opt(tm, "kernel_seconds")
                    if np.isnan(kern):
                        sums["kernel_missing"] += 1
                    else:
                        sums["kernel"] += kern
                    sums["device"] += _opt(tm, "device_seconds")
                    sums["queue"] += tm.queue_seconds
            sums["e2e"] = time.perf_counter() - t_step
            if rec is not None:
                for f in STEP_FIELDS:
                    rec[f].append(sums[f])

        done, end = 0, time.perf_counter() + spec.warmup
        while done < spec.warm_steps or time.perf_counter() < end:
            await step(None)
            done += 1
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 300)
        rec: dict[str, list[float]] = {f: [] for f in STEP_FIELDS}
        t0 = time.perf_counter()
        end = t0 + spec.seconds
        while time.perf_counter() < end or not rec["e2e"]:
            await step(rec)
        rec["_wall"] = [time.perf_counter() - t0]
        if stream is not None:
            await stream.done_writing()
        return rec


def _host_main(spec: ReplaySpec, barrier: Any, results: Any) -> None:
    import asyncio

    try:
        results.put(asyncio.run(_host(spec, barrier)))
    except BaseException as e:  # report, never hang the parent
        barrier.abort()
        results.put({"_error": repr(e)})


def run_replay(spec: ReplaySpec, hosts: int) -> tuple[dict[str, np.ndarray], float]:
    """``hosts`` host processes stepping the model; per-step figures merged, wall seconds."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(hosts)
    results = ctx.Queue()
    procs = [ctx.Process(target=_host_main, args=(spec, barrier, results), daemon=True)
             for _ in range(hosts)]
    for p in procs:
        p.start()
    got = [results.get(timeout=spec.warmup + spec.seconds + 900) for _ in procs]
    for p in procs:
        p.join(30)
    merged: dict[str, list[float]] = {f: [] for f in STEP_FIELDS}
    wall = 0.0
    for rec in got:
        if "_error" in rec:
            raise RuntimeError(f"replay host failed: {rec['_error']}")
        wall = max(wall, rec.pop("_wall")[0])
        for f in STEP_FIELDS:
            merged[f].extend(rec[f])
    return {f: np.asarray(v, np.float64) for f, v in merged.items()}, wall


# -- the floor: bare gRPC round trips of the step's call sizes -------------------------------
def _sized_echo_server(ports: Any) -> None:
    """A grpc.aio MatmulStream-shaped echo: each message's first 8 bytes say how many bytes to
    answer with (replies cached per size), nothing else is done."""
    import asyncio

    import grpc

    replies: dict[int, bytes] = {}

    def reply(req: bytes) -> bytes:
        n = int.from_bytes(req[:8], "little")
        if n not in replies:
            replies[n] = b"\0" * n
        return replies[n]

    async def stream(it: Any, ctx: Any) -> Any:
        async for req in it:
            yield reply(req)

    async def unary(req: bytes, ctx: Any) -> bytes:
        return reply(req)

    async def serve() -> None:
        from q6serve.client.channel import channel_options

        server = grpc.aio.server(options=channel_options())
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("echo.Echo", {
            "U": grpc.unary_unary_rpc_method_handler(unary),
            "S": grpc.stream_stream_rpc_method_handler(stream)})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _floor_client(port: int, sizes: list[tuple[int, int]], mode: str,
                  seconds: float) -> list[float]:
    """p50 seconds of one round trip per (request bytes, reply bytes), closed loop."""
    import asyncio

    import grpc

    from q6serve.client.channel import channel_options

    async def go() -> list[float]:
        out = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=channel_options()) as ch:
            unary = ch.unary_unary("/echo.Echo/U")
            call = ch.stream_stream("/echo.Echo/S")() if mode == "stream" else None
            for req_bytes, reply_bytes in sizes:
                req = reply_bytes.to_bytes(8, "little") + b"\1" * max(0, req_bytes - 8)
                lat: list[float] = []
                end = time.perf_counter() + seconds
                while time.perf_counter() < end or len(lat) < 10:
                    t0 = time.perf_counter()
                    if call is None:
                        await unary(req)
                    else:
                        await call.write(req)
                        await call.read()
                    lat.append(time.perf_counter() - t0)
                out.append(float(np.median(lat[len(lat) // 5:])))  # first fifth: warm-up
            if call is not None:
                await call.done_writing()
        return out

    return asyncio.run(go())


def step_floor(plan: list[Call], n: int, itemsize: int, mode: str,
               seconds: float = 0.3) -> float:
    """Sum over a step's calls of a bare gRPC round trip of the same request and reply sizes
    (server and caller in their own processes, as in the replay)."""
    def sizes(c: Call) -> tuple[int, int]:
        names = sum(len(w) + 2 for w in c.weights)
        return n * c.k * itemsize + 24 + names, c.reply_bytes(n) + 64 * len(c.weights)

    distinct = sorted({sizes(c) for c in plan})
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_sized_echo_server, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        with ctx.Pool(1) as pool:
            p50 = pool.apply(_floor_client, (port, distinct, mode, seconds))
    finally:
        server.terminate()
        server.join(10)
    table = dict(zip(distinct, p50, strict=True))
    return float(sum(table[sizes(c)] for c in plan))
