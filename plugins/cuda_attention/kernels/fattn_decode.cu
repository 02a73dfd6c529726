// flash_attn_ext for few query rows against a long KV (decode): split-K.
//
// Grid (nsplit, Hkv * ncg, B), 128 threads. A block takes one KV head, one slice
// of `chunk` keys and NCOLS query columns: a column is one (query row t, query
// head h) of the heads sharing that KV head (GQA), so every K/V byte the block
// reads serves all of them. Lanes work in groups of GL (D/8 rounded up to a power
// of two): a group holds one key, each lane 8 of its D values (16-byte loads for
// f16/bf16, dequantized in registers for q8_0/q4_0). Each group keeps a running
// max / sum / accumulator per column in f32 (log2 units); groups merge through
// shuffles, warps through shared memory, and the block writes its partial
// (max, sum, acc[D]) per column to the workspace. fattn_combine merges the
// splits, adds the sink and writes out (B, Tq, Hq, D) f32.
//
// Strides are in bytes: q (t, h, b), k and v (t, h, b), mask (t, h, b) with
// mask heads / batches broadcast by modulo (m2, m3).
#include "attn_common.cuh"

template <int D, typename KT, int NCOLS>
__global__ void __launch_bounds__(128, NCOLS >= 8 ? 2 : 3) fattn_decode(
    const char* __restrict__ q, const char* __restrict__ k, const char* __restrict__ v,
    const char* __restrict__ mask, float* __restrict__ ws_acc, float2* __restrict__ ws_ml,
    int q_f16, int tq, int hq, int tk, int group, int ncg,
    long long qs_t, long long qs_h, long long qs_b,
    long long ks_t, long long ks_h, long long ks_b,
    long long vs_t, long long vs_h, long long vs_b,
    int m2, int m3, long long ms_t, long long ms_h, long long ms_b,
    float scale, float softcap, int use_alibi, float m0, float m1, int n_head_log2,
    int chunk, int kv_vec) {
    using namespace od_attn;
    constexpr int NW = 4;
    constexpr int CH = D / 8;                                   // 8-value chunks per row
    constexpr int GL = CH <= 8 ? 8 : (CH <= 16 ? 16 : 32);      // lanes per key
    constexpr int KPW = 32 / GL;                                // keys per warp and step
    constexpr int U = NCOLS >= 8 ? 2 : 4;                       // keys per group and step
    constexpr int STEP = NW * KPW * U;
    const float NEG_INF = -__int_as_float(0x7f800000);

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int gl = lane % GL;
    const int grp = lane / GL;
    const bool active = gl < CH;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y / ncg;
    const int cg = blockIdx.y % ncg;
    const int b = blockIdx.z;
    const int ncols_total = group * tq;
    const bool has_mask = mask != nullptr;

    float qv[NCOLS][8];
    float slope[NCOLS];
    const unsigned short* mrow[NCOLS];
#pragma unroll
    for (int c = 0; c < NCOLS; ++c) {
        const int cc = cg * NCOLS + c;
        const bool valid = cc < ncols_total;
        const int h = kvh * group + (valid ? cc % group : 0);
        const int t = valid ? cc / group : 0;
        if (valid && active) {
            const char* qr = q + b * qs_b + h * qs_h + t * qs_t;
            if (q_f16) {
                Row8<f16>::load(qr, gl * 8, false, qv[c]);
            } else {
                Row8<float>::load(qr, gl * 8, false, qv[c]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                qv[c][i] *= scale;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                qv[c][i] = 0.0f;
            }
        }
        slope[c] = alibi_slope(use_alibi, h, n_head_log2, m0, m1);
        mrow[c] = has_mask ? reinterpret_cast<const unsigned short*>(mask + (b % m3) * ms_b + (h % m2) * ms_h + t * ms_t)
                           : nullptr;
    }

    float m[NCOLS], l[NCOLS], acc[NCOLS][8];
#pragma unroll
    for (int c = 0; c < NCOLS; ++c) {
        m[c] = NEG_BIG;
        l[c] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[c][i] = 0.0f;
        }
    }

    const int k_begin = split * chunk;
    const int k_end = min(tk, k_begin + chunk);
    const char* kbase = k + b * ks_b + kvh * ks_h;
    const char* vbase = v + b * vs_b + kvh * vs_h;
    const bool vec = kv_vec != 0;

    for (int kb = k_begin; kb < k_end; kb += STEP) {
        typename Row8<KT>::Raw kr[U], vr[U];
        int key[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            key[u] = kb + (u * NW + warp) * KPW + grp;
            if (active && key[u] < k_end) {
                Row8<KT>::fetch(kbase + key[u] * ks_t, gl * 8, vec, kr[u]);
                Row8<KT>::fetch(vbase + key[u] * vs_t, gl * 8, vec, vr[u]);
            } else {
                kr[u] = {};
                vr[u] = {};
            }
        }
        float s[U][NCOLS];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[8];
            Row8<KT>::decode(kr[u], gl * 8, kf);
#pragma unroll
            for (int c = 0; c < NCOLS; ++c) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    dot = fmaf(qv[c][i], kf[i], dot);
                }
#pragma unroll
                for (int off = GL / 2; off > 0; off >>= 1) {
                    dot += __shfl_xor_sync(od::FULL_MASK, dot, off, 32);
                }
                s[u][c] = dot;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool in = key[u] < k_end;
#pragma unroll
            for (int c = 0; c < NCOLS; ++c) {
                float x = s[u][c];
                if (softcap != 0.0f) {
                    x = softcap * tanhf(x / softcap);
                }
                if (has_mask && in) {
                    const float mv = slope[c] * od::f16_to_f32(mrow[c][key[u]]);
                    x = is_neg_inf(mv) ? NEG_INF : x + mv;
                }
                s[u][c] = in ? x * LOG2E : NEG_INF;
            }
        }
#pragma unroll
        for (int c = 0; c < NCOLS; ++c) {
            float mx = s[0][c];
#pragma unroll
            for (int u = 1; u < U; ++u) {
                mx = fmaxf(mx, s[u][c]);
            }
            const float mn = fmaxf(m[c], mx);
            const float alpha = exp2f(m[c] - mn);
            m[c] = mn;
            l[c] *= alpha;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc[c][i] *= alpha;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u][c] = exp2f(s[u][c] - mn);
                l[c] += s[u][c];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float vf[8];
            Row8<KT>::decode(vr[u], gl * 8, vf);
#pragma unroll
            for (int c = 0; c < NCOLS; ++c) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[c][i] = fmaf(s[u][c], vf[i], acc[c][i]);
                }
            }
        }
    }

    // Merge the key groups of a warp (lanes l and l ^ off hold the same D values).
#pragma unroll
    for (int off = GL; off < 32; off <<= 1) {
#pragma unroll
        for (int c = 0; c < NCOLS; ++c) {
            const float mo = __shfl_xor_sync(od::FULL_MASK, m[c], off, 32);
            const float lo = __shfl_xor_sync(od::FULL_MASK, l[c], off, 32);
            const float mn = fmaxf(m[c], mo);
            const float a = exp2f(m[c] - mn);
            const float bb = exp2f(mo - mn);
            l[c] = l[c] * a + lo * bb;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float ao = __shfl_xor_sync(od::FULL_MASK, acc[c][i], off, 32);
                acc[c][i] = acc[c][i] * a + ao * bb;
            }
            m[c] = mn;
        }
    }

    __shared__ float s_ml[NW][NCOLS][2];
    __shared__ float s_acc[NW][NCOLS][D];
    if (lane < GL && active) {
#pragma unroll
        for (int c = 0; c < NCOLS; ++c) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                s_acc[warp][c][gl * 8 + i] = acc[c][i];
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < NCOLS; ++c) {
            s_ml[warp][c][0] = m[c];
            s_ml[warp][c][1] = l[c];
        }
    }
    __syncthreads();

    const long long rows = static_cast<long long>(gridDim.z) * tq * hq;
    for (int e = threadIdx.x; e < NCOLS * D; e += NW * 32) {
        const int c = e / D;
        const int d = e % D;
        const int cc = cg * NCOLS + c;
        if (cc >= ncols_total) {
            continue;
        }
        const int h = kvh * group + cc % group;
        const int t = cc / group;
        const long long r = (static_cast<long long>(b) * tq + t) * hq + h;
        float mx = s_ml[0][c][0];
#pragma unroll
        for (int w = 1; w < NW; ++w) {
            mx = fmaxf(mx, s_ml[w][c][0]);
        }
        float sum = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float f = exp2f(s_ml[w][c][0] - mx);
            sum += s_ml[w][c][1] * f;
            a += s_acc[w][c][d] * f;
        }
        ws_acc[(split * rows + r) * D + d] = a;
        if (d == 0) {
            ws_ml[split * rows + r] = make_float2(mx, sum);
        }
    }
}

// Merges the nsplit partials of each output row r = (b*Tq + t)*Hq + h, adds the sink
// of head h, normalizes: out f32 (B, Tq, Hq, D) contiguous. Grid: rows; any block size.
__global__ void fattn_combine(const float* __restrict__ ws_acc, const float2* __restrict__ ws_ml,
                              const float* __restrict__ sinks, float* __restrict__ out, int d_head, int rows,
                              int nsplit, int hq) {
    using namespace od_attn;
    const long long r = blockIdx.x;
    float mx = NEG_BIG;
    for (int s = 0; s < nsplit; ++s) {
        mx = fmaxf(mx, ws_ml[s * static_cast<long long>(rows) + r].x);
    }
    float sink = 0.0f;
    if (sinks != nullptr) {
        sink = sinks[r % hq] * LOG2E;
        mx = fmaxf(mx, sink);
    }
    for (int d = threadIdx.x; d < d_head; d += blockDim.x) {
        float sum = 0.0f, a = 0.0f;
        for (int s = 0; s < nsplit; ++s) {
            const long long i = s * static_cast<long long>(rows) + r;
            const float2 ml = ws_ml[i];
            const float f = exp2f(ml.x - mx);
            sum += ml.y * f;
            a += ws_acc[i * d_head + d] * f;
        }
        if (sinks != nullptr) {
            sum += exp2f(sink - mx);
        }
        out[r * d_head + d] = sum > 0.0f ? a / sum : 0.0f;
    }
}
