// Byte-exact moves of Q6_K blocks between AoS (210-byte blocks) and the packed SoA planes of
// one slab (q6k.SoaLayout: ql[nb][128] | qh[nb][64] | scales[nb][16] | d[nb][2]).
// Used by the device-side load (staging AoS chunk -> resident slab), relayout (slab -> new
// slab) and read_aos (slab -> AoS staging). One thread per byte: not a hot path.
#include "q6k_common.cuh"

__device__ __forceinline__ u64 block_byte_addr(int soa, u64 nb, u64 b, u32 a) {
    if (!soa) return b * 210u + a;
    if (a < 128u) return b * 128u + a;
    if (a < 192u) return nb * 128u + b * 64u + (a - 128u);
    if (a < 208u) return nb * 192u + b * 16u + (a - 192u);
    return nb * 208u + b * 2u + (a - 208u);
}

// Copies blocks [src_b0, src_b0+count) of `src` to blocks [dst_b0, ...) of `dst`.
extern "C" __global__ void q6k_repack(const u8* src, int src_soa, u64 src_nb, u64 src_b0,
                                      u8* dst, int dst_soa, u64 dst_nb, u64 dst_b0, u64 count) {
    const u64 total = count * 210u;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 b = i / 210u;
        const u32 a = (u32)(i - b * 210u);
        dst[block_byte_addr(dst_soa, dst_nb, dst_b0 + b, a)] =
            src[block_byte_addr(src_soa, src_nb, src_b0 + b, a)];
    }
}
