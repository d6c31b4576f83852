// mma.h (emulator): the subset of CUDA's nvcuda::wmma that gpt2np's kernels use, on the CPU.
//
//   fragment<matrix_a, 16, 16, 8, precision::tf32, row_major | col_major>   4 floats per lane
//   fragment<matrix_b, 16, 16, 8, precision::tf32, row_major | col_major>   4 floats per lane
//   fragment<accumulator, 16, 16, 8, float>                                 8 floats per lane
//   fill_fragment, load_matrix_sync, store_matrix_sync (mem_row_major / mem_col_major), mma_sync,
//   __float_to_tf32.
//
// load_matrix_sync, store_matrix_sync and mma_sync are warp collectives: all 32 lanes of a full warp
// must reach the same one with the same pointer and ldm (checked: a mismatch, a partial warp, a
// pointer that is not 32-byte aligned or an ldm that is not a multiple of 4 fails the launch). The
// last lane to arrive does the whole warp's work (emu_runtime.h, OP_WMMA_*), as the hardware does
// it for the warp at once.
//
// Element layout: which lane holds which element of a fragment (and at which x[i]) is unspecified in
// CUDA and differs between GPU generations, so a kernel must not depend on it: it may only apply
// the same operation to every x[i] (scale all, round all, fill). The emulator picks the layout per
// launch: layout 0 is the natural one (row-major order, lane l holds elements l*n .. l*n+n-1), any
// other value seeds a pseudo-random permutation per fragment kind (EmuModule(wmma_layout=...),
// GPT2NP_EMU_WMMA_LAYOUT). Running a kernel under two layouts and comparing the results bitwise
// catches a kernel that depends on it.
//
// Arithmetic: mma_sync multiplies TF32 inputs and accumulates in fp32, in k order, starting from
// c: d = (((c + a0 b0) + a1 b1) + ...). TF32 products are exact in fp32 (11-bit significands), so
// only the additions round. Inputs are read as TF32: their 13 low mantissa bits are dropped, so a
// kernel that skips __float_to_tf32 gets truncated (not rounded) inputs. __float_to_tf32 rounds to
// nearest with ties away from zero (cvt.rna.tf32.f32; the same as runtime_emu.round_to_tf32).
// A test aid with no hardware counterpart: with wmma_tf32 off (EmuRuntime(tf32=False, wmma_tf32=False))
// __float_to_tf32 returns its input and mma_sync reads all 23 mantissa bits, so a kernel's results can
// be checked to fp32 rounding, apart from TF32's.
#pragma once

#include <cstdint>
#include <cstring>

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

// Shape of a fragment kind: rows x cols of its tile, and which layout table it uses.
template <class Use, class Layout> struct kind;
template <> struct kind<w::matrix_a, w::row_major> { enum { rows = 16, cols = 8, table = 0 }; };
template <> struct kind<w::matrix_a, w::col_major> { enum { rows = 16, cols = 8, table = 1 }; };
template <> struct kind<w::matrix_b, w::row_major> { enum { rows = 8, cols = 16, table = 2 }; };
template <> struct kind<w::matrix_b, w::col_major> { enum { rows = 8, cols = 16, table = 3 }; };
template <> struct kind<w::accumulator, void> { enum { rows = 16, cols = 16, table = 4 }; };

constexpr int kTables = 5;
constexpr int kMaxElems = 256;

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
    float* x;                // the lane's fragment elements
    float* mem;
    unsigned ldm;
    int mem_col_major;
};

inline void check_mem(uint8_t op, void* const* requests) {
    const MemRequest* first = (const MemRequest*)requests[0];
    for (int l = 1; l < 32; l++) {
        const MemRequest* r = (const MemRequest*)requests[l];
        if (r->mem != first->mem || r->ldm != first->ldm || r->mem_col_major != first->mem_col_major)
            fail("%s: lane %d passed pointer %p, ldm %u, %s while lane 0 passed %p, ldm %u, %s: every "
                 "lane must pass the same", kOpNames[op], l, (void*)r->mem, r->ldm,
                 r->mem_col_major ? "mem_col_major" : "mem_row_major", (void*)first->mem, first->ldm,
                 first->mem_col_major ? "mem_col_major" : "mem_row_major");
    }
    if ((uintptr_t)first->mem % 32)
        fail("%s: pointer %p is not 32-byte (256-bit) aligned", kOpNames[op], (void*)first->mem);
    if (first->ldm % 4)
        fail("%s: ldm %u is not a multiple of 4 floats (16 bytes)", kOpNames[op], first->ldm);
}

template <class Use, class Layout, bool Store>
void finish_mem(void* const* requests) {
    using K = kind<Use, Layout>;
    constexpr int count = K::rows * K::cols, per_lane = count / 32;
    const uint8_t op = Store ? OP_WMMA_STORE : OP_WMMA_LOAD;
    check_mem(op, requests);
    const MemRequest* first = (const MemRequest*)requests[0];
    const Table& t = table(K::table, count);
    for (int s = 0; s < count; s++) {
        const int e = t.elem_of_slot[s], r = e / K::cols, c = e % K::cols;
        float* at = first->mem + (first->mem_col_major ? (size_t)c * first->ldm + r
                                                       : (size_t)r * first->ldm + c);
        float* x = ((const MemRequest*)requests[s / per_lane])->x + s % per_lane;
        if (Store) *at = *x;
        else *x = *at;
    }
}

struct MmaRequest {
    float* d;
    const float* a;
    const float* b;
    const float* c;
};

template <class LayoutA, class LayoutB>
void finish_mma(void* const* requests) {
    using KA = kind<w::matrix_a, LayoutA>;
    using KB = kind<w::matrix_b, LayoutB>;
    using KC = kind<w::accumulator, void>;
    const Table& ta = table(KA::table, 128);
    const Table& tb = table(KB::table, 128);
    const Table& tc = table(KC::table, 256);
    auto get = [&](const Table& t, int per_lane, int e, int which) {
        const int s = t.slot_of_elem[e];
        const MmaRequest* r = (const MmaRequest*)requests[s / per_lane];
        const float* frag = which == 0 ? r->a : which == 1 ? r->b : r->c;
        return frag[s % per_lane];
    };
    float A[16][8], B[8][16], D[16][16];
    for (int m = 0; m < 16; m++)
        for (int k = 0; k < 8; k++) A[m][k] = tf32_bits(get(ta, 4, m * 8 + k, 0));
    for (int k = 0; k < 8; k++)
        for (int n = 0; n < 16; n++) B[k][n] = tf32_bits(get(tb, 4, k * 16 + n, 1));
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc = get(tc, 8, m * 16 + n, 2);
            for (int k = 0; k < 8; k++) acc += A[m][k] * B[k][n];
            D[m][n] = acc;
        }
    for (int e = 0; e < 256; e++) {          // every input was read: d may be c
        const int s = tc.slot_of_elem[e];
        ((const MmaRequest*)requests[s / 8])->d[s % 8] = D[e / 16][e % 16];
    }
}

}  // namespace wmma_detail
}  // namespace __emu

namespace nvcuda {
namespace wmma {

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment {
    static_assert(M == 16 && N == 16 && K == 8, "emulated WMMA: only the m16n16k8 shape (TF32)");
    static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float> && std::is_void_v<Layout>
                                                   : std::is_same_v<T, precision::tf32> && !std::is_void_v<Layout>,
                  "emulated WMMA: matrix_a/matrix_b fragments are precision::tf32 with row_major or "
                  "col_major, accumulators are float without a layout");
    using Kind = __emu::wmma_detail::kind<Use, Layout>;

public:
    using element_type = float;
    using storage_element_type = float;
    enum { num_elements = Kind::rows * Kind::cols / 32 };
    float x[num_elements];
};

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, float value) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = value;
}

template <class Use, int M, int N, int K, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, precision::tf32, Layout>& f, const float* p, unsigned ldm) {
    __emu::wmma_detail::MemRequest r{f.x, const_cast<float*>(p), ldm, std::is_same_v<Layout, col_major>};
    __emu::wmma_detail::collective(__emu::OP_WMMA_LOAD, &r,
                                   &__emu::wmma_detail::finish_mem<Use, Layout, false>);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 8, float>& f, const float* p, unsigned ldm,
                             layout_t layout) {
    __emu::wmma_detail::MemRequest r{f.x, const_cast<float*>(p), ldm, layout == mem_col_major};
    __emu::wmma_detail::collective(__emu::OP_WMMA_LOAD, &r,
                                   &__emu::wmma_detail::finish_mem<accumulator, void, false>);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 8, float>& f, unsigned ldm,
                              layout_t layout) {
    __emu::wmma_detail::MemRequest r{const_cast<float*>(f.x), p, ldm, layout == mem_col_major};
    __emu::wmma_detail::collective(__emu::OP_WMMA_STORE, &r,
                                   &__emu::wmma_detail::finish_mem<accumulator, void, true>);
}

template <class LayoutA, class LayoutB>
inline void mma_sync(fragment<accumulator, 16, 16, 8, float>& d,
                     const fragment<matrix_a, 16, 16, 8, precision::tf32, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, 8, precision::tf32, LayoutB>& b,
                     const fragment<accumulator, 16, 16, 8, float>& c) {
    __emu::wmma_detail::MmaRequest r{d.x, a.x, b.x, c.x};
    __emu::wmma_detail::collective(__emu::OP_WMMA_MMA, &r, &__emu::wmma_detail::finish_mma<LayoutA, LayoutB>);
}

}  // namespace wmma
}  // namespace nvcuda
