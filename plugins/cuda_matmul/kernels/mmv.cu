// Mat-vec kernels: out (N, M) = b (N, K) @ a (M, K)^T for a few columns N <= NT (<= 8),
// the weights a read once (ggml's mmvf/mmvq idea).
//
// Float weights (f32/f16/bf16, mmv*): a block of BLOCK threads computes R consecutive rows
// of a against up to NT columns of b (f32/f16/bf16): the threads split K in units of 8
// values (mm_common.cuh), each keeps NW * R * NT float partial sums, and the block reduces
// them (warp shuffles, then shared memory).
// Block-format weights (mmvq*): b is first quantized to int8 with a scale per 32 values
// (quantize_q8_1, one launch per node), then a block of up to QTHREADS threads computes QROWS
// rows streaming the weights straight from global memory (q_rows), integer dot products (dp4a).
//
// Kernels:
//   quantize_q8_1  b rows to int8 codes and per-32 scales for the mmvq* kernels.
//   mmv, mmvq      mul_mat: grid (row tiles, B2, B3), a's batch repeat-interleaved
//                  (b batch i2 uses a batch i2 / r2), optional bias or GLU epilogue.
//   mmv_id, mmvq_id
//                  mul_mat_id, one (token, slot) pair a block: grid (row tiles, U, T),
//                  the expert read from ids on the device (no host synchronization).
//   moe_route      mul_mat_id, larger batches: one block groups the (token, slot) pairs
//                  by expert into a scratch table (counts, starts, pair list).
//   mmv_id_grouped, mmvq_id_grouped
//                  then one block per (row tile, active expert): grid (row tiles,
//                  min(E, T*U)); each block runs its expert's pairs NT at a time.
//
// Sizes are ints, byte strides long long. Rows past M (the last tile) read the
// tile's last row again and write nothing. An expert id outside [0, E) writes NaN rows.

#include "mm_common.cuh"

namespace mm {

constexpr int BLOCK = 128;
constexpr int NWARPS = BLOCK / od::WARP_SIZE;

// Sum of NW * R * NT partials over the block into res[] (shared), visible to all threads after return.
template <int NV>
__device__ __forceinline__ void block_reduce(float (&acc)[NV], float* res) {
    __shared__ float part[NWARPS][NV];
    const int lane = threadIdx.x % od::WARP_SIZE, warp = threadIdx.x / od::WARP_SIZE;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        acc[i] = od::warp_sum(acc[i]);
    }
    __syncthreads();  // an earlier call may still read part[] or res[]
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            part[warp][i] = acc[i];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < NV; i += BLOCK) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            s += part[w][i];
        }
        res[i] = s;
    }
    __syncthreads();
}

// res[(w * R + r) * NT + n] = sum_k a_w[row r][k] * b[col n][k] for rows r < rows
// (row r at a[w] + r * a_row; rows past `rows` read the last valid row again,
// their sums unspecified) and columns n < ncols (columns past ncols give
// unspecified sums; their pointers must be valid).
// Waits for the kernel before (od::grid_enter) before reading b; with `preload` (the weights are
// constant: no kernel writes them) the first unit's weights are loaded before that wait, so that
// their memory latency overlaps the previous kernel's tail (programmatic dependent launch).
template <int WT, int TB, int NT, int R, bool VEC, int NW>
__device__ __forceinline__ void mmv_tile(const u8* const (&a)[NW], long long a_row, int rows,
                                         const u8* const (&bcol)[NT], int ncols, long long b_es, int K, float* res,
                                         bool preload = false) {
    const u8* arow[NW][R];
#pragma unroll
    for (int w = 0; w < NW; ++w) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            arow[w][r] = a[w] + (r < rows ? r : rows - 1) * a_row;
        }
    }
    static_assert(!Fmt<WT>::QUANT, "block-format weights take q_rows");
    float acc[NW * R * NT];
#pragma unroll
    for (int i = 0; i < NW * R * NT; ++i) {
        acc[i] = 0.0f;
    }
    if constexpr (VEC) {
        // Float rows with 16-byte loads (K % 8 == 0, rows 16-byte aligned), b f32/f16/bf16.
        const int units = K / 8;
        // acc += the unit's weights c (row w * R + r) times b's values of unit u
        auto dot_unit = [&](int u, const float (&c)[NW * R][8]) {
            const int2 k = unit_k<WT>(u);
            float bv[NT][8];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                if (n < ncols) {
                    const float4 x = load_b4<TB, true>(bcol[n], k.x, b_es);
                    const float4 y = load_b4<TB, true>(bcol[n], k.y, b_es);
                    bv[n][0] = x.x, bv[n][1] = x.y, bv[n][2] = x.z, bv[n][3] = x.w;
                    bv[n][4] = y.x, bv[n][5] = y.y, bv[n][6] = y.z, bv[n][7] = y.w;
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        bv[n][j] = 0.0f;
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < NW * R; ++i) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    float& s = acc[i * NT + n];
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        s = fmaf(c[i][j], bv[n][j], s);
                    }
                }
            }
        };
        auto load_unit = [&](int u, float (&c)[NW * R][8]) {
#pragma unroll
            for (int w = 0; w < NW; ++w) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    load_unit_float<WT>(arow[w][r], u, c[w * R + r]);
                }
            }
        };
        int u = threadIdx.x;
        const bool pre = preload && u < units;
        float first[NW * R][8];
        if (pre) {
            load_unit(u, first);
        }
        od::grid_enter();
        if (pre) {
            dot_unit(u, first);
            u += BLOCK;
        }
#pragma unroll 2
        for (; u < units; u += BLOCK) {
            float c[NW * R][8];
            load_unit(u, c);
            dot_unit(u, c);
        }
    } else {
        // Scalar float rows: any K, any alignment, b with any element stride.
        od::grid_enter();
        constexpr int ES = Fmt<WT>::ELEM;
#pragma unroll 4
        for (int k = threadIdx.x; k < K; k += BLOCK) {
            float bv[NT];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                bv[n] = n < ncols ? load_elem<TB>(bcol[n] + k * b_es) : 0.0f;
            }
#pragma unroll
            for (int w = 0; w < NW; ++w) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float x = load_elem<WT>(arow[w][r] + static_cast<long long>(k) * ES);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        float& s = acc[(w * R + r) * NT + n];
                        s = fmaf(x, bv[n], s);
                    }
                }
            }
        }
    }
    block_reduce<NW * R * NT>(acc, res);
}

// The epilogue for output (r, n) of a float tile: res holds NW * R * NT sums.
template <int EPI, int R, int NT>
__device__ __forceinline__ float finish(const float* res, int r, int n, const float* bias0, const float* bias1, int m,
                                        int glu_kind, float alpha, float limit) {
    return epilogue<EPI>(res[r * NT + n], EPI == EPI_GLU ? res[(R + r) * NT + n] : 0.0f, bias0, bias1, m, glu_kind,
                         alpha, limit);
}

// -- block-format weights (mmvq*) ----------------------------------------------------------------
//
// Two launches. quantize_q8_1 first turns the b rows into int8 codes with a scale per 32
// values (ggml's q8_1: d = absmax / 127, and d * sum(codes) for the formats' zero and offset),
// once per node, into a scratch buffer laid out for wide loads (QB8 below). Then the mat-vec
// streams the weights straight from global memory: a block of 1..QWARPS_MAX warps computes
// QROWS weight rows ("streams": QROWS rows of a0, or QROWS / 2 rows of each of a0 and a1 for
// EPI_GLU), thread t takes quant blocks j = t, t + blockDim.x, ... of all QROWS rows, so the
// b values of block j are loaded once for the QROWS rows. A weight block (18 to 34 bytes,
// 2-byte aligned) is read as the 2 or 3 aligned 16-byte granules that hold it (consecutive
// threads read consecutive blocks: a warp's loads cover whole cache lines), moved into place
// by selects and funnel shifts (load_block), and dotted with b by dp4a. No shared memory but
// the final reduction over the block's warps, no barrier before it: each thread has its
// QROWS * (2..3) weight loads and its b loads in flight at once.
constexpr int QROWS = 4;
constexpr int QWARPS_MAX = 4;
constexpr int QTHREADS = QWARPS_MAX * od::WARP_SIZE;

// Layout of quantize_q8_1's output for a b row of nb blocks, padded to nbp (a multiple of 32):
// codes at bq + row * nbp * 32: block j's 32 codes in two 16-byte halves h at byte
// ((j / 32) * 2 + h) * 512 + (j % 32) * 16 (so 32 threads read 512 contiguous bytes a half);
// (d, d * sum) as a float2 at bds + (row * nbp + j) * 8.
struct QB8 {
    static __device__ __forceinline__ long long half(int j, int h) {
        return ((j >> 5) * 2 + h) * 512ll + (j & 31) * 16;
    }
};

// The block at `blk` (2-byte aligned): q[i] = codes of values 4i .. 4i+3 (raw, see
// decode_words), scale d, offset m. Reads only the 16-byte granules holding the block's bytes.
template <int WT>
__device__ __forceinline__ void load_block(const u8* blk, int (&q)[8], float& d, float& m) {
    using F = Fmt<WT>;
    constexpr int G = (14 + F::BYTES + 15) / 16;    // granules at the worst offset (14)
    constexpr int NWD = (F::BYTES + 1) / 4 + 1;     // words decode_words reads
    static_assert(4 * G >= NWD + 3, "window too small");
    const unsigned long long addr = reinterpret_cast<unsigned long long>(blk);
    const uint4* g = reinterpret_cast<const uint4*>(addr & ~15ull);
    const int o = static_cast<int>(addr & 15);
    unsigned win[4 * G];
#pragma unroll
    for (int i = 0; i < G; ++i) {
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (i < 2 || o + F::BYTES > 16 * i) {
            v = __ldg(g + i);
        }
        win[4 * i] = v.x, win[4 * i + 1] = v.y, win[4 * i + 2] = v.z, win[4 * i + 3] = v.w;
    }
    // shift the window left by o / 4 words (two select stages), so the block starts at byte
    // (o & 2) of w[0]
    unsigned t[NWD + 1], w[NWD];
#pragma unroll
    for (int k = 0; k < NWD + 1; ++k) {
        t[k] = (o & 8) ? win[k + 2] : win[k];
    }
#pragma unroll
    for (int k = 0; k < NWD; ++k) {
        w[k] = (o & 4) ? t[k + 1] : t[k];
    }
    od::quant::decode_words<F>(w, (o & 2) * 8, q, d, m);
}

// acc[s][n] (every thread's partial) = stream s . b column n over the blocks j this thread takes.
// row[s]: stream s's weight row; bq[n], bd[n]: column n's codes and (d, d * sum) (QB8 layout).
template <int WT, int NT>
__device__ __forceinline__ void q_rows(const u8* const (&row)[QROWS], const u8* const (&bq)[NT],
                                       const float2* const (&bd)[NT], int nb, float (&acc)[QROWS][NT]) {
    using F = Fmt<WT>;
#pragma unroll
    for (int s = 0; s < QROWS; ++s) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            acc[s][n] = 0.0f;
        }
    }
    for (int j = threadIdx.x; j < nb; j += blockDim.x) {
        int q[QROWS][8];
        float d[QROWS], m[QROWS];
#pragma unroll
        for (int s = 0; s < QROWS; ++s) {
            load_block<WT>(row[s] + static_cast<long long>(j) * F::BYTES, q[s], d[s], m[s]);
        }
        const long long h0 = QB8::half(j, 0), h1 = QB8::half(j, 1);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int4 lo = __ldg(reinterpret_cast<const int4*>(bq[n] + h0));
            const int4 hi = __ldg(reinterpret_cast<const int4*>(bq[n] + h1));
            const float2 ds = __ldg(bd[n] + j);
            const int bw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int s = 0; s < QROWS; ++s) {
                int dot = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    dot = __dp4a(q[s][i], bw[i], dot);
                }
                // sum_j (c_j - zero) * d * qb_j * db + m * qb_j * db
                float v = ds.x * static_cast<float>(dot);
                if constexpr (F::ZERO != 0) {
                    v = fmaf(-static_cast<float>(F::ZERO), ds.y, v);
                }
                acc[s][n] = fmaf(d[s], v, acc[s][n]);
                if constexpr (F::M >= 0) {
                    acc[s][n] = fmaf(m[s], ds.y, acc[s][n]);
                }
            }
        }
    }
}

// Sums acc over the block (blockDim.x / 32 warps); returns shared tot[s * NT + n], visible to all.
template <int NT>
__device__ __forceinline__ const float* q_reduce(float (&acc)[QROWS][NT]) {
    __shared__ float part[QWARPS_MAX][QROWS * NT];
    __shared__ float tot[QROWS * NT];
    const int lane = threadIdx.x % od::WARP_SIZE, warp = threadIdx.x / od::WARP_SIZE;
    const int nwarps = blockDim.x / od::WARP_SIZE;
    __syncthreads();  // an earlier call may still read tot[]
#pragma unroll
    for (int s = 0; s < QROWS; ++s) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float v = od::warp_sum(acc[s][n]);
            if (lane == 0) {
                part[warp][s * NT + n] = v;
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < QROWS * NT; i += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < nwarps; ++w) {
            v += part[w][i];
        }
        tot[i] = v;
    }
    __syncthreads();
    return tot;
}

// Writes rows m0 + r (r < rows) of columns n < ncols at ocol[n][m0 + r], through the epilogue.
template <int EPI, int NT>
__device__ __forceinline__ void q_store(const float* tot, float* const (&ocol)[NT], int ncols, int m0, int rows,
                                        const float* bias0, const float* bias1, int glu_kind, float alpha,
                                        float limit) {
    constexpr int RB = EPI == EPI_GLU ? QROWS / 2 : QROWS;
    const int t = threadIdx.x;
    if (t < RB * NT) {
        const int r = t / NT, n = t % NT;
        if (r < rows && n < ncols) {
            const float up = EPI == EPI_GLU ? tot[(RB + r) * NT + n] : 0.0f;
            ocol[n][m0 + r] = epilogue<EPI>(tot[r * NT + n], up, bias0, bias1, m0 + r, glu_kind, alpha, limit);
        }
    }
}

// The QROWS stream rows of a tile: rows m0.. of a[0] (and of a[NW - 1] for EPI_GLU), rows past
// `rows` read the last valid row again.
template <int NW>
__device__ __forceinline__ void q_streams(const u8* const (&a)[NW], long long a_row, int rows,
                                          const u8* (&row)[QROWS]) {
    constexpr int RB = QROWS / NW;
#pragma unroll
    for (int s = 0; s < QROWS; ++s) {
        const int r = s % RB;
        row[s] = (s < RB ? a[0] : a[NW - 1]) + (r < rows ? r : rows - 1) * a_row;
    }
}

// Row m0 of batch (i2, i3) of the weights a0 (and a1, the up weight of EPI_GLU, NW = 2), a's
// batch axes broadcast over b's r2, r3 times (the pointers mmv and mmvq read from).
template <int NW>
__device__ __forceinline__ void weight_rows(const u8* a0, const u8* a1, long long a_row, long long a_s2,
                                            long long a_s3, int r2, int r3, int i2, int i3, int m0,
                                            const u8* (&a)[NW]) {
    const long long off = (i3 / r3) * a_s3 + (i2 / r2) * a_s2 + m0 * a_row;
    a[0] = a0 + off;
    if constexpr (NW == 2) {
        a[1] = a1 + off;
    }
}

}  // namespace mm

using mm::u8;

// b rows to int8 codes with a scale per 32 values (QB8 layout): row r = (i3, i2, i1) with
// i1 < n1, i2 < n2 (r = (i3 * n2 + i2) * n1 + i1), value k at b + i3 * s3 + i2 * s2 + i1 * s1 + k * es.
// Grid (rows, ceil(nb / 8)), QUANT_BLOCK threads: a warp per block of 32 values.
constexpr int QUANT_BLOCK = 256;

template <int TB>
__global__ void __launch_bounds__(QUANT_BLOCK) quantize_q8_1(const u8* b, long long es, long long s1, long long s2,
                                                             long long s3, int n1, int n2, int K, int nbp, u8* bq,
                                                             u8* bds) {
    od::grid_enter();
    const int r = blockIdx.x;
    const int j = blockIdx.y * (QUANT_BLOCK / od::WARP_SIZE) + threadIdx.x / od::WARP_SIZE;
    const int lane = threadIdx.x % od::WARP_SIZE;
    if (j >= K / 32) {
        return;
    }
    const int i1 = r % n1, i2 = (r / n1) % n2, i3 = r / (n1 * n2);
    const u8* src = b + i3 * s3 + i2 * s2 + i1 * s1;
    const float v = mm::load_elem<TB>(src + (32ll * j + lane) * es);
    float amax = fabsf(v);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = od::fmax_nan(amax, __shfl_xor_sync(od::FULL_MASK, amax, off));
    }
    float d, id;
    od::quant::q8_1::scale(amax, d, id);
    const int q = od::quant::q8_1::code(v, id);
    int sum = q;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_xor_sync(od::FULL_MASK, sum, off);
    }
    u8* row = bq + static_cast<long long>(r) * nbp * 32;
    row[mm::QB8::half(j, lane / 16) + lane % 16] = static_cast<u8>(q & 0xff);
    if (lane == 0) {
        reinterpret_cast<float2*>(bds)[static_cast<long long>(r) * nbp + j] = make_float2(d, d * static_cast<float>(sum));
    }
}

// mul_mat: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k] for n < N <= NT.
// a0 (and a1, the up weight of EPI_GLU, with a0's strides) rows of a_row bytes,
// batch strides a_s2, a_s3; b columns b_col bytes apart, elements b_es bytes
// apart (scalar variants), batch strides b_s2, b_s3; out contiguous (B3, B2, N, M).
// preload != 0: a0 (and a1) are constant (no kernel writes them), see mmv_tile.
template <int WT, int TB, int NT, int R, bool VEC, int EPI>
__global__ void __launch_bounds__(mm::BLOCK) mmv(const u8* a0, const u8* a1, long long a_row, long long a_s2,
                                                 long long a_s3, int r2, int r3, const u8* b, long long b_col,
                                                 long long b_es, long long b_s2, long long b_s3, float* out, int M,
                                                 int K, int N, const float* bias0, const float* bias1, int glu_kind,
                                                 float alpha, float limit, int preload) {
    od::grid_enter_later();  // in mmv_tile, after the preload of constant weights
    constexpr int NW = EPI == EPI_GLU ? 2 : 1;
    __shared__ float res[NW * R * NT];
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int m0 = blockIdx.x * R;
    const u8* a[NW];
    mm::weight_rows<NW>(a0, a1, a_row, a_s2, a_s3, r2, r3, i2, i3, m0, a);
    const u8* bb = b + i3 * b_s3 + i2 * b_s2;
    const u8* bcol[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        bcol[n] = bb + (n < N ? n : 0) * b_col;
    }
    const int rows = min(R, M - m0);
    mm::mmv_tile<WT, TB, NT, R, VEC, NW>(a, a_row, rows, bcol, N, b_es, K, res, preload != 0);
    const int t = threadIdx.x;
    if (t < R * NT) {
        const int r = t / NT, n = t % NT, m = m0 + r;
        if (r < rows && n < N) {
            float* o = out + ((static_cast<long long>(i3) * gridDim.y + i2) * N + n) * M + m;
            *o = mm::finish<EPI, R, NT>(res, r, n, bias0, bias1, m, glu_kind, alpha, limit);
        }
    }
}

// mul_mat with block-format weights: as mmv, QROWS / NW rows a block (q_rows), b already
// quantized by quantize_q8_1 (column n of batch (i3, i2) is its row (i3 * B2 + i2) * N + n,
// nbp padded blocks a row); grid (ceil(M / rows), B2, B3), 32..QTHREADS threads.
template <int WT, int NT, int EPI>
__global__ void __launch_bounds__(mm::QTHREADS) mmvq(const u8* a0, const u8* a1, long long a_row, long long a_s2,
                                                     long long a_s3, int r2, int r3, const u8* bq, const u8* bds,
                                                     int nbp, float* out, int M, int K, int N, const float* bias0,
                                                     const float* bias1, int glu_kind, float alpha, float limit) {
    od::grid_enter();
    constexpr int NW = EPI == EPI_GLU ? 2 : 1, RB = mm::QROWS / NW;
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int m0 = blockIdx.x * RB;
    const u8* a[NW];
    mm::weight_rows<NW>(a0, a1, a_row, a_s2, a_s3, r2, r3, i2, i3, m0, a);
    const int rows = min(RB, M - m0);
    const u8* row[mm::QROWS];
    mm::q_streams<NW>(a, a_row, rows, row);
    const long long brow0 = (static_cast<long long>(i3) * gridDim.y + i2) * N;
    const u8* bcol[NT];
    const float2* dcol[NT];
    float* ocol[NT];
    float* o = out + brow0 * M;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const long long r = brow0 + (n < N ? n : 0);
        bcol[n] = bq + r * nbp * 32;
        dcol[n] = reinterpret_cast<const float2*>(bds) + r * nbp;
        ocol[n] = o + static_cast<long long>(n) * M;
    }
    float acc[mm::QROWS][NT];
    mm::q_rows<WT, NT>(row, bcol, dcol, K / 32, acc);
    const float* tot = mm::q_reduce<NT>(acc);
    mm::q_store<EPI, NT>(tot, ocol, N, m0, rows, bias0, bias1, glu_kind, alpha, limit);
}

// mul_mat_id for one (token t, slot u) a block: out[t, u, m] = as[ids[t, u], m, :] . b[t, u % Ub, :].
// as0 (and as1 for EPI_GLU) experts e_stride bytes apart; ids i32 with byte strides
// ids_t, ids_u; b rows b_t, b_u bytes apart; out contiguous (T, U, M); biases
// (EPI_BIAS, EPI_GLU) rows of bias_e bytes a expert.
template <int WT, int TB, int R, bool VEC, int EPI>
__global__ void __launch_bounds__(mm::BLOCK) mmv_id(const u8* as0, const u8* as1, long long a_row, long long a_e,
                                                    int E, const u8* ids, long long ids_t, long long ids_u,
                                                    const u8* b, long long b_t, long long b_u, int Ub, long long b_es,
                                                    float* out, int M, int K, const float* bias0, const float* bias1,
                                                    long long bias_e, int glu_kind, float alpha, float limit) {
    constexpr int NW = EPI == EPI_GLU ? 2 : 1;
    __shared__ float res[NW * R];
    const int u = blockIdx.y, t = blockIdx.z, U = gridDim.y;
    const int m0 = blockIdx.x * R;
    const int rows = min(R, M - m0);
    const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
    float* o = out + (static_cast<long long>(t) * U + u) * M + m0;
    if (e < 0 || e >= E) {
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
                                                        long long bias_e, int glu_kind, float alpha, float limit) {
    constexpr int NW = EPI == EPI_GLU ? 2 : 1, RB = mm::QROWS / NW;
    const int u = blockIdx.y, t = blockIdx.z, U = gridDim.y;
    const int m0 = blockIdx.x * RB;
    const int rows = min(RB, M - m0);
    const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
    float* const ocol[1] = {out + (static_cast<long long>(t) * U + u) * M};
    if (e < 0 || e >= E) {
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
                        bias1 != nullptr ? bias1 + boff : nullptr, glu_kind, alpha, limit);
}

// The routing table of mul_mat_id's grouped path, in int32 words of `route`:
//   [0] the number S of experts used; [1, 1+E) their ids; [1+E, 1+2E) where each
//   one's pairs start; [1+2E, 1+3E) how many it has; [1+3E, 1+3E+T*U) the pairs
//   p = t * U + u, grouped by expert (in no particular order inside a group).
// One block of ROUTE_BLOCK threads; dynamic shared memory 2 * E ints. Pairs with
// an id outside [0, E) get a NaN output row here and are left out of the table.
constexpr int ROUTE_BLOCK = 1024;
constexpr int ROUTE_PER_THREAD = 4;  // experts a thread scans: E <= ROUTE_BLOCK * ROUTE_PER_THREAD

extern "C" __global__ void __launch_bounds__(ROUTE_BLOCK) moe_route(const u8* ids, long long ids_t, long long ids_u,
                                                                    int T, int U, int E, int* route, float* out,
                                                                    int M) {
    extern __shared__ int smem[];
    int* count = smem;
    int* cursor = smem + E;
    __shared__ int warp_sums[ROUTE_BLOCK / od::WARP_SIZE][2];
    const int tid = threadIdx.x;
    const int pairs = T * U;
    for (int e = tid; e < E; e += ROUTE_BLOCK) {
        count[e] = 0;
    }
    __syncthreads();
    for (int p = tid; p < pairs; p += ROUTE_BLOCK) {
        const int t = p / U, u = p % U;
        const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
        if (e >= 0 && e < E) {
            atomicAdd(&count[e], 1);
        } else {
            for (int m = 0; m < M; ++m) {
                out[static_cast<long long>(p) * M + m] = __int_as_float(0x7fc00000);
            }
        }
    }
    __syncthreads();
    // Exclusive scan over experts of (pairs, used): each thread owns ROUTE_PER_THREAD consecutive experts.
    const int e0 = tid * ROUTE_PER_THREAD;
    int own_pairs = 0, own_used = 0;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_THREAD; ++j) {
        const int c = e0 + j < E ? count[e0 + j] : 0;
        own_pairs += c;
        own_used += c > 0;
    }
    const int lane = tid % od::WARP_SIZE, warp = tid / od::WARP_SIZE;
    int sp = own_pairs, su = own_used;  // inclusive warp scan
#pragma unroll
    for (int off = 1; off < od::WARP_SIZE; off <<= 1) {
        const int xp = __shfl_up_sync(od::FULL_MASK, sp, off);
        const int xu = __shfl_up_sync(od::FULL_MASK, su, off);
        if (lane >= off) {
            sp += xp;
            su += xu;
        }
    }
    if (lane == od::WARP_SIZE - 1) {
        warp_sums[warp][0] = sp;
        warp_sums[warp][1] = su;
    }
    __syncthreads();
    int before_p = 0, before_u = 0, total_u = 0;
    for (int w = 0; w < ROUTE_BLOCK / od::WARP_SIZE; ++w) {
        if (w < warp) {
            before_p += warp_sums[w][0];
            before_u += warp_sums[w][1];
        }
        total_u += warp_sums[w][1];
    }
    int start = before_p + sp - own_pairs, slot = before_u + su - own_used;
    int* used_expert = route + 1;
    int* used_start = route + 1 + E;
    int* used_count = route + 1 + 2 * E;
    for (int j = 0; j < ROUTE_PER_THREAD && e0 + j < E; ++j) {
        const int c = count[e0 + j];
        cursor[e0 + j] = start;
        if (c > 0) {
            used_expert[slot] = e0 + j;
            used_start[slot] = start;
            used_count[slot] = c;
            ++slot;
        }
        start += c;
    }
    if (tid == 0) {
        route[0] = total_u;
    }
    __syncthreads();
    int* list = route + 1 + 3 * E;
    for (int p = tid; p < pairs; p += ROUTE_BLOCK) {
        const int t = p / U, u = p % U;
        const int e = *reinterpret_cast<const int*>(ids + t * ids_t + u * ids_u);
        if (e >= 0 && e < E) {
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
        mm::q_store<EPI, NT>(tot, ocol, ncols, m0, rows, bias_e_row, nullptr, 0, 0.0f, 0.0f);
    }
}

