"""Which kernel and launch shape a call gets: the one dispatch of the CUDA backend.

A call is (weight rows, K, N tokens, precision, kill-switch flags). :meth:`Dispatch.choose`
answers with a :class:`Choice` - kernel path, resolved precision, launch shape - from, in order:

1. the kill switches: ``decode_mmq`` off allows no tile kernel (EXACT stays the exact kernel,
   F16/AUTO above 8 tokens go to cuBLAS, Q8_1 is refused);
2. the **measured table** ``dispatch_<device>.json`` beside this file, written by
   ``bench/kernels.py --tune`` (one entry per weight shape, N bucket and precision column: the
   fastest candidate timed on that device); a shape not in it uses its nearest measured shape
   when that one is within 2x in rows*K and 4x in aspect (rows/K);
3. the **heuristics** below (:func:`heuristic_path`, :func:`default_cfg`), measured on three
   shapes, for shapes far from every table entry and N > ``F16_TILE_N``.

N buckets: a call of N tokens takes the entry of the smallest bucket >= N (1, 2, 4, 8, 16,
32, 64); N = 65..``F16_TILE_N`` takes bucket 64's (more token chunks of the same tile). The
choice never depends on the layout, so the SoA and AoS twins run the same grid and sum alike
(bit-identical). Nothing here touches a device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from ..api import KernelFlags, Precision, refuse_q8_1_without_mmq
from ..errors import FormatError

# path -> numerics. Every table entry and every choice names one of these; kernels/cuda/launch.py
# knows how to launch each of them.
KERNELS: dict[str, Precision] = {
    "exact": Precision.EXACT,  # q6k_exact: f32 FMAs on exact weights
    "mma_f16": Precision.F16,  # q6k_mma_f16: f16 tensor cores, f32 accumulation
    "mmq_q8_1": Precision.Q8_1,  # q6k_mmq_q8: q8_1 activations, int8 tensor cores
    "cublas_f16": Precision.F16,  # q6k_dequant_f16 tiles + cublasGemmEx
}
TILE_PATHS = ("exact", "mma_f16", "mmq_q8_1")  # the kernels that take a launch shape (Cfg)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Table columns: the precision asked for. AUTO may resolve to any path whose numerics are at
# least F16's (exact, mma_f16, cublas_f16); the others keep their precision.
COLUMNS: dict[str, tuple[str, ...]] = {
    Precision.AUTO.value: ("exact", "mma_f16", "cublas_f16"),
    Precision.EXACT.value: ("exact",),
    Precision.F16.value: ("mma_f16", "cublas_f16"),
    Precision.Q8_1.value: ("mmq_q8_1",),
}
F16_TILE_N = 256  # above: dequantized f16 tiles + cuBLAS beat re-reading Q6_K per 64 tokens
# Heuristic small weights (rows*K <= SMALL_WEIGHT; measured on 512x3584, bench/RESULTS.md): the
# f16 tile has too few row tiles to fill the GPU, so AUTO runs the exact kernel for N in
# SMALL_EXACT_N and cuBLAS above it (the 48 boundary is interpolated, not measured).
SMALL_WEIGHT = 1 << 21
SMALL_EXACT_N = (8, 48)
# N <= 8 on a weight of >= KSLICE_WEIGHT elements outside the table (far from it, or answered by
# a nearer, smaller shape's cell): the K-slice tile (src 4, 8 warps, register prefetch), not the
# f16 tile src 2. H200, session 18's sweep (docs/KERNELS.md; src 2 / the K-slice tile, same
# process, N = 1..8): 8192x14336 (1.17e8) 1.03-1.15x, 32768x4096, 27648x5120, 5120x27648
# (1.3-1.4e8) 1.04-1.45x, 16384x14336, 28672x8192, 8192x28672, 29568x8192 (2.3-2.4e8) 1.13-1.48x;
# below it mixed: 5120x13824 (7.1e7) 0.94x at N <= 4, 8192x8192 (6.7e7) 0.97x at N = 1,
# 11008x4096 (4.5e7) 0.90x. The threshold sits between the largest loss and the smallest win.
KSLICE_WEIGHT = 100_000_000
NEAR_SIZE = 1.0  # log2: the nearest table shape counts within 2x of rows*K ...
NEAR_ASPECT = 2.0  # ... and 4x of rows/K
TABLE_DIR = Path(__file__).resolve().parent
DEFAULT_TABLE = TABLE_DIR / "dispatch_h200.json"


@dataclass(frozen=True)
class Cfg:
    """Launch shape of one tile kernel (the table and the bench name them)."""

    nt: int = 1  # n-tiles of 8 tokens per CTA (mma/mmq) or tokens per CTA (exact)
    mt: int = 1  # m-tiles of 16 rows per warp
    warps: int = 8  # warps per CTA (row-split: each warp its own rows)
    src: int = 2  # activations: 2 staged in smem, 3 the f16 prepass buffer streamed through
    #               two smem stages (cp.async) (0 and 1, read from x or the prepass in the
    #               loop, left: no table entry or heuristic picked them),
    #               4 the K-slice tile q6k_ks_f16 (mma_f16 only: the K slice's activations
    #                 staged once per CTA, warps stream many row tiles; ksplit = K slices;
    #                 warps 8, or 12 / 16 (nt <= 4) in one CTA per SM),
    #               7 src 4 with its split-K sum inside a thread-block cluster of the ksplit
    #                 K slices (q6k_ksc_f16; sm_90+; mt 1, ksplit 2..8; session 15)
    #               8 the same schedule with wgmma on 64-row warpgroup tiles, each block's
    #                 scale folded into A, two wgmma groups in flight (q6k_wg_f16,
    #                 kernels/cuda/q6k_wgmma.cu; sm_90 only; nt 8 (nt 4: session 21), mt 1,
    #                 pf, warps 4/8/12 = 1/2/3 warpgroups per CTA; session 20). 6 (the wgmma
    #                 tile that rescaled its accumulators per block), 9 (6 with two groups in
    #                 flight) and 8 without pf (one group) left in session 21: no table cell
    #                 picked them; so did 5 (src 4 with a warp-private cp.async weight ring,
    #                 q6k_ksr_f16) once its one cell went to src 8 nt 4
    pf: bool = False  # prefetch the next block's weights (double buffer in registers: the exact
    #                   kernel; always on at src 4, 7 (session 30) and 8; src 3 has none since
    #                   session 15); src 2 (session 17): the first block's loads issued before
    #                   the activations are staged
    ksplit: int = 0  # CTAs along K (0: choose from the occupancy and grid size)

    def check(self, path: str) -> None:
        """Raise unless ``path`` can launch this shape (the limits of the templates)."""
        ok = (self.nt in (1, 2, 4) if path == "exact" else self.nt in (1, 2, 4, 8))
        wg = self.src == 8  # the wgmma tile
        ok = ok and self.mt in (1, 2) and self.src in (2, 3, 4, 7, 8)
        ok = ok and self.warps in ((4, 8, 12) if wg else (8, 12, 16) if self.src >= 4
                                   else (4, 8))
        ok = ok and self.ksplit >= 0 and not (path == "exact" and (
            self.mt != 1 or self.src != 2 or self.warps != 8))
        ok = ok and not (self.src >= 4 and (path != "mma_f16" or self.warps not in (
            (4, 8, 12) if wg else (8, 12, 16))))
        # the K-slice tiles (q6k_matmul.cu): one m-tile a warp, the register prefetch, at 12
        # warps up to 4 n-tiles and at 16 up to 2 (session 30: the session-14 shapes without
        # the prefetch, nt 8 at 12 warps and nt 4 at 16, and 2 m-tiles a warp left; no table
        # cell or heuristic picked them, bench/kernels_reach.py)
        ok = ok and not (self.src in (4, 7) and (self.mt != 1 or not self.pf or self.nt > {
            8: 8, 12: 4, 16: 2}.get(self.warps, 0)))
        ok = ok and not (self.src == 7 and (self.mt != 1 or not 2 <= self.ksplit <= 8))
        ok = ok and not (self.src == 8 and (self.mt != 1 or not self.pf or self.nt < 4))
        ok = ok and not (path == "mma_f16" and self.src == 2 and self.nt > 2)
        ok = ok and not (path == "mma_f16" and self.src == 3 and self.pf)
        ok = ok and not (path == "mma_f16" and self.src == 2 and self.pf and self.mt != 1)
        ok = ok and not (path == "mmq_q8_1" and (self.src, self.pf, self.warps) != (2, False, 8))
        if not ok:
            raise FormatError(f"launch shape {self} is not one {path} has")

    def label(self) -> str:
        """Short name for logs and the table (``nt4.m1.w8.s3.pf``)."""
        s = f"nt{self.nt}.m{self.mt}.w{self.warps}.s{self.src}" + (".pf" if self.pf else "")
        return s + (f".k{self.ksplit}" if self.ksplit else "")


@dataclass(frozen=True)
class Choice:
    """What one call runs: kernel path, resolved precision, launch shape (None: not a tile)."""

    path: str
    precision: Precision
    cfg: Cfg | None
    source: str  # "table", "table~RxK" (nearest shape), "heuristic", "flags"


def big_weight_cfg(cfg: Cfg, n: int, rows: int, k: int) -> Cfg:
    """``cfg`` (an mma_f16 launch shape chosen without a table cell of this exact shape), or the
    K-slice tile where the f16 tile src 2 would stream a weight of >= ``KSLICE_WEIGHT`` elements
    at N <= 8: src 2 loads each block's weights at the block's start (no block ahead in flight),
    so on such weights it streams at 2.3-2.9 TB/s where the K-slice tile, one block ahead per
    warp, reaches 3.3-3.5 (sessions 17-18, figures at KSLICE_WEIGHT)."""
    if cfg.src == 2 and n <= 8 and rows * k >= KSLICE_WEIGHT:
        return Cfg(nt=1, src=4, pf=True)
    return cfg


def bucket(n: int) -> int:
    """The N bucket of a call of ``n`` tokens (the table's key)."""
    for b in BUCKETS:
        if n <= b:
            return b
    return BUCKETS[-1]


# -- heuristics (shapes far from the table, N above the buckets) ---------------------------------
def heuristic_path(n: int, precision: Precision, flags: KernelFlags, rows: int = 0,
                   k: int = 0) -> tuple[str, Precision]:
    """The kernel path without a table (also the kill switches' whole table)."""
    refuse_q8_1_without_mmq(precision, flags)
    if precision is Precision.EXACT:
        return "exact", Precision.EXACT
    if precision is Precision.Q8_1:
        return "mmq_q8_1", Precision.Q8_1
    if precision is Precision.F16:
        if flags.decode_mmq and n <= F16_TILE_N:
            return "mma_f16", Precision.F16
        return "cublas_f16", Precision.F16
    if flags.decode_mmq:  # AUTO
        if 0 < rows * k <= SMALL_WEIGHT and n >= SMALL_EXACT_N[0]:
            if n <= SMALL_EXACT_N[1]:
                return "exact", Precision.EXACT
            return "cublas_f16", Precision.F16
        if n <= F16_TILE_N:
            return "mma_f16", Precision.F16
        return "cublas_f16", Precision.F16
    return ("exact", Precision.EXACT) if n <= 8 else ("cublas_f16", Precision.F16)


def default_cfg(path: str, n: int, rows: int = 0, sm_count: int = 0) -> Cfg:
    """The heuristic launch shape of a call of ``n`` tokens (measured: bench/RESULTS.md).

    ``rows``/``sm_count`` (the weight and the device) pick 32-row warps for 9..64 tokens when
    the 128-row tiles alone fill the GPU (no K split): one activation fragment then feeds two
    m-tiles (H200 lm-head: 1.50x at N=16, 1.08x at N=64; slower on 4096-row weights). Other
    weights take the K-slice tile (src 4), which the H200 table picks on every model shape
    below the lm-heads at N = 16..64 but 14336x4096 at N = 32/64 (bench/RESULTS.md)."""
    if path == "exact":
        return Cfg(nt=1 if n == 1 else 2 if n == 2 else 4, pf=n <= 2)
    if path == "mmq_q8_1":
        return Cfg(nt=1 if n <= 8 else 2 if n <= 16 else 4 if n <= 32 else 8)
    if n <= 8:
        return Cfg(nt=1)
    if sm_count and rows >= 128 * sm_count:
        return Cfg(nt=2 if n <= 16 else 4 if n <= 32 else 8, mt=2, src=3, warps=4)
    return Cfg(nt=2 if n <= 16 else 4 if n <= 32 else 8, src=4, pf=True)


# -- the measured table ------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One table cell: the fastest candidate of (shape, N bucket, column) on the tuned device."""

    rows: int
    k: int
    n: int  # bucket
    column: str  # a Precision value
    path: str
    cfg: Cfg | None
    us: float  # its median kernel time at N = n (for reading the table; not used to decide)

    def to_json(self) -> dict:
        d = {"rows": self.rows, "k": self.k, "n": self.n, "column": self.column,
             "path": self.path, "us": round(self.us, 2)}
        if self.cfg is not None:
            d["cfg"] = asdict(self.cfg)
        return d


def _entry(d: dict, where: str) -> Entry:
    try:
        rows, k, n = int(d["rows"]), int(d["k"]), int(d["n"])
        column, path = str(d["column"]), str(d["path"])
        raw = d.get("cfg")
        names = {f.name for f in fields(Cfg)}
        if raw is not None and not set(raw) <= names:
            raise FormatError(f"unknown launch-shape fields {sorted(set(raw) - names)}")
        cfg = Cfg(**raw) if raw is not None else None
        us = float(d.get("us", 0.0))
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{where}: bad dispatch entry {d!r}: {e}") from None
    if column not in COLUMNS:
        raise FormatError(f"{where}: column {column!r} is not one of {', '.join(COLUMNS)}")
    if path not in COLUMNS[column]:
        raise FormatError(f"{where}: path {path!r} is not a kernel of column {column!r} "
                          f"({', '.join(COLUMNS[column])})")
    if n not in BUCKETS or rows < 1 or k < 256 or k % 256:
        raise FormatError(f"{where}: bad shape/bucket rows={rows} K={k} N={n}")
    if (cfg is None) != (path not in TILE_PATHS):
        raise FormatError(f"{where}: {path} entries {'need' if cfg is None else 'take no'} cfg")
    if cfg is not None:
        cfg.check(path)
    return Entry(rows, k, n, column, path, cfg, us)


class DispatchTable:
    """The tuned table: entries by (rows, K) -> (bucket, column); validated on load."""

    def __init__(self, entries: Iterable[Entry], meta: dict | None = None) -> None:
        self.meta = dict(meta or {})
        self.cells: dict[tuple[int, int], dict[tuple[int, str], Entry]] = {}
        for e in entries:
            self.cells.setdefault((e.rows, e.k), {})[(e.n, e.column)] = e

    @classmethod
    def load(cls, path: str | Path) -> DispatchTable:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise FormatError(f"dispatch table {path}: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != 1 or not isinstance(
                doc.get("entries"), list):
            raise FormatError(f"dispatch table {path}: not a format-1 table")
        entries = [_entry(d, f"{path.name} entry {i}") for i, d in enumerate(doc["entries"])]
        return cls(entries, {k: v for k, v in doc.items() if k != "entries"})

    def to_json(self) -> dict:
        entries = [e.to_json() for shape in sorted(self.cells)
                   for _, e in sorted(self.cells[shape].items())]
        return {**self.meta, "format": 1, "entries": entries}

    def dump(self, path: str | Path) -> None:
        """One entry per line: a re-tune shows up as a readable diff."""
        doc = self.to_json()
        head = {k: v for k, v in doc.items() if k != "entries"}
        lines = [json.dumps(e, sort_keys=True) for e in doc["entries"]]
        text = json.dumps(head, indent=1, sort_keys=True)[:-2] + ',\n "entries": [\n  '
        Path(path).write_text(text + ",\n  ".join(lines) + "\n ]\n}\n")

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return sorted(self.cells)

    def nearest(self, rows: int, k: int) -> tuple[int, int] | None:
        """The table shape that answers for ``rows`` x ``k``: itself, else the closest one in
        log rows*K (then log aspect) within ``NEAR_SIZE``/``NEAR_ASPECT``, else None."""
        if (rows, k) in self.cells:
            return rows, k
        if rows < 1 or k < 1:
            return None
        best: tuple[float, tuple[int, int]] | None = None
        for r, kk in self.cells:
            ds = abs(math.log2(rows * k / (r * kk)))
            da = abs(math.log2((rows / k) / (r / kk)))
            if ds <= NEAR_SIZE and da <= NEAR_ASPECT:
                d = ds + da / 4
                if best is None or d < best[0]:
                    best = (d, (r, kk))
        return None if best is None else best[1]

    def lookup(self, rows: int, k: int, n: int, column: str) -> tuple[Entry, str] | None:
        shape = self.nearest(rows, k)
        if shape is None:
            return None
        e = self.cells[shape].get((bucket(n), column))
        if e is None:
            return None
        return e, "table" if shape == (rows, k) else f"table~{shape[0]}x{shape[1]}"


def load_default_table() -> DispatchTable | None:
    """The committed table, or None where there is none (the heuristics answer alone)."""
    return DispatchTable.load(DEFAULT_TABLE) if DEFAULT_TABLE.is_file() else None


class Dispatch:
    """Table first, heuristics for the rest; see the module docstring."""

    def __init__(self, table: DispatchTable | None, sm_count: int = 0) -> None:
        self.table = table
        self.sm_count = sm_count
        # answers so far: a pure function of the arguments for this table and SM count, asked
        # two or three times per call (4-9 us each on the 2-core VM); bounded
        self._memo: dict[tuple[int, Precision, KernelFlags, int, int], Choice] = {}

    def choose(self, n: int, precision: Precision, flags: KernelFlags, rows: int = 0,
               k: int = 0) -> Choice:
        key = (n, precision, flags, rows, k)
        c = self._memo.get(key)
        if c is None:
            c = self._choose(n, precision, flags, rows, k)  # a refusal raises: not kept
            if len(self._memo) >= 4096:
                self._memo.clear()
            self._memo[key] = c
        return c

    def _choose(self, n: int, precision: Precision, flags: KernelFlags, rows: int,
                k: int) -> Choice:
        refuse_q8_1_without_mmq(precision, flags)
        if not flags.decode_mmq:  # the kill switch: no tile but the exact kernel
            path, prec = heuristic_path(n, precision, flags, rows, k)
            cfg = default_cfg(path, n, rows, self.sm_count) if path in TILE_PATHS else None
            return Choice(path, prec, cfg, "flags")
        tiles_fit = precision in (Precision.EXACT, Precision.Q8_1) or n <= F16_TILE_N
        if self.table is not None and tiles_fit:
            hit = self.table.lookup(rows, k, n, precision.value)
            if hit is not None:
                e, source = hit
                cfg = e.cfg
                if cfg is not None and cfg.ksplit and source != "table":
                    # a K split measured for another K: re-derive (the cluster-sum tile's
                    # cluster is its K split, so it becomes the plain K-slice tile)
                    cfg = replace(cfg, ksplit=0, src=4 if cfg.src == 7 else cfg.src)
                if cfg is not None and e.path == "mma_f16" and source != "table":
                    cfg = big_weight_cfg(cfg, n, rows, k)
                return Choice(e.path, KERNELS[e.path], cfg, source)
        path, prec = heuristic_path(n, precision, flags, rows, k)
        cfg = default_cfg(path, n, rows, self.sm_count) if path in TILE_PATHS else None
        if cfg is not None and path == "mma_f16":
            cfg = big_weight_cfg(cfg, n, rows, k)
        return Choice(path, prec, cfg, "heuristic")
