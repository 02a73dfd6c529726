// opdispatch-arch: sm_90a
// Quantized GEMM on Hopper's warpgroup tensor cores (mmq_wgmma): out (B3, B2, N, M) f32 = b (N, K) @ a (M, K)^T
// for block-format weights a and many columns. mmq's int8 mma.sync products must be converted and scaled after
// every 32 values (a block's scale), which keeps it near twice cuBLAS bf16's time at 512 columns
// (docs/cuda_matmul.md); here each K tile of the weights is dequantized once into bf16 in shared memory (the
// scales and offsets folded into the values), b comes as bf16 rows (convert.cu, the launch before), and the
// products run on wgmma.mma_async with f32 accumulators across the whole slice of K. No weight is ever written
// back dequantized. wgmma needs the sm_90a target: the first line of this file makes kernels.py (and the compile
// test) build it so; support.mmq_wgmma_ok takes compute capability 9.0 only.
//
// A block is WGS warpgroups of 128 threads (Tiling; launched with 2): BM = 64 WGS weight rows (64 a warpgroup,
// one m64nBNk16 accumulator of BN / 2 floats a thread), BN = 128 or 256 columns, K tiles of BK = 64 values. The
// wider tile halves the dequantization a product (its A fragments serve 256 columns) and the weight reads from L2:
// on the H200 at 512 columns it took 0.71-0.81x the narrow tile's time (4096 x 14336 and 14336 x 4096, q4_0 and
// q4_K; specs/mmq_wgmma.py's tile_for says when it is used). Shared memory:
//   A    2 stages of BM x BK bf16 (BM * 128 bytes), written by the block's dequantization (st.shared, then
//        fence.proxy.async so that the tensor cores see it);
//   B    4 stages of BN x BK bf16 (BN * 128 bytes), cp.async three K tiles ahead;
//   raw  2 stages of the weights' raw blocks: mmq's K tile of 256 values (Tile<Q, 8>: each row's covering
//        16-byte granules, cp.async), 4 of this kernel's K tiles, issued two raw tiles ahead.
// A and B are K-major in the 128-byte swizzle wgmma reads (row r's 16-byte chunk c at r * 128 + (c ^ (r % 8)) *
// 16, each tile 1024-byte aligned; the descriptor's stride between 8-row groups 1024 bytes, a k16 step 32 bytes
// further along the row).
// K tile t: the four wgmma of t are issued (one commit group), then wgmma.wait_group 1 (t - 1's are done), and
// while t's run the block dequantizes t + 1 into the A stage t - 1 held (a warpgroup's threads write exactly the
// rows its own products read, so no barrier is needed before), waits for its copies, and after one barrier issues
// the copies into the stages t - 1 freed. The tensor cores are never drained inside the loop: t + 1's products
// queue behind t's. Dequantization: quant.cuh's load_unit for every format (8 values a unit, v = code * d + m in
// f32, rounded to bf16, into the A stages), but q4_0, q8_0, q4_K, q5_K and q6_K (RS), whose values go from the raw
// stage straight into the A fragments in registers (wgmma's A-from-registers form: no A stage written or read,
// which halves the shared memory traffic a K tile), two K tiles' fragments in turn: q4_0's nibbles to bf16 by their
// bits, bf16x2 arithmetic (d rounded to bf16 first); q8_0's codes to f32 by their bits, one fma each; the K-quants'
// codes to f32 by their bits (masked into the mantissa of a power of two, which is then subtracted), then the A
// stage's own f32 operation (fmaf(q, d * sc, -(dmin * min)), q6_K's (q - 32) * (d * sc)). q8_0's and the
// K-quants' fragments hold the A stage's bf16 values bit for bit (q8_0: but for an infinite d).
// Split K: the raw K tiles of a row are cut in `splits` contiguous slices, one block each (a grid of few output
// tiles still fills the GPU), and mq::finish (mmq's) writes the sums or the slices' ordered sum: deterministic.
//
// Requirements (support.mmq_wgmma_ok): K % 64 == 0 and mmq's row conditions (rows of whole 16-byte granules, a
// 16-byte aligned: the raw stages); b bf16 rows of K values, contiguous (B3, B2, N, K), 16-byte aligned. Rows
// past M read row M - 1 and columns past N read column N - 1; neither is written.

#include "mmq_common.cuh"
#include "wgmma.cuh"

namespace mw {

namespace wg = od::wg;

using mm::u8;

// 4 stages of b: step kt's cp_async_wait<1> leaves the copies of step kt - 1 in flight, so b's K tile kt + 1 is
// issued three steps ahead
constexpr int BK = 64, A_STAGES = 2, B_STAGES = 4, RAW_STAGES = 2;

// A block's tile: WGS warpgroups of 128 threads, BM = 64 WGS weight rows (64 a warpgroup), BN columns (one
// m64nBNk16 accumulator of BN / 2 floats a thread).
template <int WGS, int BN_>
struct Tiling {
    static constexpr int BM = 64 * WGS, BN = BN_, THREADS = 128 * WGS;
    static constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    static_assert(BN == 128 || BN == 256, "one m64n128 or m64n256 accumulator a warpgroup");
};
// The raw weights are staged in mmq's K tiles of RAW_KB K steps (256 values: a super-block, or 8 blocks of 32),
// SUBS of this kernel's K tiles each.
constexpr int RAW_KB = 8, SUBS = RAW_KB * 32 / BK;

// Bytes before raw K tile rt's first block in its first granule (mmq's lead: 0 where K tiles are whole granules).
template <int WT>
__device__ __forceinline__ int raw_lead(int rt) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    return T::ALIGNED ? 0 : rt * RAW_KB / T::STEPS * F::BYTES % 16;
}

using od::wg::swz;

__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// (x, x) as bf16x2.
__device__ __forceinline__ unsigned bf16x2_same(float x) { return bf16x2(x, x); }

// Two 4-bit codes of `nib` (bytes holding 0 .. 15), picked by the byte selector `sel` into the bf16 pair
// (128 + n0, 128 + n1), minus 136 (exact: 136 - 8 is the zero), times d2 (bf16x2): q4_0's values.
__device__ __forceinline__ unsigned q4_pair(unsigned nib, unsigned sel, unsigned d2) {
    const unsigned x = od::prmt(nib, 0x43434343u, sel);
    unsigned t, v;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(x), "r"(0x3f803f80u), "r"(0xc308c308u));  // x * 1 - 136
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(v) : "r"(t), "r"(d2));
    return v;
}

__device__ __forceinline__ void st_shared8(unsigned saddr, unsigned a, unsigned b) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(saddr), "r"(a), "r"(b) : "memory");
}

// 64-value K tile kt of the block's BM weight rows dequantized into the A stage at shared address sa, from the
// raw K tile (256 values: mmq's Tile<Q, 8>) holding it at `raw` (row r at raw + r * RS, its first block `lead`
// bytes in): thread t decodes row t / 2, units (8 values each, quant.cuh's load_unit) 4 (t % 2) .. 4 (t % 2) + 3
// of the tile; a unit's values v = code * d + m are rounded to bf16 and stored where unit_k puts them (8 in a row,
// or two runs of 4 for the 4- and 5-bit legacy formats).
template <int WT>
__device__ __forceinline__ void dequant_tile(unsigned sa, const u8* raw, int kt, int tid) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    const int r = tid >> 1;
    const int sub = kt % SUBS;  // this K tile's place in its raw K tile
    const u8* const row = raw + r * T::RS;
    const int u0 = sub * (BK / 8) + (tid & 1) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int u = u0 + i;
        float c[8], d, m;
        od::quant::load_unit<F>(row, u, c, d, m);
        unsigned p[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            p[j] = bf16x2(fmaf(c[2 * j], d, m), fmaf(c[2 * j + 1], d, m));
        }
        const int2 k = mm::unit_k<WT>(u);
        const int kx = k.x - sub * BK, ky = k.y - sub * BK;
        st_shared8(sa + swz(r, kx >> 3) + (kx & 7) * 2, p[0], p[1]);
        st_shared8(sa + swz(r, ky >> 3) + (ky & 7) * 2, p[2], p[3]);
    }
}

// q4_0's A fragments for 64-value K tile kt straight from its raw K tile (registers, no A stage): this lane's rows
// r0 (= the warp's first row + g) and r0 + 8, of each of the K tile's two blocks the codes 2t, 2t + 1 and 2t + 8,
// 2t + 9 (k16 step 2 j: low nibbles of qs bytes 2t .. and 2t + 8 ..) and 16 + those (step 2 j + 1: their high
// nibbles), as q4_pair makes them.
template <int WT>
__device__ __forceinline__ void q4_0_frags(const u8* raw, int kt, int r0, int t, unsigned (&a)[4][4]) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u8* const blk = raw + (r0 + 8 * h) * T::RS + (2 * (kt % SUBS) + j) * F::BYTES;
            const unsigned d2 = bf16x2_same(od::f16_to_f32(od::ld16(blk)));
            const unsigned w0 = od::ld16(blk + F::QS + 2 * t), w1 = od::ld16(blk + F::QS + 2 * t + 8);
            a[2 * j][h] = q4_pair(w0 & 0x0f0fu, 0x5140u, d2);
            a[2 * j][2 + h] = q4_pair(w1 & 0x0f0fu, 0x5140u, d2);
            a[2 * j + 1][h] = q4_pair((w0 >> 4) & 0x0f0fu, 0x5140u, d2);
            a[2 * j + 1][2 + h] = q4_pair((w1 >> 4) & 0x0f0fu, 0x5140u, d2);
        }
    }
}

// Two int8 codes of q8_0 (bytes 0 and 1 of w, each XOR 0x80: code + 128, unsigned) times d, as bf16x2. One prmt
// puts a code into byte 1 of the float 0x47000000 (32768, whose byte 1 counts units): 32768 + 128 + code. Then
// fma(that, d, c), c = -32896 d, is code * d: c is exact (32896 = 257 * 128: 257 d has at most 20 significant
// bits), so the fma rounds only code * d, which is exact in f32 (8 by 11 bits). dequant_tile's fmaf(code, d, 0)
// is the same float, +0 at code 0 included (an infinite d aside: NaN here, not +-inf), so the same bf16.
__device__ __forceinline__ unsigned q8_pair(unsigned w, float d, float c) {
    const float lo = __uint_as_float(od::prmt(w, 0x47000000u, 0x7404u));
    const float hi = __uint_as_float(od::prmt(w, 0x47000000u, 0x7414u));
    return bf16x2(fmaf(lo, d, c), fmaf(hi, d, c));
}

// q8_0's A fragments for 64-value K tile kt straight from its raw K tile, as q4_0_frags: this lane's rows r0 and
// r0 + 8, of each of the K tile's two blocks (k16 steps 2 j and 2 j + 1) the codes 8 i + 2t, 8 i + 2t + 1 (i = 0 ..
// 3: step 2 j + i / 2, k 2t (i even) or 2t + 8 (odd)), a 16-bit load each (blocks are 34 bytes, 2-byte aligned,
// and a lane's pairs 8 bytes apart: a wider load would carry other lanes' codes).
template <int WT>
__device__ __forceinline__ void q8_0_frags(const u8* raw, int kt, int r0, int t, unsigned (&a)[4][4]) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u8* const blk = raw + (r0 + 8 * h) * T::RS + (2 * (kt % SUBS) + j) * F::BYTES;
            const float d = od::f16_to_f32(od::ld16(blk)), c = -32896.0f * d;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                a[2 * j + i / 2][2 * (i % 2) + h] = q8_pair(od::ld16(blk + F::QS + 8 * i + 2 * t) ^ 0x8080u, d, c);
            }
        }
    }
}

// The BITS-bit field at bits P .. P + BITS - 1 of w as a float, exactly: under the exponent of 2^(23 - P), whose
// mantissa bit P counts units, the field reads 2^(23 - P) + q, and the subtraction of 2^(23 - P) is exact. One lop3
// (mask and exponent) and one add; static_cast<float>(q) would be an I2F, a quarter of the rate.
template <int P, int BITS = 4>
__device__ __forceinline__ float field(unsigned w) {
    static_assert(P + BITS <= 23, "the field lies in the mantissa");
    constexpr unsigned E = (127u + 23u - P) << 23;
    return __fsub_rn(__uint_as_float((w & (((1u << BITS) - 1u) << P)) | E), __uint_as_float(E));
}

// A small integer (a byte, bits 8 .. 31 clear) as a float, exactly, as field.
__device__ __forceinline__ float small_f32(unsigned x) {
    return __fsub_rn(__uint_as_float(x | 0x4b000000u), 8388608.0f);
}

// q4_K and q5_K's sub-blocks 2c and 2c + 1 of the super-block at blk (16-byte aligned): their scales s0, s1 and
// negated mins m0, m1 as K4::scale and load_unit make them (d * sc and -(dmin * min), one f32 product each, both
// exact: 11 by 6 bits). The six-bit fields as ggml's get_scale_min_k4 (scale_min_k4), two at a time and without a
// branch (c is the block's, but a branch made the compiler duplicate the whole fragment build): with hi = c / 2,
// each field is the low 4 bits of one scale byte and the 2 bits above them from another, shifted by 2 hi; c < 2:
// the scales are bytes SC + 2c, + 1 (all 6 bits), the mins SC + 4 + 2c, + 1; c >= 2: the low bits of both in
// bytes SC + 4 + 2c, + 1 (the mins' in the high nibbles), the top bits in bits 6, 7 of SC + 2c - 4 (scales) and
// SC + 2c (mins).
template <class F>
__device__ __forceinline__ void k4_scales(const u8* blk, int c, float& s0, float& m0, float& s1, float& m1) {
    const unsigned dd = *reinterpret_cast<const unsigned*>(blk + F::D);
    const float d = od::f16_to_f32(static_cast<unsigned short>(dd & 0xffffu));
    const float dmin = od::f16_to_f32(static_cast<unsigned short>(dd >> 16));
    const int hi = c >> 1;
    const u8* const sb = blk + F::SC + 2 * c;
    const unsigned sc_lo = od::ld16(sb + 4 * hi), sc_top = od::ld16(sb - 4 * hi) >> (2 * hi);
    const unsigned mn_lo = od::ld16(sb + 4) >> (4 * hi), mn_top = od::ld16(sb + 4 - 4 * hi) >> (2 * hi);
    const unsigned sc = (sc_lo & 0x0f0fu) | (sc_top & 0x3030u), mn = (mn_lo & 0x0f0fu) | (mn_top & 0x3030u);
    s0 = __fmul_rn(d, small_f32(sc & 0xffu));
    s1 = __fmul_rn(d, small_f32(sc >> 8));
    m0 = -__fmul_rn(dmin, small_f32(mn & 0xffu));
    m1 = -__fmul_rn(dmin, small_f32(mn >> 8));
}

// q4_K's A fragments for 64-value K tile kt straight from its raw K tile (one super-block a row, 16-byte aligned):
// the K tile is sub-blocks 2c and 2c + 1 (c = kt % SUBS), the low and the high nibbles of qs bytes 32c .. 32c +
// 31, so this lane's 16-bit loads at 32c + 16 j + 8 i + 2t (j, i = 0, 1) give k16 step j's codes (low nibbles,
// register 2i + h) and step j + 2's (high nibbles), rows r0 and r0 + 8 (h). Each value is fmaf(q, s, m) of the
// exact float q (field), rounded to bf16: dequant_tile's value bit for bit (load_unit's c, d, m are the same
// floats), NaN and the sign of zero included. 3 operations a value (lop3, add, fma) and a cvt a pair. q4_0's
// bf16x2 arithmetic (q * s - m in one fma.rn.bf16x2, 1.5 operations a value) would round s and m to bf16 first:
// on ggml-quantized Gaussian weights, where the min cancels most of q * s, that took the GEMM's NMSE against
// the f32 weights from 5.5e-6 to 3.0e-5 (numpy, 512 x 2048 x 256), the GPU test's bound; random blocks 8.4e-6.
template <int WT>
__device__ __forceinline__ void q4_K_frags(const u8* raw, int kt, int r0, int t, unsigned (&a)[4][4]) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    static_assert(F::QK == RAW_KB * 32 && T::ALIGNED && T::RS % 16 == 0, "a raw K tile is one aligned super-block");
    const int c = kt % SUBS;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u8* const blk = raw + (r0 + 8 * h) * T::RS;
        float s0, m0, s1, m1;
        k4_scales<F>(blk, c, s0, m0, s1, m1);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const unsigned w = od::ld16(blk + F::QS + 32 * c + 16 * j + 8 * i + 2 * t);
                a[j][2 * i + h] = bf16x2(fmaf(field<0>(w), s0, m0), fmaf(field<8>(w), s0, m0));
                a[j + 2][2 * i + h] = bf16x2(fmaf(field<4>(w), s1, m1), fmaf(field<12>(w), s1, m1));
            }
        }
    }
}

// q5_K's, as q4_K's: the same nibbles (qs at 48), each with its fifth bit, bit 2c (low nibbles) or 2c + 1 (high)
// of qh byte l for qs byte 32c + l (a 16-bit load at the same l), moved above it by rotating the qh pair: bit 2c of
// its bytes to bits 4 and 12 (the low nibbles' 5-bit fields at bits 0 .. 4 and 8 .. 12), bit 2c + 1 to bits 8 and
// 16 (the high nibbles' at 4 .. 8 and 12 .. 16); the bits the rotations bring elsewhere lie outside the fields. The
// values as q4_K's: dequant_tile's bit for bit.
template <int WT>
__device__ __forceinline__ void q5_K_frags(const u8* raw, int kt, int r0, int t, unsigned (&a)[4][4]) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    static_assert(F::QK == RAW_KB * 32 && T::ALIGNED && T::RS % 16 == 0, "a raw K tile is one aligned super-block");
    const int c = kt % SUBS;
    const int rot_lo = (2 * c - 4) & 31, rot_hi = (2 * c - 7) & 31;  // right rotations: bit 2c to 4, 2c + 1 to 8
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u8* const blk = raw + (r0 + 8 * h) * T::RS;
        float s0, m0, s1, m1;
        k4_scales<F>(blk, c, s0, m0, s1, m1);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int l = 16 * j + 8 * i + 2 * t;
                const unsigned w = od::ld16(blk + F::QS + 32 * c + l), qh = od::ld16(blk + F::QH + l);
                // one lop3 each: the nibbles where the mask is set, the rotated qh elsewhere (bits outside the fields
                // are never read)
                const unsigned lo = (w & 0x0f0fu) | (__funnelshift_r(qh, qh, rot_lo) & ~0x0f0fu);  // 0 .. 4, 8 .. 12
                const unsigned hi = (w & 0xf0f0u) | (__funnelshift_r(qh, qh, rot_hi) & ~0xf0f0u);  // 4 .. 8, 12 .. 16
                a[j][2 * i + h] = bf16x2(fmaf(field<0, 5>(lo), s0, m0), fmaf(field<8, 5>(lo), s0, m0));
                a[j + 2][2 * i + h] = bf16x2(fmaf(field<4, 5>(hi), s1, m1), fmaf(field<12, 5>(hi), s1, m1));
            }
        }
    }
}

// An int8 (bits 0 .. 7 of x, bits 8 .. 31 clear) as a float, exactly, as field: 2^23 + 128 + v, less 2^23 + 128.
__device__ __forceinline__ float s8_f32(unsigned x) {
    return __fsub_rn(__uint_as_float((x ^ 0x80u) | 0x4b000000u), 8388736.0f);
}

// q6_K's A fragments for 64-value K tile kt straight from its raw K tile (one super-block a row, 2-byte aligned):
// values 64c + k (c = kt % SUBS, k < 64) have the low 4 code bits in nibble c % 2 of ql byte 64 (c / 2) + k, the
// high 2 in crumb 2 (c % 2) + k / 32 of qh byte 32 (c / 2) + k % 32, and k16 step j's scale is int8 4c + j. This
// lane's 16-bit loads: ql at 64 (c / 2) + 16 j + 8 i + 2t, a pair of step j (register 2i + h, row r0 + 8h), qh at
// 32 (c / 2) + 16 (j % 2) + 8 i + 2t, the pairs of steps j and j + 2. The crumbs go above the nibbles by a shift
// left of 4 - 2 (j / 2) (crumb bits 4 (c % 2) + 2 (j / 2) to bit 4 (c % 2) + 4, whatever c) and one lop3 a pair
// (the nibbles where `keep`, the shifted qh elsewhere), so each 6-bit code sits at bits p .. p + 5 or p + 8 .. p +
// 13, p = 4 (c % 2): no shift of the ql pair, the positions are registers (masks, exponents and the powers 2^(23 -
// p) + 32, set once a K tile). Each value (code - 32) * (d * sc) as field (lop3, add: code - 32 exactly) and one
// multiply, rounded to bf16: dequant_tile's fmaf(code - 32, d * sc, -0) bit for bit (the product is exact: 6 by
// 11 + 7 bits), the sign of zero included.
template <int WT>
__device__ __forceinline__ void q6_K_frags(const u8* raw, int kt, int r0, int t, unsigned (&a)[4][4]) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    static_assert(F::QK == RAW_KB * 32, "a raw K tile is one super-block");
    const int c = kt % SUBS, n = c >> 1;
    const unsigned p = 4u * (c & 1), keep = 0x0f0fu << p;
    const unsigned mask0 = 0x3fu << p, mask1 = 0x3fu << (p + 8u), e0 = (150u - p) << 23, e1 = (142u - p) << 23;
    const float k0 = __fadd_rn(__uint_as_float(e0), 32.0f), k1 = __fadd_rn(__uint_as_float(e1), 32.0f);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u8* const blk = raw + (r0 + 8 * h) * T::RS;
        const float d = od::f16_to_f32(od::ld16(blk + F::D));
        const unsigned sc01 = od::ld16(blk + F::SC + 4 * c), sc23 = od::ld16(blk + F::SC + 4 * c + 2);
        const float sc[4] = {__fmul_rn(d, s8_f32(sc01 & 0xffu)), __fmul_rn(d, s8_f32(sc01 >> 8)),
                             __fmul_rn(d, s8_f32(sc23 & 0xffu)), __fmul_rn(d, s8_f32(sc23 >> 8))};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const unsigned qh = od::ld16(blk + F::QH + 32 * n + 16 * j + 8 * i + 2 * t);
#pragma unroll
                for (int up = 0; up < 2; ++up) {  // step j + 2 up: the next crumb of the same qh bytes
                    const int s = j + 2 * up;
                    const unsigned ql = od::ld16(blk + F::QL + 64 * n + 16 * s + 8 * i + 2 * t);
                    const unsigned x = (ql & keep) | ((qh << (4 - 2 * up)) & ~keep);
                    const float v0 = __fsub_rn(__uint_as_float((x & mask0) | e0), k0);
                    const float v1 = __fsub_rn(__uint_as_float((x & mask1) | e1), k1);
                    a[s][2 * i + h] = bf16x2(__fmul_rn(v0, sc[s]), __fmul_rn(v1, sc[s]));
                }
            }
        }
    }
}

// The formats whose A fragments come from registers (RS): no A stages (specs/mmq_wgmma.py's RS_FORMATS).
template <int WT>
constexpr bool RS_FORMAT = WT == W_Q4_0 || WT == W_Q8_0 || WT == W_Q4_K || WT == W_Q5_K || WT == W_Q6_K;

// This K tile's A fragments, for the formats that take them from registers (RS).
template <int WT>
__device__ __forceinline__ void frags(const u8* raw, int kt, int r0, int t, unsigned (&a)[4][4]) {
    if constexpr (WT == W_Q8_0) {
        q8_0_frags<WT>(raw, kt, r0, t, a);
    } else if constexpr (WT == W_Q4_K) {
        q4_K_frags<WT>(raw, kt, r0, t, a);
    } else if constexpr (WT == W_Q5_K) {
        q5_K_frags<WT>(raw, kt, r0, t, a);
    } else if constexpr (WT == W_Q6_K) {
        q6_K_frags<WT>(raw, kt, r0, t, a);
    } else {
        q4_0_frags<WT>(raw, kt, r0, t, a);
    }
}

// Raw K tile rt (256 values, fewer at the end of a row) of weight rows m0 .. m0 + BM - 1 (clamped to M - 1) into
// the raw stage `st`: the 16-byte granules covering each row's blocks (mmq's issue_a); returns nothing, the
// blocks start lead(rt) bytes into each row.
template <int WT, class TL>
__device__ __forceinline__ void issue_raw(u8* st, const u8* wa, long long a_row, int m0, int M, int nb, int rt,
                                          int tid) {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, RAW_KB>;
    const int j0 = rt * RAW_KB, kb = min(RAW_KB, nb - j0);
    const int lead = raw_lead<WT>(rt);
    const int at = j0 / T::STEPS * F::BYTES - lead;
    const int wg = (lead + kb / T::STEPS * F::BYTES + (T::ALIGNED ? 0 : 15)) / 16;
    for (od::Walk w(tid, TL::THREADS, wg); w.row < TL::BM; w.next()) {
        const u8* src = wa + static_cast<long long>(min(m0 + w.row, M - 1)) * a_row + at + 16 * w.col;
        od::cp_async16(od::smem_addr(st + w.row * T::RS + 16 * w.col), src);
    }
}

// K tile kt of b's columns n0 .. n0 + BN - 1 (clamped to N - 1; b bf16 rows of K values, column n of this batch
// at row brow0 + n) into the B stage at shared address sb: BN * BK / 8 cp.async of 16 bytes, a thread's every
// THREADS-th.
template <class TL>
__device__ __forceinline__ void load_b(unsigned sb, const u8* b, long long brow0, int n0, int N, int K, int kt,
                                       int tid) {
    constexpr int CHUNKS = TL::BN * BK / 8;
#pragma unroll
    for (int i = 0; i < (CHUNKS + TL::THREADS - 1) / TL::THREADS; ++i) {
        const int c = tid + i * TL::THREADS;
        if (CHUNKS % TL::THREADS != 0 && c >= CHUNKS) {
            break;
        }
        const int r = c >> 3, ch = c & 7;
        const long long row = brow0 + min(n0 + r, N - 1);
        od::cp_async16(sb + swz(r, ch), b + (row * K + kt * BK + ch * 8) * 2);
    }
}

}  // namespace mw

// mul_mat with block-format weights: out[i3, i2, n, m] = sum_k a[i3 / r3, i2 / r2, m, k] * b[i3, i2, n, k]. a rows
// a_row bytes apart, batch strides a_s2, a_s3 (16-byte multiples, a 16-byte aligned, rows of whole granules); b
// bf16 (B3, B2, N, K) contiguous; out contiguous (B3, B2, N, M). The raw K tiles of a row are cut in `splits`
// contiguous slices, one block each (split K, as mmq: a grid of few output tiles still fills the GPU); with
// splits > 1, part holds splits * B3 * B2 * N * M floats and counters B3 * B2 * tiles_m * tiles_n ints (zero
// before the launch, and again after it), and mq::finish adds the slices in order. Grid (tiles_m * splits *
// tiles_n, B2, B3), the column tile fastest (the blocks reading the same weights run together); 128 WGS threads;
// dynamic shared memory specs/mmq_wgmma.py's wgmma_smem: A_STAGES * A_BYTES (none for the RS formats) +
// B_STAGES * B_BYTES (1024-byte aligned), then RAW_STAGES raw stages of BM rows of Tile<Q, RAW_KB>::RS bytes.
template <int WT, int WGS, int BN>
__global__ void __launch_bounds__(128 * WGS, 1)
    mmq_wgmma(const mm::u8* a, long long a_row, long long a_s2, long long a_s3, int r2, int r3, const mm::u8* b,
              float* out, int M, int K, int N, int tiles_m, int tiles_n, int splits, float* part, int* counters) {
    od::grid_enter();
    using namespace mw;
    using TL = Tiling<WGS, BN>;
    constexpr int BM = TL::BM, THREADS = TL::THREADS;
    constexpr unsigned A_BYTES = TL::A_BYTES, B_BYTES = TL::B_BYTES;
    using T = mq::Tile<mm::Fmt<WT>, RAW_KB>;
    constexpr int RAW_BYTES = BM * T::RS;
    constexpr bool RS = RS_FORMAT<WT>;
    constexpr int A_STAGES_HELD = RS ? 0 : A_STAGES;  // RS formats write no A stage
    extern __shared__ uint4 smem_u4[];
    u8* const smem = reinterpret_cast<u8*>(smem_u4);
    const unsigned pad = ((od::smem_addr(smem) + 1023u) & ~1023u) - od::smem_addr(smem);
    const unsigned sA = od::smem_addr(smem) + pad, sB = sA + A_STAGES_HELD * A_BYTES;
    u8* const raw = smem + pad + A_STAGES_HELD * A_BYTES + B_STAGES * B_BYTES;

    const int tid = threadIdx.x;
    const int tn = static_cast<int>(blockIdx.x % tiles_n);
    const int split = static_cast<int>((blockIdx.x / tiles_n) % splits);
    const int tm = static_cast<int>(blockIdx.x / (tiles_n * splits));
    const int i2 = blockIdx.y, i3 = blockIdx.z;
    const int m0 = tm * BM, n0 = tn * BN;
    const u8* const wa = a + (i3 / r3) * a_s3 + (i2 / r2) * a_s2;
    const long long batch = static_cast<long long>(i3) * gridDim.y + i2;
    const long long brow0 = batch * N;
    const int nb = K / 32, nraw_all = (nb + RAW_KB - 1) / RAW_KB;
    // this block's slice: raw K tiles rt0 .. rt0 + nraw - 1, K tiles kt0 .. kt0 + nk - 1 (kt below counts from kt0)
    const int rt0 = static_cast<int>(static_cast<long long>(split) * nraw_all / splits);
    const int nraw = static_cast<int>(static_cast<long long>(split + 1) * nraw_all / splits) - rt0;
    const int kt0 = rt0 * SUBS, nk = min(nraw * SUBS, K / BK - kt0);
    const int wg = tid >> 7;  // this thread's warpgroup: weight rows 64 wg .. 64 wg + 63 of the tile
    auto raw_stage = [&](int r) { return raw + (r % RAW_STAGES) * RAW_BYTES; };
    auto raw_of = [&](int kt) { return raw_stage(kt / SUBS) + raw_lead<WT>(rt0 + kt / SUBS); };

    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
        d[i] = 0.0f;
    }
    // ahead of the loop: raw K tiles 0 and 1, b's K tiles 0 .. B_STAGES - 2, K tile 0 dequantized
    issue_raw<WT, TL>(raw_stage(0), wa, a_row, m0, M, nb, rt0, tid);
    if (nraw > 1) {
        issue_raw<WT, TL>(raw_stage(1), wa, a_row, m0, M, nb, rt0 + 1, tid);
    }
#pragma unroll
    for (int s = 0; s < B_STAGES - 1; ++s) {
        if (s < nk) {
            load_b<TL>(sB + s * B_BYTES, b, brow0, n0, N, K, kt0 + s, tid);
        }
    }
    od::cp_async_commit();
    od::cp_async_wait<0>();
    __syncthreads();
    // q4_0, q8_0, q4_K, q5_K and q6_K (RS): the weights' fragments go from the raw stage into registers, two K
    // tiles' worth (f0, f1) in turn; the other formats through the A stages
    const int frow = wg * 64 + ((tid >> 5) & 3) * 16 + ((tid & 31) >> 2), ft = tid & 3;  // this lane's row g, t
    unsigned f0[4][4], f1[4][4];
    if constexpr (RS) {
        frags<WT>(raw_of(0), 0, frow, ft, f0);
    } else {
        dequant_tile<WT>(sA, raw_of(0), 0, tid);
    }
    wg::fence_async_smem();
    __syncthreads();

    // K tile kt, its fragments in cur (RS) and the next one's into nxt
    auto step = [&](int kt, unsigned (&cur)[4][4], unsigned (&nxt)[4][4]) {
        const unsigned a_st = sA + (kt & 1) * A_BYTES + wg * 64 * 128;
        const unsigned b_st = sB + (kt % B_STAGES) * B_BYTES;
        wg::fence_regs(d);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            if constexpr (RS) {
                wg::rs<BN, true, 0>(d, cur[kk], wg::desc_k(b_st + kk * 32));
            } else {
                wg::ss<BN, true>(d, wg::desc_k(a_st + kk * 32), wg::desc_k(b_st + kk * 32), 1);
            }
        }
        wg::commit();
        // K tile kt - 1's products are done (this warpgroup's), so its A stage (or fragments), the one tile kt + 1
        // takes, is free: a warpgroup's threads dequantize exactly the rows its own products read. Tile kt's
        // products run on meanwhile, and kt + 1's are issued behind them without draining the tensor cores.
        wg::wait<1>();
        wg::fence_regs(d);
        if (kt + 1 < nk) {
            if constexpr (RS) {
                wg::fence_regs(nxt);
                frags<WT>(raw_of(kt + 1), kt + 1, frow, ft, nxt);
            } else {
                dequant_tile<WT>(sA + ((kt + 1) & 1) * A_BYTES, raw_of(kt + 1), kt + 1, tid);
            }
        }
        od::cp_async_wait<1>();  // the copies of step kt - 2 and before (b's K tile kt + 1, any raw K tile needed
                                 // next) have landed for this thread: each step commits one group
        wg::fence_async_smem();
        __syncthreads();  // ... for every thread; every warpgroup is done with K tile kt - 1's stages
        // copies into the stages K tile kt - 1 held: b's K tile kt + B_STAGES - 1; a raw K tile whose last K tile
        // (kt + 1) was just dequantized frees its stage for the raw K tile two ahead
        if (kt + B_STAGES - 1 < nk) {
            load_b<TL>(sB + ((kt + B_STAGES - 1) % B_STAGES) * B_BYTES, b, brow0, n0, N, K, kt0 + kt + B_STAGES - 1,
                   tid);
        }
        if ((kt + 1) % SUBS == SUBS - 1 && (kt + 1) / SUBS + 2 < nraw) {
            issue_raw<WT, TL>(raw_stage((kt + 1) / SUBS + 2), wa, a_row, m0, M, nb, rt0 + (kt + 1) / SUBS + 2, tid);
        }
        od::cp_async_commit();
    };
#pragma unroll 1
    for (int kt = 0; kt < nk; kt += 2) {  // two K tiles a turn: the fragments' registers swap by name
        step(kt, f0, f1);
        if (kt + 1 < nk) {
            step(kt + 1, f1, f0);
        }
    }
    wg::wait<0>();
    wg::fence_regs(d);
    od::cp_async_wait<0>();  // only empty groups can be left

    // The accumulator layout of m64nNk16 is mma.sync m16n8's, 8 columns at a time: warp w of the warpgroup holds
    // rows 16 w + lane / 4 and + 8, columns 8 i + 2 (lane % 4) and + 1 in d[4 i .. 4 i + 3], so mmq's finish
    // (FM = 1, FN = BN / 8) writes it, or its slice's plane and the slices' sum.
    const float(&acc)[1][BN / 8][4] = *reinterpret_cast<const float(*)[1][BN / 8][4]>(&d);
    const long long plane = static_cast<long long>(gridDim.y) * gridDim.z * N * M;
    mq::finish<1, BN / 8, BM, BN, THREADS>(acc, m0 + wg * 64 + ((tid >> 5) & 3) * 16, n0, m0, n0, M, N, brow0, out,
                                           part, split, splits, plane, counters + (batch * tiles_m + tm) * tiles_n + tn,
                                           nullptr, 0);
}
