// attention.cu: the non-GEMM parts of causal multi-head self-attention (GEMMs are cuBLAS,
// strided-batched over the B*NH heads).
//
// Forward:  inp (B,T,3C) = [q|k|v] --permute_qkv--> qkvr (3,B,NH,T,HS)
//           att (B,NH,T,T) = q @ k^T (cuBLAS) --causal_softmax_forward--> softmax(scale * .) with
//           the future (s > t) set to exactly 0
//           y (B,NH,T,HS) = att @ v (cuBLAS) --unpermute--> out (B,T,C)
// Backward: dout (B,T,C) --unpermute_backward--> dy (B,NH,T,HS)
//           dv = att^T @ dy, datt = dy @ v^T (cuBLAS)
//           causal_softmax_backward: dpreatt = scale * att * (datt - sum_s datt * att)
//           dq = dpreatt @ k, dk = dpreatt^T @ q (cuBLAS) --permute_backward--> dinp (B,T,3C)
// scale = 1/sqrt(HS). Softmax kernels use one warp per row of T scores.
//
// Precision: every buffer (inp, qkvr, att, y, out and their gradients) is floatX; the softmax math is
// float, rounded once when stored (in bf16, att holds the scores and then probabilities rounded to bf16).
#include "common.cuh"

// qkvr[s,b,h,t,d] = inp[b,t,s,h,d]; one thread per element of qkvr (s in {q,k,v}).
extern "C" __global__ void permute_qkv(floatX* __restrict__ qkvr, const floatX* __restrict__ inp,
                                       int B, int T, int NH, int HS) {
    const long long i = global_thread_index();
    if (i >= 3LL * B * NH * T * HS) {
        return;
    }
    int rest = (int)i;
    const int d = rest % HS; rest /= HS;
    const int t = rest % T; rest /= T;
    const int h = rest % NH; rest /= NH;
    const int b = rest % B;
    const int s = rest / B;
    qkvr[i] = inp[((b * T + t) * 3 + s) * NH * HS + h * HS + d];
}

// out[b,t,h,d] = y[b,h,t,d]; one thread per element of out.
extern "C" __global__ void unpermute(floatX* __restrict__ out, const floatX* __restrict__ y,
                                     int B, int T, int NH, int HS) {
    const long long i = global_thread_index();
    if (i >= (long long)B * T * NH * HS) {
        return;
    }
    int rest = (int)i;
    const int d = rest % HS; rest /= HS;
    const int h = rest % NH; rest /= NH;
    const int t = rest % T;
    const int b = rest / T;
    out[i] = y[((b * NH + h) * T + t) * HS + d];
}

// dy[b,h,t,d] = dout[b,t,h,d]; one thread per element of dy.
extern "C" __global__ void unpermute_backward(floatX* __restrict__ dy, const floatX* __restrict__ dout,
                                              int B, int T, int NH, int HS) {
    const long long i = global_thread_index();
    if (i >= (long long)B * NH * T * HS) {
        return;
    }
    int rest = (int)i;
    const int d = rest % HS; rest /= HS;
    const int t = rest % T; rest /= T;
    const int h = rest % NH;
    const int b = rest / NH;
    dy[i] = dout[((b * T + t) * NH + h) * HS + d];
}

// dinp[b,t,s,h,d] = dqkvr[s,b,h,t,d]; one thread per element of dinp (B,T,3,NH,HS).
extern "C" __global__ void permute_backward(floatX* __restrict__ dinp, const floatX* __restrict__ dqkvr,
                                            int B, int T, int NH, int HS) {
    const long long i = global_thread_index();
    if (i >= 3LL * B * T * NH * HS) {
        return;
    }
    int rest = (int)i;
    const int d = rest % HS; rest /= HS;
    const int h = rest % NH; rest /= NH;
    const int s = rest % 3; rest /= 3;
    const int t = rest % T;
    const int b = rest / T;
    dinp[i] = dqkvr[(((s * B + b) * NH + h) * T + t) * HS + d];
}

// In place on att (rows = B*NH*T rows of T scores; row r is query t = r % T):
// att[r, s] = exp(scale*att[r,s] - max) / sum for s <= t, and 0 for s > t.
// One warp per row; blockDim.x = 32 * rows per block.
extern "C" __global__ void causal_softmax_forward(floatX* att, int rows, int T, float scale) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= rows) {
        return;
    }
    const int t = row % T;
    floatX* a = att + (long long)row * T;
    float row_max = NEG_FLT_MAX;
    for (int s = lane; s <= t; s += WARP_SIZE) {
        row_max = fmaxf(row_max, to_float(a[s]) * scale);
    }
    row_max = warp_max(row_max);
    float sum = 0.0f;
    for (int s = lane; s <= t; s += WARP_SIZE) {
        sum += expf(to_float(a[s]) * scale - row_max);
    }
    sum = warp_sum(sum);
    for (int s = lane; s < T; s += WARP_SIZE) {
        a[s] = to_floatX(s <= t ? expf(to_float(a[s]) * scale - row_max) / sum : 0.0f);
    }
}

// dpreatt[r,s] = (datt[r,s] - sum_s' datt[r,s'] * att[r,s']) * att[r,s] * scale for s <= t, 0 beyond.
// dpreatt may alias datt (each lane reads its elements before writing them). One warp per row.
extern "C" __global__ void causal_softmax_backward(floatX* dpreatt, const floatX* datt, const floatX* __restrict__ att,
                                                   int rows, int T, float scale) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= rows) {
        return;
    }
    const int t = row % T;
    const long long base = (long long)row * T;
    float dot = 0.0f;
    for (int s = lane; s <= t; s += WARP_SIZE) {
        dot += to_float(datt[base + s]) * to_float(att[base + s]);
    }
    dot = warp_sum(dot);
    for (int s = lane; s < T; s += WARP_SIZE) {
        dpreatt[base + s] = to_floatX(s <= t ? (to_float(datt[base + s]) - dot) * to_float(att[base + s]) * scale
                                             : 0.0f);
    }
}
