"""bench/layer_wall.py on the fake CUDA device (tests/kernels/test_cuda_backend_host.py): every
variant's rounds give a row per call role, the multi-weight calls go the variant's way (parts
each their own launch, or one launch_many), a variant's launch constants hold for its rounds
only, and the bound stops it early."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lw(monkeypatch):
    """layer_wall with the fake device's backend and weights (no blocks made)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import backend_wall
    import layer_wall

    import q6serve.kernels.cuda_backend as cb
    from q6serve.kernels.cuda import launch as launch_mod
    from tests.kernels.test_cuda_backend_host import fake_backend, fake_weight

    be, cp = fake_backend(monkeypatch)
    be.device_name = lambda: "fake"
    # the diagnostic ways' empty kernel (layer_wall.Poke): counted where it runs
    cp.RawKernel = lambda src, name: (
        lambda grid, block, args, stream=None: cp.op(lambda: cp.count(name)))
    calls = {"many": 0, "single": 0, "y16": [], "dma": []}
    many, single = type(be).launch_many, type(be).launch

    def launch_many(self, *a, **k):
        calls["many"] += 1
        calls["y16"].append(launch_mod.Y16_COPY)
        calls["dma"].append(bool(layer_wall.DMA))
        return many(self, *a, **k)

    def launch(self, *a, **k):
        calls["single"] += 1
        return single(self, *a, **k)

    monkeypatch.setattr(type(be), "launch_many", launch_many)
    monkeypatch.setattr(type(be), "launch", launch)
    monkeypatch.setattr(cb, "CudaBackend", lambda device: be)
    monkeypatch.setattr(backend_wall, "load", lambda be_, blocks, r, k: fake_weight(be_, r, k))
    monkeypatch.setattr(layer_wall.q6k, "random_blocks", lambda r, k, rng: None)
    calls["cp"] = cp
    return layer_wall, calls, launch_mod


@pytest.mark.parametrize("way,kernel", [("on+g", True), ("on+G", True), ("on+k", True),
                                        ("on+e", False), ("on+w", False)])
def test_poke_ways(lw, way, kernel):
    """The diagnostic ways make their one driver call after (on+G: inside) each multi-weight
    call; the empty kernel runs once more when made (its graph's capture runs nothing), an
    event's record runs none."""
    layer_wall, calls, _ = lw
    cp = calls["cp"]
    layer_wall.main(["--seqs", "1", "--steps", "1", "--rounds", "1", "--gap-us", "0",
                     "--layers", "2", "--variants", way])
    # warm-up: 3 + 1 steps, the round: 2 + 1 steps: 7 steps x 4 multi-weight calls
    per_step = 4
    assert cp.counts.get("q6_lw_nop", 0) == (7 * per_step if kernel else 0) + 1
    assert calls["many"] == 7 * per_step


def test_rows_per_variant_and_role(lw, tmp_path, capsys):
    layer_wall, calls, launch_mod = lw
    out = tmp_path / "lw.json"
    before = launch_mod.Y16_COPY
    other = f"on:Y16_COPY={1 - before}"  # (the default's other value)
    rc = layer_wall.main(["--seqs", "1", "--steps", "3", "--rounds", "2", "--gap-us", "0,20",
                          "--layers", "2", "--variants", f"off,on,{other}",
                          "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["equal"] is True
    rows = doc["rows"]
    roles = {"q+k+v", "o", "gate+up", "down"}
    for v in ("off", "on", other):
        for g in (0.0, 20.0):
            got = [r for r in rows if r["variant"] == v and r["gap_us"] == g]
            assert {r["role"] for r in got} == roles and len(got) == 2 * len(roles)
    singles = [r for r in rows if r["role"] in ("o", "down")]
    assert all(np.isfinite(r["gpu_pre"]) and np.isfinite(r["gpu_tail"]) for r in singles)
    # the singles' launch split by the stamps on their cached calls (also after a rebind)
    assert all(0 < r["to_graph"] < r["launch"] and r["graph"] > 0 and r["record"] > 0
               for r in singles)
    assert all(not np.isfinite(r["gpu_pre"]) for r in rows if r["role"] == "q+k+v")
    assert all(r["kernel"] > 0 and r["wall"] > 0 for r in rows)
    # the launch_many calls: "on" variants only, Y16_COPY set only in its variant's rounds
    assert calls["many"] > 0 and set(calls["y16"]) == {0, 1}
    assert before == launch_mod.Y16_COPY  # (restored)
    text = capsys.readouterr().out
    assert "S=1 gap 0" in text and other in text


def test_off_runs_parts_as_single_calls(lw):
    layer_wall, calls, _ = lw
    layer_wall.main(["--seqs", "1", "--steps", "2", "--rounds", "1", "--gap-us", "0",
                     "--variants", "off"])
    assert calls["many"] == 0 and calls["single"] > 0


def test_bound_stops_after_a_round(lw, tmp_path, capsys):
    layer_wall, _, _ = lw
    out = tmp_path / "lw.json"
    layer_wall.main(["--seqs", "1,8", "--steps", "2", "--rounds", "3", "--gap-us", "0",
                     "--variants", "off,on", "--bound", "1e-9", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["variant"], r["round"], r["seqs"]) for r in rows} == {("off", 0, 1)}
    assert "# bound: stopped" in capsys.readouterr().out


def test_old_fill_variant(lw):
    """OLD_FILL=1 (a bench key): that variant's cached calls fill x by fill_x as before
    launch.stage_into; the module's stage_into is put back after."""
    layer_wall, _, launch_mod = lw
    used = []
    fill_x, stage_into = launch_mod.fill_x, launch_mod.stage_into

    def counted(dst, src):
        used.append(src.nbytes)
        fill_x(dst, src)

    launch_mod.fill_x = counted
    try:
        args = ["--seqs", "1", "--steps", "4", "--rounds", "1", "--gap-us", "0", "--variants"]
        layer_wall.main([*args, "on"])  # (fill_x: only the first, uncached calls')
        on = len(used)
        layer_wall.main([*args, "on:OLD_FILL=1"])
        # the cached calls' too: 4 calls a step x (4 + 2 + 1) steps, less the uncached ones
        assert len(used) - on >= on + 4 * 4
        assert set(used) <= {3584 * 2, 18944 * 2}
    finally:
        launch_mod.fill_x = fill_x
    assert launch_mod.stage_into is stage_into


def test_sleep_gap_and_dma_hold(lw, tmp_path, monkeypatch):
    """A gap ``W+Z`` sleeps Z us before every call (rows keep work and sleep apart); DMA_LAT=1
    holds the QoS file open with a 0 written during that variant's rounds only (the Y16_COPY
    beside it marks them), and lets it go at the end."""
    layer_wall, calls, launch_mod = lw
    qos = tmp_path / "cpu_dma_latency"
    qos.write_bytes(b"")
    monkeypatch.setattr(layer_wall, "DMA_PATH", str(qos))
    slept = []
    monkeypatch.setattr(layer_wall.time, "sleep", lambda s: slept.append(s))
    before = launch_mod.Y16_COPY
    out = tmp_path / "lw.json"
    rc = layer_wall.main(["--seqs", "1", "--steps", "2", "--rounds", "2", "--gap-us", "0+300",
                          "--variants", f"on,on:DMA_LAT=1+Y16_COPY={1 - before}",
                          "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["gap"] == "0+300" and r["gap_us"] == 0 and r["sleep_us"] == 300
                        for r in rows)
    assert slept and set(slept) == {300e-6}
    pairs = set(zip(calls["y16"], calls["dma"], strict=True))
    assert pairs == {(before, False), (1 - before, True)}
    assert qos.read_bytes().startswith(b"\0\0\0\0")
    assert layer_wall.DMA == []  # (let go)


def test_idle_per_variant(lw, monkeypatch):
    """SLEEP_US / SPIN_US: each gap sleeps / polls the empty selector in that variant's rounds
    only (its Y16_COPY marks them), and nothing after the run."""
    layer_wall, _, launch_mod = lw
    seen = []
    monkeypatch.setattr(layer_wall.time, "sleep",
                        lambda s: seen.append(("sleep", s, launch_mod.Y16_COPY)))
    monkeypatch.setattr(layer_wall, "SELECTOR", type("S", (), {"select": staticmethod(
        lambda t: seen.append(("spin", t, launch_mod.Y16_COPY)) or [])})())
    before = launch_mod.Y16_COPY
    rc = layer_wall.main(["--seqs", "1", "--steps", "2", "--rounds", "2", "--gap-us", "0",
                          "--variants", f"on:SLEEP_US=250,on:SPIN_US=40+Y16_COPY={1 - before}"])
    assert rc == 0
    assert {(k, y) for k, _, y in seen} == {("sleep", before), ("spin", 1 - before)}
    assert {s for k, s, _ in seen if k == "sleep"} == {250e-6}
    assert {t for k, t, _ in seen if k == "spin"} == {0}
    assert layer_wall.IDLE == {"SLEEP_US": 0, "SPIN_US": 0}


def test_unknown_variant_refused(lw):
    layer_wall, _, _ = lw
    with pytest.raises(SystemExit):
        layer_wall.main(["--variants", "sideways"])
    with pytest.raises(SystemExit):
        layer_wall.main(["--variants", "on:NO_SUCH_CONSTANT=1"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
