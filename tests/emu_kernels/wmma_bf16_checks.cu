// WMMA with bf16 inputs (nvcuda::wmma m16n16k16, __nv_bfloat16 fragments, float accumulators) on the emulator:
// kernels for tests/test_emu_wmma_bf16.py.
#include <cuda_bf16.h>
#include <mma.h>
using namespace nvcuda;

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> FragARow;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> FragACol;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> FragBRow;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> FragBCol;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// c (m,n) row-major (+)= A (m,k) @ B (k,n); m, n, k multiples of 16. A is stored row-major (ld k) or column-major
// (ld m), B row-major (ld n) or column-major (ld k). One warp per 16x16 tile of c: warps of the block along n,
// blocks along m. accumulate: start from c (load_matrix_sync of the accumulator), else from fill_fragment 0.
template <class FA, class FB>
__device__ void gemm(float* c, const __nv_bfloat16* a, const __nv_bfloat16* b, int m, int n, int k, int accumulate) {
    const int warp = threadIdx.x / 32;
    const int row = blockIdx.x * 16, col = warp * 16;
    if (col >= n) return;                               // whole warps only
    const bool a_col = std::is_same<FA, FragACol>::value, b_col = std::is_same<FB, FragBCol>::value;
    FragC acc;
    if (accumulate) wmma::load_matrix_sync(acc, c + row * n + col, n, wmma::mem_row_major);
    else wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < k; kk += 16) {
        FA fa;
        FB fb;
        wmma::load_matrix_sync(fa, a_col ? a + kk * m + row : a + row * k + kk, a_col ? m : k);
        wmma::load_matrix_sync(fb, b_col ? b + col * k + kk : b + kk * n + col, b_col ? k : n);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + row * n + col, acc, n, wmma::mem_row_major);
}

extern "C" __global__ void wmma_bf16_gemm(float* c, const __nv_bfloat16* a, const __nv_bfloat16* b, int m, int n,
                                         int k, int a_col_major, int b_col_major, int accumulate) {
    if (a_col_major && b_col_major) gemm<FragACol, FragBCol>(c, a, b, m, n, k, accumulate);
    else if (a_col_major) gemm<FragACol, FragBRow>(c, a, b, m, n, k, accumulate);
    else if (b_col_major) gemm<FragARow, FragBCol>(c, a, b, m, n, k, accumulate);
    else gemm<FragARow, FragBRow>(c, a, b, m, n, k, accumulate);
}

// c (16x16, stored column-major) = fill(a, value) @ B (16x16 row-major): every row of c is value * colsum(B).
extern "C" __global__ void wmma_bf16_fill(float* c, const __nv_bfloat16* b, float value) {
    FragARow fa;
    FragBRow fb;
    FragC acc;
    wmma::fill_fragment(fa, __float2bfloat16_rn(value));
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_col_major);
}

// Deliberately layout-dependent: scales element i of each lane's a fragment by i + 1 before c = a @ I.
extern "C" __global__ void wmma_bf16_layout_dependent(float* c, const __nv_bfloat16* a, const __nv_bfloat16* eye) {
    FragARow fa;
    FragBRow fb;
    FragC acc;
    wmma::load_matrix_sync(fa, a, 16);
    for (int i = 0; i < fa.num_elements; i++) fa.x[i] = __float2bfloat16_rn(__bfloat162float(fa.x[i]) * (i + 1));
    wmma::load_matrix_sync(fb, eye, 16);
    wmma::fill_fragment(acc, 0.0f);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

// The number of elements per lane of each fragment (CUDA's: 8, 8, 8).
extern "C" __global__ void wmma_bf16_counts(int* out) {
    if (threadIdx.x == 0) {
        out[0] = FragARow::num_elements;
        out[1] = FragBCol::num_elements;
        out[2] = FragC::num_elements;
        out[3] = (int)sizeof(FragARow().x[0]);
    }
}

// Errors: an ldm of 4 bf16 elements (8 bytes; must be a multiple of 16 bytes); an unaligned pointer.
extern "C" __global__ void wmma_bf16_bad_ldm(float* c, const __nv_bfloat16* a) {
    FragARow fa;
    wmma::load_matrix_sync(fa, a, 4);
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

extern "C" __global__ void wmma_bf16_unaligned(float* c, const __nv_bfloat16* a) {
    FragBRow fb;
    wmma::load_matrix_sync(fb, a + 8, 16);
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}
