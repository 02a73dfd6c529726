// Activations shared by the plugins' kernels: sigmoid, gelu and the gated linear units
// (cuda_misc's unary and glu kernels, cuda_matmul's fused GLU epilogue), with the
// reference's semantics (core/reference/elementwise.py) and ggml's constants.
//
// The formulas avoid cancellation and overflow, so results keep their relative
// precision where they are tiny. Include-free like common.cuh (NVRTC and nvcc).
#pragma once

namespace od {

// ggml's constants (ggml-cpu/vec.h)
constexpr float GELU_COEF_A = 0.044715f;
constexpr float GELU_QUICK_COEF = 1.702f;
constexpr float SQRT_2_OVER_PI = 0.79788456080286535587989211986876f;
constexpr float SQRT_2_INV = 0.70710678118654752440084436210484f;

// 1 / (1 + exp(-x)), as e / (1 + e) with e = exp(-|x|) for x < 0: no overflow, and
// the tail keeps its relative precision (down to the subnormals the reference gives).
__device__ __forceinline__ float sigmoid(float x) {
    const float e = expf(-fabsf(x));
    const float r = __fdividef(1.0f, 1.0f + e);  // 1 + e in [1, 2]: within 2 ulps
    return x >= 0.0f ? r : e * r;
}

// 0.5 x (1 + tanh(u)) with ggml's u, written as x sigmoid(2u): the same function
// without the cancellation of 1 + tanh(u) for negative x.
__device__ __forceinline__ float gelu(float x) {
    return x * sigmoid(2.0f * SQRT_2_OVER_PI * x * (1.0f + GELU_COEF_A * x * x));
}

// 0.5 x (1 + erf(x / sqrt 2)), as erfc(-z) = 1 + erf(z): no cancellation.
__device__ __forceinline__ float gelu_erf(float x) {
    return 0.5f * x * erfcf(-x * SQRT_2_INV);
}

// GLU kinds, in opdispatch.ops.GLU_KINDS order (the plugins pass the index).
constexpr int GLU_REGLU = 0;
constexpr int GLU_GEGLU = 1;
constexpr int GLU_SWIGLU = 2;
constexpr int GLU_GEGLU_ERF = 3;
constexpr int GLU_GEGLU_QUICK = 4;
constexpr int GLU_SWIGLU_OAI = 5;

// act(g) * u for GLU kind KIND. reglu's relu sends NaN to 0; swiglu_oai clips with
// comparisons that keep NaN, as numpy's minimum and clip do.
template <int KIND>
__device__ __forceinline__ float glu(float g, float u, float alpha, float limit) {
    if constexpr (KIND == GLU_REGLU) {
        return (g > 0.0f ? g : 0.0f) * u;
    } else if constexpr (KIND == GLU_GEGLU) {
        return gelu(g) * u;
    } else if constexpr (KIND == GLU_SWIGLU) {
        return g * sigmoid(g) * u;
    } else if constexpr (KIND == GLU_GEGLU_ERF) {
        return gelu_erf(g) * u;
    } else if constexpr (KIND == GLU_GEGLU_QUICK) {
        return g * sigmoid(GELU_QUICK_COEF * g) * u;
    } else {
        // x = min(gate, limit); u = clip(up, -limit, limit); x * sigmoid(alpha * x) * (u + 1)
        const float x = g > limit ? limit : g;
        const float c = u > limit ? limit : (u < -limit ? -limit : u);
        return x * sigmoid(alpha * x) * (c + 1.0f);
    }
}

// The same with the kind known only at run time (a kernel argument).
__device__ __forceinline__ float glu(int kind, float g, float u, float alpha, float limit) {
    switch (kind) {
        case GLU_REGLU: return glu<GLU_REGLU>(g, u, alpha, limit);
        case GLU_GEGLU: return glu<GLU_GEGLU>(g, u, alpha, limit);
        case GLU_SWIGLU: return glu<GLU_SWIGLU>(g, u, alpha, limit);
        case GLU_GEGLU_ERF: return glu<GLU_GEGLU_ERF>(g, u, alpha, limit);
        case GLU_GEGLU_QUICK: return glu<GLU_GEGLU_QUICK>(g, u, alpha, limit);
        default: return glu<GLU_SWIGLU_OAI>(g, u, alpha, limit);
    }
}

}  // namespace od
