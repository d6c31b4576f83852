// encoder.cu: token + position embedding, forward and backward.
//
//   forward:  out (B,T,C) = wte (Vp,C)[inp (B,T)] + wpe (maxT,C)[t]
//   backward: dwte[inp[b,t]] += dout[b,t];  dwpe[t] += sum_b dout[b,t]
//             (accumulate == 0: dwpe[t] = sum_b dout[b,t], old rows [0,T) not read; dwte always +=)
//
// Determinism: both gradients are bitwise reproducible, whatever the thread/block schedule.
// dwpe is reduced over b in a fixed order by one thread per (t, c). dwte takes no atomics: the
// host groups the B*T positions by token id (CSR: the unique tokens, and for each one its
// positions b*T+t in ascending order) and one thread per (unique token, c) adds that token's
// dout rows into dwte in that order, i.e. dwte[tok] = ((dwte[tok] + dout[p0]) + dout[p1]) + ...,
// the same order and rounding as a sequential loop over (b, t) (NumPy's np.add.at, llm.c's CPU code).
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

// dwte (Vp,C) += dout (B,T,C) rows grouped by token id, no atomics. groups (int32, 3 * capacity + 2, uploaded by
// the host with the batch, see CudaBackend.upload_tokens): [U | offsets (capacity + 1) | positions (capacity) |
// tokens (capacity)], U the number of distinct tokens, capacity >= B*T. Token tokens[u] occurs at the positions
// positions[offsets[u] .. offsets[u+1]) (ascending b*T+t). U is read on the device, so the launch does not
// depend on the batch (a captured graph replays it): grid (ceil(C / blockDim.x), gridDim.y sized for the worst
// case), 1-D blocks; thread (blockIdx.x, threadIdx.x) owns channel c, block row blockIdx.y the unique tokens
// u = blockIdx.y, blockIdx.y + gridDim.y, ... < U. Each (token, c) is written by exactly one thread, which adds
// the token's rows into dwte in position order.
extern "C" __global__ void encoder_backward_wte_grouped(float* __restrict__ dwte, const float* __restrict__ dout,
                                                       const int* __restrict__ groups, int capacity, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) {
        return;
    }
    const int num_unique = groups[0];
    const int* offsets = groups + 1;
    const int* positions = offsets + capacity + 1;
    const int* tokens = positions + capacity;
    for (int u = blockIdx.y; u < num_unique; u += gridDim.y) {
        const int end = offsets[u + 1];
        float* row = dwte + (long long)tokens[u] * C;
        float acc = row[c];
        for (int j = offsets[u]; j < end; j++) {
            acc += dout[positions[j] * C + c];
        }
        row[c] = acc;
    }
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
