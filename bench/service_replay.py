"""The decode replay of bench/service.py --replay (issue 14 item 6): hosts stepping a 28-layer
7B-class model through the worker, and the bare-gRPC floor of the same call sizes.

A decode step of one host (S sequences batched: N = S per call) is, per layer, the attention
projections q, k, v (one multi-weight call when ``multi``, else three calls), o, the MLP's gate
and up (one multi-weight call, else two) and down; then the lm-head (with the top-k epilogue
when ``topk`` > 0, else the full f32 logits). y comes back as ``out`` (f16 by default: the
activations a host feeds the next layer; the epilogue's values are always f32). Calls of a step
are sequential, as in a real decode where each matmul needs the previous one's output; each
host runs closed-loop steps on one MatmulStream (or unary calls). Every step records its
end-to-end time and the sums over its calls of the kernel time, the worker's handler, device and
queue times (from the replies' timing; a multi-weight call's queue is its parts' longest, as
they wait together), the transport (RPC minus handler) and the client's encode/decode.

Runs in spawned processes (service_load.spawn_hosts): everything here imports by name.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import reply_stamps  # a stream reply stamped by the worker run with bench/trips_site
from service_load import (
    MATMUL,
    MATMUL_STREAM,
    echo_p50,
    echo_sequence,
    nan_if_none,
    reply_arrays,
    request_bytes,
    spawn_hosts,
    start_now,
)

from q6serve.client import core

# (role, rows, K) of one layer of a 7B-class model (Qwen2-7B shapes), and the lm-head
LAYER: tuple[tuple[str, int, int], ...] = (
    ("q", 3584, 3584), ("k", 512, 3584), ("v", 512, 3584), ("o", 3584, 3584),
    ("gate", 18944, 3584), ("up", 18944, 3584), ("down", 3584, 18944))
LM_HEAD = ("lm_head", 152064, 3584)
LAYERS = 28
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # multi-weight calls of a layer
# A layer whose MLP is one call (step_plan's ``mlp``, the echo floors only: no worker serves it
# yet): x -> down(silu(gate x) * up x), gate+up -> down being the one boundary of a layer with
# no host state between (attention, residual and norm sit at the others); its reply is down's y
MLP_GROUPS = (("q", "k", "v"), ("o",), ("gate", "up", "down"))
# Untimed steps a host runs at least before its timed ones: a weight's first calls at a new N
# run before its launch plan, inline-cost estimate and CUDA graph are made (a graph from its
# 2nd call), and every weight is called once a step. With 2 (up to session 16) bundle A of
# session 17 had its first S=8 run at 128.65 ms a step (p99 242) against 102.2 for the same run
# later in the call (p99 108).
WARM_STEPS = 4
STEP_FIELDS = ("e2e", "kernel", "device", "queue", "handler", "transport", "client",
               "kernel_missing", "up", "down", "stamped", "bench", "ccpu")
# per call, by its role in the step (``Call.role``): what the step's sums are made of
# "ccpu": the caller process's CPU seconds (every thread: its loop, gRPC's poller) from the
# encoding to the decoded reply, the previous call's bookkeeping left out: the caller's own
# share of the call, beside the worker's handler; wall minus it is the caller waiting
# "enc": the client's part before the call (x's request encoded), the rest of "client" its
# decoding of the reply
CALL_FIELDS = ("rpc", "transport", "up", "down", "handler", "device", "kernel", "client",
               "enc", "req_bytes", "reply_bytes", "ccpu")


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

    @property
    def role(self) -> str:
        """The call's place in a layer ("q+k+v", "o", "gate+up", "down", "lm_head"): calls
        of one role have the same sizes, so their figures are compared as a group."""
        return "+".join(w.rsplit(".", 1)[-1] for w in self.weights)

    def reply_bytes(self, n: int, out_itemsize: int = 4) -> int:
        """Payload of the reply (y, or top-k values + indices + lse), for the floor."""
        if self.topk:
            return n * (8 * self.topk + 4)
        return out_itemsize * n * self.out_cols


def step_plan(layers: int, rows: dict[str, int], multi: bool, topk: int,
              mlp: bool = False) -> list[Call]:
    """The calls of one decode step, in order. ``mlp`` (with ``multi``): each layer's MLP as
    one call (MLP_GROUPS; its role "gate+up+down", its reply down's y)."""
    ks = {role: k for role, _, k in LAYER}
    plan: list[Call] = []
    for i in range(layers):
        for group in (MLP_GROUPS if mlp and multi else GROUPS):
            parts = [group] if multi else [(r,) for r in group]
            for g in parts:
                names = tuple(layer_name(i, r) for r in g)
                cols = rows[names[-1]] if g[-1] == "down" else sum(rows[n] for n in names)
                plan.append(Call(names, ks[g[0]], 0, cols))
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
    dtype: str  # f16 | f32 (activations)
    precision: int  # pb Precision value
    out: str = "f16"  # y's dtype (f16 | f32)
    # > 0: the host's event loop busy-polls this long (us) before it sleeps, as the worker's
    # does (service/threads.busy_poll): a reply that comes within the spin is seen by a thread
    # that is running instead of one woken from sleep; 0: it sleeps (a plain asyncio caller).
    # A sync session's (transport session / tsession / isession): its own loop's,
    # Client.session(spin_us); 0 there: the product's default spin for session, none else
    spin_us: float = 0.0
    # how the host reads a reply: "arrays" (upb parses it, then y / the top-k as arrays: the
    # replay up to session 19) or "client" (the q6serve client's own stream decoding,
    # core.stream_outcome: what Client.matmul_stream yields, timing included, large replies'
    # arrays as views of the reply's bytes, client/reply_bytes.py)
    decode: str = "arrays"
    # > 0: client/reply_bytes.VIEW_MIN in the host process (replies from this many bytes read
    # as views; a huge value: never), 0: the client's default
    view_min: int = 0
    # the host's gRPC: "aio" (grpc.aio on its event loop: up to session 20) or "sync" (the
    # sync stub's C-core calls from the host's thread; bench/svc_util_transport.py)
    transport: str = "aio"
    # more channel arguments of the host's channel, after the client's (channel_options)
    channel_args: tuple[tuple[str, int], ...] = ()
    # > 1: the host's S sequences as this many independent chains of n / chains rows, each on
    # a stream (or unary calls) of its own on the host's channel, run concurrently; a step
    # ends when every chain has made all its calls (a decode host may do this: its sequences
    # do not wait for each other). The step's sums add the chains' calls up.
    chains: int = 1
    # the host processes' GRPC_EXPERIMENTS (client/grpc_env.EVENT_ENGINE_OFF: gRPC's
    # EventEngine off as the worker runs it; "": gRPC's defaults); None: as the bench's own
    # environment has it (a caller on gRPC's defaults unless set)
    grpc_experiments: str | None = None
    # a stream's read of each reply posted before its request's write has completed (the
    # write started at once, service_load.start_now, and waited for after the read), not
    # after it: the write's completion coming back through gRPC's poller is then off the
    # round trip's path, as the worker's reads ahead of its writes
    ahead: bool = False


def _timings(r: Any) -> tuple[Any, tuple[Any, ...]]:
    """The reply as the client's MatmulOutput and its per-weight outputs (itself for one
    weight), read after the timed decode (a MatmulOutput already: as it is)."""
    o = r if isinstance(r, core.MatmulOutput) else core.output_of(r)
    return o, o.outputs or (o,)


def stream_request_id(raw: bytes) -> str:
    """A MatmulStreamResponse's request_id (its last field 1: a stamped reply's is appended)
    from its top-level fields alone, for a reply the client decoded (its MatmulOutput has the
    result's request_id, not the stream reply's)."""
    from q6serve.service.rawmsg import fields

    buf = memoryview(raw)
    ids = [buf[v0:v1] for num, wt, _, v0, v1 in fields(buf, 0, len(raw)) if num == 1 and wt == 2]
    return bytes(ids[-1]).decode(errors="replace") if ids else ""


async def _host(spec: ReplaySpec, barrier: Any) -> dict[str, list[float]]:
    import asyncio

    from svc_util_transport import SESSIONS, SYNC_SESSIONS, Channel

    from q6serve.client.channel import channel_options
    from q6serve.v1 import q6serve_pb2 as pb

    if spec.view_min:
        from q6serve.client import reply_bytes

        reply_bytes.VIEW_MIN = spec.view_min
    rng = np.random.default_rng(0)
    cpu = time.process_time  # the whole process's CPU (~1 us a read: two a call in the step)
    client = spec.decode == "client"
    dt = np.float16 if spec.dtype == "f16" else np.float32
    xs = {k: rng.standard_normal((spec.n, k)).astype(dt) for k in {c.k for c in spec.plan}}
    if spec.chains < 1 or spec.n % spec.chains:
        raise ValueError(f"chains {spec.chains}: a divisor of the host's S = {spec.n}")
    if spec.chains > 1 and spec.transport in SESSIONS:
        raise ValueError(f"chains {spec.chains}: {spec.transport} is one session (one stream)")
    rows_per_chain = spec.n // spec.chains
    # a sync session's calls run its own loop, not the host's: the spin is that loop's
    own_loop = spec.transport in SYNC_SESSIONS
    if spec.spin_us > 0 and not own_loop:
        from q6serve.service.threads import busy_poll

        busy_poll(asyncio.get_running_loop(), lambda: True, spec.spin_us)
    calls: dict[str, dict[str, list[float]]] = {}
    async with Channel(spec.transport, spec.target,
                       [*channel_options(), *spec.channel_args],
                       spec.spin_us if own_loop else 0.0) as ch:
        unary = ch.unary(MATMUL) if spec.mode == "unary" else None
        streams = ([ch.stream(MATMUL_STREAM) for _ in range(spec.chains)]
                   if spec.mode == "stream" else None)

        def account(sums: dict[str, float], rec: dict[str, list[float]] | None,
                    call: Call, t: tuple[float, float, float, float], req_bytes: int,
                    raw_bytes: int, msg: Any, reply: Any, ccpu: float) -> None:
            """One call's figures into the step's sums (and, timed, the per-role lists):
            run while the next call is in flight (or after the step's clock stopped), so
            the bench's own bookkeeping is not a host's time in the step."""
            t0, t1, t2, t3 = t
            r, timings = _timings(reply)
            handler = nan_if_none(r.handler_seconds)
            one = {"rpc": t2 - t1, "transport": (t2 - t1) - handler, "handler": handler,
                   "client": (t1 - t0) + (t3 - t2), "enc": t1 - t0, "kernel": 0.0,
                   "device": 0.0,
                   "up": float("nan"), "down": float("nan"),
                   "req_bytes": float(req_bytes), "reply_bytes": float(raw_bytes),
                   "ccpu": ccpu}
            rid = (stream_request_id(msg) if isinstance(msg, bytes)
                   else msg.request_id if msg is not None else "")
            if (st := reply_stamps.parse(rid)) is not None:
                # the worker's absolute times (bench/reply_stamps.py, one clock for the
                # host's processes): write -> taken there, encoded there -> read here
                one["up"], one["down"] = st[0] - t1, t2 - st[1]
                sums["up"] += one["up"]
                sums["down"] += one["down"]
                sums["stamped"] += 1
            sums["handler"] += handler
            sums["transport"] += one["transport"]
            sums["client"] += one["client"]
            sums["ccpu"] += ccpu
            sums["calls"] += t3 - t0
            for tm in timings:
                kern = nan_if_none(tm.kernel_seconds)
                if np.isnan(kern):
                    sums["kernel_missing"] += 1
                else:
                    sums["kernel"] += kern
                    one["kernel"] += kern
                sums["device"] += nan_if_none(tm.device_seconds)
                one["device"] += nan_if_none(tm.device_seconds)
            sums["queue"] += max(tm.queue_seconds for tm in timings)
            if rec is not None:
                got = calls.setdefault(call.role, {f: [] for f in CALL_FIELDS})
                for f in CALL_FIELDS:
                    got[f].append(one[f])

        async def chain(c: int, out: list[tuple[Any, ...]]) -> None:
            """One chain's calls of a step, in order; each call's figures into ``out``."""
            x_of = xs if spec.chains == 1 else {
                k: x[c * rows_per_chain:(c + 1) * rows_per_chain] for k, x in xs.items()}
            for call in spec.plan:
                c0 = cpu()
                t0 = time.perf_counter()
                req = request_bytes(pb, call.weights, x_of[call.k], spec.precision,
                                    "f32" if call.topk else spec.out, call.topk)
                t1 = time.perf_counter()
                if streams is None:
                    raw = await unary(req, timeout=120.0)
                elif spec.ahead:
                    writing = start_now(streams[c].write(req))
                    raw = await streams[c].read()
                    await writing
                else:
                    await streams[c].write(req)
                    raw = await streams[c].read()
                t2 = time.perf_counter()
                if client:  # the client's own decoding; the stamps read from raw later
                    if streams is None:
                        msg, reply = None, core.parse_response(raw)
                    else:
                        msg, reply = raw, core.stream_outcome(raw, {})
                        if isinstance(reply, Exception):
                            raise reply
                elif streams is None:
                    msg, reply = None, pb.MatmulResponse.FromString(raw)
                else:
                    msg = pb.MatmulStreamResponse.FromString(raw)
                    if msg.WhichOneof("outcome") != "result":
                        raise RuntimeError(f"stream error: {msg.error.code} "
                                           f"{msg.error.message}")
                    reply = msg.result
                if not client:
                    reply_arrays(reply)
                t3 = time.perf_counter()
                out.append((call, (t0, t1, t2, t3), len(req), len(raw), msg, reply,
                            cpu() - c0))

        async def step(rec: dict[str, list[float]] | None) -> None:
            sums = dict.fromkeys((*STEP_FIELDS, "calls"), 0.0)
            # every call's figures are accounted after the step's clock stops: a session
            # (client/session.py) writes and reads in one exchange, so nothing of the host's
            # could run while its call is in flight; all transports are timed alike (up to
            # session 21 a stream's previous call was accounted between its write and read)
            done: list[list[tuple[Any, ...]]] = [[] for _ in range(spec.chains)]
            t_step = time.perf_counter()
            if spec.chains == 1:
                await chain(0, done[0])
            else:
                await asyncio.gather(*(chain(c, done[c]) for c in range(spec.chains)))
            sums["e2e"] = time.perf_counter() - t_step
            for got in done:
                for one in got:
                    account(sums, rec, *one)
            # what the step spent outside its calls (encode to decode): the bench's loop
            # (with chains > 1 the calls overlap: negative)
            sums["bench"] = sums["e2e"] - sums.pop("calls")
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
        for stream in streams or ():
            await stream.done_writing()
        rec["_calls"] = calls  # type: ignore[assignment]
        # what this process's gRPC was set up with (read when it imported gRPC)
        rec["_grpc_experiments"] = os.environ.get("GRPC_EXPERIMENTS")  # type: ignore[assignment]
        return rec


def run_replay(spec: ReplaySpec, hosts: int, info: dict[str, Any] | None = None,
               ) -> tuple[dict[str, np.ndarray], float, dict[str, dict[str, float]]]:
    """``hosts`` host processes stepping the model; per-step figures merged, wall seconds,
    and per call role the p50 seconds of each CALL_FIELDS figure (and its call count).
    ``info`` gets "grpc_experiments": each host's GRPC_EXPERIMENTS (None: unset)."""
    merged: dict[str, list[float]] = {f: [] for f in STEP_FIELDS}
    by_role: dict[str, dict[str, list[float]]] = {}
    wall = 0.0
    for rec in spawn_hosts(_host, spec, hosts, spec.warmup + spec.seconds + 900,
                           spec.grpc_experiments):
        exp = rec.pop("_grpc_experiments", None)
        if info is not None:
            info.setdefault("grpc_experiments", []).append(exp)
        wall = max(wall, rec.pop("_wall")[0])
        for role, cols in rec.pop("_calls").items():
            dst = by_role.setdefault(role, {f: [] for f in CALL_FIELDS})
            for f in CALL_FIELDS:
                dst[f].extend(cols[f])
        for f in STEP_FIELDS:
            merged[f].extend(rec[f])
    roles = {role: {**{f: _p50(v) for f, v in cols.items()}, "calls": float(len(cols["rpc"]))}
             for role, cols in by_role.items()}
    return {f: np.asarray(v, np.float64) for f, v in merged.items()}, wall, roles


def _p50(v: list[float]) -> float:
    a = np.asarray(v, np.float64)
    a = a[~np.isnan(a)]
    return float(np.median(a)) if a.size else float("nan")


# -- the floor: bare gRPC round trips of the step's call sizes -------------------------------
def step_floors(plans: list[list[Call]], n: int, itemsize: int, mode: str,
                out_itemsize: int = 4, seconds: float = 0.3, spin: bool = False,
                client_spin_us: float = 0.0,
                per_size: dict[tuple[int, int], float] | None = None,
                transport: str = "aio") -> list[float]:
    """Per plan, the sum over a step's calls of a bare gRPC round trip of the same request and
    reply sizes (server and caller in their own processes, as in the replay;
    service_load.echo_p50), every distinct size of all the plans measured in one echo run;
    ``spin``: the echo's loop busy-polls as the worker's does; ``client_spin_us``: the
    caller's loop busy-polls, as a host run with ReplaySpec.spin_us; ``per_size``: gets each
    (request bytes, reply bytes)'s p50 seconds; ``transport``: the caller's gRPC, as the
    replay host's (ReplaySpec.transport: a like-for-like floor)."""
    def sizes(c: Call) -> tuple[int, int]:
        return floor_sizes(c, n, itemsize, out_itemsize)

    distinct = sorted({sizes(c) for plan in plans for c in plan})
    p50 = echo_p50(distinct, [mode], seconds, spin=spin, client_spin_us=client_spin_us,
                   transport=transport)[mode]
    table = dict(zip(distinct, p50, strict=True))
    if per_size is not None:
        per_size.update(table)
    return [float(sum(table[sizes(c)] for c in plan)) for plan in plans]


def floor_sizes(c: Call, n: int, itemsize: int, out_itemsize: int) -> tuple[int, int]:
    """(request bytes, reply bytes) the floor's echo sends for call ``c``: x's bytes and the
    weight names' fields; y's (or the top-k's) bytes and ~64 bytes of timing per weight. The
    replay records the real sizes per role beside them (ReplaySpec's host: req_bytes,
    reply_bytes)."""
    names = sum(len(w) + 2 for w in c.weights)
    return (n * c.k * itemsize + 24 + names,
            c.reply_bytes(n, out_itemsize) + 64 * len(c.weights))


def held_echo(plans: list[tuple[list[Call], int, dict[str, float]]], itemsize: int,
              out_itemsize: int, mode: str, seconds: float, client_spin_us: float = 0.0,
              transport: str = "aio") -> list[dict[str, Any]]:
    """Per (plan, n, hold us per role): the step's calls in order against a busy-polling echo
    (service_load.echo_sequence), answered at once ("bare") and each held its role's hold
    ("held": the worker's window, busy-waited on the echo's loop), alternated bare, held, held,
    bare (a drift weighs on both alike). Per kind: the mean step (ms) of its two runs and per
    role the p50 round trip (us); "held" also the round trip less its hold (transport_us)."""
    return ladder_echo([(plan, n, {"held": hold}) for plan, n, hold in plans], itemsize,
                       out_itemsize, mode, seconds, client_spin_us, transport)


CLIENT_HELD = "@client"  # a held kind so named is held by the caller (before each write)


def ladder_echo(plans: list[tuple[list[Call], int, dict[str, dict[str, float]]]], itemsize: int,
                out_itemsize: int, mode: str, seconds: float, client_spin_us: float = 0.0,
                transport: str = "aio", ahead: bool = False) -> list[dict[str, Any]]:
    """As :func:`held_echo`, with several held kinds per plan (name -> hold us per role, e.g.
    each role held for the worker's kernel, its device job, its whole handler): run bare, each
    kind in turn, the kinds again in reverse, bare. Per plan {"bare": ..., kind: ...}. A kind
    whose name ends in CLIENT_HELD is held by the caller before each write, not by the echo
    (its round trips exclude the hold: its transport_us is the round trip)."""
    out_order: list[list[str]] = []
    seqs = []
    for plan, n, holds in plans:
        names = list(holds)
        order = ["bare", *names, *reversed(names), "bare"]
        out_order.append(order)
        for kind in order:
            hold = holds.get(kind, {})
            sign = -1 if kind.endswith(CLIENT_HELD) else 1  # held by the caller
            seqs.append([(*floor_sizes(c, n, itemsize, out_itemsize),
                          sign * int(hold.get(c.role, 0) * 1e3)) for c in plan])
    results = iter(echo_sequence(seqs, mode, seconds, client_spin_us=client_spin_us,
                                 transport=transport, ahead=ahead))
    out = []
    for (plan, _, holds), order in zip(plans, out_order, strict=True):
        runs: dict[str, list[dict[str, Any]]] = {}
        for kind in order:
            runs.setdefault(kind, []).append(next(results))
        res: dict[str, Any] = {}
        for kind, got in runs.items():  # the mean of its two runs, per call position
            per: dict[str, list[float]] = {}
            for i, c in enumerate(plan):
                per.setdefault(c.role, []).append(float(np.mean([g["each"][i] for g in got])))
            res[kind] = {"step_ms": float(np.mean([g["pass"] for g in got])) * 1e3,
                         "runs_step_ms": [g["pass"] * 1e3 for g in got],
                         "passes": sum(g["passes"] for g in got),
                         "rt_us": {role: float(np.median(v)) * 1e6 for role, v in per.items()}}
        for kind, hold in holds.items():
            mine = 0 if kind.endswith(CLIENT_HELD) else 1  # (a caller's hold is not timed)
            res[kind]["transport_us"] = {role: rt - mine * int(hold.get(role, 0) * 1e3) * 1e-3
                                         for role, rt in res[kind]["rt_us"].items()}
        out.append(res)
    return out
