// soft_max (ggml_soft_max_ext): out = softmax(a*scale + slope_h*mask) over each row,
// with an optional sink logit per head. One block per row.
//
// a f32 (A3, A2, R, C), rows contiguous, outer strides in elements; mask (f16 or
// f32, MT) (M3, M2, >= R, C), row r of a reads mask row r, outer indices by
// modulo; out contiguous f32. A row with no finite logit (and no sink) gives 0s;
// a NaN or +inf logit or sink makes its row NaN (docs/ops.md, "Edge values").
//
// NC > 0: each thread keeps up to NC loads of the row in registers (one read of
// the row); NC == 0: rows longer than BLOCK*8 loads are read twice (an online
// max/sum pass, then the write pass). VEC: float4 loads of a and out, 4-wide
// mask loads (rows 16-byte aligned for a, 16 / 8 bytes for an f32 / f16 mask).
#include "attn_common.cuh"

namespace {

using od_attn::alibi_slope;
using od::block_max;

template <typename MT>
struct MaskLoad;

template <>
struct MaskLoad<float> {
    static __device__ __forceinline__ float one(const float* p, long long i) { return p[i]; }
    static __device__ __forceinline__ float4 four(const float* p, long long i) {
        return *reinterpret_cast<const float4*>(p + i);
    }
};

template <>
struct MaskLoad<od::f16> {
    static __device__ __forceinline__ float one(const od::f16* p, long long i) { return od::load(p + i); }
    static __device__ __forceinline__ float4 four(const od::f16* p, long long i) {
        const uint2 u = *reinterpret_cast<const uint2*>(p + i);
        float4 r;
        od::unpack_f16x2(u.x, r.x, r.y);
        od::unpack_f16x2(u.y, r.z, r.w);
        return r;
    }
};

}  // namespace

template <int BLOCK, int NC, bool VEC, typename MT>
__global__ void __launch_bounds__(BLOCK) soft_max_f32(
    const float* __restrict__ a, const MT* __restrict__ mask, const float* __restrict__ sinks, float* __restrict__ out,
    int ncols, int nrows, int nheads, long long as1, long long as2, long long as3,
    int m2, int m3, long long ms1, long long ms2, long long ms3,
    float scale, int use_alibi, float m0, float m1, int n_head_log2) {
    od::grid_enter();
    const long long row = blockIdx.x;
    const int i1 = static_cast<int>(row % nrows);
    const int i2 = static_cast<int>((row / nrows) % nheads);
    const int i3 = static_cast<int>(row / (static_cast<long long>(nrows) * nheads));
    const float* x = a + i1 * as1 + i2 * as2 + i3 * as3;
    float* y = out + row * ncols;
    const MT* mrow = mask != nullptr ? mask + i1 * ms1 + (i2 % m2) * ms2 + (i3 % m3) * ms3 : nullptr;
    const float slope = mask != nullptr ? alibi_slope(use_alibi, i2, n_head_log2, m0, m1) : 0.0f;
    const float sink = sinks != nullptr ? sinks[i2] : -__int_as_float(0x7f800000);
    const int tid = threadIdx.x;
    const float NEG_INF = -__int_as_float(0x7f800000);

    if constexpr (NC > 0) {
        constexpr int W = VEC ? 4 : 1;
        const int units = ncols / W;
        float v[NC][W];
        float mx = NEG_INF;
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            const int u = tid + k * BLOCK;
            if (u < units) {
                if constexpr (VEC) {
                    const float4 xa = reinterpret_cast<const float4*>(x)[u];
                    v[k][0] = xa.x * scale; v[k][1] = xa.y * scale; v[k][2] = xa.z * scale; v[k][3] = xa.w * scale;
                    if (mrow != nullptr) {
                        const float4 mv = MaskLoad<MT>::four(mrow, 4LL * u);
                        v[k][0] += slope * mv.x; v[k][1] += slope * mv.y;
                        v[k][2] += slope * mv.z; v[k][3] += slope * mv.w;
                    }
                } else {
                    v[k][0] = x[u] * scale;
                    if (mrow != nullptr) {
                        v[k][0] += slope * MaskLoad<MT>::one(mrow, u);
                    }
                }
#pragma unroll
                for (int w = 0; w < W; ++w) {
                    mx = fmaxf(mx, v[k][w]);
                }
            }
        }
        mx = fmaxf(block_max<BLOCK>(mx), sink);
        if (mx == NEG_INF) {
            mx = 0.0f;  // every logit is -inf: exp gives 0s, the sum 0, the row 0s
        }
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            if (tid + k * BLOCK < units) {
#pragma unroll
                for (int w = 0; w < W; ++w) {
                    v[k][w] = expf(v[k][w] - mx);
                    sum += v[k][w];
                }
            }
        }
        sum = od::block_sum<BLOCK>(sum);
        if (sinks != nullptr) {
            sum += expf(sink - mx);
        }
        const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;  // a NaN sum: the row NaN
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            const int u = tid + k * BLOCK;
            if (u < units) {
                if constexpr (VEC) {
                    reinterpret_cast<float4*>(y)[u] =
                        make_float4(v[k][0] * inv, v[k][1] * inv, v[k][2] * inv, v[k][3] * inv);
                } else {
                    y[u] = v[k][0] * inv;
                }
            }
        }
    } else {
        // Long rows: an online (max, sum) pass, then a pass that writes.
        float mx = NEG_INF;
        float sum = 0.0f;
        auto logit = [&](int c) -> float {
            float w = x[c] * scale;
            if (mrow != nullptr) {
                w += slope * MaskLoad<MT>::one(mrow, c);
            }
            return w;
        };
        auto add = [&](float w) {
            if (w > mx) {
                sum = sum * expf(mx - w) + 1.0f;
                mx = w;
            } else if (w != NEG_INF) {
                sum += expf(w - mx);
            }
        };
        if constexpr (VEC) {
            for (int u = tid; u < ncols / 4; u += BLOCK) {
                const float4 xa = reinterpret_cast<const float4*>(x)[u];
                float w[4] = {xa.x * scale, xa.y * scale, xa.z * scale, xa.w * scale};
                if (mrow != nullptr) {
                    const float4 mv = MaskLoad<MT>::four(mrow, 4LL * u);
                    w[0] += slope * mv.x; w[1] += slope * mv.y; w[2] += slope * mv.z; w[3] += slope * mv.w;
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    add(w[i]);
                }
            }
        } else {
            for (int c = tid; c < ncols; c += BLOCK) {
                add(logit(c));
            }
        }
        float gmx = fmaxf(block_max<BLOCK>(mx), sink);
        if (gmx == NEG_INF) {
            gmx = 0.0f;
        }
        // a thread that saw no finite logit holds 0, or NaN if it met one: keep it as it is
        sum = od::block_sum<BLOCK>(mx == NEG_INF ? sum : sum * expf(mx - gmx));
        if (sinks != nullptr) {
            sum += expf(sink - gmx);
        }
        const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;  // a NaN sum: the row NaN
        if constexpr (VEC) {
            for (int u = tid; u < ncols / 4; u += BLOCK) {
                const float4 xa = reinterpret_cast<const float4*>(x)[u];
                float w[4] = {xa.x * scale, xa.y * scale, xa.z * scale, xa.w * scale};
                if (mrow != nullptr) {
                    const float4 mv = MaskLoad<MT>::four(mrow, 4LL * u);
                    w[0] += slope * mv.x; w[1] += slope * mv.y; w[2] += slope * mv.z; w[3] += slope * mv.w;
                }
                reinterpret_cast<float4*>(y)[u] = make_float4(expf(w[0] - gmx) * inv, expf(w[1] - gmx) * inv,
                                                              expf(w[2] - gmx) * inv, expf(w[3] - gmx) * inv);
            }
        } else {
            for (int c = tid; c < ncols; c += BLOCK) {
                y[c] = expf(logit(c) - gmx) * inv;
            }
        }
    }
}
