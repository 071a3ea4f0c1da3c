// q6k_mma_ws: the F16 tensor-core tile with the WEIGHTS staged in shared memory (UNMEASURED:
// docs/KERNELS.md, "Next variants"). Same numerics as q6k_mma_f16 (f16(sc*(q-32)) x f16
// activations, f32 accumulators, the f32 block scale d applied by rescaling the accumulators
// around each 256-block; the MMAs of one accumulator run in the same order as q6k_mma_f16's).
//
// Why: q6k_mma_f16 holds each warp's raw weight words in registers, so (a) a warp has one
// block (16 rows x 210 B) in flight and waits for it before its math, and (b) warps cannot
// own more than 16 rows without running out of registers, so every warp re-reads all tokens'
// activations per block. Here the CTA streams its rows' blocks into an S-deep ring of
// shared-memory stages with cp.async (16-byte, L2 only), S-1 blocks ahead of the math, and
// the warps read the weights from shared memory, so a warp can own MT m-tiles of 16 rows and
// share each activation fragment across them.
//
// CTA = WR x WC warps: warp (wr, wc) owns rows wr*MT*16 .. +MT*16 of the CTA's RT = WR*MT*16
// rows and n-tiles wc*WN .. +WN of its 8*WC*WN tokens. Grid: (persistent row tiles, K splits,
// token chunks): CTA x handles row tiles x, x + gridDim.x, ... over K split blockIdx.y; its
// pipeline runs across tile boundaries (the stages of the next tile load during this one).
// Split-K partial sums are added in split order by the last CTA of each tile (tickets per
// tile), as in q6k_mma_f16: deterministic.
//
// Activations: TOK == 0: the q6k_prep_f16<WC*WN> buffer (fragment order), streamed through
// the same stages as the weights (any N). TOK in 1..8: N <= 8 only (WC = WN = 1): the CTA
// stages TOK tokens of its whole K range once, in fragment order, and reuses them for every
// row tile it owns (lanes of tokens >= TOK feed zeros to the MMA).
//
// One weight stage (RT rows, one 256-block each), byte offsets:
//   [0, RT*192)        row r at r*192: ql (128 B) | qh (64 B). The 192-byte row stride makes
//                      the 16-byte reads of a quarter-warp (rows g, g+1; lanes t) conflict-free.
//   [RT*192, RT*208)   scales, 16 B per row
//   [RT*208, RT*210)   d, 2 B per row (not 16-byte aligned in the SoA plane: loaded into a
//                      register when the stage is issued, stored one pipeline step later)
// then (TOK == 0) the stage's activations [nt][sp][lane] 16 B.
//
// SoA/AoS twins: the AoS twin fills the same stages with ordinary 2-byte-aligned loads (210-byte
// blocks cannot feed cp.async) and runs the same math, so outputs are bit-identical; it is
// slower (its stage loads are synchronous), which is acceptable for the kill-switch layout.
#include "q6k_common.cuh"
#include "q6k_mma.cuh"

extern __shared__ uint4 smem_ws[];

__device__ __forceinline__ u32 ws_quad_q(const uint4& ql, const uint4& qh, int nib, int j,
                                         int qsh) {
    const u32 l = word4(ql, j);
    const u32 hh = word4(qh, j) >> qsh;
    return nib ? (((l >> 4) & 0x0F0F0F0Fu) | (hh & 0x30303030u))
               : ((l & 0x0F0F0F0Fu) | ((hh << 4) & 0x30303030u));
}

template <int MT, int WN, int WR, int WC, int S, int TOK, bool SOA, class In>
__global__ void __launch_bounds__(32 * WR * WC, 1)
    q6k_mma_ws(PARAMS_W, const typename In::T* x, int K, const uint4* xp, PARAMS_OUT) {
    static_assert(S >= 3, "the d hand-off needs three stages");
    static_assert(TOK == 0 || (WN == 1 && WC == 1), "staged activations: one n-tile");
    static_assert(TOK >= 0 && TOK <= 8, "TOK: 0 (prepass) or 1..8 live tokens");
    constexpr int THREADS = 32 * WR * WC;
    constexpr int RT = WR * MT * 16;   // rows per CTA tile
    constexpr int NT = WC * WN;        // n-tiles of 8 tokens per CTA
    constexpr int WB = RT * 210;       // weight bytes per stage (a multiple of 16)
    constexpr int SB = WB + (TOK ? 0 : NT * 4096);
    static_assert(THREADS % RT == 0, "a loader thread per row for the scales and d");
    constexpr int TOKS = TOK ? TOK : 8 * NT;  // tokens per CTA (token chunk)
    MAKE_W;
    MAKE_OUT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3, qsh = 2 * (t >> 1);
    const int wr = warp % WR, wc = warp / WR;
    const int ntiles = (w.rows + RT - 1) / RT;
    int kb0, kb1;
    k_range(w.bpr, kb0, kb1);
    const int nkb = kb1 - kb0;
    const int cta_x = blockIdx.x, grid_x = gridDim.x;
    const int my_tiles = cta_x < ntiles ? (ntiles - 1 - cta_x) / grid_x + 1 : 0;
    const int total = my_tiles * nkb;  // pipeline steps: (tile, block) pairs
    const int tok0 = blockIdx.z * TOKS;
    u8* sm = reinterpret_cast<u8*>(smem_ws);

    // Loader: consecutive threads take consecutive 16-byte chunks of one row's ql (8 per row)
    // and qh (4 per row), so a warp's cp.async covers whole 128-byte lines; thread r < RT also
    // copies row r's scales and owns its d.
    const bool d_owner = (int)threadIdx.x < RT;
    const int lr = threadIdx.x;  // the scales/d row of a d_owner
    u32 dpend = 0;
    auto step_of = [&](int s, int& tile, int& kb) {
        const int m = s / nkb;
        tile = cta_x + m * grid_x;
        kb = kb0 + (s - m * nkb);
    };
    auto flush_d = [&](int s) {  // d of step s (loaded when s was issued) into its stage
        if (d_owner) *reinterpret_cast<u16*>(sm + (s % S) * SB + RT * 208 + lr * 2) = (u16)dpend;
    };
    auto issue = [&](int s) {
        int tile, kb;
        step_of(s, tile, kb);
        // Row references of the tile: one slab lookup when the tile lies in one slab (rows
        // past the end are clamped to the last row, whose bytes are read and never emitted).
        const int r0 = tile * RT, rlast = min(r0 + RT - 1, w.rows - 1);
        const bool one = r0 / w.rps == rlast / w.rps;
        const RowRef ref0 = row_ref<SOA>(w, min(r0, w.rows - 1));
        auto ref_of = [&](int lrow) -> RowRef {
            const int r = min(r0 + lrow, w.rows - 1);
            if (!one) return row_ref<SOA>(w, r);
            RowRef x = ref0;
            const u32 db = (u32)(r - r0) * (u32)w.bpr;  // blocks from row r0
            x.ql += db * (SOA ? 128u : 210u);
            x.qh += db * (SOA ? 64u : 210u);
            x.sc += db * (SOA ? 16u : 210u);
            x.d += db * (SOA ? 2u : 210u);
            return x;
        };
        u8* st = sm + (s % S) * SB;
#pragma unroll
        for (int i = 0; i < (RT * 12 + THREADS - 1) / THREADS; ++i) {
            const int c = threadIdx.x + i * THREADS;  // ql chunks [0, 8 RT), qh [8 RT, 12 RT)
            if (c >= RT * 12) break;
            const bool isql = c < RT * 8;
            const int lrow = isql ? c >> 3 : (c - RT * 8) >> 2;
            const int p = isql ? c & 7 : (c - RT * 8) & 3;
            const RowRef ref = ref_of(lrow);
            u8* dst = st + lrow * 192 + (isql ? 16 * p : 128 + 16 * p);
            if (SOA) {
                cp_async16(dst, isql ? ref.base + ref.ql + (u32)kb * 128u + 16 * p
                                     : ref.base + ref.qh + (u32)kb * 64u + 16 * p);
            } else {
                const u8* blk = ref.base + ref.ql + (u32)kb * 210u;
                *reinterpret_cast<uint4*>(dst) = ld_u128_a2(blk + (isql ? 16 * p : 128 + 16 * p));
            }
        }
        if (d_owner) {
            const RowRef ref = ref_of(lr);
            u8* dst = st + RT * 192 + lr * 16;
            if (SOA) {
                cp_async16(dst, ref.base + ref.sc + (u32)kb * 16u);
                dpend = ldg_u16(ref.base + ref.d + (u32)kb * 2u);
            } else {
                const u8* blk = ref.base + ref.ql + (u32)kb * 210u;
                *reinterpret_cast<uint4*>(dst) = ld_u128_a2(blk + 192);
                dpend = ldg_u16(blk + 208);
            }
        }
        if (TOK == 0) {
            const uint4* src = xp + ((size_t)blockIdx.z * w.bpr + kb) * NT * 256;
            uint4* dst = reinterpret_cast<uint4*>(st + WB);
            for (int c = threadIdx.x; c < NT * 256; c += THREADS) cp_async16(dst + c, src + c);
        }
    };

    // Prologue: S-1 steps in flight (one commit group each, empty ones included).
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s >= 1 && s - 1 < total) flush_d(s - 1);
        if (s < total) issue(s);
        cp_async_commit();
    }
    // Staged activations (TOK > 0) load while the first weight stages are in flight.
    const int tstride = nkb * 32 + 4;  // uint4 per token row (+64 B: conflict-free reads)
    const uint4* xs = reinterpret_cast<const uint4*>(sm + S * SB);
    if (TOK > 0) {
        uint4* xw = reinterpret_cast<uint4*>(sm + S * SB);
        const int per_tok = nkb * 32;
        for (int i = threadIdx.x; i < TOK * per_tok; i += THREADS) {
            const int tk = i / per_tok, rem = i - tk * per_tok;
            const int b = rem >> 5, sp = (rem >> 2) & 7, tt = rem & 3;
            const int tok = tok0 + tk;
            xw[tk * tstride + rem] =
                tok < o.n_tok ? load_x8_f16<In>(x + (size_t)tok * K + (kb0 + b) * 256 +
                                                quad_x_off(sp, tt))
                              : make_uint4(0, 0, 0, 0);
        }
    }

    float acc[MT][WN][4];
    for (int i = 0; i < total; ++i) {
        cp_async_wait<S - 2>();  // this thread's copies of step i have landed
        __syncthreads();         // everyone's have; everyone is done with step i-1's stage
        {
            const int s = i + S - 1;  // refill the stage step i-1 used
            if (s - 1 < total) flush_d(s - 1);
            if (s < total) issue(s);
            cp_async_commit();
        }
        int tile, kb;
        step_of(i, tile, kb);
        if (kb == kb0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int wn = 0; wn < WN; ++wn)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][wn][e] = 0.f;
        }
        const u8* st = sm + (i % S) * SB;
        const uint4* sa = reinterpret_cast<const uint4*>(st + WB);

        float dmul[MT][2];
        u32 sc2[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = wr * MT * 16 + mt * 16 + g + 8 * hr;
                const float d = f16_to_f32(*reinterpret_cast<const u16*>(st + RT * 208 + r * 2));
                const bool zero = (d == 0.f);  // a zero block adds nothing: mask it, scale by 1
                dmul[mt][hr] = zero ? 1.f : d;
                const float inv = zero ? 1.f : 1.f / d;
#pragma unroll
                for (int wn = 0; wn < WN; ++wn) {
                    acc[mt][wn][2 * hr] *= inv;
                    acc[mt][wn][2 * hr + 1] *= inv;
                }
                const uint4 scw = *reinterpret_cast<const uint4*>(st + RT * 192 + r * 16);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int scv = ((int)(word4(scw, k) << (24 - 8 * t))) >> 24;
                    const u32 h = zero ? 0u : f16_bits((float)scv);
                    sc2[mt][hr][k] = h | (h << 16);
                }
            }

#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4 bx[4][WN];  // step pairs sp = 4h + q, q = 2*nib + jj
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int wn = 0; wn < WN; ++wn) {
                    const int sp = 4 * h + q;
                    if (TOK > 0) {
                        bx[q][wn] = g < TOK ? xs[g * tstride + (kb - kb0) * 32 + sp * 4 + t]
                                            : make_uint4(0, 0, 0, 0);
                    } else {
                        bx[q][wn] = sa[((wc * WN + wn) * 8 + sp) * 32 + lane];
                    }
                }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u8* r0 = st + (wr * MT * 16 + mt * 16 + g) * 192;
                const u8* r1 = r0 + 8 * 192;
                const uint4 l0 = *reinterpret_cast<const uint4*>(r0 + 64 * h + 16 * t);
                const uint4 l1 = *reinterpret_cast<const uint4*>(r1 + 64 * h + 16 * t);
                const uint4 h0 = *reinterpret_cast<const uint4*>(r0 + 128 + 32 * h + 16 * (t & 1));
                const uint4 h1 = *reinterpret_cast<const uint4*>(r1 + 128 + 32 * h + 16 * (t & 1));
#pragma unroll
                for (int nib = 0; nib < 2; ++nib)
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                        for (int u = 0; u < 2; ++u) {
                            const int j = 2 * jj + u, q = 2 * nib + jj;
                            const u32 q0 = ws_quad_q(l0, h0, nib, j, qsh);
                            const u32 q1 = ws_quad_q(l1, h1, nib, j, qsh);
                            const u32 s0 = sc2[mt][0][2 * h + nib], s1 = sc2[mt][1][2 * h + nib];
                            const u32 a0 = deq2(q0, 0x4140u, s0), a1 = deq2(q1, 0x4140u, s1);
                            const u32 a2 = deq2(q0, 0x4342u, s0), a3 = deq2(q1, 0x4342u, s1);
#pragma unroll
                            for (int wn = 0; wn < WN; ++wn)
                                mma_f16(acc[mt][wn], a0, a1, a2, a3,
                                        u ? bx[q][wn].z : bx[q][wn].x,
                                        u ? bx[q][wn].w : bx[q][wn].y);
                        }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int wn = 0; wn < WN; ++wn)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][wn][e] *= dmul[mt][e >> 1];

        if (kb == kb1 - 1) {  // the tile's last block: write it out
            const int row0 = tile * RT;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int wn = 0; wn < WN; ++wn)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = (wc * WN + wn) * 8 + 2 * t + (e & 1);
                        if (col < TOKS)
                            emit(o, w.rows, row0 + wr * MT * 16 + mt * 16 + g + 8 * (e >> 1),
                                 tok0 + col, acc[mt][wn][e]);
                    }
            finish_split_at(o, w.rows, blockIdx.z * ntiles + tile, row0, RT, tok0, TOKS);
        }
    }
    cp_async_wait<0>();
}

#ifdef Q6SERVE_NVCC_CHECK
// Every instantiation the backend's variant table (bench/kernels.py WS_VARIANTS, the tests'
// every-variant case) can ask NVRTC for, SoA and AoS.
#define INST_WS(MT, WN, WR, WC, S, TOK, SOA, IN)                                           \
    template __global__ void q6k_mma_ws<MT, WN, WR, WC, S, TOK, SOA, IN>(                  \
        const u64*, int, int, int, const IN::T*, int, const uint4*, float*, float*, u32*, int);
#define INST_WS_L(MT, WN, WR, WC, S, TOK, IN) \
    INST_WS(MT, WN, WR, WC, S, TOK, true, IN) INST_WS(MT, WN, WR, WC, S, TOK, false, IN)
#define INST_WS_TOK(WR, S, IN) \
    INST_WS_L(1, 1, WR, 1, S, 1, IN) INST_WS_L(1, 1, WR, 1, S, 2, IN) \
    INST_WS_L(1, 1, WR, 1, S, 4, IN) INST_WS_L(1, 1, WR, 1, S, 8, IN)
// (a) N <= 8: staged activations, 8 or 4 warps x 16 rows, 3 or 4 stages
INST_WS_TOK(8, 4, InF32) INST_WS_TOK(8, 3, InF32) INST_WS_TOK(4, 4, InF32)
INST_WS_TOK(8, 4, InF16) INST_WS_TOK(8, 4, InBF16)
// (a') N <= 8 through the prepass; (b) N = 16..64: wide warp tiles over prepass stages
INST_WS_L(1, 1, 8, 1, 4, 0, InF16)
INST_WS_L(4, 1, 4, 2, 3, 0, InF16) INST_WS_L(4, 2, 4, 2, 3, 0, InF16)
INST_WS_L(4, 2, 2, 4, 3, 0, InF16) INST_WS_L(2, 2, 4, 4, 3, 0, InF16)
INST_WS_L(4, 4, 2, 2, 3, 0, InF16)
#endif
