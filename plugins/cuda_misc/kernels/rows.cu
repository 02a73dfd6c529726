// Copies and conversions (cpy, dup, cont), get_rows and set_rows of the cuda_misc plugin.
//
// Conventions: byte pointers and byte strides; 4-d shapes innermost first
// (n0 = the last numpy axis); flat indices in row-major order. Contiguous
// paths move 16 bytes per access; the strided paths unravel a flat index with
// the multiply-high divisions of index.cuh. Values are converted through f32:
// f16 and bf16 round to nearest even (bf16 with ggml's formula), f32 -> i32
// truncates toward zero, block formats round as ggml's reference quantizers.
#include "quant.cuh"
#include "rows_common.cuh"


using namespace od;
using namespace od::rows;

// -- copies -------------------------------------------------------------------------------

// Same dtype, both contiguous: nbytes copied in units of U (uint4 when both
// addresses are 16-byte aligned), the last nbytes % sizeof(U) bytes one by one.
template <class U>
__global__ void copy_contig(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                            const long long nbytes) {
    od::grid_enter();
    const long long n = nbytes / static_cast<long long>(sizeof(U));
    const long long id = thread_id();
    for (long long i = id; i < n; i += thread_count()) {
        reinterpret_cast<U*>(dst)[i] = reinterpret_cast<const U*>(src)[i];
    }
    const long long tail = n * static_cast<long long>(sizeof(U)) + id;
    if (tail < nbytes) {
        dst[tail] = src[tail];
    }
}

// Conversion between plain types, both contiguous. VEC: 8 elements per access
// pair (both addresses 16-byte aligned).
template <class S, class D, bool VEC>
__global__ void convert_contig(const S* __restrict__ src, D* __restrict__ dst, const long long n) {
    od::grid_enter();
    const long long id = thread_id();
    long long done = 0;
    if constexpr (VEC && sizeof(D) > sizeof(S)) {
        // Widening (f16 -> f32): packs sized by the destination, so that each
        // thread stores one 16-byte word and a warp's stores are contiguous.
        constexpr int N = 16 / sizeof(D);
        const long long nv = n / N;
        for (long long i = id; i < nv; i += thread_count()) {
            const od::Pack<S, N> a = *reinterpret_cast<const od::Pack<S, N>*>(src + N * i);
            od::Pack<D, N> b;
#pragma unroll
            for (int j = 0; j < N; j++) {
                b.v[j] = convert<S, D>(a.v[j]);
            }
            *reinterpret_cast<od::Pack<D, N>*>(dst + N * i) = b;
        }
        done = N * nv;
        if (done + id < n) {
            dst[done + id] = convert<S, D>(src[done + id]);
        }
    } else if constexpr (VEC) {
        const long long n8 = n / 8;
        for (long long i = id; i < n8; i += thread_count()) {
            const Pack8<S> a = load8(src + 8 * i);
            Pack8<D> b;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                b.v[j] = convert<S, D>(a.v[j]);
            }
            store8(dst + 8 * i, b);
        }
        done = 8 * n8;
        if (done + id < n) {
            dst[done + id] = convert<S, D>(src[done + id]);
        }
    } else {
        for (long long i = id; i < n; i += thread_count()) {
            dst[i] = convert<S, D>(src[i]);
        }
    }
}

// Any strides on either side: element i (row-major) of src's shape goes to
// element i of dst's shape. Plain types, or raw units (Block<N>) for block formats.
template <class S, class D>
__global__ void convert_strided(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                const unsigned n, OD_LAYOUT_PARAMS(a), OD_LAYOUT_PARAMS(b)) {
    od::grid_enter();
    const Layout la = OD_LAYOUT(a), lb = OD_LAYOUT(b);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const S v = *reinterpret_cast<const S*>(src + la.offset(i));
        *reinterpret_cast<D*>(dst + lb.offset(i)) = convert<S, D>(v);
    }
}

// Same shape, the source's fastest axis A is not the last one (a transpose):
// 32 x 32 tiles through shared memory, read along A and written along the
// last axis, both coalesced. Axes innermost first as (0, A, B, C); grid
// (tiles of axis 0, tiles of A, nB * nC), 32 x 8 threads.
template <class S, class D>
__global__ void __launch_bounds__(256) convert_tiled(const unsigned char* __restrict__ src,
                                                     unsigned char* __restrict__ dst, const unsigned n0,
                                                     const unsigned na, const unsigned nb, const long long s0,
                                                     const long long sa, const long long sb, const long long sc,
                                                     const long long d0, const long long da, const long long db,
                                                     const long long dc) {
    od::grid_enter();
    __shared__ S tile[32][33];
    const unsigned ib = blockIdx.z % nb, ic = blockIdx.z / nb;
    const unsigned char* s = src + ib * sb + ic * sc;
    unsigned char* d = dst + ib * db + ic * dc;
    const unsigned base0 = blockIdx.x * 32, basea = blockIdx.y * 32;
#pragma unroll
    for (int k = 0; k < 32; k += 8) {
        const unsigned i0 = base0 + threadIdx.y + k, ia = basea + threadIdx.x;
        if (i0 < n0 && ia < na) {
            tile[threadIdx.y + k][threadIdx.x] = *reinterpret_cast<const S*>(s + i0 * s0 + ia * sa);
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 32; k += 8) {
        const unsigned i0 = base0 + threadIdx.x, ia = basea + threadIdx.y + k;
        if (i0 < n0 && ia < na) {
            *reinterpret_cast<D*>(d + i0 * d0 + ia * da) = convert<S, D>(tile[threadIdx.x][threadIdx.y + k]);
        }
    }
}

// f32/f16/bf16 -> a block format: 8 lanes per block of 32 row-major values.
// CONTIG: both contiguous and the source 16-byte aligned (vector loads); else
// element i of the source is at la.offset(i) and block b of dst at lb.offset(b).
//
// CONTIG with a 16-byte aligned dst and blocks of at most QUANT_WARPS warps: a warp
// takes QUANT_GROUP = 16 consecutive blocks at a time (16 * BYTES bytes of dst, a
// multiple of 16 for every format, so the group starts 16-byte aligned): its lanes
// issue all 4 loads of the group first, encode the blocks into the warp's slice of
// shared memory (the 2-byte stores of encode8 stay on chip), then write the group
// with consecutive 16-byte stores. A last partial group, and every other case,
// takes 4 blocks a warp at a time with encode8 writing dst directly.
constexpr int QUANT_WARPS = 8;  // warps a block may have for the staged path (specs/rows.py BLOCK = 256)
constexpr int QUANT_GROUP = 16;

template <class Q, class S>
__device__ __forceinline__ void quantize4(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                          const unsigned nblocks, const unsigned first, const int lane) {
    const int r = lane % 8;
    const unsigned b = first + lane / 8;
    const bool active = b < nblocks;
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    unsigned char* blk = dst;
    if (active) {
        load4(reinterpret_cast<const S*>(src) + b * Q::QK + 4 * r, x);
        blk = dst + static_cast<long long>(b) * Q::BYTES;
    }
    quant::encode8<Q>(x, r, blk, active);
}

template <class Q, class S, bool CONTIG>
__global__ void quantize(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                         const unsigned nblocks, OD_LAYOUT_PARAMS(a), OD_LAYOUT_PARAMS(b)) {
    od::grid_enter();
    const Layout la = OD_LAYOUT(a), lb = OD_LAYOUT(b);
    const int lane = threadIdx.x % WARP_SIZE, r = lane % 8;
    const unsigned warp = thread_id() / WARP_SIZE;
    const unsigned warps = thread_count() / WARP_SIZE;
    if constexpr (CONTIG) {
        constexpr int UNITS = QUANT_GROUP * Q::BYTES / 16;  // uint4s of a group
        static_assert(QUANT_GROUP * Q::BYTES % 16 == 0, "a group of blocks must be a whole number of uint4s");
        __shared__ uint4 stage[QUANT_WARPS][UNITS];
        const bool staged = reinterpret_cast<unsigned long long>(dst) % 16 == 0 &&
                            blockDim.x <= QUANT_WARPS * WARP_SIZE;  // launch-uniform
        const unsigned full = staged ? nblocks / QUANT_GROUP : 0;  // whole groups
        uint4* mine = stage[(threadIdx.x / WARP_SIZE) % QUANT_WARPS];
        unsigned char* st = reinterpret_cast<unsigned char*>(mine);
        for (unsigned g = warp; g < full; g += warps) {  // warp-uniform
            const unsigned first = g * QUANT_GROUP;
            float x[QUANT_GROUP / 4][4];
#pragma unroll
            for (int k = 0; k < QUANT_GROUP / 4; k++) {
                const unsigned b = first + 4 * k + lane / 8;
                load4(reinterpret_cast<const S*>(src) + b * Q::QK + 4 * r, x[k]);
            }
            __syncwarp();  // the previous group's stores have read the stage
#pragma unroll
            for (int k = 0; k < QUANT_GROUP / 4; k++) {
                quant::encode8<Q>(x[k], r, st + (4 * k + lane / 8) * Q::BYTES, true);
            }
            __syncwarp();
            uint4* out = reinterpret_cast<uint4*>(dst + static_cast<long long>(first) * Q::BYTES);
#pragma unroll
            for (int i = lane; i < UNITS; i += WARP_SIZE) {
                out[i] = mine[i];
            }
        }
        // what the groups left: every block when not staged, else the last nblocks % 16
        for (unsigned first = full * QUANT_GROUP + 4 * warp; first < nblocks; first += 4 * warps) {
            quantize4<Q, S>(src, dst, nblocks, first, lane);
        }
        return;
    } else {
        for (unsigned first = 4 * warp; first < nblocks; first += 4 * warps) {  // warp-uniform: every lane shuffles
            const unsigned b = first + lane / 8;
            const bool active = b < nblocks;
            float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            unsigned char* blk = dst;
            if (active) {
                const unsigned e = b * Q::QK + 4 * r;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    x[i] = to_f32(*reinterpret_cast<const S*>(src + la.offset(e + i)));
                }
                blk = dst + lb.offset(b);
            }
            quant::encode8<Q>(x, r, blk, active);
        }
    }
}

// A block format -> f32/f16/bf16. CONTIG: both contiguous, 4 values per thread
// (dst aligned to 4 elements); else one value per thread, block b of the source
// at la.offset(b) and element i of dst at lb.offset(i).
template <class Q, class D, bool CONTIG>
__global__ void dequantize(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                           const unsigned n, OD_LAYOUT_PARAMS(a), OD_LAYOUT_PARAMS(b)) {
    od::grid_enter();
    const Layout la = OD_LAYOUT(a), lb = OD_LAYOUT(b);
    if constexpr (CONTIG) {
        for (unsigned t = thread_id(); t < n / 4; t += thread_count()) {
            const unsigned e = 4 * t;
            const unsigned char* blk = src + static_cast<long long>(e / Q::QK) * Q::BYTES;
            D* out = reinterpret_cast<D*>(dst) + e;
            if constexpr (same_v<D, float>) {
                float4 v;
                v.x = quant::decode<Q>(blk, e % Q::QK);
                v.y = quant::decode<Q>(blk, e % Q::QK + 1);
                v.z = quant::decode<Q>(blk, e % Q::QK + 2);
                v.w = quant::decode<Q>(blk, e % Q::QK + 3);
                *reinterpret_cast<float4*>(out) = v;
            } else {
                union {
                    uint2 raw;
                    D v[4];
                } u;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    u.v[i] = from_f32<D>(quant::decode<Q>(blk, e % Q::QK + i));
                }
                *reinterpret_cast<uint2*>(out) = u.raw;
            }
        }
    } else {
        for (unsigned i = thread_id(); i < n; i += thread_count()) {
            const float y = quant::decode<Q>(src + la.offset(i / Q::QK), i % Q::QK);
            *reinterpret_cast<D*>(dst + lb.offset(i)) = from_f32<D>(y);
        }
    }
}

// -- get_rows / set_rows -------------------------------------------------------------------
//
// Each row gets TPR = 1 << tpr_log2 consecutive threads (a block of ROW_THREADS
// holds ROW_THREADS / TPR rows, so short rows share a block) and each thread up
// to ROW_UNROLL packs of N values, TPR * N values apart: a warp's accesses are
// contiguous, and a thread issues all its loads before its stores (bytes in
// flight). Block (x, y) covers rows x * ROW_THREADS / TPR .. and packs
// y * ROW_UNROLL * TPR .. of them. A thread finds its row (one division chain)
// and reads the row's index once; nothing is divided in the copy loop.
// VEC: rows packed on both sides, each row aligned to a pack, cols % N == 0;
// N = 16 / the wider element size, so the wider side moves 16 bytes per access
// (f16 -> f32: 8-byte loads, 16-byte stores). Otherwise N = 1, any element stride.

constexpr int ROW_THREADS = 256;
constexpr int ROW_UNROLL = 4;

template <class S, class D, bool VEC>
constexpr int row_pack = VEC ? 16 / static_cast<int>(sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D)) : 1;

// Element (i3, i2, k) of the index tensor: a row id, checked by the caller (od::index_ok).
template <class I>
__device__ __forceinline__ long long row_index(const unsigned char* idx, const unsigned k, const unsigned i2,
                                               const unsigned i3, const long long is0, const long long is1,
                                               const long long is2) {
    return *reinterpret_cast<const I*>(idx + i3 * is2 + i2 * is1 + k * is0);
}

// out (A3, A2, n, C) contiguous = a[i3, i2, idx[i3, i2, k]], nrows = A3 * A2 * n
// rows. A row index out of range gives NaN (0 for i32) instead of reading outside a, and is
// recorded in the error word once the row is written (od::record_bad_index, last).
template <class S, class D, bool VEC>
__global__ void __launch_bounds__(ROW_THREADS)
    get_rows(const unsigned char* __restrict__ a, const unsigned char* __restrict__ idx, D* __restrict__ out,
             const int ncols, const unsigned n, const unsigned a2, const long long arows, const unsigned nrows,
             const int tpr_log2, const long long as0, const long long as1, const long long as2, const long long as3,
             const long long is0, const long long is1, const long long is2, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    constexpr int N = row_pack<S, D, VEC>;
    const unsigned row = blockIdx.x * (ROW_THREADS >> tpr_log2) + (threadIdx.x >> tpr_log2);
    if (row >= nrows) {
        return;
    }
    const int tpr = 1 << tpr_log2;
    const int c0 = (blockIdx.y * ROW_UNROLL * tpr + (threadIdx.x & (tpr - 1))) * N;
    const unsigned k = row % n, i2 = (row / n) % a2, i3 = row / n / a2;
    const long long i = row_index<int>(idx, k, i2, i3, is0, is1, is2);
    const bool ok = od::in_range(i, arows);
    const long long r = ok ? i : -1;
    const unsigned char* src = a + i3 * as3 + i2 * as2 + r * as1;
    D* dst = out + static_cast<long long>(row) * ncols;
    Pack<S, N> v[ROW_UNROLL];
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; u++) {
        const int c = c0 + u * tpr * N;
        if (r >= 0 && c < ncols) {
            if constexpr (VEC) {
                v[u] = *reinterpret_cast<const Pack<S, N>*>(src + c * static_cast<long long>(sizeof(S)));
            } else {
                v[u].v[0] = *reinterpret_cast<const S*>(src + c * as0);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; u++) {
        const int c = c0 + u * tpr * N;
        if (c < ncols) {
            Pack<D, N> w;
#pragma unroll
            for (int j = 0; j < N; j++) {
                w.v[j] = r < 0 ? convert<float, D>(__int_as_float(0x7fc00000)) : convert<S, D>(v[u].v[j]);
            }
            *reinterpret_cast<Pack<D, N>*>(dst + c) = w;
        }
    }
    if (!ok) {
        od::record_bad_index(err_word, err_tag, row, i);
    }
}

// The same from a block format (rows of packed blocks), dequantized to f32.
template <class Q>
__global__ void get_rows_q(const unsigned char* __restrict__ a, const unsigned char* __restrict__ idx,
                           float* __restrict__ out, const int ncols, const unsigned n, const unsigned a2,
                           const long long arows, const long long as1, const long long as2, const long long as3,
                           const long long is0, const long long is1, const long long is2, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    const unsigned row = blockIdx.x;
    const unsigned k = row % n, i2 = (row / n) % a2, i3 = row / n / a2;
    const long long i = row_index<int>(idx, k, i2, i3, is0, is1, is2);
    const bool ok = od::in_range(i, arows);
    const long long r = ok ? i : -1;
    const unsigned char* src = a + i3 * as3 + i2 * as2 + r * as1;
    float* dst = out + static_cast<long long>(row) * ncols;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int c = (blockIdx.y * 4 + u) * blockDim.x + threadIdx.x;
        if (c < ncols) {
            dst[c] = r < 0 ? __int_as_float(0x7fc00000)
                           : quant::decode<Q>(src + (c / Q::QK) * Q::BYTES, c % Q::QK);
        }
    }
    if (!ok) {
        od::record_bad_index(err_word, err_tag, row, i);
    }
}

// dst[j3, j2, idx[j3 % I2, j2 % I1, k]] = src[j3, j2, k] (f32 rows), nrows = D3 * D2 * n
// source rows, tiled as get_rows. Rows whose index is out of range are not written (and are recorded
// in the error word).
template <class D, class I, bool VEC>
__global__ void __launch_bounds__(ROW_THREADS)
    set_rows(const unsigned char* __restrict__ src, const unsigned char* __restrict__ idx,
             unsigned char* __restrict__ dst, const int ncols, const unsigned n, const unsigned d2, const unsigned ni1,
             const unsigned ni2, const long long drows, const unsigned nrows, const int tpr_log2, const long long ss0,
             const long long ss1, const long long ss2, const long long ss3, const long long is0, const long long is1,
             const long long is2, const long long ds0, const long long ds1, const long long ds2, const long long ds3,
             OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    constexpr int N = row_pack<float, D, VEC>;
    const unsigned row = blockIdx.x * (ROW_THREADS >> tpr_log2) + (threadIdx.x >> tpr_log2);
    if (row >= nrows) {
        return;
    }
    const unsigned k = row % n, j2 = (row / n) % d2, j3 = row / n / d2;
    // the source loads do not depend on the index: issued before it is checked, so both latencies overlap
    const unsigned i1 = j2 % ni1, i2 = j3 % ni2;  // the index tensor's (I2, I1, n) element read
    const long long r = row_index<I>(idx, k, i1, i2, is0, is1, is2);
    const int tpr = 1 << tpr_log2;
    const int c0 = (blockIdx.y * ROW_UNROLL * tpr + (threadIdx.x & (tpr - 1))) * N;
    const unsigned char* s = src + j3 * ss3 + j2 * ss2 + k * ss1;
    Pack<float, N> v[ROW_UNROLL];
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; u++) {
        const int c = c0 + u * tpr * N;
        if (c < ncols) {
            if constexpr (VEC) {
                v[u] = *reinterpret_cast<const Pack<float, N>*>(s + c * 4ll);
            } else {
                v[u].v[0] = *reinterpret_cast<const float*>(s + c * ss0);
            }
        }
    }
    if (!od::index_ok(r, drows, err_word, err_tag, (static_cast<long long>(i2) * ni1 + i1) * n + k)) {
        return;
    }
    unsigned char* d = dst + j3 * ds3 + j2 * ds2 + r * ds1;
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; u++) {
        const int c = c0 + u * tpr * N;
        if (c < ncols) {
            Pack<D, N> w;
#pragma unroll
            for (int j = 0; j < N; j++) {
                w.v[j] = from_f32<D>(v[u].v[j]);
            }
            if constexpr (VEC) {
                *reinterpret_cast<Pack<D, N>*>(d + c * static_cast<long long>(sizeof(D))) = w;
            } else {
                *reinterpret_cast<D*>(d + c * ds0) = w.v[0];
            }
        }
    }
}

// The same into a block format: 8 lanes per block, 4 * (blockDim.x / 32) blocks
// of the row per blockIdx.y. VEC: source rows packed and 16-byte aligned.
template <class Q, class I, bool VEC>
__global__ void set_rows_q(const unsigned char* __restrict__ src, const unsigned char* __restrict__ idx,
                           unsigned char* __restrict__ dst, const int nblocks, const unsigned n, const unsigned d2,
                           const unsigned ni1, const unsigned ni2, const long long drows, const long long ss0,
                           const long long ss1, const long long ss2, const long long ss3, const long long is0,
                           const long long is1, const long long is2, const long long ds1, const long long ds2,
                           const long long ds3, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    const unsigned row = blockIdx.x;
    const unsigned k = row % n, j2 = (row / n) % d2, j3 = row / n / d2;
    const unsigned i1 = j2 % ni1, i2 = j3 % ni2;  // the index tensor's (I2, I1, n) element read
    const long long r = row_index<I>(idx, k, i1, i2, is0, is1, is2);
    if (!od::index_ok(r, drows, err_word, err_tag, (static_cast<long long>(i2) * ni1 + i1) * n + k)) {
        return;  // uniform over the block: no lane is left waiting in a shuffle
    }
    const unsigned char* s = src + j3 * ss3 + j2 * ss2 + k * ss1;
    unsigned char* d = dst + j3 * ds3 + j2 * ds2 + r * ds1;
    const int lane = threadIdx.x % WARP_SIZE, q = lane % 8;
    const int b = (blockIdx.y * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE) * 4 + lane / 8;
    const bool active = b < nblocks;
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (active) {
        const int c = b * Q::QK + 4 * q;
        if constexpr (VEC) {
            load4(reinterpret_cast<const float*>(s) + c, x);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                x[i] = *reinterpret_cast<const float*>(s + (c + i) * ss0);
            }
        }
    }
    quant::encode8<Q>(x, q, d + static_cast<long long>(b) * Q::BYTES, active);
}
