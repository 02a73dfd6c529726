// flash_attn_ext for many query rows (prefill): tensor cores, online softmax.
//
// Grid (ceil(Tq/BM), Hq, B), 128 threads (4 warps). A block takes BM query rows of
// one head: BM = 128 for D <= 128, each warp owning 32 rows as two m16 tiles, so
// that every K/V fragment read from shared memory feeds two mma.sync (shared
// memory bandwidth is what bounds this design); BM = 64 (16 rows a warp) for
// D = 256, where registers allow one tile. Q sits in shared memory for the whole
// block; K/V tiles of BN keys (64; 32 for D = 256) are double-buffered, stored as
// f16 (bf16 when K/V are bf16): cp.async for f16/bf16, dequantized through
// registers for f32/q8_0/q4_0. S = Q K^T and O += P V run on mma.sync m16n8k16
// with f32 accumulators; the softmax is online in f32 (log2 units), and P is
// rounded to 16 bits in registers, where the S accumulators already have the
// layout of the A operand of P V. Blocks start from the last query tile, the
// longest under a causal mask, so the short ones fill the tail (prefill_common.cuh's block_tile,
// which also holds the logits, the online softmax and the tile walk fattn_prefill_wgmma.cu shares).
//
// The loop is bound by instruction issue, not by the tensor cores, so the common
// tile (whole, f16/bf16 aligned K/V, mask block all zero or no mask, no softcap)
// takes a lean path: unchecked cp.async loads, ldmatrix on precomputed 32-bit
// shared addresses, the scale folded into one FFMA before ex2.approx, O rescaled
// only when some row's maximum grew. Diagonal/tail/softcap tiles take the general
// path (mask read per element through per-row pointers).
//
// `flags` (from fattn_mask_flags, one byte per (mask slice, q tile, kv tile)):
// 0 = the mask block is all -inf, the tile is skipped (a causal mask costs half);
// 2 = all zero, the mask is not read; 1 = read it. Null flags: no mask.
//
// Strides are in bytes: q, k, v and mask (t, h, b); mask heads / batches by modulo.
#include "prefill_common.cuh"

namespace od_prefill {

// A whole K or V tile of ROWS keys (all < tk) of f16/bf16 rows 16-byte aligned: only
// cp.async, no per-chunk checks. 128 threads, D / 8 chunks a row dividing 128 (D = 64,
// 128, 256): a thread's column is fixed and its rows step by 128 / (D / 8).
template <int D, int ROWS>
__device__ __forceinline__ void load_tile_full(unsigned short* dst, const char* base, long long rs, int kb, int tid) {
    constexpr int CPR = D / 8;
    constexpr int RPP = 128 / CPR;
    static_assert(128 % CPR == 0 && ROWS % RPP == 0, "full-tile loader: chunks must divide evenly");
    const int r0 = tid / CPR;
    const int c0 = tid % CPR;
    const char* src = base + static_cast<long long>(kb + r0) * rs + c0 * 16;
    const unsigned sa = od::smem_addr(dst + r0 * (D + 8) + c0 * 8);
#pragma unroll
    for (int it = 0; it < ROWS / RPP; ++it) {
        od::cp_async16(sa + it * RPP * (D + 8) * 2, src + it * RPP * rs);
    }
}

}  // namespace od_prefill

template <int D, typename KT>
__global__ void __launch_bounds__(128, 2) fattn_prefill(
    PREFILL_PARAMS) {
    od::grid_enter();
    using namespace od_attn;
    constexpr bool BF = od::same_v<KT, bf16>;
    constexpr int MT = D > 128 ? 1 : 2;  // m16 tiles a warp
    constexpr int BM = 4 * 16 * MT;
    constexpr int BN = D > 128 ? 32 : 64;
    constexpr int SR = D + 8;            // shared row stride, in 16-bit units (conflict-free ldmatrix)
    constexpr int KSTEPS = D / 16;
    constexpr int NT = BN / 8;           // n-tiles of S
    constexpr int DT = D / 8;            // n-tiles of O

    // Q (BM x SR), then two stages of K (BN x SR) and V (BN x SR)
    extern __shared__ __align__(16) unsigned short smem[];
    unsigned short* sQ = smem;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    int qt, h, b;
    od_prefill::block_tile(qt, h, b);
    const int q0 = qt * BM;
    const int kvh = h / group;

    // -- Q tile -> shared memory (16-bit), rows past tq zero; read after the loop's first barrier --
    {
        const char* qbase = q + b * qs_b + h * qs_h;
        for (int c = tid; c < BM * (D / 8); c += 128) {
            const int row = c / (D / 8);
            const int col = c % (D / 8);
            const int t = q0 + row;
            store_q8<BF>(od::smem_addr(sQ + row * SR + col * 8), t < tq ? qbase + t * qs_t : nullptr, col * 8, q_f16);
        }
    }

    const unsigned char* fl = od_prefill::tile_flags(flags, b, h, m2, m3, qt, n_kv_tiles);
    const od_prefill::Logits lg = od_prefill::logits_of(mask, ms_t, ms_h, ms_b, m2, m3, b, h, scale, softcap,
                                                        use_alibi, m0, m1, n_head_log2, tq, tk);
    const char* kbase = k + b * ks_b + kvh * ks_h;
    const char* vbase = v + b * vs_b + kvh * vs_h;
    const bool vec = kv_vec != 0;

    auto stage_k = [&](int st) { return smem + BM * SR + st * 2 * BN * SR; };
    constexpr bool NATIVE = od::same_v<KT, f16> || BF;
    constexpr bool FULL_OK = NATIVE && 128 % (D / 8) == 0;
    auto load_kv = [&](int j, int st) {
        if constexpr (FULL_OK) {
            if (vec && (j + 1) * BN <= tk) {  // the common case: straight cp.async, no checks
                od_prefill::load_tile_full<D, BN>(stage_k(st), kbase, ks_t, j * BN, tid);
                od_prefill::load_tile_full<D, BN>(stage_k(st) + BN * SR, vbase, vs_t, j * BN, tid);
                return;
            }
        }
        load_tile<D, BN, 128, KT>(stage_k(st), kbase, ks_t, j * BN, tk, vec, tid);
        load_tile<D, BN, 128, KT>(stage_k(st) + BN * SR, vbase, vs_t, j * BN, tk, vec, tid);
    };

    float o[MT][DT][4];
    float mrun[MT][2], lrun[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
        }
        mrun[mt][0] = mrun[mt][1] = NEG_BIG;
        lrun[mt][0] = lrun[mt][1] = 0.0f;
    }
    const int g = lane >> 2;
    const int tq4 = lane & 3;
    const int wrow = warp * 16 * MT;  // this warp's first row in the tile
    // Byte addresses in shared memory of what this lane hands ldmatrix: Q rows wrow + (lane & 15),
    // column half lane >> 4; K (non-transposed B operand) rows (lane >> 4) * 8 + (lane & 7), column
    // half (lane >> 3) & 1; V (transposed) rows lane & 15, column half lane >> 4.
    const unsigned q_sa = od::smem_addr(sQ) + ((wrow + (lane & 15)) * SR + (lane >> 4) * 8) * 2;
    const unsigned kv_sa = od::smem_addr(smem) + BM * SR * 2;
    const unsigned k_lane = (((lane >> 4) * 8 + (lane & 7)) * SR + ((lane >> 3) & 1) * 8) * 2;
    const unsigned v_lane = ((lane & 15) * SR + (lane >> 4) * 8) * 2;

    int j = od_prefill::next_tile(fl, -1, n_kv_tiles, lane);
    if (j < n_kv_tiles) {
        load_kv(j, 0);
    }
    od::cp_async_commit();
    int st = 0;
    while (j < n_kv_tiles) {
        const int jn = od_prefill::next_tile(fl, j, n_kv_tiles, lane);
        od::cp_async_wait<0>();  // tile j has landed (this thread's copies) ...
        __syncthreads();     // ... everyone's (and Q), and everyone is done with the other stage
        if (jn < n_kv_tiles) {
            load_kv(jn, st ^ 1);
        }
        od::cp_async_commit();

        // ldmatrix addresses (32-bit shared): this lane's row/column offsets plus compile-time steps
        const unsigned k_sa = kv_sa + st * (2 * BN * SR * 2) + k_lane;
        const unsigned v_sa = kv_sa + st * (2 * BN * SR * 2) + BN * SR * 2 + v_lane;
        const int kb = j * BN;
        const int flag = fl != nullptr ? fl[j] : 2;  // loaded before S = Q K^T, which hides its latency

        // S = Q K^T (MT x 16 rows x BN keys per warp); each K fragment feeds MT mma
        float s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
            }
        }
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                ldsm_x4(q_sa + (mt * 16 * SR + kk * 16) * 2, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                unsigned r0, r1, r2, r3;
                ldsm_x4(k_sa + (np * 16 * SR + kk * 16) * 2, r0, r1, r2, r3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<BF>(s[mt][2 * np], a[mt], r0, r1);
                    mma_16816<BF>(s[mt][2 * np + 1], a[mt], r2, r3);
                }
            }
        }

        // logits in log2 units are s * mul (prefill_common.cuh's raw_tile), then the online softmax
        float mul = lg.mul2;
        if (!od_prefill::raw_tile(lg, flag, kb, BN)) {
            mul = 1.0f;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                od_prefill::to_log2<NT>(s[mt], lg, flag, kb, q0 + wrow + mt * 16, g, tq4);
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            od_prefill::softmax_tile<NT, DT>(s[mt], mrun[mt], lrun[mt], o[mt], mul);
        }

        // O += P V: P's A fragments straight from the S accumulators; each V fragment feeds MT mma
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = pack2<BF>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = pack2<BF>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = pack2<BF>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = pack2<BF>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned r0, r1, r2, r3;
                ldsm_x4_trans(v_sa + (kk * 16 * SR + dp * 16) * 2, r0, r1, r2, r3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<BF>(o[mt][2 * dp], a[mt], r0, r1);
                    mma_16816<BF>(o[mt][2 * dp + 1], a[mt], r2, r3);
                }
            }
        }
        j = jn;
        st ^= 1;
    }
    od::cp_async_wait<0>();

    // finish: sum the quad's partial sums, add the sink, normalize, write (B, Tq, Hq, D)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        od_prefill::write_rows<D>(o[mt], mrun[mt], lrun[mt], sinks, out, b, h, hq, tq, q0 + wrow + mt * 16, g, tq4);
    }
}
