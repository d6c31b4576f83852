"""The CuPy runtime: CudaBackend's kernels on a real GPU.

Kernels: kernels/<file>.cu compiled by NVRTC through cupy.RawModule with nvrtc_options() (CuPy adds
its own include paths, -ftz=true and -arch=sm_XX for the current device, and caches the binary on
disk keyed by the source text and options). GEMMs: cuBLAS sgemm / sgemmStridedBatched on CuPy's
handle for the current device, called with row-major semantics (see gemm). Memory: CuPy arrays.
Timing: CUDA events. Everything runs on CuPy's current stream.

TF32: off by default, so GEMMs are exact fp32 like the NumPy reference; CupyRuntime(tf32=True)
sets the handle's math mode to CUBLAS_TF32_TENSOR_OP_MATH (tensor cores, 10-bit mantissa inputs).
"""
import hashlib
from pathlib import Path

import numpy as np


def nvrtc_options(kernel_dir):
    """Our options for every kernels/*.cu, as handed to cupy.RawModule (and to NVRTC by nvrtc_check).

    -I<kernels>: for #include "common.cuh". The -D carries a hash of the headers: CuPy's disk cache
    keys on the source text and options only, so without it an edited common.cuh would be ignored.
    """
    kernel_dir = Path(kernel_dir).resolve()
    digest = hashlib.sha1()
    for header in sorted(kernel_dir.glob("*.cuh")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return ("--std=c++17", f"-I{kernel_dir}", f"-DGPT2NP_HEADERS_SHA1={digest.hexdigest()[:16]}")


class CupyRuntime:
    """NVRTC-compiled kernels, cuBLAS GEMMs and CUDA events through CuPy on the current device."""

    name = "cupy"

    def __init__(self, tf32=False):
        import cupy
        from cupy_backends.cuda.libs import cublas
        self.cp = cupy
        self.cublas = cublas
        self.tf32 = bool(tf32)
        self.handle = cupy.cuda.device.get_cublas_handle()
        cublas.setPointerMode(self.handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.setMathMode(self.handle, cublas.CUBLAS_TF32_TENSOR_OP_MATH if self.tf32 else cublas.CUBLAS_DEFAULT_MATH)
        # host scalars for alpha/beta (pointer mode host: cuBLAS reads them before returning)
        self._alpha = np.zeros(1, np.float32)
        self._beta = np.zeros(1, np.float32)

    def device_name(self):
        props = self.cp.cuda.runtime.getDeviceProperties(self.cp.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    # ---- kernels --------------------------------------------------------------------------
    def compile(self, path: Path):
        """kernels/<file>.cu -> cupy.RawModule (compiled on first get_function, cached on disk)."""
        path = Path(path)
        return self.cp.RawModule(code=path.read_text(), options=nvrtc_options(path.parent))

    def launch(self, function, grid, block, args, shared_mem=0):
        function(grid, block, args, shared_mem=shared_mem)

    # ---- GEMM -----------------------------------------------------------------------------
    def gemm(self, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c,
             batch=1):
        """Row-major, batched: C[i] (m,n) = alpha op(A[i]) @ op(B[i]) + beta C[i], i < batch.

        op(A) is (m,k): A[i] is stored (m,k) with row stride lda, or (k,m) when transa; likewise
        op(B) (k,n) from B[i] stored (k,n), or (n,k) when transb.

        cuBLAS is column-major: a row-major (r,c) matrix with row stride ld is, to cuBLAS, its
        (c,r) transpose with leading dimension ld. So we ask cuBLAS for C^T = op(B)^T op(A)^T:
        swap the operands and m <-> n; each operand keeps its own transpose flag.
        """
        cublas = self.cublas
        op_a = cublas.CUBLAS_OP_T if transa else cublas.CUBLAS_OP_N
        op_b = cublas.CUBLAS_OP_T if transb else cublas.CUBLAS_OP_N
        self._alpha[0] = alpha
        self._beta[0] = beta
        alpha_ptr, beta_ptr = self._alpha.ctypes.data, self._beta.ctypes.data
        if batch == 1:
            cublas.sgemm(self.handle, op_b, op_a, n, m, k, alpha_ptr, b.data.ptr, ldb, a.data.ptr, lda,
                         beta_ptr, c.data.ptr, ldc)
        else:
            cublas.sgemmStridedBatched(self.handle, op_b, op_a, n, m, k, alpha_ptr,
                                       b.data.ptr, ldb, stride_b, a.data.ptr, lda, stride_a,
                                       beta_ptr, c.data.ptr, ldc, stride_c, batch)

    # ---- memory ---------------------------------------------------------------------------
    def zeros(self, shape, dtype):
        return self.cp.zeros(shape, dtype)

    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def from_host(self, array):
        return self.cp.asarray(np.ascontiguousarray(array))

    def to_host(self, array):
        return self.cp.asnumpy(array)

    def copy(self, dst, src):
        if (dst.dtype == src.dtype and dst.size == src.size and dst.flags.c_contiguous
                and src.flags.c_contiguous):
            dst.data.copy_from_device_async(src.data, dst.nbytes)
        else:
            self.cp.copyto(dst, src)

    def fill(self, array, value):
        if value == 0 and array.flags.c_contiguous:
            array.data.memset_async(0, array.nbytes)
        else:
            array.fill(value)

    def pointer(self, array):
        return array.data.ptr

    # ---- time -----------------------------------------------------------------------------
    def event(self):
        return self.cp.cuda.Event()

    def elapsed_ms(self, start, end):
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end)

    def synchronize(self):
        self.cp.cuda.get_current_stream().synchronize()
