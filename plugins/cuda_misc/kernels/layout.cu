// The layout ops of the cuda_misc plugin: concat, repeat, pad, pad_reflect_1d, roll,
// arange, fill, diag, tri, set, acc (set_window) and timestep_embedding.
//
// Conventions as rows.cu's: byte pointers and byte strides, 4-d shapes innermost first,
// flat indices unravelled with index.cuh's divisions.
#include "rows_common.cuh"

using namespace od;
using namespace od::rows;

// -- layout ops -----------------------------------------------------------------------------
// Each writes a contiguous result, one element (or raw unit) per thread,
// unravelled with the result's layout `o` (its strides unused).

__device__ __forceinline__ unsigned axis_of(const Idx4 x, const int axis) {
    return axis == 0 ? x.i0 : axis == 1 ? x.i1 : axis == 2 ? x.i2 : x.i3;
}

// np.concatenate((a, b), axis): `axis` innermost first; a has alen along it.
template <class U>
__global__ void concat(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
                       U* __restrict__ out, const unsigned n, OD_LAYOUT_PARAMS(o), const int axis, const unsigned alen,
                       const long long as0, const long long as1, const long long as2, const long long as3,
                       const long long bs0, const long long bs1, const long long bs2, const long long bs3) {
    od::grid_enter();
    const Layout lo = OD_LAYOUT(o);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        Idx4 x = lo.unravel(i);
        const unsigned c = axis_of(x, axis);
        const bool from_a = c < alen;
        if (!from_a) {
            x.i0 -= axis == 0 ? alen : 0;
            x.i1 -= axis == 1 ? alen : 0;
            x.i2 -= axis == 2 ? alen : 0;
            x.i3 -= axis == 3 ? alen : 0;
        }
        const unsigned char* p = from_a ? a + (x.i0 * as0 + x.i1 * as1 + x.i2 * as2 + x.i3 * as3)
                                        : b + (x.i0 * bs0 + x.i1 * bs1 + x.i2 * bs2 + x.i3 * bs3);
        out[i] = *reinterpret_cast<const U*>(p);
    }
}

// np.tile: out element (i0..i3) = a[i0 % a0, ..., i3 % a3].
template <class U>
__global__ void repeat(const unsigned char* __restrict__ a, U* __restrict__ out, const unsigned n,
                       OD_LAYOUT_PARAMS(o), const unsigned a0, const unsigned a1, const unsigned a2, const unsigned a3,
                       const long long as0, const long long as1, const long long as2, const long long as3) {
    od::grid_enter();
    const Layout lo = OD_LAYOUT(o);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const Idx4 x = lo.unravel(i);
        const long long off = (x.i0 % a0) * as0 + (x.i1 % a1) * as1 + (x.i2 % a2) * as2 + (x.i3 % a3) * as3;
        out[i] = *reinterpret_cast<const U*>(a + off);
    }
}

// np.pad with zeros: out (i0..i3) = x[i - lo] inside x, else 0 (f32).
__global__ void pad(const unsigned char* __restrict__ x, float* __restrict__ out, const unsigned n,
                    OD_LAYOUT_PARAMS(o), const unsigned x0, const unsigned x1, const unsigned x2, const unsigned x3,
                    const unsigned lo0, const unsigned lo1, const unsigned lo2, const unsigned lo3,
                    const long long xs0, const long long xs1, const long long xs2, const long long xs3) {
    od::grid_enter();
    const Layout lo = OD_LAYOUT(o);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const Idx4 p = lo.unravel(i);
        // unsigned wrap-around makes "before the start" a large value: one compare per axis
        const unsigned j0 = p.i0 - lo0, j1 = p.i1 - lo1, j2 = p.i2 - lo2, j3 = p.i3 - lo3;
        const bool inside = j0 < x0 && j1 < x1 && j2 < x2 && j3 < x3;
        out[i] = inside ? *reinterpret_cast<const float*>(x + (j0 * xs0 + j1 * xs1 + j2 * xs2 + j3 * xs3)) : 0.0f;
    }
}

// np.pad(mode="reflect") on the last axis: p0 before, edge not repeated (f32).
__global__ void pad_reflect_1d(const unsigned char* __restrict__ x, float* __restrict__ out, const unsigned n,
                               OD_LAYOUT_PARAMS(o), const int x0, const int p0, const long long xs0,
                               const long long xs1, const long long xs2, const long long xs3) {
    od::grid_enter();
    const Layout lo = OD_LAYOUT(o);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const Idx4 p = lo.unravel(i);
        int j = static_cast<int>(p.i0) - p0;
        j = j < 0 ? -j : j;
        j = j >= x0 ? 2 * (x0 - 1) - j : j;
        out[i] = *reinterpret_cast<const float*>(x + (j * xs0 + p.i1 * xs1 + p.i2 * xs2 + p.i3 * xs3));
    }
}

// np.roll on every axis; shifts normalized to [0, n) per axis (f32; x has out's shape).
__global__ void roll(const unsigned char* __restrict__ x, float* __restrict__ out, const unsigned n,
                     OD_LAYOUT_PARAMS(o), const unsigned sh0, const unsigned sh1, const unsigned sh2,
                     const unsigned sh3, const long long xs0, const long long xs1, const long long xs2,
                     const long long xs3) {
    od::grid_enter();
    const Layout lo = OD_LAYOUT(o);
    const unsigned n0 = lo.n0.d, n1 = lo.n1.d, n2 = lo.n2.d;
    const unsigned n3 = n / (n0 * n1 * n2);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const Idx4 p = lo.unravel(i);
        const unsigned j0 = p.i0 >= sh0 ? p.i0 - sh0 : p.i0 + n0 - sh0;
        const unsigned j1 = p.i1 >= sh1 ? p.i1 - sh1 : p.i1 + n1 - sh1;
        const unsigned j2 = p.i2 >= sh2 ? p.i2 - sh2 : p.i2 + n2 - sh2;
        const unsigned j3 = p.i3 >= sh3 ? p.i3 - sh3 : p.i3 + n3 - sh3;
        out[i] = *reinterpret_cast<const float*>(x + (j0 * xs0 + j1 * xs1 + j2 * xs2 + j3 * xs3));
    }
}

// start + step * i in f32, two roundings as ggml (no FMA).
__global__ void arange(float* __restrict__ out, const unsigned n, const float start, const float step) {
    od::grid_enter();
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        out[i] = __fadd_rn(start, __fmul_rn(step, static_cast<float>(i)));
    }
}

template <class D>
__global__ void fill(D* __restrict__ out, const long long n, const float value) {
    od::grid_enter();
    const D v = from_f32<D>(value);
    for (long long i = thread_id(); i < n; i += thread_count()) {
        out[i] = v;
    }
}

// out (.., N, N): x[.., 0, i0] on the diagonal, 0 elsewhere (f32).
__global__ void diag(const unsigned char* __restrict__ x, float* __restrict__ out, const unsigned n,
                     OD_LAYOUT_PARAMS(o), const long long xs0, const long long xs2, const long long xs3) {
    od::grid_enter();
    const Layout lo = OD_LAYOUT(o);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const Idx4 p = lo.unravel(i);
        out[i] = p.i0 == p.i1 ? *reinterpret_cast<const float*>(x + (p.i0 * xs0 + p.i2 * xs2 + p.i3 * xs3)) : 0.0f;
    }
}

// Keep a triangle (f32): kind 0 lower (col < row), 1 lower_diag, 2 upper (col > row), 3 upper_diag.
__global__ void tri(const unsigned char* __restrict__ x, float* __restrict__ out, const unsigned n,
                    OD_LAYOUT_PARAMS(o), const int kind, const long long xs0, const long long xs1,
                    const long long xs2, const long long xs3) {
    od::grid_enter();
    const Layout lo = OD_LAYOUT(o);
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const Idx4 p = lo.unravel(i);
        const bool keep = kind == 0 ? p.i0 < p.i1 : kind == 1 ? p.i0 <= p.i1 : kind == 2 ? p.i0 > p.i1 : p.i0 >= p.i1;
        out[i] = keep ? *reinterpret_cast<const float*>(x + (p.i0 * xs0 + p.i1 * xs1 + p.i2 * xs2 + p.i3 * xs3))
                      : 0.0f;
    }
}

// set / acc: out (contiguous, a's shape) = a, with the window overwritten by b
// (set) or by a + b (acc). The window starts at element `woff` of out and has
// axes sorted by element stride, largest first (ws0 >= ws1 >= ...), each at
// least the span of the ones after it, so the division below finds the only
// window position of an element. Padding axes have wn = 1 and a huge stride.
template <class T, bool ACC>
__global__ void set_window(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
                           T* __restrict__ out, const unsigned n, OD_LAYOUT_PARAMS(a), const long long woff,
                           const long long ws0, const long long ws1, const long long ws2, const long long ws3,
                           const unsigned wn0, const unsigned wn1, const unsigned wn2, const unsigned wn3,
                           const long long bs0, const long long bs1, const long long bs2, const long long bs3) {
    od::grid_enter();
    const Layout la = OD_LAYOUT(a);
    const long long ws[4] = {ws0, ws1, ws2, ws3};
    const unsigned wn[4] = {wn0, wn1, wn2, wn3};
    const long long bs[4] = {bs0, bs1, bs2, bs3};
    for (unsigned i = thread_id(); i < n; i += thread_count()) {
        const T av = *reinterpret_cast<const T*>(a + la.offset(i));
        long long rel = static_cast<long long>(i) - woff;
        long long boff = 0;
        bool inside = rel >= 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const long long c = inside ? rel / ws[k] : 0;
            inside = inside && c < wn[k];
            rel -= c * ws[k];
            boff += c * bs[k];
        }
        inside = inside && rel == 0;
        T v = av;
        if (inside) {
            const T bv = *reinterpret_cast<const T*>(b + boff);
            if constexpr (ACC) {
                v = av + bv;
            } else {
                v = bv;
            }
        }
        out[i] = v;
    }
}

// out (N, dim) f32: cos(t * f_j) for j < half, sin(t * f_{j-half}) for half <= j < 2 half,
// 0 for an odd dim's last column; f_j = exp(-ln(max_period) * j / half). In double, like the reference.
__global__ void timestep_embedding(const unsigned char* __restrict__ t, float* __restrict__ out, const int rows,
                                   const int dim, const long long ts0, const double log_max_period) {
    od::grid_enter();
    const int half = dim / 2;
    const long long n = static_cast<long long>(rows) * dim;
    for (long long i = thread_id(); i < n; i += thread_count()) {
        const int row = static_cast<int>(i / dim), j = static_cast<int>(i % dim);
        float v = 0.0f;
        if (j < 2 * half) {
            const int f = j < half ? j : j - half;
            const double freq = exp(-log_max_period * f / half);
            const double arg = static_cast<double>(*reinterpret_cast<const float*>(t + row * ts0)) * freq;
            v = static_cast<float>(j < half ? cos(arg) : sin(arg));
        }
        out[i] = v;
    }
}
