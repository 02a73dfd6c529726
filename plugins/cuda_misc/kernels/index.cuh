// Index arithmetic of cuda_misc's rows, reductions and sorts: division by a divisor
// fixed at bind time (multiply-high, no hardware divide) and 4-d layouts given as sizes
// innermost first (n0 = the last numpy axis) with byte strides. Flat indices are unsigned
// 32-bit: bind declines tensors of 2**31 elements or more for the paths that unravel.
#pragma once

#include "common.cuh"

namespace od {

// n / d for n < 2**31: q = (umulhi(n, m) + n) >> l, with l = ceil(log2(d)) and
// m = floor(2**32 * (2**l - d) / d) + 1 computed on the host (opdispatch's
// cuda_misc/specs/rows.py, `fastdiv`).
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
