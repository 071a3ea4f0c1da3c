// The top-k / log-sum-exp epilogue.
//
// Contract (kernels/epilogue.py): per row, the k largest values in descending order (ties:
// lower column first; NaN ranks above +inf), their columns, and lse = log(sum exp(y)) (f32
// exp terms of y - max, summed in f64; -inf for a row of -inf, NaN if the row has a NaN).
// Which of several columns tied at the k-th value make the cut is unspecified (here: the
// first to arrive). Output: one packed int32 row per row of y, [values bits | columns | lse
// bits] (2k + 1 words), downloaded in one copy by kernels/cuda_topk.py.
//
// Two ways (kernels/cuda_topk.py picks per row width and k):
// - q6_topk_scan + q6_topk_pick (the group form, at the end of this file): y read once by every
//   SM, then per row only the ~k groups of 64 columns that can hold a top-k column.
// - q6_topk_rows (also the groups form's way for rows it cannot bound): one CTA per row. Passes over the row (read from L2/HBM 7 times; nothing
//   staged): 1. max over non-NaN values, NaN flag  2. sum of exp(y - max) in f64  3-6. radix
//   select of the k-th largest order key, 8 bits per pass (256-bin histogram in shared memory
//   over the columns still matching the prefix chosen so far; one atomic per bin per warp, not
//   per lane)  7. gather: columns above the k-th key, then as many equal to it as still needed;
//   then a bitonic sort of the (at most 256) candidates by one 64-bit key (~value, column).
// (The split form, q6_topk_chunks + q6_topk_merge - rows cut into column chunks, one CTA per
// (chunk, row), then a merge per row - left in session 14: nothing in the product picked it.)
#define Q6_TOPK_THREADS 1024
#define Q6_TOPK_MAX 256
#define Q6_TOPK_UNROLL 8

__device__ __forceinline__ unsigned int q6_order_key(float v) {
    // unsigned order == float order; NaN above +inf (as epilogue._order_key)
    const unsigned int u = __float_as_uint(v);
    if (v != v) return 0xFFFFFFFFu;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Warp-wide max of m and or of nan, and sum of s (every lane gets the result).
__device__ __forceinline__ void q6_warp_max_or(float& m, int& nan) {
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
}
__device__ __forceinline__ double q6_warp_sum(double s) {
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
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

struct Q6TopkShared {
    unsigned int hist[256];
    unsigned long long cand[Q6_TOPK_MAX];
    float red_f[32];
    int red_i[32];
    double red_d[32];
    float row_max;
    int row_nan;
    double row_sum;
    unsigned int sel_prefix, sel_need, cnt_gt, cnt_eq;
};

// Passes 1-2 over row[0, cols): sh.row_max (max of the non-NaN values, -inf if none),
// sh.row_nan, sh.row_sum = sum of exp(y - shift) in f64, shift = the max unless it is +-inf
// (then 0). Every thread of the CTA calls it; the results are valid after it returns.
__device__ void q6_row_stats(const float* __restrict__ row, int cols, Q6TopkShared& sh) {
    const float NEG_INF = __int_as_float(0xff800000);
    const float POS_INF = __int_as_float(0x7f800000);
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = (int)(blockDim.x >> 5);
    float m = NEG_INF;
    int nan = 0;
    q6_each(row, cols, [&](int, float v) {
        if (v != v) nan = 1;
        else m = fmaxf(m, v);
    });
    q6_warp_max_or(m, nan);
    if (lane == 0) {
        sh.red_f[warp] = m;
        sh.red_i[warp] = nan;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nwarps ? sh.red_f[lane] : NEG_INF;
        nan = lane < nwarps ? sh.red_i[lane] : 0;
        q6_warp_max_or(m, nan);
        if (lane == 0) {
            sh.row_max = m;
            sh.row_nan = nan;
        }
    }
    __syncthreads();
    const float mx = sh.row_max;
    const float shift = (mx == POS_INF || mx == NEG_INF) ? 0.f : mx;
    double s = 0.0;
    q6_each(row, cols, [&](int, float v) {
        if (v == v) s += (double)expf(v - shift);
    });
    s = q6_warp_sum(s);
    if (lane == 0) sh.red_d[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < nwarps ? sh.red_d[lane] : 0.0;
        s = q6_warp_sum(s);
        if (lane == 0) sh.row_sum = s;
    }
    __syncthreads();
}

// lse from a row's (max, sum of exp(y - shift), NaN) as q6_row_stats defines them.
__device__ __forceinline__ float q6_lse(float mx, double s, int nan) {
    if (nan) return __int_as_float(0x7fc00000);
    const bool inf = mx == __int_as_float(0x7f800000) || mx == __int_as_float(0xff800000);
    return (float)((double)(inf ? 0.f : mx) + log(s));
}

// One radix-select pass's choice: the bin holding the need-th largest key (scanning from bin
// 255 down; bin 0 if none). Warp 0 scans: each lane sums 8 bins, a suffix sum over the lanes
// finds the lane holding the target, which walks its 8 (a serial walk over 256 bins by one
// thread took ~5 us per pass, ~20 us of every CTA's 4 passes).
__device__ __forceinline__ void q6_pick_bin(Q6TopkShared& sh, unsigned int& prefix,
                                            unsigned int& mask, unsigned int& need, int sh_bits) {
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = (int)threadIdx.x;
        unsigned int own = 0u;
#pragma unroll
        for (int i = 0; i < 8; ++i) own += sh.hist[8 * lane + i];
        unsigned int suf = own;  // keys in the bins of lanes >= this one
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned int t = __shfl_down_sync(0xffffffffu, suf, o);
            if (lane + o < 32) suf += t;
        }
        const unsigned int above_lane = suf - own;  // keys in the bins of lanes above
        const bool here = above_lane < need && need <= suf;
        const unsigned int hit = __ballot_sync(0xffffffffu, here);
        if (hit == 0u ? lane == 0 : here) {
            unsigned int above = above_lane;
            int b = 8 * lane + 7;
            for (; b > 8 * lane; --b) {
                if (above + sh.hist[b] >= need) break;
                above += sh.hist[b];
            }
            sh.sel_prefix = prefix | ((unsigned int)b << sh_bits);
            sh.sel_need = need - above;
        }
    }
    __syncthreads();
    prefix = sh.sel_prefix;
    need = sh.sel_need;
    mask |= 255u << sh_bits;
}

// Radix select over keys key_of(0..count): the top (32 - last_shb) bits of the k-th largest
// key, 8 bits per pass (passes at shb = 24, 16, ... last_shb); returns that prefix (the lower
// bits 0) and sets need = how many keys with that prefix belong to the top k. With fewer than
// k keys the prefix is 0 (every key matches). Each pass: a 256-bin histogram in shared memory
// over the keys still matching the prefix chosen so far, warp-aggregated: the lanes of a warp
// that fall in one bin add once, by their leader (logits share a few top-byte bins, so plain
// per-lane atomics serialised on one shared address; the loop is warp-uniform so that every
// lane reaches the __match_any_sync); keys loaded Q6_TOPK_UNROLL at a time before any is used.
template <class K>
__device__ unsigned int q6_radix_select(K&& key_of, int count, int k, int last_shb,
                                        Q6TopkShared& sh, unsigned int& need) {
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int B = (int)blockDim.x;
    unsigned int prefix = 0u, mask = 0u;
    need = (unsigned int)k;
    for (int shb = 24; shb >= last_shb; shb -= 8) {
        for (int b = tid; b < 256; b += B) sh.hist[b] = 0u;
        __syncthreads();
        for (int base = warp * 32; base < count; base += Q6_TOPK_UNROLL * B) {
            unsigned int key[Q6_TOPK_UNROLL];
#pragma unroll
            for (int u = 0; u < Q6_TOPK_UNROLL; ++u) {
                const int j = base + u * B + lane;
                key[u] = j < count ? key_of(j) : 0u;
            }
#pragma unroll
            for (int u = 0; u < Q6_TOPK_UNROLL; ++u) {
                const int j = base + u * B + lane;
                unsigned int bin = 0xFFFFFFFFu;  // lanes past the end or off the prefix
                if (j < count && (key[u] & mask) == prefix) bin = (key[u] >> shb) & 255u;
                const unsigned int peers = __match_any_sync(0xffffffffu, bin);
                if (bin != 0xFFFFFFFFu && lane == __ffs(peers) - 1)
                    atomicAdd(&sh.hist[bin], (unsigned int)__popc(peers));
            }
        }
        q6_pick_bin(sh, prefix, mask, need, shb);
    }
    return prefix;
}

// Passes 3-6 over row[0, cols): the k-th largest order key T; returns T, sets need = how many
// columns equal to T belong to the top k.
__device__ unsigned int q6_select_row(const float* __restrict__ row, int cols, int k,
                                      Q6TopkShared& sh, unsigned int& need) {
    return q6_radix_select([&](int j) { return q6_order_key(row[j]); }, cols, k, 0, sh, need);
}

// The gather's start: no candidates yet (every slot ~0: sorts last).
__device__ __forceinline__ void q6_cand_reset(Q6TopkShared& sh) {
    if (threadIdx.x == 0) {
        sh.cnt_gt = 0u;
        sh.cnt_eq = 0u;
    }
    for (int i = (int)threadIdx.x; i < Q6_TOPK_MAX; i += (int)blockDim.x) sh.cand[i] = ~0ull;
    __syncthreads();
}

// Candidate c = (~key << 32 | column) into sh.cand if it makes the top k: the n_gt keys above
// T go first (any order), then the first `need` equal to T.
__device__ __forceinline__ void q6_cand_offer(Q6TopkShared& sh, unsigned int key,
                                              unsigned long long c, unsigned int T,
                                              unsigned int n_gt, unsigned int need) {
    if (key > T) {
        sh.cand[atomicAdd(&sh.cnt_gt, 1u)] = c;
    } else if (key == T) {
        const unsigned int slot = atomicAdd(&sh.cnt_eq, 1u);
        if (slot < need) sh.cand[n_gt + slot] = c;
    }
}

// Pass 7: the candidates of row[0, cols) into sh.cand as (~key << 32 | col0 + column):
// ascending = value desc, column asc. The slots past n_gt + need keep ~0 (they sort last).
__device__ void q6_gather_row(const float* __restrict__ row, int cols, int col0,
                              unsigned int T, unsigned int n_gt, unsigned int need,
                              Q6TopkShared& sh) {
    q6_cand_reset(sh);
    q6_each(row, cols, [&](int j, float v) {
        const unsigned int key = q6_order_key(v);
        q6_cand_offer(sh, key, ((unsigned long long)(~key) << 32) | (unsigned int)(col0 + j),
                      T, n_gt, need);
    });
    __syncthreads();
}

// Bitonic sort of the Q6_TOPK_MAX candidates, then the packed output row: values read from
// y_row at each candidate's column, the columns, the lse.
__device__ void q6_sort_and_write(Q6TopkShared& sh, const float* __restrict__ y_row, int k,
                                  float lse, int* __restrict__ out) {
    const int tid = (int)threadIdx.x;
    for (unsigned int size = 2u; size <= Q6_TOPK_MAX; size <<= 1) {
        for (unsigned int stride = size >> 1; stride > 0u; stride >>= 1) {
            const unsigned int i = (unsigned int)tid;
            if (i < Q6_TOPK_MAX) {
                const unsigned int p = i ^ stride;
                if (p > i) {
                    const unsigned long long a = sh.cand[i], b = sh.cand[p];
                    const bool up = (i & size) == 0u;
                    if ((a > b) == up) {
                        sh.cand[i] = b;
                        sh.cand[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
    for (int j = tid; j < k; j += (int)blockDim.x) {
        const unsigned int col = (unsigned int)(sh.cand[j] & 0xFFFFFFFFull);
        out[j] = __float_as_int(y_row[col]);
        out[k + j] = (int)col;
    }
    if (tid == 0) out[2 * k] = __float_as_int(lse);
}

extern "C" __global__ void __launch_bounds__(Q6_TOPK_THREADS)
q6_topk_rows(const float* __restrict__ y, int cols, int k, int* __restrict__ packed) {
    __shared__ Q6TopkShared sh;
    const float* row = y + (size_t)blockIdx.x * (size_t)cols;
    q6_row_stats(row, cols, sh);
    unsigned int need;
    const unsigned int T = q6_select_row(row, cols, k, sh, need);
    q6_gather_row(row, cols, 0, T, (unsigned int)k - need, need, sh);
    q6_sort_and_write(sh, row, k, q6_lse(sh.row_max, sh.row_sum, sh.row_nan),
                      packed + (size_t)blockIdx.x * (size_t)(2 * k + 1));
}

// ---- The group form (kernels/cuda_topk.py's default): y read once, candidates bounded ----
//
// q6_topk_scan: one CTA of Q6_TOPK_SCAN_THREADS per (chunk of Q6_TOPK_CHUNK columns, row), so
// that every SM streams y at once (N=64 x 152064: 2432 CTAs). Thread t loads its 16 columns
// chunk0 + u * 1024 + 4t + e (u, e < 4: float4-coalesced) once into registers; the 4 threads of
// a quad q = t / 4 make a "group" of 64 columns, chunk0 + u * 1024 + 16q + w (u < 4, w < 16),
// whose largest order key the quad writes; the CTA writes its chunk's (max, sum of
// exp(y - its max) in f64, NaN).
// q6_topk_pick: one CTA per row. tau = the top 16 bits of the k-th largest group key (two radix
// passes over the row's cols/64 group keys). Every top-k column has a key >= tau: the k largest
// group maxima are k distinct columns, so the k-th largest column is >= the k-th largest group
// maximum >= tau. So only the groups whose maximum is >= tau are read again (about k of them
// for logits), their columns >= tau staged in shared memory (at least k; about k for logits),
// ranked (or sorted) there by the 64-bit (~key, column) key and the first k written. Rows with
// more than Q6_TOPK_SEL_CAP such groups or `cap` such columns (heavy ties: a row of zeros) run
// the one-CTA-per-row passes instead. H200, N=64 x 152064, k=64 (bench/RESULTS.md): 140 us
// for the split form (chunks + merge, removed), 37 us for these two (the scan 23 of them).
#define Q6_TOPK_SCAN_THREADS 256
#define Q6_TOPK_CHUNK (Q6_TOPK_SCAN_THREADS * 16)
#define Q6_TOPK_GROUPS (Q6_TOPK_SCAN_THREADS / 4)  // groups of 64 columns per chunk
#define Q6_TOPK_CAND_CAP 2048
#define Q6_TOPK_SEL_CAP 1024
#define Q6_TOPK_RANK_MAX 512  // candidates ranked by counting up to this many, else sorted

// Column of value i (< 64) of group g of a row (chunk g / Q6_TOPK_GROUPS).
__device__ __forceinline__ int q6_group_col(int g, int i) {
    return (g / Q6_TOPK_GROUPS) * Q6_TOPK_CHUNK + (i >> 4) * 1024 + (g % Q6_TOPK_GROUPS) * 16 +
           (i & 15);
}

// Block-wide max / or over the CTA (every thread gets the result); red: >= 32 slots.
__device__ __forceinline__ void q6_block_max_or(float& m, int& nan, float* red_f, int* red_i) {
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    const int nwarps = (int)(blockDim.x >> 5);
    q6_warp_max_or(m, nan);
    if (lane == 0) {
        red_f[warp] = m;
        red_i[warp] = nan;
    }
    __syncthreads();
    m = red_f[0];
    nan = red_i[0];
    for (int w = 1; w < nwarps; ++w) {
        m = fmaxf(m, red_f[w]);
        nan |= red_i[w];
    }
}

template <bool VEC>
__device__ __forceinline__ void q6_topk_scan_impl(const float* __restrict__ y, int cols,
                                                  unsigned int* __restrict__ gkey,
                                                  float* __restrict__ cmax,
                                                  double* __restrict__ csum,
                                                  int* __restrict__ cnan) {
    __shared__ float red_f[32];
    __shared__ int red_i[32];
    __shared__ double red_d[32];
    const float NEG_INF = __int_as_float(0xff800000);
    const float POS_INF = __int_as_float(0x7f800000);
    const int c = (int)blockIdx.x, chunks = (int)gridDim.x, t = (int)threadIdx.x;
    const size_t r = blockIdx.y;
    const float* row = y + r * (size_t)cols;
    const int col0 = c * Q6_TOPK_CHUNK + 4 * t;
    float v[16];
    bool ok[16];
    if (VEC) {  // cols % 4 == 0 and the row 16-byte aligned: a float4 is all in or all out
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int j = col0 + u * 1024;
            float4 q = make_float4(0.f, 0.f, 0.f, 0.f);
            if (j < cols) q = __ldg(reinterpret_cast<const float4*>(row + j));
            v[4 * u] = q.x;
            v[4 * u + 1] = q.y;
            v[4 * u + 2] = q.z;
            v[4 * u + 3] = q.w;
#pragma unroll
            for (int e = 0; e < 4; ++e) ok[4 * u + e] = j < cols;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int j = col0 + (i >> 2) * 1024 + (i & 3);
            ok[i] = j < cols;
            v[i] = ok[i] ? __ldg(row + j) : 0.f;
        }
    }
    unsigned int kmax = 0u;  // below every float's key: columns past the row never win
    float m = NEG_INF;
    int nan = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        if (!ok[i]) continue;
        kmax = max(kmax, q6_order_key(v[i]));
        if (v[i] != v[i]) nan = 1;
        else m = fmaxf(m, v[i]);
    }
    kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, 1));  // the quad's group
    kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, 2));
    if ((t & 3) == 0)
        gkey[(r * (size_t)chunks + (size_t)c) * Q6_TOPK_GROUPS + (size_t)(t >> 2)] = kmax;
    q6_block_max_or(m, nan, red_f, red_i);
    const float shift = (m == POS_INF || m == NEG_INF) ? 0.f : m;
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < 16; ++i)
        if (ok[i] && v[i] == v[i]) s += (double)expf(v[i] - shift);
    s = q6_warp_sum(s);
    const int lane = t & 31, warp = t >> 5;
    if (lane == 0) red_d[warp] = s;
    __syncthreads();
    if (t == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) s += red_d[w];
        const size_t slot = r * (size_t)chunks + (size_t)c;
        cmax[slot] = m;
        csum[slot] = s;
        cnan[slot] = nan;
    }
}

extern "C" __global__ void __launch_bounds__(Q6_TOPK_SCAN_THREADS)
q6_topk_scan(const float* __restrict__ y, int cols, unsigned int* __restrict__ gkey,
             float* __restrict__ cmax, double* __restrict__ csum, int* __restrict__ cnan) {
    q6_topk_scan_impl<false>(y, cols, gkey, cmax, csum, cnan);
}

extern "C" __global__ void __launch_bounds__(Q6_TOPK_SCAN_THREADS)
q6_topk_scan_v4(const float* __restrict__ y, int cols, unsigned int* __restrict__ gkey,
                float* __restrict__ cmax, double* __restrict__ csum, int* __restrict__ cnan) {
    q6_topk_scan_impl<true>(y, cols, gkey, cmax, csum, cnan);
}

// The row's lse from its chunks' (max, sum of exp(y - max), NaN), by one whole warp: NaN if
// a chunk had one, +-inf if the max is, else M + log(sum_c csum_c * exp(max_c - M)).
__device__ __forceinline__ float q6_chunks_lse(const float* __restrict__ cmax,
                                               const double* __restrict__ csum,
                                               const int* __restrict__ cnan, int chunks) {
    const float NEG_INF = __int_as_float(0xff800000);
    const float POS_INF = __int_as_float(0x7f800000);
    const int lane = (int)threadIdx.x & 31;
    float M = NEG_INF;
    int nan = 0;
    for (int c = lane; c < chunks; c += 32) {
        M = fmaxf(M, cmax[c]);
        nan |= cnan[c];
    }
    q6_warp_max_or(M, nan);
    if (nan) return __int_as_float(0x7fc00000);
    if (M == POS_INF || M == NEG_INF) return M;  // a +inf term: +inf; a row of -inf sums to 0
    double s = 0.0;
    for (int c = lane; c < chunks; c += 32)
        if (cmax[c] != NEG_INF) s += csum[c] * exp((double)cmax[c] - (double)M);
    s = q6_warp_sum(s);
    return (float)((double)M + log(s));
}

// Ascending bitonic sort of a[0, n) in shared memory, n a power of two (every thread calls it).
__device__ __forceinline__ void q6_bitonic(unsigned long long* a, unsigned int n) {
    const unsigned int B = blockDim.x;
    for (unsigned int size = 2u; size <= n; size <<= 1) {
        for (unsigned int stride = size >> 1; stride > 0u; stride >>= 1) {
            for (unsigned int p = threadIdx.x; p < (n >> 1); p += B) {
                const unsigned int i = 2u * p - (p & (stride - 1u)), q = i + stride;
                const unsigned long long x = a[i], z = a[q];
                if ((x > z) == ((i & size) == 0u)) {
                    a[i] = z;
                    a[q] = x;
                }
            }
            __syncthreads();
        }
    }
}

// Candidate of column j (its key, the 64-bit sort key) into cbuf if key >= tau.
__device__ __forceinline__ void q6_stage(unsigned long long* cbuf, unsigned int* count,
                                         unsigned int cap, unsigned int key, unsigned int tau,
                                         int j) {
    if (key >= tau) {
        const unsigned int slot = atomicAdd(count, 1u);
        if (slot < cap) cbuf[slot] = ((unsigned long long)(~key) << 32) | (unsigned int)j;
    }
}

extern "C" __global__ void __launch_bounds__(Q6_TOPK_THREADS)
q6_topk_pick(const float* __restrict__ y, int cols, int chunks, int k, int cap,
             const unsigned int* __restrict__ gkey, const float* __restrict__ cmax,
             const double* __restrict__ csum, const int* __restrict__ cnan,
             int* __restrict__ packed) {
    __shared__ Q6TopkShared sh;
    __shared__ unsigned long long cbuf[Q6_TOPK_CAND_CAP];
    __shared__ int sel[Q6_TOPK_SEL_CAP];
    __shared__ unsigned int count, nsel;
    __shared__ float lse;
    const int tid = (int)threadIdx.x, B = (int)blockDim.x;
    const size_t r = blockIdx.x;
    const float* row = y + r * (size_t)cols;
    int* out = packed + r * (size_t)(2 * k + 1);
    const int groups = chunks * Q6_TOPK_GROUPS;
    const unsigned int* keys = gkey + r * (size_t)groups;
    const float* rmax = cmax + r * (size_t)chunks;
    const double* rsum = csum + r * (size_t)chunks;
    const int* rnan = cnan + r * (size_t)chunks;
    const unsigned int ucap = (unsigned int)min(cap, Q6_TOPK_CAND_CAP);
    if (tid == 0) {
        count = 0u;
        nsel = 0u;
    }
    unsigned int need;
    const unsigned int tau = q6_radix_select([&](int g) { return keys[g]; }, groups, k, 16,
                                             sh, need);
    // (q6_pick_bin's __syncthreads made count and nsel visible)
    for (int g = tid; g < groups; g += B) {
        if (keys[g] >= tau) {
            const unsigned int s = atomicAdd(&nsel, 1u);
            if (s < Q6_TOPK_SEL_CAP) sel[s] = g;
        }
    }
    __syncthreads();
    const unsigned int ns = nsel;
    if (ns <= Q6_TOPK_SEL_CAP) {  // their 64 columns each, 8 loads in flight per thread
        const int total = (int)ns * 64;
        int i = tid;
        for (; i + 7 * B < total; i += 8 * B) {
            float v[8];
            int j[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int e = i + u * B;
                j[u] = q6_group_col(sel[e >> 6], e & 63);
                v[u] = j[u] < cols ? row[j[u]] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (j[u] < cols) q6_stage(cbuf, &count, ucap, q6_order_key(v[u]), tau, j[u]);
        }
        for (; i < total; i += B) {
            const int j = q6_group_col(sel[i >> 6], i & 63);
            if (j < cols) q6_stage(cbuf, &count, ucap, q6_order_key(row[j]), tau, j);
        }
    }
    __syncthreads();
    const unsigned int n = count;  // >= k: see the comment above q6_topk_scan
    if (ns <= Q6_TOPK_SEL_CAP && n <= ucap && n <= Q6_TOPK_RANK_MAX) {
        // rank by counting (the keys are distinct: one per column); the last warp (idle: n <=
        // 512 < B - 32) computes the lse meanwhile
        if (tid < (int)n) {
            const unsigned long long mine = cbuf[tid];
            unsigned int rank = 0u;
            unsigned int j = 0u;
            for (; j + 4u <= n; j += 4u)
                rank += (cbuf[j] < mine) + (cbuf[j + 1] < mine) + (cbuf[j + 2] < mine) +
                        (cbuf[j + 3] < mine);
            for (; j < n; ++j) rank += cbuf[j] < mine;
            if (rank < (unsigned int)k) {
                const unsigned int col = (unsigned int)(mine & 0xFFFFFFFFull);
                out[rank] = __float_as_int(row[col]);
                out[k + (int)rank] = (int)col;
            }
        } else if (tid >= B - 32) {
            const float l = q6_chunks_lse(rmax, rsum, rnan, chunks);
            if (tid == B - 32) out[2 * k] = __float_as_int(l);
        }
        return;
    }
    if (tid < 32) {
        const float l = q6_chunks_lse(rmax, rsum, rnan, chunks);
        if (tid == 0) lse = l;
    }
    __syncthreads();
    if (ns <= Q6_TOPK_SEL_CAP && n <= ucap) {
        unsigned int n2 = 2u;
        while (n2 < n) n2 <<= 1;
        for (unsigned int i = n + (unsigned int)tid; i < n2; i += (unsigned int)B) cbuf[i] = ~0ull;
        __syncthreads();
        q6_bitonic(cbuf, n2);
        for (int j = tid; j < k; j += B) {
            const unsigned int col = (unsigned int)(cbuf[j] & 0xFFFFFFFFull);
            out[j] = __float_as_int(row[col]);
            out[k + j] = (int)col;
        }
        if (tid == 0) out[2 * k] = __float_as_int(lse);
        return;
    }
    // too many groups or columns at or above tau to stage: the one-CTA-per-row passes over y
    unsigned int need_t;
    const unsigned int T = q6_select_row(row, cols, k, sh, need_t);
    q6_gather_row(row, cols, 0, T, (unsigned int)k - need_t, need_t, sh);
    q6_sort_and_write(sh, row, k, lse, out);
}
