// Q6_K matmul kernels y[N][rows] = x[N][K] . W^T on resident SoA (or AoS) slabs.
// Dispatch and numerics: docs/KERNELS.md and kernels/cuda_backend.py (DISPATCH).
//
//   q6k_exact      f32 CUDA-core matvec on exactly dequantized weights, TOK tokens per CTA.
//   q6k_mma_f16    tensor-core tile: f16(sc*(q-32)) in registers x f16 activations, f32
//                  accumulators; the f32 block scale d is applied by rescaling the accumulators
//                  around each 256-block (acc *= rcp(d); acc += A.B; acc *= d), so no second set
//                  of accumulators is needed and f16 never sees d (no overflow for any finite d).
//   q6k_mmq_q8     int8 tensor-core tile on q8_1 activations (llama.cpp numerics): one k16 MMA
//                  per 16-group, u8 codes x s8 activations with the -32 centring folded into the
//                  accumulator's initial value, each group rescaled on its own in f32.
//   prepasses      activations -> f16 / q8_1 in fragment order (one 16-byte load per lane).
//   q6k_dequant_f16  rows of W -> f16 for the cuBLAS path.
#include "q6k_common.cuh"
#include "q6k_mma.cuh"

// Activations staged per CTA (SRC == 2 / SM): sized by the launch (shared_mem).
extern __shared__ uint4 smem_x[];

// ---------------------------------------------------------------------------------------------
// The prepasses' item i (a grid-stride loop over n_chunks x bpr x NT groups of 2^SH items) ->
// its token chunk z, K block kb and n-tile nt.
template <int NT, int SH>
__device__ __forceinline__ void prep_pos(long long i, int bpr, int& z, int& kb, int& nt) {
    long long rest = i >> SH;
    nt = (int)(rest % NT);
    rest /= NT;
    kb = (int)(rest % bpr);
    z = (int)(rest / bpr);
}

// f16 activations in fragment order: xp[z][kb][nt][sp][lane] = 8 f16 (16 bytes), token
// z*8*NT + nt*8 + (lane>>2), zero for tokens >= n_tok.
template <int NT, class In>
__global__ void __launch_bounds__(256) q6k_prep_f16(const typename In::T* x, int n_tok, int K,
                                                     int n_chunks, uint4* xp) {
    const int bpr = K >> 8;
    const long long total = (long long)n_chunks * bpr * NT * 8 * 32;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int lane = (int)(i & 31), sp = (int)((i >> 5) & 7);
        int z, kb, nt;
        prep_pos<NT, 8>(i, bpr, z, kb, nt);
        const int tok = z * 8 * NT + nt * 8 + (lane >> 2);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (tok < n_tok)
            v = load_x8_f16<In>(x + (size_t)tok * K + kb * 256 + quad_x_off(sp, lane & 3));
        xp[i] = v;
    }
}

// The two tensor-core tiles' common setup: row references of a warp's MT m-tiles (rows g and
// g+8 of each; rows past the end read the last row, never emitted) and zeroed accumulators.
template <int SOA, int MT>
__device__ __forceinline__ void warp_rows(const Weight& w, int wrow, int g, RowRef (&rr)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
            rr[mt][hr] = row_ref<SOA>(w, min(wrow + mt * 16 + g + 8 * hr, w.rows - 1));
}
// One K block of a warp's MT m-tiles (rows g and g+8 of each), and the double buffer's step:
// this block's weights from `nxt`, whose loads of the next block are issued.
template <int SOA, int MT>
__device__ __forceinline__ void warp_load(Raw (&dst)[MT][2], const RowRef (&rr)[MT][2], int kb,
                                          int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) dst[mt][hr] = load_raw<SOA>(rr[mt][hr], kb, t);
}
template <int SOA, int P, int MT>
__device__ __forceinline__ void warp_load_part(Raw (&dst)[MT][2], const RowRef (&rr)[MT][2],
                                               int kb, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) load_raw_part<SOA, P>(dst[mt][hr], rr[mt][hr], kb, t);
}
// The K-slice tiles' first block: its register loads after the activation staging
// (Q6SERVE_KS_XFIRST 1, session 27; 0: before it, sessions 4-26, kept for bench A/Bs). Session
// 23 read the staging's 3.4-3.7 us at N=16 as its L2 reads waiting behind every warp's opening
// DRAM requests; bench/wg_ab.py on the H200 (session 27, bundle A): 1.010-1.056x on the N = 8/16
// cells, the same bits (docs/KERNELS.md "Session 27": there also a form that issued them
// between the staging's loads and stores, and an L2 prefetch of the next blocks at the start,
// both left out).
#ifndef Q6SERVE_KS_XFIRST
#define Q6SERVE_KS_XFIRST 1
#endif
template <class T, int MT>
__device__ __forceinline__ void warp_take(T (&dst)[MT][2], const T (&src)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) dst[mt][hr] = src[mt][hr];
}
template <class T, int MT, int NT>
__device__ __forceinline__ void zero_acc(T (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = T(0);
}

// A thread's items of a CTA-wide strided loop over nrows x per items (i = threadIdx.x, +=
// blockDim.x), as (row, c), stepped without a division per item.
struct Walk {
    int row, c, drow, dc, per;
    __device__ __forceinline__ explicit Walk(int per_) : per(per_) {
        row = threadIdx.x / per;
        c = threadIdx.x - row * per;
        drow = blockDim.x / per;
        dc = blockDim.x - drow * per;
    }
    __device__ __forceinline__ void next() {
        c += dc;
        row += drow;
        if (c >= per) {
            c -= per;
            ++row;
        }
    }
};

// CTA-wide staging of nrows x per items into shared memory with U loads in flight per thread
// before any is stored: ld(row, c) loads item (row, c) of rows < nload without branching (a
// load behind a branch cannot be hoisted), st(row, c, v) stores it; rows nload.. (tokens past
// n_tok) are zero-filled without loads. (A plain strided loop compiles to one load and its
// dependent store per iteration, a whole L2 round trip each: q6k_ks_f16<8> staged its 164 KB
// as 40 such steps per thread on the H200.)
template <int U, class Ld, class St>
__device__ __forceinline__ void stage_items(int nload, int nrows, int per, Ld ld, St st) {
    typedef decltype(ld(0, 0)) V;
    Walk w(per);
    while (w.row < nload) {
        V v[U];
        int vr[U], vc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            vr[u] = w.row;
            vc[u] = w.c;
            v[u] = ld(min(w.row, nload - 1), w.c);  // past the end: a valid item, not stored
            w.next();
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (vr[u] < nload) st(vr[u], vc[u], v[u]);
    }
    for (Walk z(per); z.row < nrows - nload; z.next()) st(nload + z.row, z.c, V{});
}

// The CTA's activations of tokens tok0.. (8*NT of them, zero past n_tok) and K blocks
// [kb0, kb0+nblk) into smem_x as f16 in fragment order: [token][block][sp][t] 16 bytes, token
// rows padded by 64 bytes (4 uint4) so the 16-byte reads of a quarter-warp (two tokens, four t)
// hit distinct banks. BATCH (the K-slice tiles, whose CTAs stage up to 164 KB): four items'
// loads in flight per thread (stage_items); else the plain strided loop, one load and its store
// per item, which the many short CTAs of q6k_mma_f16 (1-2 items per thread) ran faster on the
// H200. (Eight loads in flight, and cp.async copies of the f16 activations, measured slower
// still; bench/RESULTS.md, issue 16 fourth session.)
// Loads in flight per thread in the K-slice tiles' activation staging (stage_x_f16 with BATCH,
// and q6k_wgmma.cu's wg_stage_x): Q6SERVE_STAGE_U at 4 and 8 n-tiles (N = 17..64), _SMALL at
// 1 and 2. Session 22's per-warp timestamps of the wgmma tile at N=64 (bench/wg_ab.py --trace,
// H200) put the staging at 5.8-9.6 us of a 12.5-35 us kernel with 4 in flight: 16 items per
// thread in 4 dependent L2 round trips while the SM's weight stream waits; 16 in flight stage a
// 3-block slice in one (ptxas sm_90 / sm_90a: no spills in the pair-stream instantiations;
// bundle C: 1.025-1.06x on the N = 32 / 64 cells of src 4 and 8, 0.994 on 18944x3584 N=64, the
// same bits; the staging itself only ~0.5 us shorter: docs/KERNELS.md "Session 22"). At 1
// and 2 n-tiles (N <= 16) it stays 4 (those cells were not measured with more; 16 spilled
// there: q6k_ks_f16<1 / 2, .., 8 / 16>, 128 registers). A bench A/B may set other values
// before this file (as bench/wg_ab.py's variants do; session 4 measured 8 slower on the
// K-slice tile of its day, bench/RESULTS.md).
#ifndef Q6SERVE_STAGE_U
#define Q6SERVE_STAGE_U 16
#endif
#ifndef Q6SERVE_STAGE_U_SMALL
#define Q6SERVE_STAGE_U_SMALL 4
#endif
template <int NT>
__host__ __device__ constexpr int stage_u() {
    return NT >= 4 ? Q6SERVE_STAGE_U : Q6SERVE_STAGE_U_SMALL;
}
template <int NT, class In, bool BATCH>
__device__ __forceinline__ void stage_x_f16(const typename In::T* x, int K, int n_tok, int tok0,
                                            int kb0, int nblk) {
    const int per_tok = nblk * 32, tstride = per_tok + 4;
    if (BATCH) {
        stage_items<stage_u<NT>()>(min(8 * NT, n_tok - tok0), 8 * NT, per_tok,
                                   [&](int tk, int c) -> uint4 {
            const int b = c >> 5, sp = (c >> 2) & 7, tt = c & 3;
            return load_x8_f16<In>(x + (size_t)(tok0 + tk) * K + (kb0 + b) * 256 +
                                   quad_x_off(sp, tt));
        }, [&](int tk, int c, const uint4& v) { smem_x[tk * tstride + c] = v; });
    } else {
        for (int i = threadIdx.x; i < 8 * NT * per_tok; i += blockDim.x) {
            const int tk = i / per_tok, rem = i - tk * per_tok;
            const int b = rem >> 5, sp = (rem >> 2) & 7, tt = rem & 3;
            const int tok = tok0 + tk;
            smem_x[tk * tstride + rem] =
                tok < n_tok ? load_x8_f16<In>(x + (size_t)tok * K + (kb0 + b) * 256 +
                                              quad_x_off(sp, tt))
                            : make_uint4(0, 0, 0, 0);
        }
    }
}

// Where a thread of a row-split tile (q6k_mma_f16, q6k_mmq_q8) stands: lane, warp,
// fragment coordinates (g, t), the CTA's rows [row0, row0 + rows_cta) (blockDim.x/32 warps of
// MT m-tiles), the warp's first row, the token chunk's first token (toks_cta a chunk) and the
// CTA's K blocks [kb0, kb1).
struct TilePos {
    int lane, warp, g, t, rows_cta, row0, wrow, tok0, kb0, kb1;
};
template <int MT>
__device__ __forceinline__ TilePos tile_pos(int bpr, int toks_cta) {
    TilePos p;
    p.lane = threadIdx.x & 31;
    p.warp = threadIdx.x >> 5;
    p.g = p.lane >> 2;
    p.t = p.lane & 3;
    p.rows_cta = (blockDim.x >> 5) * 16 * MT;
    p.row0 = blockIdx.x * p.rows_cta;
    p.wrow = p.row0 + p.warp * 16 * MT;
    p.tok0 = blockIdx.z * toks_cta;
    k_range(bpr, p.kb0, p.kb1);
    return p;
}

// A row-split tile's start: the thread's position, its warp's row references and zeroed
// accumulators.
template <int SOA, int MT, int NT>
__device__ __forceinline__ TilePos tile_start(const Weight& w, int toks_cta, RowRef (&rr)[MT][2],
                                              float (&acc)[MT][NT][4]) {
    const TilePos tp = tile_pos<MT>(w.bpr, toks_cta);
    warp_rows<SOA>(w, tp.wrow, tp.g, rr);
    zero_acc(acc);
    return tp;
}

// The end of a warp tile of the tensor-core tiles (MT m-tiles x NT n-tiles from row wrow and
// token tok0, the mma.sync C layout): y, or with K slices this slice's partial sums (emit).
template <int NT, int MT>
__device__ __forceinline__ void ks_emit(const Out& o, int rows, int wrow, int tok0,
                                        const float (&acc)[MT][NT][4], int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                emit(o, rows, wrow + mt * 16 + g + 8 * (i >> 1), tok0 + nt * 8 + 2 * t + (i & 1),
                     acc[mt][nt][i]);
}

struct NoMid {
    __device__ __forceinline__ void operator()() const {}
};
// One 256-block of a warp's MT m-tiles x NT n-tiles: acc = d * (acc / d + A.B) per row, with
// A = f16(sc*(q-32)) built once per weight from `raw` (lane quad order) and B = bx(sp, nt),
// the lane's 16-byte activation fragment of step pair sp. A zero d masks the block. mid() runs
// when the first half's steps are done (raw's ql[0]/qh[0] are dead: the split prefetch).
// LAY 2 (pair streams): one shift or byte permute, one LOP3 and one HFMA2 per A pair (deq2p;
// the same A bits as deq2, so the same results as the SoA twin on the same grid).
template <int NT, int MT, int LAY = 1, class BX, class MID = NoMid>
__device__ __forceinline__ void block_mma(float (&acc)[MT][NT][4], const Raw (&raw)[MT][2],
                                          int t, BX bx_of, MID mid = MID()) {
    constexpr bool F4 = LAY == 2;  // scales as sc/4 pairs with the -288 sc bias
    const u32 magic = LAY == 2 ? kPairMagic : 0u;
    const int qsh = 2 * (t >> 1);
    const u32 scsel = 0x4040u | (u32)t | ((u32)t << 8);  // sc_pair: scale byte t, both halves
    float dmul[MT][2];
    u32 sc2[MT][2][4], bias[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const float d = f16_to_f32(raw[mt][hr].d);
            const bool zero = (d == 0.f);  // a zero block adds nothing: mask it, scale by 1
            dmul[mt][hr] = zero ? 1.f : d;
            const float inv = zero ? 1.f : rcp_approx(d);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                acc[mt][nt][2 * hr] *= inv;
                acc[mt][nt][2 * hr + 1] *= inv;
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 v = word4(raw[mt][hr].sc, k);
                sc2[mt][hr][k] = zero ? 0u : F4 ? sc4_pair(v, scsel) : sc_pair(v, scsel);
                bias[mt][hr][k] = F4 ? bias_pair(sc2[mt][hr][k]) : 0u;
            }
        }
#pragma unroll
    for (int sp = 0; sp < 8; ++sp) {
        const int h = sp >> 2, nib = (sp >> 1) & 1, jj = sp & 1;
        if (sp == 4) mid();
        uint4 bx[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) bx[nt] = bx_of(sp, nt);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int j = 2 * jj + u;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u32 s0 = sc2[mt][0][2 * h + nib], s1 = sc2[mt][1][2 * h + nib];
                u32 a0, a1, a2, a3;
                if (LAY == 2) {
                    const int m = 2 * h + nib;
                    const u32 c0 = bias[mt][0][m], c1 = bias[mt][1][m];
                    a0 = deq2p(pair_field(raw[mt][0], m, 2 * j), s0, c0, magic);
                    a1 = deq2p(pair_field(raw[mt][1], m, 2 * j), s1, c1, magic);
                    a2 = deq2p(pair_field(raw[mt][0], m, 2 * j + 1), s0, c0, magic);
                    a3 = deq2p(pair_field(raw[mt][1], m, 2 * j + 1), s1, c1, magic);
                } else {
                    const u32 q0 = quad_q(raw[mt][0], h, nib, j, qsh);
                    const u32 q1 = quad_q(raw[mt][1], h, nib, j, qsh);
                    a0 = deq2<0x4140u>(q0, s0);
                    a1 = deq2<0x4140u>(q1, s1);
                    a2 = deq2<0x4342u>(q0, s0);
                    a3 = deq2<0x4342u>(q1, s1);
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    mma_f16(acc[mt][nt], a0, a1, a2, a3, u ? bx[nt].z : bx[nt].x,
                            u ? bx[nt].w : bx[nt].y);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] *= dmul[mt][i >> 1];
}

// ---------------------------------------------------------------------------------------------
// F16 tensor-core tile. CTA = blockDim.x/32 warps, each MT m-tiles of 16 rows x all 8*NT tokens
// of chunk blockIdx.z, over the K blocks of split blockIdx.y. Activations (SRC): 2 staged once
// per CTA into shared memory in fragment order (stage_x_f16), 3 the q6k_prep_f16 buffer copied
// block by block into two shared-memory stages with cp.async (the next block lands during this
// one). Each block's weights are loaded at the block's start (no double buffer: the prefetch
// variant lost every tuned cell and left, session 15). (SRC 0, x read in the loop, and 1, the
// prepass read through L1, left with the K-slice tiles: no table entry or heuristic picked them.)
template <int NT, int MT, int SOA, int SRC, class In, bool PF = false>
__global__ void __launch_bounds__(256) q6k_mma_f16(PARAMS_W, const typename In::T* x, int K,
                                                    const uint4* xp, PARAMS_OUT) {
    MAKE_W;
    MAKE_OUT;
    RowRef rr[MT][2];
    float acc[MT][NT][4];
    const TilePos tp = tile_start<SOA>(w, 8 * NT, rr, acc);
    const int lane = tp.lane, g = tp.g, t = tp.t, wrow = tp.wrow, tok0 = tp.tok0;
    const int kb0 = tp.kb0, kb1 = tp.kb1;
    static_assert(SRC == 2 || SRC == 3, "activation sources: 2 staged, 3 streamed prepass");
    constexpr int STAGE = NT * 256;  // uint4 of one block's activations (SRC 3)
    const uint4* xpz = xp + (size_t)blockIdx.z * w.bpr * STAGE;

    const int tstride = (kb1 - kb0) * 32 + 4;  // uint4 per token row of smem_x
    static_assert(!PF || SRC == 2, "PF (the first block early) is src 2's");
    if (PF) {
        // The first block's weight loads are issued before the activations are staged, so their
        // DRAM latency overlaps the staging's round trip and barrier (as the K-slice tiles do).
        // The first block is peeled (a `first` live in the loop would hold its registers
        // through every block_mma). Same math, same bits as PF = false. Per table cell: on the
        // H200 it ran 18944x3584 N = 1/2 1.02-1.04x, 4096x14336 and 3584x18944 0.95-0.98x
        // (session 17, docs/KERNELS.md).
        const auto bx = [&](int kb) {
            return [&, kb](int sp, int nt) -> uint4 {
                return smem_x[(nt * 8 + g) * tstride + (kb - kb0) * 32 + sp * 4 + t];
            };
        };
        if (kb0 < kb1) {
            Raw first[MT][2];
            warp_load<SOA>(first, rr, kb0, t);
            stage_x_f16<NT, In, false>(x, K, o.n_tok, tok0, kb0, kb1 - kb0);
            __syncthreads();
            block_mma<NT, MT, SOA>(acc, first, t, bx(kb0));
        } else {
            __syncthreads();  // (as PF = false: the staging's barrier)
        }
        for (int kb = kb0 + 1; kb < kb1; ++kb) {
            Raw raw[MT][2];
            warp_load<SOA>(raw, rr, kb, t);
            block_mma<NT, MT, SOA>(acc, raw, t, bx(kb));
        }
    } else {
        if (SRC == 2) {
            stage_x_f16<NT, In, false>(x, K, o.n_tok, tok0, kb0, kb1 - kb0);
            __syncthreads();
        }
        if (SRC == 3 && kb0 < kb1) {
            for (int i = threadIdx.x; i < STAGE; i += blockDim.x)
                cp_async16(smem_x + i, xpz + (size_t)kb0 * STAGE + i);
            cp_async_commit();
        }
        for (int kb = kb0; kb < kb1; ++kb) {
            const uint4* stage = smem_x + ((kb - kb0) & 1) * STAGE;
            if (SRC == 3) {
                if (kb + 1 < kb1) {
                    uint4* nxt_stage = smem_x + ((kb + 1 - kb0) & 1) * STAGE;
                    for (int i = threadIdx.x; i < STAGE; i += blockDim.x)
                        cp_async16(nxt_stage + i, xpz + (size_t)(kb + 1) * STAGE + i);
                    cp_async_commit();
                    cp_async_wait<1>();
                } else {
                    cp_async_wait<0>();
                }
                __syncthreads();
            }
            Raw raw[MT][2];
            warp_load<SOA>(raw, rr, kb, t);

            block_mma<NT, MT, SOA>(acc, raw, t, [&](int sp, int nt) -> uint4 {
                if (SRC == 3) return stage[(nt * 8 + sp) * 32 + lane];
                return smem_x[(nt * 8 + g) * tstride + (kb - kb0) * 32 + sp * 4 + t];
            });
            if (SRC == 3) __syncthreads();  // every warp is done with this stage before its refill
        }
    }
    ks_emit<NT, MT>(o, w.rows, wrow, tok0, acc, lane);
    finish_split(o, w.rows, tp.row0, tp.rows_cta, tok0, 8 * NT);
}

// Where a thread of a K-slice tile stands: lane, warp, fragment coordinates (g, t), the token
// chunk's first token, and the CTA's K slice [kb0, kb0 + nblk).
struct KsPos {
    int lane, warp, g, t, tok0, kb0, nblk;
};
// Every K-slice tile (src 4, 7, 8) starts here, so this is where it lets its split-K sum
// launch (PDL; q6k_sum_parts waits for the tile's results itself).
template <int NT>
__device__ __forceinline__ KsPos ks_pos(int bpr) {
    pdl_launch_dependents();
    KsPos p;
    p.lane = threadIdx.x & 31;
    p.warp = threadIdx.x >> 5;
    p.g = p.lane >> 2;
    p.t = p.lane & 3;
    p.tok0 = blockIdx.z * 8 * NT;
    int kb1;
    k_range(bpr, p.kb0, kb1);
    p.nblk = kb1 - p.kb0;
    return p;
}

// The K-slice tiles end a warp tile with ks_emit: y directly (one K slice), else this slice's
// partial sums part[ky][n_tok][rows], added by q6k_sum_parts after the kernel. (A first
// version let the last warp of each tile's slices add them, behind an atomic ticket: every
// tile then waited an atomic round trip and the adding warp a chain of L2 loads; on the H200
// the K-slice tiles took 140-270 us at N=64 on 4096x14336, ncu: 4-7% DRAM throughput.)

// Split-K epilogue of the K-slice tiles: y[i] = part[0][i] + ... + part[ks-1][i] in slice order
// (results never depend on timing), i < total = n_tok * rows; four slices' loads in flight
// before they are added. Session 20: from SUM_VEC_MIN outputs on (total a multiple of 4, both
// pointers 16-byte aligned), four outputs per thread (16-byte loads and store) and the
// remainder's slices (ks mod 4) loaded together before they are added: the same adds in the
// same order per output, so the same bits (bench/sum_ab.py on the H200: 1.02-1.53x on the cells
// of >= 151552 outputs, 0.85-0.97x on the small ones, which therefore keep one float per thread;
// Launcher.steps sizes the grid alike, launch.SUM_VEC_MIN).
constexpr long long SUM_VEC_MIN = 1 << 18;
__device__ __forceinline__ void add4(float4& s, const float4& v) {
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
}
extern "C" __global__ void __launch_bounds__(256) q6k_sum_parts(const float* part, float* y,
                                                                 int ks, long long total) {
    pdl_wait();  // launched with PDL (Launcher.pdl): the tile's partials are complete past this
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (total >= SUM_VEC_MIN && (total & 3) == 0 &&
        ((reinterpret_cast<size_t>(part) | reinterpret_cast<size_t>(y)) & 15) == 0) {
        const long long t4 = total >> 2;
        const float4* part4 = reinterpret_cast<const float4*>(part);
        for (long long i = i0; i < t4; i += stride) {
            const float4* p = part4 + i;
            float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
            int k = 0;
            for (; k + 4 <= ks; k += 4) {
                const float4 v0 = p[k * t4], v1 = p[(k + 1) * t4];
                const float4 v2 = p[(k + 2) * t4], v3 = p[(k + 3) * t4];
                add4(s, v0);
                add4(s, v1);
                add4(s, v2);
                add4(s, v3);
            }
            const int r = ks - k;  // 0..3: loaded together, added in order
            float4 v0 = s, v1 = s, v2 = s;
            if (r > 0) v0 = p[k * t4];
            if (r > 1) v1 = p[(k + 1) * t4];
            if (r > 2) v2 = p[(k + 2) * t4];
            if (r > 0) add4(s, v0);
            if (r > 1) add4(s, v1);
            if (r > 2) add4(s, v2);
            reinterpret_cast<float4*>(y)[i] = s;
        }
        return;
    }
    for (long long i = i0; i < total; i += stride) {  // session 19's loop
        const float* p = part + i;
        float s = 0.f;
        int k = 0;
        for (; k + 4 <= ks; k += 4) {
            const float v0 = p[k * total], v1 = p[(k + 1) * total];
            const float v2 = p[(k + 2) * total], v3 = p[(k + 3) * total];
            s += v0;
            s += v1;
            s += v2;
            s += v3;
        }
        for (; k < ks; ++k) s += p[k * total];
        y[i] = s;
    }
}

// Thread-block clusters (sm_90+): the barrier of all the cluster's threads, and a float2 from
// the shared memory of the cluster's CTA ``rank`` at the address ``p`` has in this CTA.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
#endif
}
__device__ __forceinline__ float2 ld_cluster_f2(const float2* p, u32 rank) {
    float2 v = make_float2(0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    u32 ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(smem_u32(p)), "r"(rank));
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(ra)
                 : "memory");
#endif
    return v;
}
// The partial-sum area of the cluster form: after the activation slice of the widest K slice
// (the same offset in every CTA of the cluster), float2 [warp][mt][nt][h][lane] = the tokens
// (2t, 2t+1) of row g + 8h of m-tile mt, n-tile nt.
template <int NT>
__device__ __forceinline__ float2* ks_cluster_area(int bpr) {
    const int per = (bpr + gridDim.y - 1) / gridDim.y;
    return reinterpret_cast<float2*>(smem_x + 8 * NT * (per * 32 + 4));
}
template <int NT, int MT>
__device__ __forceinline__ void ks_cluster_put(const float (&acc)[MT][NT][4], int warp, int lane,
                                               int bpr) {
    float2* red = ks_cluster_area<NT>(bpr);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                red[(((warp * MT + mt) * NT + nt) * 2 + h) * 32 + lane] =
                    make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
}
// wt0: the CTA's first warp tile of this round (warp w's is wt0 + w).
template <int NT, int MT, int NW, int KC>
__device__ __forceinline__ void ks_cluster_emit(const Out& o, int rows, int wt0, int tok0,
                                                int bpr) {
    const float2* red = ks_cluster_area<NT>(bpr);
    cluster_sync();  // every CTA's partials of this round are in its shared memory
    constexpr int E = NW * MT * NT * 2 * 32, C = KC > 0 ? KC : 1;
    const int r = (int)blockIdx.y;  // cluster rank = blockIdx.y (cluster dims 1 x KC)
    const int e1 = (r + 1) * E / C;
    for (int e = r * E / C + (int)threadIdx.x; e < e1; e += (int)blockDim.x) {
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int q = 0; q < KC; ++q) {  // slice order, as q6k_sum_parts
            const float2 v = ld_cluster_f2(red + e, (u32)q);
            s0 += v.x;
            s1 += v.y;
        }
        const int lane = e & 31, idx = e >> 5, h = idx & 1, nt = (idx >> 1) % NT;
        const int mt = (idx >> 1) / NT % MT, wq = idx / (2 * NT * MT);
        const int row = (wt0 + wq) * 16 * MT + mt * 16 + (lane >> 2) + 8 * h;
        const int tok = tok0 + nt * 8 + 2 * (lane & 3);
        if (row < rows) {
            if (tok < o.n_tok) o.y[(size_t)tok * rows + row] = s0;
            if (tok + 1 < o.n_tok) o.y[(size_t)(tok + 1) * rows + row] = s1;
        }
    }
    cluster_sync();  // every CTA has read the partials before any is overwritten or leaves
}

// ---------------------------------------------------------------------------------------------
// K-slice tile (issue 16, N = 9..64): the F16 numerics of q6k_mma_f16 with each weight unpacked
// once per call and no CTA barrier in the weight loop. CTA (blockIdx.x, K slice blockIdx.y,
// token chunk blockIdx.z) stages the activations of its slice for its 8*NT tokens once in
// shared memory (stage_x_f16, one barrier); then every warp streams, on its own, the warp tiles
// (16*MT rows) wt = blockIdx.x*NW + warp + i*gridDim.x*NW through the slice: each lane loads its
// weight bytes with 16-byte loads (load_raw), the next block's - of this tile or the next - in
// flight during this block's math (PF), and each A fragment feeds NT mma.sync while each
// activation fragment read from shared memory feeds MT m-tiles. The grid is at most one wave
// (gridDim.x*gridDim.y*gridDim.z CTAs resident), so a CTA stages its activations once for all
// the rows it owns: activation traffic ~ 8*NT*512 bytes per CTA per block instead of per 128
// rows. ks == 1 writes y; otherwise partial sums part[ky][n_tok][rows], which q6k_sum_parts
// adds in order 0..ks-1 after the kernel, so results never depend on timing (and the SoA/AoS
// twins, same grid, stay bit-identical).
// NW warps per CTA. Registers: with 8 warps, 2 CTAs per SM for the narrow shapes (NT*MT <= 2:
// <= 128 registers; q6k_ks_f16<2> spills there), the rest 1 (up to 255); 12 warps: one CTA of
// <= 168 registers (12 warps per SM without the spills); 16 warps: one CTA of <= 128 (as two
// 8-warp CTAs, but one activation slice per SM instead of two).
// KC: 0, the kernel q6k_ks_f16 (ks == 1 writes y, else partial sums for q6k_sum_parts); > 0,
// q6k_ksc_f16 (below): the KC K slices of a row group are one thread-block cluster and add
// their partial sums through distributed shared memory (ks_cluster_emit), no second launch.
template <int NT, int MT, int SOA, class In, int NW, int KC>
__device__ __forceinline__ void ks_body(PARAMS_W, const typename In::T* x, int K,
                                        PARAMS_OUT) {
    MAKE_W;
    MAKE_OUT;
    const KsPos ps = ks_pos<NT>(w.bpr);
    const int lane = ps.lane, warp = ps.warp, g = ps.g, t = ps.t, tok0 = ps.tok0;
    const int kb0 = ps.kb0, nblk = ps.nblk;
    const int wtiles = (w.rows + 16 * MT - 1) / (16 * MT);
    const int wstride = gridDim.x * NW;
    int wt = blockIdx.x * NW + warp;
    // CTA-uniform: no barrier is skipped by part of a CTA (the cluster form's plan gives
    // every slice blocks: a CTA leaving early would hang its cluster's barriers)
    if (KC == 0 && nblk <= 0) return;

    RowRef rr[MT][2], rn[MT][2];
    Raw nxt[MT][2];
    constexpr bool XF = Q6SERVE_KS_XFIRST;
    if (wt < wtiles) {
        warp_rows<SOA>(w, wt * 16 * MT, g, rr);
        if (!XF) warp_load<SOA>(nxt, rr, kb0, t);
    }
    // The first block's weight loads: before the staging (XFIRST 0, sessions 4-26: in flight
    // while the CTA stages its activations) or after it (1, session 27).
    stage_x_f16<NT, In, true>(x, K, o.n_tok, tok0, kb0, nblk);
    if (XF && wt < wtiles) warp_load<SOA>(nxt, rr, kb0, t);
    __syncthreads();
    const int tstride = nblk * 32 + 4;

    // SPLIT: the next block in two parts (load_raw_part), 4 and 8 n-tiles only (see there).
    constexpr bool SPLIT = NT >= 4;
    // KC > 0: every warp runs the CTA's rounds (wt - warp is the CTA's first warp tile of the
    // round), a warp without a tile in the last round only joins its cluster's sum
    for (; (KC > 0 ? wt - warp : wt) < wtiles; wt += wstride) {
      if (KC == 0 || wt < wtiles) {
        const int wrow = wt * 16 * MT;
        const bool more = wt + wstride < wtiles;
        if (!SPLIT && more) warp_rows<SOA>(w, (wt + wstride) * 16 * MT, g, rn);
        float acc[MT][NT][4];
        zero_acc(acc);
        for (int b = 0; b < nblk; ++b) {
            const auto bx = [&](int sp, int nt) -> uint4 {
                return smem_x[(nt * 8 + g) * tstride + b * 32 + sp * 4 + t];
            };
            Raw raw[MT][2];
            const bool in_tile = b + 1 < nblk;  // else the warp's next tile's first block
            if (SPLIT) {
                // the first half's codes now, the rest once this block's first half is done
                warp_take(raw, nxt);
                if (!in_tile && more) warp_rows<SOA>(w, (wt + wstride) * 16 * MT, g, rn);
                if (in_tile)
                    warp_load_part<SOA, 0>(nxt, rr, kb0 + b + 1, t);
                else if (more)
                    warp_load_part<SOA, 0>(nxt, rn, kb0, t);
                block_mma<NT, MT, SOA>(acc, raw, t, bx, [&] {
                    if (in_tile)
                        warp_load_part<SOA, 1>(nxt, rr, kb0 + b + 1, t);
                    else if (more)
                        warp_load_part<SOA, 1>(nxt, rn, kb0, t);
                });
                continue;
            }
            warp_take(raw, nxt);
            if (in_tile)
                warp_load<SOA>(nxt, rr, kb0 + b + 1, t);
            else if (more)
                warp_load<SOA>(nxt, rn, kb0, t);
            block_mma<NT, MT, SOA>(acc, raw, t, bx);
        }
        if (more) warp_take(rr, rn);
        if (KC == 0)
            ks_emit<NT, MT>(o, w.rows, wrow, tok0, acc, lane);
        else
            ks_cluster_put<NT, MT>(acc, warp, lane, w.bpr);
      }  // (a warp without a tile puts nothing: its rows are past w.rows, never written)
      if (KC > 0) ks_cluster_emit<NT, MT, NW, KC>(o, w.rows, wt - warp, tok0, w.bpr);
    }
}

template <int NT, int MT, int SOA, class In, bool PF, int NW>
__global__ void __launch_bounds__(32 * NW, NW == 8 && NT * MT <= 2 ? 2 : 1)
    q6k_ks_f16(PARAMS_W, const typename In::T* x, int K, const uint4* xp, PARAMS_OUT) {
    (void)xp;  // the kernel reads x itself (same signature as q6k_mma_f16)
    static_assert(PF, "the K-slice tile always has its register prefetch (session 30)");
    ks_body<NT, MT, SOA, In, NW, 0>(slabs, rows, bpr, rps, x, K, y, part, tickets, n_tok);
}

// The K-slice tile with its split-K sum inside a thread-block cluster (src 7; sm_90+; session
// 15's experiment on the fixed cost of N <= 16): the grid's KC K slices of each row group and
// token chunk are one cluster (gridDim.y == KC, so cluster rank = blockIdx.y = the slice). After
// each round of warp tiles every CTA puts its partial sums in its own shared memory
// (ks_cluster_put, after the activation slice), the cluster meets at a barrier, and CTA r adds
// the r-th 1/KC of the tile's outputs from all KC CTAs' shared memory in slice order 0..KC-1
// (ld.shared::cluster), the order and float adds of q6k_sum_parts (the same bits as src 4 at
// ksplit KC), and writes y; a second barrier keeps every CTA's partials alive until they are
// read. No partial sums in global memory, no second launch.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define Q6_CLUSTER_DIMS(x, y, z)  // no clusters before sm_90 (the plan runs src 4 there)
#else
#define Q6_CLUSTER_DIMS(x, y, z) __cluster_dims__(x, y, z)
#endif
template <int NT, int MT, int SOA, class In, bool PF, int NW, int KC>
__global__ void Q6_CLUSTER_DIMS(1, KC, 1) __launch_bounds__(32 * NW, NW == 8 && NT * MT <= 2 ? 2 : 1)
    q6k_ksc_f16(PARAMS_W, const typename In::T* x, int K, const uint4* xp, PARAMS_OUT) {
    (void)xp;
    static_assert(PF, "the K-slice tile always has its register prefetch (session 30)");
    ks_body<NT, MT, SOA, In, NW, KC>(slabs, rows, bpr, rps, x, K, y, part, tickets, n_tok);
}

// ---------------------------------------------------------------------------------------------
// Exact f32 matvec: CTA = blockDim.x/32 warps x 16 rows, TOK tokens of chunk blockIdx.z.
// Per lane and block: part = sum over its 64 weights of (sc*(q-32)) * x (exact weight factors,
// f32 FMAs), acc += d * part; the 4 lanes of a row are added at the end.
// The CTA first stages its activations in shared memory ([tok][block][sp][t] 8 floats).
template <int TOK, int SOA, class In, bool PF>
__global__ void __launch_bounds__(256) q6k_exact(PARAMS_W, const typename In::T* x, int K,
                                                  PARAMS_OUT) {
    MAKE_W;
    MAKE_OUT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3, qsh = 2 * (t >> 1);
    const int rows_cta = nw * 16;
    const int row0 = blockIdx.x * rows_cta;
    const int wrow = row0 + warp * 16;
    const int tok0 = blockIdx.z * TOK;
    int kb0, kb1;
    k_range(w.bpr, kb0, kb1);
    RowRef rr[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) rr[hr] = row_ref<SOA>(w, min(wrow + g + 8 * hr, w.rows - 1));
    float acc[2][TOK];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int n = 0; n < TOK; ++n) acc[hr][n] = 0.f;

    Raw nxt[2];
    if (PF && kb0 < kb1) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) nxt[hr] = load_raw<SOA>(rr[hr], kb0, t);
    }
    float4* xs = reinterpret_cast<float4*>(smem_x);
    const int nblk = kb1 - kb0;
    for (int i = threadIdx.x; i < TOK * nblk * 64; i += blockDim.x) {
        const int n = i / (nblk * 64), rem = i - n * (nblk * 64);
        const int b = rem >> 6, sp = (rem >> 3) & 7, tt = (rem >> 1) & 3, hf = rem & 1;
        xs[i] = tok0 + n < o.n_tok
                    ? load_x4_f32<In>(x + (size_t)(tok0 + n) * K + (kb0 + b) * 256 +
                                      quad_x_off(sp, tt) + 4 * hf)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncthreads();
    for (int kb = kb0; kb < kb1; ++kb) {
        Raw raw[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            if (PF) {
                raw[hr] = nxt[hr];
                if (kb + 1 < kb1) nxt[hr] = load_raw<SOA>(rr[hr], kb + 1, t);
            } else {
                raw[hr] = load_raw<SOA>(rr[hr], kb, t);
            }
        }
        float part[2][TOK];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
            for (int n = 0; n < TOK; ++n) part[hr][n] = 0.f;
#pragma unroll
        for (int sp = 0; sp < 8; ++sp) {
            const int h = sp >> 2, nib = (sp >> 1) & 1, jj = sp & 1;
            float4 xv[TOK][2];
#pragma unroll
            for (int n = 0; n < TOK; ++n) {
                const float4* p = xs + ((n * nblk + (kb - kb0)) * 8 + sp) * 8 + t * 2;
                xv[n][0] = p[0];
                xv[n][1] = p[1];
            }
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const float scf = (float)quad_sc(raw[hr], 2 * h + nib, t);
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const u32 q = quad_q<SOA>(raw[hr], h, nib, 2 * jj + u, qsh);
                    const float w0 = q_to_f32<0>(q) * scf, w1 = q_to_f32<1>(q) * scf;
                    const float w2 = q_to_f32<2>(q) * scf, w3 = q_to_f32<3>(q) * scf;
#pragma unroll
                    for (int n = 0; n < TOK; ++n) {
                        const float4 v = xv[n][u];
                        float p = part[hr][n];
                        p = fmaf(w0, v.x, p);
                        p = fmaf(w1, v.y, p);
                        p = fmaf(w2, v.z, p);
                        p = fmaf(w3, v.w, p);
                        part[hr][n] = p;
                    }
                }
            }
        }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const float d = f16_to_f32(raw[hr].d);
#pragma unroll
            for (int n = 0; n < TOK; ++n) acc[hr][n] = fmaf(d, part[hr][n], acc[hr][n]);
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int n = 0; n < TOK; ++n) {
            float v = acc[hr][n];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if ((n & 3) == t) emit(o, w.rows, wrow + g + 8 * hr, tok0 + n, v);
        }
    finish_split(o, w.rows, row0, rows_cta, tok0, TOK);
}

// ---------------------------------------------------------------------------------------------
// q8_1 activations (ggml's quantize_row_q8_1_ref, bit for bit) in int8-fragment order:
//   xq[z][kb][nt][gq][lane] 16 bytes = for the 4 groups st = 4gq..4gq+3 of the block, the
//       4 int8 values 16*st + 4*(lane&3) + 0..3 of token z*8*NT + nt*8 + (lane>>2);
//   corr[z][kb][nt][st][8] = -32 * (sum of the 16 int8 of group st): the initial accumulator
//       that turns the u8 code product into sum((q-32)*a);
//   d8[z][kb][nt][qb][8] = the f16 block scale d as f32.
// One thread per (token slot, 32-block).
template <int NT, class In>
__global__ void __launch_bounds__(256) q6k_prep_q8_1(const typename In::T* x, int n_tok, int K,
                                                      int n_chunks, u32* xq, int* corr,
                                                      float* d8) {
    const int bpr = K >> 8;
    const long long total = (long long)n_chunks * bpr * NT * 64;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int g = (int)(i & 7), qb = (int)((i >> 3) & 7);
        int z, kb, nt;
        prep_pos<NT, 6>(i, bpr, z, kb, nt);
        const int tok = z * 8 * NT + nt * 8 + g;
        const size_t base = ((size_t)z * bpr + kb) * NT + nt;
        float v[32];
        float amax = 0.f;
        if (tok < n_tok) {
#pragma unroll
            for (int e = 0; e < 32; e += 4) {
                const float4 f = load_x4_f32<In>(x + (size_t)tok * K + kb * 256 + qb * 32 + e);
                v[e] = f.x;
                v[e + 1] = f.y;
                v[e + 2] = f.z;
                v[e + 3] = f.w;
            }
#pragma unroll
            for (int e = 0; e < 32; ++e) amax = fmaxf(amax, fabsf(v[e]));
        } else {
#pragma unroll
            for (int e = 0; e < 32; ++e) v[e] = 0.f;
        }
        const float d = amax / 127.0f;
        const float id = d != 0.f ? 1.0f / d : 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int st = 2 * qb + half;
            int sum = 0;
#pragma unroll
            for (int tt = 0; tt < 4; ++tt) {
                u32 word = 0;
#pragma unroll
                for (int i4 = 0; i4 < 4; ++i4) {
                    const int q = (int)roundf(__fmul_rn(v[half * 16 + 4 * tt + i4], id));
                    sum += q;
                    word |= ((u32)q & 0xFFu) << (8 * i4);
                }
                xq[((base * 4 + (st >> 2)) * 32 + (g * 4 + tt)) * 4 + (st & 3)] = word;
            }
            corr[(base * 16 + st) * 8 + g] = -32 * sum;
        }
        d8[(base * 8 + qb) * 8 + g] = f16_to_f32(f16_bits(d));
    }
}

// Weight words for the int8 mapping: lane t holds bytes 16*lh + 4t..+3 of each 16-group run.
struct Raw8 {
    u32 ql[8];  // [h][s&1][lh]
    u32 qh[4];  // [h][lh]
    u32 q[16];  // pair streams (SOA == 2): group st's four codes, one per byte
    uint4 sc;
    u32 d;
};

// Fields 2t and 2t+1 of both 48-bit streams of a pair-stream triple (w0, w1, w2) as four codes,
// one per byte: (low 2t, high 2t, low 2t+1, high 2t+1). Field P of a stream is bits 6P..6P+5
// of (w0, w1, w2)'s 16-bit halves end to end (pair_bits' cases), so lane t's two fields are
// stream bits 12t..12t+11: w0's (t=0), w0 bits 12-15 + w1 bits 0-7 (t=1), w1 bits 8-15 + w2
// bits 0-3 (t=2), w2 bits 4-15 (t=3), for both halves at once: one byte permute of (a, b) =
// (w0, w1) or (w1, w2) and a shift by 0 or 4 (PairSel: the lane's constants), the same
// instructions in every lane. (pair_bits(2t, ..) with the lane's t was a switch on a per-lane
// value, four ways divergent in every warp: the int8 tile ran ~4x slower on pair weights than
// on plain SoA, session 13's tune.)
struct PairSel {
    bool lo;  // t < 2: (w0, w1), else (w1, w2)
    u32 sel, sh;
    __device__ __forceinline__ explicit PairSel(int t)
        : lo(t < 2), sel(t == 0 ? 0x3210u : t == 3 ? 0x7654u : 0x6341u), sh(t & 1 ? 4u : 0u) {}
};
__device__ __forceinline__ u32 pair_codes4(u32 w0, u32 w1, u32 w2, const PairSel& ps) {
    const u32 v = __byte_perm(ps.lo ? w0 : w1, ps.lo ? w1 : w2, ps.sel) >> ps.sh;
    return __byte_perm(v & 0x003F003Fu, (v >> 6) & 0x003F003Fu, 0x6420u);
}

template <int SOA>
__device__ __forceinline__ Raw8 load_raw8(const RowRef& r, int b, int t) {
    Raw8 w;
    if (SOA == 2) {
        // Group st (elements 16st..16st+15, scale byte st) is sub-block m = st>>2 of the pair
        // lane tq = st&3; this lane's codes 4t..4t+3 of it are that lane's fields 2t and 2t+1.
        // Pair lane tq's 48 bytes in three 16-byte loads (every lane of a quad reads the same
        // row bytes: the whole row once per warp), its triples m = 0..3 taken from them.
        const u8* ql = r.base + r.ql + (u32)b * 128u;
        const u8* qh = r.base + r.qh + (u32)b * 64u;
        const PairSel sh(t);
#pragma unroll
        for (int tq = 0; tq < 4; ++tq) {
            const uint4 a = ldg_stream128(ql + 32 * tq), c = ldg_stream128(ql + 32 * tq + 16);
            const uint4 e = ldg_stream128(qh + 16 * tq);
            w.q[tq] = pair_codes4(a.x, a.y, e.x, sh);
            w.q[4 + tq] = pair_codes4(a.z, a.w, e.y, sh);
            w.q[8 + tq] = pair_codes4(c.x, c.y, e.z, sh);
            w.q[12 + tq] = pair_codes4(c.z, c.w, e.w, sh);
        }
        w.sc = ldg128(r.base + r.sc + (u32)b * 16u);
        w.d = ldg_u16(r.base + r.d + (u32)b * 2u);
    } else if (SOA) {
        const u8* ql = r.base + r.ql + (u32)b * 128u + 4u * t;
        const u8* qh = r.base + r.qh + (u32)b * 64u + 4u * t;
#pragma unroll
        for (int i = 0; i < 8; ++i) w.ql[i] = ldg_stream32(ql + 16 * i);
#pragma unroll
        for (int i = 0; i < 4; ++i) w.qh[i] = ldg_stream32(qh + 16 * i);
        w.sc = ldg128(r.base + r.sc + (u32)b * 16u);
        w.d = ldg_u16(r.base + r.d + (u32)b * 2u);
    } else {
        const u8* blk = r.base + r.ql + (u32)b * 210u;
#pragma unroll
        for (int i = 0; i < 8; ++i) w.ql[i] = ld_u32_a2(blk + 4 * t + 16 * i);
#pragma unroll
        for (int i = 0; i < 4; ++i) w.qh[i] = ld_u32_a2(blk + 128 + 4 * t + 16 * i);
        w.sc = ld_u128_a2(blk + 192);
        w.d = ldg_u16(blk + 208);
    }
    return w;
}

// u8 codes of group st (h = st>>3, s = (st>>1)&3, lh = st&1) held by this lane.
template <int SOA>
__device__ __forceinline__ u32 group_q(const Raw8& w, int st) {
    if (SOA == 2) return w.q[st];
    const int h = st >> 3, s = (st >> 1) & 3, lh = st & 1;
    const u32 l = w.ql[h * 4 + (s & 1) * 2 + lh] >> (4 * (s >> 1));
    const u32 hh = w.qh[h * 2 + lh] >> (2 * s);
    return (l & 0x0F0F0F0Fu) | ((hh << 4) & 0x30303030u);
}

// Signed scale byte `st` of a block's 16 scales.
__device__ __forceinline__ int sc_byte(const uint4& v, int st) {
    return ((int)(word4(v, st >> 2) << (24 - 8 * (st & 3)))) >> 24;
}

template <int NT, int MT, int SOA>
__global__ void __launch_bounds__(256) q6k_mmq_q8(PARAMS_W, const uint4* xq, const int2* corr,
                                                   const float2* d8, PARAMS_OUT) {
    MAKE_W;
    MAKE_OUT;
    RowRef rr[MT][2];
    float acc[MT][NT][4];
    const TilePos tp = tile_start<SOA>(w, 8 * NT, rr, acc);
    const int lane = tp.lane, t = tp.t, wrow = tp.wrow, tok0 = tp.tok0;
    const int kb0 = tp.kb0, kb1 = tp.kb1;

    for (int kb = kb0; kb < kb1; ++kb) {
        Raw8 raw[MT][2];
        float dw[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                raw[mt][hr] = load_raw8<SOA>(rr[mt][hr], kb, t);
                dw[mt][hr] = f16_to_f32(raw[mt][hr].d);
            }
        const size_t base = ((size_t)blockIdx.z * w.bpr + kb) * NT;
#pragma unroll
        for (int gq = 0; gq < 4; ++gq) {
            uint4 bq[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) bq[nt] = ldg128(xq + ((base + nt) * 4 + gq) * 32 + lane);
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int st = 4 * gq + u;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const u32 a0 = group_q<SOA>(raw[mt][0], st), a1 = group_q<SOA>(raw[mt][1], st);
                    const float dsc0 = dw[mt][0] * small_i2f(sc_byte(raw[mt][0].sc, st));
                    const float dsc1 = dw[mt][1] * small_i2f(sc_byte(raw[mt][1].sc, st));
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const int2 cc = corr[((base + nt) * 16 + st) * 4 + t];
                        const float2 dx = d8[((base + nt) * 8 + (st >> 1)) * 4 + t];
                        int c[4] = {cc.x, cc.y, cc.x, cc.y};
                        mma_u8s8(c, a0, a1, u == 0 ? bq[nt].x : u == 1 ? bq[nt].y
                                                   : u == 2 ? bq[nt].z : bq[nt].w);
                        acc[mt][nt][0] = fmaf(dx.x * dsc0, small_i2f(c[0]), acc[mt][nt][0]);
                        acc[mt][nt][1] = fmaf(dx.y * dsc0, small_i2f(c[1]), acc[mt][nt][1]);
                        acc[mt][nt][2] = fmaf(dx.x * dsc1, small_i2f(c[2]), acc[mt][nt][2]);
                        acc[mt][nt][3] = fmaf(dx.y * dsc1, small_i2f(c[3]), acc[mt][nt][3]);
                    }
                }
            }
        }
    }
    ks_emit<NT, MT>(o, w.rows, wrow, tok0, acc, lane);
    finish_split(o, w.rows, tp.row0, tp.rows_cta, tok0, 8 * NT);
}

// ---------------------------------------------------------------------------------------------
// Rows [r0, r0+nrows) of W as f16 [nrows][K]: f16(d*sc * (q-32)) (f32 product, one rounding).
template <int SOA>
__global__ void __launch_bounds__(256) q6k_dequant_f16(PARAMS_W, int r0, int nrows, u16* out) {
    MAKE_W;
    const long long total = (long long)nrows * w.bpr * 4;
    const int K = w.bpr * 256;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(i & 3);
        const long long rb = i >> 2;
        const int kb = (int)(rb % w.bpr), row = (int)(rb / w.bpr);
        const Raw raw = load_raw<SOA>(row_ref<SOA>(w, r0 + row), kb, t);
        const float d = f16_to_f32(raw.d);
        u16* dst = out + (size_t)row * K + kb * 256;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nib = 0; nib < 2; ++nib) {
                const float dsc = d * (float)quad_sc(raw, 2 * h + nib, t);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u32 q = quad_q<SOA>(raw, h, nib, j, 2 * (t >> 1));
                    const u32 lo = f16_bits(q_to_f32<0>(q) * dsc) | (f16_bits(q_to_f32<1>(q) * dsc) << 16);
                    const u32 hi = f16_bits(q_to_f32<2>(q) * dsc) | (f16_bits(q_to_f32<3>(q) * dsc) << 16);
                    *(uint2*)(dst + h * 128 + 32 * ((t >> 1) + 2 * nib) + 16 * (t & 1) + 4 * j) =
                        make_uint2(lo, hi);
                }
            }
    }
}

// ---------------------------------------------------------------------------------------------
// Pair streams (layout code 2, session 11; q6k_common.cuh "pair streams"): one SoA slab's
// blocks [b0, b1) of nb rewritten in place (scales and d untouched), and the inverse. Only the
// layout-2 instantiations read such a slab. A block's quarter t (its pair-stream bytes
// ql[32t, 32t+32) and qh[16t, 16t+16)) holds the 64 codes at ggml's ql[64h + 16t + i] (low
// nibbles: codes of m = 2h, high: m = 2h+1) and the 2-bit fields 2(t>>1) + 4(m&1) of
// qh[32h + 16(t&1) + i] (h = 0, 1; i < 16): per m and half hf, the eight codes i = 2p + hf
// (p < 8) as one 48-bit stream (code p at bit 6p), its three 16-bit pieces the half hf of words
// 2m, 2m+1 (ql) and 8+m (qh). (Session 12 round 2: the same bits as session 11's one-thread-per-
// block kernels, now a thread per quarter with 16-byte loads and stores.)
__host__ __device__ __forceinline__ void pairs_pack_quarter(const u32 (&qa)[2][4],
                                                            const u32 (&qb)[2][4], int t,
                                                            u32 (&W)[12]) {
#pragma unroll
    for (int i = 0; i < 12; ++i) W[i] = 0u;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int h = m >> 1, nib = m & 1, sh = 2 * (t >> 1) + 4 * nib;
        u32 c[4];  // the 16 codes of (m, this quarter), byte i = code i
#pragma unroll
        for (int w = 0; w < 4; ++w)
            c[w] = ((qa[h][w] >> (4 * nib)) & 0x0f0f0f0fu) | (((qb[h][w] >> sh) & 0x03030303u) << 4);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            unsigned long long v = 0ull;
#pragma unroll
            for (int p = 0; p < 8; ++p)
                v |= (unsigned long long)((c[p >> 1] >> (8 * (2 * (p & 1) + hf))) & 63u) << (6 * p);
            W[2 * m] |= (u32)(v & 0xffffu) << (16 * hf);
            W[2 * m + 1] |= (u32)((v >> 16) & 0xffffu) << (16 * hf);
            W[8 + m] |= (u32)((v >> 32) & 0xffffu) << (16 * hf);
        }
    }
}

// The inverse of one quarter: qa[h] = ggml's ql[64h + 16t, +16) (whole bytes), qb[h] = this
// quarter's bits of qh[32h + 16(t&1), +16) (quarter t^2 holds the other half of the bits).
__host__ __device__ __forceinline__ void pairs_unpack_quarter(const u32 (&W)[12], int t,
                                                              u32 (&qa)[2][4], u32 (&qb)[2][4]) {
    u32 c[4][4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
        for (int w = 0; w < 4; ++w) c[m][w] = 0u;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const unsigned long long v =
                (unsigned long long)((W[2 * m] >> (16 * hf)) & 0xffffu) |
                ((unsigned long long)((W[2 * m + 1] >> (16 * hf)) & 0xffffu) << 16) |
                ((unsigned long long)((W[8 + m] >> (16 * hf)) & 0xffffu) << 32);
#pragma unroll
            for (int p = 0; p < 8; ++p)
                c[m][p >> 1] |= (u32)((v >> (6 * p)) & 63u) << (8 * (2 * (p & 1) + hf));
        }
    }
    const int sh = 2 * (t >> 1);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            qa[h][w] = (c[2 * h][w] & 0x0f0f0f0fu) | ((c[2 * h + 1][w] & 0x0f0f0f0fu) << 4);
            qb[h][w] = (((c[2 * h][w] >> 4) & 0x03030303u) << sh) |
                       (((c[2 * h + 1][w] >> 4) & 0x03030303u) << (sh + 4));
        }
}

// Thread g of the repack kernels below: quarter t = g & 3 of block b0 + g / 4 (on: b < b1) and
// the block's ql / qh planes in the slab of nb blocks.
struct PairQuarter {
    int t;
    bool on;
    u8* ql;
    u8* qh;
};
__device__ __forceinline__ PairQuarter pair_quarter(u8* slab, int nb, int b0, int b1) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = b0 + (g >> 2);
    return {g & 3, b < b1, slab + (size_t)b * 128u, slab + (size_t)nb * 128u + (size_t)b * 64u};
}

// One thread per quarter of a block (4 * (b1 - b0) threads, blockDim a multiple of 32: a
// block's four quarters sit in one warp, whose __syncwarp orders their reads before any write
// of the in-place rewrite). Loads and stores are 16 bytes; a warp covers 8 whole blocks.
extern "C" __global__ void __launch_bounds__(256) q6k_repack_pairs(u8* slab, int nb, int b0,
                                                                    int b1) {
    const PairQuarter q = pair_quarter(slab, nb, b0, b1);
    const int t = q.t;
    u32 qa[2][4], qb[2][4];
    if (q.on) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 a = *(const uint4*)(q.ql + 64 * h + 16 * t);
            const uint4 c = *(const uint4*)(q.qh + 32 * h + 16 * (t & 1));
            qa[h][0] = a.x, qa[h][1] = a.y, qa[h][2] = a.z, qa[h][3] = a.w;
            qb[h][0] = c.x, qb[h][1] = c.y, qb[h][2] = c.z, qb[h][3] = c.w;
        }
    }
    __syncwarp();  // the block's bytes read by all four quarters before any is rewritten
    if (!q.on) return;
    u32 W[12];
    pairs_pack_quarter(qa, qb, t, W);
    *(uint4*)(q.ql + 32 * t) = make_uint4(W[0], W[1], W[2], W[3]);
    *(uint4*)(q.ql + 32 * t + 16) = make_uint4(W[4], W[5], W[6], W[7]);
    *(uint4*)(q.qh + 16 * t) = make_uint4(W[8], W[9], W[10], W[11]);
}

// The inverse, in place: pair streams back to ggml's ql/qh planes (relayout to AoS, read_aos),
// bit-exact (tests/kernels/test_cuda_pairs.py round-trips); quarters t and t^2 swap their qh
// halves through a shuffle.
extern "C" __global__ void __launch_bounds__(256) q6k_unpack_pairs(u8* slab, int nb, int b0,
                                                                    int b1) {
    const PairQuarter q = pair_quarter(slab, nb, b0, b1);
    const int t = q.t;
    uint4 l0 = make_uint4(0u, 0u, 0u, 0u), l1 = l0, hq = l0;
    if (q.on) {
        l0 = *(const uint4*)(q.ql + 32 * t);
        l1 = *(const uint4*)(q.ql + 32 * t + 16);
        hq = *(const uint4*)(q.qh + 16 * t);
    }
    const u32 W[12] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w, hq.x, hq.y, hq.z, hq.w};
    u32 qa[2][4], qb[2][4];
    pairs_unpack_quarter(W, t, qa, qb);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int w = 0; w < 4; ++w) qb[h][w] |= __shfl_xor_sync(0xffffffffu, qb[h][w], 2);
    __syncwarp();  // the block's bytes read by all four quarters before any is rewritten
    if (!q.on) return;
#pragma unroll
    for (int h = 0; h < 2; ++h)
        *(uint4*)(q.ql + 64 * h + 16 * t) = make_uint4(qa[h][0], qa[h][1], qa[h][2], qa[h][3]);
    const bool hi = t >> 1;  // quarter t writes qh[32(t>>1) + 16(t&1), +16)
    *(uint4*)(q.qh + 32 * (t >> 1) + 16 * (t & 1)) =
        hi ? make_uint4(qb[1][0], qb[1][1], qb[1][2], qb[1][3])
           : make_uint4(qb[0][0], qb[0][1], qb[0][2], qb[0][3]);
}

#ifdef Q6SERVE_NVCC_CHECK
// Explicit instantiations so an offline nvcc build checks (and reports registers for) the
// variants the dispatch can launch (bench/kernels_reach.py lists them; tests/kernels/
// test_nvcc_compile.py fails on one listed here that no call can reach, and builds every
// reachable name from the loader's text as well). The f32/bf16 twins of the K-slice tile
// differ only in stage_x_f16's load: f16 activations only here, to keep CI's three-arch build
// short.
#define INST_MMA(NT, MT, SOA, SRC, IN, PF)                                                  \
    template __global__ void q6k_mma_f16<NT, MT, SOA, SRC, IN, PF>(                           \
        const u64*, int, int, int, const IN::T*, int, const uint4*, float*, float*, u32*, int);
#define INST_MMA_IN(SOA, PF) \
    INST_MMA(1, 1, SOA, 2, InF32, PF) INST_MMA(1, 1, SOA, 2, InF16, PF) INST_MMA(1, 1, SOA, 2, InBF16, PF)
// src 2 (session 17: PF, the first block's loads ahead of the staging, per table cell)
INST_MMA_IN(true, false) INST_MMA_IN(false, false) INST_MMA_IN(true, true) INST_MMA_IN(false, true)
INST_MMA(1, 1, 2, 2, InF16, false) INST_MMA(1, 1, 2, 2, InF16, true)
// src 3 on pair-stream weights (two m-tiles of the SoA / AoS shape as one: launch.pair_cfg)
INST_MMA(2, 1, 2, 3, InF16, false) INST_MMA(4, 1, 2, 3, InF16, false) INST_MMA(8, 1, 2, 3, InF16, false)
#define INST_KS2(NT, SOA, NW)                                                                \
    template __global__ void q6k_ks_f16<NT, 1, SOA, InF16, true, NW>(                         \
        const u64*, int, int, int, const InF16::T*, int, const uint4*, float*, float*, u32*, int);
#define INST_KS(NT, NW) INST_KS2(NT, true, NW) INST_KS2(NT, false, NW) INST_KS2(NT, 2, NW)
INST_KS(1, 8) INST_KS(2, 8) INST_KS(4, 8) INST_KS(8, 8)
INST_KS(1, 12) INST_KS(2, 12) INST_KS(4, 12)
INST_KS(1, 16) INST_KS(2, 16)
#define INST_PREP_IN(NAME, NT, ...) \
    template __global__ void NAME<NT, InF32>(const InF32::T*, __VA_ARGS__); \
    template __global__ void NAME<NT, InF16>(const InF16::T*, __VA_ARGS__); \
    template __global__ void NAME<NT, InBF16>(const InBF16::T*, __VA_ARGS__);
INST_PREP_IN(q6k_prep_f16, 2, int, int, int, uint4*) INST_PREP_IN(q6k_prep_f16, 4, int, int, int, uint4*)
INST_PREP_IN(q6k_prep_f16, 8, int, int, int, uint4*)
INST_PREP_IN(q6k_prep_q8_1, 1, int, int, int, u32*, int*, float*)
INST_PREP_IN(q6k_prep_q8_1, 2, int, int, int, u32*, int*, float*)
INST_PREP_IN(q6k_prep_q8_1, 4, int, int, int, u32*, int*, float*)
INST_PREP_IN(q6k_prep_q8_1, 8, int, int, int, u32*, int*, float*)
#define INST_EXACT2(TOK, SOA, IN, PF) \
    template __global__ void q6k_exact<TOK, SOA, IN, PF>(const u64*, int, int, int, const IN::T*, int, float*, float*, u32*, int);
#define INST_EXACT(TOK, SOA, IN) INST_EXACT2(TOK, SOA, IN, true) INST_EXACT2(TOK, SOA, IN, false)
#define INST_EXACT_IN(TOK, SOA) INST_EXACT(TOK, SOA, InF32) INST_EXACT(TOK, SOA, InF16) INST_EXACT(TOK, SOA, InBF16)
INST_EXACT_IN(1, true) INST_EXACT_IN(2, true) INST_EXACT_IN(1, false) INST_EXACT_IN(2, false)
INST_EXACT(1, 2, InF16) INST_EXACT(2, 2, InF16)
// four tokens a CTA: no register prefetch (pf is the exact kernel's N = 1 / 2 shape)
INST_EXACT2(4, true, InF32, false) INST_EXACT2(4, true, InF16, false) INST_EXACT2(4, true, InBF16, false)
INST_EXACT2(4, false, InF32, false) INST_EXACT2(4, false, InF16, false) INST_EXACT2(4, false, InBF16, false)
INST_EXACT2(4, 2, InF16, false)
#define INST_MMQ(NT, SOA) \
    template __global__ void q6k_mmq_q8<NT, 1, SOA>(const u64*, int, int, int, const uint4*, const int2*, const float2*, float*, float*, u32*, int);
#define INST_MMQ_L(NT) INST_MMQ(NT, true) INST_MMQ(NT, false) INST_MMQ(NT, 2)
INST_MMQ_L(1) INST_MMQ_L(2) INST_MMQ_L(4) INST_MMQ_L(8)
template __global__ void q6k_dequant_f16<true>(const u64*, int, int, int, int, int, u16*);
template __global__ void q6k_dequant_f16<false>(const u64*, int, int, int, int, int, u16*);
template __global__ void q6k_dequant_f16<2>(const u64*, int, int, int, int, int, u16*);
#endif
