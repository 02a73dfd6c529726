// Tensor-core mat-mul for few columns (mmf): out (N, M) f32 = b (N, K) @ a (M, K)^T for f16/bf16
// weights a and N <= 8 * NT (NT n8 tiles: 8 or 16 columns) f32 columns b, memory-bound: every weight
// byte is read once, with 16-byte loads straight into the A registers of
// mma.sync.m16n8k16.row.col.f32.{bf16,f16} (f32 accumulation); b is rounded to a's type (as the
// cuBLAS path and ggml do) into shared memory, once a block.
//
// Geometry:
//   block   WARPS warps, ROWS = 16 * WARPS output rows, a split of K: ks values from s * ks
//           (grid x = row blocks * splits, s the fastest; y, z the batches B2, B3).
//   warp    16 rows (m0 + g and m0 + g + 8 for lane l = 4 g + t), all N columns, the block's split.
//   unit    32 consecutive k: lane (g, t) loads k 8t .. 8t+7 of rows g and g + 8 (16 bytes each;
//           the 4 lanes of a row read 64 contiguous bytes) and of b column g (16 bytes of shared
//           memory), and feeds them to two mma: the first takes words 0, 1 as logical k (2t, 2t+1)
//           and (2t+8, 2t+9), the second words 2, 3. The k order inside a unit is permuted alike
//           for A and B, so the products are the same sums.
//   in flight  U units (4; 2 for the gate/up pair of EPI_GLU) a group, the next group's loads issued
//           before the current group's mma: 2 U KB of weights a warp. With constant weights
//           (`preload`) the first group is loaded before the wait for the kernel ahead (PDL).
//   b       shared bs[unit][column n < NB][32 k] as a's type, 64 bytes a (unit, column): a quarter
//           warp's 16-byte loads cover 128 contiguous bytes (no bank conflict). Columns n >= N and
//           k >= K hold 0.
//   out     the block's sums go through a shared tile [NW][NB][TSTRIDE] (padded: the fragment
//           stores of a warp hit 32 banks); with one split the block applies the epilogue and writes
//           out (coalesced along m); with more each block stores its tile in `part`, and the last
//           block of a row block (od::last_block on counters[batch][row block]) sums the splits in
//           order, applies the epilogue and writes out.
// Dynamic shared memory: units(ks) * NB * 64 + NW * NB * TSTRIDE * 4 bytes (specs/mmf.py).
//
// The caller's (support.py, specs/mmf.py): K % 8 == 0; a0 (and a1) and their row and batch strides
// 16-byte aligned; ks a multiple of 32; every split non-empty. Rows past M read row M - 1 and write
// nothing.

#include "mm_common.cuh"

namespace mmfk {

using mm::u8;

constexpr int WARPS = 4;                      // warps a block, a 16-row tile each
constexpr int THREADS = WARPS * od::WARP_SIZE;
constexpr int ROWS = 16 * WARPS;              // output rows a block
constexpr int UNIT = 32;                      // k values a unit
constexpr int UNIT_BYTES = 64;                // bytes of a unit of a row (or of a b column) as f16/bf16
constexpr int TSTRIDE = ROWS + 4;             // floats a column of the result tile

// d += A (16 x 16) . B (16 x 8): A rows g, g + 8 words (a0, a2), (a1, a3); B column g words b0, b1
// (the PTX ISA's m16n8k16 fragments), f32 accumulation.
template <int WT>
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
    static_assert(WT == W_F16 || WT == W_BF16, "f16 or bf16 weights");
    if constexpr (WT == W_BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// Two floats as a word of a's type (the first in the low half), rounded to nearest even.
template <int WT>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    if constexpr (WT == W_BF16) {
        return od::f32_to_bf16(lo) | (static_cast<unsigned>(od::f32_to_bf16(hi)) << 16);
    } else {
        return od::f32_to_f16(lo) | (static_cast<unsigned>(od::f32_to_f16(hi)) << 16);
    }
}

// b's columns (value k of column n at b + n * b_col + k * b_es; 16-byte loads when `vec`) for the
// split's k0 .. k0 + kn - 1 into bs (layout above), zeros past N and kn, `units` units.
template <int WT, int NB>
__device__ __forceinline__ void stage_b(const u8* b, long long b_col, long long b_es, bool vec, int N, int k0, int kn,
                                        int units, u8* bs) {
    const int quads = units * (UNIT / 4);  // 4 values a thread a step
    for (int i = threadIdx.x; i < NB * quads; i += THREADS) {
        const int n = i / quads, kk = 4 * (i - n * quads);
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (n < N && kk < kn) {  // kn % 4 == 0: the 4 values lie in the split
            const u8* col = b + n * b_col;
            v = vec ? mm::load_b4<B_F32, true>(col, k0 + kk, b_es) : mm::load_b4<B_F32, false>(col, k0 + kk, b_es);
        }
        *reinterpret_cast<uint2*>(bs + ((kk / UNIT) * NB + n) * UNIT_BYTES + (kk % UNIT) * 2) =
            make_uint2(pack2<WT>(v.x, v.y), pack2<WT>(v.z, v.w));
    }
}

}  // namespace mmfk

using mm::u8;

// mul_mat: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k] for n < N <= 8 * NT,
// arguments as mmv's (mmv.cu; b f32), then: ks k values a split, `splits` splits (grid x = row blocks *
// splits), part (splits > 1: batches * row blocks * splits tiles of NW * NB * ROWS floats) and counters
// (one int a (batch, row block), zero between launches), preload (a0, a1 constant).
template <int WT, int NT, int EPI>
__global__ void __launch_bounds__(mmfk::THREADS)
    mmf(const u8* a0, const u8* a1, long long a_row, long long a_s2, long long a_s3, int r2, int r3, const u8* b,
        long long b_col, long long b_es, long long b_s2, long long b_s3, float* out, int M, int K, int N,
        const float* bias0, const float* bias1, int glu_kind, float alpha, float limit, int ks, int splits,
        float* part, int* counters, int preload) {
    od::grid_enter_later();  // below: after the first weight loads when the weights are constant
    using namespace mmfk;
    constexpr int NW = EPI == EPI_GLU ? 2 : 1;
    constexpr int NB = 8 * NT;
    constexpr int U = NW == 2 ? 2 : 4;
    extern __shared__ uint4 mmf_smem[];
    u8* const bs = reinterpret_cast<u8*>(mmf_smem);

    const int warp = threadIdx.x / od::WARP_SIZE, lane = threadIdx.x % od::WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int rb = blockIdx.x / splits, s = blockIdx.x - rb * splits;
    const int k0 = s * ks, kn = min(ks, K - k0);
    const int units = (kn + UNIT - 1) / UNIT, groups = (units + U - 1) / U;

    // this lane's two weight rows (a0's, and a1's for EPI_GLU), at k0 + 8t
    const u8* wrow[NW][2];
    {
        const int m = rb * ROWS + warp * 16 + g;
        const long long off = (i3 / r3) * a_s3 + (i2 / r2) * a_s2 + 16ll * t + 2ll * k0;
        const long long lo = min(m, M - 1) * a_row + off, hi = min(m + 8, M - 1) * a_row + off;
        wrow[0][0] = a0 + lo;
        wrow[0][1] = a0 + hi;
        if constexpr (NW == 2) {
            wrow[1][0] = a1 + lo;
            wrow[1][1] = a1 + hi;
        }
    }
    // the weights of group q: unit u's 16 bytes, zero past the split (k0 + kn <= K)
    auto load = [&](int q, uint4 (&w)[U][NW][2]) {
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int u = q * U + i;
            const bool live = UNIT * u + 8 * t < kn;
#pragma unroll
            for (int v = 0; v < NW; ++v) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    w[i][v][h] = live ? *reinterpret_cast<const uint4*>(wrow[v][h] + UNIT_BYTES * u)
                                      : make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
    };

    uint4 cur[U][NW][2];
    if (preload) {
        load(0, cur);
    }
    od::grid_enter();
    if (!preload) {
        load(0, cur);
    }
    const u8* bb = b + i3 * b_s3 + i2 * b_s2;
    const bool vec = b_es == 4 && ((reinterpret_cast<unsigned long long>(bb) | static_cast<unsigned long long>(b_col)) &
                                   15ull) == 0;
    stage_b<WT, NB>(bb, b_col, b_es, vec, N, k0, kn, units, bs);
    __syncthreads();

    float acc[NW][NT][4];
#pragma unroll
    for (int v = 0; v < NW; ++v) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                acc[v][j][c] = 0.0f;
            }
        }
    }
    const u8* const bl = bs + g * UNIT_BYTES + 16 * t;  // column g, k 8t.. of unit 0
    for (int q = 0; q < groups; ++q) {
        uint4 nxt[U][NW][2];
        if (q + 1 < groups) {
            load(q + 1, nxt);
        }
#pragma unroll
        for (int i = 0; i < U; ++i) {
            const int u = q * U + i;
            if (u < units) {
                uint4 bv[NT];
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    bv[j] = *reinterpret_cast<const uint4*>(bl + (u * NB + 8 * j) * UNIT_BYTES);
                }
#pragma unroll
                for (int v = 0; v < NW; ++v) {
                    const uint4 lo = cur[i][v][0], hi = cur[i][v][1];
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        mma_16816<WT>(acc[v][j], lo.x, hi.x, lo.y, hi.y, bv[j].x, bv[j].y);
                        mma_16816<WT>(acc[v][j], lo.z, hi.z, lo.w, hi.w, bv[j].z, bv[j].w);
                    }
                }
            }
        }
        if (q + 1 < groups) {
#pragma unroll
            for (int i = 0; i < U; ++i) {
#pragma unroll
                for (int v = 0; v < NW; ++v) {
                    cur[i][v][0] = nxt[i][v][0];
                    cur[i][v][1] = nxt[i][v][1];
                }
            }
        }
    }

    // the sums to the tile: acc[v][j] holds rows g, g + 8 of columns 8j + 2t, 8j + 2t + 1
    float* const tile = reinterpret_cast<float*>(bs + static_cast<long long>(units) * NB * UNIT_BYTES);
#pragma unroll
    for (int v = 0; v < NW; ++v) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float* col = tile + (v * NB + 8 * j + 2 * t) * TSTRIDE + warp * 16 + g;
            col[0] = acc[v][j][0];
            col[TSTRIDE] = acc[v][j][1];
            col[8] = acc[v][j][2];
            col[TSTRIDE + 8] = acc[v][j][3];
        }
    }
    __syncthreads();

    const long long batch = static_cast<long long>(i3) * gridDim.y + i2;
    const int mb = rb * ROWS;
    float* const o = out + batch * N * M;
    if (splits == 1) {
        for (int i = threadIdx.x; i < N * ROWS; i += THREADS) {
            const int n = i / ROWS, r = i - n * ROWS;
            if (mb + r < M) {
                const float up = NW == 2 ? tile[(NB + n) * TSTRIDE + r] : 0.0f;
                o[static_cast<long long>(n) * M + mb + r] =
                    mm::epilogue<EPI>(tile[n * TSTRIDE + r], up, bias0, bias1, mb + r, glu_kind, alpha, limit);
            }
        }
        return;
    }
    constexpr int TILE = NW * NB * ROWS;  // floats of a partial tile: [v][n][r]
    const long long rbs = gridDim.x / splits, slot = batch * rbs + rb;
    float* const mine = part + (slot * splits + s) * TILE;
    for (int i = threadIdx.x; i < TILE; i += THREADS) {
        const int c = i / ROWS;
        mine[i] = tile[c * TSTRIDE + (i - c * ROWS)];
    }
    if (!od::last_block(counters + slot, splits)) {
        return;
    }
    const float* const all = part + slot * splits * TILE;
    for (int i = threadIdx.x; i < N * ROWS; i += THREADS) {
        const int n = i / ROWS, r = i - n * ROWS;
        if (mb + r < M) {
            float v = 0.0f, up = 0.0f;
            for (int p = 0; p < splits; ++p) {
                v += __ldcg(all + p * TILE + i);
                if constexpr (NW == 2) {
                    up += __ldcg(all + p * TILE + NB * ROWS + i);
                }
            }
            o[static_cast<long long>(n) * M + mb + r] =
                mm::epilogue<EPI>(v, up, bias0, bias1, mb + r, glu_kind, alpha, limit);
        }
    }
}
