// A driver for kernels with dynamic shared memory, cp.async and mma (kernels.cu, written by the test,
// includes their sources): runs one instance over a grid of one-dimensional blocks, block after block,
// every block's threads as std::threads, shared memory poisoned (0xFF) and guarded at its end.
//   emu MEM_FILE INSTANCE GX GY GZ BLOCK SMEM EAGER ARG...
// MEM_FILE holds device memory (pointer arguments are byte offsets into it, 0 = nullptr) and gets it
// back after the run; instances.inc lists {name, call} as kernel_main.cpp's. Exit status 1 if copies
// were left pending or shared memory was written past its end.
#include "shim.h"
#include "kernels.cu"

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
    operator long long() const { return atoll(text); }
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
    emu_gmem_lo = mem + 256;
    emu_gmem_hi = mem + size;
    const Entry* entry = nullptr;
    for (const Entry& e : table) if (!strcmp(e.name, argv[2])) entry = &e;
    if (!entry) { fprintf(stderr, "no instance %s\n", argv[2]); return 2; }
    gridDim.x = atoi(argv[3]); gridDim.y = atoi(argv[4]); gridDim.z = atoi(argv[5]);
    blockDim.x = atoi(argv[6]);
    const int smem = atoi(argv[7]);
    emu_eager = atoi(argv[8]) != 0;
    std::vector<Arg> args;
    for (int i = 9; i < argc; ++i) args.push_back({argv[i], mem});
    int bad = 0;
    for (unsigned bz = 0; bz < gridDim.z; ++bz)
    for (unsigned by = 0; by < gridDim.y; ++by)
    for (unsigned bx = 0; bx < gridDim.x; ++bx) {
        EmuBlock blk;
        std::barrier<> bb(blockDim.x);
        std::vector<std::barrier<>*> wb;
        for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) wb.push_back(new std::barrier<>(32));
        blk.block_bar = &bb;
        blk.warp_bar = wb;
        blk.xchg.assign(blockDim.x, 0u);
        blk.frag.assign(blockDim.x * 6, 0u);
        blk.smem = (unsigned char*)aligned_alloc(16, smem + 16);
        memset(blk.smem, 0xff, smem + 16);
        std::vector<std::thread> th;
        for (unsigned t = 0; t < blockDim.x; ++t) {
            th.emplace_back([&, t] {
                threadIdx.x = t;
                blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz;
                emu_ctx = &blk;
                emu_pending.clear();
                emu_groups = 0;
                entry->call(args.data());
                if (!emu_pending.empty()) { fprintf(stderr, "copies pending at exit\n"); bad = 1; }
            });
        }
        for (auto& x : th) x.join();
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
