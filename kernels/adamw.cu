// adamw.cu: one AdamW step over a flat segment of n parameters, in place.
//
//   g = grad * grad_scale
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   param = param * (1 - lr wd) - step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   with step_size = lr / (1 - beta1^t)
//
// The host computes the step-dependent scalars in double precision (bias corrections, decay
// factor, 1 - beta) and rounds them to float. adamw_update takes them as arguments;
// adamw_update_device reads them from a device buffer (written by an upload before the step,
// so a captured CUDA graph replays with the new step's values) and computes the clipping scale
// itself from the step's statistics (the squared gradient norm, the loss) in device memory: the
// host never reads the norm back. Both run the same fp32 operations per element (adamw_element).
#include "common.cuh"

// step statistics buffer (gpt2np.model.STATS): the mean loss, the squared global gradient norm
#define STAT_LOSS 0
#define STAT_NORM_SQUARED 1
// step scalars buffer (gpt2np.model.STEP_SCALARS): lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t), 1 - lr wd
#define SCALAR_STEP_SIZE 0
#define SCALAR_INV_SQRT_BIAS_CORRECTION2 1
#define SCALAR_DECAY 2

__device__ __forceinline__ void adamw_element(float* __restrict__ params, const float* __restrict__ grads,
                                              float* __restrict__ m, float* __restrict__ v, int i, float beta1,
                                              float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                                              float step_size, float inv_sqrt_bias_correction2, float decay,
                                              float grad_scale) {
    const float g = grads[i] * grad_scale;
    const float mi = beta1 * m[i] + one_minus_beta1 * g;
    const float vi = beta2 * v[i] + one_minus_beta2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * inv_sqrt_bias_correction2 + eps;
    params[i] = params[i] * decay - step_size * (mi / denom);
}

extern "C" __global__ void adamw_update(float* __restrict__ params, const float* __restrict__ grads,
                                        float* __restrict__ m, float* __restrict__ v, int n,
                                        float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                                        float eps, float step_size, float inv_sqrt_bias_correction2,
                                        float decay, float grad_scale) {
    const long long i = global_thread_index();
    if (i < n) {
        adamw_element(params, grads, m, v, (int)i, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size,
                      inv_sqrt_bias_correction2, decay, grad_scale);
    }
}

// As adamw_update, with the per-step scalars from `scalars` (decay applies when `decayed`, else 1) and the
// clipping from `stats`: scale = grad_clip / norm when norm > grad_clip > 0, else 1, with norm = sqrt of the
// squared norm, in double as the host did. A step whose loss or squared norm is not finite changes nothing
// (params, m, v untouched): the host learns it when it reads the step's statistics back.
extern "C" __global__ void adamw_update_device(float* __restrict__ params, const float* __restrict__ grads,
                                               float* __restrict__ m, float* __restrict__ v, int n,
                                               const float* __restrict__ scalars, const float* __restrict__ stats,
                                               int decayed, float beta1, float one_minus_beta1, float beta2,
                                               float one_minus_beta2, float eps, float grad_clip) {
    const long long i = global_thread_index();
    const float loss = stats[STAT_LOSS];
    const float norm_squared = stats[STAT_NORM_SQUARED];
    if (i >= n || !isfinite(loss) || !isfinite(norm_squared)) {
        return;
    }
    const double norm = sqrt((double)norm_squared);
    const float grad_scale = grad_clip > 0.0f && norm > (double)grad_clip ? (float)((double)grad_clip / norm) : 1.0f;
    const float decay = decayed ? scalars[SCALAR_DECAY] : 1.0f;
    adamw_element(params, grads, m, v, (int)i, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                  scalars[SCALAR_STEP_SIZE], scalars[SCALAR_INV_SQRT_BIAS_CORRECTION2], decay, grad_scale);
}
