// The quantized GEMM's K loop (mmq.cu's mul_mat, mmq_id.cu's mul_mat_id): k_loop, a block's loop over
// its BM x BN output tile: the NS-stage cp.async ring of raw weight blocks and q8_1 b columns, the mma and
// their scaling (mmq_common.cuh's fragments and step_acc). The two kernels differ only in which weights
// and b columns a block takes and where its sums go.
#pragma once
#include "mmq_common.cuh"

namespace mq {

// A block's sums acc over its BM x BN tile (BM = 16 FM WM weight rows, BN = 8 FN WN columns) for K tiles
// kt0 .. kt0 + ntiles - 1 of nb K steps: weight row r is row min(m0 + r, M - 1) of wa (a_row bytes apart),
// b column c the quantize_q8_1 row brow(c) (codes at bq, (d, d * sum) at bds, nbp blocks a row). The ring
// lives in smem (NS stages, mmq_smem of specs/mmq.py). With preload (constant weights) the first NS - 1
// stages' weight copies are issued before od::grid_enter(), which k_loop calls (once entered, a second call
// returns at once). Every thread of the block calls it; it returns with no copy in flight.
// A8 (the many-column tiles): once a K tile has landed, the block decodes its BM rows into AFrags in a
// converted tile after the ring (Conv: int8 codes and f32 scales, one a_frag per 16 rows, step and lane),
// and after a second __syncthreads every warp reads its fragments from there (one 16-byte load for the
// codes, one for the scales) instead of decoding the raw blocks itself: without A8 each row's decode is
// repeated by the WN warps that share it, at every K step.
template <int WT, int FM, int FN, int WM, int WN, int NS, int KB, bool A8, class BRow>
__device__ __forceinline__ void k_loop(u8* const smem, const u8* const wa, long long a_row, int m0, int M,
                                       const u8* bq, const u8* bds, int nbp, BRow brow, int nb, int kt0, int ntiles,
                                       int preload, float (&acc)[FM][FN][4]) {
    using Q = mm::Fmt<WT>;
    using T = Tile<Q, KB>;
    constexpr int BM = 16 * FM * WM, BN = 8 * FN * WN, THREADS = 32 * WM * WN;
    constexpr int RS = T::RS, BCODES = BM * RS, BSCALES = BCODES + BN * T::BROW;
    constexpr int STAGE = BSCALES + BN * T::BDS;
    using C = Conv<WT, BM, KB>;
    static_assert(NS >= 2, "a ring of two stages at least");
    const int tid = threadIdx.x;

    // K tile kt (of the block's slice) into stage st: the weights' blocks of each row ...
    // (the granules that cover them: lead() bytes before the first block where K tiles are not whole granules)
    auto lead = [&](int kt) { return T::ALIGNED ? 0 : (kt0 + kt) * KB / T::STEPS * Q::BYTES % 16; };
    auto issue_a = [&](int kt, u8* st) {
        const int j0 = (kt0 + kt) * KB, kb = min(KB, nb - j0);
        const int at = j0 / T::STEPS * Q::BYTES - lead(kt);
        const int wg = (lead(kt) + kb / T::STEPS * Q::BYTES + (T::ALIGNED ? 0 : 15)) / 16;
        for (od::Walk w(tid, THREADS, wg); w.row < BM; w.next()) {
            const u8* src = wa + static_cast<long long>(min(m0 + w.row, M - 1)) * a_row + at + 16 * w.col;
            od::cp_async16(od::smem_addr(st + w.row * RS + 16 * w.col), src);
        }
    };
    // ... and b's codes (two half-runs) and scales of each column
    auto issue_b = [&](int kt, u8* st) {
        const int j0 = (kt0 + kt) * KB, kb = min(KB, nb - j0);
        const int bg = 2 * kb + kb / 2;  // granules a column: codes, then scales (kb is even)
        for (od::Walk w(tid, THREADS, bg); w.row < BN; w.next()) {
            const int c = w.row, x = w.col;
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
        __syncthreads();  // tile kt landed for every thread; every warp is done with tile kt - 1's stage (and
                          // converted tile)
        if (kt + NS - 1 < ntiles) {
            u8* const next = smem + ((kt + NS - 1) % NS) * STAGE;
            issue_a(kt + NS - 1, next);
            issue_b(kt + NS - 1, next);
        }
        od::cp_async_commit();
        const u8* const st = smem + (kt % NS) * STAGE;
        const u8* const wst = st + lead(kt);  // the K tile's first block of row 0
        const int kb = min(KB, nb - (kt0 + kt) * KB);
        u8* const ac = smem + NS * STAGE;  // A8: the converted tile
        if constexpr (A8) {
            // fragment w = f * KB + j (16-row tile f, step j) by warp w % WARPS (WN divides KB: as many a warp)
            constexpr int WARPS = WM * WN;
            static_assert(C::FRAGS % WARPS == 0, "whole fragments a warp");
#pragma unroll
            for (int q = 0; q < C::FRAGS / WARPS; ++q) {
                const int w = warp + q * WARPS, f = w / KB, j = w % KB;
                if (j < kb) {
                    const u8* r0 = wst + (16 * f + g) * RS;
                    AFrag af;
                    a_frag<WT, KB>(r0, r0 + 8 * RS, j, t, af);
                    C::put(ac, w, lane, af);
                }
            }
            __syncthreads();  // the converted tile is whole
        }
#pragma unroll 2
        for (int j = 0; j < kb; ++j) {
            // the weights' K step j: A fragments and their scales, rows g and g + 8 of each 16-row tile
            AFrag af[FM];
#pragma unroll
            for (int fm = 0; fm < FM; ++fm) {
                if constexpr (A8) {
                    C::get(ac, (row0 / 16 + fm) * KB + j, lane, af[fm]);
                } else {
                    const u8* r0 = wst + (row0 + 16 * fm + g) * RS;
                    a_frag<WT, KB>(r0, r0 + 8 * RS, j, t, af[fm]);
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
                    step_acc<WT>(acc[fm][fn], af[fm], b0, b1, s0, s1);
                }
            }
        }
    }
    od::cp_async_wait<0>();  // only empty groups can be left
}

}  // namespace mq
