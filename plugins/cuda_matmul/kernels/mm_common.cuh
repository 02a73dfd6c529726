// Device helpers of the cuda_matmul kernels: weight kinds, b loads, and the
// GLU activations of the fused epilogue.
//
// Weight kinds (template parameter WT) and b kinds (TB) are small integers, named
// below, so that template instances read as mmvq<W_Q4_0, 1, EPI_NONE>; Fmt<WT> is a
// kind's element size, or its block format (quant.cuh, whose accessors decode it).
//
// Float rows (mmv) are read in "units" of 8 values:
//   VEC: unit u = values 8u .. 8u+7, one 16-byte load (f16/bf16) or two (f32);
//     b indices 8u .. 8u+3 and 8u+4 .. 8u+7.
//   scalar: unit u = value u alone (any K, any alignment).
// Block-format rows are read in quant.cuh's units (load_unit) by the dequantizing copy
// (convert.cu); the quantized mat-vecs read the legacy formats as whole blocks in registers
// (decode_words) and quant_k.cuh's and quant_iq.cuh's formats 32 values at a time (dot32).
#pragma once

#include "activations.cuh"
#include "common.cuh"
#include "quant.cuh"

// Weight kinds.
constexpr int W_F32 = 0;
constexpr int W_F16 = 1;
constexpr int W_BF16 = 2;
constexpr int W_Q4_0 = 3;
constexpr int W_Q4_1 = 4;
constexpr int W_Q5_0 = 5;
constexpr int W_Q5_1 = 6;
constexpr int W_Q8_0 = 7;
constexpr int W_Q2_K = 8;  // quant_k.cuh's formats
constexpr int W_Q3_K = 9;
constexpr int W_Q4_K = 10;
constexpr int W_Q5_K = 11;
constexpr int W_Q6_K = 12;
constexpr int W_IQ4_NL = 13;
constexpr int W_IQ4_XS = 14;
constexpr int W_MXFP4 = 15;
constexpr int W_IQ2_XXS = 16;  // quant_iq.cuh's grid I-quants
constexpr int W_IQ2_XS = 17;
constexpr int W_IQ2_S = 18;
constexpr int W_IQ3_XXS = 19;
constexpr int W_IQ3_S = 20;
constexpr int W_IQ1_S = 21;
constexpr int W_IQ1_M = 22;

// b (and destination) element kinds.
constexpr int B_F32 = 0;
constexpr int B_F16 = 1;
constexpr int B_BF16 = 2;

// Epilogues of the mat-vec kernels and mmf. A bias is one row of M floats added to every output row
// (bias_col = 0), or an addend of the output's shape whose rows are bias_col floats apart (a residual):
// output row r = (i3 * B2 + i2) * N + n adds bias[r * bias_col + m].
constexpr int EPI_NONE = 0;  // out = a . b
constexpr int EPI_BIAS = 1;  // out = a . b + bias[r * bias_col + m]
constexpr int EPI_GLU = 2;   // out = act(a0 . b + bias0[..]) * (a1 . b + bias1[..]) (biases optional, indexed alike)


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

// Block formats: quant.cuh's traits.
template <>
struct Fmt<W_Q4_0> : od::quant::q4_0 {
    static constexpr bool QUANT = true;
};
template <>
struct Fmt<W_Q4_1> : od::quant::q4_1 {
    static constexpr bool QUANT = true;
};
template <>
struct Fmt<W_Q5_0> : od::quant::q5_0 {
    static constexpr bool QUANT = true;
};
template <>
struct Fmt<W_Q5_1> : od::quant::q5_1 {
    static constexpr bool QUANT = true;
};
template <>
struct Fmt<W_Q8_0> : od::quant::q8_0 {
    static constexpr bool QUANT = true;
};
#define MM_SUBSCALED(KIND, TRAITS)                  \
    template <>                                     \
    struct Fmt<KIND> : od::quant::TRAITS {          \
        static constexpr bool QUANT = true;         \
    };
MM_SUBSCALED(W_Q2_K, q2_K)
MM_SUBSCALED(W_Q3_K, q3_K)
MM_SUBSCALED(W_Q4_K, q4_K)
MM_SUBSCALED(W_Q5_K, q5_K)
MM_SUBSCALED(W_Q6_K, q6_K)
MM_SUBSCALED(W_IQ4_NL, iq4_nl)
MM_SUBSCALED(W_IQ4_XS, iq4_xs)
MM_SUBSCALED(W_MXFP4, mxfp4)
MM_SUBSCALED(W_IQ2_XXS, iq2_xxs)
MM_SUBSCALED(W_IQ2_XS, iq2_xs)
MM_SUBSCALED(W_IQ2_S, iq2_s)
MM_SUBSCALED(W_IQ3_XXS, iq3_xxs)
MM_SUBSCALED(W_IQ3_S, iq3_s)
MM_SUBSCALED(W_IQ1_S, iq1_s)
MM_SUBSCALED(W_IQ1_M, iq1_m)
#undef MM_SUBSCALED

// Element loads of any kind as float.
template <int K>
__device__ __forceinline__ float load_elem(const u8* p) {
    if constexpr (K == W_F32 || K == B_F32) {
        return *reinterpret_cast<const float*>(p);
    } else if constexpr (K == W_F16 || K == B_F16) {
        return od::f16_to_f32(od::ld16(p));
    } else {
        return od::bf16_to_f32(od::ld16(p));
    }
}

// The first b index of each half (4 values) of unit u, for block formats and vector float rows:
// the legacy 4- and 5-bit formats' units take 4 values from each half of a block, the others'
// (q8_0, quant_k.cuh's formats, float rows) are 8 consecutive values.
template <int WT>
__device__ __forceinline__ constexpr bool split_unit() {
    if constexpr (Fmt<WT>::QUANT) {
        if constexpr (Fmt<WT>::LEGACY) {
            return Fmt<WT>::BITS < 8;
        }
    }
    return false;
}

template <int WT>
__device__ __forceinline__ int2 unit_k(int u) {
    if constexpr (split_unit<WT>()) {
        const int k = (u >> 2) * 32 + (u & 3) * 4;
        return make_int2(k, k + 16);
    } else {
        return make_int2(8 * u, 8 * u + 4);
    }
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
            od::unpack_f16x2(v.x, w[0], w[1]);
            od::unpack_f16x2(v.y, w[2], w[3]);
            od::unpack_f16x2(v.z, w[4], w[5]);
            od::unpack_f16x2(v.w, w[6], w[7]);
        } else {
            od::unpack_bf16x2(v.x, w[0], w[1]);
            od::unpack_bf16x2(v.y, w[2], w[3]);
            od::unpack_bf16x2(v.z, w[4], w[5]);
            od::unpack_bf16x2(v.w, w[6], w[7]);
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
                od::unpack_f16x2(v.x, r.x, r.y);
                od::unpack_f16x2(v.y, r.z, r.w);
            } else {
                od::unpack_bf16x2(v.x, r.x, r.y);
                od::unpack_bf16x2(v.y, r.z, r.w);
            }
            return r;
        }
    } else {
        const u8* p = col + k * es;
        return make_float4(load_elem<TB>(p), load_elem<TB>(p + es), load_elem<TB>(p + 2 * es),
                           load_elem<TB>(p + 3 * es));
    }
}

// The epilogue of an output of the mat-vec kernels (mmv.cu, mmvq_stream.cu) and mmf: v = a0 . b,
// up = a1 . b (read for EPI_GLU only), `at` the output's index into the biases (r * bias_col + m for
// output row r, column m; see EPI_NONE's comment).
template <int EPI>
__device__ __forceinline__ float epilogue(float v, float up, const float* bias0, const float* bias1, long long at,
                                          int glu_kind, float alpha, float limit) {
    if constexpr (EPI == EPI_BIAS) {
        v += bias0[at];
    } else if constexpr (EPI == EPI_GLU) {
        if (bias0 != nullptr) {
            v += bias0[at];
        }
        if (bias1 != nullptr) {
            up += bias1[at];
        }
        v = od::glu(glu_kind, v, up, alpha, limit);  // activations.cuh
    }
    return v;
}

}  // namespace mm
