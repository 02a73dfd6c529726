// The mat-vec kernels' shared device code (mmv.cu, mmv_id.cu): the float tile of mmv*, the
// block-format row dot products of mmvq*, the block reductions and epilogues.
#pragma once
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

// The epilogue for output (r, n) of a float tile (`at` its bias index, epilogue's): res holds NW * R * NT sums.
template <int EPI, int R, int NT>
__device__ __forceinline__ float finish(const float* res, int r, int n, const float* bias0, const float* bias1,
                                        long long at, int glu_kind, float alpha, float limit) {
    return epilogue<EPI>(res[r * NT + n], EPI == EPI_GLU ? res[(R + r) * NT + n] : 0.0f, bias0, bias1, at, glu_kind,
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

// q_rows for quant_k.cuh's formats: thread t takes the 32-value units j = t, t + blockDim.x, ... (the
// q8_1 blocks of b), unit j % PER of weight block j / PER, and adds the format's dot32 of it (read
// from global memory: the weights' bytes a warp reads are contiguous; no shared memory).
template <int WT, int NT>
__device__ __forceinline__ void q_rows_subscaled(const u8* const (&row)[QROWS], const u8* const (&bq)[NT],
                                                 const float2* const (&bd)[NT], int nb, float (&acc)[QROWS][NT]) {
    using F = Fmt<WT>;
    constexpr int PER = F::QK / 32;  // units a block
    for (int j = threadIdx.x; j < nb; j += blockDim.x) {
        const long long blk = static_cast<long long>(j / PER) * F::BYTES;
        const long long h0 = QB8::half(j, 0), h1 = QB8::half(j, 1);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int4 lo = __ldg(reinterpret_cast<const int4*>(bq[n] + h0));
            const int4 hi = __ldg(reinterpret_cast<const int4*>(bq[n] + h1));
            const float2 ds = __ldg(bd[n] + j);
            const int bw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int s = 0; s < QROWS; ++s) {
                acc[s][n] += F::dot32(row[s] + blk, j % PER, bw, ds);
            }
        }
    }
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
    if constexpr (!F::LEGACY) {
        q_rows_subscaled<WT, NT>(row, bq, bd, nb, acc);
    } else {
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

// Writes rows m0 + r (r < rows) of columns n < ncols at ocol[n][m0 + r], through the epilogue: column n is
// output row brow0 + n for the biases (bias_col floats a row, 0 for one row; epilogue's index).
template <int EPI, int NT>
__device__ __forceinline__ void q_store(const float* tot, float* const (&ocol)[NT], int ncols, int m0, int rows,
                                        const float* bias0, const float* bias1, long long brow0, long long bias_col,
                                        int glu_kind, float alpha, float limit) {
    constexpr int RB = EPI == EPI_GLU ? QROWS / 2 : QROWS;
    const int t = threadIdx.x;
    if (t < RB * NT) {
        const int r = t / NT, n = t % NT;
        if (r < rows && n < ncols) {
            const float up = EPI == EPI_GLU ? tot[(RB + r) * NT + n] : 0.0f;
            ocol[n][m0 + r] = epilogue<EPI>(tot[r * NT + n], up, bias0, bias1, (brow0 + n) * bias_col + m0 + r,
                                            glu_kind, alpha, limit);
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
