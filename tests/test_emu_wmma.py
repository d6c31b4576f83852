"""WMMA on the CUDA emulator (emu/include/mma.h): nvcuda::wmma TF32 m16n16k8 fragments
as warp collectives.

A 16x16x8 tile and a small GEMM against NumPy with TF32-rounded inputs (products exact, fp32 sums in
k order), every row/column-major combination, __float_to_tf32 against runtime_emu.round_to_tf32, the
fragment element layout chosen per launch (a layout-independent kernel gives bitwise the same result
under every layout, a deliberately layout-dependent one does not: that is how the kernel tests catch
the bug), and the errors.
Kernels: tests/emu_kernels/wmma_checks.cu."""
from pathlib import Path

import numpy as np
import pytest
from test_emulator import needs_gpp

from gpt2np.backends.cuda import emulator
from gpt2np.backends.cuda.emulator import EmuKernelError, EmuModule
from gpt2np.backends.cuda.runtime_emu import round_to_tf32

HERE = Path(__file__).resolve().parent
LAYOUTS = (0, 1, 0xC0FFEE)

pytestmark = needs_gpp


@pytest.fixture(scope="module")
def mod():
    src = HERE / "emu_kernels" / "wmma_checks.cu"
    return EmuModule(src.read_text(), name=src.name)


def aligned(array, alignment=32):
    """A copy of array whose data starts on an `alignment`-byte boundary (WMMA pointers must be
    32-byte aligned)."""
    array = np.ascontiguousarray(array, np.float32)
    raw = np.empty(array.size + alignment // 4, np.float32)
    skip = (-raw.ctypes.data % alignment) // 4
    out = raw[skip:skip + array.size].reshape(array.shape)
    out[...] = array
    return out


def tf32_matmul(a, b, c=None):
    """c + a @ b as the emulated tensor core computes it: TF32 inputs, exact products,
    fp32 sums in k order."""
    a, b = round_to_tf32(a), round_to_tf32(b)
    out = (np.zeros((a.shape[0], b.shape[1]), np.float32) if c is None
           else c.astype(np.float32).copy())
    for k in range(a.shape[1]):
        out += np.outer(a[:, k], b[k, :]).astype(np.float32)   # each product is exact in fp32
    return out


def test_float_to_tf32_matches_round_to_tf32(mod):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0 + 2.0 ** -11,
                                  1.0 + 3 * 2.0 ** -11, np.finfo(np.float32).max,
                                  np.finfo(np.float32).tiny], np.float32)])
    out = np.zeros_like(x)
    mod.get_function("tf32_round")(((x.size + 127) // 128,), (128,), (out, x, np.int32(x.size)))
    np.testing.assert_array_equal(out.view(np.uint32), round_to_tf32(x).view(np.uint32))
    assert out[-4] == 1.0 + 2.0 ** -10 and out[-3] == 1.0 + 2.0 ** -9         # ties away from zero


@pytest.mark.parametrize("a_col, b_col, c_col",
                         [(0, 0, 0), (1, 0, 0), (0, 1, 1), (1, 1, 0), (0, 0, 1)])
@pytest.mark.parametrize("layout", LAYOUTS[:2])
def test_tile_matches_numpy_with_tf32_inputs(mod, a_col, b_col, c_col, layout):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 16)).astype(np.float32)
    c = rng.standard_normal((16, 16)).astype(np.float32)
    expected = tf32_matmul(a, b, c)
    for rounded in (1, 0):
        store = aligned(c.T if c_col else c)
        args = (store, aligned(a.T if a_col else a), aligned(b.T if b_col else b), np.int32(a_col),
                np.int32(b_col), np.int32(c_col), np.int32(rounded))
        mod.get_function("wmma_gemm_tile")((1,), (32,), args, wmma_layout=layout)
        got = store.T if c_col else store
        if rounded:
            np.testing.assert_array_equal(got, expected)
        else:
            # without __float_to_tf32 the inputs are truncated: at most one TF32 ulp (2^-10) each
            assert (np.abs(got - expected).max()
                    <= 8 * 2 * 2.0 ** -10 * np.abs(a).max() * np.abs(b).max())


def test_gemm_of_tiles_matches_numpy_under_every_layout(mod):
    rng = np.random.default_rng(2)
    m, n, k = 32, 48, 24
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    expected = tf32_matmul(a, b)
    for layout in LAYOUTS:
        c = aligned(np.full((m, n), np.nan, np.float32))
        mod.get_function("wmma_gemm")((m // 16,), (32 * (n // 16),),
                                      (c, aligned(a), aligned(b), np.int32(m), np.int32(n),
                                       np.int32(k)), wmma_layout=layout)
        np.testing.assert_array_equal(c, expected)
    # and TF32 is visibly not fp32: the relative error against float64 is about 2^-11 per input
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert 0 < np.abs(c - exact).max() / np.abs(exact).max() < 2.0 ** -8


def test_layouts_differ_and_a_layout_dependent_kernel_is_caught(mod):
    x = aligned(np.arange(256, dtype=np.float32).reshape(16, 16))
    scaled, dependent = {}, {}
    for layout in LAYOUTS:
        out = aligned(np.zeros((16, 16), np.float32))
        mod.get_function("wmma_scale")((1,), (32,), (out, x, np.float32(0.5)), wmma_layout=layout)
        scaled[layout] = out.copy()
        mod.get_function("wmma_layout_dependent")((1,), (32,), (out, x), wmma_layout=layout)
        dependent[layout] = out.copy()
    for layout in LAYOUTS:
        # independent: the same everywhere
        np.testing.assert_array_equal(scaled[layout], 0.5 * x)
    # dependent: the layouts disagree
    assert not np.array_equal(dependent[0], dependent[1])
    assert not np.array_equal(dependent[1], dependent[0xC0FFEE])


def test_layout_from_module_and_environment(mod, monkeypatch):
    assert emulator.resolve_wmma_layout(None) == 0
    monkeypatch.setenv("GPT2NP_EMU_WMMA_LAYOUT", "7")
    assert emulator.resolve_wmma_layout(None) == 7 and emulator.resolve_wmma_layout(3) == 3
    for bad in (-1, 2 ** 32, "x"):
        with pytest.raises(ValueError, match="WMMA layout must be an integer"):
            emulator.resolve_wmma_layout(bad)
    x = aligned(np.arange(256, dtype=np.float32).reshape(16, 16))
    out = aligned(np.zeros((16, 16), np.float32))
    fn = mod.get_function("wmma_layout_dependent")
    results = []
    for layout in (0, 5):
        mod.wmma_layout = layout
        fn((1,), (32,), (out, x))
        results.append(out.copy())
    mod.wmma_layout = 0
    assert not np.array_equal(*results)


@pytest.mark.parametrize("kernel, block, message", [
    ("wmma_divergent_pointer", 32,
     "load_matrix_sync: lane 3 passed pointer .* every lane must pass the same"),
    ("wmma_unaligned", 32, "load_matrix_sync: pointer .* is not 32-byte"),
    ("wmma_partial_warp", 16,
     "load_matrix_sync needs a full warp: warp 0 of this block has only 16 threads"),
    ("wmma_diverged", 32, "wmma::load_matrix_sync.*reached by only 16 of the 32 lanes"),
])
def test_errors_name_the_operation(mod, kernel, block, message):
    x = aligned(np.zeros(512, np.float32))
    out = aligned(np.zeros(256, np.float32))
    with pytest.raises(EmuKernelError, match=message):
        mod.get_function(kernel)((1,), (block,), (out, x))


def test_fp32_mode_is_exact_fp32(mod):
    """wmma_tf32=False (a test aid): __float_to_tf32 is the identity and mma_sync reads
    full fp32 inputs."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 16)).astype(np.float32)
    c = aligned(np.zeros((16, 16), np.float32))
    mod.wmma_tf32 = False
    try:
        mod.get_function("wmma_gemm_tile")((1,), (32,), (c, aligned(a), aligned(b), np.int32(0),
                                                         np.int32(0), np.int32(0), np.int32(1)))
    finally:
        mod.wmma_tf32 = True
    expected = np.zeros((16, 16), np.float32)
    for k in range(8):
        expected += (a[:, k:k + 1] * b[k:k + 1, :]).astype(np.float32)
    np.testing.assert_allclose(c, expected, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(c, tf32_matmul(a, b))
