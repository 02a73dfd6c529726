// The int8 tensor-core arithmetic of the quantized GEMMs (mmq.cu and mmq_id.cu through mmq_tile.cuh,
// mmq_small.cu): a block format's codes as m16n8k32 A fragments (read straight from its raw blocks, in
// shared memory), the scales of a K step of 32 values, the converted K tile that holds them (Conv, for
// k_loop's A8), the mma statements, and how a step's int32 dots become f32 sums (step_acc). mmq.cu's
// opening comment explains the formats' modes; the kernels differ only in how the raw blocks and b's
// q8_1 codes reach shared memory and how the output tiles are cut.

#pragma once

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


// The A side of one K step of an m16n8k32 tile (rows g and g + 8 of lane (g, t)): codes a (mma_s8's
// layout), the mins operand m (MINS16 only) and each row's scales x, y (as `mode` says).
struct AFrag {
    unsigned a[4], m[4];
    float x[2], y[2];
};

// Lane (g, t)'s AFrag of K step j of a K tile of KB steps whose rows g and g + 8 start at r0 and r8
// (shared memory: the tile's first block of each row).
template <int WT, int KB>
__device__ __forceinline__ void a_frag(const u8* r0, const u8* r8, int j, int t, AFrag& f) {
    using Q = mm::Fmt<WT>;
    using T = Tile<Q, KB>;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u8* blk = (h == 0 ? r0 : r8) + j / T::STEPS * Q::BYTES;
        if constexpr (Q::LEGACY) {
            frag_codes<Q>(blk, t, f.a[h], f.a[2 + h]);
            block_scales<Q>(blk, f.x[h], f.y[h]);
        } else {
            sub_step<WT>(blk, j % T::STEPS, t, f.a[h], f.a[2 + h], f.x[h], f.y[h], f.m[h], f.m[2 + h]);
        }
    }
}

// -- int8 A tiles (mmq_tile.cuh's k_loop with A8): a K tile's AFrags decoded once a block ------------

// The converted K tile of BM rows and KB steps in shared memory: its FRAGS = BM / 16 * KB fragments
// (16-row tile f, step j: fragment f * KB + j) as a_frag gives them. First every fragment's codes, lane
// by lane (lane l's a[0..3] at 16 (32 i + l): a warp's load or store of a fragment is 512 contiguous
// bytes, conflict-free), then every fragment's scales, by row pair g (x[0], x[1], y[0], y[1], and for
// MINS16 then m[0..3]: SREC bytes at CODES + SREC (8 i + g), which the 4 lanes of a pair share).
template <int WT, int BM, int KB>
struct Conv {
    using Q = mm::Fmt<WT>;
    static constexpr int FRAGS = BM / 16 * KB;
    static constexpr int SREC = mode<Q>() == MINS16 ? 32 : 16;
    static constexpr int CODES = FRAGS * 32 * 16;
    static constexpr int BYTES = CODES + FRAGS * 8 * SREC;  // specs/mmq.py's conv_bytes

    // lane (g, t)'s AFrag f into fragment i (a pair's scales written by its lane t = 0)
    static __device__ __forceinline__ void put(u8* ac, int i, int lane, const AFrag& f) {
        reinterpret_cast<uint4*>(ac)[32 * i + lane] = make_uint4(f.a[0], f.a[1], f.a[2], f.a[3]);
        if (lane % 4 == 0) {
            u8* const rec = ac + CODES + SREC * (8 * i + lane / 4);
            *reinterpret_cast<float4*>(rec) = make_float4(f.x[0], f.x[1], f.y[0], f.y[1]);
            if constexpr (SREC == 32) {
                *reinterpret_cast<uint4*>(rec + 16) = make_uint4(f.m[0], f.m[1], f.m[2], f.m[3]);
            }
        }
    }

    // lane (g, t)'s AFrag f of fragment i
    static __device__ __forceinline__ void get(const u8* ac, int i, int lane, AFrag& f) {
        const uint4 c = reinterpret_cast<const uint4*>(ac)[32 * i + lane];
        const u8* const rec = ac + CODES + SREC * (8 * i + lane / 4);
        const float4 s = *reinterpret_cast<const float4*>(rec);
        f.a[0] = c.x, f.a[1] = c.y, f.a[2] = c.z, f.a[3] = c.w;
        f.x[0] = s.x, f.x[1] = s.y, f.y[0] = s.z, f.y[1] = s.w;
        if constexpr (SREC == 32) {
            const uint4 m = *reinterpret_cast<const uint4*>(rec + 16);
            f.m[0] = m.x, f.m[1] = m.y, f.m[2] = m.z, f.m[3] = m.w;
        }
    }
};

// acc (lane (g, t)'s outputs of the tile: rows g, g + 8 by columns 2t, 2t + 1, as mma_s8's d) += one K
// step: f's dot with b's codes (b0, b1: column g, mma_s8's layout), scaled by b's (d, d * sum) of columns
// 2t (s0) and 2t + 1 (s1) and f's scales, as mode<Q>() says.
// The sums go to float by static_cast: on sm_90 one I2FP.F32.S32 each, not the XU pipe's I2F. An integer add
// and an exact FADD in its place (session 39) were two instructions for one; with them main ran mmq's 64-column
// products 3-4% slower than the commit before (H100, session 40; docs/benchmarks.md).
template <int WT>
__device__ __forceinline__ void step_acc(float (&acc)[4], const AFrag& f, unsigned b0, unsigned b1, float2 s0,
                                         float2 s1) {
    using Q = mm::Fmt<WT>;
    int dot[4], dot2[4];
    if constexpr (mode<Q>() == HALVES) {
        mma_s8_k16(dot, f.a[0], f.a[1], b0);
        mma_s8_k16(dot2, f.a[2], f.a[3], b1);
    } else {
        mma_s8(dot, f.a, b0, b1);
        if constexpr (mode<Q>() == MINS16) {
            mma_s8(dot2, f.m, b0, b1);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 s = i % 2 == 0 ? s0 : s1;
        const float xw = f.x[i / 2], yw = f.y[i / 2];
        float v;
        if constexpr (mode<Q>() == HALVES) {
            v = fmaf(s.x, fmaf(xw, static_cast<float>(dot[i]), yw * static_cast<float>(dot2[i])), acc[i]);
        } else {
            v = fmaf(xw * s.x, static_cast<float>(dot[i]), acc[i]);
            if constexpr (mode<Q>() == MINS16) {
                v = fmaf(yw * s.x, static_cast<float>(dot2[i]), v);
            } else if constexpr (Q::M >= 0) {
                v = fmaf(yw, s.y, v);
            }
        }
        acc[i] = v;
    }
}

// (m, n): the row and column of a warp's sum acc[fm][fn][i] (mma tiles of 16 x 8, rows from r0 and columns from
// c0) in the mma's accumulator layout (rows lane / 4 and + 8, columns 2 (lane % 4) and + 1).
__device__ __forceinline__ int2 sum_at(int r0, int c0, int fm, int fn, int i) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    return make_int2(r0 + 16 * fm + g + 8 * (i / 2), c0 + 8 * fn + 2 * t + i % 2);
}

// f(m, n, v) for each of a warp's sums acc (FM x FN mma tiles), at its row m and column n (sum_at).
template <int FM, int FN, class F>
__device__ __forceinline__ void each_sum(const float (&acc)[FM][FN][4], int r0, int c0, F f) {
#pragma unroll
    for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
        for (int fn = 0; fn < FN; ++fn) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int2 at = sum_at(r0, c0, fm, fn, i);
                f(at.x, at.y, acc[fm][fn][i]);
            }
        }
    }
}

// The end of a warp's tile of 16 FM rows x 8 FN columns (acc: FM x FN mma_s8 outputs), rows from r0 and
// columns from c0 of the output of batch row brow0 (out + brow0 * M, N x M), in its block's tile of BM rows from
// bm0 and BN columns from bn0 (THREADS threads): written to out, or with split K (splits > 1) to the block's plane
// `split` of part (planes `plane` floats apart), after which the last block of the tile to finish (od::last_block
// on `counter`, which it sets back to 0) adds the planes in split order and writes out: deterministic. A bias
// (not null) is added to the sums written to out (with split K, the planes are added to it): output row r = brow0
// + n, column m adds bias[r * bias_col + m] (bias_col 0: one row for every output row; else a residual addend's
// rows, bias_col floats apart). Rows past M and columns past N are not written. Every thread of the block calls
// it (or with SYNC > 0 its first SYNC threads, the rest having left: od::last_block<SYNC>); a warp with `owns`
// false (mmq_small's k-groups past the first, whose sums its first k-group added) writes no plane.
template <int FM, int FN, int BM, int BN, int THREADS, int SYNC = 0>
__device__ __forceinline__ void finish(const float (&acc)[FM][FN][4], int r0, int c0, int bm0, int bn0, int M, int N,
                                       long long brow0, float* out, float* part, int split, int splits,
                                       long long plane, int* counter, const float* bias, long long bias_col,
                                       bool owns = true) {
    // output (n, m)'s bias (0 without one)
    auto bias_at = [&](int n, int m) { return bias != nullptr ? bias[(brow0 + n) * bias_col + m] : 0.0f; };
    float* const dst = (splits == 1 ? out : part + split * plane) + brow0 * M;
    const int rows = owns ? M : 0;  // the rows this warp writes below: all or none
    // FB column tiles at a time: their biases loaded together before their stores (a store may alias the bias, a
    // residual added in place, so the compiler would not move a load above one: a load's latency each output)
    constexpr int FB = FN < 4 ? FN : 4;
#pragma unroll
    for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
        for (int fn0 = 0; fn0 < FN; fn0 += FB) {
            float add[FB][4];
#pragma unroll
            for (int f = 0; f < FB; ++f) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int2 at = sum_at(r0, c0, fm, fn0 + f, i);  // (m, n)
                    add[f][i] = splits == 1 && fn0 + f < FN && at.x < rows && at.y < N ? bias_at(at.y, at.x) : 0.0f;
                }
            }
#pragma unroll
            for (int f = 0; f < FB; ++f) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int2 at = sum_at(r0, c0, fm, fn0 + f, i);
                    if (fn0 + f < FN && at.x < rows && at.y < N) {
                        dst[static_cast<long long>(at.y) * M + at.x] = acc[fm][fn0 + f][i] + add[f][i];
                    }
                }
            }
        }
    }
    if (splits == 1 || !od::last_block<SYNC>(counter, splits)) {
        return;
    }
    // The block's tile, every thread a share: runs of 4 rows (16-byte loads) where M and the addresses allow, planes
    // outermost, so that a thread has several planes' loads in flight (one output's planes in turn, by the thread
    // that held it, took 5-6 us of a 14 us launch: H200, 2048 x 8192 q4_0 at 16 columns, 16 splits). Each output's
    // planes are added in split order, as before.
    const float* const src = part + brow0 * M;
    float* const o = out + brow0 * M;
    // 16-byte runs: M % 4 == 0 keeps every run (and plane) aligned once both bases are
    const auto base = reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(o);
    const bool vec = M % 4 == 0 && (base & 15ull) == 0;
    // a thread's runs, CH at a time, 4 planes of each in flight (8 made the 1b batch-16 decode 2% slower, H200,
    // session 23; a thread's whole warp tile of planes at once had spilled in the widest instances)
    constexpr int RUN = 4, ITEMS = BM / RUN * BN, EACH = (ITEMS + THREADS - 1) / THREADS, CH = EACH < 2 ? EACH : 2;
    static_assert(BM % RUN == 0 && EACH % CH == 0, "whole runs of rows, whole chunks of runs");
    if (vec) {
#pragma unroll 1
        for (int e0 = 0; e0 < EACH; e0 += CH) {
            float4 sum[CH];
            int ns[CH], ms[CH];
            bool live[CH];
#pragma unroll
            for (int e = 0; e < CH; ++e) {
                const int item = static_cast<int>(threadIdx.x) + (e0 + e) * THREADS;
                ns[e] = bn0 + item / (BM / RUN), ms[e] = bm0 + RUN * (item % (BM / RUN));
                live[e] = item < ITEMS && ns[e] < N && ms[e] < M;
                // the bias first: its loads in flight with the planes' (after them they had added a latency)
                sum[e] = live[e] ? make_float4(bias_at(ns[e], ms[e]), bias_at(ns[e], ms[e] + 1),
                                               bias_at(ns[e], ms[e] + 2), bias_at(ns[e], ms[e] + 3))
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll 4
            for (int s = 0; s < splits; ++s) {
#pragma unroll
                for (int e = 0; e < CH; ++e) {
                    if (live[e]) {
                        const float4 x = __ldcg(reinterpret_cast<const float4*>(
                            src + s * plane + static_cast<long long>(ns[e]) * M + ms[e]));
                        sum[e].x += x.x, sum[e].y += x.y, sum[e].z += x.z, sum[e].w += x.w;
                    }
                }
            }
#pragma unroll
            for (int e = 0; e < CH; ++e) {
                if (live[e]) {
                    *reinterpret_cast<float4*>(o + static_cast<long long>(ns[e]) * M + ms[e]) = sum[e];
                }
            }
        }
        return;
    }
    for (int item = static_cast<int>(threadIdx.x); item < BM * BN; item += THREADS) {
        const int n = bn0 + item / BM, m = bm0 + item % BM;
        if (n < N && m < M) {
            const long long at = static_cast<long long>(n) * M + m;
            float sum = bias_at(n, m);
            for (int s = 0; s < splits; ++s) {
                sum += __ldcg(src + s * plane + at);
            }
            o[at] = sum;
        }
    }
}

// mul_mat_id's column tile `tile` of moe_route's table (E experts, `pairs` = T * U pairs; [0] the tiles, then
// (expert, first, count) each): false for a tile past the table's count (the block has nothing to do), else its
// expert e and pair count n, and its BN columns' pairs and q8_1 / bf16 b rows (pair p = t * U + u reads row
// t * Ub + u % Ub) in the block's shared pair[BN] and brow[BN], the columns past its pairs repeating its last. The
// block's THREADS threads call it; they have synchronized when it returns true.
template <int BN, int THREADS>
__device__ __forceinline__ bool pair_tile(const int* route, int E, int pairs, int tile, int U, int Ub, int* pair,
                                          int* brow, int& e, int& n) {
    const int* const table = route + 1 + 3 * E + pairs;
    if (tile >= table[0]) {
        return false;
    }
    e = table[1 + 3 * tile];
    n = table[3 + 3 * tile];
    const int* const list = route + 1 + 3 * E + table[2 + 3 * tile];
    for (int c = threadIdx.x; c < BN; c += THREADS) {
        const int p = list[min(c, n - 1)];
        pair[c] = p;
        brow[c] = p / U * Ub + p % U % Ub;
    }
    __syncthreads();
    return true;
}

// A warp's sums acc (FM x FN mma tiles: rows from r0, the warp's first weight row, columns from c0 of its block's
// column tile of n pairs) written to their pairs' output rows (out (pairs, M), pair[c] column c's), plus bias_row
// (not null: the expert's bias, a fused add_id); rows past M and columns past n are not written.
template <int FM, int FN>
__device__ __forceinline__ void store_pairs(const float (&acc)[FM][FN][4], int r0, int c0, int M, int n,
                                            const int* pair, float* out, const float* bias_row) {
    each_sum(acc, r0, c0, [&](int m, int c, float v) {
        if (m < M && c < n) {
            out[static_cast<long long>(pair[c]) * M + m] = v + (bias_row != nullptr ? bias_row[m] : 0.0f);
        }
    });
}

}  // namespace mq
