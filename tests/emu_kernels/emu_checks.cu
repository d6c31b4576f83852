// emu_checks.cu: small kernels that exercise the CUDA emulator (tests/test_emulator.py).
// Plain CUDA: it would compile under NVRTC as well.
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cassert>

namespace cg = cooperative_groups;

typedef float real;   // the signature check must see through typedefs

extern "C" __global__ void vector_add(real* __restrict__ out, const real* __restrict__ a,
                                      const float* __restrict__ b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}

// Every built-in index, for a 3-D grid of 3-D blocks: out[global linear id] = 4 packed fields.
extern "C" __global__ void builtins_3d(int4* out) {
    const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y * blockDim.z;
    out[block * nthreads + thread] =
        make_int4(block, thread, gridDim.x * 100 + gridDim.y * 10 + gridDim.z,
                  blockDim.x * 100 + blockDim.y * 10 + blockDim.z);
}

// Tree reduction of each block's slice in static shared memory (blockDim.x = 256).
extern "C" __global__ void block_sum_static(float* out, const float* x, int n) {
    __shared__ float buf[256];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    buf[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            buf[threadIdx.x] += buf[threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = buf[0];
    }
}

// The same in dynamic shared memory (any power-of-two blockDim.x; shared_mem = 4 * blockDim.x).
extern "C" __global__ void block_sum_dynamic(float* out, const float* x, int n) {
    extern __shared__ __align__(16) float dyn[];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    dyn[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            dyn[threadIdx.x] += dyn[threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = dyn[0];
    }
}

template <int OFFSET_START>
__device__ __forceinline__ float warp_sum_down(float v) {
    for (int offset = OFFSET_START; offset > 0; offset /= 2) {
        v += __shfl_down_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Per warp: out[4*w + 0] xor-butterfly sum (lane 0), [1] shfl_down sum (lane 0),
// [2] value broadcast from lane 5 by __shfl_sync, [3] inclusive shfl_up scan at lane 31.
extern "C" __global__ void warp_shuffles(float* out, const float* x) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    const int w = i / 32;
    float v = x[i];
    float s = v;
    for (int offset = 16; offset > 0; offset >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, offset);
    }
    const float d = warp_sum_down<16>(v);
    const float b = __shfl_sync(0xffffffffu, v, 5);
    float scan = v;
    for (int offset = 1; offset < 32; offset *= 2) {
        const float y = __shfl_up_sync(0xffffffffu, scan, offset);
        if (lane >= offset) scan += y;
    }
    if (lane == 0) {
        out[4 * w + 0] = s;
        out[4 * w + 1] = d;
        out[4 * w + 2] = b;
    }
    if (lane == 31) {
        out[4 * w + 3] = scan;
    }
}

// Segments of 8 lanes (width 8): out[i] = sum over its segment; src lane 3 of the segment in
// bcast[i].
extern "C" __global__ void shuffle_width8(float* out, float* bcast, const float* x) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int offset = 4; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset, 8);
    }
    out[i] = v;
    bcast[i] = __shfl_sync(0xffffffffu, x[i], 3, 8);
}

// Votes per warp: ballot of (x > 0), any, all.
extern "C" __global__ void warp_votes(unsigned* ballot, int* any, int* all, const float* x) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int w = i / 32;
    const unsigned b = __ballot_sync(0xffffffffu, x[i] > 0.0f);
    const int a = __any_sync(0xffffffffu, x[i] > 0.0f);
    const int l = __all_sync(0xffffffffu, x[i] > 0.0f);
    __syncwarp();
    if (threadIdx.x % 32 == 0) {
        ballot[w] = b;
        any[w] = a;
        all[w] = l;
    }
}

// cooperative_groups: per tile of 32 the sum (cg::plus) and the max (cg::greater); per tile of
// 8 the sum, written by each tile's rank 0 at its meta_group_rank.
extern "C" __global__ void cg_reduce(float* sum32, float* max32, float* sum8, const float* x) {
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
    auto tile8 = cg::tiled_partition<8>(block);
    const int i = blockIdx.x * block.size() + block.thread_rank();
    const float v = x[i];
    const float s = cg::reduce(warp, v, cg::plus<float>());
    const float m = cg::reduce(warp, v, cg::greater<float>());
    const float s8 = cg::reduce(tile8, v, cg::plus<float>());
    block.sync();
    if (warp.thread_rank() == 0) {
        const int w = blockIdx.x * warp.meta_group_size() + warp.meta_group_rank();
        sum32[w] = s;
        max32[w] = m;
    }
    if (tile8.thread_rank() == 0) {
        sum8[blockIdx.x * tile8.meta_group_size() + tile8.meta_group_rank()] = s8;
    }
}

// Atomics: a float sum, an int count of positives, an int max, and a histogram of 4 bins.
extern "C" __global__ void atomics(float* fsum, int* count, int* imax, unsigned* hist,
                                   const float* x, const int* k, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    atomicAdd(fsum, x[i]);
    if (x[i] > 0.0f) atomicAdd(count, 1);
    atomicMax(imax, k[i]);
    atomicAdd(&hist[k[i] & 3], 1u);
}

// __syncthreads_count: how many threads of each block have x > 0.
extern "C" __global__ void sync_count(int* out, const float* x) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int c = __syncthreads_count(x[i] > 0.0f);
    if (threadIdx.x == 0) out[blockIdx.x] = c;
}

// Wrong: threads past n return before the barrier the others wait at.
extern "C" __global__ void partial_barrier(float* out, int n) {
    __shared__ float buf[128];
    const int i = threadIdx.x;
    if (i >= n) return;
    buf[i] = (float)i;
    __syncthreads();
    out[i] = buf[(i + 1) % n];
}

// Wrong: half of each warp skips the shuffle that names all 32 lanes.
extern "C" __global__ void partial_shuffle(float* out) {
    float v = 1.0f;
    if (threadIdx.x % 32 < 16) {
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    }
    out[threadIdx.x] = v;
}

// Wrong: reads the neighbour's shared slot without a barrier in between.
extern "C" __global__ void racy_neighbour(float* out) {
    __shared__ float buf[64];
    buf[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

// Reads shared memory (static and dynamic) before anything writes it, then writes it, so a
// second block would see the first one's values if shared memory were not refilled.
extern "C" __global__ void read_before_write(float* stat, int* dyn_bits) {
    __shared__ float s[32];
    extern __shared__ int d[];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    stat[i] = s[threadIdx.x];
    dyn_bits[i] = d[threadIdx.x];
    __syncthreads();
    s[threadIdx.x] = 1.0f;
    d[threadIdx.x] = 7;
}

// A scalar of every supported kind, echoed back.
extern "C" __global__ void scalars(double* out, int a, unsigned int b, float c, double d,
                                   long long e, bool f) {
    out[0] = a; out[1] = b; out[2] = c; out[3] = d; out[4] = (double)e; out[5] = f;
}

// float4 loads: out[i] = x.x + x.y + x.z + x.w of vector i.
extern "C" __global__ void float4_sum(float* out, const float4* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float4 v = __ldg(&x[i]);
        out[i] = v.x + v.y + v.z + v.w;
    }
}

// Faults: a bad pointer dereference and a failing assert become launch errors.
extern "C" __global__ void bad_pointer(float* out, long long address) {
    out[threadIdx.x] = *(const float*)address;
}

extern "C" __global__ void failing_assert(int limit) {
    assert(threadIdx.x < limit);
}

// Guard pages: thread 0 reads/writes element `index` of a device buffer (out of bounds on purpose).
extern "C" __global__ void oob_write(float* out, int index) {
    if (threadIdx.x == 0) out[index] = 1.0f;
}

extern "C" __global__ void oob_read(float* out, const float* in, int index) {
    if (threadIdx.x == 0) out[0] = in[index];
}

// Thread i copies vector i of n float4s; the last thread one vector too far when `extra` is 1.
extern "C" __global__ void float4_copy(float4* out, const float4* in, int n, int extra) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n + extra) out[i] = in[i];
}

// Fast-math intrinsics against the host library: out[0..5].
extern "C" __global__ void intrinsics(float* out, float x) {
    out[0] = __expf(x);
    out[1] = __logf(x);
    out[2] = rsqrtf(x);
    out[3] = __fdividef(1.0f, x);
    out[4] = tanhf(x);
    out[5] = fmaxf(x, 2.0f) + (float)max(3, 4) + (float)min(1u, 2u);
}
