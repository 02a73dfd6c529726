// Copies that prepare the GEMMs' operands (cuBLAS's, mmq_wgmma's b), written to a contiguous scratch buffer:
//   convert<TS, TD>   a float tensor of any strides -> contiguous TD (f32/f16/bf16),
//                     rounded as opdispatch.dtypes.from_float (to nearest even).
//   dequant<WT, TD>   rows of a block-format tensor (any row and batch strides) ->
//                     contiguous TD, decoded exactly as opdispatch.dtypes.dequantize
//                     (then rounded to TD).
//   convert_norm<TD>  rows of an f32 tensor -> rms_norm(x) * w in TD (f16/bf16): the b of
//                     the products after a fused rms_norm -> mul (fusion.py's rms_norm groups
//                     on the cuBLAS paths and mmq_wgmma), so the normed values never go
//                     through memory in f32.
//   convert_glu<TD, VEC>  act(gate) * up of two contiguous f32 tensors alike -> TD: the b
//                     of the product after a fused glu (fusion.py's glu_mul_mat groups).
// convert and dequant take 4-d geometry innermost first: n0 values a row, rows n1 x n2 x n3
// with byte strides s1, s2, s3 (convert also s0, the element stride). A block of
// CONVERT_BLOCK threads walks rows (grid-stride over n1 * n2 * n3 rows); convert_norm's
// rows likewise, convert_glu's values grid-stride.

#include "mm_common.cuh"

constexpr int CONVERT_BLOCK = 256;
constexpr int CONVERT_ILP = 8;  // values a thread loads at once (a row of 2048 in one round)

namespace mm {

template <int TD>
__device__ __forceinline__ void store_as(u8* p, float v) {
    if constexpr (TD == B_F32) {
        *reinterpret_cast<float*>(p) = v;
    } else if constexpr (TD == B_F16) {
        *reinterpret_cast<unsigned short*>(p) = od::f32_to_f16(v);
    } else {
        *reinterpret_cast<unsigned short*>(p) = od::f32_to_bf16(v);
    }
}

__device__ __forceinline__ long long row_offset(long long row, int n1, int n2, long long s1, long long s2,
                                                long long s3) {
    const long long i1 = row % n1, q = row / n1;
    return i1 * s1 + (q % n2) * s2 + (q / n2) * s3;
}

}  // namespace mm

using mm::u8;

template <int TS, int TD>
__global__ void __launch_bounds__(CONVERT_BLOCK) convert(const u8* src, int n0, int n1, int n2, int n3, long long s0,
                                                         long long s1, long long s2, long long s3, u8* dst) {
    od::grid_enter();
    constexpr int DS = TD == B_F32 ? 4 : 2;
    const long long rows = static_cast<long long>(n1) * n2 * n3;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const u8* s = src + mm::row_offset(row, n1, n2, s1, s2, s3);
        u8* d = dst + row * n0 * DS;
        // CONVERT_ILP values a thread, all loaded before any is stored: a row's loads are in flight
        // together (a store may alias a later load for the compiler, which keeps them in order)
        for (int i0 = threadIdx.x; i0 < n0; i0 += CONVERT_ILP * CONVERT_BLOCK) {
            float v[CONVERT_ILP];
#pragma unroll
            for (int j = 0; j < CONVERT_ILP; ++j) {
                const int i = i0 + j * CONVERT_BLOCK;
                v[j] = i < n0 ? mm::load_elem<TS>(s + i * s0) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < CONVERT_ILP; ++j) {
                const int i = i0 + j * CONVERT_BLOCK;
                if (i < n0) {
                    mm::store_as<TD>(d + i * DS, v[j]);
                }
            }
        }
    }
}

template <int WT, int TD>
__global__ void __launch_bounds__(CONVERT_BLOCK) dequant(const u8* src, int n0, int n1, int n2, int n3, long long s1,
                                                         long long s2, long long s3, u8* dst) {
    od::grid_enter();
    using F = mm::Fmt<WT>;
    constexpr int DS = TD == B_F32 ? 4 : 2;
    const long long rows = static_cast<long long>(n1) * n2 * n3;
    const int units = n0 / 8;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const u8* s = src + mm::row_offset(row, n1, n2, s1, s2, s3);
        u8* d = dst + row * n0 * DS;
        for (int u = threadIdx.x; u < units; u += CONVERT_BLOCK) {
            float c[8], scale, offset;
            od::quant::load_unit<F>(s, u, c, scale, offset);
            const int2 k = mm::unit_k<WT>(u);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float v = __fmul_rn(c[j], scale);
                if constexpr (F::M >= 0) {
                    v = __fadd_rn(v, offset);
                }
                mm::store_as<TD>(d + (j < 4 ? k.x + j : k.y + j - 4) * DS, v);
            }
        }
    }
}

// rms_norm(x) * w of `rows` rows of n0 f32 values (row r at x + r * s1 bytes; w n0 f32 values) -> contiguous TD
// rows. A block a row (grid-stride): the row's sum of squares, then its values again (from L1 or L2 for rows
// past a round of CONVERT_ILP * CONVERT_BLOCK values: those stay in registers), scaled as cuda_norm's rms_norm
// -> mul scales them: (x * rsqrt(mean(x^2) + eps)) * w.
template <int TD>
__global__ void __launch_bounds__(CONVERT_BLOCK) convert_norm(const u8* x, long long s1, int n0, int rows,
                                                              const float* w, float eps, u8* dst) {
    od::grid_enter();
    constexpr int DS = TD == B_F32 ? 4 : 2;
    constexpr int ROUND = CONVERT_ILP * CONVERT_BLOCK;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* s = reinterpret_cast<const float*>(x + row * s1);
        u8* d = dst + static_cast<long long>(row) * n0 * DS;
        float first[CONVERT_ILP];  // the first round's values, kept
        float ss = 0.0f;
        for (int i0 = threadIdx.x; i0 < n0; i0 += ROUND) {
            float v[CONVERT_ILP];
#pragma unroll
            for (int j = 0; j < CONVERT_ILP; ++j) {
                const int i = i0 + j * CONVERT_BLOCK;
                v[j] = i < n0 ? s[i] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < CONVERT_ILP; ++j) {
                ss += v[j] * v[j];
                if (i0 == static_cast<int>(threadIdx.x)) {
                    first[j] = v[j];
                }
            }
        }
        const float scale = rsqrtf(od::block_sum<CONVERT_BLOCK>(ss) / static_cast<float>(n0) + eps);
        for (int i0 = threadIdx.x; i0 < n0; i0 += ROUND) {
#pragma unroll
            for (int j = 0; j < CONVERT_ILP; ++j) {
                const int i = i0 + j * CONVERT_BLOCK;
                if (i < n0) {
                    const float v = i0 == static_cast<int>(threadIdx.x) ? first[j] : s[i];
                    mm::store_as<TD>(d + i * DS, v * scale * w[i]);
                }
            }
        }
    }
}

// act(g) * u of n values (g and u contiguous f32, alike) -> contiguous TD, GLU kind `kind` (activations.cuh's
// GLU_* codes, uniform over the launch) with swiglu_oai's alpha and limit. VEC: n and both pointers allow float4
// loads (the bind's choice: two instances a type).
template <int TD, bool VEC>
__global__ void __launch_bounds__(CONVERT_BLOCK) convert_glu(const float* g, const float* u, long long n, int kind,
                                                             float alpha, float limit, u8* dst) {
    od::grid_enter();
    constexpr int DS = TD == B_F32 ? 4 : 2;
    constexpr int N = VEC ? 4 : 1;
    const long long stride = static_cast<long long>(gridDim.x) * CONVERT_BLOCK * N;
    for (long long i = (static_cast<long long>(blockIdx.x) * CONVERT_BLOCK + threadIdx.x) * N; i < n; i += stride) {
        float gv[N], uv[N];
        if constexpr (VEC) {
            const float4 a = *reinterpret_cast<const float4*>(g + i), b = *reinterpret_cast<const float4*>(u + i);
            gv[0] = a.x, gv[1] = a.y, gv[2] = a.z, gv[3] = a.w;
            uv[0] = b.x, uv[1] = b.y, uv[2] = b.z, uv[3] = b.w;
        } else {
            gv[0] = g[i];
            uv[0] = u[i];
        }
        float r[N];
#pragma unroll
        for (int j = 0; j < N; ++j) {
            r[j] = od::glu(kind, gv[j], uv[j], alpha, limit);
        }
        if constexpr (VEC && TD != B_F32) {  // the four 16-bit values in one 8-byte store
            unsigned h[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                h[j] = TD == B_F16 ? od::f32_to_f16(r[j]) : od::f32_to_bf16(r[j]);
            }
            *reinterpret_cast<uint2*>(dst + i * DS) = make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
        } else {
#pragma unroll
            for (int j = 0; j < N; ++j) {
                mm::store_as<TD>(dst + (i + j) * DS, r[j]);
            }
        }
    }
}
