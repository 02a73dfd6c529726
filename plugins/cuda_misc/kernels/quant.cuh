// Device helpers of cuda_misc's rows, reductions and sorts:
//
// 1. Index arithmetic: division by a divisor fixed at bind time (multiply-high,
//    no hardware divide) and 4-d layouts given as sizes innermost first (n0 =
//    the last numpy axis) with byte strides. Flat indices are unsigned 32-bit:
//    bind declines tensors of 2**31 elements or more for the paths that unravel.
//    And a block-wide scan.
//
// 2. ggml's 32-value block formats: encode (quantize) and decode.
//
// Block formats are bit-exact with opdispatch.dtypes.quantize / dequantize, which follow ggml's
// reference C (quantize_row_*_ref, dequantize_row_*) one float32 operation at
// a time. Every multiply and add below that ggml writes as separate C
// operations is spelled __fmul_rn / __fadd_rn, so that the compiler cannot
// contract them into an FMA (which would round once instead of twice and
// change codes that sit next to a half-integer); divisions are __fdiv_rn
// (IEEE, whatever the division flags).
//
// Block layouts (bytes; d and m are IEEE halves, little-endian):
//   q4_0  18: d, qs[16]            code j in the low nibble of qs[j], j+16 in the high
//   q4_1  20: d, m, qs[16]
//   q5_0  22: d, qh[4], qs[16]     5th bit of code j = bit j of qh (a little-endian u32)
//   q5_1  24: d, m, qh[4], qs[16]
//   q8_0  34: d, qs[32] int8
#pragma once

#include "common.cuh"

namespace od {

// n / d for n < 2**31: q = (umulhi(n, m) + n) >> l, with l = ceil(log2(d)) and
// m = floor(2**32 * (2**l - d) / d) + 1 computed on the host (opdispatch's
// cuda_misc/rows.py, `fastdiv`).
struct Div {
    unsigned d, m, l;
};

__device__ __forceinline__ unsigned fdiv(const unsigned n, const Div v) {
    return (__umulhi(n, v.m) + n) >> v.l;
}

struct Idx4 {
    unsigned i0, i1, i2, i3;
};

// A 4-d layout: the sizes n0, n1, n2 as divisors (n3 is whatever is left of a
// flat index) and byte strides s0..s3.
struct Layout {
    Div n0, n1, n2;
    long long s0, s1, s2, s3;

    __device__ __forceinline__ Idx4 unravel(const unsigned i) const {
        const unsigned q0 = fdiv(i, n0);
        const unsigned q1 = fdiv(q0, n1);
        const unsigned q2 = fdiv(q1, n2);
        return {i - q0 * n0.d, q0 - q1 * n1.d, q1 - q2 * n2.d, q2};
    }

    __device__ __forceinline__ long long at(const Idx4 x) const {
        return x.i0 * s0 + x.i1 * s1 + x.i2 * s2 + x.i3 * s3;
    }

    // Byte offset of the i-th element in row-major order.
    __device__ __forceinline__ long long offset(const unsigned i) const {
        return at(unravel(i));
    }
};

// Start of row `row` of a tensor read row by row: (i1, i2, i3) from `row` with
// sizes n1, n2, and byte strides s1..s3.
__device__ __forceinline__ const unsigned char* row_start(const unsigned char* x, const unsigned row,
                                                          const unsigned n1, const unsigned n2, const long long s1,
                                                          const long long s2, const long long s3) {
    const unsigned i1 = row % n1, i2 = (row / n1) % n2, i3 = row / n1 / n2;
    return x + (i1 * s1 + i2 * s2 + i3 * s3);
}

// Inclusive scan over the block (BLOCK threads), every thread gets its prefix
// and `total` the block's sum. Must be reached by every thread.
template <int BLOCK, class T>
__device__ __forceinline__ T block_scan(T v, T& total) {
    __shared__ T warp_sums[BLOCK / WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int off = 1; off < WARP_SIZE; off <<= 1) {
        const T u = __shfl_up_sync(FULL_MASK, v, off, WARP_SIZE);
        v += lane >= off ? u : T(0);
    }
    __syncthreads();  // a previous call may still read warp_sums
    if (lane == WARP_SIZE - 1) {
        warp_sums[warp] = v;
    }
    __syncthreads();
    T before = T(0);
    total = T(0);
#pragma unroll
    for (int w = 0; w < BLOCK / WARP_SIZE; w++) {
        before += w < warp ? warp_sums[w] : T(0);
        total += warp_sums[w];
    }
    return v + before;
}

}  // namespace od

// A layout as 13 kernel parameters (numpy scalars: 9 np.uint32, 4 np.int64),
// rebuilt inside the kernel with OD_LAYOUT(prefix).
#define OD_LAYOUT_PARAMS(p)                                                                             \
    unsigned p##d0, unsigned p##m0, unsigned p##l0, unsigned p##d1, unsigned p##m1, unsigned p##l1,     \
        unsigned p##d2, unsigned p##m2, unsigned p##l2, long long p##s0, long long p##s1, long long p##s2, \
        long long p##s3
#define OD_LAYOUT(p)                                                                                 \
    od::Layout {                                                                                     \
        {p##d0, p##m0, p##l0}, {p##d1, p##m1, p##l1}, {p##d2, p##m2, p##l2}, p##s0, p##s1, p##s2, p##s3 \
    }

namespace od {
namespace quant {

constexpr int QK = 32;

enum class Scale { signed_absmax, absmax, range };

// One format: geometry (byte offsets of its fields, -1 when absent) and rounding.
template <int BYTES_, int BITS_, Scale SCALE_, int DIV_, int ZERO_, int M_, int QH_, int QS_>
struct Format {
    static constexpr int BYTES = BYTES_;
    static constexpr int BITS = BITS_;
    static constexpr Scale SCALE = SCALE_;
    static constexpr int DIV = DIV_;    // d = (the scale's source) / DIV
    static constexpr int ZERO = ZERO_;  // decode: (q - ZERO) * d (+ m)
    static constexpr int M = M_;
    static constexpr int QH = QH_;
    static constexpr int QS = QS_;
    static constexpr int QMAX = (1 << BITS_) - 1;
};

using q4_0 = Format<18, 4, Scale::signed_absmax, -8, 8, -1, -1, 2>;
using q4_1 = Format<20, 4, Scale::range, 15, 0, 2, -1, 4>;
using q5_0 = Format<22, 5, Scale::signed_absmax, -16, 16, -1, 2, 6>;
using q5_1 = Format<24, 5, Scale::range, 31, 0, 2, 4, 8>;
using q8_0 = Format<34, 8, Scale::absmax, 127, 0, -1, -1, 2>;

// Blocks start at even addresses (every size is even and buffers are aligned),
// so 16-bit accesses are always aligned; wider ones are not.
__device__ __forceinline__ void put_u16(unsigned char* p, unsigned v) {
    *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(v);
}

__device__ __forceinline__ void put_u32(unsigned char* p, unsigned v) {
    put_u16(p, v & 0xffffu);
    put_u16(p + 2, v >> 16);
}

__device__ __forceinline__ unsigned get_u16(const unsigned char* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}

// -- encode: 8 lanes per block ---------------------------------------------------
//
// The 32 values of a block are spread over 8 consecutive lanes of a warp (lanes
// 8g .. 8g+7), lane r = lane % 8 holding values 4r .. 4r+3 in x. Every lane of
// the warp must call this (it shuffles with the full mask); lanes with `active`
// false take part in the shuffles but store nothing.
//
// ggml scans a block with strict comparisons, so among tied candidates the
// first index wins (which decides the sign of a zero in d and m): a partner
// lane's candidate is taken on a tie only when it comes from lower indices.

__device__ __forceinline__ bool take_partner(float mine, float theirs, int r, int off, bool greater) {
    const bool better = greater ? theirs > mine : theirs < mine;
    return better || (theirs == mine && (r ^ off) < r);
}

template <class Q>
__device__ __forceinline__ void encode8(const float (&x)[4], const int r, unsigned char* blk, const bool active) {
    float d, id, m = 0.0f;
    if constexpr (Q::SCALE == Scale::absmax) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            amax = fmaxf(amax, fabsf(x[i]));
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, off, WARP_SIZE));
        }
        d = __fdiv_rn(amax, static_cast<float>(Q::DIV));
    } else if constexpr (Q::SCALE == Scale::signed_absmax) {
        float amax = 0.0f, max = 0.0f;  // ggml's start: an all-zero block keeps max = +0
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (amax < fabsf(x[i])) {
                amax = fabsf(x[i]);
                max = x[i];
            }
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            const float a2 = __shfl_xor_sync(FULL_MASK, amax, off, WARP_SIZE);
            const float m2 = __shfl_xor_sync(FULL_MASK, max, off, WARP_SIZE);
            if (take_partner(amax, a2, r, off, true)) {
                amax = a2;
                max = m2;
            }
        }
        d = __fdiv_rn(max, static_cast<float>(Q::DIV));
    } else {
        float lo = 3.402823466e+38f, hi = -3.402823466e+38f;  // FLT_MAX, as ggml starts
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (x[i] < lo) {
                lo = x[i];
            }
            if (x[i] > hi) {
                hi = x[i];
            }
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            const float lo2 = __shfl_xor_sync(FULL_MASK, lo, off, WARP_SIZE);
            const float hi2 = __shfl_xor_sync(FULL_MASK, hi, off, WARP_SIZE);
            if (take_partner(lo, lo2, r, off, false)) {
                lo = lo2;
            }
            if (take_partner(hi, hi2, r, off, true)) {
                hi = hi2;
            }
        }
        m = lo;
        d = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(Q::DIV));
    }
    id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;

    int q[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (Q::BITS == 8) {
            q[i] = static_cast<int>(roundf(__fmul_rn(x[i], id)));  // roundf: halves away from zero, as ggml
        } else {
            const float v = Q::SCALE == Scale::range ? __fmul_rn(__fsub_rn(x[i], m), id) : __fmul_rn(x[i], id);
            const float t = truncf(__fadd_rn(v, static_cast<float>(Q::ZERO) + 0.5f));
            q[i] = static_cast<int>(fminf(t, static_cast<float>(Q::QMAX)));
        }
    }

    // One byte per code, in index order: lane r's 4 bytes of qs (8-bit codes)
    // or its 4 low nibbles (4/5-bit codes, before the merge below).
    const unsigned packed = (q[0] & 0xff) | ((q[1] & 0xff) << 8) | ((q[2] & 0xff) << 16)
        | (static_cast<unsigned>(q[3] & 0xff) << 24);
    unsigned nibbles = 0, qh = 0;
    if constexpr (Q::BITS < 8) {
        // qs byte j = code j | code j+16 << 4: lane r < 4 takes lane r+4's codes as high nibbles.
        const unsigned low = packed & 0x0f0f0f0fu;
        const unsigned high = __shfl_xor_sync(FULL_MASK, low, 4, WARP_SIZE);
        nibbles = low | (high << 4);
    }
    if constexpr (Q::BITS == 5) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            qh |= static_cast<unsigned>((q[i] >> 4) & 1) << (4 * r + i);
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            qh |= __shfl_xor_sync(FULL_MASK, qh, off, WARP_SIZE);
        }
    }
    if (!active) {
        return;
    }
    if (r == 0) {
        put_u16(blk, f32_to_f16(d));
        if constexpr (Q::M >= 0) {
            put_u16(blk + Q::M, f32_to_f16(m));
        }
        if constexpr (Q::QH >= 0) {
            put_u32(blk + Q::QH, qh);
        }
    }
    if constexpr (Q::BITS == 8) {
        put_u32(blk + Q::QS + 4 * r, packed);
    } else if (r < 4) {
        put_u32(blk + Q::QS + 4 * r, nibbles);
    }
}

// -- decode ------------------------------------------------------------------------

// Value j (0..31) of a block: (q - ZERO) * d, plus m for the affine formats.
template <class Q>
__device__ __forceinline__ float decode(const unsigned char* blk, const int j) {
    const float d = f16_to_f32(static_cast<unsigned short>(get_u16(blk)));
    int q;
    if constexpr (Q::BITS == 8) {
        q = static_cast<signed char>(blk[Q::QS + j]);
    } else {
        const unsigned b = blk[Q::QS + (j & 15)];
        q = static_cast<int>(j < 16 ? b & 0x0fu : b >> 4);
        if constexpr (Q::BITS == 5) {
            q |= ((blk[Q::QH + (j >> 3)] >> (j & 7)) & 1) << 4;
        }
    }
    const float y = __fmul_rn(static_cast<float>(q - Q::ZERO), d);
    if constexpr (Q::M >= 0) {
        return __fadd_rn(y, f16_to_f32(static_cast<unsigned short>(get_u16(blk + Q::M))));
    } else {
        return y;
    }
}

}  // namespace quant
}  // namespace od
