// A driver for any kernel of one .cu file (copied or written as kernel.cu by the test): runs one instance
// over a grid of one-dimensional blocks, block after block, every block's threads as fibers (shim.h).
//   emu MEM_FILE INSTANCE GX GY GZ BLOCK ARG...
//   EMU_SMEM=bytes: dynamic shared memory a block, poisoned (0xFF) and guarded at its end;
//   EMU_EAGER=1: cp.async copies land when issued (else at the wait_group that covers them);
//   EMU_SHUFFLE=seed: the blocks in a random order of that seed (else in grid order), for kernels whose
//   blocks meet through counters (split K's last block): they must not rely on the order;
//   EMU_LAST_FIRST=1: a block's runnable fiber of the highest thread index runs first (shim.h's emu_yield);
//   EMU_WGMMA_AT_ISSUE=1: wgmma products computed when issued (else at the wait that retires them).
// MEM_FILE holds device memory (pointer arguments are byte offsets into it, 0 = nullptr) and gets
// it back after the run. instances.inc lists {name, call}: each call passes its kernel's arguments as
// `Arg`s, which convert to the parameter's type (a pointer into the memory, an integer or a float).
// Exit status 1 if copies were left pending or shared memory was written past its end.
#include "shim.h"
#include "kernel.cu"

#include <algorithm>
#include <random>
#include <string>

struct Arg {
    const char* text;
    unsigned char* mem;
    template <class T>
    operator T*() const {
        const long long v = atoll(text);
        return v ? reinterpret_cast<T*>(mem + v) : nullptr;
    }
    operator int() const { return atoi(text); }
    operator unsigned() const { return static_cast<unsigned>(strtoull(text, nullptr, 10)); }
    operator long long() const { return atoll(text); }
    operator float() const { return static_cast<float>(atof(text)); }
};

struct Entry {
    const char* name;
    void (*call)(const Arg*);
};

static const Entry table[] = {
#include "instances.inc"
};

int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb");
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char* mem = (unsigned char*)aligned_alloc(256, (size + 255) / 256 * 256);
    if (fread(mem, 1, size, f) != (size_t)size) return 2;
    fclose(f);
    emu_gmem_lo = mem + 256;  // cp.async sources must lie in device memory
    emu_gmem_hi = mem + size;
    const Entry* entry = nullptr;
    for (const Entry& e : table) if (!strcmp(e.name, argv[2])) entry = &e;
    if (!entry) { fprintf(stderr, "no instance %s\n", argv[2]); return 2; }
    gridDim.x = atoi(argv[3]); gridDim.y = atoi(argv[4]); gridDim.z = atoi(argv[5]);
    blockDim.x = atoi(argv[6]);
    const char* smem_env = getenv("EMU_SMEM");  // dynamic shared memory bytes a block (emu_ctx->smem)
    const int smem = smem_env ? atoi(smem_env) : 0;
    const char* eager_env = getenv("EMU_EAGER");
    emu_eager = eager_env && atoi(eager_env) != 0;
    const char* last_env = getenv("EMU_LAST_FIRST");
    emu_last_first = last_env && atoi(last_env) != 0;
    const char* issue_env = getenv("EMU_WGMMA_AT_ISSUE");
    emu_wgmma_at_issue = issue_env && atoi(issue_env) != 0;
    std::vector<Arg> args;
    for (int i = 7; i < argc; ++i) args.push_back({argv[i], mem});
    int bad = 0;
    std::vector<dim3> order;
    for (unsigned bz = 0; bz < gridDim.z; ++bz)
        for (unsigned by = 0; by < gridDim.y; ++by)
            for (unsigned bx = 0; bx < gridDim.x; ++bx) order.push_back(dim3{bx, by, bz});
    if (const char* seed = getenv("EMU_SHUFFLE")) {
        std::mt19937 gen(static_cast<unsigned>(atoll(seed)));
        std::shuffle(order.begin(), order.end(), gen);
    }
    for (const dim3 at : order) {
        const unsigned bx = at.x, by = at.y, bz = at.z;
        EmuBlock blk;
        EmuBarrier bb(blockDim.x);
        std::vector<EmuBarrier*> wb;
        for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) wb.push_back(new EmuBarrier(32));
        blk.block_bar = &bb;
        blk.warp_bar = wb;
        blk.xchg.assign(blockDim.x, 0u);
        blk.frag.assign(blockDim.x * 6, 0u);
        blk.smem = smem ? (unsigned char*)aligned_alloc(16, smem + 16) : nullptr;  // poisoned, a guard after
        blk.smem_bytes = smem;
        if (smem) memset(blk.smem, 0xff, smem + 16);
        blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
        emu_ctx = &blk;
        emu_run_block(blockDim.x, [&](unsigned) {
            entry->call(args.data());
            if (!emu_pending.empty()) { fprintf(stderr, "copies pending at exit\n"); bad = 1; }
            if (!emu_fibers[emu_cur].products.empty()) { fprintf(stderr, "wgmma products pending at exit\n"); bad = 1; }
        });
        if (smem && memcmp(blk.smem + smem, "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 16)) {
            fprintf(stderr, "shared memory written past its end\n");
            bad = 1;
        }
        free(blk.smem);
        for (auto* w : wb) delete w;
        for (auto* w : blk.wg_bar) delete w;
        for (auto& [n, b] : blk.named) delete b;
    }
    f = fopen(argv[1], "wb");
    fwrite(mem, 1, size, f);
    fclose(f);
    return bad;
}
