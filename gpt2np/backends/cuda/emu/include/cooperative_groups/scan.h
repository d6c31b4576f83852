// cooperative_groups/scan.h (gpt2np CUDA emulator): cg::inclusive_scan and cg::exclusive_scan
// over a thread_block_tile (default operator: plus). exclusive_scan gives T{} to rank 0.
#pragma once
#include <cooperative_groups/reduce.h>

namespace cooperative_groups {

template <unsigned N, class P, class T, class Op>
inline T inclusive_scan(const thread_block_tile<N, P>& g, T value, Op op) {
    for (unsigned offset = 1; offset < N; offset *= 2) {
        T other = g.shfl_up(value, offset);
        if (g.thread_rank() >= offset) value = op(value, other);
    }
    return value;
}
template <unsigned N, class P, class T>
inline T inclusive_scan(const thread_block_tile<N, P>& g, T value) {
    return inclusive_scan(g, value, plus<T>());
}
template <unsigned N, class P, class T, class Op>
inline T exclusive_scan(const thread_block_tile<N, P>& g, T value, Op op) {
    T inclusive = inclusive_scan(g, value, op);
    T shifted = g.shfl_up(inclusive, 1);
    return g.thread_rank() == 0 ? T{} : shifted;
}
template <unsigned N, class P, class T>
inline T exclusive_scan(const thread_block_tile<N, P>& g, T value) {
    return exclusive_scan(g, value, plus<T>());
}

}  // namespace cooperative_groups
