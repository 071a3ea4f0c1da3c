"""The CUDA dispatch (kernels/cuda/dispatch.py): table format, lookup, fallbacks. No device."""

from __future__ import annotations

import json
import re

import pytest

from q6serve.kernels.api import KernelFlags, Precision
from q6serve.kernels.cuda.dispatch import (
    BUCKETS,
    COLUMNS,
    KERNELS,
    KSLICE_WEIGHT,
    Cfg,
    Dispatch,
    DispatchTable,
    Entry,
    big_weight_cfg,
    bucket,
    default_cfg,
    heuristic_path,
    load_default_table,
)
from q6serve.kernels.errors import DeviceError, FailedPrecondition, FormatError

SOA, OFF = KernelFlags(), KernelFlags(decode_mmq=False)


def small_table() -> DispatchTable:
    """Two shapes, every bucket and column, with choices the heuristics would not make."""
    entries = []
    for rows, k in ((4096, 14336), (512, 3584)):
        for n in BUCKETS:
            entries += [
                Entry(rows, k, n, "auto", "exact", Cfg(nt=2), 10.0),
                Entry(rows, k, n, "exact", "exact", Cfg(nt=1, pf=True), 11.0),
                Entry(rows, k, n, "f16", "cublas_f16", None, 12.0),
                Entry(rows, k, n, "q8_1", "mmq_q8_1", Cfg(nt=4), 13.0),
            ]
    entries.append(Entry(4096, 14336, 16, "auto", "mma_f16", Cfg(nt=2, src=3, warps=4), 9.0))
    entries.append(Entry(4096, 14336, 32, "auto", "mma_f16", Cfg(nt=4, src=3, ksplit=2), 9.0))
    return DispatchTable(entries, {"device": "test"})


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 256)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 32, 64, 64, 64, 64]


def test_table_answers_for_its_shapes_and_buckets():
    d = Dispatch(small_table(), 132)
    c = d.choose(9, Precision.AUTO, SOA, 4096, 14336)  # bucket 16: its own entry
    assert (c.path, c.precision, c.cfg, c.source) == (
        "mma_f16", Precision.F16, Cfg(nt=2, src=3, warps=4), "table")
    c = d.choose(3, Precision.AUTO, SOA, 4096, 14336)
    assert (c.path, c.precision, c.cfg) == ("exact", Precision.EXACT, Cfg(nt=2))
    assert d.choose(5, Precision.F16, SOA, 512, 3584).path == "cublas_f16"
    assert d.choose(200, Precision.Q8_1, SOA, 512, 3584).cfg == Cfg(nt=4)  # bucket 64's
    assert d.choose(1, Precision.EXACT, SOA, 512, 3584).cfg == Cfg(nt=1, pf=True)


def test_nearest_shape_then_heuristics():
    d = Dispatch(small_table(), 132)
    near = d.choose(8, Precision.AUTO, SOA, 4096, 12288)  # within 2x size, same aspect class
    assert near.source == "table~4096x14336" and near.cfg == Cfg(nt=2)
    assert d.choose(8, Precision.AUTO, SOA, 640, 3584).source == "table~512x3584"
    # a fixed K split holds for the measured K only: elsewhere the occupancy model decides
    assert d.choose(32, Precision.AUTO, SOA, 4096, 14336).cfg.ksplit == 2
    assert d.choose(32, Precision.AUTO, SOA, 4096, 12288).cfg == Cfg(nt=4, src=3)
    far = d.choose(16, Precision.AUTO, SOA, 152064, 3584)  # 40x larger: no table shape is near
    assert far.source == "heuristic"
    assert (far.path, far.cfg) == ("mma_f16", default_cfg("mma_f16", 16, 152064, 132))
    tall = d.choose(8, Precision.AUTO, SOA, 14336, 4096)  # same size, aspect 12x off
    assert tall.source == "heuristic"
    unknown = d.choose(8, Precision.AUTO, SOA)  # no shape given: the heuristics
    assert unknown.source == "heuristic" and unknown.path == "mma_f16"


def test_large_weights_outside_the_table_take_the_k_slice_tile_at_n_le_8():
    """The rule for N <= 8 on weights of >= KSLICE_WEIGHT elements without a cell of their own
    (H200: src 2 1.1-1.5x slower there, docs/KERNELS.md sessions 17-18): the K-slice tile,
    whether the heuristics or a nearer, smaller shape's src 2 cell would answer."""
    ks = Cfg(nt=1, src=4, pf=True)
    assert KSLICE_WEIGHT >= 1 << 26  # above every model shape of the table but the lm-heads
    d = Dispatch(small_table(), 132)
    for n in (1, 2, 3, 5, 8):
        for p in (Precision.AUTO, Precision.F16):
            c = d.choose(n, p, SOA, 16384, 14336)  # 2.3e8, far from both table shapes
            assert (c.path, c.cfg, c.source) == ("mma_f16", ks, "heuristic")
        # just below the threshold: the heuristic's src 2 stays
        rows = (KSLICE_WEIGHT - 1) // 8192
        assert d.choose(n, Precision.AUTO, SOA, rows, 8192).cfg == Cfg(nt=1)
        assert d.choose(n, Precision.AUTO, SOA, rows + 1, 8192).cfg == ks
    # N > 8 and the other columns keep their answers
    assert d.choose(9, Precision.AUTO, SOA, 16384, 14336).cfg == default_cfg(
        "mma_f16", 9, 16384, 132)
    assert d.choose(1, Precision.EXACT, SOA, 16384, 14336).path == "exact"
    assert d.choose(1, Precision.Q8_1, SOA, 16384, 14336).cfg == default_cfg("mmq_q8_1", 1)
    # a nearest-shape src 2 cell on a large weight becomes the K-slice tile (the committed
    # table: 32768x4096 is answered by 18944x3584, whose N = 1 cell is src 2 at 4 warps)
    real = Dispatch(load_default_table(), 132)
    near = real.choose(1, Precision.AUTO, SOA, 18944, 3584)
    assert near.source == "table" and near.cfg.src == 2
    big = real.choose(1, Precision.AUTO, SOA, 32768, 4096)
    assert big.source == "table~18944x3584" and big.cfg == ks
    # a table shape keeps its own cells; other launch shapes pass through
    assert real.choose(1, Precision.AUTO, SOA, 18944, 3584).cfg == near.cfg
    for cfg in (Cfg(nt=1, src=4, pf=True, warps=16), Cfg(nt=1, src=7, pf=True, ksplit=2)):
        assert big_weight_cfg(cfg, 1, 32768, 8192) == cfg
    assert big_weight_cfg(Cfg(nt=2), 16, 32768, 8192) == Cfg(nt=2)


def test_above_the_tile_range_and_the_kill_switch_ignore_the_table():
    d = Dispatch(small_table(), 132)
    assert d.choose(300, Precision.AUTO, SOA, 4096, 14336).path == "cublas_f16"
    assert d.choose(300, Precision.EXACT, SOA, 4096, 14336).source == "table"
    for n in (1, 8, 16, 64):
        c = d.choose(n, Precision.AUTO, OFF, 4096, 14336)
        assert c.source == "flags"
        assert (c.path, c.precision) == heuristic_path(n, Precision.AUTO, OFF, 4096, 14336)
    with pytest.raises(FailedPrecondition, match="q8_1"):
        d.choose(1, Precision.Q8_1, OFF, 4096, 14336)


def test_no_table_is_the_heuristics():
    d = Dispatch(None, 132)
    for n in (1, 8, 16, 64, 300):
        for p in (Precision.AUTO, Precision.EXACT, Precision.F16, Precision.Q8_1):
            c = d.choose(n, p, SOA, 4096, 14336)
            assert (c.path, c.precision) == heuristic_path(n, p, SOA, 4096, 14336)
            assert c.source == "heuristic" and c.precision is not Precision.AUTO


def test_table_round_trips_through_its_file(tmp_path):
    t = small_table()
    f = tmp_path / "t.json"
    t.dump(f)
    back = DispatchTable.load(f)
    assert back.to_json() == t.to_json() and back.meta["device"] == "test"
    assert back.shapes == [(512, 3584), (4096, 14336)]


@pytest.mark.parametrize("bad, match", [
    ({"column": "fast"}, "column"),
    ({"path": "mmq_q8_1"}, "not a kernel of column"),
    ({"path": "warp_magic"}, "not a kernel of column"),
    ({"n": 3}, "bucket"),
    ({"k": 1000}, "K=1000"),
    ({"cfg": {"nt": 16}}, "launch shape"),
    ({"cfg": {"nt": 1, "lanes": 3}}, "unknown launch-shape fields"),
    ({"cfg": None}, "need cfg"),
    ({"rows": "many"}, "bad dispatch entry"),
])
def test_bad_tables_are_refused_with_the_reason(tmp_path, bad, match):
    good = {"rows": 4096, "k": 4096, "n": 8, "column": "auto", "path": "mma_f16",
            "cfg": {"nt": 1}, "us": 1.0}
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"format": 1, "entries": [{**good, **bad}]}))
    with pytest.raises(FormatError, match=match):
        DispatchTable.load(f)
    f.write_text(json.dumps({"entries": [good]}))
    with pytest.raises(FormatError, match="format-1"):
        DispatchTable.load(f)


def test_columns_name_real_kernels_of_their_precision():
    for column, paths in COLUMNS.items():
        for p in paths:
            assert p in KERNELS
            if column != "auto":
                assert KERNELS[p].value == column


# -- the committed table (kernels/cuda/dispatch_h200.json) ------------------------------------
QWEN = ((3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (152064, 3584))
LLAMA = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096))


def committed():
    from q6serve.kernels.cuda.dispatch import DEFAULT_TABLE, load_default_table

    table = load_default_table()
    assert table is not None, f"{DEFAULT_TABLE} is missing"
    return table


def test_committed_table_covers_every_model_shape_bucket_and_column():
    table = committed()
    for rows, k in QWEN + LLAMA:
        for n in BUCKETS:
            for column in COLUMNS:
                hit = table.lookup(rows, k, n, column)
                assert hit is not None and hit[1] == "table", (rows, k, n, column)
    assert {"device", "date", "commit", "command"} <= set(table.meta)


def _deviceless_launcher(names: list):
    """A Launcher of a 132-SM sm_90 device without one: each kernel lookup appends its name
    and returns a stand-in function that carries it (``.name``)."""
    from types import SimpleNamespace

    from q6serve.kernels.cuda.launch import Launcher

    def fn(file: str, name: str) -> SimpleNamespace:
        names.append(name)
        return SimpleNamespace(name=name, num_regs=128, max_dynamic_shared_size_bytes=48 << 10)

    return Launcher(SimpleNamespace(sm_count=132, smem_sm=233472, cc="90", fn=fn))


def test_every_committed_entry_names_a_real_kernel_and_launch_shape():
    """Path of its column; a launch shape the templates have that plans on a 132-SM device
    (the nvcc test compiles the instantiations it names: requested_kernels() includes them)."""
    from q6serve.kernels.api import Layout
    from q6serve.kernels.cuda.launch import IN_TYPES, kernel_name

    names = []
    lc = _deviceless_launcher(names)
    table = committed()
    for cells in table.cells.values():
        for e in cells.values():
            assert e.path in KERNELS and e.path in COLUMNS[e.column] and e.us > 0
            if e.cfg is None:
                assert e.path == "cublas_f16"
                continue
            for in_t in IN_TYPES.values():
                lp = lc.plan(e.rows, e.k, Layout.SOA, in_t, e.path, e.cfg, e.n)
                assert lp.grid[0] >= 1 and lp.ks == lp.grid[1] >= 1
                assert kernel_name(e.path, e.cfg, True, in_t) in names


def test_backend_dispatch_reads_the_committed_table():
    d = Dispatch(committed(), 132)
    for rows, k in QWEN + LLAMA:
        c = d.choose(1, Precision.AUTO, SOA, rows, k)
        assert c.source == "table" and c.precision is not Precision.AUTO
    assert d.choose(1, Precision.AUTO, SOA, 1000, 100_000).source == "heuristic"


def test_forced_k_split_past_the_shared_memory_is_refused():
    """Device-less: a launch shape with a fixed K split whose staged activations exceed a CTA's
    shared memory (the tune's nt1.k1 on K=18944: 303 KB) is a DeviceError at plan time, not a
    CUDA launch error."""
    from types import SimpleNamespace

    from q6serve.kernels.api import Layout
    from q6serve.kernels.cuda.launch import Launcher

    class Fn:
        num_regs = 96
        max_dynamic_shared_size_bytes = 48 << 10

    lc = Launcher(SimpleNamespace(sm_count=132, smem_sm=233472, cc="90", fn=lambda f, n: Fn()))
    with pytest.raises(DeviceError, match="no K split fits"):
        lc.plan(3584, 18944, Layout.SOA, "InF16", "mma_f16", Cfg(nt=1, ksplit=1), 8)
    lp = lc.plan(3584, 18944, Layout.SOA, "InF16", "mma_f16", Cfg(nt=1, ksplit=4), 8)
    assert lp.ks == 4 and lp.smem <= 227 << 10


def test_wgmma_tile_plans_only_on_sm_90():
    """Device-less: the wgmma tile (src 8) plans on compute capability 9.0 from its own file;
    on 8.9 (no sm_90a) a table entry naming it plans the K-slice tile of the same width."""
    from types import SimpleNamespace

    from q6serve.kernels.api import Layout
    from q6serve.kernels.cuda.launch import WG_FILE, Launcher
    class Fn:
        num_regs = 168
        max_dynamic_shared_size_bytes = 48 << 10

    cfg = Cfg(nt=8, src=8, pf=True)
    asked = []
    lc = Launcher(SimpleNamespace(sm_count=132, smem_sm=233472, cc="90",
                                  fn=lambda f, n: asked.append((f, n)) or Fn()))
    lp = lc.plan(4096, 14336, Layout.AOS, "InF16", "mma_f16", cfg, 64)
    assert lp.ks == lp.grid[1] >= 1 and lp.smem <= 227 << 10
    assert (WG_FILE, "q6k_wg_f16<8, false, InF16, 2>") in asked
    assert (WG_FILE, "q6k_wg_f16<8, true, InF16, 2>") in asked
    # its 32-token form (session 21): 16 KB of activations per K block, so fewer K slices
    lp4 = lc.plan(4096, 14336, Layout.AOS, "InF16", "mma_f16", Cfg(nt=4, src=8, pf=True,
                                                                    warps=12), 32)
    assert (WG_FILE, "q6k_wg_f16<4, false, InF16, 3>") in asked
    assert lp4.smem == 4 * 8 * 512 * -(-56 // lp4.ks) and lp4.ks <= lp.ks
    asked.clear()
    lc89 = Launcher(SimpleNamespace(sm_count=128, smem_sm=102400, cc="89",
                                    fn=lambda f, n: asked.append((f, n)) or Fn()))
    lc89.plan(4096, 4096, Layout.SOA, "InF16", "mma_f16", Cfg(nt=8, src=8, pf=True, warps=12,
                                                              ksplit=3), 64)
    assert asked and all(f != WG_FILE and n.startswith(("q6k_ks_f16<8, 1,", "q6k_sum_parts"))
                         for f, n in asked)
    # the wgmma tile has 8 or 4 n-tiles and two wgmma groups in flight (pf), the f16 tile's src
    # 3 no register prefetch (sessions 15 / 21: the variants the dispatch never picked left the
    # kernels: src 6 and 9, src 8 without pf, then the ring tile src 5: two of its former launch
    # shapes, the lm-head's and a 3-stage one); src 2's pf (session 17: the first block early)
    # at one m-tile only
    for bad in (Cfg(nt=1, src=8, pf=True), Cfg(nt=8, src=8), Cfg(nt=8, mt=2, src=8, pf=True),
                Cfg(nt=2, src=8, pf=True), Cfg(nt=4, src=8, warps=12),
                Cfg(nt=8, src=8, pf=True, warps=16), Cfg(nt=8, src=4, pf=True, warps=16),
                Cfg(nt=8, src=6, pf=True, warps=12), Cfg(nt=8, src=9, pf=True, warps=12),
                Cfg(nt=1, mt=2, pf=True), Cfg(nt=2, src=3, pf=True),
                Cfg(nt=8, src=3, pf=True, warps=4),
                Cfg(nt=2, mt=2, src=4, pf=True, warps=12), Cfg(nt=4, src=5, warps=16),
                Cfg(nt=2, src=5, pf=True, warps=8)):
        with pytest.raises(FormatError):
            bad.check("mma_f16")


def test_pair_stream_weights_plan_layout_two_on_the_soa_grid():
    """Device-less: a pair-stream weight (CudaWeight.pairs) gets the layout-2 instantiation of
    the same launch shape on the SoA twin's grid (so its results are the SoA weight's), the
    wgmma tile's 4 n-tiles included; the f16 tile's two m-tiles per warp run as one m-tile with
    twice the warps (the same rows per CTA: launch.pair_cfg), never its two-m-tile pair decode
    (minutes to compile)."""
    from q6serve.kernels.api import Layout

    asked = []
    lc = _deviceless_launcher(asked)
    for path, cfg, n, pair_name in (
            ("mma_f16", Cfg(nt=2, src=4, pf=True, warps=16), 16,
             "q6k_ks_f16<2, 1, 2, InF16, true, 16>"),
            ("mma_f16", Cfg(nt=1), 1, "q6k_mma_f16<1, 1, 2, 2, InF16, false>"),
            ("mma_f16", Cfg(nt=1, pf=True), 1, "q6k_mma_f16<1, 1, 2, 2, InF16, true>"),
            ("exact", Cfg(nt=1, pf=True), 4, "q6k_exact<1, 2, InF16, true>"),
            ("mmq_q8_1", Cfg(nt=2), 16, "q6k_mmq_q8<2, 1, 2>"),
            ("mma_f16", Cfg(nt=8, src=8, pf=True), 64, "q6k_wg_f16<8, 2, InF16, 2>"),
            ("mma_f16", Cfg(nt=4, src=8, pf=True, warps=12), 32, "q6k_wg_f16<4, 2, InF16, 3>"),
            ("mma_f16", Cfg(nt=4, mt=2, src=3, warps=4), 32,
             "q6k_mma_f16<4, 1, 2, 3, InF16, false>"),
            ("mma_f16", Cfg(nt=2, mt=2, src=4, pf=True), 16,
             "q6k_ks_f16<2, 2, 2, InF16, true, 8>"),
            ("mma_f16", Cfg(nt=1, mt=2), 4, "q6k_mma_f16<1, 1, 2, 2, InF16, false>")):
        for rows, k in ((4096, 14336), (152064, 3584)):
            asked.clear()
            soa = lc.plan(rows, k, Layout.SOA, "InF16", path, cfg, n)
            soa_asked = list(asked)
            asked.clear()
            pairs = lc.plan(rows, k, Layout.SOA, "InF16", path, cfg, n, True)
            assert pair_name in asked, (pair_name, asked)
            assert not any(re.match(r"q6k_mma_f16<\d+, 2, 2,", a) for a in asked), asked
            assert pairs.smem == soa.smem and pairs.grid[1:] == soa.grid[1:], (cfg, rows)
            if cfg.mt == 1 or cfg.src == 4:
                assert pairs.grid == soa.grid and pairs.threads == soa.threads
            elif cfg.warps * cfg.mt <= 8:  # one m-tile per warp, twice the warps
                assert pairs.grid == soa.grid and pairs.threads == 2 * soa.threads
            else:  # one m-tile per warp, twice the CTAs along rows
                assert pairs.threads == soa.threads and pairs.grid[0] == -(-rows // 128)
                assert soa.grid[0] == -(-rows // 256)
            assert soa_asked[0] != pair_name


def test_row_chunks_of_a_pair_stream_weight_run_its_kernel():
    """Device-less: the row chunks of a K-slice call (Q6SERVE_Y_CHUNKS) on a pair-stream weight
    plan the pair-stream kernel the full call runs, never its plain-SoA twin."""
    from q6serve.kernels.api import Layout

    lc = _deviceless_launcher([])
    cfg = Cfg(nt=8, src=4, pf=True)
    for pairs in (True, False):
        full = lc.plan(14336, 4096, Layout.SOA, "InF16", "mma_f16", cfg, 64, pairs)
        chunks = lc.row_chunks(full, 14336, 4096, Layout.SOA, "InF16", "mma_f16", cfg, 64, 512,
                               4, pairs)
        assert chunks is not None and len(chunks) >= 2
        assert (", 2, " in full.fn.name) is pairs, full.fn.name
        assert all(p.fn.name == full.fn.name for _, _, p in chunks)


def test_cluster_sum_tile_plans_its_k_split_or_refuses():
    """Device-less: src 7 (q6k_ksc_f16, session 15's experiment) is src 4 with the split-K sum
    inside a cluster of exactly ``ksplit`` K slices: its name carries the cluster size, it has
    no q6k_sum_parts launch, a K that cuts into another slice count is refused, and before
    sm_90 it plans src 4 at the same split."""
    from types import SimpleNamespace

    from q6serve.kernels.api import Layout
    from q6serve.kernels.cuda.launch import Launcher

    asked = []
    lc = _deviceless_launcher(asked)
    lp = lc.plan(4096, 14336, Layout.SOA, "InF16", "mma_f16",
                 Cfg(nt=2, src=7, pf=True, warps=16, ksplit=8), 16, True)
    assert lp.grid[1] == 8 and lp.post is None
    assert "q6k_ksc_f16<2, 1, 2, InF16, true, 16, 8>" in asked
    with pytest.raises(DeviceError, match="not 7"):  # 8 blocks: 4 slices of 2
        lc.plan(300, 2048, Layout.SOA, "InF16", "mma_f16", Cfg(nt=1, src=7, pf=True,
                                                               ksplit=7), 8)
    asked.clear()
    lc89 = Launcher(SimpleNamespace(sm_count=128, smem_sm=102400, cc="89", fn=lambda f, n: (
        asked.append(n) or SimpleNamespace(num_regs=128, max_dynamic_shared_size_bytes=0))))
    lp = lc89.plan(4096, 14336, Layout.SOA, "InF16", "mma_f16",
                   Cfg(nt=2, src=7, pf=True, warps=16, ksplit=8), 16)
    assert lp.grid[1] == 8 and lp.post is not None and not any("ksc" in n for n in asked)
    for bad in (Cfg(nt=2, src=7, pf=True), Cfg(nt=2, src=7, ksplit=9),
                Cfg(nt=2, mt=2, src=7, ksplit=2), Cfg(nt=8, src=7, warps=16, ksplit=2)):
        with pytest.raises(FormatError):
            bad.check("mma_f16")


def test_the_k_slice_tiles_have_one_shape_family():
    """Session 30 (issue 16 item 2): the K-slice tiles (src 4 / 7) take one m-tile a warp and
    the register prefetch, at 12 warps up to 4 n-tiles and at 16 up to 2: session 14's shapes
    without the prefetch (nt 8 at 12 warps, nt 4 at 16) and 2 m-tiles a warp left, as no table
    cell or heuristic picked them; their tune candidates went with them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"
    spec = importlib.util.spec_from_file_location("_bench_kernels", path)
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    for good in (Cfg(nt=8, src=4, pf=True), Cfg(nt=4, src=4, pf=True, warps=12),
                 Cfg(nt=2, src=4, pf=True, warps=16), Cfg(nt=2, src=7, pf=True, warps=16,
                                                          ksplit=2)):
        good.check("mma_f16")
    for bad in (Cfg(nt=8, src=4, warps=12), Cfg(nt=4, src=4, warps=16), Cfg(nt=1, src=4),
                Cfg(nt=8, src=4, pf=True, warps=12), Cfg(nt=4, src=4, pf=True, warps=16),
                Cfg(nt=2, mt=2, src=4, pf=True), Cfg(nt=1, src=7, ksplit=2)):
        with pytest.raises(FormatError):
            bad.check("mma_f16")
    for n in (16, 32, 64):
        for p, cfg in bk.tune_candidates(n, 14336, 4096, 132, wg=True):
            if cfg is not None:
                cfg.check(p)


def test_cluster_sum_cells_of_the_table():
    """The committed table's src 7 cells (session 15: 14336x4096 and 3584x3584 at N = 8/16)
    name the K split the grid model gives src 4 there on the H200 (the measured, bit-identical
    pair); a shape near one of them, whose K differs, gets the plain K-slice tile with its
    split re-derived; without a device every cluster fits (clusters_fit)."""
    from types import SimpleNamespace

    from q6serve.kernels.cuda.launch import clusters_fit

    d = Dispatch(committed(), 132)
    for rows, k, n, ks in ((14336, 4096, 8, 2), (14336, 4096, 16, 2), (3584, 3584, 8, 7),
                           (3584, 3584, 16, 7)):
        for prec in (Precision.AUTO, Precision.F16):
            c = d.choose(n, prec, SOA, rows, k)
            assert (c.cfg.src, c.cfg.ksplit, c.source) == (7, ks, "table"), (rows, k, n, c)
    near = d.choose(16, Precision.AUTO, SOA, 3584, 3072)  # 3584x3584's neighbour
    assert near.source == "table~3584x3584" and (near.cfg.src, near.cfg.ksplit) == (4, 0)
    assert clusters_fit(SimpleNamespace(num_regs=128), (16, 8, 1), 512, 0, 16)


def test_wgmma_cells_of_the_two_slab_weights():
    """Session 25: the committed table gives 18944x3584 at N = 33..64 (auto, f16) to the wgmma
    tile at K split 5 (bundle A: 41.2 us against the K-slice tile's 46.3, its staged wall in 2
    row chunks 1.004 / 1.082 of src 4's at N = 64 / 48) and 14336x4096 to the wgmma tile of 8
    warps at K split 4 (bundle C: 38.1 us against the K-slice tile's 41.4), N = 32 stays the
    K-slice tile's; device-less, each weight's two slabs (storage.two_slabs) are its row chunks,
    each on the whole call's grid (the same rounds) for the wgmma tile at these K splits, so a
    large y can go down by chunks; 18944x3584 at K split 4 (33 CTAs x 3 rounds) has none."""
    from q6serve.kernels.api import Layout
    from q6serve.kernels.cuda import storage

    d = Dispatch(committed(), 132)
    lc = _deviceless_launcher([])
    for prec in (Precision.AUTO, Precision.F16):
        for n in (33, 48, 64):
            c = d.choose(n, prec, SOA, 18944, 3584)
            assert (c.cfg, c.source) == (Cfg(nt=8, warps=12, src=8, pf=True, ksplit=5),
                                         "table"), (n, c)
            c = d.choose(n, prec, SOA, 14336, 4096)
            assert (c.cfg, c.source) == (Cfg(nt=8, warps=8, src=8, pf=True, ksplit=4),
                                         "table"), (n, c)
        assert d.choose(32, prec, SOA, 18944, 3584).cfg.src == 4
    cfg = Cfg(nt=8, warps=12, src=8, pf=True, ksplit=4)
    full = lc.plan(18944, 3584, Layout.SOA, "InF16", "mma_f16", cfg, 64, True)
    assert full.grid == (33, 4, 1) and lc.row_chunks(
        full, 18944, 3584, Layout.SOA, "InF16", "mma_f16", cfg, 64, 9472, 2, True) is None
    for rows, k, ks, gx, wp in ((14336, 4096, 6, 19, 12), (18944, 3584, 5, 25, 12),
                                (14336, 4096, 4, 28, 8)):
        assert storage.two_slabs(rows, k)
        cfg = Cfg(nt=8, warps=wp, src=8, pf=True, ksplit=ks)
        full = lc.plan(rows, k, Layout.SOA, "InF16", "mma_f16", cfg, 64, True)
        assert full.grid == (gx, ks, 1)
        chunks = lc.row_chunks(full, rows, k, Layout.SOA, "InF16", "mma_f16", cfg, 64, rows // 2,
                               2, True)
        assert [(r0, r1) for r0, r1, _ in chunks] == [(0, rows // 2), (rows // 2, rows)]
        assert all((p.grid, p.smem, p.fn.name) == (full.grid, full.smem, full.fn.name)
                   for _, _, p in chunks)
