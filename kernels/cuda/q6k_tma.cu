// TMA-fed K-slice tile (issue 16, N = 9..64; mma_f16 src 7, SoA weights, sm_90 only):
// q6k_ks_f16's schedule and math with each warp's weights streamed by bulk copies
// (`cp.async.bulk ... mbarrier::complete_tx::bytes`) into a warp-private ring of S shared-memory
// stages, S-1 of them in flight while the warp computes on one.
//
// Why: Nsight Compute on the register-prefetch tiles and the cp.async ring q6k_ksr_f16 showed
// long-scoreboard stalls and at most ~54 KB of weight bytes in flight per SM (one block ahead
// per warp); the decode's instruction count is not the bound (+1.6-1.8% with a faster decode).
// A bulk copy moves a whole plane run per instruction, so a deeper ring costs the issuing
// lanes almost nothing: per stage each lane issues two copies and one mbarrier arrive.
//
// Stage = a warp tile's 16 rows x C consecutive K blocks of the CTA's slice. Because the SoA
// planes store each row's blocks contiguously, a row's C blocks of one plane are one
// contiguous run: 16 rows x 4 planes = 64 copies per stage, two per lane (lane l copies row
// l & 15: ql and qh for l < 16, scales and d for l >= 16). Stage layout (bytes; G = TmaStage):
//   ql [16][C*128] at QL + r*C*128   (no padding: the quarter-warp's 16-byte reads of rows g
//   qh [16][C*64]  at QH + r*C*64     and g+1 meet in the banks, 2-way; a first version shifted
//   sc [16][C*16]  at SC + r*C*16     odd rows by 64 bytes and overlapped the next row's bytes)
//   d  [16][DS]    at D  + r*DS: the 16-byte-aligned span around the row's 2*C bytes of d (the
//                  d plane is only 2-byte aligned per block; the span stays inside the slab,
//                  whose size is rounded up to 16), DOFF[r] the offset of the first d in it
//                  (a plain shared store by the copying lane).
// Every stage has an mbarrier (count 32: each lane arrives once with expect_tx of its own two
// copies' bytes, so the phase completes when all 32 arrived and every byte landed). The warp
// waits on the parity of its stage, reads each block's bytes as load_raw would have loaded
// them (codes of half 0, scales and d at the block's start, half 1 at block_mma's mid) and
// runs block_mma (deq2, mma.sync with all 8*NT tokens). A stage is refilled only after a
// __syncwarp (all lanes done with it) and a proxy fence (generic reads before async writes).
// Activations: the CTA's K slice staged once (stage_x_f16), as in every K-slice tile.
//
// TM (2D form): the ql, qh and scale planes of a tile's 16 rows x C blocks are one box each of a
// rank-3 tensor map per slab and plane ([row][block][bytes of a block's plane]; maps built by
// launch.py, passed as the `xp` argument: [slab][ql, qh, sc] x 128 bytes), so a stage takes 3
// tensor copies (lane 0) and the 16 per-row d copies instead of 64 copies: the per-copy cost of
// the 1D form (~130-140 copies/us per SM on the H200, its first measurement) falls away. Box
// rows past a slab's end are zero-filled (never emitted); a tile that spans two slabs takes the
// 1D copies. Box blocks past the slice's end (a short last chunk) are read and never used.
//
// Same numerics, block order and K slicing as q6k_ks_f16: with the same slice count the
// outputs are bit-identical to it, which is how the AoS layout is served (launch.py runs
// q6k_ks_f16 with this plan's grid for AoS weights: bulk copies need 16-byte aligned runs,
// and 210-byte AoS blocks are not).
#ifdef Q6SERVE_NVCC_CHECK  // q6k_matmul.cu's own instantiations are checked in its own build
#define Q6SERVE_TMA_CHECK
#undef Q6SERVE_NVCC_CHECK
#endif
#include "q6k_matmul.cu"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define Q6SERVE_TMA 1
#endif

template <int C>
struct TmaStage {
    static constexpr int QL = 0;
    static constexpr int QH = 16 * C * 128;
    static constexpr int SC = QH + 16 * C * 64;
    static constexpr int DS = 16 * ((2 * C + 29) / 16);  // >= ceil16(14 + 2C): any start offset
    static constexpr int D = SC + 16 * C * 16;
    static constexpr int DOFF = D + 16 * DS;
    static constexpr int BYTES = (DOFF + 16 + 127) / 128 * 128;  // kernels/cuda/launch.py mirrors
};

#ifdef Q6SERVE_TMA
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// The inits made visible to the async proxy (the bulk copies' complete_tx).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(u32 bar, u32 bytes) {
    asm volatile("{ .reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                 ::"r"(bar), "r"(bytes) : "memory");
}
// HINT: try_wait with a suspend-time hint (10 ms): the waiting warp sleeps until the phase
// completes instead of re-issuing try_wait (the loop's instructions took issue slots: Nsight
// Compute counted +35% instructions over q6k_ks_f16 at N=16 without it).
template <bool HINT>
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 ok = 0;
    do {
        if (HINT)
            asm volatile("{ .reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, "
                         "%3;\nselp.u32 %0, 1, 0, p; }"
                         : "=r"(ok) : "r"(bar), "r"(parity), "r"(10000000u) : "memory");
        else
            asm volatile("{ .reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p; }"
                         : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    } while (!ok);
}
// Box (0, kb, row) of a rank-3 tensor map (global memory, 64-byte aligned) into shared memory.
__device__ __forceinline__ void tensor_g2s(u32 dst, const void* map, int kb, int row, u32 bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"(map), "r"(0), "r"(kb), "r"(row), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// The warp's generic-proxy reads of a stage ordered before the async-proxy writes refilling it.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Half P of block c of row `row` of a stage as load_raw_part would have loaded it (P == 0: the
// codes of half 0, the scales and d).
template <int C, int P>
__device__ __forceinline__ void tma_raw_part(Raw& w, const u8* st, int row, int c, int t,
                                             int doff) {
    typedef TmaStage<C> G;
    w.ql[P] = *(const uint4*)(st + G::QL + row * C * 128 + c * 128 + 64 * P + 16 * t);
    w.qh[P] = *(const uint4*)(st + G::QH + row * C * 64 + c * 64 + 32 * P + 16 * (t & 1));
    if (P == 0) {
        w.sc = *(const uint4*)(st + G::SC + row * C * 16 + c * 16);
        w.d = *(const u16*)(st + G::D + row * G::DS + doff + 2 * c);
    }
}
#endif  // Q6SERVE_TMA

// NW warps per CTA, S stages of C blocks per warp; one CTA per SM (the ring and the activation
// slice take the shared memory). Dynamic shared memory: the activation slice, then NW*S stages
// (TmaStage<C>::BYTES each), then NW*S mbarriers.
// TM: 0 the 1D form, 1 the 2D form (tensor maps), 2 the 2D form waiting with a suspend hint.
template <int NT, class In, int NW, int S, int C, int TM>
__global__ void __launch_bounds__(32 * NW, 1)
    q6k_tma_f16(PARAMS_W, const typename In::T* x, int K, const uint4* xp, PARAMS_OUT) {
#ifdef Q6SERVE_TMA
    static_assert(S >= 2, "a ring of one stage has nothing in flight");
    typedef TmaStage<C> G;
    MAKE_W;
    MAKE_OUT;
    const KsPos ps = ks_pos<NT>(w.bpr);
    const int lane = ps.lane, warp = ps.warp, g = ps.g, t = ps.t, tok0 = ps.tok0;
    const int kb0 = ps.kb0, nblk = ps.nblk;
    if (nblk <= 0) return;  // CTA-uniform
    const int wtiles = (w.rows + 15) >> 4;
    const int wstride = gridDim.x * NW;
    const int wt0 = blockIdx.x * NW + warp;
    const int my_tiles = wt0 < wtiles ? (wtiles - wt0 + wstride - 1) / wstride : 0;
    const int nch = (nblk + C - 1) / C;  // stages (chunks of C blocks) per tile
    const int units = my_tiles * nch;
    const int tstride = nblk * 32 + 4;
    u8* const rings = reinterpret_cast<u8*>(smem_x + 8 * NT * tstride);
    u8* const ring = rings + warp * S * G::BYTES;
    const u32 ring_s = smem_addr(ring);
    const u32 bar_s = smem_addr(rings) + NW * S * G::BYTES + warp * S * 8;
    if (TM && (ring_s & 127u)) __trap();  // tensor copies need 128-byte aligned stages
    const u8* maps = reinterpret_cast<const u8*>(xp);
    if (lane == 0)
        for (int s = 0; s < S; ++s) mbar_init(bar_s + 8 * s, 32);
    mbar_init_fence();
    __syncwarp();

    // Fill side: lane copies row pr of the filled unit's tile, planes ql+qh or sc+d.
    const int pr = lane & 15;
    const bool hi = lane >= 16;
    const u32 dst0 = hi ? G::SC + pr * C * 16 : G::QL + pr * C * 128;
    const u32 dst1 = hi ? G::D + pr * G::DS : G::QH + pr * C * 64;
    const u32 step0 = hi ? 16u * C : 128u * C, step1 = hi ? 2u * C : 64u * C;
    int fj = 0, fc = 0;
    const u8* fbase = nullptr;
    u32 f0 = 0, f1 = 0;  // plane offsets of the lane's row at the filled chunk's first block
    bool box = false;    // TM: the tile lies in one slab (tensor copies)
    int tslab = 0, trow = 0;  // TM: its slab and first row there
    auto fill_refs = [&]() {
        const int row0 = (wt0 + fj * wstride) * 16;
        const RowRef r = row_ref<true>(w, min(row0 + pr, w.rows - 1));
        fbase = r.base;
        f0 = hi ? r.sc + (u32)kb0 * 16u : r.ql + (u32)kb0 * 128u;
        f1 = hi ? r.d + (u32)kb0 * 2u : r.qh + (u32)kb0 * 64u;
        if (TM) {
            tslab = row0 / w.rps;
            trow = row0 - tslab * w.rps;
            box = min(row0 + 15, w.rows - 1) / w.rps == tslab;
        }
    };
    auto fill = [&](int slot) {
        const u32 cb = (u32)min(C, nblk - fc * C);
        const u32 st = ring_s + slot * G::BYTES, bar = bar_s + 8 * slot;
        const u32 n0 = cb * (hi ? 16u : 128u);
        u32 a1 = f1, n1 = cb * 64u;
        if (hi) {  // the aligned span around the d run (slabs are 16-byte aligned)
            const u32 lo = a1 & 15u;
            a1 -= lo;
            n1 = (lo + 2u * cb + 15u) & ~15u;
            ring[slot * G::BYTES + G::DOFF + pr] = (u8)lo;
        }
        if (TM && box) {  // lane 0: three boxes of 16 rows x C blocks; lanes 16..31: d
            const int kb = kb0 + fc * C;
            mbar_arrive_tx(bar, hi ? n1 : lane == 0 ? 16u * C * 208u : 0u);
            if (lane == 0) {
                const u8* m = maps + (size_t)tslab * 3 * 128;
                tensor_g2s(st + G::QL, m, kb, trow, bar);
                tensor_g2s(st + G::QH, m + 128, kb, trow, bar);
                tensor_g2s(st + G::SC, m + 256, kb, trow, bar);
            }
            if (hi) bulk_g2s(st + dst1, fbase + a1, n1, bar);
        } else {
            mbar_arrive_tx(bar, n0 + n1);
            bulk_g2s(st + dst0, fbase + f0, n0, bar);
            bulk_g2s(st + dst1, fbase + a1, n1, bar);
        }
        f0 += step0;
        f1 += step1;
        if (++fc == nch) {
            fc = 0;
            ++fj;
            if (fj < my_tiles) fill_refs();
        }
    };
    if (units > 0) fill_refs();
#pragma unroll
    for (int s = 0; s < S - 1; ++s)
        if (s < units) fill(s);
    // The first weight copies are in flight while the CTA stages its activations.
    stage_x_f16<NT, In, true>(x, K, o.n_tok, tok0, kb0, nblk);
    __syncthreads();

    float acc[1][NT][4];
    zero_acc(acc);
    int slot = 0, ch = 0, wt = wt0;
    u32 phase = 0;
    for (int u = 0; u < units; ++u) {
        __syncwarp();  // every lane is done with the stage of unit u-1, which is refilled now
        if (u + S - 1 < units) {
            fence_proxy_async_smem();
            fill(slot == 0 ? S - 1 : slot - 1);
        }
        mbar_wait<TM == 2>(bar_s + 8 * slot, phase);
        const u8* st = ring + slot * G::BYTES;
        const int dg = st[G::DOFF + g], dg8 = st[G::DOFF + g + 8];
        const int cb = min(C, nblk - ch * C);
#pragma unroll 1
        for (int c = 0; c < cb; ++c) {
            const int b = ch * C + c;
            Raw raw[1][2];
            tma_raw_part<C, 0>(raw[0][0], st, g, c, t, dg);
            tma_raw_part<C, 0>(raw[0][1], st, g + 8, c, t, dg8);
            const auto bx = [&](int sp, int nt) -> uint4 {
                return smem_x[(nt * 8 + g) * tstride + b * 32 + sp * 4 + t];
            };
            const auto mid = [&] {
                tma_raw_part<C, 1>(raw[0][0], st, g, c, t, dg);
                tma_raw_part<C, 1>(raw[0][1], st, g + 8, c, t, dg8);
            };
            block_mma<NT, 1, decltype(bx), decltype(mid), false>(acc, raw, t, bx, mid);
        }
        if (++slot == S) {
            slot = 0;
            phase ^= 1u;
        }
        if (++ch == nch) {
            ks_emit<NT, 1>(o, w.rows, wt * 16, tok0, acc, lane);
            zero_acc(acc);
            ch = 0;
            wt += wstride;
        }
    }
#else
    __trap();  // not built for sm_90: the launch plan never picks this kernel there
#endif
}

#ifdef Q6SERVE_TMA_CHECK
#define INST_TMA2(NT, NW, S, C, TM)                                                          \
    template __global__ void q6k_tma_f16<NT, InF16, NW, S, C, TM>(                            \
        const u64*, int, int, int, const InF16::T*, int, const uint4*, float*, float*, u32*, int);
#define INST_TMA(NT, NW, S, C) INST_TMA2(NT, NW, S, C, 0) INST_TMA2(NT, NW, S, C, 1)
INST_TMA(2, 8, 6, 1) INST_TMA(2, 8, 3, 2) INST_TMA(2, 12, 2, 2) INST_TMA(2, 16, 2, 1)
INST_TMA(2, 16, 3, 1) INST_TMA(4, 8, 4, 1) INST_TMA(4, 12, 3, 1) INST_TMA(4, 8, 3, 2)
INST_TMA(8, 8, 3, 1) INST_TMA(8, 8, 2, 2)
INST_TMA2(2, 16, 2, 1, 2) INST_TMA2(2, 12, 2, 2, 2) INST_TMA2(2, 16, 3, 1, 2)
INST_TMA2(4, 12, 3, 1, 2) INST_TMA2(8, 8, 3, 1, 2)
#endif
