// Host emulation of the CUDA subset that the plugins' kernels and the shared headers (common.cuh, quant.cuh,
// wgmma.cuh) use, for the CPU emulation tests (tests/test_*_emulated.py, tests/test_quant_header.py): cuda_matmul's
// mmvq_stream.cu, mmq.cu, mmq_id.cu, mmq_small.cu, mmf.cu, convert.cu, mmv.cu (quantize_q8_1, mmv, mmvq),
// mmv_id.cu (its mul_mat_id kernels and moe_route), mmq_wgmma.cu (its wgmma products, mbarriers and named barrier)
// and its A-fragment builders (mmq_frags.cuh), cuda_misc's row kernels, cuda_attention's fattn_decode.cu,
// fattn_prefill.cu (its warp votes), fattn_prefill_wgmma.cu (an MN-major wgmma B), fattn_mask.cu, softmax.cu and
// rope.cu, cuda_norm's norm.cu:
// one fiber per CUDA thread (emu_run_block: a block's threads take turns on one OS thread, switching only at
// __syncthreads / __syncwarp / shuffles, which are barriers, and at an mbarrier wait that cannot complete yet),
// cp.async performed at wait_group time (lazy) or at issue (eager), and bulk copies when their mbarrier's phase
// completes, so that a read of a stage before its wait sees the poisoned (0xFF) shared memory instead of the
// weights. Shared addresses (common.cuh's smem_addr) are offsets into the block's dynamic shared memory.
#pragma once
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <algorithm>
#include <atomic>
#include <map>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
// blocks run one after another: a block-scope __shared__ variable is one static for all its threads
#define __shared__ static
#define __launch_bounds__(...)

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline int2 make_int2(int a, int b) { return {a, b}; }

struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline dim3 threadIdx, blockIdx;  // the running fiber's (emu_run_block swaps threadIdx)
inline dim3 blockDim, gridDim;

inline int min(int a, int b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; memcpy(&v, &f, 4); return v; }
inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, 4); return u; }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }  // the device's is within 2 ulp of this
// IEEE single operations, one rounding each (the test compiles with -ffp-contract=off)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return x != x ? 0 : (int)x; }  // NaN: 0, as cvt.rzi
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __int2float_rn(int x) { return (float)x; }
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned sh) {
    sh = sh > 32 ? 32 : sh;
    const unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)(v >> sh);
}
// hi:lo shifted right by sh % 32 (wrap mode): a rotation when lo == hi (mmq_frags.cuh's q5_K)
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
    const unsigned long long v = ((unsigned long long)hi << 32) | lo;
    return (unsigned)(v >> (sh & 31u));
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }  // 1 + the lowest set bit's index, 0 for none
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
// a's two int16 halves times b's two low bytes (signed), plus c
inline int __dp2a_lo(int a, int b, int c) {
    for (int i = 0; i < 2; ++i) c += (int)(short)(a >> (16 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
// dp4a.u32.s32 (common.cuh's od::dp4a_us): a's bytes unsigned, b's signed
inline int emu_dp4a_us(unsigned a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)((a >> (8 * i)) & 0xffu) * (int)(signed char)(b >> (8 * i));
    return c;
}
// prmt.b32's default mode (common.cuh's od::prmt): byte i of the result is byte (s >> 4i) & 7 of {y, x} (x bytes
// 0..3), or, where bit 4i + 3 of s is set, that byte's sign bit in all 8 bits (sign replication)
inline unsigned emu_prmt(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned sel = (s >> (4 * i)) & 15u, byte = (unsigned)((v >> (8 * (sel & 7))) & 0xffu);
        r |= (sel & 8u ? (byte & 0x80u ? 0xffu : 0u) : byte) << (8 * i);
    }
    return r;
}
inline float emu_h2f(unsigned short h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
inline unsigned short emu_f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2); return h; }

// bf16 (cuda_matmul's mmq_frags.cuh): cvt.rn.bf16x2.f32, fma.rn.bf16x2, mul.rn.bf16x2, each half rounded once to
// nearest even from the exact result, subnormals kept (none of them has .ftz), a NaN result the canonical 0x7fff
// (CUDA's own host conversion's NaN). The exact result is a double rounded to odd (a bf16 product is exact in
// double, a sum is made exact by TwoSum), then a float rounded to odd, then the float rounded to bf16: rounding
// to odd with at least 2 more bits than the target does not change the final round to nearest even.
inline float emu_bf2f(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
// f (not NaN) to bf16, to nearest even: carries into the exponent (and to infinity) by themselves
inline unsigned short emu_f2bf(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// x + e exactly (|e| at most half an ulp of x, e = 0 when x is exact) to bf16, to nearest even
inline unsigned short emu_bf16_rn(double x, double e) {
    if (x != x) return 0x7fffu;
    if (e != 0.0) {  // round x to odd: the neighbour towards e where x's last bit is even
        unsigned long long b;
        memcpy(&b, &x, 8);
        if (!(b & 1ull)) x = std::nextafter(x, e > 0 ? INFINITY : -INFINITY);
    }
    float f = (float)x;  // to nearest; then to odd
    if (std::isfinite(f) && (double)f != x && !(__float_as_uint(f) & 1u)) {
        f = std::nextafterf(f, x > (double)f ? INFINITY : -INFINITY);
    }
    return emu_f2bf(f);
}
// cvt.rn.bf16x2.f32 d, hi, lo: hi into the upper half
inline unsigned emu_cvt_bf16x2(float hi, float lo) { return (unsigned)emu_f2bf(hi) << 16 | emu_f2bf(lo); }
inline unsigned short emu_fma_bf16(unsigned short a, unsigned short b, unsigned short c) {
    const double p = (double)emu_bf2f(a) * (double)emu_bf2f(b), z = (double)emu_bf2f(c);  // p exact
    const double s = p + z;
    if (!std::isfinite(s)) return emu_bf16_rn(s, 0.0);  // inf, or NaN (inf - inf, inf * 0, a NaN input)
    const double bp = s - z, e = (p - bp) + (z - (s - bp));  // TwoSum: p + z = s + e exactly
    return emu_bf16_rn(s, e);
}
// fma.rn.bf16x2 d, a, b, c: a * b + c each half, one rounding
inline unsigned emu_fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    return (unsigned)emu_fma_bf16(a >> 16, b >> 16, c >> 16) << 16 |
           emu_fma_bf16(a & 0xffffu, b & 0xffffu, c & 0xffffu);
}
// mul.rn.bf16x2 d, a, b: a * b each half (exact in double), one rounding
inline unsigned emu_mul_bf16x2(unsigned a, unsigned b) {
    const auto mul = [](unsigned short x, unsigned short y) {
        return emu_bf16_rn((double)emu_bf2f(x) * (double)emu_bf2f(y), 0.0);
    };
    return (unsigned)mul(a >> 16, b >> 16) << 16 | mul(a & 0xffffu, b & 0xffffu);
}

// cp.async's copies not yet landed and groups committed: the running fiber's (emu_run_block swaps them)
struct EmuCopy { void* dst; const void* src; int group; int bytes; };  // bytes copied, the rest of 16 zeroed
inline std::vector<EmuCopy> emu_pending;
inline int emu_groups;

// -- a block's CUDA threads as fibers of one OS thread -------------------------------------------------------
// Each runs until it waits at a barrier or ends, then the next runnable one in index order (cyclically) takes
// over; the last to arrive at a barrier releases the others and yields too, so each phase between barriers
// runs its threads in index order. A barrier that can never fill (threads ended, or waiting elsewhere) is a
// deadlock: reported, exit status 3.
struct EmuWgmma;  // a wgmma product issued and not yet retired (the wgmma emulation below)
struct EmuFiber {
    ucontext_t ctx;
    dim3 tid;
    std::vector<EmuCopy> pending;
    int groups = 0;
    bool blocked = false, done = false;
    bool spinning = false;            // its last mbarrier try_wait failed
    std::vector<EmuWgmma*> products;  // in issue order
    int product_groups = 0;           // wgmma.commit_group's so far
};
// bytes of stack a fiber (reserved, not committed until touched), a guard page below each
inline constexpr size_t EMU_STACK = 1 << 20, EMU_GUARD = 1 << 12;
inline std::vector<EmuFiber> emu_fibers;
inline std::vector<char*> emu_stacks;
inline ucontext_t emu_home;
inline size_t emu_cur;
inline const std::function<void(unsigned)>* emu_body;

// the running fiber's state out, fiber `next`'s in, and on to it
inline void emu_switch(size_t next) {
    if (next == emu_cur) return;
    EmuFiber& a = emu_fibers[emu_cur];
    EmuFiber& b = emu_fibers[next];
    a.tid = threadIdx;
    a.pending.swap(emu_pending);
    a.groups = emu_groups;
    threadIdx = b.tid;
    emu_pending.swap(b.pending);
    emu_groups = b.groups;
    emu_cur = next;
    swapcontext(&a.ctx, &b.ctx);
}

// On to the next runnable fiber after the running one (the running one itself if it is the only one); false
// if none is runnable, not even the running one. emu_last_first (EMU_LAST_FIRST=1): the runnable fiber of the
// highest thread index instead, so that a block's last warps (a warp-specialized kernel's producer) run as far
// ahead as their barriers let them: a stage handed back too early is then refilled under the readers.
inline bool emu_last_first;
inline bool emu_yield() {
    const size_t n = emu_fibers.size();
    if (emu_last_first) {  // the highest thread that is not spinning on an mbarrier, else as below
        for (size_t j = n; j-- > 0;) {
            const EmuFiber& f = emu_fibers[j];
            if (j != emu_cur && !f.blocked && !f.done && !f.spinning) {
                emu_switch(j);
                return true;
            }
        }
    }
    for (size_t i = 1; i <= n; ++i) {
        const size_t j = (emu_cur + i) % n;
        if (!emu_fibers[j].blocked && !emu_fibers[j].done) {
            emu_switch(j);
            return true;
        }
    }
    return false;
}

inline void emu_deadlock() {
    size_t waiting = 0;
    for (const EmuFiber& f : emu_fibers) waiting += f.blocked;
    fprintf(stderr, "deadlock: %zu of %zu threads wait at a barrier that cannot fill\n", waiting, emu_fibers.size());
    fflush(stderr);
    _exit(3);
}

struct EmuBarrier {
    explicit EmuBarrier(unsigned count) : n(count) {}
    void arrive_and_wait() {
        if (++arrived < n) {
            waiting.push_back(emu_cur);
            emu_fibers[emu_cur].blocked = true;
            if (!emu_yield()) emu_deadlock();
            return;
        }
        arrived = 0;
        for (size_t f : waiting) emu_fibers[f].blocked = false;
        waiting.clear();
        emu_yield();
    }
    unsigned n, arrived = 0;
    std::vector<size_t> waiting;
};

inline void emu_fiber_main() {
    (*emu_body)(emu_fibers[emu_cur].tid.x);
    emu_fibers[emu_cur].done = true;
    if (emu_yield()) return;  // never resumed: done
    for (const EmuFiber& f : emu_fibers) {
        if (!f.done) emu_deadlock();
    }
}  // the last one: back to emu_run_block (uc_link)

// body(t) for t = 0 .. n-1, each a fiber with threadIdx.x = t (and its own cp.async state), until all have ended.
inline void emu_run_block(unsigned n, const std::function<void(unsigned)>& body) {
    while (emu_stacks.size() < n) {
        void* p = mmap(nullptr, EMU_STACK + EMU_GUARD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED || mprotect(p, EMU_GUARD, PROT_NONE)) { perror("fiber stack"); _exit(2); }
        emu_stacks.push_back(static_cast<char*>(p));
    }
    emu_fibers.clear();
    emu_fibers.resize(n);
    for (unsigned t = 0; t < n; ++t) {
        EmuFiber& f = emu_fibers[t];
        f.tid = dim3{t, 0, 0};
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = emu_stacks[t] + EMU_GUARD;
        f.ctx.uc_stack.ss_size = EMU_STACK;
        f.ctx.uc_link = &emu_home;
        makecontext(&f.ctx, emu_fiber_main, 0);
    }
    emu_body = &body;
    emu_cur = 0;
    threadIdx = emu_fibers[0].tid;
    emu_pending.clear();
    emu_groups = 0;
    swapcontext(&emu_home, &emu_fibers[0].ctx);
}

struct EmuBlock {
    EmuBarrier* block_bar;
    std::vector<EmuBarrier*> warp_bar;
    std::vector<unsigned> xchg;
    unsigned char* smem;
    std::vector<unsigned> frag;  // the mma emulations' exchange (emu_mma_post): 6 words a thread
    int vote = 0;                // __syncthreads_or's
    std::map<unsigned, EmuBarrier*> named;  // bar.sync 1, n's barriers by n (emu_named_barrier)
    std::vector<EmuBarrier*> wg_bar;        // a warpgroup's (128 threads) barrier, for the wgmma exchange
    std::vector<unsigned> wg_frag;          // its A fragments: 4 words a thread
    unsigned smem_bytes = 0;                // the dynamic shared memory (kernel_main.cpp; 0 elsewhere)
};
inline EmuBlock* emu_ctx;

inline void __syncthreads() { emu_ctx->block_bar->arrive_and_wait(); }
// bar.sync 1, threads (common.cuh's sync_block<THREADS>): the block's barrier where it names every thread, else one
// of that many threads (a warp-specialized kernel's computing warps, the others having left).
inline void emu_named_barrier(unsigned threads) {
    if (threads == blockDim.x * blockDim.y * blockDim.z) {
        __syncthreads();
        return;
    }
    EmuBarrier*& b = emu_ctx->named[threads];
    if (b == nullptr) b = new EmuBarrier(threads);
    b->arrive_and_wait();
}
// every thread's predicate ORed: the last vote read by all, cleared, gathered, then read
inline int __syncthreads_or(int p) {
    __syncthreads();
    if (threadIdx.x == 0) {
        emu_ctx->vote = 0;
    }
    __syncthreads();
    if (p) {
        emu_ctx->vote = 1;
    }
    __syncthreads();
    return emu_ctx->vote;
}
// common.cuh's od::last_block (not called by mmvq_stream, but compiled with the header)
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
// common.cuh's od::index_ok: the error word, set once
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected, unsigned long long v) {
    std::atomic_ref<unsigned long long>(*p).compare_exchange_strong(expected, v);
    return expected;  // the old value, whether swapped or not
}
template <class T>
inline T __ldcg(const T* p) { return *p; }  // od::last_block's readers, mmq's split-K sums (no cache here)
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_ctx->warp_bar[threadIdx.x / 32]->arrive_and_wait(); }

template <class T>
inline T __ldg(const T* p) { return *p; }

// lane l gets lane from(l)'s v, through the warp's exchange slots: the shuffles below
template <class T, class From>
inline T emu_shfl(T v, From from) {
    static_assert(sizeof(T) == 4, "4-byte shuffles");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned* x = emu_ctx->xchg.data() + warp * 32;
    memcpy(&x[lane], &v, 4);
    __syncwarp();
    T r;
    memcpy(&r, &x[from(lane)], 4);
    __syncwarp();
    return r;
}
// lane l gets lane l - off's v (its own where l < off): mmv_id.cu's moe_route scans with it
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned off, int = 32) {
    return emu_shfl(v, [&](int l) { return l >= (int)off ? l - (int)off : l; });
}
// lane l gets lane src's v (src taken modulo the width, within each width-lane group: rope's angle exchange)
template <class T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    return emu_shfl(v, [&](int l) { return l / width * width + (src % width + width) % width; });
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off, int = 32) {
    return emu_shfl(v, [&](int l) { return l ^ off; });
}

// vote.ballot: bit l set where lane l's predicate holds (the prefill attention's key tile walk and softmax),
// through the shuffles' exchange; vote.any from it
inline unsigned __ballot_sync(unsigned, int p) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned* x = emu_ctx->xchg.data() + warp * 32;
    x[lane] = p != 0;
    __syncwarp();
    unsigned bits = 0;
    for (int l = 0; l < 32; ++l) bits |= x[l] << l;
    __syncwarp();
    return bits;
}
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }

// cp.async (emu_pending, emu_groups: the running fiber's)
inline bool emu_eager;
inline unsigned char* emu_gmem_lo;
inline unsigned char* emu_gmem_hi;
inline unsigned emu_smem_addr(const void* p) { return (unsigned)((const unsigned char*)p - emu_ctx->smem); }
inline void emu_copy(const EmuCopy& c) {
    memcpy(c.dst, c.src, c.bytes);
    memset((unsigned char*)c.dst + c.bytes, 0, 16 - c.bytes);
}
// cp.async of 16 bytes, the first `bytes` of them read (src-size: the rest zero-filled, not read)
inline void emu_cp16z(unsigned saddr, const void* src, int bytes) {
    void* dst = emu_ctx->smem + saddr;
    const unsigned char* s = (const unsigned char*)src;
    if (bytes < 0 || bytes > 16 || s < emu_gmem_lo || s + bytes > emu_gmem_hi || ((uintptr_t)s & 15) ||
        ((uintptr_t)dst & 15) || (emu_ctx->smem_bytes && saddr + 16 > emu_ctx->smem_bytes)) {
        fprintf(stderr, "cp.async out of range or misaligned: src %p dst %p\n", src, dst);
        std::abort();
    }
    const EmuCopy c{dst, src, emu_groups, bytes};
    if (emu_eager) emu_copy(c);
    else emu_pending.push_back(c);
}
inline void emu_cp16(unsigned saddr, const void* src) { emu_cp16z(saddr, src, 16); }
inline void emu_commit() { ++emu_groups; }
inline void emu_wait(int n) {
    std::vector<EmuCopy> keep;
    for (auto& c : emu_pending) {
        if (c.group < emu_groups - n) emu_copy(c);
        else keep.push_back(c);
    }
    emu_pending.swap(keep);
}

// cp.async.bulk and its mbarrier (common.cuh's bulk copies): a barrier's copies land when its phase completes, which
// a waiting thread does once the barrier is armed (expect_tx) and the copies issued add up to the bytes armed. A wait
// that finds them short lets the other threads run (another lane may still be issuing); should waits keep failing
// (EMU_BAR_SPINS in a row, every thread's), a stage's copies never add up to what its barrier expects, or were never
// issued: reported, abort. The barriers by (the block's shared memory, address).
struct EmuBulk { void* dst; const void* src; unsigned bytes; };
struct EmuBar {
    int phase = 0;
    unsigned count = 1, pending = 1;  // arrivals a phase, and those still to come in this one
    long long expected = 0, issued = 0;
    std::vector<EmuBulk> copies;
};
inline std::map<std::pair<const unsigned char*, unsigned>, EmuBar> emu_bars;
inline constexpr long long EMU_BAR_SPINS = 1 << 20;
inline long long emu_bar_spins;  // waits failed in a row
inline EmuBar& emu_bar(unsigned bar) {
    auto it = emu_bars.find({emu_ctx->smem, bar});
    if (it == emu_bars.end()) {
        fprintf(stderr, "mbarrier at %u used before mbarrier.init\n", bar);
        std::abort();
    }
    return it->second;
}
inline void emu_mbar_init(unsigned bar, unsigned count) {
    if (count == 0 || (bar & 7)) {
        fprintf(stderr, "mbarrier.init at %u with count %u (8-byte aligned, a count above 0)\n", bar, count);
        std::abort();
    }
    emu_bars[{emu_ctx->smem, bar}] = EmuBar{0, count, count};
}
// the phase's arrivals all in and its copies' bytes issued: it completes (the copies land) when next looked at
inline bool emu_bar_ready(const EmuBar& b) { return b.pending == 0 && b.issued == b.expected; }
inline void emu_bar_complete(EmuBar& b) {
    for (const EmuBulk& c : b.copies) memcpy(c.dst, c.src, c.bytes);
    b = EmuBar{b.phase + 1, b.count, b.count};
}
// one arrival; one beyond the phase's count belongs to the next phase, once this one can complete
inline void emu_bar_arrival(unsigned bar, EmuBar& b) {
    if (b.pending == 0) {
        if (!emu_bar_ready(b)) {
            fprintf(stderr, "mbarrier at %u: an arrival beyond its count %u in phase %d\n", bar, b.count, b.phase);
            std::abort();
        }
        emu_bar_complete(b);
    }
    --b.pending;
}
inline void emu_mbar_expect_tx(unsigned bar, unsigned bytes) {
    EmuBar& b = emu_bar(bar);
    emu_bar_arrival(bar, b);
    b.expected += bytes;
}
inline void emu_mbar_arrive(unsigned bar) { emu_bar_arrival(bar, emu_bar(bar)); }
// cp.async.mbarrier.arrive.noinc: the thread's copies issued so far land (committed or not), then its arrival
inline void emu_cp_mbar_arrive(unsigned bar) {
    for (auto& c : emu_pending) emu_copy(c);
    emu_pending.clear();
    emu_mbar_arrive(bar);
}
inline void emu_bulk(unsigned saddr, const void* src, unsigned bytes, unsigned bar) {
    const unsigned char* s = (const unsigned char*)src;
    if (bytes == 0 || bytes % 16 || s < emu_gmem_lo || s + bytes > emu_gmem_hi || ((uintptr_t)s & 15) || (saddr & 15)) {
        fprintf(stderr, "cp.async.bulk out of range or misaligned: src %p, shared %u, %u bytes\n", src, saddr, bytes);
        std::abort();
    }
    EmuBar& b = emu_bar(bar);
    b.copies.push_back({emu_ctx->smem + saddr, src, bytes});
    b.issued += bytes;
}
inline bool emu_mbar_try_wait(unsigned bar, unsigned parity) {
    EmuBar& b = emu_bar(bar);
    bool done = (unsigned)(b.phase & 1) != parity;  // the phase of that parity has completed already
    if (!done && emu_bar_ready(b)) {
        emu_bar_complete(b);
        done = true;
    }
    emu_fibers[emu_cur].spinning = !done;
    if (done) {
        emu_bar_spins = 0;
        return true;
    }
    if (++emu_bar_spins > EMU_BAR_SPINS) {
        fprintf(stderr, "mbarrier at %u: phase %d never completes (%u arrivals to come, %lld bytes expected, %lld "
                "issued)\n", bar, b.phase, b.pending, b.expected, b.issued);
        std::abort();
    }
    emu_yield();  // the lanes that arm and issue run
    return false;
}

// The mma emulations' exchange, warp-collective: every lane posts its 6 fragment words (a0..a3, b0, b1);
// returns the warp's 32 x 6 once all have posted. The caller gathers its matrices from them, then calls
// __syncwarp() before the next exchange overwrites them.
inline const unsigned* emu_mma_post(const unsigned (&mine)[6]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned* x = emu_ctx->frag.data() + warp * 32 * 6;
    memcpy(x + lane * 6, mine, sizeof mine);
    __syncwarp();
    return x;
}

// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 with a zero accumulator, warp-collective: every lane
// posts its fragments (PTX ISA layout, groupID g = lane / 4, t = lane % 4: a[0] A row g k 4t..4t+3,
// a[1] row g+8 k 4t.., a[2] row g k 16+4t.., a[3] row g+8 k 16+4t..; b0 B column g k 4t.., b1 column g
// k 16+4t..), the 16 x 32 A and 32 x 8 B are gathered from all 32, and each lane computes its own
// results d[0..1] (row g, columns 2t, 2t+1) and d[2..3] (row g+8).
inline void emu_mma_s8(int* d, const unsigned* a, unsigned b0, unsigned b1) {
    const unsigned* x = emu_mma_post({a[0], a[1], a[2], a[3], b0, b1});
    signed char A[16][32], B[32][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; ++i) {
            A[g][4 * t + i] = (signed char)(x[l * 6 + 0] >> (8 * i));
            A[g + 8][4 * t + i] = (signed char)(x[l * 6 + 1] >> (8 * i));
            A[g][16 + 4 * t + i] = (signed char)(x[l * 6 + 2] >> (8 * i));
            A[g + 8][16 + 4 * t + i] = (signed char)(x[l * 6 + 3] >> (8 * i));
            B[4 * t + i][g] = (signed char)(x[l * 6 + 4] >> (8 * i));
            B[16 + 4 * t + i][g] = (signed char)(x[l * 6 + 5] >> (8 * i));
        }
    }
    __syncwarp();
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i / 2), c = 2 * t + i % 2;
        int s = 0;
        for (int k = 0; k < 32; ++k) s += A[r][k] * B[k][c];
        d[i] = s;
    }
}

// mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 with a zero accumulator: the PTX ISA's fragments are
// the k 0..15 half of m16n8k32's (a0 A row g k 4t.., a1 row g+8 k 4t..; b B column g k 4t..), so it is
// emu_mma_s8 with the k 16..31 half zero.
inline void emu_mma_s8_k16(int* d, unsigned a0, unsigned a1, unsigned b) {
    const unsigned a[4] = {a0, a1, 0u, 0u};
    emu_mma_s8(d, a, b, 0u);
}

// -- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (mmf.cu), a warp collective -----------
// The PTX ISA's fragments, lane l = 4 g + t: A (16 x 16, row-major) words a0 = A[g][2t, 2t+1],
// a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9] (low half first); B (16 x 8,
// k x n) words b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; D = A B + C (16 x 8) d0, d1 = D[g][2t, 2t+1],
// d2, d3 = D[g+8][2t, 2t+1]. Products exact, each sum in double, rounded to float once.
inline float emu_mma16_half(unsigned w, int hi, bool bf16) {
    const unsigned short h = (unsigned short)(hi ? w >> 16 : w & 0xffffu);
    return bf16 ? __uint_as_float((unsigned)h << 16) : emu_h2f(h);
}

inline void emu_mma_m16n8k16(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                             bool bf16) {
    const unsigned* x = emu_mma_post({a0, a1, a2, a3, b0, b1});
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        const unsigned* f = x + l * 6;
        for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = emu_mma16_half(f[0], e, bf16);
            A[g + 8][2 * t + e] = emu_mma16_half(f[1], e, bf16);
            A[g][2 * t + 8 + e] = emu_mma16_half(f[2], e, bf16);
            A[g + 8][2 * t + 8 + e] = emu_mma16_half(f[3], e, bf16);
            B[2 * t + e][g] = emu_mma16_half(f[4], e, bf16);
            B[2 * t + 8 + e][g] = emu_mma16_half(f[5], e, bf16);
        }
    }
    __syncwarp();  // every lane has read the fragments before the next call overwrites them
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        double s = d[i];
        for (int k = 0; k < 16; ++k) s += (double)A[row][k] * (double)B[k][col];
        d[i] = (float)s;
    }
}
inline void emu_mma_m16n8k16_bf16(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                  unsigned b1) {
    emu_mma_m16n8k16(d, a0, a1, a2, a3, b0, b1, true);
}
inline void emu_mma_m16n8k16_f16(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                 unsigned b1) {
    emu_mma_m16n8k16(d, a0, a1, a2, a3, b0, b1, false);
}

// -- wgmma.mma_async (wgmma.cuh's ss / rs), a warpgroup collective, asynchronous -------------------------------
// A product is recorded at issue (rs: the warpgroup's A fragments exchanged then, as the registers are read) and
// computed when a wgmma.wait_group retires its group (emu_wg_wait), reading B (and ss's A) from shared memory
// then: a stage overwritten before the wait that covers its products gives a wrong sum. Operands in the 128-byte
// swizzle only (the descriptor's start address, leading byte offset lbo, stride byte offset sbo): K-major, element
// (row, k) at a = start + row / 8 * sbo + row % 8 * 128 + 2 k; MN-major (rs's B with TB 1: the prefill attention's
// V), element (n, k) at a = start + n / 64 * lbo + k / 8 * sbo + k % 8 * 128 + 2 (n % 64); either swizzled
// a ^ ((a >> 7) & 7) << 4. Each thread computes its own accumulators (warp w of the warpgroup: rows 16 w + g and
// + 8, columns 8 i + 2 t and + 1), sums in double.
struct EmuWgmma {
    float* d;
    int n, group;
    bool bf16, accumulate;
    std::vector<float> a;  // rs: the warpgroup's 64 x 16 A; empty: ss, A at da
    unsigned long long da, db;
    int tb;  // B MN-major
};
// the block's warpgroup barriers and fragment exchange, made by the first wgmma instruction
inline void emu_wg_init() {
    if (emu_ctx->wg_bar.empty()) {
        for (unsigned w = 0; w < (blockDim.x + 127) / 128; ++w) emu_ctx->wg_bar.push_back(new EmuBarrier(128));
        emu_ctx->wg_frag.assign(blockDim.x * 4, 0u);
    }
}
// the running thread's warpgroup's barrier (wgmma's instructions are warpgroup collectives)
inline void emu_wg_sync() {
    emu_wg_init();
    emu_ctx->wg_bar[threadIdx.x / 128]->arrive_and_wait();
}
inline float emu_b16_value(const unsigned char* p, bool bf16) {
    unsigned short h;
    memcpy(&h, p, 2);
    return bf16 ? __uint_as_float((unsigned)h << 16) : emu_h2f(h);
}
// element (row, k) of a K-major operand, or (n = row, k) of an MN-major one (mn)
inline float emu_wg_operand(unsigned long long desc, int row, int k, bool bf16, bool mn = false) {
    if ((desc >> 62) != 1) {
        fprintf(stderr, "wgmma descriptor %llx: only the 128-byte swizzle is emulated\n", desc);
        std::abort();
    }
    const unsigned start = (unsigned)(desc & 0x3FFFu) << 4, lbo = (unsigned)((desc >> 16) & 0x3FFFu) << 4,
                   sbo = (unsigned)((desc >> 32) & 0x3FFFu) << 4;
    unsigned a = mn ? start + (unsigned)(row / 64) * lbo + (unsigned)(k / 8) * sbo + (unsigned)(k % 8) * 128 +
                          2 * (unsigned)(row % 64)
                    : start + (unsigned)(row / 8) * sbo + (unsigned)(row % 8) * 128 + 2 * (unsigned)k;
    a ^= ((a >> 7) & 7u) << 4;
    if (a + 2 > emu_ctx->smem_bytes) {
        fprintf(stderr, "wgmma operand at %u past the %u bytes of shared memory\n", a, emu_ctx->smem_bytes);
        std::abort();
    }
    return emu_b16_value(emu_ctx->smem + a, bf16);
}
inline void emu_wgmma_run(const EmuWgmma& p);
// EMU_WGMMA_AT_ISSUE=1: a product computed when issued, its operands read then (a stage read before its copies have
// landed shows), instead of at the wait that retires it (a stage refilled before then shows)
inline bool emu_wgmma_at_issue;
inline void emu_wgmma(float* d, int n, bool bf16, const unsigned* frag, unsigned long long da, unsigned long long db,
                      int tb, int accumulate) {
    EmuFiber& me = emu_fibers[emu_cur];
    EmuWgmma* p = new EmuWgmma{d, n, me.product_groups, bf16, accumulate != 0, {}, da, db, tb};
    if (frag != nullptr) {  // the warpgroup's A fragments, read now
        emu_wg_init();
        const unsigned wg = threadIdx.x / 128, l = threadIdx.x % 128;
        unsigned* x = emu_ctx->wg_frag.data() + wg * 512;
        memcpy(x + 4 * l, frag, 16);
        emu_wg_sync();
        p->a.assign(64 * 16, 0.0f);
        for (int j = 0; j < 128; ++j) {
            const int row = 16 * (j / 32) + j % 32 / 4, t = j % 4;
            for (int e = 0; e < 2; ++e) {
                const int at[4][2] = {{row, 2 * t}, {row + 8, 2 * t}, {row, 2 * t + 8}, {row + 8, 2 * t + 8}};
                for (int w = 0; w < 4; ++w) {
                    const unsigned word = x[4 * j + w];
                    const unsigned short h = (unsigned short)(e ? word >> 16 : word & 0xffffu);
                    p->a[at[w][0] * 16 + at[w][1] + e] = bf16 ? __uint_as_float((unsigned)h << 16) : emu_h2f(h);
                }
            }
        }
        emu_wg_sync();  // every thread has read the fragments before the next exchange
    }
    if (emu_wgmma_at_issue) {
        emu_wgmma_run(*p);
        delete p;
        return;
    }
    me.products.push_back(p);
}
inline void emu_wgmma_run(const EmuWgmma& p) {
    const int l = threadIdx.x % 128, w = l / 32, g = l % 32 / 4, t = l % 4;
    for (int i = 0; i < p.n / 8; ++i) {
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * w + g + 8 * (e / 2), col = 8 * i + 2 * t + e % 2;
            double s = p.accumulate ? p.d[4 * i + e] : 0.0;
            for (int k = 0; k < 16; ++k) {
                const float a = p.a.empty() ? emu_wg_operand(p.da, row, k, p.bf16) : p.a[row * 16 + k];
                s += (double)a * (double)emu_wg_operand(p.db, col, k, p.bf16, p.tb != 0);
            }
            p.d[4 * i + e] = (float)s;
        }
    }
}
inline void emu_wg_commit() { ++emu_fibers[emu_cur].product_groups; }
// wgmma.wait_group n: the products of every committed group but the newest n computed, in issue order, by the
// whole warpgroup between two of its barriers (no thread reuses their operands before every thread has read them)
inline void emu_wg_wait(int n) {
    emu_wg_sync();
    EmuFiber& me = emu_fibers[emu_cur];
    std::vector<EmuWgmma*> keep;
    for (EmuWgmma* p : me.products) {
        if (p->group < me.product_groups - n) {
            emu_wgmma_run(*p);
            delete p;
        } else {
            keep.push_back(p);
        }
    }
    me.products.swap(keep);
    emu_wg_sync();
}

// -- ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (common.cuh), a warp collective -----------------------
// Lane 8m + i gives the shared address of row i of matrix m; lane l = 4g + t receives in word m the pair
// (row g, columns 2t, 2t+1) of matrix m, or with trans its transpose's: (rows 2t, 2t+1 of column g).
inline void emu_ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, bool trans) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned* x = emu_ctx->xchg.data() + warp * 32;
    x[lane] = addr;
    __syncwarp();
    const int g = lane / 4, t = lane % 4;
    unsigned r[4];
    for (int m = 0; m < 4; ++m) {
        unsigned short h[2];
        for (int k = 0; k < 2; ++k) {
            const unsigned a = trans ? x[8 * m + 2 * t + k] + 2 * g : x[8 * m + g] + 4 * t + 2 * k;
            memcpy(&h[k], emu_ctx->smem + a, 2);
        }
        r[m] = h[0] | (unsigned)h[1] << 16;
    }
    __syncwarp();  // every lane has read the addresses before the next call overwrites them
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}

// -- the emulation mains' file I/O (their inputs and outputs are files the Python test writes and reads) --

static std::vector<unsigned char> read_file(const char* path) {
    FILE* f = fopen(path, "rb");
    std::vector<unsigned char> b;
    for (int c; (c = fgetc(f)) != EOF;) b.push_back((unsigned char)c);
    fclose(f);
    return b;
}

static void write_file(const char* path, const void* p, size_t n) {
    FILE* f = fopen(path, "wb");
    fwrite(p, 1, n, f);
    fclose(f);
}
