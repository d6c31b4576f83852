// gelu.cu: GELU, tanh approximation, elementwise over n values.
//
//   forward:  out = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),  s = sqrt(2/pi)
//   backward: dinp = dout * (0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 * 0.044715 x^2)),
//             th = tanh(s (x + 0.044715 x^3)); dinp may alias dout.
//
// Precision: every buffer is floatX; the math is float, rounded once when stored.
#include "common.cuh"

#define GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)
#define GELU_CUBE 0.044715f

extern "C" __global__ void gelu_forward(floatX* __restrict__ out, const floatX* __restrict__ inp, int n) {
    const long long i = global_thread_index();
    if (i < n) {
        const float x = to_float(inp[i]);
        const float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        out[i] = to_floatX(0.5f * x * (1.0f + tanhf(u)));
    }
}

extern "C" __global__ void gelu_backward(floatX* dinp, const floatX* __restrict__ inp, const floatX* dout, int n) {
    const long long i = global_thread_index();
    if (i < n) {
        const float x = to_float(inp[i]);
        const float th = tanhf(GELU_SCALE * (x + GELU_CUBE * x * x * x));
        const float slope = 0.5f * GELU_SCALE * x * (1.0f + 3.0f * GELU_CUBE * x * x) * (1.0f - th * th);
        dinp[i] = to_floatX(to_float(dout[i]) * (0.5f * (1.0f + th) + slope));
    }
}
