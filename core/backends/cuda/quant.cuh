// ggml's block formats on the device, defined once: one traits struct per format (its byte
// layout, which is ggml's and opdispatch.dtypes', so blocks move between host and device as
// they are) and the ways the kernels read and write blocks, all templates on the format Q:
//
//   decode(blk, j), decode_pair(blk, p), decode_block(blk, y)   one value, a pair, a block
//   fetch8, decode8             values e0 .. e0+7 of a row (cuda_attention's K/V tiles)
//   load_unit(row, u, c, d, m)  unit u of a row, 8 codes (cuda_matmul's dequantizing copy)
//   decode_words(w, sh, q, d, m)  a block held in registers, as words of codes for dp4a (mat-vecs)
//   encode8(x, r, blk, active)  quantize a block spread over 8 lanes (cuda_misc's cpy, set_rows)
//   q8_1::scale, q8_1::code     the rounding of b to ggml's q8_1 for the integer dot products
//
// Block layouts (bytes; d and m are IEEE halves, little-endian; 32 values a block):
//   q4_0  18: d, qs[16]            code j in the low nibble of qs[j], j+16 in the high
//   q4_1  20: d, m, qs[16]
//   q5_0  22: d, qh[4], qs[16]     5th bit of code j = bit j of qh (a little-endian u32)
//   q5_1  24: d, m, qh[4], qs[16]
//   q8_0  34: d, qs[32] int8
// Value j = (code j - ZERO) * d, plus m in q4_1 / q5_1. Blocks start at even addresses (every
// size is even and buffers are aligned) but no better, so fields are read with 16-bit accesses.
//
// The decodes and encode8 are bit-exact with opdispatch.dtypes.dequantize / quantize, which
// follow ggml's reference C one float32 operation at a time: every multiply and add that ggml
// writes as separate C operations is spelled __fmul_rn / __fadd_rn, so that the compiler cannot
// contract them into an FMA (one rounding instead of two); divisions are __fdiv_rn (IEEE,
// whatever the division flags). The sub-scaled formats (K-quants, iq4_nl, iq4_xs, mxfp4) are
// quant_k.cuh's traits, each with its own scale / code / dot32, and so are the grid I-quants
// (iq2_xxs .. iq1_m, quant_iq.cuh); of the accessors here they take decode and load_unit (the others
// are the 32-value legacy formats' only). A new format is a traits struct and the accessors its
// kernels need.
#pragma once

#include "common.cuh"
#include "quant_k.cuh"
#include "quant_iq.cuh"

namespace od {
namespace quant {

// How a format derives its scale d from a block (opdispatch.dtypes' scale_from).
enum class Scale { signed_absmax, absmax, range };

// ggml's 32-value formats with an f16 scale first: field offsets in bytes (-1 when absent),
// code bits, d = (the scale's source) / DIV, decode (q - ZERO) * d (+ m).
template <int BYTES_, int BITS_, Scale SCALE_, int DIV_, int ZERO_, int M_, int QH_, int QS_>
struct Block32 {
    static constexpr bool LEGACY = true;  // quant_k.cuh's formats: false
    static constexpr bool PAIRS = false;  // b in natural order (quant_k.cuh's table formats: Table4)
    static constexpr bool HALF_SUMS = false;  // b's (d, d * sum) (quant_k.cuh's q2_K, q6_K: SubScaled::HALF_SUMS)
    static constexpr int GRID_BYTES = 0;  // no lookup grid (quant_iq.cuh's formats have one)
    static constexpr int QK = 32;  // values a block
    static constexpr int BYTES = BYTES_;
    static constexpr int BITS = BITS_;
    static constexpr Scale SCALE = SCALE_;
    static constexpr int DIV = DIV_;
    static constexpr int ZERO = ZERO_;
    static constexpr int D = 0;
    static constexpr int M = M_;
    static constexpr int QH = QH_;
    static constexpr int QS = QS_;
    static constexpr int QMAX = (1 << BITS_) - 1;
};

struct q4_0 : Block32<18, 4, Scale::signed_absmax, -8, 8, -1, -1, 2> {};
struct q4_1 : Block32<20, 4, Scale::range, 15, 0, 2, -1, 4> {};
struct q5_0 : Block32<22, 5, Scale::signed_absmax, -16, 16, -1, 2, 6> {};
struct q5_1 : Block32<24, 5, Scale::range, 31, 0, 2, 4, 8> {};
struct q8_0 : Block32<34, 8, Scale::absmax, 127, 0, -1, -1, 2> {};

// ggml's q8_1, the activation side of the integer dot products: 32 values as int8 codes c and a
// float scale d (value c * d), with d * sum(c) for the weight formats' zero and offset. Where the
// codes and scales go is each kernel's own layout (mmv.cu's QB8, mmvq_stream.cu's chunks); this is
// the rounding, which quantize_q8_1 and mmvq_stream's in-block quantization share so that they
// agree bit for bit.
struct q8_1 {
    static constexpr int QK = 32;

    // The scale of 32 values whose largest magnitude is amax: d = amax / 127, and id, what a value
    // is multiplied by before rounding to its code (0 for a block of 0s). amax is NaN when a value
    // is (od::fmax_nan): d is then NaN, and so is every dot product the block enters.
    static __device__ __forceinline__ void scale(float amax, float& d, float& id) {
        d = amax / 127.0f;
        id = amax > 0.0f ? 127.0f / amax : 0.0f;
    }

    // The code of value v: v * id rounded half to even, as __float2int_rn(v * id), but by an add on
    // the FMA pipe instead of F2I, which issues at a quarter of the rate (sm_90) on the mat-vecs'
    // path from the PDL wait to the dot products: 1.5 * 2^23 + x holds x's rounded integer in its
    // low mantissa bits (|x| <= 127 here). __fmul_rn: the product rounded first, never contracted
    // with the add into one fma, which would round differently at ties.
    static __device__ __forceinline__ int code(float v, float id) {
        return static_cast<int>(__float_as_uint(__fmul_rn(v, id) + 12582912.0f) - 0x4B400000u);
    }
};

// -- decode: values as floats, exactly as opdispatch.dtypes.dequantize -------------------------

// Value j (0 .. QK-1) of a block.
template <class Q>
__device__ __forceinline__ float decode(const unsigned char* blk, const int j) {
    if constexpr (!Q::LEGACY) {  // quant_k.cuh: d * code - m, ggml's order
        float d, m;
        Q::scale(blk, j / Q::SUB, d, m);
        const float y = __fmul_rn(d, static_cast<float>(Q::code(blk, j)));
        if constexpr (Q::M >= 0) {
            return __fsub_rn(y, m);
        } else {
            return y;
        }
    } else {
        const float d = f16_to_f32(static_cast<unsigned short>(ld16(blk + Q::D)));
        int q;
        if constexpr (Q::BITS == 8) {
            q = static_cast<signed char>(blk[Q::QS + j]);
        } else {
            const unsigned b = blk[Q::QS + (j & 15)];
            q = static_cast<int>(j < 16 ? b & 0x0fu : b >> 4);
            if constexpr (Q::BITS == 5) {
                q |= ((blk[Q::QH + (j >> 3)] >> (j & 7)) & 1) << 4;
            }
        }
        const float y = __fmul_rn(static_cast<float>(q - Q::ZERO), d);
        if constexpr (Q::M >= 0) {
            return __fadd_rn(y, f16_to_f32(static_cast<unsigned short>(ld16(blk + Q::M))));
        } else {
            return y;
        }
    }
}

// Pair p (0..15) of a block, the two values ggml's dequantize kernels give together: the two codes
// of qs byte p (values p and p + 16) in the 4- and 5-bit formats, values 2p and 2p + 1 in q8_0.
template <class Q>
__device__ __forceinline__ float2 decode_pair(const unsigned char* blk, const int p) {
    const float d = f16_to_f32(static_cast<unsigned short>(ld16(blk + Q::D)));
    int q0, q1;
    if constexpr (Q::BITS == 8) {
        q0 = static_cast<signed char>(blk[Q::QS + 2 * p]);
        q1 = static_cast<signed char>(blk[Q::QS + 2 * p + 1]);
    } else {
        const unsigned b = blk[Q::QS + p];
        q0 = static_cast<int>(b & 0x0fu);
        q1 = static_cast<int>(b >> 4);
        if constexpr (Q::BITS == 5) {
            const unsigned qh = ld32_2(blk + Q::QH);
            q0 |= static_cast<int>((qh >> p) & 1u) << 4;
            q1 |= static_cast<int>((qh >> (p + 16)) & 1u) << 4;
        }
    }
    float2 v = make_float2(__fmul_rn(static_cast<float>(q0 - Q::ZERO), d),
                           __fmul_rn(static_cast<float>(q1 - Q::ZERO), d));
    if constexpr (Q::M >= 0) {
        const float m = f16_to_f32(static_cast<unsigned short>(ld16(blk + Q::M)));
        v.x = __fadd_rn(v.x, m);
        v.y = __fadd_rn(v.y, m);
    }
    return v;
}

// The whole block, y[j] = value j.
template <class Q>
__device__ __forceinline__ void decode_block(const unsigned char* blk, float (&y)[Q::QK]) {
#pragma unroll
    for (int p = 0; p < Q::QK / 2; ++p) {
        const float2 v = decode_pair<Q>(blk, p);
        const int j0 = Q::BITS == 8 ? 2 * p : p, j1 = Q::BITS == 8 ? 2 * p + 1 : p + Q::QK / 2;
        y[j0] = v.x;
        y[j1] = v.y;
    }
}

// Values e0 .. e0+7 (e0 a multiple of 8) of a row of blocks starting at `row`, in two steps
// (where registers matter, the loads can be issued well before their use): fetch8 reads what they
// need into a Raw8 (two 32-bit words of codes from 16-bit loads: qs bytes e0 % 32 .., or for 4/5-bit
// codes the 8 qs bytes holding their nibbles), decode8 turns it into floats.
template <class Q>
struct Raw8 {
    unsigned w[2];
    float d;
    float m;      // q4_1, q5_1
    unsigned qh;  // q5_0, q5_1: bit i is the 5th bit of value e0 + i
};

template <class Q>
__device__ __forceinline__ void fetch8(const unsigned char* row, const int e0, Raw8<Q>& r) {
    static_assert(Q::QK == 32, "blocks of 32 values");
    const unsigned char* blk = row + (e0 >> 5) * Q::BYTES;
    r.d = f16_to_f32(static_cast<unsigned short>(ld16(blk + Q::D)));
    const unsigned short* qs =
        reinterpret_cast<const unsigned short*>(blk + Q::QS + (Q::BITS == 8 ? e0 & 31 : e0 & 15));
    r.w[0] = static_cast<unsigned>(qs[0]) | (static_cast<unsigned>(qs[1]) << 16);
    r.w[1] = static_cast<unsigned>(qs[2]) | (static_cast<unsigned>(qs[3]) << 16);
    if constexpr (Q::M >= 0) {
        r.m = f16_to_f32(static_cast<unsigned short>(ld16(blk + Q::M)));
    }
    if constexpr (Q::BITS == 5) {
        r.qh = ld32_2(blk + Q::QH) >> (e0 & 31);
    }
}

template <class Q>
__device__ __forceinline__ void decode8(const Raw8<Q>& r, const int e0, float (&f)[8]) {
    const int shift = (e0 & 31) < 16 ? 0 : 4;  // 4/5-bit codes: values 16..31 sit in the high nibbles
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int q;
        if constexpr (Q::BITS == 8) {
            q = static_cast<int>(r.w[i / 4] << (24 - 8 * (i % 4))) >> 24;  // sign-extended byte i
        } else {
            q = static_cast<int>((r.w[i / 4] >> (8 * (i % 4) + shift)) & 0xfu);
            if constexpr (Q::BITS == 5) {
                q |= static_cast<int>((r.qh >> i) & 1u) << 4;
            }
        }
        if constexpr (Q::M >= 0) {
            f[i] = __fadd_rn(__fmul_rn(static_cast<float>(q - Q::ZERO), r.d), r.m);
        } else {
            f[i] = static_cast<float>(q - Q::ZERO) * r.d;  // nothing to contract it with: one rounding
        }
    }
}

// 4 bits (one a value) moved to bit 4 of each of 4 bytes: the 5th bits of q5 codes.
__device__ __forceinline__ unsigned spread4(unsigned h) {
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// Unit u of a row of blocks. quant_k.cuh's formats: values 8u .. 8u+7, one scale (m = minus the min).
// The legacy formats: 4 units a block, block u / 4, part s = u % 4: q8_0 codes 8s .. 8s+7;
// 4- and 5-bit: qs bytes 4s .. 4s+3, codes 4s .. 4s+3 (low nibbles) and 16+4s .. 16+4s+3 (high).
// c: its 8 codes minus the zero, as floats; d the block's scale, m its offset (0 unless q4_1/q5_1).
// Value = c * d + m rounded twice (__fmul_rn, __fadd_rn) is dequantize's.
template <class Q>
__device__ __forceinline__ void load_unit(const unsigned char* row, int u, float (&c)[8], float& d, float& m) {
    if constexpr (!Q::LEGACY) {  // quant_k.cuh: unit u = values 8u .. 8u+7 of the row, one scale
        constexpr int UNITS = Q::QK / 8;  // a block
        const unsigned char* blk = row + (u / UNITS) * Q::BYTES;
        const int j0 = 8 * (u % UNITS);
        Q::scale(blk, j0 / Q::SUB, d, m);
        m = -m;  // + (-m) rounds as ggml's - m
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            c[i] = static_cast<float>(Q::code(blk, j0 + i));
        }
    } else {
        const unsigned char* blk = row + (u >> 2) * Q::BYTES;
        const int s = u & 3;
        d = f16_to_f32(ld16(blk + Q::D));
        if constexpr (Q::M >= 0) {
            m = f16_to_f32(ld16(blk + Q::M));
        } else {
            m = 0.0f;
        }
        if constexpr (Q::BITS == 8) {
            const unsigned char* q = blk + Q::QS + 8 * s;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned v = ld16(q + 2 * i);
                c[2 * i] = static_cast<float>(static_cast<signed char>(v & 0xffu));
                c[2 * i + 1] = static_cast<float>(static_cast<signed char>(v >> 8));
            }
        } else {
            const unsigned q = ld32_2(blk + Q::QS + 4 * s);
            unsigned hl = 0, hh = 0;  // 5th bits, moved to bit 4 of each byte
            if constexpr (Q::BITS == 5) {
                const unsigned qh = ld32_2(blk + Q::QH);
                const unsigned lo = (qh >> (4 * s)) & 0xfu;         // bits of codes 4s .. 4s+3
                const unsigned hi = (qh >> (16 + 4 * s)) & 0xfu;    // bits of codes 16+4s ..
                hl = spread4(lo);
                hh = spread4(hi);
            }
            const unsigned lo4 = (q & 0x0f0f0f0fu) | hl;
            const unsigned hi4 = ((q >> 4) & 0x0f0f0f0fu) | hh;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                c[j] = static_cast<float>(static_cast<int>((lo4 >> (8 * j)) & 0xffu) - Q::ZERO);
                c[4 + j] = static_cast<float>(static_cast<int>((hi4 >> (8 * j)) & 0xffu) - Q::ZERO);
            }
        }
    }
}

// -- blocks in registers, for the integer dot products ------------------------------------------

// The 32-bit word at byte x (even; a constant once unrolled, so w stays in registers) of a
// block whose byte 0 is byte sh / 8 (0 or 2) of w[0]. __funnelshift_rc clamps a shift of 32
// to "all of the high word".
template <int N>
__device__ __forceinline__ unsigned block_word(const unsigned (&w)[N], int x, int sh) {
    return __funnelshift_rc(w[x / 4], w[x / 4 + 1], sh + 8 * (x % 4));
}

// The block whose byte 0 is byte sh / 8 (0 or 2) of w[0] (registers): q[i] = codes of values
// 4i .. 4i+3 (raw: 0 .. 2**BITS - 1, or int8 for q8_0; the caller subtracts the zero), scale d,
// offset m. The dot product with q8_1 codes b (dp4a) is then sum_j (c_j - ZERO) * d * b_j * db
// + m * b_j * db: d * (db * dot - ZERO * db * sum_b) (+ m * db * sum_b).
template <class Q, int N>
__device__ __forceinline__ void decode_words(const unsigned (&w)[N], int sh, int (&q)[8], float& d, float& m) {
    static_assert(N >= (Q::BYTES + 1) / 4 + 1, "too few words");
    d = f16_to_f32(static_cast<unsigned short>(block_word(w, Q::D, sh) & 0xffffu));
    m = 0.0f;
    if constexpr (Q::M >= 0) {
        m = f16_to_f32(static_cast<unsigned short>(block_word(w, Q::M, sh) & 0xffffu));
    }
    if constexpr (Q::BITS == 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = static_cast<int>(block_word(w, Q::QS + 4 * i, sh));
        }
    } else {
        unsigned qh = 0;
        if constexpr (Q::BITS == 5) {
            qh = block_word(w, Q::QH, sh);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned qs = block_word(w, Q::QS + 4 * i, sh);
            q[i] = static_cast<int>((qs & 0x0f0f0f0fu) | spread4((qh >> (4 * i)) & 0xfu));
            q[i + 4] = static_cast<int>(((qs >> 4) & 0x0f0f0f0fu) | spread4((qh >> (16 + 4 * i)) & 0xfu));
        }
    }
}

// -- encode: 8 lanes per block, exactly as opdispatch.dtypes.quantize -----------------------------
//
// The 32 values of a block are spread over 8 consecutive lanes of a warp (lanes
// 8g .. 8g+7), lane r = lane % 8 holding values 4r .. 4r+3 in x. Every lane of
// the warp must call this (it shuffles with the full mask); lanes with `active`
// false take part in the shuffles but store nothing.
//
// ggml scans a block with strict comparisons, so among tied candidates the
// first index wins (which decides the sign of a zero in d and m): a partner
// lane's candidate is taken on a tie only when it comes from lower indices.

__device__ __forceinline__ bool take_partner(float mine, float theirs, int r, int off, bool greater) {
    const bool better = greater ? theirs > mine : theirs < mine;
    return better || (theirs == mine && (r ^ off) < r);
}

template <class Q>
__device__ __forceinline__ void encode8(const float (&x)[4], const int r, unsigned char* blk, const bool active) {
    float d, id, m = 0.0f;
    if constexpr (Q::SCALE == Scale::absmax) {
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            amax = fmaxf(amax, fabsf(x[i]));
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, off, WARP_SIZE));
        }
        d = __fdiv_rn(amax, static_cast<float>(Q::DIV));
    } else if constexpr (Q::SCALE == Scale::signed_absmax) {
        float amax = 0.0f, max = 0.0f;  // ggml's start: an all-zero block keeps max = +0
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (amax < fabsf(x[i])) {
                amax = fabsf(x[i]);
                max = x[i];
            }
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            const float a2 = __shfl_xor_sync(FULL_MASK, amax, off, WARP_SIZE);
            const float m2 = __shfl_xor_sync(FULL_MASK, max, off, WARP_SIZE);
            if (take_partner(amax, a2, r, off, true)) {
                amax = a2;
                max = m2;
            }
        }
        d = __fdiv_rn(max, static_cast<float>(Q::DIV));
    } else {
        float lo = 3.402823466e+38f, hi = -3.402823466e+38f;  // FLT_MAX, as ggml starts
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (x[i] < lo) {
                lo = x[i];
            }
            if (x[i] > hi) {
                hi = x[i];
            }
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            const float lo2 = __shfl_xor_sync(FULL_MASK, lo, off, WARP_SIZE);
            const float hi2 = __shfl_xor_sync(FULL_MASK, hi, off, WARP_SIZE);
            if (take_partner(lo, lo2, r, off, false)) {
                lo = lo2;
            }
            if (take_partner(hi, hi2, r, off, true)) {
                hi = hi2;
            }
        }
        m = lo;
        d = __fdiv_rn(__fsub_rn(hi, lo), static_cast<float>(Q::DIV));
    }
    id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;

    int q[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (Q::BITS == 8) {
            q[i] = static_cast<int>(roundf(__fmul_rn(x[i], id)));  // roundf: halves away from zero, as ggml
        } else {
            const float v = Q::SCALE == Scale::range ? __fmul_rn(__fsub_rn(x[i], m), id) : __fmul_rn(x[i], id);
            const float t = truncf(__fadd_rn(v, static_cast<float>(Q::ZERO) + 0.5f));
            q[i] = static_cast<int>(fminf(t, static_cast<float>(Q::QMAX)));
        }
    }

    // One byte per code, in index order: lane r's 4 bytes of qs (8-bit codes)
    // or its 4 low nibbles (4/5-bit codes, before the merge below).
    const unsigned packed = (q[0] & 0xff) | ((q[1] & 0xff) << 8) | ((q[2] & 0xff) << 16)
        | (static_cast<unsigned>(q[3] & 0xff) << 24);
    unsigned nibbles = 0, qh = 0;
    if constexpr (Q::BITS < 8) {
        // qs byte j = code j | code j+16 << 4: lane r < 4 takes lane r+4's codes as high nibbles.
        const unsigned low = packed & 0x0f0f0f0fu;
        const unsigned high = __shfl_xor_sync(FULL_MASK, low, 4, WARP_SIZE);
        nibbles = low | (high << 4);
    }
    if constexpr (Q::BITS == 5) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            qh |= static_cast<unsigned>((q[i] >> 4) & 1) << (4 * r + i);
        }
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) {
            qh |= __shfl_xor_sync(FULL_MASK, qh, off, WARP_SIZE);
        }
    }
    if (!active) {
        return;
    }
    if (r == 0) {
        st16(blk + Q::D, f32_to_f16(d));
        if constexpr (Q::M >= 0) {
            st16(blk + Q::M, f32_to_f16(m));
        }
        if constexpr (Q::QH >= 0) {
            st32_2(blk + Q::QH, qh);
        }
    }
    if constexpr (Q::BITS == 8) {
        st32_2(blk + Q::QS + 4 * r, packed);
    } else if (r < 4) {
        st32_2(blk + Q::QS + 4 * r, nibbles);
    }
}

}  // namespace quant
}  // namespace od
