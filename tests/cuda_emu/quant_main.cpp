// The driver of tests/test_quant_header.py: quant.cuh's accessors compiled for the host against
// shim.h, run on blocks from files (raw little-endian arrays), results to files.
//   quant layout                  one line a format: name QK BYTES BITS SCALE DIV ZERO D M QH QS QMAX
//   quant decode FORMAT IN OUT    IN n raw blocks; OUT 7 * n * 32 f32: the row decoded by decode,
//                                 decode_pair, decode_block, fetch8 + decode8, load_unit, and
//                                 decode_words with the block at byte 0 and at byte 2 of its words
//   quant encode FORMAT IN OUT    IN n * 32 f32; OUT n raw blocks by encode8, 8 lanes a block, one
//                                 warp of 32 threads for 4 blocks (lanes of blocks past n inactive)
//   quant q8_1 IN OUT             IN n * 32 f32; OUT n * 32 i32 codes, n f32 d, n f32 d * sum
//   quant klayout                 one line a quant_k.cuh / quant_iq.cuh format: name QK BYTES SUB M
//   quant kdecode FORMAT IN OUT   (quant_k.cuh's, quant_iq.cuh's formats) IN n raw blocks; OUT 2 * n * QK f32: the row
//                                 decoded by decode and by load_unit (value c * d + m, as convert.cu)
//   quant kdot FORMAT IN B OUT    IN n raw blocks; B n * QK i32 q8_1 codes, then n * QK / 32 f32 pairs
//                                 (d, d * sum); OUT n * QK / 32 f32: dot32 of each 32 values
// Exit status 1 when an inactive lane of encode8 wrote.
#include "shim.h"
#include "quant.cuh"

#include <string>

using namespace od::quant;

// value = (code - ZERO) * d (+ m), dequantize's two roundings
template <class Q>
static float value(int code, float d, float m) {
    const float y = __fmul_rn(static_cast<float>(code - Q::ZERO), d);
    return Q::M >= 0 ? __fadd_rn(y, m) : y;
}

template <class Q>
static void decode_words_at(const unsigned char* blk, int at, float* y) {
    constexpr int NWD = (Q::BYTES + 1) / 4 + 1;  // as the mat-vecs give it
    unsigned char bytes[4 * NWD];
    memset(bytes, 0xa5, sizeof bytes);            // bytes past the block: not read into values
    memcpy(bytes + at, blk, Q::BYTES);
    unsigned w[NWD];
    memcpy(w, bytes, sizeof w);
    int q[8];
    float d, m;
    decode_words<Q>(w, 8 * at, q, d, m);
    for (int i = 0; i < 8; ++i) {
        for (int t = 0; t < 4; ++t) {
            const unsigned b = (static_cast<unsigned>(q[i]) >> (8 * t)) & 0xffu;
            y[4 * i + t] = value<Q>(Q::BITS == 8 ? static_cast<signed char>(b) : static_cast<int>(b), d, m);
        }
    }
}

template <class Q>
static void decode_all(const std::vector<unsigned char>& raw, std::vector<float>& out) {
    const int n = static_cast<int>(raw.size()) / Q::BYTES, nv = n * 32;
    out.assign(7 * static_cast<size_t>(nv), NAN);
    float* y = out.data();
    for (int b = 0; b < n; ++b) {
        const unsigned char* blk = raw.data() + b * Q::BYTES;
        for (int j = 0; j < 32; ++j) y[b * 32 + j] = decode<Q>(blk, j);
        for (int p = 0; p < 16; ++p) {
            const float2 v = decode_pair<Q>(blk, p);
            y[nv + b * 32 + (Q::BITS == 8 ? 2 * p : p)] = v.x;
            y[nv + b * 32 + (Q::BITS == 8 ? 2 * p + 1 : p + 16)] = v.y;
        }
        float blockv[32];
        decode_block<Q>(blk, blockv);
        memcpy(y + 2 * nv + b * 32, blockv, sizeof blockv);
        decode_words_at<Q>(blk, 0, y + 5 * nv + b * 32);
        decode_words_at<Q>(blk, 2, y + 6 * nv + b * 32);
    }
    for (int e0 = 0; e0 < nv; e0 += 8) {
        Raw8<Q> r;
        float f[8];
        fetch8<Q>(raw.data(), e0, r);
        decode8<Q>(r, e0, f);
        memcpy(y + 3 * nv + e0, f, sizeof f);
    }
    for (int u = 0; u < 4 * n; ++u) {
        float c[8], d, m;
        load_unit<Q>(raw.data(), u, c, d, m);
        // the value indices of the unit's codes, as cuda_matmul's unit_k
        const int k0 = Q::BITS < 8 ? (u >> 2) * 32 + (u & 3) * 4 : 8 * u, k1 = Q::BITS < 8 ? k0 + 16 : k0 + 4;
        for (int j = 0; j < 8; ++j) {
            const float v = Q::M >= 0 ? __fadd_rn(__fmul_rn(c[j], d), m) : __fmul_rn(c[j], d);
            y[4 * nv + (j < 4 ? k0 + j : k1 + j - 4)] = v;
        }
    }
}

template <class Q>
static int encode_all(const std::vector<unsigned char>& in, std::vector<unsigned char>& out) {
    const int n = static_cast<int>(in.size() / (32 * sizeof(float)));
    std::vector<float> x(in.size() / sizeof(float));
    memcpy(x.data(), in.data(), in.size());
    out.assign(static_cast<size_t>(n) * Q::BYTES, 0xee);
    unsigned char spare[64];  // where inactive lanes point: must stay untouched
    memset(spare, 0xee, sizeof spare);
    blockDim.x = 32;
    for (int g = 0; 4 * g < n; ++g) {
        EmuBlock blk;
        EmuBarrier bb(32), wb(32);
        blk.block_bar = &bb;
        blk.warp_bar = {&wb};
        blk.xchg.assign(32, 0u);
        blk.smem = nullptr;
        emu_ctx = &blk;
        emu_run_block(32, [&](unsigned t) {
            const int b = 4 * g + static_cast<int>(t) / 8, r = static_cast<int>(t) % 8;
            const bool active = b < n;
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (active) memcpy(v, x.data() + 32 * b + 4 * r, sizeof v);
            encode8<Q>(v, r, active ? out.data() + b * Q::BYTES : spare, active);
        });
    }
    for (unsigned char c : spare) {
        if (c != 0xee) return 1;
    }
    return 0;
}

static void q8_1_all(const std::vector<unsigned char>& in, const char* path) {
    const int n = static_cast<int>(in.size() / (32 * sizeof(float)));
    std::vector<float> x(in.size() / sizeof(float));
    memcpy(x.data(), in.data(), in.size());
    std::vector<int> codes(32 * static_cast<size_t>(n));
    std::vector<float> ds(2 * static_cast<size_t>(n));
    for (int b = 0; b < n; ++b) {
        float amax = 0.0f;  // as quantize_q8_1
        for (int j = 0; j < 32; ++j) amax = od::fmax_nan(amax, fabsf(x[32 * b + j]));
        float d, id;
        q8_1::scale(amax, d, id);
        int sum = 0;
        for (int j = 0; j < 32; ++j) sum += codes[32 * b + j] = q8_1::code(x[32 * b + j], id);
        ds[b] = d;
        ds[n + b] = d * static_cast<float>(sum);
    }
    FILE* f = fopen(path, "wb");
    fwrite(codes.data(), sizeof(int), codes.size(), f);
    fwrite(ds.data(), sizeof(float), ds.size(), f);
    fclose(f);
}

template <class Q>
static void kdecode(const std::vector<unsigned char>& raw, const char* path) {
    const int n = static_cast<int>(raw.size()) / Q::BYTES, nv = n * Q::QK;
    std::vector<float> y(2 * static_cast<size_t>(nv), NAN);
    for (int b = 0; b < n; ++b) {
        for (int j = 0; j < Q::QK; ++j) y[b * Q::QK + j] = decode<Q>(raw.data() + b * Q::BYTES, j);
    }
    for (int u = 0; u < nv / 8; ++u) {
        float c[8], d, m;
        load_unit<Q>(raw.data(), u, c, d, m);
        for (int i = 0; i < 8; ++i) {
            const float v = __fmul_rn(c[i], d);
            y[nv + 8 * u + i] = Q::M >= 0 ? __fadd_rn(v, m) : v;
        }
    }
    write_file(path, y.data(), y.size() * sizeof(float));
}

template <class Q>
static void kdot(const std::vector<unsigned char>& raw, const std::vector<unsigned char>& bfile, const char* path) {
    const int n = static_cast<int>(raw.size()) / Q::BYTES, units = n * Q::QK / 32;
    const int* codes = reinterpret_cast<const int*>(bfile.data());
    const float2* ds = reinterpret_cast<const float2*>(bfile.data() + sizeof(int) * 32 * static_cast<size_t>(units));
    std::vector<float> out(units);
    for (int t = 0; t < units; ++t) {
        int b[8];
        for (int i = 0; i < 8; ++i) {
            b[i] = 0;
            for (int k = 0; k < 4; ++k) b[i] |= (codes[32 * t + 4 * i + k] & 0xff) << (8 * k);
        }
        constexpr int PER = Q::QK / 32;
        out[t] = Q::dot32(raw.data() + (t / PER) * Q::BYTES, t % PER, b, ds[t]);
    }
    write_file(path, out.data(), out.size() * sizeof(float));
}

template <class Q>
static void klayout(const char* name) {
    printf("%s %d %d %d %d\n", name, Q::QK, Q::BYTES, Q::SUB, Q::M);
}

template <class Q>
static int krun(const std::string& cmd, char** argv) {
    if (cmd == "kdecode") {
        kdecode<Q>(read_file(argv[3]), argv[4]);
    } else {
        kdot<Q>(read_file(argv[3]), read_file(argv[4]), argv[5]);
    }
    return 0;
}

template <class Q>
static void layout(const char* name) {
    printf("%s %d %d %d %d %d %d %d %d %d %d %d\n", name, Q::QK, Q::BYTES, Q::BITS, static_cast<int>(Q::SCALE), Q::DIV,
           Q::ZERO, Q::D, Q::M, Q::QH, Q::QS, Q::QMAX);
}

template <class Q>
static int run(const std::string& cmd, const char* in, const char* out) {
    const std::vector<unsigned char> data = read_file(in);
    if (cmd == "decode") {
        std::vector<float> y;
        decode_all<Q>(data, y);
        write_file(out, y.data(), y.size() * sizeof(float));
        return 0;
    }
    std::vector<unsigned char> blocks;
    const int bad = encode_all<Q>(data, blocks);
    write_file(out, blocks.data(), blocks.size());
    return bad;
}

int main(int argc, char** argv) {
    const std::string cmd = argv[1];
    if (cmd == "layout") {
        layout<q4_0>("q4_0");
        layout<q4_1>("q4_1");
        layout<q5_0>("q5_0");
        layout<q5_1>("q5_1");
        layout<q8_0>("q8_0");
        return 0;
    }
    if (cmd == "klayout") {
        klayout<q2_K>("q2_K");
        klayout<q3_K>("q3_K");
        klayout<q4_K>("q4_K");
        klayout<q5_K>("q5_K");
        klayout<q6_K>("q6_K");
        klayout<iq4_nl>("iq4_nl");
        klayout<iq4_xs>("iq4_xs");
        klayout<mxfp4>("mxfp4");
        klayout<iq2_xxs>("iq2_xxs");
        klayout<iq2_xs>("iq2_xs");
        klayout<iq2_s>("iq2_s");
        klayout<iq3_xxs>("iq3_xxs");
        klayout<iq3_s>("iq3_s");
        klayout<iq1_s>("iq1_s");
        klayout<iq1_m>("iq1_m");
        return 0;
    }
    if (cmd == "q8_1") {
        q8_1_all(read_file(argv[2]), argv[3]);
        return 0;
    }
    const std::string fmt = argv[2];
    if (cmd == "kdecode" || cmd == "kdot") {
        if (fmt == "q2_K") return krun<q2_K>(cmd, argv);
        if (fmt == "q3_K") return krun<q3_K>(cmd, argv);
        if (fmt == "q4_K") return krun<q4_K>(cmd, argv);
        if (fmt == "q5_K") return krun<q5_K>(cmd, argv);
        if (fmt == "q6_K") return krun<q6_K>(cmd, argv);
        if (fmt == "iq4_nl") return krun<iq4_nl>(cmd, argv);
        if (fmt == "iq4_xs") return krun<iq4_xs>(cmd, argv);
        if (fmt == "mxfp4") return krun<mxfp4>(cmd, argv);
        if (fmt == "iq2_xxs") return krun<iq2_xxs>(cmd, argv);
        if (fmt == "iq2_xs") return krun<iq2_xs>(cmd, argv);
        if (fmt == "iq2_s") return krun<iq2_s>(cmd, argv);
        if (fmt == "iq3_xxs") return krun<iq3_xxs>(cmd, argv);
        if (fmt == "iq3_s") return krun<iq3_s>(cmd, argv);
        if (fmt == "iq1_s") return krun<iq1_s>(cmd, argv);
        if (fmt == "iq1_m") return krun<iq1_m>(cmd, argv);
        fprintf(stderr, "unknown format %s\n", fmt.c_str());
        return 2;
    }
    if (fmt == "q4_0") return run<q4_0>(cmd, argv[3], argv[4]);
    if (fmt == "q4_1") return run<q4_1>(cmd, argv[3], argv[4]);
    if (fmt == "q5_0") return run<q5_0>(cmd, argv[3], argv[4]);
    if (fmt == "q5_1") return run<q5_1>(cmd, argv[3], argv[4]);
    if (fmt == "q8_0") return run<q8_0>(cmd, argv[3], argv[4]);
    fprintf(stderr, "unknown format %s\n", fmt.c_str());
    return 2;
}
