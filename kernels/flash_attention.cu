// flash_attention.cu: causal self-attention without the (T,T) matrix (FlashAttention-2's scheme), with
// the matrix products on tensor cores through nvcuda::wmma (TF32 inputs in the fp32 build, bf16 inputs in the
// bf16 build; fp32 accumulation in both).
//
// Shapes: inp (B,T,3C) = [q | k | v], heads of HS = 64 channels (C = NH * 64); out (B,T,C);
// lse (B,NH,T) the log-sum-exp of each row of the scaled, masked scores; dinp (B,T,3C); D (B,NH,T).
//
// Work split, the same in the three big kernels: a block of 4 warps owns 64 rows of one (batch, head) (queries
// in the forward and in dQ, keys in dK/dV), 16 rows per warp, and walks the other side's rows in steps of 32.
// Each warp keeps its 16 rows' inputs (Q, or K and V, and dO) in fragments for the whole walk and does its own
// softmax, so warps meet only where a new step's 32 rows are put into shared memory (two barriers a step);
// the next step's rows are read from global memory into registers while this step computes. A warp whose 16
// rows the causal mask hides from a whole step skips its arithmetic there.
//
// Forward, one block per (64 queries, batch * head), over the key steps 0..its last row: per step
// S = Q K^T (tensor cores); then per row the online softmax (two lanes a row, 16 scores each) against a
// reference max m, P = exp(S - m), and the running sum l of P; then O += P V (tensor cores, O in fragments).
// The reference moves only when a row's max passes it by more than FLASH_RESCALE_ABOVE (then O and l are
// rescaled by exp(m_old - m_new) through the warp's shared O tile, where rows are rows), which after the first
// steps is rare. At the end out = O / l and lse = m + log l. Nothing of size T x T is ever written.
//
// Backward recomputes P = exp(S - lse) tile by tile instead of reading a stored one. With
// D = rowsum(dout * out) (= rowsum(P * dP)), dP = dout V^T and dS = P (dP - D) scale:
// dV = P^T dout, dK = dS^T Q, dQ = dS K. Two kernels, so no two blocks ever add into the same output
// (no atomics, bitwise reproducible): one block per 64 keys accumulates dK and dV over the query steps at and
// after them (working on S^T = K Q^T, dP^T = V dO^T); one block per 64 queries accumulates dQ over the key steps
// up to them. Accumulators stay in fragments; results go out through the warp's shared tile.
//
// Fragment layouts are opaque (they differ between GPUs; the emulator permutes them per run): the
// kernels only load, multiply and store fragments, and do every per-row step (max, exp, rescale) on
// the tiles in shared memory, where rows are rows.
//
// Precision, one source for both builds (kernels/common.cuh's floatX):
//   fp32 build: inp, out, dout, dinp float; fragments TF32 m16n16k8. Inputs are rounded to TF32
//     (__float_to_tf32) as they are put into shared memory, and so are P and dS, in place of the fp32
//     scores they overwrite, so every fragment loaded from shared memory is TF32 already.
//   bf16 build (-DGPT2NP_BF16): inp, out, dout, dinp __nv_bfloat16; fragments bf16 m16n16k16. Q, K, V, dO are
//     put into shared memory as they are (bf16); the scores S and dP come out of the accumulators in fp32,
//     the softmax statistics (m, l, lse, D) and P, dS are computed in fp32, and P and dS are rounded to bf16
//     (round to nearest even) into tiles of their own as the inputs of the second products (P V, P^T dO,
//     dS^T Q, dS K), as FlashAttention does; out and dinp are rounded to bf16 once, at the store.
// lse and D are float in both. Accumulators are fp32 (products exact, sums rounded in fp32).
// Shared memory (one array per kernel, under the 48 KB a kernel gets without opting in): forward 43 KB,
// dK/dV 35 KB, dQ 35 KB (fp32 build); 40, 37, 37 KB (bf16 build). Block: 128 threads (4 warps).
// Global reads and writes are 16-byte vectors where the arrays are 16-byte aligned (then every row of a head is:
// C % 64 == 0), else single elements (flash_aligned).
// WMMA TF32 and bf16 need sm_80+: on older GPUs the kernels trap (CudaBackend refuses to launch them there).
#include "common.cuh"
#include <mma.h>

#define FLASH_HS 64                    // head size the kernels are written for
#define FLASH_BM 64                    // rows a block owns (queries, or keys in dK/dV): 16 per warp
#define FLASH_WR 16                    // rows per warp
#define FLASH_BN 32                    // rows of the other side per step
#define FLASH_THREADS 128              // 4 warps
#define FLASH_WARPS (FLASH_THREADS / WARP_SIZE)
#define FLASH_LDS (FLASH_BN + 4)       // row stride of a warp's (16 x 32) fp32 score tiles
#define FLASH_LDO (FLASH_HS + 4)       // row stride of a warp's (16 x 64) fp32 tiles (forward's O, result staging)
#define FLASH_NEG_INF __int_as_float(0xff800000)   // -inf (NVRTC has no INFINITY)
#define FLASH_RESCALE_ABOVE 12.0f      // forward: how far (log2 units) a row's max may pass its reference max
#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_LN2 0.6931471805599453f
// Blocks per SM each kernel is built to fit (__launch_bounds__'s second argument, which caps the registers),
// the fastest of 1, 2 and 3 at d12 shapes (-D overrides; the timings are in docs/benchmarks.md); the bf16
// backward stays at 2 because 3 spills dK/dV's registers.
#ifndef FLASH_FWD_MIN_BLOCKS
#if defined(GPT2NP_BF16)
#define FLASH_FWD_MIN_BLOCKS 3
#else
#define FLASH_FWD_MIN_BLOCKS 2
#endif
#endif
#ifndef FLASH_BWD_MIN_BLOCKS
#if defined(GPT2NP_BF16)
#define FLASH_BWD_MIN_BLOCKS 2
#else
#define FLASH_BWD_MIN_BLOCKS 2
#endif
#endif

// The tensor-core input type (flash_in: what the (rows x 64) Q, K, V, dO tiles and the P, dS tiles the second
// products read hold), the WMMA shape's k (FLASH_K) and the row strides of the input tiles: a multiple of 16
// bytes (WMMA's ldm) that skews the banks; P and dS have tiles of their own (FLASH_OWN_P) only in the bf16 build.
// FLASH_VEC: the elements of one 16-byte global load or store.
#if defined(GPT2NP_BF16)
typedef __nv_bfloat16 flash_in;
#define FLASH_FRAG_T __nv_bfloat16
#define FLASH_K 16
#define FLASH_LD (FLASH_HS + 8)        // row stride of the (rows x 64) input tiles
#define FLASH_LDP (FLASH_BN + 8)       // row stride of the (16 x 32) P and dS tiles
#define FLASH_OWN_P 1
#define FLASH_OWN_P_TILES 1            // whether the warps' own P and dS tiles take shared memory
#define FLASH_VEC 8
#else
typedef float flash_in;
#define FLASH_FRAG_T wmma::precision::tf32
#define FLASH_K 8
#define FLASH_LD (FLASH_HS + 4)
#define FLASH_LDP FLASH_LDS            // P and dS overwrite the fp32 scores in place
#define FLASH_OWN_P_TILES 0
#define FLASH_VEC 4
#endif
#define FLASH_KSTEPS (FLASH_HS / FLASH_K)                          // fragments along one 64-channel row
#define FLASH_WS (FLASH_WR * FLASH_LDS)                             // floats of a warp's score tile
#define FLASH_WP (FLASH_WR * FLASH_LDP)                             // flash_in of a warp's own P / dS tile
#define FLASH_STEP_ELEMS (FLASH_BN * FLASH_LD)                      // flash_in of a (32 x 64) input tile
#define FLASH_VECS (FLASH_BN * FLASH_HS / FLASH_VEC / FLASH_THREADS) // 16-byte vectors per thread per tile
// bytes of shared memory -> floats, each region a multiple of 32 bytes (WMMA's pointer alignment)
#define FLASH_FLOATS(bytes) ((((bytes) + 31) / 32) * 8)

// 16 bytes of consecutive elements (floatX in global memory, flash_in in shared memory).
struct __align__(16) flash_vec { floatX e[FLASH_VEC]; };
struct __align__(16) flash_in_vec { flash_in e[FLASH_VEC]; };

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FLASH_WMMA 1
using namespace nvcuda;
typedef wmma::fragment<wmma::matrix_a, 16, 16, FLASH_K, FLASH_FRAG_T, wmma::row_major> FlashARow;
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

// One step's 32 rows of one (batch, part, head) in registers: FLASH_VECS 16-byte vectors per thread, element
// e = threadIdx.x + i * FLASH_THREADS of the (32 x 64 / FLASH_VEC) vectors.
struct FlashRows {
    flash_vec v[FLASH_VECS];
};

// Whether p is 16-byte aligned: then (width and the head offset being multiples of FLASH_VEC elements) every row
// of the head is, and the kernels use 16-byte vectors; else single elements. The model's activations are views
// of one buffer, and an odd L*B*T puts qkv and atty off 16 bytes in the fp32 build.
__device__ __forceinline__ bool flash_aligned(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Reads rows row0 .. row0+31 into registers; rows at or past T are zeros. src points at channel 0 of row 0 of
// this (batch, part, head); rows are `width` elements apart; vec: src is 16-byte aligned (flash_aligned).
__device__ __forceinline__ void flash_fetch(FlashRows& r, const floatX* src, int row0, int T, int width, bool vec) {
#pragma unroll
    for (int i = 0; i < FLASH_VECS; i++) {
        const int e = threadIdx.x + i * FLASH_THREADS;
        const int row = e / (FLASH_HS / FLASH_VEC), c = (e % (FLASH_HS / FLASH_VEC)) * FLASH_VEC;
        const int t = row0 + row;
        if (t < T && vec) {
            r.v[i] = *reinterpret_cast<const flash_vec*>(src + (long long)t * width + c);
        } else if (t < T) {
#pragma unroll
            for (int k = 0; k < FLASH_VEC; k++) r.v[i].e[k] = src[(long long)t * width + c + k];
        } else {
#pragma unroll
            for (int k = 0; k < FLASH_VEC; k++) r.v[i].e[k] = to_floatX(0.0f);
        }
    }
}

// Puts fetched rows into a (32 x 64) shared tile of tensor-core inputs (ld FLASH_LD).
__device__ __forceinline__ void flash_put(flash_in* tile, const FlashRows& r) {
#pragma unroll
    for (int i = 0; i < FLASH_VECS; i++) {
        const int e = threadIdx.x + i * FLASH_THREADS;
        const int row = e / (FLASH_HS / FLASH_VEC), c = (e % (FLASH_HS / FLASH_VEC)) * FLASH_VEC;
        flash_in_vec out;
#pragma unroll
        for (int k = 0; k < FLASH_VEC; k++) out.e[k] = flash_round(to_float(r.v[i].e[k]));
        *reinterpret_cast<flash_in_vec*>(tile + row * FLASH_LD + c) = out;
    }
}

// Rows row0 .. row0+63 (0 past T) into a (64 x 64) shared tile, then warp w's 16 rows of it into fragments
// (a (16 x 64) row-major matrix_a: the warp's rows times the channels). Ends with every thread in step and the
// tile free again.
__device__ __forceinline__ void flash_own_rows(FlashARow* frag, flash_in* tile, const floatX* src, int row0, int T,
                                               int width, int warp) {
    FlashRows r;
    const bool vec = flash_aligned(src);
#pragma unroll
    for (int half = 0; half < FLASH_BM / FLASH_BN; half++) {
        flash_fetch(r, src, row0 + half * FLASH_BN, T, width, vec);
        flash_put(tile + half * FLASH_STEP_ELEMS, r);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < FLASH_KSTEPS; i++) {
        wmma::load_matrix_sync(frag[i], tile + warp * FLASH_WR * FLASH_LD + i * FLASH_K, FLASH_LD);
    }
    __syncthreads();
}

// S (16 x 32, ld FLASH_LDS) = A (16 x 64, the warp's fragments) @ M (32 x 64, a shared step tile)^T.
__device__ __forceinline__ void flash_scores(float* S, const FlashARow* A, const flash_in* M) {
#pragma unroll
    for (int j = 0; j < FLASH_BN / 16; j++) {
        FlashAcc acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int i = 0; i < FLASH_KSTEPS; i++) {
            FlashBCol b;                                // b (k, n) = M[16 j + n][k]: M^T read column-major
            wmma::load_matrix_sync(b, M + j * 16 * FLASH_LD + i * FLASH_K, FLASH_LD);
            wmma::mma_sync(acc, A[i], b, acc);
        }
        wmma::store_matrix_sync(S + j * 16, acc, FLASH_LDS, wmma::mem_row_major);
    }
}

// acc[j] (the 16 x 16 blocks of a 16 x 64 result) += P (16 x 32, ld FLASH_LDP) @ M (32 x 64, a shared step tile).
__device__ __forceinline__ void flash_accumulate(FlashAcc* acc, const flash_in* P, const flash_in* M) {
#pragma unroll 1   // fully unrolled, the fragment loads run ahead and the backward kernels spill registers
    for (int i = 0; i < FLASH_BN / FLASH_K; i++) {
        FlashARow a;
        wmma::load_matrix_sync(a, P + i * FLASH_K, FLASH_LDP);
#pragma unroll
        for (int j = 0; j < FLASH_HS / 16; j++) {
            FlashBRow b;
            wmma::load_matrix_sync(b, M + i * FLASH_K * FLASH_LD + j * 16, FLASH_LD);
            wmma::mma_sync(acc[j], a, b, acc[j]);
        }
    }
}

// The walk over K and V, step kt (rows 32 kt ..): the rows fetched before into the shared tiles Ks, Vs, then the
// next step's rows fetched into kr, vr, to arrive while this step computes. base: this (batch, head)'s inp.
__device__ __forceinline__ void flash_kv_step(flash_in* Ks, flash_in* Vs, FlashRows& kr, FlashRows& vr,
                                              const floatX* base, int kt, int steps, int T, int C, bool vec) {
    __syncthreads();                                    // every warp is done with the last step's K, V
    flash_put(Ks, kr);
    flash_put(Vs, vr);
    __syncthreads();
    if (kt + 1 < steps) {
        flash_fetch(kr, base + C, (kt + 1) * FLASH_BN, T, 3 * C, vec);
        flash_fetch(vr, base + 2 * C, (kt + 1) * FLASH_BN, T, 3 * C, vec);
    }
}

// Writes 32 consecutive values src[0..31] * mul to dst (floatX), rounded once; 16-byte vectors where dst is
// 16-byte aligned.
__device__ __forceinline__ void flash_store32(floatX* dst, const float* src, float mul) {
    if (!flash_aligned(dst)) {
#pragma unroll
        for (int c = 0; c < 32; c++) dst[c] = to_floatX(src[c] * mul);
        return;
    }
#pragma unroll
    for (int c = 0; c < 32; c += FLASH_VEC) {
        flash_vec v;
#pragma unroll
        for (int k = 0; k < FLASH_VEC; k++) v.e[k] = to_floatX(src[c + k] * mul);
        *reinterpret_cast<flash_vec*>(dst + c) = v;
    }
}

// Writes a warp's (16 x 64) result held in four accumulators to rows row0 .. row0+15 of dst (rows `width`
// elements apart; rows at or past T skipped) through stage, the warp's free (16 x FLASH_LDO) fp32 tile. Lane l
// writes half l % 2 of row l / 2.
__device__ __forceinline__ void flash_store_rows(floatX* dst, float* stage, const FlashAcc* acc, int row0, int T,
                                                 int width, int lane) {
#pragma unroll
    for (int j = 0; j < FLASH_HS / 16; j++) {
        wmma::store_matrix_sync(stage + j * 16, acc[j], FLASH_LDO, wmma::mem_row_major);
    }
    __syncwarp();
    const int r = lane / 2, half = lane % 2;
    if (row0 + r < T) {
        flash_store32(dst + (long long)(row0 + r) * width + half * 32, stage + r * FLASH_LDO + half * 32, 1.0f);
    }
}
#endif

// out (B,T,C), lse (B,NH,T) from inp (B,T,3C). Grid (ceil(T/64), B*NH), block FLASH_THREADS.
#define FLASH_FWD_K_BYTES (FLASH_STEP_ELEMS * (int)sizeof(flash_in))
#define FLASH_FWD_FLOATS (2 * FLASH_FLOATS(FLASH_FWD_K_BYTES) + FLASH_WARPS * FLASH_WR * FLASH_LDO \
                          + FLASH_WARPS * FLASH_WS \
                          + FLASH_OWN_P_TILES * FLASH_FLOATS(FLASH_WARPS * FLASH_WP * (int)sizeof(flash_in)))
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, FLASH_FWD_MIN_BLOCKS)
flash_attention_forward(floatX* out, float* lse, const floatX* inp, int B, int T, int NH, float scale) {
#if defined(FLASH_WMMA)
    // shared: K, V of the step | O of each warp (first: the block's Q) | scores of each warp | (bf16) P of each warp
    __shared__ __align__(32) float smem[FLASH_FWD_FLOATS];
    flash_in* const Ks = reinterpret_cast<flash_in*>(smem);
    flash_in* const Vs = reinterpret_cast<flash_in*>(smem + FLASH_FLOATS(FLASH_FWD_K_BYTES));
    float* const Os = smem + 2 * FLASH_FLOATS(FLASH_FWD_K_BYTES);
    float* const Ss = Os + FLASH_WARPS * FLASH_WR * FLASH_LDO;
    const int C = NH * FLASH_HS, C3 = 3 * C;
    const int qb = gridDim.x - 1 - blockIdx.x;          // the longest rows first
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int q0 = qb * FLASH_BM;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const floatX* base = inp + (long long)b * T * C3 + h * FLASH_HS;
    float* const O = Os + warp * FLASH_WR * FLASH_LDO;
    float* const S = Ss + warp * FLASH_WS;
#if defined(FLASH_OWN_P)
    flash_in* const P = reinterpret_cast<flash_in*>(Ss + FLASH_WARPS * FLASH_WS) + warp * FLASH_WP;
#else
    flash_in* const P = S;                              // P (TF32) over the scores
#endif
    FlashARow qf[FLASH_KSTEPS];
    flash_own_rows(qf, reinterpret_cast<flash_in*>(Os), base, q0, T, C3, warp);
    // lane l: row r = l / 2 of the warp's 16 (query q), scores 16 half .. 16 half + 15 of each step, O's
    // channels 32 half .. 32 half + 31 at the end. Scores in log2 units (s = S scale log2(e), so that
    // exp(S scale - x) = exp2(s - x log2(e)): one hardware exp2). m: the row's reference max, l: its running sum
    // of exp2(s - m) (the same in both lanes of the row). O stays in fragments, unnormalized against m.
    const float scale2 = scale * FLASH_LOG2E;
    const int r = lane / 2, half = lane % 2;
    const int w0 = q0 + warp * FLASH_WR, q = w0 + r;
    float m = FLASH_NEG_INF, l = 0.0f;
    FlashAcc o[FLASH_HS / 16];
#pragma unroll
    for (int j = 0; j < FLASH_HS / 16; j++) wmma::fill_fragment(o[j], 0.0f);
    const int steps = (min(q0 + FLASH_BM, T) - 1) / FLASH_BN + 1;      // key steps up to the block's last row
    FlashRows kr, vr;
    const bool vec = flash_aligned(base);              // inp's rows (and so K's and V's) 16-byte aligned
    flash_fetch(kr, base + C, 0, T, C3, vec);
    flash_fetch(vr, base + 2 * C, 0, T, C3, vec);
    for (int kt = 0; kt < steps; kt++) {
        const int k0 = kt * FLASH_BN;
        flash_kv_step(Ks, Vs, kr, vr, base, kt, steps, T, C, vec);
        // key k0 <= the warp's first row (k0 and w0 are multiples of 16) and k0 < T, so every row that gets
        // here has a finite maximum; a warp whose rows all come before k0, or lie past T, skips the step
        if (k0 > w0 + FLASH_WR - 1 || w0 >= T) continue;
        flash_scores(S, qf, Ks);
        __syncwarp();
        float s[16], mx = FLASH_NEG_INF;
#pragma unroll
        for (int c = 0; c < 16; c++) {
            const int key = k0 + half * 16 + c;
            s[c] = (key <= q && key < T) ? S[r * FLASH_LDS + half * 16 + c] * scale2 : FLASH_NEG_INF;
            mx = fmaxf(mx, s[c]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        // Lazy rescaling: the reference max moves only when the row's max passes it by more than
        // FLASH_RESCALE_ABOVE (then O and l are rescaled by alpha = exp2(m_old - m_new), through the warp's shared
        // O tile, where rows are rows); otherwise p = exp2(s - m) <= 2^FLASH_RESCALE_ABOVE, far from fp32's range.
        // The first step sets m without a rescale (O and l are 0). Softmax does not depend on the reference, only
        // the roundings do, by relative amounts, as with the exact max.
        const bool move = mx > m + FLASH_RESCALE_ABOVE;
        if (__any_sync(FULL_MASK, move && m != FLASH_NEG_INF)) {
#pragma unroll
            for (int j = 0; j < FLASH_HS / 16; j++) {
                wmma::store_matrix_sync(O + j * 16, o[j], FLASH_LDO, wmma::mem_row_major);
            }
            __syncwarp();
            const float alpha = move ? exp2f(m - mx) : 1.0f;      // 0 while m = -inf (O is 0 there)
#pragma unroll
            for (int c = 0; c < 32; c++) O[r * FLASH_LDO + half * 32 + c] *= alpha;
            __syncwarp();
#pragma unroll
            for (int j = 0; j < FLASH_HS / 16; j++) {
                wmma::load_matrix_sync(o[j], O + j * 16, FLASH_LDO, wmma::mem_row_major);
            }
            l *= alpha;
        }
        if (move) m = mx;
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < 16; c++) {
            const float p = exp2f(s[c] - m);
            sum += p;
            P[r * FLASH_LDP + half * 16 + c] = flash_round(p);
        }
        l += sum + __shfl_xor_sync(FULL_MASK, sum, 1);
        __syncwarp();
        flash_accumulate(o, P, Vs);                     // O += P V
        __syncwarp();
    }
    if (w0 < T) {
#pragma unroll
        for (int j = 0; j < FLASH_HS / 16; j++) wmma::store_matrix_sync(O + j * 16, o[j], FLASH_LDO, wmma::mem_row_major);
    }
    __syncwarp();
    if (q < T) {
        flash_store32(out + ((long long)b * T + q) * C + h * FLASH_HS + half * 32, O + r * FLASH_LDO + half * 32,
                      1.0f / l);
        if (half == 0) lse[((long long)b * NH + h) * T + q] = m * FLASH_LN2 + logf(l);
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


// The backward kernels' shared memory: the step's two input tiles (32 x 64) | lse log2(e) and D of the step's
// queries (dK/dV) | each warp's two fp32 score tiles, adjacent (16 x 2 FLASH_LDS >= 16 x FLASH_LDO: the result staging)
// | (bf16) each warp's own P and dS tiles. At the start the block's 64 own rows of two inputs are staged through
// it from offset 0.
#define FLASH_BWD_IN_FLOATS FLASH_FLOATS(FLASH_STEP_ELEMS * (int)sizeof(flash_in))
#define FLASH_BWD_FLOATS (2 * FLASH_BWD_IN_FLOATS + 2 * FLASH_BN + FLASH_WARPS * 2 * FLASH_WS \
                          + FLASH_OWN_P_TILES * FLASH_FLOATS(2 * FLASH_WARPS * FLASH_WP * (int)sizeof(flash_in)))

// dK, dV parts of dinp (B,T,3C): one block per (64 keys, batch * head) over the query steps at and after them.
// Grid (ceil(T/64), B*NH), block FLASH_THREADS. D from flash_attention_backward_delta.
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, FLASH_BWD_MIN_BLOCKS)
flash_attention_backward_dkv(floatX* dinp, const floatX* dout, const floatX* inp, const float* lse, const float* D,
                             int B, int T, int NH, float scale) {
#if defined(FLASH_WMMA)
    __shared__ __align__(32) float smem[FLASH_BWD_FLOATS];
    flash_in* const Qs = reinterpret_cast<flash_in*>(smem);
    flash_in* const dOs = reinterpret_cast<flash_in*>(smem + FLASH_BWD_IN_FLOATS);
    float* const lse_s = smem + 2 * FLASH_BWD_IN_FLOATS;
    float* const D_s = lse_s + FLASH_BN;
    const int C = NH * FLASH_HS, C3 = 3 * C;
    const int kb = blockIdx.x;                          // the most query steps first
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int k0 = kb * FLASH_BM;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    float* const ST = D_s + FLASH_BN + warp * 2 * FLASH_WS;           // S^T (16 keys x 32 queries), then P^T
    float* const dPT = ST + FLASH_WS;                                 // dP^T, then dS^T
#if defined(FLASH_OWN_P)
    flash_in* const PT = reinterpret_cast<flash_in*>(D_s + FLASH_BN + FLASH_WARPS * 2 * FLASH_WS) + warp * 2 * FLASH_WP;
    flash_in* const dST = PT + FLASH_WP;
#else
    flash_in* const PT = ST;
    flash_in* const dST = dPT;
#endif
    const floatX* base = inp + (long long)b * T * C3 + h * FLASH_HS;
    const floatX* dbase = dout + (long long)b * T * C + h * FLASH_HS;
    const float* lse_bh = lse + (long long)blockIdx.y * T;
    const float* D_bh = D + (long long)blockIdx.y * T;
    FlashARow kf[FLASH_KSTEPS], vf[FLASH_KSTEPS];
    flash_own_rows(kf, reinterpret_cast<flash_in*>(smem), base + C, k0, T, C3, warp);
    flash_own_rows(vf, reinterpret_cast<flash_in*>(smem), base + 2 * C, k0, T, C3, warp);
    FlashAcc dk[FLASH_HS / 16], dv[FLASH_HS / 16];
#pragma unroll
    for (int j = 0; j < FLASH_HS / 16; j++) {
        wmma::fill_fragment(dk[j], 0.0f);
        wmma::fill_fragment(dv[j], 0.0f);
    }
    // lane l: key row r = l / 2 of the warp's 16 (key w0 + r), queries 16 half .. 16 half + 15 of each step
    const int r = lane / 2, half = lane % 2;
    const int w0 = k0 + warp * FLASH_WR, key = w0 + r;
    const int first = k0 / FLASH_BN, steps = (T + FLASH_BN - 1) / FLASH_BN;
    FlashRows qr, dor;
    // thread t < 32: lse log2(e) of query t of the step (so that exp(S scale - lse) = exp2(S scale2 - that));
    // 32..63: D of query t - 32
    const float scale2 = scale * FLASH_LOG2E;
    float lse_r = 0.0f;
    const bool vec = flash_aligned(inp) && flash_aligned(dout);      // all rows of Q and dO 16-byte aligned
    flash_fetch(qr, base, first * FLASH_BN, T, C3, vec);
    flash_fetch(dor, dbase, first * FLASH_BN, T, C, vec);
    if (threadIdx.x < 2 * FLASH_BN) {
        const int t = first * FLASH_BN + threadIdx.x % FLASH_BN;
        lse_r = t < T ? (threadIdx.x < FLASH_BN ? lse_bh[t] * FLASH_LOG2E : D_bh[t]) : 0.0f;
    }
    for (int qt = first; qt < steps; qt++) {
        const int q0 = qt * FLASH_BN;
        __syncthreads();
        flash_put(Qs, qr);
        flash_put(dOs, dor);
        if (threadIdx.x < 2 * FLASH_BN) lse_s[threadIdx.x] = lse_r;    // lse_s then D_s
        __syncthreads();
        if (qt + 1 < steps) {
            flash_fetch(qr, base, q0 + FLASH_BN, T, C3, vec);
            flash_fetch(dor, dbase, q0 + FLASH_BN, T, C, vec);
            if (threadIdx.x < 2 * FLASH_BN) {
                const int t = q0 + FLASH_BN + threadIdx.x % FLASH_BN;
                lse_r = t < T ? (threadIdx.x < FLASH_BN ? lse_bh[t] * FLASH_LOG2E : D_bh[t]) : 0.0f;
            }
        }
        // every query of the step before the warp's first key, or the warp's keys all past T: nothing to add
        if (q0 + FLASH_BN - 1 < w0 || w0 >= T) continue;
        flash_scores(ST, kf, Qs);                       // S^T = K Q^T
        flash_scores(dPT, vf, dOs);                     // dP^T = V dO^T
        __syncwarp();
#pragma unroll
        for (int c = 0; c < 16; c++) {
            const int j = half * 16 + c, qq = q0 + j;
            const float p = (key <= qq && qq < T) ? exp2f(ST[r * FLASH_LDS + j] * scale2 - lse_s[j]) : 0.0f;
            const float ds = p * (dPT[r * FLASH_LDS + j] - D_s[j]) * scale;
            PT[r * FLASH_LDP + j] = flash_round(p);
            dST[r * FLASH_LDP + j] = flash_round(ds);
        }
        __syncwarp();
        flash_accumulate(dv, PT, dOs);                  // dV += P^T dO
        flash_accumulate(dk, dST, Qs);                  // dK += dS^T Q
        __syncwarp();
    }
    floatX* dst = dinp + (long long)b * T * C3 + h * FLASH_HS;
    flash_store_rows(dst + C, ST, dk, w0, T, C3, lane);
    __syncwarp();
    flash_store_rows(dst + 2 * C, ST, dv, w0, T, C3, lane);
#else
    __trap();
#endif
}

// dQ part of dinp (B,T,3C): one block per (64 queries, batch * head) over the key steps up to them.
// Grid (ceil(T/64), B*NH), block FLASH_THREADS.
extern "C" __global__ void __launch_bounds__(FLASH_THREADS, FLASH_BWD_MIN_BLOCKS)
flash_attention_backward_dq(floatX* dinp, const floatX* dout, const floatX* inp, const float* lse, const float* D,
                            int B, int T, int NH, float scale) {
#if defined(FLASH_WMMA)
    __shared__ __align__(32) float smem[FLASH_BWD_FLOATS];
    flash_in* const Ks = reinterpret_cast<flash_in*>(smem);
    flash_in* const Vs = reinterpret_cast<flash_in*>(smem + FLASH_BWD_IN_FLOATS);
    const int C = NH * FLASH_HS, C3 = 3 * C;
    const int qb = gridDim.x - 1 - blockIdx.x;          // the most key steps first
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int q0 = qb * FLASH_BM;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    float* const S = smem + 2 * FLASH_BWD_IN_FLOATS + 2 * FLASH_BN + warp * 2 * FLASH_WS;    // S (16 x 32)
    float* const dP = S + FLASH_WS;                                                        // dP, then dS
#if defined(FLASH_OWN_P)
    flash_in* const dS = reinterpret_cast<flash_in*>(smem + 2 * FLASH_BWD_IN_FLOATS + 2 * FLASH_BN
                                                     + FLASH_WARPS * 2 * FLASH_WS) + warp * 2 * FLASH_WP;
#else
    flash_in* const dS = dP;
#endif
    const floatX* base = inp + (long long)b * T * C3 + h * FLASH_HS;
    FlashARow qf[FLASH_KSTEPS], dof[FLASH_KSTEPS];
    flash_own_rows(qf, reinterpret_cast<flash_in*>(smem), base, q0, T, C3, warp);
    flash_own_rows(dof, reinterpret_cast<flash_in*>(smem), dout + (long long)b * T * C + h * FLASH_HS, q0, T, C,
                   warp);
    FlashAcc dq[FLASH_HS / 16];
#pragma unroll
    for (int j = 0; j < FLASH_HS / 16; j++) wmma::fill_fragment(dq[j], 0.0f);
    // lane l: query row r = l / 2 of the warp's 16 (query q), keys 16 half .. 16 half + 15 of each step
    const int r = lane / 2, half = lane % 2;
    const int w0 = q0 + warp * FLASH_WR, q = w0 + r;
    const float scale2 = scale * FLASH_LOG2E;         // exp(S scale - lse) = exp2(S scale2 - lse log2(e))
    const float lse_q = q < T ? lse[(long long)blockIdx.y * T + q] * FLASH_LOG2E : 0.0f;
    const float D_q = q < T ? D[(long long)blockIdx.y * T + q] : 0.0f;
    const int steps = (min(q0 + FLASH_BM, T) - 1) / FLASH_BN + 1;
    FlashRows kr, vr;
    const bool vec = flash_aligned(base);              // inp's rows (and so K's and V's) 16-byte aligned
    flash_fetch(kr, base + C, 0, T, C3, vec);
    flash_fetch(vr, base + 2 * C, 0, T, C3, vec);
    for (int kt = 0; kt < steps; kt++) {
        const int k0 = kt * FLASH_BN;
        flash_kv_step(Ks, Vs, kr, vr, base, kt, steps, T, C, vec);
        if (k0 > w0 + FLASH_WR - 1 || w0 >= T) continue;
        flash_scores(S, qf, Ks);                        // S = Q K^T
        flash_scores(dP, dof, Vs);                      // dP = dO V^T
        __syncwarp();
#pragma unroll
        for (int c = 0; c < 16; c++) {
            const int j = half * 16 + c, key = k0 + j;
            const float p = (key <= q && q < T) ? exp2f(S[r * FLASH_LDS + j] * scale2 - lse_q) : 0.0f;
            dS[r * FLASH_LDP + j] = flash_round(p * (dP[r * FLASH_LDS + j] - D_q) * scale);
        }
        __syncwarp();
        flash_accumulate(dq, dS, Ks);                   // dQ += dS K
        __syncwarp();
    }
    flash_store_rows(dinp + (long long)b * T * C3 + h * FLASH_HS, S, dq, w0, T, C3, lane);
#else
    __trap();
#endif
}
