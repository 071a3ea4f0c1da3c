"""A weight row-sharded across several workers, used like one worker.

    from q6serve.client.sharded import ShardedClient
    with ShardedClient(["10.0.0.5:50051", "10.0.0.6:50051"]) as c:
        c.load("model.gguf", ["output.weight"])      # shard i loads its even share of the rows
        y = c.matmul("output.weight", x)              # fans out, concatenates along rows

Shard ``i`` is ``targets[i]``. Every call fans out to all shards at once (gRPC futures, no
threads) with a deadline, and the outputs concatenate in the shards' global row order, taken
from the ranges the workers report (GetWeight), so a wrong target order cannot scramble y.
A failing shard fails the call with its own status code and a message naming the shard; the
other shards' calls are cancelled. Nothing waits without a deadline.

Replicas: a target may be a DNS name resolving to several replicas of one shard (a Kubernetes
headless Service, e.g. ``dns:///q6serve-shard-0.q6serve.svc:50051``); each shard's channel
uses gRPC's own ``round_robin`` policy over the resolved addresses. Loads through such a
channel reach ONE replica, so load each pod directly (docs/SCALEOUT.md).
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np

from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

from .client import (
    PLACEMENTS,
    MatmulOutput,
    Q6ServeError,
    Weight,
    decode_tensor,
    matmul_request,
)

MAX_MESSAGE_BYTES = 256 << 20
_PRECISION_NAME = {pb.PRECISION_AUTO: "auto", pb.PRECISION_EXACT: "exact",
                   pb.PRECISION_F16: "f16", pb.PRECISION_Q8_1: "q8_1"}
_LAYOUT_NAME = {pb.LAYOUT_SOA: "soa", pb.LAYOUT_AOS: "aos", pb.LAYOUT_UNSPECIFIED: ""}


def round_robin_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel options: large messages, and gRPC's round_robin over every resolved address
    (with the default pick_first, a DNS name with several replicas would use only one)."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.lb_policy_name", "round_robin"),
            # re-resolve soon after a replica goes away or a new one appears
            ("grpc.dns_min_time_between_resolutions_ms", 5_000)]


def replica_channel(target: str, *, credentials: grpc.ChannelCredentials | None = None,
                    max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel spreading calls over the replicas behind ``target`` (``dns:///name:port``).
    Also usable for an unsharded replicated set: ``Client(target, channel=replica_channel(t))``."""
    opts = round_robin_options(max_message_bytes)
    if credentials is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, credentials, options=opts)


@dataclass(frozen=True)
class ShardRows:
    """Where one shard's rows of a weight go in the whole: global rows [begin, end)."""

    shard: int
    begin: int
    end: int
    tensor_rows: int


class ShardedClient:
    """The :class:`~q6serve.client.client.Client` API over a row-sharded set of workers."""

    def __init__(self, targets: Sequence[str] | str, *, token: str | None = None,
                 timeout: float = 60.0, credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        if isinstance(targets, str):
            targets = [t for t in targets.split(",") if t]
        if not targets:
            raise ValueError("ShardedClient needs at least one target")
        if timeout is None or timeout <= 0:
            raise ValueError("every fan-out call needs a deadline: timeout must be > 0")
        self.targets = list(targets)
        self.timeout = timeout
        self._channels = [replica_channel(t, credentials=credentials,
                                          max_message_bytes=max_message_bytes)
                          for t in self.targets]
        self._stubs = [pb_grpc.Q6ServeStub(ch) for ch in self._channels]
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._plans: dict[str, list[ShardRows]] = {}

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def shards(self) -> int:
        return len(self.targets)

    def _name(self, i: int) -> str:
        return f"shard {i} of {self.shards} ({self.targets[i]})"

    # -- fan-out ----------------------------------------------------------------------------
    def _fan_out(self, method: str, requests: Sequence[object], timeout: float | None = None,
                 stubs: Sequence[Any] | None = None) -> list[Any]:
        """Call ``method`` on every shard at once (request i to shard i); all replies in shard
        order, or the first failure (naming its shard) after cancelling the rest."""
        deadline = timeout if timeout is not None else self.timeout
        done: queue.Queue[int] = queue.Queue()
        futures = []
        for i, (stub, req) in enumerate(zip(stubs or self._stubs, requests, strict=True)):
            f = getattr(stub, method).future(req, timeout=deadline, metadata=self._metadata)
            f.add_done_callback(lambda _f, i=i: done.put(i))
            futures.append(f)
        try:
            for _ in futures:
                # each future ends by its own deadline; the margin only guards against a lost
                # callback, so this never hangs
                i = done.get(timeout=deadline + 5.0)
                err = futures[i].exception()
                if err is not None:
                    raise self._error(i, err)
        except queue.Empty:
            raise Q6ServeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no answer from every shard within {deadline} s") from None
        finally:
            for f in futures:
                f.cancel()  # no-op for finished calls
        return [f.result() for f in futures]

    def _error(self, i: int, err: BaseException) -> Q6ServeError:
        if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
            code, details = err.code(), err.details() or ""
        else:
            code, details = grpc.StatusCode.UNKNOWN, repr(err)
        return Q6ServeError(code, f"{self._name(i)}: {details}")

    # -- weights ----------------------------------------------------------------------------
    def load(self, gguf_path: str, tensors: Iterable[str] = (), prefix: str = "",
             timeout: float | None = None, *,
             ranges: Sequence[tuple[int, int]] | None = None,
             placement: str | None = None) -> list[Weight]:
        """Each shard loads its row range of each tensor of ``gguf_path`` (a path under every
        worker's --model-dir): the even split by default, else ``ranges[i]`` for shard i.
        Returns the merged weights (whole-tensor shapes)."""
        base = dict(gguf_path=gguf_path, tensors=list(tensors), prefix=prefix,
                    placement=PLACEMENTS[placement])
        if ranges is not None:
            if len(ranges) != self.shards:
                raise ValueError(f"{len(ranges)} row ranges for {self.shards} shards")
            reqs = [pb.LoadWeightsRequest(**base, row_range=pb.RowRange(begin=b, end=e))
                    for b, e in ranges]
        else:
            reqs = [pb.LoadWeightsRequest(**base, shard=pb.ShardSpec(index=i, count=self.shards))
                    for i in range(self.shards)]
        replies = self._fan_out("LoadWeights", reqs, timeout)
        per_shard = [[Weight.from_pb(w) for w in r.weights] for r in replies]
        for ws in per_shard:
            for w in ws:
                self._plans.pop(w.name, None)
        return [self._merge(name, parts) for name, parts in _by_name(per_shard).items()]

    def list(self) -> list[Weight]:
        """Weights whose shards tile the whole tensor (see :meth:`list_shards` for the rest)."""
        merged = []
        for name, parts in _by_name(self.list_shards()).items():
            try:
                merged.append(self._merge(name, parts))
            except Q6ServeError:
                continue
        return merged

    def list_shards(self) -> list[list[Weight]]:
        """Every shard's own ListWeights (shard order)."""
        replies = self._fan_out("ListWeights", [pb.ListWeightsRequest()] * self.shards)
        return [[Weight.from_pb(w) for w in r.weights] for r in replies]

    def get(self, name: str) -> Weight:
        replies = self._fan_out("GetWeight", [pb.GetWeightRequest(name=name)] * self.shards)
        parts = {i: Weight.from_pb(r.weight) for i, r in enumerate(replies)}
        return self._merge(name, parts)

    def unload(self, name: str, timeout: float | None = None) -> Weight:
        self._plans.pop(name, None)
        replies = self._fan_out("UnloadWeight", [pb.UnloadWeightRequest(name=name)] * self.shards,
                                timeout)
        return self._merge(name, {i: Weight.from_pb(r.weight) for i, r in enumerate(replies)})

    def _merge(self, name: str, parts: dict[int, Weight]) -> Weight:
        """One whole-tensor Weight from the shards' parts; remembers the row order."""
        plan = self._plan(name, parts)
        ws = [parts[p.shard] for p in plan]
        first = ws[0]
        return replace(first, rows=first.tensor_rows, nbytes=sum(w.nbytes for w in ws),
                       sha256="",  # per-shard digests: see list_shards()
                       source=first.source, in_flight=sum(w.in_flight for w in ws),
                       row_begin=0, row_end=first.tensor_rows)

    def _plan(self, name: str, parts: dict[int, Weight]) -> list[ShardRows]:
        missing = [self._name(i) for i in range(self.shards) if i not in parts]
        if missing:
            raise Q6ServeError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"weight {name!r} is missing on {', '.join(missing)}")
        rows = sorted((ShardRows(i, w.row_begin, w.row_end, w.tensor_rows)
                       for i, w in parts.items()), key=lambda r: r.begin)
        total, k = rows[0].tensor_rows, parts[0].k
        at = 0
        for r in rows:
            if r.begin != at or r.tensor_rows != total or parts[r.shard].k != k:
                raise Q6ServeError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"weight {name!r}: the shards' row ranges do not tile one tensor: " +
                    ", ".join(f"{self._name(x.shard)} holds [{x.begin}, {x.end}) of "
                              f"{x.tensor_rows} (K={parts[x.shard].k})" for x in rows))
            at = r.end
        if at != total:
            raise Q6ServeError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"weight {name!r}: the shards cover rows [0, {at}) of {total}")
        self._plans[name] = rows
        return rows

    def _plan_for(self, name: str, timeout: float | None) -> list[ShardRows]:
        if name not in self._plans:
            replies = self._fan_out("GetWeight", [pb.GetWeightRequest(name=name)] * self.shards,
                                    timeout)
            self._plan(name, {i: Weight.from_pb(r.weight) for i, r in enumerate(replies)})
        return self._plans[name]

    # -- matmul -----------------------------------------------------------------------------
    def matmul_full(self, weight: str, x: np.ndarray, *, precision: str = "auto",
                    out_dtype: str = "f32", timeout: float | None = None) -> MatmulOutput:
        """``y = x · Wᵀ`` over all shards; the timing fields are the slowest shard's."""
        plan = self._plan_for(weight, timeout)
        req = matmul_request(weight, x, precision, out_dtype)
        try:
            replies = self._fan_out("Matmul", [req] * self.shards, timeout)
        except Q6ServeError:
            self._plans.pop(weight, None)  # a shard may have restarted: re-read the ranges
            raise
        parts = []
        for p in plan:
            y = decode_tensor(replies[p.shard].y)
            if y.shape[1] != p.end - p.begin:
                self._plans.pop(weight, None)
                raise Q6ServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{self._name(p.shard)} returned {y.shape[1]} rows of "
                                   f"{weight!r}, expected {p.end - p.begin}: reloaded?")
            parts.append(y)
        return _merged_output(np.concatenate(parts, axis=1), replies)

    def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
               out_dtype: str = "f32", timeout: float | None = None) -> np.ndarray:
        return self.matmul_full(weight, x, precision=precision, out_dtype=out_dtype,
                                timeout=timeout).y

    # -- workers ----------------------------------------------------------------------------
    def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when every shard reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        serving = health_pb2.HealthCheckResponse.SERVING
        stubs = [health_pb2_grpc.HealthStub(ch) for ch in self._channels]
        req = health_pb2.HealthCheckRequest(service=service)
        replies = self._fan_out("Check", [req] * self.shards, timeout, stubs)
        return all(r.status == serving for r in replies)

    def status(self) -> list[pb.GetStatusResponse]:
        """Every shard's GetStatus (shard order)."""
        return self._fan_out("GetStatus", [pb.GetStatusRequest()] * self.shards)


def _by_name(per_shard: Iterable[Iterable[Weight]]) -> dict[str, dict[int, Weight]]:
    out: dict[str, dict[int, Weight]] = {}
    for i, ws in enumerate(per_shard):
        for w in ws:
            out.setdefault(w.name, {})[i] = w
    return out


def _merged_output(y: np.ndarray, replies: list[pb.MatmulResponse]) -> MatmulOutput:
    first = replies[0]
    kernel_s = [r.timing.kernel_seconds for r in replies if r.timing.HasField("kernel_seconds")]
    return MatmulOutput(y, first.kernel, _LAYOUT_NAME[first.layout],
                        _PRECISION_NAME[first.precision],
                        max(r.timing.queue_seconds for r in replies),
                        max(kernel_s) if len(kernel_s) == len(replies) else None,
                        min(r.timing.batch_rows for r in replies),
                        min(r.timing.batch_requests for r in replies))
