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
//
// Precision. fp32 build: params and grads are float, `master` is not read or written (the host passes
// params itself there), and t, seed, offset are unused: the update is the one above on params, in place.
// bf16 build (-DGPT2NP_BF16): params and grads are bf16, `master` holds the fp32 master weights. The
// (exactly upcast) gradient drives the same fp32 update of master, m and v, and params = master rounded
// stochastically with the noise of (seed, t, offset + i), offset being params[0]'s index in the model's
// flat parameter buffer: bitwise gpt2np.bf16.round_stochastic (SplitMix64, see there). A null
// `master` (llm.c's -w 0, no master weights) updates the upcast bf16 parameter itself, rounded the same way.
// m and v are fp32 in both builds.
#include "common.cuh"

// step statistics buffer (gpt2np.model.STATS): the mean loss, the squared global gradient norm
#define STAT_LOSS 0
#define STAT_NORM_SQUARED 1
// step scalars buffer (gpt2np.model.STEP_SCALARS), float32 x 6: lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t),
// 1 - lr wd, t itself (mod 2^32) stored as the BITS of its float32 slot (an unsigned int view; read with
// __float_as_uint), so every step number is exact, then the outlier limits of the loss and of the grad norm
// (gpt2np.outlier, train.py -sl/-sg; inf = none). Only the bf16 build reads SCALAR_STEP.
#define SCALAR_STEP_SIZE 0
#define SCALAR_INV_SQRT_BIAS_CORRECTION2 1
#define SCALAR_DECAY 2
#define SCALAR_STEP 3
#define SCALAR_LOSS_LIMIT 4
#define SCALAR_NORM_LIMIT 5

#if defined(GPT2NP_BF16)
// SplitMix64 (gpt2np.bf16): the golden-ratio increment and the finalizer's multipliers
#define SPLITMIX_GAMMA 0x9E3779B97F4A7C15ull
#define SPLITMIX_MIX1 0xBF58476D1CE4E5B9ull
#define SPLITMIX_MIX2 0x94D049BB133111EBull
#define BF16_QUIET_NAN 0x7FC0u

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * SPLITMIX_MIX1;
    z = (z ^ (z >> 27)) * SPLITMIX_MIX2;
    return z ^ (z >> 31);
}

// The step's stream: mix64(seed * 2^32 + t), seed and t mod 2^32 (bf16.stream_key).
__device__ __forceinline__ unsigned long long rounding_stream(int seed, unsigned int t) {
    return mix64(((unsigned long long)(unsigned int)seed << 32) | (unsigned long long)t);
}

// x rounded to bf16 with the noise of element `index`: r = top 16 bits of mix64(stream + (index + 1) GAMMA);
// the magnitude rounds up when r < x's low 16 bits (bf16.round_stochastic). NaN -> 0x7FC0; inf stays inf.
__device__ __forceinline__ floatX round_stochastic(float x, unsigned long long stream, unsigned long long index) {
    const unsigned int u = __float_as_uint(x);
    unsigned int hi;
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        hi = BF16_QUIET_NAN;
    } else {
        const unsigned int r = (unsigned int)(mix64(stream + (index + 1ull) * SPLITMIX_GAMMA) >> 48);
        hi = (u >> 16) + (r < (u & 0xFFFFu) ? 1u : 0u);       // carries into the exponent as it should
    }
    return __ushort_as_bfloat16((unsigned short)hi);
}
#endif

// One element. `stream` and `offset` are the bf16 build's stochastic rounding (unused in the fp32 build).
__device__ __forceinline__ void adamw_element(floatX* __restrict__ params, const floatX* __restrict__ grads,
                                              float* __restrict__ m, float* __restrict__ v, float* master, int i,
                                              float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                                              float eps, float step_size, float inv_sqrt_bias_correction2,
                                              float decay, float grad_scale, unsigned long long stream, int offset) {
    const float g = to_float(grads[i]) * grad_scale;
    const float mi = beta1 * m[i] + one_minus_beta1 * g;
    const float vi = beta2 * v[i] + one_minus_beta2 * (g * g);
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * inv_sqrt_bias_correction2 + eps;
#if defined(GPT2NP_BF16)
    const float old = master != nullptr ? master[i] : to_float(params[i]);    // null: -w 0
    const float p = old * decay - step_size * (mi / denom);
    if (master != nullptr) {
        master[i] = p;
    }
    params[i] = round_stochastic(p, stream, (unsigned long long)offset + (unsigned long long)i);
#else
    (void)master;
    (void)stream;
    (void)offset;
    params[i] = params[i] * decay - step_size * (mi / denom);
#endif
}

// master: the fp32 master weights (bf16 build; null for -w 0); in the fp32 build not accessed (pass params).
// t: the AdamW step (>= 1), seed: stochastic rounding's seed (its 32 bits), offset: params[0]'s index in the flat parameter buffer;
// these three only matter in the bf16 build.
extern "C" __global__ void adamw_update(floatX* __restrict__ params, const floatX* __restrict__ grads,
                                        float* __restrict__ m, float* __restrict__ v, float* master, int n,
                                        float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                                        float eps, float step_size, float inv_sqrt_bias_correction2,
                                        float decay, float grad_scale, int t, int seed, int offset) {
    const long long i = global_thread_index();
    if (i < n) {
#if defined(GPT2NP_BF16)
        const unsigned long long stream = rounding_stream(seed, (unsigned int)t);
#else
        const unsigned long long stream = 0;
        (void)t;
        (void)seed;
#endif
        adamw_element(params, grads, m, v, master, (int)i, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                      step_size, inv_sqrt_bias_correction2, decay, grad_scale, stream, offset);
    }
}

// As adamw_update, with the per-step scalars from `scalars` (decay applies when `decayed`, else 1; the bf16
// build's t from scalars[SCALAR_STEP]) and the clipping from `stats`: scale = grad_clip / norm when
// norm > grad_clip > 0, else 1, with norm = sqrt of the squared norm, in double as the host did. A step whose
// loss or squared norm is not finite, or whose loss or norm is above its outlier limit in `scalars` (-sl/-sg),
// changes nothing (params, master, m, v untouched): the host learns it when it reads the step's statistics back
// (and repeats these comparisons). seed and offset are constant over a run (a captured graph replays them).
extern "C" __global__ void adamw_update_device(floatX* __restrict__ params, const floatX* __restrict__ grads,
                                               float* __restrict__ m, float* __restrict__ v, float* master, int n,
                                               const float* __restrict__ scalars, const float* __restrict__ stats,
                                               int decayed, float beta1, float one_minus_beta1, float beta2,
                                               float one_minus_beta2, float eps, float grad_clip, int seed,
                                               int offset) {
    const long long i = global_thread_index();
    const float loss = stats[STAT_LOSS];
    const float norm_squared = stats[STAT_NORM_SQUARED];
    if (i >= n || !isfinite(loss) || !isfinite(norm_squared) || loss > scalars[SCALAR_LOSS_LIMIT]) {
        return;
    }
    const double norm = sqrt((double)norm_squared);
    if (norm > (double)scalars[SCALAR_NORM_LIMIT]) {       // an outlier grad norm (-sg): skip the update
        return;
    }
    const float grad_scale = grad_clip > 0.0f && norm > (double)grad_clip ? (float)((double)grad_clip / norm) : 1.0f;
    const float decay = decayed ? scalars[SCALAR_DECAY] : 1.0f;
#if defined(GPT2NP_BF16)
    const unsigned long long stream = rounding_stream(seed, __float_as_uint(scalars[SCALAR_STEP]));
#else
    const unsigned long long stream = 0;
    (void)seed;
#endif
    adamw_element(params, grads, m, v, master, (int)i, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
                  scalars[SCALAR_STEP_SIZE], scalars[SCALAR_INV_SQRT_BIAS_CORRECTION2], decay, grad_scale, stream,
                  offset);
}
