// opdispatch-arch: sm_90a
// Quantized GEMM on Hopper's warpgroup tensor cores (mmq_wgmma): out (B3, B2, N, M) f32 = b (N, K) @ a (M, K)^T
// for block-format weights a and many columns. mmq's int8 mma.sync products must be converted and scaled after
// every 32 values (a block's scale), which keeps it near twice cuBLAS bf16's time at 512 columns
// (docs/cuda_matmul.md); here each K tile of the weights is dequantized once into bf16 in shared memory (the
// scales and offsets folded into the values), b comes as bf16 rows (convert.cu, the launch before), and the
// products run on wgmma.mma_async with f32 accumulators across the whole slice of K. No weight is ever written
// back dequantized. wgmma needs the sm_90a target: the first line of this file makes kernels.py (and the compile
// test) build it so; support.mmq_wgmma_ok takes compute capability 9.0 only. The K loops (mw::main_loop, and
// mw::produce / mw::consume for the RS formats below) also run mul_mat_id's many-token products (mmq_wgmma_id,
// the end of this file), its b columns gathered by pair.
//
// A block is WGS computing warpgroups of 128 threads (Tiling; launched with 2), plus for the RS formats one
// warpgroup more that only copies (see "warp-specialized" below): BM = 64 WGS weight rows (64 a warpgroup,
// one m64nBNk16 accumulator of BN / 2 floats a thread), BN = 128 or 256 columns (mmq_wgmma_id: 64 or 128), K tiles
// of BK = 64 values. The wider tile halves the dequantization a product (its A fragments serve 256 columns) and the
// weight reads from L2: on the H200 at 512 columns it took 0.71-0.81x the narrow tile's time (4096 x 14336 and
// 14336 x 4096, q4_0 and q4_K; specs/mmq_wgmma.py's tile_for says when it is used). Shared memory:
//   A    2 stages of BM x BK bf16 (BM * 128 bytes), written by the block's dequantization (st.shared, then
//        fence.proxy.async so that the tensor cores see it);
//   B    4 stages of BN x BK bf16 (BN * 128 bytes), cp.async three K tiles ahead (warp-specialized: as many
//        stages as fit, up to 8 (Stages::NB), each refilled as soon as it is free);
//   raw  2 stages of the weights' raw blocks: mmq's K tile of 256 values (Tile<Q, 8>: each row's covering
//        16-byte granules, cp.async), 4 of this kernel's K tiles, issued two raw tiles ahead (warp-specialized:
//        3 stages where 4 B stages fit beside them (Stages::NR), each issued with b's K tile two before the raw
//        tile's first).
// A and B are K-major in the 128-byte swizzle wgmma reads (row r's 16-byte chunk c at r * 128 + (c ^ (r % 8)) *
// 16, each tile 1024-byte aligned; the descriptor's stride between 8-row groups 1024 bytes, a k16 step 32 bytes
// further along the row).
// K tile t (main_loop, the A-stage formats): the four wgmma of t are issued (one commit group), then wgmma.wait_group 1
// (t - 1's are done), and while t's run the block dequantizes t + 1 into the A stage t - 1 held (a warpgroup's threads
// write exactly the rows its own products read, so no barrier is needed before), waits for its copies, and after one
// barrier issues the copies into the stages t - 1 freed. The tensor cores are never drained inside the loop: t + 1's
// products queue behind t's. The RS formats' loop is warp-specialized (produce, consume): the last warpgroup issues
// every copy and the computing warpgroups only build fragments and issue products, the stages handed over on mbarriers
// (Bars) instead of a block barrier a K tile, and setmaxnreg gives the copying warpgroup's registers to the computing
// ones. Dequantization: quant.cuh's load_unit for every format (8 values a unit, v = code * d + m in f32, rounded to
// bf16, into the A stages), but q4_0, q8_0, q4_K, q5_K and q6_K (RS), whose values go from the raw stage straight into
// the A fragments in registers (wgmma's A-from-registers form: no A stage written or read, which halves the shared
// memory traffic a K tile), two K tiles' fragments in turn: q4_0's nibbles to bf16 by their bits, bf16x2 arithmetic (d
// rounded to bf16 first); q8_0's codes to f32 by their bits, one fma each; the K-quants' codes to f32 by their bits
// (masked into the mantissa of a power of two, which is then subtracted), then the A stage's own f32 operation (fmaf(q,
// d * sc, -(dmin * min)), q6_K's (q - 32) * (d * sc)). q8_0's and the K-quants' fragments hold the A stage's bf16
// values bit for bit (q8_0: but for an infinite d). The fragment builders live in mmq_frags.cuh, which
// tests/test_mmq_frags_emulated.py runs on the CPU.
// Split K: the raw K tiles of a row are cut in `splits` contiguous slices, one block each (a grid of few output
// tiles still fills the GPU), and mq::finish (mmq's) writes the sums or the slices' ordered sum: deterministic.
//
// Requirements (support.mmq_wgmma_ok): K % 64 == 0 and mmq's row conditions (rows of whole 16-byte granules, a
// 16-byte aligned: the raw stages); b bf16 rows of K values, contiguous (B3, B2, N, K), 16-byte aligned, readable
// BN rows past its last (what they hold is never used). Rows past M read row M - 1 and columns past N read the rows
// after column N - 1 (the next batch's, or that padding); neither is written.

#include "mmq_frags.cuh"
#include "wgmma.cuh"

namespace mw {

namespace wg = od::wg;

// 4 stages of b: step kt's cp_async_wait<1> leaves the copies of step kt - 1 in flight, so b's K tile kt + 1 is
// issued three steps ahead
constexpr int A_STAGES = 2, B_STAGES = 4, RAW_STAGES = 2;
// The warp-specialized loop (the RS formats) holds as many B stages as fit, up to WS_B_MAX: its copies are not
// waited for by the computing threads, so every stage more is a K tile more of copy latency hidden (the narrow
// tile's K tile is half the wide one's products). SMEM_BUDGET: the 227 KB a block may opt in to on compute
// capability 9.0, less 2 KB (the static barriers, mmq_wgmma_id's pairs and b rows); specs/mmq_wgmma.py's
// b_stages mirrors the count.
constexpr int WS_B_MAX = 8;
constexpr unsigned SMEM_BUDGET = 227 * 1024 - 2048;
// ... and a third raw stage where B_STAGES B stages still fit beside it: the producer then waits for the raw stage
// of raw K tile r - 3 instead of r - 2, so that it may run up to 8 K tiles ahead, not 4
constexpr int WS_RAW_STAGES = 3;

// A block's tile: WGS warpgroups of 128 threads computing (CONSUMERS), BM = 64 WGS weight rows (64 a warpgroup),
// BN columns (one m64nBNk16 accumulator of BN / 2 floats a thread); with PRODUCER one warpgroup more, after them,
// that only copies (the RS formats: specialized, produce and consume).
template <int WGS, int BN_, bool PRODUCER = false>
struct Tiling {
    static constexpr int BM = 64 * WGS, BN = BN_, CONSUMERS = 128 * WGS, THREADS = CONSUMERS + (PRODUCER ? 128 : 0);
    static constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    static_assert(BN == 64 || BN == 128 || BN == 256, "one m64n64, m64n128 or m64n256 accumulator a warpgroup");
};
// mmq_wgmma's tiling for format WT: a producer warpgroup for the RS formats.
template <int WT, int WGS, int BN>
using TilingOf = Tiling<WGS, BN, RS_FORMAT<WT>>;

// Bytes before raw K tile rt's first block in its first granule (mmq's lead: 0 where K tiles are whole granules).
template <int WT>
__device__ __forceinline__ int raw_lead(int rt) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    return T::ALIGNED ? 0 : rt * RAW_KB / T::STEPS * F::BYTES % 16;
}

using od::wg::swz;

__device__ __forceinline__ void st_shared8(unsigned saddr, unsigned a, unsigned b) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(saddr), "r"(a), "r"(b) : "memory");
}

// 64-value K tile kt of the block's BM weight rows dequantized into the A stage at shared address sa, from the
// raw K tile (256 values: mmq's Tile<Q, 8>) holding it at `raw` (row r at raw + r * RS, its first block `lead`
// bytes in): thread t decodes row t / 2, units (8 values each, quant.cuh's load_unit) 4 (t % 2) .. 4 (t % 2) + 3
// of the tile; a unit's values v = code * d + m are rounded to bf16 and stored where unit_k puts them (8 in a row,
// or two runs of 4 for the 4- and 5-bit legacy formats).
template <int WT>
__device__ __forceinline__ void dequant_tile(unsigned sa, const u8* raw, int kt, int tid) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    const int r = tid >> 1;
    const int sub = kt % SUBS;  // this K tile's place in its raw K tile
    const u8* const row = raw + r * T::RS;
    const int u0 = sub * (BK / 8) + (tid & 1) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int u = u0 + i;
        float c[8], d, m;
        od::quant::load_unit<F>(row, u, c, d, m);
        unsigned p[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            p[j] = bf16x2(fmaf(c[2 * j], d, m), fmaf(c[2 * j + 1], d, m));
        }
        const int2 k = mm::unit_k<WT>(u);
        const int kx = k.x - sub * BK, ky = k.y - sub * BK;
        st_shared8(sa + swz(r, kx >> 3) + (kx & 7) * 2, p[0], p[1]);
        st_shared8(sa + swz(r, ky >> 3) + (ky & 7) * 2, p[2], p[3]);
    }
}

// Raw K tile rt (256 values, fewer at the end of a row) of weight rows m0 .. m0 + BM - 1 (clamped to M - 1) into
// the raw stage `st` by NT threads (tid < NT): the 16-byte granules covering each row's blocks (mmq's issue_a);
// returns nothing, the blocks start lead(rt) bytes into each row.
template <int WT, int BM, int NT>
__device__ __forceinline__ void issue_raw(u8* st, const u8* wa, long long a_row, int m0, int M, int nb, int rt,
                                          int tid) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    const int j0 = rt * RAW_KB, kb = min(RAW_KB, nb - j0);
    const int lead = raw_lead<WT>(rt);
    const int at = j0 / T::STEPS * F::BYTES - lead;
    const int wg = (lead + kb / T::STEPS * F::BYTES + (T::ALIGNED ? 0 : 15)) / 16;
    for (od::Walk w(tid, NT, wg); w.row < BM; w.next()) {
        const u8* src = wa + static_cast<long long>(min(m0 + w.row, M - 1)) * a_row + at + 16 * w.col;
        od::cp_async16(od::smem_addr(st + w.row * T::RS + 16 * w.col), src);
    }
}

// A thread's share of a B stage copied by NT threads: chunk ch = tid % 8 (16 bytes, K values 8 ch .. 8 ch + 7 of the
// K tile) of tile rows r0 + ROWS i, i < PER (r0 = tid / 8, ROWS = NT / 8: BN * BK / 8 chunks a stage, NT at a time),
// each at the same offset of its 128-byte row in the swizzled stage: r0's + 128 ROWS i (ROWS a multiple of 8 keeps
// r % 8).
template <int BN, int NT>
struct BShare {
    static constexpr int ROWS = NT / 8, PER = BN / ROWS;
    static_assert(BN % ROWS == 0, "whole rows of chunks a thread");
    __device__ __forceinline__ static unsigned dst(int tid) { return swz(tid >> 3, tid & 7); }
};

// The thread's B sources at K tile 0 (row(i): row i of its share, its chunk), for load_b: Dense, b's rows of a
// column tile in order (padded past the last column: no clamp), a fixed stride apart; Gathered, rows by a table
// (mmq_wgmma_id's pairs), each address kept. Both computed once, before the K loop.
struct DenseB {
    const u8* p;
    long long step;
    __device__ __forceinline__ const u8* row(int i) const { return p + i * step; }
};
template <int PER>
struct GatheredB {
    const u8* p[PER];
    __device__ __forceinline__ const u8* row(int i) const { return p[i]; }
};

// Copying thread t's B sources (of NT copying threads) for b's rows from row0 on (a column tile, K values each).
template <int BN, int NT>
__device__ __forceinline__ DenseB dense_share(const u8* b, long long row0, int K, int t) {
    return DenseB{b + ((row0 + (t >> 3)) * K + (t & 7) * 8) * 2, 2ll * BShare<BN, NT>::ROWS * K};
}
// The same for the rows brow[0 .. BN - 1] of b (a tile's gathered pairs, in shared memory).
template <int BN, int NT>
__device__ __forceinline__ GatheredB<BShare<BN, NT>::PER> gathered_share(const u8* b, const int* brow, int K, int t) {
    using S = BShare<BN, NT>;
    GatheredB<S::PER> src;
#pragma unroll
    for (int i = 0; i < S::PER; ++i) {
        const long long row = brow[(t >> 3) + S::ROWS * i];
        src.p[i] = b + (row * K + (t & 7) * 8) * 2;
    }
    return src;
}

// K tile kt of the block's BN b columns into the B stage at shared address sb: the thread's BShare (of NT copying
// threads), from src.
template <int BN, int NT, class Src>
__device__ __forceinline__ void load_b(unsigned sb, const Src& src, int kt, int tid) {
    using S = BShare<BN, NT>;
    const unsigned d = sb + S::dst(tid);
#pragma unroll
    for (int i = 0; i < S::PER; ++i) {
        od::cp_async16(d + i * S::ROWS * 128, src.row(i) + kt * BK * 2);
    }
}

// The stages of a block's shared memory (wgmma_smem of specs/mmq_wgmma.py: A_STAGES A stages, none for the RS
// formats; NB B stages, each 1024-byte aligned; NR raw stages of BM rows of Tile<Q, RAW_KB>::RS
// bytes) and the K tiles of a block's slice (raw K tiles rt0 .. rt0 + nraw - 1: K tiles kt0 .. kt0 + nk - 1).
template <int WT, class TL>
struct Stages {
    using T = mq::Tile<mm::Fmt<WT>, RAW_KB>;
    static constexpr int A_HELD = RS_FORMAT<WT> ? 0 : A_STAGES, RAW_BYTES = TL::BM * T::RS;
    // B stages fitting beside nr raw stages
    static constexpr int fit(int nr) { return static_cast<int>((SMEM_BUDGET - 1024 - nr * RAW_BYTES) / TL::B_BYTES); }
    // raw stages: RAW_STAGES for main_loop, WS_RAW_STAGES for the RS formats where B_STAGES B stages fit beside them
    static constexpr int NR = RS_FORMAT<WT> && fit(WS_RAW_STAGES) >= B_STAGES ? WS_RAW_STAGES : RAW_STAGES;
    // B stages: B_STAGES for main_loop (its wait_group counts assume them), as many as fit for the RS formats
    static constexpr int NB = !RS_FORMAT<WT> ? B_STAGES : fit(NR) < WS_B_MAX ? fit(NR) : WS_B_MAX;
    unsigned sA, sB;
    u8* raw;
    int rt0, kt0, nk;
    __device__ __forceinline__ Stages(u8* smem, int K, int rt0_, int nraw) : rt0(rt0_) {
        const unsigned pad = ((od::smem_addr(smem) + 1023u) & ~1023u) - od::smem_addr(smem);
        sA = od::smem_addr(smem) + pad;
        sB = sA + A_HELD * TL::A_BYTES;
        raw = smem + pad + A_HELD * TL::A_BYTES + NB * TL::B_BYTES;
        kt0 = rt0 * SUBS;
        nk = min(nraw * SUBS, K / BK - kt0);
    }
    __device__ __forceinline__ unsigned b(int kt) const { return sB + (kt % NB) * TL::B_BYTES; }
    __device__ __forceinline__ u8* raw_stage(int r) const { return raw + (r % NR) * RAW_BYTES; }
    // K tile kt's raw K tile, from its first block
    __device__ __forceinline__ const u8* raw_of(int kt) const {
        return raw_stage(kt / SUBS) + raw_lead<WT>(rt0 + kt / SUBS);
    }
};

// A block's sums d (one m64nBNk16 accumulator a warpgroup) over raw K tiles rt0 .. rt0 + nraw - 1 of its BM weight
// rows (row r: row min(m0 + r, M - 1) of wa, a_row bytes apart) and its BN b columns (bsrc, load_b's), for the
// formats dequantized into A stages (not RS_FORMAT): the K loop of mmq_wgmma and mmq_wgmma_id, every thread of
// the block computing and copying. It returns with no copy in flight and every product done.
template <int WT, class TL, class Src>
__device__ __forceinline__ void main_loop(u8* const smem, const u8* const wa, long long a_row, int m0, int M,
                                          const Src& bsrc, int K, int rt0, int nraw, float (&d)[TL::BN / 2]) {
    static_assert(!RS_FORMAT<WT>, "the RS formats run the warp-specialized loop (specialized)");
    constexpr int BN = TL::BN, NT = TL::THREADS;
    const Stages<WT, TL> st(smem, K, rt0, nraw);
    const int tid = threadIdx.x, nb = K / 32, kt0 = st.kt0, nk = st.nk;
    const int wg = tid >> 7;  // this thread's warpgroup: weight rows 64 wg .. 64 wg + 63 of the tile

#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
        d[i] = 0.0f;
    }
    // ahead of the loop: raw K tiles 0 and 1, b's K tiles 0 .. B_STAGES - 2, K tile 0 dequantized
    issue_raw<WT, TL::BM, NT>(st.raw_stage(0), wa, a_row, m0, M, nb, rt0, tid);
    if (nraw > 1) {
        issue_raw<WT, TL::BM, NT>(st.raw_stage(1), wa, a_row, m0, M, nb, rt0 + 1, tid);
    }
#pragma unroll
    for (int s = 0; s < B_STAGES - 1; ++s) {
        if (s < nk) {
            load_b<BN, NT>(st.b(s), bsrc, kt0 + s, tid);
        }
    }
    od::cp_async_commit();
    od::cp_async_wait<0>();
    __syncthreads();
    dequant_tile<WT>(st.sA, st.raw_of(0), 0, tid);
    wg::fence_async_smem();
    __syncthreads();

#pragma unroll 1
    for (int kt = 0; kt < nk; ++kt) {
        const unsigned a_st = st.sA + (kt & 1) * TL::A_BYTES + wg * 64 * 128;
        const unsigned b_st = st.b(kt);
        wg::fence_regs(d);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            wg::ss<BN, true>(d, wg::desc_k(a_st + kk * 32), wg::desc_k(b_st + kk * 32), 1);
        }
        wg::commit();
        // K tile kt - 1's products are done (this warpgroup's), so its A stage, the one tile kt + 1 takes, is
        // free: a warpgroup's threads dequantize exactly the rows its own products read. Tile kt's products run on
        // meanwhile, and kt + 1's are issued behind them without draining the tensor cores.
        wg::wait<1>();
        wg::fence_regs(d);
        if (kt + 1 < nk) {
            dequant_tile<WT>(st.sA + ((kt + 1) & 1) * TL::A_BYTES, st.raw_of(kt + 1), kt + 1, tid);
        }
        od::cp_async_wait<1>();  // the copies of step kt - 2 and before (b's K tile kt + 1, any raw K tile needed
                                 // next) have landed for this thread: each step commits one group
        wg::fence_async_smem();
        __syncthreads();  // ... for every thread; every warpgroup is done with K tile kt - 1's stages
        // copies into the stages K tile kt - 1 held: b's K tile kt + B_STAGES - 1; a raw K tile whose last K tile
        // (kt + 1) was just dequantized frees its stage for the raw K tile two ahead
        if (kt + B_STAGES - 1 < nk) {
            load_b<BN, NT>(st.b(kt + B_STAGES - 1), bsrc, kt0 + kt + B_STAGES - 1, tid);
        }
        if ((kt + 1) % SUBS == SUBS - 1 && (kt + 1) / SUBS + 2 < nraw) {
            issue_raw<WT, TL::BM, NT>(st.raw_stage((kt + 1) / SUBS + 2), wa, a_row, m0, M, nb,
                                      rt0 + (kt + 1) / SUBS + 2, tid);
        }
        od::cp_async_commit();
    }
    wg::wait<0>();
    wg::fence_regs(d);
    od::cp_async_wait<0>();  // only empty groups can be left
}

// The warp-specialized K loop of the RS formats (specialized): the block's last warpgroup only copies (produce),
// the others only build fragments and issue products (consume), handing stages over on mbarriers in shared memory
// (Bars), so that the computing warps' chain a K tile holds neither the copies' address arithmetic nor a block
// barrier. ncu of the loop where every warp did both (q4_0 4096 x 14336 at 512 columns, H200, session 35): about
// 265 instructions a warp a K tile, 5.4 cycles apart (2 warps a scheduler), 1630 cycles a K tile against the 1024
// of its products; the tensor pipe 61% busy, the warps waiting on it 0.3% of their stalls.
//   full_b[s] / empty_b[s]   B stage s holds K tile kt (s = kt % NB, Stages' count) / is free again: each of the
//                            producer's 128 threads arrives on full_b as its copies land
//                            (cp.async.mbarrier.arrive.noinc, issued behind them), and each computing thread fences
//                            the stage for the async proxy (fence.proxy.async) before its products read it; the
//                            computing threads arrive on empty_b once tile kt's products are done (wgmma.wait_group).
//   full_raw[s] / empty_raw[s]  raw stage s holds raw K tile r (s = r % NR, Stages' count) / is free again: its copies
//                            go out before b's K tile r SUBS - 2 (K tile 0 for r = 0) and arrive on it as they land;
//                            the computing threads arrive on empty_raw once the fragments of its last K tile are
//                            built.
// A barrier's n-th use (n = kt / NB, or r / NR) completes phase n: waited on with parity n & 1.
constexpr int PRODUCER_THREADS = 128;
// setmaxnreg: the producer gives registers to the computing warpgroups (2 C + P <= 504 for 2 computing
// warpgroups: their 384 threads start at 168 each)
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;

struct Bars {
    unsigned base;  // full_b[WS_B_MAX], empty_b[WS_B_MAX], full_raw[WS_RAW_STAGES], empty_raw[WS_RAW_STAGES], 8 bytes
    __device__ __forceinline__ unsigned full_b(int s) const { return base + 8 * s; }
    __device__ __forceinline__ unsigned empty_b(int s) const { return base + 8 * (WS_B_MAX + s); }
    __device__ __forceinline__ unsigned full_raw(int s) const { return base + 8 * (2 * WS_B_MAX + s); }
    __device__ __forceinline__ unsigned empty_raw(int s) const { return base + 8 * (2 * WS_B_MAX + WS_RAW_STAGES + s); }
};

// The block's barriers, initialized by thread 0 and visible to every thread when it returns (a block barrier).
template <class TL>
__device__ __forceinline__ Bars init_bars() {
    __shared__ unsigned long long bars[2 * WS_B_MAX + 2 * WS_RAW_STAGES];  // 8-byte aligned, as mbarriers must be
    const Bars b{od::smem_addr(bars)};
    if (threadIdx.x == 0) {
        for (int s = 0; s < WS_B_MAX; ++s) {  // those past the format's stage count go unused
            od::mbar_init(b.full_b(s), PRODUCER_THREADS);
            od::mbar_init(b.empty_b(s), TL::CONSUMERS);
        }
        for (int s = 0; s < WS_RAW_STAGES; ++s) {
            od::mbar_init(b.full_raw(s), PRODUCER_THREADS);
            od::mbar_init(b.empty_raw(s), TL::CONSUMERS);
        }
    }
    __syncthreads();
    return b;
}

// The raw K tile whose copies go out with b's K tile kt, or -1: raw K tile 0 with K tile 0, r with r SUBS - 2 (its
// first fragments are built at step r SUBS - 1).
__device__ __forceinline__ int raw_with(int kt, int nraw) {
    const int r = kt == 0 ? 0 : (kt + 2) % SUBS == 0 ? (kt + 2) / SUBS : -1;
    return r < nraw ? r : -1;
}

// The producer warpgroup's loop (p: its thread, 0 .. 127): every stage's copies, b's from bsrc (load_b's, for 128
// threads), each stage refilled once the computing threads have freed it, and signalled by the copies themselves
// (cp_async_mbar_arrive): a stage fills as soon as its copies land, never behind the producer's next wait.
template <int WT, class TL, class Src>
__device__ __forceinline__ void produce(u8* const smem, const Bars& bars, const u8* const wa, long long a_row,
                                        int m0, int M, const Src& bsrc, int K, int rt0, int nraw, int p) {
    static_assert(SUBS > 2, "a raw K tile's copies go out two K tiles before its first");
    const Stages<WT, TL> st(smem, K, rt0, nraw);
    constexpr int NB = Stages<WT, TL>::NB, NR = Stages<WT, TL>::NR;
    const int nb = K / 32, nk = st.nk;
#pragma unroll 1
    for (int kt = 0; kt < nk; ++kt) {
        const int r = raw_with(kt, nraw);
        if (r >= 0) {
            if (r >= NR) {
                od::mbar_wait(bars.empty_raw(r % NR), (r / NR - 1) & 1);
            }
            issue_raw<WT, TL::BM, PRODUCER_THREADS>(st.raw_stage(r), wa, a_row, m0, M, nb, rt0 + r, p);
            od::cp_async_mbar_arrive(bars.full_raw(r % NR));
        }
        if (kt >= NB) {
            od::mbar_wait(bars.empty_b(kt % NB), (kt / NB - 1) & 1);
        }
        load_b<TL::BN, PRODUCER_THREADS>(st.b(kt), bsrc, st.kt0 + kt, p);
        od::cp_async_mbar_arrive(bars.full_b(kt % NB));
    }
    od::cp_async_commit();
    od::cp_async_wait<0>();  // none of its copies outlives the thread
}

// The computing warpgroups' loop (threadIdx.x < TL::CONSUMERS): each K tile's four products issued as its B stage
// fills, the next K tile's fragments built from its raw stage while they run (two fragment sets in turn: a set is
// rewritten only after wgmma.wait_group 1 has retired the products that read it). Returns every product done.
template <int WT, class TL>
__device__ __forceinline__ void consume(u8* const smem, const Bars& bars, int K, int rt0, int nraw,
                                        float (&d)[TL::BN / 2]) {
    constexpr int BN = TL::BN;
    const Stages<WT, TL> st(smem, K, rt0, nraw);
    constexpr int NB = Stages<WT, TL>::NB, NR = Stages<WT, TL>::NR;
    const int tid = threadIdx.x, nk = st.nk;
    const int wg = tid >> 7;
    const int frow = wg * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2), ft = tid & 3;  // this lane's row g, t
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
        d[i] = 0.0f;
    }
    unsigned f0[4][4], f1[4][4];
    od::mbar_wait(bars.full_raw(0), 0);
    frags<WT>(st.raw_of(0), 0, frow, ft, f0);
    auto step = [&](int kt, unsigned (&cur)[4][4], unsigned (&nxt)[4][4]) {
        // the stage's descriptor once: a k16 step 32 bytes on is 2 more in its address field (>> 4), which stays
        // below its 14 bits (shared memory < 256 KB)
        const unsigned long long db = wg::desc_k(st.b(kt));
        od::mbar_wait(bars.full_b(kt % NB), (kt / NB) & 1);
        wg::fence_async_smem();  // the stage's copies (the generic proxy) before the products' reads (the async one)
        wg::fence_regs(d);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            wg::rs<BN, true, 0>(d, cur[kk], db + 2 * kk);
        }
        wg::commit();
        wg::wait<1>();  // K tile kt - 1's products are done: its B stage and fragment set are free
        wg::fence_regs(d);
        if (kt >= 1) {
            od::mbar_arrive(bars.empty_b((kt - 1) % NB));
        }
        const int n = kt + 1;
        if (n < nk) {
            if (n % SUBS == 0) {
                od::mbar_wait(bars.full_raw((n / SUBS) % NR), (n / SUBS / NR) & 1);
            }
            wg::fence_regs(nxt);
            frags<WT>(st.raw_of(n), n, frow, ft, nxt);
            if (n % SUBS == SUBS - 1) {  // the raw K tile's last fragments: its stage is free
                od::mbar_arrive(bars.empty_raw((n / SUBS) % NR));
            }
        }
    };
#pragma unroll 1
    for (int kt = 0; kt < nk; kt += 2) {  // two K tiles a turn: the fragments' registers swap by name
        step(kt, f0, f1);
        if (kt + 1 < nk) {
            step(kt + 1, f1, f0);
        }
    }
    wg::wait<0>();
    wg::fence_regs(d);
}

// setmaxnreg for the warpgroup's role (sm_90a), each in its own branch of the role's if / else.
template <int R>
__device__ __forceinline__ void regs_down() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_up() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// An RS format's block (TL with its producer warpgroup): the copying warpgroup runs produce (its B sources
// src_of(p), p its thread), the computing ones consume and then epilogue(d) with their sums; each warpgroup's
// registers set for its role first. Every thread of the block calls it.
template <int WT, class TL, class SrcOf, class Epilogue>
__device__ __forceinline__ void specialized(u8* const smem, const u8* const wa, long long a_row, int m0, int M,
                                            const SrcOf& src_of, int K, int rt0, int nraw, const Epilogue& epilogue) {
    const Bars bars = init_bars<TL>();
    if (threadIdx.x >= TL::CONSUMERS) {
        regs_down<PRODUCER_REGS>();
        const int p = static_cast<int>(threadIdx.x) - TL::CONSUMERS;
        produce<WT, TL>(smem, bars, wa, a_row, m0, M, src_of(p), K, rt0, nraw, p);
    } else {
        regs_up<CONSUMER_REGS>();
        float d[TL::BN / 2];
        consume<WT, TL>(smem, bars, K, rt0, nraw, d);
        epilogue(d);
    }
}

// The accumulator layout of m64nNk16 is mma.sync m16n8's, 8 columns at a time: warp w of the warpgroup holds rows
// 16 w + lane / 4 and + 8, columns 8 i + 2 (lane % 4) and + 1 in d[4 i .. 4 i + 3], so mmq's writers (FM = 1,
// FN = BN / 8) take it as their sums, from the warp's first row, wg_row(): 64 wg + 16 w of the tile.
template <int BN>
using Frags = float[1][BN / 8][4];
template <int BN>
__device__ __forceinline__ const Frags<BN>& as_frags(const float (&d)[BN / 2]) {
    return *reinterpret_cast<const Frags<BN>*>(&d);
}
__device__ __forceinline__ int wg_row() {
    return static_cast<int>(threadIdx.x >> 7) * 64 + static_cast<int>((threadIdx.x >> 5) & 3) * 16;
}

}  // namespace mw

// mul_mat with block-format weights: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k]. a rows
// a_row bytes apart, batch strides a_s2, a_s3 (16-byte multiples, a 16-byte aligned, rows of whole granules); b
// bf16 (B3, B2, N, K) contiguous; out contiguous (B3, B2, N, M). The raw K tiles of a row are cut in `splits`
// contiguous slices, one block each (split K, as mmq: a grid of few output tiles still fills the GPU); with
// splits > 1, part holds splits * B3 * B2 * N * M floats and counters B3 * B2 * tiles_m * tiles_n ints (zero
// before the launch, and again after it), and mq::finish adds the slices in order. A bias (not null: a fused
// mul_mat_add) is added to every output written, output row r adding bias[r * bias_col + m] (mq::finish). Grid
// (tiles_m * splits * tiles_n, B2, B3), the column tile fastest (the blocks reading the same weights run
// together); 128 WGS threads; dynamic shared memory specs/mmq_wgmma.py's wgmma_smem: A_STAGES * A_BYTES (none for
// the RS formats) + NB * B_BYTES (Stages' count: B_STAGES, or for the RS formats as many as fit up to WS_B_MAX;
// 1024-byte aligned), then NR raw stages (RAW_STAGES, or WS_RAW_STAGES where they fit) of BM rows of
// Tile<Q, RAW_KB>::RS bytes.
template <int WT, int WGS, int BN>
__global__ void __launch_bounds__(mw::TilingOf<WT, WGS, BN>::THREADS, 1)
    mmq_wgmma(const mm::u8* a, long long a_row, long long a_s2, long long a_s3, int r2, int r3, const mm::u8* b,
              float* out, int M, int K, int N, int tiles_m, int tiles_n, int splits, float* part, int* counters,
              const float* bias, long long bias_col) {
    od::grid_enter();
    using namespace mw;
    using TL = TilingOf<WT, WGS, BN>;
    extern __shared__ uint4 smem_u4[];
    u8* const smem = reinterpret_cast<u8*>(smem_u4);

    const int tn = static_cast<int>(blockIdx.x % tiles_n);
    const int split = static_cast<int>((blockIdx.x / tiles_n) % splits);
    const int tm = static_cast<int>(blockIdx.x / (tiles_n * splits));
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int m0 = tm * TL::BM, n0 = tn * BN;
    const long long batch = static_cast<long long>(i3) * gridDim.y + i2;
    const long long brow0 = batch * N;
    const u8* const wa = a + (i3 / r3) * a_s3 + (i2 / r2) * a_s2;
    // this block's slice: raw K tiles rt0 .. rt0 + nraw - 1
    const int nraw_all = (K / 32 + RAW_KB - 1) / RAW_KB;
    const int rt0 = static_cast<int>(static_cast<long long>(split) * nraw_all / splits);
    const int nraw = static_cast<int>(static_cast<long long>(split + 1) * nraw_all / splits) - rt0;
    const long long plane = static_cast<long long>(gridDim.y) * gridDim.z * N * M;
    int* const counter = counters + (batch * tiles_m + tm) * tiles_n + tn;
    if constexpr (RS_FORMAT<WT>) {
        specialized<WT, TL>(
            smem, wa, a_row, m0, M, [&](int p) { return dense_share<BN, PRODUCER_THREADS>(b, brow0 + n0, K, p); }, K,
            rt0, nraw, [&](const float(&d)[BN / 2]) {
                mq::finish<1, BN / 8, TL::BM, BN, TL::CONSUMERS, TL::CONSUMERS>(
                    as_frags<BN>(d), m0 + wg_row(), n0, m0, n0, M, N, brow0, out, part, split, splits, plane, counter,
                    bias, bias_col);
            });
    } else {
        float d[BN / 2];
        main_loop<WT, TL>(smem, wa, a_row, m0, M, dense_share<BN, TL::THREADS>(b, brow0 + n0, K, threadIdx.x), K,
                          rt0, nraw, d);
        mq::finish<1, BN / 8, TL::BM, BN, TL::THREADS>(as_frags<BN>(d), m0 + wg_row(), n0, m0, n0, M, N, brow0, out,
                                                       part, split, splits, plane, counter, bias, bias_col);
    }
}

// mul_mat_id with many tokens on the same K loop (mmq_wgmma_id, MoE prefill): out[t, u, :] = as[ids[t, u]] @
// b[t, u % Ub] for block-format experts, as mmq_id.cu's mmq_id but for its b (bf16 rows, T * Ub of them: the
// conversion launch before) and its products (this file's). moe_route's tile table (tile_n = BN) gives a block its
// expert and column tile of pairs; grid (tiles_m * max_tiles), the column tile fastest; a block past the table's
// tile count exits; no split K. Dynamic shared memory: the tile's pairs and b rows (BN ints each), then wgmma_smem's
// (whose slack aligns the stages after them). Requirements (support.mmq_wgmma_id_ok): mmq_wgmma's, the experts'
// rows a_row and experts a_e bytes apart. Out contiguous (T, U, M), plus expert e's bias row (bias_e bytes apart)
// where bias is not null (a fused add_id).
template <int WT, int WGS, int BN>
__global__ void __launch_bounds__(mw::TilingOf<WT, WGS, BN>::THREADS, 1)
    mmq_wgmma_id(const mm::u8* as, long long a_row, long long a_e, int E, const int* route, int pairs, int max_tiles,
                 int U, int Ub, const mm::u8* b, float* out, int M, int K, const float* bias, long long bias_e) {
    od::grid_enter();  // the table (moe_route) and b's bf16 rows (the conversion) come from the kernels before
    using namespace mw;
    using TL = TilingOf<WT, WGS, BN>;
    extern __shared__ uint4 smem_u4[];
    u8* const smem = reinterpret_cast<u8*>(smem_u4);
    int* const pair = reinterpret_cast<int*>(smem);
    int* const brow = pair + BN;
    int e, n;
    if (!mq::pair_tile<BN, TL::THREADS>(route, E, pairs, static_cast<int>(blockIdx.x % max_tiles), U, Ub, pair, brow,
                                        e, n)) {
        return;
    }
    const int m0 = static_cast<int>(blockIdx.x / max_tiles) * TL::BM;
    const int nraw = (K / 32 + RAW_KB - 1) / RAW_KB;
    const u8* const wa = as + e * a_e;
    const float* const bias_row = bias != nullptr ? bias + e * bias_e / 4 : nullptr;
    if constexpr (RS_FORMAT<WT>) {
        specialized<WT, TL>(
            smem + 8 * BN, wa, a_row, m0, M, [&](int p) { return gathered_share<BN, PRODUCER_THREADS>(b, brow, K, p); },
            K, 0, nraw, [&](const float(&d)[BN / 2]) {
                mq::store_pairs<1, BN / 8>(as_frags<BN>(d), m0 + wg_row(), 0, M, n, pair, out, bias_row);
            });
    } else {
        float d[BN / 2];
        main_loop<WT, TL>(smem + 8 * BN, wa, a_row, m0, M, gathered_share<BN, TL::THREADS>(b, brow, K, threadIdx.x), K,
                          0, nraw, d);
        mq::store_pairs<1, BN / 8>(as_frags<BN>(d), m0 + wg_row(), 0, M, n, pair, out, bias_row);
    }
}
