// Quantized GEMM (mmq): out (B3, B2, N, M) f32 = b (N, K) @ a (M, K)^T for block-format weights a
// and more columns than the mat-vecs take (N > 8), on the int8 tensor cores (mma.sync m16n8k32 s8 ->
// s32), ggml's "mmq" idea. Two launches: quantize_q8_1 (mmv.cu) turns b into int8 codes with a scale
// per 32 values (QB8 layout, mmv_common.cuh), then this kernel. Its fragments and a block's K loop
// (mq::k_loop) live in mmq_tile.cuh, shared with mmq_id.cu (mul_mat_id on gathered b rows); this file
// holds mul_mat's block: which weights and b columns, split K, the output. A K step is 32 values, whose
// int32 dot products are scaled in f32 by the weights' scale(s) for them and b's scale db:
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
// Tiling (template FM, FN, WM, WN, NS, KB, A8): a warp computes 16 FM weight rows x 8 FN columns (FM x FN
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
// nibbles), so no weight is ever written back dequantized; but with template flag A8 (the many-column
// tiles, whose rows WN warps share) the block first decodes each landed K tile once into int8 fragments
// and f32 scales (mmq_common.cuh's Conv: a_frag's output, after the ring; a second __syncthreads a K
// tile), which every warp then loads (16 bytes of codes, 16 of scales a fragment). With `preload` (the
// weights are constant) the first NS - 1 stages' weights are issued before the wait for quantize_q8_1
// (PDL), so that their latency overlaps its tail.
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

#include "mmq_tile.cuh"

using mm::u8;

// mul_mat with block-format weights: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k].
// a rows a_row bytes apart, batch strides a_s2, a_s3 (16-byte multiples, a 16-byte aligned); b
// quantized by quantize_q8_1 (column n of batch (i3, i2) is its row (i3 * B2 + i2) * N + n, nbp
// blocks a row: codes at bq, (d, d * sum) at bds); out contiguous (B3, B2, N, M); bias (null: none) added
// as mq::finish says (one row, bias_col 0, or a residual's rows bias_col floats apart). Grid (tiles_m *
// splits * tiles_n, B2, B3), WM * WN warps, dynamic shared memory mmq_smem (specs/mmq.py). With
// splits > 1: part holds splits * B3 * B2 * N * M floats, counters B3 * B2 * tiles_m * tiles_n ints
// (zero before the launch, and again after it).
template <int WT, int FM, int FN, int WM, int WN, int NS, int KB, bool A8 = false>
__global__ void __launch_bounds__(32 * WM * WN)
    mmq(const u8* a, long long a_row, long long a_s2, long long a_s3, int r2, int r3, const u8* bq, const u8* bds,
        int nbp, float* out, int M, int K, int N, const float* bias, long long bias_col, int tiles_m, int tiles_n,
        int splits, float* part, int* counters, int preload) {
    od::grid_enter_later();  // below: after the first weight copies when the weights are constant
    constexpr int BM = 16 * FM * WM, BN = 8 * FN * WN;
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

    float acc[FM][FN][4];
    mq::k_loop<WT, FM, FN, WM, WN, NS, KB, A8>(smem, wa, a_row, m0, M, bq, bds, nbp,
                                               [&](int c) { return brow0 + min(n0 + c, N - 1); }, nb, kt0,
                                               ntiles, preload, acc);
    const int warp = threadIdx.x / 32;
    const int row0 = warp / WN * 16 * FM, col0 = warp % WN * 8 * FN;  // the warp's tile in the block's

    const long long plane = static_cast<long long>(gridDim.y) * gridDim.z * N * M;
    mq::finish<FM, FN, BM, BN, 32 * WM * WN>(acc, m0 + row0, n0 + col0, m0, n0, M, N, brow0, out, part, split,
                                             splits, plane, counters + (batch * tiles_m + tm) * tiles_n + tn, bias,
                                             bias_col);
}
