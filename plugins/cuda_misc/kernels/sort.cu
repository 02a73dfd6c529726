// Sorting of the cuda_misc plugin: argsort, top_k, and the fused MoE router
// (soft_max -> top_k -> get_rows [-> sum_rows -> div]).
//
// Every value becomes a unique 64-bit key: a 32-bit order key (ascending keys
// give the order asked for, NaN last, -0 equal to +0) above its index, so
// ties fall in index order and any correct sort gives numpy's stable order.
//
// argsort: rows of up to 4096 values are sorted in registers by one warp (up to
// 512) or a few (sort_rows_warp), the network below in registers and shuffles.
// Longer rows that fit shared memory are sorted there by one block each (a
// bitonic network in the form where every comparator puts the smaller key
// first, so positions past the row's end hold nothing and their comparators
// are skipped: rows need no padding values). Longer rows are sorted in chunks
// of CHUNK keys, then merged level by level: the comparators that span more
// than a chunk run as one launch per step over global memory (indices in the
// output, keys re-read from x), the rest of each level in shared memory.
//
// top_k: rows that fit are sorted whole (in registers up to 4096 values);
// longer ones select the k-th key by a radix select (four 8-bit passes), gather
// the k winners (ties at the threshold by lowest index) and sort only those.
#include "common.cuh"
#include "index.cuh"

namespace od {
namespace sort {

__device__ __forceinline__ unsigned order_key(const float x, const bool desc) {
    if (x != x) {
        return 0xffffffffu;  // NaN: last in either order, as numpy's argsort of x or -x
    }
    unsigned u = __float_as_uint(x);
    u = u == 0x80000000u ? 0u : u;                    // -0 == +0: they tie, and ties go by index
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // increasing with x
    return desc ? ~u : u;                             // never 0xffffffff: NaN stays apart
}

__device__ __forceinline__ unsigned long long sort_key(const unsigned key, const unsigned i) {
    return (static_cast<unsigned long long>(key) << 32) | i;
}

__device__ __forceinline__ float value(const unsigned char* row, const long long s0, const unsigned i) {
    return *reinterpret_cast<const float*>(row + i * s0);
}

// One step of the network over keys[0, npad): comparator t joins i = 2t - t % half
// (the lower half of its group) with p = i ^ mask, smaller key first; p >= n is skipped.
// The first step of a level of size k is the flip (mask k - 1, half k / 2),
// the next ones half-cleaners (mask j, half j).
template <int BLOCK>
__device__ __forceinline__ void step(unsigned long long* keys, const int n, const int npad, const int mask,
                                     const int half) {
    for (int t = threadIdx.x; t < npad / 2; t += BLOCK) {
        const int i = 2 * t - (t & (half - 1));
        const int p = i ^ mask;
        if (p < n) {
            const unsigned long long a = keys[i], b = keys[p];
            if (b < a) {
                keys[i] = b;
                keys[p] = a;
            }
        }
    }
    __syncthreads();
}

// Sort keys[0, n) in shared memory, n <= npad (a power of two).
template <int BLOCK>
__device__ __forceinline__ void bitonic_sort(unsigned long long* keys, const int n, const int npad) {
    for (int k = 2; k <= npad; k <<= 1) {
        step<BLOCK>(keys, n, npad, k - 1, k / 2);
        for (int j = k / 4; j > 0; j >>= 1) {
            step<BLOCK>(keys, n, npad, j, j);
        }
    }
}

// sort_rows_warp's comparators: a <= b after `order`; `keep` gives the smaller of
// v and its partner's o at the lower position of a comparator, else the larger.
__device__ __forceinline__ void order(unsigned long long& a, unsigned long long& b) {
    const unsigned long long x = a, y = b;
    const bool swap = y < x;
    a = swap ? y : x;
    b = swap ? x : y;
}

__device__ __forceinline__ unsigned long long keep(const unsigned long long v, const unsigned long long o,
                                                   const bool lower) {
    return (o < v) == lower ? o : v;
}

__device__ __forceinline__ int pow2_at_least(const int n) {
    int p = 1;
    while (p < n) {
        p <<= 1;
    }
    return p;
}

}  // namespace sort
}  // namespace od

using namespace od;
using namespace od::sort;

// Sort each chunk of `chunk` values (a power of two) of every row of x (.., n)
// and write the first `kout` indices of each sorted chunk at out + row *
// out_stride + chunk start. Grid (rows, chunks); chunk * 8 bytes of dynamic
// shared memory. One chunk per row (chunk >= n) sorts whole rows: argsort
// with kout = n, top_k with kout = k.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) sort_chunks(const unsigned char* __restrict__ x, int* __restrict__ out,
                                                     const int n, const int chunk, const int kout,
                                                     const long long out_stride, const int desc, const unsigned n1,
                                                     const unsigned n2, const long long s0, const long long s1,
                                                     const long long s2, const long long s3) {
    extern __shared__ unsigned long long keys[];
    const unsigned char* row = row_start(x, blockIdx.x, n1, n2, s1, s2, s3);
    const int start = blockIdx.y * chunk;
    const int len = min(chunk, n - start);
    for (int i = threadIdx.x; i < len; i += BLOCK) {
        keys[i] = sort_key(order_key(value(row, s0, start + i), desc), start + i);
    }
    __syncthreads();
    bitonic_sort<BLOCK>(keys, len, pow2_at_least(len));
    int* dst = out + blockIdx.x * out_stride + start;
    for (int i = threadIdx.x; i < min(len, kout); i += BLOCK) {
        dst[i] = static_cast<int>(keys[i] & 0xffffffffu);
    }
}

// Rows of n <= 32 * K * WARPS values sorted in registers: the network of
// `bitonic_sort` over 32 * K * WARPS positions, position (warp * 32 + lane) * K + j
// in register j (pads: keys above every real one). Comparators of stride below K
// order registers; those below 32 * K pair the lane with lane ^ (stride / K)
// through shuffles (the flip also reverses the registers); longer ones (WARPS > 1
// only: a few steps) go through shared memory. One row per block of WARPS warps,
// or 4 rows per block when WARPS = 1 (then no barrier at all). Values are loaded
// coalesced (value t + 32 * WARPS * j into register j of thread t): where a value
// starts in the network does not matter, its index travels in its key. The first
// kout indices go to out + row * out_stride through shared memory, so the stores
// coalesce too. K <= 16 keeps the unrolled code within the instruction cache.
template <int K, int WARPS>
__global__ void __launch_bounds__(WARPS == 1 ? 128 : 32 * WARPS, WARPS == 1 ? 4 : 16 / WARPS)  // 16 warps per SM
    sort_rows_warp(const unsigned char* __restrict__ x, int* __restrict__ out, const unsigned rows, const int n,
                   const int kout, const long long out_stride, const int desc, const unsigned n1, const unsigned n2,
                   const long long s0, const long long s1, const long long s2, const long long s3) {
    static_assert(K >= 1 && K <= 16 && (K & (K - 1)) == 0 && (WARPS == 1 || K == 16), "K: 1 .. 16, 16 if WARPS > 1");
    constexpr int W = WARP_SIZE, ROWS = WARPS == 1 ? 4 : 1, RUN = W * K, LEN = RUN * WARPS;
    // per row: LEN keys, one padding slot after each lane's K (no bank conflicts);
    // the sorted indices are staged there too
    __shared__ unsigned long long buf[ROWS][LEN + LEN / K];
    const int t = ROWS == 1 ? threadIdx.x : threadIdx.x % W;  // thread of the row
    const unsigned row = blockIdx.x * ROWS + threadIdx.x / (W * WARPS);
    if (row >= rows) {
        return;  // a whole row's warps: ROWS > 1 only when WARPS = 1
    }
    const int lane = t % W, first = t * K;  // position of register 0
    unsigned long long* mine = buf[threadIdx.x / (W * WARPS)];
    const unsigned char* src = row_start(x, row, n1, n2, s1, s2, s3);
    unsigned long long v[K];
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int c = t + W * WARPS * j;
        v[j] = c < n ? sort_key(order_key(value(src, s0, c), desc), c) : ~0ull;
    }
    // A step whose partner is in another warp: i <-> i ^ mask, top = mask's highest bit.
    auto through_smem = [&](const int mask, const int top) {
#pragma unroll
        for (int j = 0; j < K; j++) {
            mine[(first + j) + (first + j) / K] = v[j];
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < K; j++) {
            const int p = (first + j) ^ mask;
            v[j] = keep(v[j], mine[p + p / K], ((first + j) & top) == 0);
        }
        __syncthreads();
    };
#pragma unroll
    for (int k = 2; k <= LEN; k <<= 1) {
        if (k <= K) {  // the flip, i <-> i ^ (k - 1), inside the registers
#pragma unroll
            for (int j = 0; j < K; j++) {
                if (j < (j ^ (k - 1))) {
                    order(v[j], v[j ^ (k - 1)]);
                }
            }
        } else if (k <= RUN) {  // partner lane ^ (k / K - 1), register K - 1 - j
            const bool lower = (lane & (k / (2 * K))) == 0;
#pragma unroll
            for (int j = 0; j < (K + 1) / 2; j++) {
                const int q = K - 1 - j;
                const unsigned long long a = __shfl_xor_sync(FULL_MASK, v[q], k / K - 1);
                const unsigned long long b = __shfl_xor_sync(FULL_MASK, v[j], k / K - 1);
                v[j] = keep(v[j], a, lower);
                if (q != j) {
                    v[q] = keep(v[q], b, lower);
                }
            }
        } else {
            through_smem(k - 1, k / 2);
        }
#pragma unroll
        for (int h = k / 4; h > 0; h >>= 1) {  // half-cleaners, i <-> i ^ h
            if (h < K) {
#pragma unroll
                for (int j = 0; j < K; j++) {
                    if ((j & h) == 0) {
                        order(v[j], v[j | h]);
                    }
                }
            } else if (h < RUN) {
                const bool lower = (lane & (h / K)) == 0;
#pragma unroll
                for (int j = 0; j < K; j++) {
                    v[j] = keep(v[j], __shfl_xor_sync(FULL_MASK, v[j], h / K), lower);
                }
            } else {
                through_smem(h, h);
            }
        }
    }
    int* staged = reinterpret_cast<int*>(mine);
#pragma unroll
    for (int j = 0; j < K; j++) {
        staged[(first + j) + (first + j) / K] = static_cast<int>(v[j] & 0xffffffffu);
    }
    if constexpr (WARPS == 1) {
        __syncwarp();
    } else {
        __syncthreads();
    }
    int* dst = out + row * out_stride;
#pragma unroll
    for (int j = 0; j < K; j++) {
        const int p = t + W * WARPS * j;
        if (p < kout) {
            dst[p] = staged[p + p / K];
        }
    }
}

// One merge step over global memory for rows of n sorted indices in out
// (rows of n): comparator t as in `step`. Grid (comparators / 256, rows).
__global__ void __launch_bounds__(256) merge_step(const unsigned char* __restrict__ x, int* __restrict__ out,
                                                  const int n, const int npad, const int mask, const int half,
                                                  const int desc, const unsigned n1, const unsigned n2,
                                                  const long long s0, const long long s1, const long long s2,
                                                  const long long s3) {
    const int t = blockIdx.x * 256 + threadIdx.x;
    if (t >= npad / 2) {
        return;
    }
    const int i = 2 * t - (t & (half - 1));
    const int p = i ^ mask;
    if (p >= n) {
        return;
    }
    const unsigned char* row = row_start(x, blockIdx.y, n1, n2, s1, s2, s3);
    int* o = out + static_cast<long long>(blockIdx.y) * n;
    const unsigned ia = o[i], ib = o[p];
    const unsigned long long a = sort_key(order_key(value(row, s0, ia), desc), ia);
    const unsigned long long b = sort_key(order_key(value(row, s0, ib), desc), ib);
    if (b < a) {
        o[i] = static_cast<int>(ib);
        o[p] = static_cast<int>(ia);
    }
}

// The last steps of a merge level, those inside one chunk: the half-cleaners
// chunk/2 .. 1, in shared memory. Grid (rows, chunks).
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) merge_chunks(const unsigned char* __restrict__ x, int* __restrict__ out,
                                                      const int n, const int chunk, const int desc,
                                                      const unsigned n1, const unsigned n2, const long long s0,
                                                      const long long s1, const long long s2, const long long s3) {
    extern __shared__ unsigned long long keys[];
    const unsigned char* row = row_start(x, blockIdx.x, n1, n2, s1, s2, s3);
    const int start = blockIdx.y * chunk;
    const int len = min(chunk, n - start);
    int* o = out + static_cast<long long>(blockIdx.x) * n + start;
    for (int i = threadIdx.x; i < len; i += BLOCK) {
        const unsigned idx = o[i];
        keys[i] = sort_key(order_key(value(row, s0, idx), desc), idx);
    }
    __syncthreads();
    for (int j = chunk / 2; j > 0; j >>= 1) {
        step<BLOCK>(keys, len, chunk, j, j);
    }
    for (int i = threadIdx.x; i < len; i += BLOCK) {
        o[i] = static_cast<int>(keys[i] & 0xffffffffu);
    }
}

// top_k of rows too long to sort in shared memory: the k largest of each row
// (ties at the threshold: lowest indices), written in descending order with
// ties by index, exactly as the stable sort would. One block per row;
// kpad * 8 bytes of dynamic shared memory (kpad: a power of two >= k).
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) topk_select(const unsigned char* __restrict__ x, int* __restrict__ out,
                                                     const int n, const int k, const int kpad, const unsigned n1,
                                                     const unsigned n2, const long long s0, const long long s1,
                                                     const long long s2, const long long s3) {
    extern __shared__ unsigned long long keys[];
    __shared__ unsigned hist[256];
    __shared__ unsigned chosen[2];
    const unsigned char* row = row_start(x, blockIdx.x, n1, n2, s1, s2, s3);

    // The k-th smallest order key, 8 bits at a time from the top: `prefix`
    // holds the bits found, `want` how many keys equal to it are still to take.
    unsigned prefix = 0, mask = 0, want = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += BLOCK) {
            hist[i] = 0;
        }
        __syncthreads();
        for (int c = threadIdx.x; c < n; c += BLOCK) {
            const unsigned key = order_key(value(row, s0, c), true);
            if ((key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned below = 0;
            unsigned d = 0;
            while (d < 255 && below + hist[d] < want) {
                below += hist[d++];
            }
            chosen[0] = prefix | (d << shift);
            chosen[1] = want - below;
        }
        __syncthreads();
        prefix = chosen[0];
        want = chosen[1];
        mask |= 255u << shift;
    }

    // Gather, in index order: every key below the threshold, and the first
    // `want` keys equal to it after them.
    const unsigned below_count = k - want;
    unsigned n_below = 0, n_equal = 0;
    for (int base = 0; base < n; base += BLOCK) {
        const int c = base + threadIdx.x;
        const unsigned key = c < n ? order_key(value(row, s0, c), true) : 0u;
        const bool lt = c < n && key < prefix;
        const bool eq = c < n && key == prefix;
        unsigned total;
        const unsigned flags = static_cast<unsigned>(lt) | (static_cast<unsigned>(eq) << 16);
        const unsigned before = block_scan<BLOCK>(flags, total) - flags;  // per-tile counts stay below 2**16
        if (lt) {
            keys[n_below + (before & 0xffffu)] = sort_key(key, c);
        }
        const unsigned rank = n_equal + (before >> 16);
        if (eq && rank < want) {
            keys[below_count + rank] = sort_key(key, c);
        }
        n_below += total & 0xffffu;
        n_equal += total >> 16;
    }
    __syncthreads();
    bitonic_sort<BLOCK>(keys, k, kpad);
    int* dst = out + static_cast<long long>(blockIdx.x) * k;
    for (int i = threadIdx.x; i < k; i += BLOCK) {
        dst[i] = static_cast<int>(keys[i] & 0xffffffffu);
    }
}

// MoE routing, ggml's topk-moe: per row of logits (E <= 32 * NPL experts),
// p = softmax(scale * logits); the k largest p (ties: lowest expert) in
// descending order -> weights (rows of k), divided by their sum when `norm`;
// their experts -> ids (rows of k) when ids is not null. One warp per row,
// 4 rows per block of 128 threads.
template <int NPL>
__global__ void __launch_bounds__(128) topk_moe(const float* __restrict__ logits, float* __restrict__ weights,
                                                int* __restrict__ ids, const unsigned rows, const int E, const int k,
                                                const long long row_stride, const float scale, const int norm) {
    od::grid_enter();
    const unsigned row = blockIdx.x * 4 + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp
    }
    const float* in = logits + row * row_stride;
    float p[NPL];
    float mx = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int e = lane + WARP_SIZE * i;
        p[i] = e < E ? in[e] * scale : -__int_as_float(0x7f800000);
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        // a row of -inf gives zeros (the reference's choice), not NaN
        p[i] = lane + WARP_SIZE * i < E && mx != -__int_as_float(0x7f800000) ? expf(p[i] - mx) : 0.0f;
        sum += p[i];
    }
    sum = warp_sum(sum);
    float* w = weights + static_cast<long long>(row) * k;
    int* id = ids != nullptr ? ids + static_cast<long long>(row) * k : nullptr;
    if (sum != sum) {
        // a NaN or +inf logit: every probability is NaN, and NaNs rank in expert order (the reference's
        // stable sort), so the row takes experts 0 .. k-1, each weighing NaN
        for (int j = lane; j < k; j += WARP_SIZE) {
            w[j] = __int_as_float(0x7fc00000);
            if (id != nullptr) {
                id[j] = j;
            }
        }
        return;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        // below every probability: padding lanes and experts already taken
        p[i] = lane + WARP_SIZE * i < E ? p[i] * inv : -1.0f;
    }

    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        float best = p[0];
        int at = lane;
#pragma unroll
        for (int i = 1; i < NPL; i++) {
            if (p[i] > best) {  // strict: the lowest expert of this lane on ties
                best = p[i];
                at = lane + WARP_SIZE * i;
            }
        }
#pragma unroll
        for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
            const float b2 = __shfl_xor_sync(FULL_MASK, best, off, WARP_SIZE);
            const int a2 = __shfl_xor_sync(FULL_MASK, at, off, WARP_SIZE);
            if (b2 > best || (b2 == best && a2 < at)) {
                best = b2;
                at = a2;
            }
        }
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            if (lane + WARP_SIZE * i == at) {
                p[i] = -2.0f;  // taken
            }
        }
        total += best;
        if (lane == 0) {
            w[j] = best;
            if (id != nullptr) {
                id[j] = at;
            }
        }
    }
    if (norm) {
        __syncwarp();  // lane 0's writes are visible to the warp
        for (int j = lane; j < k; j += WARP_SIZE) {
            w[j] = w[j] / total;
        }
    }
}
