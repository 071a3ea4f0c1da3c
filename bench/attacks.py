"""Issue 18's targets, measured: each class of attack against a `q6serve worker --backend numpy`
subprocess while a clean caller and a health checker run beside it.

    .venv/bin/python bench/attacks.py [--seconds 4] [--only slow_reader,...] [--json out.json]

Per attack: the worker's VmRSS (/proc, every 20 ms) before, at most during and after it
(after: once the attack's calls are gone and the figures settled), against the bound that
applies (the VRAM budget plus the documented fixed costs of that class); grpc.health.v1 Check
latency p50/p99/max (every 20 ms, its own connection); the clean caller's calls (every reply
compared with the first: exact on NumPy) and failures; the accounted figures (weights,
scratch, staging, reserved, host overhead) before and after. Then SIGTERM during a hostile
parse: exit time against the grace period. docs/RELIABILITY.md ("The targets, measured").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from q6serve.client.client import Client, matmul_request
from q6serve.client.core import upload_header
from q6serve.v1 import q6serve_pb2 as pb
from q6serve.v1 import q6serve_pb2_grpc as pb_grpc
from tests.reliability import gguf_corpus as g
from tests.reliability.stalling import StallingProxy, stop_all
from tests.service.svc_util import random_q6k

K = 256
USER, ADMIN = "user-token-" + "u" * 20, "admin-token-" + "a" * 20
BUDGET = 512 << 20
STREAM_TOTAL = 256 << 20  # --max-stream-bytes-total
MESSAGE = 256 << 20  # --max-message-bytes
INFLIGHT = 128  # --max-inflight-rpcs
MIB = 1 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


class Worker:
    def __init__(self, model_dir: Path, grace: float = 10.0) -> None:
        env = dict(os.environ, Q6SERVE_TOKEN=USER, Q6SERVE_ADMIN_TOKEN=ADMIN)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "q6serve.client.cli", "worker", "--port", "0",
             "--backend", "numpy", "--vram-budget", str(BUDGET), "--model-dir", str(model_dir),
             "--max-stream-bytes-total", str(STREAM_TOTAL), "--max-message-bytes", str(MESSAGE),
             "--max-inflight-rpcs", str(INFLIGHT), "--grace-period", str(grace),
             "--max-request-bytes", str(REQUEST_LIMIT[0]), *WORKER_ARGS,
             "--log-level", "INFO"], env=env, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        self.target = ""
        for _ in range(200):
            m = re.search(r"listening on (\S+:\d+)", self.proc.stderr.readline())
            if m:
                self.target = m.group(1)
                break
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()
        self.admin = Client(self.target, token=ADMIN, timeout=120)

    def figures(self) -> dict[str, int]:
        s = self.admin.status()
        v = s.vram
        return {"weights": v.weights_bytes, "scratch": v.scratch_bytes,
                "staging": v.staging_bytes, "reserved": v.reserved_bytes,
                "host_overhead": s.host_overhead_bytes, "weights_loaded": s.weights_loaded}

    def stop(self) -> None:
        self.admin.close()
        self.proc.terminate()
        self.proc.wait(30)


def _watch(target: str, pid: int, stop: Any, out: Any) -> None:
    """In a process of its own (the attacker's 100 MB serializations hold this process's
    GIL for ~0.3 s): health latency, a clean caller, the worker's RSS."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health: list[float] = []
    rss_seen: list[int] = []
    calls = [0, 0]  # calls, wrong or failed
    took: list[float] = []  # the clean caller's OK calls, seconds
    errors: dict[str, int] = {}
    hch = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    hstub = health_pb2_grpc.HealthStub(hch)
    clean = Client(target, token=USER, timeout=30, channel=_channel(target))
    x = np.random.default_rng(3).standard_normal((4, K)).astype(np.float32)
    want = clean.matmul("clean", x)
    tol = 1e-5 * float(np.abs(want).max())  # batching changes BLAS's summation order

    def ask_health() -> None:
        while not stop.wait(0.02):
            t0 = time.perf_counter()
            hstub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            health.append(time.perf_counter() - t0)

    def caller() -> None:
        while not stop.wait(0.02):
            t0 = time.perf_counter()
            try:
                ok = bool(np.abs(clean.matmul("clean", x) - want).max() <= tol)
                took.append(time.perf_counter() - t0)
            except Exception as e:
                errors[str(e)[:120]] = errors.get(str(e)[:120], 0) + 1
                ok = False
            calls[0] += 1
            calls[1] += not ok

    def sample() -> None:
        while not stop.wait(0.02):
            rss_seen.append(rss(pid))

    threads = [threading.Thread(target=f) for f in (ask_health, caller, sample)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hch.close()
    clean.close()
    h = np.array(health or [0.0]) * 1e3
    c = np.array(took or [0.0]) * 1e3
    out.put({"health_p50_ms": float(np.percentile(h, 50)),
             "health_p99_ms": float(np.percentile(h, 99)),
             "health_max_ms": float(h.max()), "health_n": len(health),
             "clean_calls": calls[0], "clean_failed": calls[1], "clean_errors": errors,
             "clean_p99_ms": float(np.percentile(c, 99)), "clean_max_ms": float(c.max()),
             "rss_max": max(rss_seen or [0])})


class Watch:
    def __init__(self, w: Worker) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop, self.out = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=_watch, args=(w.target, w.proc.pid, self.stop,
                                                     self.out))
        self.proc.start()
        time.sleep(2.0)  # the process has started and made its first call

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        result: dict[str, Any] = self.out.get(timeout=120)
        self.proc.join()
        return result


def _channel(target: str) -> grpc.Channel:
    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1)]
    return grpc.insecure_channel(target, options=opts)


def channels(w: Worker, n: int) -> list[grpc.Channel]:
    return [_channel(w.target) for _ in range(n)]


AUTH = (("authorization", f"Bearer {USER}"),)
ADMIN_AUTH = (("authorization", f"Bearer {ADMIN}"),)


# -- the attacks: each runs for `seconds` and cleans up after itself --------------------------
def slow_readers(w: Worker, seconds: float) -> str:
    """8 MatmulStreams on 8 connections ask for 4 MiB replies at 20/s and never read."""
    req = matmul_request("big", np.ones((64, K), np.float32))
    chans = channels(w, 8)

    def requests() -> Iterator[pb.MatmulRequest]:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            yield req
            time.sleep(0.05)

    calls = [pb_grpc.Q6ServeStub(c).MatmulStream(requests(), metadata=AUTH) for c in chans]
    time.sleep(seconds)
    for c in calls:
        c.cancel()
    for c in chans:
        c.close()
    return "8 streams x 4 MiB replies at 20/s, never read"


BIG_MIB = [100]  # --big-mib
REQUEST_LIMIT = [16 * MIB]  # the worker's --max-request-bytes (--request-limit-mib)
WIDE_K = 32768  # the "wide" weight: K of the largest requests the limit lets through
BIG_CONNECTIONS = [4]  # --big-connections
WORKER_ARGS: list[str] = []  # --worker-args


def refused_big(w: Worker, seconds: float) -> str:
    """Big (100 MiB) Matmul requests the worker refuses (K mismatch), with a token or not."""
    x = np.ones((BIG_MIB[0] * MIB // (4 * 512), 512), np.float32)
    req = matmul_request("clean", x)
    chans = channels(w, 2)
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for ch, md in zip(chans, (AUTH, ()), strict=True):
            with contextlib.suppress(grpc.RpcError):
                pb_grpc.Q6ServeStub(ch).Matmul(req, metadata=md, timeout=30)
            n += 1
    for c in chans:
        c.close()
    return f"{n} refused {BIG_MIB[0]} MiB requests (half without a token)"


def big_under_limit(w: Worker, seconds: float) -> str:
    """Requests just under the receive limit, back to back from 4 connections (or
    --big-connections), each alternating valid ones
    (N = 255 x K = 32768 f32 on the "wide" weight) and refused ones (K mismatch), sent as
    ready-made bytes so the attacker is not the bottleneck."""
    rows = (REQUEST_LIMIT[0] - 64 * 1024) // (4 * WIDE_K)
    x = np.ones((rows, WIDE_K), np.float32)
    raws = [matmul_request("wide", x).SerializeToString(),
            matmul_request("clean", x.reshape(-1, 512)).SerializeToString()]
    chans = channels(w, BIG_CONNECTIONS[0])
    counts = [0, 0]  # OK, refused
    end = time.monotonic() + seconds

    def send(ch: grpc.Channel, i: int) -> None:
        call = ch.unary_unary("/q6serve.v1.Q6Serve/Matmul")
        j = i
        while time.monotonic() < end:
            try:
                call(raws[j % 2], metadata=AUTH, timeout=30)
                counts[0] += 1
            except grpc.RpcError:
                counts[1] += 1
            j += 1

    threads = [threading.Thread(target=send, args=(c, i)) for i, c in enumerate(chans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop_all((), chans)
    return (f"{sum(counts)} requests of {len(raws[0]) / MIB:.1f} MiB from {len(chans)} "
            "connections "
            f"({counts[0]} OK, {counts[1]} refused)")


def non_readers(w: Worker, seconds: float) -> str:
    """32 connections that never read (a TCP proxy each that stops passing the worker's
    bytes back) ask for 4 MiB replies, 8 calls at a time each: with the admission limit at
    128 and a floor of 8 places per connection, enough to hold every place."""
    proxies = [StallingProxy(w.target) for _ in range(32)]
    chans = [_channel(p.target) for p in proxies]
    req = matmul_request("big", np.ones((64, K), np.float32))
    futs = [pb_grpc.Q6ServeStub(c).Matmul.future(req, metadata=AUTH, timeout=seconds + 30)
            for c in chans for _ in range(8)]
    time.sleep(seconds)
    stop_all(futs, [*chans, *proxies])
    return "32 connections x 8 calls for 4 MiB replies, never read"


def _nothing(stop: threading.Event) -> Iterator[Any]:
    """A request iterator that sends nothing until ``stop``."""
    stop.wait()
    return
    yield


def silent_calls(w: Worker, seconds: float) -> str:
    """32 connections x 8 Matmul calls that send their headers and never the message."""
    stop = threading.Event()
    chans = channels(w, 32)
    futs = [c.stream_unary("/q6serve.v1.Q6Serve/Matmul").future(
        _nothing(stop), metadata=AUTH, timeout=seconds + 30) for c in chans for _ in range(8)]
    time.sleep(seconds)
    stop.set()
    stop_all(futs, chans)
    return "32 connections x 8 calls that never send their request"


def idle_streams(w: Worker, seconds: float) -> str:
    """8 connections open 1000 MatmulStreams each (an asyncio client: no thread per call)
    and never send on them."""
    import asyncio

    async def run() -> tuple[int, int]:
        chans = [grpc.aio.insecure_channel(w.target, options=[
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(8)]
        calls = [pb_grpc.Q6ServeStub(c).MatmulStream(metadata=AUTH, timeout=seconds + 30)
                 for c in chans for _ in range(1000)]
        await asyncio.sleep(seconds)
        refused = sum(c.done() for c in calls)
        for c in calls:
            c.cancel()
        for c in chans:
            await c.close()
        return len(calls), refused

    n, refused = asyncio.run(run())
    return f"{n} idle MatmulStreams on 8 connections ({refused} refused)"


def stream_hogs(w: Worker, seconds: float) -> str:
    """A clean MatmulStream caller beside 8 streams that never read on 8 connections (the
    stream budget's total is theirs in ~1 s): the clean stream's p99/max are in the row."""
    chans = channels(w, 9)
    stop = threading.Event()
    req = matmul_request("big", np.ones((64, K), np.float32))

    def requests() -> Iterator[pb.MatmulRequest]:
        while not stop.is_set():
            yield req
            time.sleep(0.01)

    hogs = [pb_grpc.Q6ServeStub(c).MatmulStream(requests(), metadata=AUTH,
                                                timeout=seconds + 30) for c in chans[:8]]
    time.sleep(1.0)
    clean = Client(w.target, token=USER, timeout=30, channel=chans[8])
    x = np.ones((64, K), np.float32)  # a 4 MiB reply: it needs the budget
    took, end = [], time.monotonic() + seconds - 1
    while time.monotonic() < end:
        t0 = time.perf_counter()
        list(clean.matmul_stream([("c", "big", x)], timeout=30))
        took.append(time.perf_counter() - t0)
    stop.set()
    stop_all(hogs, chans)
    t = np.array(took) * 1e3
    return (f"8 non-reading streams; a clean stream: {len(t)} calls, p50/p99/max "
            f"{np.percentile(t, 50):.0f}/{np.percentile(t, 99):.0f}/{t.max():.0f} ms")


def header_flood(w: Worker, seconds: float) -> str:
    """Calls with 64 KiB of metadata (over gRPC's 8 KiB default) and with 100 headers, as
    fast as 8 connections send them."""
    big = (("x-junk", "a" * (64 << 10)),)
    many = tuple((f"x-h{i}", "b" * 60) for i in range(100))
    chans = channels(w, 8)
    req = matmul_request("clean", np.ones((1, K), np.float32))
    codes: dict[str, int] = {}
    end = time.monotonic() + seconds

    def send(ch: grpc.Channel, md: tuple[tuple[str, str], ...]) -> None:
        stub = pb_grpc.Q6ServeStub(ch)
        while time.monotonic() < end:
            try:
                stub.Matmul(req, metadata=AUTH + md, timeout=10)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=send, args=(c, big if i % 2 else many))
               for i, c in enumerate(chans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop_all((), chans)
    return f"calls with 64 KiB / 100 headers: {codes}"


def stalled_uploads(w: Worker, seconds: float) -> str:
    """8 f32 uploads of 512 MiB each send their header and 2 MiB, then stall."""
    raw = memoryview(b"\0" * (2 * MIB))
    hdr = upload_header("u", raw, rows=512 * MIB // (4 * 4096), k=4096, fmt="f32",
                        sha256="0" * 64)
    hdr.total_bytes = 512 * MIB
    stop = threading.Event()

    def stream(i: int) -> Iterator[pb.UploadWeightRequest]:
        h = pb.UploadHeader()
        h.CopyFrom(hdr)
        h.name = f"stall{i}"
        yield pb.UploadWeightRequest(header=h)
        yield pb.UploadWeightRequest(chunk=bytes(raw))
        stop.wait(seconds)

    chans = channels(w, 8)
    futs = [pb_grpc.Q6ServeStub(c).UploadWeight.future(stream(i), metadata=ADMIN_AUTH,
                                                       timeout=seconds + 30)
            for i, c in enumerate(chans)]
    time.sleep(seconds)
    for f in futs:
        f.cancel()
    stop.set()
    for c in chans:
        c.close()
    return "8 f32 uploads of 512 MiB stalled after header + 2 MiB"


def many_calls(w: Worker, seconds: float) -> str:
    """3000 unary calls at once on one connection, and 32 more connections x 100."""
    req = matmul_request("clean", np.ones((1, K), np.float32))
    chans = channels(w, 33)
    futs = [pb_grpc.Q6ServeStub(chans[0]).Matmul.future(req, metadata=AUTH, timeout=120)
            for _ in range(3000)]
    futs += [pb_grpc.Q6ServeStub(c).Matmul.future(req, metadata=AUTH, timeout=120)
             for c in chans[1:] for _ in range(100)]
    failed = 0
    for f in futs:
        try:
            f.result()
        except grpc.RpcError:
            failed += 1
    for c in chans:
        c.close()
    return f"{len(futs)} concurrent calls on 33 connections: {failed} failed"


def nan_batches(w: Worker, seconds: float) -> str:
    """q8_1 requests with NaN rows from 8 callers, batched with everyone's."""
    x = np.ones((4, K), np.float32)
    x[1, 7] = np.nan
    req = matmul_request("clean", x, precision="q8_1")
    chans = channels(w, 8)
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        futs = [pb_grpc.Q6ServeStub(c).Matmul.future(req, metadata=AUTH, timeout=30)
                for c in chans for _ in range(4)]
        for f in futs:
            f.result()
            n += 1
    for c in chans:
        c.close()
    return f"{n} q8_1 requests with NaN rows"


def metadata_bomb(w: Worker, seconds: float) -> str:
    """Loads of a file with 4 Mi metadata items (1.5 M strings) and one tiny tensor."""
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        w.admin.load("bomb.gguf", prefix=f"b{n}.")
        w.admin.unload(f"b{n}.t")
        n += 1
    return f"{n} loads + unloads of a 4 Mi-item metadata file"


def many_tensors(w: Worker, seconds: float) -> str:
    """A file of 16384 1x256 tensors loaded, listed, then unloaded one by one."""
    w.admin.load("many.gguf")
    w.admin.list()
    for i in range(16384):
        w.admin.unload(f"t{i}")
    return "16384 tensors loaded, listed, unloaded"


ATTACKS: dict[str, tuple[Callable[[Worker, float], str], str]] = {
    "slow_readers": (slow_readers, "--max-stream-bytes-total 256 MiB"),
    "refused_big": (refused_big, "refused by gRPC before they are read: 0"),
    "big_under_limit": (big_under_limit, "4 requests in flight + their copies"),
    "non_readers": (non_readers, f"{INFLIGHT} places x 4 MiB replies"),
    "stalled_uploads": (stalled_uploads, "the VRAM budget (staging) 512 MiB"),
    "silent_calls": (silent_calls, f"{INFLIGHT} places x (call, no message)"),
    "idle_streams": (idle_streams, "4096 streams x ~35 KiB (StreamSlots)"),
    "stream_hogs": (stream_hogs, "--max-stream-bytes-total 256 MiB + lingering"),
    "header_flood": (header_flood, "gRPC's metadata limit (8 KiB)"),
    "many_calls": (many_calls, f"{INFLIGHT} in flight x (request + reply)"),
    "nan_batches": (nan_batches, "-"),
    "metadata_bomb": (metadata_bomb, "< 2x the tensors + parse"),
    "many_tensors": (many_tensors, "16384 x (2 + 4) KiB host overhead"),
}


def build_files(d: Path) -> None:
    items = b"".join(g.gstr(f"tok{i}") for i in range(1_500_000))
    nums = np.zeros(2_600_000, "<f4")  # 4.1 Mi items in all: just inside the scan's cap
    scores = g.u32(g.F32V) + g.u64(nums.size) + nums.tobytes()
    (d / "bomb.gguf").write_bytes(g.File(
        tensors=[g.Tensor("t", [K, 1], data=g.q6k_blocks(1, K, 1))],
        kvs=[g.kv("tokenizer.ggml.tokens", g.ARR, g.u32(g.STR) + g.u64(1_500_000) + items),
             g.kv("tokenizer.ggml.scores", g.ARR, scores)],
    ).build())
    b = g.q6k_blocks(1, K, 1)
    (d / "many.gguf").write_bytes(g.File(tensors=[g.Tensor(f"t{i}", [K, 1], data=b)
                                                  for i in range(16384)]).build())


def settle(w: Worker, before: dict[str, int], timeout: float = 20) -> dict[str, int]:
    end = time.monotonic() + timeout
    while True:
        now = w.figures()
        if now == before or time.monotonic() > end:
            return now
        time.sleep(0.1)


def drain_time(d: Path) -> dict[str, float]:
    """SIGTERM while a hostile parse runs (a 4 Mi-item file loading in a loop), grace 2 s."""
    w = Worker(d, grace=2.0)
    stop = threading.Event()

    def loads() -> None:
        i = 0
        while not stop.is_set():
            with contextlib.suppress(Exception):
                w.admin.load("bomb.gguf", prefix=f"d{i}.")
            i += 1

    threading.Thread(target=loads, daemon=True).start()
    time.sleep(1.0)
    t0 = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    code = w.proc.wait(60)
    took = time.monotonic() - t0
    stop.set()
    return {"grace_s": 2.0, "exit_s": round(took, 2), "exit_code": code}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--only", default="", help="comma-separated attack names")
    ap.add_argument("--settle", type=float, default=6.0,
                    help="seconds after an attack before its RSS 'after' is read")
    ap.add_argument("--big-mib", type=int, default=100, help="refused_big's request size")
    ap.add_argument("--big-connections", type=int, default=4,
                    help="big_under_limit's connections")
    ap.add_argument("--request-limit-mib", type=int, default=16,
                    help="the worker's --max-request-bytes, in MiB (big_under_limit sizes "
                         "its requests from it)")
    ap.add_argument("--worker-args", default="",
                    help="more `q6serve worker` flags, e.g. '--max-reading-rpcs 1000'")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    BIG_MIB[0] = args.big_mib
    BIG_CONNECTIONS[0] = args.big_connections
    REQUEST_LIMIT[0] = args.request_limit_mib * MIB
    WORKER_ARGS[:] = args.worker_args.split()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        build_files(d)
        w = Worker(d)
        try:
            w.admin.upload("clean", random_q6k(64, K, 1), 64, K)
            w.admin.upload("big", random_q6k(16384, K, 2), 16384, K)  # N=64 reply: 4 MiB
            w.admin.upload("wide", random_q6k(8, WIDE_K, 4), 8, WIDE_K)
            for name in names:
                fn, bound = ATTACKS[name]
                before = w.figures()
                time.sleep(0.5)
                rss0 = rss(w.proc.pid)
                watch = Watch(w)
                what = fn(w, args.seconds)
                seen = watch.finish()
                after = settle(w, before)
                time.sleep(args.settle)  # the worker trims its C heap every 5 s
                row = {"attack": name, "what": what, "bound": bound,
                       "rss_before_mib": round(rss0 / MIB, 1),
                       "rss_max_mib": round(seen.pop("rss_max") / MIB, 1),
                       "rss_after_mib": round(rss(w.proc.pid) / MIB, 1),
                       "figures_back": after == before, **seen}
                if after != before:
                    row["figures"] = {"before": before, "after": after}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            w.stop()
        drain = drain_time(d)
        print(json.dumps({"drain": drain}), flush=True)
    print(f"\n{'attack':<16} {'RSS before/max/after MiB':>26} {'health p50/p99/max ms':>24} "
          f"{'clean ok/all':>13} {'clean p99/max ms':>17} back")
    for r in rows:
        print(f"{r['attack']:<16} {r['rss_before_mib']:>8}/{r['rss_max_mib']:>7}/"
              f"{r['rss_after_mib']:>7}  {r['health_p50_ms']:>7.1f}/{r['health_p99_ms']:>6.1f}/"
              f"{r['health_max_ms']:>6.1f}   {r['clean_calls'] - r['clean_failed']:>5}/"
              f"{r['clean_calls']:<5} {r['clean_p99_ms']:>8.1f}/{r['clean_max_ms']:>7.1f}  "
              f"{r['figures_back']}")
    print(f"SIGTERM during a hostile parse: exit after {drain['exit_s']} s "
          f"(grace {drain['grace_s']} s), code {drain['exit_code']}")
    if args.json:
        args.json.write_text(json.dumps({"attacks": rows, "drain": drain}, indent=1))


if __name__ == "__main__":
    main()
