// mma.h (emulator): the subset of CUDA's nvcuda::wmma that gpt2np's kernels use, on the CPU.
//
//   fragment<matrix_a, 16, 16, 8, precision::tf32, row_major | col_major>   4 floats per lane
//   fragment<matrix_b, 16, 16, 8, precision::tf32, row_major | col_major>   4 floats per lane
//   fragment<accumulator, 16, 16, 8, float>                                 8 floats per lane
//   fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major | col_major>   8 bf16 per lane
//   fragment<matrix_b, 16, 16, 16, __nv_bfloat16, row_major | col_major>   8 bf16 per lane
//   fragment<accumulator, 16, 16, 16, float>                                8 floats per lane
//   fill_fragment, load_matrix_sync, store_matrix_sync (mem_row_major / mem_col_major), mma_sync,
//   __float_to_tf32.
// (the element counts per lane are CUDA's: num_elements of each fragment kind in CUDA's crt/mma.h). The bf16
// fragments load from __nv_bfloat16 memory, the accumulators of both shapes from and to float memory; fill_fragment
// takes the fragment's element_type (float, or __nv_bfloat16 for a bf16 fragment: no implicit conversion).
//
// load_matrix_sync, store_matrix_sync and mma_sync are warp collectives: all 32 lanes of a full warp
// must reach the same one with the same pointer and ldm (checked: a mismatch, a partial warp, a
// pointer that is not 32-byte aligned or an ldm that is not a multiple of 16 bytes (4 floats, 8 bf16)
// fails the launch). The last lane to arrive does the whole warp's work (emu_runtime.h, OP_WMMA_*), as
// the hardware does it for the warp at once.
//
// Element layout: which lane holds which element of a fragment (and at which x[i]) is unspecified in
// CUDA and differs between GPU generations, so a kernel must not depend on it: it may only apply
// the same operation to every x[i] (scale all, round all, fill). The emulator picks the layout per
// launch: layout 0 is the natural one (row-major order, lane l holds elements l*n .. l*n+n-1), any
// other value seeds a pseudo-random permutation per fragment kind (every use, layout and shape its own;
// EmuModule(wmma_layout=...), GPT2NP_EMU_WMMA_LAYOUT). Running a kernel under two layouts and comparing
// the results bitwise catches a kernel that depends on it.
//
// Arithmetic: mma_sync multiplies TF32 or bf16 inputs and accumulates in fp32, in k order, starting from
// c: d = (((c + a0 b0) + a1 b1) + ...). TF32 (11-bit significands) and bf16 (8-bit) products are exact
// in fp32, so only the additions round. (The hardware's adder tree sums in another order, with its own
// internal precision: results agree with a GPU's to fp32 accumulation rounding, not bitwise.)
// TF32 inputs are read as TF32: their 13 low mantissa bits are dropped, so a
// kernel that skips __float_to_tf32 gets truncated (not rounded) inputs. __float_to_tf32 rounds to
// nearest with ties away from zero (cvt.rna.tf32.f32; the same as runtime_emu.round_to_tf32).
// bf16 inputs are bf16 already (a kernel rounds with __float2bfloat16_rn as it stores them).
// A test aid with no hardware counterpart: with wmma_tf32 off (EmuRuntime(tf32=False, wmma_tf32=False))
// __float_to_tf32 returns its input and mma_sync reads all 23 mantissa bits of TF32 inputs, so a kernel's
// results can be checked to fp32 rounding, apart from TF32's (bf16 fragments are unaffected).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
namespace precision {
struct tf32 {};
}  // namespace precision
enum layout_t { mem_row_major, mem_col_major };

inline float __float_to_tf32(float in) {
    if (!__emu::g_wmma_tf32) return in;
    uint32_t bits;
    memcpy(&bits, &in, 4);
    if ((bits & 0x7F800000u) != 0x7F800000u) bits = (bits + 0x1000u) & 0xFFFFE000u;   // inf, NaN kept
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

}  // namespace wmma
}  // namespace nvcuda

namespace __emu {
namespace wmma_detail {
namespace w = nvcuda::wmma;

// Shape of a fragment kind: rows x cols of its tile, and which layout table it uses. K: the shape's k (8 for
// TF32, 16 for bf16).
template <class Use, class Layout, int K> struct kind;
template <> struct kind<w::matrix_a, w::row_major, 8> { enum { rows = 16, cols = 8, table = 0 }; };
template <> struct kind<w::matrix_a, w::col_major, 8> { enum { rows = 16, cols = 8, table = 1 }; };
template <> struct kind<w::matrix_b, w::row_major, 8> { enum { rows = 8, cols = 16, table = 2 }; };
template <> struct kind<w::matrix_b, w::col_major, 8> { enum { rows = 8, cols = 16, table = 3 }; };
template <> struct kind<w::accumulator, void, 8> { enum { rows = 16, cols = 16, table = 4 }; };
template <> struct kind<w::matrix_a, w::row_major, 16> { enum { rows = 16, cols = 16, table = 5 }; };
template <> struct kind<w::matrix_a, w::col_major, 16> { enum { rows = 16, cols = 16, table = 6 }; };
template <> struct kind<w::matrix_b, w::row_major, 16> { enum { rows = 16, cols = 16, table = 7 }; };
template <> struct kind<w::matrix_b, w::col_major, 16> { enum { rows = 16, cols = 16, table = 8 }; };
template <> struct kind<w::accumulator, void, 16> { enum { rows = 16, cols = 16, table = 9 }; };

constexpr int kTables = 10;
constexpr int kMaxElems = 256;

// What a fragment of element type T stores (TF32 inputs are held as float).
template <class T> struct storage { using type = T; };
template <> struct storage<w::precision::tf32> { using type = float; };

struct Table {
    unsigned seed = ~0u;                 // the layout it was built for (~0u: not built)
    uint16_t elem_of_slot[kMaxElems];    // slot = lane * per_lane + i  ->  element = row * cols + col
    uint16_t slot_of_elem[kMaxElems];
};
inline Table g_tables[kTables];

inline uint64_t splitmix64(uint64_t& s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The layout of fragment kind `id` (count elements) for this launch's g_wmma_layout.
inline const Table& table(int id, int count) {
    Table& t = g_tables[id];
    if (t.seed != g_wmma_layout) {
        for (int e = 0; e < count; e++) t.elem_of_slot[e] = (uint16_t)e;
        if (g_wmma_layout != 0) {                       // Fisher-Yates, seeded per layout and kind
            uint64_t s = (uint64_t)g_wmma_layout * 0x100000001B3ull + (uint64_t)id;
            for (int e = count - 1; e > 0; e--) {
                int j = (int)(splitmix64(s) % (uint64_t)(e + 1));
                uint16_t tmp = t.elem_of_slot[e];
                t.elem_of_slot[e] = t.elem_of_slot[j];
                t.elem_of_slot[j] = tmp;
            }
        }
        for (int s = 0; s < count; s++) t.slot_of_elem[t.elem_of_slot[s]] = (uint16_t)s;
        t.seed = g_wmma_layout;
    }
    return t;
}

inline float tf32_bits(float v) {           // what the tensor core reads of a TF32 input
    if (!g_wmma_tf32) return v;
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7F800000u) != 0x7F800000u) bits &= 0xFFFFE000u;
    memcpy(&v, &bits, 4);
    return v;
}

inline float input_value(float v) { return tf32_bits(v); }                     // a TF32 input
inline float input_value(__nv_bfloat16 v) { return __bfloat162float(v); }     // a bf16 input: exact

// A lane arrives at a WMMA collective with its request; `finish` completes it for the whole warp.
inline void collective(uint8_t op, void* request, void (*finish)(void* const*)) {
    const unsigned warp = g_cur->linear >> 5;
    if (g_warps[warp].exist != 0xFFFFFFFFu)
        fail("%s needs a full warp: warp %u of this block has only %d threads (make blockDim a "
             "multiple of 32)", kOpNames[op], warp, __builtin_popcount(g_warps[warp].exist));
    unsigned char in[kValueBytes];
    memcpy(in, &request, sizeof(void*));
    memcpy(in + sizeof(void*), &finish, sizeof finish);
    warp_collective(op, 0xFFFFFFFFu, in, kValueBytes, 0, 32);
}

struct MemRequest {          // load_matrix_sync / store_matrix_sync
    void* x;                 // the lane's fragment elements
    void* mem;
    unsigned ldm;            // in elements
    int mem_col_major;
};

inline void check_mem(uint8_t op, void* const* requests, int elem_bytes) {
    const MemRequest* first = (const MemRequest*)requests[0];
    for (int l = 1; l < 32; l++) {
        const MemRequest* r = (const MemRequest*)requests[l];
        if (r->mem != first->mem || r->ldm != first->ldm || r->mem_col_major != first->mem_col_major)
            fail("%s: lane %d passed pointer %p, ldm %u, %s while lane 0 passed %p, ldm %u, %s: every "
                 "lane must pass the same", kOpNames[op], l, r->mem, r->ldm,
                 r->mem_col_major ? "mem_col_major" : "mem_row_major", first->mem, first->ldm,
                 first->mem_col_major ? "mem_col_major" : "mem_row_major");
    }
    if ((uintptr_t)first->mem % 32)
        fail("%s: pointer %p is not 32-byte (256-bit) aligned", kOpNames[op], first->mem);
    if (first->ldm % (16 / elem_bytes))
        fail("%s: ldm %u is not a multiple of %d %s (16 bytes)", kOpNames[op], first->ldm, 16 / elem_bytes,
             elem_bytes == 4 ? "floats" : "bf16 elements");
}

template <class Use, class Layout, int K, class E, bool Store>
void finish_mem(void* const* requests) {
    using Kd = kind<Use, Layout, K>;
    constexpr int count = Kd::rows * Kd::cols, per_lane = count / 32;
    const uint8_t op = Store ? OP_WMMA_STORE : OP_WMMA_LOAD;
    check_mem(op, requests, (int)sizeof(E));
    const MemRequest* first = (const MemRequest*)requests[0];
    const Table& t = table(Kd::table, count);
    for (int s = 0; s < count; s++) {
        const int e = t.elem_of_slot[s], r = e / Kd::cols, c = e % Kd::cols;
        E* at = (E*)first->mem + (first->mem_col_major ? (size_t)c * first->ldm + r : (size_t)r * first->ldm + c);
        E* x = (E*)((const MemRequest*)requests[s / per_lane])->x + s % per_lane;
        if (Store) *at = *x;
        else *x = *at;
    }
}

struct MmaRequest {
    float* d;
    const void* a;
    const void* b;
    const float* c;
};

// d = c + a b for the whole warp: a (16 x K), b (K x 16) of element storage E, fp32 products (exact) summed in
// k order.
template <class LayoutA, class LayoutB, int K, class E>
void finish_mma(void* const* requests) {
    using KA = kind<w::matrix_a, LayoutA, K>;
    using KB = kind<w::matrix_b, LayoutB, K>;
    using KC = kind<w::accumulator, void, K>;
    constexpr int na = 16 * K / 32, nb = K * 16 / 32, nc = 8;   // elements per lane
    const Table& ta = table(KA::table, 16 * K);
    const Table& tb = table(KB::table, K * 16);
    const Table& tc = table(KC::table, 256);
    auto input = [&](const Table& t, int per_lane, int e, bool is_a) {
        const int s = t.slot_of_elem[e];
        const MmaRequest* r = (const MmaRequest*)requests[s / per_lane];
        return input_value(((const E*)(is_a ? r->a : r->b))[s % per_lane]);
    };
    float A[16][K], B[K][16], D[16][16];
    for (int m = 0; m < 16; m++)
        for (int k = 0; k < K; k++) A[m][k] = input(ta, na, m * K + k, true);
    for (int k = 0; k < K; k++)
        for (int n = 0; n < 16; n++) B[k][n] = input(tb, nb, k * 16 + n, false);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            const int s = tc.slot_of_elem[m * 16 + n];
            float acc = ((const MmaRequest*)requests[s / nc])->c[s % nc];
            for (int k = 0; k < K; k++) acc += A[m][k] * B[k][n];
            D[m][n] = acc;
        }
    for (int e = 0; e < 256; e++) {          // every input was read: d may be c
        const int s = tc.slot_of_elem[e];
        ((const MmaRequest*)requests[s / nc])->d[s % nc] = D[e / 16][e % 16];
    }
}

}  // namespace wmma_detail
}  // namespace __emu

namespace nvcuda {
namespace wmma {

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
    static_assert(M == 16 && N == 16 && (K == 8 || K == 16),
                  "emulated WMMA: only the m16n16k8 (TF32) and m16n16k16 (bf16) shapes");
    static_assert(std::is_same_v<Use, accumulator>
                      ? std::is_same_v<T, float> && std::is_void_v<Layout>
                      : std::is_same_v<T, std::conditional_t<K == 8, precision::tf32, __nv_bfloat16>> &&
                            !std::is_void_v<Layout>,
                  "emulated WMMA: matrix_a/matrix_b fragments are precision::tf32 (k 8) or __nv_bfloat16 (k 16) "
                  "with row_major or col_major, accumulators are float without a layout");
    using Kind = __emu::wmma_detail::kind<Use, Layout, K>;

public:
    using element_type = std::conditional_t<std::is_same_v<T, __nv_bfloat16>, __nv_bfloat16, float>;
    using storage_element_type = typename __emu::wmma_detail::storage<T>::type;
    enum { num_elements = Kind::rows * Kind::cols / 32 };
    storage_element_type x[num_elements];
};

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f,
                          const typename fragment<Use, M, N, K, T, Layout>::element_type& value) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = value;
}

template <class Use, int M, int N, int K, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, precision::tf32, Layout>& f, const float* p, unsigned ldm) {
    __emu::wmma_detail::MemRequest r{f.x, const_cast<float*>(p), ldm, std::is_same_v<Layout, col_major>};
    __emu::wmma_detail::collective(__emu::OP_WMMA_LOAD, &r,
                                   &__emu::wmma_detail::finish_mem<Use, Layout, K, float, false>);
}

template <class Use, int M, int N, int K, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p,
                             unsigned ldm) {
    __emu::wmma_detail::MemRequest r{f.x, const_cast<__nv_bfloat16*>(p), ldm, std::is_same_v<Layout, col_major>};
    __emu::wmma_detail::collective(__emu::OP_WMMA_LOAD, &r,
                                   &__emu::wmma_detail::finish_mem<Use, Layout, K, __nv_bfloat16, false>);
}

template <int K>
inline void load_matrix_sync(fragment<accumulator, 16, 16, K, float>& f, const float* p, unsigned ldm,
                             layout_t layout) {
    __emu::wmma_detail::MemRequest r{f.x, const_cast<float*>(p), ldm, layout == mem_col_major};
    __emu::wmma_detail::collective(__emu::OP_WMMA_LOAD, &r,
                                   &__emu::wmma_detail::finish_mem<accumulator, void, K, float, false>);
}

template <int K>
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, K, float>& f, unsigned ldm,
                              layout_t layout) {
    __emu::wmma_detail::MemRequest r{const_cast<float*>(f.x), p, ldm, layout == mem_col_major};
    __emu::wmma_detail::collective(__emu::OP_WMMA_STORE, &r,
                                   &__emu::wmma_detail::finish_mem<accumulator, void, K, float, true>);
}

template <int K, class T, class LayoutA, class LayoutB>
inline void mma_sync(fragment<accumulator, 16, 16, K, float>& d, const fragment<matrix_a, 16, 16, K, T, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, K, T, LayoutB>& b, const fragment<accumulator, 16, 16, K, float>& c) {
    using E = typename fragment<matrix_a, 16, 16, K, T, LayoutA>::storage_element_type;
    __emu::wmma_detail::MmaRequest r{d.x, a.x, b.x, c.x};
    __emu::wmma_detail::collective(__emu::OP_WMMA_MMA, &r,
                                   &__emu::wmma_detail::finish_mma<LayoutA, LayoutB, K, E>);
}

}  // namespace wmma
}  // namespace nvcuda
