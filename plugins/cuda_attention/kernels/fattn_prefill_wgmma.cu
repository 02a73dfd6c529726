// opdispatch-arch: sm_90a
// flash_attn_ext for many query rows (prefill) on Hopper's warpgroup tensor cores (wgmma): what fattn_prefill.cu
// does on mma.sync, for head sizes 64 and 128 and f16/bf16 K/V. fattn_prefill is bound by instruction issue
// (ldmatrix and mma.sync a 16 x 8 x 16 product); here one wgmma m64nNk16 takes a warpgroup's 64 query rows
// against BN keys (S = Q K^T) or 64 rows against the head (O += P V), its operands read by the tensor cores from
// shared memory (wgmma.cuh's 128-byte swizzle), and P from registers: the S accumulators, rounded to 16 bits,
// already have the layout of the A operand.
//
// Grid (ceil(Tq / BM), Hq, B), WGS warpgroups (128 threads each), each owning 64 query rows: BM = 64 WGS. Shared
// memory (1024-byte aligned): Q (BM rows x D, in D / 64 column blocks of 64 values), then STAGES stages of a K
// tile and a V tile of BN keys (each D / 64 blocks of BN rows of 64 values). K is S's B operand K-major, V is
// P V's B operand MN-major (a row holds 64 values of the head at one key): one layout for both, filled by
// cp.async (16-byte rows of f16/bf16 aligned: `kv_vec`; else through registers), keys past tk zeros.
// Loop over the live key tiles (prefill_common.cuh: flags skip fully masked ones), c counting them:
//   wait for tile c's copies, barrier, copies of tile c + 1 into stage (c + 1) % STAGES;
//   S = Q K^T (D / 16 wgmma), wait for it (which also retires tile c - 1's P V);
//   logits, online softmax, O rescaled (prefill_common.cuh, as fattn_prefill);
//   P rounded into registers, O += P V (BN / 16 wgmma) issued and left running.
// With 3 stages the stage tile c + 1 takes held tile c - 2, whose P V every warpgroup retired before this
// iteration's barrier; with 2, each warpgroup waits for its P V of tile c - 1 before the barrier. The warpgroups
// of a block meet at that barrier every tile, so their softmaxes run together; blocks of one warpgroup, several
// an SM, drift apart and overlap one another's products and softmaxes (specs/flash.py's WGMMA_CONFIG).
//
// Requirements (specs/flash.py: prefill_wgmma): compute capability 9.0 (sm_90a code), D 64 or 128, K and V f16
// or bf16 (q f32 or f16, rounded to K/V's type in shared memory). `flags` as fattn_prefill's, for this kernel's
// BM x BN tiles. Strides in bytes: q, k, v and mask (t, h, b); mask heads / batches by modulo.
#include "prefill_common.cuh"
#include "wgmma.cuh"

template <int D, typename KT, int WGS, int BN, int STAGES>
__global__ void __launch_bounds__(WGS * 128, 1) fattn_prefill_wgmma(
    PREFILL_PARAMS) {
    od::grid_enter();
    using namespace od_attn;
    namespace wg = od::wg;
    static_assert((D == 64 || D == 128) && (BN == 64 || BN == 128), "head sizes 64 and 128, key tiles of 64 or 128");
    constexpr bool BF = od::same_v<KT, bf16>;
    constexpr int THREADS = WGS * 128;
    constexpr int BM = 64 * WGS;
    constexpr int DB = D / 64;            // 64-value column blocks of a row
    constexpr int NT = BN / 8, DT = D / 8;  // n8 tiles of S and of O
    constexpr unsigned Q_BLOCK = BM * 128, KV_BLOCK = BN * 128;  // bytes of one column block
    constexpr unsigned KV_BYTES = DB * KV_BLOCK, STAGE_BYTES = 2 * KV_BYTES;

    extern __shared__ uint4 smem_u4[];
    const unsigned base = od::smem_addr(smem_u4);
    const unsigned sQ = (base + 1023u) & ~1023u;
    const unsigned sKV = sQ + DB * Q_BLOCK;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int w = tid >> 7;  // this thread's warpgroup: query rows 64 w .. 64 w + 63 of the tile
    const int g = lane >> 2, tq4 = lane & 3;
    const int wrow = 64 * w + ((tid >> 5) & 3) * 16;  // this warp's first row in the tile
    int qt, h, b;
    od_prefill::block_tile(qt, h, b);
    const int q0 = qt * BM;
    const int kvh = h / group;

    // -- Q tile -> shared memory (16-bit), rows past tq zero; read after the loop's first barrier --
    {
        const char* qbase = q + b * qs_b + h * qs_h;
        for (int c = tid; c < BM * (D / 8); c += THREADS) {
            const int row = c / (D / 8), ch = c % (D / 8);
            const int t = q0 + row;
            store_q8<BF>(sQ + (ch >> 3) * Q_BLOCK + wg::swz(row, ch & 7), t < tq ? qbase + t * qs_t : nullptr,
                         ch * 8, q_f16);
        }
    }

    const unsigned char* fl = od_prefill::tile_flags(flags, b, h, m2, m3, qt, n_kv_tiles);
    const od_prefill::Logits lg = od_prefill::logits_of(mask, ms_t, ms_h, ms_b, m2, m3, b, h, scale, softcap,
                                                        use_alibi, m0, m1, n_head_log2, tq, tk);
    const char* kbase = k + b * ks_b + kvh * ks_h;
    const char* vbase = v + b * vs_b + kvh * vs_h;
    const bool vec = kv_vec != 0;

    // Key tile j's K and V rows into stage st: 16-byte chunks, a thread's chunk column fixed (THREADS is a
    // multiple of the D / 8 chunks of a row, its rows step by THREADS / (D / 8)); keys past tk zeros.
    auto load_kv = [&](int j, int st) {
        const unsigned sk = sKV + st * STAGE_BYTES, sv = sk + KV_BYTES;
        constexpr int CPR = D / 8;
        static_assert(THREADS % CPR == 0, "a thread's chunk column must be fixed");
        const int ch = tid % CPR;
        const unsigned col = (ch >> 3) * KV_BLOCK;
#pragma unroll
        for (int i = 0; i < (BN * CPR + THREADS - 1) / THREADS; ++i) {
            const int r = tid / CPR + i * (THREADS / CPR);
            if (BN * CPR % THREADS != 0 && r >= BN) {
                break;
            }
            const int key = j * BN + r;
            const unsigned off = col + wg::swz(r, ch & 7);
            if (key >= tk) {
                st_shared16(sk + off, 0u, 0u, 0u, 0u);
                st_shared16(sv + off, 0u, 0u, 0u, 0u);
            } else if (vec) {
                od::cp_async16(sk + off, kbase + key * ks_t + ch * 16);
                od::cp_async16(sv + off, vbase + key * vs_t + ch * 16);
            } else {
                typename Row8Half<BF>::Raw rk, rv;
                Row8Half<BF>::fetch(kbase + key * ks_t, ch * 8, false, rk);
                Row8Half<BF>::fetch(vbase + key * vs_t, ch * 8, false, rv);
                st_shared16(sk + off, rk.w[0], rk.w[1], rk.w[2], rk.w[3]);
                st_shared16(sv + off, rv.w[0], rv.w[1], rv.w[2], rv.w[3]);
            }
        }
    };

    float o[D / 2];
    float mrun[2] = {NEG_BIG, NEG_BIG}, lrun[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < D / 2; ++i) {
        o[i] = 0.0f;
    }
    float(&o4)[DT][4] = *reinterpret_cast<float(*)[DT][4]>(&o);
    unsigned p[BN / 16][4];  // P's A fragments, kept until the P V that reads them is retired
#pragma unroll
    for (int i = 0; i < BN / 16; ++i) {
        p[i][0] = p[i][1] = p[i][2] = p[i][3] = 0u;
    }
    const unsigned q_desc0 = sQ + w * 64 * 128;

    int j = od_prefill::next_tile(fl, -1, n_kv_tiles, lane);
    if (j >= n_kv_tiles) {  // every key masked: the rows are zeros (or the sink's), as fattn_prefill writes them
        od_prefill::write_rows<D>(o4, mrun, lrun, sinks, out, b, h, hq, tq, q0 + wrow, g, tq4);
        return;
    }
    load_kv(j, 0);
    od::cp_async_commit();
    int st = 0;
    do {
        const int jn = od_prefill::next_tile(fl, j, n_kv_tiles, lane);
        if constexpr (STAGES == 2) {
            wg::wait<0>();  // this warpgroup's P V of the tile before: its stage is the next one's
            wg::fence_regs(o);
            wg::fence_regs(p);
        }
        od::cp_async_wait<0>();  // tile j has landed (this thread's copies) ...
        wg::fence_async_smem();
        __syncthreads();  // ... everyone's (and Q); every warpgroup is done with the stage tile jn takes
        const int stn = st + 1 == STAGES ? 0 : st + 1;
        if (jn < n_kv_tiles) {
            load_kv(jn, stn);
        }
        od::cp_async_commit();

        const unsigned sk = sKV + st * STAGE_BYTES, sv = sk + KV_BYTES;
        const int kb = j * BN;
        const int flag = fl != nullptr ? fl[j] : 2;

        // S = Q K^T: 64 rows x BN keys a warpgroup
        float s[BN / 2];
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const unsigned at = (kk >> 2) * Q_BLOCK + (kk & 3) * 32;
            const unsigned bt = (kk >> 2) * KV_BLOCK + (kk & 3) * 32;
            wg::ss<BN, BF>(s, wg::desc_k(q_desc0 + at), wg::desc_k(sk + bt), kk);  // kk 0: S = Q K^T
        }
        wg::commit();
        wg::wait<0>();  // S, and the P V of the tile before
        wg::fence_regs(s);
        wg::fence_regs(o);
        wg::fence_regs(p);

        float(&s4)[NT][4] = *reinterpret_cast<float(*)[NT][4]>(&s);
        float mul = lg.mul2;
        if (!od_prefill::raw_tile(lg, flag, kb, BN)) {
            mul = 1.0f;
            od_prefill::to_log2<NT>(s4, lg, flag, kb, q0 + wrow, g, tq4);
        }
        od_prefill::softmax_tile<NT, DT>(s4, mrun, lrun, o4, mul);

        // O += P V: P's A fragments from the S accumulators (keys 16 kk ..: n8 tiles 2 kk and 2 kk + 1)
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            p[kk][0] = pack2<BF>(s4[2 * kk][0], s4[2 * kk][1]);
            p[kk][1] = pack2<BF>(s4[2 * kk][2], s4[2 * kk][3]);
            p[kk][2] = pack2<BF>(s4[2 * kk + 1][0], s4[2 * kk + 1][1]);
            p[kk][3] = pack2<BF>(s4[2 * kk + 1][2], s4[2 * kk + 1][3]);
        }
        wg::fence_regs(p);  // P and O's rescaling written before the products that read them are issued
        wg::fence_regs(o);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            wg::rs<D, BF, 1>(o, p[kk], wg::desc_mn(sv + kk * 16 * 128, KV_BLOCK));
        }
        wg::commit();
        j = jn;
        st = stn;
    } while (j < n_kv_tiles);
    wg::wait<0>();
    wg::fence_regs(o);
    wg::fence_regs(p);
    od::cp_async_wait<0>();

    od_prefill::write_rows<D>(o4, mrun, lrun, sinks, out, b, h, hq, tq, q0 + wrow, g, tq4);
}
