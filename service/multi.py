"""Multi-weight requests: one x applied to several weights of the same K (q/k/v, gate/up).

The request fans out to each weight's own batcher concurrently (so every part still batches
with other callers' requests for that weight) and gathers one reply per weight, in order.
All-or-nothing: every weight is checked (known, K equal to x's, k <= its rows) before any part
is queued, and if a part fails afterwards the others are cancelled (a queued part is dropped
before launch) and the request fails with that part's status, its message naming the weight.
Works on any engine with ``get(name)`` and ``start_matmul(call)`` (one device or several), on
the same no-task-per-request path as a single-weight call (futures and done callbacks). The
parts are queued inside ``engine.grouped()``: on each device they run in one device job, back
to back (service/batcher.py's ``Group``), not one job each. Where every part would run at once
as a lone inline job, :func:`run_weights_now` runs them in the caller's own loop trip instead
(the direct path, as ``Engine.run_now`` for a single-weight request).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from q6serve.kernels.epilogue import check_k
from q6serve.kernels.errors import FormatError, InvalidArgument, Q6Error

from .batcher import MatmulReply
from .engine import Engine
from .engine_types import MatmulCall, WeightView
from .registry import MAX_NAME_LEN

MAX_REQUEST_WEIGHTS = 16  # weights of one multi-weight request


class MatmulEngine(Protocol):
    def get(self, name: str) -> WeightView: ...

    def start_matmul(self, call: MatmulCall,
                     sink: Callable[[asyncio.Future[MatmulReply]], None] | None = None,
                     ) -> asyncio.Future[MatmulReply]: ...

    def grouped(self) -> contextlib.AbstractContextManager[None]: ...


def check_weights(weights: Sequence[str]) -> tuple[str, ...]:
    """1..MAX_REQUEST_WEIGHTS distinct non-empty names, else INVALID_ARGUMENT."""
    if not weights:
        raise InvalidArgument("MatmulRequest.weights is empty")
    if len(weights) > MAX_REQUEST_WEIGHTS:
        raise InvalidArgument(f"MatmulRequest.weights lists {len(weights)} weights; at most "
                              f"{MAX_REQUEST_WEIGHTS} per request")
    seen: set[str] = set()
    for i, name in enumerate(weights):
        if not name:
            raise InvalidArgument(f"MatmulRequest.weights[{i}] is empty")
        if name in seen:
            raise InvalidArgument(f"MatmulRequest.weights lists {name[:MAX_NAME_LEN]!r} twice")
        seen.add(name)
    return tuple(weights)


def _named(i: int, name: str, e: Q6Error) -> Q6Error:
    """``e`` (same class, so the same status) with the weight it is about in front."""
    out = type(e)(f"weights[{i}] {name[:MAX_NAME_LEN]!r}: {e}")
    out.__cause__ = e
    return out


def check_parts(engine: MatmulEngine, call: MatmulCall) -> tuple[str, ...]:
    """The weights of multi-weight ``call``, each checked (known, K equal to x's, k <= its
    rows) before any part is queued or run; a refusal raises, naming its weight."""
    names = check_weights(call.weights)
    k = int(call.x.shape[1]) if call.x.ndim == 2 else -1
    shape_of = getattr(engine, "shape_of", None)  # (rows, K) without a view, where offered
    for i, name in enumerate(names):
        try:
            if shape_of is not None:
                rows, wk = shape_of(name)
            else:
                w = engine.get(name)
                rows, wk = w.rows, w.k
            if wk != k:
                raise FormatError(f"activations have K={k}, the weight has K={wk}")
            if call.topk:
                check_k(call.topk, rows, weight=name)
        except Q6Error as e:
            raise _named(i, name, e) from None
    return names


def _part(call: MatmulCall, name: str) -> MatmulCall:
    return MatmulCall(name, call.x, call.precision, call.out_dtype, call.timeout, call.topk)


def run_weights_now(engine: Engine, call: MatmulCall, own: object = None,
                    ) -> list[tuple[str, MatmulReply]] | None:
    """The direct path of a multi-weight call (``Engine.run_now``'s, for every part): when
    each part would take it and all of them together are short enough to inline
    (``Engine.direct_batchers``), run the parts here, one after the other, and return
    (weight, reply) per weight, in order; else None (nothing was done: queue it with
    :func:`start_matmul_weights`). The same checks and errors as the queued path: a refusal
    raises before any part runs, a part that fails raises its error naming the weight."""
    names = check_parts(engine, call)
    key = engine.batch_key(call)
    parts = [_part(call, name) for name in names]
    batchers = engine.direct_batchers(parts, key, own)
    if batchers is None:
        return None
    if engine.multi_launch and len(parts) > 1:
        try:
            got = engine.run_direct_many(batchers, parts, key)
        except Q6Error as e:
            i = getattr(e, "part", 0)
            raise _named(i, parts[i].weight, e) from None
        if got is not None:
            return [(p.weight, r) for p, r in zip(parts, got, strict=True)]
    slots = engine.device.now_slots
    if engine.multi_pipeline and len(parts) > 1 and slots > 1:
        return _launch_parts(engine, parts, batchers, key, slots)
    out: list[tuple[str, MatmulReply]] = []
    for i, (part, b) in enumerate(zip(parts, batchers, strict=True)):
        try:
            out.append((part.weight, engine.run_direct(b, part, key)))
        except Q6Error as e:
            raise _named(i, part.weight, e) from None
    return out


def _launch_parts(engine: Engine, parts: list[MatmulCall], batchers: list[Any], key: Any,
                  slots: int) -> list[tuple[str, MatmulReply]]:
    """:func:`run_weights_now`'s parts launched behind each other (``Engine.launch_direct``;
    at most ``slots`` launched and not yet waited for), then waited for in order: the GPU
    runs part i + 1 while the host finishes part i's launch and the next, instead of the
    host waiting for each part's end before it launches the next. Every launch is waited
    for, also after a failure (the first one raises, naming its weight, after all are
    done; the parts' results are then dropped, as the queued path's are)."""
    out: list[Any] = [None] * len(parts)
    waits: collections.deque[tuple[int, Callable[[], MatmulReply]]] = collections.deque()
    err: BaseException | None = None

    def wait_oldest() -> None:
        nonlocal err
        i, finish = waits.popleft()
        try:
            out[i] = (parts[i].weight, finish())
        except Q6Error as e:
            err = err or _named(i, parts[i].weight, e)
        except BaseException as e:
            err = err or e

    for i, (part, b) in enumerate(zip(parts, batchers, strict=True)):
        if len(waits) >= slots:
            wait_oldest()
        if err is not None:
            break
        try:
            waits.append((i, engine.launch_direct(b, part, key)))
        except Q6Error as e:
            err = _named(i, part.weight, e)
        except BaseException as e:
            err = e
        if err is not None:
            break
    while waits:
        wait_oldest()
    if err is not None:
        raise err
    return out


def start_matmul_weights(engine: MatmulEngine, call: MatmulCall,
                         sink: Callable[[asyncio.Future[Any]], None] | None = None,
                         ) -> asyncio.Future[list[tuple[str, MatmulReply]]]:
    """Check and queue every part of ``call`` (a multi-weight call: ``call.weights``) now; the
    future resolves with (weight, reply) per weight, in order. A refusal raises here (nothing
    stays queued); cancelling the future drops the parts that have not run yet. ``sink(fut)``
    is called right after the future is resolved, in the loop trip that resolves its last part
    (as ``Engine.start_matmul``'s sink; not when the future is cancelled from outside)."""
    names = check_parts(engine, call)
    whole: asyncio.Future[list[tuple[str, MatmulReply]]] = (
        asyncio.get_running_loop().create_future())
    parts: list[asyncio.Future[MatmulReply]] = []
    settled: set[int] = set()

    def part_done(i: int, f: asyncio.Future[MatmulReply]) -> None:
        """Each part's sink (the trip that resolves it) and its done callback (a trip later,
        also for cancellations): the first call of each part counts."""
        if i in settled:
            return
        settled.add(i)
        if whole.done():
            return
        exc = None if f.cancelled() else f.exception()
        if f.cancelled() or exc is not None:  # one part failed: the request has failed
            for g in parts:
                g.cancel()
            if exc is None:
                whole.cancel()
                return
            whole.set_exception(_named(i, names[i], exc) if isinstance(exc, Q6Error) else exc)
        elif len(settled) == len(names):
            whole.set_result([(n, g.result()) for n, g in zip(names, parts, strict=True)])
        else:
            return
        if sink is not None:
            sink(whole)

    try:
        with engine.grouped():
            for i, name in enumerate(names):
                try:
                    parts.append(engine.start_matmul(_part(call, name),
                                                     functools.partial(part_done, i)))
                except Q6Error as e:
                    raise _named(i, name, e) from None
    except BaseException:
        for f in parts:
            f.cancel()
        raise

    def whole_done(f: asyncio.Future[list[tuple[str, MatmulReply]]]) -> None:
        if f.cancelled():  # the caller went away: drop the parts not run yet
            for g in parts:
                g.cancel()

    for i, f in enumerate(parts):
        f.add_done_callback(functools.partial(part_done, i))
    whole.add_done_callback(whole_done)
    return whole
