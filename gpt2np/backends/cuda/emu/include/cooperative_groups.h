// cooperative_groups.h (gpt2np CUDA emulator): the subset of CUDA's cooperative groups that
// the emulator supports, built on the warp collectives and block barrier of cuda_emu.h.
//   thread_block        this_thread_block(); sync() thread_rank() size() num_threads()
//                       group_index() thread_index() group_dim() dim_threads()
//   thread_block_tile<N[, Parent]>, N a power of two <= 32, from tiled_partition<N>(parent):
//                       sync() thread_rank() meta_group_rank() meta_group_size() size()
//                       num_threads() shfl(v, src) shfl_up(v, d) shfl_down(v, d) shfl_xor(v, m)
//                       any(p) all(p) ballot(p) (bit i = tile rank i)
//   cg::sync(group);  cg::reduce / cg::inclusive_scan / cg::exclusive_scan are in
//   cooperative_groups/reduce.h and cooperative_groups/scan.h.
// Not emulated: grid_group/this_grid, coalesced_threads, dynamic tiled_partition(g, n),
// cluster groups, memcpy_async.
#pragma once

namespace cooperative_groups {

class thread_block {
  public:
    static void sync() { __syncthreads(); }
    static unsigned thread_rank() {
        return (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    }
    static unsigned size() { return blockDim.x * blockDim.y * blockDim.z; }
    static unsigned num_threads() { return size(); }
    static dim3 group_index() { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
    static dim3 thread_index() { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
    static dim3 group_dim() { return blockDim; }
    static dim3 dim_threads() { return blockDim; }
};

inline thread_block this_thread_block() { return thread_block(); }

template <unsigned N, class Parent = void>
class thread_block_tile {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0,
                  "gpt2np emulator: thread_block_tile<N> needs N a power of two <= 32");

  public:
    thread_block_tile() = default;
    template <class P> thread_block_tile(const thread_block_tile<N, P>&) {}

    static constexpr unsigned num_threads() { return N; }
    static constexpr unsigned size() { return N; }
    static unsigned thread_rank() { return thread_block::thread_rank() % N; }
    static unsigned meta_group_rank() { return thread_block::thread_rank() / N; }
    static unsigned meta_group_size() { return (thread_block::size() + N - 1) / N; }
    // The lanes of the caller's warp that belong to its tile.
    static unsigned tile_mask() {
        const unsigned base = (thread_block::thread_rank() % 32) & ~(N - 1);
        return N == 32 ? 0xffffffffu : ((1u << N) - 1u) << base;
    }
    static void sync() { __syncwarp(tile_mask()); }
    template <class T> static T shfl(T v, unsigned src) {
        return __emu::shfl(__emu::OP_SHFL_IDX, tile_mask(), v, (int)src, (int)N);
    }
    template <class T> static T shfl_up(T v, unsigned delta) {
        return __emu::shfl(__emu::OP_SHFL_UP, tile_mask(), v, (int)delta, (int)N);
    }
    template <class T> static T shfl_down(T v, unsigned delta) {
        return __emu::shfl(__emu::OP_SHFL_DOWN, tile_mask(), v, (int)delta, (int)N);
    }
    template <class T> static T shfl_xor(T v, unsigned lane_mask) {
        return __emu::shfl(__emu::OP_SHFL_XOR, tile_mask(), v, (int)lane_mask, (int)N);
    }
    static int any(int pred) { return (int)__emu::vote(__emu::OP_ANY, tile_mask(), pred); }
    static int all(int pred) { return (int)__emu::vote(__emu::OP_ALL, tile_mask(), pred); }
    static unsigned ballot(int pred) {
        const unsigned base = (thread_block::thread_rank() % 32) & ~(N - 1);
        return __emu::vote(__emu::OP_BALLOT, tile_mask(), pred) >> base;
    }
};

template <unsigned N, class Parent>
inline thread_block_tile<N, Parent> tiled_partition(const Parent&) {
    return thread_block_tile<N, Parent>();
}

inline void sync(const thread_block& g) { g.sync(); }
template <unsigned N, class P> inline void sync(const thread_block_tile<N, P>& g) { g.sync(); }

}  // namespace cooperative_groups
