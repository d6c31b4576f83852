// adamw.cu: one AdamW step over a flat segment of n parameters, in place.
//
//   g = grad * grad_scale
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   param = param * (1 - lr wd) - step_size * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   with step_size = lr / (1 - beta1^t)
//
// The host computes the step-dependent scalars in double precision (bias corrections, decay
// factor, 1 - beta) and passes them as floats.
#include "common.cuh"

extern "C" __global__ void adamw_update(float* __restrict__ params, const float* __restrict__ grads,
                                        float* __restrict__ m, float* __restrict__ v, int n,
                                        float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                                        float eps, float step_size, float inv_sqrt_bias_correction2,
                                        float decay, float grad_scale) {
    const long long i = global_thread_index();
    if (i < n) {
        const float g = grads[i] * grad_scale;
        const float mi = beta1 * m[i] + one_minus_beta1 * g;
        const float vi = beta2 * v[i] + one_minus_beta2 * (g * g);
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) * inv_sqrt_bias_correction2 + eps;
        params[i] = params[i] * decay - step_size * (mi / denom);
    }
}
