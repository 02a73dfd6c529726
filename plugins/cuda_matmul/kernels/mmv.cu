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
//                  (b batch i2 uses a batch i2 / r2), optional bias (one row, or a residual
//                  addend: mm_common.cuh's EPI_NONE) or GLU epilogue.
//
// Sizes are ints, byte strides long long. Rows past M (the last tile) read the
// tile's last row again and write nothing. An expert id outside [0, E) writes NaN rows.

#include "mmv_common.cuh"

// b rows to int8 codes with a scale per 32 values (QB8 layout): row r = (i3, i2, i1) with
// i1 < n1, i2 < n2 (r = (i3 * n2 + i2) * n1 + i1), value k at b + i3 * s3 + i2 * s2 + i1 * s1 + k * es.
// Grid (rows, ceil(nb / 8)), QUANT_BLOCK threads: a warp per block of 32 values.
// NORM (a fused rms_norm -> mul before the GEMMs: fusion.py's rms_norm groups): the values quantized are
// rms_norm(b) * nw, b the norm's input; every block sums its row's squares itself (K values, from L2)
// rather than waiting on another block's.
constexpr int QUANT_BLOCK = 256;

template <int TB, bool NORM = false>
__global__ void __launch_bounds__(QUANT_BLOCK) quantize_q8_1(const u8* b, long long es, long long s1, long long s2,
                                                             long long s3, int n1, int n2, int K, int nbp, u8* bq,
                                                             u8* bds, const float* nw, float eps) {
    od::grid_enter();
    const int r = blockIdx.x;
    const int j = blockIdx.y * (QUANT_BLOCK / od::WARP_SIZE) + threadIdx.x / od::WARP_SIZE;
    const int lane = threadIdx.x % od::WARP_SIZE;
    const int i1 = r % n1, i2 = (r / n1) % n2, i3 = r / (n1 * n2);
    const u8* src = b + i3 * s3 + i2 * s2 + i1 * s1;
    float scale = 1.0f;
    if constexpr (NORM) {
        __shared__ float sums[QUANT_BLOCK / od::WARP_SIZE];
        float ss = 0.0f;
        for (int k = threadIdx.x; k < K; k += QUANT_BLOCK) {
            const float x = mm::load_elem<TB>(src + k * es);
            ss += x * x;
        }
        ss = od::warp_sum(ss);
        if (lane == 0) {
            sums[threadIdx.x / od::WARP_SIZE] = ss;
        }
        __syncthreads();
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < QUANT_BLOCK / od::WARP_SIZE; ++w) {
            total += sums[w];
        }
        scale = rsqrtf(total / static_cast<float>(K) + eps);
    }
    if (j >= K / 32) {
        return;
    }
    float v = mm::load_elem<TB>(src + (32ll * j + lane) * es);
    if constexpr (NORM) {
        v = v * scale * nw[32 * j + lane];
    }
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
// apart (scalar variants), batch strides b_s2, b_s3; out contiguous (B3, B2, N, M); biases rows
// bias_col floats apart (0: one row; mm_common.cuh's EPI_NONE).
// preload != 0: a0 (and a1) are constant (no kernel writes them), see mmv_tile.
template <int WT, int TB, int NT, int R, bool VEC, int EPI>
__global__ void __launch_bounds__(mm::BLOCK) mmv(const u8* a0, const u8* a1, long long a_row, long long a_s2,
                                                 long long a_s3, int r2, int r3, const u8* b, long long b_col,
                                                 long long b_es, long long b_s2, long long b_s3, float* out, int M,
                                                 int K, int N, const float* bias0, const float* bias1,
                                                 long long bias_col, int glu_kind, float alpha, float limit,
                                                 int preload) {
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
            const long long row = (static_cast<long long>(i3) * gridDim.y + i2) * N + n;
            out[row * M + m] = mm::finish<EPI, R, NT>(res, r, n, bias0, bias1, row * bias_col + m, glu_kind, alpha,
                                                      limit);
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
                                                     const float* bias1, long long bias_col, int glu_kind,
                                                     float alpha, float limit) {
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
    mm::q_store<EPI, NT>(tot, ocol, N, m0, rows, bias0, bias1, brow0, bias_col, glu_kind, alpha, limit);
}
