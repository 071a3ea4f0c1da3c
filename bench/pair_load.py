"""Load-time cost of the pair-stream repack (session 12, k round 2; run on a GPU).

For each weight shape: the wall of ``CudaBackend.load`` (64 MB chunks through the pinned buffer,
as the worker loads a GGUF tensor) with Q6SERVE_Q6K_PAIRS off and on, alternated, the median of
``--reps``; then the repack and its inverse alone on one 64 MB slab (CUDA events, median of 5):
session 12's coalesced kernels (a thread per quarter block, 16-byte loads and stores) beside
session 11's one-thread-per-block ones (their source kept below, built here with NVRTC), and
the bits of both on that slab compared (repack and unpack, and the round trip to the file's bytes).

    python bench/pair_load.py [--shapes 4096x14336,152064x3584] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from q6serve.kernels import q6k
from q6serve.kernels.api import Layout, iter_aos_chunks
from q6serve.kernels.cuda_backend import CudaBackend

CHUNK = 64 << 20
# Session 11's kernels (q6k_matmul.cu before session 12 round 2), renamed.
S11_SRC = r"""
typedef unsigned char u8;
typedef unsigned int u32;
extern "C" __global__ void __launch_bounds__(128) s11_repack_pairs(u8* slab, int nb, int b0,
                                                                    int b1) {
    const int b = b0 + blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= b1) return;
    u8* ql = slab + (size_t)b * 128u;
    u8* qh = slab + (size_t)nb * 128u + (size_t)b * 64u;
    u8 q[256];
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
            const u32 a = ql[64 * h + l], c = ql[64 * h + l + 32], hh = qh[32 * h + l];
            q[128 * h + l] = (u8)((a & 15u) | ((hh & 3u) << 4));
            q[128 * h + l + 32] = (u8)((c & 15u) | (((hh >> 2) & 3u) << 4));
            q[128 * h + l + 64] = (u8)((a >> 4) | (((hh >> 4) & 3u) << 4));
            q[128 * h + l + 96] = (u8)((c >> 4) | (((hh >> 6) & 3u) << 4));
        }
    for (int t = 0; t < 4; ++t) {
        u32 W[12];
        for (int i = 0; i < 12; ++i) W[i] = 0u;
        for (int m = 0; m < 4; ++m)
            for (int p = 0; p < 8; ++p)
                for (int hf = 0; hf < 2; ++hf) {
                    const int j = p >> 1, i = 2 * (p & 1) + hf;
                    const int e = (m >> 1) * 128 + 32 * ((t >> 1) + 2 * (m & 1)) + 16 * (t & 1) +
                                  4 * j + i;
                    const u32 code = q[e];
                    for (int k = 0; k < 6; ++k) {
                        const int sb = 6 * p + k, word = sb >> 4;
                        const int wi = word == 2 ? 8 + m : 2 * m + word;
                        W[wi] |= ((code >> k) & 1u) << ((sb & 15) + 16 * hf);
                    }
                }
        u32* dl = (u32*)(ql + 32 * t);
        u32* dh = (u32*)(qh + 16 * t);
        for (int i = 0; i < 8; ++i) dl[i] = W[i];
        for (int i = 0; i < 4; ++i) dh[i] = W[8 + i];
    }
}

// The inverse, in place: pair streams back to ggml's ql/qh planes (relayout to AoS, read_aos),
// bit-exact (tests/kernels/test_cuda_pairs.py round-trips).
extern "C" __global__ void __launch_bounds__(128) s11_unpack_pairs(u8* slab, int nb, int b0,
                                                                    int b1) {
    const int b = b0 + blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= b1) return;
    u8* ql = slab + (size_t)b * 128u;
    u8* qh = slab + (size_t)nb * 128u + (size_t)b * 64u;
    u8 q[256];
    for (int t = 0; t < 4; ++t) {
        u32 W[12];
        for (int i = 0; i < 8; ++i) W[i] = ((const u32*)(ql + 32 * t))[i];
        for (int i = 0; i < 4; ++i) W[8 + i] = ((const u32*)(qh + 16 * t))[i];
        for (int m = 0; m < 4; ++m)
            for (int p = 0; p < 8; ++p)
                for (int hf = 0; hf < 2; ++hf) {
                    const int j = p >> 1, i = 2 * (p & 1) + hf;
                    const int e = (m >> 1) * 128 + 32 * ((t >> 1) + 2 * (m & 1)) + 16 * (t & 1) +
                                  4 * j + i;
                    u32 code = 0u;
                    for (int k = 0; k < 6; ++k) {
                        const int sb = 6 * p + k, word = sb >> 4;
                        const int wi = word == 2 ? 8 + m : 2 * m + word;
                        code |= ((W[wi] >> ((sb & 15) + 16 * hf)) & 1u) << k;
                    }
                    q[e] = (u8)code;
                }
    }
    for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
            const u32 a = q[128 * h + l], c = q[128 * h + l + 32];
            const u32 e = q[128 * h + l + 64], f = q[128 * h + l + 96];
            ql[64 * h + l] = (u8)((a & 15u) | ((e & 15u) << 4));
            ql[64 * h + l + 32] = (u8)((c & 15u) | ((f & 15u) << 4));
            qh[32 * h + l] = (u8)((a >> 4) | ((c >> 4) << 2) | ((e >> 4) << 4) | ((f >> 4) << 6));
        }
}
"""


def slab_events(be, fn, slab, nb: int, grid: int, block: int, iters: int = 5) -> float:
    """Median microseconds of ``fn`` over the whole slab (in place; contents do not matter)."""
    cp = be.ctx.cp
    times = []
    for _ in range(iters):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(be.stream)
        fn((grid,), (block,), (slab, np.int32(nb), np.int32(0), np.int32(nb)))
        e1.record(be.stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return statistics.median(times)


def run_shape(be, old, rows: int, k: int, reps: int) -> dict:
    cp = be.ctx.cp
    aos = np.random.default_rng(rows).integers(0, 256, q6k.aos_nbytes(rows, k), dtype=np.uint8)
    walls: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(reps + 1):  # the first round warms (NVRTC, the pool, the pinned buffer)
        for on in (False, True):
            be.storage.pairs = on
            with be.ctx.dev:
                cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            w = be.load(iter_aos_chunks(aos, rows, k, CHUNK), rows, k, Layout.SOA, CHUNK)
            with be.ctx.dev:
                be.stream.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            if rep:
                walls[on].append(wall)
            if on:
                pw = w
            else:
                plain = w
    nb = plain.data.slabs[0].size // 210
    with be.ctx.dev, be.stream:
        new_r = be.ctx.fn("q6k_matmul.cu", "q6k_repack_pairs")
        new_u = be.ctx.fn("q6k_matmul.cu", "q6k_unpack_pairs")
        src = plain.data.slabs[0]
        a, b = src.copy(), src.copy()
        old[0]((-(-nb // 128),), (128,), (a, np.int32(nb), np.int32(0), np.int32(nb)))
        new_r((-(-4 * nb // 256),), (256,), (b, np.int32(nb), np.int32(0), np.int32(nb)))
        same_r = bool(cp.array_equal(a, b)) and bool(cp.array_equal(b, pw.data.slabs[0]))
        old[1]((-(-nb // 128),), (128,), (a, np.int32(nb), np.int32(0), np.int32(nb)))
        new_u((-(-4 * nb // 256),), (256,), (b, np.int32(nb), np.int32(0), np.int32(nb)))
        same_u = bool(cp.array_equal(a, b)) and bool(cp.array_equal(b, src))
        t = {"repack_new_us": slab_events(be, new_r, b, nb, -(-4 * nb // 256), 256),
             "repack_s11_us": slab_events(be, old[0], b, nb, -(-nb // 128), 128),
             "unpack_new_us": slab_events(be, new_u, b, nb, -(-4 * nb // 256), 256),
             "unpack_s11_us": slab_events(be, old[1], b, nb, -(-nb // 128), 128)}
    slabs = len(pw.data.slabs)
    for w in (plain, pw):
        be.free(w)
    off, on = statistics.median(walls[False]), statistics.median(walls[True])
    return {"shape": f"{rows}x{k}", "mb": q6k.aos_nbytes(rows, k) / 1e6, "slab_blocks": nb,
            "slabs": slabs, "load_off_ms": off,
            "load_on_ms": on, "walls_off": walls[False], "walls_on": walls[True],
            "bits_same_repack": same_r, "bits_same_unpack": same_u, **t}


HEAD = (f"{'shape':>12} {'MB':>6} {'load off':>9} {'load on':>9} {'on-off':>7} "
        f"{'repack new/s11 us':>18} {'unpack new/s11 us':>18} bits")


def row(r: dict) -> str:
    return (f"{r['shape']:>12} {r['mb']:6.1f} {r['load_off_ms']:7.1f}ms {r['load_on_ms']:7.1f}ms "
            f"{r['load_on_ms'] - r['load_off_ms']:+6.1f} "
            f"{r['repack_new_us']:8.0f}/{r['repack_s11_us']:<9.0f} "
            f"{r['unpack_new_us']:8.0f}/{r['unpack_s11_us']:<9.0f} "
            f"{'same' if r['bits_same_repack'] and r['bits_same_unpack'] else 'DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x14336,152064x3584")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    be = CudaBackend(0)
    with be.ctx.dev:
        mod = be.ctx.cp.RawModule(code=S11_SRC)
        old = (mod.get_function("s11_repack_pairs"), mod.get_function("s11_unpack_pairs"))
    print(HEAD, flush=True)
    out = []
    for s in args.shapes.split(","):
        rows, k = (int(v) for v in s.split("x"))
        r = run_shape(be, old, rows, k, args.reps)
        out.append(r)
        print(json.dumps(r), flush=True)
        print(row(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    print(HEAD)
    for r in out:
        print(row(r))


if __name__ == "__main__":
    main()
