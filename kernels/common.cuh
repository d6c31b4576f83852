// common.cuh: helpers shared by every kernel file: warp and block reductions, constants.
//
// Included as #include "common.cuh" (compile with -I <kernels dir>). Only plain CUDA: warp shuffles
// (__shfl_xor_sync) and __shared__ scratch passed in by the kernel, so the same code runs under NVRTC
// and under gpt2np's CPU emulator.
//
// Conventions for all kernel files:
//   * entry points are extern "C" __global__ (no templates), named after the op they implement;
//   * scalar arguments are int or float only (the Python side passes np.int32 / np.float32);
//   * block sizes are multiples of 32 and at most 1024 unless a kernel says otherwise;
//   * one thread per element: the global thread index is formed in 64 bits and compared with n,
//     then element indices are int (the Python side checks every such buffer has < 2^31
//     elements); only row offsets into logits (N*Vp) and att (B*NH*T*T) are 64-bit.
#pragma once

// Storage precision: floatX is what parameters, gradients and activations are stored in. Each kernel file
// is compiled twice from this one source: as is (floatX = float) and with -DGPT2NP_BF16 (floatX =
// __nv_bfloat16, the "bf16" precision). Kernels read floatX into float with to_float (exact), compute and
// accumulate in float, and store with to_floatX (round to nearest even, once, at the op's output).
// Statistics (LayerNorm mean/rstd, losses, logsumexp), AdamW's master weights and moments and every
// partial sum stay float in both builds. The conversions are explicit: bf16's C++ operators are switched
// off, so no arithmetic happens in bf16 by accident (and the emulator's type has none).
#if defined(GPT2NP_BF16)
#define __CUDA_NO_BFLOAT16_CONVERSIONS__
#define __CUDA_NO_BFLOAT16_OPERATORS__
#define __CUDA_NO_BFLOAT162_OPERATORS__
#include <cuda_bf16.h>
typedef __nv_bfloat16 floatX;
__device__ __forceinline__ float to_float(floatX x) { return __bfloat162float(x); }
__device__ __forceinline__ floatX to_floatX(float x) { return __float2bfloat16_rn(x); }
#else
typedef float floatX;
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_floatX(float x) { return x; }
#endif

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
// Largest finite float: the "minus infinity" of running maxima (avoids inf - inf = NaN).
#define NEG_FLT_MAX (-3.402823466e+38f)

// Sum of v over the 32 lanes of a warp. Butterfly (xor) exchange: every lane ends with the
// same, bitwise identical total (float addition is commutative), so results are deterministic.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(FULL_MASK, v, offset);
    }
    return v;
}

// Maximum of v over the 32 lanes of a warp; every lane gets it.
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

// Sum of v over a 1-D block; every thread gets the total. blockDim.x must be a multiple of 32.
// scratch: a __shared__ float[32] owned by the caller. Safe to call several times in a row
// with the same scratch (the first barrier waits until the previous call's readers are done).
// Must be reached by every thread of the block.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// This thread's index in a 1-D grid, in 64 bits (blockIdx.x * blockDim.x can pass 2^31).
__device__ __forceinline__ long long global_thread_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

// Threads in the whole 1-D grid: the stride of a grid-stride loop.
__device__ __forceinline__ long long grid_thread_count() {
    return (long long)gridDim.x * blockDim.x;
}

// Column sums of a row-major (N, C) matrix, first stage, shared by the parameter-gradient
// reductions (layernorm dweight/dbias, matmul dbias). Block layout: 1-D, blockDim.x = 32 * R
// (R warps); thread (lane, warp) owns column blockIdx.x * 32 + lane and rows
// row_begin + warp, row_begin + warp + R, ... < row_end. Returns the block's sum for the
// thread's column in warp 0 (other warps get 0); `scratch` is __shared__ float[1024].
// The order of additions is fixed by the launch shape, so the result is deterministic.
__device__ __forceinline__ float column_block_sum(float partial, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    scratch[warp * WARP_SIZE + lane] = partial;
    __syncthreads();
    float total = 0.0f;
    if (warp == 0) {
        for (int w = 0; w < num_warps; w++) {
            total += scratch[w * WARP_SIZE + lane];
        }
    }
    __syncthreads();
    return total;
}
