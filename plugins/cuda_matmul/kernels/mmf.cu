// Tensor-core mat-mul for few columns (mmf): out (N, M) f32 = b (N, K) @ a (M, K)^T for f16/bf16
// weights a and N <= 8 * NT (NT n8 tiles: 8 or 16 columns) f32 columns b, a weight stream bound by
// memory bandwidth: every weight byte is read once, copied by cp.async into a per-warp ring of shared
// memory in runs of whole row pieces (a warp's copy instruction reads 256 contiguous bytes of each of two
// rows, or 128 of four for the gate/up pair), then fed by ldmatrix to mma.sync.m16n8k16.row.col.f32.{bf16,
// f16} (f32 accumulation). The copies in flight hold no registers (the kernel before this one loaded
// 16-byte pieces of 8 rows straight into the mma registers, two groups in flight a warp; docs/benchmarks.md
// has both timed). b is rounded to a's type (as the cuBLAS path and ggml do) into shared memory, once a
// block, so no conversion launch runs before it.
//
// Geometry:
//   grid    x = row groups G * splits S (s the fastest), y, z the batches B2, B3. Block (r, s) takes split
//           s of K (ks values from s * ks) and warp tiles r * WARPS + w + i * G * WARPS (i = 0, 1, ...):
//           with G smaller than the row blocks (large M) the blocks are persistent, each staging b once
//           for all its tiles.
//   warp    a warp tile: 16 rows, all N columns, the block's split; the warp streams its tiles one after
//           the other, its accumulators flushed at the end of each.
//   groups  U units of 32 k (4; 2 for the gate/up pair of EPI_GLU: STAGE_BYTES of weights either way) a
//           group, a tile's split ceil(units / U) groups (k past the split's end reads as zeros). A warp's
//           groups, tile after tile, go through its ring of STAGES slots: group q + STAGES - 1 is copied
//           while the warp multiplies group q, so STAGES - 1 groups are in flight, across tile boundaries
//           too. With constant weights (`preload`) the first STAGES - 1 groups are issued before the wait
//           for the kernel ahead (PDL); either way before b is staged.
//   slot    a weight's 16 rows of PR = 4 U pieces (16 bytes, 8 k) each, piece p of row r at r * PR + (p ^ (r
//           % 8)) (so that ldmatrix's 8 rows of one piece hit 8 different bank groups); lane l's copy j takes
//           piece (32 j + l) % PR of row (32 j + l) / PR.
//   mma     k16 step m of a group: one ldmatrix.x4 a weight (rows 0-7 / 8-15 of pieces 2m, 2m + 1: the A
//           fragment), and lane (g, t)'s b words from shared memory.
//   b       shared bs[unit][column n < NB][32 k] as a's type, 64 bytes a (unit, column), its 16 pairs of k in
//           the order the fragments take them: lane t's 16 bytes hold pairs (2t, 2t + 8, 16 + 2t, 24 + 2t),
//           b0 and b1 of the unit's two k16 steps (pair 4w + t at word 4t + w). A quarter warp's 16-byte loads
//           cover 128 contiguous bytes (no bank conflict). Columns n >= N and k >= the split's end hold 0.
//           Each thread issues STAGE_LOADS loads of b before it stores any.
//   out     one split: the warp applies the epilogue (a bias row, or a residual addend's element:
//           mm_common.cuh's EPI_NONE) to its fragments and writes its rows < M, columns < N. Several: the warp
//           stores its fragments in `part` (tile slot, split; coalesced float4s), and the last warp of the
//           tile's splits (last_warp on counters[batch][tile]) sums them in split order (deterministic),
//           applies the epilogue and writes out.
// Dynamic shared memory: the rings (WARPS * STAGES * STAGE_BYTES), then b: ks / 32 * NB * 64 bytes
// (specs/mmf.py).
//
// The caller's (support.py, specs/mmf.py): K % 8 == 0; a0 (and a1) and their row and batch strides
// 16-byte aligned; ks a multiple of 32 U; every split non-empty. Rows past M read row M - 1 and write
// nothing.

#include "mm_common.cuh"

namespace mmfk {

using mm::u8;

constexpr int WARPS = 8;                      // warps a block, a warp tile each at a time
constexpr int THREADS = WARPS * od::WARP_SIZE;
constexpr int UNIT = 32;                      // k values a unit
constexpr int UNIT_BYTES = 64;                // bytes of a unit of a row (or of a b column) as f16/bf16
constexpr int PIECE = 16;                     // bytes a copy (8 k)
constexpr int STAGES = 3;                     // ring slots a warp
constexpr int STAGE_BYTES = 4096;             // a slot: one group of 16 rows (of each weight)
constexpr int RING_BYTES = WARPS * STAGES * STAGE_BYTES;
constexpr int STAGE_LOADS = 8;                // b loads (4 floats each) a thread issues before it stores

// Units a group: a slot's 16 rows of 256 bytes, or of 128 for each weight of a pair.
template <int NW>
__host__ __device__ constexpr int group_units() {
    return STAGE_BYTES / (NW * 16 * UNIT_BYTES);
}

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
// split's k0 .. k0 + kn - 1 into bs (layout above), zeros past N and kn, `units` units. The loads of a
// round go out before its stores, so a thread waits for memory once a round, not once a load.
template <int WT, int NB>
__device__ __forceinline__ void stage_b(const u8* b, long long b_col, long long b_es, bool vec, int N, int k0, int kn,
                                        int units, u8* bs) {
    const int quads = units * (UNIT / 4);  // 4 values a load
    const int total = NB * quads;
    // i / quads as umulhi(i, inv): exact while i * quads < 2^32 (here i < total + STAGE_LOADS * THREADS and quads
    // at most KS_MAX / 4: specs/mmf.py), one multiply where a signed division took a dozen instructions
    const unsigned inv = 0xffffffffu / static_cast<unsigned>(quads) + 1u;
    for (int i0 = threadIdx.x; i0 < total; i0 += STAGE_LOADS * THREADS) {
        float4 v[STAGE_LOADS];
#pragma unroll
        for (int r = 0; r < STAGE_LOADS; ++r) {
            const int i = i0 + r * THREADS, n = __umulhi(i, inv), kk = 4 * (i - n * quads);
            v[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (n < N && kk < kn) {  // kn % 8 == 0: the 4 values lie in the split; i >= total: n >= NB >= N
                const u8* col = b + n * b_col;
                v[r] = vec ? mm::load_b4<B_F32, true>(col, k0 + kk, b_es)
                           : mm::load_b4<B_F32, false>(col, k0 + kk, b_es);
            }
        }
#pragma unroll
        for (int r = 0; r < STAGE_LOADS; ++r) {
            const int i = i0 + r * THREADS, n = __umulhi(i, inv), kk = 4 * (i - n * quads);
            if (i < total) {  // pairs p, p + 1 of the unit (p even) at words 4 (p % 4) + p / 4 (the layout above)
                unsigned* col = reinterpret_cast<unsigned*>(bs + ((kk / UNIT) * NB + n) * UNIT_BYTES);
                const int p = (kk % UNIT) / 2;
                col[4 * (p % 4) + p / 4] = pack2<WT>(v[r].x, v[r].y);
                col[4 * (p % 4 + 1) + p / 4] = pack2<WT>(v[r].z, v[r].w);
            }
        }
    }
}

// od::last_block for one warp: each warp of a tile's splits calls it after storing its partial sums; true
// in the warp that counted last, which then sees the others' stores (read them with __ldcg) and has set
// the counter back to 0 for the next launch or graph replay.
__device__ __forceinline__ bool last_warp(int* counter, int warps) {
    __threadfence();  // this lane's stores are visible device-wide before the warp counts itself done
    __syncwarp();
    int last = 0;
    if (threadIdx.x % od::WARP_SIZE == 0) {
        last = atomicAdd(counter, 1) == warps - 1;
        if (last) {
            *counter = 0;
        }
    }
    last = od::warp_sum(last);  // lane 0's answer to every lane
    if (last) {
        __threadfence();  // order this warp's reads after the other warps' counted stores
    }
    return last != 0;
}

}  // namespace mmfk

using mm::u8;

// mul_mat: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k] for n < N <= 8 * NT,
// arguments as mmv's (mmv.cu; b f32; biases rows bias_col floats apart, 0 for one row), then: ks k values
// a split, `splits` splits (grid x = row groups * splits), part (splits > 1: batches * warp tiles * splits
// partial tiles of NW * NT * 32 float4s) and counters (one int a (batch, warp tile), zero between
// launches), preload (a0, a1 constant).
template <int WT, int NT, int EPI>
__global__ void __launch_bounds__(mmfk::THREADS, 2)
    mmf(const u8* a0, const u8* a1, long long a_row, long long a_s2, long long a_s3, int r2, int r3, const u8* b,
        long long b_col, long long b_es, long long b_s2, long long b_s3, float* out, int M, int K, int N,
        const float* bias0, const float* bias1, long long bias_col, int glu_kind, float alpha, float limit, int ks,
        int splits, float* part, int* counters, int preload) {
    od::grid_enter_later();  // below: after the first weight loads when the weights are constant
    using namespace mmfk;
    constexpr int NW = EPI == EPI_GLU ? 2 : 1;
    constexpr int NB = 8 * NT;
    constexpr int U = group_units<NW>();
    constexpr int PR = 4 * U;                        // pieces a row of a slot
    constexpr int WEIGHT_BYTES = 16 * PR * PIECE;    // a weight's rows in a slot
    constexpr int COPIES = WEIGHT_BYTES / (PIECE * od::WARP_SIZE);  // a lane's copies a weight and group
    constexpr int FRAGS = NW * NT * od::WARP_SIZE;  // float4s of a partial tile: [v][j][lane]
    const int warp = threadIdx.x / od::WARP_SIZE, lane = threadIdx.x % od::WARP_SIZE;
    extern __shared__ uint4 mmf_smem[];
    u8* const ring = reinterpret_cast<u8*>(mmf_smem) + warp * STAGES * STAGE_BYTES;
    u8* const bs = reinterpret_cast<u8*>(mmf_smem) + RING_BYTES;

    const int g = lane / 4, t = lane % 4;
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int rg = blockIdx.x / splits, s = blockIdx.x - rg * splits, groups_x = gridDim.x / splits;
    const int k0 = s * ks, kn = min(ks, K - k0);
    const int units = (kn + UNIT - 1) / UNIT, gpt = (units + U - 1) / U;  // groups a tile
    const int tiles = (M + 15) / 16;
    const int first = rg * WARPS + warp, stride = groups_x * WARPS;
    const int total = first < tiles ? ((tiles - 1 - first) / stride + 1) * gpt : 0;  // this warp's groups

    // The copy stream, STAGES - 1 groups ahead of the products: group qi (of the warp's `total`) into ring slot
    // si, group gi of tile ti. A lane's copies of a group all take piece wp = lane % PR of a row, rows wr + RJ j
    // (j < COPIES); src[j] points at that piece of a0's row (clamped to M - 1) for the group, set at a tile's
    // first group and moved on by a group's bytes after each, and its slot offset is at[j % V] plus a constant
    // (the swizzle r % 8 repeats every V copies), so that a copy costs its address add (a1's: the weights'
    // offset added). Pieces past the split (k0 + kn <= K) are zeros, stored, not copied.
    constexpr int RJ = od::WARP_SIZE / PR;      // rows a copy instruction covers
    constexpr int V = 8 / RJ;                   // copies before the rows' swizzle repeats
    constexpr int GROUP_STEP = U * UNIT_BYTES;  // bytes of a row a group covers
    static_assert(8 % RJ == 0 && COPIES % V == 0, "whole swizzle periods");
    const int wp = lane % PR, wr = lane / PR;
    unsigned at[V];
#pragma unroll
    for (int c = 0; c < V; ++c) {
        const int r = wr + RJ * c;
        at[c] = (r * PR + (wp ^ (r % 8))) * PIECE;
    }
    auto piece_at = [&](int j) { return at[j % V] + j / V * 8 * PR * PIECE; };  // copy j's offset in a slot
    const unsigned ring_s = od::smem_addr(ring);
    const long long a1_off = NW == 2 ? static_cast<long long>(a1 - a0) : 0;  // the pair shares a0's strides
    const u8* const wbase = a0 + (i3 / r3) * a_s3 + (i2 / r2) * a_s2 + 2ll * k0 + PIECE * wp;
    const u8* src[COPIES];
    int qi = 0, gi = 0, ti = first, si = 0;
    auto issue = [&]() {
        if (qi < total) {
            if (gi == 0) {
#pragma unroll
                for (int j = 0; j < COPIES; ++j) {
                    src[j] = wbase + min(ti * 16 + wr + RJ * j, M - 1) * a_row;
                }
            }
            const unsigned slot = si * STAGE_BYTES;
            if (gi * U * UNIT + 8 * wp < kn) {
#pragma unroll
                for (int j = 0; j < COPIES; ++j) {
                    const unsigned dst = ring_s + slot + piece_at(j);
#pragma unroll
                    for (int v = 0; v < NW; ++v) {
                        od::cp_async16(dst + v * WEIGHT_BYTES, src[j] + v * a1_off);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < COPIES; ++j) {
                    u8* const dst = ring + slot + piece_at(j);
#pragma unroll
                    for (int v = 0; v < NW; ++v) {
                        *reinterpret_cast<uint4*>(dst + v * WEIGHT_BYTES) = make_uint4(0u, 0u, 0u, 0u);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < COPIES; ++j) {
                src[j] += GROUP_STEP;
            }
            ++qi;
            si = si == STAGES - 1 ? 0 : si + 1;
            if (++gi == gpt) {
                gi = 0;
                ti += stride;
            }
        }
        od::cp_async_commit();  // empty past the warp's last group: the wait below counts groups alike
    };

    auto issue_first = [&]() {
#pragma unroll
        for (int q = 0; q < STAGES - 1; ++q) {
            issue();
        }
    };
    if (preload) {
        issue_first();
    }
    od::grid_enter();
    if (!preload) {
        issue_first();
    }
    const u8* bb = b + i3 * b_s3 + i2 * b_s2;
    const bool vec = b_es == 4 && ((reinterpret_cast<unsigned long long>(bb) | static_cast<unsigned long long>(b_col)) &
                                   15ull) == 0;
    stage_b<WT, NB>(bb, b_col, b_es, vec, N, k0, kn, gpt * U, bs);
    __syncthreads();

    const long long batch = static_cast<long long>(i3) * gridDim.y + i2;
    float* const o = out + batch * N * M;
    const long long brow0 = batch * N;  // the batch's first output row (the biases' index)
    // the epilogue of fragment sums x (rows m0 + g, m0 + g + 8; columns 8j + 2t, 8j + 2t + 1) to out
    auto write = [&](int m0, const float (&x)[NW][NT][4]) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int n = 8 * j + 2 * t + (c & 1), m = m0 + g + 8 * (c >> 1);
                if (n < N && m < M) {
                    const float up = NW == 2 ? x[NW - 1][j][c] : 0.0f;
                    o[static_cast<long long>(n) * M + m] = mm::epilogue<EPI>(
                        x[0][j][c], up, bias0, bias1, (brow0 + n) * bias_col + m, glu_kind, alpha, limit);
                }
            }
        }
    };
    float acc[NW][NT][4];
    auto zero = [&]() {
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
    };
    // the sums of warp tile wt: written out (one split), or stored as a partial, the last warp of the tile's
    // splits adding them all in split order
    auto flush = [&](int wt) {
        if (splits == 1) {
            write(16 * wt, acc);
            return;
        }
        const long long slot = batch * tiles + wt;
        float4* const mine = reinterpret_cast<float4*>(part) + (slot * splits + s) * FRAGS;
#pragma unroll
        for (int v = 0; v < NW; ++v) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                mine[(v * NT + j) * od::WARP_SIZE + lane] = make_float4(acc[v][j][0], acc[v][j][1], acc[v][j][2],
                                                                        acc[v][j][3]);
            }
        }
        if (!last_warp(counters + slot, splits)) {
            return;
        }
        const float4* const all = reinterpret_cast<const float4*>(part) + slot * splits * FRAGS + lane;
        zero();
#pragma unroll 4
        for (int p = 0; p < splits; ++p) {
#pragma unroll
            for (int v = 0; v < NW; ++v) {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const float4 x = __ldcg(all + p * FRAGS + (v * NT + j) * od::WARP_SIZE);
                    acc[v][j][0] += x.x;
                    acc[v][j][1] += x.y;
                    acc[v][j][2] += x.z;
                    acc[v][j][3] += x.w;
                }
            }
        }
        write(16 * wt, acc);
    };
    const u8* const bl = bs + g * UNIT_BYTES + 16 * t;  // column g, pairs of lane t, of unit 0
    // ldmatrix: lanes 0-7 / 8-15 / 16-23 / 24-31 address rows 0-7 / 8-15 / 0-7 / 8-15, pieces 2m / 2m / 2m + 1 / 2m + 1
    const int lr = lane % 8 + 8 * ((lane / 8) % 2), lp = lane / 16;
    // The products: group gs of tile ts from ring slot ss, then the tile's flush at its last group
    int gs = 0, ts = first, ss = 0;
    auto step = [&]() {
        const unsigned slot = ring_s + ss * STAGE_BYTES + lr * PR * PIECE;
        const u8* const bu = bl + gs * U * NB * UNIT_BYTES;  // b's units of the group
#pragma unroll
        for (int j = 0; j < U; ++j) {
            uint4 bv[NT];
#pragma unroll
            for (int h = 0; h < NT; ++h) {
                bv[h] = *reinterpret_cast<const uint4*>(bu + (j * NB + 8 * h) * UNIT_BYTES);
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int p = 2 * (2 * j + e) + lp;
#pragma unroll
                for (int v = 0; v < NW; ++v) {
                    unsigned x0, x1, x2, x3;
                    od::ldsm_x4(slot + v * WEIGHT_BYTES + (p ^ (lr % 8)) * PIECE, x0, x1, x2, x3);
#pragma unroll
                    for (int h = 0; h < NT; ++h) {
                        mma_16816<WT>(acc[v][h], x0, x1, x2, x3, e ? bv[h].z : bv[h].x, e ? bv[h].w : bv[h].y);
                    }
                }
            }
        }
        ss = ss == STAGES - 1 ? 0 : ss + 1;
        if (++gs == gpt) {
            flush(ts);
            zero();
            gs = 0;
            ts += stride;
        }
    };

    zero();
    for (int q = 0; q < total; ++q) {
        od::cp_async_wait<STAGES - 2>();  // this lane's copies of group q have landed
        __syncwarp();                      // and the other lanes': the slot is whole; the slot group q - 1 read is free
        issue();                           // group q + STAGES - 1, into that slot
        step();
    }
}
