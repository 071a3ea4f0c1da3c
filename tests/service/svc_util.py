"""Service test helpers: an in-process worker on its own loop thread, random Q6_K weights."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from q6serve.client.client import Client, Q6ServeError
from q6serve.kernels import q6k
from q6serve.kernels.api import Backend
from q6serve.service.config import WorkerConfig
from q6serve.service.worker import Worker


def random_q6k(rows: int, k: int, seed: int) -> np.ndarray:
    """Valid random Q6_K AoS blocks ``[rows*k/256, 210]`` with small finite scales."""
    return q6k.random_blocks(rows, k, np.random.default_rng(seed))


async def numpy_engine(name: str, rows: int, k: int) -> Any:
    """An in-process Engine on the NumPy backend (any known cost inlines: a loaded CI
    machine's thread job can take longer than the default 3 ms) with random Q6_K weight
    ``name`` of ``rows`` x ``k`` uploaded."""
    import hashlib

    from q6serve.kernels.numpy_backend import NumpyBackend
    from q6serve.service.engine import Engine
    from q6serve.service.engine_types import UploadSpec

    eng = Engine(NumpyBackend(), WorkerConfig(inline_device_us=10**9))
    data = q6k.random_blocks(rows, k, np.random.default_rng(0)).tobytes()

    async def chunks() -> Any:
        yield data

    await eng.upload(UploadSpec(name, rows, k, "q6_k", len(data),
                                hashlib.sha256(data).hexdigest()), chunks())
    return eng


def reference(blocks: np.ndarray, rows: int, k: int, x: np.ndarray) -> np.ndarray:
    """float64 ``x @ W.T`` on exactly dequantized weights."""
    w = q6k.dequantize_aos(blocks, rows, k).astype(np.float64)
    return np.asarray(x, dtype=np.float64) @ w.T


def backend_name() -> str:
    """The backend under test: numpy in CI; Q6SERVE_TEST_BACKEND=cuda on a GPU machine."""
    return os.environ.get("Q6SERVE_TEST_BACKEND", "numpy")


def auto_rtol() -> float:
    """Tolerance for precision=auto results: exact on NumPy; the GPU's AUTO may be q8_1."""
    return 1e-5 if backend_name() == "numpy" else 3e-2


def make_backend() -> Backend:
    from q6serve.kernels.backends import make_backend as mk

    return mk(backend_name())


class RunningWorker:
    """A Worker on a private event loop thread; ``call`` runs coroutines on that loop."""

    def __init__(self, config: WorkerConfig, backend: Backend | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.registry = CollectorRegistry()
        self.worker = Worker(config, backend or make_backend(), self.registry)
        self.call(self.worker.start())
        self.target = self.worker.target
        self.clients: list[Client] = []

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run a plain callable on the loop thread (e.g. to read engine state)."""
        async def wrap() -> Any:
            return fn()

        return self.call(wrap())

    @property
    def engine(self) -> Any:
        return self.worker.engine

    def client(self, **kw: Any) -> Client:
        c = Client(self.target, **kw)
        self.clients.append(c)
        return c

    def stop(self, grace: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        for c in self.clients:
            c.close()
        self.call(self.worker.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class ForwardingBackend(Backend):
    """A backend that hands every call to ``inner``: the one place the test wrappers
    (InstrumentedBackend here, tests/reliability's FaultyBackend) forward the Backend methods
    they do not change, so a method added to Backend is forwarded by all of them at once."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        return self.inner.matmul(w, x, **kw)

    def load(self, chunks: Any, rows: int, k: int, layout: Any, chunk_bytes: int) -> Any:
        return self.inner.load(chunks, rows, k, layout, chunk_bytes)

    def device_name(self) -> str:
        return self.inner.device_name()

    def memory(self) -> Any:
        return self.inner.memory()

    def weight_nbytes(self, rows: int, k: int, layout: Any) -> int:
        return self.inner.weight_nbytes(rows, k, layout)

    def load_scratch_nbytes(self, rows: int, k: int, chunk_bytes: int) -> int:
        return self.inner.load_scratch_nbytes(rows, k, chunk_bytes)

    def relayout(self, w: Any, layout: Any, chunk_bytes: int) -> Any:
        return self.inner.relayout(w, layout, chunk_bytes)

    def relayout_scratch_nbytes(self, rows: int, k: int, layout: Any, chunk_bytes: int) -> int:
        return self.inner.relayout_scratch_nbytes(rows, k, layout, chunk_bytes)

    def free(self, w: Any) -> None:
        self.inner.free(w)

    def read_aos(self, w: Any) -> np.ndarray:
        return self.inner.read_aos(w)

    def plan(self, n: int, precision: Any, flags: Any) -> Any:
        return self.inner.plan(n, precision, flags)

    def close(self) -> None:
        self.inner.close()


class InstrumentedBackend(ForwardingBackend):
    """Wraps the test backend: optional matmul delay, a log of launched N, injected load
    failures. Everything else is forwarded unchanged."""

    def __init__(self, matmul_delay: float = 0.0, fail_load_call: int | None = None) -> None:
        super().__init__(make_backend())
        self.matmul_delay = matmul_delay
        self.fail_load_call = fail_load_call
        self.launches: list[int] = []
        self.loads = 0

    def matmul(self, w: Any, x: np.ndarray, **kw: Any) -> Any:
        self.launches.append(int(x.shape[0]))
        if self.matmul_delay:
            time.sleep(self.matmul_delay)
        return self.inner.matmul(w, x, **kw)

    def load(self, chunks: Any, rows: int, k: int, layout: Any, chunk_bytes: int) -> Any:
        from q6serve.kernels.errors import DeviceError

        self.loads += 1
        if self.fail_load_call is not None and self.loads == self.fail_load_call:
            raise DeviceError(f"injected allocation failure on load #{self.loads}")
        return self.inner.load(chunks, rows, k, layout, chunk_bytes)


def write_gguf(path: Path, tensors: dict[str, tuple[int, int, int]]) -> dict[str, np.ndarray]:
    """Write ``{name: (rows, k, seed)}`` random Q6_K tensors; return their AoS blocks."""
    from q6serve.kernels.gguf_io import write_q6k_gguf

    blocks = {n: random_q6k(r, k, s) for n, (r, k, s) in tensors.items()}
    write_q6k_gguf(path, {n: (blocks[n], r, k) for n, (r, k, _) in tensors.items()})
    return blocks


def assert_close(y: np.ndarray, want: np.ndarray, rtol: float | None = None) -> None:
    """Equal to the float64 reference within ``rtol`` (default: auto_rtol()) of the scale."""
    rtol = auto_rtol() if rtol is None else rtol
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(y - want).max())
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:.1g} x scale {scale:.3g}"


@dataclass
class Callers:
    """Caller threads started by :func:`verified_callers`; ``stop`` ends them."""

    threads: list[threading.Thread]
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    ok: list[int] = field(default_factory=list)  # verified results, per thread

    def join(self, timeout: float = 30.0) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout)


def verified_callers(target: str, blocks: np.ndarray, rows: int, k: int, allowed: set[Any],
                     threads: int = 6, max_n: int = 3, client_kw: dict[str, Any] | None = None,
                     **matmul_kw: Any) -> Callers:
    """``threads`` threads, each its own Client calling ``matmul("w", x)`` with 1..max_n
    random tokens until ``stop``, every y checked against the float64 reference with EXACT's
    contract (:func:`assert_close`, 1e-5 of the output's scale: each row's f32 sums depend on
    the batch it ran in). A refusal whose code is in ``allowed`` is expected (e.g. NOT_FOUND
    while the weight is away); any other refusal or a wrong y goes to ``errors``."""
    got = Callers(threads=[], ok=[0] * threads)

    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(target, **(client_kw or {})) as c:
            while not got.stop.is_set():
                x = rng.standard_normal((1 + seed % max_n, k)).astype(np.float32)
                try:
                    y = c.matmul("w", x, **matmul_kw)
                except Q6ServeError as e:
                    if e.code not in allowed:
                        got.errors.append(e)
                    continue
                try:
                    assert_close(y, reference(blocks, rows, k, x), 1e-5)
                    got.ok[seed] += 1
                except AssertionError as e:
                    got.errors.append(e)

    got.threads = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in got.threads:
        t.start()
    return got


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` (bounded) instead of sleeping a guessed time."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@contextlib.contextmanager
def matmul_stream(target: str) -> Iterator[tuple[Callable[[Any], Any], Any]]:
    """``(ask, stub)``: a MatmulStream on its own channel, asked one request at a time
    (``ask(req)`` sends ``req`` and returns its reply), and a stub on the same channel for
    other calls. On a clean exit the stream is ended, and it must have no reply left over."""
    import grpc

    from q6serve.v1 import q6serve_pb2_grpc as pb_grpc

    sent: queue.Queue[Any] = queue.Queue()
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.Q6ServeStub(ch)
        replies = stub.MatmulStream(iter(sent.get, None), timeout=60)

        def ask(req: Any) -> Any:
            sent.put(req)
            return next(replies)

        try:
            yield ask, stub
        finally:
            sent.put(None)  # (on an error too: the stream ends instead of waiting)
        assert list(replies) == []


def matmul_request(weight: str | list[str], x: np.ndarray, topk: int | None = None,
                   **kw: Any) -> Any:
    """A raw MatmulRequest (exact precision): one weight, or several (a multi-weight one),
    with the top-k epilogue when ``topk`` is given (0 included); ``kw``: other fields."""
    from q6serve.client.client import fill_tensor
    from q6serve.v1 import q6serve_pb2 as pb

    req = pb.MatmulRequest(precision=pb.PRECISION_EXACT, **kw)
    if isinstance(weight, str):
        req.weight = weight
    else:
        req.weights.extend(weight)
    if topk is not None:
        req.topk.k = topk
    fill_tensor(req.x, x)
    return req


def process_tree(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc: each process's parent), ``pid`` not
    included."""
    kids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().split(")")[-1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if ppid == pid:
            kids += [int(p), *process_tree(int(p))]
    return kids
