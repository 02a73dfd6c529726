// Mat-vec kernels: out (N, M) = b (N, K) @ a (M, K)^T for a few columns N <= NT (<= 8),
// the weights a read once (ggml's mmvf/mmvq idea).
//
// A block of BLOCK threads computes R consecutive rows of a against up to NT
// columns of b: the threads split K in units of 8 values (mm_common.cuh), each
// keeps NW * R * NT float partial sums, and the block reduces them (warp
// shuffles, then shared memory). Float weights (f32/f16/bf16) take b in float
// (TB = B_F32/B_F16/B_BF16). Block-format weights take b quantized to int8
// records (TB = B_Q8, convert.cu's quantize_q8) and are decoded on the fly into
// integer dot products (dp4a), scales applied once per 8 values:
// d * db * (dot - zero * sum(qb)) + m * db * sum(qb).
//
// Kernels:
//   mmv            mul_mat: grid (ceil(M / R), B2, B3), a's batch repeat-interleaved
//                  (b batch i2 uses a batch i2 / r2), optional bias or GLU epilogue.
//   mmv_id         mul_mat_id, one (token, slot) pair a block: grid (ceil(M / R), U, T),
//                  the expert read from ids on the device (no host synchronization).
//   moe_route      mul_mat_id, larger batches: one block groups the (token, slot) pairs
//                  by expert into a scratch table (counts, starts, pair list).
//   mmv_id_grouped then one block per (row tile, active expert): grid (ceil(M / R),
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
    float acc[NW * R * NT];
#pragma unroll
    for (int i = 0; i < NW * R * NT; ++i) {
        acc[i] = 0.0f;
    }
    if constexpr (TB == B_Q8) {
        // Block-format weights against b quantized to int8 (records, see mm_common.cuh):
        // sum_j (c_j - zero) * d * qb_j * db + m * qb_j * db, with integer dot products.
        static_assert(Fmt<WT>::QUANT, "B_Q8 is for block-format weights");
        using F = Fmt<WT>;
        constexpr bool NEED_SUM = F::ZERO != 0 || F::M >= 0;
        const int units = K / 8;
#pragma unroll 2
        for (int u = threadIdx.x; u < units; u += BLOCK) {
            const int2 k = unit_k<WT>(u);
            int qlo[NT], qhi[NT], qsum[NT];
            float db[NT];
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const u8* col = bcol[n];
                qlo[n] = *reinterpret_cast<const int*>(col + k.x);
                qhi[n] = *reinterpret_cast<const int*>(col + k.y);
                db[n] = reinterpret_cast<const float*>(col + K)[k.x >> 5];
                if constexpr (NEED_SUM) {
                    qsum[n] = __dp4a(0x01010101, qlo[n], __dp4a(0x01010101, qhi[n], 0));
                }
            }
#pragma unroll
            for (int w = 0; w < NW; ++w) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    int lo, hi;
                    float d, m;
                    load_unit_words<WT>(arow[w][r], u, lo, hi, d, m);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        int dot = __dp4a(lo, qlo[n], __dp4a(hi, qhi[n], 0));
                        if constexpr (F::ZERO != 0) {
                            dot -= F::ZERO * qsum[n];
                        }
                        float& acc_s = acc[(w * R + r) * NT + n];
                        acc_s = fmaf(d * db[n], static_cast<float>(dot), acc_s);
                        if constexpr (F::M >= 0) {
                            acc_s = fmaf(m * db[n], static_cast<float>(qsum[n]), acc_s);
                        }
                    }
                }
            }
        }
    } else if constexpr (VEC) {
        // Float rows with 16-byte loads (K % 8 == 0, rows 16-byte aligned), b f32/f16/bf16.
        static_assert(!Fmt<WT>::QUANT, "block-format weights take b as B_Q8");
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
        static_assert(!Fmt<WT>::QUANT, "block-format weights take b as B_Q8");
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

// The epilogue for output (r, n) of a tile: res holds NW * R * NT sums.
template <int EPI, int R, int NT>
__device__ __forceinline__ float finish(const float* res, int r, int n, const float* bias0, const float* bias1, int m,
                                        int glu_kind, float alpha, float limit) {
    float v = res[r * NT + n];
    if constexpr (EPI == EPI_BIAS) {
        v += bias0[m];
    } else if constexpr (EPI == EPI_GLU) {
        float up = res[(R + r) * NT + n];
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
