// The mask flags of a flash-attention prefill (fattn_prefill.cu and fattn_prefill_wgmma.cu read them): which of its
// tiles a mask skips, which it leaves alone and which read it.
#include "common.cuh"

// Whether either f16 of a 32-bit word of mask values is not -inf (0xfc00), and whether either is nonzero (a zero
// of either sign counts as zero).
__device__ __forceinline__ void see_pair(unsigned w, int& finite, int& nonzero) {
    finite |= (w & 0xffffu) != 0xfc00u || (w >> 16) != 0xfc00u;
    nonzero |= (w & 0x7fff7fffu) != 0;
}

// One byte per (mask slice z = i3 * m2 + i2, q tile i, kv tile j): 0 if every mask value of the tile (rows < tq,
// columns < tk) is -inf, 2 if every one is zero, else 1. A thread reads 8 values at a time (16-byte loads) where
// the tile's rows allow it, else one, U loads issued before any is used (one 2-byte load in turn took 12 us a
// launch on the H200: a load's latency for each of a thread's 32 values of a 64 x 64 tile).
// Grid (n_kv_tiles, n_q_tiles, m3 * m2), 128 threads.
__global__ void __launch_bounds__(128) fattn_mask_flags(const char* __restrict__ mask, unsigned char* __restrict__ flags,
                                                        int tq, int tk, int bm, int bn, int m2, long long ms_t,
                                                        long long ms_h, long long ms_b) {
    od::grid_enter();
    const int j = blockIdx.x, i = blockIdx.y, z = blockIdx.z;
    const char* const tile = mask + (z / m2) * ms_b + (z % m2) * ms_h + static_cast<long long>(i) * bm * ms_t +
                             static_cast<long long>(j) * bn * 2;
    const int rows = min(bm, tq - i * bm), cols = min(bn, tk - j * bn);
    int finite = 0, nonzero = 0;
    constexpr int U = 4;  // a thread's loads in flight together
    if (((reinterpret_cast<unsigned long long>(tile) | static_cast<unsigned long long>(ms_t)) & 15u) == 0 &&
        cols % 8 == 0) {
        const int per_row = cols / 8, n = rows * per_row;
        for (int e0 = threadIdx.x; e0 < n; e0 += 128 * U) {
            uint4 w[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int e = e0 + 128 * u;
                if (e < n) {
                    w[u] = __ldg(reinterpret_cast<const uint4*>(tile + (e / per_row) * ms_t) + e % per_row);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (e0 + 128 * u < n) {
                    see_pair(w[u].x, finite, nonzero);
                    see_pair(w[u].y, finite, nonzero);
                    see_pair(w[u].z, finite, nonzero);
                    see_pair(w[u].w, finite, nonzero);
                }
            }
        }
    } else {
        const int n = rows * cols;
        for (int e0 = threadIdx.x; e0 < n; e0 += 128 * U) {
            unsigned bits[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int e = e0 + 128 * u;
                if (e < n) {
                    bits[u] = __ldg(reinterpret_cast<const unsigned short*>(tile + (e / cols) * ms_t) + e % cols);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (e0 + 128 * u < n) {
                    finite |= bits[u] != 0xfc00u;
                    nonzero |= (bits[u] & 0x7fffu) != 0;
                }
            }
        }
    }
    finite = __syncthreads_or(finite);
    nonzero = __syncthreads_or(nonzero);
    if (threadIdx.x == 0) {
        flags[(static_cast<long long>(z) * gridDim.y + i) * gridDim.x + j] = !finite ? 0 : (nonzero ? 1 : 2);
    }
}
