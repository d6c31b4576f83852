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
//
// Precision: out, wte, wpe, dwte, dwpe, dout are floatX; every sum is float, rounded once when stored.
#include "common.cuh"

// Four consecutive channels, one vector load/store: float4 (16 bytes) in the fp32 build, four bf16
// (8 bytes) in the bf16 build.
#if defined(GPT2NP_BF16)
struct __align__(8) floatX4 {
    floatX x, y, z, w;
};
#else
typedef float4 floatX4;
#endif

// One thread per 4 channels, floatX4 loads/stores: needs C % 4 == 0 and out, wte, wpe aligned to
// sizeof(floatX4) (the Python side checks both).
extern "C" __global__ void encoder_forward(floatX* __restrict__ out, const int* __restrict__ inp,
                                          const floatX* __restrict__ wte, const floatX* __restrict__ wpe,
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
    const floatX4 e = reinterpret_cast<const floatX4*>(wte)[(long long)token * C4 + c4];
    const floatX4 p = reinterpret_cast<const floatX4*>(wpe)[t * C4 + c4];
    floatX4 o;
    o.x = to_floatX(to_float(e.x) + to_float(p.x));
    o.y = to_floatX(to_float(e.y) + to_float(p.y));
    o.z = to_floatX(to_float(e.z) + to_float(p.z));
    o.w = to_floatX(to_float(e.w) + to_float(p.w));
    reinterpret_cast<floatX4*>(out)[idx] = o;
}

// dwte (Vp,C) += dout (B,T,C) rows grouped by token id, no atomics. groups (int32, 3 * capacity + 2, uploaded by
// the host with the batch, see CudaBackend.upload_tokens): [U | offsets (capacity + 1) | positions (capacity) |
// tokens (capacity)], U the number of distinct tokens, capacity >= B*T. Token tokens[u] occurs at the positions
// positions[offsets[u] .. offsets[u+1]) (ascending b*T+t). U is read on the device, so the launch does not
// depend on the batch (a captured graph replays it): grid (ceil(C / blockDim.x), gridDim.y sized for the worst
// case), 1-D blocks; thread (blockIdx.x, threadIdx.x) owns channel c, block row blockIdx.y the unique tokens
// u = blockIdx.y, blockIdx.y + gridDim.y, ... < U. Each (token, c) is written by exactly one thread, which adds
// the token's rows into dwte in position order.
extern "C" __global__ void encoder_backward_wte_grouped(floatX* __restrict__ dwte, const floatX* __restrict__ dout,
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
        floatX* row = dwte + (long long)tokens[u] * C;
        float acc = to_float(row[c]);
        for (int j = offsets[u]; j < end; j++) {
            acc += to_float(dout[positions[j] * C + c]);
        }
        row[c] = to_floatX(acc);
    }
}

// dwpe (maxT,C) rows [0,T) += sum over b of dout[b] (= when accumulate == 0; rows [T,maxT) are
// not touched, the caller zeroes them): one thread per (t, c), b summed in order.
extern "C" __global__ void encoder_backward_wpe(floatX* __restrict__ dwpe, const floatX* __restrict__ dout,
                                               int B, int T, int C, int accumulate) {
    const long long i = global_thread_index();
    const int n = T * C;
    if (i >= n) {
        return;
    }
    const int idx = (int)i;
    float sum = 0.0f;
    for (int b = 0; b < B; b++) {
        sum += to_float(dout[b * n + idx]);
    }
    dwpe[idx] = to_floatX(accumulate ? to_float(dwpe[idx]) + sum : sum);
}
