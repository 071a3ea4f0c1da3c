// Shared device code of the Q6_K kernels: slab addressing, weight loads (SoA and AoS twins
// return the same bytes, which is what makes the two layouts bit-identical), 6-bit unpacking,
// inline-PTX helpers and the deterministic split-K epilogue.
//
// No CUDA headers are included on purpose: the same text compiles under NVRTC (CuPy) and nvcc.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// A resident weight: rows x (bpr * 256), stored as slabs of `rps` rows (the last may be
// shorter). Each slab is one allocation, laid out either as AoS 210-byte blocks or as the
// packed SoA planes of q6k.SoaLayout for that slab's blocks: ql[nb][128] | qh[nb][64] |
// scales[nb][16] | d[nb][2], blocks row-major, every plane 16-byte aligned (nb*128, nb*192 and
// nb*208 are multiples of 16).
struct Weight {
    const u64* slabs;
    int rows;
    int bpr;
    int rps;
};

// Byte offsets of block 0 of one row inside its slab, per plane.
struct RowRef {
    const u8* base;
    u32 ql, qh, sc, d;
};

// SOA (the layout code): 0 AoS, 1 SoA, 2 SoA in pair-stream order (session 11: the same planes,
// each block's code bytes re-ordered per lane; load_raw / quad_q below and docs/KERNELS.md).
template <int SOA>
__device__ __forceinline__ RowRef row_ref(const Weight& w, int r) {
    const int s = r / w.rps;
    const int lr = r - s * w.rps;
    const u32 nb = (u32)min(w.rps, w.rows - s * w.rps) * (u32)w.bpr;
    const u32 b0 = (u32)lr * (u32)w.bpr;
    RowRef ref;
    ref.base = (const u8*)w.slabs[s];
    if (SOA) {
        ref.ql = b0 * 128u;
        ref.qh = nb * 128u + b0 * 64u;
        ref.sc = nb * 192u + b0 * 16u;
        ref.d = nb * 208u + b0 * 2u;
    } else {
        ref.ql = b0 * 210u;
        ref.qh = ref.ql + 128u;
        ref.sc = ref.ql + 192u;
        ref.d = ref.ql + 208u;
    }
    return ref;
}

// ---- loads -----------------------------------------------------------------------------------

__device__ __forceinline__ uint4 ldg_stream128(const void* p) {
    // Weights are read once: keep them out of L1 so the activations stay there.
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_stream32(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg_u16(const void* p) {
    unsigned short v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return (u32)v;
}
__device__ __forceinline__ uint4 ldg128(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ldg64(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
// AoS blocks are 210 bytes: only 2-byte alignment is guaranteed.
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) {
    return ldg_u16(p) | (ldg_u16(p + 2) << 16);
}
__device__ __forceinline__ uint4 ld_u128_a2(const u8* p) {
    return make_uint4(ld_u32_a2(p), ld_u32_a2(p + 4), ld_u32_a2(p + 8), ld_u32_a2(p + 12));
}

// ---- the "quad" lane mapping (f16 MMA, exact f32, dequant) ------------------------------------
// Lane t (0..3) of a row-block reads ql bytes [16t, 16t+16) of each 64-byte half h and the qh
// bytes [16(t&1), +16) of half h: four lanes read each plane row contiguously (full sectors).
// It then holds 64 weights: for half h, nibble nib and word j, the quad
//   e = h*128 + 32*((t>>1) + 2*nib) + 16*(t&1) + 4*j + i,   i = 0..3,
// all in 16-group g = h*8 + 4*nib + t (scale byte t of scale word 2h+nib).
struct Raw {
    uint4 ql[2];
    uint4 qh[2];
    uint4 sc;
    u32 d;
};

template <int SOA>
__device__ __forceinline__ Raw load_raw(const RowRef& r, int b, int t) {
    Raw w;
    if (SOA == 2) {  // pair streams: ql holds W0..W7, qh[0] W8..W11 (qh[1] unused)
        const u8* ql = r.base + r.ql + (u32)b * 128u + 32u * t;
        w.ql[0] = ldg_stream128(ql);
        w.ql[1] = ldg_stream128(ql + 16);
        w.qh[0] = ldg_stream128(r.base + r.qh + (u32)b * 64u + 16u * t);
        w.sc = ldg128(r.base + r.sc + (u32)b * 16u);
        w.d = ldg_u16(r.base + r.d + (u32)b * 2u);
    } else if (SOA) {
        const u8* ql = r.base + r.ql + (u32)b * 128u + 16u * t;
        const u8* qh = r.base + r.qh + (u32)b * 64u + 16u * (t & 1);
        w.ql[0] = ldg_stream128(ql);
        w.ql[1] = ldg_stream128(ql + 64);
        w.qh[0] = ldg_stream128(qh);
        w.qh[1] = ldg_stream128(qh + 32);
        w.sc = ldg128(r.base + r.sc + (u32)b * 16u);
        w.d = ldg_u16(r.base + r.d + (u32)b * 2u);
    } else {
        const u8* blk = r.base + r.ql + (u32)b * 210u;
        w.ql[0] = ld_u128_a2(blk + 16 * t);
        w.ql[1] = ld_u128_a2(blk + 64 + 16 * t);
        w.qh[0] = ld_u128_a2(blk + 128 + 16 * (t & 1));
        w.qh[1] = ld_u128_a2(blk + 160 + 16 * (t & 1));
        w.sc = ld_u128_a2(blk + 192);
        w.d = ldg_u16(blk + 208);
    }
    return w;
}

// One part of load_raw's bytes: P = 0 the first 128-element half's codes (ql[0], qh[0]), P = 1
// the second half's and the scales (ql[1], qh[1], sc, d). q6k_ks_f16 at 4 and 8 n-tiles
// prefetches the next block in these two parts, the second when the current block's first half
// is done (its ql[0]/qh[0] registers dead): fewer live registers, the codes a block ahead, the
// scales half a block. On the H200 that ran N = 32/64 1.035-1.055x on the 48-56 MB shapes, but
// N <= 16 on the lm-heads 0.77-0.90x (the next block's start waited on its scales; with the
// scales in the first part the registers were those of the whole-block prefetch), so 1 and 2
// n-tiles keep load_raw at the block's start.
template <int SOA, int P>
__device__ __forceinline__ void load_raw_part(Raw& w, const RowRef& r, int b, int t) {
    if (SOA == 2) {  // pair streams: P = 0 W0..W3 and W8..W11, P = 1 W4..W7, scales, d
        const u8* ql = r.base + r.ql + (u32)b * 128u + 32u * t;
        if (P == 0) {
            w.ql[0] = ldg_stream128(ql);
            w.qh[0] = ldg_stream128(r.base + r.qh + (u32)b * 64u + 16u * t);
        } else {
            w.ql[1] = ldg_stream128(ql + 16);
            w.sc = ldg128(r.base + r.sc + (u32)b * 16u);
            w.d = ldg_u16(r.base + r.d + (u32)b * 2u);
        }
    } else if (SOA) {
        const u8* ql = r.base + r.ql + (u32)b * 128u + 16u * t + 64u * P;
        const u8* qh = r.base + r.qh + (u32)b * 64u + 16u * (t & 1) + 32u * P;
        w.ql[P] = ldg_stream128(ql);
        w.qh[P] = ldg_stream128(qh);
        if (P == 1) {
            w.sc = ldg128(r.base + r.sc + (u32)b * 16u);
            w.d = ldg_u16(r.base + r.d + (u32)b * 2u);
        }
    } else {
        const u8* blk = r.base + r.ql + (u32)b * 210u;
        w.ql[P] = ld_u128_a2(blk + 64 * P + 16 * t);
        w.qh[P] = ld_u128_a2(blk + 128 + 32 * P + 16 * (t & 1));
        if (P == 1) {
            w.sc = ld_u128_a2(blk + 192);
            w.d = ldg_u16(blk + 208);
        }
    }
}

__device__ __forceinline__ u32 word4(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// ---- pair streams (SOA == 2) ------------------------------------------------------------------
// Lane t's 48 code bytes of a block: W0..W7 (ql plane [32t, +32)) and W8..W11 (qh plane [16t,
// +16)). Sub-block m = 2h + nib is the triple (W[2m], W[2m+1], W[8+m]): two 48-bit streams (the
// low and the high halves of the three words), 8 six-bit fields each; field P of the low stream
// is element 2(P&1) of quad j = P>>1, of the high stream the element after it, so field P of
// both is one f16x2 A pair. pair_bits brings field P of both halves to bits 2-7 (field 3 is
// there; 0 1 4 6 7 one shift; 2 and 5 straddle two words: a byte permute and a shift).
__device__ __forceinline__ u32 pair_bits(int p, u32 w0, u32 w1, u32 w2) {
    switch (p) {
        case 0: return w0 << 2;
        case 1: return w0 >> 4;
        case 2: return __byte_perm(w0, w1, 0x6341u) >> 2;  // w0 bits 12-15 + w1 bits 0-1
        case 3: return w1;
        case 4: return w1 >> 6;
        case 5: return __byte_perm(w1, w2, 0x6341u) >> 4;  // w1 bits 14-15 + w2 bits 0-3
        case 6: return w2 >> 2;
        default: return w2 >> 8;
    }
}
// Field P of sub-block m of a pair-stream Raw (both halves at bits 2-7, other bits garbage).
__device__ __forceinline__ u32 pair_field(const Raw& w, int m, int p) {
    return pair_bits(p, word4(w.ql[m >> 1], 2 * (m & 1)), word4(w.ql[m >> 1], 2 * (m & 1) + 1),
                     word4(w.qh[0], m));
}
// The codes of quad (h, nib, j) as 4q (bits 2-7 of each byte, bits 0-1 zero), from pair streams.
__device__ __forceinline__ u32 pair_quad4(const Raw& w, int h, int nib, int j) {
    const int m = 2 * h + nib;
    return __byte_perm(pair_field(w, m, 2 * j) & 0x00FC00FCu,
                       pair_field(w, m, 2 * j + 1) & 0x00FC00FCu, 0x6420u);
}

// 6-bit codes (0..63, one per byte) of quad (h, nib, j); qsh = 2*(t>>1). The high bits sit at
// qh bits qsh (nib 0) and qsh + 4 (nib 1) of each byte: one shift each lands them on bits 4-5.
template <int SOA = 1>
__device__ __forceinline__ u32 quad_q(const Raw& w, int h, int nib, int j, int qsh) {
    if (SOA == 2) return pair_quad4(w, h, nib, j) >> 2;
    const u32 l = word4(w.ql[h], j), hw = word4(w.qh[h], j);
    return nib ? (((l >> 4) & 0x0F0F0F0Fu) | ((hw >> qsh) & 0x30303030u))
               : ((l & 0x0F0F0F0Fu) | ((hw << (4 - qsh)) & 0x30303030u));
}

// Signed scale byte t of scale word k.
__device__ __forceinline__ int quad_sc(const Raw& w, int k, int t) {
    return ((int)(word4(w.sc, k) << (24 - 8 * t))) >> 24;
}

// ---- number helpers --------------------------------------------------------------------------

__device__ __forceinline__ float f16_to_f32(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
__device__ __forceinline__ u32 f16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float bf16_to_f32(u32 b) { return __int_as_float(b << 16); }

// (q - 32) as an exact float, q in 0..63 held in byte `i` of `q4` (2^23 bias trick).
template <int I>
__device__ __forceinline__ float q_to_f32(u32 q4) {
    return __int_as_float(__byte_perm(q4, 0x4B000000u, 0x7440 + I)) - 8388640.0f;
}

// ---- activation readers: 8 consecutive values starting at an element offset ------------------
struct InF32 {
    typedef float T;
};
struct InF16 {
    typedef unsigned short T;
};
struct InBF16 {
    typedef unsigned short T;
};

// 8 consecutive activations as 4 f16x2 words (each rounded to f16 once, via exact f32).
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 v) {
    return pack_f16x2(bf16_to_f32(v & 0xFFFFu), bf16_to_f32(v >> 16));
}
template <class In>
__device__ __forceinline__ uint4 load_x8_f16(const typename In::T* p);
template <>
__device__ __forceinline__ uint4 load_x8_f16<InF32>(const float* p) {
    const uint4 a = ldg128(p), b = ldg128(p + 4);
    return make_uint4(pack_f16x2(__uint_as_float(a.x), __uint_as_float(a.y)),
                      pack_f16x2(__uint_as_float(a.z), __uint_as_float(a.w)),
                      pack_f16x2(__uint_as_float(b.x), __uint_as_float(b.y)),
                      pack_f16x2(__uint_as_float(b.z), __uint_as_float(b.w)));
}
template <>
__device__ __forceinline__ uint4 load_x8_f16<InF16>(const unsigned short* p) {
    return ldg128(p);
}
template <>
__device__ __forceinline__ uint4 load_x8_f16<InBF16>(const unsigned short* p) {
    const uint4 v = ldg128(p);
    return make_uint4(bf16x2_to_f16x2(v.x), bf16x2_to_f16x2(v.y), bf16x2_to_f16x2(v.z),
                      bf16x2_to_f16x2(v.w));
}

// 4 consecutive activations as exact f32.
template <class In>
__device__ __forceinline__ float4 load_x4_f32(const typename In::T* p);
template <>
__device__ __forceinline__ float4 load_x4_f32<InF32>(const float* p) {
    const uint4 a = ldg128(p);
    return make_float4(__uint_as_float(a.x), __uint_as_float(a.y), __uint_as_float(a.z),
                       __uint_as_float(a.w));
}
template <>
__device__ __forceinline__ float4 load_x4_f32<InF16>(const unsigned short* p) {
    const uint2 a = ldg64(p);
    return make_float4(f16_to_f32(a.x & 0xFFFFu), f16_to_f32(a.x >> 16), f16_to_f32(a.y & 0xFFFFu),
                       f16_to_f32(a.y >> 16));
}
template <>
__device__ __forceinline__ float4 load_x4_f32<InBF16>(const unsigned short* p) {
    const uint2 a = ldg64(p);
    return make_float4(bf16_to_f32(a.x & 0xFFFFu), bf16_to_f32(a.x >> 16),
                       bf16_to_f32(a.y & 0xFFFFu), bf16_to_f32(a.y >> 16));
}

__device__ __forceinline__ float ldcg_f32(const float* p) {
    float v;  // L2 only: other CTAs wrote it
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// ---- output ----------------------------------------------------------------------------------
// y is f32 [n_tok][rows]. With ksplit > 1 every CTA writes its partial sums to
// part[ky][n_tok][rows]; the last CTA of a (row tile, token chunk) to arrive (ticket counter)
// adds the ksplit partials in the fixed order 0..ksplit-1, so results never depend on timing.
struct Out {
    float* y;
    float* part;
    u32* tickets;  // one per (blockIdx.x, blockIdx.z); zero between launches (reset here)
    int n_tok;
};

__device__ __forceinline__ void emit(const Out& o, int rows, int row, int tok, float v) {
    if (row >= rows || tok >= o.n_tok) return;
    if (gridDim.y == 1) {
        o.y[(size_t)tok * rows + row] = v;
    } else {
        o.part[((size_t)blockIdx.y * o.n_tok + tok) * rows + row] = v;
    }
}

// Called by every thread of the CTA after its emits. rows_cta/toks_cta: the CTA's tile;
// ticket: the tile's counter (persistent kernels own several tiles, one after the other).
__device__ __forceinline__ void finish_split_at(const Out& o, int rows, u32 ticket, int row0,
                                                int rows_cta, int tok0, int toks_cta) {
    if (gridDim.y == 1) return;
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* t = o.tickets + ticket;
        const u32 prev = atomicAdd(t, 1u);
        last = (prev == gridDim.y - 1);
        if (last) *t = 0;  // ready for the next launch (stream order)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int nr = min(rows_cta, rows - row0);
    const int nt = min(toks_cta, o.n_tok - tok0);
    for (int i = threadIdx.x; i < nr * nt; i += blockDim.x) {
        const int tok = tok0 + i / nr, row = row0 + i % nr;
        float s = 0.f;
        for (int k = 0; k < (int)gridDim.y; ++k)
            s += ldcg_f32(o.part + ((size_t)k * o.n_tok + tok) * rows + row);
        o.y[(size_t)tok * rows + row] = s;
    }
}
__device__ __forceinline__ void finish_split(const Out& o, int rows, int row0, int rows_cta,
                                             int tok0, int toks_cta) {
    finish_split_at(o, rows, blockIdx.z * gridDim.x + blockIdx.x, row0, rows_cta, tok0, toks_cta);
}

// Programmatic dependent launch (PDL, sm_90; no-ops elsewhere and when the launch had no such
// attribute). A K-slice tile lets the split-K sum that follows it launch at once (its CTAs
// start as the tile's CTAs leave the SMs, instead of after the whole grid and a launch); the
// sum waits for the tile's completion and memory before reading the partials.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// K range of this CTA in blocks: ceil(bpr / ksplit) blocks per split.
__device__ __forceinline__ void k_range(int bpr, int& kb0, int& kb1) {
    const int per = (bpr + gridDim.y - 1) / gridDim.y;
    kb0 = blockIdx.y * per;
    kb1 = min(bpr, kb0 + per);
}
