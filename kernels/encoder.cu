// encoder.cu: token + position embedding, forward and backward.
//
//   forward:  out (B,T,C) = wte (Vp,C)[inp (B,T)] + wpe (maxT,C)[t]
//   backward: dwte[inp[b,t]] += dout[b,t];  dwpe[t] += sum_b dout[b,t]
//             (accumulate == 0: dwpe[t] = sum_b dout[b,t], old rows [0,T) not read; dwte always +=)
//
// Determinism: dwpe is reduced over b in a fixed order by one thread per (t, c), so it is
// bitwise reproducible. dwte uses float atomicAdd (a token can occur many times in a batch);
// the order of those additions is up to the hardware, so dwte can differ from run to run in the
// last bits when a token repeats within a batch (as in llm.c's first CUDA encoder backward).
#include "common.cuh"

// One thread per 4 channels, float4 loads/stores: needs C % 4 == 0 and 16-byte aligned
// out, wte, wpe (the Python side checks both).
extern "C" __global__ void encoder_forward(float* __restrict__ out, const int* __restrict__ inp,
                                          const float* __restrict__ wte, const float* __restrict__ wpe,
                                          int B, int T, int C) {
    const int C4 = C / 4;
    const long long i = global_thread_index();
    if (i >= (long long)B * T * C4) {
        return;
    }
    const int idx = (int)i;
    const int bt = idx / C4;
    const int c4 = idx % C4;
    const int t = bt % T;
    const int token = inp[bt];
    const float4 e = reinterpret_cast<const float4*>(wte)[(long long)token * C4 + c4];
    const float4 p = reinterpret_cast<const float4*>(wpe)[t * C4 + c4];
    reinterpret_cast<float4*>(out)[idx] = make_float4(e.x + p.x, e.y + p.y, e.z + p.z, e.w + p.w);
}

// dwte (Vp,C) += scatter of dout (B,T,C) rows by token id: one thread per element, atomicAdd.
extern "C" __global__ void encoder_backward_wte(float* dwte, const float* __restrict__ dout,
                                               const int* __restrict__ inp, int B, int T, int C) {
    const long long i = global_thread_index();
    if (i >= (long long)B * T * C) {
        return;
    }
    const int idx = (int)i;
    const int bt = idx / C;
    const int c = idx % C;
    atomicAdd(&dwte[(long long)inp[bt] * C + c], dout[idx]);
}

// dwpe (maxT,C) rows [0,T) += sum over b of dout[b] (= when accumulate == 0; rows [T,maxT) are
// not touched, the caller zeroes them): one thread per (t, c), b summed in order.
extern "C" __global__ void encoder_backward_wpe(float* __restrict__ dwpe, const float* __restrict__ dout,
                                               int B, int T, int C, int accumulate) {
    const long long i = global_thread_index();
    const int n = T * C;
    if (i >= n) {
        return;
    }
    const int idx = (int)i;
    float sum = 0.0f;
    for (int b = 0; b < B; b++) {
        sum += dout[b * n + idx];
    }
    dwpe[idx] = accumulate ? dwpe[idx] + sum : sum;
}
