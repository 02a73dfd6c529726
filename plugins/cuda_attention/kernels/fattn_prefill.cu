// flash_attn_ext for many query rows (prefill): tensor cores, online softmax.
//
// Grid (ceil(Tq/64), Hq, B), 128 threads: a block takes 64 query rows of one head,
// each warp 16 of them. K/V tiles of BN keys (64; 32 for D = 256) are staged in
// shared memory as f16 (bf16 when K/V are bf16), two stages deep for D <= 128
// (cp.async for f16/bf16, dequantized through registers for f32/q8_0/q4_0).
// S = Q K^T and O += P V run on mma.sync m16n8k16 with f32 accumulators; the
// softmax is online in f32 (log2 units); P is rounded to 16 bits for P V.
//
// `flags` (from fattn_mask_flags, one byte per (mask slice, q tile, kv tile)):
// 0 = the mask block is all -inf, the tile is skipped (a causal mask costs half);
// 2 = all zero, the mask is not read; 1 = read it. Null flags: no mask.
//
// Strides are in bytes: q, k, v and mask (t, h, b); mask heads / batches by modulo.
#include "attn_common.cuh"

namespace {

template <class A, class B>
struct same_type {
    static constexpr bool value = false;
};
template <class A>
struct same_type<A, A> {
    static constexpr bool value = true;
};

// One tile of BN rows x D values into shared memory (row stride D + 8 16-bit
// units); rows past tk are zeros.
template <int D, int BN, typename KT, bool BF>
__device__ __forceinline__ void load_tile(unsigned short* dst, const char* base, long long rs, int kb, int tk, bool vec,
                                          int tid) {
    using namespace od_attn;
    constexpr bool NATIVE = same_type<KT, f16>::value || same_type<KT, bf16>::value;
    constexpr int CPR = D / 8;
    constexpr int TOTAL = BN * CPR;
    static_assert(TOTAL % 128 == 0, "tile chunks must divide among 128 threads");
#pragma unroll
    for (int it = 0; it < TOTAL / 128; ++it) {
        const int c = tid + it * 128;
        const int row = c / CPR;
        const int col = c % CPR;
        const int key = kb + row;
        const unsigned sa = smem_addr(dst + row * (D + 8) + col * 8);
        if (key >= tk) {
            st_shared16(sa, 0u, 0u, 0u, 0u);
            continue;
        }
        const char* src = base + key * rs;
        if constexpr (NATIVE) {
            if (vec) {
                cp_async16(sa, src + col * 16);
            } else {
                const unsigned short* p = reinterpret_cast<const unsigned short*>(src) + col * 8;
                unsigned w[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    w[i] = static_cast<unsigned>(p[2 * i]) | (static_cast<unsigned>(p[2 * i + 1]) << 16);
                }
                st_shared16(sa, w[0], w[1], w[2], w[3]);
            }
        } else {
            float f[8];
            Row8<KT>::load(src, col * 8, vec, f);
            st_shared16(sa, pack2<BF>(f[0], f[1]), pack2<BF>(f[2], f[3]), pack2<BF>(f[4], f[5]),
                        pack2<BF>(f[6], f[7]));
        }
    }
}

}  // namespace

template <int D, typename KT>
__global__ void __launch_bounds__(128) fattn_prefill(
    const char* __restrict__ q, const char* __restrict__ k, const char* __restrict__ v,
    const char* __restrict__ mask, const float* __restrict__ sinks, float* __restrict__ out,
    const unsigned char* __restrict__ flags,
    int q_f16, int tq, int hq, int tk, int group,
    long long qs_t, long long qs_h, long long qs_b,
    long long ks_t, long long ks_h, long long ks_b,
    long long vs_t, long long vs_h, long long vs_b,
    int m2, int m3, long long ms_t, long long ms_h, long long ms_b,
    float scale, float softcap, int use_alibi, float m0, float m1, int n_head_log2,
    int kv_vec, int n_kv_tiles) {
    using namespace od_attn;
    constexpr bool BF = same_type<KT, bf16>::value;
    constexpr int BM = 64;
    constexpr int BN = D > 128 ? 32 : 64;
    constexpr int STAGES = D > 128 ? 1 : 2;
    constexpr bool QREG = D <= 128;  // Q fragments in registers (else read from shared memory each tile)
    constexpr int SR = D + 8;        // shared row stride, in 16-bit units (conflict-free ldmatrix)
    constexpr int KSTEPS = D / 16;
    constexpr int NT = BN / 8;       // n-tiles of S
    constexpr int DT = D / 8;        // n-tiles of O
    const float NEG_INF = -__int_as_float(0x7f800000);
    static_assert(!QREG || STAGES == 2, "Q aliases the second stage");

    extern __shared__ __align__(16) unsigned short smem[];
    // stage s: K at smem + s*2*BN*SR, V right after; Q aliases stage 1 when it lives in
    // registers (it is read once, before stage 1 is first written), else follows the stages.
    unsigned short* sQ = QREG ? smem + 2 * BN * SR : smem + STAGES * 2 * BN * SR;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int q0 = blockIdx.x * BM;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int kvh = h / group;

    // -- Q tile -> shared memory (16-bit), rows past tq zero --
    {
        const char* qbase = q + b * qs_b + h * qs_h;
        for (int c = tid; c < BM * (D / 8); c += 128) {
            const int row = c / (D / 8);
            const int col = c % (D / 8);
            const int t = q0 + row;
            float f[8];
            if (t < tq) {
                if (q_f16) {
                    Row8<f16>::load(qbase + t * qs_t, col * 8, false, f);
                } else {
                    Row8<float>::load(qbase + t * qs_t, col * 8, false, f);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    f[i] = 0.0f;
                }
            }
            st_shared16(smem_addr(sQ + row * SR + col * 8), pack2<BF>(f[0], f[1]), pack2<BF>(f[2], f[3]),
                        pack2<BF>(f[4], f[5]), pack2<BF>(f[6], f[7]));
        }
    }
    __syncthreads();
    unsigned qf[QREG ? KSTEPS : 1][4];
    if constexpr (QREG) {
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            ldsm_x4(smem_addr(sQ + (warp * 16 + (lane & 15)) * SR + kk * 16 + (lane >> 4) * 8), qf[kk][0], qf[kk][1],
                    qf[kk][2], qf[kk][3]);
        }
        __syncthreads();
    }

    const unsigned char* fl =
        flags != nullptr ? flags + ((static_cast<long long>(b % m3) * m2 + h % m2) * gridDim.x + blockIdx.x) * n_kv_tiles
                         : nullptr;
    const char* mbase = mask != nullptr ? mask + (b % m3) * ms_b + (h % m2) * ms_h : nullptr;
    const float slope = alibi_slope(use_alibi, h, n_head_log2, m0, m1);
    const char* kbase = k + b * ks_b + kvh * ks_h;
    const char* vbase = v + b * vs_b + kvh * vs_h;
    const bool vec = kv_vec != 0;

    auto flag_of = [&](int j) -> int { return fl != nullptr ? fl[j] : 2; };
    auto next_tile = [&](int j) -> int {
        ++j;
        while (j < n_kv_tiles && flag_of(j) == 0) {
            ++j;
        }
        return j;
    };
    auto stage_k = [&](int st) { return smem + st * 2 * BN * SR; };
    auto stage_v = [&](int st) { return smem + st * 2 * BN * SR + BN * SR; };
    auto load_kv = [&](int j, int st) {
        load_tile<D, BN, KT, BF>(stage_k(st), kbase, ks_t, j * BN, tk, vec, tid);
        load_tile<D, BN, KT, BF>(stage_v(st), vbase, vs_t, j * BN, tk, vec, tid);
    };

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    }
    float mrun[2] = {NEG_BIG, NEG_BIG};
    float lrun[2] = {0.0f, 0.0f};
    const int g = lane >> 2;
    const int tq4 = lane & 3;
    const int row0 = q0 + warp * 16 + g;
    const int row1 = row0 + 8;

    int j = next_tile(-1);
    if constexpr (STAGES == 2) {
        if (j < n_kv_tiles) {
            load_kv(j, 0);
        }
        cp_async_commit();
    }
    int st = 0;
    while (j < n_kv_tiles) {
        const int jn = next_tile(j);
        if constexpr (STAGES == 2) {
            if (jn < n_kv_tiles) {
                load_kv(jn, st ^ 1);
            }
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            load_kv(j, 0);
            cp_async_commit();
            cp_async_wait<0>();
        }
        __syncthreads();

        const unsigned short* Ks = stage_k(st);
        const unsigned short* Vs = stage_v(st);
        const int kb = j * BN;

        // S = Q K^T (16 rows x BN keys per warp)
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            unsigned a[4];
            if constexpr (QREG) {
                a[0] = qf[kk][0];
                a[1] = qf[kk][1];
                a[2] = qf[kk][2];
                a[3] = qf[kk][3];
            } else {
                ldsm_x4(smem_addr(sQ + (warp * 16 + (lane & 15)) * SR + kk * 16 + (lane >> 4) * 8), a[0], a[1], a[2],
                        a[3]);
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned r0, r1, r2, r3;
                ldsm_x4(smem_addr(Ks + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * SR + kk * 16 + ((lane >> 3) & 1) * 8),
                        r0, r1, r2, r3);
                mma_16816<BF>(s[2 * np], a, r0, r1);
                mma_16816<BF>(s[2 * np + 1], a, r2, r3);
            }
        }

        // scale, softcap, mask (+ ALiBi), keys past tk; to log2 units
        const int flag = flag_of(j);
        const bool tail = kb + BN > tk;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = e < 2 ? row0 : row1;
                const int key = kb + nt * 8 + 2 * tq4 + (e & 1);
                float x = s[nt][e] * scale;
                if (softcap != 0.0f) {
                    x = softcap * tanhf(x / softcap);
                }
                if (flag == 1 && row < tq && key < tk) {
                    const float mv = slope * od::f16_to_f32(
                                                 *reinterpret_cast<const unsigned short*>(mbase + row * ms_t + key * 2LL));
                    x = is_neg_inf(mv) ? NEG_INF : x + mv;
                }
                if (tail && key >= tk) {
                    x = NEG_INF;
                }
                s[nt][e] = x * LOG2E;
            }
        }

        // online softmax: rows row0 (e = 0, 1) and row1 (e = 2, 3); a row spans the 4 lanes of a quad
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
        const float mn0 = fmaxf(mrun[0], mx0);
        const float mn1 = fmaxf(mrun[1], mx1);
        const float a0 = exp2f(mrun[0] - mn0);
        const float a1 = exp2f(mrun[1] - mn1);
        mrun[0] = mn0;
        mrun[1] = mn1;
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - mn0);
            s[nt][1] = exp2f(s[nt][1] - mn0);
            s[nt][2] = exp2f(s[nt][2] - mn1);
            s[nt][3] = exp2f(s[nt][3] - mn1);
            ls0 += s[nt][0] + s[nt][1];
            ls1 += s[nt][2] + s[nt][3];
        }
        lrun[0] = lrun[0] * a0 + ls0;
        lrun[1] = lrun[1] * a1 + ls1;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= a0;
            o[dt][1] *= a0;
            o[dt][2] *= a1;
            o[dt][3] *= a1;
        }

        // O += P V
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned a[4];
            a[0] = pack2<BF>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<BF>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<BF>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<BF>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned r0, r1, r2, r3;
                ldsm_x4_trans(smem_addr(Vs + (kk * 16 + (lane & 15)) * SR + dp * 16 + (lane >> 4) * 8), r0, r1, r2, r3);
                mma_16816<BF>(o[2 * dp], a, r0, r1);
                mma_16816<BF>(o[2 * dp + 1], a, r2, r3);
            }
        }
        __syncthreads();
        j = jn;
        if constexpr (STAGES == 2) {
            st ^= 1;
        }
    }
    if constexpr (STAGES == 2) {
        cp_async_wait<0>();
    }

    // finish: sum the quad's partial sums, add the sink, normalize, write (B, Tq, Hq, D)
    float l0 = lrun[0], l1 = lrun[1];
    l0 += __shfl_xor_sync(od::FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(od::FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(od::FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(od::FULL_MASK, l1, 2);
    float sc0 = 1.0f, sc1 = 1.0f;
    if (sinks != nullptr) {
        const float sk = sinks[h] * LOG2E;
        const float mf0 = fmaxf(mrun[0], sk);
        const float mf1 = fmaxf(mrun[1], sk);
        sc0 = exp2f(mrun[0] - mf0);
        sc1 = exp2f(mrun[1] - mf1);
        l0 = l0 * sc0 + exp2f(sk - mf0);
        l1 = l1 * sc1 + exp2f(sk - mf1);
    }
    const float inv0 = l0 > 0.0f ? sc0 / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? sc1 / l1 : 0.0f;
    if (row0 < tq) {
        float* y = out + ((static_cast<long long>(b) * tq + row0) * hq + h) * D + 2 * tq4;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            *reinterpret_cast<float2*>(y + dt * 8) = make_float2(o[dt][0] * inv0, o[dt][1] * inv0);
        }
    }
    if (row1 < tq) {
        float* y = out + ((static_cast<long long>(b) * tq + row1) * hq + h) * D + 2 * tq4;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            *reinterpret_cast<float2*>(y + dt * 8) = make_float2(o[dt][2] * inv1, o[dt][3] * inv1);
        }
    }
}

// One byte per (mask slice z = i3*m2 + i2, q tile i, kv tile j): 0 if every mask value
// of the block (rows < tq, columns < tk) is -inf, 2 if every one is zero, else 1.
// Grid (n_kv_tiles, n_q_tiles, m3*m2), 128 threads.
__global__ void __launch_bounds__(128) fattn_mask_flags(const char* __restrict__ mask, unsigned char* __restrict__ flags,
                                                        int tq, int tk, int bm, int bn, int m2, long long ms_t,
                                                        long long ms_h, long long ms_b) {
    const int j = blockIdx.x;
    const int i = blockIdx.y;
    const int z = blockIdx.z;
    const char* base = mask + (z / m2) * ms_b + (z % m2) * ms_h;
    const int rows = min(bm, tq - i * bm);
    const int cols = min(bn, tk - j * bn);
    int finite = 0, nonzero = 0;
    for (int e = threadIdx.x; e < rows * cols; e += 128) {
        const int r = e / cols;
        const int c = e % cols;
        const unsigned short bits =
            *reinterpret_cast<const unsigned short*>(base + (static_cast<long long>(i) * bm + r) * ms_t +
                                                     (static_cast<long long>(j) * bn + c) * 2);
        finite |= bits != 0xfc00u;
        nonzero |= (bits & 0x7fffu) != 0;
    }
    finite = __syncthreads_or(finite);
    nonzero = __syncthreads_or(nonzero);
    if (threadIdx.x == 0) {
        flags[(static_cast<long long>(z) * gridDim.y + i) * gridDim.x + j] = !finite ? 0 : (nonzero ? 1 : 2);
    }
}
