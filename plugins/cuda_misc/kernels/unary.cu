// Elementwise maps of one source: sqr, sqrt, log, sin, cos, scale, clamp,
// leaky_relu, every unary op (abs .. trunc), and the fused softcap
// (scale -> tanh -> scale).
//
// T is float, od::f16 or od::bf16; the source and the result have the same
// type, values are computed in float. The result is contiguous.
//
//   unary_flat<T>     the source contiguous too: 16-byte vectors, grid-stride
//                     loop, two vectors in flight per thread; `nvec` vectors
//                     (0 when a pointer is not 16-byte aligned), then the
//                     tail [nvec * VEC, n) one element at a time.
//   unary_strided<T>  any source strides (elements, 4 dims): a 2-D block,
//                     threads along the last axis, rows (the outer three
//                     axes, split per row) across blockDim.y and the grid.
//
// The op is a run-time code (OP_* below, the table UNARY_CODES of
// specs/unary.py): one switch per group of vectors, uniform across the grid,
// keeps each instance small (NVRTC: 0.2-0.9 s) at no cost to bandwidth; the
// long-code ops (erf, sin, ...) are one out-of-line call per element. On the
// H200 (64 Mi elements, copy 4.2 TB/s): relu, scale, softcap 92-94% of copy
// bandwidth in f32 and 92% (f16) / 88-92% (bf16); silu, gelu 94% f32 and
// 81-85% f16/bf16; sin 90% f32; gelu_erf 69% f32, 34% f16/bf16.
//
// Semantics are the numpy reference's (core/reference/elementwise.py):
// comparisons are written so that NaN goes where the reference sends it
// (relu/step/sgn/leaky_relu: 0, clamp: the bounds' order, hardsigmoid and
// the rest: NaN propagates); round is roundf (halves away from zero);
// softplus passes x through above 20; gelu uses ggml's tanh constants. The
// formulas avoid cancellation and overflow (sigmoid, gelu, gelu_erf: activations.cuh), so
// results keep their relative precision where they are tiny.
//
// Aliasing: the result may be the source itself (same layout): every element
// is read and then written by one thread.

#include "ew_common.cuh"

namespace ew_unary {

using ew::put;
using ew::round_to;
using ew::Vec;
using od::GELU_QUICK_COEF;
using od::gelu;
using od::gelu_erf;
using od::sigmoid;
using od::Pack;

// Op codes: must match UNARY_CODES in plugins/cuda_misc/specs/unary.py.
constexpr int OP_ABS = 0;
constexpr int OP_SGN = 1;
constexpr int OP_NEG = 2;
constexpr int OP_STEP = 3;
constexpr int OP_TANH = 4;
constexpr int OP_ELU = 5;
constexpr int OP_RELU = 6;
constexpr int OP_SIGMOID = 7;
constexpr int OP_GELU = 8;
constexpr int OP_GELU_ERF = 9;
constexpr int OP_GELU_QUICK = 10;
constexpr int OP_SILU = 11;
constexpr int OP_HARDSWISH = 12;
constexpr int OP_HARDSIGMOID = 13;
constexpr int OP_EXP = 14;
constexpr int OP_EXPM1 = 15;
constexpr int OP_SOFTPLUS = 16;
constexpr int OP_FLOOR = 17;
constexpr int OP_CEIL = 18;
constexpr int OP_ROUND = 19;
constexpr int OP_TRUNC = 20;
constexpr int OP_SQR = 21;
constexpr int OP_SQRT = 22;
constexpr int OP_LOG = 23;
constexpr int OP_SIN = 24;
constexpr int OP_COS = 25;
constexpr int OP_SCALE = 26;       // x * p0 + p1
constexpr int OP_CLAMP = 27;       // p0 = min, p1 = max
constexpr int OP_LEAKY_RELU = 28;  // p0 = negative slope
constexpr int OP_SOFTCAP = 29;     // p1 * tanh(p0 * x), rounded to T between steps as the unfused ops do

// -- the maps ---------------------------------------------------------------------------

// Subnormal inputs. CuPy compiles every module with -ftz=true, so arithmetic and comparisons
// read a subnormal as a zero of its sign. Where that would change a result by more than a
// subnormal (sgn, step, floor, ceil, sqrt, log), these read the bits instead, as the reference
// and ggml's CPU (which does not flush) compute them (docs/ops.md, "Edge values").
__device__ __forceinline__ unsigned magnitude_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }
__device__ __forceinline__ bool sign_bit(float x) { return (__float_as_uint(x) >> 31) != 0u; }
__device__ __forceinline__ bool is_subnormal(float x) {
    const unsigned a = magnitude_bits(x);
    return a != 0u && a < 0x00800000u;
}
// 1 for x > 0, -1 for x < 0, 0 for a zero or NaN
__device__ __forceinline__ float sgn(float x) {
    const unsigned a = magnitude_bits(x);
    return a == 0u || a > 0x7f800000u ? 0.0f : (sign_bit(x) ? -1.0f : 1.0f);
}
__device__ __forceinline__ float step(float x) {
    const unsigned a = magnitude_bits(x);
    return !sign_bit(x) && a != 0u && a <= 0x7f800000u ? 1.0f : 0.0f;
}
__device__ __forceinline__ float floor_exact(float x) {
    return is_subnormal(x) ? (sign_bit(x) ? -1.0f : 0.0f) : floorf(x);
}
__device__ __forceinline__ float ceil_exact(float x) {
    return is_subnormal(x) ? (sign_bit(x) ? -0.0f : 1.0f) : ceilf(x);
}
// x = m * 2^-149 with m < 2^23 an exact float: sqrt(x) = sqrt(2m) * 2^-75 (one rounding, a normal
// result), log(x) = log(m) - 149 ln 2; a negative subnormal gives NaN, as any negative value.
__device__ __forceinline__ float sqrt_exact(float x) {
    if (!is_subnormal(x)) {
        return sqrtf(x);
    }
    return sign_bit(x) ? __int_as_float(0x7fc00000) : sqrtf(2.0f * static_cast<float>(magnitude_bits(x))) * 0x1p-75f;
}
__device__ __forceinline__ float log_exact(float x) {
    if (!is_subnormal(x)) {
        return logf(x);
    }
    return sign_bit(x) ? __int_as_float(0x7fc00000) : logf(static_cast<float>(magnitude_bits(x))) - 103.27892990343184f;
}

// Ops whose code is large (argument reduction, long polynomials) run through
// one out-of-line function per T, called once per element: inlining them for
// every element of a vector would multiply the module's size (and NVRTC's
// compile time) for ops that are rare in models and compute-heavy anyway.
template <typename T>
__device__ __noinline__ float map_large(int op, float x, float p0, float p1) {
    switch (op) {
        case OP_ELU: return x > 0.0f ? x : expm1f(x);
        case OP_GELU_ERF: return gelu_erf(x);
        case OP_EXPM1: return expm1f(x);
        case OP_SOFTPLUS: return x > 20.0f ? x : log1pf(expf(x));
        case OP_LOG: return log_exact(x);
        case OP_SIN: return sinf(x);
        case OP_COS: return cosf(x);
        default: return x;
    }
}

__device__ __forceinline__ float hardsigmoid(float x) {
    // min(1, max(0, (x + 3) / 6)) with NaN propagating as numpy's minimum/maximum do
    float h = (x + 3.0f) / 6.0f;
    h = h < 0.0f ? 0.0f : h;
    return h > 1.0f ? 1.0f : h;
}

__device__ __forceinline__ float clamp(float x, float lo, float hi) {
    // ggml: MAX(MIN(x, max), min) with C's ternaries: NaN -> max, then min wins when min > max
    x = x < hi ? x : hi;
    return x > lo ? x : lo;
}

// One op over N values in place; the switch is outside the element loop.
template <typename T, int N>
__device__ __forceinline__ void apply(int op, float (&v)[N], float p0, float p1) {
    switch (op) {
#define EW_MAP(code, expr)                                  \
    case code:                                              \
        _Pragma("unroll") for (int k = 0; k < N; ++k) {     \
            const float x = v[k];                           \
            v[k] = (expr);                                  \
        }                                                   \
        break;
        EW_MAP(OP_ABS, fabsf(x))
        EW_MAP(OP_SGN, sgn(x))
        EW_MAP(OP_NEG, -x)
        EW_MAP(OP_STEP, step(x))
        EW_MAP(OP_TANH, tanhf(x))
        EW_MAP(OP_RELU, x > 0.0f ? x : 0.0f)
        EW_MAP(OP_SIGMOID, sigmoid(x))
        EW_MAP(OP_GELU, gelu(x))
        EW_MAP(OP_GELU_QUICK, x * sigmoid(GELU_QUICK_COEF * x))
        EW_MAP(OP_SILU, x * sigmoid(x))
        EW_MAP(OP_HARDSWISH, x * hardsigmoid(x))
        EW_MAP(OP_HARDSIGMOID, hardsigmoid(x))
        EW_MAP(OP_EXP, expf(x))
        EW_MAP(OP_FLOOR, floor_exact(x))
        EW_MAP(OP_CEIL, ceil_exact(x))
        EW_MAP(OP_ROUND, roundf(x))
        EW_MAP(OP_TRUNC, truncf(x))
        EW_MAP(OP_SQR, x * x)
        EW_MAP(OP_SQRT, sqrt_exact(x))
        EW_MAP(OP_SCALE, fmaf(x, p0, p1))
        EW_MAP(OP_CLAMP, clamp(x, p0, p1))
        EW_MAP(OP_LEAKY_RELU, (x > 0.0f ? x : 0.0f) + p0 * (x < 0.0f ? x : 0.0f))
        // the unfused scale (bias 0), tanh and scale, each result rounded to T
        EW_MAP(OP_SOFTCAP, fmaf(round_to<T>(tanhf(round_to<T>(fmaf(x, p0, 0.0f)))), p1, 0.0f))
#undef EW_MAP
        default:
#pragma unroll
            for (int k = 0; k < N; ++k) {
                v[k] = map_large<T>(op, v[k], p0, p1);
            }
            break;
    }
}

}  // namespace ew_unary

// y[i] = f(x[i]) for i in [0, n): x and y contiguous; the first nvec * VEC
// elements as 16-byte vectors (nvec = 0 when x or y is not 16-byte aligned).
template <typename T>
__global__ void unary_flat(const T* x, T* y, long long n, long long nvec, int op, float p0, float p1) {
    od::grid_enter();
    using namespace ew_unary;
    constexpr int N = Vec<T>::N;
    using P = Pack<T, N>;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const P* xv = reinterpret_cast<const P*>(x);
    P* yv = reinterpret_cast<P*>(y);
    // two vectors per thread and step: both loads issued before either is used
    for (; i + stride < nvec; i += 2 * stride) {
        const P a = xv[i];
        const P b = xv[i + stride];
        float v[2 * N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            v[k] = od::load(&a.v[k]);
            v[N + k] = od::load(&b.v[k]);
        }
        apply<T, 2 * N>(op, v, p0, p1);
        P ra, rb;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            put(&ra.v[k], v[k]);
            put(&rb.v[k], v[N + k]);
        }
        yv[i] = ra;
        yv[i + stride] = rb;
    }
    if (i < nvec) {
        const P a = xv[i];
        float v[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
            v[k] = od::load(&a.v[k]);
        }
        apply<T, N>(op, v, p0, p1);
        P r;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            put(&r.v[k], v[k]);
        }
        yv[i] = r;
    }
    // the tail (or everything, unaligned), one element per thread and step
    for (long long j = nvec * N + (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        float v[1] = {od::load(x + j)};
        apply<T, 1>(op, v, p0, p1);
        put(y + j, v[0]);
    }
}

// y (contiguous, n0 x n1 x n2 x n3) = f(x) with x's element strides s0..s3.
// Rows r = (i0 * n1 + i1) * n2 + i2 < n0 * n1 * n2 (< 2**31) go along
// blockDim.y and gridDim.y, the last axis along blockDim.x and gridDim.x.
template <typename T>
__global__ void unary_strided(const T* x, T* y, int n0, int n1, int n2, int n3, long long s0, long long s1,
                              long long s2, long long s3, int op, float p0, float p1) {
    od::grid_enter();
    using namespace ew_unary;
    const long long rows = (long long)n0 * n1 * n2;
    for (long long r = blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += gridDim.y * blockDim.y) {
        int i0 = 0, i1 = 0, i2 = (int)r;  // rows along one axis: no division
        if (rows != n2) {
            const int t = (int)r / n2;
            i2 = (int)r - t * n2;
            i1 = t % n1;
            i0 = t / n1;
        }
        const T* xr = x + i0 * s0 + i1 * s1 + i2 * s2;
        T* yr = y + (long long)r * n3;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n3; c += gridDim.x * blockDim.x) {
            float v[1] = {od::load(xr + c * s3)};
            apply<T, 1>(op, v, p0, p1);
            put(yr + c, v[0]);
        }
    }
}
