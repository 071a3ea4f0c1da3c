"""bench/check_targets.py: the closing check's target rows from its JSON files. A verdict must
follow the figure and the limit (not a flag copied blindly where the table computes it), and a
target whose run is missing must read "not run", never met."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench/check_targets.py"


def kernel(shape: str, n: int, us: float) -> dict:
    return {"shape": shape, "n": n, "path": "auto=mma_f16.f16", "dtype": "f16", "us": us}


def write(d: Path, name: str, doc: dict) -> None:
    (d / f"{name}.json").write_text(json.dumps(doc))


def rows(out: str) -> dict[str, list[str]]:
    """target -> [figure, limit, result] from the printed markdown table."""
    got = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| target"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            got[cells[0]] = cells[1:]
    return got


def run(out: Path) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return rows(done.stdout)


def test_verdicts_from_figures_and_limits(tmp_path: Path) -> None:
    write(tmp_path, "kernels_ref", {"device": "test GPU", "results": [
        kernel("3584x18944", 1, 20.0), kernel("4096x14336", 1, 20.0),
        kernel("14336x4096", 1, 20.0), kernel("4096x14336", 64, 40.0),
        kernel("14336x4096", 64, 40.0)]})
    write(tmp_path, "t1", {"device": "test GPU", "targets": [
        {"target": "T1", "p50_minus_kernel_us": 300.0, "limit_us": 367.0, "met": True,
         "bare_grpc_p50_us": 267.0}],
        "runs": [{"label": "T1 1 caller N=1 stream", "kernel_p50_us": 26.0}]})
    # N=1: one shape 0.5 us over its 30 us: the row is missed; N=64 both inside 100
    write(tmp_path, "wall", {"results": [
        {"shape": "4096x14336", "n": 1, "mode": "staged", "variant": "", "wall_p50": 45.0},
        {"shape": "14336x4096", "n": 1, "mode": "staged", "variant": "", "wall_p50": 50.5},
        {"shape": "14336x4096", "n": 1, "mode": "graph", "variant": "", "wall_p50": 30.0},
        {"shape": "4096x14336", "n": 64, "mode": "staged", "variant": "", "wall_p50": 120.0},
        {"shape": "14336x4096", "n": 64, "mode": "staged", "variant": "", "wall_p50": 139.0}]})
    write(tmp_path, "lm_head", {"lm_head": {"p50_us": 4200.0, "ratio": 1175.0, "met": True}})
    write(tmp_path, "replay", {"replay": [
        {"seqs": 8, "hosts": 1, "multi": True, "step_p50_ms": 80.0, "floor_step_ms": 40.0,
         "limit_ms": 86.0, "met": True},
        {"seqs": 8, "hosts": 1, "multi": False, "step_p50_ms": 190.0, "floor_step_ms": 70.0,
         "limit_ms": 112.5, "met": False},
        {"seqs": 64, "hosts": 1, "multi": True, "step_p50_ms": 300.0, "floor_step_ms": 250.0,
         "limit_ms": 400.0, "met": True, "transport": "session", "caller_spin_us": 2000.0}]})
    (tmp_path / "dataplane").mkdir()
    write(tmp_path / "dataplane", "dataplane_f6_rr", {"targets": [
        {"target": "T2", "frontends": 6, "region": "bytes", "rows_per_s": 36808.0,
         "rows_per_s_min": 20000.0, "p99_us": 3331.0, "p99_limit_us": 4000.0, "met": True,
         "runs": [{"rows_per_s": 36000.0, "p99_us": 3100.0},
                  {"rows_per_s": 37600.0, "p99_us": 4450.0}]},
        {"target": "T3", "frontends": 6, "region": "cuda", "hosts": 8, "fraction": 0.46,
         "fraction_min": 0.5, "service_rows_per_s": 6.0e5, "kernel_rows_per_s": 1.3e6,
         "met": False}]})
    (tmp_path / "kernels_gpu.log").write_text("255 passed, 4 skipped in 71.09s (0:01:11)\n")
    (tmp_path / "service_cuda.log").write_text("1 failed, 77 passed in 19.25s\n")
    (tmp_path / "demo.log").write_text("all 288 results match the NumPy reference\n")
    got = run(tmp_path)
    t1 = got["T1, p50 - kernel (N=1 f16 ffn_down, stream)"]
    assert t1 == ["300 us (echo 267)", "367 us (echo + 100)", "**met**"]
    kr = got["kernel in the service (T1 p50) / bench/kernels.py (3584x18944 N=1 f16)"]
    assert kr == ["26.00 / 20.00 us = 1.30x", "1.25x", "missed"]
    assert got["host wall (staged) - kernel, N=1"][2] == "missed"
    assert "14336x4096: 50.5 - 20.0 = 30.5 us" in got["host wall (staged) - kernel, N=1"][0]
    assert got["host wall (staged) - kernel, N=64"][2] == "**met**"
    lm = got["lm-head N=64 x8 top-64: p50, reply smaller than f32 logits"]
    assert lm[0].startswith("one process: p50 4.20 ms, 1,175x; busy polling off: -")
    assert lm[2] == "**met**"
    assert got["replay S=8 step p50, multi / single (the target)"] == [
        "80.00 / 190.00 ms (floor 40.00 / 70.00)", "86.0 / 112.5 ms", "**met** / missed"]
    assert got["replay S=1 step p50, multi / single"][2] == "not run"
    # a row that says its caller: the figure names it (the floor's echo caller the same)
    assert got["replay S=64 step p50, multi / single"][0] == (
        "multi 300.00 ms (floor 250.00); caller session spinning 2000 us")
    assert got["T2, 64 callers N=1 (6 front ends, bytes)"][2] == "**met**"
    assert got["T2, 64 callers N=1 (6 front ends, bytes)"][0] == (
        "36,808 rows/s, p99 3.33 ms (2 runs pooled; each p99 3.10-4.45 ms, 36,000-37,600 rows/s)")
    assert got["T3, N=64 x8 hosts (6 front ends, cuda), of the kernel alone"][2] == "missed"
    assert got["GPU tests, tests/kernels"][2] == "**met**"
    assert got["service + issue-18 tests on CUDA"][2] == "missed"
    assert got["GPU tests, tests/dataplane"][2] == "not run"
    assert got["q6serve demo --backend cuda"][:1] == ["288/288 match"]


def test_an_empty_folder_is_not_run_everywhere(tmp_path: Path) -> None:
    got = run(tmp_path)
    assert got, "no rows"
    assert {r[2] for r in got.values()} == {"not run"}


def test_a_suite_cut_short_is_missed_and_a_skipped_one_not_run(tmp_path: Path) -> None:
    """Without steps.tsv (a check before session 19): a suite's log without pytest's summary
    is missed; one gpu_lib's step skipped for want of time is cut."""
    (tmp_path / "kernels_gpu.log").write_text("........................F....\n")
    (tmp_path / "dataplane_gpu.log").write_text("skipped: 300 s of the bound (290 s)\n")
    (tmp_path / "demo.log").write_text("demo: 3 of 288 results differ\n")
    got = run(tmp_path)
    assert got["GPU tests, tests/kernels"][2] == "missed"
    assert got["GPU tests, tests/dataplane"][2] == "cut"
    assert got["q6serve demo --backend cuda"][2] == "missed"


def steps_tsv(d: Path, *rows: tuple[str, int, str]) -> None:
    """OUT/steps.tsv as gpu_lib.sh's step writes it: name, rc, seconds, limit, how."""
    (d / "steps.tsv").write_text("".join(f"{n}\t{rc}\t12\t60\t{how}\n" for n, rc, how in rows))


def test_a_cut_step_reads_cut_a_failed_one_failed(tmp_path: Path) -> None:
    """steps.tsv says why a figure is missing: the replay cut after S=8 (S=1's single style and
    S=64 cut, S=8 kept), T1 failed, the lm-head skipped by the bound, a suite cut with how far
    it got; a step that never ran (T2/T3's) stays "not run"."""
    steps_tsv(tmp_path, ("t1", 1, "ran"), ("wall", 0, "ran"), ("kernel_ref", 0, "ran"),
              ("replay", 124, "cut"), ("lm_head", 124, "skipped"),
              ("kernels_gpu", 124, "cut"), ("demo", 0, "ran"))
    write(tmp_path, "replay", {"argv": ["--replay", "--replay-seqs", "8,1,64"], "replay": [
        {"seqs": 8, "hosts": 1, "multi": True, "step_p50_ms": 80.0, "floor_step_ms": 40.0,
         "limit_ms": 86.0, "met": True},
        {"seqs": 8, "hosts": 1, "multi": False, "step_p50_ms": 190.0, "floor_step_ms": 70.0,
         "limit_ms": 112.5, "met": False},
        {"seqs": 1, "hosts": 1, "multi": True, "step_p50_ms": 60.0, "floor_step_ms": 20.0,
         "limit_ms": 36.0, "met": False}]})
    (tmp_path / "kernels_gpu.log").write_text(
        "........................................ [ 15%]\n..F.....s...\n")
    (tmp_path / "lm_head.log").write_text("skipped: 441 s of the bound (440 s)\n")
    (tmp_path / "demo.log").write_text("all 288 results match the NumPy reference\n")
    got = run(tmp_path)
    assert got["replay S=8 step p50, multi / single (the target)"][2] == "**met** / missed"
    assert got["replay S=1 step p50, multi / single"][0].startswith("multi 60.00 ms")
    assert got["replay S=1 step p50, multi / single"][2] == "missed; single cut"
    assert got["replay S=64 step p50, multi / single"][2] == "cut"
    assert got["T1, p50 - kernel (N=1 f16 ffn_down, stream)"][2] == "failed (rc 1)"
    assert got["host wall (staged) - kernel, N=1"][2] == "no figure"  # ran well, no JSON
    assert got["lm-head N=64 x8 top-64: p50, reply smaller than f32 logits"][2] == "cut"
    assert got["T2 / T3 (data plane)"][2] == "not run"
    assert got["GPU tests, tests/kernels"] == ["cut after 50 passed, 1 failed", "all pass",
                                               "cut"]
    assert got["q6serve demo --backend cuda"][2] == "**met**"
    assert got["GPU tests, tests/dataplane"][2] == "not run"


def test_a_cut_replay_names_only_the_s_it_was_asked_for(tmp_path: Path) -> None:
    """A replay asked for S=8,64 and cut: S=64 reads cut, S=1 (never asked) not run."""
    steps_tsv(tmp_path, ("replay", 124, "cut"))
    write(tmp_path, "replay", {"argv": ["--replay", "--replay-seqs", "8,64"], "replay": [
        {"seqs": 8, "hosts": 1, "multi": True, "step_p50_ms": 96.3, "floor_step_ms": 47.3,
         "limit_ms": 76.0, "met": False}]})
    got = run(tmp_path)
    assert got["replay S=64 step p50, multi / single"][2] == "cut"
    assert got["replay S=1 step p50, multi / single"][2] == "not run"
    assert got["replay S=8 step p50, multi / single (the target)"][2] == "missed; single cut"


def test_t3_through_the_lane_row_per_front_end_count(tmp_path: Path) -> None:
    """LANE=1's T3 shape through the fast lane (OUT/lane, gpu_dataplane_lane.sh's files): one
    row per front-end count from 1 caller a host, met by its fraction against 0.50, named as
    the lane's (not gRPC's); the 2-callers variant is no row; a lane step cut without its
    file reads cut; without a lane step there is no row."""
    lane = tmp_path / "lane"
    lane.mkdir()
    doc = {"frontends": 2, "hosts": 8, "callers": 1, "rows_per_s": 916800.0,
           "kernel_p50_us": 55.58, "kernel_fraction": 0.7962}
    write(lane, "lane_f2_c1_job1_pipe0", doc)
    write(lane, "lane_f1_c1_job1_pipe0", {**doc, "frontends": 1, "rows_per_s": 520000.0,
                                          "kernel_fraction": 0.42})
    write(lane, "lane_f2_c2_job1_pipe0", {**doc, "callers": 2, "kernel_fraction": 0.9})
    got = run(tmp_path)
    name = ("T3 through the fast lane (no gRPC a call), N=64 x8 hosts x1 caller (system "
            "regions, {}), of the kernel alone")
    assert got[name.format("2 front ends")] == [
        "0.80 (916,800 rows/s; kernel p50 55.6 us)", "0.50", "**met**"]
    assert got[name.format("one process")][2] == "missed"
    assert sum(k.startswith("T3 through the fast lane") for k in got) == 2
    for p in lane.iterdir():
        p.unlink()
    steps_tsv(tmp_path, ("lane", 124, "cut"))
    got = run(tmp_path)
    assert got["T3 through the fast lane (no gRPC a call), N=64 x8 hosts x1 caller (system "
               "regions), of the kernel alone"][2] == "cut"
    (tmp_path / "steps.tsv").unlink()
    assert not any(k.startswith("T3 through the fast lane") for k in run(tmp_path))


def test_the_stretch_rows_over_the_socket_and_the_ring(tmp_path: Path) -> None:
    """bench/lane_latency.py --rings: a row per way (socket, ring), each its runs' median p50 -
    kernel against 50 us; a single lane run (no --rings) stays one row."""
    res = {f"lane sock #{i}": {"p50_minus_kernel_us": v} for i, v in enumerate((55, 60, 58), 1)}
    res |= {f"lane ring #{i}": {"p50_minus_kernel_us": v} for i, v in enumerate((45, 49, 52), 1)}
    res["rings_p50_minus_kernel_us"] = {"sock": 58.0, "ring": 49.0}
    write(tmp_path, "lane_latency", {"results": res})
    got = {k: v for k, v in run(tmp_path).items() if k.startswith("stretch")}
    assert got == {
        "stretch: one caller N=1 ffn_down on the lane over its socket, p50 - kernel "
        "(median of 3 runs)": ["58.0 us", "50 us", "missed"],
        "stretch: one caller N=1 ffn_down on the lane over its shared-memory ring (the default), "
        "p50 - kernel (median of 3 runs)": ["49.0 us", "50 us", "**met**"]}
    write(tmp_path, "lane_latency", {"results": {"lane": {"p50_minus_kernel_us": 51.5}}})
    got = {k: v for k, v in run(tmp_path).items() if k.startswith("stretch")}
    assert got == {"stretch: one caller N=1 ffn_down on the lane, p50 - kernel":
                   ["51.5 us", "50 us", "missed"]}


def test_the_awake_replay_has_rows_only_where_it_ran(tmp_path: Path) -> None:
    """The replay on a --keep-cpus-awake worker (AWAKE_REPLAY=1): rows of its own, named, only
    for the S it was asked for; none at all when it was not asked."""
    replay = {"argv": ["--replay", "--replay-seqs", "8,1"], "replay": [
        {"seqs": 8, "hosts": 1, "multi": True, "step_p50_ms": 60.0, "floor_step_ms": 20.0,
         "limit_ms": 30.0, "met": False}]}
    write(tmp_path, "replay", replay)
    steps_tsv(tmp_path, ("replay", 0, "ok"))
    assert not [k for k in run(tmp_path) if "keep-cpus-awake" in k]
    write(tmp_path, "replay_awake", replay)
    steps_tsv(tmp_path, ("replay", 0, "ok"), ("replay_awake", 124, "cut"))
    got = {k: v for k, v in run(tmp_path).items() if "keep-cpus-awake" in k}
    assert set(got) == {
        "replay S=8 step p50, multi / single (the target), the worker with --keep-cpus-awake",
        "replay S=1 step p50, multi / single, the worker with --keep-cpus-awake"}
    assert got["replay S=1 step p50, multi / single, the worker with --keep-cpus-awake"][2] \
        == "cut"
    assert got["replay S=8 step p50, multi / single (the target), the worker with "
               "--keep-cpus-awake"][0].startswith("multi 60.00 ms")
