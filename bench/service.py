"""End-to-end decode replay over gRPC: rows/s, latency, batching gain and where each call's
time goes (issue 9).

A worker runs as its own process (``q6serve worker --port 0``; we parse ``listening on H:P``)
with synthetic Q6_K weights of a 7B-class model's real shapes uploaded to it. H simulated
inference hosts (spawned processes, one gRPC channel each) drive S sequences each: either S
concurrent callers of N = 1, or (``--host-batch``) one caller of N = S. Each caller runs
closed-loop decode steps, one matmul per weight of ``--weights`` per step.

Every call is split along one timeline into parts that add up to its end-to-end time:

  client_encode   activations -> request bytes (the q6serve client's encoder: x copied once)
  transport       the rest of the RPC: HTTP/2 both ways, gRPC's queues and threads, reply
                  serialization in the worker (= RPC time minus the worker's handler time)
  server_decode   worker: RPC taken -> activations decoded (auth, protobuf parse, checks)
  queue           worker: enqueued -> its batch's device job started
  kernel          device time of the batch (CUDA events; host-timed on NumPy)
  device_other    rest of the device job: H2D/D2H copies, launches, syncs, batch concat
  server_other    rest of the handler: loop wake-ups, batch split, encoding y
  client_decode   reply bytes -> y array (the client's: protobuf parse + a view of y)

The worker's parts come from the reply's MatmulTiming (queue, kernel, device, decode,
handler seconds). ``--target-report`` measures issue 9's three targets in one invocation.
``--dataplane`` (issue 15) measures T2 and T3 through the worker's ``--frontends N`` with bytes
and with shared-memory regions (bench/gpu_dataplane_run.sh runs it for N = 1, 2, 4, 8).

``--replay`` (issue 14): the decode replay of a whole 28-layer 7B-class model (q, k, v, o,
gate, up, down per layer, then the lm-head; synthetic weights; bench/service_replay.py): hosts
of S = 1, 8, 64 sequences (N = S per call) step it closed-loop, with multi-weight calls (q/k/v,
gate/up) and without, the lm-head through the top-k epilogue. Per S and call style: steps/s,
per-step latency p50/p99, calls per step, the kernel-only time of a step (the sum of the
replies' kernel times in the same run) and the bare-gRPC floor of the step's call sizes. y comes
back as ``--replay-out`` (f16: what a host feeds its next layer).

``--lm-head`` (issue 14's lm-head target): ``--lm-callers`` callers (one process each) of
N = ``--lm-n`` rows on the full lm-head (152064 x 3584, scaled by --row-scale) with the top-k
epilogue (``--topk``): reply bytes against the f32 logits they replace, p50/p99 per call.

    python bench/service.py --backend numpy --row-scale 0.01 --seconds 2
    python bench/service.py --backend cuda --target-report --json "$OUT/service.json"
    python bench/service.py --backend numpy --replay --layers 2 --scale 0.002 --seconds 1
    python bench/service.py --backend cuda --replay --json "$OUT/replay.json"
    python bench/service.py --backend cuda --lm-head --mode stream --json "$OUT/lm.json"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import service_load  # bench/ is sys.path[0]
from service_load import LoadSpec, grpc_floor, run_load
from service_replay import (
    LAYERS,
    WARM_STEPS,
    ReplaySpec,
    floor_sizes,
    held_echo,
    model_weights,
    run_replay,
    step_floors,
    step_plan,
)
from svc_util_transport import SESSIONS, TRANSPORTS, caller_spin_us

from q6serve.client.worker_process import WorkerProcess
from q6serve.kernels import q6k
from q6serve.service.affinity import parse_cpus

WEIGHTS = {"attn_v": (512, 3584), "ffn_down": (3584, 18944), "lm_head": (152064, 3584)}
PARTS = ("client_encode", "transport", "server_decode", "queue", "kernel", "device_other",
         "server_other", "client_decode")
DYN_FLAG = "Q6SERVE_DYNAMIC_BATCHING"
WARM_NS = (1, 8, 16, 32, 64)  # one N per launch-shape bucket of the CUDA tiles (cuda_backend)
NEG_TOL = 5e-6  # a part below -5 us means the timeline is inconsistent (counted per run)
LM_REPLY_RATIO_MIN = 100.0  # issue 14: the top-k reply >= 100x smaller than the f32 logits
LM_P50_LIMIT_US = 5000.0  # ... and p50 <= 5 ms (N=64, 8 callers, k=64)


# -- worker process ---------------------------------------------------------------------------
def random_q6k(rows: int, k: int, seed: int) -> np.ndarray:
    """Valid random Q6_K blocks (kernels/q6k.py's generator, seeded)."""
    return q6k.random_blocks(rows, k, np.random.default_rng(seed))


def start_worker(backend: str, log_path: Path, extra: list[str]) -> WorkerProcess:
    """``q6serve worker --port 0`` as a started subprocess; its log goes to ``log_path``."""
    return WorkerProcess(["--backend", backend, "--log-level", "INFO", *extra], log_path).start()


# -- figures ----------------------------------------------------------------------------------
def parts(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-call breakdown; sums to e2e by construction, each part measured (not guessed)."""
    kernel = np.nan_to_num(s["kernel"], nan=0.0)
    device = np.where(np.isnan(s["device"]), kernel, s["device"])
    handler = np.where(np.isnan(s["handler"]), s["rpc"], s["handler"])
    srv_decode = np.nan_to_num(s["srv_decode"], nan=0.0)
    return {"client_encode": s["encode"], "transport": s["rpc"] - handler,
            "server_decode": srv_decode, "queue": s["queue"], "kernel": kernel,
            "device_other": device - kernel,
            "server_other": handler - srv_decode - s["queue"] - device,
            "client_decode": s["decode"]}


@dataclass
class RunResult:
    label: str
    weight: str
    config: dict[str, Any]
    calls: int
    seconds: float
    rows_per_s: float
    calls_per_s: float
    p50_us: float
    p99_us: float
    kernel_p50_us: float | None
    batch_rows_mean: float
    parts_mean_us: dict[str, float] = field(default_factory=dict)
    parts_p50_us: dict[str, float] = field(default_factory=dict)
    e2e_mean_us: float = 0.0
    missing_server_timing: int = 0  # replies without the worker's handler/decode timing
    negative_calls: dict[str, int] = field(default_factory=dict)  # part < -NEG_TOL: clock bug
    reply_bytes_mean: float = 0.0  # serialized reply, as received


def summarize(label: str, weight: str, s: dict[str, np.ndarray], seconds: float,
              config: dict[str, Any]) -> RunResult:
    n = int(config["n"])
    calls = int(s["e2e"].size)
    pt = parts(s)
    kern = s["kernel"][~np.isnan(s["kernel"])]
    return RunResult(
        label, weight, config, calls, seconds, calls * n / seconds, calls / seconds,
        float(np.percentile(s["e2e"], 50) * 1e6), float(np.percentile(s["e2e"], 99) * 1e6),
        float(np.percentile(kern, 50) * 1e6) if kern.size else None,
        float(np.mean(s["batch_rows"])),
        {k: float(np.mean(v) * 1e6) for k, v in pt.items()},
        {k: float(np.median(v) * 1e6) for k, v in pt.items()},
        float(np.mean(s["e2e"]) * 1e6), int(np.isnan(s["handler"]).sum()),
        {k: int((v < -NEG_TOL).sum()) for k, v in pt.items()},
        float(np.mean(s["reply_bytes"])))


def print_result(r: RunResult) -> None:
    kp = "n/a" if r.kernel_p50_us is None else f"{r.kernel_p50_us:.0f}"
    print(f"{r.label:<28} {r.weight:<9} calls {r.calls:>7}  rows/s {r.rows_per_s:>10,.0f}  "
          f"p50 {r.p50_us:>8.0f} us  p99 {r.p99_us:>8.0f} us  kernel p50 {kp:>6} us  "
          f"batch rows {r.batch_rows_mean:5.1f}", flush=True)
    print("    mean us: " + "  ".join(f"{k} {v:.0f}" for k, v in r.parts_mean_us.items())
          + f"  = {sum(r.parts_mean_us.values()):.0f} (e2e {r.e2e_mean_us:.0f})", flush=True)


# --pin auto / auto-w / auto-c: the cores a probe finds fastest (bench/service_pin.py), this
# many for the worker and for the callers; -w / -c: only that side pinned
AUTO_PIN = {"auto": (True, True), "auto-w": (True, False), "auto-c": (False, True)}
AUTO_CORES = (2, 2)


def auto_pin(text: str) -> str:
    """``--pin auto[-w|-c]`` as WORKER_CPUS:LOAD_CPUS: each core's speed at a pure-Python loop
    (bench/machine_probe.py), the worker on the AUTO_CORES[0] fastest and the callers on the
    AUTO_CORES[1] next fastest (session 25: T1 pinned so met its target where unpinned it
    missed; the cores' speed mattered less than keeping each process on its own two)."""
    import machine_probe
    import service_pin

    w, c = AUTO_PIN[text]
    pins = service_pin.pin_by_speed(machine_probe.cpu_ns(20_000, 3)["per_core_ns"],
                                    *AUTO_CORES)
    if pins is None:
        raise SystemExit(f"--pin {text}: fewer than {sum(AUTO_CORES)} cores to pin on")
    worker, _, load = pins[0].partition(":")
    return f"{worker if w else ''}:{load if c else ''}"


def pin_parts(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``--pin WORKER_CPUS:LOAD_CPUS`` -> (the worker's cores, the load's); a side left empty
    is not pinned (``()``), e.g. ``:8,9`` pins only the callers."""
    worker, sep, load = text.partition(":")
    if not sep or not (worker or load):
        raise SystemExit(f"--pin {text!r}: WORKER_CPUS:LOAD_CPUS, e.g. 2,3:8,9 (a side may be "
                         "empty: not pinned)")
    return (parse_cpus(worker) if worker else (),
            parse_cpus(load) if load else ())


# -- orchestration ----------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, out_dir: Path) -> None:
        from q6serve.client.client import Client

        extra = ["--max-batch-rows", str(args.max_batch_rows)]
        if args.max_batch_delay_us is not None:
            extra += ["--max-batch-delay-us", str(args.max_batch_delay_us)]
        if args.inline_device_us is not None:
            extra += ["--inline-device-us", str(args.inline_device_us)]
        if args.pin and (cpus := args.pin.split(":")[0]):  # the worker pins itself (every
            extra += ["--cpus", cpus]  # thread); the echo floor gets the same
        if args.vram_budget:
            extra += ["--vram-budget", args.vram_budget]
        if args.frontends > 1:  # issue 15: N gRPC front-end processes feed one device
            extra += ["--frontends", str(args.frontends)]
        if args.dataplane:  # issue 15: callers' regions (one per caller, all at once)
            extra += ["--allow-shm", "--max-regions", "1024"]
        if args.keep_cpus_awake:  # its SCHED_IDLE spinners, one per CPU, for its life
            extra += ["--keep-cpus-awake"]
        self.args = args
        self.worker = start_worker(args.backend, out_dir / "worker.log", extra)
        self.client = Client(self.worker.target, timeout=600.0)
        st = self.client.status()
        self.backend, self.device = st.backend, st.device
        self.shapes: dict[str, tuple[int, int]] = {}
        self.results: list[RunResult] = []
        self.targets: list[dict[str, Any]] = []
        self.gains: list[dict[str, Any]] = []
        self.floor: dict[str, float] = {}
        self.replay: list[dict[str, Any]] = []
        self.lm_head: dict[str, Any] | None = None
        self.errors: list[dict[str, str]] = []
        self.t_start = time.perf_counter()
        self._warm: set[tuple[str, int]] = set()

    def upload(self, names: list[str]) -> None:
        for i, name in enumerate(names):
            if name in self.shapes:
                continue
            rows, k = WEIGHTS[name]
            rows = max(1, round(rows * self.args.row_scale))
            t0 = time.perf_counter()
            self.client.upload(name, random_q6k(rows, k, i), rows, k)
            self.shapes[name] = (rows, k)
            print(f"# uploaded {name} {rows}x{k} in {time.perf_counter() - t0:.1f} s",
                  flush=True)

    def batching(self, on: bool) -> None:
        self.client.flags({DYN_FLAG: on})

    def run(self, label: str, weights: list[str], hosts: int, callers: int, n: int,
            mode: str, topk: int = 0, region: str = "", own_channel: bool = False,
            keep: list[tuple[dict[str, np.ndarray], float]] | None = None,
            ) -> list[RunResult]:
        """One closed-loop run; a failure is recorded and yields [] (the report goes on).
        ``region``: "system"/"cuda" (x and y through each caller's region, issue 15);
        ``own_channel``: a connection per caller (spread over the worker's --frontends);
        ``keep``: gets each weight's samples and the run's wall seconds (:meth:`pooled`)."""
        from q6serve.client.client import PRECISIONS

        a = self.args
        spec = LoadSpec(self.worker.target, tuple((w, self.shapes[w][1]) for w in weights),
                        callers, n, a.seconds, a.warmup, mode, a.dtype, PRECISIONS[a.precision],
                        topk, region, max(self.shapes[w][0] for w in weights), own_channel)
        try:
            self.prewarm(weights, n)
            samples, wall = run_load(spec, hosts)
            on = self.client.flags()[DYN_FLAG]
        except Exception as e:
            print(f"# {label} FAILED: {e}", flush=True)
            self.errors.append({"run": label, "error": repr(e)[:2000]})
            self.save()
            return []
        out = []
        for w in weights:
            if w not in samples:  # no call finished in the timed span (too short a run)
                print(f"# {label} {w}: no call finished in {a.seconds} s", flush=True)
                self.errors.append({"run": label, "error": f"{w}: no call finished"})
                continue
            cfg = {"hosts": hosts, "callers_per_host": callers, "n": n, "mode": mode,
                   "dtype": a.dtype, "precision": a.precision, "dynamic_batching": on,
                   "rows": self.shapes[w][0], "k": self.shapes[w][1], "topk": topk,
                   "frontends": a.frontends, "region": region or "bytes",
                   "channel_per_caller": own_channel}
            r = summarize(label, w, samples[w], wall, cfg)
            print_result(r)
            out.append(r)
            if keep is not None:
                keep.append((samples[w], wall))
        self.results += out
        self.save()
        return out

    def prewarm(self, weights: list[str], n: int) -> None:
        """Untimed calls per weight first, at this N and at one N of every launch-shape bucket
        a coalesced batch may hit: kernels compile on first use, never inside a run."""
        dt = np.float16 if self.args.dtype == "f16" else np.float32
        for w in weights:
            for m in sorted({n, *WARM_NS}):
                if (w, m) not in self._warm and (m <= self.args.max_batch_rows or m == n):
                    x = np.ones((m, self.shapes[w][1]), dt)
                    self.client.matmul_full(w, x, precision=self.args.precision, timeout=600.0)
                    self._warm.add((w, m))

    def one(self, label: str, hosts: int, callers: int, n: int, mode: str,
            weight: str = "ffn_down", region: str = "",
            own_channel: bool = False) -> RunResult | None:
        got = self.run(label, [weight], hosts, callers, n, mode, region=region,
                       own_channel=own_channel)
        return got[0] if got else None

    def pooled(self, label: str, runs: int, hosts: int, callers: int, n: int, mode: str,
               weight: str = "ffn_down", region: str = "", own_channel: bool = False,
               ) -> tuple[RunResult | None, list[RunResult]]:
        """``runs`` runs of :meth:`one` back to back, and one result of all their calls
        pooled (rows/s over their summed walls, p50/p99 of every call): the same statistic
        as one run, over more calls, with each run's own figures beside it (a host whose
        tail comes and goes shows it as their spread). None if no run finished."""
        keep: list[tuple[dict[str, np.ndarray], float]] = []
        each: list[RunResult] = []
        for i in range(runs):
            got = self.run(f"{label} ({i + 1}/{runs})", [weight], hosts, callers, n, mode,
                           region=region, own_channel=own_channel, keep=keep)
            each += got
        if not keep:
            return None, each
        merged = {f: np.concatenate([s[f] for s, _ in keep]) for f in keep[0][0]}
        r = summarize(f"{label} (pooled {len(keep)})", weight, merged,
                      sum(w for _, w in keep), each[0].config)
        print_result(r)
        return r, each

    def save(self) -> None:
        """Write everything so far (a run cut short by a time limit keeps what it had)."""
        if self.args.json is None:
            return
        doc = {"backend": self.backend, "device": self.device, "commit": _commit(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "cores": os.cpu_count(), "argv": self.args.argv, "parts": PARTS,
               "runs": [asdict(r) for r in self.results], "targets": self.targets,
               "gains": self.gains, "floor_us": self.floor, "replay": self.replay,
               "lm_head": self.lm_head, "errors": self.errors,
               "wall_seconds": time.perf_counter() - self.t_start}
        self.args.json.write_text(json.dumps(doc, indent=1))

    def close(self) -> None:
        self.client.close()
        self.worker.stop()


def replay(b: Bench) -> None:
    """The plain replay: H hosts x S sequences over --weights, batching on (and off)."""
    a = b.args
    callers, n = (1, a.seqs) if a.host_batch else (a.seqs, 1)
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.batching]
    by_mode: dict[bool, list[RunResult]] = {}
    for on in modes:
        b.batching(on)
        by_mode[on] = b.run(f"replay batching={'on' if on else 'off'}", a.weights, a.hosts,
                            callers, n, a.mode)
    if len(modes) == 2 and by_mode[True] and by_mode[False]:
        for r_on, r_off in zip(by_mode[True], by_mode[False], strict=True):
            b.gains.append({"weight": r_on.weight,
                            "batching_gain": r_on.rows_per_s / max(r_off.rows_per_s, 1e-9)})
            print(f"# batching gain {r_on.weight}: {b.gains[-1]['batching_gain']:.2f}x")
    b.save()


def _target(b: Bench, t: dict[str, Any]) -> None:
    b.targets.append(t)
    print("# " + json.dumps(t), flush=True)
    b.save()


def target_report(b: Bench) -> None:
    """Issue 9's targets, all on ffn_down with --dtype activations and --precision."""
    a = b.args
    rows, k = b.shapes["ffn_down"]
    itemsize = 2 if a.dtype == "f16" else 4
    spin_floor: dict[str, float] = {}
    try:  # request: activations + ~40 bytes of framing; reply: f32 y + ~60 bytes
        b.floor = grpc_floor(k * itemsize + 40, rows * 4 + 60, a.modes, min(a.seconds, 3.0))
        print(f"# bare gRPC round trip, same sizes (p50 us): {b.floor}", flush=True)
        # the same echo whose loop busy-polls as the worker's does by default (on this host's
        # cores: the same rule): the worker's own setting, so the like-for-like floor
        spin_floor = grpc_floor(k * itemsize + 40, rows * 4 + 60, a.modes,
                                min(a.seconds, 3.0), spin=True)
        print(f"# bare gRPC round trip, echo busy-polling (p50 us): {spin_floor}", flush=True)
    except Exception as e:
        b.errors.append({"run": "grpc floor", "error": repr(e)[:2000]})
    client_floor: dict[str, float] = {}
    if "T1" in a.targets and a.dtype == "f16":
        try:  # the same echo with T1's caller's own encoding and decoding around each trip
            client_floor = grpc_floor(k * itemsize + 40, rows * 4 + 60, a.modes,
                                      min(a.seconds, 3.0), work=(k, rows))
            print(f"# bare gRPC round trip with the caller's encode/decode (p50 us): "
                  f"{client_floor}", flush=True)
        except Exception as e:
            b.errors.append({"run": "grpc floor with client work", "error": repr(e)[:2000]})
    b.batching(True)
    for mode in a.modes if "T1" in a.targets else []:
        r = b.one(f"T1 1 caller N=1 {mode}", 1, 1, 1, mode)
        if r is None:
            continue
        gap = r.p50_us - (r.kernel_p50_us or 0.0)
        # judged on the faster of the two bare echoes (plain, busy-polling): the stricter limit
        floors = [f for f in (b.floor.get(mode), spin_floor.get(mode)) if f is not None]
        floor = min(floors) if floors else None
        # issue 14: p50 - kernel <= the bare gRPC round trip of the same sizes + 100 us
        # (issue 9's fixed 150 us where the floor could not be measured)
        limit = 150.0 if floor is None else floor + 100.0
        _target(b, {"target": "T1", "mode": mode, "p50_minus_kernel_us": gap,
                    "limit_us": limit, "met": gap <= limit, "run": r.label,
                    "bare_grpc_p50_us": floor,
                    "bare_grpc_plain_p50_us": b.floor.get(mode),
                    "bare_grpc_spin_p50_us": spin_floor.get(mode),
                    "service_overhead_us": None if floor is None else gap - floor,
                    # beside the target (judged on the faster bare echo): the floor whose
                    # caller also encodes x and decodes y, as T1's caller does (its p50 holds
                    # both, and the pause they put between round trips is the caller's)
                    "bare_grpc_client_work_p50_us": client_floor.get(mode),
                    "worker_overhead_us": (None if mode not in client_floor
                                           else gap - client_floor[mode])})
    procs = a.t2_procs or max(1, min(8, (os.cpu_count() or 2) // 2))
    per = max(1, 64 // procs)
    for mode in a.modes if "T2" in a.targets else []:
        b.batching(False)
        off = b.one(f"T2 {procs * per}x N=1 {mode} batch off", procs, per, 1, mode)
        b.batching(True)
        on = b.one(f"T2 {procs * per}x N=1 {mode} batch on", procs, per, 1, mode)
        if off is None or on is None:
            continue
        gain = on.rows_per_s / max(off.rows_per_s, 1e-9)
        _target(b, {"target": "T2", "mode": mode, "callers": procs * per, "gain": gain,
                    "gain_min": 5.0, "p99_us": on.p99_us, "p99_limit_us": 2000.0,
                    "met": gain >= 5.0 and on.p99_us <= 2000.0})
    for mode in a.modes if "T3" in a.targets else []:
        runs = [b.one(f"T3 {h} hosts N=64 {mode}", h, 1, 64, mode) for h in a.t3_hosts]
        done = [r for r in runs if r is not None and r.kernel_p50_us]
        if not done:
            continue
        best = max(done, key=lambda r: r.rows_per_s)
        # the kernel alone: back-to-back N=64 launches at the device time each one took
        kernel_rows_s = 64 / (best.kernel_p50_us * 1e-6)  # type: ignore[operator]
        frac = best.rows_per_s / kernel_rows_s
        _target(b, {"target": "T3", "mode": mode, "hosts": best.config["hosts"],
                    "service_rows_per_s": best.rows_per_s, "kernel_rows_per_s": kernel_rows_s,
                    "fraction": frac, "fraction_min": 0.5, "met": frac >= 0.5})


def lm_head_topk(b: Bench) -> None:
    """Issue 14's lm-head target: --lm-callers callers of N=--lm-n with the top-k epilogue."""
    a = b.args
    b.upload(["lm_head"])
    rows = b.shapes["lm_head"][0]
    k = min(a.topk, rows)
    if k == 0:
        print("# lm-head scenario skipped: --topk 0", flush=True)
        return
    b.batching(True)
    got = b.run(f"lm-head N={a.lm_n} x{a.lm_callers} top-{k} {a.mode}", ["lm_head"],
                a.lm_callers, 1, a.lm_n, a.mode, topk=k)
    if not got:
        return
    r = got[0]
    logits = a.lm_n * rows * 4  # what the reply replaces: f32 logits
    ratio = logits / max(r.reply_bytes_mean, 1.0)
    b.lm_head = {"label": r.label, "n": a.lm_n, "callers": a.lm_callers, "topk": k,
                 "rows": rows, "mode": a.mode, "reply_bytes": r.reply_bytes_mean,
                 "f32_logits_bytes": logits, "ratio": ratio, "p50_us": r.p50_us,
                 "p99_us": r.p99_us, "kernel_p50_us": r.kernel_p50_us,
                 "batch_rows_mean": r.batch_rows_mean,
                 "met": ratio >= LM_REPLY_RATIO_MIN and r.p50_us <= LM_P50_LIMIT_US}
    b.save()
    print(lm_line(b.lm_head), flush=True)


def lm_line(t: dict[str, Any]) -> str:
    return (f"lm-head N={t['n']} x{t['callers']} callers top-{t['topk']} ({t['rows']} rows, "
            f"{t['mode']}): reply {t['reply_bytes']:,.0f} B vs f32 logits "
            f"{t['f32_logits_bytes']:,} B = {t['ratio']:,.0f}x smaller (>= "
            f"{LM_REPLY_RATIO_MIN:.0f}), p50 {t['p50_us'] / 1e3:.2f} ms (<= "
            f"{LM_P50_LIMIT_US / 1e3:.0f}) p99 {t['p99_us'] / 1e3:.2f} ms "
            f"{'met' if t['met'] else 'MISSED'}")


def dataplane_report(b: Bench) -> None:
    """Issue 15's targets on ffn_down through this worker's --frontends (run once per N):
    T2 (64 callers of N=1: rows/s, p99) and T3 (8 hosts of N=64: rows/s against the kernel
    alone), each with the bytes in the messages and with every caller's x and y in its own
    shared-memory region (--cuda-regions: T3 with device buffers by CUDA IPC too). Every
    caller has its own connection, so the kernel spreads them over the front ends."""
    a = b.args
    fe = a.frontends
    kinds = ["" if k == "bytes" else k for k in a.regions.split(",")]
    procs = a.t2_procs or max(1, min(8, (os.cpu_count() or 2) // 2))
    per = max(1, 64 // procs)
    b.batching(True)
    for mode in a.modes:
        for kind in kinds if "T2" in a.targets else []:
            # --t2-runs R: R runs pooled (the p99 of all their calls, as one run's), each
            # run's rows/s and p99 beside it: how far the tail moves between runs
            r, each = b.pooled(f"T2 fe={fe} {procs * per}x N=1 {mode} {kind or 'bytes'}",
                               a.t2_runs, procs, per, 1, mode, region=kind, own_channel=True)
            if r is not None:
                _target(b, {"target": "T2", "frontends": fe, "region": kind or "bytes",
                            "mode": mode, "callers": procs * per, "rows_per_s": r.rows_per_s,
                            "rows_per_s_min": 20000.0, "p99_us": r.p99_us,
                            "p99_limit_us": 4000.0,
                            "runs": [{"rows_per_s": e.rows_per_s, "p99_us": e.p99_us}
                                     for e in each],
                            "met": r.rows_per_s >= 20000.0 and r.p99_us <= 4000.0})
        # the kernel alone: the fastest kernel p50 of this shape at N=64 in these runs (the
        # CUDA-region path times its direct launches, 272-304 us against 63 on the H200)
        kernel_us: float | None = None
        for kind in (kinds + (["cuda"] if a.cuda_regions else [])
                     if "T3" in a.targets else []):
            h = max(a.t3_hosts)
            r = b.one(f"T3 fe={fe} {h} hosts N=64 {mode} {kind or 'bytes'}", h, 1, 64, mode,
                      region=kind, own_channel=True)
            if r is None or not r.kernel_p50_us:
                continue
            kernel_us = min(kernel_us or r.kernel_p50_us, r.kernel_p50_us)
            kernel_rows_s = 64 / (kernel_us * 1e-6)  # back-to-back N=64 launches
            frac = r.rows_per_s / kernel_rows_s
            need = 0.5 if kind else 0.25  # regions: 50%; bytes with several front ends: 25%
            _target(b, {"target": "T3", "frontends": fe, "region": kind or "bytes",
                        "mode": mode, "hosts": h, "service_rows_per_s": r.rows_per_s,
                        "kernel_rows_per_s": kernel_rows_s, "fraction": frac,
                        "fraction_min": need, "p99_us": r.p99_us, "met": frac >= need})


def upload_model(b: Bench) -> dict[str, int]:
    """Upload the replay's synthetic model (one random tensor per shape, under every name of
    that shape: contents do not matter to a matmul's cost); returns rows per weight."""
    from concurrent.futures import ThreadPoolExecutor

    a = b.args
    weights = model_weights(a.layers, a.scale)
    data: dict[tuple[int, int], tuple[np.ndarray, str]] = {}
    for i, (rows, k) in enumerate(sorted({(r, k) for _, r, k in weights})):
        blocks = random_q6k(rows, k, 100 + i)
        data[(rows, k)] = (blocks, hashlib.sha256(blocks).hexdigest())
    t0 = time.perf_counter()

    def up(w: tuple[str, int, int]) -> None:
        name, rows, k = w
        if b.shapes.get(name) == (rows, k):  # e.g. --lm-head's lm_head: already there
            return
        if name in b.shapes:
            b.client.unload(name)
            del b.shapes[name]
        blocks, sha = data[(rows, k)]
        b.client.upload(name, blocks, rows, k, sha256=sha)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(up, weights))
    total = sum(data[(r, k)][0].nbytes for _, r, k in weights)
    print(f"# uploaded {len(weights)} weights ({a.layers} layers + lm-head, {total / 1e9:.2f} GB "
          f"of Q6_K) in {time.perf_counter() - t0:.1f} s", flush=True)
    return {name: rows for name, rows, _ in weights}


def model_replay(b: Bench) -> None:
    """The 7B decode replay (issue 14 item 6): every S, with and without multi-weight calls."""
    from q6serve.client.client import PRECISIONS

    a = b.args
    rows = upload_model(b)
    itemsize = 2 if a.dtype == "f16" else 4
    styles = {"both": [True, False], "on": [True], "off": [False]}[a.multi]
    b.batching(True)
    for s_ in a.replay_seqs:
        plans = {multi: step_plan(a.layers, rows, multi, a.topk) for multi in styles}
        # (host spin, multi) -> the step's floor per echo kind; every style's sizes in one
        # echo run per kind (one server process each)
        floors: dict[tuple[float, bool], dict[str, float]] = {}
        for multi in styles:
            plan = plans[multi]
            for spin in a.replay_spins:
                label = f"replay S={s_} {'multi' if multi else 'single'}"
                if len(a.replay_spins) > 1 or spin:
                    label += f" spin={spin:g}"
                spec = ReplaySpec(b.worker.target, tuple(plan), s_, a.seconds, a.warmup, WARM_STEPS,
                                  a.replay_mode, a.dtype, PRECISIONS[a.precision],
                                  a.replay_out, spin, transport=a.replay_transport,
                                  # a client session's replies as its calls return them
                                  decode="client" if a.replay_transport in SESSIONS
                                  else a.replay_decode)
                try:
                    if a.replay_floor and (spin, multi) not in floors:
                        got = replay_floors(plans, s_, itemsize, a, spin)
                        floors.update({(spin, m): f for m, f in got.items()})
                    st, wall, roles = run_replay(spec, a.replay_hosts)
                except Exception as e:
                    print(f"# {label} FAILED: {e}", flush=True)
                    b.errors.append({"run": label, "error": repr(e)[:2000]})
                    b.save()
                    continue
                fl = dict(floors.get((spin, multi), {}))
                per_call_floor = fl.pop("per_call", {})
                # judged on the faster echo (its loop busy-polling as the worker's, or not),
                # as T1 is; the caller's loop as the host's (spin or not): like for like
                floor = min(fl.values()) if fl else float("nan")
                ms = {f: float(np.nanmedian(v) * 1e3) if v.size and not np.isnan(v).all()
                      else float("nan")
                      for f, v in st.items() if f not in ("kernel_missing", "stamped")}
                stamped = bool(st["stamped"].size and st["stamped"].min() == len(plan))
                if not stamped:  # the worker ran without bench/reply_stamps.py
                    ms["up"] = ms["down"] = float("nan")
                kernel = ms["kernel"] if not st["kernel_missing"].any() else None
                limit = (None if kernel is None or np.isnan(floor)
                         else 1.5 * (floor * 1e3 + kernel))
                r = {"label": label, "hosts": a.replay_hosts, "seqs": s_, "n": s_,
                     "multi": multi, "layers": a.layers, "scale": a.scale, "topk": a.topk,
                     "mode": a.replay_mode, "transport": a.replay_transport,
                     "decode": spec.decode,
                     "out_dtype": a.replay_out, "host_spin_us": spin,
                     # the caller's loop's spin, the session's own where it has one (and
                     # the floor's echo caller's)
                     "caller_spin_us": caller_spin_us(a.replay_transport, spin),
                     "calls_per_step": len(plan), "steps": int(st["e2e"].size),
                     "seconds": wall, "steps_per_s": st["e2e"].size / wall,
                     "tokens_per_s": st["e2e"].size * s_ / wall,
                     "step_p50_ms": float(np.percentile(st["e2e"], 50) * 1e3),
                     "step_p99_ms": float(np.percentile(st["e2e"], 99) * 1e3),
                     "kernel_step_ms": kernel, "floor_step_ms": floor * 1e3,
                     "floors_step_ms": {k: v * 1e3 for k, v in fl.items()},
                     "stamped": stamped,
                     "step_parts_p50_ms": ms, "limit_ms": limit,
                     "per_call_p50_us": {role: {f: v if f in UNSCALED else v * 1e6
                                                for f, v in got.items()}
                                         for role, got in roles.items()},
                     # the floor's echo sizes per role, beside the real ones (req_bytes,
                     # reply_bytes above): the bare round trip is of the same sizes
                     "floor_bytes": {c.role: floor_sizes(c, s_, itemsize,
                                                         2 if a.replay_out == "f16" else 4)
                                     for c in plan},
                     # the bare round trip of each role's sizes (us, per echo kind)
                     "floor_per_call_us": {role: {k: v * 1e6 for k, v in got.items()}
                                           for role, got in per_call_floor.items()},
                     "met": None if limit is None else ms["e2e"] <= limit}
                if a.replay_seq_echo:
                    try:
                        r["seq_echo"] = seq_echo(plan, r, s_, itemsize, a, spin)
                    except Exception as e:
                        b.errors.append({"run": f"{label} seq echo", "error": repr(e)[:2000]})
                b.replay.append(r)
                b.save()
                print(replay_line(r), flush=True)
                print(roles_table(r), flush=True)
                if "seq_echo" in r:
                    print(seq_echo_table(r), flush=True)


UNSCALED = ("calls", "req_bytes", "reply_bytes")  # per_call_p50_us: counts and bytes as they are


def replay_floors(plans: dict[bool, list[Any]], n: int, itemsize: int, a: argparse.Namespace,
                  spin: float) -> dict[bool, dict[str, Any]]:
    """Each plan's bare-gRPC floor per step (seconds) with a plain echo and with one whose
    loop busy-polls as the worker's does (the echo's caller spins as the replay host does),
    and under "per_call" each of its roles' round trip (seconds, per echo kind)."""
    out: dict[bool, dict[str, Any]] = {m: {"per_call": {}} for m in plans}
    out_size = 2 if a.replay_out == "f16" else 4
    for kind, echo_spin in (("plain", False), ("spin", True)):
        table: dict[tuple[int, int], float] = {}
        got = step_floors(list(plans.values()), n, itemsize, a.replay_mode, out_size,
                          spin=echo_spin,
                          client_spin_us=caller_spin_us(a.replay_transport, spin),
                          per_size=table,
                          transport=a.replay_transport)
        for (m, plan), f in zip(plans.items(), got, strict=True):
            out[m][kind] = f
            for c in plan:
                out[m]["per_call"].setdefault(c.role, {})[kind] = table[
                    floor_sizes(c, n, itemsize, out_size)]
    for m, fl in out.items():
        print(f"# replay S={n} {'multi' if m else 'single'} floor per step (ms), caller spin "
              f"{caller_spin_us(a.replay_transport, spin):g} us: "
              + ", ".join(f"{k} echo {fl[k] * 1e3:.2f}"
                                           for k in ("plain", "spin")), flush=True)
    return out


def seq_echo(plan: list[Any], r: dict[str, Any], n: int, itemsize: int,
             a: argparse.Namespace, spin: float) -> dict[str, Any]:
    """The step's calls in order against a busy-polling echo (service_replay.held_echo),
    answered at once ("bare") and each held its role's handler p50 of this replay run
    ("held": the worker's window): per role the p50 round trip, and for "held" the same less
    its hold (the transport a bare server with the worker's windows pays)."""
    hold = {role: got["handler"] for role, got in r["per_call_p50_us"].items()}
    return held_echo([(plan, n, hold)], itemsize, 2 if a.replay_out == "f16" else 4,
                     a.replay_mode, min(a.seconds, 1.0),
                     caller_spin_us(a.replay_transport, spin), a.replay_transport)[0]


def seq_echo_table(r: dict[str, Any]) -> str:
    """The replay's transport per call beside the sequence echo's (bare, and held for the
    worker's window)."""
    se = r["seq_echo"]
    lines = [f"    seq echo: step bare {se['bare']['step_ms']:.2f} ms, held "
             f"{se['held']['step_ms']:.2f} ms; per call p50 us: role, echo bare RT, "
             "echo held RT - hold, replay transport (up + down)"]
    for role, got in r["per_call_p50_us"].items():
        lines.append(f"    seq echo  {role:<10} {se['bare']['rt_us'][role]:>8.1f} "
                     f"{se['held']['transport_us'][role]:>8.1f} {got['transport']:>8.1f} "
                     f"({got['up']:.1f} + {got['down']:.1f})")
    return "\n".join(lines)


def roles_table(r: dict[str, Any]) -> str:
    """Per call role, p50 us of one call: where a step's time goes (up / down: the worker's
    reply stamps, when it was run with them), beside the faster bare echo of its sizes."""
    cols = ("rpc", "transport", "up", "down", "handler", "device", "kernel", "client")
    lines = [f"    per call p50 us  {'role':<10} {'calls':>6} " + " ".join(f"{c:>9}" for c in cols)
             + f" {'echo':>9}  bytes up/down (floor's)"]
    for role, got in r["per_call_p50_us"].items():
        fl = r["floor_bytes"].get(role, (0, 0))
        echo = min(r["floor_per_call_us"].get(role, {}).values(), default=float("nan"))
        lines.append(f"    per call p50 us  {role:<10} {got['calls']:>6.0f} "
                     + " ".join(f"{got[c]:>9.1f}" for c in cols) + f" {echo:>9.1f}"
                     + f"  {got['req_bytes']:.0f}/{got['reply_bytes']:.0f} ({fl[0]}/{fl[1]})")
    return "\n".join(lines)


def replay_line(r: dict[str, Any]) -> str:
    k = "n/a" if r["kernel_step_ms"] is None else f"{r['kernel_step_ms']:.2f}"
    p = r["step_parts_p50_ms"]
    verdict = "" if r["limit_ms"] is None else (
        f"  limit 1.5x(floor+kernel) {r['limit_ms']:.1f} ms {'met' if r['met'] else 'MISSED'}")
    return (f"{r['label']:<24} calls/step {r['calls_per_step']:>3}  steps {r['steps']:>5}  "
            f"steps/s {r['steps_per_s']:8.2f}  step p50 {r['step_p50_ms']:8.2f} ms  "
            f"p99 {r['step_p99_ms']:8.2f} ms  kernel/step {k} ms  "
            f"bare gRPC/step {r['floor_step_ms']:.2f} ms{verdict}\n"
            f"    caller gRPC {r.get('transport', 'aio')} {r['mode']}, its loop spinning "
            f"{r.get('caller_spin_us', r.get('host_spin_us', 0)):g} us (the floor's echo "
            "caller the same)\n"
            f"    per step p50 ms: transport {p['transport']:.2f}"
            + ("" if np.isnan(p.get("up", float("nan")))
               else f" (up {p['up']:.2f}, down {p['down']:.2f})")
            + f"  worker {p['handler']:.2f} "
            f"(device {p['device']:.2f}, queue {p['queue']:.2f})  client {p['client']:.2f}"
            + (f"  bench {p['bench']:.2f}" if "bench" in p else ""))


def t2_spread(t: dict[str, Any]) -> str:
    """T2's runs beside their pooled figure (--t2-runs > 1), else nothing."""
    runs = t.get("runs") or []
    if len(runs) < 2:
        return ""
    p99 = [r["p99_us"] / 1e3 for r in runs]
    rows = [r["rows_per_s"] for r in runs]
    return (f"; {len(runs)} runs pooled, each p99 {min(p99):.2f}-{max(p99):.2f} ms, "
            f"rows/s {min(rows):,.0f}-{max(rows):,.0f}")


def target_line(t: dict[str, Any]) -> str:
    verdict = "met" if t["met"] else "MISSED"
    if t["target"] == "T1":
        return (f"T1 {t['mode']}: p50 - kernel = {t['p50_minus_kernel_us']:.0f} us "
                f"(<= {t['limit_us']:.0f} = bare gRPC {t['bare_grpc_p50_us'] or 0:.0f} + 100) "
                f"{verdict}")
    where = f" frontends={t['frontends']} {t['region']}" if "frontends" in t else ""
    if t["target"] == "T2" and "gain" not in t:  # the data-plane report (issue 15)
        return (f"T2 {t['mode']}{where}: {t['rows_per_s']:,.0f} rows/s (>= 20,000), p99 "
                f"{t['p99_us']:.0f} us (<= 4000) {verdict}{t2_spread(t)}")
    if t["target"] == "T2":
        return (f"T2 {t['mode']}: batching gain {t['gain']:.2f}x (>= 5), p99 "
                f"{t['p99_us']:.0f} us (<= 2000) {verdict}")
    return (f"T3 {t['mode']}{where}: {t['service_rows_per_s']:,.0f} rows/s = "
            f"{t['fraction']:.2f} of the kernel alone ({t['kernel_rows_per_s']:,.0f}; "
            f">= {t.get('fraction_min', 0.5)}) {verdict}")


def _commit() -> str:
    """The tree's commit: its COMMIT file where a shipped tree has one (bench/gpu_lib.sh: the
    copy's git metadata may be another checkout's: session 11's checks named ddfe5ee), else
    git's."""
    shipped = Path(__file__).parent.parent / "COMMIT"
    if shipped.is_file():
        return shipped.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"))
    ap.add_argument("--weights", default="attn_v,ffn_down,lm_head",
                    help="weights each decode step calls, in order (of: " + ", ".join(WEIGHTS)
                    + ")")
    ap.add_argument("--row-scale", type=float, default=1.0,
                    help="scale every weight's rows (K stays real), e.g. 0.01 on a CPU")
    ap.add_argument("--hosts", type=int, default=2, help="simulated inference hosts (H)")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per host (S)")
    ap.add_argument("--host-batch", action="store_true",
                    help="each host sends one N=S call per matmul (default: S callers, N=1)")
    ap.add_argument("--mode", default="unary", choices=("unary", "stream", "mux"),
                    help="unary calls, one MatmulStream per caller, or one per host (mux)")
    ap.add_argument("--modes", default="unary,stream",
                    help="--target-report: call modes to measure (default unary,stream)")
    ap.add_argument("--batching", default="both", choices=("on", "off", "both"))
    ap.add_argument("--dtype", default="f16", choices=("f16", "f32"))
    ap.add_argument("--precision", default="f16", choices=("auto", "exact", "f16", "q8_1"))
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run")
    ap.add_argument("--warmup", type=float, default=0.5, help="untimed seconds per run")
    ap.add_argument("--max-batch-rows", type=int, default=64)
    ap.add_argument("--max-batch-delay-us", type=int, default=None)
    ap.add_argument("--inline-device-us", type=int, default=None,
                    help="the worker's --inline-device-us (default: the worker's)")
    ap.add_argument("--pin", default="", metavar="WORKER_CPUS:LOAD_CPUS",
                    help="the worker's --cpus (and the bare gRPC echo's cores) and the cores "
                         "of the load processes (the callers, the floors' callers), e.g. "
                         "2:8-15; either side empty: that side unpinned, e.g. :8,9 the "
                         "callers only; auto, auto-w, auto-c: both sides, the worker's, the "
                         "callers' on the cores a probe finds fastest, 2 each, the worker's "
                         "loop busy-polling (Q6SERVE_BUSY_POLL_US=1000 unless set; "
                         "docs/SERVICE.md, pinning)")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--frontends", type=int, default=1,
                    help="worker --frontends N: gRPC front-end processes (run 1, 2, 4, 8 to "
                    "compare; docs/SERVICE.md)")
    ap.add_argument("--dataplane", action="store_true",
                    help="issue 15: T2 and T3 on ffn_down with bytes and with shm regions "
                         "through this --frontends count (run once per count)")
    ap.add_argument("--regions", default="bytes,system",
                    help="--dataplane: how x and y travel (bytes, system shm regions)")
    ap.add_argument("--cuda-regions", action="store_true",
                    help="--dataplane: T3 with CUDA IPC device buffers too (CUDA backend)")
    ap.add_argument("--target-report", action="store_true",
                    help="measure issue 9's three targets (ffn_down) instead of the replay")
    ap.add_argument("--replay", action="store_true",
                    help="the decode replay of a whole 28-layer 7B-class model (issue 14; "
                    "--layers, --scale, --replay-seqs, --replay-hosts, --multi, --topk) instead "
                    "of the per-weight replay (with --target-report: after it)")
    ap.add_argument("--layers", type=int, default=LAYERS, help="--replay: layers (28)")
    ap.add_argument("--scale", type=float, default=None,
                    help="--replay: scale every weight's rows (default --row-scale)")
    ap.add_argument("--replay-seqs", default="1,8,64",
                    help="--replay: sequences per host S (N = S per call), each measured")
    ap.add_argument("--replay-hosts", type=int, default=1, help="--replay: hosts")
    ap.add_argument("--replay-mode", default="stream", choices=("unary", "stream"),
                    help="--replay: one MatmulStream per host (default) or unary calls")
    ap.add_argument("--replay-transport", default="aio", choices=TRANSPORTS,
                    help="--replay: the hosts' gRPC: aio (default: grpc.aio's stream on the "
                    "host's loop; session 23's 28-layer A/B: S=8 131.1 ms a step against "
                    "Client.session()'s 135.5 / 179.4), session (Client.session() as a user "
                    "runs it, spinning for each reply on 8+ cores: session 22's default), the "
                    "sync stub, ... (bench/svc_util_transport.py); the floor's echo caller "
                    "uses the same, its loop spinning as the host's")
    ap.add_argument("--replay-decode", default="arrays", choices=("arrays", "client"),
                    help="--replay (aio / sync hosts; a session's replies are always the "
                    "client's): how a host reads its replies: arrays (upb parses the reply, "
                    "then y / the top-k as arrays: y copied twice) or client (the q6serve "
                    "client's own stream decoding, core.stream_outcome: what "
                    "Client.matmul_stream yields, large replies' arrays as views of the reply)")
    ap.add_argument("--multi", default="both", choices=("both", "on", "off"),
                    help="--replay: multi-weight calls for q/k/v and gate/up, or not, or both")
    ap.add_argument("--replay-out", default="f16", choices=("f16", "f32"),
                    help="--replay: y's dtype in the replies (f16: what a host feeds its next "
                    "layer)")
    ap.add_argument("--topk", type=int, default=64,
                    help="--replay, --lm-head: the lm-head's top-k epilogue k (0: full f32 "
                    "logits)")
    ap.add_argument("--lm-head", action="store_true",
                    help="issue 14's lm-head target: --lm-callers callers of N=--lm-n with the "
                    "top-k epilogue (--topk), --mode calls; reply bytes vs f32 logits, p50/p99")
    ap.add_argument("--lm-callers", type=int, default=8, help="--lm-head: callers (8)")
    ap.add_argument("--lm-n", type=int, default=64, help="--lm-head: rows per call (64)")
    ap.add_argument("--replay-spins", default="0",
                    help="--replay: the host's loop busy-polls this long (us) before it sleeps, "
                    "each value a run in the order given (e.g. 0,1000,0,1000: alternated); 0: "
                    "a plain asyncio caller (--replay-transport session: the session's own "
                    "default spin)")
    ap.add_argument("--replay-seq-echo", action="store_true",
                    help="--replay: after each run, its step's calls in order against an echo, "
                    "answered at once and held for each role's handler p50 (the transport a bare "
                    "server with the worker's windows pays)")
    ap.add_argument("--no-replay-floor", dest="replay_floor", action="store_false",
                    help="--replay: skip the bare-gRPC floor of the step's call sizes")
    ap.add_argument("--t2-procs", type=int, default=0,
                    help="T2: load processes for the 64 callers (default: cores/2, <= 8)")
    ap.add_argument("--t2-runs", type=int, default=1,
                    help="--dataplane: T2 as this many runs pooled (each --seconds; its "
                    "target the p99 and rows/s of all their calls, each run's beside)")
    ap.add_argument("--t3-hosts", default="1,4,8", help="T3: host counts tried (best kept)")
    ap.add_argument("--targets", default="T1,T2,T3",
                    help="--target-report / --dataplane: which of T1, T2, T3 to measure")
    ap.add_argument("--keep-cpus-awake", action="store_true",
                    help="the worker runs with --keep-cpus-awake: a SCHED_IDLE spinner on "
                    "every CPU for its life (no vCPU halts; the callers and floors run under "
                    "it too; service/keep_awake.py)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    a = ap.parse_args(argv)
    a.weights = [w for w in a.weights.split(",") if w]
    a.modes = [m for m in a.modes.split(",") if m]
    a.t3_hosts = [int(h) for h in a.t3_hosts.split(",") if h]
    a.targets = {t for t in a.targets.upper().split(",") if t}
    if not a.targets <= {"T1", "T2", "T3"}:
        ap.error(f"--targets {sorted(a.targets)}: use T1, T2, T3")
    a.replay_seqs = [int(x) for x in a.replay_seqs.split(",") if x]
    a.replay_spins = [float(x) for x in a.replay_spins.split(",") if x]
    if not a.replay_spins or any(x < 0 for x in a.replay_spins):
        ap.error("--replay-spins: one or more numbers >= 0")
    if a.scale is None:
        a.scale = a.row_scale
    if a.layers < 1 or any(x < 1 for x in a.replay_seqs) or a.replay_hosts < 1:
        ap.error("--layers, --replay-seqs and --replay-hosts must be >= 1")
    if a.lm_callers < 1 or a.lm_n < 1 or a.topk < 0:
        ap.error("--lm-callers and --lm-n must be >= 1, --topk >= 0")
    bad = [w for w in a.weights if w not in WEIGHTS]
    if bad:
        ap.error(f"unknown weights {bad}; use {list(WEIGHTS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # `timeout` sends SIGTERM: exit through the finally below, so the worker and the load
    # processes are stopped and the JSON is written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(a.json).parent if a.json else Path(tempfile.mkdtemp(prefix="q6bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.pin in AUTO_PIN:
        asked, a.pin = a.pin, auto_pin(a.pin)
        # a worker pinned to fewer than 8 cores would not busy-poll (service/threads.py):
        # session 25's pinned T1 ran with it on, the worker's and the echo floor's alike
        if AUTO_PIN[asked][0]:
            os.environ.setdefault("Q6SERVE_BUSY_POLL_US", "1000")
        print(f"# --pin {asked}: {a.pin} (the fastest cores); Q6SERVE_BUSY_POLL_US="
              f"{os.environ.get('Q6SERVE_BUSY_POLL_US')}", flush=True)
    pins = pin_parts(a.pin) if a.pin else None  # (refused before a worker starts)
    b = Bench(a, out_dir)
    if a.keep_cpus_awake:  # the worker's line about it
        said = [x.split(": ", 1)[-1] for x in b.worker.log().splitlines() if "keep awake:" in x]
        print(f"# worker: {said[0] if said else '?'}", flush=True)
    if pins is not None:  # load processes and floor clients are spawned from here: they
        server, load = pins  # inherit it
        service_load.SERVER_CPUS = server
        if load:
            os.sched_setaffinity(0, load)
    try:
        print(f"# worker {b.worker.target}: {b.backend} on {b.device}; commit {_commit()}; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
              f"{os.cpu_count()} cores", flush=True)
        # what the callers' and the floors' processes inherit (q6serve.client's import sets
        # it where unset: client/grpc_env.py)
        print(f"# callers' gRPC: GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS')!r}",
              flush=True)
        if a.target_report:
            b.upload(["ffn_down"])
            target_report(b)
        if a.lm_head:
            lm_head_topk(b)
        if a.dataplane:
            b.upload(["ffn_down"])
            dataplane_report(b)
        if a.replay:
            model_replay(b)
        elif not (a.target_report or a.lm_head or a.dataplane):
            b.upload(a.weights)
            replay(b)
    finally:
        b.save()
        b.close()
    for t in b.targets:
        print("# " + target_line(t), flush=True)
    if b.lm_head is not None:
        print("# " + lm_line(b.lm_head), flush=True)
    for r in b.replay:
        print("# " + replay_line(r).replace("\n", "\n# "), flush=True)
    print(f"# done in {time.perf_counter() - b.t_start:.0f} s; worker log {b.worker.log_path}",
          flush=True)
    return 1 if b.errors else 0


if __name__ == "__main__":
    sys.exit(main())
