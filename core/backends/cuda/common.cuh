// Device helpers shared by every opdispatch kernel: warp and block reductions and
// scans, f16/bf16 loads, stores and conversions, 2-byte aligned raw accesses, index
// checks, programmatic dependent launch, cp.async and the walk of a copy loop over a grid of items.
// Block formats: quant.cuh.
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

// same_v<A, B>: A and B are one type (no system header, so no <type_traits>).
template <class A, class B>
constexpr bool same_v = false;
template <class A>
constexpr bool same_v<A, A> = true;

// -- reductions -----------------------------------------------------------------
// Every lane of the warp gets the result (xor butterfly). T: any type the shuffles take.

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
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

// Maximum over a one-dimensional block of BLOCK threads, as block_sum (fmaxf: a NaN is dropped).
template <int BLOCK>
__device__ __forceinline__ float block_max(float v) {
    static_assert(BLOCK % WARP_SIZE == 0 && BLOCK <= 1024, "BLOCK must be a multiple of 32, at most 1024");
    v = warp_max(v);
    if constexpr (BLOCK > WARP_SIZE) {
        __shared__ float partial[BLOCK / WARP_SIZE];
        const int lane = threadIdx.x % WARP_SIZE;
        const int warp = threadIdx.x / WARP_SIZE;
        __syncthreads();
        if (lane == 0) {
            partial[warp] = v;
        }
        __syncthreads();
        v = lane < BLOCK / WARP_SIZE ? partial[lane] : -__int_as_float(0x7f800000);
        v = warp_max(v);
    }
    return v;
}

// Inclusive scan over the block (BLOCK threads), every thread gets its prefix
// and `total` the block's sum; with `exclusive`, also the sum of the threads before
// it, added up rather than taken as prefix - v (inf - inf would make it NaN).
// Must be reached by every thread.
template <int BLOCK, class T>
__device__ __forceinline__ T block_scan(T v, T& total, T* exclusive = nullptr) {
    __shared__ T warp_sums[BLOCK / WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
#pragma unroll
    for (int off = 1; off < WARP_SIZE; off <<= 1) {
        const T u = __shfl_up_sync(FULL_MASK, v, off, WARP_SIZE);
        v += lane >= off ? u : T(0);
    }
    T up = T(0);  // the inclusive sum of the lane before, within the warp
    if (exclusive != nullptr) {
        up = __shfl_up_sync(FULL_MASK, v, 1, WARP_SIZE);
        up = lane >= 1 ? up : T(0);
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
    if (exclusive != nullptr) {
        *exclusive = up + before;
    }
    return v + before;
}

// sync_block<THREADS>(): the block's barrier, or with THREADS > 0 named barrier 1 of the first THREADS threads
// (a kernel whose other warps have left, such as a producer warpgroup's: kernels/mmq_wgmma.cu).
template <int THREADS = 0>
__device__ __forceinline__ void sync_block() {
    if constexpr (THREADS == 0) {
        __syncthreads();
    } else {
        asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
    }
}

// -- "the last block finishes the job" -------------------------------------------
// A grid whose blocks each write a part of a result, and whose last block to finish then
// reads all of it (merges split-K partials, normalizes the rows the others wrote), in one
// launch. Every block calls last_block(counter, blocks) after its writes; it returns true in
// the one block that counted last, after which that block sees every other block's writes
// (read them with __ldcg or volatile loads: not through the read-only cache, and not through
// L1, which may hold stale lines). The last block sets the counter back to 0, so the
// counter, zeroed once when allocated, is ready for the next launch or CUDA-graph replay.
// Must be reached by every thread of the block (with THREADS > 0: by its first THREADS threads, which
// sync_block<THREADS> synchronizes).
template <int THREADS = 0>
__device__ __forceinline__ bool last_block(int* counter, int blocks) {
    __shared__ bool last;
    __threadfence();  // this block's writes are visible device-wide before it counts itself done
    sync_block<THREADS>();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1) == blocks - 1;
        if (last) {
            *counter = 0;  // every block has counted: ready for the next launch
        }
    }
    sync_block<THREADS>();
    if (last) {
        __threadfence();  // order this block's reads after the other blocks' counted writes
    }
    return last;
}

// -- index checks -------------------------------------------------------------------
// A kernel that reads indices from data (row ids, expert ids) ends its parameters with
// OD_INDEX_CHECK_PARAMS: the plan's error word, 4 u64 in host-mapped memory ([tag + 1, position,
// value, spare], zero while all is well), and the tag of this use of an index tensor, by which the
// host names the node, the tensor and the valid range (opdispatch.errorword). index_ok(i, n, ...)
// is 0 <= i < n; a bad index is recorded (the first one only: the word is set once, by
// compare-and-swap; the host clears it) and the caller must not dereference it. A null word
// (OPDISPATCH_CHECK_INDICES=0) records nothing: a bad index is still skipped, only not reported.
// The recording is out of line, so that it costs the kernel's hot path no registers, as long as
// nothing is live across it: a kernel that has work left for a bad index (a NaN row to write)
// tests in_range, does that work, then calls record_bad_index last.
#define OD_INDEX_CHECK_PARAMS unsigned long long* err_word, unsigned err_tag

__device__ __forceinline__ bool in_range(const long long i, const long long n) {
    return static_cast<unsigned long long>(i) < static_cast<unsigned long long>(n);
}

__device__ __noinline__ void record_bad_index(unsigned long long* word, const unsigned tag, const long long position,
                                              const long long i) {
    if (word != nullptr && atomicCAS(word, 0ull, tag + 1ull) == 0ull) {
        word[1] = static_cast<unsigned long long>(position);
        word[2] = static_cast<unsigned long long>(i);
        __threadfence_system();
    }
}

__device__ __forceinline__ bool index_ok(const long long i, const long long n, unsigned long long* word,
                                         const unsigned tag, const long long position) {
    if (in_range(i, n)) {
        return true;
    }
    record_bad_index(word, tag, position, i);
    return false;
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

// PTX prmt in its default mode: byte i of the result is byte (s >> 4i) & 7 of the pair (a bytes 0..3, b
// 4..7), or that byte's sign bit in all 8 bits where bit 4i + 3 of s is set. __byte_perm(a, b, s) is the
// same on s & 0x7777, an instruction (LOP3) the table lookups, whose selectors never set bit 3, do not need.
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

// dp4a with a's bytes unsigned (0..255) and b's signed: quant_k.cuh dots a code field masked where it lies in its
// byte (above bit 0) and shifts the sum once, exactly (a multiple of the field's place value), where shifting each
// word down took an instruction a word.
__device__ __forceinline__ int dp4a_us(unsigned a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
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

// Two 16-bit floats packed in a word (the first in the low half) as floats.
__device__ __forceinline__ void unpack_f16x2(unsigned w, float& lo, float& hi) {
    lo = f16_to_f32(static_cast<unsigned short>(w & 0xffffu));
    hi = f16_to_f32(static_cast<unsigned short>(w >> 16));
}

__device__ __forceinline__ void unpack_bf16x2(unsigned w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}

// to_f32(v): an element's value as float (i32 rounded to nearest, as cpy's i32 -> f32).
__device__ __forceinline__ float to_f32(const float v) { return v; }
__device__ __forceinline__ float to_f32(const f16 v) { return f16_to_f32(v.bits); }
__device__ __forceinline__ float to_f32(const bf16 v) { return bf16_to_f32(v.bits); }
__device__ __forceinline__ float to_f32(const int v) { return __int2float_rn(v); }

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

// -- small integers as floats, exactly, without I2F ----------------------------------
// Where nvcc can tell a value fits 16 bits it converts it by I2F.U16 / I2F.S16, on the XU pipe at a quarter
// of the FMA pipe's rate (a q4_K K step of mmq_small held 8 of them); these take a lop3 and an add instead:
// under the exponent of 2^23 the mantissa counts units, and the subtraction is exact.
// x (bits 8 .. 31 clear) as a float.
__device__ __forceinline__ float small_f32(unsigned x) {
    return __fsub_rn(__uint_as_float(x | 0x4b000000u), 8388608.0f);
}

// An int8 (bits 0 .. 7 of x, bits 8 .. 31 clear) as a float: 2^23 + 128 + v, less 2^23 + 128.
__device__ __forceinline__ float s8_f32(unsigned x) {
    return __fsub_rn(__uint_as_float((x ^ 0x80u) | 0x4b000000u), 8388736.0f);
}

// -- raw accesses at 2-byte aligned addresses --------------------------------------
// Block formats of 18, 22 or 34 bytes leave their fields only 2-byte aligned: one 16-bit
// access, or two for 32 bits.

__device__ __forceinline__ unsigned ld16(const unsigned char* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}

__device__ __forceinline__ unsigned ld32_2(const unsigned char* p) {
    return ld16(p) | (ld16(p + 2) << 16);
}

__device__ __forceinline__ void st16(unsigned char* p, unsigned v) {
    *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(v);
}

__device__ __forceinline__ void st32_2(unsigned char* p, unsigned v) {
    st16(p, v & 0xffffu);
    st16(p + 2, v >> 16);
}

// -- a thread's items of a rows x cols grid ------------------------------------------
// A loop `for (i = first; i < rows * cols; i += step)` that needs item i's (row, col) = (i / cols, i % cols):
// Walk divides once, for the first item and the step, and then moves (row, col) by additions. A division by a
// runtime value is about 20 instructions; in mmq_small's copy loops, which divided at every item, it made a
// third of a small launch's instructions (ncu, H200, 2026-12-03).
struct Walk {  // cols > 0
    int row, col, drow, dcol, cols;
    __device__ __forceinline__ Walk(int first, int step, int cols_)
        : row(first / cols_), col(first % cols_), drow(step / cols_), dcol(step % cols_), cols(cols_) {}
    __device__ __forceinline__ void next() {
        row += drow;
        col += dcol;
        if (col >= cols) {
            col -= cols;
            ++row;
        }
    }
};

// -- cp.async (sm_80+): global -> shared copies that bypass the registers -------------
// cp_async16(saddr, src) copies 16 bytes (both 16-byte aligned) to the shared address saddr
// (smem_addr; cp_async16_zfill: only the first bytes of them, zeros after); commit closes a group of
// copies, wait<N> returns once at most N groups are in flight.

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(unsigned saddr, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(src) : "memory");
}

// The same reading only the first `bytes` (0..16) of the 16 at src and zero-filling the rest (the source size):
// a row's last granule without reading past the row.
__device__ __forceinline__ void cp_async16_zfill(unsigned saddr, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// -- bulk copies (sm_90+): global -> shared through the copy engine (TMA), counted on an mbarrier ---------
// One instruction moves a whole contiguous run (16-byte aligned at both ends, a multiple of 16 bytes), where
// cp_async16 takes one a 16-byte granule and the address arithmetic around it. A stage's barrier (mbar_init, count
// 1) is armed with the bytes to come (mbar_expect_tx: the one arrival, plus that many bytes of transactions), each
// copy (bulk_copy) counts its bytes off it, and the phase completes when all have landed; mbar_wait(parity) spins
// until phase `parity` (0, 1, 0, ... for a barrier's successive uses) has. HAS_BULK: whether this target has them
// (OD_BULK; the helpers compile to nothing below sm_90, where callers take cp_async16).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define OD_BULK 1
#else
#define OD_BULK 0
#endif
constexpr bool HAS_BULK = OD_BULK;

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
#if OD_BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
    // the initialised barrier visible to the copy engine (the async proxy) before a copy signals it
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
#if OD_BULK
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy(unsigned saddr, const void* src, unsigned bytes, unsigned bar) {
#if OD_BULK
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(saddr), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}

// One arrival on the barrier (its count of expected arrivals set by mbar_init), no transactions.
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
#if OD_BULK
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// One arrival on the barrier once every cp.async this thread has issued so far has landed (cp.async.mbarrier.arrive
// .noinc: the arrival is one of the count mbar_init set, made by the copy engine when the copies complete), so that
// a copying thread signals a stage without waiting for its copies itself.
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
#if OD_BULK
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
#if OD_BULK
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
#endif
}

// -- ldmatrix (sm_75+): four 8x8 matrices of 16-bit values from shared memory, a warp collective ---------
// Lane 8m + i gives the shared address (smem_addr) of row i (16 bytes) of matrix m; lane 4g + t receives in
// word m the pair (row g, columns 2t, 2t + 1) of matrix m, or with _trans its transpose's (rows 2t, 2t + 1 of
// column g): the A and B fragments of mma.sync.m16n8k16.

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

}  // namespace od
