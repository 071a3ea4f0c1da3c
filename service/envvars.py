"""The worker's tuning variables from the environment: one table, one parser.

Each ``Q6SERVE_*`` tuning variable (not the kill-switch flags, :mod:`q6serve.service.flags`,
which SetFlags changes at run time) is a :class:`Var` here, read where its module needs it
(``Var.read``) and checked all at once when ``q6serve worker`` starts (:func:`check`), so a
bad value is refused there in one line that names the variable, before anything starts -
not silently read as a default, and not as a traceback from a thread or a front-end process.
An empty or unset variable means the default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from q6serve.kernels.errors import InvalidArgument
from q6serve.service.flags import parse_bool


class EnvError(InvalidArgument, ValueError):
    """A tuning variable's value that cannot be used; the message names the variable."""


@dataclass(frozen=True)
class Var:
    """One variable. ``kind``: "switch" (0/1, as the flags: also off/on, false/true, no/yes),
    "count" (a whole number in [low, high]) or "number" (a real number in [low, high]).
    ``default`` is what unset or empty means (None: the caller decides, e.g. from the host)."""

    name: str
    kind: str
    default: float | int | bool | None
    what: str  # what a value is, for the refusal: "microseconds", "batches per job", ...
    low: float = 0
    high: float = math.inf

    def read(self, env: Mapping[str, str] | None = None) -> float | int | bool | None:
        raw = (os.environ if env is None else env).get(self.name, "").strip()
        if not raw:
            return self.default
        if self.kind == "switch":
            try:
                return parse_bool(self.name, raw)
            except InvalidArgument:
                raise EnvError(f"{self.name}={raw!r}: write 0 or 1 ({self.what})") from None
        try:
            value: float = int(raw) if self.kind == "count" else float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and self.low <= value <= self.high):  # garbage: NaN
            span = (f"{_num(self.low)} or more" if self.high == math.inf
                    else f"{_num(self.low)}..{_num(self.high)}")
            whole = "a whole number " if self.kind == "count" else ""
            raise EnvError(f"{self.name}={raw!r}: give {self.what}, {whole}{span}")
        return value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


BUSY_POLL_US = Var("Q6SERVE_BUSY_POLL_US", "number", None,
                   "microseconds the loop polls before it sleeps (0: never)")
DEFER_KERNEL_US = Var("Q6SERVE_DEFER_KERNEL_US", "number", 200.0,
                      "microseconds of kernel above which a batch's wait is deferred")
GIL_SWITCH_US = Var("Q6SERVE_GIL_SWITCH_US", "number", None,
                    "the interpreter's switch interval in microseconds", low=1, high=1_000_000)
MMAP_THRESHOLD = Var("Q6SERVE_MMAP_THRESHOLD", "count", 32 << 20,
                     "malloc's mmap threshold in bytes (0: glibc's own)")
JOB_BATCHES = Var("Q6SERVE_JOB_BATCHES", "count", 1,
                  "batches of one weight per device-thread job", low=1)
FRONTEND_STACKS = Var("Q6SERVE_FRONTEND_STACKS", "count", 2,
                      "stacks a front end keeps in flight (0: no limit)")
FRONTEND_BUSY_POLL_US = Var("Q6SERVE_FRONTEND_BUSY_POLL_US", "number", 0.0,
                            "microseconds a front end's loop polls before it sleeps (0: never)")
FRONTEND_ROUND_ROBIN = Var("Q6SERVE_FRONTEND_ROUND_ROBIN", "switch", False,
                           "new connections dealt to the front ends in turn (eBPF)")
FRONTEND_GC_FREEZE = Var("Q6SERVE_FRONTEND_GC_FREEZE", "switch", False,
                         "a front end freezes its start-up objects out of the cyclic GC")
HANDOFF_YIELD = Var("Q6SERVE_HANDOFF_YIELD", "switch", True,
                    "yield the GIL when a job reaches an idle device thread")
PIPELINE = Var("Q6SERVE_PIPELINE", "switch", True,
               "launch a batch while the previous one runs")
DEFER_SLOTS = Var("Q6SERVE_DEFER_SLOTS", "count", None,
                  "launched batches in flight whose kernels are deferred (at most the "
                  "backend's launch slots)", low=1, high=4)
DEFER_NOW = Var("Q6SERVE_DEFER_NOW", "switch", True,
                "launch a deferred batch's successor in the trip that hears of its end")
MULTI_PIPELINE = Var("Q6SERVE_MULTI_PIPELINE", "switch", False,
                     "a multi-weight call's direct path launches its parts behind each other")
MULTI_LAUNCH = Var("Q6SERVE_MULTI_LAUNCH", "switch", True,
                   "a multi-weight call's parts that run together are one backend call "
                   "(Backend.launch_many: x uploaded once, one sync)")
PIPELINE_SHORT = Var("Q6SERVE_PIPELINE_SHORT", "switch", False,
                     "pipeline short batches under load too")
DEVICE_MERGE = Var("Q6SERVE_DEVICE_MERGE", "switch", True,
                   "merge front-end calls read in one loop trip")
PIN_REGIONS = Var("Q6SERVE_PIN_REGIONS", "switch", True,
                  "page-lock system regions for the device's copies")
# read by the CUDA backend itself (kernels/cuda/launch.py pdl_from_env, region_streams_from_env,
# slots_from_env, the y chunks' reader:
# kernels never import service); listed here so the worker's start check names a bad value like
# the others
PDL = Var("Q6SERVE_PDL", "switch", True,
          "the split-K sum's launch with programmatic dependent launch (CUDA)")

REGION_STREAMS = Var("Q6SERVE_REGION_STREAMS", "switch", True,
                     "a lane plan's copies on streams of their own, beside the kernels (CUDA)")
TIMING_ANCHOR = Var("Q6SERVE_TIMING_ANCHOR", "count", 1,
                    "empty kernels around a captured call's kernel events: 1 before the start "
                    "event, 2 also after the end event (CUDA)", high=2)
# None: the launcher module's COPY_KERNEL_MAX (kernels/cuda/launch.py)
COPY_KERNEL_MAX = Var("Q6SERVE_COPY_KERNEL_MAX", "count", None,
                      "bytes up to which x's upload and a small y's download are a copy kernel's, "
                      "not the copy engine's (CUDA; 0: none)")
# read by the CUDA backend's storage (kernels/cuda/storage.py pairs_from_env)
Q6K_PAIRS = Var("Q6SERVE_Q6K_PAIRS", "switch", True,
                "SoA weights' code planes in pair-stream order on the device (CUDA)")

# None: each weight's own (2 for the CUDA storage's two-slab weights, else none)
Y_CHUNKS = Var("Q6SERVE_Y_CHUNKS", "count", None,
               "row chunks a large y is computed and downloaded in (CUDA; unset: each "
               "weight's own, 0 or 1: off)", high=16)

HOT_CALLS = Var("Q6SERVE_HOT_CALLS", "switch", True,
                "a repeated call found by x's shape, slot and its arguments' identity first "
                "(CUDA)")

LAUNCH_SLOTS = Var("Q6SERVE_LAUNCH_SLOTS", "count", 3,
                   "launches in flight on one launcher: all for the lane's pipeline, at most 2 "
                   "for the batcher's (CUDA)", low=1, high=4)

# the device process of a --frontends worker (service/frontends.py, service/cuda_regions.py)
DP_LEAN = Var("Q6SERVE_DP_LEAN", "switch", True,
              "CUDA-region calls' lean launch: views cached per place, the launch choice kept")
DP_SYS_PIPE = Var("Q6SERVE_DP_SYS_PIPE", "switch", True,
                  "full system-region calls launched through the device process's pipeline")
DP_READY_POLL = Var("Q6SERVE_DP_READY_POLL", "switch", True,
                    "the device process answers its launches once done, without a blocking sync")
DP_PLACE_GRAPH = Var("Q6SERVE_DP_PLACE_GRAPH", "switch", True,
                     "a repeated CUDA-region call is one graph launch per (weight, N, x and y "
                     "place, slot): x's and y's copies and the completion event inside")
DP_PIN_ARENA = Var("Q6SERVE_DP_PIN_ARENA", "switch", True,
                   "page-lock the front ends' arenas in the device process: x DMA'd from its "
                   "slot, a full call's y DMA'd into it (CUDA)")
DP_ARENA_GATHER = Var("Q6SERVE_DP_ARENA_GATHER", "switch", True,
                      "with pinned arenas: a merged batch's x DMA'd from its calls' slots, no "
                      "concatenation on the host (CUDA)")
DP_LANE_PIPE = Var("Q6SERVE_DP_LANE_PIPE", "switch", True,
                   "a --frontends worker's fast lanes launch their full batches through the "
                   "device process's pipeline and answer them a loop trip later, not inline")
LANE_RING = Var("Q6SERVE_LANE_RING", "switch", True,
                "fast lanes may run over a shared-memory ring in their region, the socket "
                "kept for setup, errors and doorbells (x86-64 workers; a caller asks with "
                "ring=True)")
# the worker's --keep-cpus-awake when the option is not given (service/keep_awake.py)
KEEP_CPUS_AWAKE = Var("Q6SERVE_KEEP_CPUS_AWAKE", "switch", False,
                      "a SCHED_IDLE spinner on every CPU while the worker runs")

VARS: tuple[Var, ...] = (BUSY_POLL_US, DEFER_KERNEL_US, GIL_SWITCH_US, MMAP_THRESHOLD,
                         JOB_BATCHES, FRONTEND_STACKS, FRONTEND_BUSY_POLL_US,
                         FRONTEND_ROUND_ROBIN, FRONTEND_GC_FREEZE, HANDOFF_YIELD, PIPELINE,
                         DEFER_SLOTS, DEFER_NOW, MULTI_PIPELINE, MULTI_LAUNCH, PIPELINE_SHORT,
                         DEVICE_MERGE, PIN_REGIONS, PDL, REGION_STREAMS, LANE_RING,
                         Y_CHUNKS, LAUNCH_SLOTS, Q6K_PAIRS, TIMING_ANCHOR, COPY_KERNEL_MAX,
                         HOT_CALLS, DP_LEAN, DP_SYS_PIPE, DP_READY_POLL,
                         DP_PLACE_GRAPH, DP_PIN_ARENA, DP_ARENA_GATHER, DP_LANE_PIPE,
                         KEEP_CPUS_AWAKE)


# A process's own spin (the worker's loop; a lane caller's, client/lane.py, keeps its own copy
# of the rule: the client library never imports the service) defaults on only where it may run on
# SPIN_MIN_CPUS cores or more: a spin takes a core that gRPC's threads, the device thread or a
# caller on the same host need (on the 2-core VM it was worse; service/threads.py says more).
SPIN_MIN_CPUS = 8


def spin_us(var: Var, default_us: float, env: Mapping[str, str] | None = None) -> float:
    """``var`` (microseconds) when set, else ``default_us`` on a process allowed SPIN_MIN_CPUS
    cores or more, else 0."""
    us = var.read(env)
    if us is None:
        return default_us if len(os.sched_getaffinity(0)) >= SPIN_MIN_CPUS else 0.0
    return float(us)



def check(env: Mapping[str, str] | None = None) -> None:
    """Read every variable; the first bad one raises :class:`EnvError`."""
    for var in VARS:
        var.read(env)
