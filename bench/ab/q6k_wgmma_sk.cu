// Stream-K form of the wgmma tile (issue 16 ask of session 29; bench-only, not in the product:
// bench/sk_ab.py compiles this file with q6k_wgmma.cu inlined and launches it on a grid of its
// own). Session 28's model: on the tall weights at N = 33..64 the wgmma tile alone matches
// torch, and the split-K sum's partials (15-24 MB, 5-8 us) plus the rounds x blocks of an
// unbalanced slice grid make the gap. Here the work is cut into units (a row group of NWG
// 64-row tiles, one K block); the grid's G CTAs (one per SM) each take a contiguous run of
// ceil-or-floor(U / G) units of the row-group-major order, so every SM streams the same weight
// bytes, whatever rows x K.
//
// A CTA's run crosses 1-3 row groups: its first one (in unit order) it holds only the tail
// of (the row group's last units), its last one only the head, the ones between whole. It
// runs them last-first: the head of its last row group first (a partial: written to its slot
// of the workspace, flagged with the launch's epoch), the whole ones (y directly), the tail of
// its first row group last: it owns that row group, waits for the flags of the lower CTAs that
// hold its other units (written at their start, or at their end by a CTA whose whole run lies
// inside the row group) and adds their partials to its own in a fixed order (own, then the
// CTAs below from the nearest down), then writes y. Deterministic: which CTA holds which units
// depends only on (U, G), never on timing. A CTA waits only on lower-numbered CTAs, which are
// resident when it is (one CTA per SM, G <= SMs; the hardware starts a grid in index order).
//
// Activations: a ring of S stages of one K block each (32 KB at 64 tokens), a unit's block
// staged two units ahead by cp.async (XB 0: from x, 4-byte copies into wg_stage_x's B layout;
// XB 1: from a prepacked copy of x in that layout, q6k_sk_xb below, 16-byte copies); one
// barrier a unit (the copies visible; every warpgroup past the wgmmas that read the stage
// being refilled: wg_wait<2> leaves only the previous unit's last two steps in flight).
// Weights: each warp's two rows of a unit in registers, the next unit's loads in flight (as
// q6k_wg_f16). Block scale: as q6k_wg_f16, r = d / dmax with dmax over the segment's blocks.
#include "q6k_wgmma.cu"

// Probes (bench only, wrong y; 0 = the kernel): NOFIX the owner neither waits for nor adds the
// partials of the CTAs below; NOMMA no wgmma (the decode kept alive); NODEQ the raw code words
// as A (no decode).
// DRAIN 1: every unit ends with wg_wait<0>, so that no wgmma is in flight while the next
// unit's head (the ring's producer, copies, arrivals: code in divergent paths) runs; else
// ptxas serializes every wgmma of the kernel (C7518, "WG.DP in divergent path"): bundles A-C
// ran so.
#ifndef Q6SERVE_SK_DRAIN
#define Q6SERVE_SK_DRAIN 1
#endif
// LATE_RN 1: the next segment's row references and d loads at the segment's last unit, not at
// its start (12 registers less through the unit loop; the d loads get one unit to land).
#ifndef Q6SERVE_SK_LATE_RN
#define Q6SERVE_SK_LATE_RN 1
#endif
#ifndef Q6SERVE_SK_NOFIX
#define Q6SERVE_SK_NOFIX 0
#endif
#ifndef Q6SERVE_SK_NOMMA
#define Q6SERVE_SK_NOMMA 0
#endif
#ifndef Q6SERVE_SK_NODEQ
#define Q6SERVE_SK_NODEQ 0
#endif
#ifndef Q6SERVE_SK_DU
#define Q6SERVE_SK_DU 2
#endif
// Q6SERVE_SK_RESET 1: a slot's flag is set to 1 by its writer and back to 0 by its owner once
// read (each slot has one reader), so a launch needs no new argument (CUDA graphs replay one);
// 0: set to the launch's epoch (the host passes a new one to every launch), never reset.
#ifndef Q6SERVE_SK_RESET
#define Q6SERVE_SK_RESET 1
#endif
#if Q6SERVE_SK_RESET
#define SK_FLAG 1u
#else
#define SK_FLAG epoch
#endif
#ifndef Q6SERVE_SK_STAGES
#define Q6SERVE_SK_STAGES 4
#endif

// The B layout of one K block for tokens tok0 .. tok0 + 8NT - 1 (zeros past n_tok), all K
// blocks, as wg_stage_x stores it into shared memory: xb[z][kb][16 * 64 * NT words].
template <int NT>
__global__ void __launch_bounds__(256) q6k_sk_xb(const unsigned short* x, int n_tok, int K,
                                                  int n_chunks, u32* xb) {
    const int bpr = K >> 8;
    const long long per = (long long)NT * 256;  // items per (chunk, block)
    const long long total = (long long)n_chunks * bpr * per;
    for (long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x; i0 < total;
         i0 += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(i0 % per);
        const long long zb = i0 / per;
        const int kb = (int)(zb % bpr), z = (int)(zb / bpr);
        const int t = i & 3, n8 = (i >> 2) & 7, jj = (i >> 5) & 1, hn = (i >> 6) & 3;
        const int ng = i >> 8, n = z * 8 * NT + ng * 8 + n8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (n < n_tok)
            v = ldg128(x + (size_t)n * K + kb * 256 + hn * 64 + 16 * t + 8 * jj);
        u32* p = xb + (size_t)zb * (16 * 64 * NT) + (hn * 4 + 2 * jj) * 64 * NT + ng * 64 +
                 n8 * 4 + t;
        p[0] = v.x;
        p[32] = v.y;
        p[64 * NT] = v.z;
        p[64 * NT + 32] = v.w;
    }
}

#ifdef Q6SERVE_WGMMA
__device__ __forceinline__ u32 sk_ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void sk_st_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ float4 sk_ldcg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
// m64n16k16 / m64n8k16 (2 / 1 n-tiles: N = 9..16 / 1..8), as wgmma_rs<8> / <4> of q6k_wgmma.cu.
#define SK_ACC4(nt) "+f"(c[0][nt][0]), "+f"(c[0][nt][1]), "+f"(c[0][nt][2]), "+f"(c[0][nt][3])
template <>
__device__ __forceinline__ void wgmma_rs<2>(float (&c)[1][2][4], u32 a0, u32 a1, u32 a2, u32 a3,
                                            u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
        : SK_ACC4(0), SK_ACC4(1)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
}
template <>
__device__ __forceinline__ void wgmma_rs<1>(float (&c)[1][1][4], u32 a0, u32 a1, u32 a2, u32 a3,
                                            u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : SK_ACC4(0)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
}
#undef SK_ACC4

// unit j of [u0, u1) in the CTA's order (row groups last-first, blocks ascending in each):
// (row group, K block); rg -1 past the end.
__device__ __forceinline__ int2 sk_unit(int j, int u0, int u1, int bpr) {
    for (int rg = (u1 - 1) / bpr; rg >= 0 && rg * bpr + bpr > u0; --rg) {
        const int a = max(u0, rg * bpr), e = min(u1, rg * bpr + bpr);
        if (j < e - a) return make_int2(rg, a - rg * bpr + j);
        j -= e - a;
    }
    return make_int2(-1, 0);
}
#endif

// One K block of the unit (rg, kb) into ring stage `st` (one commit group per call, empty
// when rg < 0, so that the group count per thread stays uniform).
template <int NT, int XB>
__device__ __forceinline__ void sk_stage(u32 sbase, const unsigned short* x, const u32* xb,
                                         int K, int bpr, int n_tok, int tok0, int2 u, int st) {
    constexpr int SW = 16 * 64 * NT;  // u32 words a stage
    const u32 sb = sbase + 4u * (u32)(st * SW);
    if (u.x >= 0) {
        if (XB) {
            const u32* src = xb + ((size_t)blockIdx.z * bpr + u.y) * SW;
            for (int i = threadIdx.x; i < SW / 4; i += blockDim.x) {
                const u32 d = sb + 16u * (u32)i;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d),
                             "l"(src + 4 * i) : "memory");
            }
        } else {
            const int last = min(8 * NT, n_tok - tok0) - 1;
            constexpr int per = NT * 256;
            for (int i = threadIdx.x; i < per; i += blockDim.x) {
                const int t = i & 3, n8 = (i >> 2) & 7, jj = (i >> 5) & 1, hn = (i >> 6) & 3;
                const int ng = i >> 8, n = ng * 8 + n8, src = n <= last ? 4 : 0;
                const unsigned short* gp = x + (size_t)(tok0 + min(n, last)) * K + u.y * 256 +
                                           hn * 64 + 16 * t + 8 * jj;
                const int s0 = hn * 4 + 2 * jj;
                const u32 p = sb + 4u * (u32)(s0 * 64 * NT + ng * 64 + n8 * 4 + t);
                cp_async4z(p, gp, src);
                cp_async4z(p + 4 * 32, gp + 2, src);
                cp_async4z(p + 4 * 64 * NT, gp + 4, src);
                cp_async4z(p + 4 * (64 * NT + 32), gp + 6, src);
            }
        }
    }
    cp_async_commit();
}

// XB 2: the ring by bulk copies of the prepacked block (one cp.async.bulk of SW words a unit,
// issued by thread 0, completing on the stage's `full` mbarrier), and each warp's lane 0
// arriving on the stage's `empty` mbarrier (4 NWG arrivals) once the wgmmas that read it are
// done (at the start of the unit two later: wg_wait<2> at the end of the previous unit leaves
// only that unit's last two steps in flight). No barrier of the CTA a unit: a warpgroup waits
// only for its unit's bytes, the producer for the stage's readers of S units before (S = 6:
// the others may lag thread 0's warpgroup by two units).
__device__ __forceinline__ void sk_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// The spin in one asm block (as CUTLASS's ClusterBarrier::wait): a C++ loop on try_wait's
// per-thread result is a divergent path to ptxas, which then serializes every wgmma of the
// kernel (C7518, "compiler-inserted WG.DP in divergent path"; bundle B's sk2 ran so).
__device__ __forceinline__ void sk_mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nSK_WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra SK_WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void sk_mbar_arrive(u32 bar) {
    asm volatile("{ .reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar)
                 : "memory");
}
// thread 0: unit `u` (of nu) into stage u % S, once the stage's readers of unit u - S are done
template <int NT, int S>
__device__ __forceinline__ void sk_produce(u32 sbase, u32 bars, const u32* xb, int bpr, int u,
                                           int nu, int u0, int u1) {
    constexpr int SW = 16 * 64 * NT;
    if (u >= nu) return;
    const int st = u % S;
    const int2 un = sk_unit(u, u0, u1, bpr);
    const u32 full = bars + 8u * st, empty = bars + 8u * (S + st);
    if (u >= S) sk_mbar_wait(empty, (u32)((u / S - 1) & 1));
    asm volatile("{ .reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
                 ::"r"(full), "r"((u32)(SW * 4)) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];"
                 ::"r"(sbase + 4u * (u32)(st * SW)),
                 "l"(xb + ((size_t)blockIdx.z * bpr + un.y) * SW), "r"((u32)(SW * 4)), "r"(full)
                 : "memory");
}

// part: [z][G][128 NWG threads][4 NT floats] (each thread its accumulator fragment, float4s);
// flags: [z][G] u32, the epoch of the launch that last wrote the slot (zero at first; the host
// passes a new epoch to every launch, never 0), then one word counting waits given up (~1 s).
template <int NT, int SOA, int NWG, int XB>
__global__ void __launch_bounds__(128 * NWG, 1)
    q6k_wgsk_f16(PARAMS_W, const unsigned short* x, int K, const u32* xb, float* y, float* part,
                 u32* flags, int n_tok, u32 epoch) {
    static_assert(NT == 8 || NT == 4 || NT == 2 || NT == 1, "q6k_wgsk_f16: 8, 4, 2 or 1 n-tiles");
#ifdef Q6SERVE_WGMMA
    MAKE_W;
    constexpr int S = Q6SERVE_SK_STAGES;
    static_assert(S >= 4, "two units ahead: the stage refilled was read two units before the "
                          "current one (the previous unit's last two wgmmas may be in flight)");
    static_assert(XB != 2 || S >= 5, "XB 2: thread 0 would wait on its own warpgroup");
    constexpr int SW = 16 * 64 * NT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    const int tok0 = blockIdx.z * 8 * NT;
    const int gtiles = (w.rows + 63) >> 6;
    const int rgroups = (gtiles + NWG - 1) / NWG;
    const long long U = (long long)rgroups * bpr;
    const int G = gridDim.x, c = blockIdx.x;
    const int u0 = (int)(U * c / G), u1 = (int)(U * (c + 1) / G);
    if (u0 >= u1) return;  // CTA-uniform
    const int rg_lo = u0 / bpr;
    float* my_part = part + (((size_t)blockIdx.z * G + c) * (128 * NWG) + threadIdx.x) * (4 * NT);
    u32* fl = flags + (size_t)blockIdx.z * G;

    const u32 sbase = smem_u32(smem_x);
    const int nu = u1 - u0;
    const u32 bars = sbase + 4u * (u32)(S * SW);  // XB 2: full[S], empty[S] (8 bytes each)
    // the ring's first two units, before any weight load
    if (XB == 2) {
        if (threadIdx.x == 0) {
            for (int st = 0; st < S; ++st) {
                sk_mbar_init(bars + 8u * st, 1u);
                sk_mbar_init(bars + 8u * (S + st), 4u * NWG);
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            sk_produce<NT, S>(sbase, bars, xb, bpr, 0, nu, u0, u1);
            sk_produce<NT, S>(sbase, bars, xb, bpr, 1, nu, u0, u1);
        }
    } else {
        sk_stage<NT, XB>(sbase, x, xb, K, bpr, n_tok, tok0, sk_unit(0, u0, u1, bpr), 0);
        sk_stage<NT, XB>(sbase, x, xb, K, bpr, n_tok, tok0, sk_unit(1, u0, u1, bpr), 1);
    }

    const u64 desc0 = (u64)((sbase & 0x3FFFFu) >> 4) | ((u64)(128 >> 4) << 16) |
                      ((u64)(256 >> 4) << 32);
    const int qsh = 2 * (t >> 1);
    const u32 scsel = 0x4040u | (u32)t | ((u32)t << 8);
    constexpr int DU = Q6SERVE_SK_DU;  // d loads a lane and row in registers (4: 16 blocks, a whole row group of K <= 4096)

    // the first segment: the CTA's last row group
    int rg = (u1 - 1) / bpr;
    int a = max(u0, rg * bpr) - rg * bpr, e = min(u1, rg * bpr + bpr) - rg * bpr;
    int gt = rg * NWG + wg;
    bool live = gt < gtiles;  // warpgroup-uniform
    RowRef rr[1][2], rn[1][2];
    Raw nxt[1][2];
    DLoad<DU> dl = {};
    if (live) {
        warp_rows<SOA>(w, gt * 64 + wq * 16, g, rr);
        warp_load<SOA>(nxt, rr, a, t);
        dl = wg_dload<SOA, DU>(rr, a, e - a, t);
    }
    int j = 0;  // units done
    for (;;) {
        const bool more = rg > rg_lo;
        const int rgn = rg - 1;
        const int an = more ? max(u0, rgn * bpr) - rgn * bpr : 0;
        const int en = more ? bpr : 0;  // a row group below the last is held to its end
        const int gtn = rgn * NWG + wg;
        const bool liven = more && gtn < gtiles;
#if !Q6SERVE_SK_LATE_RN
        if (liven) warp_rows<SOA>(w, gtn * 64 + wq * 16, g, rn);
#endif
        float2 dmx = make_float2(0.f, 0.f);
        if (live) dmx = wg_dmax(dl);
#if !Q6SERVE_SK_LATE_RN
        if (liven) dl = wg_dload<SOA, DU>(rn, an, en - an, t);
#endif
        float rinv[2];
        rinv[0] = dmx.x > 0.f ? 1.f / dmx.x : 0.f;
        rinv[1] = dmx.y > 0.f ? 1.f / dmx.y : 0.f;
        float acc[1][NT][4];
        zero_acc(acc);
        for (int kb = a; kb < e; ++kb, ++j) {
            if (XB == 2) {
                if (j >= 2 && lane == 0) sk_mbar_arrive(bars + 8u * (S + (j - 2) % S));
                if (threadIdx.x == 0) sk_produce<NT, S>(sbase, bars, xb, bpr, j + 2, nu, u0, u1);
                // every warp, live or not: a warp that ran ahead would arrive twice in one
                // phase of an empty barrier
                sk_mbar_wait(bars + 8u * (j % S), (u32)((j / S) & 1));
            } else {
                cp_async_wait<1>();  // this thread's copies of unit j landed (j + 1 in flight)
                fence_async_shared();
                __syncthreads();  // everyone's copies of j; every wgmma of j - 1 issued, of j - 2 done
                sk_stage<NT, XB>(sbase, x, xb, K, bpr, n_tok, tok0, sk_unit(j + 2, u0, u1, bpr),
                                 (j + 2) % S);
            }
#if Q6SERVE_SK_LATE_RN  // the next segment's rows and d at its last unit (fewer live registers)
            if (liven && kb + 1 == e) {
                warp_rows<SOA>(w, gtn * 64 + wq * 16, g, rn);
                dl = wg_dload<SOA, DU>(rn, an, en - an, t);
            }
#endif
            if (!live && liven && kb + 1 == e)  // (this warpgroup's first tile is the next one)
                warp_load<SOA>(nxt, rn, an, t);
            if (live) {
                Raw raw[2];
                raw[0] = nxt[0][0];
                raw[1] = nxt[0][1];
                if (kb + 1 < e)
                    warp_load<SOA>(nxt, rr, kb + 1, t);
                else if (liven)
                    warp_load<SOA>(nxt, rn, an, t);
                u32 sc2[2][4];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const u32 rh = f16_bits(f16_to_f32(raw[hr].d) * rinv[hr]);
                    const u32 r2 = rh | (rh << 16);
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        sc2[hr][k] = hmul2(sc_pair(word4(raw[hr].sc, k), scsel), r2);
                }
                const u64 dblk = desc0 + (u64)((j % S) * (SW * 4 / 16));
#pragma unroll
                for (int s = 0; s < 16; ++s) {
                    const int hn = s >> 2, jq = s & 3;
#if Q6SERVE_SK_NODEQ  // (probe, wrong y) the raw code words as A: no decode
                    const uint2 a02 = make_uint2(word4(raw[0].ql[hn >> 1], jq) ^ sc2[0][hn],
                                                 word4(raw[0].qh[0], jq));
                    const uint2 a13 = make_uint2(word4(raw[1].ql[hn >> 1], jq) ^ sc2[1][hn],
                                                 word4(raw[1].qh[0], jq));
#else
                    const uint2 a02 = wg_deq<SOA>(raw[0], hn, jq, qsh, sc2[0][hn]);
                    const uint2 a13 = wg_deq<SOA>(raw[1], hn, jq, qsh, sc2[1][hn]);
#endif
                    wg_fence();
#if Q6SERVE_SK_NOMMA  // (probe, wrong y) the decode kept, no tensor-core work
                    asm volatile("" ::"r"(a02.x), "r"(a13.x), "r"(a02.y), "r"(a13.y), "l"(dblk));
#else
                    wgmma_rs<NT>(acc, a02.x, a13.x, a02.y, a13.y, dblk + (u64)(s * 16 * NT));
#endif
                    wg_commit();
                    wg_wait<2>();
                }
#if Q6SERVE_SK_DRAIN
                wg_wait<0>();  // no wgmma in flight across the next unit's divergent code
#endif
            }
        }
        if (live) wg_tile_end(acc, dmx);
        // owner: this CTA holds the row group's last unit
        const bool owner = rg < (u1 - 1) / bpr || u1 == rg * bpr + bpr;
        if (!owner) {  // the head of the CTA's last row group: a partial for the owner above
            if (live) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    reinterpret_cast<float4*>(my_part)[nt] =
                        make_float4(acc[0][nt][0], acc[0][nt][1], acc[0][nt][2], acc[0][nt][3]);
            }
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) sk_st_release(fl + c, SK_FLAG);
        } else {
            if (a > 0 && !Q6SERVE_SK_NOFIX) {  // the CTAs below hold the row group's other units
                if (threadIdx.x == 0)
                    for (int cl = c - 1; cl >= 0 && (int)(U * (cl + 1) / G) > rg * bpr; --cl)
                        for (int spin = 0; sk_ld_acquire(fl + cl) != SK_FLAG; ++spin) {
                            asm volatile("nanosleep.u32 64;");
                            if (spin == (1 << 24)) {  // ~1 s: counted, not hung (the bench says)
                                atomicAdd(flags + (size_t)gridDim.z * G, 1u);
                                break;
                            }
                        }
                __syncthreads();
                __threadfence();
                if (live)
                    for (int cl = c - 1; cl >= 0 && (int)(U * (cl + 1) / G) > rg * bpr; --cl) {
                        const float* pp =
                            part + (((size_t)blockIdx.z * G + cl) * (128 * NWG) + threadIdx.x) *
                                       (4 * NT);
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            const float4 v = sk_ldcg4(pp + 4 * nt);
                            acc[0][nt][0] += v.x;
                            acc[0][nt][1] += v.y;
                            acc[0][nt][2] += v.z;
                            acc[0][nt][3] += v.w;
                        }
                    }
                if (Q6SERVE_SK_RESET) {  // every partial read: the slots' flags back to 0
                    __syncthreads();
                    if (threadIdx.x == 0)
                        for (int cl = c - 1; cl >= 0 && (int)(U * (cl + 1) / G) > rg * bpr; --cl)
                            fl[cl] = 0u;
                }
            }
            if (live) {
                const int wrow = gt * 64 + wq * 16;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int row = wrow + g + 8 * (i >> 1);
                        const int tok = tok0 + nt * 8 + 2 * t + (i & 1);
                        if (row < w.rows && tok < n_tok) y[(size_t)tok * w.rows + row] = acc[0][nt][i];
                    }
            }
        }
        if (!more) break;
        rg = rgn;
        a = an;
        e = en;
        gt = gtn;
        live = liven;
        rr[0][0] = rn[0][0];
        rr[0][1] = rn[0][1];
    }
    if (XB != 2) cp_async_wait<0>();  // (no copies are left: the ring's last groups were empty)
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Stream-K v2 (sk3, session 30; compile-checked, not yet run): sk2's units, partition, ring of
// prepacked blocks and fix-up order (so the same sums: the same bits as sk2), but nothing
// between two units of a segment that ptxas must treat as divergent, so that it keeps the
// previous unit's last two wgmma groups in flight across the unit's head as q6k_wg_f16 does
// across its blocks (sk2 drains every unit: Q6SERVE_SK_DRAIN; without the drain ptxas
// serialized every wgmma, C7518). What changed against sk2:
// - no `live`: a warpgroup past the last 64-row tile decodes the last row's blocks (warp_rows
//   clamps the rows) and writes nothing (its rows fail emit's bound): the wgmmas sit in no
//   branch on the warp index;
// - the next unit's weights by selects (the segment's next block, or the next segment's
//   first), one warp_load a unit, no branch;
// - the next segment's rows and d loads at the segment's start (sk2's LATE_RN 0), before its
//   first wgmma;
// - the ring: every thread arrives on a stage's empty barrier (count 128 NWG) and every thread
//   waits for it before the refill, whose expect_tx and bulk copy thread 0 issues under a
//   predicate inside one asm (no branch on the thread index);
// - the fix-up in parallel: thread i waits for the flag of the i-th CTA below (all at once,
//   not one after the other by thread 0), and each thread loads its fragment of P partials
//   before adding them in the fixed order (own, then the nearest CTA below down).
// The segment's end (wg_wait<0>, the scale, the partial or the fix-up and y) runs with no
// wgmma in flight, as q6k_wg_f16's tile end.
#ifdef Q6SERVE_WGMMA
// Thread 0 (issuer): expect `bytes` on `full` and copy them from `src` to `dst` (cp.async.bulk);
// every other thread runs the same instructions with the predicate off.
__device__ __forceinline__ void sk3_issue(bool issuer, u32 full, u32 dst, const void* src,
                                          u32 bytes) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b64 st;\nsetp.ne.u32 p, %0, 0;\n"
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 st, [%1], %4;\n"
        "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3], %4, "
        "[%1];\n}\n" ::"r"((u32)issuer), "r"(full), "r"(dst), "l"(src), "r"(bytes)
        : "memory");
}

template <int NT, int SOA, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1)
    q6k_wgsk3_f16(PARAMS_W, const unsigned short* x, int K, const u32* xb, float* y, float* part,
                  u32* flags, int n_tok, u32 epoch) {
    static_assert(NT == 8 || NT == 4 || NT == 2 || NT == 1, "q6k_wgsk3_f16: 8, 4, 2 or 1 n-tiles");
    MAKE_W;
    (void)x;
    (void)K;
    (void)epoch;
    constexpr int S = Q6SERVE_SK_STAGES;
    static_assert(S >= 5, "the refill of unit j + 2 waits for the readers of unit j + 2 - S, "
                          "released at unit j + 4 - S's head (S = 6: two units of slack)");
    constexpr int SW = 16 * 64 * NT;  // u32 words a stage
    constexpr int P = NT == 8 ? 2 : 4;  // partials loaded together in the fix-up
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    const int tok0 = blockIdx.z * 8 * NT;
    const int gtiles = (w.rows + 63) >> 6;
    const int rgroups = (gtiles + NWG - 1) / NWG;
    const long long U = (long long)rgroups * bpr;
    const int G = gridDim.x, c = blockIdx.x;
    const int u0 = (int)(U * c / G), u1 = (int)(U * (c + 1) / G);
    if (u0 >= u1) return;  // CTA-uniform
    const int rg_lo = u0 / bpr;
    float* my_part = part + (((size_t)blockIdx.z * G + c) * (128 * NWG) + threadIdx.x) * (4 * NT);
    u32* fl = flags + (size_t)blockIdx.z * G;
    const int tid = threadIdx.x;
    const bool issuer = tid == 0;

    const u32 sbase = smem_u32(smem_x);
    const int nu = u1 - u0;
    const u32 bars = sbase + 4u * (u32)(S * SW);  // full[S], empty[S] (8 bytes each)
    const u32* xbz = xb + (size_t)blockIdx.z * bpr * SW;
    if (issuer) {
        for (int st = 0; st < S; ++st) {
            sk_mbar_init(bars + 8u * st, 1u);
            sk_mbar_init(bars + 8u * (S + st), 128u * NWG);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int u = 0; u < 2 && u < nu; ++u)  // the ring's first two units, before any weight load
        sk3_issue(issuer, bars + 8u * u, sbase + 4u * (u32)(u * SW),
                  xbz + (size_t)sk_unit(u, u0, u1, bpr).y * SW, (u32)(SW * 4));

    const u64 desc0 = (u64)((sbase & 0x3FFFFu) >> 4) | ((u64)(128 >> 4) << 16) |
                      ((u64)(256 >> 4) << 32);
    const int qsh = 2 * (t >> 1);
    const u32 scsel = 0x4040u | (u32)t | ((u32)t << 8);
    constexpr int DU = Q6SERVE_SK_DU;

    // the first segment: the CTA's last row group
    int rg = (u1 - 1) / bpr;
    int a = max(u0, rg * bpr) - rg * bpr, e = min(u1, rg * bpr + bpr) - rg * bpr;
    int gt = rg * NWG + wg;
    RowRef rr[1][2], rn[1][2];
    Raw nxt[1][2];
    warp_rows<SOA>(w, gt * 64 + wq * 16, g, rr);
    warp_load<SOA>(nxt, rr, a, t);
    DLoad<DU> dl = wg_dload<SOA, DU>(rr, a, e - a, t);
    int j = 0;  // units done
    for (;;) {
        const bool more = rg > rg_lo;  // CTA-uniform, as every segment bound below
        const int rgn = more ? rg - 1 : rg;
        const int an = more ? max(u0, rgn * bpr) - rgn * bpr : a;
        const int en = more ? bpr : e;  // a row group below the last is held to its end
        const int gtn = rgn * NWG + wg;
        warp_rows<SOA>(w, gtn * 64 + wq * 16, g, rn);  // (the last segment: its own rows again)
        const float2 dmx = wg_dmax(dl);
        if (more) dl = wg_dload<SOA, DU>(rn, an, en - an, t);
        float rinv[2];
        rinv[0] = dmx.x > 0.f ? 1.f / dmx.x : 0.f;
        rinv[1] = dmx.y > 0.f ? 1.f / dmx.y : 0.f;
        float acc[1][NT][4];
        zero_acc(acc);
        for (int kb = a; kb < e; ++kb, ++j) {
            // ring: unit j - 2's stage released (wg_wait<2> in unit j - 1 retired its wgmmas),
            // unit j + 2 into its stage once the readers of unit j + 2 - S released it, then
            // unit j's bytes awaited
            if (j >= 2) sk_mbar_arrive(bars + 8u * (S + (j - 2) % S));
            if (j + 2 < nu) {
                const int u = j + 2, st = u % S;
                if (u >= S) sk_mbar_wait(bars + 8u * (S + st), (u32)((u / S - 1) & 1));
                sk3_issue(issuer, bars + 8u * st, sbase + 4u * (u32)(st * SW),
                          xbz + (size_t)sk_unit(u, u0, u1, bpr).y * SW, (u32)(SW * 4));
            }
            sk_mbar_wait(bars + 8u * (j % S), (u32)((j / S) & 1));
            Raw raw[2];
            raw[0] = nxt[0][0];
            raw[1] = nxt[0][1];
            {  // the next unit's weights: this segment's next block, or the next one's first
                const bool in = kb + 1 < e;
                RowRef rs[1][2];
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    rs[0][hr].base = in ? rr[0][hr].base : rn[0][hr].base;
                    rs[0][hr].ql = in ? rr[0][hr].ql : rn[0][hr].ql;
                    rs[0][hr].qh = in ? rr[0][hr].qh : rn[0][hr].qh;
                    rs[0][hr].sc = in ? rr[0][hr].sc : rn[0][hr].sc;
                    rs[0][hr].d = in ? rr[0][hr].d : rn[0][hr].d;
                }
                warp_load<SOA>(nxt, rs, in ? kb + 1 : an, t);
            }
            u32 sc2[2][4];
            wg_scales(raw, rinv, scsel, sc2);
            wg_steps<NT, SOA>(acc, raw, sc2, qsh, desc0 + (u64)((j % S) * (SW * 4 / 16)));
        }
        wg_tile_end(acc, dmx);
        // owner: this CTA holds the row group's last unit
        const bool owner = rg < (u1 - 1) / bpr || u1 == rg * bpr + bpr;
        if (!owner) {  // the head of the CTA's last row group: a partial for the owner above
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                reinterpret_cast<float4*>(my_part)[nt] =
                    make_float4(acc[0][nt][0], acc[0][nt][1], acc[0][nt][2], acc[0][nt][3]);
            __threadfence();
            __syncthreads();
            if (issuer) sk_st_release(fl + c, SK_FLAG);
        } else {
            if (a > 0 && !Q6SERVE_SK_NOFIX) {  // the CTAs below hold the row group's other units
                int nlow = 0;  // c - 1, c - 2, .., c - nlow (CTA-uniform)
                while (c - 1 - nlow >= 0 && (int)(U * (c - nlow) / G) > rg * bpr) ++nlow;
                if (tid < nlow)  // all flags awaited at once
                    for (int spin = 0; sk_ld_acquire(fl + c - 1 - tid) != SK_FLAG;
                         ++spin) {
                        asm volatile("nanosleep.u32 64;");
                        if (spin == (1 << 24)) {  // ~1 s: counted, not hung (the bench says)
                            atomicAdd(flags + (size_t)gridDim.z * G, 1u);
                            break;
                        }
                    }
                __syncthreads();
                __threadfence();
                const float* pbase =
                    part + ((size_t)blockIdx.z * G * (128 * NWG) + threadIdx.x) * (4 * NT);
                for (int i0 = 0; i0 < nlow; i0 += P) {  // P partials' loads, then their adds
                    float4 v[P][NT];
#pragma unroll
                    for (int p = 0; p < P; ++p) {
                        const int cl = c - 1 - min(i0 + p, nlow - 1);
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            v[p][nt] = sk_ldcg4(pbase + (size_t)cl * (128 * NWG) * (4 * NT) +
                                                4 * nt);
                    }
#pragma unroll
                    for (int p = 0; p < P; ++p)
                        if (i0 + p < nlow)
#pragma unroll
                            for (int nt = 0; nt < NT; ++nt) {
                                acc[0][nt][0] += v[p][nt].x;
                                acc[0][nt][1] += v[p][nt].y;
                                acc[0][nt][2] += v[p][nt].z;
                                acc[0][nt][3] += v[p][nt].w;
                            }
                }
                if (Q6SERVE_SK_RESET) {  // every partial read: the slots' flags back to 0
                    __syncthreads();
                    if (tid < nlow) fl[c - 1 - tid] = 0u;
                }
            }
            ks_emit<NT, 1>(Out{y, nullptr, nullptr, n_tok}, w.rows, gt * 64 + wq * 16, tok0, acc,
                           lane);
        }
        if (!more) break;
        rg = rgn;
        a = an;
        e = en;
        gt = gtn;
        rr[0][0] = rn[0][0];
        rr[0][1] = rn[0][1];
    }
}
#endif

#ifdef Q6SERVE_SK_CHECK
#define INST_SK(NT, SOA, NWG, XB)                                                               \
    template __global__ void q6k_wgsk_f16<NT, SOA, NWG, XB>(                                   \
        const u64*, int, int, int, const unsigned short*, int, const u32*, float*, float*,      \
        u32*, int, u32);
INST_SK(8, 2, 3, 0) INST_SK(8, 2, 3, 1) INST_SK(4, 2, 3, 0) INST_SK(4, 2, 3, 1)
#if Q6SERVE_SK_STAGES >= 5
INST_SK(8, 2, 3, 2) INST_SK(4, 2, 3, 2) INST_SK(2, 2, 3, 2) INST_SK(1, 2, 3, 2)
#endif
INST_SK(8, 2, 2, 0) INST_SK(8, 2, 2, 1) INST_SK(2, 2, 3, 0) INST_SK(1, 2, 3, 0)
INST_SK(8, true, 3, 0) INST_SK(8, false, 3, 0)
#if Q6SERVE_SK_STAGES >= 5  // sk3 (stream-K v2): the widths and layouts sk_ab may ask for
#define INST_SK3(NT, SOA, NWG)                                                                  \
    template __global__ void q6k_wgsk3_f16<NT, SOA, NWG>(                                      \
        const u64*, int, int, int, const unsigned short*, int, const u32*, float*, float*,      \
        u32*, int, u32);
INST_SK3(8, 2, 3) INST_SK3(8, 2, 2) INST_SK3(4, 2, 3) INST_SK3(4, 2, 2) INST_SK3(2, 2, 3)
INST_SK3(1, 2, 3) INST_SK3(8, true, 3) INST_SK3(8, false, 3)
#endif
template __global__ void q6k_sk_xb<8>(const unsigned short*, int, int, int, u32*);
template __global__ void q6k_sk_xb<4>(const unsigned short*, int, int, int, u32*);
#endif
