// The angle of a rope pair and the pairs of a head row, shared by rope.cu and fattn_decode.cu (which
// rotates q and the new K row of a decode step itself when it runs fused with the cache writes).
// For pair i < n_dims/2 of a token at position pos: theta_ext = pos * theta_scale**i / ff[i],
// theta_scale = freq_base**(-2/n_dims) (ggml computes it this way, in float), then YaRN's mix (corr
// dims lo, hi from the host) and mscale. Pairs: (2i, 2i+1) in normal mode, (i, i + n_dims/2) in neox
// mode; dims >= n_dims are copied.
#pragma once

#include "common.cuh"

namespace od_rope {

struct RopeParams {
    int d;       // head size (D), even
    int n_dims;  // rotated dims
    float theta_scale;
    float freq_scale;
    float ext_factor;
    float mscale;  // attn_factor, times YaRN's magnitude correction when ext_factor != 0
    float corr_lo;
    float corr_hi;
};

// The kernels take the parameters one by one (launch arguments are scalars).
#define ROPE_PARAMS                                                                                         \
    int d, int n_dims, float theta_scale, float freq_scale, float ext_factor, float mscale, float corr_lo, \
        float corr_hi
#define ROPE_STRUCT {d, n_dims, theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi}

__device__ __forceinline__ void rope_cos_sin(float theta_ext, int i, const RopeParams& p, float& c, float& s) {
    const float theta_int = p.freq_scale * theta_ext;
    float theta = theta_int;
    if (p.ext_factor != 0.0f) {
        const float y = (static_cast<float>(i) - p.corr_lo) / fmaxf(0.001f, p.corr_hi - p.corr_lo);
        const float mix = p.ext_factor * (1.0f - fminf(1.0f, fmaxf(0.0f, y)));
        theta = theta_int * (1.0f - mix) + theta_ext * mix;
    }
    sincosf(theta, &s, &c);
    c *= p.mscale;
    s *= p.mscale;
}

// The angle of pair i at position pos (ggml's CUDA formula: powf per pair).
__device__ __forceinline__ void cos_sin_of(int i, int pos, const float* ff, const RopeParams& p, float& c, float& s) {
    float theta_ext = static_cast<float>(pos) * powf(p.theta_scale, static_cast<float>(i));
    if (ff != nullptr) {
        theta_ext /= ff[i];
    }
    rope_cos_sin(theta_ext, i, p, c, s);
}

// The pair handled by flat pair index j of a row: its two element offsets, its
// frequency index, and whether it rotates.
template <bool NEOX>
__device__ __forceinline__ void pair_of(int j, const RopeParams& p, int& e0, int& e1, int& i, bool& rot) {
    const int half = p.n_dims / 2;
    if (2 * j >= p.n_dims) {  // pass-through: (2j, 2j+1)
        e0 = 2 * j;
        e1 = 2 * j + 1;
        i = 0;
        rot = false;
    } else if (NEOX) {
        e0 = j;
        e1 = j + half;
        i = j;
        rot = true;
    } else {
        e0 = 2 * j;
        e1 = 2 * j + 1;
        i = j;
        rot = true;
    }
}

}  // namespace od_rope
