// Copies that prepare cuBLAS operands, written to a contiguous scratch buffer:
//   convert<TS, TD>   a float tensor of any strides -> contiguous TD (f32/f16/bf16),
//                     rounded as opdispatch.dtypes.from_float (to nearest even).
//   dequant<WT, TD>   rows of a block-format tensor (any row and batch strides) ->
//                     contiguous TD, decoded exactly as opdispatch.dtypes.dequantize
//                     (then rounded to TD).
// Both take 4-d geometry innermost first: n0 values a row, rows n1 x n2 x n3
// with byte strides s1, s2, s3 (convert also s0, the element stride). A block
// of CONVERT_BLOCK threads walks rows (grid-stride over n1 * n2 * n3 rows).

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
