// Quantized GEMM (mmq): out (B3, B2, N, M) f32 = b (N, K) @ a (M, K)^T for block-format weights a
// and more columns than the mat-vecs take (N > 8), on the int8 tensor cores (mma.sync m16n8k32 s8 ->
// s32), ggml's "mmq" idea. Two launches: quantize_q8_1 (mmv.cu) turns b into int8 codes with a scale
// per 32 values (QB8 layout, mmv_common.cuh), then this kernel. A K step is 32 values, whose int32 dot
// products are scaled in f32 by the weights' scale(s) for them and b's scale db:
//   legacy formats (q4_0, q4_1, q5_0, q5_1, q8_0): a step is one block, scaled by its d (plus its
//     offset m times db * sum(b codes) for q4_1 / q5_1; q4_0 / q5_0 codes have their zero subtracted
//     when they are read, so that they need no such term);
//   quant_k.cuh's formats: step u of a block is its values 32u .. 32u+31 (a sub-block of a 256-value
//     super-block; iq4_nl and mxfp4 blocks are one step), the codes turned into int8 as ggml dequantizes
//     them (offsets, iq4 / mxfp4 tables through lookup8), then by mq::mode:
//     ONE (q4_K, q5_K, iq4_xs, iq4_nl, mxfp4: a scale per 32 values) like the legacy formats, the
//       q4_K / q5_K min as an offset -dmin * min times db * sum;
//     HALVES (q3_K, q6_K: a scale per 16 values; scale times code can pass int8, so it cannot be folded
//       into the codes) one m16n8k16 mma per half of the step (the same fragments, halved), each half's
//       dot scaled by its own d * sc;
//     MINS16 (q2_K: scale and min per 16 values, both 4-bit) its scales multiplied into its 2-bit codes
//       (at most 45: still int8) for one mma, and its mins (replicated into a second A operand, each half
//       of the step its min) a second mma with the same b fragments: the mins times each half's b codes,
//       which q8_1's per-32 sums cannot give; acc += db (d dot - dmin mins).
//
// Tiling (template FM, FN, WM, WN, NS, KB): a warp computes 16 FM weight rows x 8 FN columns (FM x FN
// mma tiles); a block's WM x WN warps cover BM = 16 FM WM rows and BN = 8 FN WN columns. K is cut in
// K tiles of KB K steps, and the K tiles of a row in `splits` contiguous slices (split-K across
// blocks, a launch parameter: few columns leave few output tiles, so the slices make the grid several
// waves of blocks, each streaming its own weights). Grid (tiles_m * splits * tiles_n, B2, B3), the
// column tile fastest (the blocks reading the same weights run together) and the row tile slowest.
//
// Stages (an NS-deep ring, cp.async 16 bytes a thread, one __syncthreads a K tile): a stage holds
//   weights  BM rows of a K tile's raw blocks as they are in memory (Tile below), RS bytes apart: an
//            odd number of 16-byte granules, so that the 8 rows a fragment load reads (lanes 4g ..
//            4g+3 read row g) fall in 8 distinct bank groups. A legacy K tile (KB blocks) is whole
//            granules; a sub-scaled one (KB / STEPS blocks) need not be (q6_K's super-block is 210
//            bytes): each row then copies the granules covering it, its first block `lead` bytes in;
//   b codes  BN columns, BROW bytes apart (odd granules): the KB steps' first 16 codes, then
//            their last 16 (QB8's two half-runs, copied as they are);
//   b scales BN columns of KB (d, d * sum) float2, BDS bytes apart.
// A fragments are read straight from the raw blocks (frag_codes, sub_step below: one 32-bit read gives a
// lane its codes 4t .. 4t+3 and, for the legacy 4- and 5-bit formats, 16+4t .. 16+4t+3 in the high
// nibbles), so no weight is ever written back dequantized. With `preload` (the weights are constant)
// the first NS - 1 stages' weights are issued before the wait for quantize_q8_1 (PDL), so that their
// latency overlaps its tail.
//
// Split-K: with splits > 1 each block writes its partial sums to part (splits planes shaped as out),
// then the last block of an output tile to finish (od::last_block on its counter, zeroed once) adds
// the planes in split order and writes out: the result does not depend on which block finished last.
//
// Requirements (support.mmq_ok): a's rows a multiple of 16 bytes (whole chunks of specs/stream.py's
// STREAMED: K % 256 for q4_0, q5_0, q8_0, q4_K, q5_K, iq4_nl; K % 128 for q4_1, K % 64 for q5_1; K % 512
// for iq4_xs, mxfp4; K % 1024 for q2_K; K % 2048 for q3_K, q6_K), a 16-byte aligned (base, row and batch
// strides); 1 <= splits <= K tiles (specs/mmq.py). The last K tile may hold fewer than KB steps (always
// a multiple of 8: whole b granules, whole blocks); rows past M and columns past N read row M - 1 and
// column N - 1 and write nothing.

#include "mmv_common.cuh"

namespace mq {

using mm::u8;

// A K tile's layout in a stage, for format Q and KB K steps (32 values each) a K tile: KB / STEPS blocks
// of a row (RAW bytes). A legacy format's K tile is whole granules; a sub-scaled format's may start
// inside a granule (q6_K's 210-byte super-blocks): then a row copies the granules that cover it, G at
// most, and its blocks start `lead` bytes into them (an even number but for mxfp4).
template <class Q, int KB>
struct Tile {
    static constexpr int STEPS = Q::QK / 32;                        // K steps a block
    static constexpr int RAW = KB / STEPS * Q::BYTES;
    static constexpr bool ALIGNED = RAW % 16 == 0;                  // every K tile starts on a granule
    static constexpr int G = ALIGNED ? RAW / 16 : (RAW + 2 * 15) / 16;  // granules a row's K tile spans
    static constexpr int RS = 16 * (G % 2 == 1 ? G : G + 1);        // a weight row, odd granules
    static constexpr int BROW = 2 * KB * 16 + 16;                     // a b column's codes (odd granules)
    static constexpr int BDS = KB * 8 + 16;                           // a b column's scales (odd granules)
    static_assert(KB % 8 == 0 && KB % STEPS == 0, "a K tile is whole blocks and b granules");
    static_assert(ALIGNED || !Q::LEGACY, "a legacy K tile is whole granules");
};

// -- the per-format trait: a block's codes as int8 mma fragments ------------------------------------

// Each byte of x (a code 0 .. 2**BITS - 1) minus Q::ZERO, as int8: no borrow crosses a byte, since
// every byte is at least 0x80 - ZERO before the subtraction.
template <class Q>
__device__ __forceinline__ unsigned sub_zero(unsigned x) {
    if constexpr (Q::ZERO == 0) {
        return x;
    } else {
        return ((x | 0x80808080u) - 0x01010101u * static_cast<unsigned>(Q::ZERO)) ^ 0x80808080u;
    }
}

// Lane t's (t = lane % 4) codes of the block at blk (shared, 2-byte aligned), as int8 minus the
// zero: lo = codes 4t .. 4t+3, hi = codes 16+4t .. 16+4t+3 (the fragment layout of m16n8k32's A
// and B: registers 0 / 1 hold k 4t .. 4t+3, registers 2 / 3 k 16+4t ..).
template <class Q>
__device__ __forceinline__ void frag_codes(const u8* blk, int t, unsigned& lo, unsigned& hi) {
    if constexpr (Q::BITS == 8) {
        lo = od::ld32_2(blk + Q::QS + 4 * t);
        hi = od::ld32_2(blk + Q::QS + 16 + 4 * t);
    } else {
        const unsigned qs = od::ld32_2(blk + Q::QS + 4 * t);  // codes 4t.. low nibbles, 16+4t.. high
        lo = qs & 0x0f0f0f0fu;
        hi = (qs >> 4) & 0x0f0f0f0fu;
        if constexpr (Q::BITS == 5) {
            const unsigned qh = od::ld32_2(blk + Q::QH);
            lo |= od::quant::spread4((qh >> (4 * t)) & 0xfu);
            hi |= od::quant::spread4((qh >> (16 + 4 * t)) & 0xfu);
        }
        lo = sub_zero<Q>(lo);
        hi = sub_zero<Q>(hi);
    }
}

// The block's scale d and offset m (0 without one).
template <class Q>
__device__ __forceinline__ void block_scales(const u8* blk, float& d, float& m) {
    d = od::f16_to_f32(static_cast<unsigned short>(od::ld16(blk + Q::D)));
    m = 0.0f;
    if constexpr (Q::M >= 0) {
        m = od::f16_to_f32(static_cast<unsigned short>(od::ld16(blk + Q::M)));
    }
}

// -- the sub-scaled formats (quant_k.cuh): K step u of a block is its values 32u .. 32u+31 ----------

// How a K step's int32 dot products become floats (per output, b's scale db = s.x, db * sum = s.y):
//   ONE     one m16n8k32 mma; acc += x db dot + y db sum (y: the legacy offset m, or minus a K4 min)
//   HALVES  a scale per 16 values (q3_K, q6_K), too wide to fold into the codes: one m16n8k16 mma a
//           half, acc += db (x dot_lo + y dot_hi)
//   MINS16  q2_K: its 4-bit scales folded into its 2-bit codes (products <= 45, still int8), its 4-bit
//           mins a second A operand of one m16n8k32 mma with b (each half's min times that half's b
//           codes): acc += x db dot + y db mins, x = d, y = -dmin
enum Mode : int { ONE = 0, HALVES = 1, MINS16 = 2 };

template <class Q>
__device__ __forceinline__ constexpr int mode() {
    if constexpr (Q::LEGACY) {
        return ONE;
    } else {
        return Q::SUB == 32 ? ONE : (Q::M >= 0 ? MINS16 : HALVES);
    }
}

// Lane t's A registers of K step u of the sub-scaled block at blk (shared): lo = codes 4t .. 4t+3 of
// the step, hi = 16+4t .. 16+4t+3, as int8 (ggml's dequantized code: offsets and tables applied);
// x, y as `mode` says; for MINS16 m0, m1 the mins of the step's halves in each byte.
template <int WT>
__device__ __forceinline__ void sub_step(const u8* blk, int u, int t, unsigned& lo, unsigned& hi, float& x, float& y,
                                         unsigned& m0, unsigned& m1) {
    namespace q = od::quant;
    using Q = mm::Fmt<WT>;
    const q::Mem<Q::BYTES % 2 == 1> src{blk};
    if constexpr (WT == W_Q4_K || WT == W_Q5_K) {
        const int qs = Q::QS + 32 * (u >> 1) + 4 * t, sh = 4 * (u & 1);
        lo = (src.u32(qs) >> sh) & 0x0f0f0f0fu;
        hi = (src.u32(qs + 16) >> sh) & 0x0f0f0f0fu;
        if constexpr (Q::QH >= 0) {
            lo |= q::bits4(src.u32(Q::QH + 4 * t), u) << 4;
            hi |= q::bits4(src.u32(Q::QH + 16 + 4 * t), u) << 4;
        }
    } else if constexpr (WT == W_Q6_K) {
        const int n = u >> 2, c = u & 3;  // values 128n + 32c ..
        const int ql = Q::QL + 64 * n + 32 * (c & 1) + 4 * t, qh = Q::QH + 32 * n + 4 * t, sh = 4 * (c >> 1);
        lo = q::centre4<6>(((src.u32(ql) >> sh) & 0x0f0f0f0fu) | (q::crumbs4(src.u32(qh), c) << 4));
        hi = q::centre4<6>(((src.u32(ql + 16) >> sh) & 0x0f0f0f0fu) | (q::crumbs4(src.u32(qh + 16), c) << 4));
    } else if constexpr (WT == W_Q3_K) {
        const int qs = Q::QS + 32 * (u >> 2) + 4 * t, hm = Q::HM + 4 * t;
        lo = q::centre4<3>(q::crumbs4(src.u32(qs), u & 3) | (q::bits4(src.u32(hm), u) << 2));
        hi = q::centre4<3>(q::crumbs4(src.u32(qs + 16), u & 3) | (q::bits4(src.u32(hm + 16), u) << 2));
    } else if constexpr (WT == W_Q2_K) {
        const int qs = Q::QS + 32 * (u >> 2) + 4 * t;
        const unsigned s0 = src.u8(Q::SC + 2 * u), s1 = src.u8(Q::SC + 2 * u + 1);
        lo = q::crumbs4(src.u32(qs), u & 3) * (s0 & 15u);  // bytes <= 3 * 15: no carry
        hi = q::crumbs4(src.u32(qs + 16), u & 3) * (s1 & 15u);
        m0 = (s0 >> 4) * 0x01010101u;
        m1 = (s1 >> 4) * 0x01010101u;
        x = q::half_in(src, Q::D);
        y = -q::half_in(src, Q::M);
        return;
    } else {  // iq4_nl, iq4_xs, mxfp4: q4_0's nibble order through the format's table
        constexpr q::Table16 table = WT == W_MXFP4 ? q::mxfp4_table() : q::iq4nl_table();
        const unsigned w = src.u32(Q::QS + (WT == W_IQ4_XS ? 16 * u : 0) + 4 * t);
        q::lookup8(table, w, lo, hi);
    }
    float m;
    if constexpr (mode<Q>() == HALVES) {
        Q::scale(blk, 2 * u, x, m);
        Q::scale(blk, 2 * u + 1, y, m);
    } else {
        Q::scale(blk, u, x, m);
        y = -m;
    }
}

// d = a (16 x 16, row) . b (16 x 8, col), int8 in, int32 out, from zero: a0 row g k 4t.., a1 row g+8
// k 4t..; b column g k 4t..; d as mma_s8's. The HALVES formats' half-steps.
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], unsigned a0, unsigned a1, unsigned b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %7, %7, %7};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// d = a (16 x 32, row) . b (32 x 8, col), int8 in, int32 out, from zero: one warp-collective mma.
// a[0] row g k 4t.., a[1] row g+8 k 4t.., a[2] row g k 16+4t.., a[3] row g+8 k 16+4t..;
// b[0] column g k 4t.., b[1] column g k 16+4t..; d[0..1] row g columns 2t, 2t+1, d[2..3] row g+8.
__device__ __forceinline__ void mma_s8(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %10, %10, %10};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

}  // namespace mq

using mm::u8;

// mul_mat with block-format weights: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k].
// a rows a_row bytes apart, batch strides a_s2, a_s3 (16-byte multiples, a 16-byte aligned); b
// quantized by quantize_q8_1 (column n of batch (i3, i2) is its row (i3 * B2 + i2) * N + n, nbp
// blocks a row: codes at bq, (d, d * sum) at bds); out contiguous (B3, B2, N, M). Grid (tiles_m *
// splits * tiles_n, B2, B3), WM * WN warps, dynamic shared memory mmq_smem (specs/mmq.py). With
// splits > 1: part holds splits * B3 * B2 * N * M floats, counters B3 * B2 * tiles_m * tiles_n ints
// (zero before the launch, and again after it).
template <int WT, int FM, int FN, int WM, int WN, int NS, int KB>
__global__ void __launch_bounds__(32 * WM * WN)
    mmq(const u8* a, long long a_row, long long a_s2, long long a_s3, int r2, int r3, const u8* bq, const u8* bds,
        int nbp, float* out, int M, int K, int N, int tiles_m, int tiles_n, int splits, float* part, int* counters,
        int preload) {
    od::grid_enter_later();  // below: after the first weight copies when the weights are constant
    using Q = mm::Fmt<WT>;
    using T = mq::Tile<Q, KB>;
    constexpr int BM = 16 * FM * WM, BN = 8 * FN * WN, THREADS = 32 * WM * WN;
    constexpr int RS = T::RS, BCODES = BM * RS, BSCALES = BCODES + BN * T::BROW;
    constexpr int STAGE = BSCALES + BN * T::BDS;
    static_assert(NS >= 2, "a ring of two stages at least");
    extern __shared__ uint4 smem_u4[];
    u8* const smem = reinterpret_cast<u8*>(smem_u4);

    const int tn = static_cast<int>(blockIdx.x % tiles_n);
    const int split = static_cast<int>((blockIdx.x / tiles_n) % splits);
    const int tm = static_cast<int>(blockIdx.x / (tiles_n * splits));
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int m0 = tm * BM, n0 = tn * BN;
    const u8* const wa = a + (i3 / r3) * a_s3 + (i2 / r2) * a_s2;
    const long long batch = static_cast<long long>(i3) * gridDim.y + i2;
    const long long brow0 = batch * N;
    const int nb = K / 32, nkt = (nb + KB - 1) / KB;
    const int kt0 = static_cast<int>(static_cast<long long>(split) * nkt / splits);
    const int ntiles = static_cast<int>(static_cast<long long>(split + 1) * nkt / splits) - kt0;
    const int tid = threadIdx.x;

    // K tile kt (of the block's slice) into stage st: the weights' blocks of each row ...
    // (the granules that cover them: lead() bytes before the first block where K tiles are not whole granules)
    auto lead = [&](int kt) { return T::ALIGNED ? 0 : (kt0 + kt) * KB / T::STEPS * Q::BYTES % 16; };
    auto issue_a = [&](int kt, u8* st) {
        const int j0 = (kt0 + kt) * KB, kb = min(KB, nb - j0);
        const int at = j0 / T::STEPS * Q::BYTES - lead(kt);
        const int wg = (lead(kt) + kb / T::STEPS * Q::BYTES + (T::ALIGNED ? 0 : 15)) / 16;
        for (int i = tid; i < BM * wg; i += THREADS) {
            const int r = i / wg, x = i - r * wg;
            const u8* src = wa + static_cast<long long>(min(m0 + r, M - 1)) * a_row + at + 16 * x;
            od::cp_async16(od::smem_addr(st + r * RS + 16 * x), src);
        }
    };
    // ... and b's codes (two half-runs) and scales of each column
    auto issue_b = [&](int kt, u8* st) {
        const int j0 = (kt0 + kt) * KB, kb = min(KB, nb - j0);
        const int bg = 2 * kb + kb / 2;  // granules a column: codes, then scales (kb is even)
        for (int i = tid; i < BN * bg; i += THREADS) {
            const int c = i / bg, x = i - c * bg;
            const long long row = brow0 + min(n0 + c, N - 1);
            const u8* src;
            u8* dst;
            if (x < 2 * kb) {
                const int h = x / kb, y = x - h * kb;
                src = bq + row * nbp * 32 + mm::QB8::half(j0, h) + 16 * y;
                dst = st + BCODES + c * T::BROW + h * KB * 16 + 16 * y;
            } else {
                const int y = x - 2 * kb;
                src = bds + (row * nbp + j0) * 8 + 16 * y;
                dst = st + BSCALES + c * T::BDS + 16 * y;
            }
            od::cp_async16(od::smem_addr(dst), src);
        }
    };

    const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wn = warp % WN, wm = warp / WN;
    const int row0 = wm * 16 * FM, col0 = wn * 8 * FN;  // the warp's tile in the block's
    float acc[FM][FN][4];
#pragma unroll
    for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
        for (int fn = 0; fn < FN; ++fn) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[fm][fn][i] = 0.0f;
            }
        }
    }

    // the first NS - 1 stages: the weights' copies go into the first group, before the wait for
    // quantize_q8_1 when they are constant
    if (preload) {
#pragma unroll
        for (int s = 0; s < NS - 1; ++s) {
            if (s < ntiles) {
                issue_a(s, smem + s * STAGE);
            }
        }
    }
    od::grid_enter();
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (s < ntiles) {
            if (!preload) {
                issue_a(s, smem + s * STAGE);
            }
            issue_b(s, smem + s * STAGE);
        }
        od::cp_async_commit();
    }
    for (int kt = 0; kt < ntiles; ++kt) {
        od::cp_async_wait<NS - 2>();
        __syncthreads();  // tile kt landed for every thread; every warp is done with tile kt - 1's stage
        if (kt + NS - 1 < ntiles) {
            u8* const next = smem + ((kt + NS - 1) % NS) * STAGE;
            issue_a(kt + NS - 1, next);
            issue_b(kt + NS - 1, next);
        }
        od::cp_async_commit();
        const u8* const st = smem + (kt % NS) * STAGE;
        const u8* const wst = st + lead(kt);  // the K tile's first block of row 0
        const int kb = min(KB, nb - (kt0 + kt) * KB);
#pragma unroll 2
        for (int j = 0; j < kb; ++j) {
            // the weights' K step j: A fragments and their scales (x, y; mins for MINS16), rows g and g + 8
            unsigned af[FM][4], mf[FM][4];
            float x[FM][2], y[FM][2];
#pragma unroll
            for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u8* blk = wst + (row0 + 16 * fm + g + 8 * h) * RS + j / T::STEPS * Q::BYTES;
                    if constexpr (Q::LEGACY) {
                        mq::frag_codes<Q>(blk, t, af[fm][h], af[fm][2 + h]);
                        mq::block_scales<Q>(blk, x[fm][h], y[fm][h]);
                    } else {
                        mq::sub_step<WT>(blk, j % T::STEPS, t, af[fm][h], af[fm][2 + h], x[fm][h], y[fm][h],
                                         mf[fm][h], mf[fm][2 + h]);
                    }
                }
            }
#pragma unroll
            for (int fn = 0; fn < FN; ++fn) {
                const int c = col0 + 8 * fn;
                const u8* bc = st + BCODES + (c + g) * T::BROW + 16 * j + 4 * t;
                const unsigned b0 = *reinterpret_cast<const unsigned*>(bc);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(bc + KB * 16);
                const u8* bs = st + BSCALES + (c + 2 * t) * T::BDS + 8 * j;
                const float2 s0 = *reinterpret_cast<const float2*>(bs);
                const float2 s1 = *reinterpret_cast<const float2*>(bs + T::BDS);
#pragma unroll
                for (int fm = 0; fm < FM; ++fm) {
                    int dot[4], dot2[4];
                    if constexpr (mq::mode<Q>() == mq::HALVES) {
                        mq::mma_s8_k16(dot, af[fm][0], af[fm][1], b0);
                        mq::mma_s8_k16(dot2, af[fm][2], af[fm][3], b1);
                    } else {
                        mq::mma_s8(dot, af[fm], b0, b1);
                        if constexpr (mq::mode<Q>() == mq::MINS16) {
                            mq::mma_s8(dot2, mf[fm], b0, b1);
                        }
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 s = i % 2 == 0 ? s0 : s1;
                        const float xw = x[fm][i / 2], yw = y[fm][i / 2];
                        float v;
                        if constexpr (mq::mode<Q>() == mq::HALVES) {
                            v = fmaf(s.x, fmaf(xw, static_cast<float>(dot[i]), yw * static_cast<float>(dot2[i])),
                                     acc[fm][fn][i]);
                        } else {
                            v = fmaf(xw * s.x, static_cast<float>(dot[i]), acc[fm][fn][i]);
                            if constexpr (mq::mode<Q>() == mq::MINS16) {
                                v = fmaf(yw * s.x, static_cast<float>(dot2[i]), v);
                            } else if constexpr (Q::M >= 0) {
                                v = fmaf(yw, s.y, v);
                            }
                        }
                        acc[fm][fn][i] = v;
                    }
                }
            }
        }
    }
    od::cp_async_wait<0>();  // only empty groups can be left

    // this block's sums: straight to out, or to its plane of part (the last block adds the planes up)
    const long long plane = static_cast<long long>(gridDim.y) * gridDim.z * N * M;
    float* const dst = (splits == 1 ? out : part + split * plane) + brow0 * M;
#pragma unroll
    for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
        for (int fn = 0; fn < FN; ++fn) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = m0 + row0 + 16 * fm + g + 8 * (i / 2);
                const int n = n0 + col0 + 8 * fn + 2 * t + i % 2;
                if (m < M && n < N) {
                    dst[static_cast<long long>(n) * M + m] = acc[fm][fn][i];
                }
            }
        }
    }
    if (splits == 1 || !od::last_block(counters + (batch * tiles_m + tm) * tiles_n + tn, splits)) {
        return;
    }
    const float* const src = part + brow0 * M;
    float* const o = out + brow0 * M;
#pragma unroll
    for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
        for (int fn = 0; fn < FN; ++fn) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int m = m0 + row0 + 16 * fm + g + 8 * (i / 2);
                const int n = n0 + col0 + 8 * fn + 2 * t + i % 2;
                if (m < M && n < N) {
                    const long long at = static_cast<long long>(n) * M + m;
                    float sum = 0.0f;
                    for (int s = 0; s < splits; ++s) {
                        sum += __ldcg(src + s * plane + at);
                    }
                    o[at] = sum;
                }
            }
        }
    }
}
