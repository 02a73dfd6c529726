// What both flash_attn_ext prefill kernels (fattn_prefill.cu on mma.sync, fattn_prefill_wgmma.cu on Hopper's
// wgmma) do alike: the order blocks take query tiles in, the walk over key tiles that skips fully masked ones,
// the scores brought to log2 units and masked, and the online softmax of one m16 tile of scores. A tile's scores
// s[nt][e] are the mma.sync m16n8 accumulator layout (wgmma's too): rows g (e = 0, 1) and g + 8 (e = 2, 3), keys
// 8 nt + 2 t4 + (e & 1); g = lane / 4, t4 = lane % 4.
#pragma once

#include "attn_common.cuh"

// Both prefill kernels' parameters (specs/flash.py's PrefillArgs): q, K, V, the f16 mask and sinks (null: none),
// the f32 output, the mask tile flags; sizes; strides in bytes (t rows, h heads, b batches; the mask's slices by
// modulo m2, m3); scale, softcap, ALiBi; kv_vec (K/V rows 16-byte aligned) and the key tiles.
#define PREFILL_PARAMS                                                                                      \
    const char* __restrict__ q, const char* __restrict__ k, const char* __restrict__ v,                    \
        const char* __restrict__ mask, const float* __restrict__ sinks, float* __restrict__ out,         \
        const unsigned char* __restrict__ flags, int q_f16, int tq, int hq, int tk, int group,           \
        long long qs_t, long long qs_h, long long qs_b, long long ks_t, long long ks_h, long long ks_b,  \
        long long vs_t, long long vs_h, long long vs_b, int m2, int m3, long long ms_t, long long ms_h,  \
        long long ms_b, float scale, float softcap, int use_alibi, float m0, float m1, int n_head_log2,  \
        int kv_vec, int n_kv_tiles

namespace od_prefill {

using od_attn::LOG2E;

// 2^x on the MUFU unit, flushing denormal results to zero (exp2f adds a range fix-up
// of three instructions around it; probabilities below 2^-126 do not matter here).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// This block's query tile qt, head h and batch b (blocks are dispatched in linear-id order): the q tiles run from
// the last one (the longest under a causal mask) down, in phases of halving length (the top half of every (batch,
// head)'s q tiles, then the next quarter, ..., 4 at least), each phase (batch, head)-major so that a few blocks of
// one head run together and share its K/V in L2. The last blocks dispatched are short ones, so the tail stays
// balanced. Grid (q tiles, heads, batches).
__device__ __forceinline__ void block_tile(int& qt, int& h, int& b) {
    const int n_qt = gridDim.x;
    const long long nh = static_cast<long long>(gridDim.y) * gridDim.z;
    long long lin = blockIdx.x + gridDim.x * (blockIdx.y + static_cast<long long>(gridDim.y) * blockIdx.z);
    int start = 0, rem = n_qt, len = 0;
    for (;;) {
        len = rem <= 4 ? rem : (rem + 1) / 2;
        if (lin < len * nh) {
            break;
        }
        lin -= len * nh;
        start += len;
        rem -= len;
    }
    const long long hb = lin / len;
    qt = n_qt - 1 - (start + static_cast<int>(lin - hb * len));
    h = static_cast<int>(hb % gridDim.y);
    b = static_cast<int>(hb / gridDim.y);
}

// The first kv tile after j whose mask block is not all -inf (flags fl, null: every tile): 32 flags per ballot,
// so skipping the causal half costs a load or two, not one per tile. Every warp finds the same tile, so the
// barriers of the loop over them stay uniform.
__device__ __forceinline__ int next_tile(const unsigned char* fl, int j, int n_kv_tiles, int lane) {
    for (int base = j + 1; base < n_kv_tiles; base += 32) {
        const int t = base + lane;
        const unsigned live = __ballot_sync(od::FULL_MASK, t < n_kv_tiles && (fl == nullptr || fl[t] != 0));
        if (live != 0u) {
            return base + __ffs(live) - 1;
        }
    }
    return n_kv_tiles;
}

// How a block's raw scores become logits in log2 units: softcap ? cap * tanh(s * scale / cap) : s * scale, times
// log2(e) (mul2, in_scale), plus the ALiBi slope (slope2) times the f16 mask value; the mask rows of this (batch,
// head) at mbase, ms_t bytes apart (mask_al4: rows 4-byte aligned, a key pair one 32-bit load).
struct Logits {
    const char* mbase;
    long long ms_t;
    float slope2, mul2, in_scale, softcap;
    int tq, tk;
    bool mask_al4;
};

// The mask tile flags of query tile qt for (batch b, head h), n_kv_tiles bytes (fattn_mask.cu's; null without flags).
__device__ __forceinline__ const unsigned char* tile_flags(const unsigned char* flags, int b, int h, int m2, int m3,
                                                           int qt, int n_kv_tiles) {
    return flags != nullptr
               ? flags + ((static_cast<long long>(b % m3) * m2 + h % m2) * gridDim.x + qt) * n_kv_tiles
               : nullptr;
}

// The Logits of (batch b, head h): its mask rows (the mask's slices by modulo m2, m3; none without a mask), its
// ALiBi slope and the scales, from the kernels' PREFILL_PARAMS of those names.
__device__ __forceinline__ Logits logits_of(const char* mask, long long ms_t, long long ms_h, long long ms_b, int m2,
                                            int m3, int b, int h, float scale, float softcap, int use_alibi, float m0,
                                            float m1, int n_head_log2, int tq, int tk) {
    const char* mbase = mask != nullptr ? mask + (b % m3) * ms_b + (h % m2) * ms_h : nullptr;
    // mask rows 4-byte aligned: a key pair (even key) is one 32-bit load
    const bool al4 =
        ((reinterpret_cast<unsigned long long>(mbase) | static_cast<unsigned long long>(ms_t)) & 3ull) == 0;
    return {mbase, ms_t, od_attn::alibi_slope(use_alibi, h, n_head_log2, m0, m1) * LOG2E,
            softcap != 0.0f ? softcap * LOG2E : scale * LOG2E, softcap != 0.0f ? scale / softcap : 1.0f, softcap, tq,
            tk, al4};
}

// Whether a key tile (first key kb, BN keys, mask flag `flag`) keeps the raw dot products (the common tile: mask
// block all zero or no mask, no softcap, every key < tk, scale > 0): their maximum is taken raw and scaled once a
// row, and the scale folds into the exponent's FFMA, so a logit costs FMNMX + FFMA + MUFU + FADD. Other tiles (the
// causal diagonal, a tail, softcap) are brought to log2 units first (to_log2) and take mul = 1.
__device__ __forceinline__ bool raw_tile(const Logits& L, int flag, int kb, int bn) {
    return !(flag != 2 || kb + bn > L.tk || L.softcap != 0.0f || !(L.mul2 > 0.0f));
}

// One m16 tile's scores (first row row0) of a key tile that is not raw_tile's to log2 units, masked.
template <int NT>
__device__ __forceinline__ void to_log2(float (&s)[NT][4], const Logits& L, int flag, int kb, int row0, int g,
                                        int tq4) {
    const float NEG_INF = -__int_as_float(0x7f800000);
    if (flag == 1 && kb + NT * 8 <= L.tk && L.softcap == 0.0f && L.mask_al4) {
        // A whole mixed tile (the causal diagonal): the two mask values of a lane's key pair in one 32-bit load,
        // no per-key checks; same arithmetic as the general path below. Rows past tq read row tq - 1 (their
        // output is never written).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = min(row0 + g + 8 * r, L.tq - 1);
            const unsigned* mrow =
                reinterpret_cast<const unsigned*>(L.mbase + row * L.ms_t + static_cast<long long>(kb) * 2) + tq4;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned mv = mrow[nt * 4];  // keys kb + nt * 8 + 2 * tq4 + {0, 1}
                s[nt][2 * r] =
                    od_attn::masked(static_cast<unsigned short>(mv & 0xffffu), L.slope2, s[nt][2 * r] * L.mul2);
                s[nt][2 * r + 1] =
                    od_attn::masked(static_cast<unsigned short>(mv >> 16), L.slope2, s[nt][2 * r + 1] * L.mul2);
            }
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r;
        const unsigned short* mrow =
            flag == 1 && row < L.tq ? reinterpret_cast<const unsigned short*>(L.mbase + row * L.ms_t) : nullptr;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e2 = 0; e2 < 2; ++e2) {
                float x = s[nt][2 * r + e2];
                if (L.softcap != 0.0f) {
                    x = tanhf(x * L.in_scale);
                }
                x *= L.mul2;
                const int key = kb + nt * 8 + 2 * tq4 + e2;
                if (key >= L.tk) {
                    x = NEG_INF;
                } else if (mrow != nullptr) {
                    x = od_attn::masked(mrow[key], L.slope2, x);
                }
                s[nt][2 * r + e2] = x;
            }
        }
    }
}

// Online softmax of one m16 tile: scores s (logits / mul, log2 units) become probabilities relative to the rows'
// running maxima mrun (a row spans a quad's 4 lanes), their sums join lrun, and O (DT n8 tiles) is rescaled
// where some row's maximum grew.
template <int NT, int DT>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], float (&mrun)[2], float (&lrun)[2], float (&o)[DT][4],
                                             float mul) {
    const float NEG_INF = -__int_as_float(0x7f800000);
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(od::FULL_MASK, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(od::FULL_MASK, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(od::FULL_MASK, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(od::FULL_MASK, mx1, 2));
    const float mn0 = fmaxf(mrun[0], mx0 * mul);  // mul > 0: the max commutes with it
    const float mn1 = fmaxf(mrun[1], mx1 * mul);
    const float a0 = ex2(mrun[0] - mn0);
    const float a1 = ex2(mrun[1] - mn1);
    mrun[0] = mn0;
    mrun[1] = mn1;
    float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        s[nt][0] = ex2(fmaf(s[nt][0], mul, -mn0));
        s[nt][1] = ex2(fmaf(s[nt][1], mul, -mn0));
        s[nt][2] = ex2(fmaf(s[nt][2], mul, -mn1));
        s[nt][3] = ex2(fmaf(s[nt][3], mul, -mn1));
        ls0 += s[nt][0] + s[nt][1];
        ls1 += s[nt][2] + s[nt][3];
    }
    lrun[0] = lrun[0] * a0 + ls0;
    lrun[1] = lrun[1] * a1 + ls1;
    // rescale O only where some row of the warp saw its maximum grow (warp-uniform branch)
    if (__any_sync(od::FULL_MASK, a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= a0;
            o[dt][1] *= a0;
            o[dt][2] *= a1;
            o[dt][3] *= a1;
        }
    }
}

// The finished rows of one m16 tile (first row row0): the quad's partial sums added, the sink joined (sinks, null:
// none), O normalized and written to out (B, Tq, Hq, D) f32 for rows < tq.
template <int D>
__device__ __forceinline__ void write_rows(const float (&o)[D / 8][4], const float (&mrun)[2], const float (&lrun)[2],
                                           const float* sinks, float* out, int b, int h, int hq, int tq, int row0,
                                           int g, int tq4) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = lrun[r];
        l += __shfl_xor_sync(od::FULL_MASK, l, 1);
        l += __shfl_xor_sync(od::FULL_MASK, l, 2);
        float sc = 1.0f;
        if (sinks != nullptr) {
            const float sk = sinks[h] * LOG2E;
            const float mf = fmaxf(mrun[r], sk);
            sc = exp2f(mrun[r] - mf);
            l = l * sc + exp2f(sk - mf);
        }
        const float inv = l == 0.0f ? 0.0f : sc / l;  // a NaN l (a NaN or +inf logit or sink): the row NaN
        const int row = row0 + g + 8 * r;
        if (row < tq) {
            float* y = out + ((static_cast<long long>(b) * tq + row) * hq + h) * D + 2 * tq4;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                *reinterpret_cast<float2*>(y + dt * 8) = make_float2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
            }
        }
    }
}

}  // namespace od_prefill
