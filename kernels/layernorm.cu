// layernorm.cu: LayerNorm over the last axis (eps 1e-5), forward and backward.
//
//   forward:  mean, rstd (N) per row of inp (N,C); out = (inp - mean) * rstd * weight + bias
//   backward: dinp (N,C) += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)),
//             with norm = (inp - mean) * rstd and dnorm = dout * weight;
//             dweight (C) += sum_rows dout * norm;  dbias (C) += sum_rows dout
//             (accumulate == 0: dweight, dbias = those sums, old contents never read; dinp always +=)
//
//   fused_residual_layernorm_forward: residual = inp1 + inp2, then the forward on residual, one kernel
//             (the residual stream's add and the next LayerNorm: the sum is normalized while in cache)
//   layernorm_backward_fused: the backward in one pass over dout and inp: dinp, and per-block partial
//             sums of dweight, dbias (then ..._params_finish)
//
// N = B*T rows. Row kernels use one warp per row (blockDim.x = 32 * rows per block). The
// parameter gradients are column sums done in two deterministic stages: per-chunk partial sums
// (layernorm_backward_params_partial, or layernorm_backward_fused) and a fixed-order sum over
// chunks (..._finish); no atomics, so the sums are the same bitwise on every run.
//
// Precision: out, inp, inp1, inp2, residual, weight, bias, dinp, dout, dweight, dbias are floatX; mean,
// rstd and the partial sums stay float.
#include "common.cuh"

#define LN_EPS 1e-5f

extern "C" __global__ void layernorm_forward(floatX* __restrict__ out, float* __restrict__ mean,
                                             float* __restrict__ rstd, const floatX* __restrict__ inp,
                                             const floatX* __restrict__ weight, const floatX* __restrict__ bias,
                                             int N, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) {
        return;  // the whole warp leaves together, so the shuffles below stay full-warp
    }
    const floatX* x = inp + (long long)row * C;
    float sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        sum += to_float(x[c]);
    }
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float d = to_float(x[c]) - m;
        sq += d * d;
    }
    const float s = rsqrtf(warp_sum(sq) / C + LN_EPS);
    floatX* o = out + (long long)row * C;
    for (int c = lane; c < C; c += WARP_SIZE) {
        o[c] = to_floatX((to_float(x[c]) - m) * s * to_float(weight[c]) + to_float(bias[c]));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// residual = inp1 + inp2 and out = layernorm(residual), one warp per row. The arithmetic is
// residual_forward's and layernorm_forward's, in the same order, so the results are bitwise theirs
// (in bf16 the statistics are taken of the rounded residual, the value stored and read back).
// Each lane reads back only the residual values it wrote itself (no barrier needed).
extern "C" __global__ void fused_residual_layernorm_forward(floatX* __restrict__ residual, floatX* __restrict__ out,
                                                            float* __restrict__ mean, float* __restrict__ rstd,
                                                            const floatX* __restrict__ inp1,
                                                            const floatX* __restrict__ inp2,
                                                            const floatX* __restrict__ weight,
                                                            const floatX* __restrict__ bias, int N, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) {
        return;
    }
    const long long base = (long long)row * C;
    floatX* r = residual + base;
    float sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const floatX v = to_floatX(to_float(inp1[base + c]) + to_float(inp2[base + c]));
        r[c] = v;
        sum += to_float(v);
    }
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float d = to_float(r[c]) - m;
        sq += d * d;
    }
    const float s = rsqrtf(warp_sum(sq) / C + LN_EPS);
    floatX* o = out + base;
    for (int c = lane; c < C; c += WARP_SIZE) {
        o[c] = to_floatX((to_float(r[c]) - m) * s * to_float(weight[c]) + to_float(bias[c]));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// dinp += ...: one warp per row, two row reductions.
extern "C" __global__ void layernorm_backward_dinp(floatX* __restrict__ dinp, const floatX* __restrict__ dout,
                                                   const floatX* __restrict__ inp, const floatX* __restrict__ weight,
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
        const float norm = (to_float(inp[base + c]) - m) * s;
        const float dnorm = to_float(dout[base + c]) * to_float(weight[c]);
        dnorm_sum += dnorm;
        dnorm_norm_sum += dnorm * norm;
    }
    const float dnorm_mean = warp_sum(dnorm_sum) / C;
    const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float norm = (to_float(inp[base + c]) - m) * s;
        const float dnorm = to_float(dout[base + c]) * to_float(weight[c]);
        dinp[base + c] = to_floatX(to_float(dinp[base + c]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
    }
}

// Stage 1 of dweight/dbias: partial (num_chunks, 2, C); partial[k,0,c] = sum of dout*norm and
// partial[k,1,c] = sum of dout over rows [k*rows_per_chunk, (k+1)*rows_per_chunk).
// Grid (ceil(C/32), num_chunks); blockDim.x = 32 * R (see column_block_sum in common.cuh).
extern "C" __global__ void layernorm_backward_params_partial(float* __restrict__ partial,
                                                             const floatX* __restrict__ dout,
                                                             const floatX* __restrict__ inp,
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
            const float g = to_float(dout[i]);
            dw += g * ((to_float(inp[i]) - mean[row]) * rstd[row]);
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

// Stage 2: dweight[c] += sum_k partial[k,0,c]; dbias[c] += sum_k partial[k,1,c] (accumulate == 0: = instead
// of +=, the old dweight/dbias are not read). Block (X, Y): X columns, Y threads per column; thread y adds the
// chunks k = y, y + Y, y + 2Y, ... in order, then thread 0 of the column adds the Y sums in y order: a fixed
// order for a given Y (Y = 1: one thread adds every chunk in order). Y threads a column keep Y times the loads
// in flight: with one thread per column (C threads in all) the thousands of chunks of a large batch were read
// one latency after another. Dynamic shared memory: 2*X*Y floats.
extern "C" __global__ void layernorm_backward_params_finish(floatX* __restrict__ dweight, floatX* __restrict__ dbias,
                                                            const float* __restrict__ partial,
                                                            int num_chunks, int C, int accumulate) {
    extern __shared__ float sums[];          // [2][Y][X]: the column sums of each thread row
    const int X = blockDim.x;
    const int Y = blockDim.y;
    const int x = threadIdx.x;
    const int y = threadIdx.y;
    const int c = blockIdx.x * X + x;
    float dw = 0.0f;
    float db = 0.0f;
    if (c < C) {
        for (int k = y; k < num_chunks; k += Y) {
            dw += partial[((long long)k * 2) * C + c];
            db += partial[((long long)k * 2 + 1) * C + c];
        }
    }
    sums[y * X + x] = dw;
    sums[(Y + y) * X + x] = db;
    __syncthreads();
    if (y != 0 || c >= C) {
        return;
    }
    for (int i = 1; i < Y; i++) {
        dw += sums[i * X + x];
        db += sums[(Y + i) * X + x];
    }
    dweight[c] = to_floatX(accumulate ? to_float(dweight[c]) + dw : dw);
    dbias[c] = to_floatX(accumulate ? to_float(dbias[c]) + db : db);
}

// The whole backward in one pass. Block k owns rows [k*rows_per_block, (k+1)*rows_per_block), one
// warp per row at a time (blockDim.x = 32 * W): per row, the two row sums, then dinp += ... and the
// row's dout*norm and dout added into the warp's own columns of the dynamic shared memory
// acc[W][2][C] (lane owns columns lane, lane+32, ...: no two threads touch a slot, no atomics). Then
// the block sums its W warps in warp order into partial[k][0][c] (dweight) and partial[k][1][c]
// (dbias); layernorm_backward_params_finish adds the blocks in order. Shared memory: W*2*C floats.
extern "C" __global__ void layernorm_backward_fused(float* __restrict__ partial, floatX* __restrict__ dinp,
                                                    const floatX* __restrict__ dout, const floatX* __restrict__ inp,
                                                    const floatX* __restrict__ weight, const float* __restrict__ mean,
                                                    const float* __restrict__ rstd, int N, int C,
                                                    int rows_per_block) {
    extern __shared__ float acc[];
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    float* dw = acc + (long long)warp * 2 * C;
    float* db = dw + C;
    for (int c = lane; c < C; c += WARP_SIZE) {
        dw[c] = 0.0f;
        db[c] = 0.0f;
    }
    const int row_begin = blockIdx.x * rows_per_block;
    const int row_end = min(N, row_begin + rows_per_block);
    for (int row = row_begin + warp; row < row_end; row += num_warps) {
        const long long base = (long long)row * C;
        const float m = mean[row];
        const float s = rstd[row];
        float dnorm_sum = 0.0f;
        float dnorm_norm_sum = 0.0f;
        for (int c = lane; c < C; c += WARP_SIZE) {
            const float norm = (to_float(inp[base + c]) - m) * s;
            const float dnorm = to_float(dout[base + c]) * to_float(weight[c]);
            dnorm_sum += dnorm;
            dnorm_norm_sum += dnorm * norm;
        }
        const float dnorm_mean = warp_sum(dnorm_sum) / C;
        const float dnorm_norm_mean = warp_sum(dnorm_norm_sum) / C;
        for (int c = lane; c < C; c += WARP_SIZE) {
            const float norm = (to_float(inp[base + c]) - m) * s;
            const float g = to_float(dout[base + c]);
            const float dnorm = g * to_float(weight[c]);
            dinp[base + c] = to_floatX(to_float(dinp[base + c]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
            dw[c] += g * norm;
            db[c] += g;
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sw = 0.0f;
        float sb = 0.0f;
        for (int w = 0; w < num_warps; w++) {
            sw += acc[(long long)w * 2 * C + c];
            sb += acc[(long long)w * 2 * C + C + c];
        }
        partial[((long long)blockIdx.x * 2) * C + c] = sw;
        partial[((long long)blockIdx.x * 2 + 1) * C + c] = sb;
    }
}
