// Helpers of the cuda_attention kernels: ALiBi slopes, row loaders for every K/V
// type (f32, f16, bf16, and the block formats q8_0, q4_0 through quant.cuh) and the
// sm_80+ instructions both flash kernels use (mma.sync; ldmatrix and cp.async are
// common.cuh's), written in PTX so that no system header is needed (NVRTC and nvcc
// alike), and the K/V tile loader they share.
#pragma once

#include "common.cuh"
#include "quant.cuh"

namespace od_attn {

using od::bf16;
using od::f16;

constexpr float LOG2E = 1.4426950408889634f;
// The running maximum starts here rather than at -inf, so that exp(m_old - m_new)
// and exp(s - m) stay finite (0 or 1) while every logit so far was -inf.
constexpr float NEG_BIG = -1e30f;

// ALiBi slope of head h (ggml_soft_max / flash_attn_ext); 1 when max_bias <= 0 (use_alibi 0).
__device__ __forceinline__ float alibi_slope(int use_alibi, int h, int n_head_log2, float m0, float m1) {
    if (!use_alibi) {
        return 1.0f;
    }
    return h < n_head_log2 ? powf(m0, (float)(h + 1)) : powf(m1, (float)(2 * (h - n_head_log2) + 1));
}

__device__ __forceinline__ bool is_neg_inf(float x) { return x == -__int_as_float(0x7f800000); }

// A logit x (log2 units) plus slope2 * its f16 mask value m: -inf where m is -inf, even where x is
// not finite (a key the mask hides is skipped outright, as in ggml: garbage K rows do not matter).
// The sum is computed whatever m is and then selected: a conditional conversion (inline PTX, which the
// compiler does not speculate) became a branch per score, 1.7% of the 1b decode step on the H200.
__device__ __forceinline__ float masked(unsigned short m, float slope2, float x) {
    const float y = fmaf(slope2, od::f16_to_f32(m), x);
    return m == 0xfc00u ? -__int_as_float(0x7f800000) : y;
}

// -- loaders: 8 consecutive values of a row as floats ----------------------------------
// Row8<T>::load(row, e0, vec, f): values e0 .. e0+7 (e0 a multiple of 8) of the row
// starting at byte address `row`. `vec`: the row start is 16-byte aligned (16-byte
// loads for f16/bf16/f32); block formats are read in 2-byte words (blocks of 34 or 18
// bytes are only 2-byte aligned). Float rows also in two steps, where registers matter:
// fetch(...) loads the raw bytes into a Raw, decode(raw, e0, f) converts them.

// A block format Q (od::quant::q8_0, q4_0): quant.cuh's fetch8 and decode8.
template <typename Q>
struct Row8 {
    using Raw = od::quant::Raw8<Q>;
    static __device__ __forceinline__ void fetch(const char* row, int e0, bool, Raw& r) {
        od::quant::fetch8<Q>(reinterpret_cast<const unsigned char*>(row), e0, r);
    }
    static __device__ __forceinline__ void decode(const Raw& r, int e0, float (&f)[8]) {
        od::quant::decode8<Q>(r, e0, f);
    }
    static __device__ __forceinline__ void load(const char* row, int e0, bool vec, float (&f)[8]) {
        Raw r;
        fetch(row, e0, vec, r);
        decode(r, e0, f);
    }
};

template <>
struct Row8<float> {
    struct Raw {
        float v[8];
    };
    static __device__ __forceinline__ void fetch(const char* row, int e0, bool vec, Raw& r) {
        const float* p = reinterpret_cast<const float*>(row) + e0;
        if (vec) {
            const float4 a = reinterpret_cast<const float4*>(p)[0];
            const float4 b = reinterpret_cast<const float4*>(p)[1];
            r.v[0] = a.x; r.v[1] = a.y; r.v[2] = a.z; r.v[3] = a.w;
            r.v[4] = b.x; r.v[5] = b.y; r.v[6] = b.z; r.v[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                r.v[i] = p[i];
            }
        }
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, float (&f)[8]) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            f[i] = r.v[i];
        }
    }
    static __device__ __forceinline__ void load(const char* row, int e0, bool vec, float (&f)[8]) {
        Raw r;
        fetch(row, e0, vec, r);
        decode(r, e0, f);
    }
};

template <bool BF>
struct Row8Half {
    struct Raw {
        unsigned w[4];
    };
    static __device__ __forceinline__ void fetch(const char* row, int e0, bool vec, Raw& r) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + e0;
        if (vec) {
            const uint4 u = *reinterpret_cast<const uint4*>(p);
            r.w[0] = u.x; r.w[1] = u.y; r.w[2] = u.z; r.w[3] = u.w;
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                r.w[i] = static_cast<unsigned>(p[2 * i]) | (static_cast<unsigned>(p[2 * i + 1]) << 16);
            }
        }
    }
    static __device__ __forceinline__ void decode(const Raw& r, int, float (&f)[8]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if constexpr (BF) {
                od::unpack_bf16x2(r.w[i], f[2 * i], f[2 * i + 1]);
            } else {
                od::unpack_f16x2(r.w[i], f[2 * i], f[2 * i + 1]);
            }
        }
    }
    static __device__ __forceinline__ void load(const char* row, int e0, bool vec, float (&f)[8]) {
        Raw r;
        fetch(row, e0, vec, r);
        decode(r, e0, f);
    }
};

template <>
struct Row8<f16> : Row8Half<false> {};

template <>
struct Row8<bf16> : Row8Half<true> {};

// -- sm_80+ instructions -------------------------------------------------------------------

using od::ldsm_x4;  // common.cuh's
using od::ldsm_x4_trans;

// D (16x8 f32) += A (16x16, row) * B (16x8, col); BF: bf16 inputs, else f16.
template <bool BF>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (BF) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Two floats as a packed pair of 16-bit values, `lo` in the low half (round to nearest even).
template <bool BF>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    if constexpr (BF) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

__device__ __forceinline__ void st_shared16(unsigned saddr, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(saddr), "r"(a), "r"(b), "r"(c), "r"(d));
}

// One tile of ROWS keys x D values into shared memory as 16-bit values (bf16 when
// K/V are bf16, else f16), row stride D + 8 units (conflict-free ldmatrix); keys
// past `end` are zeros (so P * V never meets garbage). f16/bf16 rows 16-byte aligned
// (`vec`) go through cp.async, other types are converted through registers.
// A thread copies 16-byte chunks c = tid + i * THREADS; where THREADS is a multiple
// of the chunks in a row, its column is fixed and its rows step evenly, which keeps
// the addresses in few registers.
template <int D, int ROWS, int THREADS, typename KT>
__device__ __forceinline__ void load_tile(unsigned short* dst, const char* base, long long rs, int kb, int end, bool vec,
                                          int tid) {
    constexpr bool BF = od::same_v<KT, bf16>;
    constexpr bool NATIVE = od::same_v<KT, f16> || BF;
    constexpr int CPR = D / 8;
    constexpr int TOTAL = ROWS * CPR;
    constexpr bool EVEN = THREADS % CPR == 0;
    static_assert(TOTAL % THREADS == 0, "tile chunks must divide among the threads");
    const char* src0 = base + (kb + tid / CPR) * rs;
#pragma unroll
    for (int it = 0; it < TOTAL / THREADS; ++it) {
        const int c = tid + it * THREADS;
        const int row = EVEN ? tid / CPR + it * (THREADS / CPR) : c / CPR;
        const int col = EVEN ? tid % CPR : c % CPR;
        const unsigned sa = od::smem_addr(dst + row * (D + 8) + col * 8);
        if (kb + row >= end) {
            st_shared16(sa, 0u, 0u, 0u, 0u);
            continue;
        }
        const char* src = EVEN ? src0 + it * (THREADS / CPR) * rs : base + (kb + row) * rs;
        if constexpr (NATIVE) {
            if (vec) {
                od::cp_async16(sa, src + col * 16);
            } else {
                typename Row8Half<BF>::Raw r;
                Row8Half<BF>::fetch(src, col * 8, false, r);
                st_shared16(sa, r.w[0], r.w[1], r.w[2], r.w[3]);
            }
        } else {
            float f[8];
            Row8<KT>::load(src, col * 8, vec, f);
            st_shared16(sa, pack2<BF>(f[0], f[1]), pack2<BF>(f[2], f[3]), pack2<BF>(f[4], f[5]),
                        pack2<BF>(f[6], f[7]));
        }
    }
}

// 8 values e0 .. e0+7 of a query row (f32, or f16 if q_f16) into shared memory at shared address saddr as
// 16-bit values; a null row stores zeros.
template <bool BF>
__device__ __forceinline__ void store_q8(unsigned saddr, const char* row, int e0, int q_f16) {
    float f[8];
    if (row == nullptr) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            f[i] = 0.0f;
        }
    } else if (q_f16) {
        Row8<f16>::load(row, e0, false, f);
    } else {
        Row8<float>::load(row, e0, false, f);
    }
    st_shared16(saddr, pack2<BF>(f[0], f[1]), pack2<BF>(f[2], f[3]), pack2<BF>(f[4], f[5]), pack2<BF>(f[6], f[7]));
}

}  // namespace od_attn
