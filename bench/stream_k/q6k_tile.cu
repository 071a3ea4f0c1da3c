// q6k_tile_f16: the stream-K tensor-core tile for N = 9..64 tokens (issue 16 item 1).
//
// What it changes against q6k_mma_f16 (q6k_matmul.cu): that tile loads each lane's weights
// straight from global memory into registers (half-line loads, a whole 256-block per row pair
// in registers, double-buffered), so wide token tiles spill or run one 8-warp CTA of 16-row
// warps that re-read every activation fragment per 16 rows. Here
//
//   * weights AND activations go through an S-stage cp.async ring in shared memory, one stage
//     per 256-wide K block: the CTA copies BM rows x 210 bytes of Q6_K (whole 128-byte lines of
//     the ql plane, 64-byte runs of qh, the 16 scale bytes) plus the block's f16 activations
//     (the q6k_prep_f16 buffer, already in mma fragment order) with coalesced 16-byte
//     cp.async, S-1 blocks ahead of the math; a warp reads only the 16-byte words it needs
//     for the current 128-wide half block, so no weight lives in registers across blocks;
//   * each warp owns MT m-tiles (16 rows each) x all 8*NT tokens: every weight is unpacked
//     exactly once per call (by the one lane that owns it) and feeds NT mma.sync.m16n8k16;
//     every activation fragment read from shared memory feeds MT m-tiles;
//   * stream-K: the grid is exactly the resident CTAs (SMs x occupancy, at most the work),
//     and the (row tile, K block) units, tile-major, are cut into G equal contiguous ranges,
//     so every SM gets the same number of blocks for any rows x K (the 3584x3584 weight has
//     14 row tiles of 256 x 14 blocks = 196 units: 132 CTAs get 1-2 each instead of 14 CTAs
//     doing all the work). A tile wholly inside one CTA's range is written straight to y; a
//     tile cut between CTAs leaves partial sums, and its last CTA to arrive (atomic ticket)
//     adds them in CTA order, so the result never depends on timing.
//
// Numerics are those of q6k_mma_f16 (the F16 contract): A = f16(sc*(q-32)) built with the
// 0x64 magic (deq2), B = activations rounded to f16 once by the prepass, f32 accumulators
// scaled by 1/d before and d after each block (no second accumulator set, d never meets f16,
// a zero d masks its block). The k order inside a block is that tile's quad order.
//
// Shared memory of one stage (bytes; BM = 8 warps x 16 x MT rows):
//   ql [BM][128]  row r's 16-byte chunk c stored at chunk c ^ ((r & 1) << 2): a quarter-warp
//                 reads chunks 4h+t of rows 2i, 2i+1, which this swizzle puts on all 32 banks
//   qh [BM][64]   lane (g, t) reads 16 bytes at 32h + 16(t&1): rows 2i, 2i+1 are 64 bytes
//                 apart, so a quarter-warp touches distinct banks (t, t^2 share a word)
//   sc [BM][16]
//   d  [BM] x 4   the 4-byte-aligned word that holds the row's f16 d (cp.async moves 4, 8 or
//                 16 aligned bytes, d is 2), and dp [BM] x 1 which half of it d is
//   x  [NT][8 sp][32 lanes] x 16 bytes (the prepass layout of one block)
// plus a per-tile table of row addresses (BM x RowRef, static) that the fill reads, rewritten
// by the fill when it crosses into the next row tile. Everything a block's math reads is in
// its stage: a first version read d from global memory one block ahead into registers, and
// every block then waited a loaded DRAM latency for it (H200: 1.1-2.0 TB/s on the big shapes).
//
// The AoS twin fills the same stages with 2-byte-aligned loads and plain shared stores (AoS
// blocks are only 2-byte aligned, cp.async needs 16): same stage bytes, same math, so SoA and
// AoS outputs are bit-identical (the grid is computed from the SoA twin).
#include "q6k_common.cuh"
#include "q6k_mma.cuh"

extern __shared__ __align__(16) uint4 tile_stage[];

template <int NT, int MT>
struct TileGeom {
    static constexpr int WARPS = 8;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int BM = WARPS * 16 * MT;  // rows of a tile
    static constexpr int QH = BM * 128;         // byte offsets inside a stage
    static constexpr int SC = QH + BM * 64;
    static constexpr int D = SC + BM * 16;  // u32 word holding d, per row
    static constexpr int DP = D + BM * 4;   // which half of it is d, per row (byte)
    static constexpr int X = DP + BM;
    static constexpr int STAGE = X + NT * 8 * 32 * 16;
};

// Units of CTA c: [start(c), start(c+1)) of U = tiles * bpr, tile-major.
__device__ __forceinline__ long long unit_start(long long c, long long units, long long g) {
    return c * units / g;
}
// The CTA whose range holds unit x: the largest c with start(c) <= x (units >= g, so starts
// strictly increase).
__device__ __forceinline__ int unit_owner(long long x, long long units, long long g) {
    return (int)(((x + 1) * g + units - 1) / units - 1);
}

// 16-byte copy of the first `bytes` (0 or 16) of gmem, zeros for the rest (tokens past N).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, int bytes) {
    u32 a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(a) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(gmem), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ float4 ldcg_f32x4(const float* p) {
    float4 v;  // L2 only: other CTAs wrote it
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}


// Copy unit (tile, kb) into stage `st`. `tab` holds the tile's row references (rows past the
// end repeat the last row: read, never emitted).
template <int NT, int MT, bool SOA, bool XH>
__device__ __forceinline__ void fill_stage(u8* st, const RowRef* tab, int kb, const void* x,
                                           int n_tok, int K, int tid) {
    typedef TileGeom<NT, MT> G;
    constexpr u32 QL_STEP = SOA ? 128u : 210u, QH_STEP = SOA ? 64u : 210u,
                  SC_STEP = SOA ? 16u : 210u;
#pragma unroll
    for (int i = tid; i < G::BM * 8; i += G::THREADS) {
        const int r = i >> 3, c = i & 7;
        const RowRef& rf = tab[r];
        u8* dst = st + r * 128 + ((c ^ ((r & 1) << 2)) << 4);
        const u8* src = rf.base + rf.ql + (u32)kb * QL_STEP + 16u * c;
        if (SOA)
            cp_async16(dst, src);
        else
            *(uint4*)dst = ld_u128_a2(src);
    }
#pragma unroll
    for (int i = tid; i < G::BM * 4; i += G::THREADS) {
        const int r = i >> 2, c = i & 3;
        const RowRef& rf = tab[r];
        u8* dst = st + G::QH + r * 64 + 16 * c;
        const u8* src = rf.base + rf.qh + (u32)kb * QH_STEP + 16u * c;
        if (SOA)
            cp_async16(dst, src);
        else
            *(uint4*)dst = ld_u128_a2(src);
    }
#pragma unroll
    for (int i = tid; i < G::BM; i += G::THREADS) {
        const RowRef& rf = tab[i];
        u8* dst = st + G::SC + 16 * i;
        const u8* src = rf.base + rf.sc + (u32)kb * SC_STEP;
        if (SOA)
            cp_async16(dst, src);
        else
            *(uint4*)dst = ld_u128_a2(src);
    }
#pragma unroll
    for (int i = tid; i < G::BM; i += G::THREADS) {
        const RowRef& rf = tab[i];
        u32* dst = (u32*)(st + G::D) + i;
        if (SOA) {  // the aligned word around d (slabs and the d plane are 16-byte aligned)
            const size_t a = (size_t)(rf.base + rf.d + 2u * kb);
            cp_async4(dst, (const void*)(a & ~(size_t)3));
            st[G::DP + i] = (u8)((a >> 1) & 1);
        } else {
            *dst = ldg_u16(rf.base + rf.d + 210u * kb);
            st[G::DP + i] = 0;
        }
    }
#pragma unroll
    for (int i = tid; i < NT * 256; i += G::THREADS) {
        if (XH) {  // straight from f16 x: 8 consecutive activations per fragment slot
            const int lane = i & 31, tok = (i >> 8) * 8 + (lane >> 2);
            const unsigned short* x16 = (const unsigned short*)x;
            const bool live = tok < n_tok;
            const unsigned short* src =
                live ? x16 + (size_t)tok * K + kb * 256 + quad_x_off((i >> 5) & 7, lane & 3) : x16;
            cp_async16_zfill(st + G::X + 16 * i, src, live ? 16 : 0);
        } else {
            cp_async16(st + G::X + 16 * i, (const uint4*)x + (size_t)kb * NT * 256 + i);
        }
    }
}


// The 4 code bytes of quad (nib, j) of one row-half from its ql/qh words (see quad_q).
__device__ __forceinline__ u32 half_q(const uint4& l4, const uint4& h4, int nib, int j, int qsh) {
    const u32 l = word4(l4, j), hw = word4(h4, j);
    return nib ? (((l >> 4) & 0x0F0F0F0Fu) | ((hw >> qsh) & 0x30303030u))
               : ((l & 0x0F0F0F0Fu) | ((hw << (4 - qsh)) & 0x30303030u));
}

// The last CTA of a cut tile: y = the contributors' partial sums added in CTA order (fixed,
// so results never depend on timing). float4 over rows, and each thread issues the loads of
// 4 contributors before adding them: a first version loaded one float at a time and waited
// an L2 round trip per term.
template <int NT, int MT>
__device__ __forceinline__ void reduce_tile(const Out& o, int rows, int tile, int row0, int c_lo,
                                            int c_hi, long long units, long long ng, int bpr,
                                            int tid) {
    typedef TileGeom<NT, MT> G;
    constexpr int Q = G::BM / 4;  // float4 per token row of a partial
    const int nr = min(G::BM, rows - row0);
    for (int i = tid; i < o.n_tok * Q; i += G::THREADS) {
        const int tok = i / Q, r4 = (i - tok * Q) * 4;
        if (r4 >= nr) continue;
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int c0 = c_lo; c0 <= c_hi; c0 += 4) {
            float4 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int cc = c0 + j;
                if (cc > c_hi) {
                    v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
                    continue;
                }
                const int ps = (long long)tile == unit_start(cc, units, ng) / bpr ? 0 : 1;
                v[j] = ldcg_f32x4(o.part + (((size_t)cc * 2 + ps) * (8 * NT) + tok) * G::BM + r4);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (c0 + j > c_hi) break;
                s.x += v[j].x;
                s.y += v[j].y;
                s.z += v[j].z;
                s.w += v[j].w;
            }
        }
        float* y = o.y + (size_t)tok * rows + row0 + r4;
        y[0] = s.x;
        if (r4 + 1 < nr) y[1] = s.y;
        if (r4 + 2 < nr) y[2] = s.z;
        if (r4 + 3 < nr) y[3] = s.w;
    }
}

// x (n_tok <= 8*NT): XH the f16 activations [n_tok][K] themselves (the fill gathers the
// fragment order, zero-filling tokens past n_tok: no prepass launch), else the q6k_prep_f16<NT>
// buffer of token chunk 0 (f32/bf16 activations). One CTA per resident slot,
// gridDim.x = G <= tiles * bpr. part: [G][2][8*NT][BM] floats (slot 0: the CTA's first tile,
// 1: its last), tickets: one per row tile, zero between launches.
template <int NT, int MT, int S, bool SOA, int MINB, bool XH>
__global__ void __launch_bounds__(256, MINB) q6k_tile_f16(PARAMS_W, const void* x,
                                                           PARAMS_OUT) {
    typedef TileGeom<NT, MT> G;
    MAKE_W;
    MAKE_OUT;
    __shared__ RowRef tab[G::BM];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3, qsh = 2 * (t >> 1);
    const u32 scsel = 0x4040u | (u32)t | ((u32)t << 8);
    const int tiles = (w.rows + G::BM - 1) / G::BM;
    const long long units = (long long)tiles * bpr, ng = gridDim.x;
    const int c = blockIdx.x;
    const long long u0 = unit_start(c, units, ng), u1 = unit_start(c + 1, units, ng);
    u8* stages = reinterpret_cast<u8*>(tile_stage);

    // ---- producer: the fill of unit u into slot s (all threads, CTA-uniform) ----
    int fill_tile = -1;
    auto fill = [&](long long u, int s) {
        const int tile = (int)(u / bpr), kb = (int)(u - (long long)tile * bpr);
        if (tile != fill_tile) {  // new row tile: rewrite the row table
            __syncthreads();      // every thread has issued the previous fill's copies
            if (tid < G::BM) tab[tid] = row_ref<SOA>(w, min(tile * G::BM + tid, w.rows - 1));
            __syncthreads();
            fill_tile = tile;
        }
        fill_stage<NT, MT, SOA, XH>(stages + s * G::STAGE, tab, kb, x, o.n_tok, bpr * 256, tid);
    };
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (u0 + s < u1) fill(u0 + s, s);
        cp_async_commit();  // empty groups keep the wait count uniform
    }

    const int wr = warp * 16 * MT;  // the warp's first row inside a tile

    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

    int slot = 0;
    for (long long u = u0; u < u1; ++u) {
        cp_async_wait<S - 2>();  // unit u's copies (this thread's) have landed ...
        __syncthreads();         // ... everyone's, and slot (u-1)'s readers are done
        {
            const long long nu = u + S - 1;
            if (nu < u1) fill(nu, (slot + S - 1) % S);
            cp_async_commit();
        }
        const int tile = (int)(u / bpr), kb = (int)(u - (long long)tile * bpr);

        const u8* st = stages + slot * G::STAGE;
        float dmul[MT][2];
        u32 sc2[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = wr + mt * 16 + g + 8 * hr;
                const uint4 scw = *(const uint4*)(st + G::SC + 16 * r);
                const u32 dw = ((const u32*)(st + G::D))[r] >> (16 * st[G::DP + r]);
                const float d = f16_to_f32(dw & 0xFFFFu);
                const bool zero = (d == 0.f);  // a zero block adds nothing: mask it, scale by 1
                dmul[mt][hr] = zero ? 1.f : d;
                const float inv = zero ? 1.f : rcp_approx(d);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    acc[mt][nt][2 * hr] *= inv;
                    acc[mt][nt][2 * hr + 1] *= inv;
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) sc2[mt][hr][k] = zero ? 0u : sc_pair(word4(scw, k), scsel);
            }
        const uint4* xs = (const uint4*)(st + G::X);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4 lq[MT][2], hq[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int r = wr + mt * 16 + g + 8 * hr;
                    lq[mt][hr] = *(const uint4*)(st + r * 128 + (((4 * h + t) ^ ((r & 1) << 2)) << 4));
                    hq[mt][hr] = *(const uint4*)(st + G::QH + r * 64 + 32 * h + 16 * (t & 1));
                }
#pragma unroll
            for (int nib = 0; nib < 2; ++nib)
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
                    const int sp = 4 * h + 2 * nib + jj;
                    u32 a[MT][2][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int uu = 0; uu < 2; ++uu) {
                            const int j = 2 * jj + uu;
                            const u32 q0 = half_q(lq[mt][0], hq[mt][0], nib, j, qsh);
                            const u32 q1 = half_q(lq[mt][1], hq[mt][1], nib, j, qsh);
                            const u32 s0 = sc2[mt][0][2 * h + nib], s1 = sc2[mt][1][2 * h + nib];
                            a[mt][uu][0] = deq2<0x4140u>(q0, s0);
                            a[mt][uu][1] = deq2<0x4140u>(q1, s1);
                            a[mt][uu][2] = deq2<0x4342u>(q0, s0);
                            a[mt][uu][3] = deq2<0x4342u>(q1, s1);
                        }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const uint4 bx = xs[(nt * 8 + sp) * 32 + lane];
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            mma_f16(acc[mt][nt], a[mt][0][0], a[mt][0][1], a[mt][0][2],
                                    a[mt][0][3], bx.x, bx.y);
                            mma_f16(acc[mt][nt], a[mt][1][0], a[mt][1][1], a[mt][1][2],
                                    a[mt][1][3], bx.z, bx.w);
                        }
                    }
                }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][nt][i] *= dmul[mt][i >> 1];
        slot = slot + 1 == S ? 0 : slot + 1;

        if (kb != bpr - 1 && u + 1 != u1) continue;
        // ---- the end of this CTA's part of `tile`: emit it (CTA-uniform branch) ----
        const int row0 = tile * G::BM;
        const int c_lo = unit_owner((long long)tile * bpr, units, ng);
        const int c_hi = unit_owner((long long)tile * bpr + bpr - 1, units, ng);
        if (c_lo == c_hi) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int row = row0 + wr + mt * 16 + g + 8 * (i >> 1);
                        const int tok = nt * 8 + 2 * t + (i & 1);
                        if (row < w.rows && tok < o.n_tok) o.y[(size_t)tok * w.rows + row] = acc[mt][nt][i];
                    }
        } else {
            const int ps = (long long)tile == u0 / bpr ? 0 : 1;
            float* p = o.part + ((size_t)c * 2 + ps) * (8 * NT) * G::BM;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        p[(nt * 8 + 2 * t + (i & 1)) * G::BM + wr + mt * 16 + g + 8 * (i >> 1)] =
                            acc[mt][nt][i];
            __shared__ u32 last;
            __threadfence();
            __syncthreads();
            if (tid == 0) {
                const u32 prev = atomicAdd(o.tickets + tile, 1u);
                last = prev == (u32)(c_hi - c_lo);
                if (last) o.tickets[tile] = 0;  // ready for the next launch (stream order)
            }
            __syncthreads();
            if (last) {
                __threadfence();
                reduce_tile<NT, MT>(o, w.rows, tile, row0, c_lo, c_hi, units, ng, bpr, tid);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
    }
    cp_async_wait<0>();  // no copy outlives the CTA's shared memory
}

#ifdef Q6SERVE_NVCC_CHECK
// Every launch shape the backend and bench/tile_probe.py may ask NVRTC for.
#define INST_TILE2(NT, MT, S, SOA, MINB, XH)                \
    template __global__ void q6k_tile_f16<NT, MT, S, SOA, MINB, XH>( \
        const u64*, int, int, int, const void*, float*, float*, u32*, int);
#define INST_TILE(NT, MT, S, MINB)                                          \
    INST_TILE2(NT, MT, S, true, MINB, true) INST_TILE2(NT, MT, S, false, MINB, true) \
    INST_TILE2(NT, MT, S, true, MINB, false) INST_TILE2(NT, MT, S, false, MINB, false)
INST_TILE(2, 1, 4, 1) INST_TILE(2, 1, 3, 2) INST_TILE(2, 2, 3, 1)
INST_TILE(4, 1, 4, 1) INST_TILE(4, 2, 3, 1) INST_TILE(4, 1, 2, 2)
INST_TILE(8, 1, 3, 1) INST_TILE(8, 2, 2, 1)
#endif
