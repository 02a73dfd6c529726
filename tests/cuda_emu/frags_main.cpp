// The driver of tests/test_mmq_frags_emulated.py: mmq_wgmma's register A-fragment builders (cuda_matmul's
// kernels/mmq_frags.cuh, frags<WT>) compiled for the host against shim.h, run on raw K tiles from a file.
//   frags layout                      one line a format of formats.inc (the test writes it: FORMAT(name, W_KIND)
//                                     a line): name RS_FORMAT QK BYTES RAW RS BK SUBS
//   frags build FORMAT ROWS IN OUT    IN n raw K tiles of ROWS rows (ROWS % 16 == 0), each row's RAW bytes (256
//                                     values: 8 blocks or a super-block) after the other; OUT n * SUBS *
//                                     (ROWS / 16) * 32 * 16 u32: for raw K tile i, its K tile k (kt = SUBS * i + k),
//                                     warp w (rows 16 w ..), lane l = 4 g + t, the lane's a[kk][j] (kk the k16
//                                     step, j the register), as frags<WT>(raw, kt, 16 w + g, t, a) writes them
//   frags bf16 IN OUT                 IN n u32 triples (a, b, c); OUT n u32 triples: shim.h's cvt.rn.bf16x2.f32 of
//                                     the floats (a, b) (a into the upper half), fma.rn.bf16x2 (a, b, c),
//                                     mul.rn.bf16x2 (a, b)
// Raw K tile i sits in a stage of ROWS rows of Tile<F, RAW_KB>::RS bytes, as the kernel's raw stages hold it: row r
// at r * RS + lead (lead as mmq_wgmma.cu's raw_lead: 0 for formats whose K tiles are whole granules, else
// i * RAW % 16), every other byte of the stage poisoned (0xFF). The fragments start poisoned (0xDEADBEEF), so
// one the builder leaves unwritten shows.
#include "shim.h"
#include "mmq_frags.cuh"

#include <string>

template <int WT>
struct Geometry {
    using F = mm::Fmt<WT>;
    using T = mq::Tile<F, mw::RAW_KB>;
    static constexpr int RAW = T::RAW, RS = T::RS;
};

template <int WT>
static void layout(const char* name) {
    using G = Geometry<WT>;
    printf("%s %d %d %d %d %d %d %d\n", name, mw::RS_FORMAT<WT> ? 1 : 0, G::F::QK, G::F::BYTES, G::RAW, G::RS, mw::BK,
           mw::SUBS);
}

template <int WT>
static int build_rs(int rows, const char* in, const char* out) {
    using G = Geometry<WT>;
    const std::vector<unsigned char> raw = read_file(in);
    const size_t tile_bytes = (size_t)rows * G::RAW;
    if (rows % 16 != 0 || raw.size() % tile_bytes != 0) {
        fprintf(stderr, "frags build: %zu bytes are no whole raw K tiles of %d rows of %d bytes\n", raw.size(), rows,
                G::RAW);
        return 2;
    }
    const int n = (int)(raw.size() / tile_bytes), warps = rows / 16;
    std::vector<unsigned> frag;
    frag.reserve((size_t)n * mw::SUBS * warps * 32 * 16);
    const size_t stage_bytes = (size_t)rows * G::RS;
    unsigned char* stage = (unsigned char*)aligned_alloc(16, (stage_bytes + 15) / 16 * 16);
    for (int i = 0; i < n; ++i) {
        const int lead = G::T::ALIGNED ? 0 : i * G::RAW % 16;
        memset(stage, 0xff, stage_bytes);
        for (int r = 0; r < rows; ++r) {
            memcpy(stage + (size_t)r * G::RS + lead, raw.data() + i * tile_bytes + (size_t)r * G::RAW, G::RAW);
        }
        for (int k = 0; k < mw::SUBS; ++k) {
            for (int w = 0; w < warps; ++w) {
                for (int lane = 0; lane < 32; ++lane) {
                    unsigned a[4][4];
                    for (auto& step : a) for (unsigned& v : step) v = 0xdeadbeefu;
                    mw::frags<WT>(stage + lead, mw::SUBS * i + k, 16 * w + lane / 4, lane % 4, a);
                    for (auto& step : a) for (unsigned v : step) frag.push_back(v);
                }
            }
        }
    }
    free(stage);
    write_file(out, frag.data(), frag.size() * sizeof(unsigned));
    return 0;
}

template <int WT>
static int build(int rows, const char* in, const char* out) {
    if constexpr (mw::RS_FORMAT<WT>) {
        return build_rs<WT>(rows, in, out);
    } else {
        fprintf(stderr, "frags build: not a format whose fragments come from registers (RS_FORMAT)\n");
        return 2;
    }
}

static int bf16_ops(const char* in, const char* out) {
    const std::vector<unsigned char> bytes = read_file(in);
    std::vector<unsigned> x(bytes.size() / 4), y(bytes.size() / 4);
    memcpy(x.data(), bytes.data(), x.size() * 4);
    for (size_t i = 0; i + 2 < x.size(); i += 3) {
        y[i] = emu_cvt_bf16x2(__uint_as_float(x[i]), __uint_as_float(x[i + 1]));
        y[i + 1] = emu_fma_bf16x2(x[i], x[i + 1], x[i + 2]);
        y[i + 2] = emu_mul_bf16x2(x[i], x[i + 1]);
    }
    write_file(out, y.data(), y.size() * 4);
    return 0;
}

int main(int argc, char** argv) {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "layout") {
#define FORMAT(NAME, WT) layout<WT>(#NAME);
#include "formats.inc"
#undef FORMAT
        return 0;
    }
    if (cmd == "build" && argc == 6) {
        const std::string name = argv[2];
        const int rows = atoi(argv[3]);
#define FORMAT(NAME, WT) if (name == #NAME) return build<WT>(rows, argv[4], argv[5]);
#include "formats.inc"
#undef FORMAT
        fprintf(stderr, "frags build: no format %s\n", argv[2]);
        return 2;
    }
    if (cmd == "bf16" && argc == 4) return bf16_ops(argv[2], argv[3]);
    fprintf(stderr, "usage: frags layout | frags build FORMAT ROWS IN OUT | frags bf16 IN OUT\n");
    return 2;
}
