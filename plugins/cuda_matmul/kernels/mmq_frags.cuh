// The register A fragments of mmq_wgmma.cu (Hopper's quantized GEMM) for the formats whose weights skip its A
// stages (RS: q4_0, q8_0, q4_K, q5_K, q6_K): frags<WT> builds one lane's A operands of a 64-value K tile, its
// four k16 steps' m16n8k16 A fragments (wgmma.cuh: a[kk] = (row g, k 2t), (row g + 8, k 2t), (row g, k 2t + 8),
// (row g + 8, k 2t + 8) of step kk, each a bf16 pair, the lower k in the low half; g = lane / 4, t = lane % 4),
// straight from the raw K tile in shared memory; and the K tile geometry they read (BK, RAW_KB, SUBS).
// mmq_wgmma.cu's opening comment explains how the kernel uses them.
//
// Apart from mmq_wgmma.cu so that the CPU emulation can include it: tests/test_mmq_frags_emulated.py compiles
// this header with g++ against tests/cuda_emu/shim.h (its inline PTX swapped for host functions) and checks the
// fragments bit for bit against the reference dequantization rounded to bf16. So it must not include wgmma.cuh
// nor use any sm_90a-only instruction (its bf16x2 conversion and arithmetic are sm_90's).
#pragma once

#include "mmq_common.cuh"

namespace mw {

using mm::u8;

// K tiles of BK values (one m64nNk16 product a k16 step, four a K tile). The raw weights are staged in mmq's K
// tiles of RAW_KB K steps (256 values: a super-block, or 8 blocks of 32), SUBS of this kernel's K tiles each.
constexpr int BK = 64;
constexpr int RAW_KB = 8, SUBS = RAW_KB * 32 / BK;

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
    s0 = __fmul_rn(d, od::small_f32(sc & 0xffu));
    s1 = __fmul_rn(d, od::small_f32(sc >> 8));
    m0 = -__fmul_rn(dmin, od::small_f32(mn & 0xffu));
    m1 = -__fmul_rn(dmin, od::small_f32(mn >> 8));
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
        const float sc[4] = {__fmul_rn(d, od::s8_f32(sc01 & 0xffu)), __fmul_rn(d, od::s8_f32(sc01 >> 8)),
                             __fmul_rn(d, od::s8_f32(sc23 & 0xffu)), __fmul_rn(d, od::s8_f32(sc23 >> 8))};
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

}  // namespace mw
