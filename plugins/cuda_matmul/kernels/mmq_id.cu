// mul_mat_id with many tokens on the quantized GEMM (mmq_id, MoE prefill and batched decode):
// out[t, u, :] = as[ids[t, u]] @ b[t, u % Ub] for block-format experts, in three launches, none of which
// syncs with the host: moe_route (mmv_id.cu) groups the (token, slot) pairs by expert and cuts each
// expert's pairs in column tiles of at most BN pairs (its tile table, tile_n = BN); quantize_q8_1 (mmv.cu)
// rounds b's T * Ub rows to q8_1; then here a block takes one BM-row tile of one column tile: expert e's
// weight rows and, as its b columns, the q8_1 rows of the tile's pairs (pair p = t * U + u reads row
// t * Ub + u % Ub), through mmq's K loop (mmq_tile.cuh: the same ring, fragments and mma as mul_mat's
// mmq), and writes each column's sums to its pair's output row (plus e's bias row for a fused add_id).
//
// Grid (tiles_m * max_tiles), the column tile fastest: max_tiles = ceil(T U / BN) + min(E, T U) bounds the
// tiles of any routing (each used expert adds at most one partial tile), so the grid depends on the shapes
// alone and a CUDA graph replays it whatever the ids; a block past the table's tile count exits. No split
// K: with T U > 8 E (support.MMQ_ID_PAIRS_PER_EXPERT) the grid has tiles_m blocks an expert at least.
//
// Requirements (support.mmq_id_ok): mmq's (the experts' rows whole 16-byte chunks, 16-byte aligned).
// Rows past M read row M - 1 and write nothing; a tile's columns past its pairs read its last pair's b
// row and write nothing. An expert id outside [0, E) is left out of the table by moe_route, which writes
// that pair's NaN row.

#include "mmq_tile.cuh"

using mm::u8;

// The experts as rows a_row bytes apart, experts a_e bytes apart (16-byte multiples, as 16-byte aligned);
// route: moe_route's table for E experts and `pairs` = T * U pairs, with tile_n = BN; b quantized by
// quantize_q8_1 (nbp blocks a row: codes at bq, (d, d * sum) at bds); out contiguous (T, U, M); bias
// (EPI of add_id) rows of bias_e bytes an expert, or null. Grid (tiles_m * max_tiles), WM * WN warps,
// dynamic shared memory mmq_id_smem (specs/mmq_id.py): the tile's pairs and b rows (BN ints each), then
// the ring.
template <int WT, int FM, int FN, int WM, int WN, int NS, int KB, bool A8 = false>
__global__ void __launch_bounds__(32 * WM * WN)
    mmq_id(const u8* as, long long a_row, long long a_e, int E, const int* route, int pairs, int max_tiles, int U,
           int Ub, const u8* bq, const u8* bds, int nbp, float* out, int M, int K, const float* bias,
           long long bias_e) {
    od::grid_enter();  // the table (moe_route) and b's q8_1 rows (quantize_q8_1) come from the kernels before
    constexpr int BM = 16 * FM * WM, BN = 8 * FN * WN, THREADS = 32 * WM * WN;
    extern __shared__ uint4 smem_u4[];
    u8* const smem = reinterpret_cast<u8*>(smem_u4);

    int* const pair = reinterpret_cast<int*>(smem);  // column c's pair (its output row) ...
    int* const brow = pair + BN;                      // ... and its q8_1 b row
    int e, n;
    if (!mq::pair_tile<BN, THREADS>(route, E, pairs, static_cast<int>(blockIdx.x % max_tiles), U, Ub, pair, brow, e,
                                    n)) {
        return;
    }
    const int tm = static_cast<int>(blockIdx.x / max_tiles);
    const int m0 = tm * BM, nb = K / 32;
    float acc[FM][FN][4];
    mq::k_loop<WT, FM, FN, WM, WN, NS, KB, A8>(smem + 8 * BN, as + e * a_e, a_row, m0, M, bq, bds, nbp,
                                               [&](int c) { return static_cast<long long>(brow[c]); }, nb, 0,
                                               (nb + KB - 1) / KB, 0, acc);
    const int warp = threadIdx.x / 32;
    mq::store_pairs<FM, FN>(acc, m0 + warp / WN * 16 * FM, warp % WN * 8 * FN, M, n, pair, out,
                            bias != nullptr ? bias + e * bias_e / 4 : nullptr);
}
