// classifier.cu: fused softmax + cross-entropy loss + dlogits, one block per row of logits.
//
//   logits (N,Vp), N = B*T, real vocabulary [0,V), padding [V,Vp); targets (N) int32
//   losses[r] = log(sum_v exp(logits[r,v] - max)) + max - logits[r, target]      (v < V)
//   if write_dlogits: logits[r,v] = exp(logits[r,v] - max) * (dloss / sum) - dloss * (v == target)
//                     for v < V, and 0 for the padding v >= V (in place).
//
// The row is read once for the statistics (online max and sum of exponentials per thread,
// combined across the block) and once more to write dlogits. blockDim.x: multiple of 32, <= 1024.
//
// Precision: logits (and the dlogits written over them) are floatX; losses and loss_mean's stats stay float.
#include "common.cuh"

// Merge two running (max, sum of exp(x - max)) pairs. Symmetric in its arguments, bit for bit,
// so a butterfly exchange leaves every lane with the same result.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float other_m, float other_s) {
    const float new_m = fmaxf(m, other_m);
    s = s * expf(m - new_m) + other_s * expf(other_m - new_m);
    m = new_m;
}

__device__ __forceinline__ void warp_softmax_stats(float& m, float& s) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const float other_m = __shfl_xor_sync(FULL_MASK, m, offset);
        const float other_s = __shfl_xor_sync(FULL_MASK, s, offset);
        softmax_merge(m, s, other_m, other_s);
    }
}

extern "C" __global__ void __launch_bounds__(1024)
fused_classifier(floatX* logits, float* __restrict__ losses, const int* __restrict__ targets, int N, int V, int Vp,
                 float dloss, int write_dlogits) {
    __shared__ float shared_max[WARP_SIZE];
    __shared__ float shared_sum[WARP_SIZE];
    const int row = blockIdx.x;
    if (row >= N) {
        return;  // whole block
    }
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    floatX* x = logits + (long long)row * Vp;
    const int target = targets[row];
    // read before any thread can overwrite it with dlogits (the block barriers below order this)
    const float target_logit = threadIdx.x == 0 ? to_float(x[target]) : 0.0f;

    float m = NEG_FLT_MAX;
    float s = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float xv = to_float(x[v]);
        if (xv > m) {
            s = s * expf(m - xv) + 1.0f;
            m = xv;
        } else {
            s += expf(xv - m);
        }
    }
    warp_softmax_stats(m, s);
    if (lane == 0) {
        shared_max[warp] = m;
        shared_sum[warp] = s;
    }
    __syncthreads();
    m = lane < num_warps ? shared_max[lane] : NEG_FLT_MAX;
    s = lane < num_warps ? shared_sum[lane] : 0.0f;
    warp_softmax_stats(m, s);  // every thread now holds the row's max and sum

    if (threadIdx.x == 0) {
        losses[row] = logf(s) + m - target_logit;
    }
    if (write_dlogits) {
        const float scale = dloss / s;
        for (int v = threadIdx.x; v < Vp; v += blockDim.x) {
            float d = 0.0f;
            if (v < V) {
                d = expf(to_float(x[v]) - m) * scale;
                if (v == target) {
                    d -= dloss;
                }
            }
            x[v] = to_floatX(d);
        }
    }
}

// The step's mean loss on the device (no read-back): one block of blockDim.x threads (a power of two,
// <= 1024); thread i sums losses[i], losses[i + blockDim.x], ... in double, then the partial sums are
// combined in a fixed tree order, so the result is deterministic (no atomics). With accumulate == 0:
// stats[0] = mean / count, else stats[0] += mean / count (count: the micro-batches of the step, so
// stats[0] ends as the mean over them).
extern "C" __global__ void __launch_bounds__(1024)
loss_mean(float* __restrict__ stats, const float* __restrict__ losses, int N, int count, int accumulate) {
    __shared__ double partial[1024];
    double sum = 0.0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        sum += (double)losses[i];
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const float mean = (float)(partial[0] / N / count);
        stats[0] = accumulate ? stats[0] + mean : mean;
    }
}
