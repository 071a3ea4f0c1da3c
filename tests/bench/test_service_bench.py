"""bench/service.py in a tiny configuration: it runs, and its per-call breakdown adds up.

Not a timing assertion: the parts of each call (client encode, transport, worker decode,
queue, kernel, device, handler rest, client decode) must be non-negative and sum to the
end-to-end time measured by the load process, with the worker's parts taken from the reply.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_replay_breakdown_adds_up(tmp_path: Path) -> None:
    out = tmp_path / "service.json"
    cmd = [sys.executable, str(ROOT / "bench/service.py"), "--backend", "numpy",
           "--row-scale", "0.005", "--weights", "attn_v,ffn_down", "--hosts", "1",
           "--seqs", "2", "--seconds", "0.6", "--warmup", "0.2", "--batching", "both",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == "numpy"
    runs = doc["runs"]
    assert {r["weight"] for r in runs} == {"attn_v", "ffn_down"}
    assert {r["config"]["dynamic_batching"] for r in runs} == {True, False}
    for r in runs:
        assert r["calls"] > 0, r["label"]
        assert r["missing_server_timing"] == 0, r
        assert set(r["parts_mean_us"]) == set(doc["parts"])
        total = sum(r["parts_mean_us"].values())
        assert abs(total - r["e2e_mean_us"]) <= 0.01 * r["e2e_mean_us"] + 1.0, r
        # the worker's own time fits inside the caller's RPC time (one clock per process)
        assert all(v == 0 for v in r["negative_calls"].values()), r["negative_calls"]
        assert r["parts_mean_us"]["kernel"] > 0
        assert r["p50_us"] <= r["p99_us"]
    assert [g["weight"] for g in doc["gains"]] == ["attn_v", "ffn_down"]


def test_q6serve_bench_preset_runs_the_service_bench(tmp_path: Path) -> None:
    out = tmp_path / "preset.json"
    args = (f"--backend numpy --row-scale 0.005 --weights attn_v --hosts 1 --seqs 1 "
            f"--seconds 0.3 --warmup 0.1 --batching on --json {out}")
    done = subprocess.run([sys.executable, "-m", "q6serve.client.cli", "bench", "--preset",
                           "decode-7b", "--preset-args", args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["weight"] for r in runs] == ["attn_v"] and runs[0]["calls"] > 0


def test_tiny_model_replay(tmp_path: Path) -> None:
    """--replay on 2 layers of a 7B-class model scaled down: one S, with and without
    multi-weight calls; calls per step, kernel-only step time and the floor are reported."""
    out = tmp_path / "replay.json"
    cmd = [sys.executable, str(ROOT / "bench/service.py"), "--backend", "numpy", "--replay",
           "--layers", "2", "--scale", "0.002", "--replay-seqs", "2", "--topk", "8",
           "--seconds", "0.4", "--warmup", "0.1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["multi"]: r for r in doc["replay"]}
    assert set(rows) == {True, False} and not doc["errors"]
    # per layer: qkv, o, gate/up, down (multi) or 7 calls; then the lm-head
    assert rows[True]["calls_per_step"] == 2 * 4 + 1
    assert rows[False]["calls_per_step"] == 2 * 7 + 1
    for r in rows.values():
        assert r["steps"] > 0 and r["seqs"] == 2 and r["topk"] == 8 and r["out_dtype"] == "f16"
        assert 0 < r["kernel_step_ms"] <= r["step_p50_ms"] <= r["step_p99_ms"]
        assert r["floor_step_ms"] > 0 and r["limit_ms"] is not None
    # the GPU scripts' table reads the same JSON (bench/service_summary.py)
    (tmp_path / "main.json").write_text(out.read_text())
    table = subprocess.run([sys.executable, str(ROOT / "bench/service_summary.py"), "run",
                            str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr[-2000:]
    assert "replay S=2 multi" in table.stdout and "replay S=2 single" in table.stdout


def test_replay_stamped_per_role_and_host_spin(tmp_path: Path) -> None:
    """--replay with the worker's replies stamped (bench/reply_stamps.py through
    bench/trips_site, as session 17's bench/gpu_t1_s17a.sh ran it) and two host spins: one row
    per spin, each with its floors (plain and busy-polling echo) and the per-call p50s of every
    role of the step, the transport split into a way up and a way down that add up to at most
    it."""
    import os

    out = tmp_path / "replay.json"
    env = {**os.environ, "Q6SERVE_REPLY_STAMPS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "bench/trips_site"),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, str(ROOT / "bench/service.py"), "--backend", "numpy", "--replay",
           "--layers", "1", "--scale", "0.002", "--replay-seqs", "1", "--multi", "on",
           "--replay-spins", "0,100", "--seconds", "0.4", "--warmup", "0.1",
           "--replay-seq-echo", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert not doc["errors"]
    assert [r["host_spin_us"] for r in doc["replay"]] == [0.0, 100.0]
    assert [r["label"] for r in doc["replay"]] == ["replay S=1 multi spin=0",
                                                   "replay S=1 multi spin=100"]
    for r in doc["replay"]:
        assert r["stamped"] and set(r["floors_step_ms"]) == {"plain", "spin"}
        assert r["floor_step_ms"] == min(r["floors_step_ms"].values()) > 0
        roles = r["per_call_p50_us"]
        assert list(roles) == ["q+k+v", "o", "gate+up", "down", "lm_head"]
        for role, got in roles.items():
            assert got["calls"] == r["steps"]
            # the floor's echo is of the same sizes (within a few fields' bytes; a stamped
            # reply carries the two times' ~40 bytes more)
            req, reply = r["floor_bytes"][role]
            assert abs(got["req_bytes"] - req) <= 64 and abs(got["reply_bytes"] - reply) <= 128
            assert got["up"] > 0 and got["down"] > 0 and got["kernel"] > 0
            assert got["device"] <= got["handler"] <= got["rpc"]
        # one layer: each role once a step, so its echo round trips add up to the floor
        for kind in ("plain", "spin"):
            per_call = sum(r["floor_per_call_us"][role][kind] for role in roles)
            assert abs(per_call * 1e-3 - r["floors_step_ms"][kind]) < 1e-6
        p = r["step_parts_p50_ms"]
        # up + down = the round trip less the worker's taken -> encoded: the transport less
        # the reply's last encoding step (a few us a call), never more, call by call; these
        # are p50s, and a sum of two medians is not the median of the sum: on a loaded 2-core
        # host the two tails need not line up (this test failed once in session 18's CI; in
        # session 19 one tests/bench test failed once, its output lost), so 1.2x, not 1.02x:
        # a way counted twice still fails it
        assert 0.5 * p["transport"] <= p["up"] + p["down"] <= 1.2 * p["transport"]
        # the step less its calls (encode to decode): the bench's own loop, its bookkeeping
        # done while the next call is in flight
        assert 0 <= p["bench"] < p["e2e"]
        # the step's calls in order against an echo: answered at once, and held each role's
        # handler p50 (the hold is honoured: a held round trip is at least its hold)
        se = r["seq_echo"]
        assert se["bare"]["passes"] >= 4 and se["held"]["passes"] >= 4
        assert set(se["bare"]["rt_us"]) == set(se["held"]["rt_us"]) == set(roles)
        for role, got in roles.items():
            assert se["bare"]["rt_us"][role] > 0
            assert se["held"]["rt_us"][role] >= got["handler"]
            assert se["held"]["transport_us"][role] == pytest.approx(
                se["held"]["rt_us"][role] - int(got["handler"] * 1e3) * 1e-3)
    assert "per call p50 us  gate+up" in done.stdout


def test_lm_head_topk_scenario(tmp_path: Path) -> None:
    """--lm-head: callers of N rows on the lm-head with the top-k epilogue; the row states the
    reply's bytes against the f32 logits it replaces, and p50/p99."""
    out = tmp_path / "lm.json"
    cmd = [sys.executable, str(ROOT / "bench/service.py"), "--backend", "numpy", "--lm-head",
           "--row-scale", "0.002", "--lm-callers", "2", "--lm-n", "4", "--topk", "8",
           "--mode", "stream", "--seconds", "0.3", "--warmup", "0.1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lm = json.loads(out.read_text())["lm_head"]
    rows = round(152064 * 0.002)
    assert (lm["n"], lm["callers"], lm["topk"], lm["rows"]) == (4, 2, 8, rows)
    assert lm["f32_logits_bytes"] == 4 * rows * 4
    # values + indices + lse of 4 rows, plus the message's own fields
    assert 4 * (8 * 8 + 4) < lm["reply_bytes"] < lm["f32_logits_bytes"]
    assert lm["ratio"] == lm["f32_logits_bytes"] / lm["reply_bytes"]
    assert 0 < lm["p50_us"] <= lm["p99_us"] and isinstance(lm["met"], bool)
    assert "lm-head N=4 x2 callers top-8" in done.stdout


def test_batcher_overhead_modes_run() -> None:
    """bench/batcher_overhead.py's modes run and print their figures (tiny call counts)."""
    script = str(ROOT / "bench/batcher_overhead.py")
    for args, want in ((["--job-py-us", "5", "--job-wait-us", "5", "--loop-us", "5",
                         "--handoff-yield"], "submit->result p50"),
                       (["--engine", "--noop-rows", "64"], "p50 us per stage: parse"),
                       (["--multi"], "q/k/v multi-weight call: submit -> sink p50")):
        done = subprocess.run([sys.executable, script, "--rounds", "1", "--calls", "50", *args],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert want in done.stdout, done.stdout


def test_stream_overhead_variants_run() -> None:
    """bench/stream_overhead.py: every variant serves its round trips and the table prints
    (tiny sizes and spans; the worker variants include their kernel subtraction), with each
    aio server's loop trips counted (the worker's through bench/trips_site) and a timeline; a
    ladder rung with every feature; stamped replies split into up, window and down; grpc's
    sync server's echo and MatmulStream prototype (f32 replies) beside the aio ones."""
    ladder = "bare+" + "+".join(("wopts", "hr", "icpt", "proto", "coro", "threads", "tasks",
                                 "heap", "log", "imports", "work", "spin"))
    variants = ",".join(("bare", "proto", "struct", "icpt", "servicer", "direct", "engine",
                         "worker", "worker0", "sbare", "sync", ladder))
    done = subprocess.run([sys.executable, str(ROOT / "bench/stream_overhead.py"), "--rounds",
                           "1", "--seconds", "0.2", "--warmup", "0.05", "--k", "256",
                           "--rows", "2", "--out", "f32", "--inproc", "200", "--trips",
                           "--timeline", "3",
                           "--variants", variants],
                          capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "WORK_US": "20"})
    assert done.returncode == 0, done.stderr[-2000:]
    for variant in ("direct", "engine", "worker", "worker0", "sync", ladder):  # stamped
        assert re.search(rf"^{re.escape(variant)} +median .* up +[0-9]+ window +-?[0-9]+ "
                         r"down +[0-9]+", done.stdout, re.MULTILINE), done.stdout
    for variant in ("bare", "proto", "struct", "icpt", "servicer", "worker"):
        assert re.search(rf"^{variant} +median", done.stdout, re.MULTILINE), done.stdout
        trips = re.search(rf"^{variant} +loop trips per round trip ([0-9.]+)", done.stdout,
                          re.MULTILINE)
        assert trips and 1.0 <= float(trips.group(1)) <= 50.0, done.stdout
    for variant in ("sync", "worker"):  # against both echoes
        assert re.search(rf"^{variant} +median .* over bare +\+ *-?[0-9]+ over sbare", done.stdout,
                         re.MULTILINE), done.stdout
    assert re.search(r"^sbare +median +[0-9]+ .* p99 +[0-9]+", done.stdout, re.MULTILINE)
    assert not re.search(r"^s(bare|ync) +loop trips", done.stdout, re.MULTILINE), done.stdout
    assert "Task.task_wakeup" in done.stdout and " select " in done.stdout, done.stdout
    for variant in ("direct", "engine", ladder):  # requests taken and answered in one step
        assert re.search(rf"^{re.escape(variant)} +request step \(median of [0-9]+\): taken "
                         r"after -?[0-9.]+ us, encoded [0-9.]+ us later", done.stdout,
                         re.MULTILINE), done.stdout
    assert "in process, no gRPC" in done.stdout, done.stdout


def test_stream_overhead_event_engine_off() -> None:
    """bench/stream_overhead.py's bareee and workeree: the echo and the worker with gRPC's
    EventEngine experiments off in their own processes (GRPC_EXPERIMENTS), this caller's
    environment untouched. The bare echo's round trips wake gRPC's EventEngine threads; the
    bareee echo's round trips do not (the variable reached its process before gRPC started):
    a thread of that name may still exist there and wake now and then (a loaded 2-core CI
    machine read 0.08 sleeps a round trip against the bare echo's 3.06), so the test holds
    it to a tenth of the bare echo's wake-ups."""
    done = subprocess.run([sys.executable, str(ROOT / "bench/stream_overhead.py"), "--rounds",
                           "1", "--seconds", "0.3", "--warmup", "0.05", "--k", "256",
                           "--rows", "2", "--out", "f32", "--inproc", "0",
                           "--variants", "bare,bareee,workeree"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^workeree +median .* up +[0-9]+ window +-?[0-9]+ down +[0-9]+",
                     done.stdout, re.MULTILINE), done.stdout
    threads = dict(re.findall(r"^(bare|bareee) +median .*\n +threads[^:]*: (.*)$", done.stdout,
                              re.MULTILINE))
    assert set(threads) == {"bare", "bareee"}, done.stdout
    sleeps = {v: {name: float(n) for name, n in re.findall(r"(\w+) ([0-9.]+) [0-9]+", t)}
              for v, t in threads.items()}
    assert sleeps["bare"].get("event_engine", 0) > 0.5, done.stdout
    assert sleeps["bareee"].get("event_engine", 0) <= 0.1 * sleeps["bare"]["event_engine"], (
        done.stdout)


def test_stream_overhead_step_marks(tmp_path: Path) -> None:
    """bench/stream_overhead.py with Q6SERVE_STEP_MARKS=1 (bench/loop_trips.install_marks):
    the engine's request step gives its marks' medians in the order the handler passes them
    (request taken, decoded, the direct job's start and end, reply encoded, handed to the
    write, the step's end); and bench/spy_summary.py --under splits a profile's stacks below a
    frame, file paths and line numbers cut, unnamed native frames dropped."""
    done = subprocess.run([sys.executable, str(ROOT / "bench/stream_overhead.py"), "--rounds",
                           "1", "--seconds", "0.3", "--warmup", "0.05", "--k", "256",
                           "--rows", "2", "--out", "f32", "--inproc", "0", "--trips",
                           "--variants", "engine"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "Q6SERVE_STEP_MARKS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^# server pids: engine=[0-9]+$", done.stdout, re.MULTILINE), done.stdout
    line = re.search(r"^engine +its marks \(median us from the step's start\): (.*)$",
                     done.stdout, re.MULTILINE)
    assert line, done.stdout
    marks = [(m.group(1), float(m.group(2)))
             for m in re.finditer(r"(\w+) (-?[0-9.]+)", line.group(1))]
    assert [label for label, _ in marks] == ["taken", "decoded", "job", "job_end", "encoded",
                                             "send", "end"], line.group(0)
    values = [us for _, us in marks]
    assert values == sorted(values), line.group(0)
    prof = tmp_path / "p.raw"
    prof.write_text(
        "thread (1): MainThread;run (/x/loop.py:5);MatmulStream (/a/servicer.py:9);"
        "write (/a/servicer.py:150);0x7f00 (libgrpc.so);sendmsg (libc.so.6) 3\n"
        "thread (1): MainThread;run (/x/loop.py:5);MatmulStream (/a/servicer.py:9);"
        "write (/a/servicer.py:151);sendmsg (libc.so.6) 1\n"
        "thread (1): MainThread;run (/x/loop.py:5);select (/x/sel.py:7) 4\n"
        "thread (2): Other;MatmulStream (/a/servicer.py:9) 5\n")
    done = subprocess.run([sys.executable, str(ROOT / "bench/spy_summary.py"), str(prof),
                           "--thread", "MainThread", "--under", "MatmulStream", "--depth", "2"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "samples 8\n" in done.stdout, done.stdout
    assert "under MatmulStream: 4 samples (50.0%)" in done.stdout, done.stdout
    assert re.search(r"^ +4 +100.0% write \(servicer.py\) > sendmsg \(libc.so.6\)$",
                     done.stdout, re.MULTILINE), done.stdout


def test_stream_overhead_hold_and_keepers() -> None:
    """bench/stream_overhead.py: a holdNNN rung's window is at least its hold (a busy wait
    before the stamped reply), and --keepers runs every variant again beside the keepers
    (labels ~keep), whose policy the run reports."""
    done = subprocess.run([sys.executable, str(ROOT / "bench/stream_overhead.py"), "--rounds",
                           "1", "--seconds", "0.2", "--warmup", "0.05", "--k", "256",
                           "--rows", "2", "--inproc", "0", "--keepers", "1",
                           "--variants", "bare,bare+proto+hold300"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^# keepers: 1 processes, (SCHED_IDLE|nice 19)", done.stdout,
                     re.MULTILINE), done.stdout
    for label in ("bare", "bare~keep"):
        assert re.search(rf"^{re.escape(label)} +median", done.stdout, re.MULTILINE), done.stdout
    for label in ("bare+proto+hold300", "bare+proto+hold300~keep"):
        got = re.search(rf"^{re.escape(label)} +median .* window +([0-9]+) ", done.stdout,
                        re.MULTILINE)
        assert got and int(got.group(1)) >= 299, done.stdout


def test_stream_overhead_job_rung() -> None:
    """bench/stream_overhead.py's floor probe (session 19): the echo running the worker's
    direct job (bare+spin+job) answers each request with a result (an error reply fails the
    run: _reply_times raises), stamped (up, window, down) and set against the bare echo."""
    done = subprocess.run([sys.executable, str(ROOT / "bench/stream_overhead.py"), "--rounds",
                           "1", "--seconds", "0.2", "--warmup", "0.05", "--k", "512",
                           "--rows", "64", "--out", "f32", "--inproc", "0",
                           "--variants", "bare,bare+spin+job"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^bare\+spin\+job +median +[0-9]+ .* up +[0-9]+ window +-?[0-9]+ down "
                     r"+[0-9]+ +\+ *-?[0-9]+ over bare", done.stdout, re.MULTILINE), done.stdout


def test_grpc_floor_with_the_callers_own_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """T1's second floor: the echo's caller encodes a real MatmulRequest and decodes a real
    reply around each round trip (service_load._ClientWork); all three floors (plain, with the
    caller's work, the echo busy-polling) come back."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # (spawned children get it too)
    import service_load

    work = service_load._ClientWork(512, 64)
    raw = work.request(b"\0" * 8)
    from q6serve.v1 import q6serve_pb2 as pb

    msg = pb.MatmulRequest.FromString(raw[8:])
    assert msg.weight == "ffn_down" and list(msg.x.shape) == [1, 512]
    assert len(msg.x.data) == 2 * 512
    work.decode()
    plain = service_load.grpc_floor(2 * 512 + 40, 4 * 64 + 60, ["stream"], 0.3)
    with_work = service_load.grpc_floor(2 * 512 + 40, 4 * 64 + 60, ["stream"], 0.3,
                                        work=(512, 64))
    monkeypatch.setenv("Q6SERVE_BUSY_POLL_US", "200")  # the spinning echo spins on 2 cores too
    spin = service_load.grpc_floor(2 * 512 + 40, 4 * 64 + 60, ["stream"], 0.3, spin=True)
    assert plain["stream"] > 0 and with_work["stream"] > 0 and spin["stream"] > 0


def test_echo_servers_run_the_workers_grpc(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """The floors' echo servers stand for the worker's transport: spawned with gRPC set up as
    `q6serve worker` sets up its own (client/grpc_env.py), unless the environment says
    otherwise (an empty GRPC_EXPERIMENTS: gRPC's defaults in both), and this process's own
    environment left as it was."""
    import multiprocessing as mp

    from q6serve.client import grpc_env

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import service_load

    def child_sees(name: str) -> str:
        out = tmp_path / name
        # (os.system pickles by name: the spawned child's shell writes what it was given)
        p = mp.get_context("spawn").Process(
            target=os.system, args=(f'printf %s "${{GRPC_EXPERIMENTS-unset}}" > {out}',))
        service_load._start_as_worker(p)
        p.join(60)
        return out.read_text()

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    assert child_sees("default") == grpc_env.EVENT_ENGINE_OFF
    assert "GRPC_EXPERIMENTS" not in os.environ
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")
    assert child_sees("empty") == ""
    assert os.environ["GRPC_EXPERIMENTS"] == ""


def test_stamped_worker_sets_up_grpc_first(tmp_path: Path) -> None:
    """A worker with bench/trips_site on its path (its reply stamps import gRPC at start-up)
    still runs gRPC as `q6serve worker` sets it up (client/grpc_env.py): the site does it first."""
    from q6serve.client import grpc_env
    from q6serve.client.worker_process import WorkerProcess

    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "bench/trips_site"),
                                                      env.get("PYTHONPATH", "")) if p),
               Q6SERVE_REPLY_STAMPS="1")
    log = tmp_path / "worker.log"
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # (WorkerProcess starts the worker with this environment)
    try:
        with WorkerProcess(["--backend", "numpy"], log):
            pass
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = log.read_text()
    assert f"gRPC: GRPC_EXPERIMENTS='{grpc_env.EVENT_ENGINE_OFF}'\n" in text, text


def test_dataplane_region_rows_run(tmp_path: Path) -> None:
    """--dataplane through shared-memory regions: the load reads y (and the timing) from the
    caller's region, not from the reply's empty y (its `output_of` once read the message: every
    region row failed with "cannot reshape array of size 0", the H200 closing check of session
    15 included)."""
    out = tmp_path / "dp.json"
    cmd = [sys.executable, str(ROOT / "bench/service.py"), "--backend", "numpy",
           "--row-scale", "0.005", "--dataplane", "--regions", "bytes,system", "--modes",
           "stream", "--frontends", "1", "--t3-hosts", "1", "--targets", "T3", "--seconds",
           "0.3", "--warmup", "0.1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "FAILED" not in done.stdout, done.stdout[-2000:]
    doc = json.loads(out.read_text())
    got = {t["region"]: t for t in doc["targets"] if t["target"] == "T3"}
    assert set(got) == {"bytes", "system"}, doc["targets"]
    assert all(t["service_rows_per_s"] > 0 for t in got.values()), got


def test_dataplane_t2_runs_pooled(tmp_path: Path) -> None:
    """--t2-runs 2: T2 is judged on the calls of both runs pooled (p99 of all of them, rows/s
    over both walls), each run's own figures beside it (the spread between runs)."""
    out = tmp_path / "dp.json"
    cmd = [sys.executable, str(ROOT / "bench/service.py"), "--backend", "numpy",
           "--row-scale", "0.005", "--dataplane", "--regions", "bytes", "--modes", "stream",
           "--frontends", "1", "--targets", "T2", "--t2-procs", "1", "--t2-runs", "2",
           "--seconds", "0.3", "--warmup", "0.1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    (t2,) = [t for t in doc["targets"] if t["target"] == "T2"]
    runs = [r for r in doc["runs"] if r["label"].startswith("T2 ")]
    assert [r["label"][-5:] for r in runs] == ["(1/2)", "(2/2)"]
    assert [e["p99_us"] for e in t2["runs"]] == [r["p99_us"] for r in runs]
    calls = sum(r["calls"] for r in runs)
    assert t2["rows_per_s"] == pytest.approx(calls / sum(r["seconds"] for r in runs))
    assert min(r["p50_us"] for r in runs) <= t2["p99_us"] <= max(r["p99_us"] for r in runs) * 1.001
    assert "2 runs pooled, each p99" in done.stdout


def test_replay_floor_uses_the_replays_caller_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay's limit is 1.5 x (bare round trips + kernels): the bare round trips must be
    made with the gRPC the replay's hosts use (--replay-transport, --replay-mode), or the floor
    is not the replay's. bench/service.py's floor and its sequence echo both pass them on."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import argparse

    from service_replay import floor_sizes, model_weights, step_plan

    import service as bench_service

    got: list[tuple[str, str]] = []

    def floors(plans: list, n: int, itemsize: int, mode: str, out_size: int,
               **kw: object) -> list[float]:
        got.append((mode, str(kw["transport"])))
        kw["per_size"].update({floor_sizes(c, n, itemsize, out_size): 1e-3  # type: ignore[attr-defined]
                               for plan in plans for c in plan})
        return [0.001 for _ in plans]

    def held(plans: list, itemsize: int, out_itemsize: int, mode: str, seconds: float,
             spin: float, transport: str) -> list[dict]:
        got.append((mode, transport))
        return [{}]

    monkeypatch.setattr(bench_service, "step_floors", floors)
    monkeypatch.setattr(bench_service, "held_echo", held)
    rows = {name: r for name, r, _ in model_weights(1, 0.001)}
    plan = step_plan(1, rows, True, 4)
    for transport, mode in (("sync", "unary"), ("aio", "stream"), ("sync", "stream")):
        a = argparse.Namespace(replay_out="f16", replay_mode=mode, replay_transport=transport,
                               seconds=0.1)
        got.clear()
        bench_service.replay_floors({True: plan}, 1, 2, a, 0.0)
        bench_service.seq_echo(plan, {"per_call_p50_us": {}}, 1, 2, a, 0.0)
        assert got == [(mode, transport)] * 3  # the plain and spinning echo, the sequence echo
    assert bench_service.parse_args(["--replay", "--replay-transport", "sync"]).replay_transport \
        == "sync"
    # the replay's host: grpc.aio on the host's loop (session 23's 28-layer A/B: the spinning
    # Client.session(), session 22's default, was no faster)
    assert bench_service.parse_args(["--replay"]).replay_transport == "aio"
    # its replies read as upb and y alone (session 27's bundle D: the client's own decoding,
    # views from 256 KiB, moved neither S=8 nor S=1)
    assert bench_service.parse_args(["--replay"]).replay_decode == "arrays"


def test_tiny_model_replay_sync_unary(tmp_path: Path) -> None:
    """--replay with the sync stub's unary calls: runs, and the row says which gRPC it used."""
    out = tmp_path / "replay.json"
    cmd = [sys.executable, str(ROOT / "bench/service.py"), "--backend", "numpy", "--replay",
           "--layers", "1", "--scale", "0.002", "--replay-seqs", "2", "--topk", "8",
           "--multi", "on", "--replay-transport", "sync", "--replay-mode", "unary",
           "--replay-decode", "client", "--seconds", "0.3", "--warmup", "0.1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (r,) = json.loads(out.read_text())["replay"]
    assert (r["transport"], r["mode"], r["decode"]) == ("sync", "unary", "client")
    assert r["steps"] > 0 and r["floor_step_ms"] > 0 and r["limit_ms"] is not None
    assert "caller gRPC sync unary" in done.stdout


def test_replay_floor_caller_spins_as_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's session (--replay-transport session) spins for each reply
    as client/session.session_spin_us says: the floor's echo caller must spin as long, else
    the bare round trips are a sleeping caller's and the limit is not like for like. A spin
    given (--replay-spins) is the session's and the floor's; other transports keep theirs."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import argparse

    from service_replay import floor_sizes, model_weights, step_plan
    from svc_util_transport import caller_spin_us

    import service as bench_service

    monkeypatch.setenv("Q6SERVE_SESSION_SPIN_US", "700")
    assert caller_spin_us("session", 0.0) == 700.0
    assert caller_spin_us("session", 300.0) == 300.0
    assert caller_spin_us("aio", 0.0) == caller_spin_us("tsession", 0.0) == 0.0
    got: list[float] = []

    def floors(plans: list, n: int, itemsize: int, mode: str, out_size: int,
               **kw: object) -> list[float]:
        got.append(float(kw["client_spin_us"]))  # type: ignore[arg-type]
        kw["per_size"].update({floor_sizes(c, n, itemsize, out_size): 1e-3  # type: ignore[attr-defined]
                               for plan in plans for c in plan})
        return [0.001 for _ in plans]

    monkeypatch.setattr(bench_service, "step_floors", floors)
    plan = step_plan(1, {name: r for name, r, _ in model_weights(1, 0.001)}, True, 4)
    for transport, spin, want in (("session", 0.0, 700.0), ("session", 250.0, 250.0),
                                  ("aio", 0.0, 0.0), ("aio", 100.0, 100.0)):
        a = argparse.Namespace(replay_out="f16", replay_mode="stream",
                               replay_transport=transport, seconds=0.1)
        got.clear()
        bench_service.replay_floors({True: plan}, 1, 2, a, spin)
        assert got == [want, want], (transport, spin)  # the plain and the spinning echo


def test_t1_ab_of_two_trees(tmp_path: Path) -> None:
    """bench/service_t1ab.py on NumPy: a variant on another tree's q6serve (PYTHONPATH, as the
    device script's main) and this tree's, alternated; each run's parts add up to its mean
    round trip and the table gives a median per variant."""
    other = tmp_path / "other"
    (other / "q6serve").mkdir(parents=True)
    for d in ("kernels", "service", "client"):
        (other / "q6serve" / d).symlink_to(ROOT / d)
    (other / "q6serve" / "v1").symlink_to(ROOT / "proto/q6serve/v1")
    out = tmp_path / "t1ab.json"
    got = subprocess.run(
        [sys.executable, str(ROOT / "bench/service_t1ab.py"), "--backend", "numpy",
         "--row-scale", "0.002", "--variants", f"main:PYTHONPATH={other} new:",
         "--order", "main,new", "--seconds", "0.3", "--warmup", "0.1",
         "--out-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ})
    assert got.returncode == 0, got.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]] == ["main_1", "new_1"]
    for r in doc["runs"]:
        assert r["calls"] > 0 and r["gap_us"] > 0
        assert min(r["parts_mean_us"].values()) > -5.0
    assert "# main median of 1 runs" in got.stdout and "# new median of 1 runs" in got.stdout
