// Reductions of the cuda_misc plugin: sum, sum_rows, mean, cumsum, argmax, count_equal.
//
// Row kernels take one row per block: the row's outer indices (i1, i2, i3)
// come from blockIdx.x with sizes n1, n2, its elements at byte stride s0.
// The whole-tensor reductions (sum, count_equal) run on up to MAX_PARTIALS
// blocks; each block writes its partial and the last block to finish adds
// the partials in block order (deterministic) and resets the counter. The
// partials live in this module's own global memory: launches on one stream
// run one after another, so they never share them.
#include "common.cuh"
#include "quant.cuh"

namespace od {
namespace reduce {

constexpr int MAX_PARTIALS = 1024;

__device__ float sum_partials[MAX_PARTIALS];
__device__ unsigned long long count_partials[MAX_PARTIALS];
__device__ unsigned blocks_done;

template <class T>
__device__ __forceinline__ T warp_add(T v) {
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, off, WARP_SIZE);
    }
    return v;
}

__device__ __forceinline__ float to_f32(const float v) { return v; }
__device__ __forceinline__ float to_f32(const f16 v) { return f16_to_f32(v.bits); }
__device__ __forceinline__ float to_f32(const bf16 v) { return bf16_to_f32(v.bits); }

// Is this block the last of the grid to finish? (after writing its partial)
__device__ __forceinline__ bool last_block() {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&blocks_done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    return last;
}

}  // namespace reduce
}  // namespace od

using namespace od;
using namespace od::reduce;

// x.sum(-1) (or the mean) of f32 rows. VEC: rows packed, 16-byte aligned starts.
template <int BLOCK, bool MEAN, bool VEC>
__global__ void __launch_bounds__(BLOCK) sum_rows(const unsigned char* __restrict__ x, float* __restrict__ out,
                                                  const int ncols, const unsigned n1, const unsigned n2,
                                                  const long long s0, const long long s1, const long long s2,
                                                  const long long s3) {
    const unsigned char* row = row_start(x, blockIdx.x, n1, n2, s1, s2, s3);
    float acc = 0.0f;
    if constexpr (VEC) {
        const float4* r4 = reinterpret_cast<const float4*>(row);
        for (int c = threadIdx.x; c < ncols / 4; c += BLOCK) {
            const float4 v = r4[c];
            acc += (v.x + v.y) + (v.z + v.w);
        }
        const int c = ncols / 4 * 4 + threadIdx.x;
        if (c < ncols) {
            acc += reinterpret_cast<const float*>(row)[c];
        }
    } else {
        for (int c = threadIdx.x; c < ncols; c += BLOCK) {
            acc += *reinterpret_cast<const float*>(row + c * s0);
        }
    }
    acc = block_sum<BLOCK>(acc);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = MEAN ? acc / static_cast<float>(ncols) : acc;
    }
}

// np.cumsum(x, -1) of f32 rows into contiguous rows: tiles of 4 * BLOCK values,
// 4 consecutive values per thread, a block scan per tile and a running carry.
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) cumsum(const unsigned char* __restrict__ x, float* __restrict__ out,
                                                const int ncols, const unsigned n1, const unsigned n2,
                                                const long long s0, const long long s1, const long long s2,
                                                const long long s3) {
    const unsigned char* row = row_start(x, blockIdx.x, n1, n2, s1, s2, s3);
    float* dst = out + static_cast<long long>(blockIdx.x) * ncols;
    float carry = 0.0f;
    for (int tile = 0; tile < ncols; tile += 4 * BLOCK) {
        const int c = tile + 4 * threadIdx.x;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = c + i < ncols ? *reinterpret_cast<const float*>(row + (c + i) * s0) : 0.0f;
        }
        v[1] += v[0];
        v[2] += v[1];
        v[3] += v[2];
        float total;
        const float before = block_scan<BLOCK>(v[3], total) - v[3] + carry;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (c + i < ncols) {
                dst[c + i] = v[i] + before;
            }
        }
        carry += total;
    }
}

// Index of each row's maximum, the last one on ties (ggml); f32 rows of (R, C).
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) argmax(const unsigned char* __restrict__ x, int* __restrict__ out,
                                                const int ncols, const long long s0, const long long s1) {
    const unsigned char* row = x + blockIdx.x * s1;
    float best = -__int_as_float(0x7f800000);
    int at = -1;
    for (int c = threadIdx.x; c < ncols; c += BLOCK) {
        const float v = *reinterpret_cast<const float*>(row + c * s0);
        if (v >= best) {  // later columns win ties; NaN never wins
            best = v;
            at = c;
        }
    }
    __shared__ float bests[BLOCK / WARP_SIZE];
    __shared__ int ats[BLOCK / WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        const float b2 = __shfl_xor_sync(FULL_MASK, best, off, WARP_SIZE);
        const int a2 = __shfl_xor_sync(FULL_MASK, at, off, WARP_SIZE);
        if (b2 > best || (b2 == best && a2 > at)) {
            best = b2;
            at = a2;
        }
    }
    if (lane == 0) {
        bests[warp] = best;
        ats[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < BLOCK / WARP_SIZE; w++) {
            if (bests[w] > best || (bests[w] == best && ats[w] > at)) {
                best = bests[w];
                at = ats[w];
            }
        }
        out[blockIdx.x] = at < 0 ? 0 : at;  // a row of NaN: unspecified, 0
    }
}

// Sum of every element of x (f32/f16/bf16, any strides) into out[0] of x's type.
// CONTIG: x packed, element i at x + i.
template <class T, bool CONTIG>
__global__ void __launch_bounds__(256) sum_all(const unsigned char* __restrict__ x, T* __restrict__ out,
                                               const unsigned n, OD_LAYOUT_PARAMS(a)) {
    const Layout la = OD_LAYOUT(a);
    float acc = 0.0f;
    for (unsigned i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256) {
        acc += to_f32(CONTIG ? reinterpret_cast<const T*>(x)[i] : *reinterpret_cast<const T*>(x + la.offset(i)));
    }
    acc = block_sum<256>(acc);
    if (threadIdx.x == 0) {
        sum_partials[blockIdx.x] = acc;
    }
    if (last_block()) {
        float total = 0.0f;
        for (unsigned b = threadIdx.x; b < gridDim.x; b += 256) {
            total += __ldcg(&sum_partials[b]);  // written by other blocks: not from L1
        }
        total = block_sum<256>(total);
        if (threadIdx.x == 0) {
            store(out, total);
            blocks_done = 0;
        }
    }
}

// Number of positions where a == b (i32, one shape, any strides) into out[0] (i64).
__global__ void __launch_bounds__(256) count_equal(const unsigned char* __restrict__ a,
                                                   const unsigned char* __restrict__ b, long long* __restrict__ out,
                                                   const unsigned n, OD_LAYOUT_PARAMS(a), OD_LAYOUT_PARAMS(b)) {
    const Layout la = OD_LAYOUT(a), lb = OD_LAYOUT(b);
    unsigned long long count = 0;
    for (unsigned i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256) {
        count += *reinterpret_cast<const int*>(a + la.offset(i)) == *reinterpret_cast<const int*>(b + lb.offset(i));
    }
    __shared__ unsigned long long warp_counts[256 / WARP_SIZE];
    count = warp_add(count);
    if (threadIdx.x % WARP_SIZE == 0) {
        warp_counts[threadIdx.x / WARP_SIZE] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < 256 / WARP_SIZE; w++) {
            count += warp_counts[w];
        }
        count_partials[blockIdx.x] = count;
    }
    if (last_block() && threadIdx.x == 0) {
        unsigned long long total = 0;
        for (unsigned k = 0; k < gridDim.x; k++) {
            total += __ldcg(&count_partials[k]);
        }
        *out = static_cast<long long>(total);
        blocks_done = 0;
    }
}
