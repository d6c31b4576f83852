"""The CuPy runtime: CudaBackend's kernels on a real GPU.

Kernels: kernels/<file>.cu compiled by NVRTC through cupy.RawModule with nvrtc_options() (CuPy adds
its own include paths, -ftz=true and -arch=sm_XX for the current device, and caches the binary on
disk keyed by the source text and options). GEMMs: cuBLAS sgemm / sgemmStridedBatched on a cuBLAS
handle of our own (CuPy's shared handle is reset by other CuPy code and by a second runtime, which would
change our math mode under us), called with row-major semantics (see gemm). Memory: CuPy arrays.
Timing: CUDA events. Everything runs on CuPy's current stream (the handle follows it).

Precision: CupyRuntime(tf32=False) keeps the GEMMs exact fp32 (CUBLAS_DEFAULT_MATH), like the NumPy
reference; tf32=True sets the handle's math mode to CUBLAS_TF32_TENSOR_OP_MATH (tensor cores, inputs
rounded to a 10-bit mantissa, fp32 accumulation). CuPy's cublas module defines only CUBLAS_DEFAULT_MATH and
CUBLAS_TENSOR_OP_MATH, so the values come from cuBLAS's own header (cublas_api.h, cublasMath_t) where CuPy
has none.
"""
import hashlib
from pathlib import Path

import numpy as np

# cublasMath_t in cublas_api.h (CUDA 11 and newer); CuPy 14's cublas module has no name for the TF32 mode
CUBLAS_DEFAULT_MATH = 0
CUBLAS_TF32_TENSOR_OP_MATH = 3


def math_mode(cublas, tf32: bool) -> int:
    """The cublasMath_t for exact fp32 or TF32 tensor-core GEMMs: CuPy's constant where it has one, else cuBLAS's
    value from cublas_api.h."""
    if tf32:
        return getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", CUBLAS_TF32_TENSOR_OP_MATH)
    return getattr(cublas, "CUBLAS_DEFAULT_MATH", CUBLAS_DEFAULT_MATH)


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


CUBLAS_WORKSPACE_BYTES = 32 << 20     # cuBLAS's own default on Hopper; ours, set on the handle (graph capture)
CUBLAS_LIBRARIES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")


def cublas_set_workspace():
    """cublasSetWorkspace_v2(handle, ptr, bytes) from the cuBLAS library CuPy loaded, or None where it cannot be
    found. CuPy's cublas module has no binding for it. A workspace of our own keeps cuBLAS from allocating one
    while a CUDA graph is captured; cublasSetStream resets it to cuBLAS's pool, so it is set after each."""
    import ctypes
    for name in CUBLAS_LIBRARIES:
        try:
            fn = ctypes.CDLL(name).cublasSetWorkspace_v2
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_int

        def set_workspace(handle, ptr, nbytes, fn=fn):
            status = fn(handle, ptr, nbytes)
            if status != 0:
                raise RuntimeError(f"cublasSetWorkspace failed with status {status}")
        return set_workspace
    return None


class CupyReadback:
    """A device->host copy into pinned memory with an event behind it (runtime.Readback)."""

    def __init__(self, host, event, memory):
        self._host, self._event, self._memory = host, event, memory

    def done(self):
        return bool(self._event.done)

    def result(self):
        self._event.synchronize()
        return self._host.copy()


class CupyGraph:
    """A captured cupy.cuda.Graph, launched on the runtime's current stream."""

    def __init__(self, runtime, graph):
        self.runtime, self.graph = runtime, graph

    def launch(self):
        self.graph.launch(stream=self.runtime.cp.cuda.get_current_stream())


class CupyRuntime:
    """NVRTC-compiled kernels, cuBLAS GEMMs and CUDA events through CuPy on the current device."""

    name = "cupy"

    def __init__(self, tf32=False, cupy=None, cublas=None, set_workspace=None):
        """cupy, cublas, set_workspace (cublas_set_workspace's function): stand-ins for tests (default: the real
        ones)."""
        if cupy is None:
            import cupy
        if cublas is None:
            from cupy_backends.cuda.libs import cublas
        self.cp = cupy
        self.cublas = cublas
        self.tf32 = bool(tf32)
        self.device_id = cupy.cuda.runtime.getDevice()
        self.handle = cublas.create()            # ours alone: no other code changes its math mode or stream
        self._stream = None                      # the stream the handle is set to (set before each GEMM)
        cublas.setPointerMode(self.handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.setMathMode(self.handle, math_mode(cublas, self.tf32))
        # host scalars for alpha/beta (pointer mode host: cuBLAS reads them before returning)
        self._alpha = np.zeros(1, np.float32)
        self._beta = np.zeros(1, np.float32)
        self._set_workspace = set_workspace if set_workspace is not None else (
            cublas_set_workspace() if getattr(cupy, "__name__", "") == "cupy" else None)
        self._workspace = None
        self._staged = []            # (event, pinned memory) of uploads not known to be done yet
        self._capture_stream = None  # the stream a capture runs on (CUDA cannot capture the legacy default one)
        self._outer_stream = None

    def close(self):
        """Destroy the cuBLAS handle (also done when the runtime is garbage collected)."""
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None:
            try:
                with self.cp.cuda.Device(self.device_id):
                    self.cublas.destroy(handle)
            except Exception:          # at interpreter exit the context may be gone already
                pass

    def __del__(self):
        self.close()

    def _set_stream(self):
        """Point our handle at CuPy's current stream (what CuPy does for its own handle)."""
        stream = self.cp.cuda.get_current_stream().ptr
        if stream != self._stream:
            self.cublas.setStream(self.handle, stream)
            self._stream = stream
            if self._set_workspace is not None:          # setStream dropped it
                if self._workspace is None:
                    self._workspace = self.cp.empty(CUBLAS_WORKSPACE_BYTES, np.uint8)
                self._set_workspace(self.handle, self._workspace.data.ptr, CUBLAS_WORKSPACE_BYTES)

    def stream_ptr(self):
        """The current CUDA stream (cudaStream_t as an int), as NCCL takes it."""
        return self.cp.cuda.get_current_stream().ptr

    def free_memory(self):
        """Bytes a new allocation can still get on this device: the driver's free memory plus what CuPy's pool
        holds unused."""
        free, _total = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes())

    def total_memory(self):
        return int(self.cp.cuda.runtime.memGetInfo()[1])

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
        """CuPy passes a Python int as a 64-bit integer and a float as a double: scalars must be np.int32 /
        np.float32 (CudaBackend._launch checks them against the kernel's signature; this catches the rest)."""
        for i, a in enumerate(args):
            if isinstance(a, (int, float, np.integer, np.floating)) and type(a) not in (np.int32, np.float32):
                raise TypeError(f"kernel argument {i} is {type(a).__name__} {a}: kernel scalars must be "
                                f"np.int32 or np.float32")
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
        self._set_stream()
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

    def _pinned(self, nbytes):
        memory = self.cp.cuda.alloc_pinned_memory(max(int(nbytes), 1))
        return memory, np.frombuffer(memory, np.uint8, max(int(nbytes), 1))

    def upload(self, dst, array):
        """Copy into pinned memory, then an asynchronous copy on the stream: the host never waits. The pinned
        block stays referenced until its copy is done (checked with event queries, never waited on)."""
        if self._outer_stream is not None:
            raise RuntimeError("CupyRuntime.upload while capturing: uploads go before the graph's launch")
        array = np.ascontiguousarray(array, dtype=dst.dtype)
        memory, host = self._pinned(array.nbytes)
        host[:array.nbytes] = array.reshape(-1).view(np.uint8)
        stream = self.cp.cuda.get_current_stream()
        dst.data.copy_from_host_async(memory.ptr, array.nbytes, stream)
        event = self.cp.cuda.Event(disable_timing=True)
        event.record(stream)
        self._staged = [(e, m) for e, m in self._staged if not e.done] + [(event, memory)]

    def read_async(self, array):
        memory, host = self._pinned(array.nbytes)
        stream = self.cp.cuda.get_current_stream()
        array.data.copy_to_host_async(memory.ptr, array.nbytes, stream)
        event = self.cp.cuda.Event(disable_timing=True)
        event.record(stream)
        return CupyReadback(host[:array.nbytes].view(array.dtype).reshape(array.shape), event, memory)

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

    # ---- CUDA graphs ----------------------------------------------------------------------
    def begin_capture(self):
        """Capture on a stream of our own (the legacy default stream cannot be captured), made current until
        end_capture so that kernels, copies and our cuBLAS handle all go to it. The capture stream first waits
        for the work already queued on the current stream."""
        if self._outer_stream is not None:
            raise RuntimeError("CupyRuntime.begin_capture: already capturing")
        if self._capture_stream is None:
            self._capture_stream = self.cp.cuda.Stream(non_blocking=True)
        outer = self.cp.cuda.get_current_stream()
        self._capture_stream.wait_event(outer.record())
        self._outer_stream = outer
        self._capture_stream.use()
        self._capture_stream.begin_capture()

    def end_capture(self):
        if self._outer_stream is None:
            raise RuntimeError("CupyRuntime.end_capture without begin_capture")
        stream, outer = self._capture_stream, self._outer_stream
        try:
            graph = stream.end_capture()
        finally:
            self._outer_stream = None
            outer.use()
        return CupyGraph(self, graph)
