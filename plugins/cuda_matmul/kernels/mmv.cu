// Mat-vec kernels: out (N, M) = b (N, K) @ a (M, K)^T for a few columns N <= NT (<= 8),
// the weights a read once (ggml's mmvf/mmvq idea).
//
// Float weights (f32/f16/bf16, mmv*): a block of BLOCK threads computes R consecutive rows
// of a against up to NT columns of b (f32/f16/bf16): the threads split K in units of 8
// values (mm_common.cuh), each keeps NW * R * NT float partial sums, and the block reduces
// them (warp shuffles, then shared memory).
// Block-format weights (mmvq*): q_tile below: a block of QBLOCK threads computes QSTREAMS
// rows, staging 16-byte loads of the weights through shared memory and quantizing b to int8
// there, for integer dot products (dp4a).
//
// Kernels:
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
template <int WT, int TB, int NT, int R, bool VEC, int NW>
__device__ __forceinline__ void mmv_tile(const u8* const (&a)[NW], long long a_row, int rows,
                                         const u8* const (&bcol)[NT], int ncols, long long b_es, int K, float* res) {
    const u8* arow[NW][R];
#pragma unroll
    for (int w = 0; w < NW; ++w) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            arow[w][r] = a[w] + (r < rows ? r : rows - 1) * a_row;
        }
    }
    static_assert(!Fmt<WT>::QUANT, "block-format weights take q_tile");
    float acc[NW * R * NT];
#pragma unroll
    for (int i = 0; i < NW * R * NT; ++i) {
        acc[i] = 0.0f;
    }
    if constexpr (VEC) {
        // Float rows with 16-byte loads (K % 8 == 0, rows 16-byte aligned), b f32/f16/bf16.
        const int units = K / 8;
#pragma unroll 2
        for (int u = threadIdx.x; u < units; u += BLOCK) {
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
            for (int w = 0; w < NW; ++w) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float c[8];
                    load_unit_float<WT>(arow[w][r], u, c);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        float& s = acc[(w * R + r) * NT + n];
#pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            s = fmaf(c[j], bv[n][j], s);
                        }
                    }
                }
            }
        }
    } else {
        // Scalar float rows: any K, any alignment, b with any element stride.
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

// The epilogue of output row m: v = a0 . b, up = a1 . b (read for EPI_GLU only).
template <int EPI>
__device__ __forceinline__ float epilogue(float v, float up, const float* bias0, const float* bias1, int m,
                                          int glu_kind, float alpha, float limit) {
    if constexpr (EPI == EPI_BIAS) {
        v += bias0[m];
    } else if constexpr (EPI == EPI_GLU) {
        if (bias0 != nullptr) {
            v += bias0[m];
        }
        if (bias1 != nullptr) {
            up += bias1[m];
        }
        v = glu(glu_kind, v, up, alpha, limit);
    }
    return v;
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
// A block of QBLOCK threads computes QSTREAMS weight rows ("streams": QSTREAMS rows of a0, or
// QSTREAMS / 2 rows of each of a0 and a1 for EPI_GLU) against up to NT columns of b (f32, f16
// or bf16, any element stride). K is walked in chunks of QCHUNK blocks (32 values each):
//   stage    each stream's chunk is copied to shared memory in 16-byte loads of the aligned
//            granules that hold it: consecutive threads read consecutive granules, so a warp
//            reads whole cache lines whatever the block size (18 to 34 bytes, 2-byte aligned).
//            A granule never crosses a page: its few bytes outside the row are read and ignored.
//            The chunk's b values are quantized to int8 with a scale per 32 (ggml's q8_1:
//            d = absmax / 127, and d * sum(codes) for the formats' zero and offset) into
//            shared memory, once for all the block's rows.
//   compute  warp w takes streams w and w + QWARPS, lane l blocks l and l + 32 of both:
//            8 dp4a a block and column, scales applied once a block.
// The next chunk's loads (weights and b) are issued before the current chunk is computed: a
// block has QSTREAMS chunks in flight (18 KB of q4_0, 35 KB of q8_0), and nothing but those
// loads and b (read from L2) leaves the SM.
constexpr int QBLOCK = 256;
constexpr int QWARPS = QBLOCK / od::WARP_SIZE;
constexpr int QSTREAMS = 2 * QWARPS;
constexpr int QCHUNK = 64;                          // blocks of a row in a chunk: 2 a lane
constexpr int QB_COLUMN = QCHUNK * (8 * 4 + 8);     // shared bytes of one b column of a chunk

template <int WT>
struct QTile {
    static constexpr int BYTES = Fmt<WT>::BYTES;
    static constexpr int STEP = QCHUNK * BYTES / 16;  // granules from a chunk to the next (rows stay aligned alike)
    static constexpr int GRANULES = STEP + 1;         // granules holding a chunk, at most (unaligned rows)
    static constexpr int LOADS = (QSTREAMS * GRANULES + QBLOCK - 1) / QBLOCK;  // granule loads a thread
    // dynamic shared memory (mirrored by __init__.py's q_smem)
    static constexpr int smem(int nt) { return QSTREAMS * GRANULES * 16 + nt * QB_COLUMN; }
};

// acc[t][n] (summed over the warp, every lane) = stream (warp + t * QWARPS) . column n of b,
// streams s < QSTREAMS / NW rows of a[0], then as many of a[1]; row r at a[w] + r * a_row
// (rows past `rows` read the last valid row again). Column n's value k at bcol[n] + k * b_es.
// smem: QTile<WT>::smem(NT) bytes. Ends with the block synchronized (smem free again).
template <int WT, int TB, int NT, int NW>
__device__ __forceinline__ void q_tile(const u8* const (&a)[NW], long long a_row, int rows,
                                       const u8* const (&bcol)[NT], long long b_es, int K, uint4* smem,
                                       float (&acc)[2][NT]) {
    using T = QTile<WT>;
    using F = Fmt<WT>;
    constexpr int RB = QSTREAMS / NW;
    const int tid = threadIdx.x, lane = tid % od::WARP_SIZE, warp = tid / od::WARP_SIZE;
    const int nb = K / 32, chunks = (nb + QCHUNK - 1) / QCHUNK;
    const u8* sw = reinterpret_cast<const u8*>(smem);
    int* bq = reinterpret_cast<int*>(smem + QSTREAMS * T::GRANULES);  // [NT][8][QCHUNK] code words
    float2* bds = reinterpret_cast<float2*>(bq + NT * 8 * QCHUNK);    // [NT][QCHUNK] (d, d * sum)

    auto row_of = [&](int s) {
        const int r = s % RB;
        return (s < RB ? a[0] : a[NW - 1]) + (r < rows ? r : rows - 1) * a_row;
    };
    auto misalign = [](const u8* p) { return static_cast<int>(reinterpret_cast<unsigned long long>(p) & 15); };
    // this thread's granules: source (chunk 0) and the chunk byte each starts at (past the end: none)
    const uint4* src[T::LOADS];
    int first[T::LOADS];
#pragma unroll
    for (int i = 0; i < T::LOADS; ++i) {
        const int f = tid + i * QBLOCK;
        const u8* row = row_of(min(f / T::GRANULES, QSTREAMS - 1));
        const int g = f % T::GRANULES, o = misalign(row);
        src[i] = reinterpret_cast<const uint4*>(row - o) + g;
        first[i] = f < QSTREAMS * T::GRANULES ? 16 * g - o : 0x7fffffff;
    }
    // where this thread's two streams start in shared memory
    int pos[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int s = warp + t * QWARPS;
        pos[t] = s * T::GRANULES * 16 + misalign(row_of(s));
    }

    uint4 wreg[T::LOADS];
    float breg[NT][2][4];  // b values k0 + 32 * qb + 4 * part + j, qb = tid / 8 + 32 p, part = tid % 8
#pragma unroll
    for (int i = 0; i < T::LOADS; ++i) {
        wreg[i] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                breg[n][p][j] = 0.0f;
            }
        }
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            acc[t][n] = 0.0f;
        }
    }
    const int part = tid % 8;

    auto load = [&](int c) {
        const int nblk = min(QCHUNK, nb - c * QCHUNK);
#pragma unroll
        for (int i = 0; i < T::LOADS; ++i) {
            if (first[i] < nblk * T::BYTES) {
                wreg[i] = __ldg(src[i] + c * T::STEP);
            }
        }
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int qb = tid / 8 + 32 * p;
            if (qb < nblk) {
                const long long k = 32ll * (c * QCHUNK + qb) + 4 * part;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        breg[n][p][j] = load_elem<TB>(bcol[n] + (k + j) * b_es);
                    }
                }
            }
        }
    };

    auto stage = [&](int c) {
#pragma unroll
        for (int i = 0; i < T::LOADS; ++i) {
            if (tid + i * QBLOCK < QSTREAMS * T::GRANULES) {
                smem[tid + i * QBLOCK] = wreg[i];
            }
        }
        const int nblk = min(QCHUNK, nb - c * QCHUNK);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const float* v = breg[n][p];
                float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
                for (int off = 1; off < 8; off <<= 1) {  // the 8 lanes of one 32-value block
                    amax = fmaxf(amax, __shfl_xor_sync(od::FULL_MASK, amax, off));
                }
                const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
                int word = 0, sum = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int q = __float2int_rn(v[j] * id);
                    word |= (q & 0xff) << (8 * j);
                    sum += q;
                }
#pragma unroll
                for (int off = 1; off < 8; off <<= 1) {
                    sum += __shfl_xor_sync(od::FULL_MASK, sum, off);
                }
                const int qb = tid / 8 + 32 * p;
                if (qb < nblk) {
                    bq[(n * 8 + part) * QCHUNK + qb] = word;
                    if (part == 0) {
                        bds[n * QCHUNK + qb] = make_float2(d, d * static_cast<float>(sum));
                    }
                }
            }
        }
    };

    auto compute = [&](int c) {
        const int nblk = min(QCHUNK, nb - c * QCHUNK);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = lane + 32 * h;
            if (j < nblk) {
                int q[2][8];
                float d[2], m[2];
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    decode_block<WT>(sw, pos[t] + j * T::BYTES, q[t], d[t], m[t]);
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    int bw[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        bw[i] = bq[(n * 8 + i) * QCHUNK + j];
                    }
                    const float2 ds = bds[n * QCHUNK + j];
#pragma unroll
                    for (int t = 0; t < 2; ++t) {
                        int dot = 0;
#pragma unroll
                        for (int i = 0; i < 8; ++i) {
                            dot = __dp4a(q[t][i], bw[i], dot);
                        }
                        // sum_j (c_j - zero) * d * qb_j * db + m * qb_j * db
                        float v = ds.x * static_cast<float>(dot);
                        if constexpr (F::ZERO != 0) {
                            v = fmaf(-static_cast<float>(F::ZERO), ds.y, v);
                        }
                        acc[t][n] = fmaf(d[t], v, acc[t][n]);
                        if constexpr (F::M >= 0) {
                            acc[t][n] = fmaf(m[t], ds.y, acc[t][n]);
                        }
                    }
                }
            }
        }
    };

    load(0);
    for (int c = 0; c < chunks; ++c) {
        stage(c);
        __syncthreads();
        if (c + 1 < chunks) {
            load(c + 1);
        }
        compute(c);
        __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            acc[t][n] = od::warp_sum(acc[t][n]);
        }
    }
}

// Writes q_tile's rows m0 + r (r < rows) of columns n < ncols at ocol[n][m0 + r], through the epilogue.
template <int EPI, int NT, int NW>
__device__ __forceinline__ void q_store(const float (&acc)[2][NT], float* const (&ocol)[NT], int ncols, int m0,
                                        int rows, const float* bias0, const float* bias1, int glu_kind, float alpha,
                                        float limit) {
    const int lane = threadIdx.x % od::WARP_SIZE, warp = threadIdx.x / od::WARP_SIZE;
    if (lane != 0) {
        return;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        if (n < ncols) {
            if constexpr (NW == 2) {  // streams: gate row `warp`, up row `warp`
                if (warp < rows) {
                    const int m = m0 + warp;
                    ocol[n][m] = epilogue<EPI>(acc[0][n], acc[1][n], bias0, bias1, m, glu_kind, alpha, limit);
                }
            } else {  // streams: rows `warp` and `warp + QWARPS`
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const int r = warp + t * QWARPS;
                    if (r < rows) {
                        ocol[n][m0 + r] = epilogue<EPI>(acc[t][n], 0.0f, bias0, bias1, m0 + r, glu_kind, alpha,
                                                        limit);
                    }
                }
            }
        }
    }
}

}  // namespace mm

using mm::u8;

// mul_mat: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k] for n < N <= NT.
// a0 (and a1, the up weight of EPI_GLU, with a0's strides) rows of a_row bytes,
// batch strides a_s2, a_s3; b columns b_col bytes apart, elements b_es bytes
// apart (scalar variants), batch strides b_s2, b_s3; out contiguous (B3, B2, N, M).
template <int WT, int TB, int NT, int R, bool VEC, int EPI>
__global__ void __launch_bounds__(mm::BLOCK) mmv(const u8* a0, const u8* a1, long long a_row, long long a_s2,
                                                 long long a_s3, int r2, int r3, const u8* b, long long b_col,
                                                 long long b_es, long long b_s2, long long b_s3, float* out, int M,
                                                 int K, int N, const float* bias0, const float* bias1, int glu_kind,
                                                 float alpha, float limit) {
    constexpr int NW = EPI == EPI_GLU ? 2 : 1;
    __shared__ float res[NW * R * NT];
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int m0 = blockIdx.x * R;
    const long long a_off = (i3 / r3) * a_s3 + (i2 / r2) * a_s2 + m0 * a_row;
    const u8* a[NW];
    a[0] = a0 + a_off;
    if constexpr (NW == 2) {
        a[1] = a1 + a_off;
    }
    const u8* bb = b + i3 * b_s3 + i2 * b_s2;
    const u8* bcol[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        bcol[n] = bb + (n < N ? n : 0) * b_col;
    }
    const int rows = min(R, M - m0);
    mm::mmv_tile<WT, TB, NT, R, VEC, NW>(a, a_row, rows, bcol, N, b_es, K, res);
    const int t = threadIdx.x;
    if (t < R * NT) {
        const int r = t / NT, n = t % NT, m = m0 + r;
        if (r < rows && n < N) {
            float* o = out + ((static_cast<long long>(i3) * gridDim.y + i2) * N + n) * M + m;
            *o = mm::finish<EPI, R, NT>(res, r, n, bias0, bias1, m, glu_kind, alpha, limit);
        }
    }
}

// mul_mat with block-format weights: as mmv, QSTREAMS / NW rows a block (q_tile), grid
// (ceil(M / rows), B2, B3), QTile<WT>::smem(NT) bytes of dynamic shared memory.
template <int WT, int TB, int NT, int EPI>
__global__ void __launch_bounds__(mm::QBLOCK) mmvq(const u8* a0, const u8* a1, long long a_row, long long a_s2,
                                                   long long a_s3, int r2, int r3, const u8* b, long long b_col,
                                                   long long b_es, long long b_s2, long long b_s3, float* out, int M,
                                                   int K, int N, const float* bias0, const float* bias1, int glu_kind,
                                                   float alpha, float limit) {
    constexpr int NW = EPI == EPI_GLU ? 2 : 1, RB = mm::QSTREAMS / NW;
    extern __shared__ uint4 qsmem[];
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int m0 = blockIdx.x * RB;
    const long long a_off = (i3 / r3) * a_s3 + (i2 / r2) * a_s2 + m0 * a_row;
    const u8* a[NW];
    a[0] = a0 + a_off;
    if constexpr (NW == 2) {
        a[1] = a1 + a_off;
    }
    const u8* bb = b + i3 * b_s3 + i2 * b_s2;
    const u8* bcol[NT];
    float* ocol[NT];
    float* o = out + (static_cast<long long>(i3) * gridDim.y + i2) * N * M;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        bcol[n] = bb + (n < N ? n : 0) * b_col;
        ocol[n] = o + static_cast<long long>(n) * M;
    }
    const int rows = min(RB, M - m0);
    float acc[2][NT];
    mm::q_tile<WT, TB, NT, NW>(a, a_row, rows, bcol, b_es, K, qsmem, acc);
    mm::q_store<EPI, NT, NW>(acc, ocol, N, m0, rows, bias0, bias1, glu_kind, alpha, limit);
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

// mul_mat_id with block-format experts, one (token t, slot u) a block: as mmv_id, QSTREAMS / NW
// rows a block, b f32; grid (ceil(M / rows), U, T), QTile<WT>::smem(1) bytes of dynamic shared memory.
template <int WT, int EPI>
__global__ void __launch_bounds__(mm::QBLOCK) mmvq_id(const u8* as0, const u8* as1, long long a_row, long long a_e,
                                                      int E, const u8* ids, long long ids_t, long long ids_u,
                                                      const u8* b, long long b_t, long long b_u, int Ub, long long b_es,
                                                      float* out, int M, int K, const float* bias0,
                                                      const float* bias1, long long bias_e, int glu_kind, float alpha,
                                                      float limit) {
    constexpr int NW = EPI == EPI_GLU ? 2 : 1, RB = mm::QSTREAMS / NW;
    extern __shared__ uint4 qsmem[];
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
    const u8* const bcol[1] = {b + t * b_t + (u % Ub) * b_u};
    float acc[2][1];
    mm::q_tile<WT, B_F32, 1, NW>(a, a_row, rows, bcol, b_es, K, qsmem, acc);
    const long long boff = e * bias_e / 4;
    mm::q_store<EPI, 1, NW>(acc, ocol, 1, m0, rows, bias0 != nullptr ? bias0 + boff : nullptr,
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

// mul_mat_id, grouped, block-format experts: as mmv_id_grouped, QSTREAMS rows a block (q_tile),
// b f32; grid (ceil(M / QSTREAMS), min(E, T*U)), QTile<WT>::smem(NT) bytes of dynamic shared memory.
template <int WT, int NT, int EPI>
__global__ void __launch_bounds__(mm::QBLOCK) mmvq_id_grouped(const u8* as, long long a_row, long long a_e, int E,
                                                              const int* route, const u8* b, long long b_t,
                                                              long long b_u, int Ub, long long b_es, float* out,
                                                              int M, int K, int U, const float* bias,
                                                              long long bias_e) {
    extern __shared__ uint4 qsmem[];
    const int s = blockIdx.y;
    if (s >= route[0]) {
        return;
    }
    const int e = route[1 + s], first = route[1 + E + s], count = route[1 + 2 * E + s];
    const int* list = route + 1 + 3 * E + first;
    const int m0 = blockIdx.x * mm::QSTREAMS;
    const int rows = min(mm::QSTREAMS, M - m0);
    const u8* const a[1] = {as + e * a_e + m0 * a_row};
    const float* bias_e_row = bias != nullptr ? bias + e * bias_e / 4 : nullptr;
    for (int g = 0; g < count; g += NT) {
        const int ncols = min(NT, count - g);
        const u8* bcol[NT];
        float* ocol[NT];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int p = list[g + (n < ncols ? n : 0)];
            bcol[n] = b + (p / U) * b_t + ((p % U) % Ub) * b_u;
            ocol[n] = out + static_cast<long long>(p) * M;
        }
        float acc[2][NT];
        mm::q_tile<WT, B_F32, NT, 1>(a, a_row, rows, bcol, b_es, K, qsmem, acc);
        mm::q_store<EPI, NT, 1>(acc, ocol, ncols, m0, rows, bias_e_row, nullptr, 0, 0.0f, 0.0f);
    }
}
