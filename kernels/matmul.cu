// matmul.cu: the non-GEMM parts of a linear layer y = x @ W^T + b (the GEMMs are cuBLAS).
//
//   add_bias:          out (N,OC) += bias (OC)   (after the forward GEMM wrote out)
//   bias_grad_partial: partial (num_chunks, OC) = column sums of dout (N,OC) per chunk of rows
//   bias_grad_finish:  dbias (OC) += sum over chunks of partial, in chunk order
//                      (accumulate == 0: dbias = that sum; its old contents are never read)
//
// The bias gradient is a two-stage column reduction with a fixed addition order (deterministic).
//
// Precision: out, bias, dout, dbias are floatX; the partial sums stay float.
#include "common.cuh"

extern "C" __global__ void add_bias(floatX* __restrict__ out, const floatX* __restrict__ bias, int N, int OC) {
    const long long i = global_thread_index();
    if (i < (long long)N * OC) {
        const int idx = (int)i;
        // bias + out: the operand order the fp32 build always compiled to (its cubin stays byte-identical)
        out[idx] = to_floatX(to_float(bias[idx % OC]) + to_float(out[idx]));
    }
}

// Grid (ceil(OC/32), num_chunks); blockDim.x = 32 * R (see column_block_sum in common.cuh).
extern "C" __global__ void bias_grad_partial(float* __restrict__ partial, const floatX* __restrict__ dout,
                                             int N, int OC, int rows_per_chunk) {
    __shared__ float scratch[1024];
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int c = blockIdx.x * WARP_SIZE + lane;
    const int chunk = blockIdx.y;
    const int row_begin = chunk * rows_per_chunk;
    const int row_end = min(N, row_begin + rows_per_chunk);
    float sum = 0.0f;
    if (c < OC) {
        for (int row = row_begin + warp; row < row_end; row += num_warps) {
            sum += to_float(dout[(long long)row * OC + c]);
        }
    }
    sum = column_block_sum(sum, scratch);
    if (warp == 0 && c < OC) {
        partial[(long long)chunk * OC + c] = sum;
    }
}

extern "C" __global__ void bias_grad_finish(floatX* __restrict__ dbias, const float* __restrict__ partial,
                                            int num_chunks, int OC, int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) {
        return;
    }
    float sum = 0.0f;
    for (int k = 0; k < num_chunks; k++) {
        sum += partial[(long long)k * OC + c];
    }
    dbias[c] = to_floatX(accumulate ? to_float(dbias[c]) + sum : sum);
}
