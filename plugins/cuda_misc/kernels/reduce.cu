// Reductions of the cuda_misc plugin: sum, sum_rows, mean, cumsum, argmax, count_equal; the
// fused greedy pick (argmax -> cpy -> cpy -> set_rows) in argmax_split.
//
// Row kernels take one row per block: the row's outer indices (i1, i2, i3)
// come from blockIdx.x with sizes n1, n2, its elements at byte stride s0;
// argmax_split, for few long rows, takes several blocks a row, their partials
// and per-row counters in a workspace of the launch (made and zeroed at bind).
// The whole-tensor reductions (sum, count_equal) run on up to MAX_PARTIALS
// blocks; each block writes its partial and the last block to finish adds
// the partials in block order (deterministic) and resets the counter. The
// partials live in this module's own global memory: launches on one stream
// run one after another, so they never share them.
#include "common.cuh"
#include "index.cuh"

namespace od {
namespace reduce {

constexpr int MAX_PARTIALS = 1024;

__device__ float sum_partials[MAX_PARTIALS];
__device__ unsigned long long count_partials[MAX_PARTIALS];
__device__ int blocks_done;  // od::last_block's counter of sum_all and count_equal

// Keeps the better of (best, at) and (v, i): the larger value, the larger index of equal values
// (ggml's argmax keeps the last maximum). NaN never wins. The winner does not depend on the order
// candidates come in, so blocks and warps may merge in any order.
__device__ __forceinline__ void take_better(float& best, int& at, const float v, const int i) {
    if (v > best || (v == best && i > at)) {
        best = v;
        at = i;
    }
}

// (best, at) over a block of BLOCK threads; thread 0 gets the winner. Every thread must call it.
template <int BLOCK>
__device__ __forceinline__ void block_argmax(float& best, int& at) {
    __shared__ float bests[BLOCK / WARP_SIZE];
    __shared__ int ats[BLOCK / WARP_SIZE];
#pragma unroll
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        take_better(best, at, __shfl_xor_sync(FULL_MASK, best, off, WARP_SIZE),
                    __shfl_xor_sync(FULL_MASK, at, off, WARP_SIZE));
    }
    if constexpr (BLOCK > WARP_SIZE) {
        __syncthreads();  // an earlier call may still be reading bests / ats
        if (threadIdx.x % WARP_SIZE == 0) {
            bests[threadIdx.x / WARP_SIZE] = best;
            ats[threadIdx.x / WARP_SIZE] = at;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < BLOCK / WARP_SIZE; w++) {
                take_better(best, at, bests[w], ats[w]);
            }
        }
    }
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
    od::grid_enter();
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
    od::grid_enter();
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
        float exclusive;
        block_scan<BLOCK>(v[3], total, &exclusive);
        const float before = exclusive + carry;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (c + i < ncols) {
                dst[c + i] = v[i] + before;
            }
        }
        carry += total;
    }
}

// Index of each row's maximum, the last one on ties (ggml); f32 rows of (R, C), one block a row
// (many rows, or short ones: argmax_split below takes few long rows).
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) argmax(const unsigned char* __restrict__ x, int* __restrict__ out,
                                                const int ncols, const long long s0, const long long s1) {
    od::grid_enter();
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
    block_argmax<BLOCK>(best, at);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = at < 0 ? 0 : at;  // a row of NaN: unspecified, 0
    }
}

constexpr int SPLIT_BLOCK = 128;

// The same for few long rows (a decode step's logits: 1..16 rows of 32000+): one block cannot
// keep enough loads in flight for a whole row, so each row is split over `nblk` blocks (grid
// nblk * rows, block k of a row taking columns [k * chunk, (k + 1) * chunk), chunk a multiple of
// 4) that together fill the GPU. Each block reduces its slice to a (max, index) partial; the last
// block of the row to finish (its counter in `counters`, zeroed at bind; that block sets it back
// to 0 for the next launch or CUDA-graph replay) merges the row's partials and writes out[row].
// One block a row (nblk 1) skips the workspace. VEC: rows packed and 16-byte aligned (float4 loads).
//
// The fused greedy pick (out_f32 not null; cuda_misc's greedy_pick rule: argmax -> cpy i32 ->
// cpy f32 -> set_rows) also writes the index as f32 into out_f32[row] and into row idx[row] of
// `token_log` (rows of one f32 value, `ls1` bytes apart; a row id outside [0, log_rows) is not
// written, as set_rows, and is recorded in the error word). I is the index type (int or long long).
template <bool VEC, class I>
__global__ void __launch_bounds__(SPLIT_BLOCK) argmax_split(
    const unsigned char* __restrict__ x, int* __restrict__ out, float* __restrict__ out_f32,
    unsigned char* __restrict__ token_log, const unsigned char* __restrict__ idx, int2* __restrict__ partials,
    int* __restrict__ counters, const int ncols, const int chunk, const int nblk, const long long s0,
    const long long s1, const long long is0, const long long ls1, const long long log_rows, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    const int row = blockIdx.x / nblk;
    const unsigned char* xr = x + row * s1;
    const int lo = (blockIdx.x % nblk) * chunk;
    const int hi = min(lo + chunk, ncols);
    float best = -__int_as_float(0x7f800000);
    int at = -1;
    // Each thread takes its columns in increasing order, so `>=` keeps the last of its ties.
    if constexpr (VEC) {
        const int hi4 = lo + (hi - lo) / 4 * 4;
        const float4* x4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 4
        for (int c = lo + 4 * threadIdx.x; c < hi4; c += 4 * SPLIT_BLOCK) {
            const float4 v = x4[c / 4];
            if (v.x >= best) { best = v.x; at = c; }
            if (v.y >= best) { best = v.y; at = c + 1; }
            if (v.z >= best) { best = v.z; at = c + 2; }
            if (v.w >= best) { best = v.w; at = c + 3; }
        }
        const int c = hi4 + threadIdx.x;  // the row's last ncols % 4 columns, past every float4
        if (c < hi) {
            const float v = reinterpret_cast<const float*>(xr)[c];
            if (v >= best) { best = v; at = c; }
        }
    } else {
        for (int c = lo + threadIdx.x; c < hi; c += SPLIT_BLOCK) {
            const float v = *reinterpret_cast<const float*>(xr + c * s0);
            if (v >= best) { best = v; at = c; }
        }
    }
    block_argmax<SPLIT_BLOCK>(best, at);
    if (nblk > 1) {
        if (threadIdx.x == 0) {
            partials[blockIdx.x] = make_int2(__float_as_int(best), at);
        }
        if (!od::last_block(counters + row, nblk)) {
            return;
        }
        best = -__int_as_float(0x7f800000);
        at = -1;
        for (int k = threadIdx.x; k < nblk; k += SPLIT_BLOCK) {
            const int2 p = __ldcg(partials + row * nblk + k);  // written by other SMs: from L2, not L1
            take_better(best, at, __int_as_float(p.x), p.y);
        }
        block_argmax<SPLIT_BLOCK>(best, at);
    }
    if (threadIdx.x == 0) {
        const int pick = at < 0 ? 0 : at;  // a row of NaN: unspecified, 0
        out[row] = pick;
        if (out_f32 != nullptr) {
            const float as_f32 = __int2float_rn(pick);  // cpy's i32 -> f32
            out_f32[row] = as_f32;
            const long long r = *reinterpret_cast<const I*>(idx + row * is0);
            if (od::index_ok(r, log_rows, err_word, err_tag, row)) {
                *reinterpret_cast<float*>(token_log + r * ls1) = as_f32;
            }
        }
    }
}

// Sum of every element of x (f32/f16/bf16, any strides) into out[0] of x's type.
// CONTIG: x packed, element i at x + i.
template <class T, bool CONTIG>
__global__ void __launch_bounds__(256) sum_all(const unsigned char* __restrict__ x, T* __restrict__ out,
                                               const unsigned n, OD_LAYOUT_PARAMS(a)) {
    od::grid_enter();
    const Layout la = OD_LAYOUT(a);
    float acc = 0.0f;
    for (unsigned i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256) {
        acc += to_f32(CONTIG ? reinterpret_cast<const T*>(x)[i] : *reinterpret_cast<const T*>(x + la.offset(i)));
    }
    acc = block_sum<256>(acc);
    if (threadIdx.x == 0) {
        sum_partials[blockIdx.x] = acc;
    }
    if (od::last_block(&blocks_done, gridDim.x)) {
        float total = 0.0f;
        for (unsigned b = threadIdx.x; b < gridDim.x; b += 256) {
            total += __ldcg(&sum_partials[b]);  // written by other blocks: not from L1
        }
        total = block_sum<256>(total);
        if (threadIdx.x == 0) {
            store(out, total);
        }
    }
}

// Number of positions where a == b (i32, one shape, any strides) into out[0] (i64).
__global__ void __launch_bounds__(256) count_equal(const unsigned char* __restrict__ a,
                                                   const unsigned char* __restrict__ b, long long* __restrict__ out,
                                                   const unsigned n, OD_LAYOUT_PARAMS(a), OD_LAYOUT_PARAMS(b)) {
    od::grid_enter();
    const Layout la = OD_LAYOUT(a), lb = OD_LAYOUT(b);
    unsigned long long count = 0;
    for (unsigned i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256) {
        count += *reinterpret_cast<const int*>(a + la.offset(i)) == *reinterpret_cast<const int*>(b + lb.offset(i));
    }
    __shared__ unsigned long long warp_counts[256 / WARP_SIZE];
    count = warp_sum(count);
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
    if (od::last_block(&blocks_done, gridDim.x) && threadIdx.x == 0) {
        unsigned long long total = 0;
        for (unsigned k = 0; k < gridDim.x; k++) {
            total += __ldcg(&count_partials[k]);
        }
        *out = static_cast<long long>(total);
    }
}
