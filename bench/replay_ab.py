"""An A/B of worker variants on the decode replay of ``bench/service.py --replay`` (issue 14),
alternated in one call: one worker per variant (its environment), all started first and each
given the whole synthetic model once (uploads in parallel), then the replay runs round by
round in ``--order``, each S of ``--seqs`` per run. Same calls, same client code, same
figures as ``bench/service.py --replay`` (bench/service_replay.py; no bare-gRPC floor), but
the ~12 s upload of the 28-layer model is paid once per worker, not once per run, so an
alternated pair fits a short device call.

    python3 bench/replay_ab.py --backend cuda --variants "def: pipe:Q6SERVE_MULTI_PIPELINE=1" \
        --order def,pipe,pipe,def --seqs 1,8 --seconds 1.5 --json out.json
    a CPU rehearsal: --backend numpy --layers 2 --scale 0.002

``--variants``: space-separated ``NAME:ENV=V,ENV=V`` (an empty list: the tree's defaults);
``host.*`` in a variant's list are the replay host's own options, not the worker's:
``host.spin=US`` (its loop busy-polls US before it sleeps, as ``--spin`` for every variant),
``host.decode=arrays|client`` (upb and the arrays, as up to session 19, or the q6serve client's
own stream decoding), ``host.view_min=BYTES`` (client/reply_bytes.VIEW_MIN there: 1e18 never
reads arrays as views), ``host.transport=aio|sync`` (the host's gRPC: grpc.aio or the sync stub,
bench/svc_util_transport.py), ``host.mode=stream|unary`` (MatmulStream or unary Matmul calls),
``host.grpc.NAME=INT`` (channel argument grpc.NAME of the host's channel, beside the client's
own, e.g. host.grpc.enable_retries=0), ``host.chains=C`` (the host's S sequences as C
concurrent chains of S / C rows, a stream each; an S that C does not divide is not run),
``host.multi=on|off`` (this variant's calls with or without multi-weight requests, in place of
``--multi``: multi-weight and single calls alternated on one worker),
``host.ahead=on|off`` (the host's stream reads each reply before its request's write has
completed: the write started at once, service_load.start_now; off by default),
``host.precision=auto|exact|f16|q8_1`` (the requests' precision: auto by default,
bench/service.py --replay's default is f16), ``host.ee=off|def`` (the host processes'
GRPC_EXPERIMENTS: gRPC's EventEngine off as `q6serve worker` runs it, client/grpc_env.py, or
gRPC's defaults; not given: this process's environment).
``sys.hold=dma|idlespin``: a machine-wide hold this process keeps around the variant's runs only
(bench/cpu_hold.py: /dev/cpu_dma_latency at 0, or a SCHED_IDLE spinner per CPU), neither the
worker's nor the host's option: every worker is up under it alike.
Variants whose worker environments are equal share one worker, so
host-side variants alternate on one worker.
``--bound S``: no run starts after S seconds from the start (what would end past it is
skipped, said so); the table of what ran is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from cpu_hold import SystemHold, idle_text
from service_replay import LAYERS, WARM_STEPS, ReplaySpec, model_weights, run_replay, step_plan
from svc_util_transport import TRANSPORTS

from q6serve.client import grpc_env
from q6serve.client.worker_process import WorkerProcess
from q6serve.kernels import q6k
from q6serve.service.affinity import parse_cpus

# per call role, what a run keeps (p50 us; "calls": how many were timed)
ROLE_FIELDS = ("rpc", "transport", "handler", "device", "kernel", "client", "enc", "ccpu", "up",
               "down", "calls")
def _choice(key: str, choices: tuple[str, ...]) -> Any:
    def check(v: str) -> str:
        if v not in choices:
            raise SystemExit(f"--variants: {key}={v!r}: one of {', '.join(choices)}")
        return v
    return check


def _decode_mode(v: str) -> str:
    if v not in ("arrays", "client"):
        raise SystemExit(f"--variants: host.decode={v!r}: arrays or client")
    return v


# a variant's options for the replay host (its caller): ReplaySpec's spin_us, decode, view_min
HOST_KEYS: dict[str, Any] = {"host.spin": float, "host.decode": _decode_mode,
                             "host.view_min": lambda v: int(float(v)),
                             "host.transport": _choice("host.transport", TRANSPORTS),
                             "host.mode": _choice("host.mode", ("stream", "unary")),
                             "host.chains": int,
                             "host.multi": _choice("host.multi", ("on", "off")),
                             "host.ee": _choice("host.ee", ("off", "def")),
                             "host.ahead": _choice("host.ahead", ("on", "off")),
                             "host.precision": _choice("host.precision",
                                                       ("auto", "exact", "f16", "q8_1"))}
# host.ee: the replay host's GRPC_EXPERIMENTS (its gRPC's EventEngine off as `q6serve worker`
# runs it, or gRPC's defaults); not given: the bench's environment (gRPC's defaults unless set)
HOST_EE = {"off": grpc_env.EVENT_ENGINE_OFF, "def": ""}


def ee_name(value: str | None) -> str:
    """A GRPC_EXPERIMENTS value, short: "EE off" (client/grpc_env's), "defaults" (unset or
    empty), else the value itself."""
    if value == grpc_env.EVENT_ENGINE_OFF:
        return "EE off"
    return "defaults" if not value else repr(value)


def parse_variants(text: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in text.split():
        name, _, envs = item.partition(":")
        env = {}
        for kv in filter(None, envs.split(",")):
            k, sep, v = kv.partition("=")
            if not sep:
                raise SystemExit(f"--variants: {kv!r} is not ENV=VALUE")
            env[k] = v
        out[name] = env
    return out


def variants_and_order(ap: argparse.ArgumentParser, variants_text: str,
                       order_text: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """--variants parsed and --order checked against them (an unknown name: ap.error)."""
    variants = parse_variants(variants_text)
    order = [v for v in order_text.split(",") if v]
    if unknown := [v for v in order if v not in variants]:
        ap.error(f"--order names {unknown} not in --variants")
    return variants, order


def split_variant(env: dict[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """A variant's worker environment and its host options (HOST_KEYS, typed)."""
    worker = {k: v for k, v in env.items() if not k.startswith(("host.", "sys."))}
    host: dict[str, Any] = {}
    for k, v in env.items():
        if k.startswith("host.grpc."):  # a channel argument of the host's gRPC channel
            try:
                host.setdefault("host.grpc", {})[k[len("host."):]] = int(v)
            except ValueError:
                raise SystemExit(f"--variants: {k}={v!r}: an integer") from None
        elif k == "sys.hold":
            host[k] = v
        elif k.startswith("sys."):
            raise SystemExit(f"--variants: unknown machine option {k!r} (known: sys.hold)")
        elif k.startswith("host."):
            if k not in HOST_KEYS:
                raise SystemExit(f"--variants: unknown host option {k!r} (known: "
                                 f"{', '.join(HOST_KEYS)})")
            host[k] = HOST_KEYS[k](v)
    return worker, host


def worker_keys(variants: dict[str, dict[str, str]]) -> dict[str, str]:
    """Variant -> the name of the worker it runs on: the first variant with the same worker
    environment (host options aside)."""
    first: dict[tuple[tuple[str, str], ...], str] = {}
    return {v: first.setdefault(tuple(sorted(split_variant(env)[0].items())), v)
            for v, env in variants.items()}


def start(backend: str, env: dict[str, str], log: Path,
          cpus: tuple[int, ...] = ()) -> WorkerProcess:
    """A worker with ``env`` on top of our environment (given to its exec: os.environ is never
    changed here, as the workers start from several threads at once); ``cpus``: pinned there
    (its --cpus: every thread of it)."""
    args = ["--backend", backend, "--log-level", "INFO"]
    if cpus:
        args += ["--cpus", ",".join(map(str, cpus))]
    return WorkerProcess(args, log, env=env).start()


def start_all(backend: str, envs: dict[str, dict[str, str]], out_dir: Path,
              cpus: dict[str, tuple[int, ...]] | None = None) -> dict[str, WorkerProcess]:
    """A worker per name of ``envs``, all started at once (start: that name's environment,
    its log ``out_dir/worker_<name>.log``, its ``cpus`` where given)."""
    with ThreadPoolExecutor(len(envs)) as pool:
        return dict(zip(envs, pool.map(
            lambda v: start(backend, envs[v], out_dir / f"worker_{v}.log",
                            (cpus or {}).get(v, ())), envs), strict=True))


def saver(doc: dict[str, Any], path: Path | None, t_start: float) -> Callable[[], None]:
    """What saves an A/B's ``doc``: as JSON to ``path`` (None: nowhere), with its wall seconds
    since ``t_start``."""
    def save() -> None:
        if path is not None:
            doc["wall_seconds"] = time.perf_counter() - t_start
            path.write_text(json.dumps(doc, indent=1))
    return save


def stop_all(clients: Any, workers: Any, save: Callable[[], None]) -> None:
    """An A/B's end (its ``finally``): every client (an iterable) closed, every worker
    stopped, the document saved."""
    for c in clients:
        c.close()
    for w in workers:
        w.stop()
    save()


def pin_plan(text: str, variants: list[str]) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...]]:
    """``--pin WORKER_CPUS:LOAD_CPUS`` -> each variant's worker cores and the hosts' cores.
    As many worker cores as variants: one core each (an idle worker's threads then never share
    the measured one's core); else every worker on all of them. Empty: nothing pinned."""
    if not text:
        return {v: () for v in variants}, ()
    worker, sep, load = text.partition(":")
    if not sep or not worker or not load:
        raise SystemExit(f"--pin {text!r}: WORKER_CPUS:LOAD_CPUS, e.g. 2,3:8-15")
    w, ld = parse_cpus(worker), parse_cpus(load)
    if set(w) & set(ld):
        raise SystemExit(f"--pin {text!r}: the workers' and the hosts' cores overlap")
    if len(w) == len(variants):
        return {v: (c,) for v, c in zip(variants, w, strict=True)}, ld
    return {v: w for v in variants}, ld


def worker_env(w: WorkerProcess) -> dict[str, str]:
    """The Q6SERVE_ variables (and GLIBC_TUNABLES) the worker process really has (its /proc
    environ)."""
    try:
        raw = Path(f"/proc/{w.proc.pid}/environ").read_bytes()  # type: ignore[union-attr]
    except OSError as e:
        return {"?": type(e).__name__}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0"))
    return {k: v for k, _, v in pairs if k.startswith("Q6SERVE_") or k == "GLIBC_TUNABLES"}


def give_model(clients: list[Any], layers: int, scale: float) -> list[tuple[str, int, int]]:
    """The synthetic model (service_replay.model_weights: (name, rows, K) per weight) uploaded
    to every one of ``clients`` (q6serve Clients), 4 uploads a client at once; said in one
    line."""
    weights = model_weights(layers, scale)
    data = {}
    for i, (rows, k) in enumerate(sorted({(r, k) for _, r, k in weights})):
        data[(rows, k)] = q6k.random_blocks(rows, k, np.random.default_rng(100 + i))
    t0 = time.perf_counter()
    jobs = [(c, name, rows, k) for c in clients for name, rows, k in weights]
    with ThreadPoolExecutor(4 * len(clients)) as pool:
        list(pool.map(lambda j: j[0].upload(j[1], data[(j[2], j[3])], j[2], j[3]), jobs))
    total = sum(data[(r, k)].nbytes for _, r, k in weights)
    print(f"# {len(clients)} workers given {len(weights)} weights each ({total / 1e9:.2f} GB "
          f"of Q6_K) in {time.perf_counter() - t0:.1f} s", flush=True)
    return weights


def bounded(doc: dict[str, Any], label: str, key: int, need: dict[int, float],
            t_start: float, a: argparse.Namespace, save: Callable[[], None],
            run: Callable[[], Any]) -> tuple[Any, float] | None:
    """One run of an A/B's loop (bench/replay_ab.py's, hp_toggle_ab's, service_t1ab's,
    hp_cold_t1's): not started where it would end past ``a.bound`` s after ``t_start`` (said,
    noted in ``doc["errors"]``; None), else ``run()``; a failure is said, noted and saved
    (None); else (what ``run()`` gave, the perf_counter the run started at). ``need`` (per
    ``key``, e.g. S): what a run takes, its host process's start included: a guess until one
    has run (``a.seconds + a.warmup`` + 4 s), then the shortest seen and 1 s, the call's
    first run left out (a fixed guess of 4 s over the timed part skipped runs that fitted: a
    run's start and warm-up take ~1-1.5 s on the H200; so did the longest or the last seen:
    the call's first run took 5.0-6.4 s against 2.1-2.9 for every later one, session 18
    bundles B and C; a run longer than its estimate ends inside the reserve the scripts keep
    after --bound)."""
    t_run = time.perf_counter()
    if t_run - t_start + need.get(key, a.seconds + a.warmup + 4.0) > a.bound:
        print(f"# {label} skipped: {t_run - t_start:.0f} s of {a.bound:.0f}", flush=True)
        doc["errors"].append({"run": label, "error": "skipped (bound)"})
        return None
    try:
        got = run()
        if doc["runs"]:  # (this run is not yet in them: not the first)
            need[key] = min(need.get(key, 1e9), time.perf_counter() - t_run + 1.0)
    except Exception as e:
        print(f"# {label} FAILED: {e}", flush=True)
        doc["errors"].append({"run": label, "error": repr(e)[:2000]})
        save()
        return None
    return got, t_run


def one_run(doc: dict[str, Any], label: str, seqs: int, need: dict[int, float],
            t_start: float, a: argparse.Namespace, save: Callable[[], None],
            run: Callable[[], tuple[dict[str, Any], float, dict[str, Any]]],
            ) -> dict[str, Any] | None:
    """One replay run of an A/B's loop (this file's, bench/hp_toggle_ab.py's), as ``bounded``
    runs it (None: skipped or failed), ``run()`` service_replay.run_replay's (stats, wall,
    roles); its figures: step p50 / p99 and steps/s, each step part's p50 (ms), per call role
    each ROLE_FIELDS p50 (us)."""
    got = bounded(doc, label, seqs, need, t_start, a, save, run)
    if got is None:
        return None
    (st_, wall, roles), t_run = got
    ms = {f: float(np.median(x) * 1e3) for f, x in st_.items()
          if f not in ("kernel_missing", "stamped")}
    return {"seqs": seqs, "label": label, "steps": int(st_["e2e"].size),
            "steps_per_s": st_["e2e"].size / wall,
            "step_p50_ms": float(np.percentile(st_["e2e"], 50) * 1e3),
            "step_p99_ms": float(np.percentile(st_["e2e"], 99) * 1e3),
            "step_parts_p50_ms": ms, "t": time.perf_counter() - t_start,
            "run_s": time.perf_counter() - t_run,
            # per call role, the p50 us of a call's parts (what bench/replay_echo.py
            # --holds-from holds an echo's calls for, and sets its round trips beside)
            "roles_p50_us": {role: {f: (x if f == "calls" else x * 1e6)
                                    for f, x in got.items() if f in ROLE_FIELDS}
                             for role, got in roles.items()}}


def main(argv: list[str] | None = None) -> int:
    from q6serve.client.client import PRECISIONS, Client

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--variants", default="def: pipe:Q6SERVE_MULTI_PIPELINE=1")
    ap.add_argument("--order", default="def,pipe,pipe,def")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--multi", default="on", choices=("on", "off"))
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--warmup", type=float, default=0.4)
    ap.add_argument("--bound", type=float, default=1e9)
    ap.add_argument("--spin", type=float, default=0.0,
                    help="the host's loop busy-polls this long (us) before it sleeps "
                    "(bench/service.py --replay-spins; 0: a plain asyncio caller)")
    ap.add_argument("--pin", default="", metavar="WORKER_CPUS:LOAD_CPUS",
                    help="each worker pinned (--cpus; one core each when as many as the "
                    "variants), the replay's host processes on LOAD_CPUS")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    variants, order = variants_and_order(ap, a.variants, a.order)
    seqs = [int(s) for s in a.seqs.split(",") if s]
    a.out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"argv": sys.argv, "variants": variants, "runs": [], "errors": [],
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    save = saver(doc, a.json, t_start)
    on = worker_keys(variants)  # variant -> its worker's name
    names = list(dict.fromkeys(on.values()))
    cpus, load_cpus = pin_plan(a.pin, names)
    doc["pin"] = {"workers": cpus, "hosts": load_cpus}
    doc["worker_of"] = on
    workers = start_all(a.backend, {v: split_variant(variants[v])[0] for v in names},
                        a.out_dir, cpus)
    if load_cpus:  # the hosts are spawned from here (after the workers: not theirs)
        os.sched_setaffinity(0, load_cpus)
    clients = {v: Client(w.target, timeout=600.0) for v, w in workers.items()}
    doc["worker_env"] = {v: worker_env(w) for v, w in workers.items()}
    print(f"# the workers' Q6SERVE_ variables: {doc['worker_env']}", flush=True)
    try:
        st = next(iter(clients.values())).status()
        doc["backend"], doc["device"] = st.backend, st.device
        weights = give_model(list(clients.values()), a.layers, a.scale)
        for c in clients.values():
            c.flags({"Q6SERVE_DYNAMIC_BATCHING": True})
        rows = {name: r for name, r, _ in weights}
        plans = {m: tuple(step_plan(a.layers, rows, m == "on", a.topk)) for m in ("on", "off")}
        need: dict[int, float] = {}  # what a run at S takes (one_run)
        seen: dict[str, int] = {}
        for v in order:
            seen[v] = seen.get(v, 0) + 1
            for s in seqs:
                label = f"{v}_{seen[v]} S={s}"
                host = split_variant(variants[v])[1]
                plan = plans[host.get("host.multi", a.multi)]
                chains = host.get("host.chains", 1)
                if s % chains:  # S=1 has no sequences to split
                    print(f"# {label} not run: S={s} is not {chains} chains of equal rows",
                          flush=True)
                    continue
                spec = ReplaySpec(workers[on[v]].target, plan, s, a.seconds, a.warmup,
                                  WARM_STEPS, host.get("host.mode", "stream"), "f16",
                                  PRECISIONS[host.get("host.precision", "auto")], "f16",
                                  host.get("host.spin", a.spin),
                                  host.get("host.decode", "arrays"),
                                  host.get("host.view_min", 0),
                                  host.get("host.transport", "aio"),
                                  tuple(sorted(host.get("host.grpc", {}).items())),
                                  chains,
                                  HOST_EE.get(host.get("host.ee", "")),
                                  host.get("host.ahead", "off") == "on")
                info: dict[str, Any] = {}
                held = SystemHold(host.get("sys.hold", ""))

                def go(spec: ReplaySpec = spec, held: SystemHold = held,
                       info: dict[str, Any] = info) -> tuple[dict[str, Any], float, Any]:
                    with held:
                        return run_replay(spec, 1, info)

                fig = one_run(doc, label, s, need, t_start, a, save, go)
                if fig is None:
                    continue
                r = {"variant": v, "round": seen[v], "calls_per_step": len(plan), **fig,
                     "hold": held.info,
                     # the host's GRPC_EXPERIMENTS as its gRPC read it (None: unset)
                     "host_grpc_experiments": info.get("grpc_experiments", [None])[0]}
                doc["runs"].append(r)
                save()
                print(f"# {label}: step p50 {r['step_p50_ms']:.2f} ms ({r['steps']} steps; "
                      f"run {r['run_s']:.1f} s, at {r['t']:.0f} s; host gRPC "
                      f"{ee_name(r['host_grpc_experiments'])}; hold {held.info['kind']}: "
                      f"{held.info.get('message', '-')}; idle {idle_text(held.info)})",
                      flush=True)
    finally:
        stop_all(clients.values(), workers.values(), save)
    print(table(doc, a))
    return 0


def table(doc: dict[str, Any], a: argparse.Namespace) -> str:
    nan = float("nan")  # a figure an older run's JSON or an unstamped worker lacks
    lines = [f"# replay A/B: {a.layers} layers, multi {a.multi}, top-{a.topk}, host spin "
             f"{a.spin:g} us; step p50 / p99 ms; per step p50 ms: worker (device) transport "
             "client (encode + decode) ccpu (the caller's CPU in its calls); steps",
             f"# {doc.get('device', '?')}; variants {doc['variants']}; pinned "
             f"{doc.get('pin') or 'no'}"]
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        by.setdefault((r["variant"], r["round"]), []).append(r)
    for (v, rnd), rs in by.items():
        cells = []
        for r in rs:
            p = r["step_parts_p50_ms"]
            cells.append(f"S={r['seqs']}: {r['step_p50_ms']:6.2f} / {r['step_p99_ms']:6.2f}  "
                         f"w {p['handler']:5.2f} ({p['device']:5.2f}) tr {p['transport']:5.2f} "
                         f"cl {p['client']:4.2f} ccpu {p.get('ccpu', nan):5.2f} n {r['steps']}")
        hold = rs[0].get("hold") or {}
        lines.append(f"{v + '_' + str(rnd):<10} " + " | ".join(cells)
                     + (f" | {hold['kind']}: idle {idle_text(hold)}" if hold else ""))
    for s in sorted({r["seqs"] for r in doc["runs"]}):
        med = {v: float(np.median([r["step_p50_ms"] for r in doc["runs"]
                                   if r["variant"] == v and r["seqs"] == s]))
               for v in doc["variants"] if any(r["variant"] == v and r["seqs"] == s
                                               for r in doc["runs"])}
        lines.append(f"# S={s} median of the runs' p50: "
                     + ", ".join(f"{v} {m:.2f}" for v, m in med.items()))
        for v in med:
            per = role_medians(doc["runs"], v, s)
            lines.append(f"# S={s} {v} per call p50 us (median of runs), rpc / handler / "
                         "caller CPU (its encode + decode, the encode) / up + down: "
                         + ", ".join(f"{role} {got['rpc']:.0f} / {got['handler']:.0f} / "
                                     f"{got.get('ccpu', nan):.0f} ({got['client']:.0f}, "
                                     f"{got.get('enc', nan):.0f}) / "
                                     f"{got.get('up', nan):.0f} + {got.get('down', nan):.0f}"
                                     for role, got in per.items()))
    return "\n".join(lines)


def role_medians(runs: list[dict[str, Any]], variant: str, seqs: int,
                 ) -> dict[str, dict[str, float]]:
    """Per call role, the median over ``variant``'s runs at S = ``seqs`` of each run's p50
    (us) of every ROLE_FIELDS figure ("calls": summed)."""
    got: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        if r["variant"] != variant or r["seqs"] != seqs:
            continue
        for role, fields in r.get("roles_p50_us", {}).items():
            dst = got.setdefault(role, {})
            for f, v in fields.items():
                dst.setdefault(f, []).append(v)
    return {role: {f: float(np.sum(v) if f == "calls" else np.nanmedian(v))
                   for f, v in fields.items()}
            for role, fields in got.items()}


if __name__ == "__main__":
    sys.exit(main())
