// flash_attention.cu: causal self-attention without the (T,T) matrix (FlashAttention-2's scheme), with
// the matrix products on tensor cores through nvcuda::wmma (TF32 inputs in the fp32 build, bf16 inputs in the
// bf16 build; fp32 accumulation in both).
//
// Shapes: inp (B,T,3C) = [q | k | v], heads of HS = 64 channels (C = NH * 64); out (B,T,C);
// lse (B,NH,T) the log-sum-exp of each row of the scaled, masked scores; dinp (B,T,3C); D (B,NH,T).
//
// Forward, one block per (query tile of BQ rows, batch * head): the block keeps its Q tile and an
// output accumulator O in shared memory and walks the key tiles 0..its own (the causal mask drops the
// rest). Per key tile: S = Q K^T (tensor cores), then per row the online softmax: the new running max m,
// the rescale factor alpha = exp(m_old - m_new) applied to O and to the running sum l, P = exp(S - m);
// then O += P V (tensor cores). At the end out = O / l and lse = m + log l. Nothing of size T x T is
// ever written.
//
// Backward recomputes P = exp(S - lse) tile by tile instead of reading a stored one. With
// D = rowsum(dout * out) (= rowsum(P * dP)), dP = dout V^T and dS = P (dP - D) scale:
// dV = P^T dout, dK = dS^T Q, dQ = dS K. Two kernels, so no two blocks ever add into the same output
// (no atomics, bitwise reproducible): one block per key tile accumulates dK and dV over the query
// tiles at and after it; one block per query tile accumulates dQ over the key tiles up to it.
//
// Fragment layouts are opaque (they differ between GPUs; the emulator permutes them per run): the
// kernels only load, multiply and store fragments, and do every per-row step (max, exp, rescale) on
// the tiles in shared memory, where rows are rows.
//
// Precision, one source for both builds (kernels/common.cuh's floatX):
//   fp32 build: inp, out, dout, dinp float; fragments TF32 m16n16k8. Inputs are rounded to TF32
//     (__float_to_tf32) as they are copied into shared memory, and so are P and dS, in place of the fp32
//     scores they overwrite, so every fragment loaded from shared memory is TF32 already.
//   bf16 build (-DGPT2NP_BF16): inp, out, dout, dinp __nv_bfloat16; fragments bf16 m16n16k16. Q, K, V, dO are
//     copied into shared memory as they are (bf16); the scores S and dP come out of the accumulators in fp32,
//     the softmax statistics (m, l, lse, D) and P, dS are computed in fp32, and P and dS are rounded to bf16
//     (round to nearest even) into tiles of their own as the inputs of the second products (P V, P^T dO,
//     dS^T Q, dS K), as FlashAttention does; out and dinp are rounded to bf16 once, at the store.
// lse and D are float in both. Accumulators are fp32 (products exact, sums rounded in fp32).
// Shared memory: 39 KB forward, 44 KB backward (fp32 build); 29 KB, 33 KB (bf16 build); under the 48 KB a
// kernel gets without opting in. Block: 128 threads (4 warps).
// WMMA TF32 and bf16 need sm_80+: on older GPUs the kernels trap (CudaBackend refuses to launch them there).
#include "common.cuh"
#include <mma.h>

#define FLASH_HS 64                    // head size the kernels are written for
#define FLASH_TILE 32                  // query rows (BQ) and key rows (BK) per tile
#define FLASH_LDS (FLASH_TILE + 4)     // row stride of the (32 x 32) fp32 score tiles
#define FLASH_LDO (FLASH_HS + 4)       // row stride of the (32 x 64) fp32 tiles (forward's O, result staging)
#define FLASH_THREADS 128              // 4 warps
#define FLASH_SCORE_FLOATS (FLASH_TILE * FLASH_LDS)
#define FLASH_NEG_INF __int_as_float(0xff800000)   // -inf (NVRTC has no INFINITY)

// The tensor-core input type (flash_in: what the (32 x 64) Q, K, V, dO tiles and the P, dS tiles the second
// products read hold), the WMMA shape's k (FLASH_K) and the row strides of the input tiles: a multiple of 16
// bytes (WMMA's ldm) that skews the banks; P and dS have tiles of their own (FLASH_OWN_P) only in the bf16 build.
#if defined(GPT2NP_BF16)
typedef __nv_bfloat16 flash_in;
#define FLASH_FRAG_T __nv_bfloat16
#define FLASH_K 16
#define FLASH_LD (FLASH_HS + 8)        // row stride of the (32 x 64) input tiles
#define FLASH_LDP (FLASH_TILE + 8)     // row stride of the (32 x 32) P and dS tiles
#define FLASH_OWN_P 1
#else
typedef float flash_in;
#define FLASH_FRAG_T wmma::precision::tf32
#define FLASH_K 8
#define FLASH_LD (FLASH_HS + 4)
#define FLASH_LDP FLASH_LDS            // P and dS overwrite the fp32 scores in place
#endif
#define FLASH_TILE_ELEMS (FLASH_TILE * FLASH_LD)
#define FLASH_P_ELEMS (FLASH_TILE * FLASH_LDP)

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FLASH_WMMA 1
using namespace nvcuda;
typedef wmma::fragment<wmma::matrix_a, 16, 16, FLASH_K, FLASH_FRAG_T, wmma::row_major> FlashARow;
typedef wmma::fragment<wmma::matrix_a, 16, 16, FLASH_K, FLASH_FRAG_T, wmma::col_major> FlashACol;
typedef wmma::fragment<wmma::matrix_b, 16, 16, FLASH_K, FLASH_FRAG_T, wmma::row_major> FlashBRow;
typedef wmma::fragment<wmma::matrix_b, 16, 16, FLASH_K, FLASH_FRAG_T, wmma::col_major> FlashBCol;
typedef wmma::fragment<wmma::accumulator, 16, 16, FLASH_K, float> FlashAcc;

// A tensor-core input from fp32: TF32 (round to nearest, ties away) or bf16 (round to nearest even; exact for a
// value read from bf16 storage).
__device__ __forceinline__ flash_in flash_round(float x) {
#if defined(GPT2NP_BF16)
    return __float2bfloat16_rn(x);
#else
    return wmma::__float_to_tf32(x);
#endif
}

// Copies rows row0 .. row0+31 of one head's HS channels into a (32 x HS) shared tile of tensor-core inputs;
// rows at or past T are zeros. src points at channel 0 of row 0 of this (batch, part, head); rows are
// `width` elements apart.
__device__ __forceinline__ void flash_load_tile(flash_in* tile, const floatX* src, int row0, int T, int width) {
    for (int i = threadIdx.x; i < FLASH_TILE * FLASH_HS; i += FLASH_THREADS) {
        const int r = i / FLASH_HS, c = i % FLASH_HS;
        const int t = row0 + r;
        tile[r * FLASH_LD + c] = flash_round(t < T ? to_float(src[(long long)t * width + c]) : 0.0f);
    }
}

// S (32 x 32, ld FLASH_LDS) = A (32 x HS) @ Bm (32 x HS)^T, both tiles of ld FLASH_LD. Warp w: the
// 16 x 16 block (w / 2, w % 2).
__device__ __forceinline__ void flash_scores(float* S, const flash_in* A, const flash_in* Bm, int warp) {
    const int row = (warp / 2) * 16, col = (warp % 2) * 16;
    FlashAcc acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll 2   // fully unrolled, the fragment loads run ahead and spill registers
    for (int kk = 0; kk < FLASH_HS; kk += FLASH_K) {
        FlashARow a;
        FlashBCol b;                                    // b (k, n) = Bm[n][k]: Bm^T read column-major
        wmma::load_matrix_sync(a, A + row * FLASH_LD + kk, FLASH_LD);
        wmma::load_matrix_sync(b, Bm + col * FLASH_LD + kk, FLASH_LD);
        wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(S + row * FLASH_LDS + col, acc, FLASH_LDS, wmma::mem_row_major);
}

// acc (16 x 16 block at (row, col) of a 32 x HS result) += P (32 x 32) @ M (32 x HS), or P^T @ M when
// transpose; P has ld FLASH_LDP, M ld FLASH_LD.
template <bool transpose>
__device__ __forceinline__ void flash_accumulate(FlashAcc& acc, const flash_in* P, const flash_in* M, int row,
                                                 int col) {
#pragma unroll 2
    for (int kk = 0; kk < FLASH_TILE; kk += FLASH_K) {
        FlashBRow b;
        wmma::load_matrix_sync(b, M + kk * FLASH_LD + col, FLASH_LD);
        if (transpose) {
            FlashACol a;                                // a (m, k) = P[k][m]
            wmma::load_matrix_sync(a, P + kk * FLASH_LDP + row, FLASH_LDP);
            wmma::mma_sync(acc, a, b, acc);
        } else {
            FlashARow a;
            wmma::load_matrix_sync(a, P + row * FLASH_LDP + kk, FLASH_LDP);
            wmma::mma_sync(acc, a, b, acc);
        }
    }
}
#endif

// out (B,T,C), lse (B,NH,T) from inp (B,T,3C). Grid (ceil(T/32), B*NH), block FLASH_THREADS.
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 1)
flash_attention_forward(floatX* out, float* lse, const floatX* inp, int B, int T, int NH, float scale) {
#if defined(FLASH_WMMA)
    __shared__ __align__(32) flash_in Qs[FLASH_TILE_ELEMS];
    __shared__ __align__(32) flash_in Ks[FLASH_TILE_ELEMS];
    __shared__ __align__(32) flash_in Vs[FLASH_TILE_ELEMS];
    __shared__ __align__(32) float Os[FLASH_TILE * FLASH_LDO];
    __shared__ __align__(32) float Ss[FLASH_SCORE_FLOATS];     // scores (fp32)
#if defined(FLASH_OWN_P)
    __shared__ __align__(32) flash_in Ps[FLASH_P_ELEMS];       // P (bf16)
#else
    flash_in* const Ps = Ss;                                    // P (TF32) over the scores
#endif
    const int C = NH * FLASH_HS, C3 = 3 * C;
    const int qt = gridDim.x - 1 - blockIdx.x;          // the longest rows first
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int q0 = qt * FLASH_TILE;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const floatX* base = inp + (long long)b * T * C3 + h * FLASH_HS;
    flash_load_tile(Qs, base, q0, T, C3);
    for (int i = threadIdx.x; i < FLASH_TILE * FLASH_LDO; i += FLASH_THREADS) Os[i] = 0.0f;
    // warp w owns rows 8w .. 8w+7 for the softmax: their running max and sum (the same in every lane)
    float m[8], l[8];
#pragma unroll
    for (int rr = 0; rr < 8; rr++) {
        m[rr] = FLASH_NEG_INF;
        l[rr] = 0.0f;
    }
    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * FLASH_TILE;
        flash_load_tile(Ks, base + C, k0, T, C3);
        flash_load_tile(Vs, base + 2 * C, k0, T, C3);
        __syncthreads();
        flash_scores(Ss, Qs, Ks, warp);
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < 8; rr++) {
            // key k0 <= every query row of this tile and k0 < T, so each row has a finite maximum
            const int r = warp * 8 + rr, q = q0 + r, key = k0 + lane;
            const float s = (key <= q && key < T) ? Ss[r * FLASH_LDS + lane] * scale : FLASH_NEG_INF;
            const float m_new = fmaxf(m[rr], warp_max(s));
            const float p = expf(s - m_new);
            const float alpha = expf(m[rr] - m_new);    // 0 on the first tile (m = -inf)
            l[rr] = l[rr] * alpha + warp_sum(p);
            m[rr] = m_new;
            Ps[r * FLASH_LDP + lane] = flash_round(p);
            Os[r * FLASH_LDO + lane] *= alpha;
            Os[r * FLASH_LDO + lane + WARP_SIZE] *= alpha;
        }
        __syncthreads();
        // O += P V: warp w the 16 x 16 blocks (w % 2, 2 (w / 2)) and (w % 2, 2 (w / 2) + 1)
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            const int row = (warp % 2) * 16, col = ((warp / 2) * 2 + j) * 16;
            FlashAcc acc;
            wmma::load_matrix_sync(acc, Os + row * FLASH_LDO + col, FLASH_LDO, wmma::mem_row_major);
            flash_accumulate<false>(acc, Ps, Vs, row, col);
            wmma::store_matrix_sync(Os + row * FLASH_LDO + col, acc, FLASH_LDO, wmma::mem_row_major);
        }
        __syncthreads();
    }
#pragma unroll
    for (int rr = 0; rr < 8; rr++) {
        const int r = warp * 8 + rr, q = q0 + r;
        if (q < T) {
            floatX* o = out + ((long long)b * T + q) * C + h * FLASH_HS;
            const float inv = 1.0f / l[rr];
            o[lane] = to_floatX(Os[r * FLASH_LDO + lane] * inv);
            o[lane + WARP_SIZE] = to_floatX(Os[r * FLASH_LDO + lane + WARP_SIZE] * inv);
            if (lane == 0) lse[((long long)b * NH + h) * T + q] = m[rr] + logf(l[rr]);
        }
    }
#else
    __trap();   // WMMA TF32 / bf16 needs sm_80+
#endif
}

// D (B,NH,T) = rowsum(dout * out) per head: one warp per (b, h, t). Grid ceil(B*NH*T / warps), block
// 32 * warps. Any head size.
extern "C" __global__ void flash_attention_backward_delta(float* D, const floatX* dout, const floatX* out, int B,
                                                          int T, int NH, int HS) {
    const long long row = (long long)blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= (long long)B * NH * T) return;
    const int t = (int)(row % T), h = (int)(row / T % NH), b = (int)(row / T / NH);
    const long long at = ((long long)b * T + t) * NH * HS + (long long)h * HS;
    float sum = 0.0f;
    for (int c = lane; c < HS; c += WARP_SIZE) sum += to_float(dout[at + c]) * to_float(out[at + c]);
    sum = warp_sum(sum);
    if (lane == 0) D[row] = sum;
}

#if defined(FLASH_WMMA)
// The backward's shared tiles and the step both kernels share: P and dS of one (query tile, key tile).
struct FlashBackwardTiles {
    flash_in Q[FLASH_TILE_ELEMS];
    flash_in dO[FLASH_TILE_ELEMS];
    flash_in K[FLASH_TILE_ELEMS];
    flash_in V[FLASH_TILE_ELEMS];
    float P[FLASH_SCORE_FLOATS];        // scores (fp32); fp32 build: then P (TF32)
    float dS[FLASH_SCORE_FLOATS];       // dP (fp32); fp32 build: then dS (TF32)
#if defined(FLASH_OWN_P)
    flash_in Pin[FLASH_P_ELEMS];        // P (bf16)
    flash_in dSin[FLASH_P_ELEMS];       // dS (bf16)
#endif
    float lse[FLASH_TILE];
    float D[FLASH_TILE];
};
// The P and dS tiles the second products read (ld FLASH_LDP).
#if defined(FLASH_OWN_P)
#define FLASH_P_IN(s) ((s).Pin)
#define FLASH_DS_IN(s) ((s).dSin)
#else
#define FLASH_P_IN(s) ((s).P)
#define FLASH_DS_IN(s) ((s).dS)
#endif

// Loads lse and D of query rows q0 .. q0+31 (0 past T) into the tiles.
__device__ __forceinline__ void flash_load_rows(FlashBackwardTiles& s, const float* lse, const float* D, int q0,
                                                int T) {
    if (threadIdx.x < FLASH_TILE) {
        const int q = q0 + threadIdx.x;
        s.lse[threadIdx.x] = q < T ? lse[q] : 0.0f;
        s.D[threadIdx.x] = q < T ? D[q] : 0.0f;
    }
}

// With Q, dO, K, V, lse, D of query tile q0 and key tile k0 in s: P = exp(scale Q K^T - lse) (0 where
// masked), dS = P (dO V^T - D) scale, in fp32, stored as tensor-core inputs (TF32 or bf16) into FLASH_P_IN(s) and
// FLASH_DS_IN(s). Starts and ends with every thread in step.
__device__ __forceinline__ void flash_probabilities(FlashBackwardTiles& s, int q0, int k0, int T, float scale,
                                                    int warp) {
    flash_scores(s.P, s.Q, s.K, warp);
    flash_scores(s.dS, s.dO, s.V, warp);
    __syncthreads();
    for (int i = threadIdx.x; i < FLASH_TILE * FLASH_TILE; i += FLASH_THREADS) {
        const int r = i / FLASH_TILE, c = i % FLASH_TILE;
        const int q = q0 + r, key = k0 + c;
        const float p = (key <= q && q < T) ? expf(s.P[r * FLASH_LDS + c] * scale - s.lse[r]) : 0.0f;
        const float ds = p * (s.dS[r * FLASH_LDS + c] - s.D[r]) * scale;
        FLASH_P_IN(s)[r * FLASH_LDP + c] = flash_round(p);
        FLASH_DS_IN(s)[r * FLASH_LDP + c] = flash_round(ds);
    }
    __syncthreads();
}

// Writes a (32 x HS) result held as two accumulators per warp (blocks (w % 2, 2 (w / 2) + j)) to rows
// row0 .. of dst (rows `width` elements apart, rows at or past T skipped, rounded to floatX), through `stage`, a
// free (32 x 32) fp32 score tile of ld FLASH_LDS: half the columns at a time (j: the channels 16 j .. 16 j + 15
// and 32 + 16 j .. 32 + 16 j + 15). Ends with every thread in step.
__device__ __forceinline__ void flash_store_rows(floatX* dst, float* stage, const FlashAcc* acc, int row0, int T,
                                                 int width, int warp) {
    #pragma unroll
    for (int j = 0; j < 2; j++) {
        const int row = (warp % 2) * 16;
        wmma::store_matrix_sync(stage + row * FLASH_LDS + (warp / 2) * 16, acc[j], FLASH_LDS, wmma::mem_row_major);
        __syncthreads();
        for (int i = threadIdx.x; i < FLASH_TILE * FLASH_TILE; i += FLASH_THREADS) {
            const int r = i / FLASH_TILE, c = i % FLASH_TILE;
            const int channel = (c / 16) * 32 + j * 16 + c % 16;
            if (row0 + r < T) dst[(long long)(row0 + r) * width + channel] = to_floatX(stage[r * FLASH_LDS + c]);
        }
        __syncthreads();
    }
}
#endif

// dK, dV parts of dinp (B,T,3C): one block per (key tile, batch * head) over the query tiles at and after
// it. Grid (ceil(T/32), B*NH), block FLASH_THREADS. D from flash_attention_backward_delta.
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 1)
flash_attention_backward_dkv(floatX* dinp, const floatX* dout, const floatX* inp, const float* lse, const float* D,
                             int B, int T, int NH, float scale) {
#if defined(FLASH_WMMA)
    __shared__ __align__(32) FlashBackwardTiles s;
    const int C = NH * FLASH_HS, C3 = 3 * C;
    const int kt = blockIdx.x;                          // the most query tiles first
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int k0 = kt * FLASH_TILE, tiles = (T + FLASH_TILE - 1) / FLASH_TILE;
    const int warp = threadIdx.x / WARP_SIZE;
    const floatX* base = inp + (long long)b * T * C3 + h * FLASH_HS;
    const floatX* dbase = dout + (long long)b * T * C + h * FLASH_HS;
    const float* lse_bh = lse + (long long)blockIdx.y * T;
    const float* D_bh = D + (long long)blockIdx.y * T;
    flash_load_tile(s.K, base + C, k0, T, C3);
    flash_load_tile(s.V, base + 2 * C, k0, T, C3);
    FlashAcc dk[2], dv[2];
    #pragma unroll
    for (int j = 0; j < 2; j++) {
        wmma::fill_fragment(dk[j], 0.0f);
        wmma::fill_fragment(dv[j], 0.0f);
    }
    const int row = (warp % 2) * 16;
    for (int qt = kt; qt < tiles; qt++) {
        const int q0 = qt * FLASH_TILE;
        flash_load_tile(s.Q, base, q0, T, C3);
        flash_load_tile(s.dO, dbase, q0, T, C);
        flash_load_rows(s, lse_bh, D_bh, q0, T);
        __syncthreads();
        flash_probabilities(s, q0, k0, T, scale, warp);
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = ((warp / 2) * 2 + j) * 16;
            flash_accumulate<true>(dv[j], FLASH_P_IN(s), s.dO, row, col);     // dV += P^T dO
            flash_accumulate<true>(dk[j], FLASH_DS_IN(s), s.Q, row, col);     // dK += dS^T Q
        }
        __syncthreads();
    }
    floatX* dst = dinp + (long long)b * T * C3 + h * FLASH_HS;
    flash_store_rows(dst + C, s.P, dk, k0, T, C3, warp);
    flash_store_rows(dst + 2 * C, s.P, dv, k0, T, C3, warp);
#else
    __trap();
#endif
}

// dQ part of dinp (B,T,3C): one block per (query tile, batch * head) over the key tiles up to it.
// Grid (ceil(T/32), B*NH), block FLASH_THREADS.
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 1)
flash_attention_backward_dq(floatX* dinp, const floatX* dout, const floatX* inp, const float* lse, const float* D,
                            int B, int T, int NH, float scale) {
#if defined(FLASH_WMMA)
    __shared__ __align__(32) FlashBackwardTiles s;
    const int C = NH * FLASH_HS, C3 = 3 * C;
    const int qt = gridDim.x - 1 - blockIdx.x;          // the most key tiles first
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int q0 = qt * FLASH_TILE;
    const int warp = threadIdx.x / WARP_SIZE;
    const floatX* base = inp + (long long)b * T * C3 + h * FLASH_HS;
    flash_load_tile(s.Q, base, q0, T, C3);
    flash_load_tile(s.dO, dout + (long long)b * T * C + h * FLASH_HS, q0, T, C);
    flash_load_rows(s, lse + (long long)blockIdx.y * T, D + (long long)blockIdx.y * T, q0, T);
    FlashAcc dq[2];
    #pragma unroll
    for (int j = 0; j < 2; j++) wmma::fill_fragment(dq[j], 0.0f);
    const int row = (warp % 2) * 16;
    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * FLASH_TILE;
        flash_load_tile(s.K, base + C, k0, T, C3);
        flash_load_tile(s.V, base + 2 * C, k0, T, C3);
        __syncthreads();
        flash_probabilities(s, q0, k0, T, scale, warp);
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = ((warp / 2) * 2 + j) * 16;
            flash_accumulate<false>(dq[j], FLASH_DS_IN(s), s.K, row, col);    // dQ += dS K
        }
        __syncthreads();
    }
    flash_store_rows(dinp + (long long)b * T * C3 + h * FLASH_HS, s.P, dq, q0, T, C3, warp);
#else
    __trap();
#endif
}
