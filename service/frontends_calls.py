"""The device process's plain matmuls (service/frontends.py): x in a front end's arena slot
(or in the message), y answered into the same slot. Calls read in one loop trip for the same
weight, dtypes and K merge into one engine request at the trip's end, which runs on the
engine's direct path when the device is idle; each call's rows go back to its front end.

``PlainCalls`` is a part of ``FrontendsWorker`` (its state is made in
``FrontendsWorker.__init__``); ``_DeviceStats`` times its methods by name.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from q6serve.kernels.api import DTYPES, Precision
from q6serve.kernels.errors import FailedPrecondition, InvalidArgument
from q6serve.kernels.hostio import Route

from .engine import Engine, MatmulReply
from .engine_types import MatmulCall
from .frontends_ipc import (
    _DTYPE_BY_CODE,
    _DTYPE_CODE,
    _LE,
    _LE_BY_CODE,
    _MM,
    _MMOK,
    _NAME,
    _PRECISION_BY_CODE,
    _PRECISION_OF,
    SLOT_ALIGN,
    Outs,
    _desc,
    _fields,
    _Front,
    _mmok_head,
    _parts,
    _portable_error,
    _rmok_head,
    _strip,
    _unopt,
)
from .multi import start_matmul_weights

# a merged batch's x is gathered from its calls' slots only at these precisions: the others
# may resolve to Q8_1, whose launch reads x on the host first (kernels/api.py launch_ieee)
_GATHER_PRECISIONS = frozenset((Precision.EXACT, Precision.F16))


def _settled(outcome: Any) -> asyncio.Future[Any]:
    """A future already holding ``outcome`` (an exception: failed), for a sink."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)
    return fut


def _told_failure(fe: _Front, rid: int, fut: asyncio.Future[Any]) -> bool:
    """A sink's first step: a failed (or cancelled) request's error goes to its front end."""
    if not fut.cancelled() and fut.exception() is None:
        return False
    exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
    fe.send(("err", rid, _portable_error(exc)))  # type: ignore[arg-type]
    return True


def _longest(parts: list[tuple[MatmulCall, Any]]) -> float | None:
    """The deadline of merged calls' one request: the longest (each caller's own deadline
    ends its RPC); None if any has none."""
    timeout = 0.0
    for c, _ in parts:
        if c.timeout is None:
            return None
        timeout = max(timeout, c.timeout)
    return timeout


def _probe(parts: list[tuple[MatmulCall, Any]], rows: int, timeout: float | None) -> MatmulCall:
    """Merged calls' request as the engine's checks read it (rows and dtypes; x one row,
    repeated: nothing copied), before x is built (``_staged``)."""
    first = parts[0][0]
    x0 = first.x
    return MatmulCall(first.weight, np.ndarray((rows, x0.shape[1]), x0.dtype, x0, 0,
                                               (0, x0.strides[1])),
                      first.precision, first.out_dtype, timeout)


def _staged(engine: Engine, parts: list[tuple[MatmulCall, Any]], rows: int) -> np.ndarray:
    """Merged calls' x concatenated straight into the backend's upload buffer
    (``Backend.staging``: valid until the next launch, which must be this one's)."""
    x0 = parts[0][0].x
    return np.concatenate([c.x for c, _ in parts],
                          out=engine.backend.staging(rows, x0.shape[1], x0.dtype))


# ============================================================================================
# The device process


class PlainCalls:
    """FrontendsWorker's plain matmuls: a front end's "mm" messages and frames, merged per loop
    trip, run on the engine's direct path or queued, answered into their slots."""

    def _matmul(self, fe: _Front, rid: int, weight: str, weights: tuple[str, ...], topk: int,
                precision: Any, out_dtype: str, timeout: float | None, x: Any,
                slot: int) -> None:
        fe.calls += 1
        try:
            if isinstance(x, tuple):  # (dtype, shape) in the slot
                x = fe.arena.array(slot, _LE[x[0]], x[1], writable=False)
            call = MatmulCall(weight, x, _PRECISION_OF[precision], DTYPES[out_dtype], timeout,
                              topk, weights)
            # the answer goes out from the sink, in the loop trip that resolves the future (a
            # done callback would cost one more trip and handle per request)
            sink = functools.partial(self._matmul_done, fe, rid, slot)
            # what the one-process servicer does (Q6ServeServicer._start): a multi-weight
            # request fans out here, to every weight's batcher
            if weights:
                start_matmul_weights(self.engine, call, sink)  # type: ignore[arg-type]
            else:
                self._queue_call(call, sink)
        except BaseException as e:
            fe.send(("err", rid, _portable_error(e)))
            return
        del x, call  # the queued request holds x; once it ran, nothing here does
        self._count_pending(fe)

    def _plain_mm(self, fe: _Front, b: memoryview) -> None:
        """A plain matmul's frame (``_MM``: one weight, no top-k, x in its slot), parsed here:
        ``_matmul``'s work for that one case, without the decoded message tuple."""
        _, rid, slot, rows, k, xdt, out, prec, timeout = _MM.unpack_from(b)
        weight = bytes(b[_MM.size :]).decode()
        x_dtype, out_dtype, precision = _LE_BY_CODE[xdt], _DTYPE_BY_CODE[out], \
            _PRECISION_BY_CODE[prec]
        fe.calls += 1
        key: Route | None = None
        try:
            x = fe.arena.array(slot, x_dtype, (rows, k), writable=False)
            if rows >= self._merge_rows and fe.arena.pinned:  # a full call, alone: y routed
                key = self._route_arena(fe, slot, x, weight, out_dtype)
            sink = (functools.partial(self._matmul_done, fe, rid, slot) if key is None else
                    functools.partial(self._routed_done, fe, rid, slot, key))
            self._queue_call(MatmulCall(weight, x, precision, out_dtype, _unopt(timeout)), sink)
        except BaseException as e:
            if key is not None:
                self._arena_io.unroute(key)  # type: ignore[union-attr]
            fe.send(("err", rid, _portable_error(e)))
            return
        del x  # the queued request holds x; once it ran, nothing here does
        self._count_pending(fe)

    def _route_arena(self, fe: _Front, slot: int, x: np.ndarray, weight: str,
                     out_dtype: np.dtype) -> Route | None:
        """A full call's y routed to the start of its slot in the page-locked arena (where
        the front end reads it; kernels/hostio.py): the backend DMAs y there (x's upload from
        the same bytes comes first on its stream). None where y does not fit the slot."""
        io = self._arena_io
        assert io is not None and self.engine is not None
        shape = (x.shape[0], self.engine.rows_of(weight))
        if shape[0] * shape[1] * out_dtype.itemsize > fe.arena.slot_bytes:
            return None
        at = fe.arena.addr + slot * fe.arena.slot_bytes
        return io.route(x, fe.arena.array(slot, out_dtype.newbyteorder("<"), shape,
                                          writable=True), at, at)

    def _routed_done(self, fe: _Front, rid: int, slot: int, key: Route,
                     fut: asyncio.Future[Any]) -> None:
        """``_matmul_done`` for a call whose y was routed into its slot (``_route_arena``):
        where the backend took the route, y is in the slot already (no copy)."""
        taken = self._arena_io.unroute(key)  # type: ignore[union-attr]
        if not taken or _told_failure(fe, rid, fut):
            if taken:
                self._one_done(fe)
            else:
                self._matmul_done(fe, rid, slot, fut)
            return
        reply = fut.result()
        self._answer_mm(fe, rid, slot, _fields(reply), reply.y, placed=True)

    # -- the calls of one loop trip as one engine request ------------------------------------
    def _queue_call(self, call: MatmulCall, sink: Callable[[Any], None],
                    merges: bool | None = None) -> None:
        """Queue a single-weight call whose answer goes to ``sink(fut)``. A plain one (no
        top-k, fewer than ``_merge_rows`` rows) waits for the end of this loop trip and goes to
        the engine together with the others of its weight, dtypes and K read in the same trip
        (from every front end): one request, one MatmulReply for all of them, each sink then
        gets its rows (``_answer_merged``). The engine's per-request work was a third of the
        device process's loop under T2 (bench/RESULTS.md, issue 15 session 5). On an idle
        device, once a like job is measured, that request takes the engine's direct path at
        the end of the trip (``_run_merged_now``: no queue, future or timer; -27% of the
        device process's CPU per call under T2, session 9). Not with dynamic batching off
        (Q6SERVE_DYNAMIC_BATCHING) or Q6SERVE_DEVICE_MERGE=0. ``merges``: ``_merges(x)``,
        where the caller knows it already."""
        x, engine = call.x, self.engine
        assert engine is not None
        if call.topk or not (self._merges(x) if merges is None else merges):
            engine.start_matmul(call, sink)
            return
        self._flush_due()
        key = (call.weight, x.dtype, x.shape[1], call.precision, call.out_dtype)
        if (got := self._merging.get(key)) is None:
            self._merging[key] = [(call, sink)]
        else:
            got.append((call, sink))

    def _merges(self, x: np.ndarray) -> bool:
        """Would a single-weight call of ``x`` (no top-k) wait for the trip's end to merge
        (``_queue_call``)? Not with merging or dynamic batching off (one by one), not a full
        one (it merges with nothing)."""
        return (self.merge and x.ndim == 2 and 0 < x.shape[0] < self._merge_rows
                and self.engine.flags.state.dynamic_batching)  # type: ignore[union-attr]

    def _flush_due(self) -> None:
        """A call for the trip's end (``_flush_calls``, scheduled once a trip)."""
        if not self._merging and not self._cuda_due and not self._sys_due:
            asyncio.get_running_loop().call_soon(self._flush_calls)

    def _flush_calls(self) -> None:
        """The calls merged in this trip to the engine (``_start_merged``). What ran here on
        the direct path is answered here: those answers go out now (``_Out.flush_now``),
        not a loop iteration later, after the messages read meanwhile were parsed and
        merged. The trip's CUDA-region calls are launched next, then the launches of earlier
        trips are waited for and answered (the GPU has this trip's to run meanwhile)."""
        merging, self._merging = self._merging, {}
        earlier = self._launches
        for parts in merging.values():
            chunk: list[tuple[MatmulCall, Any]] = []
            rows = 0
            for part in parts:
                n = part[0].x.shape[0]
                if chunk and rows + n > self._merge_rows:
                    self._start_merged(chunk, rows)
                    chunk, rows = [], 0
                chunk.append(part)
                rows += n
            self._start_merged(chunk, rows)
        if self._cuda_due:
            self._launch_cuda_due()
        if self._sys_due:
            self._launch_sys_due()
        self._settle_done(earlier)
        for fe in self._fronts.values():
            fe.out.flush_now()

    def _start_merged(self, parts: list[tuple[MatmulCall, Any]], rows: int) -> None:
        if len(parts) == 1:
            call, sink = parts[0]
            if getattr(sink, "func", None) == self._region_done:  # alone after all: routed
                sink = self._region_routed(call, sink)
            self._start_alone(call, sink)
            return
        timeout = _longest(parts)
        try:
            if self._run_merged_now(parts, rows, timeout):
                return
        except Exception:  # (a refusal may be one caller's: each gets its own answer)
            for part in parts:
                self._start_alone(*part)
            return
        self._start_queued(parts, timeout)

    def _start_queued(self, parts: list[tuple[MatmulCall, Any]],
                      timeout: float | None) -> None:
        """Merged calls as one queued engine request (x concatenated), each answered from
        its reply (``_merged_done``)."""
        calls = [c for c, _ in parts]
        first = calls[0]
        try:
            x = np.concatenate([c.x for c in calls])
            self.engine.start_matmul(  # type: ignore[union-attr]
                MatmulCall(first.weight, x, first.precision, first.out_dtype, timeout),
                functools.partial(self._merged_done, parts))
        except Exception:  # (a refusal may be one caller's: each gets its own answer)
            for part in parts:
                self._start_alone(*part)
            return
        self.merged[0] += 1
        self.merged[1] += len(parts)

    def _run_merged_now(self, parts: list[tuple[MatmulCall, Any]], rows: int,
                        timeout: float | None) -> bool:
        """The engine's direct path for merged calls (``Engine.direct_batchers`` and
        ``run_direct``): when their request would run at once as an inline job anyway (the
        device idle, nothing of the weight queued, a like job measured and short), x is
        concatenated straight into the backend's upload buffer (``Backend.staging``: the CUDA
        backend then skips its own copy of x) and the job runs here, now, its reply split
        among the calls in this trip: no queue entry, future, deadline timer or loop trip per
        merged request (the one-process servicer's direct path, for the device process).
        False: nothing was done (queue it). A refusal is handled as ``_merged_done`` does."""
        engine = self.engine
        assert engine is not None
        probe = _probe(parts, rows, timeout)
        key = engine.batch_key(probe)
        got = engine.direct_batchers((probe,), key)
        if got is None:
            return False
        x = self._stage_x(engine, parts, rows)
        if len(parts) > 1:
            self.merged[0] += 1
            self.merged[1] += len(parts)
            self.merged_direct += 1
        call = MatmulCall(probe.weight, x, probe.precision, probe.out_dtype, timeout)
        try:
            reply = engine.run_direct(got[0], call, key)
        except Exception as e:
            self._merged_failed(parts, e)
            return True
        self._answer_merged(parts, reply)
        return True

    def _stage_x(self, engine: Engine, parts: list[tuple[MatmulCall, Any]],
                 rows: int) -> np.ndarray:
        """``_staged``, as a method: a stage of its own for the stage timers (T2's merged
        batch: x's rows copied into the upload buffer, ``_DeviceStats._stages``); with the
        arenas pinned, ``_gathered`` first."""
        if self._gather is not None and (x := self._gathered(parts, rows)) is not None:
            return x
        return _staged(engine, parts, rows)

    def _gathered(self, parts: list[tuple[MatmulCall, Any]], rows: int) -> np.ndarray | None:
        """The merged calls' x as the backend's placeholder for their slots' bytes
        (``CudaBackend.gathered``: each call's rows DMA'd from its slot in its pinned arena
        into the device's x at the launch, instead of ~36 us of concatenation a batch on the
        H200 under T2: session 21, bundle B), or None (a call whose x is not at the start of
        its slot, e.g. sent in its message; a Q8_1-capable precision, whose launch reads x on
        the host; an arena not pinned)."""
        first = parts[0][0]
        if first.precision not in _GATHER_PRECISIONS:
            return None
        pieces = []
        done = self._matmul_done
        for call, sink in parts:
            if getattr(sink, "func", None) != done:
                return None
            fe, _, slot = sink.args
            a = fe.arena
            if call.x.base is not a.base or not a.pinned:  # (x in its slot, at offset 0)
                return None
            pieces.append((a.addr + slot * a.slot_bytes, call.x.nbytes))
        x0 = first.x
        x = self._gather(pieces, rows, x0.shape[1], x0.dtype)  # type: ignore[misc]
        if x is not None:
            self.gathered += 1
        return x

    def _start_alone(self, call: MatmulCall, sink: Callable[[Any], None]) -> None:
        """One call to the engine: run here and now on its direct path when it would run at
        once as an inline job anyway (``Engine.run_now``), else queued."""
        engine = self.engine
        assert engine is not None
        try:
            reply = engine.run_now(call)
            if reply is None:
                engine.start_matmul(call, sink)
                return
        except Exception as e:
            sink(_settled(e))
            return
        if getattr(sink, "func", None) == self._matmul_done and reply.y is not None:
            self._answer_mm(*sink.args, _fields(reply), reply.y)  # (no future for it)
        else:
            sink(_settled(reply))

    def _merged_done(self, parts: list[tuple[MatmulCall, Any]],
                     fut: asyncio.Future[Any]) -> None:
        """Each merged call's sink with its rows of y, or the failure."""
        if fut.cancelled() or fut.exception() is not None:
            self._merged_failed(parts, fut.exception() if not fut.cancelled()  # type: ignore[arg-type]
                                else asyncio.CancelledError())
            return
        self._answer_merged(parts, fut.result())

    def _merged_failed(self, parts: list[tuple[MatmulCall, Any]], e: BaseException) -> None:
        """A merged request failed: a refusal that may be one caller's input
        (INVALID_ARGUMENT, FAILED_PRECONDITION) runs each call alone, as the batcher isolates a
        bad request; any other failure goes to every call."""
        exc = _portable_error(e)
        if isinstance(exc, InvalidArgument | FailedPrecondition):
            for part in parts:
                self._start_alone(*part)
            return
        for _, sink in parts:
            sink(_settled(exc))

    def _answer_merged(self, parts: list[tuple[MatmulCall, Any]], r: MatmulReply) -> None:
        """Each merged call's sink with its rows of ``r.y``."""
        fields = head = rhead = None  # the merged reply's fields: the same for every part
        row = 0
        done, region_done = self._matmul_done, self._region_done
        for call, sink in parts:
            n = call.x.shape[0]
            y = r.y[row : row + n]
            row += n
            func = getattr(sink, "func", None)
            if func == done:  # a plain call: answered here
                if head is None:
                    fields = fields or _fields(r)
                    head = _mmok_head(fields)
                self._answer_mm(*sink.args, fields, y, head)  # (no reply object or future)
                continue
            if func == region_done:  # a system-region call: y into its region, "rmok"
                if rhead is None:
                    fields = fields or _fields(r)
                    rhead = _rmok_head(fields, r.y)
                self._region_answer(*sink.args, fields, y, rhead)  # (no reply or future)
                continue
            sink(_settled(MatmulReply(y, r.kernel, r.layout, r.precision, r.queue_seconds,
                                      r.kernel_seconds, r.batch_rows, r.batch_requests,
                                      r.device_seconds)))

    def _count_pending(self, fe: _Front) -> None:
        """A matmul of ``fe`` was queued (its sink counts it done)."""
        fe.pending += 1
        self._pending += 1
        self.pending_peak = max(self.pending_peak, self._pending)

    def _matmul_done(self, fe: _Front, rid: int, slot: int, fut: asyncio.Future[Any]) -> None:
        if _told_failure(fe, rid, fut):
            self._one_done(fe)
            return
        reply = fut.result()
        if isinstance(reply, MatmulReply) and reply.y is not None:
            self._answer_mm(fe, rid, slot, _fields(reply), reply.y)
            return
        try:
            if not fe.alive:
                return  # its front end died: the result has nobody to go to
            outs: Outs = []
            used = 0  # bytes of the slot taken by earlier parts
            for part in _parts(reply):
                y = part.y
                if y is None:  # the top-k epilogue: its small arrays travel in the reply
                    outs.append(None)
                elif slot >= 0 and used + y.nbytes <= fe.arena.slot_bytes:
                    fe.arena.array(slot, y.dtype.newbyteorder("<"), y.shape, writable=True,
                                   offset=used)[...] = y
                    outs.append((used, *_desc(y)))
                    used += -(-y.nbytes // SLOT_ALIGN) * SLOT_ALIGN
                else:
                    outs.append(np.ascontiguousarray(y))
            fe.send(("mmok", rid, _strip(reply), outs))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._one_done(fe)

    def _answer_mm(self, fe: _Front, rid: int, slot: int, fields: tuple[Any, ...],
                   y: np.ndarray, head: tuple[tuple[Any, ...], bytes] | None = None,
                   placed: bool = False) -> None:
        """A plain call's answer: y into its slot (or in the message), "mmok" with the
        reply's ``fields``; ``head``: ``_mmok_head(fields)``, made once for a merged batch's
        calls (None: made here); ``placed``: y is in its slot already (the device wrote it
        there: ``_routed_done``)."""
        try:
            if not fe.alive:
                return  # its front end died: the result has nobody to go to
            if slot >= 0 and y.nbytes <= fe.arena.slot_bytes:
                if not placed:
                    fe.arena.put(slot, y)
                if head is None:
                    head = _mmok_head(fields)
                dt = _DTYPE_CODE.get(_NAME.get(y.dtype))  # type: ignore[arg-type]
                if head is not None and dt is not None and y.ndim == 2:  # _encode's "R" frame
                    fe.out.send_bytes(_MMOK.pack(b"R", rid, *head[0], 0, dt, *y.shape)
                                      + head[1])
                    return
                out: Any = (0, *_desc(y))
            else:
                out = np.ascontiguousarray(y)
            fe.send(("mmok", rid, fields, [out]))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._one_done(fe)

    def _one_done(self, fe: _Front) -> None:
        fe.done_one()
        self._pending -= 1
