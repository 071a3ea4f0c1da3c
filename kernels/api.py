"""The backend API shared by the NumPy and CUDA backends.

The service talks to a :class:`Backend` only through this module: arrays and plain dataclasses
in, arrays out. Nothing here knows about gRPC, metrics or flags' sources.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from . import q6k
from .epilogue import TopK, check_k
from .errors import FailedPrecondition, FormatError, InvalidArgument, Q6Error

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# Activation/output dtypes accepted on the wire and by every backend.
DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": BFLOAT16,
}


def dtype_name(dt: np.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dt:
            return name
    raise FormatError(f"unsupported dtype {dt}; use one of {', '.join(DTYPES)}")


# The words a 0/1 switch takes: the kill-switch flags (service/flags.py), the worker's tuning
# variables (service/envvars.py) and the kernels' own (Q6SERVE_PDL, kernels/cuda/launch.py).
_TRUE = frozenset(("1", "true", "on", "yes"))
_FALSE = frozenset(("0", "false", "off", "no"))


def parse_bool(name: str, text: str) -> bool:
    """``text`` (a switch's value, e.g. an environment variable's) as a bool; other words are
    refused, naming ``name``."""
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise InvalidArgument(f"{name}={text!r}: use 0 or 1")


def env_switch(name: str, default: bool = True, env: Any = None) -> bool:
    """The switch variable ``name`` of ``env`` (os.environ if None): unset or empty,
    ``default``; else :func:`parse_bool` (other words refused, naming it)."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    return default if not raw else parse_bool(name, raw)


class Precision(enum.StrEnum):
    """Numerics of one matmul call (see docs/KERNELS.md for the error contract)."""

    AUTO = "auto"  # fastest path of this backend under the current flags
    EXACT = "exact"  # f32 math on exactly dequantized weights
    F16 = "f16"  # activations rounded to f16, tensor-core f16 MMA
    Q8_1 = "q8_1"  # activations quantized to q8_1, int8 MMA (llama.cpp numerics)


class Layout(enum.StrEnum):
    SOA = "soa"
    AOS = "aos"


@dataclass(frozen=True)
class KernelFlags:
    """The kill-switches that reach the kernels (the service owns where they come from)."""

    soa: bool = True  # Q6SERVE_Q6K_SOA: 0 = AoS everywhere
    decode_mmq: bool = True  # Q6SERVE_DECODE_MMQ: 0 = no decode MMQ tile

    @property
    def layout(self) -> Layout:
        return Layout.SOA if self.soa else Layout.AOS


DEFAULT_FLAGS = KernelFlags()


@dataclass
class KernelTiming:
    """Kernel time of one call: host-timed (NumPy), or device events around the kernels only
    (CUDA: read right after the batch's one sync, so ``host_seconds`` is set at return), or
    events still to be read (``_events``).

    ``seconds()`` never forces a device sync on the hot path: with pending events it returns
    None until the end event has completed and the service reads it after the reply is sent.
    """

    host_seconds: float | None = None
    _events: Any = None  # (start, end) device events, backend-specific

    def seconds(self, wait: bool = False) -> float | None:
        if self._events is None:
            return self.host_seconds
        start, end = self._events
        if not wait and not end.done:
            return None
        end.synchronize()
        from cupy.cuda import get_elapsed_time  # only reached on the CUDA backend

        return get_elapsed_time(start, end) / 1e3


@dataclass
class MatmulResult:
    y: np.ndarray | None  # [N, rows] in the requested output dtype; None with a top-k epilogue
    kernel: str  # e.g. "numpy.exact", "cuda.matvec.soa"
    layout: Layout
    precision: Precision  # resolved (never AUTO)
    timing: KernelTiming = field(default_factory=KernelTiming)
    topk: TopK | None = None  # the epilogue's result (matmul(..., topk=k)) instead of y


class Launched:
    """A matmul started on its device (:meth:`Backend.launch`): :meth:`wait` blocks until it
    is done and returns its result. Call it once, from any thread, and before the backend's
    next launch (backends reuse their upload buffers and timing events between calls)."""

    __slots__ = ("_wait", "finished")

    def __init__(self, wait: Callable[[], MatmulResult], finished: bool = False) -> None:
        self._wait = wait
        self.finished = finished  # wait() returns at once: nothing to wait for elsewhere

    def wait(self) -> MatmulResult:
        return self._wait()

    @classmethod
    def ready(cls, result: MatmulResult) -> Launched:
        """An already finished call (backends that compute synchronously)."""
        return cls(lambda: result, finished=True)


class LaunchedMany(Launched):
    """A multi-weight call started on its device (:meth:`Backend.launch_many`): :meth:`wait`
    returns one :class:`MatmulResult` per weight, in order. The rules of :class:`Launched`."""

    __slots__ = ()

    def wait(self) -> list[MatmulResult]:  # type: ignore[override]
        return self._wait()  # type: ignore[return-value]

    @classmethod
    def ready(cls, results: list[MatmulResult]) -> LaunchedMany:  # type: ignore[override]
        return cls(lambda: results, finished=True)  # type: ignore[arg-type,return-value]


FlagsArg = KernelFlags | Sequence[KernelFlags]


def flags_of(flags: FlagsArg, parts: int) -> tuple[KernelFlags, ...]:
    """:meth:`Backend.launch_many`'s ``flags`` as one per weight (one given: for all)."""
    if isinstance(flags, KernelFlags):
        return (flags,) * parts
    out = tuple(flags)
    if len(out) != parts:
        raise InvalidArgument(f"{len(out)} kernel flags for {parts} weights")
    return out


@dataclass(frozen=True)
class MemoryInfo:
    """Device (or host, on NumPy) memory figures in bytes."""

    free: int
    total: int
    pool_used: int = 0  # bytes held by the backend's allocator pool
    pool_total: int = 0


@dataclass
class ResidentWeight:
    """A weight held by a backend. ``data`` is the backend's own storage."""

    rows: int
    k: int
    layout: Layout
    nbytes: int  # exactly what the backend allocated for it
    data: Any = None

    @property
    def n_blocks(self) -> int:
        return self.rows * (self.k // q6k.QK_K)


AosChunks = Iterable[bytes | memoryview | np.ndarray]


def iter_aos_chunks(aos: np.ndarray | bytes | memoryview, rows: int, k: int,
                    chunk_bytes: int) -> Iterator[np.ndarray]:
    """Split AoS bytes into chunks of whole rows no larger than ``chunk_bytes`` (>= 1 row)."""
    blocks = q6k.as_blocks(aos, rows, k)
    row_bytes = q6k.aos_nbytes(1, k)
    rows_per = max(1, chunk_bytes // row_bytes)
    per_row = k // q6k.QK_K
    for r0 in range(0, rows, rows_per):
        r1 = min(rows, r0 + rows_per)
        yield blocks[r0 * per_row : r1 * per_row]


class Backend(abc.ABC):
    """What every backend implements. All arrays are host NumPy arrays."""

    name: str
    # launches that may await their ``wait`` at once (the CUDA backend: its launch slots, so a
    # batch can be launched while the previous one runs); the NumPy backend computes at launch
    launch_slots: int = 1
    # precisions a call of this backend never resolves to Q8_1 at: launch_ieee asks plan()
    # for the others only (AUTO may resolve to Q8_1 where a backend says nothing; the CUDA and
    # NumPy backends list it: a call at AUTO then costs the host what one at F16 does)
    no_q8_1: frozenset[Precision] = frozenset((Precision.EXACT, Precision.F16))

    @property
    def now_slots(self) -> int:
        """Launches a ``launch_now`` pipeline (the lane's full batches) may keep in flight: the
        batcher's ``launch_slots`` unless the backend has more (CUDA: its launcher's slots)."""
        return self.launch_slots

    @abc.abstractmethod
    def device_name(self) -> str: ...

    @abc.abstractmethod
    def memory(self) -> MemoryInfo: ...

    @abc.abstractmethod
    def weight_nbytes(self, rows: int, k: int, layout: Layout) -> int:
        """Exact bytes :meth:`load` will allocate for such a weight (for reserve-before-alloc)."""

    @abc.abstractmethod
    def load_scratch_nbytes(self, rows: int, k: int, chunk_bytes: int) -> int:
        """Peak transient bytes while loading (staging + repack scratch)."""

    @abc.abstractmethod
    def load(self, chunks: AosChunks, rows: int, k: int, layout: Layout,
             chunk_bytes: int) -> ResidentWeight:
        """Build a resident weight from AoS chunks of whole rows, in order."""

    def relayout_scratch_nbytes(self, rows: int, k: int, layout: Layout,
                                chunk_bytes: int) -> int:
        """Peak transient bytes while re-laying such a weight to ``layout`` (beyond the growth
        of the weight itself, which the caller reserves as weight bytes)."""
        return self.load_scratch_nbytes(rows, k, chunk_bytes)

    @abc.abstractmethod
    def relayout(self, w: ResidentWeight, layout: Layout, chunk_bytes: int) -> ResidentWeight:
        """Return ``w`` re-laid to ``layout`` (same bytes, bounded scratch)."""

    @abc.abstractmethod
    def free(self, w: ResidentWeight) -> None: ...

    @abc.abstractmethod
    def read_aos(self, w: ResidentWeight) -> np.ndarray:
        """The weight's AoS bytes ``[n_blocks, 210]`` (for checks; not on the hot path)."""

    @abc.abstractmethod
    def plan(self, n: int, precision: Precision, flags: KernelFlags) -> tuple[str, Precision]:
        """Dispatch: the kernel name and resolved precision for N rows (raises if refused)."""

    @abc.abstractmethod
    def matmul(self, w: ResidentWeight, x: np.ndarray, *, precision: Precision = Precision.AUTO,
               flags: KernelFlags = DEFAULT_FLAGS, out_dtype: np.dtype | None = None,
               topk: int = 0) -> MatmulResult:
        """``y = x @ W.T`` for x ``[N, K]`` f32/f16/bf16; y ``[N, rows]`` (default f32).

        ``topk`` > 0: the top-k epilogue (kernels/epilogue.py) runs on the f32 y where y lives
        (on the device for CUDA) and the result carries ``topk`` instead of ``y``
        (``out_dtype`` is then ignored: the epilogue's values are f32)."""

    def launch(self, w: ResidentWeight, x: np.ndarray, *, precision: Precision = Precision.AUTO,
               flags: KernelFlags = DEFAULT_FLAGS, out_dtype: np.dtype | None = None,
               topk: int = 0) -> Launched:
        """:meth:`matmul` started without waiting for the device (refusals raise here, device
        errors may surface at ``wait()``). Default: computed now (NumPy)."""
        return Launched.ready(self.matmul(w, x, precision=precision, flags=flags,
                                          out_dtype=out_dtype, topk=topk))

    def launch_many(self, weights: Sequence[ResidentWeight], x: np.ndarray, *,
                    precision: Precision = Precision.AUTO, flags: FlagsArg = DEFAULT_FLAGS,
                    out_dtype: np.dtype | None = None, topk: int = 0) -> LaunchedMany:
        """One x applied to several weights of its K (a multi-weight call: q/k/v, gate/up):
        ``wait()`` returns one :class:`MatmulResult` per weight, in order, each as
        :meth:`launch` of that weight would (its kernel, layout, precision and kernel time).
        ``flags``: one for every weight, or one per weight. Every part is checked before any
        is launched (a refusal raises here, ``e.part`` the index of the weight it is about);
        device errors may surface at ``wait()``. The call holds one launch slot until its
        wait; x may be :meth:`staging`'s buffer.
        Default: each part's :meth:`launch` and wait in turn (computed now on NumPy); the
        CUDA backend launches every part's kernels in one sequence (kernels/cuda/launch.py)."""
        fl = flags_of(flags, len(weights))
        check_many(weights, x, topk)
        out = []
        for i, (w, f) in enumerate(zip(weights, fl, strict=True)):
            with part_error(i):
                out.append(self.launch(w, x, precision=precision, flags=f,
                                       out_dtype=out_dtype, topk=topk).wait())
        return LaunchedMany.ready(out)

    def staging(self, n: int, k: int, dtype: np.dtype) -> np.ndarray:
        """An ``[n, k]`` array to build the next :meth:`matmul`'s activations in (e.g. a batch
        concatenated straight into it). The CUDA backend hands out the pinned upload buffer of
        its next launch slot, so a call given this array skips its host copy; the array is
        valid until the next call on this backend (build and call from the same thread).
        Default: a new array."""
        return np.empty((n, k), dtype)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything the backend holds."""


def check_activations(x: np.ndarray, k: int) -> np.ndarray:
    """Validate x ``[N, K]`` (dtype, shape, K); return it C-contiguous."""
    if not isinstance(x, np.ndarray):
        raise FormatError(f"activations must be a numpy array, got {type(x).__name__}")
    dtype_name(x.dtype)
    if x.ndim != 2:
        raise FormatError(f"activations must be 2-D [N, K], got shape {tuple(x.shape)}")
    n, xk = x.shape
    if n < 1:
        raise FormatError("activations have N=0 rows")
    if xk != k:
        raise FormatError(f"activations have K={xk}, weight has K={k}")
    return np.ascontiguousarray(x)


def check_matmul(w: ResidentWeight, x: np.ndarray, topk: int = 0) -> np.ndarray:
    """What every backend's :meth:`Backend.matmul` checks before any work: x ``[N, K]`` of the
    weight's K (:func:`check_activations`), then the top-k epilogue's k (1..256, at most the
    weight's rows) when asked. Returns x C-contiguous."""
    x = check_activations(x, w.k)
    if topk:
        check_k(topk, w.rows)
    return x


@contextlib.contextmanager
def part_error(i: int) -> Iterator[None]:
    """A :class:`Q6Error` raised inside names the multi-weight call's part it is about:
    ``e.part = i`` (the index into the call's weights), unless an inner part set it."""
    try:
        yield
    except Q6Error as e:
        if getattr(e, "part", None) is None:
            e.part = i  # type: ignore[attr-defined]
        raise


def check_many(weights: Sequence[ResidentWeight], x: np.ndarray, topk: int = 0) -> np.ndarray:
    """What :meth:`Backend.launch_many` checks before anything is launched: one weight or
    more, then each part's :func:`check_matmul` (a refusal names its part: ``e.part``).
    Returns x C-contiguous."""
    if not len(weights):
        raise InvalidArgument("launch_many needs at least one weight")
    for i, w in enumerate(weights):
        with part_error(i):
            x = check_matmul(w, x, topk)
    return x


def refuse_q8_1_without_mmq(precision: Precision, flags: KernelFlags) -> None:
    if precision is Precision.Q8_1 and not flags.decode_mmq:
        raise FailedPrecondition(
            "precision q8_1 needs the decode MMQ kernels, which are disabled "
            "(Q6SERVE_DECODE_MMQ=0); use auto, exact or f16")


def nonfinite_rows(x: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``x [N, K]`` holding a NaN or +-Inf (one f32 sum per row: a
    row whose finite values overflow the sum is reported too, which costs only precision)."""
    with np.errstate(over="ignore", invalid="ignore"):
        sums = np.add.reduce(x, axis=1, dtype=np.float32)
    return np.flatnonzero(~np.isfinite(sums))


def matmul_ieee(backend: Backend, w: ResidentWeight, x: np.ndarray, *,
                precision: Precision = Precision.AUTO, flags: KernelFlags = DEFAULT_FLAGS,
                out_dtype: np.dtype | None = None, topk: int = 0) -> MatmulResult:
    """``backend.matmul`` with non-finite activations propagating per IEEE 754 whatever the
    precision (docs/RELIABILITY.md, "NaN and Inf activations").

    q8_1 cannot carry NaN/Inf (its per-block scale would be NaN/Inf, and ggml's quantizer
    turns them into arbitrary int8 levels), so when the call resolves to Q8_1, rows holding
    them run at EXACT and the other rows at Q8_1. That changes nothing a caller can see in
    those rows: a NaN makes every output of its row NaN, and an Inf makes every output of its
    row +-Inf or NaN, whatever the finite values next to it. The reply names the Q8_1 kernel.
    ``topk``: the epilogue of :meth:`Backend.matmul` (rows are independent, so it splits too).
    """
    return launch_ieee(backend, w, x, precision=precision, flags=flags, out_dtype=out_dtype,
                       topk=topk).wait()


def launch_ieee(backend: Backend, w: ResidentWeight, x: np.ndarray, *,
                precision: Precision = Precision.AUTO, flags: KernelFlags = DEFAULT_FLAGS,
                out_dtype: np.dtype | None = None, topk: int = 0) -> Launched:
    """:func:`matmul_ieee` started with :meth:`Backend.launch` (a q8_1 call whose rows need
    the split below runs to the end now: two launches and a merge)."""
    # a call at a precision the backend never resolves to Q8_1 (EXACT, F16; AUTO on CUDA and
    # NumPy: Backend.no_q8_1) skips plan(): ~0.5-3 us of every such launch; and the launch as
    # is, before the keyword dict the split needs (the direct path's every call)
    if precision in backend.no_q8_1 or backend.plan(int(x.shape[0]), precision,
                                                flags)[1] is not Precision.Q8_1:
        return backend.launch(w, x, precision=precision, flags=flags, out_dtype=out_dtype,
                              topk=topk)
    kw = {"flags": flags, "out_dtype": out_dtype, "topk": topk}
    bad = nonfinite_rows(x)
    if not bad.size:
        return backend.launch(w, x, precision=precision, **kw)
    return Launched.ready(_split_ieee(backend, w, x, bad, precision, kw))


def _split_ieee(backend: Backend, w: ResidentWeight, x: np.ndarray, bad: np.ndarray,
                precision: Precision, kw: dict[str, Any]) -> MatmulResult:
    good = np.setdiff1d(np.arange(x.shape[0]), bad)
    # both halves copied out before either call: x may be the backend's staging buffer (a
    # batch concatenated into it), which the first call overwrites
    x_bad, x_good = x[bad], x[good]
    ieee = backend.matmul(w, x_bad, precision=Precision.EXACT, **kw)
    if not good.size:
        return MatmulResult(ieee.y, ieee.kernel, ieee.layout, Precision.Q8_1, ieee.timing,
                            ieee.topk)
    res = backend.matmul(w, x_good, precision=precision, **kw)

    def rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], *a.shape[1:]), a.dtype)
        out[good], out[bad] = a, b
        return out

    if res.topk is not None and ieee.topk is not None:
        top = TopK(rows(res.topk.values, ieee.topk.values),
                   rows(res.topk.indices, ieee.topk.indices), rows(res.topk.lse, ieee.topk.lse))
        return MatmulResult(None, res.kernel, res.layout, res.precision, res.timing, top)
    assert res.y is not None and ieee.y is not None
    return MatmulResult(rows(res.y, ieee.y), res.kernel, res.layout, res.precision, res.timing)


def launch_many_ieee(backend: Backend, weights: Sequence[ResidentWeight], x: np.ndarray, *,
                     precision: Precision = Precision.AUTO, flags: FlagsArg = DEFAULT_FLAGS,
                     out_dtype: np.dtype | None = None, topk: int = 0) -> LaunchedMany:
    """:func:`launch_ieee` of a multi-weight call (:meth:`Backend.launch_many`): x's
    non-finite rows are looked for once for all parts, and only when a part resolves to Q8_1;
    with such rows each part runs :func:`launch_ieee`'s split, in turn."""
    fl = flags_of(flags, len(weights))
    n = int(x.shape[0]) if isinstance(x, np.ndarray) and x.ndim == 2 else 0
    if precision in backend.no_q8_1 or not n or all(
            backend.plan(n, precision, f)[1] is not Precision.Q8_1 for f in set(fl)):
        return backend.launch_many(weights, x, precision=precision, flags=fl,
                                   out_dtype=out_dtype, topk=topk)
    bad = nonfinite_rows(x)
    if not bad.size:
        return backend.launch_many(weights, x, precision=precision, flags=fl,
                                   out_dtype=out_dtype, topk=topk)
    check_many(weights, x, topk)
    out = []
    for i, (w, f) in enumerate(zip(weights, fl, strict=True)):
        with part_error(i):
            out.append(launch_ieee(backend, w, x, precision=precision, flags=f,
                                   out_dtype=out_dtype, topk=topk).wait())
    return LaunchedMany.ready(out)
