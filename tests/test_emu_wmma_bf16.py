"""WMMA with bf16 inputs on the CUDA emulator (emu/include/mma.h): nvcuda::wmma m16n16k16 fragments
of __nv_bfloat16 with float accumulators, as warp collectives.

A GEMM of tiles against NumPy (bf16 inputs, products exact in fp32, fp32 sums in k order from c) for
every row/column-major combination of A and B, under two fragment element layouts, bitwise;
fill_fragment with a bf16 value; CUDA's element counts per lane; a layout-dependent kernel caught;
the alignment and ldm errors.
Kernels: tests/emu_kernels/wmma_bf16_checks.cu."""
from pathlib import Path

import numpy as np
import pytest
from test_emulator import needs_gpp

from gpt2np.backends.cuda.emulator import EmuKernelError, EmuModule
from gpt2np.bf16 import BF16

HERE = Path(__file__).resolve().parent
LAYOUTS = (0, 0xC0FFEE)

pytestmark = needs_gpp


@pytest.fixture(scope="module")
def mod():
    src = HERE / "emu_kernels" / "wmma_bf16_checks.cu"
    return EmuModule(src.read_text(), name=src.name)


def aligned(array, dtype, alignment=32):
    """A copy of array as `dtype` whose data starts on an `alignment`-byte boundary (WMMA
    pointers: 32 bytes)."""
    array = np.ascontiguousarray(array).astype(dtype)
    item = array.dtype.itemsize
    raw = np.empty(array.size + alignment // item, array.dtype)
    skip = (-raw.ctypes.data % alignment) // item
    out = raw[skip:skip + array.size].reshape(array.shape)
    out[...] = array
    return out


def bf16_matmul(a, b, c):
    """c + a @ b as the emulated tensor core computes it: bf16 inputs, exact fp32 products,
    fp32 sums in k order."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    out = c.astype(np.float32).copy()
    for k in range(a.shape[1]):
        # 8-bit significands: each product exact in fp32
        out += np.outer(a[:, k], b[k, :]).astype(np.float32)
    return out


@pytest.mark.parametrize("a_col, b_col", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gemm_matches_numpy_under_two_layouts(mod, a_col, b_col):
    rng = np.random.default_rng(5)
    m, n, k = 32, 48, 48
    a = rng.standard_normal((m, k)).astype(BF16)
    b = rng.standard_normal((k, n)).astype(BF16)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    for accumulate in (0, 1):
        expected = bf16_matmul(a, b, c0 if accumulate else np.zeros_like(c0))
        for layout in LAYOUTS:
            c = aligned(c0 if accumulate else np.full((m, n), np.nan), np.float32)
            args = (c, aligned(a.T if a_col else a, BF16), aligned(b.T if b_col else b, BF16),
                    np.int32(m), np.int32(n), np.int32(k), np.int32(a_col), np.int32(b_col),
                    np.int32(accumulate))
            mod.get_function("wmma_bf16_gemm")((m // 16,), (32 * (n // 16),), args,
                                               wmma_layout=layout)
            np.testing.assert_array_equal(c, expected)
    # the products are exact: against float64 only the fp32 additions round
    exact = c0.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(c - exact).max() <= k * 2.0 ** -23 * (np.abs(c0).max() + k * np.abs(exact).max())


def test_fill_counts_and_layouts(mod):
    rng = np.random.default_rng(6)
    b = aligned(rng.standard_normal((16, 16)), BF16)
    c = aligned(np.zeros((16, 16)), np.float32)
    mod.get_function("wmma_bf16_fill")((1,), (32,), (c, b, np.float32(0.5)))
    expected = bf16_matmul(np.full((16, 16), 0.5, BF16), b, np.zeros((16, 16), np.float32))
    np.testing.assert_array_equal(c.T, expected)               # stored column-major
    counts = np.zeros(4, np.int32)
    mod.get_function("wmma_bf16_counts")((1,), (32,), (counts,))
    # CUDA's num_elements; x[] holds __nv_bfloat16
    assert counts.tolist() == [8, 8, 8, 2]
    a = aligned(np.arange(256).reshape(16, 16), BF16)
    eye = aligned(np.eye(16), BF16)
    got = {}
    for layout in (0, 1, 0xC0FFEE):
        mod.get_function("wmma_bf16_layout_dependent")((1,), (32,), (c, a, eye), wmma_layout=layout)
        got[layout] = c.copy()
    assert not np.array_equal(got[0], got[1]) and not np.array_equal(got[1], got[0xC0FFEE])


@pytest.mark.parametrize("kernel, message", [
    ("wmma_bf16_bad_ldm", "load_matrix_sync: ldm 4 is not a multiple of 8 bf16 elements"),
    ("wmma_bf16_unaligned", "load_matrix_sync: pointer .* is not 32-byte"),
])
def test_errors(mod, kernel, message):
    c = aligned(np.zeros(256), np.float32)
    a = aligned(np.zeros(512), BF16)
    with pytest.raises(EmuKernelError, match=message):
        mod.get_function(kernel)((1,), (32,), (c, a))
