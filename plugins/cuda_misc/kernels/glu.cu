// Gated linear units: y = act(gate) * up, per kind (reglu, geglu, swiglu,
// geglu_erf, geglu_quick, swiglu_oai), for every form of the glu op: halves
// of one tensor (either order) or two tensors (glu_split). The caller passes
// the gate and up pointers and their strides, so the forms are one kernel.
//
// T is float, od::f16 or od::bf16 (gate, up and result alike); computed in
// float. The result is contiguous, rows of `nc`; gate and up are rows of nc
// packed elements, row r = (i0 * n1 + i1) * n2 + i2 at i0 * s0 + i1 * s1 +
// i2 * s2 elements (the division happens per row, and not at all when the
// caller folded the rows into the last axis: n0 = n1 = 1). Columns along x, rows along y.
// vec: nc, every row stride and pointer allow 16-byte vectors.
//
// Semantics are the reference's (core/reference/elementwise.py): reglu's relu
// sends NaN to 0; swiglu_oai clips with comparisons that keep NaN, as numpy's
// minimum and clip do.

#include "ew_common.cuh"

namespace ew_glu {

using ew::put;
using od::Pack;

using namespace od;  // GLU_* kinds and glu<KIND> (activations.cuh)

template <int KIND, int N, typename T>
__device__ __forceinline__ void glu_loop(const T* g, long long gs0, long long gs1, long long gs2, const T* u,
                                         long long us0, long long us1, long long us2, T* y, int n1, int n2,
                                         long long rows, int nc, float alpha, float limit) {
    using P = Pack<T, N>;
    const int ncv = nc / N;
    const bool folded = rows == n2;  // one axis of rows: no division
    for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < rows;
         r += (long long)gridDim.y * blockDim.y) {
        long long go, uo;
        if (folded) {
            go = r * gs2;
            uo = r * us2;
        } else {
            const int i2 = (int)r % n2;
            const int t = (int)r / n2;
            const int i1 = t % n1;
            const int i0 = t / n1;
            go = i0 * gs0 + i1 * gs1 + i2 * gs2;
            uo = i0 * us0 + i1 * us1 + i2 * us2;
        }
        const P* gr = reinterpret_cast<const P*>(g + go);
        const P* ur = reinterpret_cast<const P*>(u + uo);
        P* yr = reinterpret_cast<P*>(y + r * nc);
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < ncv; c += gridDim.x * blockDim.x) {
            const P gv = gr[c];
            const P uv = ur[c];
            P out;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                put(&out.v[k], glu<KIND>(od::load(&gv.v[k]), od::load(&uv.v[k]), alpha, limit));
            }
            yr[c] = out;
        }
    }
}

}  // namespace ew_glu

// y (rows x nc, contiguous) = act(gate) * up; rows = n0 * n1 * n2 (n0 implied).
template <typename T>
__global__ void glu_rows(const T* g, long long gs0, long long gs1, long long gs2, const T* u, long long us0,
                         long long us1, long long us2, T* y, int n1, int n2, long long rows, int nc, int kind,
                         float alpha, float limit, int vec) {
    od::grid_enter();
    using namespace ew_glu;
    constexpr int N = 16 / sizeof(T);
#define EW_CASE(K)                                                                                  \
    case K:                                                                                         \
        if (vec) {                                                                                  \
            glu_loop<K, N>(g, gs0, gs1, gs2, u, us0, us1, us2, y, n1, n2, rows, nc, alpha, limit);  \
        } else {                                                                                    \
            glu_loop<K, 1>(g, gs0, gs1, gs2, u, us0, us1, us2, y, n1, n2, rows, nc, alpha, limit);  \
        }                                                                                           \
        break;
    switch (kind) {
        EW_CASE(GLU_REGLU)
        EW_CASE(GLU_GEGLU)
        EW_CASE(GLU_SWIGLU)
        EW_CASE(GLU_GEGLU_ERF)
        EW_CASE(GLU_GEGLU_QUICK)
        EW_CASE(GLU_SWIGLU_OAI)
        default:
            break;
    }
#undef EW_CASE
}
