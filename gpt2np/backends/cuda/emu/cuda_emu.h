// cuda_emu.h: the CUDA shim of gpt2np's CPU emulator. g++ compiles the same kernels/*.cu files
// that NVRTC compiles for the GPU, with this header force-included (-include cuda_emu.h) and
// gpt2np/cuda/emu/include first on the include path. gpt2np/cuda/emulator.py drives it.
//
// Supported subset (anything else fails to compile, or is listed under "not emulated"):
//   qualifiers   __global__ __device__ __host__ __forceinline__ __noinline__ __restrict__
//                __launch_bounds__(...) __align__(n) __constant__ (a plain global) __grid_constant__
//   built-ins    threadIdx blockIdx blockDim gridDim (uint3/dim3) warpSize (32)
//   shared mem   static __shared__ (any scope, any type) and `extern __shared__ T name[];`
//                (dynamic; launch shared_mem bytes, at most 227 KiB). All of it is filled with
//                0xFF bytes (a quiet NaN as float, -1 as int) at the start of every block.
//   barriers     __syncthreads __syncthreads_count/_and/_or __syncwarp(mask)
//                __threadfence(_block/_system) (no-ops: blocks run one at a time)
//   warp         __shfl_sync __shfl_up_sync __shfl_down_sync __shfl_xor_sync (any arithmetic
//                type, optional width) __all_sync __any_sync __ballot_sync __activemask
//                __reduce_{add,min,max,and,or,xor}_sync __match_any_sync __match_all_sync
//                Every lane named in the mask (that exists in the block) must reach the same
//                collective with the same mask; otherwise the launch fails with an error.
//                Reading a lane that does not take part gives 0xFF bytes.
//   atomics      atomicAdd (int, unsigned, unsigned long long, float, double), atomicSub,
//                atomicExch, atomicMin/Max (int, unsigned, long long, unsigned long long),
//                atomicInc/Dec, atomicCAS (incl. unsigned short), atomicAnd/Or/Xor; _block and
//                _system variants. Implemented with std::atomic_ref (C++20).
//   vectors      char/uchar/short/ushort/int/uint/long/ulong/longlong/ulonglong/float/double
//                1..4 with CUDA's alignment, make_<type><n>(), dim3. No operators (as in CUDA).
//   math         the C math library (expf, logf, tanhf, fmaxf, erff, ...; float overloads of
//                exp, sqrt, ...), rsqrtf, __expf __logf __log2f __log10f __exp10f __powf __sinf
//                __cosf __tanf __sincosf __fdividef fdividef __frcp_rn __fsqrt_r* __frsqrt_rn
//                __f{add,sub,mul,div}_r* __fmaf_r* __saturatef, min/max overloads, umin umax,
//                conversions __float2int_r* __float2uint_r* __int2float_rn __float_as_int
//                __int_as_float __float_as_uint __uint_as_float __double_as_longlong
//                __longlong_as_double, bit ops __popc __popcll __clz __clzll __ffs __ffsll __brev
//                __brevll __byte_perm __mul24 __umul24 __mulhi __umulhi __mul64hi __umul64hi.
//                Fast-math intrinsics are computed exactly (the GPU approximates).
//   loads/stores __ldg __ldca __ldcg __ldcs __ldlu __ldcv, __stwb __stcg __stcs __stwt
//   misc         printf, assert (a failure is a launch error, not an abort), __trap,
//                __nanosleep, clock64 (a counter), <cooperative_groups.h>.
//   cooperative_groups (include/cooperative_groups.h): thread_block (this_thread_block, sync,
//                thread_rank, size, num_threads, group_index, thread_index, group_dim,
//                dim_threads), thread_block_tile<N> for N = 1,2,4,...,32 (tiled_partition<N>,
//                sync, thread_rank, meta_group_rank, meta_group_size, size, num_threads, shfl,
//                shfl_xor, shfl_down, shfl_up, any, all, ballot), cg::sync(g), cg::reduce with
//                cg::plus/less/greater/bit_and/bit_or/bit_xor, cg::inclusive_scan and
//                cg::exclusive_scan (cooperative_groups/scan.h).
//   bf16         (include/cuda_bf16.h) __nv_bfloat16 as storage, __float2bfloat16_rn, __bfloat162float.
//   not emulated half (cuda_fp16.h), bf16 arithmetic, textures, grid sync (this_grid),
//                memcpy_async, inline PTX, __CUDA_ARCH__ (left undefined), dynamic parallelism.
//                GPT2NP_CUDA_EMULATOR is defined to 1.
// Semantics: blocks run one after another (last to first under the "reverse" schedule); the
// threads of a block are fibers that switch only at barriers and warp collectives, so a kernel
// that reads another thread's shared or global write without a barrier sees a schedule-dependent
// value (run both schedules to catch such races). Every thread of a block must reach every
// __syncthreads, including threads that would otherwise return early. Fibers are never
// preempted: a thread spinning on a value that another thread or block writes hangs.
#pragma once
#define GPT2NP_CUDA_EMULATOR 1

#include <assert.h>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <type_traits>

// ---------------------------------------------------------------- vector types -------------
#define EMU_VEC1(T, N) struct alignas(sizeof(T)) N##1 { T x; };
#define EMU_VEC2(T, N, A) struct alignas(A) N##2 { T x, y; };
#define EMU_VEC3(T, N) struct N##3 { T x, y, z; };
#define EMU_VEC4(T, N, A) struct alignas(A) N##4 { T x, y, z, w; };
#define EMU_MAKE(T, N)                                                                         \
    inline N##1 make_##N##1(T x) { return N##1{x}; }                                           \
    inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }                                   \
    inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }                           \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
#define EMU_VECS(T, N, A2, A4) EMU_VEC1(T, N) EMU_VEC2(T, N, A2) EMU_VEC3(T, N) EMU_VEC4(T, N, A4) EMU_MAKE(T, N)
EMU_VECS(signed char, char, 2, 4)
EMU_VECS(unsigned char, uchar, 2, 4)
EMU_VECS(short, short, 4, 8)
EMU_VECS(unsigned short, ushort, 4, 8)
EMU_VECS(int, int, 8, 16)
EMU_VECS(unsigned int, uint, 8, 16)
EMU_VECS(long, long, 16, 16)
EMU_VECS(unsigned long, ulong, 16, 16)
EMU_VECS(long long, longlong, 16, 16)
EMU_VECS(unsigned long long, ulonglong, 16, 16)
EMU_VECS(float, float, 8, 16)
EMU_VECS(double, double, 16, 16)

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ---------------------------------------------------------------- built-in variables -------
// Plain globals: the scheduler sets threadIdx whenever it switches fibers, blockIdx per block.
uint3 threadIdx;
uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;
constexpr int warpSize = 32;

#include "emu_runtime.h"

namespace __emu {
#define EMU_VECINFO(T, N)                                                                      \
    template <> struct vec_info<N##1> { enum { n = 1 }; using elem = T; };         \
    template <> struct vec_info<N##2> { enum { n = 2 }; using elem = T; };         \
    template <> struct vec_info<N##3> { enum { n = 3 }; using elem = T; };         \
    template <> struct vec_info<N##4> { enum { n = 4 }; using elem = T; };
EMU_VECINFO(signed char, char) EMU_VECINFO(unsigned char, uchar) EMU_VECINFO(short, short)
EMU_VECINFO(unsigned short, ushort) EMU_VECINFO(int, int) EMU_VECINFO(unsigned int, uint)
EMU_VECINFO(long, long) EMU_VECINFO(unsigned long, ulong) EMU_VECINFO(long long, longlong)
EMU_VECINFO(unsigned long long, ulonglong) EMU_VECINFO(float, float) EMU_VECINFO(double, double)
#undef EMU_VECINFO
}  // namespace __emu

// ---------------------------------------------------------------- qualifiers ---------------
// __global__ and __shared__ are rewritten by emulator.py after preprocessing (static shared
// variables go to the "emu_shared" section that is NaN-filled per block; extern ones point
// into the dynamic shared buffer), so they are deliberately not macros here.
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
#define __managed__
#define __grid_constant__
#define __cudart_builtin__

// ---------------------------------------------------------------- barriers -----------------
inline void __syncthreads() { __emu::block_barrier(__emu::BAR_SYNC, 0); }
inline int __syncthreads_count(int pred) { return __emu::block_barrier(__emu::BAR_COUNT, pred); }
inline int __syncthreads_and(int pred) { return __emu::block_barrier(__emu::BAR_AND, pred); }
inline int __syncthreads_or(int pred) { return __emu::block_barrier(__emu::BAR_OR, pred); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { __emu::fail("__trap() called"); }
[[noreturn]] inline void __brkpt() { __emu::fail("__brkpt() called"); }
inline void __nanosleep(unsigned) {}
inline long long clock64() { static long long t = 0; return t += 1000; }

// ---------------------------------------------------------------- warp collectives ---------
namespace __emu {
template <class T>
inline T shfl(uint8_t kind, unsigned mask, T var, int arg, int width) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= kValueBytes,
                  "warp shuffles move trivially copyable values of at most 16 bytes");
    warp_collective(kind, mask, &var, sizeof(T), arg, width);
    T r;
    memcpy(&r, g_cur->out, sizeof(T));
    return r;
}
inline unsigned vote(uint8_t kind, unsigned mask, int pred) {
    int dummy = 0;
    warp_collective(kind, mask, &dummy, 4, pred != 0, 32);
    unsigned r;
    memcpy(&r, g_cur->out, 4);
    return r;
}
template <class T>
inline unsigned reduce32(uint8_t kind, unsigned mask, T v) {
    warp_collective(kind, mask, &v, 4, 0, 32);
    unsigned r;
    memcpy(&r, g_cur->out, 4);
    return r;
}
}  // namespace __emu

template <class T> inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {
    static_assert(std::is_arithmetic_v<T>, "__shfl_sync: arithmetic types only");
    return __emu::shfl(__emu::OP_SHFL_IDX, mask, var, srcLane, width);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    static_assert(std::is_arithmetic_v<T>, "__shfl_up_sync: arithmetic types only");
    return __emu::shfl(__emu::OP_SHFL_UP, mask, var, (int)delta, width);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    static_assert(std::is_arithmetic_v<T>, "__shfl_down_sync: arithmetic types only");
    return __emu::shfl(__emu::OP_SHFL_DOWN, mask, var, (int)delta, width);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {
    static_assert(std::is_arithmetic_v<T>, "__shfl_xor_sync: arithmetic types only");
    return __emu::shfl(__emu::OP_SHFL_XOR, mask, var, laneMask, width);
}
inline int __all_sync(unsigned mask, int pred) { return (int)__emu::vote(__emu::OP_ALL, mask, pred); }
inline int __any_sync(unsigned mask, int pred) { return (int)__emu::vote(__emu::OP_ANY, mask, pred); }
inline unsigned __ballot_sync(unsigned mask, int pred) { return __emu::vote(__emu::OP_BALLOT, mask, pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { __emu::vote(__emu::OP_SYNCWARP, mask, 0); }
// The lanes of the caller's warp that have not returned (fibers have no divergence to track).
inline unsigned __activemask() {
    const __emu::Fiber* base = __emu::g_fibers + (__emu::g_cur->linear & ~31u);
    const unsigned exist = __emu::g_warps[__emu::g_cur->linear >> 5].exist;
    unsigned m = 0;
    for (unsigned l = 0; l < 32; l++)
        if ((exist >> l & 1u) && base[l].state != __emu::EXITED) m |= 1u << l;
    return m;
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) { return __emu::reduce32(__emu::OP_REDUCE_ADD_U, mask, v); }
inline int __reduce_add_sync(unsigned mask, int v) { return (int)__emu::reduce32(__emu::OP_REDUCE_ADD_I, mask, v); }
inline unsigned __reduce_min_sync(unsigned mask, unsigned v) { return __emu::reduce32(__emu::OP_REDUCE_MIN_U, mask, v); }
inline int __reduce_min_sync(unsigned mask, int v) { return (int)__emu::reduce32(__emu::OP_REDUCE_MIN_I, mask, v); }
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) { return __emu::reduce32(__emu::OP_REDUCE_MAX_U, mask, v); }
inline int __reduce_max_sync(unsigned mask, int v) { return (int)__emu::reduce32(__emu::OP_REDUCE_MAX_I, mask, v); }
inline unsigned __reduce_and_sync(unsigned mask, unsigned v) { return __emu::reduce32(__emu::OP_REDUCE_AND, mask, v); }
inline unsigned __reduce_or_sync(unsigned mask, unsigned v) { return __emu::reduce32(__emu::OP_REDUCE_OR, mask, v); }
inline unsigned __reduce_xor_sync(unsigned mask, unsigned v) { return __emu::reduce32(__emu::OP_REDUCE_XOR, mask, v); }
template <class T> inline unsigned __match_any_sync(unsigned mask, T value) {
    static_assert(std::is_arithmetic_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "__match_any_sync: 32/64-bit values");
    __emu::warp_collective(__emu::OP_MATCH_ANY, mask, &value, sizeof(T), 0, 32);
    unsigned r;
    memcpy(&r, __emu::g_cur->out, 4);
    return r;
}
template <class T> inline unsigned __match_all_sync(unsigned mask, T value, int* pred) {
    static_assert(std::is_arithmetic_v<T> && (sizeof(T) == 4 || sizeof(T) == 8), "__match_all_sync: 32/64-bit values");
    __emu::warp_collective(__emu::OP_MATCH_ALL, mask, &value, sizeof(T), 0, 32);
    unsigned r;
    memcpy(&r, __emu::g_cur->out, 4);
    *pred = __emu::g_cur->arg;
    return r;
}

// ---------------------------------------------------------------- atomics ------------------
namespace __emu {
template <class T> inline std::atomic_ref<T> aref(T* p) { return std::atomic_ref<T>(*p); }
template <class T, class F> inline T atomic_update(T* p, F f) {
    auto a = aref(p);
    T old = a.load(std::memory_order_relaxed);
    while (!a.compare_exchange_weak(old, f(old), std::memory_order_relaxed)) {}
    return old;
}
}  // namespace __emu
#define EMU_ATOMIC_SCOPES(RET, NAME, PARAMS, ARGS)                                             \
    inline RET NAME##_block PARAMS { return NAME ARGS; }                                       \
    inline RET NAME##_system PARAMS { return NAME ARGS; }
#define EMU_ATOMIC_ADD(T)                                                                      \
    inline T atomicAdd(T* p, T v) { return __emu::aref(p).fetch_add(v, std::memory_order_relaxed); } \
    EMU_ATOMIC_SCOPES(T, atomicAdd, (T* p, T v), (p, v))
EMU_ATOMIC_ADD(int) EMU_ATOMIC_ADD(unsigned int) EMU_ATOMIC_ADD(unsigned long long)
EMU_ATOMIC_ADD(float) EMU_ATOMIC_ADD(double)
#define EMU_ATOMIC_SUB(T)                                                                      \
    inline T atomicSub(T* p, T v) { return __emu::aref(p).fetch_sub(v, std::memory_order_relaxed); } \
    EMU_ATOMIC_SCOPES(T, atomicSub, (T* p, T v), (p, v))
EMU_ATOMIC_SUB(int) EMU_ATOMIC_SUB(unsigned int)
#define EMU_ATOMIC_EXCH(T)                                                                     \
    inline T atomicExch(T* p, T v) { return __emu::aref(p).exchange(v, std::memory_order_relaxed); } \
    EMU_ATOMIC_SCOPES(T, atomicExch, (T* p, T v), (p, v))
EMU_ATOMIC_EXCH(int) EMU_ATOMIC_EXCH(unsigned int) EMU_ATOMIC_EXCH(unsigned long long) EMU_ATOMIC_EXCH(float)
#define EMU_ATOMIC_MINMAX(T)                                                                   \
    inline T atomicMin(T* p, T v) { return __emu::atomic_update(p, [v](T o) { return v < o ? v : o; }); } \
    inline T atomicMax(T* p, T v) { return __emu::atomic_update(p, [v](T o) { return v > o ? v : o; }); } \
    EMU_ATOMIC_SCOPES(T, atomicMin, (T* p, T v), (p, v))                                       \
    EMU_ATOMIC_SCOPES(T, atomicMax, (T* p, T v), (p, v))
EMU_ATOMIC_MINMAX(int) EMU_ATOMIC_MINMAX(unsigned int) EMU_ATOMIC_MINMAX(long long)
EMU_ATOMIC_MINMAX(unsigned long long)
#define EMU_ATOMIC_BITS(T)                                                                     \
    inline T atomicAnd(T* p, T v) { return __emu::aref(p).fetch_and(v, std::memory_order_relaxed); } \
    inline T atomicOr(T* p, T v) { return __emu::aref(p).fetch_or(v, std::memory_order_relaxed); }   \
    inline T atomicXor(T* p, T v) { return __emu::aref(p).fetch_xor(v, std::memory_order_relaxed); } \
    EMU_ATOMIC_SCOPES(T, atomicAnd, (T* p, T v), (p, v))                                       \
    EMU_ATOMIC_SCOPES(T, atomicOr, (T* p, T v), (p, v))                                        \
    EMU_ATOMIC_SCOPES(T, atomicXor, (T* p, T v), (p, v))
EMU_ATOMIC_BITS(int) EMU_ATOMIC_BITS(unsigned int) EMU_ATOMIC_BITS(unsigned long long)
#define EMU_ATOMIC_CAS(T)                                                                      \
    inline T atomicCAS(T* p, T cmp, T v) {                                                     \
        __emu::aref(p).compare_exchange_strong(cmp, v, std::memory_order_relaxed);             \
        return cmp;                                                                            \
    }                                                                                          \
    EMU_ATOMIC_SCOPES(T, atomicCAS, (T* p, T c, T v), (p, c, v))
EMU_ATOMIC_CAS(int) EMU_ATOMIC_CAS(unsigned int) EMU_ATOMIC_CAS(unsigned long long)
EMU_ATOMIC_CAS(unsigned short)
inline unsigned atomicInc(unsigned* p, unsigned v) {
    return __emu::atomic_update(p, [v](unsigned o) { return o >= v ? 0u : o + 1u; });
}
inline unsigned atomicDec(unsigned* p, unsigned v) {
    return __emu::atomic_update(p, [v](unsigned o) { return (o == 0u || o > v) ? v : o - 1u; });
}
EMU_ATOMIC_SCOPES(unsigned, atomicInc, (unsigned* p, unsigned v), (p, v))
EMU_ATOMIC_SCOPES(unsigned, atomicDec, (unsigned* p, unsigned v), (p, v))
#undef EMU_ATOMIC_ADD
#undef EMU_ATOMIC_SUB
#undef EMU_ATOMIC_EXCH
#undef EMU_ATOMIC_MINMAX
#undef EMU_ATOMIC_BITS
#undef EMU_ATOMIC_CAS
#undef EMU_ATOMIC_SCOPES

// ---------------------------------------------------------------- math ---------------------
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fsqrt_rz(float x) { return sqrtf(x); }
inline float __fsqrt_ru(float x) { return sqrtf(x); }
inline float __fsqrt_rd(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
#define EMU_ROUNDED(SUFFIX)                                                                    \
    inline float __fadd_##SUFFIX(float a, float b) { return a + b; }                           \
    inline float __fsub_##SUFFIX(float a, float b) { return a - b; }                           \
    inline float __fmul_##SUFFIX(float a, float b) { return a * b; }                           \
    inline float __fdiv_##SUFFIX(float a, float b) { return a / b; }                           \
    inline float __fmaf_##SUFFIX(float a, float b, float c) { return fmaf(a, b, c); }          \
    inline double __dadd_##SUFFIX(double a, double b) { return a + b; }                        \
    inline double __dmul_##SUFFIX(double a, double b) { return a * b; }                        \
    inline double __fma_##SUFFIX(double a, double b, double c) { return fma(a, b, c); }
EMU_ROUNDED(rn) EMU_ROUNDED(rz) EMU_ROUNDED(ru) EMU_ROUNDED(rd)
#undef EMU_ROUNDED
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }

inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline int __float_as_int(float x) { int r; memcpy(&r, &x, 4); return r; }
inline unsigned __float_as_uint(float x) { unsigned r; memcpy(&r, &x, 4); return r; }
inline float __int_as_float(int x) { float r; memcpy(&r, &x, 4); return r; }
inline float __uint_as_float(unsigned x) { float r; memcpy(&r, &x, 4); return r; }
inline long long __double_as_longlong(double x) { long long r; memcpy(&r, &x, 8); return r; }
inline double __longlong_as_double(long long x) { double r; memcpy(&r, &x, 8); return r; }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
    return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((b >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
}
inline int __mul24(int a, int b) { return (int)((long long)((a << 8) >> 8) * ((b << 8) >> 8)); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xFFFFFFu) * (b & 0xFFFFFFu); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// min/max as CUDA's overloads: mixed operands go to their common type.
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) { using C = std::common_type_t<A, B>; return (C)b < (C)a ? (C)b : (C)a; }
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) { using C = std::common_type_t<A, B>; return (C)a < (C)b ? (C)b : (C)a; }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// ---------------------------------------------------------------- cached loads/stores ------
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// assert: a failing kernel assert stops the launch with an error (include/assert.h keeps this
// definition when a kernel includes <assert.h> or <cassert> itself).
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
#define assert(e) ((e) ? (void)0 : ::__emu::assert_fail(#e, __FILE__, __LINE__))
#endif
