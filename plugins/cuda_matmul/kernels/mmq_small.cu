// Quantized mul_mat for few columns (mmq_small): out (B3, B2, N, M) f32 = b (N, K) @ a (M, K)^T for
// block-format weights a and 9 .. 8 NT columns (support.MMQ_SMALL_MAX_N), weight-streaming like
// mmvq_stream but on the int8 tensor cores like mmq (mmq_common.cuh's fragments, scales and epilogue).
// Two launches: quantize_q8_1 (mmv.cu) rounds b to q8_1 (QB8 layout), then this kernel.
//
// Memory-bound at these widths: every weight byte is read once, and the kernel is cut so that the
// weights stream without block-wide barriers:
//   warps   each warp owns WR = 16 FM weight rows (FM m16 mma tiles) and all 8 NT columns (NT n8
//           tiles), over every KW-th K tile of its block's slice: a block is W / KW row groups (BM =
//           W / KW * WR rows) of KW warps (k-groups), warp w row group w / KW and k-group w % KW, taking
//           the slice's K tiles kg, kg + KW, ... KW > 1 cuts the K steps one warp runs in a row, the
//           chain of dependent loads, decodes and mma that bounds a launch at small shapes, by KW.
//   split   K is cut in K tiles of KB steps of 32 values (mq::Tile: KB / STEPS blocks a row), and the
//           K tiles of a row in `splits` contiguous slices, one block each: grid (tiles_m * splits, B2,
//           B3), the slices of a row tile adjacent. specs/mmq_small.py picks splits so that the grid is
//           several blocks an SM (the weights in flight) while each slice keeps a few K tiles.
//   b       the slice's q8_1 codes and (d, d * sum) of the N columns are copied once into shared memory
//           (16-byte loads into registers, 8 a thread in flight, then stores: no cp.async group; the 8 NT - N
//           columns past N are not copied: their products, garbage, are never written; copying column N - 1
//           into them took SMALL_WAVE's q4_0 3072x2048 launch from 8.0 to 16.8 us at 9 columns) and read by
//           every warp as mma B fragments: column c's codes at c * BCOL (step s's 32 codes at 32 s, BCOL an
//           odd number of granules: the 8 columns of a fragment read fall in distinct bank groups), its
//           scales at c * BSCOL (a float2 a step).
//   ring    each warp streams its rows' K tiles through a ring of NS stages of its own in shared
//           memory (cp.async 16 bytes a lane, one group a K tile, wait_group NS - 2 and __syncwarp a
//           K tile, no __syncthreads after b landed): NS - 1 K tiles of loads in flight a warp. A stage
//           holds the warp's WR rows of a K tile as raw blocks, RS bytes apart (mq::Tile: an odd
//           number of granules; a sub-scaled K tile not starting on a granule copies the granules that
//           cover it, its first block `lead` bytes in), and the fragments are decoded from them
//           (mq::a_frag), so no weight is written back dequantized.
//   reduce  KW > 1: each k-group past the first stores its sums in its own ring (its copies done), and
//           after a __syncthreads the first k-group of the row group adds them in k-group order:
//           deterministic; only it writes (mq::finish's owns).
//   finish  splits == 1: straight to out; else each block writes its plane of part and the last block
//           of a row tile adds the planes in split order (mq::finish): deterministic. The bias (not
//           null: one row, bias_col 0, or a residual's rows bias_col floats apart) is added as out is
//           written.
//   pair    a1 not null: a second product of the same b by weights a1 of a's shape and strides (a gate/up
//           pair), written to out1, in the same launch: the grid's x doubles, its second half a1's blocks,
//           with their own planes of part (after a's splits) and counters (after a's). One launch where
//           two would each pay a launch's ramp and tail. A pair takes no bias.
// With `preload` (constant weights) the first NS - 1 K tiles' copies are issued before the PDL wait
// for quantize_q8_1, a cp.async group each, so that a warp's first K tile waits for that tile's copies only.
// Requirements (support.mmq_small_ok, as mmq's): rows of whole 16-byte chunks (specs/stream.py's
// STREAMED), a 16-byte aligned; a slice holds at most kts K tiles (the b copy's size, a launch
// argument); the last K tile may be short (whole chunks). Rows past M read row M - 1 and write nothing.
// Dynamic shared memory (specs/mmq_small.py's small_smem): 8 NT (BCOL + BSCOL) + W NS WR RS bytes.

#include "mmq_common.cuh"

using mm::u8;

// Blocks of W warps an SM the launch bound asks for: 16 warps, 128 registers a thread (without a block count
// ptxas held the sub-scaled formats to 64 registers and spilled).
template <int W>
constexpr int SMALL_MIN_BLOCKS = W >= 16 ? 1 : 16 / W;

template <int WT, int NT, int FM, int W, int NS, int KB, int KW>
__global__ void __launch_bounds__(32 * W, SMALL_MIN_BLOCKS<W>)
    mmq_small(const u8* a, long long a_row, long long a_s2, long long a_s3, int r2, int r3, const u8* bq,
              const u8* bds, int nbp, float* out, int M, int K, int N, const float* bias, long long bias_col,
              int tiles_m, int splits, int kts, float* part, int* counters, int preload, const u8* a1,
              float* out1) {
    od::grid_enter_later();  // below: after the first weight copies when the weights are constant
    using Q = mm::Fmt<WT>;
    using T = mq::Tile<Q, KB>;
    constexpr int WR = 16 * FM, BM = WR * (W / KW), NP = 8 * NT, RS = T::RS, STAGE = WR * RS;
    // a K tile's steps unrolled whole (every b and weight address a constant offset: fewer instructions) where
    // a warp has at most two mma tiles; by two at four (whole, ptxas spilled the K-quants at 128 registers)
    constexpr int STEP_UNROLL = FM * NT <= 2 ? KB : 2;
    static_assert(NS >= 2, "a ring of two stages at least");
    static_assert(W % KW == 0, "whole row groups of KW warps");
    static_assert(FM * NT * 32 * 16 <= NS * STAGE, "a warp's sums fit its ring (the k-groups' reduction)");
    extern __shared__ uint4 smem_u4[];
    u8* const smem = reinterpret_cast<u8*>(smem_u4);

    const int per = tiles_m * splits, second = static_cast<int>(blockIdx.x) >= per;  // a1's block (pair)
    const int bx = static_cast<int>(blockIdx.x) - second * per;
    const int split = bx % splits, tm = bx / splits;
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int kg = warp % KW;                   // the warp's k-group: K tiles kg, kg + KW, ... of the slice
    const int row0 = tm * BM + warp / KW * WR;  // the warp's first row
    const u8* const wa = (second ? a1 : a) + (i3 / r3) * a_s3 + (i2 / r2) * a_s2;
    const long long batch = static_cast<long long>(i3) * gridDim.y + i2;
    const long long brow0 = batch * N;
    const int nb = K / 32, nkt = (nb + KB - 1) / KB;
    const int kt0 = static_cast<int>(static_cast<long long>(split) * nkt / splits);
    const int ntiles = static_cast<int>(static_cast<long long>(split + 1) * nkt / splits) - kt0;  // <= kts
    const int mine = ntiles > kg ? (ntiles - kg + KW - 1) / KW : 0;  // the warp's K tiles: kg + KW i, i < mine
    const int bcol = kts * KB * 32 + 16, bscol = kts * KB * 8 + 16;  // odd granules (KB % 8 == 0)
    u8* const bcodes = smem;
    u8* const bscales = bcodes + NP * bcol;
    u8* const ring = bscales + NP * bscol + warp * NS * STAGE;

    // K tile kt of the slice (the warp's i-th: kt = kg + KW i) into stage st: the warp's rows' blocks (the
    // granules that cover them, lead() bytes before the first block where K tiles are not whole granules)
    auto lead = [&](int kt) { return T::ALIGNED ? 0 : (kt0 + kt) * KB / T::STEPS * Q::BYTES % 16; };
    auto issue = [&](int kt, u8* st) {
        const int j0 = (kt0 + kt) * KB, kb = min(KB, nb - j0);
        const int at = j0 / T::STEPS * Q::BYTES - lead(kt);
        const int wg = (lead(kt) + kb / T::STEPS * Q::BYTES + (T::ALIGNED ? 0 : 15)) / 16;
        for (od::Walk w(lane, 32, wg); w.row < WR; w.next()) {
            const u8* src = wa + static_cast<long long>(min(row0 + w.row, M - 1)) * a_row + at + 16 * w.col;
            od::cp_async16(od::smem_addr(st + w.row * RS + 16 * w.col), src);
        }
    };

    float acc[FM][NT][4];
#pragma unroll
    for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
        for (int fn = 0; fn < NT; ++fn) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[fm][fn][i] = 0.0f;
            }
        }
    }

    // the first NS - 1 K tiles' copies, a group each: before the PDL wait for quantize_q8_1 when the weights are
    // constant, after it else
    auto first_stages = [&] {
#pragma unroll
        for (int s = 0; s < NS - 1; ++s) {
            if (s < mine) {
                issue(kg + KW * s, ring + s * STAGE);
            }
            od::cp_async_commit();
        }
    };
    if (preload) {
        first_stages();
    }
    od::grid_enter();
    if (!preload) {
        first_stages();
    }
    {  // b's codes (QB8's two half-runs of each step) and scales for the slice, columns < N, through registers
       // (8 granules a thread in flight): a cp.async group of its own would complete only after the weight
       // groups before it, so that the first K tile would wait for every preloaded one (H200, 2026-12-03)
        const int j0 = kt0 * KB, ns = min(ntiles * KB, nb - j0);  // steps of the slice (even: nb is)
        const int cg = 2 * ns + ns / 2;                              // granules a column
        const int nc = min(N, NP);
        for (od::Walk w(tid, 32 * W, cg); w.row < nc;) {
            uint4 v[8];
            u8* dst[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                dst[j] = nullptr;
                if (w.row < nc) {
                    const int c = w.row, x = w.col;
                    const long long row = brow0 + c;
                    const u8* src;
                    if (x < 2 * ns) {
                        src = bq + row * nbp * 32 + mm::QB8::half(j0 + x / 2, x % 2);
                        dst[j] = bcodes + c * bcol + 16 * x;
                    } else {
                        src = bds + (row * nbp + j0) * 8 + 16 * (x - 2 * ns);
                        dst[j] = bscales + c * bscol + 16 * (x - 2 * ns);
                    }
                    v[j] = __ldcg(reinterpret_cast<const uint4*>(src));
                    w.next();
                }
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (dst[j] != nullptr) {
                    *reinterpret_cast<uint4*>(dst[j]) = v[j];
                }
            }
        }
    }
    __syncthreads();  // b is whole

    for (int i = 0; i < mine; ++i) {
        od::cp_async_wait<NS - 2>();
        __syncwarp();  // the warp's K tile i landed for every lane; every lane is done with tile i - 1's stage
        if (i + NS - 1 < mine) {
            issue(kg + KW * (i + NS - 1), ring + (i + NS - 1) % NS * STAGE);
        }
        od::cp_async_commit();
        const int kt = kg + KW * i;
        const u8* const wst = ring + i % NS * STAGE + lead(kt);
        const int kb = min(KB, nb - (kt0 + kt) * KB);
#pragma unroll STEP_UNROLL
        for (int j = 0; j < KB; ++j) {
            if (j >= kb) {
                break;
            }
            mq::AFrag af[FM];
#pragma unroll
            for (int fm = 0; fm < FM; ++fm) {
                const u8* r0 = wst + (16 * fm + g) * RS;
                mq::a_frag<WT, KB>(r0, r0 + 8 * RS, j, t, af[fm]);
            }
            const int s = kt * KB + j;  // the step in the slice
#pragma unroll
            for (int fn = 0; fn < NT; ++fn) {
                const u8* bc = bcodes + (8 * fn + g) * bcol + 32 * s + 4 * t;
                const unsigned b0 = *reinterpret_cast<const unsigned*>(bc);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(bc + 16);
                const u8* bs = bscales + (8 * fn + 2 * t) * bscol + 8 * s;
                const float2 s0 = *reinterpret_cast<const float2*>(bs);
                const float2 s1 = *reinterpret_cast<const float2*>(bs + bscol);
#pragma unroll
                for (int fm = 0; fm < FM; ++fm) {
                    mq::step_acc<WT>(acc[fm][fn], af[fm], b0, b1, s0, s1);
                }
            }
        }
    }
    od::cp_async_wait<0>();  // only empty groups can be left
    if constexpr (KW > 1) {
        __syncwarp();  // every lane is done reading the warp's ring
        float4* const sums = reinterpret_cast<float4*>(ring);
        if (kg > 0) {
#pragma unroll
            for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
                for (int fn = 0; fn < NT; ++fn) {
                    const float(&a)[4] = acc[fm][fn];
                    sums[(fm * NT + fn) * 32 + lane] = make_float4(a[0], a[1], a[2], a[3]);
                }
            }
        }
        __syncthreads();
        if (kg == 0) {
            for (int k = 1; k < KW; ++k) {
                const float4* const other = reinterpret_cast<const float4*>(ring + k * NS * STAGE);  // warp + k's
#pragma unroll
                for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
                    for (int fn = 0; fn < NT; ++fn) {
                        const float4 x = other[(fm * NT + fn) * 32 + lane];
                        acc[fm][fn][0] += x.x;
                        acc[fm][fn][1] += x.y;
                        acc[fm][fn][2] += x.z;
                        acc[fm][fn][3] += x.w;
                    }
                }
            }
        }
    }

    const long long batches = static_cast<long long>(gridDim.y) * gridDim.z, plane = batches * N * M;
    float* const planes = splits > 1 ? part + second * splits * plane : part;  // this product's
    mq::finish<FM, NT, BM, NP, 32 * W>(acc, row0, 0, tm * BM, 0, M, N, brow0, second ? out1 : out, planes, split,
                                       splits, plane, counters + (second * batches + batch) * tiles_m + tm, bias,
                                       bias_col, kg == 0);
}
