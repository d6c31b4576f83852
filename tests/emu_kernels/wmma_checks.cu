// WMMA (nvcuda::wmma, TF32 m16n16k8) on the emulator: kernels for tests/test_emu_wmma.py.
#include <mma.h>
using namespace nvcuda;

typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> FragARow;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major> FragACol;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> FragBRow;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> FragBCol;
typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> FragC;

template <class A, class B>
__device__ void gemm_tile(float* c, const float* a, const float* b, int lda, int ldb, int c_col_major, int round) {
    A fa;
    B fb;
    FragC fc;
    wmma::load_matrix_sync(fa, a, lda);
    wmma::load_matrix_sync(fb, b, ldb);
    if (round) {
        for (int i = 0; i < fa.num_elements; i++) fa.x[i] = wmma::__float_to_tf32(fa.x[i]);
        for (int i = 0; i < fb.num_elements; i++) fb.x[i] = wmma::__float_to_tf32(fb.x[i]);
    }
    const wmma::layout_t lc = c_col_major ? wmma::mem_col_major : wmma::mem_row_major;
    wmma::load_matrix_sync(fc, c, 16, lc);
    wmma::mma_sync(fc, fa, fb, fc);
    wmma::store_matrix_sync(c, fc, 16, lc);
}

// c (16x16) += a (16x8) @ b (8x16); a stored row-major (ld 8) or column-major (ld 16), likewise b
// (ld 16 / 8) and c. round: __float_to_tf32 on every loaded element of a and b first.
extern "C" __global__ void wmma_gemm_tile(float* c, const float* a, const float* b, int a_col_major,
                                          int b_col_major, int c_col_major, int round) {
    if (a_col_major && b_col_major) gemm_tile<FragACol, FragBCol>(c, a, b, 16, 8, c_col_major, round);
    else if (a_col_major) gemm_tile<FragACol, FragBRow>(c, a, b, 16, 16, c_col_major, round);
    else if (b_col_major) gemm_tile<FragARow, FragBCol>(c, a, b, 8, 8, c_col_major, round);
    else gemm_tile<FragARow, FragBRow>(c, a, b, 8, 16, c_col_major, round);
}

// A (m,k) @ B (k,n) row-major with m, n multiples of 16 and k of 8: one warp per 16x16 tile of c
// (warps of the block along n, blocks along m), fill_fragment then k/8 mma_sync steps.
extern "C" __global__ void wmma_gemm(float* c, const float* a, const float* b, int m, int n, int k) {
    const int warp = threadIdx.x / 32;
    const int row = blockIdx.x * 16, col = warp * 16;
    if (col >= n) return;                               // whole warps only
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < k; kk += 8) {
        FragARow fa;
        FragBRow fb;
        wmma::load_matrix_sync(fa, a + row * k + kk, k);
        wmma::load_matrix_sync(fb, b + kk * n + col, n);
        for (int i = 0; i < fa.num_elements; i++) fa.x[i] = wmma::__float_to_tf32(fa.x[i]);
        for (int i = 0; i < fb.num_elements; i++) fb.x[i] = wmma::__float_to_tf32(fb.x[i]);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + row * n + col, acc, n, wmma::mem_row_major);
}

// out[i] = __float_to_tf32(in[i]).
extern "C" __global__ void tf32_round(float* out, const float* in, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = wmma::__float_to_tf32(in[i]);
}

// Layout-independent: every element scaled alike (what a kernel may do with x[]).
extern "C" __global__ void wmma_scale(float* out, const float* in, float s) {
    FragC f;
    wmma::load_matrix_sync(f, in, 16, wmma::mem_row_major);
    for (int i = 0; i < f.num_elements; i++) f.x[i] *= s;
    wmma::store_matrix_sync(out, f, 16, wmma::mem_row_major);
}

// Deliberately layout-dependent: scales x[i] by i + 1 and lane by lane, as if element i of lane l
// were a known row and column. Right for one GPU's layout at best; the emulator's layouts catch it.
extern "C" __global__ void wmma_layout_dependent(float* out, const float* in) {
    FragC f;
    wmma::load_matrix_sync(f, in, 16, wmma::mem_row_major);
    for (int i = 0; i < f.num_elements; i++) f.x[i] *= (float)(i + 1) + (float)(threadIdx.x % 32);
    wmma::store_matrix_sync(out, f, 16, wmma::mem_row_major);
}

// Errors: lanes passing different pointers; an unaligned pointer; a partial warp (blockDim 16).
extern "C" __global__ void wmma_divergent_pointer(float* out, const float* in) {
    FragC f;
    wmma::load_matrix_sync(f, in + (threadIdx.x == 3 ? 16 : 0), 16, wmma::mem_row_major);
    wmma::store_matrix_sync(out, f, 16, wmma::mem_row_major);
}

extern "C" __global__ void wmma_unaligned(float* out, const float* in) {
    FragC f;
    wmma::load_matrix_sync(f, in + 1, 16, wmma::mem_row_major);
    wmma::store_matrix_sync(out, f, 16, wmma::mem_row_major);
}

extern "C" __global__ void wmma_partial_warp(float* out, const float* in) {
    FragC f;
    wmma::load_matrix_sync(f, in, 16, wmma::mem_row_major);
    wmma::store_matrix_sync(out, f, 16, wmma::mem_row_major);
}

// Half the warp returns before the collective: the other lanes wait forever (a deadlock report).
extern "C" __global__ void wmma_diverged(float* out, const float* in) {
    if (threadIdx.x % 32 >= 16) return;
    FragC f;
    wmma::load_matrix_sync(f, in, 16, wmma::mem_row_major);
    wmma::store_matrix_sync(out, f, 16, wmma::mem_row_major);
}
