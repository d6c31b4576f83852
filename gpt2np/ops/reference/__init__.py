"""The plain NumPy reference: one module per kernels/*.cu, each op a short function that reads like
its equation.

Every op writes into buffers the caller preallocated, as the op contract says
(gpt2np/ops/contract.py): "=" overwrites, "+=" accumulates, and parameter gradients follow the
`accumulate` flag. These functions ARE the numpy backend's --cpu-math exact (it calls them on blocks
of rows, one block per thread), so their order of operations is part of the numbers: the golden run
(tests/test_golden_run.py) pins it. The GEMMs go through np.matmul and np.dot (not the @ operator),
which that test replaces by exactly rounded ones.

Shapes: B batch, T time, C channels, OC output channels, NH heads, HS = C/NH, V vocab, Vp padded
vocab, N = B*T rows.
"""
