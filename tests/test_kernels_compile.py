"""Every kernels/*.cu compiles for sm_75, sm_80 and sm_90 as CuPy will compile it (NVRTC with CuPy's
options) and with nvcc -cubin, without register spills; and CupyRuntime's cuBLAS call maps row-major
operands correctly (against a column-major reference). No GPU needed."""
import re
from pathlib import Path

import pytest
from fake_gpu import FakeCublas, FakeCupy

from gpt2np.backends.cuda import nvrtc_check
from gpt2np.backends.cuda.backend import KERNEL_DIR, KERNEL_FILES, KERNELS, kernel_registry


def _nvrtc_usable():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return True
    except Exception:
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_usable(),
                                 reason="needs cupy + nvidia-cuda-nvrtc (libnvrtc)")


@pytest.fixture(scope="module")
def reports():
    return nvrtc_check.check(KERNEL_FILES, nvrtc_check.ARCHS, use_nvcc=True, jobs=2)


def test_registry_is_read_from_the_kernel_files():
    on_disk = {p.stem for p in KERNEL_DIR.glob("*.cu")}
    assert on_disk == set(KERNEL_FILES)
    for stem in KERNEL_FILES:
        source = (KERNEL_DIR / f"{stem}.cu").read_text()
        entry = r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\('
        declared = set(re.findall(entry, source))
        assert declared and declared == {k for k, f in KERNELS.items() if f == stem}, stem


def test_every_kernel_is_launched_by_the_backend_or_tested():
    """A kernel added to kernels/*.cu must be used: launched by CudaBackend (its name as a string in
    backend.py) or exercised by the kernel tests; and every name the backend launches must exist."""
    from gpt2np.backends.cuda import backend
    backend_source = Path(backend.__file__).read_text()
    tests_source = (Path(__file__).parent / "test_kernels.py").read_text()
    launched = {name for name in KERNELS if f'"{name}"' in backend_source}
    tested = {name for name in KERNELS if name in tests_source}
    unused = sorted(set(KERNELS) - launched - tested)
    assert not unused, f"kernels neither launched by CudaBackend nor tested: {unused}"
    quoted = set(re.findall(r'self\._launch\(\s*"(\w+)"', backend_source))
    assert quoted <= set(KERNELS), quoted - set(KERNELS)


def test_a_new_unused_kernel_is_caught(tmp_path):
    """The registry sees a kernel as soon as it is in a file, so the test above would name it."""
    (tmp_path / "extra.cu").write_text('extern "C" __global__ void __launch_bounds__(256)\n'
                                       'new_kernel(float* x) {}\n')
    assert kernel_registry(tmp_path) == {"new_kernel": "extra"}
    (tmp_path / "again.cu").write_text('extern "C" __global__ void new_kernel(float* x) {}\n')
    with pytest.raises(ValueError, match="also defined"):
        kernel_registry(tmp_path)


@needs_nvrtc
def test_nvrtc_builds_every_kernel_for_every_arch_in_both_builds(reports):
    built = {(r.file, r.arch, r.kernel, r.build) for r in reports if r.tool == "nvrtc"}
    expected = {(f, f"sm_{a}", k, b) for k, f in KERNELS.items() for a in nvrtc_check.ARCHS
                for b in nvrtc_check.BUILDS}
    assert built == expected


@needs_nvrtc
@pytest.mark.skipif(nvrtc_check.find_nvcc() is None, reason="nvcc not found")
def test_nvcc_builds_every_kernel_for_every_arch_in_both_builds(reports):
    built = {(r.file, r.arch, r.kernel, r.build) for r in reports if r.tool == "nvcc"}
    expected = {(f, f"sm_{a}", k, b) for k, f in KERNELS.items() for a in nvrtc_check.ARCHS
                for b in nvrtc_check.BUILDS}
    assert built == expected


@needs_nvrtc
def test_no_register_spills(reports):
    spilled = [f"{r.tool} {r.file} {r.arch} {r.kernel}: {r.spill_stores}/{r.spill_loads} bytes"
               for r in reports if r.spills]
    assert not spilled, spilled
    assert all(r.stack_bytes == 0 for r in reports), [r for r in reports if r.stack_bytes]


@needs_nvrtc
def test_options_match_cupy_rawmodule():
    options = nvrtc_check.cupy_nvrtc_options("90")
    assert "--std=c++17" in options and "-ftz=true" in options and "-arch=sm_90" in options
    # no FMA contraction: the emulator's (and NumPy's) roundings
    assert "--fmad=false" in options
    assert f"-I{KERNEL_DIR.resolve()}" in options
    assert options.index("-ftz=true") < options.index("-arch=sm_90")


@needs_nvrtc
def test_compile_error_names_the_file(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text((KERNEL_DIR / "common.cuh").read_text())
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken() { '
                                        'undefined_thing(); }\n')
    monkeypatch.setattr(nvrtc_check, "KERNEL_DIR", tmp_path)
    with pytest.raises(nvrtc_check.KernelCompileError, match="broken.cu.*sm_90"):
        nvrtc_check.compile_nvrtc("broken", "90")


def test_parse_ptxas_reads_spills():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 0 barriers\n")
    (r,) = nvrtc_check.parse_ptxas(log, "nvcc", "x")
    got = (r.kernel, r.arch, r.registers, r.stack_bytes, r.spill_stores, r.spill_loads)
    assert got == ("k", "sm_90", 255, 8, 4, 12)
    assert r.spills


# ---- the CuPy runtime's cuBLAS call, checked against a column-major reference ------------------
class _FakeCublas(FakeCublas):
    """cuBLAS's column-major sgemm / sgemmStridedBatched semantics on host memory, for checking how
    CupyRuntime.gemm maps row-major operands (pointer mode host: alpha/beta are host addresses)."""

    @staticmethod
    def _matrix(ptr, rows, cols, ld):
        import ctypes

        import numpy as np
        extent = (cols - 1) * ld + rows
        flat = np.ctypeslib.as_array((ctypes.c_float * extent).from_address(ptr))
        # column-major view
        return np.lib.stride_tricks.as_strided(flat, (rows, cols), (4, 4 * ld))

    def sgemm(self, handle, opa, opb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
        self.sgemmStridedBatched(handle, opa, opb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C,
                                 ldc, 0, 1)

    def sgemmStridedBatched(self, handle, opa, opb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C,
                            ldc, sc, batch):
        import ctypes
        alpha = ctypes.c_float.from_address(alpha).value
        beta = ctypes.c_float.from_address(beta).value
        for i in range(batch):
            a = self._matrix(A + 4 * i * sa, *((k, m) if opa else (m, k)), lda)
            b = self._matrix(B + 4 * i * sb, *((n, k) if opb else (k, n)), ldb)
            c = self._matrix(C + 4 * i * sc, m, n, ldc)
            c[...] = alpha * ((a.T if opa else a) @ (b.T if opb else b)) + beta * c


class _DeviceArray:
    """A NumPy array posing as a CuPy one (.data.ptr)."""

    def __init__(self, array):
        import types
        self.array, self.dtype = array, array.dtype
        self.data = types.SimpleNamespace(ptr=array.__array_interface__["data"][0])


@pytest.mark.parametrize("transa, transb, batch",
                         [(False, False, 1), (False, True, 1), (True, False, 1), (True, True, 3),
                          (False, True, 4)])
def test_cupy_gemm_maps_row_major_onto_column_major_cublas(transa, transb, batch):
    import numpy as np

    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    rt = CupyRuntime(cupy=FakeCupy(), cublas=_FakeCublas())         # no GPU: fake CuPy and cuBLAS
    m, n, k = 5, 7, 3
    rng = np.random.default_rng(0)
    a = rng.standard_normal((batch, *((k, m) if transa else (m, k)))).astype(np.float32)
    b = rng.standard_normal((batch, *((n, k) if transb else (k, n)))).astype(np.float32)
    c = rng.standard_normal((batch, m, n)).astype(np.float32)
    expected = 0.5 * ((a.transpose(0, 2, 1) if transa else a)
                      @ (b.transpose(0, 2, 1) if transb else b)) + 2.0 * c
    rt.gemm(transa, transb, m, n, k, 0.5, _DeviceArray(a), a.shape[2], a[0].size, _DeviceArray(b),
            b.shape[2], b[0].size, 2.0, _DeviceArray(c), n, m * n, batch)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-5)


def test_header_hash_in_options_tracks_common_cuh(tmp_path):
    from gpt2np.backends.cuda.runtime_cupy import nvrtc_options
    (tmp_path / "common.cuh").write_text("// v1\n")
    before = nvrtc_options(tmp_path)
    (tmp_path / "common.cuh").write_text("// v2\n")
    assert nvrtc_options(tmp_path) != before             # CuPy's disk cache sees a new key
