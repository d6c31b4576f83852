// residual.cu: the residual connection, elementwise over n floats.
//
//   forward:  out = inp1 + inp2
//   backward: dinp1 += dout; dinp2 += dout   (dinp1 may alias dinp2: then it gains 2 * dout)
#include "common.cuh"

extern "C" __global__ void residual_forward(float* __restrict__ out, const float* __restrict__ inp1,
                                            const float* __restrict__ inp2, int n) {
    const long long i = global_thread_index();
    if (i < n) {
        out[i] = inp1[i] + inp2[i];
    }
}

extern "C" __global__ void residual_backward(float* dinp1, float* dinp2, const float* __restrict__ dout, int n) {
    const long long i = global_thread_index();
    if (i < n) {
        const float g = dout[i];
        dinp1[i] += g;
        dinp2[i] += g;
    }
}
