"""The CUDA emulator (gpt2np.backends.cuda.emulator): g++ + shim + fibers run
CUDA kernels on the CPU.

Kernels live in tests/emu_kernels/emu_checks.cu (one module, compiled once and cached).
Results are checked against NumPy; the error paths (partial barrier, partial warp shuffle,
races, faults, argument checking) must raise clear exceptions instead of hanging or crashing.
Device arrays of the emulator runtime sit against PROT_NONE guard pages (emulator.device_array):
out-of-bounds kernels fault and the error names the kernel, the thread and the buffer.
"""
import gc
import mmap
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

from gpt2np.backends.cuda import emulator
from gpt2np.backends.cuda.emulator import (
    CompilerNotFoundError,
    EmuKernelError,
    EmuModule,
    buffer_of,
    device_array,
)
from gpt2np.paths import KERNEL_DIR

HERE = Path(__file__).resolve().parent
KERNELS_DIR = KERNEL_DIR
SCHEDULES = ("forward", "reverse")

try:
    emulator.compiler()
    HAVE_GPP = True
except CompilerNotFoundError:
    HAVE_GPP = False
needs_gpp = pytest.mark.skipif(not HAVE_GPP, reason="g++ not installed")


@pytest.fixture(scope="module")
def mod():
    src = HERE / "emu_kernels" / "emu_checks.cu"
    return EmuModule(src.read_text(), name=src.name)


def rand(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


# ---------------------------------------------------------------- compiler and module -------

@needs_gpp
def test_compiler_is_gnu_gpp():
    path, version = emulator.compiler()
    assert "g++" in Path(path).name
    assert "clang" not in version.lower()


def test_missing_compiler_gives_clear_error(monkeypatch):
    monkeypatch.setenv("GPT2NP_EMU_CXX", "gpt2np-no-such-g++")
    with pytest.raises(CompilerNotFoundError,
                       match="gpt2np-no-such-g\\+\\+' not found on PATH.*g\\+\\+"):
        EmuModule(f'extern "C" __global__ void k(int* p) {{ }} // {uuid.uuid4()}')


@needs_gpp
def test_module_finds_kernels_and_resolves_signatures(mod, tmp_path):
    assert {"vector_add", "block_sum_static", "cg_reduce", "scalars"} <= set(mod.kernels)
    fn = mod.get_function("vector_add")
    assert [n for n, _ in fn.params] == ["out", "a", "b", "n"]
    assert fn.codes == ["P:f4", "Pc:f4", "Pc:f4", "S:i4"]          # `real` is float
    assert mod.get_function("float4_sum").codes[1] == "Pc:Vf4x4"
    with pytest.raises(ValueError,
                       match="no extern \"C\" __global__ kernel named 'nope'.*vector_add"):
        mod.get_function("nope")
    # the compiled module is cached: same source -> same .so, not rebuilt
    again = EmuModule((HERE / "emu_kernels" / "emu_checks.cu").read_text(), name="emu_checks.cu")
    assert again.path == mod.path and mod.path.exists()


@needs_gpp
def test_compile_error_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2NP_EMU_CACHE", str(tmp_path))
    with pytest.raises(emulator.EmuCompileError, match="broken.cu:2.*undeclared_thing"):
        EmuModule('extern "C" __global__ void k(float* p) {\n p[0] = undeclared_thing; }',
                  name="broken.cu")


# ---------------------------------------------------------------- results -------------------

@needs_gpp
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_vector_add(mod, schedule):
    n = 1000
    a, b = rand(n, 1), rand(n, 2)
    out = np.zeros(n, np.float32)
    mod.get_function("vector_add")((n + 127) // 128, 128, (out, a, b, np.int32(n)),
                                   schedule=schedule)
    np.testing.assert_array_equal(out, a + b)


@needs_gpp
def test_builtins_3d(mod):
    grid, block = (3, 2, 2), (4, 2, 3)
    nb, nt = 12, 24
    out = np.zeros((nb * nt, 4), np.int32)
    mod.get_function("builtins_3d")(grid, block, (out,))
    np.testing.assert_array_equal(out[:, 0], np.repeat(np.arange(nb), nt))
    np.testing.assert_array_equal(out[:, 1], np.tile(np.arange(nt), nb))
    assert (out[:, 2] == 322).all() and (out[:, 3] == 423).all()


@needs_gpp
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_block_reduction_static_and_dynamic_shared(mod, schedule):
    n = 1000
    x = rand(n, 3)
    expect = np.array([x[i:i + 256].sum(dtype=np.float64) for i in range(0, n, 256)])
    out = np.zeros(4, np.float32)
    mod.get_function("block_sum_static")(4, 256, (out, x, np.int32(n)), schedule=schedule)
    np.testing.assert_allclose(out, expect, rtol=1e-5)
    out_dyn = np.zeros(8, np.float32)
    mod.get_function("block_sum_dynamic")(8, 128, (out_dyn, x, np.int32(n)), shared_mem=128 * 4,
                                          schedule=schedule)
    np.testing.assert_allclose(out_dyn, [x[i:i + 128].sum(dtype=np.float64)
                                         for i in range(0, n, 128)], rtol=1e-5)


@needs_gpp
def test_warp_shuffles(mod):
    x = rand(128, 4)
    out = np.zeros(16, np.float32)
    mod.get_function("warp_shuffles")(2, 64, (out, x))
    w = x.reshape(4, 32).astype(np.float64)
    got = out.reshape(4, 4)
    np.testing.assert_allclose(got[:, 0], w.sum(1), rtol=1e-5)
    np.testing.assert_allclose(got[:, 1], w.sum(1), rtol=1e-5)
    np.testing.assert_array_equal(got[:, 2], x.reshape(4, 32)[:, 5])
    np.testing.assert_allclose(got[:, 3], w.sum(1), rtol=1e-5)
    # width 8: segments of 8 lanes
    seg, bcast = np.zeros(64, np.float32), np.zeros(64, np.float32)
    mod.get_function("shuffle_width8")(1, 64, (seg, bcast, x[:64]))
    s8 = x[:64].reshape(8, 8)
    np.testing.assert_allclose(seg, np.repeat(s8.sum(1), 8), rtol=1e-5)
    np.testing.assert_array_equal(bcast, np.repeat(s8[:, 3], 8))


@needs_gpp
def test_warp_votes(mod):
    x = rand(96, 5)
    x[32:64] = np.abs(x[32:64]) + 1      # warp 1: all positive
    x[64:96] = -np.abs(x[64:96]) - 1     # warp 2: none positive
    ballot, anyv, allv = np.zeros(3, np.uint32), np.zeros(3, np.int32), np.zeros(3, np.int32)
    mod.get_function("warp_votes")(1, 96, (ballot, anyv, allv, x))
    expect = [sum(1 << l for l in range(32) if x[32 * w + l] > 0) for w in range(3)]
    assert ballot.tolist() == expect
    assert anyv.tolist() == [int(expect[0] != 0), 1, 0] and allv.tolist() == [0, 1, 0]


@needs_gpp
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cooperative_groups_reduce(mod, schedule):
    x = rand(256, 6)
    s32, m32, s8 = np.zeros(8, np.float32), np.zeros(8, np.float32), np.zeros(32, np.float32)
    mod.get_function("cg_reduce")(2, 128, (s32, m32, s8, x), schedule=schedule)
    np.testing.assert_allclose(s32, x.reshape(8, 32).sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(m32, x.reshape(8, 32).max(1))
    np.testing.assert_allclose(s8, x.reshape(32, 8).sum(1), rtol=1e-5, atol=1e-6)


@needs_gpp
def test_atomics(mod):
    n = 1000
    x = rand(n, 7)
    k = np.random.default_rng(8).integers(0, 10**6, n).astype(np.int32)
    fsum, count, imax = np.zeros(1, np.float32), np.zeros(1, np.int32), np.full(1, -1, np.int32)
    hist = np.zeros(4, np.uint32)
    mod.get_function("atomics")(8, 128, (fsum, count, imax, hist, x, k, np.int32(n)))
    assert fsum[0] == pytest.approx(x.sum(dtype=np.float64), rel=1e-4)
    assert count[0] == (x > 0).sum() and imax[0] == k.max()
    np.testing.assert_array_equal(hist, np.bincount(k & 3, minlength=4))


@needs_gpp
def test_syncthreads_count(mod):
    x = rand(192, 9)
    out = np.zeros(3, np.int32)
    mod.get_function("sync_count")(3, 64, (out, x))
    np.testing.assert_array_equal(out, (x.reshape(3, 64) > 0).sum(1))


@needs_gpp
def test_scalars_and_vector_pointers(mod):
    out = np.zeros(6, np.float64)
    mod.get_function("scalars")(1, 1, (out, np.int32(-3), np.uint32(4000000000), np.float32(1.5),
                                       np.float64(2.25), np.int64(-2**40), np.bool_(True)))
    np.testing.assert_array_equal(out, [-3, 4000000000, 1.5, 2.25, -2**40, 1])
    x = rand(64, 10)
    s = np.zeros(16, np.float32)
    mod.get_function("float4_sum")(1, 32, (s, x, np.int32(16)))
    np.testing.assert_allclose(s, x.reshape(16, 4).sum(1), rtol=1e-6)


@needs_gpp
def test_intrinsics(mod):
    out = np.zeros(6, np.float32)
    x = np.float32(1.7)
    mod.get_function("intrinsics")(1, 1, (out, x))
    xd = float(x)
    np.testing.assert_allclose(out, [np.exp(xd), np.log(xd), 1 / np.sqrt(xd), 1 / xd, np.tanh(xd),
                                     2 + 4 + 1], rtol=1e-6)


# ---------------------------------------------------------------- errors and races ----------

@needs_gpp
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_partial_syncthreads_raises(mod, schedule):
    fn = mod.get_function("partial_barrier")
    out = np.zeros(128, np.float32)
    with pytest.raises(EmuKernelError,
                       match=r"kernel 'partial_barrier' block \(0,0,0\) thread \(\d+,0,0\): "
                             r"__syncthreads reached by only 100 of the block's 128 threads"):
        fn(1, 128, (out, np.int32(100)), schedule=schedule)
    fn(1, 128, (out, np.int32(128)), schedule=schedule)     # the module still works afterwards
    np.testing.assert_array_equal(out, (np.arange(128) + 1) % 128)


@needs_gpp
def test_partial_warp_shuffle_raises(mod):
    with pytest.raises(EmuKernelError, match=r"kernel 'partial_shuffle' block \(0,0,0\) thread .*"
                                             r"__shfl_xor_sync\(mask 0xffffffff\) in warp 0 "
                                             r"reached by only 16 of the 32"):
        mod.get_function("partial_shuffle")(1, 64, (np.zeros(64, np.float32),))


@needs_gpp
def test_race_surfaces_under_a_schedule(mod):
    results = {}
    for schedule in SCHEDULES:
        out = np.zeros(64, np.float32)
        mod.get_function("racy_neighbour")(1, 64, (out,), schedule=schedule)
        results[schedule] = out
    correct = ((np.arange(64) + 1) % 64).astype(np.float32)
    # forward: each thread reads its neighbour's slot before the neighbour ran -> NaN fill;
    # reverse: the neighbour already wrote it. Either way, the two schedules disagree.
    assert np.isnan(results["forward"][:63]).all()
    assert not np.array_equal(results["forward"], results["reverse"], equal_nan=True)
    assert not (np.array_equal(results["forward"], correct)
                and np.array_equal(results["reverse"], correct))


@needs_gpp
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shared_memory_is_nan_filled_every_block(mod, schedule):
    stat, dyn = np.zeros(64, np.float32), np.zeros(64, np.int32)
    mod.get_function("read_before_write")(2, 32, (stat, dyn), shared_mem=32 * 4, schedule=schedule)
    # both blocks, though block 0 wrote 1.0 before block 1
    assert np.isnan(stat).all()
    assert (dyn == -1).all()                    # 0xFF bytes


@needs_gpp
def test_faults_and_asserts_become_errors(mod):
    with pytest.raises(EmuKernelError, match=r"kernel 'bad_pointer' block \(0,0,0\) thread "
                                             r"\(0,0,0\): invalid memory access at address 0x10"):
        mod.get_function("bad_pointer")(1, 4, (np.zeros(4, np.float32), np.int64(16)))
    with pytest.raises(EmuKernelError, match=r"thread \(3,0,0\): assertion 'threadIdx.x < limit' "
                                             r"failed at emu_checks.cu:\d+"):
        mod.get_function("failing_assert")(1, 8, (np.int32(3),))


# ---------------------------------------------------------------- argument checking ---------

@needs_gpp
def test_scalar_argument_types_are_checked(mod):
    fn = mod.get_function("vector_add")
    a = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match=r"kernel 'vector_add' parameter 3 'n' \(int\): expected a "
                                        r"numpy.int32 scalar, got numpy.float32"):
        fn(1, 4, (a, a, a, np.float32(4)))
    with pytest.raises(TypeError,
                       match=r"'n' \(int\).*got Python int.*CuPy would pass a Python int as int64"):
        fn(1, 4, (a, a, a, 4))
    with pytest.raises(TypeError, match=r"'n' \(int\).*numpy.int64"):
        fn(1, 4, (a, a, a, np.int64(4)))
    with pytest.raises(TypeError,
                       match=r"kernel 'vector_add' takes 4 arguments \(out, a, b, n\), got 3"):
        fn(1, 4, (a, a, a))
    with pytest.raises(TypeError, match=r"kernel 'scalars' parameter 3 'c' \(float\): expected a "
                                        r"numpy.float32 scalar, got Python float"):
        mod.get_function("scalars")(1, 1, (np.zeros(6), np.int32(1), np.uint32(1), 1.5,
                                           np.float64(1), np.int64(1), np.bool_(1)))


@needs_gpp
def test_pointer_dtypes_are_checked(mod):
    fn = mod.get_function("vector_add")
    f32, n = np.zeros(8, np.float32), np.int32(8)
    with pytest.raises(TypeError, match=r"parameter 1 'a' \(const real\*\): expected a float32 "
                                        r"array, got float64"):
        fn(1, 8, (f32, np.zeros(8), f32, n))
    with pytest.raises(TypeError,
                       match=r"parameter 0 'out' \(real\*\): expected a float32 array, got int32"):
        fn(1, 8, (np.zeros(8, np.int32), f32, f32, n))
    with pytest.raises(TypeError, match=r"'out'.*not C-contiguous"):
        fn(1, 8, (np.zeros(16, np.float32)[::2], f32, f32, n))
    readonly = np.zeros(8, np.float32)
    readonly.flags.writeable = False
    fn(1, 8, (f32, readonly, readonly, n))                          # const pointers may read it
    with pytest.raises(TypeError, match=r"'out'.*read-only"):
        fn(1, 8, (readonly, f32, f32, n))
    with pytest.raises(TypeError, match=r"'a'.*None.*pass 0 for a null pointer"):
        fn(1, 8, (f32, None, f32, n))
    with pytest.raises(TypeError, match=r"'a'.*expected a NumPy array.*numpy.float32 scalar"):
        fn(1, 8, (f32, np.float32(1), f32, n))
    fn(1, 8, (f32, f32, f32, np.int32(0)))
    with pytest.raises(TypeError, match=r"'x' \(const float4\*\): array of 6 elements is not a "
                                        r"whole number of 4-vectors"):
        mod.get_function("float4_sum")(1, 1, (f32, np.zeros(6, np.float32), np.int32(1)))


@needs_gpp
def test_launch_configuration_is_checked(mod):
    fn = mod.get_function("block_sum_dynamic")
    x, out = rand(64), np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="block .* exceeds CUDA's limits"):
        fn(1, 2048, (out, x, np.int32(64)))
    with pytest.raises(ValueError, match="shared_mem=65536 bytes exceeds the 49152-byte limit"):
        fn(1, 64, (out, x, np.int32(64)), shared_mem=65536)
    fn.max_dynamic_shared_size_bytes = 100 * 1024
    fn(1, 64, (out, x, np.int32(64)), shared_mem=65536)
    fn.max_dynamic_shared_size_bytes = emulator.DEFAULT_DYNAMIC_SHARED
    np.testing.assert_allclose(out[0], x.sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="unknown schedule 'sideways'"):
        fn(1, 64, (out, x, np.int32(64)), schedule="sideways")
    with pytest.raises(ValueError, match="grid"):
        fn((0, 1), 64, (out, x, np.int32(64)))


@needs_gpp
def test_dynamic_shared_memory_past_what_the_launch_gave_faults(mod):
    """extern __shared__ memory ends where the launch's shared_mem (rounded up to 128 bytes) ends,
    on a guard page, and the rounding's bytes hold a canary: a kernel that uses more than its launch
    asked for stops with a message saying so (on a GPU it would use other memory)."""
    fn = mod.get_function("block_sum_dynamic")
    x, out = rand(64), np.zeros(1, np.float32)
    with pytest.raises(EmuKernelError, match=r"block_sum_dynamic.*thread \(32,0,0\): write of "
                       r"dynamic shared memory at byte 128, past the 128 bytes the launch gave"):
        fn(1, 64, (out, x, np.int32(64)), shared_mem=32 * 4)
    with pytest.raises(EmuKernelError, match="past the 0 bytes the launch gave"):
        fn(1, 64, (out, x, np.int32(64)))
    # 4 floats short: inside the rounding to 128 bytes, found after the block by
    # the canary bytes there
    with pytest.raises(EmuKernelError, match=r"block \(0,0,0\): write of dynamic shared memory at "
                                             r"byte 240, past the 240 bytes the launch gave "
                                             r".*found after the block, thread unknown"):
        fn(1, 64, (out, x, np.int32(64)), shared_mem=60 * 4)
    fn(1, 64, (out, x, np.int32(64)), shared_mem=64 * 4)
    np.testing.assert_allclose(out[0], x.sum(), rtol=1e-5)


@needs_gpp
def test_portable_ucontext_switch_and_define_option():
    """-DGPT2NP_EMU_UCONTEXT (an NVRTC-style option passed through to g++) selects the portable
    ucontext fiber switch used off x86-64; results and error reports must be the same."""
    src = HERE / "emu_kernels" / "emu_checks.cu"
    mod = EmuModule(src.read_text(), options=("-DGPT2NP_EMU_UCONTEXT", "--use_fast_math"),
                    name=src.name)
    assert mod.ignored_options == ["--use_fast_math"]
    x = rand(256, 11)
    s32, m32, s8 = np.zeros(8, np.float32), np.zeros(8, np.float32), np.zeros(32, np.float32)
    mod.get_function("cg_reduce")(2, 128, (s32, m32, s8, x))
    np.testing.assert_allclose(s32, x.reshape(8, 32).sum(1), rtol=1e-5, atol=1e-6)
    with pytest.raises(EmuKernelError,
                       match="__syncthreads reached by only 100 of the block's 128 threads"):
        mod.get_function("partial_barrier")(1, 128, (np.zeros(128, np.float32), np.int32(100)))
    with pytest.raises(EmuKernelError, match="invalid memory access"):
        mod.get_function("bad_pointer")(1, 4, (np.zeros(4, np.float32), np.int64(16)))


@needs_gpp
def test_default_schedule_from_environment(monkeypatch):
    monkeypatch.setenv("GPT2NP_EMU_SCHEDULE", "reverse")
    src = HERE / "emu_kernels" / "emu_checks.cu"
    mod = EmuModule(src.read_text(), name=src.name)
    assert mod.schedule == "reverse"
    out = np.zeros(64, np.float32)
    mod.get_function("racy_neighbour")(1, 64, (out,))         # reverse: neighbours wrote first
    assert np.isnan(out[63]) and not np.isnan(out[:63]).any()
    with pytest.raises(ValueError, match="unknown schedule"):
        mod.schedule = "random"


# ---------------------------------------------------------------- guard pages (memcheck) ----

GUARDS = ("after", "before")


def buffer_name(array, shape, nbytes, dtype="float32"):
    """The regex for 'buffer #N (float32, shape (64,), 256 bytes)' of a device array."""
    return re.escape(f"buffer #{buffer_of(array).number} ({dtype}, shape {shape}, {nbytes} bytes)")


@pytest.mark.parametrize("guard", GUARDS)
def test_guarded_allocation_layout_alignment_and_views(guard):
    page = mmap.PAGESIZE
    for shape, dtype in [((4, 192), np.float32), ((10,), np.float32),
                         ((3,), np.int32), ((1,), np.float64),
                         ((0,), np.float32), ((2, 3, 5), np.uint8), ((64,), np.float32)]:
        a = device_array(shape, dtype, guard)
        buf = buffer_of(a)
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        # zero-filled, like runtime.zeros
        assert not a.any()
        start, end = a.ctypes.data, a.ctypes.data + a.nbytes
        assert (buf.data, buf.end) == (start, end)
        if guard == "after":     # the end touches the guard page; the start stays 16-byte aligned
            assert start % 16 == 0 and 0 <= buf.guards[1][0] - end < 16
            if a.nbytes % 256 == 0:
                assert start % 256 == 0 and buf.guards[1][0] == end
        else:
            # the start follows the guard page (page-aligned, so 256-byte aligned)
            assert start == buf.guards[0][1] and start % page == 0
        flat = a.reshape(-1)
        assert buffer_of(flat[1:]) is buf and buffer_of(a[..., :1]) is buf
        flat[:] = 7
        assert (a == 7).all()
    assert device_array(5, np.float32).shape == (5,)
    assert buffer_of(np.zeros(3)) is None
    with pytest.raises(ValueError, match="guard must be 'after' or 'before'"):
        device_array(3, np.float32, "off")


def test_guarded_memory_is_released_with_its_last_view():
    gc.collect()
    live = len(emulator._LIVE_BUFFERS)
    maps = Path("/proc/self/maps")
    before = len(maps.read_text().splitlines()) if maps.exists() else None
    arrays = [device_array((100, 7), np.float32, GUARDS[i % 2]) for i in range(300)]
    views = [a.reshape(-1)[3:] for a in arrays[:10]]
    del arrays
    gc.collect()
    assert len(emulator._LIVE_BUFFERS) == live + 10                 # views keep their mapping alive
    assert all(v.sum() == 0 for v in views)
    del views
    gc.collect()
    assert len(emulator._LIVE_BUFFERS) == live
    if before is not None:
        assert len(maps.read_text().splitlines()) <= before + 5     # unmapped again


@needs_gpp
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_overrun_faults_against_the_guard_page_after(mod, schedule):
    out, inp = device_array(64, np.float32, "after"), device_array((4, 16), np.float32, "after")
    with pytest.raises(EmuKernelError, match=(
            r"^kernel 'oob_write' block \(0,0,0\) thread \(0,0,0\): out-of-bounds write past the "
            r"end of parameter 'out' = " + buffer_name(out, (64,), 256)
            + r": element 64, byte offset 256 \(0 bytes past the end\); address 0x[0-9a-f]+ is on "
              r"the guard page after the buffer \(GPT2NP_EMU_GUARD=after\)$")):
        mod.get_function("oob_write")(1, 32, (out, np.int32(64)), schedule=schedule)
    with pytest.raises(EmuKernelError, match=(
            r"^kernel 'oob_read' block \(0,0,0\) thread \(0,0,0\): out-of-bounds read past the end "
            r"of parameter 'in' = " + buffer_name(inp, (4, 16), 256)
            + r": element 70, byte offset 280 \(24 bytes past the end\)")):
        mod.get_function("oob_read")(1, 32, (out, inp, np.int32(70)), schedule=schedule)
    # float4: the thread one vector too far faults on its 16-byte load
    src, dst = device_array(32, np.float32, "after"), device_array(32, np.float32, "after")
    with pytest.raises(EmuKernelError, match=(
            r"^kernel 'float4_copy' block \(2,0,0\) thread \(0,0,0\): out-of-bounds read past the "
            r"end of parameter 'in' = " + buffer_name(src, (32,), 128)
            + r": element 32, byte offset 128 \(0 bytes")):
        mod.get_function("float4_copy")(3, 4, (dst, src, np.int32(8), np.int32(1)),
                                        schedule=schedule)
    assert not out.any()                       # nothing was written: the store itself faulted


@needs_gpp
def test_underrun_faults_against_the_guard_page_before(mod):
    out, inp = device_array(64, np.float32, "before"), device_array(64, np.float32, "before")
    with pytest.raises(EmuKernelError, match=(
            r"^kernel 'oob_write' block \(0,0,0\) thread \(0,0,0\): out-of-bounds write before the "
            r"start of parameter 'out' = " + buffer_name(out, (64,), 256)
            + r": element -1, byte offset -4 \(4 bytes before the start\); address 0x[0-9a-f]+ is "
              r"on the guard page before the buffer \(GPT2NP_EMU_GUARD=before\)$")):
        mod.get_function("oob_write")(1, 32, (out, np.int32(-1)))
    with pytest.raises(EmuKernelError, match=(
            r"out-of-bounds read before the start of parameter 'in' = "
            + buffer_name(inp, (64,), 256) + r": element -3, byte offset -12")):
        mod.get_function("oob_read")(1, 32, (out, inp, np.int32(-3)))
    # a far underrun in mode "after" still hits the guard page in front of the buffer's page
    far = device_array(64, np.float32, "after")
    with pytest.raises(EmuKernelError, match=r"write before the start of parameter 'out' = "
                       r".*element -1100.*guard page before the buffer \(GPT2NP_EMU_GUARD=after\)"):
        mod.get_function("oob_write")(1, 32, (far, np.int32(-1100)))


@needs_gpp
def test_writes_into_the_pads_are_caught_after_the_launch(mod):
    """The side without the guard page (and the <16-byte alignment pad in mode "after") is
    canary-filled: writes there are reported after the launch; reads there go unnoticed (the
    documented limit)."""
    fn, read = mod.get_function("oob_write"), mod.get_function("oob_read")
    odd = device_array(10, np.float32, "after")                    # 40 bytes: 8-byte alignment pad
    with pytest.raises(EmuKernelError, match=(
            r"^kernel 'oob_write': out-of-bounds write past the end of parameter 'out' = " +
            buffer_name(odd, (10,), 40) + r": element 11 \(byte offsets 44\.\.47\) in the 8-byte "
                                          r"alignment pad between it and its guard page \(found "
                                          r"after the launch from the pad's canary bytes; block "
            r"and thread unknown\)$")):
        fn(1, 32, (odd, np.int32(11)))
    # the pad was restored: no new report
    fn(1, 32, (odd, np.int32(9)))
    read(1, 32, (odd, odd, np.int32(11)))                          # a read of the pad: not caught
    with pytest.raises(EmuKernelError, match=r"read past the end of parameters 'out', 'in' = "
                       r".*element 12, byte offset 48 \(8 bytes past the end\)"):
        read(1, 32, (odd, odd, np.int32(12)))                      # the guard page itself
    after, before = device_array(64, np.float32, "after"), device_array(64, np.float32, "before")
    with pytest.raises(EmuKernelError, match=(
            r"write before the start of parameter 'out' = " + buffer_name(after, (64,), 256) +
            r": element -2 \(byte offsets -8\.\.-5\) in the 3840-byte pad before it, the "
            r"rest of its page")):
        fn(1, 32, (after, np.int32(-2)))
    with pytest.raises(EmuKernelError, match=(
            r"write past the end of parameter 'out' = " + buffer_name(before, (64,), 256) +
            r": element 64 \(byte offsets 256\.\.259\) in the 3840-byte pad after it, the "
            r"rest of its page")):
        fn(1, 32, (before, np.int32(64)))
    read(1, 32, (after, before, np.int32(64)))                     # reads of the pad: not caught
    read(1, 32, (before, after, np.int32(-1)))
    assert not after[1:].any() and not before[1:].any()             # [0]: the pads' canary, read


@needs_gpp
@pytest.mark.parametrize("guard", GUARDS)
def test_the_process_and_later_launches_survive_faults(mod, guard):
    n = 300
    a, b = device_array(n, np.float32, guard), device_array(n, np.float32, guard)
    a[:], b[:] = rand(n, 1), rand(n, 2)
    out = device_array(n, np.float32, guard)
    bad = n if guard == "after" else -1
    for _ in range(3):
        with pytest.raises(EmuKernelError, match="out-of-bounds write"):
            mod.get_function("oob_write")(2, 64, (out, np.int32(bad)))
        mod.get_function("vector_add")(3, 128, (out, a, b, np.int32(n)))
        np.testing.assert_array_equal(out, a + b)
    # not near a buffer
    with pytest.raises(EmuKernelError, match="invalid memory access at address 0x10"):
        mod.get_function("bad_pointer")(1, 4, (out, np.int64(16)))
    # float4 loads of guarded memory
    x = device_array(256, np.float32, guard)
    x[:] = rand(256, 3)
    s = device_array(64, np.float32, guard)
    mod.get_function("float4_sum")(1, 64, (s, x, np.int32(64)))
    np.testing.assert_allclose(s, x.reshape(64, 4).sum(1), rtol=1e-6)


@needs_gpp
def test_a_fault_on_another_buffers_guard_page_names_both(mod):
    given, other = device_array(4, np.float32), device_array((2, 8), np.int32)
    address = buffer_of(other).guards[1][0] + 8
    with pytest.raises(EmuKernelError, match=(
            r"^kernel 'bad_pointer' block \(0,0,0\) thread \(0,0,0\): out-of-bounds read at "
            r"address 0x[0-9a-f]+, nearest buffer of the launch: (past the end|before "
            r"the start) of parameter 'out' = " + buffer_name(given, (4,), 16)
            + r": element -?\d+, byte offset -?\d+ .*; the address is on the guard page after "
            + buffer_name(other, (2, 8), 64, "int32") + ", which this launch was not given$")):
        mod.get_function("bad_pointer")(1, 4, (given, np.int64(address)))


def test_guard_mode_from_argument_and_environment(monkeypatch):
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    monkeypatch.delenv("GPT2NP_EMU_GUARD", raising=False)
    assert emulator.guard_mode() == "after" and EmuRuntime().guard == "after"
    monkeypatch.setenv("GPT2NP_EMU_GUARD", "before")
    rt = EmuRuntime()
    assert rt.guard == "before" and EmuRuntime(guard="after").guard == "after"
    host = np.arange(12, dtype=np.int32).reshape(3, 4)
    for array in (rt.zeros((3, 4), np.float32), rt.empty(5, np.float64), rt.from_host(host),
                  CudaBackend(rt).scratch("work", (2, 3))):
        buf = buffer_of(array)
        assert buf is not None and buf.guard == "before" and array.ctypes.data == buf.guards[0][1]
    copy = rt.from_host(host)
    assert copy.dtype == np.int32 and (copy == host).all() and not np.shares_memory(copy, host)
    off = EmuRuntime(guard="off")
    assert all(buffer_of(a) is None for a in (off.zeros(3, np.float32), off.empty(3, np.float32),
                                              off.from_host(host)))
    with pytest.raises(ValueError, match="unknown guard mode 'sideways'"):
        EmuRuntime(guard="sideways")
    monkeypatch.setenv("GPT2NP_EMU_GUARD", "nowhere")
    with pytest.raises(ValueError, match="unknown guard mode 'nowhere'.*GPT2NP_EMU_GUARD"):
        EmuRuntime()


@needs_gpp
@pytest.mark.parametrize("guard", GUARDS)
def test_project_kernel_overrun_through_the_backend_names_kernel_and_buffer(guard):
    """CudaBackend's launch path on the emulator runtime: encoder_forward handed an output one
    float4 short faults (mode "after") or is caught by the pad's canary (mode "before")."""
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    be = CudaBackend(EmuRuntime(guard=guard))
    B, T, C = 2, 3, 8
    rng = np.random.default_rng(0)
    inp = be.from_host(rng.integers(0, 5, (B, T)).astype(np.int32))
    wte, wpe = (be.from_host(rand(5 * C, 4).reshape(5, C)),
                be.from_host(rand(T * C, 5).reshape(T, C)))
    short = be.zeros(B * T * C - 4)
    args = (short, inp, wte, wpe, np.int32(B), np.int32(T), np.int32(C))
    if guard == "after":
        match = (r"^kernel 'encoder_forward' block \(0,0,0\) thread \(11,0,0\): out-of-bounds "
                 r"write past the end of parameter 'out' = " + buffer_name(short, (44,), 176)
                 + r": element 44, byte offset 176 \(0 bytes past the end\)")
    else:
        match = (r"^kernel 'encoder_forward': out-of-bounds write past the end of "
                 r"parameter 'out' = " + buffer_name(short, (44,), 176)
                 + r": elements 44\.\.47 \(byte offsets 176\.\.191\)")
    with pytest.raises(EmuKernelError, match=match):
        be._launch("encoder_forward", (1,), (64,), args)
    out = be.zeros((B, T, C))
    be.encoder_forward(out, inp, wte, wpe)                           # the right size: fine
    np.testing.assert_array_equal(out, wte[inp] + wpe[None, :T])


# ---------------------------------------------------------------- the project's kernels -----

@needs_gpp
@pytest.mark.parametrize("path", sorted(KERNELS_DIR.glob("*.cu")), ids=lambda p: p.name)
def test_project_kernels_compile_and_parse(path):
    """Every kernels/*.cu builds under the emulator and the Python-side parse of each
    extern "C" kernel agrees with the C++ signature (the parameter count)."""
    mod = EmuModule(path.read_text(), include_dirs=(str(KERNELS_DIR),), name=path.name)
    entry = r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\('
    declared = re.findall(entry, path.read_text())
    assert set(declared) == set(mod.kernels)
    for name, params in mod.kernels.items():
        assert len(params) == len(mod.get_function(name).codes), name
