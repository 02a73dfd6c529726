// ggml's grid I-quants on the device (included by quant.cuh after quant_k.cuh, whose interface they
// share): iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, iq1_s, iq1_m, 256 values a super-block. Each
// group of 8 values (iq3: 4) is an index into one of ggml's grids (iq_grids.cuh, in global memory;
// dot32_in reads the grid it is given: mmvq_stream's copy in shared memory) plus sign bits (iq2/iq3)
// or a shared +-1/8 shift (iq1). The traits are quant_k.cuh's: scale(blk, s, d, m), code(blk, j), dot32 and
// dot32_in (see its header comment), with no mins (M = -1), so that value j = d * code:
//
//   iq2 / iq3   d = ggml's db (d * (0.5 + ls) * 0.25, iq3_xxs * 0.5, iq3_s d * (1 + 2 s)), each
//               product rounded in ggml's order; code = the grid entry times its sign (a sign is
//               a multiply by +-1 in ggml: exact, so db * (grid * sign) is its (db * grid) * sign)
//   iq1         (the grid held as iq1s_nibbles: each value plus 1 in a nibble, 4 bytes an entry)
//               ggml's value is dl * (grid + delta), grid in {-1, 0, 1}, delta +-1/8: here
//               d = dl / 8 (exact: dl is an f16 times an odd integer below 16, far from float's
//               subnormals) and code = 8 * grid + 8 * delta, an odd integer, so d * code is the
//               same real number rounded once: bit-exact with opdispatch.dtypes.dequantize
//
// Block layouts (bytes; d an IEEE half, little-endian; "group" = 8 values):
//   iq2_xxs 66: d, then 8 bytes a 32 values: 4 group indices (iq2xxs_grid), a u32 of 4 x 7 sign
//               bits (group l at bit 7l) and the 4-bit scale ls in bits 28..31
//   iq2_xs  74: d, qs u16[32] (group g: 9-bit iq2xs_grid index, 7 sign bits above), scales[8]
//               (a nibble a 16 values, low first)
//   iq2_s   82: d, qs[32] (index low bits of group g), signs[32] (one byte a group), qh[8] (2 index
//               high bits a group: group 4b + l at bits 2l of qh[b]), scales[8] as iq2_xs
//   iq3_xxs 98: d, qs[64] (an iq3xxs_grid index a 4 values), then a u32 a 32 values as iq2_xxs's
//   iq3_s  110: d, qs[64] (index low bits a 4 values), qh[8] (bit k of qh[b]: index 8b + k's
//               9th bit), signs[32] (a byte a group), scales[4] (a nibble a 32 values: 1 + 2 s)
//   iq1_s   50: d, qs[32] (index low bits a group), qh u16[8] a 32 values: 3 index high bits a
//               group (bit 3l), scale s (bits 12..14: dl = d * (2 s + 1)), delta's sign (bit 15)
//   iq1_m   56: qs[32], qh[16] (a nibble a group, low first: 3 index high bits, delta's sign
//               bit 3), scales u16[4] (3-bit s a 16 values, 4 a word at bits 3k; d is the f16
//               made of the words' top nibbles, word 0's lowest)
// The sign bits of a group are 7 (iq2_xxs, iq2_xs, iq3_xxs: the 8th is their parity, ggml's
// ksigns_iq2xs, computed here) or 8 (iq2_s, iq3_s). The dot products follow ggml's
// vec_dot_iq*_q8_1: integer dp4a sums per scale, then floats; where ggml's CUDA code rounds the
// scale's fraction away in integers ((ls * sum + sum / 2) / 4) the sums are scaled by the odd
// integer 2 ls + 1 instead and the power of two goes to the float scale (exact, as ggml's CPU dot).
#pragma once

#include "iq_grids.cuh"

namespace od {
namespace quant {

// What the grid formats share: no legacy fields, 256 values, no mins; a grid of ENTRIES entries of type E,
// which dot32_in reads through `grid` (ggml's table in global memory by default; mmvq_stream passes a
// GridAt of its copies in shared memory, where a warp's gather of 32 scattered entries costs fewer
// wavefronts than in the L1).
template <int BYTES_, int SUB_, class E, int ENTRIES_>
struct GridScaled : SubScaled<256, BYTES_, SUB_, -1> {
    using Entry = E;
    static constexpr int ENTRIES = ENTRIES_;
    static constexpr int GRID_BYTES = ENTRIES_ * static_cast<int>(sizeof(E));
};

// A grid held as copies interleaved entry by entry (entry i's copy r at entry i * copies + r), read from
// one copy: p its entry 0, stride = copies * sizeof(E) (mmvq_stream: the lane's copy, lane % copies, so that
// the lanes of one shared-memory wavefront meet distinct banks whatever entries they gather).
template <class E>
struct GridAt {
    const unsigned char* p;
    unsigned stride;
    __device__ __forceinline__ E operator[](unsigned i) const { return *reinterpret_cast<const E*>(p + i * stride); }
};

// ggml's ksigns_iq2xs: 7 sign bits and their parity as the 8th (an even count of minus signs).
__device__ __forceinline__ unsigned signs8(unsigned s7) { return s7 | ((__popc(s7) & 1u) << 7); }

// A group's sign masks: byte i of lo is 0xff where value i is negative, else 0 (values 0..3), of hi for
// value 4 + i.
struct Signs {
    unsigned lo, hi;
};

// The masks of 8 sign bits s (s < 512). s * 0x80402010 (0x08040201) holds copies of s 9 bits apart, which never
// carry, and so bit 3 - i (7 - i) as byte i's top bit; the byte permute spreads each top bit over its byte, the
// bytes in reverse order.
__device__ __forceinline__ Signs signs_of(unsigned s) {
    return {prmt(s * 0x80402010u, 0u, 0x89abu), prmt(s * 0x08040201u, 0u, 0x89abu)};
}

// The masks of ggml's 7 stored sign bits s7 and their parity as the 8th (signs8's): hi's byte 3 is the sign of
// byte 0 of popc(s7) << 7, whose top bit is the parity.
__device__ __forceinline__ Signs signs_of7(unsigned s7) {
    const unsigned parity = static_cast<unsigned>(__popc(s7)) << 7;
    return {prmt(s7 * 0x80402010u, 0u, 0x89abu), prmt(s7 * 0x08040201u, parity, 0xc9abu)};
}

// A signed dot product of grid bytes: pos - neg. A byte under a minus sign is taken as ~g = -g - 1, which
// leaves b's code there short: neg gathers minus those codes (the mask's bytes are -1), once a unit.
struct SignedDot {
    int pos = 0, neg = 0;
    __device__ __forceinline__ int value() const { return pos - neg; }
};

// Values 8l .. 8l+7 of a 32-value unit, the group's 8 int8 grid bytes g (low word: values 0..3) under
// its signs m, dotted with b's codes b[2l], b[2l+1].
__device__ __forceinline__ void dot_group(unsigned long long g, Signs m, const int (&b)[8], int l, SignedDot& acc) {
    acc.pos = dot4(static_cast<unsigned>(g) ^ m.lo, b[2 * l], acc.pos);
    acc.pos = dot4(static_cast<unsigned>(g >> 32) ^ m.hi, b[2 * l + 1], acc.pos);
    acc.neg = dot4(m.lo, b[2 * l], acc.neg);
    acc.neg = dot4(m.hi, b[2 * l + 1], acc.neg);
}

// Byte k (0..7) of a grid entry, as the signed value it is.
__device__ __forceinline__ int grid_byte(unsigned long long g, int k) {
    return static_cast<signed char>((g >> (8 * k)) & 0xffu);
}

// A grid value under sign bit k of s.
__device__ __forceinline__ int sign_of(int v, unsigned s, int k) { return ((s >> k) & 1u) ? -v : v; }

// iq2 scales: d * (0.5 + ls) * 0.25 (iq3_xxs: * 0.5), ggml's three roundings.
__device__ __forceinline__ float half_ls(float d, unsigned ls, float quarter) {
    return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, static_cast<float>(ls))), quarter);
}

// -- iq2 -----------------------------------------------------------------------------------------

struct iq2_xxs : GridScaled<66, 32, unsigned long long, 256> {
    static __device__ __forceinline__ const Entry* global_grid() { return iq2xxs_grid; }
    static constexpr int D = 0, QS = 2;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        d = half_ls(half_at(blk + D), ld32_2(blk + QS + 8 * s + 4) >> 28, 0.25f);
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const unsigned char* u = blk + QS + 8 * (j >> 5);
        const int l = (j >> 3) & 3;
        const unsigned s = signs8((ld32_2(u + 4) >> (7 * l)) & 127u);
        return sign_of(grid_byte(iq2xxs_grid[u[l]], j & 7), s, j & 7);
    }
    template <class S, class G = const Entry*>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds,
                                                    G grid = global_grid()) {
        const unsigned q = src.u32(QS + 8 * u), aux = src.u32(QS + 8 * u + 4);
        SignedDot sum;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            dot_group(grid[(q >> (8 * l)) & 0xffu], signs_of7((aux >> (7 * l)) & 127u), b, l, sum);
        }
        const int ls = static_cast<int>(aux >> 28);
        return ds.x * (half_in(src, D) * 0.125f) * static_cast<float>((2 * ls + 1) * sum.value());
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

// iq2_xs and iq2_s: a nibble scale a 16 values (scales[8] at byte SC); their dot products sum each half apart.
template <int BYTES_, int SC_, int ENTRIES_>
struct Iq2Halves : GridScaled<BYTES_, 16, unsigned long long, ENTRIES_> {
    static constexpr int D = 0, QS = 2, SC = SC_;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        d = half_ls(half_at(blk + D), (blk[SC + (s >> 1)] >> (4 * (s & 1))) & 15u, 0.25f);
        m = 0.0f;
    }
    // d / 8 * ((2 ls0 + 1) * lo + (2 ls1 + 1) * hi), the unit's two halves' sums lo, hi
    template <class S>
    static __device__ __forceinline__ float finish(const S& src, int u, int lo, int hi, float2 ds) {
        const unsigned sc = src.u8(SC + u);
        const int ls0 = static_cast<int>(sc & 15u), ls1 = static_cast<int>(sc >> 4);
        return ds.x * (half_in(src, D) * 0.125f) * static_cast<float>((2 * ls0 + 1) * lo + (2 * ls1 + 1) * hi);
    }
};

struct iq2_xs : Iq2Halves<74, 66, 512> {
    static __device__ __forceinline__ const Entry* global_grid() { return iq2xs_grid; }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const unsigned q = ld16(blk + QS + 2 * (j >> 3));
        return sign_of(grid_byte(iq2xs_grid[q & 511u], j & 7), signs8(q >> 9), j & 7);
    }
    template <class S, class G = const Entry*>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds,
                                                    G grid = global_grid()) {
        SignedDot sum[2];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned q = src.u16(QS + 8 * u + 2 * l);
            dot_group(grid[q & 511u], signs_of7(q >> 9), b, l, sum[l >> 1]);
        }
        return finish(src, u, sum[0].value(), sum[1].value(), ds);
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

struct iq2_s : Iq2Halves<82, 74, 1024> {
    static __device__ __forceinline__ const Entry* global_grid() { return iq2s_grid; }
    static constexpr int SG = 34, QH = 66;
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const int g = j >> 3;
        const unsigned idx = blk[QS + g] | (((blk[QH + (g >> 2)] >> (2 * (g & 3))) & 3u) << 8);
        return sign_of(grid_byte(iq2s_grid[idx], j & 7), blk[SG + g], j & 7);
    }
    template <class S, class G = const Entry*>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds,
                                                    G grid = global_grid()) {
        const unsigned qs = src.u32(QS + 4 * u), sg = src.u32(SG + 4 * u), qh = src.u8(QH + u);
        SignedDot sum[2];
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned idx = ((qs >> (8 * l)) & 0xffu) | (((qh >> (2 * l)) & 3u) << 8);
            dot_group(grid[idx], signs_of((sg >> (8 * l)) & 0xffu), b, l, sum[l >> 1]);
        }
        return finish(src, u, sum[0].value(), sum[1].value(), ds);
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

// -- iq3: an index a 4 values ------------------------------------------------------------------

// Values 8l .. 8l+7 from two iq3 grid entries (4 bytes each) under signs m.
__device__ __forceinline__ void dot_group3(unsigned g0, unsigned g1, Signs m, const int (&b)[8], int l,
                                           SignedDot& acc) {
    dot_group(g0 | (static_cast<unsigned long long>(g1) << 32), m, b, l, acc);
}

struct iq3_xxs : GridScaled<98, 32, unsigned, 256> {
    static __device__ __forceinline__ const Entry* global_grid() { return iq3xxs_grid; }
    static constexpr int D = 0, QS = 2, SS = 66;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        d = half_ls(half_at(blk + D), ld32_2(blk + SS + 4 * s) >> 28, 0.5f);
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const unsigned s = signs8((ld32_2(blk + SS + 4 * (j >> 5)) >> (7 * ((j >> 3) & 3))) & 127u);
        return sign_of(grid_byte(iq3xxs_grid[blk[QS + (j >> 2)]], j & 3), s, j & 7);
    }
    template <class S, class G = const Entry*>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds,
                                                    G grid = global_grid()) {
        const unsigned q[2] = {src.u32(QS + 8 * u), src.u32(QS + 8 * u + 4)};
        const unsigned aux = src.u32(SS + 4 * u);
        SignedDot sum;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned w = q[l >> 1] >> (16 * (l & 1));
            dot_group3(grid[w & 0xffu], grid[(w >> 8) & 0xffu], signs_of7((aux >> (7 * l)) & 127u), b, l, sum);
        }
        const int ls = static_cast<int>(aux >> 28);
        return ds.x * (half_in(src, D) * 0.25f) * static_cast<float>((2 * ls + 1) * sum.value());
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

struct iq3_s : GridScaled<110, 32, unsigned, 512> {
    static __device__ __forceinline__ const Entry* global_grid() { return iq3s_grid; }
    static constexpr int D = 0, QS = 2, QH = 66, SG = 74, SC = 106;
    template <class S>
    static __device__ __forceinline__ int ls(const S& src, int s) {
        return static_cast<int>((src.u8(SC + (s >> 1)) >> (4 * (s & 1))) & 15u);
    }
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        d = __fmul_rn(half_at(blk + D), static_cast<float>(1 + 2 * ls(Mem<false>{blk}, s)));
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const int k = j >> 2;  // the index, 0..63
        const unsigned idx = blk[QS + k] | (((blk[QH + (k >> 3)] >> (k & 7)) & 1u) << 8);
        return sign_of(grid_byte(iq3s_grid[idx], j & 3), blk[SG + (j >> 3)], j & 7);
    }
    template <class S, class G = const Entry*>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds,
                                                    G grid = global_grid()) {
        const unsigned q[2] = {src.u32(QS + 8 * u), src.u32(QS + 8 * u + 4)};
        const unsigned qh = src.u8(QH + u), sg = src.u32(SG + 4 * u);
        SignedDot sum;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned w = q[l >> 1] >> (16 * (l & 1));
            const unsigned i0 = (w & 0xffu) | (((qh >> (2 * l)) & 1u) << 8);
            const unsigned i1 = ((w >> 8) & 0xffu) | (((qh >> (2 * l + 1)) & 1u) << 8);
            dot_group3(grid[i0], grid[i1], signs_of((sg >> (8 * l)) & 0xffu), b, l, sum);
        }
        return ds.x * half_in(src, D) * static_cast<float>((1 + 2 * ls(src, u)) * sum.value());
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

// -- iq1: grid values -1, 0, 1 plus a delta of +-1/8 ----------------------------------------------

// An iq1s_nibbles entry g (iq_grids.cuh: a group's values plus 1, 0..2, value k in byte k's low nibble, 4 + k in
// its high) dotted with b's codes b[2l], b[2l+1] where the nibbles lie: lo gathers the low nibbles' dots, hi 16
// times the high nibbles' (unsigned bytes, od::dp4a_us); the plain dot is lo + hi / 16 minus b's sum there.
__device__ __forceinline__ void dot_iq1(unsigned g, const int (&b)[8], int l, int& lo, int& hi) {
    lo = dp4a_us(g & 0x0f0f0f0fu, b[2 * l], lo);
    hi = dp4a_us(g & 0xf0f0f0f0u, b[2 * l + 1], hi);
}

// 8 * (grid value k of entry g) + (delta negative ? -1 : 1): 8 * (grid + delta).
__device__ __forceinline__ int iq1_code(unsigned g, int k, bool minus) {
    const int v = static_cast<int>((g >> (8 * (k & 3) + 4 * (k >> 2))) & 15u) - 1;
    return 8 * v + (minus ? -1 : 1);
}

struct iq1_s : GridScaled<50, 32, unsigned, 2048> {
    static __device__ __forceinline__ const Entry* global_grid() { return iq1s_nibbles; }
    static constexpr int D = 0, QS = 2, QH = 34;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        const unsigned h = ld16(blk + QH + 2 * s);
        d = __fmul_rn(__fmul_rn(half_at(blk + D), static_cast<float>(2 * ((h >> 12) & 7u) + 1)), 0.125f);
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const unsigned h = ld16(blk + QH + 2 * (j >> 5));
        const int l = (j >> 3) & 3;
        const unsigned idx = blk[QS + (j >> 3)] | (((h >> (3 * l)) & 7u) << 8);
        return iq1_code(iq1s_nibbles[idx], j & 7, (h & 0x8000u) != 0);
    }
    // ggml's: dl * (db * sum(grid * b) + delta * db * sum(b)), db * sum(b) being q8_1's ds.y; here the dot of
    // grid + 1 (dot_iq1's) and delta - 1
    template <class S, class G = const Entry*>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds,
                                                    G grid = global_grid()) {
        const unsigned qs = src.u32(QS + 4 * u), h = src.u16(QH + 2 * u);
        int lo = 0, hi = 0;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            dot_iq1(grid[((qs >> (8 * l)) & 0xffu) | (((h >> (3 * l)) & 7u) << 8)], b, l, lo, hi);
        }
        const float dl = half_in(src, D) * static_cast<float>(2 * ((h >> 12) & 7u) + 1);
        const float delta = (h & 0x8000u) ? -1.125f : -0.875f;
        return dl * (ds.x * static_cast<float>(lo + (hi >> 4)) + ds.y * delta);
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

struct iq1_m : GridScaled<56, 16, unsigned, 2048> {
    static __device__ __forceinline__ const Entry* global_grid() { return iq1s_nibbles; }
    static constexpr int QS = 0, QH = 32, SC = 48;
    // d: the f16 of the 4 scale words' top nibbles
    template <class S>
    static __device__ __forceinline__ float dd(const S& src) {
        const unsigned lo = src.u32(SC), hi = src.u32(SC + 4);
        const unsigned h = ((lo >> 12) & 0xfu) | ((lo >> 24) & 0xf0u) | ((hi >> 4) & 0xf00u) | ((hi >> 16) & 0xf000u);
        return f16_to_f32(static_cast<unsigned short>(h));
    }
    // the 3-bit scale of values 16s .. 16s+15
    template <class S>
    static __device__ __forceinline__ int sc3(const S& src, int s) {
        return static_cast<int>((src.u16(SC + 2 * (s >> 2)) >> (3 * (s & 3))) & 7u);
    }
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        const Mem<false> src{blk};
        d = __fmul_rn(__fmul_rn(dd(src), static_cast<float>(2 * sc3(src, s) + 1)), 0.125f);
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const int t = j >> 3;  // the group
        const unsigned nib = (blk[QH + (t >> 1)] >> (4 * (t & 1))) & 15u;
        return iq1_code(iq1s_nibbles[blk[QS + t] | ((nib & 7u) << 8)], j & 7, (nib & 8u) != 0);
    }
    // ggml's: per half, sum(grid * b) + delta * sum(b) group by group, here 8 times that in integers: the dot of
    // grid + 1 (dot_iq1's) and (delta - 1) * sum(b)
    template <class S, class G = const Entry*>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds,
                                                    G grid = global_grid()) {
        const unsigned qs = src.u32(QS + 4 * u), qh = src.u16(QH + 2 * u);
        int sum[2] = {0, 0};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int lo = 0, hi = 0;
#pragma unroll
            for (int l = 2 * half; l < 2 * half + 2; ++l) {
                const unsigned nib = (qh >> (4 * l)) & 15u;
                dot_iq1(grid[((qs >> (8 * l)) & 0xffu) | ((nib & 7u) << 8)], b, l, lo, hi);
                const int sumb = dot4(0x01010101u, b[2 * l + 1], dot4(0x01010101u, b[2 * l], 0));
                sum[half] += (nib & 8u) ? -9 * sumb : -7 * sumb;
            }
            sum[half] += 8 * (lo + (hi >> 4));
        }
        const int s0 = 2 * sc3(src, 2 * u) + 1, s1 = 2 * sc3(src, 2 * u + 1) + 1;
        return ds.x * (dd(src) * 0.125f) * static_cast<float>(s0 * sum[0] + s1 * sum[1]);
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

}  // namespace quant
}  // namespace od
