// The mul_mat_id mat-vec kernels (few tokens, the experts chosen on the device): see mmv.cu for
// the weights' layouts and mmv_common.cuh for the shared tile code.
//
// Kernels:
//   mmv_id, mmvq_id
//                  mul_mat_id, one (token, slot) pair a block: grid (row tiles, U, T),
//                  the expert read from ids on the device (no host synchronization).
//   moe_route      mul_mat_id, larger batches: one block groups the (token, slot) pairs
//                  by expert into a scratch table (counts, starts, pair list; for mmq_id.cu
//                  also its column tiles).
//   mmv_id_grouped, mmvq_id_grouped
//                  then one block per (row tile, active expert): grid (row tiles,
//                  min(E, T*U)); each block runs its expert's pairs NT at a time.
//
// Sizes are ints, byte strides long long. Rows past M (the last tile) read the
// tile's last row again and write nothing. An expert id outside [0, E) writes NaN rows and is
// recorded in the error word (od::index_ok, OD_INDEX_CHECK_PARAMS last: mmv_id, mmvq_id, moe_route).

#include "mmv_common.cuh"

// mul_mat_id for one (token t, slot u) a block: out[t, u, m] = as[ids[t, u], m, :] . b[t, u % Ub, :].
// as0 (and as1 for EPI_GLU) experts e_stride bytes apart; ids i32 with byte strides
// ids_t, ids_u; b rows b_t, b_u bytes apart; out contiguous (T, U, M); biases
// (EPI_BIAS, EPI_GLU) rows of bias_e bytes a expert.
template <int WT, int TB, int R, bool VEC, int EPI>
__global__ void __launch_bounds__(mm::BLOCK) mmv_id(const u8* as0, const u8* as1, long long a_row, long long a_e,
                                                    int E, const u8* ids, long long ids_t, long long ids_u,
                                                    const u8* b, long long b_t, long long b_u, int Ub, long long b_es,
                                                    float* out, int M, int K, const float* bias0, const float* bias1,
                                                    long long bias_e, int glu_kind, float alpha, float limit,
                                                    OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    constexpr int NW = EPI == EPI_GLU ? 2 : 1;
    __shared__ float res[NW * R];
    const int u = blockIdx.y, t = blockIdx.z, U = gridDim.y;
    const int m0 = blockIdx.x * R;
    const int rows = min(R, M - m0);
    const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
    float* o = out + (static_cast<long long>(t) * U + u) * M + m0;
    if (!od::index_ok(e, E, err_word, err_tag, static_cast<long long>(t) * U + u)) {
        if (threadIdx.x < rows) {
            o[threadIdx.x] = __int_as_float(0x7fc00000);  // NaN: the id is out of range
        }
        return;
    }
    const u8* a[NW];
    a[0] = as0 + e * a_e + m0 * a_row;
    if constexpr (NW == 2) {
        a[1] = as1 + e * a_e + m0 * a_row;
    }
    const u8* bcol[1] = {b + t * b_t + (u % Ub) * b_u};
    mm::mmv_tile<WT, TB, 1, R, VEC, NW>(a, a_row, rows, bcol, 1, b_es, K, res);
    const int r = threadIdx.x;
    if (r < rows) {
        const long long boff = e * bias_e / 4;
        const float* b0 = bias0 != nullptr ? bias0 + boff : nullptr;
        const float* b1 = bias1 != nullptr ? bias1 + boff : nullptr;
        o[r] = mm::finish<EPI, R, 1>(res, r, 0, b0, b1, m0 + r, glu_kind, alpha, limit);
    }
}

// mul_mat_id with block-format experts, one (token t, slot u) a block: as mmv_id, QROWS / NW
// rows a block; b (T, Ub, K) quantized by quantize_q8_1 (row t * Ub + u % Ub, nbp blocks a row);
// grid (ceil(M / rows), U, T), 32..QTHREADS threads.
template <int WT, int EPI>
__global__ void __launch_bounds__(mm::QTHREADS) mmvq_id(const u8* as0, const u8* as1, long long a_row, long long a_e,
                                                        int E, const u8* ids, long long ids_t, long long ids_u,
                                                        const u8* bq, const u8* bds, int nbp, int Ub, float* out,
                                                        int M, int K, const float* bias0, const float* bias1,
                                                        long long bias_e, int glu_kind, float alpha, float limit,
                                                        OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    constexpr int NW = EPI == EPI_GLU ? 2 : 1, RB = mm::QROWS / NW;
    const int u = blockIdx.y, t = blockIdx.z, U = gridDim.y;
    const int m0 = blockIdx.x * RB;
    const int rows = min(RB, M - m0);
    const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
    float* const ocol[1] = {out + (static_cast<long long>(t) * U + u) * M};
    if (!od::index_ok(e, E, err_word, err_tag, static_cast<long long>(t) * U + u)) {
        if (threadIdx.x < rows) {
            ocol[0][m0 + threadIdx.x] = __int_as_float(0x7fc00000);  // NaN: the id is out of range
        }
        return;
    }
    const u8* a[NW];
    a[0] = as0 + e * a_e + m0 * a_row;
    if constexpr (NW == 2) {
        a[1] = as1 + e * a_e + m0 * a_row;
    }
    const u8* row[mm::QROWS];
    mm::q_streams<NW>(a, a_row, rows, row);
    const long long r = static_cast<long long>(t) * Ub + u % Ub;
    const u8* const bcol[1] = {bq + r * nbp * 32};
    const float2* const dcol[1] = {reinterpret_cast<const float2*>(bds) + r * nbp};
    float acc[mm::QROWS][1];
    mm::q_rows<WT, 1>(row, bcol, dcol, K / 32, acc);
    const float* tot = mm::q_reduce<1>(acc);
    const long long boff = e * bias_e / 4;
    mm::q_store<EPI, 1>(tot, ocol, 1, m0, rows, bias0 != nullptr ? bias0 + boff : nullptr,
                        bias1 != nullptr ? bias1 + boff : nullptr, 0, 0, glu_kind, alpha, limit);
}

// The routing table of mul_mat_id's grouped paths, in int32 words of `route`:
//   [0] the number S of experts used; [1, 1+E) their ids; [1+E, 1+2E) where each
//   one's pairs start; [1+2E, 1+3E) how many it has; [1+3E, 1+3E+T*U) the pairs
//   p = t * U + u, grouped by expert (in no particular order inside a group).
// With tile_n > 0 (mmq_id's column tiles), then the tile table: [1+3E+T*U] the number of
//   tiles, and from 2+3E+T*U three words a tile (expert, the position of its first pair in
//   the pair list, its pairs): each used expert's pairs cut in ceil(count / tile_n) tiles of
//   tile_n pairs (its last one fewer), expert by expert in ascending order. There are at most
//   ceil(T*U / tile_n) + min(E, T*U) tiles, whatever the ids: a grid of that many column tiles
//   is fixed by the shapes (mmq_id's blocks past the table's count exit).
// One block of ROUTE_BLOCK threads; dynamic shared memory 2 * E ints. Pairs with
// an id outside [0, E) get a NaN output row here and are left out of the table.
constexpr int ROUTE_BLOCK = 1024;
constexpr int ROUTE_PER_THREAD = 4;  // experts a thread scans: E <= ROUTE_BLOCK * ROUTE_PER_THREAD

extern "C" __global__ void __launch_bounds__(ROUTE_BLOCK) moe_route(const u8* ids, long long ids_t, long long ids_u,
                                                                    int T, int U, int E, int* route, float* out,
                                                                    int M, int tile_n, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    extern __shared__ int smem[];
    int* count = smem;
    int* cursor = smem + E;
    __shared__ int warp_sums[ROUTE_BLOCK / od::WARP_SIZE][3];
    const int tid = threadIdx.x;
    const int pairs = T * U;
    for (int e = tid; e < E; e += ROUTE_BLOCK) {
        count[e] = 0;
    }
    __syncthreads();
    for (int p = tid; p < pairs; p += ROUTE_BLOCK) {
        const int t = p / U, u = p % U;
        const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
        if (od::index_ok(e, E, err_word, err_tag, p)) {
            atomicAdd(&count[e], 1);
        } else {
            for (int m = 0; m < M; ++m) {
                out[static_cast<long long>(p) * M + m] = __int_as_float(0x7fc00000);
            }
        }
    }
    __syncthreads();
    // Exclusive scan over experts of (pairs, used, tiles): each thread owns ROUTE_PER_THREAD consecutive experts.
    const int e0 = tid * ROUTE_PER_THREAD;
    auto tiles_of = [&](int c) { return tile_n > 0 ? (c + tile_n - 1) / tile_n : 0; };
    int own_pairs = 0, own_used = 0, own_tiles = 0;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_THREAD; ++j) {
        const int c = e0 + j < E ? count[e0 + j] : 0;
        own_pairs += c;
        own_used += c > 0;
        own_tiles += tiles_of(c);
    }
    const int lane = tid % od::WARP_SIZE, warp = tid / od::WARP_SIZE;
    int sp = own_pairs, su = own_used, st = own_tiles;  // inclusive warp scan
#pragma unroll
    for (int off = 1; off < od::WARP_SIZE; off <<= 1) {
        const int xp = __shfl_up_sync(od::FULL_MASK, sp, off);
        const int xu = __shfl_up_sync(od::FULL_MASK, su, off);
        const int xt = __shfl_up_sync(od::FULL_MASK, st, off);
        if (lane >= off) {
            sp += xp;
            su += xu;
            st += xt;
        }
    }
    if (lane == od::WARP_SIZE - 1) {
        warp_sums[warp][0] = sp;
        warp_sums[warp][1] = su;
        warp_sums[warp][2] = st;
    }
    __syncthreads();
    int before_p = 0, before_u = 0, before_t = 0, total_u = 0, total_t = 0;
    for (int w = 0; w < ROUTE_BLOCK / od::WARP_SIZE; ++w) {
        if (w < warp) {
            before_p += warp_sums[w][0];
            before_u += warp_sums[w][1];
            before_t += warp_sums[w][2];
        }
        total_u += warp_sums[w][1];
        total_t += warp_sums[w][2];
    }
    int start = before_p + sp - own_pairs, slot = before_u + su - own_used, tile = before_t + st - own_tiles;
    int* used_expert = route + 1;
    int* used_start = route + 1 + E;
    int* used_count = route + 1 + 2 * E;
    int* tiles = route + 2 + 3 * E + pairs;  // with tile_n > 0: (expert, first, count) a tile
    for (int j = 0; j < ROUTE_PER_THREAD && e0 + j < E; ++j) {
        const int c = count[e0 + j];
        cursor[e0 + j] = start;
        if (c > 0) {
            used_expert[slot] = e0 + j;
            used_start[slot] = start;
            used_count[slot] = c;
            ++slot;
        }
        for (int f = 0; f < tiles_of(c); ++f, ++tile) {
            tiles[3 * tile] = e0 + j;
            tiles[3 * tile + 1] = start + f * tile_n;
            tiles[3 * tile + 2] = min(tile_n, c - f * tile_n);
        }
        start += c;
    }
    if (tid == 0) {
        route[0] = total_u;
        if (tile_n > 0) {
            tiles[-1] = total_t;
        }
    }
    __syncthreads();
    int* list = route + 1 + 3 * E;
    for (int p = tid; p < pairs; p += ROUTE_BLOCK) {
        const int t = p / U, u = p % U;
        const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
        if (od::index_ok(e, E, err_word, err_tag, p)) {  // as counted above (a bad id is recorded already)
            list[atomicAdd(&cursor[e], 1)] = p;
        }
    }
}

// mul_mat_id, grouped: block (row tile, slot s) runs the pairs of the s-th expert
// used (moe_route's table), NT at a time. EPI_NONE or EPI_BIAS (bias rows of bias_e bytes).
template <int WT, int TB, int NT, int R, bool VEC, int EPI>
__global__ void __launch_bounds__(mm::BLOCK) mmv_id_grouped(const u8* as, long long a_row, long long a_e, int E,
                                                            const int* route, const u8* b, long long b_t,
                                                            long long b_u, int Ub, long long b_es, float* out, int M,
                                                            int K, int U, const float* bias, long long bias_e) {
    od::grid_enter();
    __shared__ float res[R * NT];
    const int s = blockIdx.y;
    if (s >= route[0]) {
        return;
    }
    const int e = route[1 + s], first = route[1 + E + s], count = route[1 + 2 * E + s];
    const int* list = route + 1 + 3 * E + first;
    const int m0 = blockIdx.x * R;
    const int rows = min(R, M - m0);
    const u8* a[1] = {as + e * a_e + m0 * a_row};
    for (int g = 0; g < count; g += NT) {
        const int ncols = min(NT, count - g);
        const u8* bcol[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int p = list[g + (n < ncols ? n : 0)];
            bcol[n] = b + (p / U) * b_t + ((p % U) % Ub) * b_u;
        }
        mm::mmv_tile<WT, TB, NT, R, VEC, 1>(a, a_row, rows, bcol, ncols, b_es, K, res);
        const int t = threadIdx.x;
        if (t < R * NT) {
            const int r = t / NT, n = t % NT;
            if (r < rows && n < ncols) {
                const int p = list[g + n];
                const int m = m0 + r;
                float v = res[r * NT + n];
                if constexpr (EPI == EPI_BIAS) {
                    v += bias[e * bias_e / 4 + m];
                }
                out[static_cast<long long>(p) * M + m] = v;
            }
        }
    }
}

// mul_mat_id, grouped, block-format experts: as mmv_id_grouped, QROWS rows a block (q_rows),
// b (T, Ub, K) quantized by quantize_q8_1 (pair p = t * U + u reads row t * Ub + u % Ub);
// grid (ceil(M / QROWS), min(E, T*U)), 32..QTHREADS threads.
template <int WT, int NT, int EPI>
__global__ void __launch_bounds__(mm::QTHREADS) mmvq_id_grouped(const u8* as, long long a_row, long long a_e, int E,
                                                                const int* route, const u8* bq, const u8* bds,
                                                                int nbp, int Ub, float* out, int M, int K, int U,
                                                                const float* bias, long long bias_e) {
    od::grid_enter();
    const int s = blockIdx.y;
    if (s >= route[0]) {
        return;
    }
    const int e = route[1 + s], first = route[1 + E + s], count = route[1 + 2 * E + s];
    const int* list = route + 1 + 3 * E + first;
    const int m0 = blockIdx.x * mm::QROWS;
    const int rows = min(mm::QROWS, M - m0);
    const u8* const a[1] = {as + e * a_e + m0 * a_row};
    const u8* row[mm::QROWS];
    mm::q_streams<1>(a, a_row, rows, row);
    const float* bias_e_row = bias != nullptr ? bias + e * bias_e / 4 : nullptr;
    for (int g = 0; g < count; g += NT) {
        const int ncols = min(NT, count - g);
        const u8* bcol[NT];
        const float2* dcol[NT];
        float* ocol[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int p = list[g + (n < ncols ? n : 0)];
            const long long r = static_cast<long long>(p / U) * Ub + (p % U) % Ub;
            bcol[n] = bq + r * nbp * 32;
            dcol[n] = reinterpret_cast<const float2*>(bds) + r * nbp;
            ocol[n] = out + static_cast<long long>(p) * M;
        }
        float acc[mm::QROWS][NT];
        mm::q_rows<WT, NT>(row, bcol, dcol, K / 32, acc);
        const float* tot = mm::q_reduce<NT>(acc);
        mm::q_store<EPI, NT>(tot, ocol, ncols, m0, rows, bias_e_row, nullptr, 0, 0, 0, 0.0f, 0.0f);
    }
}

