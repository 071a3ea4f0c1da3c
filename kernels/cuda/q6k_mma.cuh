// Shared pieces of the f16 tensor-core kernels (q6k_matmul.cu, q6k_mma_ws.cu): kernel
// parameter macros, f16x2 dequantization, cp.async and mma.sync wrappers, the fragment-order
// activation offsets. Moved verbatim from q6k_matmul.cu. Include after q6k_common.cuh (the loader
// inlines each include where it appears, so headers do not include each other).
#pragma once

#define PARAMS_W const u64 *slabs, int rows, int bpr, int rps
#define PARAMS_OUT float *y, float *part, u32 *tickets, int n_tok
#define MAKE_W Weight w = {slabs, rows, bpr, rps}
#define MAKE_OUT Out o = {y, part, tickets, n_tok}

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// f16x2 of sc*(q-32) for the two code bytes picked by SEL (0x4140: bytes 0,1; 0x4342: 2,3).
// 0x64XX is 1024+XX in f16, 0x6420 is 1056: the subtraction is exact, and so is the product
// unless |sc*(q-32)| > 2048 (then it is rounded to f16, the F16 path's contract).
// The 0x64 bytes come from constant memory, so SEL can be the PRMT's immediate: with both as
// literals ptxas makes the magic the immediate and copies SEL from a uniform register before
// every PRMT (~60 moves per 256-block in the decode loop's SASS).
__constant__ u32 kDeqMagic = 0x64646464u;
template <u32 SEL>
__device__ __forceinline__ u32 deq2(u32 q, u32 sc2) {
    return hmul2(hsub2(__byte_perm(q, kDeqMagic, SEL), 0x64206420u), sc2);
}

// f16x2 (sc, sc) of the signed scale byte that `sel` (0x4040 | t | t << 8) picks from word v:
// v ^ 0x80 turns each byte into sc + 128, the 0x64 magic into the f16 1024 + sc + 128, and
// subtracting 1152 is exact: the same bits as f16(float(sc)) in both halves, without I2F/F2F.
__device__ __forceinline__ u32 sc_pair(u32 v, u32 sel) {
    return hsub2(__byte_perm(v ^ 0x80808080u, 0x64646464u, sel), 0x64806480u);
}

// The one-HFMA2 decode, now the pair streams' (deq2p below; on the nibble layouts session 7
// measured it on the register-prefetch tiles and reverted it there, which stall on load latency,
// and session 8 kept it on the ring tile src 5, 1.00-1.05x, until that tile left the product code
// after session 21): with the code two bits up (4q),
// v = 0x64XX = 1024 + 4q and fma(v, sc/4, -288*sc) = sc*(q-32) rounded once, the same A bits as
// deq2 (both constants are exact f16 for every scale byte: sc/4, and 288*sc = 9*sc*32 with
// 9*|sc| <= 1152 < 2^11).
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// f16x2 (sc/4, sc/4) of the scale byte `sel` picks (as sc_pair): (1152 + sc)/4 - 288, exact.
__device__ __forceinline__ u32 sc4_pair(u32 v, u32 sel) {
    return hfma2(__byte_perm(v ^ 0x80808080u, 0x64646464u, sel), 0x34003400u, 0xDC80DC80u);
}
// deq2p's bias pair -288*sc = (sc/4) * -1152, exact (a zero scale gives -0; fma(v, 0, -0) = +0).
__device__ __forceinline__ u32 bias_pair(u32 s4) { return hmul2(s4, 0xE480E480u); }

// Pair streams (layout 2): field bits v (pair_bits) -> the A pair, the one-HFMA2 decode after
// one LOP3 ((v & mask) | 0x6400 magic). The magic comes in a register (read once from constant
// memory): with both constants as immediates ptxas emits two LOP3s (a LOP3 takes one immediate).
__constant__ u32 kPairMagic = 0x64006400u;
__device__ __forceinline__ u32 deq2p(u32 v, u32 s4, u32 c, u32 magic) {
    u32 r;
    asm("lop3.b32 %0, %1, 0x00FC00FC, %2, 0xEA;" : "=r"(r) : "r"(v), "r"(magic));
    return hfma2(r, s4, c);
}

// 1/x to within 1 ulp (MUFU.RCP): the f16 tile scales its accumulators by 1/d then d around
// each block, so this costs <= 2 ulp of f32 per block instead of the IEEE division's sequence.
__device__ __forceinline__ float rcp_approx(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// The shared-state-space address (what cp.async, wgmma descriptors and mapa take) of a generic
// pointer into this CTA's shared memory.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(gmem)
                 : "memory");
}
// 4-byte copy through L1 (cp.async.cg only moves 16 bytes).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(smem)), "l"(gmem)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mma_f16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                        u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_u8s8(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// Exact float of an int with |v| < 2^22 (full-rate ops instead of the slow I2F).
__device__ __forceinline__ float small_i2f(int v) {
    return __int_as_float(v + 0x4B400000) - 12582912.0f;
}

// Element offset inside a block of the 8 activations lane t needs for step pair sp
// (half h = sp>>2, nibble nib = (sp>>1)&1, words j = 2*(sp&1) + 0..1).
__device__ __forceinline__ int quad_x_off(int sp, int t) {
    const int h = sp >> 2, nib = (sp >> 1) & 1, jj = sp & 1;
    return h * 128 + 32 * ((t >> 1) + 2 * nib) + 16 * (t & 1) + 8 * jj;
}
