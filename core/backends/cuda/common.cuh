// Device helpers shared by every opdispatch kernel: warp and block reductions,
// f16/bf16 loads and stores.
//
// Compiled both by NVRTC (through cupy.RawModule, with this folder on the
// include path) and by nvcc in CI, so it includes no system header: f16 and
// bf16 are handled as raw 16-bit storage, converted with PTX (f16) or with
// ggml's own bit formula (bf16, round to nearest even, NaN made quiet), so
// device results match the host's `opdispatch.dtypes` conversions.
#pragma once

namespace od {

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

// -- reductions -----------------------------------------------------------------
// Every lane of the warp gets the result (xor butterfly).

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, offset, WARP_SIZE);
    }
    return v;
}

__device__ __forceinline__ float2 warp_sum(float2 v) {
    v.x = warp_sum(v.x);
    v.y = warp_sum(v.y);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset, WARP_SIZE));
    }
    return v;
}

// Sum over a one-dimensional block of BLOCK threads (a multiple of 32, at most
// 1024); every thread gets the result. T is float or float2. Must be reached
// by every thread of the block. Safe to call several times in one kernel.
template <int BLOCK, typename T>
__device__ __forceinline__ T block_sum(T v) {
    static_assert(BLOCK % WARP_SIZE == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, at most 1024");
    v = warp_sum(v);
    if constexpr (BLOCK > WARP_SIZE) {
        __shared__ T partial[BLOCK / WARP_SIZE];
        const int lane = threadIdx.x % WARP_SIZE;
        const int warp = threadIdx.x / WARP_SIZE;
        __syncthreads();  // an earlier call may still be reading `partial`
        if (lane == 0) {
            partial[warp] = v;
        }
        __syncthreads();
        v = lane < BLOCK / WARP_SIZE ? partial[lane] : T{};
        v = warp_sum(v);
    }
    return v;
}

// -- "the last block finishes the job" -------------------------------------------
// A grid whose blocks each write a part of a result, and whose last block to finish then
// reads all of it (merges split-K partials, normalizes the rows the others wrote), in one
// launch. Every block calls last_block(counter, blocks) after its writes; it returns true in
// the one block that counted last, after which that block sees every other block's writes
// (read them with __ldcg or volatile loads: not through the read-only cache, and not through
// L1, which may hold stale lines). The last block sets the counter back to 0, so the
// counter, zeroed once when allocated, is ready for the next launch or CUDA-graph replay.
// Must be reached by every thread of the block.

__device__ __forceinline__ bool last_block(int* counter, int blocks) {
    __shared__ bool last;
    __threadfence();  // this block's writes are visible device-wide before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == blocks - 1;
        if (last) {
            *counter = 0;  // every block has counted: ready for the next launch
        }
    }
    __syncthreads();
    if (last) {
        __threadfence();  // order this block's reads after the other blocks' counted writes
    }
    return last;
}

// -- programmatic dependent launch (Hopper) ---------------------------------------
// A kernel launched with PDL may start while the kernel before it on the stream
// is still running, so that its launch and setup overlap that kernel's tail. It must call
// grid_wait() before it reads anything an earlier kernel writes or writes anything an earlier
// kernel reads: grid_wait() returns once the kernel before it has finished and its writes are
// visible. grid_release() lets the next kernel start launching (once every block of this one has
// released or exited). Both are no-ops in a kernel launched without the attribute, and before
// sm_90. (Prefetching the weights into L2 before the wait was measured: slower on the H200.)

__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// grid_wait() then grid_release(): the first statement of a kernel launched with PDL (kernels.py
// launches a kernel whose body begins with it so). Released after the wait, the overlap stays one
// kernel deep (releasing first measured slower on the H200: 0.850 against 0.842 ms a 1b decode step).
__device__ __forceinline__ void grid_enter() {
    grid_wait();
    grid_release();
}

// The first statement of a kernel that launches with PDL but calls grid_enter() itself, later:
// before it, the kernel may only read data no kernel writes (constant weights). Does nothing.
__device__ __forceinline__ void grid_enter_later() {}

// -- 16-bit floats as raw storage -------------------------------------------------

struct f16 {
    unsigned short bits;
};

struct bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// max(a, b), NaN when either is (fmaxf returns the other operand): a block maximum that carries a
// NaN input through to its scale.
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(static_cast<unsigned>(b) << 16);
}

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return static_cast<unsigned short>((u >> 16) | 64u);  // NaN: keep it, make it quiet
    }
    return static_cast<unsigned short>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

// load(p) reads one element as float; store(p, v) writes v converted to *p's type.
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const f16* p) { return f16_to_f32(p->bits); }
__device__ __forceinline__ float load(const bf16* p) { return bf16_to_f32(p->bits); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(f16* p, float v) { p->bits = f32_to_f16(v); }
__device__ __forceinline__ void store(bf16* p, float v) { p->bits = f32_to_bf16(v); }

// N elements as one aligned access of N * sizeof(T) bytes (16 bytes: one vector load).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

}  // namespace od
