"""The device process of a ``--frontends`` worker, alone: CPU per front-end message and per call.

``bench/frontend_cpu.py`` measures the whole worker under gRPC load, where two load processes,
the front ends and the device process share the machine and every figure moves with the
neighbours. This probe runs only the device process's side in one process, with no gRPC and
no front-end processes: its Engine (NumPy or CUDA backend), and one front end's connection
(``frontends._FrontConnection``) fed ready-made frames, the stacked plain matmuls a front end
sends (x already in the arena), closed-loop: ``--inflight`` messages outstanding, each answer
followed by a new message, the new ones of a loop trip delivered as one read (as a socket
read would). The stand-in front end reuses prebuilt frames and reads only each answer's
request id, so nearly all the CPU measured is the device process's: decoding, the engine's
checks and batcher, the device job, the reply into the slot and its message.

    python bench/device_ipc.py                           # NumPy, 16x256 weight, stacks of 4
    python bench/device_ipc.py --stack 1 --inflight 8    # one call per message
    python bench/device_ipc.py --backend cuda --rows 3584 --k 18944 --stack 8 --inflight 8
    python bench/device_ipc.py --region --stack 1 --inflight 16   # x and y in shm regions
    # T2 over system regions, modelled GPU: N=1 calls merged, x gathered from the regions
    python bench/device_ipc.py --gpu-us 33 --region --stack 1 --inflight 8 --precision f16 \
        --rows 3584 --k 18944

``--region``: each message is a matmul whose x and y are in the caller's system shm region
(the "rm" message a front end sends for a request naming x_region and y_region), one region
per message. Env Q6SERVE_DEVICE_MERGE=0: the device process does not merge the calls of a
loop trip (compare).

``--lane``: each call is a fast-lane request record (service/lane.py) on its own lane
connection (no socket: records delivered and replies read in this process), x and y in the
lane's system region, as T3's shape through lanes: ``--lane --stack 64 --inflight 8``. Its full
batches go through the device process's pipeline (``FrontendsWorker._pipe``, answered a loop
trip later), as a --frontends worker's lanes do by default since session 24
(``Q6SERVE_DP_LANE_PIPE``); ``--no-lane-pipe``: each lane flush waits for its own launches
(the path this probe measured before session 25). On the CUDA backend the launches out are
polled by their slots' events (ready polling), as in ``FrontendsWorker.start``.

``--gpu-us US`` (a model of the GPU, for the CPU): the NumPy backend's weights and checks, but
each launch only *models* a GPU: it copies x into a pinned-like upload buffer unless x was
built there (``staging``) or lies in a page-locked region (as the CUDA backend), takes
``--launch-us`` of host CPU (the rest of the CUDA host path: graph launch, copies enqueued),
its "GPU work" takes US on one in-order stream (a launch starts when the previous one ends),
and its wait sleeps until then, as a CUDA sync waits without the GIL; launch slots (2 for the
batcher, 3 for launch_now) and page-locked regions with y routes (``HostIO``), as the CUDA
backend has. y's bytes are not
computed (zeros; a routed y is left as it is): what is measured is the device process's host
path and how it overlaps the modelled GPU, e.g.
T3's shape with regions: ``--gpu-us 130 --region --stack 64 --rows 3584 --k 18944``.

``--parts`` (with ``--lane``): where one pipelined lane call's loop time goes, without a
sampler (py-spy's slowdown sends lane calls down the queued path): perf_counter around the
functions in ``PARTS`` (inclusive; indented under their callers), summed over the timed
window and printed per call. The wrappers add ~0.3 us each; compare totals without it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from q6serve.kernels.cuda.launch import BATCH_SLOTS, SLOTS

# --parts: the functions timed (inclusive), as (module, class or None, attribute, label);
# "+" after the attribute: the function it returns (a launch's finish) is timed as well
PARTS = [
    ("q6serve.service.lane", "_LaneConn", "data_received", "lane read (parse + _direct)"),
    ("q6serve.service.lane", "LaneServer", "_direct", " _direct (checks, views, route)"),
    ("q6serve.service.regions", "RegionTable", "hold", "  table.hold"),
    ("q6serve.service.regions", "Region", "array", "  region.array (x2)"),
    ("q6serve.service.regions", "RegionTable", "route", "  table.route"),
    ("q6serve.service.lane", "LaneServer", "_flush", "lane _flush (pipeline, all)"),
    ("q6serve.service.engine", "Engine", "launch_now+", " engine.launch_now"),
    ("q6serve.service.batcher", "Batcher", "can_launch_now", "  batcher.can_launch_now"),
    ("q6serve.service.engine", "Engine", "_admit", "  engine._admit"),
    ("q6serve.service.batcher", "Batcher", "launch_now", "  batcher.launch_now"),
    ("q6serve.service.engine", None, "launch_ieee", "   api.launch_ieee"),
    ("__main__", "ModelGpu", "launch", "    backend launch (model)"),
    ("__main__", "ModelRegionCall", "launch", "    region call launch (model)"),
    ("q6serve.kernels.cuda.launch", "RegionCall", "launch", "    region call launch (CUDA)"),
    ("q6serve.kernels.cuda.launch", "RegionCall", "_run_streams", "     with the copy streams"),
    ("q6serve.kernels.cuda.launch", "RegionCall", "_wait", "    region call wait (CUDA)"),
    ("q6serve.service.batcher", "Batcher", "_now_reply", "  batcher._now_reply"),
    ("q6serve.service.frontends", "FrontendsWorker", "_pipe", " worker._pipe (launch, slot)"),
    ("q6serve.service.frontends", "FrontendsWorker", "_settle", " worker._settle (waits)"),
    ("q6serve.service.frontends", "FrontendsWorker", "_tick", "worker._tick (a trip later)"),
    ("q6serve.service.lane", "LaneServer", "_answer", " lane _answer"),
    ("q6serve.service.regions", "RegionTable", "unroute", "  table.unroute"),
    ("q6serve.service.lane", "_LaneConn", "answer", "  conn.answer (write)"),
    ("q6serve.service.regions", "RegionTable", "let_go", "  table.let_go"),
    ("q6serve.service.engine", "Engine", "_on_batch", "engine._on_batch (metrics)"),
]


class Parts:
    """``--parts``: inclusive perf_counter time of each function in PARTS, summed (no sampler,
    so the path taken is the unperturbed one; each wrapper adds ~0.3 us to its callers)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.on = False

    def _timed(self, fn: Any, label: str, returns: bool) -> Any:
        s, n, pc = self.s, self.n, time.perf_counter
        s.setdefault(label, 0.0)
        n.setdefault(label, 0)
        if returns:  # (listed after its launch)
            s.setdefault(label + " finish", 0.0)
            n.setdefault(label + " finish", 0)

        def timed(*args: Any, **kw: Any) -> Any:
            t = pc()
            try:
                r = fn(*args, **kw)
            finally:
                if self.on:
                    s[label] += pc() - t
                    n[label] += 1
            return self._timed(r, label + " finish", False) if returns and r else r

        return timed

    def install(self) -> None:
        import importlib

        for mod, cls, attr, label in PARTS:
            returns = attr.endswith("+")
            attr = attr.rstrip("+")
            owner: Any = sys.modules[mod] if mod == "__main__" else importlib.import_module(mod)
            if cls is not None:
                owner = getattr(owner, cls)
            setattr(owner, attr, self._timed(owner.__dict__[attr] if cls else
                                             getattr(owner, attr), label, returns))

    def report(self, calls: int, loop_s: float) -> str:
        lines = [f"parts, inclusive, per lane call ({calls} calls; loop thread "
                 f"{loop_s / calls * 1e6:.1f} us a call with the wrappers):"]
        for label in self.s:
            if self.n[label]:
                lines.append(f"  {label:<36} {self.s[label] / calls * 1e6:7.2f} us "
                             f"({self.n[label] / calls:.2f} a call)")
        return "\n".join(lines)


class ModelGpu:
    """The CUDA backend's host side over a modelled GPU (``--gpu-us``): the NumPy backend for
    weights and checks, launches that take ``launch_s`` of CPU and end ``gpu_s`` after the
    previous one ends (one in-order stream), waits that sleep until then."""

    name = "cuda"  # (Device's hand-off yield, as on CUDA)
    launch_slots, now_slots = BATCH_SLOTS, SLOTS  # (as CudaBackend's)

    def __init__(self, inner: Any, gpu_s: float, launch_s: float,
                 region_launch_s: float = 5e-6, piece_s: float = 2e-6) -> None:
        from q6serve.kernels import api
        from q6serve.kernels.hostio import HostIO

        self._api = api
        self.inner, self.gpu_s, self.launch_s = inner, gpu_s, launch_s
        self.region_launch_s = region_launch_s
        self.piece_s = piece_s  # a gathered x's DMA a piece (host CPU: its enqueue)
        self._pieces = 0  # the staged placeholder's pieces (``gathered``), 0: staged
        self.hostio = HostIO()  # ranges recorded, y routes answered
        self._free_at = 0.0  # when the modelled stream has done everything launched so far
        # the pinned upload buffers of the launch slots: x is copied into the next one unless
        # it was built there (``staging``), as the CUDA backend does
        self._upload = [np.empty(0, np.uint8)] * self.now_slots
        self._staged: np.ndarray | None = None
        self.launches = 0
        self.busy_s = 0.0  # modelled GPU seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        return self.launch(w, x, **kw).wait()

    def _host(self, nbytes: int) -> np.ndarray:
        slot = self.launches % self.now_slots
        if self._upload[slot].size < nbytes:
            self._upload[slot] = np.zeros(nbytes, np.uint8)  # (faulted in once)
        return self._upload[slot][:nbytes]

    def staging(self, n: int, k: int, dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        self._staged = self._host(n * k * dt.itemsize).view(dt).reshape(n, k)
        self._pieces = 0
        return self._staged

    def gathered(self, pieces: Any, n: int, k: int, dtype: Any) -> np.ndarray | None:
        """As ``CudaBackend.gathered``: a placeholder x whose launch DMAs each page-locked
        piece into the device's x (modelled: ``piece_s`` of host CPU a piece, one
        cudaMemcpyAsync each, and no host copy), None where a piece is not page-locked."""
        if not all(self.hostio.covers_range(p, nb) for p, nb in pieces):
            return None
        x = self.staging(n, k, dtype)
        self._pieces = len(pieces)
        return x

    def launch(self, w: Any, x: np.ndarray, *, precision: Any = None, flags: Any = None,
               out_dtype: Any = None, topk: int = 0) -> Any:
        api = self._api
        x = api.check_matmul(w, x, topk)
        # the host copy into the pinned upload buffer, unless x was built there or lies in a
        # page-locked region (the CUDA backend DMAs such an x in place: no copy)
        if x is not self._staged and not self.hostio.covers(x):
            self._host(x.nbytes)[...] = x.reshape(-1).view(np.uint8)
        spin = self.launch_s + (self.piece_s * self._pieces if x is self._staged else 0.0)
        self._staged, self._pieces = None, 0
        kernel, resolved = self.inner.plan(x.shape[0], precision or api.Precision.AUTO,
                                           flags or api.DEFAULT_FLAGS)
        t = time.perf_counter()
        while time.perf_counter() - t < spin:  # the host path's CPU
            pass
        take = getattr(self.hostio, "take", None)  # (a base tree's HostIO may have none)
        route = take(x, w.rows, out_dtype) if take is not None else None
        y = route.y if route is not None else self.hostio.output(x, w.rows, out_dtype)
        if y is None:
            y = np.zeros((x.shape[0], w.rows), out_dtype or np.float32)
        result = api.MatmulResult(y, kernel, w.layout, resolved,
                                  api.KernelTiming(host_seconds=self.gpu_s))
        if route is not None and getattr(route, "want", False):  # as CudaBackend: RegionCall
            route.call = ModelRegionCall(self, result)
        return self.gpu(result)

    def gpu(self, result: Any) -> Any:
        """The modelled GPU work of one launch: ends ``gpu_s`` after the previous one."""
        end = max(time.perf_counter(), self._free_at) + self.gpu_s
        self._free_at = end
        self.launches += 1
        self.busy_s += self.gpu_s

        def wait() -> Any:
            left = end - time.perf_counter()
            if left > 0:
                time.sleep(left)
            return result

        return self._api.Launched(wait)


class ModelRegionCall:
    """The CUDA backend's ``RegionCall`` over the modelled GPU: ``region_launch_s`` of host
    CPU (one graph launch and an event record: ``--region-launch-us``), then the GPU work."""

    def __init__(self, gpu: ModelGpu, result: Any) -> None:
        self.g, self.result = gpu, result

    def live(self) -> bool:
        return True

    def launch(self) -> Any:
        t = time.perf_counter()
        while time.perf_counter() - t < self.g.region_launch_s:
            pass
        return self.g.gpu(self.result)


async def run(a: argparse.Namespace, parts: Parts | None = None) -> dict[str, Any]:
    from q6serve.kernels import q6k
    from q6serve.kernels.backends import make_backend
    from q6serve.service import frontends as fe
    from q6serve.service import frontends_ipc as ipc
    from q6serve.service.config import WorkerConfig
    from q6serve.service.engine_types import UploadSpec

    cfg = WorkerConfig(max_batch_rows=64, frontends=1)
    backend = make_backend(a.backend)
    if a.gpu_us:
        backend = ModelGpu(backend, a.gpu_us * 1e-6, a.launch_us * 1e-6,
                           a.region_launch_us * 1e-6)
    worker = fe.FrontendsWorker(cfg, backend)
    worker._init_metrics()
    worker.engine = engine = worker.make_engine()
    if worker.ready_poll:  # (as FrontendsWorker.start: the CUDA launcher's slots' events)
        worker._ws = getattr(getattr(worker.backend, "launcher", None), "ws", None)
        worker._ws_slots = SLOTS
    data = q6k.random_blocks(a.rows, a.k, np.random.default_rng(1)).tobytes()

    async def once() -> Any:
        yield data

    await engine.upload(UploadSpec("w", a.rows, a.k, "q6_k", len(data),
                                   hashlib.sha256(data).hexdigest()), once())
    slot_bytes = max(a.stack * max(a.k * 2, a.rows * 4), 4096)
    arena = fe.Arena.create(a.inflight, slot_bytes)
    regions: list[Any] = []
    if a.region:  # one region per message: x at 0, y after it
        from q6serve.client.shm import ShmRegion
        from q6serve.service.regions import ShmSource, table_for

        worker.regions = table_for(True, 1024, 1 << 40, worker.backend, engine)
        if worker.regions.hostio is not None:  # (as FrontendsWorker.start; a base tree's
            # worker has no region gather: the attribute is then not read)
            worker._region_gather = getattr(worker.backend, "gathered", None)
        for i in range(a.inflight):
            r = ShmRegion.create(f"ipc{os.getpid()}_{i}", 2 * slot_bytes)
            worker.regions.register("", r.name, ShmSource(r.key, 0, 2 * slot_bytes))
            regions.append(r)
    loop = asyncio.get_running_loop()
    answered = [0]
    running = [True]
    resend: list[bytes] = []
    frames = []  # one prebuilt request per slot (its request id is its slot)
    for slot in range(a.inflight):
        x = arena.array(slot, np.dtype("<f2"), (a.stack, a.k), writable=True)
        x[...] = np.random.default_rng(slot).uniform(-1, 1, x.shape)
        if a.region:
            regions[slot].ndarray(0, np.dtype("<f2"), x.shape)[...] = x
            payload = ipc._encode(("rm", slot, "", (regions[slot].name, 0, "f16",
                                                   (a.stack, a.k)),
                                  (regions[slot].name, slot_bytes), "w", a.precision, "f32",
                                  None))
        else:
            payload = ipc._encode(("mm", slot, "w", (), 0, a.precision, "f32", None,
                                  ("f16", (a.stack, a.k)), slot))
        frames.append(ipc.FRAME.pack(len(payload)) + payload)
    del x

    lane = None
    if a.lane:  # one fast-lane connection per region instead of a front end
        deliver, lane = _lane_ends(a, worker, engine, regions, slot_bytes, answered,
                                   running)
        arena.unlink()
        deliver()
    else:
        class FrontEnd:
            """The transport the device process writes to: each answer sends its slot's
            request again, the whole trip's worth in one read."""

            def write(self, data: bytes) -> None:
                pos = 0
                while pos < len(data):
                    (n,) = ipc.FRAME.unpack_from(data, pos)
                    start, pos = pos + ipc.FRAME.size, pos + ipc.FRAME.size + n
                    if data[start] != 0x52:  # not b"R", an answer in the slot: the hello's ack,
                        msg = ipc._decode(data[start:pos])  # a region call's answer, or, once
                        if msg[0] == "rmok":  # stopped, a refusal
                            rid = msg[1]
                        else:
                            if msg[0] != "ack" and running[0]:
                                sys.exit(f"unexpected answer {msg!r}")
                            continue
                    else:
                        rid = int.from_bytes(data[start + 1 : start + 9], "little")
                    answered[0] += 1
                    if not running[0]:
                        continue
                    if not resend:
                        loop.call_soon(deliver)
                    resend.append(frames[rid])

            def is_closing(self) -> bool:
                return False

        conn = fe._FrontConnection(worker)
        fe._Peer.connection_made(conn, FrontEnd())  # type: ignore[arg-type]  # (no peer pid)
        conn.message(("hello", 0, os.getpid(), arena.name, a.inflight, slot_bytes))
        arena.unlink()

        def deliver() -> None:
            batch = b"".join(resend)
            resend.clear()
            conn.data_received(batch)

        resend.extend(frames)
        deliver()
    await asyncio.sleep(a.warmup)
    if parts is not None:
        parts.on = True
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    g0 = getattr(backend, "busy_s", 0.0)
    n0, c0, t0, j0 = answered[0], time.process_time(), time.perf_counter(), engine.device.jobs
    l0 = time.thread_time()  # the loop's own thread (the device thread's CPU is not in it)
    await asyncio.sleep(a.seconds)
    n1, c1, t1, j1 = answered[0], time.process_time(), time.perf_counter(), engine.device.jobs
    l1 = time.thread_time()
    g1 = getattr(backend, "busy_s", 0.0)
    if parts is not None:
        parts.on = False
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)
    running[0] = False
    while engine.device.inflight or worker._pending:  # the last answers, before closing
        await asyncio.sleep(0.01)
    await engine.close()
    if lane is not None:
        lane.close()
    arena.close()
    for r in regions:
        worker.regions.unregister("", r.name)  # type: ignore[union-attr]
        r.on_close = None
        r.close()
    msgs = n1 - n0
    return {"backend": a.backend, "rows": a.rows, "k": a.k, "stack": a.stack,
            "inflight": a.inflight, "messages": msgs, "messages_per_s": msgs / (t1 - t0),
            "cpu_us_per_message": (c1 - c0) / msgs * 1e6,
            "cpu_us_per_call": (c1 - c0) / (msgs * a.stack) * 1e6,
            "loop_cpu_us_per_message": (l1 - l0) / msgs * 1e6,
            "messages_per_batch": msgs / max(j1 - j0, 1), "region": a.region,
            "merge": worker.merge,
            "jobs": engine.device.jobs, "inline_jobs": engine.device.inline_jobs,
            "direct_jobs": engine.device.direct_jobs,
            "deferred_jobs": engine.device.deferred_jobs,
            "behind_jobs": engine.device.behind_jobs,
            # the lane's pipelines: full batches per _flush (a flush starts and ends with the
            # GPU idle: the records of a trip are read before it, the last waited for in it)
            "calls_per_flush": (lane.piped / lane.flushes if lane is not None and lane.flushes
                                else None),
            # launches through the device process's pipeline (FrontendsWorker._pipe: the
            # lanes' full batches by default, full system-region calls), answered a trip later
            "pipelined": worker.pipelined[0],
            "gpu_busy": (g1 - g0) / (t1 - t0) if a.gpu_us else None,
            "parts": parts.report(msgs, l1 - l0) if parts is not None else None}


def _lane_ends(a: argparse.Namespace, worker: Any, engine: Any, regions: list[Any],
               slot_bytes: int, answered: list[int], running: list[bool]) -> tuple[Any, Any]:
    """--lane: one fast-lane connection per region (service/lane.py's ``_LaneConn``, its
    ticket taken, no socket), each with one request record in flight: x at 0, y at
    ``slot_bytes`` of its region. Each reply sends that lane's record again; the records of a
    loop trip arrive in the next, each lane's read a handle of its own (as the selector's
    events become handles: ``LaneServer._lane_ready`` sees the others waiting).
    Returns (deliver, the LaneServer)."""
    from q6serve.client import core
    from q6serve.service.lane import REPLY, REQUEST, LaneServer, Ticket, _LaneConn

    loop = asyncio.get_running_loop()
    server = LaneServer(worker.regions, engine)
    if worker.lane_pipe and not a.no_lane_pipe:  # (as _dev_region's open_lane: the default)
        server.pipe = worker._pipe
    f16, f32 = core._DTYPE_TO_PB["f16"], core._DTYPE_TO_PB["f32"]
    ready: list[int] = []

    class End:
        """A lane's transport: reads each reply record's status, queues the lane again."""

        def __init__(self, i: int) -> None:
            self.i = i

        def write(self, data: bytes) -> None:
            pos = 0
            while pos < len(data):
                _, code, msg_len, *_ = REPLY.unpack_from(data, pos)
                pos += REPLY.size + msg_len
                if code and running[0]:
                    sys.exit(f"lane request failed ({code}): {data[pos - msg_len:pos]!r}")
                answered[0] += 1
                if running[0]:
                    if not ready:
                        loop.call_soon(deliver)
                    ready.append(self.i)

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:  # (LaneServer.close closes its lanes)
            pass

        def _read_ready(self) -> None:  # (the name and owner a socket transport's read has)
            conns[self.i].data_received(records[self.i])

    conns, records, ends = [], [], []
    for i, r in enumerate(regions):
        c = _LaneConn(server)
        c.transport = End(i)  # type: ignore[assignment]
        server._lanes.add(c.transport)  # type: ignore[arg-type]
        c.ticket = Ticket("", r.name, float("inf"))
        conns.append(c)
        ends.append(c.transport)
        records.append(REQUEST.pack(i, a.stack, a.k, 0, slot_bytes, f16, f32, 0, 0, 1, 0)
                       + b"w")

    def deliver() -> None:  # each lane's read its own handle, as the selector's events are
        todo = list(ready)
        ready.clear()
        for i in todo:
            loop.call_soon(ends[i]._read_ready)

    ready.extend(range(len(conns)))
    return deliver, server


def dma_probe(x_bytes: int, y_bytes: int, reps: int = 30) -> dict[str, float]:
    """``--dma`` (CUDA): the copies a system-region call needs, alone on the GPU, timed by
    events (median of ``reps``, us): x's ``x_bytes`` host -> device and y's ``y_bytes`` device
    -> host from/to page-locked shared memory (``cudaHostRegister`` of a mapping, as
    ``HostIO.pin`` does a region), both at once on two streams (the copy streams'
    overlap), and x from pageable memory (what an unregistered buffer pays). The floor of a
    region call's copies: at N=64 on ffn_down, x 2.4 MB and y 0.9 MB."""
    import mmap

    import cupy as cp

    rt = cp.cuda.runtime
    maps = [mmap.mmap(-1, -(-b // 4096) * 4096) for b in (x_bytes, y_bytes)]
    hx, hy = (np.frombuffer(m, np.uint8) for m in maps)
    hx[:] = 1
    hy[:] = 0
    ax, ay = (int(h.ctypes.data) for h in (hx, hy))
    for a_, h in ((ax, hx), (ay, hy)):
        rt.hostRegister(a_, h.nbytes, 0)
    plain = np.ones(x_bytes, np.uint8)
    dx, dy = cp.empty(x_bytes, cp.uint8), cp.empty(y_bytes, cp.uint8)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    h2d, d2h = rt.memcpyHostToDevice, rt.memcpyDeviceToHost

    def timed(ops: list[tuple[Any, Any]]) -> float:
        """ops: (stream, enqueue(stream)); the span from the first start to the last end."""
        evs = []
        for st, fn in ops:
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(st)
            fn(st)
            e1.record(st)
            evs.append((e0, e1))
        for _, e1 in evs:
            e1.synchronize()
        t0 = evs[0][0]  # (recorded first)
        return max(cp.cuda.get_elapsed_time(t0, e1) for _, e1 in evs) * 1e3

    def xin(st: Any) -> None:
        rt.memcpyAsync(dx.data.ptr, ax, x_bytes, h2d, st.ptr)

    def yout(st: Any) -> None:
        rt.memcpyAsync(ay, dy.data.ptr, y_bytes, d2h, st.ptr)

    def xplain(st: Any) -> None:
        rt.memcpyAsync(dx.data.ptr, int(plain.ctypes.data), x_bytes, h2d, st.ptr)

    cases = {"x in (page-locked)": [(s1, xin)], "y out (page-locked)": [(s1, yout)],
             "x in + y out, two streams": [(s1, xin), (s2, yout)],
             "x in (pageable)": [(s1, xplain)]}
    out = {}
    for name, ops in cases.items():
        timed(ops)  # (warm)
        out[name] = float(np.median([timed(ops) for _ in range(reps)]))
    for a_ in (ax, ay):
        rt.hostUnregister(a_)
    return out  # (the mappings go with the process: numpy views of them are alive here)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cuda"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--stack", type=int, default=4, help="calls (rows) per message")
    ap.add_argument("--precision", default="auto",
                    help="the requests' precision (f16: T2's, which merged batches gather)")
    ap.add_argument("--inflight", type=int, default=8, help="messages outstanding")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--region", action="store_true",
                    help="x and y in a system shm region per message (the 'rm' message)")
    ap.add_argument("--no-lane-pipe", action="store_true",
                    help="--lane: the lanes' full batches waited for in their own flush, not "
                         "through the device process's pipeline (Q6SERVE_DP_LANE_PIPE=0; the "
                         "pipeline is a --frontends worker's default since session 24)")
    ap.add_argument("--lane", action="store_true",
                    help="x and y in a region per lane, each call a fast-lane request record "
                         "(service/lane.py) instead of a front end's message (implies --region)")
    ap.add_argument("--gpu-us", type=float, default=0.0,
                    help="model the GPU: each launch's device work takes this long (see above)")
    ap.add_argument("--launch-us", type=float, default=20.0,
                    help="--gpu-us: host CPU each launch takes (the CUDA host path)")
    ap.add_argument("--region-launch-us", type=float, default=5.0,
                    help="--gpu-us: host CPU a lane plan's region call takes (one graph "
                         "launch and an event record: CUDA's RegionCall)")
    ap.add_argument("--profile", type=Path, metavar="FILE",
                    help="cProfile the timed part into FILE (pstats)")
    ap.add_argument("--parts", action="store_true",
                    help="--lane: time the lane call's parts (perf_counter around the "
                         "functions in PARTS, no sampler) and print them per call")
    ap.add_argument("--dma", action="store_true",
                    help="(CUDA) only time the copies of a system-region call of --stack rows "
                         "(x f16 in, y f32 out; see dma_probe) and exit")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.dma:
        got = dma_probe(a.stack * a.k * 2, a.stack * a.rows * 4)
        for name, us in got.items():
            nbytes = a.stack * (a.rows * 4 if name.startswith("y") else a.k * 2)
            if "+" in name:
                nbytes = a.stack * (a.rows * 4 + a.k * 2)
            print(f"dma {name}: {us:.1f} us ({nbytes / us / 1e3:.1f} GB/s)", flush=True)
        if a.json:
            a.json.write_text(json.dumps(got, indent=1))
        return 0
    a.region = a.region or a.lane
    if a.gpu_us:  # the modelled waits end on time (a CUDA sync spins; Linux's default timer
        import ctypes  # slack would add ~50 us to each sleep); threads made later inherit it

        ctypes.CDLL(None).prctl(29, 1000)  # PR_SET_TIMERSLACK: 1 us
    parts = None
    if a.parts:
        parts = Parts()
        parts.install()
    r = asyncio.run(run(a, parts))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1))
    print(f"device process alone, {a.backend} {a.rows}x{a.k}, {a.inflight} messages of "
          f"{a.stack} calls in flight: {r['messages_per_s']:,.0f} messages/s, CPU "
          f"{r['cpu_us_per_message']:.1f} us per message (loop thread "
          f"{r['loop_cpu_us_per_message']:.1f}) = {r['cpu_us_per_call']:.1f} us per "
          f"call; {r['messages_per_batch']:.1f} messages per batch ({r['inline_jobs']}/"
          f"{r['jobs']} device jobs inline, {r['direct_jobs']} of them on the direct path, "
          f"{r['deferred_jobs']} launched and waited on the "
          f"thread, {r['behind_jobs']} behind another)"
          + (f"; modelled GPU busy {r['gpu_busy']:.0%}" if a.gpu_us else ""), flush=True)
    if r["calls_per_flush"] is not None:
        print(f"lane pipelines: {r['calls_per_flush']:.1f} full batches per flush", flush=True)
    if r["parts"]:
        print(r["parts"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
