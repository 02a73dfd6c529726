// The quantized GEMM's shared tile code (mmq.cu's mul_mat, mmq_id.cu's mul_mat_id): the formats' int8
// fragments (the layout and the modes are described in mmq.cu) and k_loop, a block's K loop over its
// BM x BN output tile: the NS-stage cp.async ring of raw weight blocks and q8_1 b columns, the mma and
// their scaling. The two kernels differ only in which weights and b columns a block takes and where its
// sums go.
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

// A block's sums acc over its BM x BN tile (BM = 16 FM WM weight rows, BN = 8 FN WN columns) for K tiles
// kt0 .. kt0 + ntiles - 1 of nb K steps: weight row r is row min(m0 + r, M - 1) of wa (a_row bytes apart),
// b column c the quantize_q8_1 row brow(c) (codes at bq, (d, d * sum) at bds, nbp blocks a row). The ring
// lives in smem (NS stages, mmq_smem of specs/mmq.py). With preload (constant weights) the first NS - 1
// stages' weight copies are issued before od::grid_enter(), which k_loop calls (once entered, a second call
// returns at once). Every thread of the block calls it; it returns with no copy in flight.
template <int WT, int FM, int FN, int WM, int WN, int NS, int KB, class BRow>
__device__ __forceinline__ void k_loop(u8* const smem, const u8* const wa, long long a_row, int m0, int M,
                                       const u8* bq, const u8* bds, int nbp, BRow brow, int nb, int kt0, int ntiles,
                                       int preload, float (&acc)[FM][FN][4]) {
    using Q = mm::Fmt<WT>;
    using T = Tile<Q, KB>;
    constexpr int BM = 16 * FM * WM, BN = 8 * FN * WN, THREADS = 32 * WM * WN;
    constexpr int RS = T::RS, BCODES = BM * RS, BSCALES = BCODES + BN * T::BROW;
    constexpr int STAGE = BSCALES + BN * T::BDS;
    static_assert(NS >= 2, "a ring of two stages at least");
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
            const long long row = brow(c);
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
                        frag_codes<Q>(blk, t, af[fm][h], af[fm][2 + h]);
                        block_scales<Q>(blk, x[fm][h], y[fm][h]);
                    } else {
                        sub_step<WT>(blk, j % T::STEPS, t, af[fm][h], af[fm][2 + h], x[fm][h], y[fm][h],
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
                    if constexpr (mode<Q>() == HALVES) {
                        mma_s8_k16(dot, af[fm][0], af[fm][1], b0);
                        mma_s8_k16(dot2, af[fm][2], af[fm][3], b1);
                    } else {
                        mma_s8(dot, af[fm], b0, b1);
                        if constexpr (mode<Q>() == MINS16) {
                            mma_s8(dot2, mf[fm], b0, b1);
                        }
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 s = i % 2 == 0 ? s0 : s1;
                        const float xw = x[fm][i / 2], yw = y[fm][i / 2];
                        float v;
                        if constexpr (mode<Q>() == HALVES) {
                            v = fmaf(s.x, fmaf(xw, static_cast<float>(dot[i]), yw * static_cast<float>(dot2[i])),
                                     acc[fm][fn][i]);
                        } else {
                            v = fmaf(xw * s.x, static_cast<float>(dot[i]), acc[fm][fn][i]);
                            if constexpr (mode<Q>() == MINS16) {
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
}

}  // namespace mq
