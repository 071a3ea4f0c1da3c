"""The device process's counters for profiling (env ``Q6SERVE_DP_STATS=FILE``): what it does
per call, one JSON line a second; bench/device_stats_table.py reads them. Made by
``FrontendsWorker.start`` (service/frontends.py) when the env names a file, and told of the
fast lanes when the first opens; off, nothing is wrapped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import lane as lane_mod
from .frontends_ipc import _MM, _RM, _Front

if TYPE_CHECKING:
    from .frontends import FrontendsWorker, _FrontConnection

# -- counters of the device process, for profiling (env Q6SERVE_DP_STATS=FILE) ----------------
STATS_ENV = "Q6SERVE_DP_STATS"


class _DeviceStats:
    """What the device process does per call, counted from outside the hot path: with
    ``Q6SERVE_DP_STATS=FILE`` the device process wraps its selector, its connections, its
    dispatch, its inline device jobs and its batch metrics with counters, and appends one JSON
    line of cumulative figures to FILE every second (deltas of two lines = a window): loop
    iterations and time blocked in epoll, socket reads and writes, messages and calls received
    (and each front end's rows, by pid),
    batches and their rows, inline jobs' wall and CPU, per-thread CPU and context switches.
    Off (no wrapper at all) unless the env names a file."""

    def __init__(self, worker: FrontendsWorker, path: str) -> None:
        import threading

        self.w, self.path, self._threading = worker, path, threading
        self._lanes: lane_mod.LaneServer | None = None  # the fast lanes', once one opened
        self.c: dict[str, float] = collections.defaultdict(float)
        loop = asyncio.get_running_loop()
        sel = loop._selector  # type: ignore[attr-defined]
        select, c = sel.select, self.c
        pc = time.perf_counter

        def counted_select(timeout: float | None = None) -> Any:
            t = pc()
            ev = select(timeout)
            c["select_s"] += pc() - t
            c["loop_iterations"] += 1
            c["select_events"] += len(ev)
            if ev:
                c["wakeups"] += 1
            return ev

        sel.select = counted_select
        dev = worker.engine.device  # type: ignore[union-attr]

        def timed(run: Callable[..., Any]) -> Callable[..., Any]:
            def timed_run(*a: Any) -> Any:
                t, tc = pc(), time.thread_time()
                try:
                    return run(*a)
                finally:
                    c["inline_jobs_wall_s"] += pc() - t
                    c["inline_jobs_cpu_s"] += time.thread_time() - tc

            return timed_run

        dev._run_here = timed(dev._run_here)  # type: ignore[method-assign]
        # the direct path's jobs (their answers are not in their time)
        dev.run_now = timed(dev.run_now)  # type: ignore[method-assign]
        if worker.metrics is not None:
            observe = worker.metrics.observe_batch

            def counted_batch(stats: Any) -> None:
                c["batches"] += 1
                c["batch_rows"] += stats.rows
                c["batch_requests"] += stats.requests
                observe(stats)

            worker.metrics.observe_batch = counted_batch  # type: ignore[method-assign]
        dispatch = worker._dispatch

        def counted_dispatch(fe: _Front, msg: tuple[Any, ...]) -> None:
            c["msg_" + msg[0]] += 1
            if msg[0] == "call":  # which device call (a region's: which operation)
                c[f"call_{msg[2]}" + (f"_{msg[3][0]}" if msg[2] == "region" else "")] += 1
                if msg[2] == "region" and msg[3][0] == "matmul":  # a call of x's rows
                    shape = msg[3][2].x_shape
                    c["region_rows"] += shape[0] if shape else 1
            elif msg[0] == "rm":  # x and y in regions
                c["region_rows"] += msg[3][3][0]
            elif msg[0] == "mm":
                x = msg[8]
                n = x[1][0] if isinstance(x, tuple) else len(x)
                c["mm_rows"] += n
                c[f"front_rows_{fe.pid}"] += n
            dispatch(fe, msg)

        worker._dispatch = counted_dispatch  # type: ignore[method-assign]
        plain = worker._plain_mm

        def counted_plain(fe: _Front, b: memoryview) -> None:
            c["msg_mm"] += 1
            n = _MM.unpack_from(b)[3]
            c["mm_rows"] += n
            c[f"front_rows_{fe.pid}"] += n  # each front end's rows (calls of one row)
            plain(fe, b)

        worker._plain_mm = counted_plain  # type: ignore[method-assign]
        region_frame = worker._region_frame

        def counted_region(fe: _Front, b: memoryview) -> None:
            c["msg_rm"] += 1
            c["region_rows"] += _RM.unpack_from(b)[3]
            region_frame(fe, b)

        worker._region_frame = counted_region  # type: ignore[method-assign]
        self._stages(worker)
        for fe in worker._fronts.values():  # connected while the worker started
            self.connection(fe.transport.get_protocol())  # type: ignore[arg-type]
        self.t0 = pc()
        loop.call_later(1.0, self._tick)

    def _timed(self, obj: Any, attr: str, key: str) -> None:
        """``obj.attr`` (a bound method or a module function) wrapped to add its wall time
        and calls to ``st_KEY_s`` / ``st_KEY_n`` (inclusive of what it calls: a stage's
        nested stages are inside its time). Two perf_counter reads a call (~0.1 us)."""
        fn, c, pc = getattr(obj, attr, None), self.c, time.perf_counter
        if fn is None:
            return
        s_key, n_key = f"st_{key}_s", f"st_{key}_n"

        def timed_stage(*a: Any, **kw: Any) -> Any:
            t = pc()
            try:
                return fn(*a, **kw)
            finally:
                c[s_key] += pc() - t
                c[n_key] += 1

        setattr(obj, attr, timed_stage)

    def _stages(self, worker: FrontendsWorker) -> None:
        """Where the loop's busy time goes per call (issue 15, session 20: 100-160 us of
        loop a region call with nothing dominant in py-spy's few samples): wall time of the
        device process's stages, each a method of the worker, its region table, its CUDA
        region support or its engine, or this module's message codec. The top-level ones
        (what a loop trip runs: ``read``, ``flush_calls``, ``tick``, ``out_flush``) sum to
        the loop's busy time less asyncio's own share; bench/device_stats_table.py
        --stages prints them a call."""
        t = self._timed
        t(worker, "_dispatch", "dispatch")  # (inside read: a decoded message)
        t(worker, "_plain_mm", "plain_mm")
        t(worker, "_region_matmul", "region_mm")  # the checks, x/y views, queued for the trip
        t(worker, "_flush_calls", "flush_calls")  # the trip's end: launches, waits, answers
        t(worker, "_launch_cuda_due", "launch_cuda")
        t(worker, "_launch_sys_due", "launch_sys")
        t(worker, "_settle", "settle")  # waits (pipelined_wait_s) and the answers
        t(worker, "_cuda_region_done", "cuda_done")
        t(worker, "_sys_done", "sys_done")
        t(worker, "_tick", "tick")
        t(worker, "_start_merged", "start_merged")
        # (inside start_merged: T2's merged batch, x's rows staged, the job, the answers)
        t(worker, "_stage_x", "stage_x")
        t(worker, "_answer_merged", "answer_merged")
        t(worker, "_region_answer", "region_answer")  # (inside answer_merged: a region call)
        t(worker, "_start_alone", "start_alone")  # (a trip's lone call: its job, its answer)
        if worker.regions is not None:
            t(worker.regions, "hold", "hold")
            t(worker.regions, "let_go", "let_go")
            if (cuda := worker.regions.cuda) is not None:
                t(cuda, "launch_now", "cuda_launch_now")
                t(cuda, "_admit", "cuda_admit")
                t(cuda, "_launch", "cuda_launch")  # the slot, the bound sequence, the event
                t(cuda, "_launch_known", "cuda_launch_known")
                t(cuda, "_launch_place", "cuda_launch_place")  # (a place graph's launch)
        if worker.engine is not None:
            t(worker.engine, "launch_now", "engine_launch_now")
            t(worker.engine, "run_direct", "run_direct")  # (the merged batch's inline job)
            t(worker.engine, "run_now", "run_now")  # (a lone call's inline job)

    def lanes(self, server: lane_mod.LaneServer) -> None:
        """Time the fast lanes' stages (once, when the first lane opens): a request record
        handled (``lane_request``: the checks, then launched or queued), the trip's full
        batches pipelined (``lane_flush``) and a reply (``lane_answer``); their requests
        are the snapshot's ``lane_requests`` (bench/device_stats_table.py counts them as
        calls: a lane's request is one, as a front end's message is)."""
        if self._lanes is None:
            self._lanes = server
            self._timed(server, "_request", "lane_request")
            self._timed(server, "_flush", "lane_flush")
            self._timed(server, "_answer", "lane_answer")

    def connection(self, conn: _FrontConnection) -> None:
        """Count one front end's socket reads and writes (and their time: ``read`` is a
        socket read's frames parsed and handed on, ``write`` the transport's send)."""
        c, received = self.c, conn.data_received
        transport = conn.transport
        assert transport is not None
        write = transport.write

        def counted_received(data: bytes) -> None:
            c["socket_reads"] += 1
            c["socket_read_bytes"] += len(data)
            received(data)

        def counted_write(data: Any) -> None:
            c["socket_writes"] += 1
            write(data)

        conn.data_received = counted_received  # type: ignore[method-assign]
        transport.write = counted_write  # type: ignore[method-assign]
        self._timed(conn, "data_received", "read")
        self._timed(transport, "write", "write")
        if conn.out is not None:  # its answers' writes, scheduled or at a trip's end
            self._timed(conn.out, "flush", "out_flush")

    def snapshot(self) -> dict[str, Any]:
        names = {t.native_id: t.name for t in self._threading.enumerate()}
        tick = os.sysconf("SC_CLK_TCK")
        threads = {}
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/self/task/{task}/stat") as f:
                    comm, rest = f.read().rsplit(")", 1)
                fields = rest.split()
                key = f"{task}:{names.get(int(task), comm.split('(', 1)[1])}"
                threads[key] = (int(fields[11]) + int(fields[12])) / tick
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        dev = self.w.engine.device  # type: ignore[union-attr]
        return {"t": time.perf_counter() - self.t0, "wall": time.time(),
                "cpu_s": time.process_time(),
                **self.c, "jobs": dev.jobs, "inline_jobs": dev.inline_jobs,
                "deferred_jobs": dev.deferred_jobs, "behind_jobs": dev.behind_jobs,
                "direct_jobs": dev.direct_jobs, "merged_requests": self.w.merged[0],
                "merged_calls": self.w.merged[1], "gathered_batches": self.w.gathered,
                "pipelined_batches": self.w.pipelined[0],
                "pipelined_wait_s": self.w.pipelined[1], "threads_cpu_s": threads,
                # the full system-region calls: launched, by their plan, queued
                "sys_launched": self.w.sys_launched, "sys_planned": self.w.sys_planned,
                "sys_queued": self.w.sys_queued,
                # the fast lanes' requests (each a call; none before a lane opened)
                "lane_requests": 0 if self._lanes is None else self._lanes.direct,
                # (not ``regions and ...``: a RegionTable with no region left is falsy)
                "place_launches": getattr(None if self.w.regions is None
                                          else self.w.regions.cuda, "place_launches", 0),
                **{k.strip(): int(v) for k, v in status.items()}}

    def _tick(self) -> None:
        with contextlib.suppress(OSError), open(self.path, "a") as f:
            f.write(json.dumps(self.snapshot()) + "\n")
        if not self.w._draining:
            asyncio.get_running_loop().call_later(1.0, self._tick)
