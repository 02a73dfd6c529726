// Shared by cuda_misc's elementwise kernels (elementwise.cu, unary.cu, glu.cu).
#pragma once

#include "activations.cuh"
#include "common.cuh"

namespace ew {

// Stores convert with round-to-nearest-even, as common.cuh's od::store; bf16 through the
// hardware's cvt.rn.bf16.f32 (sm_80+): the same value as od::store's bit formula in one
// instruction instead of six (a NaN becomes the canonical quiet NaN, its payload dropped).
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(od::f16* p, float v) { od::store(p, v); }
__device__ __forceinline__ void put(od::bf16* p, float v) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p->bits = h;
}

// v rounded to T and back (identity for float): what storing a result in T keeps.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    T t;
    put(&t, v);
    return od::load(&t);
}

template <typename T>
struct Vec {
    static constexpr int N = 16 / sizeof(T);  // elements per 16-byte vector
};

}  // namespace ew
