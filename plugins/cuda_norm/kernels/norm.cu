// Norm kernels, f32: norm, rms_norm, l2_norm over rows (with rms_norm/norm
// -> mul (-> add) fused), and group_norm over channel groups.
//
// One block per row (or per group). Statistics are float sums reduced with
// warp shuffles; norm sums x - x[0] and its square (the shifted-data
// algorithm), so the variance keeps its precision when the mean is large.
// VEC variants move float4 and keep rows of up to 8 float4s a thread in
// registers (x read once); the caller picks them when every row start is
// 16-byte aligned and every row length a multiple of 4.
//
// Aliasing: the output may be the input (or the residual) itself, laid out
// alike. Each element is read and then written by the same thread, and x[0]
// is read by every thread before the block reduction that precedes all writes.

#include "common.cuh"

// MODE: what a row is normalized by.
constexpr int NORM_MEAN_VAR = 0;  // (x - mean) / sqrt(var + eps)
constexpr int NORM_RMS = 1;       // x / sqrt(mean(x^2) + eps)
constexpr int NORM_L2 = 2;        // x / max(||x||, eps)

// FUSE: what follows the norm in the same kernel.
constexpr int FUSE_NONE = 0;
constexpr int FUSE_MUL = 1;      // * weight
constexpr int FUSE_MUL_ADD = 2;  // * weight + residual

// y = (x - shift) * scale
struct Affine {
    float shift;
    float scale;
};

template <int MODE>
__device__ __forceinline__ Affine norm_affine(float2 sums, int n, float k, float eps) {
    if constexpr (MODE == NORM_MEAN_VAR) {
        const float m = sums.x / n;  // mean of x - k
        float var = sums.y / n - m * m;
        var = var < 0.0f ? 0.0f : var;  // not fmaxf: an inf in the row (inf - inf) keeps the row NaN
        return {k + m, rsqrtf(var + eps)};
    } else if constexpr (MODE == NORM_RMS) {
        return {0.0f, rsqrtf(sums.y / n + eps)};
    } else {
        // ggml's 1 / max(sqrt(sum), eps): eps * eps would underflow to 0 for eps < 1e-19 (a zero row NaN)
        return {0.0f, 1.0f / fmaxf(sqrtf(sums.y), eps)};
    }
}

__device__ __forceinline__ void accumulate(float2& acc, float v, float k) {
    const float d = v - k;
    acc.x += d;
    acc.y += d * d;
}

__device__ __forceinline__ void accumulate(float2& acc, float4 v, float k) {
    const float d0 = v.x - k, d1 = v.y - k, d2 = v.z - k, d3 = v.w - k;
    acc.x += (d0 + d1) + (d2 + d3);
    acc.y += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3);
}

// Four outputs: (v - a.shift) * a.scale [* w4[i]] [+ r4[i]].
template <int FUSE>
__device__ __forceinline__ float4 finish4(float4 v, Affine a, const float4* w4, const float4* r4, int i) {
    v.x = (v.x - a.shift) * a.scale;
    v.y = (v.y - a.shift) * a.scale;
    v.z = (v.z - a.shift) * a.scale;
    v.w = (v.w - a.shift) * a.scale;
    if constexpr (FUSE >= FUSE_MUL) {
        const float4 g = w4[i];
        v.x *= g.x;
        v.y *= g.y;
        v.z *= g.z;
        v.w *= g.w;
    }
    if constexpr (FUSE == FUSE_MUL_ADD) {
        const float4 b = r4[i];
        v.x += b.x;
        v.y += b.y;
        v.z += b.z;
        v.w += b.w;
    }
    return v;
}

// float4 loads a thread keeps in registers between the statistics and the output
// (the PER of the large-tensor instances).
constexpr int CACHE = 8;

// Four outputs from prefetched operands: (v - a.shift) * a.scale [* g] [+ b].
template <int FUSE>
__device__ __forceinline__ float4 finish4v(float4 v, Affine a, float4 g, float4 b) {
    v.x = (v.x - a.shift) * a.scale;
    v.y = (v.y - a.shift) * a.scale;
    v.z = (v.z - a.shift) * a.scale;
    v.w = (v.w - a.shift) * a.scale;
    if constexpr (FUSE >= FUSE_MUL) {
        v.x *= g.x;
        v.y *= g.y;
        v.z *= g.z;
        v.w *= g.w;
    }
    if constexpr (FUSE == FUSE_MUL_ADD) {
        v.x += b.x;
        v.y += b.y;
        v.z += b.z;
        v.w += b.w;
    }
    return v;
}

// y[0, n) = the MODE norm of x[0, n), then * w [+ r] (FUSE), all of length n,
// with float4 moves: n % 4 == 0 and 16-byte aligned pointers. A span of at most
// PER * BLOCK float4s stays in registers, so x is read from memory once;
// a longer one is read twice (the second time mostly from L2).
// PER <= 2 is the latency-bound configuration (few rows, each thread one or two
// float4s): the weight and residual float4s are loaded together with x, before
// the reduction, so the row costs one memory round trip instead of two.
template <int MODE, int BLOCK, int FUSE, int PER = CACHE>
__device__ __forceinline__ void norm_span_vec(const float* x, float* y, int n, float k, float eps,
                                              const float* w, const float* r) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const float4* r4 = reinterpret_cast<const float4*>(r);
    float4* y4 = reinterpret_cast<float4*>(y);
    const int units = n / 4;
    float2 acc{0.0f, 0.0f};
    if (units <= PER * BLOCK) {
        constexpr bool PREFETCH = PER <= 2;
        float4 v[PER];
        float4 g[PREFETCH && FUSE >= FUSE_MUL ? PER : 1];
        float4 b[PREFETCH && FUSE == FUSE_MUL_ADD ? PER : 1];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = threadIdx.x + j * BLOCK;
            if (i < units) {
                v[j] = x4[i];
                if constexpr (PREFETCH && FUSE >= FUSE_MUL) {
                    g[j] = w4[i];
                }
                if constexpr (PREFETCH && FUSE == FUSE_MUL_ADD) {
                    b[j] = r4[i];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            if (threadIdx.x + j * BLOCK < units) {
                accumulate(acc, v[j], k);
            }
        }
        const Affine a = norm_affine<MODE>(od::block_sum<BLOCK>(acc), n, k, eps);
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = threadIdx.x + j * BLOCK;
            if (i < units) {
                if constexpr (PREFETCH) {
                    y4[i] = finish4v<FUSE>(v[j], a, g[FUSE >= FUSE_MUL ? j : 0], b[FUSE == FUSE_MUL_ADD ? j : 0]);
                } else {
                    y4[i] = finish4<FUSE>(v[j], a, w4, r4, i);
                }
            }
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < units; i += BLOCK) {
            accumulate(acc, x4[i], k);
        }
        const Affine a = norm_affine<MODE>(od::block_sum<BLOCK>(acc), n, k, eps);
#pragma unroll 4
        for (int i = threadIdx.x; i < units; i += BLOCK) {
            y4[i] = finish4<FUSE>(x4[i], a, w4, r4, i);
        }
    }
}

// As norm_span_vec for any n and alignment, one float at a time, reading x
// twice; w and r repeat with periods wn and rn (ggml's broadcast by modulo).
template <int MODE, int BLOCK, int FUSE>
__device__ __forceinline__ void norm_span(const float* x, float* y, int n, float k, float eps,
                                          const float* w, int wn, const float* r, int rn) {
    float2 acc{0.0f, 0.0f};
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += BLOCK) {
        accumulate(acc, x[i], k);
    }
    const Affine a = norm_affine<MODE>(od::block_sum<BLOCK>(acc), n, k, eps);
    for (int i = threadIdx.x; i < n; i += BLOCK) {
        float v = (x[i] - a.shift) * a.scale;
        if constexpr (FUSE >= FUSE_MUL) {
            v *= w[wn == n ? i : i % wn];
        }
        if constexpr (FUSE == FUSE_MUL_ADD) {
            v += r[rn == n ? i : i % rn];
        }
        y[i] = v;
    }
}

// Row norms. x is (n0, n1, n2, ncols) with element strides (xs0, xs1, xs2, 1);
// block b takes row (i0, i1, i2) with b = (i0 * n1 + i1) * n2 + i2 and writes
// dst's row b (dst is contiguous). The weight w (FUSE >= FUSE_MUL) and the
// residual r (FUSE_MUL_ADD) have shapes (w0, w1, w2, wcols) / (r0, r1, r2, rcols)
// dividing x's, broadcast by modulo in every axis (ggml's repeat), with element
// strides ws*/rs* and contiguous rows; unused ones are passed as null, 1s and 0s.
//
// PER: float4s a thread keeps in registers (VEC only). The host picks PER = 2
// with BLOCK >= n / 8 for few rows (latency-bound: one block per row, every
// thread one or two loads of x, w and r issued together), and the default
// otherwise (throughput-bound large tensors).
template <int MODE, int BLOCK, bool VEC, int FUSE, int PER = CACHE>
__global__ void __launch_bounds__(BLOCK) norm_rows_f32(
        const float* x, float* dst, int ncols, float eps,
        int n1, int n2, long long xs0, long long xs1, long long xs2,
        const float* w, int w0, int w1, int w2, int wcols, long long ws0, long long ws1, long long ws2,
        const float* r, int r0, int r1, int r2, int rcols, long long rs0, long long rs1, long long rs2) {
    od::grid_enter();
    static_assert(MODE != NORM_L2 || FUSE == FUSE_NONE, "l2_norm has no fused variants");
    const int row = blockIdx.x;  // grids stay below 2**31 blocks
    const int i2 = row % n2;
    const int i1 = row / n2 % n1;
    const int i0 = row / n2 / n1;

    const float* xr = x + i0 * xs0 + i1 * xs1 + i2 * xs2;
    float* yr = dst + static_cast<long long>(row) * ncols;
    const float* wr = nullptr;
    const float* rr = nullptr;
    if constexpr (FUSE >= FUSE_MUL) {
        wr = w + (i0 % w0) * ws0 + (i1 % w1) * ws1 + (i2 % w2) * ws2;
    }
    if constexpr (FUSE == FUSE_MUL_ADD) {
        rr = r + (i0 % r0) * rs0 + (i1 % r1) * rs1 + (i2 % r2) * rs2;
    }

    const float k = MODE == NORM_MEAN_VAR ? xr[0] : 0.0f;
    if constexpr (VEC) {
        norm_span_vec<MODE, BLOCK, FUSE, PER>(xr, yr, ncols, k, eps, wr, rr);
    } else {
        norm_span<MODE, BLOCK, FUSE>(xr, yr, ncols, k, eps, wr, wcols, rr, rcols);
    }
}

// Group norm. x is (N, C, H*W) with (C, H*W) contiguous and sample stride
// xs_n (elements); dst is contiguous. Block b takes sample b / groups and
// channels [c0, c0 + per_group) of it, c0 = (b % groups) * per_group, clipped
// to C: per_group = ceil(C / groups) as in ggml, so trailing groups may be
// short or empty.
template <int BLOCK, bool VEC>
__global__ void __launch_bounds__(BLOCK) group_norm_f32(
        const float* x, float* dst, int channels, int hw, int per_group, int groups, long long xs_n, float eps) {
    const int b = blockIdx.x;
    const int n = b / groups;
    const int c0 = (b % groups) * per_group;
    if (c0 >= channels) {
        return;  // an empty trailing group (the whole block leaves)
    }
    const int len = (channels - c0 < per_group ? channels - c0 : per_group) * hw;
    const float* xg = x + n * xs_n + static_cast<long long>(c0) * hw;
    float* yg = dst + (static_cast<long long>(n) * channels + c0) * hw;

    const float k = xg[0];
    if constexpr (VEC) {
        norm_span_vec<NORM_MEAN_VAR, BLOCK, FUSE_NONE>(xg, yg, len, k, eps, nullptr, nullptr);
    } else {
        norm_span<NORM_MEAN_VAR, BLOCK, FUSE_NONE>(xg, yg, len, k, eps, nullptr, 1, nullptr, 1);
    }
}
