// Hopper's warpgroup tensor-core products (wgmma.mma_async, sm_90a only: a file that includes this header starts
// with `// opdispatch-arch: sm_90a`, docs/plugins.md) and the shared-memory layout they read: tiles of 128-byte
// rows in the 128-byte swizzle (row r's 16-byte chunk c at r * 128 + (c ^ (r % 8)) * 16, each tile 1024-byte
// aligned), 64 16-bit values a row.
//   K-major operand (A, or B not transposed): a row a matrix row, K along it; the descriptor's stride between
//     8-row groups is 1024 bytes, a k16 step starts 32 bytes further along the rows.
//   MN-major operand (B transposed, e.g. V in O += P V): a row holds 64 values of N at one k; the 8-k groups are
//     1024 bytes apart, a k16 step starts 2048 bytes further, and N beyond 64 continues `lbo` bytes on.
// Accumulators are f32, 64 x N a warpgroup: warp w holds rows 16 w + lane / 4 and + 8, columns 8 i + 2 (lane % 4)
// and + 1 in d[4 i .. 4 i + 3] (mma.sync m16n8's layout, 8 columns at a time). An A operand from registers is the
// m16n8k16 A fragment of the warp's 16 rows: (row g, k 2t), (row g + 8, k 2t), (row g, k 2t + 8), (row g + 8,
// k 2t + 8), each a 16-bit pair; g = lane / 4, t = lane % 4.
#pragma once

#include "common.cuh"

namespace od::wg {

// Byte offset of row r's 16-byte chunk c in a swizzled tile of 128-byte rows.
__device__ __forceinline__ unsigned swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// Descriptor of a K-major tile at shared address `saddr`: start address >> 4 (bits 0-13), leading byte offset 1
// (unused by swizzled K-major layouts), stride byte offset 1024 >> 4 (bits 32-45), swizzle 128 bytes (bits 62-63).
__device__ __forceinline__ unsigned long long desc_k(unsigned saddr) {
    return static_cast<unsigned long long>((saddr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// Descriptor of an MN-major tile: the leading byte offset (bits 16-29) is `lbo`, the distance between blocks of
// 64 values of N; the stride byte offset 1024, between groups of 8 k.
__device__ __forceinline__ unsigned long long desc_mn(unsigned saddr, unsigned lbo) {
    return static_cast<unsigned long long>((saddr & 0x3FFFFu) >> 4) |
           (static_cast<unsigned long long>((lbo >> 4) & 0x3FFFu) << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Ordinary shared-memory stores (st.shared, cp.async) made visible to the async proxy (the tensor cores' reads).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keeps the compiler from moving uses of registers across the asynchronous wgmma that writes or reads them
// (CUTLASS's warpgroup_fence_operand): each is an input and output of an empty asm statement. The compiler sees
// an asynchronous product's register operands as consumed at issue, so A fragments are fenced after the wait
// that retires their products, and accumulators after it too.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        asm volatile("" : "+f"(d[i])::"memory");
    }
}
template <int R, int C>
__device__ __forceinline__ void fence_regs(unsigned (&f)[R][C]) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int j = 0; j < C; ++j) {
            asm volatile("" : "+r"(f[i][j])::"memory");
        }
    }
}

// The accumulator registers of m64n64 (32), m64n128 (64) and m64n256 (128): asm operand lists (outputs 0 ..) and
// their text.
#define OD_WG_ACC32_TXT \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define OD_WG_ACC64_TXT OD_WG_ACC32_TXT ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define OD_WG_ACC32_OUTS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define OD_WG_ACC64_OUTS(d) OD_WG_ACC32_OUTS(d), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

#define OD_WG_ACC128_TXT OD_WG_ACC64_TXT ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define OD_WG_ACC128_OUTS(d) OD_WG_ACC64_OUTS(d), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d (64 x N f32) = A (64 x 16, descriptor da) * B (N x 16 K-major, db)^T + (acc ? d : 0): ss<N, BF>, 16-bit
// inputs (bf16 if BF, else f16); acc 0 starts a sum without the accumulators being written by other
// instructions first (which would make ptxas serialize the wgmma in flight). rs<N, BF, TB>: d += A B^T, A from
// registers (a), B K-major (TB 0) or MN-major (TB 1).
template <int N, bool BF>
__device__ __forceinline__ void ss(float (&d)[N / 2], unsigned long long da, unsigned long long db, int acc);
template <int N, bool BF, int TB>
__device__ __forceinline__ void rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db);

#define OD_WG_SS(N, TY, BF, ACC_TXT, ACC_OUTS, IA, IB, IP) \
    template <> \
    __device__ __forceinline__ void ss<N, BF>(float (&d)[N / 2], unsigned long long da, unsigned long long db, \
                                              int acc) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" ACC_TXT "}, %" #IA \
                     ", %" #IB ", p, 1, 1, 0, 0;\n}\n" \
                     : ACC_OUTS(d) \
                     : "l"(da), "l"(db), "r"(acc)); \
    }
#define OD_WG_RS(N, TY, BF, TB, ACC_TXT, ACC_OUTS, I0, I1, I2, I3, IB) \
    template <> \
    __device__ __forceinline__ void rs<N, BF, TB>(float (&d)[N / 2], const unsigned (&a)[4], \
                                                  unsigned long long db) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" ACC_TXT "}, {%" #I0 \
                     ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #IB ", p, 1, 1, " #TB ";\n}\n" \
                     : ACC_OUTS(d) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db)); \
    }

OD_WG_SS(64, "bf16", true, OD_WG_ACC32_TXT, OD_WG_ACC32_OUTS, 32, 33, 34)
OD_WG_SS(64, "f16", false, OD_WG_ACC32_TXT, OD_WG_ACC32_OUTS, 32, 33, 34)
OD_WG_SS(128, "bf16", true, OD_WG_ACC64_TXT, OD_WG_ACC64_OUTS, 64, 65, 66)
OD_WG_SS(128, "f16", false, OD_WG_ACC64_TXT, OD_WG_ACC64_OUTS, 64, 65, 66)
OD_WG_RS(64, "bf16", true, 0, OD_WG_ACC32_TXT, OD_WG_ACC32_OUTS, 32, 33, 34, 35, 36)
OD_WG_RS(64, "bf16", true, 1, OD_WG_ACC32_TXT, OD_WG_ACC32_OUTS, 32, 33, 34, 35, 36)
OD_WG_RS(64, "f16", false, 1, OD_WG_ACC32_TXT, OD_WG_ACC32_OUTS, 32, 33, 34, 35, 36)
OD_WG_RS(128, "bf16", true, 0, OD_WG_ACC64_TXT, OD_WG_ACC64_OUTS, 64, 65, 66, 67, 68)
OD_WG_RS(128, "bf16", true, 1, OD_WG_ACC64_TXT, OD_WG_ACC64_OUTS, 64, 65, 66, 67, 68)
OD_WG_RS(128, "f16", false, 1, OD_WG_ACC64_TXT, OD_WG_ACC64_OUTS, 64, 65, 66, 67, 68)
OD_WG_SS(256, "bf16", true, OD_WG_ACC128_TXT, OD_WG_ACC128_OUTS, 128, 129, 130)
OD_WG_RS(256, "bf16", true, 0, OD_WG_ACC128_TXT, OD_WG_ACC128_OUTS, 128, 129, 130, 131, 132)

#undef OD_WG_SS
#undef OD_WG_RS
#undef OD_WG_ACC32_TXT
#undef OD_WG_ACC64_TXT
#undef OD_WG_ACC32_OUTS
#undef OD_WG_ACC64_OUTS
#undef OD_WG_ACC128_TXT
#undef OD_WG_ACC128_OUTS

}  // namespace od::wg
