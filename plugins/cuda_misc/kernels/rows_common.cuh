// Helpers the cuda_misc row and layout kernels (rows.cu, layout.cu) share: element
// conversions through f32, 16-byte packs, grid-stride thread indices.
#pragma once
#include "common.cuh"
#include "index.cuh"

namespace od {
namespace rows {

// -- element conversions ---------------------------------------------------------------

template <class D>
__device__ __forceinline__ D from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(const float v) { return v; }
template <>
__device__ __forceinline__ f16 from_f32<f16>(const float v) { return f16{f32_to_f16(v)}; }
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(const float v) { return bf16{f32_to_bf16(v)}; }
template <>
__device__ __forceinline__ int from_f32<int>(const float v) { return __float2int_rz(v); }

// Same type: the bits, untouched (NaN payloads, large integers, raw units).
template <class S, class D>
__device__ __forceinline__ D convert(const S v) {
    if constexpr (same_v<S, D>) {
        return v;
    } else {
        return from_f32<D>(to_f32(v));
    }
}

// Raw units for same-dtype copies of block formats: one block.
template <int BYTES>
struct Block {
    unsigned short w[BYTES / 2];
};

// Eight elements through one or two 16-byte accesses (the address must be aligned).
template <class T>
union Pack8 {
    uint4 raw[sizeof(T) / 2];
    T v[8];
};

template <class T>
__device__ __forceinline__ Pack8<T> load8(const T* p) {
    Pack8<T> r;
#pragma unroll
    for (int k = 0; k < int(sizeof(T) / 2); k++) {
        r.raw[k] = reinterpret_cast<const uint4*>(p)[k];
    }
    return r;
}

template <class T>
__device__ __forceinline__ void store8(T* p, const Pack8<T>& r) {
#pragma unroll
    for (int k = 0; k < int(sizeof(T) / 2); k++) {
        reinterpret_cast<uint4*>(p)[k] = r.raw[k];
    }
}

// Four consecutive source values as f32 (the address aligned to 4 elements).
__device__ __forceinline__ void load4(const float* p, float (&x)[4]) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
}

template <class T>
__device__ __forceinline__ void load4(const T* p, float (&x)[4]) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);  // four 16-bit values
    const T* h = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[i] = to_f32(h[i]);
    }
}

__device__ __forceinline__ long long thread_id() {
    return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long thread_count() {
    return static_cast<long long>(gridDim.x) * blockDim.x;
}

}  // namespace rows
}  // namespace od
