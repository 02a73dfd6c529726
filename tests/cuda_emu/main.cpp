// The emulator's driver: runs one kernel instance of mmvq_stream.cu (transformed by the test: no
// inline PTX) over a grid, block after block, every block's threads as fibers (shim.h).
//   emu MEM_FILE INSTANCE GX GY GZ BLOCK SMEM EAGER ARG...
// MEM_FILE holds device memory (pointer arguments are byte offsets into it, 0 = nullptr) and gets
// it back after the run. Exit status 1 if copies were left pending or shared memory overrun.
#include "shim.h"
#include "mmvq_stream.cu"
using Fn = void (*)(const u8*, const u8*, long long, long long, long long, int, int, const u8*, long long,
                   long long, long long, long long, float*, int, int, int, const float*, const float*, long long,
                   int, float, float, const u8*, long long, long long, int, long long, const float*, float, float*,
                   int, int, unsigned long long*, unsigned);
struct Entry { const char* name; Fn fn; };
static const Entry table[] = {
#include "instances.inc"
};
int main(int argc, char** argv) {
    // mem_file name gx gy gz block smem eager arg...
    FILE* f = fopen(argv[1], "rb");
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char* mem = (unsigned char*)aligned_alloc(256, (size + 255) / 256 * 256);
    if (fread(mem, 1, size, f) != (size_t)size) return 2;
    fclose(f);
    emu_gmem_lo = mem + 256;
    emu_gmem_hi = mem + size;
    Fn fn = nullptr;
    for (const Entry& e : table) if (!strcmp(e.name, argv[2])) fn = e.fn;
    if (!fn) { fprintf(stderr, "no instance %s\n", argv[2]); return 2; }
    gridDim.x = atoi(argv[3]); gridDim.y = atoi(argv[4]); gridDim.z = atoi(argv[5]);
    blockDim.x = atoi(argv[6]);
    const int smem = atoi(argv[7]);
    emu_eager = atoi(argv[8]) != 0;
    char** a = argv + 9;
    auto P = [&](int i) -> unsigned char* { long long v = atoll(a[i]); return v ? mem + v : nullptr; };
    auto L = [&](int i) { return atoll(a[i]); };
    auto I = [&](int i) { return atoi(a[i]); };
    auto F = [&](int i) { return (float)atof(a[i]); };
    int bad = 0;
    for (unsigned bz = 0; bz < gridDim.z; ++bz)
    for (unsigned by = 0; by < gridDim.y; ++by)
    for (unsigned bx = 0; bx < gridDim.x; ++bx) {
        EmuBlock blk;
        EmuBarrier bb(blockDim.x);
        std::vector<EmuBarrier*> wb;
        for (unsigned w = 0; w < blockDim.x / 32; ++w) wb.push_back(new EmuBarrier(32));
        blk.block_bar = &bb;
        blk.warp_bar = wb;
        blk.xchg.assign(blockDim.x, 0u);
        blk.smem = (unsigned char*)aligned_alloc(16, smem + 16);
        memset(blk.smem, 0xff, smem + 16);
        blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
        emu_ctx = &blk;
        emu_run_block(blockDim.x, [&](unsigned) {
            fn(P(0), P(1), L(2), L(3), L(4), I(5), I(6), P(7), L(8), L(9), L(10), L(11), (float*)P(12), I(13),
               I(14), I(15), (const float*)P(16), (const float*)P(17), L(18), I(19), F(20), F(21), P(22),
               L(23), L(24), I(25), L(26), (const float*)P(27), F(28), (float*)P(29), I(30), I(31),
               (unsigned long long*)P(32), (unsigned)atoll(a[33]));
            if (!emu_pending.empty()) { fprintf(stderr, "copies pending at exit\n"); bad = 1; }
        });
        if (memcmp(blk.smem + smem, "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 16)) {
            fprintf(stderr, "shared memory written past its end\n"); bad = 1;
        }
        free(blk.smem);
        for (auto* w : wb) delete w;
    }
    f = fopen(argv[1], "wb");
    fwrite(mem, 1, size, f);
    fclose(f);
    return bad;
}
