// flash_attn_ext for few query rows against a long KV (decode): split-K on tensor cores.
//
// Grid (nsplit, Hkv * ncg, B), 128 threads (4 warps). A block takes one KV head,
// one slice of `chunk` keys (a multiple of 64) and 16 query columns: a column is
// one (query row t, query head h) of the heads sharing that KV head (GQA), so each
// K/V byte is read once for all of them. The 16 columns are the M rows of
// mma.sync m16n8k16 (columns past group * Tq are zeros, never written): S = Q K^T
// and O += P V run on tensor cores with f32 accumulators, which leaves the SM
// free to keep the memory system busy. K/V tiles of 64 keys stream through
// STAGES shared-memory stages (cp.async for f16/bf16, so several tiles per block
// are in flight); each warp takes 16 keys of a tile and keeps its own online
// softmax (f32, log2 units). At the end the warps merge through shared memory.
//
// With one split (gridDim.x == 1) the block holds the whole softmax of its
// columns: it adds the sink, normalizes and writes `out` (B, Tq, Hq, D) f32.
// With several, each block writes its partial (max, sum, acc[D]) per column to
// the workspace and counts itself done on its (batch, KV head, column group)
// counter; the last block of the group to finish merges the nsplit partials,
// adds the sink and writes `out`, then sets the counter back to 0 for the next
// launch (the counters start zeroed at bind). One launch either way: a second
// combine kernel costs ~2-3 us in a CUDA graph, more than short-KV attention.
//
// Strides are in bytes: q (t, h, b), k and v (t, h, b), mask (t, h, b) with
// mask heads / batches broadcast by modulo (m2, m3).
//
// Fused with the decode step's rope and cache writes (ROPE 1 normal, 2 neox; one query row a
// sequence; the parameters after kv_vec, unused otherwise): q is the projection's f32 rows,
// rotated by the block into shared memory (the last K/V stage, free until the tile loop) before its
// fragments are built; the new K row of
// sequence b (k_new, rotated) and V row (v_new) are written into the caches at row new_idx[b], and
// the block whose slice holds that row (key j of the window, j = new_idx[b] - row0 - b * rows_b)
// puts them into its shared tile in place of the row it loaded, so no block reads the row before
// it is written (split 0 writes a row outside the window). A row id outside [0, new_rows) (the rows
// both caches have) is written in neither and is recorded in the error word (od::index_ok); the
// unfused kernel is passed a null word.
// Angles: rope_common.cuh, as the rope kernels compute them.
//
// The order of the loads keeps the block's chain of dependent memory round trips short, which is what
// a decode step at short KV waits on (a 64-key tile a block, a few KiB; docs/cuda_attention.md):
// - the mask values of a tile travel with its K/V copies, in the same cp.async group, into the stages'
//   row padding (unused by ldmatrix: 16 bytes a row, 128 rows a stage = 16 columns x 64 keys), instead
//   of a load after the wait for the tile;
// - fused, every global load of the rope part (row id, position, the block's q pairs, the new K and V
//   pairs) is issued before any is used, a thread a (pair, column), all 4 warps: one round trip where
//   the pair loop took one a column, one warp doing it;
// - kv_early (the host sets it for the fused kernel only, specs/flash.py): the first K/V (and mask)
//   copies are issued before the wait for the kernel ahead (PDL). Safe because the copies read only
//   (a) the mask and the caches' rows other than the new one, which no kernel of this run writes (the
//   mask is a graph input, uploaded before the run; the caches are states, set_rows' destinations read
//   as leaves, written by this kernel in earlier runs), and (b) the new row itself, which the kernel
//   writes after the wait and puts into its shared tile in place of whatever the copy brought.
#include "attn_common.cuh"
#include "rope_common.cuh"

// The factor that turns a column's merged (max, sum, acc) into its output: the sink of head h
// joins the softmax denominator (ggml's attention sinks); a column with nothing to attend gives 0.
__device__ __forceinline__ float finish_scale(float mx, float sum, const float* sinks, int h) {
    float m = mx, sink = 0.0f;
    if (sinks != nullptr) {
        sink = sinks[h] * od_attn::LOG2E;
        m = fmaxf(m, sink);
    }
    const float f = exp2f(mx - m);
    float total = sum * f;
    if (sinks != nullptr) {
        total += exp2f(sink - m);
    }
    return total == 0.0f ? 0.0f : f / total;  // a NaN total (a NaN or +inf logit or sink): the row NaN
}

// Dynamic shared memory: the K/V stages (specs/flash.py decode_smem); the fused variant adds after them the
// new K and V rows (16-bit, as the tiles hold them). Its rotated q (16 columns x D, f32) lives in the last
// stage, which no copy fills before the tile loop (the first STAGES - 1 tiles go to the others; the loop's
// first barrier, which every thread reaches after building its q fragments, comes before the copy of tile
// STAGES - 1), so that the fused kernel fits as many blocks an SM as the unfused one at D = 64 (4 on the H200).
template <int D>
__host__ __device__ constexpr int decode_stage_smem() {
    return (D > 128 ? 2 : 3) * 2 * 64 * (D + 8) * 2;
}

// A value of a new K/V row: into the cache as its type stores it, and into `tile` (shared) as the
// K/V tiles hold that stored value (f16, or bf16 for bf16 K/V), as load_tile would have.
template <typename KT>
__device__ __forceinline__ void put_new(KT* cache, unsigned short* tile, float x) {
    KT stored;
    od::store(&stored, x);
    *cache = stored;
    const float y = od::load(&stored);
    *tile = od::same_v<KT, od::bf16> ? od::f32_to_bf16(y) : od::f32_to_f16(y);
}

template <int D, typename KT, int ROPE = 0, typename IT = int>
__global__ void __launch_bounds__(128, D == 64 ? 4 : 2) fattn_decode(
    const char* __restrict__ q, const char* __restrict__ k, const char* __restrict__ v,
    const char* __restrict__ mask, float* __restrict__ ws_acc, float2* __restrict__ ws_ml,
    int* __restrict__ counters, const float* __restrict__ sinks, float* __restrict__ out,
    int q_f16, int tq, int hq, int tk, int group, int ncg,
    long long qs_t, long long qs_h, long long qs_b,
    long long ks_t, long long ks_h, long long ks_b,
    long long vs_t, long long vs_h, long long vs_b,
    int m2, int m3, long long ms_t, long long ms_h, long long ms_b,
    float scale, float softcap, int use_alibi, float m0, float m1, int n_head_log2,
    int chunk, int kv_vec, int mask_vec, int kv_early,
    const int* __restrict__ rope_pos, const float* __restrict__ rope_ff, const char* __restrict__ k_new,
    const char* __restrict__ v_new, const IT* __restrict__ new_idx, char* __restrict__ k_cache,
    char* __restrict__ v_cache, long long kn_b, long long kn_h, long long vn_b, long long kc_t, long long vc_t,
    long long row0, long long rows_b, long long new_rows, ROPE_PARAMS, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter_later();  // kv_early: after the first K/V copies (header)
    const bool early = kv_early != 0;
    if (!early) {
        od::grid_enter();
    }
    using namespace od_attn;
    constexpr bool BF = od::same_v<KT, bf16>;
    constexpr int BN = 64;                    // keys a tile, 16 a warp
    constexpr int STAGES = D > 128 ? 2 : 3;   // tiles in flight (shared memory: STAGES * 2 * BN * SR * 2 bytes)
    constexpr int SR = D + 8;                 // shared row stride in 16-bit units (conflict-free ldmatrix)
    constexpr int KSTEPS = D / 16;
    constexpr int DT = D / 8;
    constexpr int OR = D + 4;                 // row stride of the f32 merge buffer
    static_assert(decode_stage_smem<D>() == STAGES * 2 * BN * SR * 2, "decode_stage_smem is the stages' size");
    const float NEG_INF = -__int_as_float(0x7f800000);

    extern __shared__ __align__(16) unsigned short smem[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int tq4 = lane & 3;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y / ncg;
    const int cg = blockIdx.y % ncg;
    const int b = blockIdx.z;
    const int ncols = group * tq;
    const int k_begin = split * chunk;
    const int k_end = min(tk, k_begin + chunk);
    const int n_tiles = (k_end - k_begin + BN - 1) / BN;
    const char* kbase = k + b * ks_b + kvh * ks_h;
    const char* vbase = v + b * vs_b + kvh * vs_h;
    const bool vec = kv_vec != 0;

    auto stage_k = [&](int st) { return smem + st * 2 * BN * SR; };
    auto stage_v = [&](int st) { return smem + (st * 2 + 1) * BN * SR; };
    // Slot p (0..127) of stage st, the padding after row p of its K then V tile, holds the mask
    // values of column p % 16, keys 8 * (p / 16) .. + 7 of the tile (so that the 8 lanes of a fragment
    // row group read 8 consecutive rows: no bank conflicts). Thread tid copies slot tid.
    static_assert(BN / 8 * 16 == 128, "a mask slot a thread: 16 columns x 64 keys in 16-byte slots");
    auto mask_slot = [&](int st, int p) { return (p < BN ? stage_k(st) + p * SR : stage_v(st) + (p - BN) * SR) + D; };
    const unsigned short* mslot = nullptr;  // this thread's slot's mask row (null: no mask, or no column)
    if (mask != nullptr) {
        const int cc = cg * 16 + tid % 16;
        if (cc < ncols) {
            const int h = kvh * group + cc % group;
            mslot = reinterpret_cast<const unsigned short*>(mask + (b % m3) * ms_b + (h % m2) * ms_h +
                                                            (cc / group) * ms_t);
        }
    }
    auto load_kv = [&](int i) {  // tile i of the slice; keys past k_end are zeros
        const int st = i % STAGES;
        load_tile<D, BN, 128, KT>(stage_k(st), kbase, ks_t, k_begin + i * BN, k_end, vec, tid);
        load_tile<D, BN, 128, KT>(stage_v(st), vbase, vs_t, k_begin + i * BN, k_end, vec, tid);
        if (mslot != nullptr) {  // keys past k_end: never read (their logits are -inf whatever the mask)
            const int key0 = k_begin + i * BN + tid / 16 * 8;
            unsigned short* dst = mask_slot(st, tid);
            if (mask_vec && key0 + 8 <= k_end) {
                od::cp_async16(od::smem_addr(dst), mslot + key0);
            } else {
                for (int e = 0; e < 8 && key0 + e < k_end; ++e) {
                    dst[e] = mslot[key0 + e];
                }
            }
        }
    };
    // start the K/V stream first; the Q fragments are built while it flies
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < n_tiles) {
            load_kv(i);
        }
        od::cp_async_commit();
    }
    if (early) {
        od::grid_enter();
    }

    // Fused: rotate q into shared memory (a thread a pair of a column, all 4 warps, every global load
    // issued before any is used: one round trip) and, in the block that owns it, the new K row; convert
    // the new V row; write both rows to the caches. own_tile / own_row: where the new row sits in this slice.
    int own_tile = -1, own_row = 0;
    const char* q_src = q;  // what the fragments read: q, or the rotated q (f32) in shared memory
    if constexpr (ROPE != 0) {
        const od_rope::RopeParams rp = ROPE_STRUCT;
        static_assert(STAGES >= 3 && 16 * D * 4 <= 2 * BN * SR * 2, "q_rot fits a stage no copy fills yet");
        float* q_rot = reinterpret_cast<float*>(stage_k(STAGES - 1));  // [16][D]
        unsigned short* kv_rows = smem + decode_stage_smem<D>() / 2;  // new K row, new V row
        const long long cache_row = static_cast<long long>(new_idx[b]);
        const int pos = rope_pos[b];
        const int nc = min(16, ncols - cg * 16);
        const float* kn = reinterpret_cast<const float*>(k_new + b * kn_b + kvh * kn_h);
        const float* vn = reinterpret_cast<const float*>(v_new + b * vn_b) + kvh * D;
        // this thread's pair and the columns it rotates
        constexpr int PAIRS = D / 2;
        constexpr int CPP = 128 / PAIRS;  // columns a pass of the 128 threads
        constexpr int PASSES = 16 / CPP;
        static_assert(128 % PAIRS == 0, "the threads take whole passes of pairs");
        const int c0 = tid / PAIRS;
        float qx[PASSES][2], kx[2] = {0.0f, 0.0f}, vx[2] = {0.0f, 0.0f};
        int pe0, pe1, pfi;
        bool prot;
        od_rope::pair_of<ROPE == 2>(tid % PAIRS, rp, pe0, pe1, pfi, prot);
#pragma unroll
        for (int it = 0; it < PASSES; ++it) {
            const int cc = c0 + it * CPP;
            if (cc < nc) {
                const int h = kvh * group + (cg * 16 + cc) % group;
                const float* x = reinterpret_cast<const float*>(q + b * qs_b + h * qs_h);
                qx[it][0] = x[pe0];
                qx[it][1] = x[pe1];
            }
        }
        if (c0 == 0) {  // the new rows' pair: V by the same elements (the pairs cover the row once)
            kx[0] = kn[pe0];
            kx[1] = kn[pe1];
            vx[0] = vn[pe0];
            vx[1] = vn[pe1];
        }
        const bool row_ok = od::index_ok(cache_row, new_rows, err_word, err_tag, b);
        const long long j = cache_row - row0 - b * rows_b;
        const bool in_window = row_ok && j >= 0 && j < tk;
        // every column group alike; a bad row id: no block
        const bool writes = row_ok && (in_window ? j >= k_begin && j < k_end : split == 0);
        if (in_window && writes) {
            own_tile = static_cast<int>(j - k_begin) / BN;
            own_row = static_cast<int>(j - k_begin) % BN;
        }
        KT* kc = reinterpret_cast<KT*>(k_cache + cache_row * kc_t) + kvh * D;
        KT* vc = reinterpret_cast<KT*>(v_cache + cache_row * vc_t) + kvh * D;
        float c = 1.0f, sn = 0.0f;
        if (prot) {
            od_rope::cos_sin_of(pfi, pos, rope_ff, rp, c, sn);
        }
#pragma unroll
        for (int it = 0; it < PASSES; ++it) {
            const int cc = c0 + it * CPP;
            if (cc < nc) {
                const float x0 = qx[it][0], x1 = qx[it][1];
                q_rot[cc * D + pe0] = prot ? x0 * c - x1 * sn : x0;
                q_rot[cc * D + pe1] = prot ? x0 * sn + x1 * c : x1;
            }
        }
        if (c0 == 0 && writes) {
            put_new(kc + pe0, kv_rows + pe0, prot ? kx[0] * c - kx[1] * sn : kx[0]);
            put_new(kc + pe1, kv_rows + pe1, prot ? kx[0] * sn + kx[1] * c : kx[1]);
            put_new(vc + pe0, kv_rows + D + pe0, vx[0]);
            put_new(vc + pe1, kv_rows + D + pe1, vx[1]);
        }
        __syncthreads();
        q_src = reinterpret_cast<const char*>(q_rot);
    }

    // This lane's fragment rows g and g + 8 are columns cg*16 + g (+ 8): whether they read the mask
    // (their values come through the mask slots), their ALiBi slope and the Q A-fragments, read
    // straight from global memory (fused: from the rotated q in shared memory).
    bool mcol[2];
    float slope2[2];
    unsigned qa[KSTEPS][4];
    {
        const char* qrow[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int cc = cg * 16 + g + 8 * r;
            const bool valid = cc < ncols;
            const int h = kvh * group + (valid ? cc % group : 0);
            const int t = valid ? cc / group : 0;
            if constexpr (ROPE != 0) {
                qrow[r] = valid ? q_src + (g + 8 * r) * D * 4 : nullptr;
            } else {
                qrow[r] = valid ? q_src + b * qs_b + h * qs_h + t * qs_t : nullptr;
            }
            slope2[r] = alibi_slope(use_alibi, h, n_head_log2, m0, m1) * LOG2E;
            mcol[r] = mask != nullptr && valid;
        }
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // a0: (g, 2t), a1: (g+8, 2t), a2: (g, 2t+8), a3: (g+8, 2t+8)
                const char* qr = qrow[i & 1];
                const int e = kk * 16 + (i >> 1) * 8 + 2 * tq4;
                float x0 = 0.0f, x1 = 0.0f;
                if (qr != nullptr) {
                    if (ROPE == 0 && q_f16) {
                        x0 = od::f16_to_f32(reinterpret_cast<const unsigned short*>(qr)[e]);
                        x1 = od::f16_to_f32(reinterpret_cast<const unsigned short*>(qr)[e + 1]);
                    } else {
                        x0 = reinterpret_cast<const float*>(qr)[e];
                        x1 = reinterpret_cast<const float*>(qr)[e + 1];
                    }
                }
                qa[kk][i] = pack2<BF>(x0, x1);
            }
        }
    }
    // logit in log2 units: softcap ? cap*tanh(s*scale/cap) : s*scale, times log2(e)
    const float mul2 = softcap != 0.0f ? softcap * LOG2E : scale * LOG2E;
    const float in_scale = softcap != 0.0f ? scale / softcap : 1.0f;

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    }
    float mrun[2] = {NEG_BIG, NEG_BIG};
    float lrun[2] = {0.0f, 0.0f};

    for (int i = 0; i < n_tiles; ++i) {
        od::cp_async_wait<STAGES - 2>();  // tile i has landed (this thread's copies) ...
        __syncthreads();              // ... everyone's, and everyone is done with tile i - 1
        if (i + STAGES - 1 < n_tiles) {
            load_kv(i + STAGES - 1);  // into the stage tile i - 1 used
        }
        od::cp_async_commit();

        if constexpr (ROPE != 0) {
            if (i == own_tile && warp == own_row / 16) {  // the warp that reads the row replaces it
                const unsigned short* kv_rows = smem + decode_stage_smem<D>() / 2;
                unsigned short* kd = stage_k(i % STAGES) + own_row * SR;
                unsigned short* vd = stage_v(i % STAGES) + own_row * SR;
                for (int e = lane; e < D; e += 32) {
                    kd[e] = kv_rows[e];
                    vd[e] = kv_rows[D + e];
                }
                __syncwarp();
            }
        }
        const unsigned short* Ks = stage_k(i % STAGES) + warp * 16 * SR;
        const unsigned short* Vs = stage_v(i % STAGES) + warp * 16 * SR;
        const int kw = k_begin + i * BN + warp * 16;  // this warp's first key
        // this lane's 8 mask values of the tile, from its mask slots (two keys a 32-bit word)
        unsigned short mk[2][4];
        if (mask != nullptr) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const unsigned w = *reinterpret_cast<const unsigned*>(
                        mask_slot(i % STAGES, (warp * 2 + nt) * 16 + g + 8 * r) + 2 * tq4);
                    mk[nt][2 * r] = static_cast<unsigned short>(w & 0xffffu);
                    mk[nt][2 * r + 1] = static_cast<unsigned short>(w >> 16);
                }
            }
        }

        // S (16 columns x 16 keys) = Q K^T
        float s[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            unsigned r0, r1, r2, r3;
            ldsm_x4(od::smem_addr(Ks + ((lane >> 4) * 8 + (lane & 7)) * SR + kk * 16 + ((lane >> 3) & 1) * 8), r0,
                    r1, r2, r3);
            mma_16816<BF>(s[0], qa[kk], r0, r1);
            mma_16816<BF>(s[1], qa[kk], r2, r3);
        }
        // element (nt, e): column g + 8*(e >> 1), key kw + nt*8 + 2*tq4 + (e & 1)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kw + nt * 8 + 2 * tq4 + (e & 1);
                float x = s[nt][e] * in_scale;
                x = (softcap != 0.0f ? tanhf(x) : x) * mul2;
                if (key >= k_end) {
                    x = NEG_INF;
                } else if (mcol[e >> 1]) {
                    x = masked(mk[nt][e], slope2[e >> 1], x);
                }
                s[nt][e] = x;
            }
        }

        // online softmax; a column's 16 keys sit in the 4 lanes of a quad
        float mx[2] = {fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1])),
                       fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]))};
        float alpha[2], ls[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(od::FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(od::FULL_MASK, mx[r], 2));
            const float mn = fmaxf(mrun[r], mx[r]);
            alpha[r] = exp2f(mrun[r] - mn);
            mrun[r] = mn;
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - mrun[e >> 1]);
                ls[e >> 1] += s[nt][e];
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            lrun[r] = lrun[r] * alpha[r] + ls[r];
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }

        // O += P V: the S accumulators are the A fragment of P (16 columns x 16 keys)
        const unsigned pa[4] = {pack2<BF>(s[0][0], s[0][1]), pack2<BF>(s[0][2], s[0][3]), pack2<BF>(s[1][0], s[1][1]),
                                pack2<BF>(s[1][2], s[1][3])};
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            unsigned r0, r1, r2, r3;
            ldsm_x4_trans(od::smem_addr(Vs + (lane & 15) * SR + dp * 16 + (lane >> 4) * 8), r0, r1, r2, r3);
            mma_16816<BF>(o[2 * dp], pa, r0, r1);
            mma_16816<BF>(o[2 * dp + 1], pa, r2, r3);
        }
    }

    // Merge the 4 warps through shared memory (the K/V stages are free now).
    od::cp_async_wait<0>();
    __syncthreads();
    float* s_o = reinterpret_cast<float*>(smem);  // [warp][column][OR]
    float* s_ml = s_o + 4 * 16 * OR;              // [warp][column] (max, sum)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lrun[r] += __shfl_xor_sync(od::FULL_MASK, lrun[r], 1);
        lrun[r] += __shfl_xor_sync(od::FULL_MASK, lrun[r], 2);
        float* row = s_o + (warp * 16 + g + 8 * r) * OR + 2 * tq4;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            *reinterpret_cast<float2*>(row + dt * 8) = make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
        }
        if (tq4 == 0) {
            s_ml[(warp * 16 + g + 8 * r) * 2] = mrun[r];
            s_ml[(warp * 16 + g + 8 * r) * 2 + 1] = lrun[r];
        }
    }
    __syncthreads();

    const long long rows = static_cast<long long>(gridDim.z) * tq * hq;
    const bool single = gridDim.x == 1;  // the whole KV in this block: finish here
    for (int e = tid; e < 16 * D; e += 128) {
        const int c = e / D;
        const int d = e % D;
        const int cc = cg * 16 + c;
        if (cc >= ncols) {
            break;  // e only grows past the valid columns
        }
        const int h = kvh * group + cc % group;
        const long long r = (static_cast<long long>(b) * tq + cc / group) * hq + h;
        float mx = s_ml[c * 2];
#pragma unroll
        for (int w = 1; w < 4; ++w) {
            mx = fmaxf(mx, s_ml[(w * 16 + c) * 2]);
        }
        float sum = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float f = exp2f(s_ml[(w * 16 + c) * 2] - mx);
            sum += s_ml[(w * 16 + c) * 2 + 1] * f;
            a += s_o[(w * 16 + c) * OR + d] * f;
        }
        if (single) {
            out[r * D + d] = a * finish_scale(mx, sum, sinks, h);
        } else {
            ws_acc[(split * rows + r) * D + d] = a;
            if (d == 0) {
                ws_ml[split * rows + r] = make_float2(mx, sum);
            }
        }
    }
    if (single) {
        return;
    }

    // Split: the last block of this (batch, KV head, column group) merges every split.
    if (!od::last_block(counters + b * gridDim.y + blockIdx.y, gridDim.x)) {
        return;
    }
    // Every split's (max, sum) and accumulator slice of this thread's (column, 4 dims) loaded
    // together, MERGE_LOADS splits at a time, so that the merge costs about one L2 round trip
    // (the partials were written by other SMs: __ldcg reads them from L2, past this SM's L1).
    constexpr int MERGE_LOADS = 12;  // 16 would cost registers at D = 64 (134: 3 blocks an SM, not 4)
    const int nc = min(16, ncols - cg * 16);
    for (int e = tid; e < nc * (D / 4); e += 128) {
        const int c = e / (D / 4);
        const int d4 = e % (D / 4);
        const int cc = cg * 16 + c;
        const int h = kvh * group + cc % group;
        const long long r = (static_cast<long long>(b) * tq + cc / group) * hq + h;
        float mx = NEG_BIG, sum = 0.0f;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int s0 = 0; s0 < static_cast<int>(gridDim.x); s0 += MERGE_LOADS) {
            float2 ml[MERGE_LOADS];
            float4 x[MERGE_LOADS];
#pragma unroll
            for (int j = 0; j < MERGE_LOADS; ++j) {
                const long long i = (s0 + j) * rows + r;
                const bool in = s0 + j < static_cast<int>(gridDim.x);
                ml[j] = in ? __ldcg(&ws_ml[i]) : make_float2(NEG_BIG, 0.0f);
                x[j] = in ? __ldcg(reinterpret_cast<const float4*>(ws_acc + i * D) + d4)
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
            float m = mx;
#pragma unroll
            for (int j = 0; j < MERGE_LOADS; ++j) {
                m = fmaxf(m, ml[j].x);
            }
            const float f = exp2f(mx - m);
            sum *= f;
            a = make_float4(a.x * f, a.y * f, a.z * f, a.w * f);
#pragma unroll
            for (int j = 0; j < MERGE_LOADS; ++j) {
                const float w = exp2f(ml[j].x - m);
                sum += ml[j].y * w;
                a = make_float4(fmaf(x[j].x, w, a.x), fmaf(x[j].y, w, a.y), fmaf(x[j].z, w, a.z),
                                fmaf(x[j].w, w, a.w));
            }
            mx = m;
        }
        const float k = finish_scale(mx, sum, sinks, h);
        reinterpret_cast<float4*>(out + r * D)[d4] = make_float4(a.x * k, a.y * k, a.z * k, a.w * k);
    }
}
