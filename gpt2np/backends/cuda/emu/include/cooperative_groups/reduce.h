// cooperative_groups/reduce.h (gpt2np CUDA emulator): cg::reduce over a thread_block_tile and
// the operator objects plus, less (minimum), greater (maximum), bit_and, bit_or, bit_xor.
// Every thread of the tile receives the result (a butterfly of shfl_xor steps).
#pragma once
#include <cooperative_groups.h>

namespace cooperative_groups {

template <class T> struct plus { T operator()(T a, T b) const { return a + b; } };
template <class T> struct less { T operator()(T a, T b) const { return b < a ? b : a; } };
template <class T> struct greater { T operator()(T a, T b) const { return a < b ? b : a; } };
template <class T> struct bit_and { T operator()(T a, T b) const { return a & b; } };
template <class T> struct bit_or { T operator()(T a, T b) const { return a | b; } };
template <class T> struct bit_xor { T operator()(T a, T b) const { return a ^ b; } };

template <unsigned N, class P, class T, class Op>
inline T reduce(const thread_block_tile<N, P>& g, T value, Op op) {
    for (unsigned offset = N / 2; offset > 0; offset /= 2) value = op(value, g.shfl_xor(value, offset));
    return value;
}

}  // namespace cooperative_groups
