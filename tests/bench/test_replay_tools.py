"""bench/replay_ab.py's per-role figures and bench/replay_echo.py's holds taken from them: the
held echo of a device call is held for the windows that call measured, so these must pick the
right variant, S and role, and refuse what is not there rather than hold 0."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import replay_ab
import replay_echo


def run(variant: str, seqs: int, rnd: int, handler: float, rpc: float) -> dict[str, Any]:
    return {"variant": variant, "seqs": seqs, "round": rnd,
            "roles_p50_us": {"o": {"rpc": rpc, "handler": handler, "calls": 10.0},
                             "down": {"rpc": rpc + 100, "handler": handler + 50,
                                      "calls": 10.0}}}


DOC = {"variants": {"def": {}, "g200": {"Q6SERVE_GIL_SWITCH_US": "200"}},
       "runs": [run("def", 1, 1, 100, 400), run("g200", 1, 1, 900, 900),
                run("def", 1, 2, 120, 380), run("def", 1, 3, 300, 700),
                run("def", 8, 1, 200, 600)]}


def test_role_medians_take_one_variant_and_s() -> None:
    got = replay_ab.role_medians(DOC["runs"], "def", 1)
    assert got["o"] == {"rpc": 400.0, "handler": 120.0, "calls": 30.0}
    assert got["down"]["handler"] == 170.0
    assert replay_ab.role_medians(DOC["runs"], "g200", 1)["o"]["handler"] == 900.0
    assert replay_ab.role_medians(DOC["runs"], "g200", 8) == {}


def test_holds_from_a_replay_ab_json() -> None:
    holds, per = replay_echo.holds_from(DOC, "def", [1, 8])
    assert holds == {1: {"handler": {"o": 120.0, "down": 170.0}},
                     8: {"handler": {"o": 200.0, "down": 250.0}}}
    assert per[1]["down"]["rpc"] == 500.0
    # one held kind per field: the rpc's medians as holds too
    holds, _ = replay_echo.holds_from(DOC, "def", [1], ("rpc", "handler"))
    assert holds == {1: {"rpc": {"o": 400.0, "down": 500.0},
                         "handler": {"o": 120.0, "down": 170.0}}}


def test_holds_from_refuses_what_is_not_there() -> None:
    with pytest.raises(SystemExit, match="not in the A/B's variants"):
        replay_echo.holds_from(DOC, "g100", [1])
    # an S the A/B did not reach is left out (the rest is echoed); none at all: refused
    holds, _ = replay_echo.holds_from(DOC, "g200", [1, 8])
    assert holds == {1: {"handler": {"o": 900.0, "down": 950.0}}}
    with pytest.raises(SystemExit, match=r"no run of 'g200' at S = \[8\]"):
        replay_echo.holds_from(DOC, "g200", [8])


def test_parse_holds() -> None:
    assert replay_echo.parse_holds("1:q+k+v=207,o=89; 8:o=130") == {
        1: {"q+k+v": 207.0, "o": 89.0}, 8: {"o": 130.0}}


def test_pin_plan() -> None:
    assert replay_ab.pin_plan("", ["a", "b"]) == ({"a": (), "b": ()}, ())
    # as many worker cores as variants: one each; else all of them for every worker
    assert replay_ab.pin_plan("2,3:8-10", ["a", "b"]) == ({"a": (2,), "b": (3,)}, (8, 9, 10))
    assert replay_ab.pin_plan("2-4:8", ["a", "b"]) == ({"a": (2, 3, 4), "b": (2, 3, 4)}, (8,))
    with pytest.raises(SystemExit, match="overlap"):
        replay_ab.pin_plan("2,3:3-5", ["a", "b"])
    with pytest.raises(SystemExit, match="WORKER_CPUS:LOAD_CPUS"):
        replay_ab.pin_plan("2,3", ["a", "b"])


@pytest.mark.parametrize(("transport", "mode"),
                         [("aio", "stream"), ("sync", "stream"), ("sync", "unary")])
def test_ladder_echo_holds_each_kind(transport: str, mode: str) -> None:
    """A one-layer plan against the real echo, with each caller transport (the replay host's:
    bench/svc_util_transport.py): every kind comes back, each call's round trip at least its
    hold (busy-waited by the echo), and transport_us is the round trip less it."""
    from service_replay import ladder_echo, model_weights, step_plan

    rows = {name: r for name, r, _ in model_weights(1, 0.001)}
    plan = step_plan(1, rows, True, 4)
    holds = {"short": {"o": 100.0}, "long": {"o": 3000.0, "down": 500.0}}
    (res,) = ladder_echo([(plan, 1, holds)], 2, 2, mode, 0.05, transport=transport)
    assert set(res) == {"bare", "short", "long"}
    assert res["long"]["rt_us"]["o"] >= 3000.0
    assert res["long"]["rt_us"]["down"] >= 500.0
    assert res["short"]["rt_us"]["o"] >= 100.0
    assert res["long"]["transport_us"]["o"] == pytest.approx(res["long"]["rt_us"]["o"] - 3000.0)
    assert "transport_us" not in res["bare"]
    assert len(res["long"]["runs_step_ms"]) == 2  # run on either side of the other kinds


def test_host_variants_share_a_worker() -> None:
    """host.* options are the replay host's, not the worker's: variants that differ only in
    them run on one worker (the first one's), so a caller-side A/B alternates on one worker."""
    v = replay_ab.parse_variants(
        "plain: spin:host.spin=300 g:Q6SERVE_X=1 gs:Q6SERVE_X=1,host.spin=5")
    assert replay_ab.worker_keys(v) == {"plain": "plain", "spin": "plain", "g": "g", "gs": "g"}
    assert replay_ab.split_variant(v["gs"]) == ({"Q6SERVE_X": "1"}, {"host.spin": 5.0})
    with pytest.raises(SystemExit, match="unknown host option"):
        replay_ab.split_variant({"host.nope": "1"})
    assert replay_ab.split_variant({"host.transport": "sync", "host.mode": "unary"}) == (
        {}, {"host.transport": "sync", "host.mode": "unary"})
    with pytest.raises(SystemExit, match=r"host\.transport='grpc'"):
        replay_ab.split_variant({"host.transport": "grpc"})
    with pytest.raises(SystemExit, match=r"host\.mode='bidi'"):
        replay_ab.split_variant({"host.mode": "bidi"})
    assert replay_ab.split_variant({"host.grpc.enable_retries": "0", "Q6SERVE_X": "1"}) == (
        {"Q6SERVE_X": "1"}, {"host.grpc": {"grpc.enable_retries": 0}})
    with pytest.raises(SystemExit, match="an integer"):
        replay_ab.split_variant({"host.grpc.enable_retries": "no"})


def test_stream_request_id_is_the_last_field_one() -> None:
    """A stamped stream reply (bench/reply_stamps.py appends a request_id after the result)
    read without parsing the result: the last request_id wins, as upb reads it."""
    import service_replay

    from q6serve.v1 import q6serve_pb2 as pb

    result = pb.MatmulResponse(y=pb.Tensor(data=bytes(300), shape=[1, 150]), kernel="k")
    raw = pb.MatmulStreamResponse(request_id="r", result=result).SerializeToString()
    assert service_replay.stream_request_id(raw) == "r"
    stamped = raw + pb.MatmulStreamResponse(request_id="1.5 2.5").SerializeToString()
    assert service_replay.stream_request_id(stamped) == "1.5 2.5"
    assert pb.MatmulStreamResponse.FromString(stamped).request_id == "1.5 2.5"
    assert service_replay.stream_request_id(b"") == ""



def _stamped_replay_ab(tmp_path: Path, variants: str, order: str) -> tuple[str, dict[str, Any]]:
    """bench/replay_ab.py on a 1-layer NumPy model at S=2, the worker's replies stamped (each
    role's way up and down): its stdout and its JSON document (the run must succeed)."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "bench/trips_site"),
           "Q6SERVE_REPLY_STAMPS": "1"}
    out = tmp_path / "ab.json"
    got = subprocess.run(
        [sys.executable, str(root / "bench/replay_ab.py"), "--backend", "numpy", "--layers", "1",
         "--scale", "0.002", "--variants", variants, "--order", order, "--seqs", "2",
         "--seconds", "0.3", "--warmup", "0.1", "--out-dir", str(tmp_path), "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=240)
    assert got.returncode == 0, got.stderr[-2000:]
    return got.stdout, json.loads(out.read_text())

def test_replay_ab_host_decoding_on_one_worker(tmp_path: Path) -> None:
    """A caller-side A/B (the client's own decoding, views on and off) on one NumPy worker,
    its replies stamped: every run has each role's caller CPU and way up / down."""
    stdout, doc = _stamped_replay_ab(tmp_path, "cl:host.decode=client "
                                     "clcopy:host.decode=client,host.view_min=1e18", "cl,clcopy")
    assert doc["worker_of"] == {"cl": "cl", "clcopy": "cl"}
    assert [r["variant"] for r in doc["runs"]] == ["cl", "clcopy"]
    for r in doc["runs"]:
        for role, f in r["roles_p50_us"].items():
            assert f["ccpu"] > 0 and f["up"] > 0 and f["down"] > 0, (role, f)
    assert "caller CPU" in stdout


def test_replay_ab_caller_transports_on_one_worker(tmp_path: Path) -> None:
    """The host's gRPC alternated on one NumPy worker, its replies stamped: grpc.aio, the sync
    stub and the client's two sessions (client/session.py) on MatmulStream (stamped: each
    role's way up and down), the sync stub's unary Matmul (no stream reply, so no stamps: the
    mode really changed), every role with its round trip above the worker's handler and the
    caller's CPU."""
    _, doc = _stamped_replay_ab(
        tmp_path, "aio: s:host.transport=sync "
        "su:host.transport=sync,host.mode=unary,host.grpc.enable_retries=0 "
        "ss:host.transport=session ts:host.transport=tsession is:host.transport=isession "
        "as:host.transport=asession", "aio,s,su,ss,ts,is,as")
    assert set(doc["worker_of"].values()) == {"aio"}
    runs = {r["variant"]: r for r in doc["runs"]}
    assert set(runs) == {"aio", "s", "su", "ss", "ts", "is", "as"}
    for v, r in runs.items():
        assert r["steps"] > 0
        for role, f in r["roles_p50_us"].items():
            assert f["rpc"] > f["handler"] > 0 and f["ccpu"] > 0, (v, role, f)
            stamped = f["up"] > 0 and f["down"] > 0
            assert stamped == (v != "su"), (v, role, f)  # (NaN: not stamped)


def test_replay_ab_multi_and_single_calls_on_one_worker(tmp_path: Path) -> None:
    """host.multi=on / off alternated on one NumPy worker: the multi variant's step has the
    q+k+v and gate+up calls, the single one a call per weight (q, k, v, gate, up)."""
    _, doc = _stamped_replay_ab(tmp_path, "mul:host.multi=on one:host.multi=off", "mul,one")
    assert doc["worker_of"] == {"mul": "mul", "one": "mul"}
    runs = {r["variant"]: r for r in doc["runs"]}
    assert {"q+k+v", "gate+up"} <= set(runs["mul"]["roles_p50_us"])
    assert {"q", "k", "v", "gate", "up"} <= set(runs["one"]["roles_p50_us"])
    assert not {"q+k+v", "gate+up"} & set(runs["one"]["roles_p50_us"])
    assert runs["one"]["calls_per_step"] > runs["mul"]["calls_per_step"]


def test_replay_ab_host_chains(tmp_path: Path) -> None:
    """host.chains=2 at S=2: the host's two sequences as two concurrent chains of one row, a
    stream each: every role makes two calls a step (one a step with one chain), each as
    large as one row's; the step still ends with its calls done."""
    _, doc = _stamped_replay_ab(tmp_path, "one: two:host.chains=2", "one,two")
    runs = {r["variant"]: r for r in doc["runs"]}
    assert set(runs) == {"one", "two"}
    for v, per_step in (("one", 1), ("two", 2)):
        r = runs[v]
        for role, f in r["roles_p50_us"].items():
            assert f["calls"] == per_step * r["steps"], (v, role, f)
            assert f["rpc"] > f["handler"] > 0, (v, role, f)


def test_replay_ab_grpc_experiments_of_host_and_worker(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """host.ee alternates the replay host's gRPC setup on one worker (EventEngine off as
    `q6serve worker` runs it, gRPC's defaults, or the bench's environment: here unset), and
    each run says what its host's gRPC read; a worker variant GRPC_EXPERIMENTS= runs a worker
    on gRPC's defaults beside one that sets its own (client/grpc_env.py)."""
    from q6serve.client import grpc_env

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    stdout, doc = _stamped_replay_ab(
        tmp_path, "w: off:host.ee=off def:host.ee=def gd:GRPC_EXPERIMENTS=", "w,off,def,gd")
    assert doc["worker_of"] == {"w": "w", "off": "w", "def": "w", "gd": "gd"}
    host = {r["variant"]: r["host_grpc_experiments"] for r in doc["runs"]}
    assert host == {"w": None, "off": grpc_env.EVENT_ENGINE_OFF, "def": "", "gd": None}
    assert "host gRPC EE off" in stdout and "host gRPC defaults" in stdout
    assert f"gRPC: GRPC_EXPERIMENTS='{grpc_env.EVENT_ENGINE_OFF}'" in (
        tmp_path / "worker_w.log").read_text()
    assert "gRPC: GRPC_EXPERIMENTS=''" in (tmp_path / "worker_gd.log").read_text()


def test_machine_probe_measures_every_part(tmp_path: Path) -> None:
    """bench/machine_probe.py: a figure for every core this process may use, a first touch that
    costs more than touching the same pages again, a ping-pong through a real child process."""
    import json
    import os

    import machine_probe

    out = tmp_path / "probe.json"
    assert machine_probe.main(["--label", "t", "--touch-mib", "8", "--iters", "2000",
                               "--rounds", "50", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(map(int, doc["cpu"]["per_core_ns"])) == sorted(os.sched_getaffinity(0))
    assert 0 < doc["cpu"]["min_ns"] <= doc["cpu"]["median_ns"] <= doc["cpu"]["max_ns"]
    touch = doc["touch"]
    assert touch["first_us"] > touch["again_us"] > 0 and touch["copy_gbs"] > 0
    assert 0 < doc["wake"]["p50_us"] <= doc["wake"]["p90_us"]
    assert os.sched_getaffinity(0) == set(map(int, doc["cpu"]["per_core_ns"]))  # restored


def test_service_pin_by_core_speed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/service_pin.py: the W fastest cores for the worker, the L next for the load (ties
    by core number), and the same from the slow end, in bench/service.py --pin's form; none
    where the cores are too few; read from bench/machine_probe.py's JSON."""
    import json

    import service_pin

    ns = {0: 40.0, 1: 33.0, 2: 70.0, 3: 33.0, 4: 35.0, 5: 60.0}
    assert service_pin.pin_by_speed(ns, 2, 1) == ("1,3:4", "2,5:0")
    assert service_pin.pin_by_speed(ns, 1, 2) == ("1:3,4", "2:0,5")
    assert service_pin.pin_by_speed(ns, 4, 3) is None
    assert service_pin.pin_by_speed({0: 1.0, 1: 2.0}, 1, 1) == ("0:1", "1:0")
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"cpu": {"per_core_ns": {str(c): v for c, v in ns.items()}}}))
    assert service_pin.main([str(probe), "2,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("  #")[0] for ln in lines] == ["fastest 1,3:4", "slowest 2,5:0"]
    assert service_pin.main([str(probe), "4,3"]) == 0
    assert "too few" in capsys.readouterr().out


def test_service_pin_sides() -> None:
    """bench/service.py --pin: either side may be left unpinned (empty); both empty, or no
    colon, is refused."""
    import service

    assert service.pin_parts("2,3:8-9") == ((2, 3), (8, 9))
    assert service.pin_parts("2,3:") == ((2, 3), ())
    assert service.pin_parts(":8,9") == ((), (8, 9))
    for bad in (":", "2,3"):
        with pytest.raises(SystemExit, match="WORKER_CPUS:LOAD_CPUS"):
            service.pin_parts(bad)


def test_service_auto_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    """--pin auto / auto-w / auto-c: the probe's fastest cores, both sides or one."""
    import machine_probe

    import service

    ns = {0: 40.0, 1: 33.0, 2: 70.0, 3: 33.0, 4: 35.0, 5: 60.0, 6: 34.0}
    monkeypatch.setattr(machine_probe, "cpu_ns", lambda *_: {"per_core_ns": ns})
    assert service.auto_pin("auto") == "1,3:4,6"
    assert service.auto_pin("auto-w") == "1,3:"
    assert service.auto_pin("auto-c") == ":4,6"
    monkeypatch.setattr(machine_probe, "cpu_ns", lambda *_: {"per_core_ns": {0: 1.0}})
    with pytest.raises(SystemExit, match="fewer than 4 cores"):
        service.auto_pin("auto")


def test_psr_watch_pairs_count_samples_on_one_cpu() -> None:
    """bench/psr_watch.py's report: per pair of busy threads of different processes, the
    samples where both ran and those on one CPU; idle and same-process pairs left out."""
    import psr_watch

    w1, c1, w2, idle = ("10", "10"), ("20", "20"), ("10", "11"), ("30", "30")
    running = [{w1: 3, c1: 3, w2: 5}, {w1: 3, c1: 4}, {w1: 2, c1: 2}, {c1: 1}]
    w = {"wall": 1.0, "samples": 4, "cmds": {"10": "worker", "20": "caller", "30": "x"},
         "names": {w1: "py", c1: "py", w2: "py", idle: "py"},
         "busy": {w1: 0.9, c1: 0.8, w2: 0.5, idle: 0.0},
         "cpus": {}, "running": running}
    lines, doc = psr_watch.report(w, 0.2)
    got = {(tuple(p["a"]), tuple(p["b"])): (p["both"], p["same"]) for p in doc["pairs"]}
    assert got == {(w1, c1): (3, 2), (c1, w2): (1, 0)}
    assert [t["tid"] for t in doc["threads"]] == ["10", "20", "11"]
    assert any("on one CPU in 67%" in line for line in lines)


def test_mlp_plan_is_one_call_per_mlp() -> None:
    """step_plan's mlp: each layer's gate, up and down as one call (3 a layer + the lm-head),
    K of gate, its reply down's y; the other calls as the multi-weight plan's."""
    from service_replay import model_weights, step_plan

    rows = {name: r for name, r, _ in model_weights(2, 1.0)}
    multi, mlp = step_plan(2, rows, True, 64), step_plan(2, rows, True, 64, mlp=True)
    assert (len(multi), len(mlp)) == (9, 7)
    assert [c.role for c in mlp[:3]] == ["q+k+v", "o", "gate+up+down"]
    fused = mlp[2]
    assert fused.weights == ("blk.0.gate", "blk.0.up", "blk.0.down")
    assert (fused.k, fused.out_cols) == (3584, 3584)
    assert mlp[:2] == multi[:2] and mlp[-1] == multi[-1]
    assert step_plan(2, rows, False, 64, mlp=True) == step_plan(2, rows, False, 64)


def test_replay_echo_holds_the_mlp_call_for_both_windows(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: Any) -> None:
    """replay_echo --multi on,mlp: one echo run for both plans; the MLP call is held for
    gate+up's hold and down's together."""
    seen: list[Any] = []

    def ladder(plans: Any, *args: Any, **kw: Any) -> list[dict[str, Any]]:
        seen.extend(plans)
        return [{"bare": {"step_ms": 1.0, "rt_us": {c.role: 1.0 for c in plan}},
                 "held": {"step_ms": 2.0, "rt_us": {c.role: 2.0 for c in plan}}}
                for plan, _, _ in plans]

    monkeypatch.setattr(replay_echo, "ladder_echo", ladder)
    assert replay_echo.main(["--seqs", "1", "--layers", "1", "--multi", "on,mlp", "--holds",
                             "1:gate+up=200,down=100,o=50"]) == 0
    assert [len(p) for p, _, _ in seen] == [5, 4]
    assert seen[1][2]["held"]["gate+up+down"] == 300
    assert "multi mlp (4 calls)" in capsys.readouterr().out


def test_machine_holds_are_neither_the_workers_nor_the_hosts() -> None:
    """sys.hold: a machine-wide hold the A/B keeps around a variant's runs (bench/cpu_hold.py),
    out of the worker's environment; replay_ab's variants differing only in it share a
    worker, and so do service_t1ab's, whose other variants keep a worker each (an A/A)."""
    import service_t1ab

    v = replay_ab.parse_variants("off: spin:sys.hold=idlespin g:Q6SERVE_X=1,sys.hold=dma")
    assert replay_ab.split_variant(v["g"]) == ({"Q6SERVE_X": "1"}, {"sys.hold": "dma"})
    assert replay_ab.worker_keys(v) == {"off": "off", "spin": "off", "g": "g"}
    with pytest.raises(SystemExit, match="unknown machine option"):
        replay_ab.split_variant({"sys.nope": "1"})
    t = replay_ab.parse_variants("a: a2: h:sys.hold=idlespin x:Q6SERVE_X=1,sys.hold=dma")
    assert service_t1ab.worker_of(t) == {"a": "a", "a2": "a2", "h": "a", "x": "x"}
    from cpu_hold import SystemHold

    with pytest.raises(SystemExit, match="cpu hold 'warm'"):
        SystemHold("warm")
    with SystemHold("") as h:
        pass
    assert h.info["kind"] == "none" and "idle_delta" in h.info
