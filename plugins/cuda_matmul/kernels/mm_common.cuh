// Device helpers of the cuda_matmul kernels: weight formats, b loads, and the
// GLU activations of the fused epilogue.
//
// Weight kinds (template parameter WT) and b kinds (TB) are small integers, named
// below, so that template instances read as mmvq<W_Q4_0, 1, EPI_NONE>.
//
// Float rows (mmv) are read in "units" of 8 values:
//   VEC: unit u = values 8u .. 8u+7, one 16-byte load (f16/bf16) or two (f32);
//     b indices 8u .. 8u+3 and 8u+4 .. 8u+7.
//   scalar: unit u = value u alone (any K, any alignment).
// Block formats (32 values a block) are decoded two ways:
//   load_unit_quant (the dequantizing copy, convert.cu): 4 units a block, unit u =
//     block u / 4, part s = u % 4: q8_0 codes 8s .. 8s+7; 4- and 5-bit: qs bytes
//     4s .. 4s+3 hold codes 4s..4s+3 (low nibbles) and 16+4s .. 16+4s+3 (high).
//   decode_words (the quantized mat-vec, mmv.cu): a whole block, held in registers,
//     as 8 words of 4 int8 codes, word i = values 4i .. 4i+3, for dp4a.
//   value_j = c_j * d + m, where c_j is the code minus the format's zero, d the
//   block scale and m its offset (0 unless q4_1/q5_1). Blocks are only 2-byte
//   aligned (18, 22 and 34 bytes): global fields are read with 16-bit loads.
//
// Decoding for the dequantizing copy (convert.cu) is exactly opdispatch.dtypes.dequantize:
// (q - zero) * d then + m, each rounded once (__fmul_rn / __fadd_rn keep the
// compiler from contracting them into an FMA).
#pragma once

#include "activations.cuh"
#include "common.cuh"

// Weight kinds.
constexpr int W_F32 = 0;
constexpr int W_F16 = 1;
constexpr int W_BF16 = 2;
constexpr int W_Q4_0 = 3;
constexpr int W_Q4_1 = 4;
constexpr int W_Q5_0 = 5;
constexpr int W_Q5_1 = 6;
constexpr int W_Q8_0 = 7;

// b (and destination) element kinds.
constexpr int B_F32 = 0;
constexpr int B_F16 = 1;
constexpr int B_BF16 = 2;

// Epilogues of the mat-vec kernels.
constexpr int EPI_NONE = 0;  // out = a . b
constexpr int EPI_BIAS = 1;  // out = a . b + bias[m]
constexpr int EPI_GLU = 2;   // out = act(a0 . b + bias0[m]) * (a1 . b + bias1[m]) (biases optional)


namespace mm {

using u8 = unsigned char;

template <int WT>
struct Fmt;

template <>
struct Fmt<W_F32> {
    static constexpr bool QUANT = false;
    static constexpr int ELEM = 4;
    static constexpr int BITS = 8 * 4;
    static constexpr int M = -1;
};
template <>
struct Fmt<W_F16> {
    static constexpr bool QUANT = false;
    static constexpr int ELEM = 2;
    static constexpr int BITS = 8 * 2;
    static constexpr int M = -1;
};
template <>
struct Fmt<W_BF16> {
    static constexpr bool QUANT = false;
    static constexpr int ELEM = 2;
    static constexpr int BITS = 8 * 2;
    static constexpr int M = -1;
};

// Block formats: bytes, field offsets (-1: absent), code zero, code bits.
template <int BYTES_, int M_, int QH_, int QS_, int ZERO_, int BITS_>
struct QFmt {
    static constexpr bool QUANT = true;
    static constexpr int BYTES = BYTES_;
    static constexpr int M = M_;
    static constexpr int QH = QH_;
    static constexpr int QS = QS_;
    static constexpr int ZERO = ZERO_;
    static constexpr int BITS = BITS_;
};
template <>
struct Fmt<W_Q4_0> : QFmt<18, -1, -1, 2, 8, 4> {};
template <>
struct Fmt<W_Q4_1> : QFmt<20, 2, -1, 4, 0, 4> {};
template <>
struct Fmt<W_Q5_0> : QFmt<22, -1, 2, 6, 16, 5> {};
template <>
struct Fmt<W_Q5_1> : QFmt<24, 2, 4, 8, 0, 5> {};
template <>
struct Fmt<W_Q8_0> : QFmt<34, -1, -1, 2, 0, 8> {};

// ggml's q8_1 scale of 32 values whose largest magnitude is amax: d = amax / 127 (a value is
// code * d), and id, what a value is multiplied by before rounding to its code (0 for a block of 0s).
// quantize_q8_1 (mmv.cu) and mmvq_stream's in-block quantization both use it and q8_1_code, so they
// agree bit for bit. amax is NaN when a value is (od::fmax_nan): d is then NaN, and so is every dot
// product the block enters.
__device__ __forceinline__ void q8_1_scale(float amax, float& d, float& id) {
    d = amax / 127.0f;
    id = amax > 0.0f ? 127.0f / amax : 0.0f;
}

// The q8_1 code of value v: v * id rounded half to even, as __float2int_rn(v * id), but by an add on
// the FMA pipe instead of F2I, which issues at a quarter of the rate (sm_90) on the path from the
// PDL wait to the dot products: 1.5 * 2^23 + x holds x's rounded integer in its low mantissa bits
// (|x| <= 127 here). __fmul_rn: the product rounded first, never contracted with the add into one
// fma, which would round differently at ties.
__device__ __forceinline__ int q8_1_code(float v, float id) {
    return static_cast<int>(__float_as_uint(__fmul_rn(v, id) + 12582912.0f) - 0x4B400000u);
}

__device__ __forceinline__ unsigned ld16(const u8* p) {
    return *reinterpret_cast<const unsigned short*>(p);
}

// 4 bytes at a 2-byte aligned address.
__device__ __forceinline__ unsigned ld32_2(const u8* p) {
    return ld16(p) | (ld16(p + 2) << 16);
}

// Element loads of any kind as float.
template <int K>
__device__ __forceinline__ float load_elem(const u8* p) {
    if constexpr (K == W_F32 || K == B_F32) {
        return *reinterpret_cast<const float*>(p);
    } else if constexpr (K == W_F16 || K == B_F16) {
        return od::f16_to_f32(ld16(p));
    } else {
        return od::bf16_to_f32(ld16(p));
    }
}

// The first b index of each half (4 values) of unit u, for block formats and vector float rows.
template <int WT>
__device__ __forceinline__ int2 unit_k(int u) {
    if constexpr (Fmt<WT>::QUANT && Fmt<WT>::BITS < 8) {
        const int k = (u >> 2) * 32 + (u & 3) * 4;
        return make_int2(k, k + 16);
    } else {
        return make_int2(8 * u, 8 * u + 4);
    }
}

__device__ __forceinline__ void half2_to_f(unsigned v, float& lo, float& hi) {
    lo = od::f16_to_f32(static_cast<unsigned short>(v & 0xffffu));
    hi = od::f16_to_f32(static_cast<unsigned short>(v >> 16));
}

__device__ __forceinline__ void bf2_to_f(unsigned v, float& lo, float& hi) {
    lo = __uint_as_float(v << 16);
    hi = __uint_as_float(v & 0xffff0000u);
}

// 8 float values of unit u of a float row (16-byte aligned row, K % 8 == 0).
template <int WT>
__device__ __forceinline__ void load_unit_float(const u8* row, int u, float (&w)[8]) {
    if constexpr (WT == W_F32) {
        const float4* p = reinterpret_cast<const float4*>(row) + 2 * u;
        const float4 x = p[0], y = p[1];
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
        w[4] = y.x, w[5] = y.y, w[6] = y.z, w[7] = y.w;
    } else {
        const uint4 v = reinterpret_cast<const uint4*>(row)[u];
        if constexpr (WT == W_F16) {
            half2_to_f(v.x, w[0], w[1]);
            half2_to_f(v.y, w[2], w[3]);
            half2_to_f(v.z, w[4], w[5]);
            half2_to_f(v.w, w[6], w[7]);
        } else {
            bf2_to_f(v.x, w[0], w[1]);
            bf2_to_f(v.y, w[2], w[3]);
            bf2_to_f(v.z, w[4], w[5]);
            bf2_to_f(v.w, w[6], w[7]);
        }
    }
}

// 4 bits (one a value) moved to bit 4 of each of 4 bytes: the 5th bits of q5 codes.
__device__ __forceinline__ unsigned spread4(unsigned h) {
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// Codes c (minus the zero, as floats), scale d and offset m of unit u of a block-format row.
template <int WT>
__device__ __forceinline__ void load_unit_quant(const u8* row, int u, float (&c)[8], float& d, float& m) {
    using F = Fmt<WT>;
    const u8* blk = row + (u >> 2) * F::BYTES;
    const int s = u & 3;
    d = od::f16_to_f32(ld16(blk));
    if constexpr (F::M >= 0) {
        m = od::f16_to_f32(ld16(blk + F::M));
    } else {
        m = 0.0f;
    }
    if constexpr (F::BITS == 8) {
        const u8* q = blk + F::QS + 8 * s;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned v = ld16(q + 2 * i);
            c[2 * i] = static_cast<float>(static_cast<signed char>(v & 0xffu));
            c[2 * i + 1] = static_cast<float>(static_cast<signed char>(v >> 8));
        }
    } else {
        const unsigned q = ld32_2(blk + F::QS + 4 * s);
        unsigned hl = 0, hh = 0;  // 5th bits, moved to bit 4 of each byte
        if constexpr (F::BITS == 5) {
            const unsigned qh = ld32_2(blk + F::QH);
            const unsigned lo = (qh >> (4 * s)) & 0xfu;         // bits of codes 4s .. 4s+3
            const unsigned hi = (qh >> (16 + 4 * s)) & 0xfu;    // bits of codes 16+4s ..
            hl = spread4(lo);
            hh = spread4(hi);
        }
        const unsigned lo4 = (q & 0x0f0f0f0fu) | hl;
        const unsigned hi4 = ((q >> 4) & 0x0f0f0f0fu) | hh;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            c[j] = static_cast<float>(static_cast<int>((lo4 >> (8 * j)) & 0xffu) - F::ZERO);
            c[4 + j] = static_cast<float>(static_cast<int>((hi4 >> (8 * j)) & 0xffu) - F::ZERO);
        }
    }
}

// The 32-bit word at byte x (even; a constant once unrolled, so w stays in registers) of a
// block whose byte 0 is byte sh / 8 (0 or 2) of w[0]. __funnelshift_rc clamps a shift of 32
// to "all of the high word".
template <int N>
__device__ __forceinline__ unsigned block_word(const unsigned (&w)[N], int x, int sh) {
    return __funnelshift_rc(w[x / 4], w[x / 4 + 1], sh + 8 * (x % 4));
}

// The block whose byte 0 is byte sh / 8 (0 or 2) of w[0] (registers): q[i] = codes of values
// 4i .. 4i+3 (raw: 0 .. 2**BITS - 1, or int8 for q8_0; the caller subtracts the zero), scale d,
// offset m.
template <int WT, int N>
__device__ __forceinline__ void decode_words(const unsigned (&w)[N], int sh, int (&q)[8], float& d, float& m) {
    using F = Fmt<WT>;
    static_assert(N >= (F::BYTES + 1) / 4 + 1, "too few words");
    d = od::f16_to_f32(static_cast<unsigned short>(block_word(w, 0, sh) & 0xffffu));
    m = 0.0f;
    if constexpr (F::M >= 0) {
        m = od::f16_to_f32(static_cast<unsigned short>(block_word(w, F::M, sh) & 0xffffu));
    }
    if constexpr (F::BITS == 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = static_cast<int>(block_word(w, F::QS + 4 * i, sh));
        }
    } else {
        unsigned qh = 0;
        if constexpr (F::BITS == 5) {
            qh = block_word(w, F::QH, sh);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned qs = block_word(w, F::QS + 4 * i, sh);
            q[i] = static_cast<int>((qs & 0x0f0f0f0fu) | spread4((qh >> (4 * i)) & 0xfu));
            q[i + 4] = static_cast<int>(((qs >> 4) & 0x0f0f0f0fu) | spread4((qh >> (16 + 4 * i)) & 0xfu));
        }
    }
}

// 4 b values at index k of a contiguous column (VEC: 16-byte aligned f32 or 8-byte aligned f16/bf16 data).
template <int TB, bool VEC>
__device__ __forceinline__ float4 load_b4(const u8* col, int k, long long es) {
    if constexpr (VEC) {
        if constexpr (TB == B_F32) {
            return *reinterpret_cast<const float4*>(col + 4ll * k);
        } else {
            const uint2 v = *reinterpret_cast<const uint2*>(col + 2ll * k);
            float4 r;
            if constexpr (TB == B_F16) {
                half2_to_f(v.x, r.x, r.y);
                half2_to_f(v.y, r.z, r.w);
            } else {
                bf2_to_f(v.x, r.x, r.y);
                bf2_to_f(v.y, r.z, r.w);
            }
            return r;
        }
    } else {
        const u8* p = col + k * es;
        return make_float4(load_elem<TB>(p), load_elem<TB>(p + es), load_elem<TB>(p + 2 * es),
                           load_elem<TB>(p + 3 * es));
    }
}

// The epilogue of output row m of the mat-vec kernels (mmv.cu, mmvq_stream.cu): v = a0 . b,
// up = a1 . b (read for EPI_GLU only).
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
        v = od::glu(glu_kind, v, up, alpha, limit);  // activations.cuh
    }
    return v;
}

}  // namespace mm
