// layernorm.cu: LayerNorm over the last axis (eps 1e-5), forward and backward.
//
//   forward:  mean, rstd (N) per row of inp (N,C); out = (inp - mean) * rstd * weight + bias
//   backward: dinp (N,C) += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)),
//             with norm = (inp - mean) * rstd and dnorm = dout * weight;
//             dweight (C) += sum_rows dout * norm;  dbias (C) += sum_rows dout
//             (accumulate == 0: dweight, dbias = those sums, old contents never read; dinp always +=)
//
// N = B*T rows. Row kernels use one warp per row (blockDim.x = 32 * rows per block). The
// parameter gradients are column sums done in two deterministic stages: per-chunk partial sums
// (layernorm_backward_params_partial) and a fixed-order sum over chunks (..._finish).
#include "common.cuh"

#define LN_EPS 1e-5f

extern "C" __global__ void layernorm_forward(float* __restrict__ out, float* __restrict__ mean,
                                             float* __restrict__ rstd, const float* __restrict__ inp,
                                             const float* __restrict__ weight, const float* __restrict__ bias,
                                             int N, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) {
        return;  // the whole warp leaves together, so the shuffles below stay full-warp
    }
    const float* x = inp + (long long)row * C;
    float sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        sum += x[c];
    }
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float d = x[c] - m;
        sq += d * d;
    }
    const float s = rsqrtf(warp_sum(sq) / C + LN_EPS);
    float* o = out + (long long)row * C;
    for (int c = lane; c < C; c += WARP_SIZE) {
        o[c] = (x[c] - m) * s * weight[c] + bias[c];
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// dinp += ...: one warp per row, two row reductions.
extern "C" __global__ void layernorm_backward_dinp(float* __restrict__ dinp, const float* __restrict__ dout,
                                                   const float* __restrict__ inp, const float* __restrict__ weight,
                                                   const float* __restrict__ mean, const float* __restrict__ rstd,
                                                   int N, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) {
        return;
    }
    const long long base = (long long)row * C;
    const float m = mean[row];
    const float s = rstd[row];
    float dnorm_sum = 0.0f;
    float dnorm_norm_sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float norm = (inp[base + c] - m) * s;
        const float dnorm = dout[base + c] * weight[c];
        dnorm_sum += dnorm;
        dnorm_norm_sum += dnorm * norm;
    }
    const float dnorm_mean = warp_sum(dnorm_sum) / C;
    const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float norm = (inp[base + c] - m) * s;
        const float dnorm = dout[base + c] * weight[c];
        dinp[base + c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
}

// Stage 1 of dweight/dbias: partial (num_chunks, 2, C); partial[k,0,c] = sum of dout*norm and
// partial[k,1,c] = sum of dout over rows [k*rows_per_chunk, (k+1)*rows_per_chunk).
// Grid (ceil(C/32), num_chunks); blockDim.x = 32 * R (see column_block_sum in common.cuh).
extern "C" __global__ void layernorm_backward_params_partial(float* __restrict__ partial,
                                                             const float* __restrict__ dout,
                                                             const float* __restrict__ inp,
                                                             const float* __restrict__ mean,
                                                             const float* __restrict__ rstd,
                                                             int N, int C, int rows_per_chunk) {
    __shared__ float scratch[1024];
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int c = blockIdx.x * WARP_SIZE + lane;
    const int chunk = blockIdx.y;
    const int row_begin = chunk * rows_per_chunk;
    const int row_end = min(N, row_begin + rows_per_chunk);
    float dw = 0.0f;
    float db = 0.0f;
    if (c < C) {
        for (int row = row_begin + warp; row < row_end; row += num_warps) {
            const long long i = (long long)row * C + c;
            const float g = dout[i];
            dw += g * ((inp[i] - mean[row]) * rstd[row]);
            db += g;
        }
    }
    dw = column_block_sum(dw, scratch);
    db = column_block_sum(db, scratch);
    if (warp == 0 && c < C) {
        partial[((long long)chunk * 2) * C + c] = dw;
        partial[((long long)chunk * 2 + 1) * C + c] = db;
    }
}

// Stage 2: dweight[c] += sum_k partial[k,0,c]; dbias[c] += sum_k partial[k,1,c], k in order
// (accumulate == 0: = instead of +=, the old dweight/dbias are not read).
extern "C" __global__ void layernorm_backward_params_finish(float* __restrict__ dweight, float* __restrict__ dbias,
                                                            const float* __restrict__ partial,
                                                            int num_chunks, int C, int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) {
        return;
    }
    float dw = 0.0f;
    float db = 0.0f;
    for (int k = 0; k < num_chunks; k++) {
        dw += partial[((long long)k * 2) * C + c];
        db += partial[((long long)k * 2 + 1) * C + c];
    }
    dweight[c] = accumulate ? dweight[c] + dw : dw;
    dbias[c] = accumulate ? dbias[c] + db : db;
}
