"""The device process's region calls (service/frontends.py): a matmul whose x and y live in
the caller's registered regions (system shared memory or CUDA IPC), sent by a front end as one
"rm" frame (frontends_front.py ``_PlaneProxy.matmul``). The checks (owner, bounds, the backing
object) run in the loop trip that reads it; y is written into its region (by the device where
it can) and the answer carries no bytes. Full system-region batches go through the launch
pipeline (frontends_pipeline.py) and reuse their region's plans.

``RegionCalls`` is a part of ``FrontendsWorker`` (its state is made in
``FrontendsWorker.__init__``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from q6serve.kernels.api import DTYPES, dtype_name
from q6serve.kernels.errors import Unavailable

from . import lane as lane_mod
from . import regions as regions_mod
from .engine_types import MatmulCall
from .frontends_calls import _told_failure
from .frontends_ipc import (
    _DTYPE_NAMES,
    _LE,
    _NAME,
    _PRECISION_OF,
    _PRECISIONS,
    _RM,
    _RMOK,
    _fields,
    _Front,
    _portable_error,
    _unopt,
)
from .regions import CUDA, Region, RegionIO, RegionRef
from .threads import outcome


@dataclasses.dataclass(slots=True)
class _SysCall:
    """A full system-region call on its way through the device process's pipeline
    (``FrontendsWorker._sys_call``): who gets the answer, its region (x and y, held), y's
    place, the call, y's view, the route key (unrouted once), its plan (launched by it), the
    plan's key in ``region.plans`` and the flag state a plan from it would be valid for."""

    fe: _Front
    rid: int
    region: Region
    y_off: int
    call: MatmulCall
    dest: np.ndarray
    key: Any
    plan: Any
    pkey: tuple[Any, ...]
    state: Any

    def drop_plan(self) -> None:
        """Forget the region's plan for this call's place (stale, refused, or the call queued:
        a later repeat plans again)."""
        if self.region.plans is not None:
            self.region.plans.pop(self.pkey, None)


class RegionCalls:
    """FrontendsWorker's region calls: a front end's "rm" frames and messages."""

    def _region_frame(self, fe: _Front, b: memoryview) -> None:
        """A region call's frame (``_RM``: x and y in system or CUDA regions, x 2-D), parsed
        here: ``_decode`` and ``_dispatch``'s work for that one case, without the decoded
        message tuple, then ``_region_matmul``."""
        (_, rid, xo, rows, k, yo, xdt, out, prec, timeout, lo, lx,
         ly) = _RM.unpack_from(b)
        raw = bytes(b[_RM.size :])
        xe, ye = lo + lx, lo + lx + ly
        self._region_matmul(fe, rid, raw[:lo].decode(),
                            (raw[lo:xe].decode(), xo, _DTYPE_NAMES[xdt], (rows, k)),
                            (raw[xe:ye].decode(), yo), raw[ye:].decode(), _PRECISIONS[prec],
                            _DTYPE_NAMES[out], _unopt(timeout))

    def _region_matmul(self, fe: _Front, rid: int, owner: str, xs: tuple[Any, ...],
                       ys: tuple[str, int], weight: str, precision: str, out_dtype: str,
                       timeout: float | None) -> None:
        """A matmul whose x and y both live in the caller's system shared-memory regions
        (the front end's ``_PlaneProxy.matmul``): the checks of ``regions.matmul`` (owner,
        bounds, alignment, the backing object still there, y's span) run here, in this loop
        trip; the request goes to the engine with a sink, which writes y into its region,
        lets the regions go and answers ("rmok": the reply's fields, no bytes). No task, no
        protobuf. A CUDA IPC region on either side: ``_cuda_region_matmul`` (no task either)."""
        fe.calls += 1
        table = self.regions
        assert table is not None
        x_name, x_off, x_dtype, x_shape = xs
        xr = yr = None
        try:
            # (one at a time: x's hold is let go below if y's is refused)
            xr = table.hold_name(owner, x_name)
            yr = table.hold_name(owner, ys[0])
            if CUDA in (xr.kind, yr.kind):  # on the device end to end (cuda_regions.py)
                io = RegionIO(RegionRef(x_name, x_off), _LE[x_dtype], x_shape, RegionRef(*ys))
                self._cuda_region_matmul(fe, rid, xr, yr, io, weight, precision, out_dtype,
                                         timeout)
                self._count_pending(fe)
                return
            if (self.sys_pipe and xr is yr and len(x_shape) == 2
                    and x_shape[0] >= self.config.max_batch_rows):
                self._sys_call(fe, rid, xr, xs, ys[1], weight, precision, out_dtype, timeout)
                self._count_pending(fe)
                return
            call = MatmulCall(weight, xr.array(x_off, _LE[x_dtype], x_shape, "x"),
                              _PRECISION_OF[precision], DTYPES[out_dtype], timeout)
            shape = (x_shape[0], self.engine.rows_of(weight))  # type: ignore[union-attr]
            # y's place, for the backend to write straight into (kernels/hostio.py); one
            # region for x and y (the usual case): its backing object was checked just now
            dest = yr.array(ys[1], call.out_dtype, shape, "y", writable=True, alive=yr is xr)
            # a call that merges with the trip's others (``_queue_call``) is not routed: the
            # batch's x is not its x, so the backend would never take the route (one left
            # alone at the trip's end is routed then, ``_region_routed``)
            merges = self._merges(call.x)
            key = None if merges else table.route(call.x, dest)
            try:
                self._queue_call(call, functools.partial(self._region_done, fe, rid, xr, yr,
                                                         ys[1], dest, key), merges)
            except BaseException:
                table.unroute(key)
                raise
        except BaseException as e:
            call = dest = None  # type: ignore[assignment]  # (views of the regions: drop first)
            table.let_go(xr)
            table.let_go(yr)
            fe.send(("err", rid, _portable_error(e)))
            if not isinstance(e, Exception):
                raise
            return
        del call, dest
        self._count_pending(fe)

    def _sys_call(self, fe: _Front, rid: int, r: Region, xs: tuple[Any, ...], y_off: int,
                  weight: str, precision: str, out_dtype: str, timeout: float | None) -> None:
        """A full batch (N >= --max-batch-rows) with x and y in one system
        region, both held: the fast lane's route for full batches (service/lane.py
        ``_direct``/``_flush``) in this process's pipeline. A repeat of a call planned before
        (same weight, shapes, dtypes, precision and places) takes its plan (``lane._Plan``:
        the backend's region call, one graph launch, the copies on copy streams beside
        another launch); else x and y are viewed, y routed (the backend DMAs it into the
        region, and is asked for a region call to plan with). Launched at the trip's end
        (``_launch_sys_due``) behind the launches out, waited for a trip later; a call the
        engine will not launch now is queued as any other. Raises what refuses the call."""
        engine, table = self.engine, self.regions
        assert engine is not None and table is not None
        x_off, x_dtype, x_shape = xs[1], _LE[xs[2]], tuple(xs[3])
        out, prec = DTYPES[out_dtype], _PRECISION_OF[precision]
        pkey = (weight, x_shape, x_off, y_off, x_dtype, out, prec)
        plans = r.plans
        # (a plan's call has its first call's deadline, which only had to be ahead: a call
        # whose deadline passed is checked, and refused, by a call of its own)
        plan = plans.get(pkey) if plans and (timeout is None or timeout > 0) else None
        flags = engine.flags
        if plan is not None:
            r.mapping.check_alive("x", r.name)  # (checked when it was made)
            if plan.live(flags):
                if not engine.serving:
                    raise Unavailable("the worker is draining and takes no new requests")
                self._flush_due()
                self._sys_due.append(_SysCall(fe, rid, r, y_off, plan.call, plan.dest, None,
                                              plan, pkey, None))
                return
            plans.pop(pkey, None)  # stale (weight, flags, page-locked ranges)
        call = MatmulCall(weight, r.array(x_off, x_dtype, x_shape, "x", alive=plan is not None),
                          prec, out, timeout)
        if not engine.serving:
            raise Unavailable("the worker is draining and takes no new requests")
        dest = r.array(y_off, out, (x_shape[0], engine.rows_of(weight)), "y", writable=True,
                       alive=True)
        self._flush_due()
        self._sys_due.append(self._sys_routed(_SysCall(fe, rid, r, y_off, call, dest, None,
                                                       None, pkey, None)))

    def _sys_routed(self, p: _SysCall) -> _SysCall:
        """``p`` with y routed into its region (the backend DMAs it there) and, where its
        region has room for another plan, a region call asked for (``Route.want``)."""
        table = self.regions
        assert table is not None and self.engine is not None
        r, base = p.region, p.region.mapping.addr
        x_off = p.pkey[2]
        p.plan = None
        p.key = table.route(p.call.x, p.dest, None if base is None else base + x_off,
                            None if base is None else base + p.y_off)
        if (p.key is not None and r.plans is not None
                and len(r.plans) < regions_mod.VIEW_CACHE):
            p.key.want, p.state = True, self.engine.flags.state
        return p

    def _launch_sys_due(self) -> None:
        """The trip's full system-region calls (``_sys_call``) through ``Engine.launch_now``
        (a plan's call by its region call), behind the launches out; one the engine will not
        launch now (a like job not measured yet, or the device busy otherwise) is queued."""
        due, self._sys_due = self._sys_due, []
        engine = self.engine
        assert engine is not None
        for p in due:
            try:
                self._pipe(functools.partial(self._sys_launch, p),
                           functools.partial(self._sys_done, p),
                           functools.partial(self._sys_queue, p))
            except Exception as e:
                self._sys_done(p, None, e)

    def _sys_launch(self, p: _SysCall) -> Callable[[], Any] | None:
        engine = self.engine
        assert engine is not None
        plan = p.plan
        if plan is not None and not plan.live(engine.flags):
            p.drop_plan()
            self._sys_routed(p)
            plan = None
        try:
            wait = engine.launch_now(p.call, None if plan is None else plan.launch)
        except Exception:
            if plan is not None:
                p.drop_plan()  # (not again)
            raise
        if wait is not None:
            self.sys_launched += 1
            self.sys_planned += plan is not None
        return wait

    def _sys_queue(self, p: _SysCall) -> None:
        """``p`` queued as any full call (the engine would not launch it now)."""
        self.sys_queued += 1
        if p.plan is not None:
            p.drop_plan()
            self._sys_routed(p)  # (queued: routed as any other)

        def answered(fut: asyncio.Future[Any]) -> None:
            self._sys_done(p, *outcome(fut))

        self.engine.start_matmul(p.call, answered)  # type: ignore[union-attr]

    def _sys_done(self, p: _SysCall, reply: Any, exc: BaseException | None) -> None:
        """``p``'s answer: y into place unless the backend wrote it there (its route, or its
        plan's region call), a plan made from a routed call's region call, "rmok"; then its
        region let go."""
        table, fe = self.regions, p.fe
        assert table is not None
        try:
            taken = table.unroute(p.key) or p.plan is not None
            if exc is not None:
                fe.send(("err", p.rid, _portable_error(exc)))
                return
            key, plans = p.key, p.region.plans
            if (key is not None and key.call is not None and plans is not None
                    and self.engine.flags.state is p.state):  # type: ignore[union-attr]
                plans[p.pkey] = lane_mod._Plan(p.call, p.dest, key.call, p.state)
            y = reply.y
            regions_mod.place_y(p.region, p.y_off, y, p.dest, taken)
            fe.send(("rmok", p.rid, _fields(reply), (_NAME.get(y.dtype) or dtype_name(y.dtype),
                                                      y.shape)))
        except Exception as e:
            fe.send(("err", p.rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, p.region, p.region)

    def _region_done(self, fe: _Front, rid: int, xr: Region, yr: Region, y_off: int,
                     dest: np.ndarray, key: Any, fut: asyncio.Future[Any]) -> None:
        table = self.regions
        assert table is not None
        try:
            taken = table.unroute(key)  # the device wrote y into its region
            if _told_failure(fe, rid, fut):
                return
            reply = fut.result()
            y = reply.y
            regions_mod.place_y(yr, y_off, y, dest, taken)
            fe.send(("rmok", rid, _fields(reply), (_NAME.get(y.dtype) or dtype_name(y.dtype),
                                                   y.shape)))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, xr, yr)

    def _region_routed(self, call: MatmulCall, sink: Any) -> Any:
        """A system-region call's sink (``_region_done``) with its y routed into its region
        (the backend DMAs it there), for a call that did not merge (``_region_matmul``
        routes only the calls that will not)."""
        fe, rid, xr, yr, y_off, dest, key = sink.args
        if key is not None:
            return sink
        key = self.regions.route(call.x, dest)  # type: ignore[union-attr]
        return functools.partial(self._region_done, fe, rid, xr, yr, y_off, dest, key)

    def _region_answer(self, fe: _Front, rid: int, xr: Region, yr: Region, y_off: int,
                       dest: np.ndarray, key: Any, fields: tuple[Any, ...],
                       y: np.ndarray, head: tuple[tuple[Any, ...], bytes] | None) -> None:
        """``_region_done`` for a merged batch's system-region call (``_answer_merged``): its
        rows ``y`` of the batch's y and the batch's reply ``fields``, no reply object or
        future. A merged call's y is never the backend's to route (the batch's x is not
        this call's), so it is copied into place: into ``dest`` (its view, made when the
        call came) once the backing object is checked again (a shrunk one is refused, not
        written: SIGBUS), else as ``place_y`` does. ``head``: ``_rmok_head(fields, y of the
        batch)``, made once for the batch (None: the message is encoded as usual)."""
        try:
            if key is not None:  # (None: never routed)
                self.regions.unroute(key)  # type: ignore[union-attr]
            if y.shape == dest.shape and y.dtype == dest.dtype:
                yr.mapping.check_alive("y", yr.name)
                dest[...] = y
            else:
                regions_mod.place_y(yr, y_off, y, dest, False)
            if head is not None:  # _encode's "K" frame
                if fe.alive:
                    fe.out.send_bytes(_RMOK.pack(b"K", rid, *head[0], *y.shape) + head[1])
                return
            fe.send(("rmok", rid, fields, (_NAME.get(y.dtype) or dtype_name(y.dtype),
                                           y.shape)))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, xr, yr)

    def _cuda_region_matmul(self, fe: _Front, rid: int, xr: Region, yr: Region, io: RegionIO,
                            weight: str, precision: str, out_dtype: str,
                            timeout: float | None) -> None:
        """``_region_matmul`` with a CUDA IPC region on either side (x and y held): the
        checks of ``regions.matmul`` here, the job through ``CudaSupport.start`` (no task, no
        future), answered as "rmok" from its end (``_region_done``; a y in a CUDA region is
        written by the job, a y for a system region comes back on the host). Raises what
        refuses the call (the caller lets the regions go)."""
        table = self.regions
        assert table is not None and table.cuda is not None  # (a CUDA region exists)
        assert io.x is not None and io.y is not None and io.x_shape is not None
        call = MatmulCall(weight, xr.array(io.x.offset, io.x_dtype, io.x_shape, "x"),
                          _PRECISION_OF[precision], DTYPES[out_dtype], timeout)
        # (rows_of: the rows without building a WeightView, ~7 us on the VM a call)
        shape = (io.x_shape[0], self.engine.rows_of(weight))  # type: ignore[union-attr]
        dest = yr.array(io.y.offset, call.out_dtype, shape, "y", writable=True)
        yd = dest if yr.kind == CUDA else None
        done = functools.partial(self._cuda_region_done, fe, rid, xr, yr, io.y.offset, dest,
                                 np.dtype(call.out_dtype), shape)
        self._flush_due()  # launched at the trip's end (_launch_cuda_due)
        self._cuda_due.append((call, yd, done))

    def _cuda_region_done(self, fe: _Front, rid: int, xr: Region, yr: Region, y_off: int,
                          dest: Any, out: np.dtype, shape: tuple[int, int], reply: Any,
                          exc: BaseException | None) -> None:
        try:
            if exc is not None:
                fe.send(("err", rid, _portable_error(exc)))
                return
            if yr.kind != CUDA:  # y came back on the host: into the system region
                yr.array(y_off, reply.y.dtype, reply.y.shape, "y", writable=True)[...] = reply.y
            fe.send(("rmok", rid, _fields(reply), (_NAME.get(out) or dtype_name(out), shape)))
        except Exception as e:
            fe.send(("err", rid, _portable_error(e)))
        finally:
            self._region_call_ended(fe, xr, yr)

    def _region_call_ended(self, fe: _Front, xr: Region, yr: Region) -> None:
        """A region call answered: its regions let go, its front end's call done."""
        assert self.regions is not None
        self.regions.let_go(xr)
        self.regions.let_go(yr)
        self._one_done(fe)
