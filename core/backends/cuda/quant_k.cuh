// ggml's sub-scaled block formats on the device, defined once (included by quant.cuh, whose
// generic accessors decode<Q> and load_unit<Q> reach them): the K-quants q2_K .. q6_K (256 values
// a super-block), iq4_nl (32), iq4_xs (256) and mxfp4 (32). Each traits struct gives
//
//   scale(blk, s, d, m)   sub-block s's scale d (ggml's d * sc as one float product) and, where
//                         the format has mins (M >= 0), its min m (dmin * min), subtracted
//   code(blk, j)          value j's integer code: signed (offset applied) or its table entry
//   dot32(blk, u, b, ds)  values 32u .. 32u+31 dotted with their q8_1 codes: b[i] holds the codes
//                         of values 4i .. 4i+3, ds = (q8_1 d, d * sum(codes)) (the mat-vecs)
//   dot32_in(src, u, b, ds)  the same, the block's bytes read through a byte source (Mem: memory at
//                         a pointer, what dot32 passes; Regs: the register words of a run of blocks,
//                         mmvq_stream's chunks), the same operations in the same order; dot32_in<true>
//                         takes b as mmvq_stream stores it where that differs (PAIRS, HALF_SUMS)
//
// so that value j = d * code - m, ggml's dequantize_row_* one float32 operation at a time
// ((d*sc)*q - (dmin*m)), bit-exact with opdispatch.dtypes.dequantize (and gguf-py's quants).
// Block layouts (bytes; d, dmin IEEE halves, little-endian):
//   q2_K   84: scales[16] (low nibble sc, high nibble min, 16 values each), qs[64], d, dmin
//              code of value 128n + 32c + l: crumb c (bits 2c) of qs[32n + l]
//   q3_K  110: hmask[32], qs[64], scales[12] (16 six-bit scales, offset 32), d
//              code = crumb as q2_K, minus 4 where bit (j / 32) of hmask[j % 32] is clear
//   q4_K  144: d, dmin, scales[12] (8 six-bit scales and mins, 32 values each), qs[128]
//              code of value 64c + 32h + l: nibble h of qs[32c + l]
//   q5_K  176: d, dmin, scales[12], qh[32], qs[128]: q4_K's code | bit (j / 32) of qh[l] << 4
//   q6_K  210: ql[128], qh[64], scales[16] (int8, 16 values each), d; code offset 32:
//              value 128n + r: nibble r / 64 of ql[64n + r % 64] | crumb r / 32 of qh[32n + r % 32] << 4
//   iq4_nl 18: d, qs[16]; value j = d * kvalues_iq4nl[nibble], nibbles as q4_0's (j low, j+16 high)
//   iq4_xs 136: d, scales_h (u16), scales_l[4], qs[128]; sub-block s (32 values): 6-bit scale
//              (nibble s % 2 of scales_l[s / 2] | crumb s of scales_h << 4) - 32, qs[16s ..] as iq4_nl
//   mxfp4  17: e (e8m0), qs[16]; value j = (2^(e-127) / 2) * kvalues_mxfp4 (doubled e2m1), nibbles
//              as q4_0's. 17 bytes: blocks sit at any address, so mxfp4 reads bytes only.
// Blocks of the other formats start at even addresses (buffers aligned, sizes even): 16-bit loads.
// The dot products follow ggml's vec_dot_*_q8_1 (integer dp4a sums per scale, then floats); their
// float order is not dequantize's (they are compared by NMSE).
#pragma once

namespace od {
namespace quant {

// What the sub-scaled formats share: no legacy Block32 fields; SUB values a scale.
template <int QK_, int BYTES_, int SUB_, int M_>
struct SubScaled {
    static constexpr bool LEGACY = false;
    static constexpr int QK = QK_;
    static constexpr int BYTES = BYTES_;
    static constexpr int SUB = SUB_;  // values sharing one scale (and min)
    static constexpr int M = M_;      // byte offset of dmin, -1 without mins
    static constexpr bool PAIRS = false;  // dot32_in<true> takes b's codes in nibble-pair order (pair_word)
    // dot32_in<true> takes the sums of b's codes over each half of 16 in ds.y's bits (two int16, low half
    // first: mmvq_stream's b) instead of d * sum(codes)
    static constexpr bool HALF_SUMS = false;
    static constexpr int GRID_BYTES = 0;  // a grid format's lookup grid (quant_iq.cuh's GridScaled)
};

// A 16-entry int8 table as 4 words (entry i is byte i % 4 of word i / 4).
struct Table16 {
    unsigned w[4];
};

__device__ __forceinline__ constexpr unsigned pack4(int a, int b, int c, int d) {
    return (static_cast<unsigned>(a) & 0xffu) | ((static_cast<unsigned>(b) & 0xffu) << 8)
        | ((static_cast<unsigned>(c) & 0xffu) << 16) | ((static_cast<unsigned>(d) & 0xffu) << 24);
}

// ggml's kvalues_iq4nl, and kvalues_mxfp4 (e2m1 values doubled).
__device__ __forceinline__ constexpr Table16 iq4nl_table() {
    return {{pack4(-127, -104, -83, -65), pack4(-49, -35, -22, -10), pack4(1, 13, 25, 38), pack4(53, 69, 89, 113)}};
}
__device__ __forceinline__ constexpr Table16 mxfp4_table() {
    return {{pack4(0, 1, 2, 3), pack4(4, 6, 8, 12), pack4(0, -1, -2, -3), pack4(-4, -6, -8, -12)}};
}

// mxfp4's values plus MXFP4_BIAS, all in [0, 127]: its dot products look them up (lookup8_pairs<true>) and subtract
// MXFP4_BIAS times b's sum
constexpr int MXFP4_BIAS = 12;
__device__ __forceinline__ constexpr Table16 mxfp4_biased_table() {
    return {{pack4(12, 13, 14, 15), pack4(16, 18, 20, 24), pack4(12, 11, 10, 9), pack4(8, 6, 4, 0)}};
}

// The 4-bit table formats (iq4_nl, iq4_xs, mxfp4): dot32_in<PAIRED> takes b's codes in natural order, or in
// nibble-pair order (dot8's sum does not depend on it: mmvq_stream stores its b so, mmv reads quantize_q8_1's).
template <int QK_, int BYTES_>
struct Table4 : SubScaled<QK_, BYTES_, 32, -1> {
    static constexpr bool PAIRS = true;
};

__device__ __forceinline__ float half_at(const unsigned char* p) {
    return f16_to_f32(static_cast<unsigned short>(ld16(p)));
}

// Bytes at any address (mxfp4) as a little-endian word.
__device__ __forceinline__ unsigned ld32_1(const unsigned char* p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<unsigned>(p[3]) << 24);
}

// Byte sources of dot32_in: u8 / u16 / u32 (o) = the little-endian byte, half-word, word at byte o of
// the block. Mem reads memory at p: 2-byte aligned blocks (16-bit loads), or any address (ANY: byte
// loads, mxfp4's). Regs reads the words w of a run of blocks held in registers, the block at byte `at`
// of them: with `at` and o compile-time constants once unrolled, every access is a register (and a
// funnel shift where it straddles two words), so the array stays in registers.
template <bool ANY>
struct Mem {
    const unsigned char* p;
    __device__ __forceinline__ unsigned u8(int o) const { return p[o]; }
    __device__ __forceinline__ unsigned u16(int o) const {
        return ANY ? p[o] | (static_cast<unsigned>(p[o + 1]) << 8) : ld16(p + o);
    }
    __device__ __forceinline__ unsigned u32(int o) const { return ANY ? ld32_1(p + o) : ld32_2(p + o); }
};

struct Regs {
    const unsigned* w;
    int at;
    __device__ __forceinline__ unsigned u32(int o) const {
        const int b = at + o;
        return b % 4 == 0 ? w[b / 4] : __funnelshift_rc(w[b / 4], w[b / 4 + 1], 8 * (b % 4));
    }
    __device__ __forceinline__ unsigned u16(int o) const {
        const int b = at + o;
        return (b % 4 == 3 ? u32(o) : w[b / 4] >> (8 * (b % 4))) & 0xffffu;
    }
    __device__ __forceinline__ unsigned u8(int o) const { return (w[(at + o) / 4] >> (8 * ((at + o) % 4))) & 0xffu; }
};

template <class S>
__device__ __forceinline__ float half_in(const S& src, int o) {
    return f16_to_f32(static_cast<unsigned short>(src.u16(o)));
}

// Crumb c (bits 2c, 2c+1) of each byte of w, and 1-bit field b of each byte, as bytes.
__device__ __forceinline__ unsigned crumbs4(unsigned w, int c) { return (w >> (2 * c)) & 0x03030303u; }
__device__ __forceinline__ unsigned bits4(unsigned w, int b) { return (w >> b) & 0x01010101u; }

// Bytes of w holding B-bit two's complement codes (B = 3 or 6), sign-extended to int8 each (no
// carry crosses a byte: the sign bit times 2^(8-B) - 2 fills the bits above it).
template <int B>
__device__ __forceinline__ unsigned sext4(unsigned w) {
    constexpr unsigned sign = 0x01010101u << (B - 1);
    return w | (w & sign) * ((1u << (8 - B + 1)) - 2u);
}

// Raw codes 0 .. 2^B - 1 of each byte minus 2^(B-1), as int8 bytes (q3_K's - 4, q6_K's - 32, in mmq's tiles; the
// dot32s fold the offset into how they dot the code fields instead: q3_K's mat-vec 13.9 -> 11.6 us at 14336x4096 on
// the H200 when they first did so, q6_K's 14.5 -> 14.1, session 20).
template <int B>
__device__ __forceinline__ unsigned centre4(unsigned w) {
    return sext4<B>(w ^ (0x01010101u << (B - 1)));
}

__device__ __forceinline__ int dot4(unsigned a, unsigned b, int c) {
    return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
}

// The table entries of the 8 nibbles of w, a word of q4_0-style nibbles (low nibbles values 4i ..
// 4i+3, high nibbles 16+4i ..), in nibble order: p0 = the entries of nibbles 0..3 (byte 0's low then
// high nibble, byte 1's), p1 = nibbles 4..7. Byte permutes read a nibble as a selector (its 3 low bits
// pick one of the 8 bytes of a pair of table words): the two pairs' picks, then each nibble's bit 3
// chooses between them (selector byte i or 4 + i). 11 operations for 8 values.
// POS: every entry of t in [0, 127] (mxfp4_biased_table): each half's picks take the nibbles as they are, a selector
// nibble with bit 3 set giving its byte's sign bit, 0 here: the low half's picks with w, the high half's with w ^
// 0x88888888, OR-ed (9 operations for 8 values).
template <bool POS = false>
__device__ __forceinline__ void lookup8_pairs(const Table16& t, unsigned w, unsigned& p0, unsigned& p1) {
    if constexpr (POS) {
        const unsigned x = w ^ 0x88888888u;
        p0 = prmt(t.w[0], t.w[1], w) | prmt(t.w[2], t.w[3], x);
        p1 = prmt(t.w[0], t.w[1], w >> 16) | prmt(t.w[2], t.w[3], x >> 16);
    } else {
        const unsigned x = w & 0x77777777u;
        const unsigned s = ((w >> 1) & 0x44444444u) | 0x32103210u;
        p0 = prmt(prmt(t.w[0], t.w[1], x), prmt(t.w[2], t.w[3], x), s);
        p1 = prmt(prmt(t.w[0], t.w[1], x >> 16), prmt(t.w[2], t.w[3], x >> 16), s >> 16);
    }
}

// The same entries sorted by value: lo = the low nibbles' entries (values 4i .. 4i+3), hi = the high
// nibbles' (13 operations, where masking, shifting and selecting each index took 27).
template <bool POS = false>
__device__ __forceinline__ void lookup8(const Table16& t, unsigned w, unsigned& lo, unsigned& hi) {
    unsigned p0, p1;
    lookup8_pairs<POS>(t, w, p0, p1);
    lo = prmt(p0, p1, 0x6420u);
    hi = prmt(p0, p1, 0x7531u);
}

// b's 8 code words of a unit (natural order: word i holds the codes of values 4i .. 4i+3) in nibble-pair
// order, the order lookup8_pairs gives a qs word's entries in: word 2i = the codes of values 4i, 16+4i,
// 4i+1, 17+4i, word 2i+1 those of 4i+2, 18+4i, 4i+3, 19+4i. The table formats' dot32_in<true> take b so.
__device__ __forceinline__ unsigned pair_word(unsigned lo_word, unsigned hi_word, int half) {
    return prmt(lo_word, hi_word, half == 0 ? 0x5140u : 0x7362u);
}

// Entry i (0..15) of t.
__device__ __forceinline__ int entry(const Table16& t, unsigned i) {
    const unsigned pick = prmt(t.w[0], t.w[1], i & 7u), pick_hi = prmt(t.w[2], t.w[3], i & 7u);
    return static_cast<signed char>((i & 8u ? pick_hi : pick) & 0xffu);
}

// The dot of 8 code words with b, in two halves of 16 values (the formats with 16-value scales). UNSIGNED: q's bytes
// unsigned (od::dp4a_us), for code fields masked where they lie in their bytes, each half's sum then shifted down once
// by the caller (q2_K, q3_K, q6_K).
template <bool UNSIGNED = false>
__device__ __forceinline__ int2 dot_halves(const unsigned (&q)[8], const int (&b)[8]) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo = UNSIGNED ? dp4a_us(q[i], b[i], lo) : dot4(q[i], b[i], lo);
        hi = UNSIGNED ? dp4a_us(q[i + 4], b[i + 4], hi) : dot4(q[i + 4], b[i + 4], hi);
    }
    return make_int2(lo, hi);
}

// The q4_0-style nibbles of the 16 bytes at byte qs of src (value i low nibble of byte i, value 16 + i
// high) through table t: q[i] = the entries of values 4i .. 4i+3, or with PAIRED in nibble-pair order
// (pair_word's), two permutes a word fewer.
template <bool PAIRED, bool POS = false, class S>
__device__ __forceinline__ void table_words(const S& src, int qs, const Table16& t, unsigned (&q)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (PAIRED) {
            lookup8_pairs<POS>(t, src.u32(qs + 4 * i), q[2 * i], q[2 * i + 1]);
        } else {
            lookup8<POS>(t, src.u32(qs + 4 * i), q[i], q[i + 4]);
        }
    }
}

// lo and hi's low 16 bits as one word, lo's first (dp2a's int16 pair)
__device__ __forceinline__ int pack16(int lo, int hi) {
    return static_cast<int>(prmt(static_cast<unsigned>(lo), static_cast<unsigned>(hi), 0x5410u));
}

// x * 2^sh, sh of either sign (a constant once unrolled; x >> -sh exact on the masked dots, multiples of 2^-sh).
__device__ __forceinline__ int shift2(int x, int sh) {
    return sh >= 0 ? x << sh : x >> -sh;
}

// b's codes summed over each half of 16 (dp4a against ones): the formats with 16-value scales and a code
// offset or mins apply those to the sums instead of to each code.
__device__ __forceinline__ int2 sum_halves(const int (&b)[8]) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo = dot4(0x01010101u, b[i], lo);
        hi = dot4(0x01010101u, b[i + 4], hi);
    }
    return make_int2(lo, hi);
}

// b's code sums over each half of 16 as an int16 pair (dp2a's operand, |sum| <= 16 * 127): given in ds.y's bits
// (SUMS: mmvq_stream's b for SubScaled::HALF_SUMS formats), or summed here.
template <bool SUMS>
__device__ __forceinline__ int half_sums(const int (&b)[8], float2 ds) {
    if constexpr (SUMS) {
        return __float_as_int(ds.y);
    } else {
        const int2 sb = sum_halves(b);
        return pack16(sb.x, sb.y);
    }
}

__device__ __forceinline__ int dot8(const unsigned (&q)[8], const int (&b)[8]) {
    const int2 h = dot_halves(q, b);
    return h.x + h.y;
}

// -- the K-quants -------------------------------------------------------------------------------

struct q2_K : SubScaled<256, 84, 16, 82> {
    static constexpr int SC = 0, QS = 16, D = 80;
    static constexpr bool HALF_SUMS = true;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        const unsigned sc = blk[SC + s];
        d = __fmul_rn(half_at(blk + D), static_cast<float>(sc & 15u));
        m = __fmul_rn(half_at(blk + M), static_cast<float>(sc >> 4));
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        return (blk[QS + 32 * (j >> 7) + (j & 31)] >> (2 * ((j >> 5) & 3))) & 3;
    }
    template <bool SUMS = false, class S>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds) {
        const int qs = QS + 32 * (u >> 2), c = u & 3;
        unsigned q[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = src.u32(qs + 4 * i) & (0x03030303u << (2 * c));  // crumb c where it lies: 4^c times the codes
        }
        const int2 h = dot_halves<true>(q, b);
        // the halves' scale bytes (sc in the low nibbles, mins in the high), each half's products summed by dp2a over
        // int16 pairs (|sums| < 2^15): the codes' dots, and the mins times the sums of b's codes over each half
        const unsigned sc = src.u16(SC + 2 * u);
        const int dots = __dp2a_lo(pack16(h.x >> (2 * c), h.y >> (2 * c)), static_cast<int>(sc & 0x0f0fu), 0);
        const int mins = __dp2a_lo(half_sums<SUMS>(b, ds), static_cast<int>((sc >> 4) & 0x0f0fu), 0);
        return ds.x * (half_in(src, D) * static_cast<float>(dots) - half_in(src, M) * static_cast<float>(mins));
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

struct q3_K : SubScaled<256, 110, 16, -1> {
    static constexpr int HM = 0, QS = 32, SC = 96, D = 108;
    template <class S>
    static __device__ __forceinline__ int sc6(const S& src, int s) {
        const unsigned lo4 = (src.u8(SC + (s & 7)) >> (4 * (s >> 3))) & 15u;
        const unsigned hi2 = (src.u8(SC + 8 + (s & 3)) >> (2 * (s >> 2))) & 3u;
        return static_cast<int>(lo4 | (hi2 << 4)) - 32;
    }
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        d = __fmul_rn(half_at(blk + D), static_cast<float>(sc6(Mem<false>{blk}, s)));
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const int low = (blk[QS + 32 * (j >> 7) + (j & 31)] >> (2 * ((j >> 5) & 3))) & 3;
        return ((blk[HM + (j & 31)] >> (j >> 5)) & 1) ? low : low - 4;
    }
    template <class S>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds) {
        // code = crumb - 4 where the hmask bit is clear: the crumbs where they lie (4^c times) and the clear bits
        // where they lie (2^u times), dotted apart
        const int qs = QS + 32 * (u >> 2), c = u & 3;
        unsigned lo[8], clear[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            lo[i] = src.u32(qs + 4 * i) & (0x03030303u << (2 * c));
            clear[i] = ~src.u32(HM + 4 * i) & (0x01010101u << u);
        }
        const int2 dl = dot_halves<true>(lo, b), dc = dot_halves<true>(clear, b);
        const int hx = (dl.x >> (2 * c)) - shift2(dc.x, 2 - u), hy = (dl.y >> (2 * c)) - shift2(dc.y, 2 - u);
        return ds.x * half_in(src, D) * static_cast<float>(sc6(src, 2 * u) * hx + sc6(src, 2 * u + 1) * hy);
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

// q4_K and q5_K's 12 bytes of six-bit scales and mins at byte sc of src (ggml's get_scale_min_k4).
template <class S>
__device__ __forceinline__ void scale_min_k4(const S& src, int sc, int s, unsigned& scale, unsigned& min) {
    if (s < 4) {
        scale = src.u8(sc + s) & 63u;
        min = src.u8(sc + s + 4) & 63u;
    } else {
        scale = (src.u8(sc + s + 4) & 15u) | ((src.u8(sc + s - 4) >> 6) << 4);
        min = (src.u8(sc + s + 4) >> 4) | ((src.u8(sc + s) >> 6) << 4);
    }
}

template <int BYTES_, int QH_, int QS_>
struct K4 : SubScaled<256, BYTES_, 32, 2> {
    static constexpr int D = 0, SC = 4, QH = QH_, QS = QS_;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        unsigned sc, mn;
        scale_min_k4(Mem<false>{blk}, SC, s, sc, mn);
        d = __fmul_rn(half_at(blk + D), small_f32(sc));  // not static_cast: an I2F.U16 (common.cuh)
        m = __fmul_rn(half_at(blk + 2), small_f32(mn));
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        int q = (blk[QS + 32 * (j >> 6) + (j & 31)] >> (4 * ((j >> 5) & 1))) & 15;
        if constexpr (QH >= 0) {
            q |= ((blk[QH + (j & 31)] >> (j >> 5)) & 1) << 4;
        }
        return q;
    }
    template <class S>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds) {
        // the nibbles (and q5_K's high bits) dotted where they lie in their bytes (16^(u % 2) and 2^u times the
        // fields, unsigned), each sum shifted once
        const int qs = QS + 32 * (u >> 1);
        unsigned lo[8], hi[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            lo[i] = src.u32(qs + 4 * i) & (0x0f0f0f0fu << (4 * (u & 1)));
            hi[i] = QH >= 0 ? src.u32(QH + 4 * i) & (0x01010101u << u) : 0u;
        }
        const int2 dl = dot_halves<true>(lo, b);
        int dot = (dl.x + dl.y) >> (4 * (u & 1));
        if constexpr (QH >= 0) {
            const int2 dh = dot_halves<true>(hi, b);
            dot += shift2(dh.x + dh.y, 4 - u);
        }
        unsigned sc, mn;
        scale_min_k4(src, SC, u, sc, mn);
        return half_in(src, D) * static_cast<float>(sc) * (ds.x * static_cast<float>(dot))
            - half_in(src, 2) * static_cast<float>(mn) * ds.y;
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

struct q4_K : K4<144, -1, 16> {};
struct q5_K : K4<176, 16, 48> {};

struct q6_K : SubScaled<256, 210, 16, -1> {
    static constexpr int QL = 0, QH = 128, SC = 192, D = 208;
    static constexpr bool HALF_SUMS = true;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        d = __fmul_rn(half_at(blk + D), s8_f32(blk[SC + s]));  // not static_cast: an I2F.S16 (common.cuh)
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        const int n = j >> 7, r = j & 127;
        const int low = (blk[QL + 64 * n + (r & 63)] >> (4 * (r >> 6))) & 15;
        const int high = (blk[QH + 32 * n + (r & 31)] >> (2 * (r >> 5))) & 3;
        return (low | (high << 4)) - 32;
    }
    template <bool SUMS = false, class S>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds) {
        const int n = u >> 2, c = u & 3;  // values 128n + 32c ..
        const int ql = QL + 64 * n + 32 * (c & 1), qh = QH + 32 * n;
        unsigned lo[8], hi[8];
        if constexpr (!SUMS) {
            // without b's half sums at hand (mmvq, mmvq_id: quantize_q8_1's b): code - 32 = low + 16 (high - 2), the
            // low nibbles where they lie (16^(c / 2) times, unsigned) and high - 2 as each byte's signed top crumb
            // ((high ^ 2) << 6: 64 times the value, signed dp4a); summing b's halves here took mmvq<q6_K> at 2-5
            // columns from 72-128 to 96-168 registers (ptxas, sm_90)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                lo[i] = src.u32(ql + 4 * i) & (0x0f0f0f0fu << (4 * (c >> 1)));
                hi[i] = ((src.u32(qh + 4 * i) << (6 - 2 * c)) & 0xc0c0c0c0u) ^ 0x80808080u;
            }
            const int2 dl = dot_halves<true>(lo, b), dh = dot_halves(hi, b);
            const int hx = (dl.x >> (4 * (c >> 1))) + (dh.x >> 2), hy = (dl.y >> (4 * (c >> 1))) + (dh.y >> 2);
            const unsigned sc = src.u16(SC + 2 * u);
            const int s0 = static_cast<signed char>(sc & 0xffu), s1 = static_cast<signed char>(sc >> 8);
            return ds.x * half_in(src, D) * static_cast<float>(s0 * hx + s1 * hy);
        }
        // code - 32 = low + 16 high - 32: the low nibbles and the high crumbs dotted where they lie (16^(c / 2) and
        // 4^c times the fields, unsigned), then 32 times the halves' scaled sums of b's codes subtracted once (one
        // dp2a over the sums mmvq_stream's b carries)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            lo[i] = src.u32(ql + 4 * i) & (0x0f0f0f0fu << (4 * (c >> 1)));
            hi[i] = src.u32(qh + 4 * i) & (0x03030303u << (2 * c));
        }
        const int2 dl = dot_halves<true>(lo, b), dh = dot_halves<true>(hi, b);
        const int hx = (dl.x >> (4 * (c >> 1))) + shift2(dh.x, 4 - 2 * c);
        const int hy = (dl.y >> (4 * (c >> 1))) + shift2(dh.y, 4 - 2 * c);
        const unsigned sc = src.u16(SC + 2 * u);  // the halves' int8 scales
        const int s0 = static_cast<signed char>(sc & 0xffu), s1 = static_cast<signed char>(sc >> 8);
        const int dots = s0 * hx + s1 * hy - 32 * __dp2a_lo(half_sums<SUMS>(b, ds), static_cast<int>(sc), 0);
        return ds.x * half_in(src, D) * static_cast<float>(dots);
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

// -- the 4-bit table formats --------------------------------------------------------------------

struct iq4_nl : Table4<32, 18> {
    static constexpr int D = 0, QS = 2;
    static __device__ __forceinline__ void scale(const unsigned char* blk, int, float& d, float& m) {
        d = half_at(blk + D);
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        return entry(iq4nl_table(), (blk[QS + (j & 15)] >> (4 * (j >> 4))) & 15u);
    }
    template <bool PAIRED = false, class S>
    static __device__ __forceinline__ float dot32_in(const S& src, int, const int (&b)[8], float2 ds) {
        unsigned q[8];
        table_words<PAIRED>(src, QS, iq4nl_table(), q);
        return ds.x * half_in(src, D) * static_cast<float>(dot8(q, b));
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

struct iq4_xs : Table4<256, 136> {
    static constexpr int D = 0, SH = 2, SL = 4, QS = 8;
    template <class S>
    static __device__ __forceinline__ int ls(const S& src, int s) {
        const unsigned lo = (src.u8(SL + (s >> 1)) >> (4 * (s & 1))) & 15u;
        const unsigned hi = (src.u16(SH) >> (2 * s)) & 3u;
        return static_cast<int>(lo | (hi << 4)) - 32;
    }
    static __device__ __forceinline__ void scale(const unsigned char* blk, int s, float& d, float& m) {
        d = __fmul_rn(half_at(blk + D), static_cast<float>(ls(Mem<false>{blk}, s)));
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        return entry(iq4nl_table(), (blk[QS + 16 * (j >> 5) + (j & 15)] >> (4 * ((j >> 4) & 1))) & 15u);
    }
    template <bool PAIRED = false, class S>
    static __device__ __forceinline__ float dot32_in(const S& src, int u, const int (&b)[8], float2 ds) {
        unsigned q[8];
        table_words<PAIRED>(src, QS + 16 * u, iq4nl_table(), q);
        return ds.x * half_in(src, D) * static_cast<float>(ls(src, u) * dot8(q, b));
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<false>{blk}, u, b, ds);
    }
};

struct mxfp4 : Table4<32, 17> {
    static constexpr int E = 0, QS = 1;
    // ggml's e8m0_to_fp32_half: 2^(e - 128) (half the block scale, kvalues being doubled)
    static __device__ __forceinline__ float half_scale(unsigned e) {
        return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    }
    static __device__ __forceinline__ void scale(const unsigned char* blk, int, float& d, float& m) {
        d = half_scale(blk[E]);
        m = 0.0f;
    }
    static __device__ __forceinline__ int code(const unsigned char* blk, int j) {
        return entry(mxfp4_table(), (blk[QS + (j & 15)] >> (4 * (j >> 4))) & 15u);
    }
    template <bool PAIRED = false, class S>
    static __device__ __forceinline__ float dot32_in(const S& src, int, const int (&b)[8], float2 ds) {
        unsigned q[8];
        table_words<PAIRED, true>(src, QS, mxfp4_biased_table(), q);  // the values plus MXFP4_BIAS
        const int2 h = dot_halves<true>(q, b);
        return half_scale(src.u8(E)) * (ds.x * static_cast<float>(h.x + h.y) - static_cast<float>(MXFP4_BIAS) * ds.y);
    }
    static __device__ __forceinline__ float dot32(const unsigned char* blk, int u, const int (&b)[8], float2 ds) {
        return dot32_in(Mem<true>{blk}, u, b, ds);
    }
};

}  // namespace quant
}  // namespace od
