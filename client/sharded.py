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
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import numpy as np

from q6serve.kernels.epilogue import check_k, merge_topk
from q6serve.kernels.errors import InvalidArgument
from q6serve.v1 import q6serve_pb2 as pb

from . import core
from .channel import MAX_MESSAGE_BYTES, channel_options, make_channel
from .core import Call, MatmulOutput, Q6ServeError, TopK, Weight, Weights
from .retry import RetryPolicy, pause_or_raise

T = TypeVar("T")
STREAM_WINDOW = 16  # matmul_stream: requests in flight at once


def round_robin_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel options: large messages, and gRPC's round_robin over every resolved address
    (with the default pick_first, a DNS name with several replicas would use only one)."""
    return channel_options(max_message_bytes, round_robin=True)


def replica_channel(target: str, *, credentials: grpc.ChannelCredentials | None = None,
                    max_message_bytes: int = MAX_MESSAGE_BYTES, **tls: Any) -> grpc.Channel:
    """A channel spreading calls over the replicas behind ``target`` (``dns:///name:port``).
    Also usable for an unsharded replicated set: ``Client(target, channel=replica_channel(t))``."""
    return make_channel(target, credentials=credentials, max_message_bytes=max_message_bytes,
                        round_robin=True, **tls)  # type: ignore[return-value]


@dataclass(frozen=True)
class ShardRows:
    """Where one shard's rows of a weight go in the whole: global rows [begin, end)."""

    shard: int
    begin: int
    end: int
    tensor_rows: int


class ShardedClient(core.Transport):
    """The :class:`~q6serve.client.client.Client` API over a row-sharded set of workers.

    Same arguments as :class:`Client` (``token``, ``timeout``, ``retry``, TLS keywords,
    ``max_message_bytes``); each shard's call is retried on UNAVAILABLE by the same policy,
    inside the call's deadline. ``load`` takes ``ranges`` (one row range per shard) where
    ``Client.load`` takes ``rows``/``shard``; ``upload`` is not offered (an upload has no
    row range on the wire: upload each shard's rows with a Client)."""

    def __init__(self, targets: Sequence[str] | str, *, token: str | None = None,
                 timeout: float | None = 60.0, retry: RetryPolicy | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 **channel_kw: Any) -> None:
        if isinstance(targets, str):
            targets = [t for t in targets.split(",") if t]
        if not targets:
            raise ValueError("ShardedClient needs at least one target")
        if timeout is None or timeout <= 0:
            raise ValueError("every fan-out call needs a deadline: timeout must be > 0")
        super().__init__(token=token, timeout=timeout, retry=retry)
        self.targets = list(targets)
        self._channels = [make_channel(t, credentials=credentials, round_robin=True,
                                       **channel_kw) for t in self.targets]
        self._stubs = [core.stubs(ch) for ch in self._channels]
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
    def _each(self, call: Call[T]) -> list[Call[T]]:
        return [call] * self.shards

    def _fan_out(self, calls: Sequence[Call[T]], timeout: float | None = None) -> list[T]:
        """Make call i on shard i, all at once; every result in shard order, or the first
        failure (naming its shard) after cancelling the rest. A shard failing with
        UNAVAILABLE is called again after the policy's backoff, inside the deadline (the
        other shards' replies are kept)."""
        budget = self._deadline(timeout)
        assert budget is not None  # __init__ refuses a client without a deadline
        deadline = time.monotonic() + budget
        done: queue.Queue[tuple[int, Any]] = queue.Queue()
        futures: list[Any] = [None] * len(calls)
        replies: list[Any] = [None] * len(calls)
        attempts = [0] * len(calls)
        again: dict[int, float] = {}  # shard -> when to call it again

        def start(i: int) -> None:
            left = max(deadline - time.monotonic(), 0.001)
            call = calls[i]
            f = getattr(self._stubs[i][call.service], call.method).future(
                call.fresh_request(), timeout=left, metadata=self._metadata)
            futures[i] = f
            f.add_done_callback(lambda f, i=i: done.put((i, f)))

        for i in range(len(calls)):
            start(i)
        waiting = len(calls)
        try:
            while waiting:
                now = time.monotonic()
                for i in [i for i, t in again.items() if t <= now]:
                    del again[i]
                    start(i)
                # each call ends by its own deadline; the margin only guards against a lost
                # callback, so this never hangs
                pause = deadline + 5.0 - now
                if again:
                    pause = min(pause, min(again.values()) - now)
                try:
                    i, f = done.get(timeout=max(pause, 0.0))
                except queue.Empty:
                    if again:
                        continue
                    raise Q6ServeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"no answer from every shard within {budget} s") from None
                if f is not futures[i]:
                    continue  # an earlier attempt's late callback
                err = f.exception()
                if err is None:
                    replies[i] = calls[i].decode(f.result())
                    waiting -= 1
                    continue
                try:
                    again[i] = time.monotonic() + pause_or_raise(
                        err, attempts[i], self._policy(calls[i]), deadline)
                except Exception:
                    raise self._error(i, err) from None
                attempts[i] += 1
        finally:
            for f in futures:
                f.cancel()  # no-op for finished calls
        return replies

    def _error(self, i: int, err: BaseException) -> Q6ServeError:
        return Q6ServeError.from_rpc(err, f"{self._name(i)}: ")  # type: ignore[arg-type]

    # -- weights ----------------------------------------------------------------------------
    def load(self, gguf_path: str, tensors: Iterable[str] = (), prefix: str = "",
             timeout: float | None = None, *,
             ranges: Sequence[tuple[int, int]] | None = None,
             placement: str | None = None) -> list[Weight]:
        """Each shard loads its row range of each tensor of ``gguf_path`` (a path under every
        worker's --model-dir): the even split by default, else ``ranges[i]`` for shard i.
        Returns the merged weights (whole-tensor shapes)."""
        if ranges is not None:
            if len(ranges) != self.shards:
                raise ValueError(f"{len(ranges)} row ranges for {self.shards} shards")
            calls = [core.load_call(gguf_path, tensors, prefix, rows=r, placement=placement)
                     for r in ranges]
        else:
            calls = [core.load_call(gguf_path, tensors, prefix, shard=(i, self.shards),
                                    placement=placement) for i in range(self.shards)]
        per_shard = self._fan_out(calls, timeout)
        for ws in per_shard:
            for w in ws:
                self._plans.pop(w.name, None)
        return [self._merge(name, parts) for name, parts in _by_name(per_shard).items()]

    def list(self, timeout: float | None = None) -> list[Weight]:
        """Weights whose shards tile the whole tensor (see :meth:`list_shards` for the rest)."""
        merged = []
        for name, parts in _by_name(self.list_shards(timeout)).items():
            try:
                merged.append(self._merge(name, parts))
            except Q6ServeError:
                continue
        return merged

    def list_shards(self, timeout: float | None = None) -> list[list[Weight]]:
        """Every shard's own ListWeights (shard order)."""
        return self._fan_out(self._each(core.list_call()), timeout)

    def get(self, name: str, timeout: float | None = None) -> Weight:
        parts = self._fan_out(self._each(core.get_call(name)), timeout)
        return self._merge(name, dict(enumerate(parts)))

    def unload(self, name: str, timeout: float | None = None) -> Weight:
        self._plans.pop(name, None)
        parts = self._fan_out(self._each(core.unload_call(name)), timeout)
        return self._merge(name, dict(enumerate(parts)))

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
            self.get(name, timeout)  # merging the shards' parts plans the weight
        return self._plans[name]

    # -- matmul -----------------------------------------------------------------------------
    def matmul_full(self, weight: Weights, x: np.ndarray, *, precision: str = "auto",
                    out_dtype: str = "f32", timeout: float | None = None,
                    topk: int | None = None) -> MatmulOutput:
        """``y = x · Wᵀ`` over all shards; the timing fields are the slowest shard's.
        ``weight`` a list: one multi-weight request per shard (``outputs``, as
        :meth:`Client.matmul_full`). ``topk=k``: each shard returns the top-k of its own rows
        (min(k, its rows)) and they merge into the top-k over global columns, lse combined."""
        names = [weight] if isinstance(weight, str) else list(weight)
        plans = {n: self._plan_for(n, timeout) for n in names}
        per_shard: list[int | None] = [topk] * self.shards
        if topk is not None:
            for n in names:
                total = plans[n][-1].end
                try:
                    check_k(topk, total, weight=n)
                except InvalidArgument as e:
                    raise Q6ServeError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            for i in range(self.shards):  # one k per request: each part needs min(k, rows)
                want = {min(topk, p.end - p.begin) for n in names for p in plans[n]
                        if p.shard == i}
                if len(want) > 1:  # shards of different heights: one weight at a time
                    outs = [self.matmul_full(n, x, precision=precision, timeout=timeout,
                                             topk=topk) for n in names]
                    return MatmulOutput(None, "", "", "", 0.0, None, 0, 0, outputs=tuple(
                        replace(o, weight=n) for n, o in zip(names, outs, strict=True)))
                per_shard[i] = want.pop()
        calls = [core.matmul_call(weight, x, precision, out_dtype, topk=k) for k in per_shard]
        try:
            outs = self._fan_out(calls, timeout)
        except Q6ServeError:
            for n in names:
                self._plans.pop(n, None)  # a shard may have restarted: re-read the ranges
            raise
        if isinstance(weight, str):
            return self._join(weight, plans[weight], outs, topk)
        outputs = tuple(replace(self._join(n, plans[n], [o.outputs[j] for o in outs], topk),
                                weight=n) for j, n in enumerate(names))
        return replace(merged_output(outs), outputs=outputs)

    def _join(self, weight: str, plan: list[ShardRows], outs: list[MatmulOutput],
              topk: int | None) -> MatmulOutput:
        """One weight's output from its shards' (shard order): y concatenated in global row
        order, or the top-k over global columns."""
        if topk is not None:
            top = merge_topk([core.topk_of(outs[p.shard]) for p in plan],
                             [p.begin for p in plan], topk)
            return replace(merged_output(outs), topk=top)
        parts = []
        for p in plan:
            y = core.y_of(outs[p.shard])
            if y.shape[1] != p.end - p.begin:
                self._plans.pop(weight, None)
                raise Q6ServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{self._name(p.shard)} returned {y.shape[1]} rows of "
                                   f"{weight!r}, expected {p.end - p.begin}: reloaded?")
            parts.append(y)
        return replace(merged_output(outs), y=np.concatenate(parts, axis=1))

    def matmul(self, weight: str, x: np.ndarray, *, precision: str = "auto",
               out_dtype: str = "f32", timeout: float | None = None) -> np.ndarray:
        """As :meth:`Client.matmul`, over all shards."""
        return core.y_of(self.matmul_full(core.one_weight(weight), x, precision=precision,
                                          out_dtype=out_dtype, timeout=timeout))

    def matmul_multi(self, weights: Sequence[str], x: np.ndarray, *,
                     precision: str = "auto", out_dtype: str = "f32",
                     timeout: float | None = None) -> list[np.ndarray]:
        """As :meth:`Client.matmul_multi`, over all shards."""
        return core.ys_of(self.matmul_full(core.weight_list(weights), x, precision=precision,
                                           out_dtype=out_dtype, timeout=timeout))

    def matmul_topk(self, weight: str, x: np.ndarray, k: int, *, precision: str = "auto",
                    timeout: float | None = None) -> TopK:
        """As :meth:`Client.matmul_topk`: indices are global columns of the whole tensor."""
        return core.topk_of(self.matmul_full(weight, x, precision=precision, timeout=timeout,
                                             topk=k))

    def matmul_stream(self, requests: Iterable[tuple[str, Weights, np.ndarray]], *,
                      precision: str = "auto", out_dtype: str = "f32",
                      timeout: float | None = None, topk: int | None = None,
                      ) -> Iterator[MatmulOutput | Q6ServeError]:
        """``(request_id, weight, x)`` in; per request a MatmulOutput or a Q6ServeError (with
        ``request_id`` set) out, in completion order, as :meth:`Client.matmul_stream`. Each
        request fans out as one :meth:`matmul_full` (retried like it), up to
        ``STREAM_WINDOW`` at once; ``timeout`` bounds the whole stream."""
        budget = self._deadline(timeout)
        assert budget is not None  # __init__ refuses a client without a deadline
        deadline = time.monotonic() + budget
        items = iter(requests)
        running: dict[Future[MatmulOutput], str] = {}

        def one(weight: Weights, x: np.ndarray) -> MatmulOutput:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Q6ServeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"the stream's {budget} s deadline passed")
            return self.matmul_full(weight, x, precision=precision, out_dtype=out_dtype,
                                    timeout=left, topk=topk)

        with ThreadPoolExecutor(STREAM_WINDOW, thread_name_prefix="q6serve-sharded") as pool:
            try:
                while True:
                    for rid, weight, x in items:
                        running[pool.submit(one, weight, x)] = rid
                        if len(running) >= STREAM_WINDOW:
                            break
                    if not running:
                        return
                    finished, _ = wait(running, timeout=max(deadline - time.monotonic(), 0)
                                       + 5.0, return_when=FIRST_COMPLETED)
                    if not finished:
                        raise Q6ServeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"the stream's {budget} s deadline passed")
                    for f in finished:
                        rid = running.pop(f)
                        try:
                            yield replace(f.result(), request_id=rid)
                        except Q6ServeError as e:
                            e.request_id = rid
                            yield e
            finally:
                for f in running:
                    f.cancel()

    # -- workers ----------------------------------------------------------------------------
    def health(self, service: str = "", timeout: float | None = 5.0) -> bool:
        """True when every shard reports SERVING (one attempt each: health is a probe)."""
        return all(self._fan_out(self._each(core.health_call(service)), timeout))

    def status(self, timeout: float | None = None) -> list[pb.GetStatusResponse]:
        """Every shard's GetStatus (shard order)."""
        return self._fan_out(self._each(core.status_call()), timeout)

    def status_dict(self, timeout: float | None = None) -> list[dict[str, object]]:
        """Every shard's GetStatus as JSON-ready types (shard order)."""
        return self._fan_out(self._each(core.status_call().then(core.status_to_dict)), timeout)

    def flags(self, changes: Mapping[str, bool] | None = None,
              timeout: float | None = None) -> dict[str, bool]:
        """Set ``changes`` (if any) on every shard and return the flags' state; a flag that
        differs between shards is a FAILED_PRECONDITION naming them."""
        states = self._fan_out(self._each(core.flags_call(changes)), timeout)
        for i, st in enumerate(states[1:], 1):
            if st != states[0]:
                raise Q6ServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"flags differ: {self._name(0)} has {states[0]}, "
                                   f"{self._name(i)} has {st}")
        return states[0]


def _by_name(per_shard: Iterable[Iterable[Weight]]) -> dict[str, dict[int, Weight]]:
    out: dict[str, dict[int, Weight]] = {}
    for i, ws in enumerate(per_shard):
        for w in ws:
            out.setdefault(w.name, {})[i] = w
    return out


def merged_output(outs: list[MatmulOutput]) -> MatmulOutput:
    """The shards' outputs of one call (or of one weight of it) as one, without y, topk or
    outputs (the caller joins those): the first shard's kernel, layout and precision, the
    slowest shard's times (None unless every shard sent that one), the smallest batch."""
    def slowest(name: str) -> float | None:
        v = [getattr(o, name) for o in outs]
        return None if any(t is None for t in v) else max(v)

    return replace(outs[0], y=None, topk=None, outputs=(),
                   queue_seconds=max(o.queue_seconds for o in outs),
                   kernel_seconds=slowest("kernel_seconds"),
                   decode_seconds=slowest("decode_seconds"),
                   device_seconds=slowest("device_seconds"),
                   handler_seconds=slowest("handler_seconds"),
                   batch_rows=min(o.batch_rows for o in outs),
                   batch_requests=min(o.batch_requests for o in outs))
