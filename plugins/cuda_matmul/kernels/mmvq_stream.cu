// Quantized mat-vec in one launch, the weights streamed through shared memory (mmvq_stream):
// out (N, M) = b (N, K) @ a (M, K)^T for block-format weights a and N <= NT (<= 8) float
// columns b, each weight byte read once (cp.async, or on sm_90+ bulk copies: 2. below).
//
// mmv.cu's mmvq takes two launches (quantize_q8_1 into a scratch buffer, then the mat-vec
// reading 2-byte aligned blocks straight from global memory); this kernel is one:
//
// 1. Each warp of a block issues the first NS - 1 stages of its weight stream
//    (cp.async.cg.shared.global, 16 bytes a lane, commit_group), and the whole block
//    quantizes the N columns of b it needs to q8_1 into shared memory, exactly as
//    quantize_q8_1 does (per 32 values: d = absmax / 127, codes round(v * 127 / absmax),
//    and d * sum(codes)), two threads a block of 32: after the copies are issued when the
//    weights are constant (those are issued before the PDL wait), before otherwise.
//    One __syncthreads.
// 2. Each warp then walks its row groups through a ring of NS stage buffers of its own
//    (issue the stage NS - 1 ahead, wait_group NS - 1, __syncwarp, compute, __syncwarp). On sm_90+
//    the stages go by bulk copies (cp.async.bulk, one a slot row, counted on the stage's mbarrier,
//    which the warp waits on instead; the half-piece formats' prologue stages by cp.async), but for
//    RAGGED slots and the formats of CP_ASYNC_STAGES.
//
// Geometry (Geo and layout below; cuda_matmul/specs/stream.py's stream_geo and stream_layout mirror it):
//   chunk   CB consecutive blocks of a row, the fewest whose bytes are a multiple of 16
//           (Geo: q4_0, q5_0, q8_0 8 blocks = 144, 176, 272 bytes; q4_1 4 = 80; q5_1 2 = 48;
//           q4_K 1 = 144, q5_K 1 = 176, iq4_xs 2 = 272, mxfp4 16 = 272, iq4_nl 8 = 144, iq1_m 2 =
//           112; q2_K 4 = 336, q3_K 8 = 880, q6_K 8 = 1680, iq2_xxs 8 = 528, iq2_xs 8 = 592, iq2_s
//           8 = 656, iq3_xxs 8 = 784, iq3_s 8 = 880, iq1_s 8 = 400): rows of whole chunks
//           (K % (QK * CB) == 0), the weights 16-byte aligned (base, row and batch strides) are the
//           caller's.
//   piece   what one lane dots, LB blocks: the chunk when it is at most REG_CHUNK_MAX (272) bytes
//           (REG: every legacy format, q4_K, q5_K, iq4_nl, iq1_m), half of it for the table formats
//           iq4_xs (one block, 136 bytes) and mxfp4 (8 blocks, 136 bytes; HALF_PIECE), else one block
//           (q2_K, q3_K, q6_K and the other grid I-quants: a chunk is too many registers). A row is
//           C = K / (QK * LB) pieces.
//   lanes   G = min(32, next_pow2(C)) lanes a row, R = 32 / G rows (slots) a warp stage,
//           S = ceil(C / G) segments a row (S > 1 only when G = 32). Lane l of a stage takes
//           slot l / G, piece seg * G + l % G of that slot's row (idle past C).
//   stage   the R slot rows' segment, copied contiguously per row: slot r's pieces land at
//           r * G * PIECE, so lane l's piece is at l * PIECE of the stage buffer (32 * PIECE
//           bytes; G >= CB / LB, so rows and segments start on granules). A REG lane reads its
//           chunk with 16-byte loads: the chunk stride is an odd number of 16-byte granules for
//           every format, so the 8 lanes of a quarter warp hit 8 distinct bank groups (a half piece
//           with 8-byte loads, 34 words apart: a half warp's 16 lanes on 32 distinct banks). Legacy
//           blocks are moved out of the chunk's words at compile-time offsets (decode_words) and
//           dotted with b's codes by dp4a; quant_k.cuh's formats go 32 values (a unit) at a time
//           through the format's dot32_in, reading the words through a Regs source (constant
//           offsets: registers and funnel shifts). A one-block piece (lanes BYTES apart, an even
//           number: 2-byte aligned) is read with 4-byte loads and funnel-shifted into place.
//   groups  a group is RO output rows: R of them (EPI_NONE/EPI_BIAS), or with EPI_GLU R / 2
//           gate rows in slots 0 .. R/2 - 1 and the same up rows in slots R/2 .. R - 1
//           (R >= 2: one shuffle pairs them), or, when R = 1, one row: its S gate segments
//           then its S up segments. A group is UG units (stages): S, 1 or 2 S.
//   warps   the warps of the grid (gridDim.x * blockDim.x / 32 for each batch (i2, i3) of
//           gridDim.y, gridDim.z) split the groups of a batch into even contiguous ranges
//           (warp w: groups [w * groups / W, (w + 1) * groups / W)).
//   b       column n's piece c at bs + (n * C + c) * BCHUNK: NU = LB * QK / 32 q8_1 blocks of 32
//           int8 codes (the table formats': in nibble-pair order), then NU float2 (d, d * sum; Fmt::HALF_SUMS:
//           (d, the two halves' sums as int16 in the float's bits), q2_K's mins' dp2a operand), padded
//           to an odd number of granules (conflict-free as the weights); codes read with 16-byte loads,
//           (d, d * sum) two blocks at a time (legacy) or one (a unit of quant_k.cuh's formats).
// RAGGED (instances of their own: rows that are not whole chunks, so row starts off 16-byte boundaries; one
// column): C = ceil(K / piece values), the last piece of a row partial; each slot's segment is staged as its
// covering granules, zeros after them (issue_ragged), slots ragged_slot bytes apart, and each lane reads its piece
// where it lies, with one load more, funnel-shifting the words into place (load_shifted); b's q8_1 units past K
// are zeros. The weights' base must be 16-byte aligned. Not for the legacy formats (a static_assert; mmvq runs
// their ragged rows, as fast or faster on the H200: docs/cuda_matmul.md), so only dot_piece reads shifted pieces.
// Fused rms_norm (norm_w not null; fusion.py's rms_norm_mul_mat groups): b is the norm's input x, and
// the block quantizes x * norm_w while it sums x^2 (quantize_b); every output is then scaled by its
// column's rsqrt(sum / K + norm_eps) before the epilogue, which is rms_norm(x) * norm_w . a up to float
// rounding (q8_1's block scales absorb the column's scale).
// KEEP (the rms_norm_mul_mat_share group, one column: the normed values are read by other nodes too): the
// blocks also write rms_norm(x) * norm_w to norm_out, (N, K) f32 contiguous, each block a slice, after
// the ring. A template flag, not a null check: the code in every instance cost the q4_0 1b decode ~1%.
// Dynamic shared memory: N * C * BCHUNK + (blockDim.x / 32) * NS * 32 * PIECE bytes, then the norm's
// sums (8 floats a warp), then a grid format's grid_copies copies of its grid (stage_grid), then each
// warp's NS stage barriers (8 bytes each; used by the bulk copies only).
//
// Scaling as q_rows: a legacy block's dot with b's codes (dp4a over raw codes c), then
// d * (db * dot - zero * db * sum) (+ m * db * sum for q4_1 / q5_1); quant_k.cuh's units as their
// dot32 (q_rows_subscaled), summed in unit order. Rows past M (the last group) read row M - 1 and
// write nothing. Output (B3, B2, N, M) contiguous, epilogue() as mmvq.

#include "mm_common.cuh"

namespace mms {

using mm::u8;

constexpr int THREADS_MAX = 256;  // launch bound: up to 8 warps a block
constexpr int REG_CHUNK_MAX = 272;  // most chunk bytes a lane holds in registers (q8_0's, iq4_xs's, mxfp4's)

constexpr int pow2_of(int x) {
    return x % 16 == 0 ? 16 : x % 8 == 0 ? 8 : x % 4 == 0 ? 4 : x % 2 == 0 ? 2 : 1;
}

// The formats whose lane dots half a chunk (iq4_xs one block of 136 bytes, mxfp4 8 of 17): their table
// lookups make them ALU-bound, and half pieces halve a warp's ring and its registers, so that two 8-warp
// blocks fit an SM (four warps a scheduler where one block left two). specs/stream.py's HALF_PIECE.
template <int WT>
constexpr bool HALF_PIECE = WT == W_IQ4_XS || WT == W_MXFP4;

// The formats whose stages go by cp.async even where bulk copies exist: the lightest dots a byte (4 or 5 bits a
// weight, a chunk a lane), at the bandwidth, where bulk copies measured 3-4% slower (H200, 14336x4096, one column,
// cold: q4_0 9.7 -> 10.1 us, q4_K 9.75 -> 10.07, q5_K 11.45 -> 11.78) and the formats whose lanes do more work
// gained 5-10% (q3_K 11.7 -> 10.8, iq4_xs 12.5 -> 11.7, mxfp4 12.9 -> 12.0, q8_0 16.1 -> 15.8; q6_K even).
template <int WT>
constexpr bool CP_ASYNC_STAGES =
    WT == W_Q4_0 || WT == W_Q4_1 || WT == W_Q5_0 || WT == W_Q5_1 || WT == W_Q4_K || WT == W_Q5_K;

// How a stage is issued, a compile-time choice: bulk copies (Copies<true>) or cp.async (Copies<false>).
template <bool BULK>
struct Copies {
    static constexpr bool bulk = BULK;
};

// Chunk and piece geometry of format WT.
template <int WT>
struct Geo {
    using F = mm::Fmt<WT>;
    static constexpr int CB = 16 / pow2_of(F::BYTES);  // blocks a chunk: lcm(BYTES, 16) / BYTES
    static constexpr int CHUNK = CB * F::BYTES;         // weight bytes a chunk
    static constexpr bool REG = CHUNK <= REG_CHUNK_MAX;  // a lane's piece is held in registers
    static constexpr int LB = !REG ? 1 : HALF_PIECE<WT> ? CB / 2 : CB;  // blocks a piece (a lane's share of a stage)
    static constexpr int PIECE = LB * F::BYTES;
    static constexpr int GRAN = CHUNK / 16;
    static constexpr int WORDS = CHUNK / 4;
    static constexpr int LOAD = pow2_of(PIECE);  // bytes a REG lane loads at once: 16, or 8 for half pieces
    static constexpr int NU = LB * F::QK / 32;          // q8_1 blocks (units of 32 values) a piece
    static constexpr int BCODES = NU * 32;              // b: a piece's codes, then its (d, d * sum)
    static constexpr int BRAW = NU * 40;
    static constexpr int BCHUNK = (BRAW / 16) % 2 == 1 ? BRAW : BRAW + 16;
    // blocks an SM the registers must allow (the launch bound's second argument: 2 caps a thread at 128):
    // 1 for the legacy chunks (q8_0's 68 words in registers) and iq4_nl; 2 for the one-block pieces
    // (their words and their shifted copy), the half pieces, q4_K, q5_K and iq1_m, whose shared memory
    // fits two blocks an SM: unbounded, q4_K took 132-136 registers after the fused norm and bias
    // epilogues came in (sessions 14-15) and its blocks ran one an SM (H200, 14336x4096, one column: 12.95
    // us; bounded 9.71), q5_K 153 (12.8 us with 3 stages; bounded, 2 stages: 11.5), iq1_m 223 (18.0 us;
    // bounded: 14.5, an 8-byte spill in ptxas -v; session 20); the others spill nothing
    static constexpr int MIN_BLOCKS = REG && (F::LEGACY || WT == W_IQ4_NL) ? 1 : 2;
    static_assert(CHUNK % 16 == 0 && GRAN % 2 == 1, "chunk stride must be an odd number of granules");
    static_assert(NU % 2 == 0 && BRAW % 16 == 0 && (BCHUNK / 16) % 2 == 1, "b chunk layout");
    static_assert(F::LEGACY ? REG : F::QK % 32 == 0, "legacy chunks in registers");
    static_assert((32 * PIECE) % 16 == 0 && (!REG || LOAD >= 8), "a stage of whole granules, REG pieces of 8-byte words");
};

// Granules of n consecutive pieces (n a multiple of CB / LB: whole chunks).
template <int WT>
__device__ __forceinline__ int piece_granules(int n) {
    using Gm = Geo<WT>;
    if constexpr (Gm::PIECE % 16 == 0) {
        return n * (Gm::PIECE / 16);
    } else {
        return n * Gm::PIECE / 16;
    }
}

// -- geometry ---------------------------------------------------------------------------------------

struct Layout {
    int C;   // chunks a row
    int G;   // lanes a row
    int R;   // slots (rows) a stage
    int S;   // segments a row
    int RO;  // output rows a group
    int UG;  // units (stages) a group
};

__device__ __forceinline__ Layout layout(int C, bool glu) {
    Layout l;
    l.C = C;
    l.G = 1;
    while (l.G < C && l.G < 32) {
        l.G <<= 1;
    }
    l.R = 32 / l.G;
    l.S = (C + l.G - 1) / l.G;
    if (!glu) {
        l.RO = l.R;
        l.UG = l.S;
    } else if (l.R >= 2) {
        l.RO = l.R / 2;
        l.UG = 1;
    } else {
        l.RO = 1;
        l.UG = 2 * l.S;
    }
    return l;
}

// -- b to q8_1 in shared memory ----------------------------------------------------------------------

// V (16 or 32) consecutive values of a column of b (at src) as floats: 16-byte loads when `vec`.
template <int TB, int V>
__device__ __forceinline__ void load_b(const u8* src, long long b_es, bool vec, float (&v)[V]) {
    if (vec) {
        if constexpr (TB == B_F32) {
#pragma unroll
            for (int i = 0; i < V / 4; ++i) {
                const float4 x = reinterpret_cast<const float4*>(src)[i];
                v[4 * i] = x.x, v[4 * i + 1] = x.y, v[4 * i + 2] = x.z, v[4 * i + 3] = x.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < V / 8; ++i) {
                const uint4 x = reinterpret_cast<const uint4*>(src)[i];
                const unsigned u[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    if constexpr (TB == B_F16) {
                        od::unpack_f16x2(u[t], v[8 * i + 2 * t], v[8 * i + 2 * t + 1]);
                    } else {
                        od::unpack_bf16x2(u[t], v[8 * i + 2 * t], v[8 * i + 2 * t + 1]);
                    }
                }
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; ++i) {
            v[i] = mm::load_elem<TB>(src + i * b_es);
        }
    }
}

// Half h of a block of 32 values to q8_1 at dst (its chunk's b bytes), slot jj of the chunk, as
// quantize_q8_1: amax over the 32 values (NaN if one is), d = amax / 127, codes v * 127 / amax
// rounded half to even (od::quant::q8_1::code); the codes in value order, or for the 4-bit table formats
// (Fmt::PAIRS) in nibble-pair order, so that their lookups skip a sort (quant_k.cuh's pair_word); with
// Fmt::HALF_SUMS the halves' code sums in place of d * sum (q2_K's mins, q6_K's -32 offsets: one dp2a, b not
// summed again).
// The two halves are lanes l and l ^ 1 of one warp, which meet by shuffles (every lane of the warp
// calls this; `store` false: a lane with no block this round, whose partner has none either).
template <int WT>
__device__ __forceinline__ void store_q8_1_half(const float (&v)[16], int h, bool store, u8* dst, int jj) {
    using Gm = Geo<WT>;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        amax = od::fmax_nan(amax, fabsf(v[i]));
    }
    amax = od::fmax_nan(amax, __shfl_xor_sync(od::FULL_MASK, amax, 1));
    float d, id;
    od::quant::q8_1::scale(amax, d, id);
    int sum = 0;
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned word = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int q = od::quant::q8_1::code(v[4 * i + t], id);
            sum += q;
            word |= (static_cast<unsigned>(q) & 0xffu) << (8 * t);
        }
        w[i] = word;
    }
    const int other = __shfl_xor_sync(od::FULL_MASK, sum, 1);
    // Fmt::HALF_SUMS: ds.y's bits are the halves' sums as two int16 (|sum| <= 16 * 127), low half (lane h = 0) first
    const float dsy = mm::Fmt<WT>::HALF_SUMS ? __uint_as_float((static_cast<unsigned>(sum) & 0xffffu) | (static_cast<unsigned>(other) << 16))
                                             : d * static_cast<float>(sum + other);
    if constexpr (mm::Fmt<WT>::PAIRS) {
        // nibble-pair order (quant_k.cuh's pair_word): half h's words are pairs of natural words 2h, 2h + 1
        // (this lane's when h = 0) and 4 + 2h, 5 + 2h (the partner's when h = 0)
        const unsigned r0 = __shfl_xor_sync(od::FULL_MASK, h ? w[0] : w[2], 1);
        const unsigned r1 = __shfl_xor_sync(od::FULL_MASK, h ? w[1] : w[3], 1);
        const unsigned lo0 = h ? r0 : w[0], hi0 = h ? w[2] : r0, lo1 = h ? r1 : w[1], hi1 = h ? w[3] : r1;
        w[0] = od::quant::pair_word(lo0, hi0, 0);
        w[1] = od::quant::pair_word(lo0, hi0, 1);
        w[2] = od::quant::pair_word(lo1, hi1, 0);
        w[3] = od::quant::pair_word(lo1, hi1, 1);
    }
    if (store) {
        reinterpret_cast<uint4*>(dst + 32 * jj)[h] = make_uint4(w[0], w[1], w[2], w[3]);
        if (h == 0) {
            reinterpret_cast<float2*>(dst + Gm::BCODES)[jj] = make_float2(d, dsy);
        }
    }
}

// Columns n < N of b (value k of column n at b + n * b_col + k * b_es) to q8_1 at bs (layout
// above). Two threads (lanes 2i, 2i + 1) take a (column, block) item, 16 values each, so that every
// thread of the block takes part; every thread runs the same rounds, so whole warps shuffle.
// With a norm (nw not null: the fused rms_norm -> mul, b its input x): the values quantized are
// x[k] * nw[k], and each warp leaves column n's sum of x^2 over its items at ss[warp * NT + n]; the
// kernel scales the dot products by rsqrt(mean + eps) (norm_scales), which q8_1's per-block scale makes
// the same as quantizing the normed values, up to float rounding.
template <int WT, int TB, int NT>
__device__ __forceinline__ void quantize_b(const u8* b, long long b_col, long long b_es, int N, int K, int C, u8* bs,
                                           const float* nw, float* ss) {
    using Gm = Geo<WT>;
    constexpr int ES = TB == B_F32 ? 4 : 2;
    const int nb = K / 32, items = N * nb, pairs = static_cast<int>(blockDim.x / 2);
    const bool vec = b_es == ES && ((reinterpret_cast<unsigned long long>(b) | static_cast<unsigned long long>(b_col)) &
                                    15ull) == 0;
    const int h = static_cast<int>(threadIdx.x & 1);
    float sq[NT];
#pragma unroll
    for (int c = 0; c < NT; ++c) {
        sq[c] = 0.0f;
    }
    for (int round = 0; round < items; round += pairs) {
        const int it = round + static_cast<int>(threadIdx.x / 2);
        const bool live = it < items;
        const int n = live ? it / nb : 0, j = live ? it - n * nb : 0;  // not live: item 0, read, not stored
        float v[16];
        load_b<TB>(b + n * b_col + (32ll * j + 16 * h) * b_es, b_es, vec, v);
        if (nw != nullptr) {
            float s = 0.0f;
            float w[16];
            load_b<B_F32>(reinterpret_cast<const u8*>(nw + 32 * j + 16 * h), 4, true, w);
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                s += v[i] * v[i];
                v[i] *= w[i];
            }
#pragma unroll
            for (int c = 0; c < NT; ++c) {
                sq[c] += live && c == n ? s : 0.0f;
            }
        }
        store_q8_1_half<WT>(v, h, live, bs + (static_cast<long long>(n) * C + j / Gm::NU) * Gm::BCHUNK, j % Gm::NU);
    }
    if (nw != nullptr) {
        const int warp = static_cast<int>(threadIdx.x / od::WARP_SIZE);
#pragma unroll
        for (int c = 0; c < NT; ++c) {
            const float t = od::warp_sum(sq[c]);
            if (threadIdx.x % od::WARP_SIZE == 0) {
                ss[warp * NT + c] = t;
            }
        }
    }
}

// The fused rms_norm's scale of each column, rsqrt(sum x^2 / K + eps) from the warps' sums quantize_b
// left at ss (after the block's barrier); 1 without a norm.
template <int NT>
__device__ __forceinline__ void norm_scales(const float* nw, const float* ss, int nwarps, int K, float eps,
                                            float (&sc)[NT]) {
#pragma unroll
    for (int c = 0; c < NT; ++c) {
        float t = 0.0f;
        if (nw != nullptr) {
            for (int w = 0; w < nwarps; ++w) {
                t += ss[w * NT + c];
            }
        }
        sc[c] = nw != nullptr ? rsqrtf(t / static_cast<float>(K) + eps) : 1.0f;
    }
}

// The normed values rms_norm(x) * nw of columns n < N (x f32, column n at x + n * x_col) to out, (N, K)
// contiguous, sc the columns' scales (norm_scales): block blockIdx.x of gridDim.x takes every gridDim.x-th
// thread's share, so the blocks write it all once between them.
template <int NT>
__device__ __forceinline__ void write_normed(const u8* x, long long x_col, long long x_es, const float* nw, int N,
                                             int K, const float (&sc)[NT], float* out) {
    const long long total = static_cast<long long>(N) * K;
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
        const int n = static_cast<int>(i / K), k = static_cast<int>(i - static_cast<long long>(n) * K);
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < NT; ++c) {
            s = c == n ? sc[c] : s;
        }
        out[i] = *reinterpret_cast<const float*>(x + n * x_col + k * x_es) * s * nw[k];
    }
}

// -- rows that are not whole granules (RAGGED) ---------------------------------------------------------
// A slot holds the granules covering its row segment (`valid` bytes from src, any alignment), from the granule at
// or below src (no copy starts before the weights, whose base is 16-byte aligned), the granule holding the
// segment's end copied only up to it (cp.async's source size: nothing past the row is read), then zeros (source
// size 0) to one granule past the slot's pieces: a lane's piece starts `lead` (src % 16) bytes past its place and
// is read with one load more than an aligned one (load_shifted), and a partial last piece decodes its blocks past
// the row as zeros.

// Bytes of a RAGGED slot of G lanes' pieces: the pieces, the lead and the granule read past them.
template <int WT>
__device__ __forceinline__ int ragged_slot(int G) {
    return (G * Geo<WT>::PIECE + 15) / 16 * 16 + 3 * 16;
}

// The copies of a slot whose segment is `valid` bytes from src and whose lanes read `pieces` pieces.
template <int WT>
__device__ __forceinline__ void issue_ragged(u8* slot, const u8* src, int valid, int pieces, int lane) {
    const int lead = static_cast<int>(reinterpret_cast<unsigned long long>(src) & 15ull);
    const u8* const g0 = src - lead;
    const int n16 = (lead + pieces * Geo<WT>::PIECE + 15) / 16 + 1;
    for (int i = lane; i < n16; i += od::WARP_SIZE) {
        const int bytes = max(0, min(16, lead + valid - 16 * i));
        od::cp_async16_zfill(od::smem_addr(slot + 16 * i), bytes > 0 ? g0 + 16 * i : g0, bytes);
    }
}

// The W words at p (shared, any byte alignment) into wd: V-byte loads from the V-byte boundary below (one load
// more than W words take), funnel-shifted by p's phase. The word offset takes one unrolled path each: lanes of
// one slot agree on it.
template <int W, int V>
__device__ __forceinline__ void load_shifted(const u8* p, unsigned* wd) {
    constexpr int PER = V / 4, NV = (W + PER - 1) / PER + 1;
    const int lead = static_cast<int>(reinterpret_cast<unsigned long long>(p) & (V - 1));
    const u8* const base = p - lead;
    unsigned raw[NV * PER];
#pragma unroll
    for (int g = 0; g < NV; ++g) {
        if constexpr (V == 16) {
            const uint4 v = reinterpret_cast<const uint4*>(base)[g];
            raw[4 * g] = v.x, raw[4 * g + 1] = v.y, raw[4 * g + 2] = v.z, raw[4 * g + 3] = v.w;
        } else if constexpr (V == 8) {
            const uint2 v = reinterpret_cast<const uint2*>(base)[g];
            raw[2 * g] = v.x, raw[2 * g + 1] = v.y;
        } else {
            raw[g] = reinterpret_cast<const unsigned*>(base)[g];
        }
    }
    const int q = lead >> 2, sh = 8 * (lead & 3);
#pragma unroll
    for (int qq = 0; qq < PER; ++qq) {
        if (q == qq) {
#pragma unroll
            for (int i = 0; i < W; ++i) {
                wd[i] = __funnelshift_rc(raw[i + qq], raw[i + qq + 1], sh);
            }
        }
    }
}

// -- the dot products of one chunk ----------------------------------------------------------------

// acc[n] += chunk (CB blocks at `wchunk`, shared) . b column n's chunk (at bchunk + n * bcol_stride).
template <int WT, int NT>
__device__ __forceinline__ void dot_chunk(const u8* wchunk, const u8* bchunk, int bcol_stride, int N,
                                          float (&acc)[NT]) {
    using Gm = Geo<WT>;
    using F = mm::Fmt<WT>;
    constexpr int NWD = (F::BYTES + 1) / 4 + 1;  // words decode_words reads
    unsigned wd[Gm::WORDS + 2];
#pragma unroll
    for (int g = 0; g < Gm::GRAN; ++g) {
        const uint4 v = reinterpret_cast<const uint4*>(wchunk)[g];
        wd[4 * g] = v.x, wd[4 * g + 1] = v.y, wd[4 * g + 2] = v.z, wd[4 * g + 3] = v.w;
    }
    wd[Gm::WORDS] = 0u;  // read (with a shift of 0) by the last block's decode only
    wd[Gm::WORDS + 1] = 0u;
#pragma unroll
    for (int j = 0; j < Gm::CB; ++j) {
        const int o = j * F::BYTES;  // a constant once unrolled
        unsigned bw[NWD];
#pragma unroll
        for (int t = 0; t < NWD; ++t) {
            bw[t] = wd[o / 4 + t];
        }
        int q[8];
        float d, m;
        od::quant::decode_words<F>(bw, (o % 4) * 8, q, d, m);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            if (NT == 1 || n < N) {  // no branch between the blocks of a one-column chunk
                const u8* bc = bchunk + n * bcol_stride;
                const int4 lo = reinterpret_cast<const int4*>(bc + 32 * j)[0];
                const int4 hi = reinterpret_cast<const int4*>(bc + 32 * j)[1];
                const float4 ds2 = reinterpret_cast<const float4*>(bc + Gm::BCODES)[j / 2];
                const float2 ds = (j % 2 == 0) ? make_float2(ds2.x, ds2.y) : make_float2(ds2.z, ds2.w);
                const int bq[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
                int dot = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    dot = __dp4a(q[i], bq[i], dot);
                }
                float v = ds.x * static_cast<float>(dot);
                if constexpr (F::ZERO != 0) {
                    v = fmaf(-static_cast<float>(F::ZERO), ds.y, v);
                }
                acc[n] = fmaf(d, v, acc[n]);
                if constexpr (F::M >= 0) {
                    acc[n] = fmaf(m, ds.y, acc[n]);
                }
            }
        }
    }
}

// The grid formats whose blocks may hold copies of their grid (stage_grid, a runtime count): those of which
// GRID_COPIES_MIN copies fit in GRID_COPIES_MAX bytes (specs/stream.py's, which picks the count). The larger grids
// (iq2_s, iq1_s, iq1_m) never get more than one, and read it through a plain pointer as before: the copies'
// runtime stride and staging cost them 1-6% (H200, one column, docs/benchmarks.md's session 30).
constexpr int GRID_COPIES_MIN = 8, GRID_COPIES_MAX = 32768;
template <class F>
constexpr bool GRID_COPIES = F::GRID_BYTES > 0 && F::GRID_BYTES * GRID_COPIES_MIN <= GRID_COPIES_MAX;

// A grid format's lane's copy of its grid (quant_iq.cuh's GridAt), or a plain pointer to its one copy (and
// nothing for the other formats).
template <class F, bool = GRID_COPIES<F>>
struct GridRef {
    using type = const u8*;
};
template <class F>
struct GridRef<F, true> {
    using type = od::quant::GridAt<typename F::Entry>;
};
template <int WT>
using GridOf = typename GridRef<mm::Fmt<WT>>::type;

// Lane `lane`'s copy (lane % copies, copies a power of two) of the grid's `copies` at `grid` (stage_grid).
template <int WT>
__device__ __forceinline__ GridOf<WT> lane_grid(const u8* grid, int copies, int lane) {
    using F = mm::Fmt<WT>;
    if constexpr (GRID_COPIES<F>) {
        constexpr int E = static_cast<int>(sizeof(typename F::Entry));
        return {grid + (lane & (copies - 1)) * E, static_cast<unsigned>(copies * E)};
    } else {
        return grid;
    }
}

// acc[n] += piece (at `wpiece`, shared) . b column n's piece, for quant_k.cuh's formats: the piece's
// words in registers, then each 32-value unit u by the format's dot32_in over them (a Regs source:
// constant offsets). A chunk (REG) is read with 16-byte loads, conflict-free as the legacy chunks; a
// one-block piece (2-byte aligned: even BYTES, lanes BYTES apart) with 4-byte loads from the word
// boundary below it, then funnel-shifted by its phase (0 or 2 bytes: the same instructions in every
// lane; the last lane's block ends on a granule, so no load passes the stage).
template <int WT, int NT, bool RAGGED = false>
__device__ __forceinline__ void dot_piece(const u8* wpiece, const u8* bpiece, int bcol_stride, int N,
                                          GridOf<WT> grid, float (&acc)[NT]) {
    using Gm = Geo<WT>;
    using F = mm::Fmt<WT>;
    constexpr int PER = F::QK / 32;  // units a block
    constexpr int RW = Gm::REG ? Gm::PIECE / 4 : (F::BYTES + 3) / 4;  // words of the piece in registers
    unsigned wd[RW];
    if constexpr (RAGGED) {  // any alignment (the slot's lead): a load more, funnel-shifted
        load_shifted<RW, Gm::REG ? Gm::LOAD : 4>(wpiece, wd);
    } else if constexpr (Gm::REG && Gm::LOAD == 16) {
#pragma unroll
        for (int g = 0; g < RW / 4; ++g) {
            const uint4 v = reinterpret_cast<const uint4*>(wpiece)[g];
            wd[4 * g] = v.x, wd[4 * g + 1] = v.y, wd[4 * g + 2] = v.z, wd[4 * g + 3] = v.w;
        }
    } else if constexpr (Gm::REG) {  // a half piece (8-byte aligned): lanes 34 or 18 words apart, conflict-free
#pragma unroll
        for (int g = 0; g < RW / 2; ++g) {
            const uint2 v = reinterpret_cast<const uint2*>(wpiece)[g];
            wd[2 * g] = v.x, wd[2 * g + 1] = v.y;
        }
    } else {
        static_assert(F::BYTES % 2 == 0 && Gm::LB == 1, "one 2-byte aligned block a lane");
        // words covering the block from the word boundary below (phase 2 only where BYTES % 4 == 2)
        constexpr int LW = F::BYTES % 4 == 0 ? F::BYTES / 4 : (F::BYTES + 2) / 4;
        const int ph = static_cast<int>(reinterpret_cast<unsigned long long>(wpiece) & 3ull);
        const unsigned* const src = reinterpret_cast<const unsigned*>(wpiece - ph);
        unsigned raw[LW + 1];
#pragma unroll
        for (int i = 0; i < LW; ++i) {
            raw[i] = src[i];
        }
        raw[LW] = 0u;  // past the block: the high bytes of its last word only
#pragma unroll
        for (int i = 0; i < RW; ++i) {
            wd[i] = __funnelshift_rc(raw[i], raw[i + 1], 8 * ph);
        }
    }
#pragma unroll
    for (int u = 0; u < Gm::NU; ++u) {
        const int j = u / PER;  // the block, a constant once unrolled
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            if (NT == 1 || n < N) {
                const u8* bc = bpiece + n * bcol_stride;
                const int4 lo = reinterpret_cast<const int4*>(bc + 32 * u)[0];
                const int4 hi = reinterpret_cast<const int4*>(bc + 32 * u)[1];
                const float2 ds = reinterpret_cast<const float2*>(bc + Gm::BCODES)[u];
                const int bq[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
                if constexpr (F::PAIRS || F::HALF_SUMS) {  // b as quantize_b stores it for them
                    acc[n] += F::template dot32_in<true>(od::quant::Regs{wd, j * F::BYTES}, u % PER, bq, ds);
                } else if constexpr (GRID_COPIES<F>) {  // the lane's copy of the grid in shared memory
                    acc[n] += F::dot32_in(od::quant::Regs{wd, j * F::BYTES}, u % PER, bq, ds, grid);
                } else if constexpr (F::GRID_BYTES > 0) {  // the grid's one copy in shared memory
                    acc[n] += F::dot32_in(od::quant::Regs{wd, j * F::BYTES}, u % PER, bq, ds,
                                          reinterpret_cast<const typename F::Entry*>(grid));
                } else {
                    acc[n] += F::dot32_in(od::quant::Regs{wd, j * F::BYTES}, u % PER, bq, ds);
                }
            }
        }
    }
}

// A grid format's lookup grid in shared memory at dst, `copies` copies interleaved entry by entry (GridAt):
// the dot products gather 32 scattered entries a warp instruction; one copy met 3.9-way bank conflicts on
// average (ncu, iq2_xxs, H200), and a lane reading copy lane % copies meets none where copies are the lanes of
// one wavefront (16 of 8-byte entries, 32 of 4-byte ones). A thread loads up to BATCH entries at once (their
// loads in flight together: the grid comes from L2 or DRAM) and stores each entry's copies from copy
// (entry % copies) on, so that a warp's stores go to distinct banks. The large grids (not GRID_COPIES) are
// copied once, entry by entry; nothing for other formats.
template <int WT>
__device__ __forceinline__ void stage_grid(u8* dst, int copies) {
    using F = mm::Fmt<WT>;
    if constexpr (!GRID_COPIES<F> && F::GRID_BYTES > 0) {  // one copy
        using E = typename F::Entry;
        const E* const src = F::global_grid();
        for (int i = static_cast<int>(threadIdx.x); i < F::ENTRIES; i += static_cast<int>(blockDim.x)) {
            reinterpret_cast<E*>(dst)[i] = src[i];
        }
    } else if constexpr (GRID_COPIES<F>) {
        using E = typename F::Entry;
        constexpr int BATCH = 8;
        const E* const src = F::global_grid();
        E* const out = reinterpret_cast<E*>(dst);
        const int step = static_cast<int>(blockDim.x);
        for (int i0 = static_cast<int>(threadIdx.x); i0 < F::ENTRIES; i0 += BATCH * step) {
            E e[BATCH];
#pragma unroll
            for (int k = 0; k < BATCH; ++k) {
                e[k] = i0 + k * step < F::ENTRIES ? src[i0 + k * step] : E{};
            }
#pragma unroll
            for (int k = 0; k < BATCH; ++k) {
                const int i = i0 + k * step;
                for (int r = 0; i < F::ENTRIES && r < copies; ++r) {
                    out[i * copies + ((r + i) & (copies - 1))] = e[k];
                }
            }
        }
    }
}

}  // namespace mms

using mm::u8;

// mul_mat with block-format weights in one launch: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k]
// * b[i3, i2, n, k] for n < N <= NT, arguments exactly as mmv's (mmv.cu): a0 (and a1, the up weight
// of EPI_GLU, a0's strides) rows a_row bytes apart, batch strides a_s2, a_s3; b columns b_col bytes
// apart, elements b_es apart (16-byte loads when b_es is the element size and b, b_col are 16-byte
// aligned), batch strides b_s2, b_s3; out contiguous (B3, B2, N, M); biases rows bias_col floats apart
// (0: one row; mm_common.cuh's EPI_NONE). NS stages a warp. Grid (blocks, B2, B3), blockDim.x a multiple
// of 32 (at most THREADS_MAX), dynamic shared memory as above.
//
// mul_mat_id (ids not null; grid y a slot u, z a token t, N = 1): a0 / a1 are the experts, a_s2 the
// expert stride (a_s3, r2, r3 unused); batch (t, u) uses expert e = ids[t * ids_t + u * ids_u] (an int
// read on the device, after the wait unless `preload`) and b at t * b_s3 + u * b_s2 (b_s2 0 when b
// has one row a token), bias0 / bias1 + e * bias_e (bias_col 0). An id outside [0, E) writes NaN rows and is
// recorded in the error word (od::index_ok; a null word for mul_mat).
template <int WT, int TB, int NT, int EPI, int NS, bool KEEP = false, bool RAGGED = false>
__global__ void __launch_bounds__(mms::THREADS_MAX, mms::Geo<WT>::MIN_BLOCKS)
    mmvq_stream(const u8* a0, const u8* a1, long long a_row, long long a_s2, long long a_s3, int r2, int r3,
                const u8* b, long long b_col, long long b_es, long long b_s2, long long b_s3, float* out, int M,
                int K, int N, const float* bias0, const float* bias1, long long bias_col, int glu_kind, float alpha,
                float limit, const u8* ids, long long ids_t, long long ids_u, int E, long long bias_e,
                const float* norm_w, float norm_eps, float* norm_out, int preload, int grid_copies,
                OD_INDEX_CHECK_PARAMS) {
    od::grid_enter_later();  // below: after the first weight copies when the weights are constant
    using Gm = mms::Geo<WT>;
    constexpr int NW = EPI == EPI_GLU ? 2 : 1;
    static_assert(NS >= 2 && NS <= 4, "2 to 4 stages");
    static_assert(!(RAGGED && mm::Fmt<WT>::LEGACY), "no RAGGED instances of the legacy formats (mmvq runs those rows)");
    extern __shared__ uint4 smem_u4[];
    u8* const smem = reinterpret_cast<u8*>(smem_u4);

    const int i2 = blockIdx.y, i3 = blockIdx.z;
    // pieces a row (RAGGED: the last one may be partial, zeros after the row)
    const mms::Layout L = mms::layout(RAGGED ? (K / 32 + Gm::NU - 1) / Gm::NU : K / (32 * Gm::NU), NW == 2);
    const int groups = (M + L.RO - 1) / L.RO;
    const int nwarps = blockDim.x / od::WARP_SIZE, warp = threadIdx.x / od::WARP_SIZE;
    const int lane = threadIdx.x % od::WARP_SIZE;
    const long long W = static_cast<long long>(gridDim.x) * nwarps;
    const long long wi = static_cast<long long>(blockIdx.x) * nwarps + warp;
    const int g0 = static_cast<int>(wi * groups / W), g1 = static_cast<int>((wi + 1) * groups / W);
    const int nunits = (g1 - g0) * L.UG;
    const int bcol_stride = L.C * Gm::BCHUNK;
    const long long brow0 = (static_cast<long long>(i3) * gridDim.y + i2) * N;  // the batch's first output row
    float* const o_base = out + brow0 * M;

    // the weights of this batch: mul_mat's broadcast, or mul_mat_id's expert (ids may be the kernel
    // before's output: read after the wait unless constant)
    if (!preload) {
        od::grid_enter();
    }
    int e = 0;
    if (ids != nullptr) {
        e = *reinterpret_cast<const int*>(ids + i3 * ids_t + i2 * ids_u);
        if (!od::index_ok(e, E, err_word, err_tag, static_cast<long long>(i3) * gridDim.y + i2)) {
            // the whole block: this warp's output rows are NaN
            for (int i = lane; i < (g1 - g0) * L.RO; i += od::WARP_SIZE) {
                const int m = g0 * L.RO + i;
                if (m < M) {
                    o_base[m] = __int_as_float(0x7fc00000);
                }
            }
            return;
        }
    }
    const long long aoff = ids != nullptr ? e * a_s2 : (i3 / r3) * a_s3 + (i2 / r2) * a_s2;
    const u8* const wa0 = a0 + aoff;
    const u8* const wa1 = NW == 2 ? a1 + aoff : wa0;
    const float* const bias0_e = bias0 != nullptr ? bias0 + e * bias_e : nullptr;
    const float* const bias1_e = bias1 != nullptr ? bias1 + e * bias_e : nullptr;
    u8* const bs = smem;
    // a stage: R slots of G pieces (RAGGED: ragged_slot bytes each, at most 3 granules more a slot)
    constexpr int STAGE = od::WARP_SIZE * Gm::PIECE + (RAGGED ? od::WARP_SIZE * 4 * 16 : 0);
    u8* const ring = smem + static_cast<long long>(N) * bcol_stride + static_cast<long long>(warp) * NS * STAGE;
    const int slotb = RAGGED ? mms::ragged_slot<WT>(L.G) : L.G * Gm::PIECE;
    const int row_bytes = K / mm::Fmt<WT>::QK * mm::Fmt<WT>::BYTES;
    float* const norm_ss = reinterpret_cast<float*>(smem + static_cast<long long>(N) * bcol_stride +
                                                    static_cast<long long>(nwarps) * NS * STAGE);
    u8* const grid = reinterpret_cast<u8*>(norm_ss + nwarps * 8);
    // stages by bulk copies where the target has them (RAGGED slots take cp.async's zero fill, and the formats of
    // CP_ASYNC_STAGES its per-lane copies): each warp's NS stage barriers after the grid, armed with a stage's bytes
    // by lane 0, the copies issued by a lane a slot. The half-piece formats' prologue stages, which every warp issues
    // at once, go by cp.async (BULK_FIRST false): H200, 4096x4096, about one stage a warp, iq4_xs 5.6 us with them,
    // 6.0 by bulk copies (mxfp4 5.7, 6.1), where at 14336x4096 bulk copies from the first stage were faster for every
    // format (q3_K 9.8 -> 9.4 us, q2_K 8.3 -> 7.9, iq3_xxs 14.6 -> 13.9), and for the half pieces too (iq4_xs 11.8 ->
    // 11.5): measured in one call, docs/benchmarks.md's session 28.
    constexpr bool BULK = od::HAS_BULK && !RAGGED && !mms::CP_ASYNC_STAGES<WT>;
    constexpr bool BULK_FIRST = BULK && !mms::HALF_PIECE<WT>;
    const unsigned bars = od::smem_addr(grid + mm::Fmt<WT>::GRID_BYTES * grid_copies) + 8u * NS * warp;
    if constexpr (BULK) {
        if (lane < NS) {
            od::mbar_init(bars + 8u * lane, 1u);
        }
        __syncwarp();
    }

    // the next unit to issue: group ig, unit iu of it
    int ig = g0, iu = 0;
    // RAGGED: slot rs of unit u of group gr: its row's segment (src, valid bytes) and its pieces (nch)
    auto segment = [&](int gr, int u, int rs, const u8*& src, int& valid, int& nch) {
        const int w = NW == 2 ? (L.R == 1 ? u / L.S : rs / L.RO) : 0;
        const int seg = L.R == 1 ? u - w * L.S : 0;
        const int o = L.R == 1 ? gr : gr * L.RO + rs - w * L.RO;
        const int s0 = seg * L.G * Gm::PIECE;
        src = (w ? wa1 : wa0) + static_cast<long long>(min(o, M - 1)) * a_row + s0;
        valid = min(row_bytes - s0, L.G * Gm::PIECE);
        nch = min(L.G, L.C - seg * L.G);
    };
    auto issue = [&](int stage, auto copies) {
        u8* const buf = ring + stage * STAGE;
        if constexpr (decltype(copies)::bulk) {
            const unsigned bar = bars + 8u * stage;
            if (L.R == 1) {
                const int w = NW == 2 ? iu / L.S : 0;
                const int seg = iu - w * L.S;
                const unsigned bytes = 16u * mms::piece_granules<WT>(min(L.G, L.C - seg * L.G));
                if (lane == 0) {
                    od::mbar_expect_tx(bar, bytes);
                    od::bulk_copy(od::smem_addr(buf), (w ? wa1 : wa0) + static_cast<long long>(min(ig, M - 1)) * a_row +
                                  static_cast<long long>(seg) * L.G * Gm::PIECE, bytes, bar);
                }
            } else {
                const unsigned bytes = 16u * mms::piece_granules<WT>(L.C);
                if (lane == 0) {  // the barrier counts the slots' bytes, whichever lands first
                    od::mbar_expect_tx(bar, L.R * bytes);
                }
                if (lane < L.R) {
                    const int w = NW == 2 ? lane / L.RO : 0;
                    const int o = ig * L.RO + lane - w * L.RO;
                    od::bulk_copy(od::smem_addr(buf + lane * L.G * Gm::PIECE),
                                  (w ? wa1 : wa0) + static_cast<long long>(min(o, M - 1)) * a_row, bytes, bar);
                }
            }
        } else if constexpr (RAGGED) {
            for (int rs = 0; rs < L.R; ++rs) {
                const u8* src;
                int valid, nch;
                segment(ig, iu, rs, src, valid, nch);
                mms::issue_ragged<WT>(buf + rs * slotb, src, valid, nch, lane);
            }
        } else if (L.R == 1) {
            const int w = NW == 2 ? iu / L.S : 0;
            const int seg = iu - w * L.S;
            const int nch = min(L.G, L.C - seg * L.G);
            const u8* src = (w ? wa1 : wa0) + static_cast<long long>(min(ig, M - 1)) * a_row +
                            static_cast<long long>(seg) * L.G * Gm::PIECE;
            const int n16 = mms::piece_granules<WT>(nch);
            for (int i = lane; i < n16; i += od::WARP_SIZE) {
                od::cp_async16(od::smem_addr(buf + 16 * i), src + 16 * i);
            }
        } else {
            const int n16 = mms::piece_granules<WT>(L.C);
            for (int rs = 0; rs < L.R; ++rs) {
                const int w = NW == 2 ? rs / L.RO : 0;
                const int o = ig * L.RO + rs - w * L.RO;
                const u8* src = (w ? wa1 : wa0) + static_cast<long long>(min(o, M - 1)) * a_row;
                u8* dst = buf + rs * L.G * Gm::PIECE;
                for (int i = lane; i < n16; i += od::WARP_SIZE) {
                    od::cp_async16(od::smem_addr(dst + 16 * i), src + 16 * i);
                }
            }
        }
        if (++iu == L.UG) {
            iu = 0;
            ++ig;
        }
    };

    // 1. the first stages in flight and b to q8_1. Constant weights (`preload`) are copied before
    // waiting for the kernel before (programmatic dependent launch), b after; others after the wait,
    // and after b: b's loads then come ahead of the weight copies in the memory queues, not behind a
    // whole matrix's (H200, cold, no preload: q4_0 4096^2 6.09 -> 5.44 us, q8_0 7.37 -> 6.92 us).
    const long long bb = i3 * b_s3 + i2 * b_s2;
    if (!preload) {
        mms::quantize_b<WT, TB, NT>(b + bb, b_col, b_es, N, K, L.C, bs, norm_w, norm_ss);
    }
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (s < nunits) {
            issue(s, mms::Copies<BULK_FIRST>{});
        }
        if constexpr (!BULK_FIRST) {
            od::cp_async_commit();
        }
    }
    mms::stage_grid<WT>(grid, grid_copies);  // constant data: before the wait when the weights are too
    if (preload) {
        od::grid_enter();
        mms::quantize_b<WT, TB, NT>(b + bb, b_col, b_es, N, K, L.C, bs, norm_w, norm_ss);
    }
    if constexpr (RAGGED) {  // b's q8_1 units of the last pieces past K: zero codes and scales
        const int nb = K / 32, tail = L.C * Gm::NU - nb;
        for (int t = static_cast<int>(threadIdx.x); t < N * tail; t += static_cast<int>(blockDim.x)) {
            const int n = t / tail, j = nb + t % tail;
            u8* const piece = bs + (static_cast<long long>(n) * L.C + j / Gm::NU) * Gm::BCHUNK;
            reinterpret_cast<uint4*>(piece + 32 * (j % Gm::NU))[0] = make_uint4(0u, 0u, 0u, 0u);
            reinterpret_cast<uint4*>(piece + 32 * (j % Gm::NU))[1] = make_uint4(0u, 0u, 0u, 0u);
            reinterpret_cast<float2*>(piece + Gm::BCODES)[j % Gm::NU] = make_float2(0.0f, 0.0f);
        }
    }
    __syncthreads();
    float sc[NT];
    mms::norm_scales<NT>(norm_w, norm_ss, nwarps, K, norm_eps, sc);

    // 2. the ring
    const int rs = lane / L.G, lc = lane % L.G;
    const mms::GridOf<WT> my_grid = mms::lane_grid<WT>(grid, grid_copies, lane);
    float acc[NT], gate[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        acc[n] = 0.0f;
        gate[n] = 0.0f;
    }
    int cg = g0, cu = 0;  // the unit computed
    for (int i = 0; i < nunits; ++i) {
        if (i + NS - 1 < nunits) {
            issue((i + NS - 1) % NS, mms::Copies<BULK>{});
        }
        if constexpr (BULK_FIRST) {  // stage i % NS's use i / NS
            od::mbar_wait(bars + 8u * (i % NS), static_cast<unsigned>(i / NS) & 1u);
        } else if constexpr (BULK) {
            if (i >= NS - 1) {  // stage s's bulk uses after the cp.async prologue: units s + NS, ... (s from NS - 1 on)
                const int s = i % NS, first = s >= NS - 1 ? s : s + NS;
                od::mbar_wait(bars + 8u * s, static_cast<unsigned>((i - first) / NS) & 1u);
            } else {  // the prologue's cp.async stages
                od::cp_async_wait<0>();
                __syncwarp();
            }
        } else {
            od::cp_async_commit();
            od::cp_async_wait<NS - 1>();
            __syncwarp();  // the other lanes' copies too
        }
        const int w = (NW == 2 && L.R == 1) ? cu / L.S : 0;
        const int seg = L.R == 1 ? cu - w * L.S : 0;
        const int c = seg * L.G + lc;
        // the lane's piece: lane PIECE bytes into the stage, or in its RAGGED slot, its segment's lead past it
        int at = lane * Gm::PIECE;
        if constexpr (RAGGED) {
            const u8* src;
            int valid, nch;
            segment(cg, cu, rs, src, valid, nch);
            at = rs * slotb + static_cast<int>(reinterpret_cast<unsigned long long>(src) & 15ull) + lc * Gm::PIECE;
        }
        if (c < L.C) {
            if constexpr (mm::Fmt<WT>::LEGACY) {
                mms::dot_chunk<WT, NT>(ring + (i % NS) * STAGE + at, bs + c * Gm::BCHUNK, bcol_stride, N, acc);
            } else {
                mms::dot_piece<WT, NT, RAGGED>(ring + (i % NS) * STAGE + at, bs + c * Gm::BCHUNK, bcol_stride, N,
                                               my_grid, acc);
            }
        }
        if (seg == L.S - 1) {  // the end of a row's segments: sums over the row's G lanes
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                for (int off = L.G / 2; off > 0; off >>= 1) {
                    acc[n] += __shfl_xor_sync(od::FULL_MASK, acc[n], off);
                }
            }
            if (NW == 2 && L.R == 1 && w == 0) {  // the gate row's sums; its up row follows
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    gate[n] = acc[n];
                    acc[n] = 0.0f;
                }
            } else {
                int m;
                bool writer;
                float up[NT];
                if constexpr (NW == 2) {
                    if (L.R == 1) {
                        m = cg;
                        writer = lane == 0;
#pragma unroll
                        for (int n = 0; n < NT; ++n) {
                            up[n] = acc[n];
                            acc[n] = gate[n];
                        }
                    } else {  // slots RO .. R - 1 (lanes 16 .. 31) hold the up rows of slots 0 .. RO - 1
#pragma unroll
                        for (int n = 0; n < NT; ++n) {
                            up[n] = __shfl_xor_sync(od::FULL_MASK, acc[n], 16);
                        }
                        m = cg * L.RO + rs;
                        writer = lc == 0 && rs < L.RO;
                    }
                } else {
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        up[n] = 0.0f;
                    }
                    m = cg * L.RO + rs;
                    writer = lc == 0;
                }
                if (writer && m < M) {
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        if (n < N) {
                            o_base[static_cast<long long>(n) * M + m] =
                                mm::epilogue<EPI>(acc[n] * sc[n], up[n] * sc[n], bias0_e, bias1_e,
                                                  (brow0 + n) * bias_col + m, glu_kind, alpha, limit);
                        }
                    }
                }
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    acc[n] = 0.0f;
                }
            }
        }
        if (++cu == L.UG) {
            cu = 0;
            ++cg;
        }
        __syncwarp();  // every lane is done with this stage before the next issue overwrites it
    }
    if constexpr (!BULK_FIRST) {
        od::cp_async_wait<0>();  // nothing left in flight at exit (a warp with no units committed empty groups)
    }
    if constexpr (KEEP) {
        mms::write_normed<NT>(b + bb, b_col, b_es, norm_w, N, K, sc, norm_out);
    }
}
