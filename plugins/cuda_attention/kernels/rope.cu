// rope (ggml_rope_ext) in normal and neox modes, with YaRN and frequency factors,
// and the fused rope -> view -> set_rows that writes rotated K rows straight into
// a KV cache. One thread per (token, pair of values) and group of up to `hpt` heads:
// the angle's sin/cos are computed once for the heads of the group.
//
// Where rows allow it (D % 64 == 0, n_dims / 2 a multiple of E, 16-byte aligned rows:
// rope_vec_ok), a warp, whose 32 threads hold 32 consecutive pairs of one token and
// head group, moves the values in 16-byte packs instead (rope_warp): E = 16 / sizeof(x)
// pairs a chunk, each lane rotates one chunk of one or two heads with the angles of
// its chunk taken from the lanes that computed them. The angles, and so the results,
// are those of the one-pair-per-thread path.
//
// x (B, T, H, D) with contiguous rows, outer strides in elements (xs_h, xs_t,
// xs_b); pos i32 (T,); ff f32 (>= n_dims/2) or null. For pair i < n_dims/2 of
// token t: theta_ext = pos[t] * theta_scale**i / ff[i], theta_scale =
// freq_base**(-2/n_dims) (ggml computes it this way, in float), then YaRN's mix
// (corr dims lo, hi from the host) and mscale. Pairs: (2i, 2i+1) in normal mode,
// (i, i + n_dims/2) in neox mode; dims >= n_dims are copied.
#include "attn_common.cuh"

namespace {

struct RopeParams {
    int d;           // head size (D), even
    int n_dims;      // rotated dims
    int heads;       // H
    int tokens;      // T
    float theta_scale;
    float freq_scale;
    float ext_factor;
    float mscale;    // attn_factor, times YaRN's magnitude correction when ext_factor != 0
    float corr_lo;
    float corr_hi;
};

// The kernels take the parameters one by one (launch arguments are scalars).
#define ROPE_PARAMS                                                                                         \
    int d, int n_dims, int heads, int tokens, float theta_scale, float freq_scale, float ext_factor,        \
        float mscale, float corr_lo, float corr_hi
#define ROPE_STRUCT {d, n_dims, heads, tokens, theta_scale, freq_scale, ext_factor, mscale, corr_lo, corr_hi}

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

template <bool NEOX>
__device__ __forceinline__ void cos_sin_of(int i, int pos, const float* ff, const RopeParams& p, float& c, float& s) {
    float theta_ext = static_cast<float>(pos) * powf(p.theta_scale, static_cast<float>(i));
    if (ff != nullptr) {
        theta_ext /= ff[i];
    }
    rope_cos_sin(theta_ext, i, p, c, s);
}

// Flat thread index -> (pair j of a row, head group hg, token row bt = b*T + t). Each thread
// rotates pair j of heads hg*hpt .. hg*hpt + hpt - 1 of one token: the angle depends on the
// token and the pair only, so its sin/cos are computed once for those heads.
struct PairIndex {
    unsigned j, h0, h1, bt;
};

__device__ __forceinline__ PairIndex pair_index(unsigned idx, const RopeParams& p, int hpt) {
    const unsigned pairs = static_cast<unsigned>(p.d / 2);
    const unsigned groups = static_cast<unsigned>((p.heads + hpt - 1) / hpt);
    PairIndex r;
    r.j = idx % pairs;
    const unsigned rest = idx / pairs;
    const unsigned hg = rest % groups;
    r.bt = rest / groups;
    r.h0 = hg * hpt;
    r.h1 = min(r.h0 + hpt, static_cast<unsigned>(p.heads));
    return r;
}

// One chunk of E pairs of one head: the two packs of E values at o0 and o1 of the
// row (neox rotated: the halves (i, i + n_dims/2); normal or passed through: 2E
// consecutive values, pairs (2e, 2e+1)), rotated by angle e when `rot`.
template <typename T, int E>
struct Chunk {
    od::Pack<T, E> a, b;
};

template <int E, typename TI>
__device__ __forceinline__ Chunk<TI, E> load_chunk(const TI* xr, int o0, int o1) {
    return {*reinterpret_cast<const od::Pack<TI, E>*>(xr + o0), *reinterpret_cast<const od::Pack<TI, E>*>(xr + o1)};
}

template <bool NEOX, int E, typename TI, typename TO>
__device__ __forceinline__ void rotate_chunk(const Chunk<TI, E>& x, TO* yr, int o0, int o1, bool rot,
                                             const float (&c)[E], const float (&s)[E]) {
    float u[2 * E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        u[e] = od::load(&x.a.v[e]);
        u[E + e] = od::load(&x.b.v[e]);
    }
    if (rot) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int i0 = NEOX ? e : 2 * e, i1 = NEOX ? E + e : 2 * e + 1;
            const float x0 = u[i0], x1 = u[i1];
            u[i0] = x0 * c[e] - x1 * s[e];
            u[i1] = x0 * s[e] + x1 * c[e];
        }
    }
    od::Pack<TO, E> y0, y1;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        od::store(&y0.v[e], u[e]);
        od::store(&y1.v[e], u[E + e]);
    }
    *reinterpret_cast<od::Pack<TO, E>*>(yr + o0) = y0;
    *reinterpret_cast<od::Pack<TO, E>*>(yr + o1) = y1;
}

// Whether rope_warp applies: every warp holds 32 pairs of one row (D/2 % 32 == 0),
// chunks do not straddle n_dims, and x's rows and y's rows (stride ys) are aligned
// to packs. Launch-uniform.
template <int E, typename TI, typename TO>
__device__ __forceinline__ bool rope_vec_ok(const TI* x, long long xs_h, long long xs_t, long long xs_b, const TO* y,
                                            long long ys, const RopeParams& p) {
    const unsigned long long xa = reinterpret_cast<unsigned long long>(x);
    const unsigned long long ya = reinterpret_cast<unsigned long long>(y);
    return p.d % 64 == 0 && (p.n_dims / 2) % E == 0 && xa % 16 == 0 && xs_h % E == 0 && xs_t % E == 0 &&
           xs_b % E == 0 && ya % (E * sizeof(TO)) == 0 && ys % E == 0;
}

// The warp's pairs j0 .. j0 + 31 of heads h0 .. h1 - 1 of one token (xb, yb: the
// token's rows, heads xs_h and D apart) as 32 / E chunks of E pairs times the heads:
// lane l takes chunk l % (32 / E) of heads h0 + l / (32 / E), + E, ... Lane l holds
// the angle of pair j0 + l; a chunk's E angles come by shuffles.
//
// The lane's first NH heads are loaded before anything else: angle(c, s) (which
// reads pos and runs powf/sincosf) is called after those loads are issued, so the
// angle's latency hides behind theirs; a lane with more than NH heads (hpt > NH * E)
// does the rest NH at a time, each round's loads before its stores.
template <bool NEOX, int E, typename TI, typename TO, typename Angle>
__device__ __forceinline__ void rope_warp(const TI* xb, long long xs_h, TO* yb, const PairIndex& q,
                                          const RopeParams& p, Angle angle) {
    constexpr int CHUNKS = 32 / E;
    constexpr int STEP = 32 / CHUNKS;  // heads the warp covers per load (= E)
    constexpr int NH = E < 8 ? 2 : 1;  // heads of a lane in flight (hpt = 8: all of the lane's)
    const int lane = threadIdx.x % 32, ch = lane % CHUNKS;
    const int jj = static_cast<int>(q.j & ~31u) + ch * E;  // the chunk's first pair
    const bool rot = 2 * jj < p.n_dims;
    const int o0 = NEOX && rot ? jj : 2 * jj;
    const int o1 = NEOX && rot ? jj + p.n_dims / 2 : 2 * jj + E;
    unsigned h = q.h0 + lane / CHUNKS;
    Chunk<TI, E> x[NH];
#pragma unroll
    for (int k = 0; k < NH; ++k) {
        if (h + k * STEP < q.h1) {
            x[k] = load_chunk<E>(xb + (h + k * STEP) * xs_h, o0, o1);
        }
    }
    float c, s;
    angle(c, s);
    float cc[E], ss[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        cc[e] = __shfl_sync(od::FULL_MASK, c, ch * E + e);
        ss[e] = __shfl_sync(od::FULL_MASK, s, ch * E + e);
    }
    for (;;) {
#pragma unroll
        for (int k = 0; k < NH; ++k) {
            if (h + k * STEP < q.h1) {
                rotate_chunk<NEOX>(x[k], yb + static_cast<long long>(h + k * STEP) * p.d, o0, o1, rot, cc, ss);
            }
        }
        h += NH * STEP;
        if (h >= q.h1) {
            break;
        }
#pragma unroll
        for (int k = 0; k < NH; ++k) {
            if (h + k * STEP < q.h1) {
                x[k] = load_chunk<E>(xb + (h + k * STEP) * xs_h, o0, o1);
            }
        }
    }
}

}  // namespace

// out contiguous (B, T, H, D), x's type T. total = B*T*ceil(H/hpt)*D/2 threads (< 2**32).
template <bool NEOX, typename T>
__global__ void __launch_bounds__(256) rope_kernel(const T* __restrict__ x, const int* __restrict__ pos,
                                                   const float* __restrict__ ff, T* __restrict__ out, unsigned total,
                                                   int hpt, long long xs_h, long long xs_t, long long xs_b,
                                                   ROPE_PARAMS) {
    const RopeParams p = ROPE_STRUCT;
    const unsigned idx = blockIdx.x * 256u + threadIdx.x;
    if (idx >= total) {
        return;
    }
    const PairIndex q = pair_index(idx, p, hpt);
    const unsigned t = q.bt % static_cast<unsigned>(p.tokens);
    const unsigned b = q.bt / static_cast<unsigned>(p.tokens);
    int e0, e1, i;
    bool rot;
    pair_of<NEOX>(static_cast<int>(q.j), p, e0, e1, i, rot);
    const T* xb = x + t * xs_t + b * xs_b;
    constexpr int E = 16 / sizeof(T);
    if (rope_vec_ok<E>(x, xs_h, xs_t, xs_b, out, p.d, p)) {  // then total % 32 == 0: whole warps
        const auto angle = [&](float& c, float& s) {
            c = 1.0f;
            s = 0.0f;
            if (rot) {
                cos_sin_of<NEOX>(i, pos[t], ff, p, c, s);
            }
        };
        rope_warp<NEOX, E>(xb, xs_h, out + static_cast<long long>(q.bt) * p.heads * p.d, q, p, angle);
        return;
    }
    float c = 1.0f, s = 0.0f;
    if (rot) {
        cos_sin_of<NEOX>(i, pos[t], ff, p, c, s);
    }
    for (unsigned h = q.h0; h < q.h1; ++h) {
        const T* xr = xb + h * xs_h;
        T* yr = out + (static_cast<long long>(q.bt) * p.heads + h) * p.d;
        const float x0 = od::load(xr + e0);
        const float x1 = od::load(xr + e1);
        if (rot) {
            od::store(yr + e0, x0 * c - x1 * s);
            od::store(yr + e1, x0 * s + x1 * c);
        } else {
            od::store(yr + e0, x0);
            od::store(yr + e1, x1);
        }
    }
}

// Fused rope -> view (T, H*D) -> set_rows: x f32 (1, T, H, D); row t of the rotated
// values goes to cache row idx[t] (cache row stride cs in elements), converted to DT.
template <bool NEOX, typename DT, typename IT>
__global__ void __launch_bounds__(256) rope_set_rows(const float* __restrict__ x, const int* __restrict__ pos,
                                                     const float* __restrict__ ff, DT* __restrict__ cache,
                                                     const IT* __restrict__ idx, unsigned total, int hpt,
                                                     long long xs_h, long long xs_t, long long cs, ROPE_PARAMS) {
    const RopeParams p = ROPE_STRUCT;
    const unsigned k = blockIdx.x * 256u + threadIdx.x;
    if (k >= total) {
        return;
    }
    const PairIndex q = pair_index(k, p, hpt);
    const unsigned t = q.bt;  // batch 1
    int e0, e1, i;
    bool rot;
    pair_of<NEOX>(static_cast<int>(q.j), p, e0, e1, i, rot);
    const float* xb = x + t * xs_t;
    DT* yb = cache + static_cast<long long>(idx[t]) * cs;
    if (rope_vec_ok<4>(x, xs_h, xs_t, 0ll, cache, cs, p)) {  // then total % 32 == 0: whole warps
        const auto angle = [&](float& c, float& s) {
            c = 1.0f;
            s = 0.0f;
            if (rot) {
                cos_sin_of<NEOX>(i, pos[t], ff, p, c, s);
            }
        };
        rope_warp<NEOX, 4>(xb, xs_h, yb, q, p, angle);
        return;
    }
    float c = 1.0f, s = 0.0f;
    if (rot) {
        cos_sin_of<NEOX>(i, pos[t], ff, p, c, s);
    }
    for (unsigned h = q.h0; h < q.h1; ++h) {
        const float* xr = xb + h * xs_h;
        DT* yr = yb + static_cast<long long>(h) * p.d;
        const float x0 = xr[e0];
        const float x1 = xr[e1];
        if (rot) {
            od::store(yr + e0, x0 * c - x1 * s);
            od::store(yr + e1, x0 * s + x1 * c);
        } else {
            od::store(yr + e0, x0);
            od::store(yr + e1, x1);
        }
    }
}
