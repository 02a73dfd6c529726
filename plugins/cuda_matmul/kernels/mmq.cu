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

#include "mmq_common.cuh"


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
            // the weights' K step j: A fragments and their scales, rows g and g + 8 of each 16-row tile
            mq::AFrag af[FM];
#pragma unroll
            for (int fm = 0; fm < FM; ++fm) {
                const u8* r0 = wst + (row0 + 16 * fm + g) * RS;
                mq::a_frag<WT, KB>(r0, r0 + 8 * RS, j, t, af[fm]);
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
                    mq::step_acc<WT>(acc[fm][fn], af[fm], b0, b1, s0, s1);
                }
            }
        }
    }
    od::cp_async_wait<0>();  // only empty groups can be left

    const long long plane = static_cast<long long>(gridDim.y) * gridDim.z * N * M;
    mq::finish<FM, FN>(acc, m0 + row0, n0 + col0, M, N, brow0, out, part, split, splits, plane,
                       counters + (batch * tiles_m + tm) * tiles_n + tn);
}
