"""One decode layer's backend calls in one process, multi-weight calls as one call or in parts
(issue 14, session 27: why a single-weight call is dearer after a ``launch_many``; run on a GPU).

A step is the replay's layer as the worker's direct path calls the backend (S tokens, f16 x and
y, precision F16, through ``api.launch_ieee`` / ``api.launch_many_ieee`` with the engine's one
flags object): q+k+v (3584x3584 + 512x3584 + 512x3584) on one x, o (3584x3584), gate+up (2 x
18944x3584), down (3584x18944). A variant decides how the two multi-weight calls run:

- ``off``: each part's launch and wait in turn (``Q6SERVE_MULTI_LAUNCH`` off: the engine runs
  every part as its own direct job);
- ``on``: ``launch_many_ieee`` (``Q6SERVE_MULTI_LAUNCH=1``: one backend call);
- ``on+s``: ``on`` and a tiny single call (the k weight's, on the same x) right after each
  multi-weight call, before the next single: whether o / down pay for what ran just before them
  on the device or on the host (the same calls in ``off`` follow k/v's and up's single calls);
- ``on+g`` / ``on+e`` / ``on+k``: ``on`` and, right after each multi-weight call, one driver
  call on the backend's stream without a wait: the launch of a captured graph of one empty
  kernel / an event's record / that empty kernel launched directly (which of a single call's
  steps leaves what the next single call's launch finds cheaper); ``on+w``: an event's record
  and its synchronize (a host wait on the stream); ``on+G``: that graph launched between the
  multi-weight call's launch and its wait (where the host only waits for the GPU).

A variant ``WAY:NAME=INT[+NAME=INT...]`` also sets constants of kernels/cuda/launch.py for its
rounds (e.g. ``on:Y16_COPY=1``; each switch rebinds the sequences, two steps unmeasured after
it); ``OLD_FILL=1``: a cached call's x into its staging by ``fill_x`` (byte views, slice,
reshape) as before ``launch.stage_into``. Variants alternate per round (order reversed every
other round). ``--gap-us G``: before every call the host does ~G us of other Python work over a
few MB (the worker's gRPC, decode and reply between two device jobs, which evict the caches a
back-to-back loop keeps warm); ``G+Z``: that work, then Z us asleep (the worker's loop idle in
its poll while the reply and the next request travel: the CPU may enter an idle state, as in
the replay). ``DMA_LAT=1`` in a variant (session 29): while its rounds run, this process holds
/dev/cpu_dma_latency open with 0 written (the kernel's PM QoS: no CPU enters an idle state
deeper than polling; the file needs root), let go when a variant without it runs;
``SLEEP_US=Z`` / ``SPIN_US=Z``: after each gap's work, Z us asleep / busy-polling an empty
selector (as the worker's loop spins between requests), per variant (alternated with the
rest, so the machine's drift weighs on both).

Per call role (q+k+v, o, gate+up, down): wall (launch .. wait returned), launch (launch's own
return), wait, kernel (the calls' reported kernel time, the parts' summed), host = wall -
kernel, and for the singles ``gpu_pre``: from a CUDA event recorded right before the launch to
the call's start event (its graph's upload of x and launch latency on the GPU), ``gpu_tail``:
from its end event to an event recorded right after the launch returned (y's f16 conversion,
its download, the completion event; both bench events cost the singles' wall a host call each,
in every variant alike). Medians per
round; the table prints the median over rounds per (S, gap, role, variant). Every variant's
y's are compared bit for bit with ``off``'s on the first step's x.

    python bench/layer_wall.py [--seqs 1,8] [--steps 200] [--layers 1] [--rounds 4] [--gap-us 0,150]
                               [--variants off,on,on+s] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import sys
import time
from typing import Any

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import KernelFlags, Precision, launch_ieee, launch_many_ieee

LAYER = {"q": (3584, 3584), "k": (512, 3584), "v": (512, 3584), "o": (3584, 3584),
         "gate": (18944, 3584), "up": (18944, 3584), "down": (3584, 18944)}
ROLES = (("q+k+v", ("q", "k", "v"), 3584), ("o", ("o",), 3584),
         ("gate+up", ("gate", "up"), 3584), ("down", ("down",), 18944))
WAYS = ("off", "on", "on+s", "on+g", "on+G", "on+e", "on+w", "on+k")
# variant keys that are not launch.py constants (their defaults): OLD_FILL=1, a cached call's
# unstaged x copied into its staging by fill_x as before session 27's launch.stage_into
# DMA_LAT=1: /dev/cpu_dma_latency held at 0 while the variant runs (CPUs kept out of deep idle);
# SLEEP_US / SPIN_US: after the gap's work, that long asleep / busy-polling an empty selector
# without blocking, as the worker's loop spins between requests (service/threads.py)
LOCAL = {"OLD_FILL": 0, "DMA_LAT": 0, "SLEEP_US": 0, "SPIN_US": 0}
IDLE = {"SLEEP_US": 0, "SPIN_US": 0}  # the running variant's
SELECTOR = selectors.DefaultSelector()  # (SPIN_US: polled empty)
DMA_PATH = "/dev/cpu_dma_latency"
DMA: list[int] = []  # the descriptor held open while a DMA_LAT=1 variant runs


def hold_dma(on: bool) -> None:
    """DMA_PATH held open with 0 written (on) or let go; a failure to open it is printed."""
    if on and not DMA:
        try:
            fd = os.open(DMA_PATH, os.O_WRONLY)
        except OSError as e:
            print(f"# DMA_LAT=1: {DMA_PATH} not held ({e})", flush=True)
            return
        os.write(fd, (0).to_bytes(4, sys.byteorder))
        DMA.append(fd)
    elif not on and DMA:
        os.close(DMA.pop())


FLAGS = KernelFlags()  # the engine's one flags object (a cached call's identity checks hold)
F16 = np.dtype(np.float16)


class Gap:
    """~``us`` microseconds of host work over a few MB of its own (0: none), then ``sleep_us``
    asleep."""

    def __init__(self, us: float, sleep_us: float = 0.0) -> None:
        self.us, self.sleep_us = us, sleep_us
        self.src = np.random.default_rng(1).integers(0, 255, 4 << 20, np.uint8)
        self.dst = np.empty_like(self.src)
        self.at = 0

    @classmethod
    def parse(cls, text: str) -> Gap:
        work, _, sleep = text.partition("+")
        return cls(float(work), float(sleep or 0))

    def __call__(self) -> None:
        if self.us:
            self.work()
        sleep = self.sleep_us or IDLE["SLEEP_US"]
        if sleep:
            time.sleep(sleep * 1e-6)
        if IDLE["SPIN_US"]:
            end = time.perf_counter() + IDLE["SPIN_US"] * 1e-6
            while time.perf_counter() < end:
                SELECTOR.select(0)

    def work(self) -> None:
        end = time.perf_counter() + self.us * 1e-6
        while time.perf_counter() < end:  # copy 256 KiB slices of 4 MiB round and round
            a = self.at
            self.dst[a : a + (256 << 10)] = self.src[a : a + (256 << 10)]
            self.at = (a + (256 << 10)) % (4 << 20)
            bytes(64)  # (and a little Python allocation, as a handler has)


STAMPS: dict[str, float] = {}  # a single call's stamps inside its launch (Stamped*)


class StampedGraph:
    """A cached single call's graph with the host's clock read around its launch (g0, g1)."""

    def __init__(self, g: Any) -> None:
        self.g = g

    def launch(self, stream: Any) -> None:
        STAMPS["g0"] = time.perf_counter()
        self.g.launch(stream)
        STAMPS["g1"] = time.perf_counter()


class StampedEvent:
    """A cached single call's completion event with its record stamped (r0, r1)."""

    def __init__(self, ev: Any) -> None:
        self.ev, self.ptr = ev, ev.ptr

    def record(self, stream: Any = None) -> None:
        STAMPS["r0"] = time.perf_counter()
        self.ev.record(stream)
        STAMPS["r1"] = time.perf_counter()

    def synchronize(self) -> None:
        self.ev.synchronize()


def stamp_calls(layers: list[dict], s: int) -> None:
    """Put the stamps on the singles' cached calls (o, down at S=s, slot 0): after a binding,
    the calls are new objects."""
    for w in layers:
        for name in ("o", "down"):
            call = w[name].data.plans.get(((s, LAYER[name][1]), 0))
            if call is None or not hasattr(call, "b"):
                continue
            if call.b.graph and type(call.b.graph) is not StampedGraph:
                call.b.graph = StampedGraph(call.b.graph)
            if type(call.done) is not StampedEvent:
                call.done = StampedEvent(call.done)


def single(be: Any, w: Any, x: np.ndarray, ev: tuple[Any, Any], gpu: bool) -> tuple:
    """One single-weight call: (results, wall, launch, kernel, gpu_pre, gpu_tail, to_graph,
    graph, record) in s: the last three inside the launch where its call is stamped
    (:func:`stamp_calls`: launch .. graph launch, the graph launch, the event's record)."""
    if gpu:
        ev[0].record(be.stream)
    STAMPS.clear()
    t0 = time.perf_counter()
    launched = launch_ieee(be, w, x, precision=Precision.F16, flags=FLAGS, out_dtype=F16)
    t1 = time.perf_counter()
    if gpu:
        ev[1].record(be.stream)
    r = launched.wait()
    t2 = time.perf_counter()
    pre = tail = float("nan")
    if gpu:
        call = w.data.plans.get((x.shape, 0))
        if call is not None and hasattr(call, "b"):
            el = be.ctx.cp.cuda.get_elapsed_time
            ev[1].synchronize()
            pre = el(ev[0], call.b.start) * 1e-3
            tail = el(call.b.end, ev[1]) * 1e-3
    st, nan = STAMPS, float("nan")
    parts = ((st["g0"] - t0, st["g1"] - st["g0"], st["r1"] - st["r0"]) if len(st) == 4 else
             (nan, nan, nan))
    return ([r], t2 - t0, t1 - t0, r.timing.seconds(wait=True) or nan, pre, tail, *parts)


class Poke:
    """The diagnostic ways' driver calls (``on+g``, ``on+G``, ``on+e``, ``on+w``, ``on+k``): a
    graph of one empty kernel, that kernel, an event; made on first use."""

    SRC = 'extern "C" __global__ void q6_lw_nop() {}'

    def __init__(self, be: Any) -> None:
        self.be, self.made = be, False

    def _make(self) -> None:
        be = self.be
        cp, st = be.ctx.cp, be.ctx.stream
        with be.ctx.dev, st:
            self.kern = cp.RawKernel(self.SRC, "q6_lw_nop")
            self.kern((1,), (1,), (), stream=st)  # (compiled, loaded)
            st.synchronize()
            st.begin_capture(getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2))
            self.kern((1,), (1,), (), stream=st)
            self.graph = st.end_capture()
            self.ev = cp.cuda.Event(disable_timing=True)
        self.made = True

    def __call__(self, what: str) -> None:
        if not self.made:
            self._make()
        st = self.be.ctx.stream
        with self.be.ctx.dev:
            if what in ("g", "G"):
                self.graph.launch(st)
            elif what == "e":
                self.ev.record(st)
            elif what == "w":
                self.ev.record(st)
                self.ev.synchronize()
            else:
                self.kern((1,), (1,), (), stream=st)


def multi(be: Any, ws: list, x: np.ndarray, way: str, poke: Poke | None = None) -> tuple:
    """One multi-weight call ``way``: (results, wall, launch, kernel summed, nan, nan)."""
    t0 = time.perf_counter()
    if way == "off":  # each part's launch and wait (the engine's run_direct per part)
        rs, t1 = [], None
        for w in ws:
            la = launch_ieee(be, w, x, precision=Precision.F16, flags=FLAGS, out_dtype=F16)
            t1 = t1 or time.perf_counter()
            rs.append(la.wait())
    else:
        la = launch_many_ieee(be, ws, x, precision=Precision.F16, flags=[FLAGS] * len(ws),
                              out_dtype=F16)
        t1 = time.perf_counter()
        if way == "on+G" and poke is not None:  # (the host only waits for the GPU here)
            poke("G")
        rs = la.wait()
    t2 = time.perf_counter()
    ks = [r.timing.seconds(wait=True) for r in rs]
    nan = float("nan")
    return rs, t2 - t0, t1 - t0, sum(ks) if None not in ks else nan, nan, nan, nan, nan, nan


def step(be: Any, layers: list[dict], xs: tuple[np.ndarray, np.ndarray], way: str, gap: Gap,
         ev: tuple[Any, Any], out: dict[str, list] | None, poke: Poke | None = None) -> list:
    """Every layer's calls in turn; their timings appended to ``out[role]`` (None: not
    kept)."""
    ys = []
    for w, (role, names, _) in ((w, r) for w in layers for r in ROLES):
        x = xs[1] if role == "down" else xs[0]
        gap()
        if len(names) == 1:
            got = single(be, w[names[0]], x, ev, out is not None)
        else:
            got = multi(be, [w[n] for n in names], x, way, poke)
        ys += [r.y for r in got[0]]
        if out is not None:
            out.setdefault(role, []).append(got[1:])
        if len(names) > 1 and way == "on+s":  # a tiny single call right after it
            launch_ieee(be, w["k"], xs[0], precision=Precision.F16, flags=FLAGS,
                        out_dtype=F16).wait()
        elif len(names) > 1 and way in ("on+g", "on+e", "on+w", "on+k") and poke is not None:
            poke(way[-1])
    return ys


class _Bound(Exception):
    """--bound reached: no more rounds."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=1,
                    help="layers a step (each its own copy of the weights: its own cached "
                    "calls and graphs, as in the replay)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gap-us", default="0,150")
    ap.add_argument("--variants", default=",".join(WAYS),
                    help="WAY[:NAME=INT[+NAME=INT...]] comma separated (WAY: off, on, on+s, on+g, "
                    "on+G, on+e, on+w, on+k; "
                    "NAME: a constant of kernels/cuda/launch.py set for that variant's rounds, "
                    "e.g. on:Y16_COPY=1; every switch rebinds the sequences)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--bound", type=float, default=0,
                    help="seconds: start no round that would end past it (0: none)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    from backend_wall import load

    from q6serve.kernels.cuda import launch as launch_mod
    from q6serve.kernels.cuda_backend import CudaBackend

    variants: list[str] = a.variants.split(",")
    spec: dict[str, tuple[str, dict[str, int]]] = {}
    for v in variants:
        way, _, sets = v.partition(":")
        pairs = dict(kv.split("=") for kv in filter(None, sets.split("+")))
        if way not in WAYS or not all(hasattr(launch_mod, k) or k in LOCAL for k in pairs):
            ap.error(f"--variants: {v!r} (a way of {', '.join(WAYS)}, then constants of "
                     "kernels/cuda/launch.py)")
        spec[v] = (way, {k: int(x) for k, x in pairs.items()})
    defaults = {k: LOCAL[k] if k in LOCAL else getattr(launch_mod, k)
                for _, sets in spec.values() for k in sets}
    now: list[dict[str, int]] = [{}]
    stage_into = launch_mod.stage_into
    def old_fill(call: Any, x: np.ndarray) -> None:  # (OLD_FILL=1: before stage_into)
        launch_mod.fill_x(call.host, x)

    def use(v: str) -> str:
        """Variant ``v``'s constants set (a change rebinds every sequence); its way."""
        way, sets = spec[v]
        want = {**defaults, **sets}
        if want != now[0]:
            for k, x in want.items():
                if k == "OLD_FILL":
                    launch_mod.stage_into = old_fill if x else stage_into
                elif k == "DMA_LAT":
                    hold_dma(bool(x))
                elif k in IDLE:
                    IDLE[k] = x
                else:
                    setattr(launch_mod, k, x)
            be.launcher.ws.gen += 1
            now[0] = want
        return way

    be = CudaBackend(0)
    rng = np.random.default_rng(0)
    blocks = {n: q6k.random_blocks(r, k, rng) for n, (r, k) in LAYER.items()}
    w = [{n: load(be, blocks[n], r, k) for n, (r, k) in LAYER.items()}
         for _ in range(a.layers)]  # (each layer its own weights, as the replay's)
    ev = (be.ctx.cp.cuda.Event(), be.ctx.cp.cuda.Event())
    poke = Poke(be)
    print(f"# device: {be.device_name()}  date: {time.strftime('%Y-%m-%d %H:%M')}  layer: "
          + ", ".join(f"{n} {r}x{k}" for n, (r, k) in LAYER.items()) + f"; f16 x and y, F16; "
          f"{a.layers} layers x {a.steps} steps a round, {a.rounds} rounds", flush=True)
    rows: list[dict] = []
    equal = True
    try:
        for s in map(int, a.seqs.split(",")):
            xs = [(rng.standard_normal((s, 3584)).astype(F16),
                   rng.standard_normal((s, 18944)).astype(F16)) for _ in range(4)]
            ref = None
            for v in variants:  # warm-up (bind, capture) and the bit check on xs[0]
                way = use(v)
                for _ in range(3):
                    step(be, w, xs[0], way, Gap(0), ev, None, poke)
                ys = step(be, w, xs[0], way, Gap(0), ev, None, poke)
                ys = [y.copy() for y in ys]
                if ref is None:
                    ref = ys
                elif not all(np.array_equal(p, q) for p, q in zip(ys, ref, strict=True)):
                    print(f"# S={s} {v}: y DIFFERS from {variants[0]}'s", flush=True)
                    equal = False
            for gtext in a.gap_us.split(","):
                gap = Gap.parse(gtext)
                g = f"{gap.us:g}" + (f"+{gap.sleep_us:g}" if gap.sleep_us else "")
                for rnd in range(a.rounds):
                    for v in (variants[::-1] if rnd % 2 else variants):
                        t_r = time.perf_counter()
                        way = use(v)
                        for _ in range(2):  # (after a rebind: bound and captured again)
                            step(be, w, xs[1], way, gap, ev, None, poke)
                        stamp_calls(w, s)
                        got: dict[str, list] = {}
                        for i in range(a.steps):
                            step(be, w, xs[i % len(xs)], way, gap, ev, got, poke)
                        for role, vals in got.items():
                            cols = list(zip(*vals, strict=True))
                            wall, launch, kern, pre, tail, to_g, graph, rec = (
                                statistics.median(c) * 1e6 for c in cols)
                            host = statistics.median((x - y) * 1e6 for x, y in zip(cols[0], cols[2],
                                                                                     strict=True))
                            rows.append({"seqs": s, "gap": g, "gap_us": gap.us,
                                         "sleep_us": gap.sleep_us, "variant": v, "round": rnd,
                                         "role": role, "wall": wall, "launch": launch,
                                         "wait": wall - launch, "kernel": kern, "host": host,
                                         "gpu_pre": pre, "gpu_tail": tail, "to_graph": to_g,
                                         "graph": graph, "record": rec})
                        took = time.perf_counter() - t_r
                        if a.bound and time.perf_counter() - t_start + took > a.bound:
                            print(f"# bound: stopped after S={s} gap {g} round {rnd} {v}",
                                  flush=True)
                            raise _Bound
    except _Bound:
        pass
    finally:
        for k, x in defaults.items():  # (the module as it was)
            if k not in LOCAL:
                setattr(launch_mod, k, x)
        launch_mod.stage_into = stage_into
        hold_dma(False)
        IDLE.update(SLEEP_US=0, SPIN_US=0)
    return report(rows, variants, a.json, equal)


def report(rows: list[dict], variants: list[str], path: str | None, equal: bool) -> int:
    print("# per call, us, median over rounds of each round's median: host = wall - kernel "
          "(wall, launch, kernel, gpu_pre, gpu_tail; in the launch: to the graph launch / the "
          "graph launch / the event record)")
    gaps = list(dict.fromkeys(r["gap"] for r in rows))  # (in the order run)
    keys = sorted({(r["seqs"], r["gap"], r["role"]) for r in rows},
                  key=lambda k: (k[0], gaps.index(k[1]), [x[0] for x in ROLES].index(k[2])))
    wide = max(map(len, variants))
    for s, g, role in keys:
        cells = []
        for v in variants:
            rs = [r for r in rows if (r["seqs"], r["gap"], r["role"], r["variant"]) ==
                  (s, g, role, v)]
            if not rs:
                continue
            m = {f: statistics.median(r.get(f, float("nan")) for r in rs)
                 for f in ("host", "wall", "launch", "kernel", "gpu_pre", "gpu_tail", "to_graph",
                           "graph", "record")}
            pre = ("" if m["gpu_pre"] != m["gpu_pre"] else
                   f", {m['gpu_pre']:.1f}, {m['gpu_tail']:.1f}")
            if m["to_graph"] == m["to_graph"]:
                pre += f"; {m['to_graph']:.1f} / {m['graph']:.1f} / {m['record']:.1f}"
            cells.append(f"{v} {m['host']:.1f} ({m['wall']:.1f}, {m['launch']:.1f}, "
                         f"{m['kernel']:.1f}{pre}) x{len(rs)}")
        head = f"S={s} gap {g} {role:>8}:"
        if len(variants) <= 3:  # one line a role
            print(f"{head} " + "  ".join(cells), flush=True)
        else:  # one line a variant
            for c in cells:
                v, _, rest = c.partition(" ")
                print(f"{head} {v:>{wide}} {rest}", flush=True)
    if not equal:
        print("# y DIFFERS between variants")
    if path:
        with open(path, "w") as fh:
            json.dump({"rows": rows, "equal": equal}, fh, indent=1)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (backend_wall's load)
    sys.exit(main())
