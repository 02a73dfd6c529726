// rope (ggml_rope_ext) in normal and neox modes, with YaRN and frequency factors; the fused
// rope -> view -> set_rows that writes rotated K rows straight into a KV cache; and the fused
// decode-step write rope(q), rope(k) -> K cache rows, v -> V cache rows, in one launch.
//
// The angle of a pair depends on its token and its index only, so a thread rotates the same
// pair(s) of several heads of one token with one set of angles: heads g, g + G, g + 2G, ...
// of G head groups (the host picks G). Two thread layouts, picked on the host:
// - chunks, where rows allow 16-byte packs (x rows 16-byte aligned, D and n_dims multiples of
//   2E, E = 16 / sizeof(x)): a thread takes chunk c of a head row, E pairs held in two packs of
//   E values (neox rotated: (cE .. cE+E-1) and the same + n_dims/2; otherwise the 2E values
//   from 2cE). It issues the loads of its first NH heads, then reads pos and computes its E
//   angles (powf, sincosf: their latency overlaps the loads), rotates and stores, NH heads at
//   a time. Neighbouring threads take neighbouring chunks, so a warp's loads cover whole
//   128-byte segments of head rows, and every thread moves 16 bytes a load. The lanes of a
//   warp holding one chunk of one token in SH head groups (rope_kernel's SH, the host's
//   RopeLayout.share) compute E / SH of the angles each and swap them by shuffles: powf and
//   sincosf are most of a thread's instructions where it has few heads (f16 at 4096 tokens).
// - pairs, any other layout: a thread takes one pair (pair_of) of its heads.
// The angles, and so the results, are the same in both.
//
// Rows x (B, T, H, D) with contiguous rows, outer strides in elements; pos i32 (T,); ff f32
// (>= n_dims/2) or null. Angles and pairs: rope_common.cuh.
#include "rope_common.cuh"

using namespace od_rope;

namespace {

// Flat thread index -> (unit u of a head row: a chunk or a pair, head group g, token row bt).
struct Slot {
    unsigned u, g, bt;
};

__device__ __forceinline__ Slot slot_of(unsigned idx, unsigned units, unsigned groups) {
    const unsigned rest = idx / units;
    return {idx - rest * units, rest % groups, rest / groups};
}

// One chunk of E pairs of one head: the two packs of E values at o0 and o1 of the
// row, rotated by angle e when `rot`.
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
    // value k of the chunk's 2E: pack a's, then pack b's (k is a constant once unrolled)
    const auto get = [&](int k) { return k < E ? od::load(&x.a.v[k]) : od::load(&x.b.v[k - E]); };
    od::Pack<TO, E> y0, y1;
    const auto put = [&](int k, float v) { k < E ? od::store(&y0.v[k], v) : od::store(&y1.v[k - E], v); };
#pragma unroll
    for (int e = 0; e < E; ++e) {  // pair e: one value at a time, so few are live at once
        const int i0 = NEOX ? e : 2 * e, i1 = NEOX ? E + e : 2 * e + 1;
        const float x0 = get(i0), x1 = get(i1);
        put(i0, rot ? x0 * c[e] - x1 * s[e] : x0);
        put(i1, rot ? x0 * s[e] + x1 * c[e] : x1);
    }
    *reinterpret_cast<od::Pack<TO, E>*>(yr + o0) = y0;
    *reinterpret_cast<od::Pack<TO, E>*>(yr + o1) = y1;
}

// The E angles of the chunk whose first pair is jj, at position *pos, into c, s (where `rot`).
// SH > 1: the SH lanes of this chunk of SH consecutive head groups (group g the lane's, lanes
// `units` apart in one warp, every lane of the warp here: the host's rope_layout sees to it)
// compute E / SH angles each and take the others from each other by shuffles.
template <int SH, int E>
__device__ __forceinline__ void chunk_angles(int jj, bool rot, unsigned g, int units, const int* pos, const float* ff,
                                             const RopeParams& p, float (&c)[E], float (&s)[E]) {
    static_assert(E % SH == 0, "each sharing lane computes E / SH angles");
    constexpr int PER = E / SH;
    const int r = static_cast<int>(g % SH);
    float mc[PER] = {}, ms[PER] = {};
    if (rot) {
        const int t = *pos;
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            cos_sin_of(jj + r * PER + k, t, ff, p, mc[k], ms[k]);
        }
    }
    if constexpr (SH == 1) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            c[e] = mc[e];
            s[e] = ms[e];
        }
    } else {
        const int first = static_cast<int>(threadIdx.x % od::WARP_SIZE) - r * units;  // the lane of group g - r
#pragma unroll
        for (int e = 0; e < E; ++e) {
            c[e] = __shfl_sync(od::FULL_MASK, mc[e % PER], first + (e / PER) * units);
            s[e] = __shfl_sync(od::FULL_MASK, ms[e % PER], first + (e / PER) * units);
        }
    }
}

// Chunk c of heads g, g + groups, ... (< heads) of one token: x rows xs_h apart from xb,
// y rows ys_h apart from yb, position *pos. The first NH heads are loaded before the
// angles are computed (SH lanes sharing them: chunk_angles); the rest follow NH at a time,
// each round's loads before its stores.
template <bool NEOX, int NH, int SH, typename TI, typename TO>
__device__ __forceinline__ void rope_chunks(const TI* xb, long long xs_h, TO* yb, long long ys_h, unsigned c,
                                            unsigned g, unsigned groups, unsigned heads, const int* pos,
                                            const float* ff, const RopeParams& p) {
    constexpr int E = 16 / sizeof(TI);
    const int jj = static_cast<int>(c) * E;  // the chunk's first pair
    const bool rot = 2 * jj < p.n_dims;
    const int o0 = NEOX && rot ? jj : 2 * jj;
    const int o1 = NEOX && rot ? jj + p.n_dims / 2 : 2 * jj + E;
    Chunk<TI, E> x[NH];
    unsigned h = g;
#pragma unroll
    for (int k = 0; k < NH; ++k) {
        if (h + k * groups < heads) {
            x[k] = load_chunk<E>(xb + (h + k * groups) * xs_h, o0, o1);
        }
    }
    float cc[E], ss[E];  // read only where `rot`
    chunk_angles<SH>(jj, rot, g, p.d / (2 * E), pos, ff, p, cc, ss);
    for (;;) {
#pragma unroll
        for (int k = 0; k < NH; ++k) {
            if (h + k * groups < heads) {
                rotate_chunk<NEOX>(x[k], yb + (h + k * groups) * ys_h, o0, o1, rot, cc, ss);
            }
        }
        h += NH * groups;
        if (h >= heads) {
            break;
        }
#pragma unroll
        for (int k = 0; k < NH; ++k) {
            if (h + k * groups < heads) {
                x[k] = load_chunk<E>(xb + (h + k * groups) * xs_h, o0, o1);
            }
        }
    }
}

// Pair j of heads g, g + groups, ... (< heads) of one token (rows as in rope_chunks).
template <bool NEOX, typename TI, typename TO>
__device__ __forceinline__ void rope_pairs(const TI* xb, long long xs_h, TO* yb, long long ys_h, unsigned j,
                                           unsigned g, unsigned groups, unsigned heads, const int* pos,
                                           const float* ff, const RopeParams& p) {
    int e0, e1, i;
    bool rot;
    pair_of<NEOX>(static_cast<int>(j), p, e0, e1, i, rot);
    float c = 1.0f, s = 0.0f;
    if (rot) {
        cos_sin_of(i, *pos, ff, p, c, s);
    }
    for (unsigned h = g; h < heads; h += groups) {
        const TI* xr = xb + h * xs_h;
        TO* yr = yb + h * ys_h;
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

// The slot's unit of its heads, in the layout `vec` picks (chunks of E = 16 / sizeof(TI)
// pairs, SH lanes sharing their angles, or pairs).
template <bool NEOX, int NH, int SH, typename TI, typename TO>
__device__ __forceinline__ void rope_slot(bool vec, const Slot& s, const TI* xb, long long xs_h, TO* yb,
                                          long long ys_h, unsigned groups, unsigned heads, const int* pos,
                                          const float* ff, const RopeParams& p) {
    if (vec) {
        rope_chunks<NEOX, NH, SH>(xb, xs_h, yb, ys_h, s.u, s.g, groups, heads, pos, ff, p);
    } else {
        rope_pairs<NEOX>(xb, xs_h, yb, ys_h, s.u, s.g, groups, heads, pos, ff, p);
    }
}

// Units of a head row: chunks of E pairs (vec) or pairs.
template <typename TI>
__device__ __forceinline__ unsigned row_units(bool vec, int d) {
    return static_cast<unsigned>(vec ? d / (32 / sizeof(TI)) : d / 2);
}

}  // namespace

// out contiguous (B, T, H, D), x's type. total = B*T * groups * row_units threads (< 2**32); with
// SH > 1 (chunks only), a multiple of 32, groups a multiple of SH and SH * row_units dividing 32.
template <bool NEOX, typename T, int NH, int SH>
__global__ void __launch_bounds__(256) rope_kernel(const T* __restrict__ x, const int* __restrict__ pos,
                                                   const float* __restrict__ ff, T* __restrict__ out, unsigned total,
                                                   int vec, int heads, int groups, int tokens, long long xs_h,
                                                   long long xs_t, long long xs_b, ROPE_PARAMS) {
    od::grid_enter();
    const RopeParams p = ROPE_STRUCT;
    const unsigned idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) {
        return;
    }
    const Slot s = slot_of(idx, row_units<T>(vec, d), groups);
    const unsigned t = s.bt % static_cast<unsigned>(tokens);
    const unsigned b = s.bt / static_cast<unsigned>(tokens);
    rope_slot<NEOX, NH, SH>(vec, s, x + t * xs_t + b * xs_b, xs_h, out + static_cast<long long>(s.bt) * heads * d,
                            d, groups, heads, pos + t, ff, p);
}

// Fused rope -> view (T, H*D) -> set_rows: x f32 (1, T, H, D); row t of the rotated
// values goes to cache row idx[t] (cache row stride cs in elements, `rows` rows), converted to DT.
// A row id outside [0, rows) is not written and is recorded in the error word (od::index_ok).
template <bool NEOX, typename DT, typename IT, int NH>
__global__ void __launch_bounds__(256) rope_set_rows(const float* __restrict__ x, const int* __restrict__ pos,
                                                     const float* __restrict__ ff, DT* __restrict__ cache,
                                                     const IT* __restrict__ idx, unsigned total, int vec, int heads,
                                                     int groups, long long xs_h, long long xs_t, long long cs,
                                                     long long rows, ROPE_PARAMS, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    const RopeParams p = ROPE_STRUCT;
    const unsigned k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= total) {
        return;
    }
    const Slot s = slot_of(k, row_units<float>(vec, d), groups);
    const unsigned t = s.bt;  // batch 1
    const long long row = static_cast<long long>(idx[t]);
    if (!od::index_ok(row, rows, err_word, err_tag, t)) {
        return;
    }
    rope_slot<NEOX, NH, 1>(vec, s, x + t * xs_t, xs_h, cache + row * cs, d, groups, heads, pos + t, ff, p);
}

// A decode step's K/V write and q rotation in one launch (blockIdx.y: 0 q, 1 k, 2 v), tokens
// t < T of batch 1: q (T, hq, D) f32 rotated into q_out (contiguous); k (T, hk, D) f32 rotated
// into K cache row idx[t] (row stride kcs elements, heads D apart); v (T, v_cols) f32 copied
// into V cache row idx[t] (stride vcs). q, k: rope_kernel's layouts and head groups (gq, gk);
// v: 4 values a thread where `vec` (16-byte rows, 4*sizeof(DT)-aligned cache rows), else one.
// A row id outside [0, rows) (the rows both caches have) is written in neither and is recorded in
// the error word (od::index_ok).
template <bool NEOX, typename DT, typename IT, int NH>
__global__ void __launch_bounds__(256) rope_qkv_set_rows(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ pos,
    const float* __restrict__ ff, float* __restrict__ q_out, DT* __restrict__ k_cache, DT* __restrict__ v_cache,
    const IT* __restrict__ idx, int vec, int tokens, int hq, int gq, int hk, int gk, int v_cols, long long qs_h,
    long long qs_t, long long ks_h, long long ks_t, long long vs_t, long long kcs, long long vcs, long long rows,
    ROPE_PARAMS, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    const RopeParams p = ROPE_STRUCT;
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (blockIdx.y == 2) {
        const unsigned per_row = static_cast<unsigned>(vec ? v_cols / 4 : v_cols);
        if (i >= static_cast<unsigned>(tokens) * per_row) {
            return;
        }
        const unsigned t = i / per_row, u = i - t * per_row;
        const long long row = static_cast<long long>(idx[t]);
        if (!od::index_ok(row, rows, err_word, err_tag, t)) {
            return;
        }
        const float* src = v + t * vs_t;
        DT* dst = v_cache + row * vcs;
        if (vec) {
            const od::Pack<float, 4> a = reinterpret_cast<const od::Pack<float, 4>*>(src)[u];
            od::Pack<DT, 4> y;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                od::store(&y.v[e], a.v[e]);
            }
            reinterpret_cast<od::Pack<DT, 4>*>(dst)[u] = y;
        } else {
            od::store(dst + u, src[u]);
        }
        return;
    }
    const bool is_q = blockIdx.y == 0;
    const unsigned groups = static_cast<unsigned>(is_q ? gq : gk);
    const unsigned units = row_units<float>(vec, d);
    if (i >= static_cast<unsigned>(tokens) * groups * units) {
        return;
    }
    const Slot s = slot_of(i, units, groups);
    const unsigned t = s.bt;
    if (is_q) {
        rope_slot<NEOX, NH, 1>(vec, s, q + t * qs_t, qs_h, q_out + static_cast<long long>(t) * hq * d, d, groups,
                               hq, pos + t, ff, p);
    } else {
        const long long row = static_cast<long long>(idx[t]);
        if (!od::index_ok(row, rows, err_word, err_tag, t)) {
            return;
        }
        rope_slot<NEOX, NH, 1>(vec, s, k + t * ks_t, ks_h, k_cache + row * kcs, d, groups, hk, pos + t, ff, p);
    }
}
