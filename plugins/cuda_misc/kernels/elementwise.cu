// Binary elementwise ops: add, sub, mul, div (b repeated into a by modulo in
// every axis, as ggml_add does), add1, add_id, and ggml's multi-add (a chain
// of adds run as one kernel).
//
// Ta is the type of a and of the result, Tb the type of b: each float,
// od::f16 or od::bf16; values are computed in float and rounded once to Ta on
// store, so results are bit-equal to the reference's (float64 then rounded to
// f32, then to Ta) for every type pair. The result is contiguous.
//
//   binary_flat<Ta, Tb>   a, b, result contiguous with b the same shape as a or
//                         one element (add1): 16-byte vectors of the result
//                         type, grid-stride; `nvec` vectors (0 when a pointer
//                         is not aligned to its vector), then the tail.
//   binary_rows<Ta, Tb>   the result as `rows` x `cols` (contiguous); a and b
//                         rows of `cols` packed elements at a_rs / b_rs elements
//                         apart (b_rs = 0: one row broadcast over all of them,
//                         loaded once per thread). Columns along x, rows along
//                         y; 16-byte vectors only (cols, row strides and
//                         pointers must allow them: else binary_bcast runs).
//                         No division anywhere.
//   binary_bcast<Ta, Tb>  any shapes and element strides, modulo in every
//                         axis: rows split per row, the last axis per element.
//   add_id<Ta, Tb>        out[t, u] = a[t, u] + b[ids[t, u]].
//   multi_add<T>          out = (((s0 + s1) + s2) + ...) for up to 9 sources,
//                         each rows of `cols` packed elements at its own row
//                         stride (0: broadcast); the partial sums are rounded to
//                         T as the unfused adds store them, so fused and
//                         unfused agree exactly.
//
// Aliasing: the result may be a itself (same layout): each element is read
// and then written by one thread.

#include "ew_common.cuh"

namespace ew_binary {

using ew::put;
using ew::round_to;
using ew::Vec;  // elements of the result type a vector; b moves the same count
using od::Pack;

// Op codes: must match BINARY_CODES in plugins/cuda_misc/specs/elementwise.py.
constexpr int OP_ADD = 0;
constexpr int OP_SUB = 1;
constexpr int OP_MUL = 2;
constexpr int OP_DIV = 3;

template <int OP>
__device__ __forceinline__ float bin(float a, float b) {
    if constexpr (OP == OP_ADD) {
        return a + b;
    } else if constexpr (OP == OP_SUB) {
        return a - b;
    } else if constexpr (OP == OP_MUL) {
        return a * b;
    } else {
        return a / b;
    }
}

// Row r = (i0 * n1 + i1) * n2 + i2 of `rows`: no division when the rows are one axis.
__device__ __forceinline__ void split_row(long long r, int n1, int n2, long long rows, int& i0, int& i1, int& i2) {
    if (rows == n2) {
        i0 = 0;
        i1 = 0;
        i2 = (int)r;
        return;
    }
    const int t = (int)r / n2;
    i2 = (int)r - t * n2;
    i1 = t % n1;
    i0 = t / n1;
}

// i % m for i >= 0, without the division where it is not needed (m = 1, or i < m).
__device__ __forceinline__ int wrap(int i, int m) { return m == 1 ? 0 : (i < m ? i : i % m); }

template <typename T, int N>
__device__ __forceinline__ void unpack(const Pack<T, N>& p, float (&v)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
        v[k] = od::load(&p.v[k]);
    }
}

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> pack(const float (&v)[N]) {
    Pack<T, N> p;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        put(&p.v[k], v[k]);
    }
    return p;
}

// -- flat ---------------------------------------------------------------------------------

template <int OP, typename Ta, typename Tb>
__device__ __forceinline__ void flat_loop(const Ta* a, const Tb* b, Ta* y, long long n, long long nvec, bool b_scalar) {
    constexpr int N = Vec<Ta>::N;
    using PA = Pack<Ta, N>;
    using PB = Pack<Tb, N>;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const float bs = b_scalar ? od::load(b) : 0.0f;
    const PA* av = reinterpret_cast<const PA*>(a);
    const PB* bv = reinterpret_cast<const PB*>(b);
    PA* yv = reinterpret_cast<PA*>(y);
    for (long long i = first; i < nvec; i += stride) {
        float x[N], z[N];
        unpack(av[i], x);
        if (b_scalar) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                z[k] = bs;
            }
        } else {
            unpack(bv[i], z);
        }
#pragma unroll
        for (int k = 0; k < N; ++k) {
            x[k] = bin<OP>(x[k], z[k]);
        }
        yv[i] = pack<Ta, N>(x);
    }
    for (long long j = nvec * N + first; j < n; j += stride) {
        put(y + j, bin<OP>(od::load(a + j), b_scalar ? bs : od::load(b + j)));
    }
}

// -- rows ---------------------------------------------------------------------------------

template <int OP, int N, typename Ta, typename Tb>
__device__ __forceinline__ void rows_loop(const Ta* a, long long a_rs, const Tb* b, long long b_rs, Ta* y,
                                          long long rows, long long cols) {
    using PA = Pack<Ta, N>;
    using PB = Pack<Tb, N>;
    const long long ncv = cols / N;  // vectors per row
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < ncv; c += (long long)gridDim.x * blockDim.x) {
        const long long r0 = (long long)blockIdx.y * blockDim.y + threadIdx.y;
        const long long rstep = (long long)gridDim.y * blockDim.y;
        if (b_rs == 0) {  // one row of b for every row of a: loaded once
            float z[N];
            unpack(reinterpret_cast<const PB*>(b)[c], z);
            for (long long r = r0; r < rows; r += rstep) {
                float x[N];
                unpack(reinterpret_cast<const PA*>(a + r * a_rs)[c], x);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    x[k] = bin<OP>(x[k], z[k]);
                }
                reinterpret_cast<PA*>(y + r * cols)[c] = pack<Ta, N>(x);
            }
        } else {
            for (long long r = r0; r < rows; r += rstep) {
                float x[N], z[N];
                unpack(reinterpret_cast<const PA*>(a + r * a_rs)[c], x);
                unpack(reinterpret_cast<const PB*>(b + r * b_rs)[c], z);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    x[k] = bin<OP>(x[k], z[k]);
                }
                reinterpret_cast<PA*>(y + r * cols)[c] = pack<Ta, N>(x);
            }
        }
    }
}

}  // namespace ew_binary

// y = a op b over n elements, b the same shape as a (b_scalar = 0) or one element (1).
template <typename Ta, typename Tb>
__global__ void binary_flat(const Ta* a, const Tb* b, Ta* y, long long n, long long nvec, int b_scalar, int op) {
    od::grid_enter();
    using namespace ew_binary;
#define EW_CASE(OPC)                                    \
    case OPC:                                           \
        flat_loop<OPC>(a, b, y, n, nvec, b_scalar != 0); \
        break;
    switch (op) {
        EW_CASE(OP_ADD)
        EW_CASE(OP_SUB)
        EW_CASE(OP_MUL)
        EW_CASE(OP_DIV)
        default:
            break;
    }
#undef EW_CASE
}

// y (rows x cols, contiguous) = a op b, a and b rows at a_rs and b_rs elements apart.
// Vectors only: cols % VEC == 0 and every row of a, b and y starts aligned to its vector.
template <typename Ta, typename Tb>
__global__ void binary_rows(const Ta* a, long long a_rs, const Tb* b, long long b_rs, Ta* y, long long rows,
                            long long cols, int op) {
    od::grid_enter();
    using namespace ew_binary;
    constexpr int N = Vec<Ta>::N;
#define EW_CASE(OPC)                                            \
    case OPC:                                                   \
        rows_loop<OPC, N>(a, a_rs, b, b_rs, y, rows, cols);     \
        break;
    switch (op) {
        EW_CASE(OP_ADD)
        EW_CASE(OP_SUB)
        EW_CASE(OP_MUL)
        EW_CASE(OP_DIV)
        default:
            break;
    }
#undef EW_CASE
}

// y (n0 x n1 x n2 x n3, contiguous) = a op b[i % m]: a with element strides
// as0..as3, b of shape m0..m3 (each n a multiple of its m) with strides bs0..bs3.
template <typename Ta, typename Tb>
__global__ void binary_bcast(const Ta* a, long long as0, long long as1, long long as2, long long as3, const Tb* b,
                             int m0, int m1, int m2, int m3, long long bs0, long long bs1, long long bs2,
                             long long bs3, Ta* y, int n0, int n1, int n2, int n3, int op) {
    od::grid_enter();
    using namespace ew_binary;
    const long long rows = (long long)n0 * n1 * n2;
    for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < rows;
         r += (long long)gridDim.y * blockDim.y) {
        int i0, i1, i2;
        split_row(r, n1, n2, rows, i0, i1, i2);
        const Ta* ar = a + i0 * as0 + i1 * as1 + i2 * as2;
        const Tb* br = b + wrap(i0, m0) * bs0 + wrap(i1, m1) * bs1 + wrap(i2, m2) * bs2;
        Ta* yr = y + r * n3;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n3; c += gridDim.x * blockDim.x) {
            const float x = od::load(ar + c * as3);
            const float z = od::load(br + wrap(c, m3) * bs3);
            float v;
            switch (op) {
                case OP_ADD: v = x + z; break;
                case OP_SUB: v = x - z; break;
                case OP_MUL: v = x * z; break;
                default: v = x / z; break;
            }
            put(yr + c, v);
        }
    }
}

// y[t, u, :] = a[t, u, :] + b[ids[t, u], :]: a (T, U, C) with element strides
// as0..as2, b (E, C) with bs0, bs1, ids (T, U) i32 with is0, is1; y contiguous.
// An id outside [0, E) gives a NaN row and is recorded in the error word (od::index_ok).
template <typename Ta, typename Tb>
__global__ void add_id(const Ta* a, long long as0, long long as1, long long as2, const Tb* b, long long bs0,
                       long long bs1, const int* ids, long long is0, long long is1, Ta* y, int n_t, int n_u,
                       int n_c, int n_e, OD_INDEX_CHECK_PARAMS) {
    od::grid_enter();
    using namespace ew_binary;
    const long long rows = (long long)n_t * n_u;
    for (long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y; r < rows;
         r += (long long)gridDim.y * blockDim.y) {
        const int t = (int)r / n_u;
        const int u = (int)r - t * n_u;
        const int e = ids[t * is0 + u * is1];
        const bool ok = od::index_ok(e, n_e, err_word, err_tag, r);
        const Ta* ar = a + t * as0 + u * as1;
        const Tb* br = b + (ok ? e : 0) * bs0;
        Ta* yr = y + r * n_c;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < n_c; c += gridDim.x * blockDim.x) {
            const float v = od::load(ar + c * as2) + (ok ? od::load(br + c * bs1) : __int_as_float(0x7fc00000));
            put(yr + c, v);
        }
    }
}

// y (rows x cols, contiguous) = s0 + s1 + ... + s{n-1}, added left to right with
// each partial sum rounded to T; source k has rows of `cols` packed elements
// rs_k elements apart (0: one row broadcast). 2 <= n <= 9; unused pointers 0.
// vec: cols % VEC == 0 and every row of every source and of y 16-byte aligned.
template <typename T>
__global__ void multi_add(const T* s0, const T* s1, const T* s2, const T* s3, const T* s4, const T* s5, const T* s6,
                          const T* s7, const T* s8, long long rs0, long long rs1, long long rs2, long long rs3,
                          long long rs4, long long rs5, long long rs6, long long rs7, long long rs8, int n, T* y,
                          long long rows, long long cols, int vec) {
    od::grid_enter();
    using namespace ew_binary;
    const T* src[9] = {s0, s1, s2, s3, s4, s5, s6, s7, s8};
    const long long rs[9] = {rs0, rs1, rs2, rs3, rs4, rs5, rs6, rs7, rs8};
    const long long r0 = (long long)blockIdx.y * blockDim.y + threadIdx.y;
    const long long rstep = (long long)gridDim.y * blockDim.y;
    const long long cfirst = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long cstep = (long long)gridDim.x * blockDim.x;
    if (vec) {
        constexpr int N = Vec<T>::N;
        using P = Pack<T, N>;
        for (long long c = cfirst; c < cols / N; c += cstep) {
            for (long long r = r0; r < rows; r += rstep) {
                float acc[N];
                unpack(reinterpret_cast<const P*>(src[0] + r * rs[0])[c], acc);
#pragma unroll
                for (int k = 1; k < 9; ++k) {
                    if (k < n) {
                        float z[N];
                        unpack(reinterpret_cast<const P*>(src[k] + r * rs[k])[c], z);
#pragma unroll
                        for (int e = 0; e < N; ++e) {
                            acc[e] = round_to<T>(acc[e] + z[e]);
                        }
                    }
                }
                reinterpret_cast<P*>(y + r * cols)[c] = pack<T, N>(acc);
            }
        }
    } else {
        for (long long c = cfirst; c < cols; c += cstep) {
            for (long long r = r0; r < rows; r += rstep) {
                float acc = od::load(src[0] + r * rs[0] + c);
#pragma unroll
                for (int k = 1; k < 9; ++k) {
                    if (k < n) {
                        acc = round_to<T>(acc + od::load(src[k] + r * rs[k] + c));
                    }
                }
                put(y + r * cols + c, acc);
            }
        }
    }
}
