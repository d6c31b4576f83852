// global_norm.cu: sum of squares of a flat buffer (the squared global gradient norm).
//
//   global_norm_squared_partial: partial[block] = sum of x[i]^2 over the block's grid-stride slice
//   global_norm_squared_finish:  out[0] = sum of partial[0..num_partials), one block
//
// Two stages with a fixed launch shape give a deterministic result (no atomics). x is floatX (bf16 in the
// bf16 build, read exactly into float); squares and sums are fp32 in both builds.
#include "common.cuh"

extern "C" __global__ void global_norm_squared_partial(float* __restrict__ partial, const floatX* __restrict__ x,
                                                       int n) {
    __shared__ float scratch[WARP_SIZE];
    float sum = 0.0f;
    for (long long i = global_thread_index(); i < n; i += grid_thread_count()) {
        const float xi = to_float(x[i]);
        sum += xi * xi;
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
global_norm_squared_finish(float* __restrict__ out, const float* __restrict__ partial, int num_partials) {
    __shared__ float scratch[WARP_SIZE];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < num_partials; i += blockDim.x) {
        sum += partial[i];
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        out[0] = sum;
    }
}
