// The top-k / log-sum-exp epilogue fused into one kernel: one CTA per row of y.
//
// Contract (kernels/epilogue.py): per row, the k largest values in descending order (ties:
// lower column first; NaN ranks above +inf), their columns, and lse = log(sum exp(y)) (f32
// exp terms of y - max, summed in f64; -inf for a row of -inf, NaN if the row has a NaN).
// Which of several columns tied at the k-th value make the cut is unspecified (here: the
// first to arrive). Output: one packed int32 row per row of y, [values bits | columns | lse
// bits] (2k + 1 words), downloaded in one copy by kernels/cuda_topk.py.
//
// Passes over the row (it is read from L2/HBM 7 times; nothing is staged):
//   1. max over non-NaN values, NaN flag     2. sum of exp(y - max) in f64
//   3-6. radix select of the k-th largest order key, 8 bits per pass (256-bin histogram in
//        shared memory over the columns still matching the prefix chosen so far; one atomic
//        per bin per warp, not per lane)
//   7. gather: columns above the k-th key, then as many equal to it as still needed
// then a bitonic sort of the (at most 256) candidates by one 64-bit key (~value, column).

#define Q6_TOPK_THREADS 1024
#define Q6_TOPK_MAX 256
#define Q6_TOPK_UNROLL 8

__device__ __forceinline__ unsigned int q6_order_key(float v) {
    // unsigned order == float order; NaN above +inf (as epilogue._order_key)
    const unsigned int u = __float_as_uint(v);
    if (v != v) return 0xFFFFFFFFu;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Columns tid, tid + B, ... (B = blockDim.x) visited Q6_TOPK_UNROLL at a time, all loads of a
// group issued before any is used. One CTA per row runs one CTA per SM on at most N SMs; with one
// load in flight per warp a pass over a 152064-column row is latency-bound (~90 us; the whole
// epilogue took 1.1-1.3 ms at N=64 on the H200 next to a 0.33 ms matmul).
template <class F>
__device__ __forceinline__ void q6_each(const float* __restrict__ row, int cols, F&& f) {
    const int B = (int)blockDim.x;
    int j = (int)threadIdx.x;
    for (; j + (Q6_TOPK_UNROLL - 1) * B < cols; j += Q6_TOPK_UNROLL * B) {
        float v[Q6_TOPK_UNROLL];
#pragma unroll
        for (int u = 0; u < Q6_TOPK_UNROLL; ++u) v[u] = row[j + u * B];
#pragma unroll
        for (int u = 0; u < Q6_TOPK_UNROLL; ++u) f(j + u * B, v[u]);
    }
    for (; j < cols; j += B) f(j, row[j]);
}

extern "C" __global__ void __launch_bounds__(Q6_TOPK_THREADS)
q6_topk_rows(const float* __restrict__ y, int cols, int k, int* __restrict__ packed) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long cand[Q6_TOPK_MAX];
    __shared__ float red_f[32];
    __shared__ int red_i[32];
    __shared__ double red_d[32];
    __shared__ float row_max;
    __shared__ int row_nan;
    __shared__ float row_lse;
    __shared__ unsigned int sel_prefix, sel_need, cnt_gt, cnt_eq;

    const float NEG_INF = __int_as_float(0xff800000);
    const float POS_INF = __int_as_float(0x7f800000);
    const float* row = y + (size_t)blockIdx.x * (size_t)cols;
    int* out = packed + (size_t)blockIdx.x * (size_t)(2 * k + 1);
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = (int)(blockDim.x >> 5);

    // 1. max over the non-NaN values, and whether there is a NaN
    float m = NEG_INF;
    int nan = 0;
    q6_each(row, cols, [&](int, float v) {
        if (v != v) nan = 1;
        else m = fmaxf(m, v);
    });
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    if (lane == 0) {
        red_f[warp] = m;
        red_i[warp] = nan;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nwarps ? red_f[lane] : NEG_INF;
        nan = lane < nwarps ? red_i[lane] : 0;
        for (int o = 16; o > 0; o >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            nan |= __shfl_xor_sync(0xffffffffu, nan, o);
        }
        if (lane == 0) {
            row_max = m;
            row_nan = nan;
        }
    }
    __syncthreads();

    // 2. sum of exp(y - shift) in f64; shift = max unless it is +-inf
    const float mx = row_max;
    const float shift = (mx == POS_INF || mx == NEG_INF) ? 0.f : mx;
    double s = 0.0;
    q6_each(row, cols, [&](int, float v) {
        if (v == v) s += (double)expf(v - shift);
    });
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) red_d[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < nwarps ? red_d[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) {
            row_lse = row_nan ? __int_as_float(0x7fc00000) : (float)((double)shift + log(s));
        }
    }

    // 3-6. radix select: the k-th largest key T, and how many columns equal to T are needed
    unsigned int prefix = 0u, mask = 0u, need = (unsigned int)k;
    for (int sh = 24; sh >= 0; sh -= 8) {
        for (int b = tid; b < 256; b += (int)blockDim.x) hist[b] = 0u;
        __syncthreads();
        // Warp-aggregated: the lanes of a warp that fall in one bin add once, by their
        // leader. Logits share a few top-byte bins, so plain per-lane atomics serialised on
        // one shared address (32 lanes, one instruction); the loop is warp-uniform so that
        // every lane reaches the __match_any_sync.
        const int B = (int)blockDim.x;
        for (int base = warp * 32; base < cols; base += Q6_TOPK_UNROLL * B) {
            unsigned int key[Q6_TOPK_UNROLL];  // loads first (as q6_each), then the bins
#pragma unroll
            for (int u = 0; u < Q6_TOPK_UNROLL; ++u) {
                const int j = base + u * B + lane;
                key[u] = j < cols ? q6_order_key(row[j]) : 0u;
            }
#pragma unroll
            for (int u = 0; u < Q6_TOPK_UNROLL; ++u) {
                const int j = base + u * B + lane;
                unsigned int bin = 0xFFFFFFFFu;  // lanes past the row or off the prefix
                if (j < cols && (key[u] & mask) == prefix) bin = (key[u] >> sh) & 255u;
                const unsigned int peers = __match_any_sync(0xffffffffu, bin);
                if (bin != 0xFFFFFFFFu && lane == __ffs(peers) - 1)
                    atomicAdd(&hist[bin], (unsigned int)__popc(peers));
            }
        }
        __syncthreads();
        if (tid == 0) {
            unsigned int above = 0u;  // matching columns in bins above b
            int b = 255;
            for (; b > 0; --b) {
                if (above + hist[b] >= need) break;
                above += hist[b];
            }
            sel_prefix = prefix | ((unsigned int)b << sh);
            sel_need = need - above;
        }
        __syncthreads();
        prefix = sel_prefix;
        need = sel_need;
        mask |= 255u << sh;
    }
    const unsigned int T = prefix;
    const unsigned int n_gt = (unsigned int)k - need;  // columns with a key above T

    // 7. gather the k candidates as (~key << 32 | column): ascending = value desc, column asc
    if (tid == 0) {
        cnt_gt = 0u;
        cnt_eq = 0u;
    }
    for (int i = tid; i < Q6_TOPK_MAX; i += (int)blockDim.x) cand[i] = ~0ull;
    __syncthreads();
    q6_each(row, cols, [&](int j, float v) {
        const unsigned int key = q6_order_key(v);
        const unsigned long long c = ((unsigned long long)(~key) << 32) | (unsigned int)j;
        if (key > T) {
            cand[atomicAdd(&cnt_gt, 1u)] = c;
        } else if (key == T) {
            const unsigned int slot = atomicAdd(&cnt_eq, 1u);
            if (slot < need) cand[n_gt + slot] = c;
        }
    });
    __syncthreads();

    // bitonic sort of the Q6_TOPK_MAX candidates (padding ~0 sorts last)
    for (unsigned int size = 2u; size <= Q6_TOPK_MAX; size <<= 1) {
        for (unsigned int stride = size >> 1; stride > 0u; stride >>= 1) {
            const unsigned int i = (unsigned int)tid;
            if (i < Q6_TOPK_MAX) {
                const unsigned int p = i ^ stride;
                if (p > i) {
                    const unsigned long long a = cand[i], b = cand[p];
                    const bool up = (i & size) == 0u;
                    if ((a > b) == up) {
                        cand[i] = b;
                        cand[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }

    for (int j = tid; j < k; j += (int)blockDim.x) {
        const unsigned int col = (unsigned int)(cand[j] & 0xFFFFFFFFull);
        out[j] = __float_as_int(row[col]);
        out[k + j] = (int)col;
    }
    if (tid == 0) out[2 * k] = __float_as_int(row_lse);
}
