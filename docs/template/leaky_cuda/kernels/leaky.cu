// y = leaky_relu(scale * x): one float a thread.
#include "common.cuh"

template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) leaky_f32(const float* __restrict__ x, float* __restrict__ y, const int n,
                                                    const float scale, const float slope) {
    od::grid_enter();
    const int i = blockIdx.x * BLOCK + threadIdx.x;
    if (i < n) {
        const float v = scale * x[i];
        y[i] = v > 0.0f ? v : slope * v;
    }
}
