// residual.cu: the residual connection, elementwise over n values.
//
//   forward:  out = inp1 + inp2
//   backward: dinp1 += dout; dinp2 += dout   (dinp1 may alias dinp2: then it gains 2 * dout)
//
// Precision: every buffer is floatX; each sum is float, rounded once when stored.
#include "common.cuh"

extern "C" __global__ void residual_forward(floatX* __restrict__ out, const floatX* __restrict__ inp1,
                                            const floatX* __restrict__ inp2, int n) {
    const long long i = global_thread_index();
    if (i < n) {
        out[i] = to_floatX(to_float(inp1[i]) + to_float(inp2[i]));
    }
}

extern "C" __global__ void residual_backward(floatX* dinp1, floatX* dinp2, const floatX* __restrict__ dout, int n) {
    const long long i = global_thread_index();
    if (i < n) {
        const float g = to_float(dout[i]);
        dinp1[i] = to_floatX(to_float(dinp1[i]) + g);
        dinp2[i] = to_floatX(to_float(dinp2[i]) + g);     // read after the store above: aliasing adds twice
    }
}
