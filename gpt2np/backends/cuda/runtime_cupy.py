"""The CuPy runtime: CudaBackend's kernels on a real GPU.

Kernels: kernels/<file>.cu compiled by NVRTC through cupy.RawModule with nvrtc_options() (CuPy adds
its own include paths, -ftz=true and -arch=sm_XX for the current device, and caches the binary on
disk keyed by the source text and options). GEMMs: cuBLAS sgemm / sgemmStridedBatched on a cuBLAS
handle of our own (CuPy's shared handle is reset by other CuPy code and by a second runtime, which
would change our math mode under us), called with row-major semantics (see gemm).
Memory: CuPy arrays.
Timing: CUDA events. Everything runs on CuPy's current stream (the handle follows it).

Precision: CupyRuntime(tf32=False) keeps the GEMMs exact fp32 (CUBLAS_DEFAULT_MATH), like the NumPy
reference; tf32=True sets the handle's math mode to CUBLAS_TF32_TENSOR_OP_MATH (tensor cores, inputs
rounded to a 10-bit mantissa, fp32 accumulation). bf16 operands (the bf16 build) go through
cublasGemmEx / cublasGemmStridedBatchedEx with CUDA_R_16BF matrices and CUBLAS_COMPUTE_32F (bf16
tensor cores, fp32 accumulation, each output rounded once), and through cuBLASLt with bf16 layouts
for the epilogues. CuPy's cublas module defines only CUBLAS_DEFAULT_MATH and CUBLAS_TENSOR_OP_MATH,
so the values come from cuBLAS's own header (cublas_api.h, cublasMath_t) where CuPy has none.

GEMM epilogues (runtime.EPILOGUES: bias, bias + GELU writing the pre-activation, dGELU, bias
gradient): cuBLASLt through nvmath-python's low-level bindings (nvmath.bindings.cublasLt, the `cuda`
extra), a cublasLt handle of our own, a 32 MiB workspace, TF32 through the compute type. Without
nvmath or cuBLASLt the runtime says so in one line and has no epilogues (`epilogues` False):
CudaBackend then runs the same math as plain cuBLAS GEMMs plus its own kernels.
"""
import ctypes
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from gpt2np.backends.cuda.runtime import check_epilogue

# cublasMath_t in cublas_api.h (CUDA 11 and newer); CuPy 14's cublas module has no
# name for the TF32 mode
CUBLAS_DEFAULT_MATH = 0
CUBLAS_TF32_TENSOR_OP_MATH = 3


# cuBLASLt's enum values, as nvmath-python 1.0.0 declares them from the cuBLAS headers:
# nvmath/bindings/cycublasLt.pxd (cublasLtMatmulDescAttributes_t, cublasLtEpilogue_t,
# cublasLtMatmulPreferenceAttributes_t) and cycublas.pxd (cublasComputeType_t, cublasOperation_t);
# cudaDataType_t from library_types.h.
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_GEMM_DEFAULT = -1                     # cublasGemmAlgo_t: the heuristic's choice
CUBLAS_COMPUTE_32F = 68                      # exact fp32
CUBLAS_COMPUTE_32F_FAST_TF32 = 77            # TF32 tensor cores, fp32 accumulation
MATMUL_DESC_TRANSA, MATMUL_DESC_TRANSB, MATMUL_DESC_EPILOGUE = 3, 4, 7
MATMUL_DESC_BIAS_POINTER, MATMUL_DESC_EPILOGUE_AUX_POINTER, MATMUL_DESC_EPILOGUE_AUX_LD = 8, 11, 12
MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
MATMUL_PREF_MIN_ALIGNMENT_BYTES = {"A": 5, "B": 6, "C": 7, "D": 8}
EPILOGUE_BIAS, EPILOGUE_GELU_AUX_BIAS, EPILOGUE_DGELU, EPILOGUE_BGRADB = 4, 164, 192, 512
# Our row-major epilogue -> cuBLASLt's, on the column-major product D^T = op(B)^T op(A)^T that gemm
# asks for (our B is cuBLASLt's A, our A its B): a bias per column of our C is one per row of D
# (BIAS, GELU_AUX_BIAS); the sums of our op(A) over k are those of cuBLASLt's op(B) over k, one per
# column of D (BGRADB, as llm.c's dweight GEMM uses it). GELU: cuBLASLt's GELU epilogues compute the
# tanh form, GPT-2's (the cuBLAS docs say only "GELU"; NVIDIA's own tests of these epilogues check
# GELU against 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.0447 x^3))) and DGELU against that form's
# derivative: NVIDIA/nvmath-python tests/nvmath_tests/linalg/advanced/matmul/test_epilog.py). On a
# GPU, tests/test_kernels.py (rerun by test_gpu.py) compares the epilogue with the NumPy tanh GELU
# at 1e-4, tighter than the 4e-4 that separates the two forms. The aux matrix's leading dimension
# must be a multiple of 8 (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD); CudaBackend falls back to separate
# kernels where it is not.
LT_EPILOGUES = {"bias": EPILOGUE_BIAS, "gelu_bias": EPILOGUE_GELU_AUX_BIAS, "dgelu": EPILOGUE_DGELU,
                "bgrad": EPILOGUE_BGRADB}
# bytes; cuBLASLt is told 256 less (nvmath adds 16 for epilogues)
LT_WORKSPACE = 32 << 20
_said_no_cublaslt = []


def load_cublaslt():
    """nvmath.bindings.cublasLt, or (None, why) when nvmath-python or libcublasLt is missing."""
    try:
        from nvmath.bindings import cublasLt
        return cublasLt, None
    except Exception as e:                 # ImportError, or the library failing to load
        return None, f"{type(e).__name__}: {e}"


def pointer_alignment(ptr: int) -> int:
    """The largest power of two (at most 256) dividing a device address: what cuBLASLt may assume of
    it (a bf16 operand may be only 2-byte aligned)."""
    return min(256, ptr & -ptr) if ptr else 256


def math_mode(cublas, tf32: bool) -> int:
    """The cublasMath_t for exact fp32 or TF32 tensor-core GEMMs: CuPy's constant where it has one,
    else cuBLAS's value from cublas_api.h."""
    if tf32:
        return getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", CUBLAS_TF32_TENSOR_OP_MATH)
    return getattr(cublas, "CUBLAS_DEFAULT_MATH", CUBLAS_DEFAULT_MATH)


def nvrtc_options(kernel_dir):
    """Our options for every kernels/*.cu, as handed to cupy.RawModule (and to
    NVRTC by nvrtc_check).

    -I<kernels>: for #include "common.cuh". The -D carries a hash of the headers: CuPy's disk cache
    keys on the source text and options only, so without it an edited common.cuh would be ignored.
    --fmad=false: every float multiply and add rounded on its own, as the CPU emulator (g++, ISO
    C++: no contraction) and the NumPy reference compute them; NVRTC would otherwise fuse a*b + c
    into one FMA, and the elementwise kernels (AdamW, LayerNorm, GELU, ...) would stop giving the
    emulator's bits, which the tests claim. It should cost little there (those kernels wait on
    memory); the GEMMs (cuBLAS, cuBLASLt) and the WMMA tiles of flash attention are not affected.
    """
    kernel_dir = Path(kernel_dir).resolve()
    digest = hashlib.sha1()
    for header in sorted(kernel_dir.glob("*.cuh")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return ("--std=c++17", "--fmad=false", f"-I{kernel_dir}",
            f"-DGPT2NP_HEADERS_SHA1={digest.hexdigest()[:16]}",
            *(f"-I{d}" for d in wmma_include_dirs()))


def wmma_include_dirs():
    """Where NVRTC finds <mma.h>'s "crt/mma.h" (kernels/flash_attention.cu uses nvcuda::wmma):
    nothing when the nvidia-cuda-runtime wheel's include folder (on CuPy's include path) has it (the
    nvidia-cuda-crt wheel puts it there), else a CUDA toolkit's include folder that has it
    ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda)."""
    try:
        import nvidia
        wheels = [Path(p) / "cu13" / "include" for p in nvidia.__path__]
    except ImportError:
        wheels = []
    if any((d / "crt" / "mma.h").is_file() for d in wheels):
        return ()
    toolkits = [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH")
                if os.environ.get(v)]
    for d in toolkits + [Path("/usr/local/cuda/include")]:
        if (d / "crt" / "mma.h").is_file():
            return (str(d.resolve()),)
    return ()


# cuBLAS's own default on Hopper; ours, set on the handle (graph capture)
CUBLAS_WORKSPACE_BYTES = 32 << 20
CUBLAS_LIBRARIES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")


def cublas_set_workspace():
    """cublasSetWorkspace_v2(handle, ptr, bytes) from the cuBLAS library CuPy loaded, or None where
    it cannot be found. CuPy's cublas module has no binding for it. A workspace of our own keeps
    cuBLAS from allocating one while a CUDA graph is captured; cublasSetStream resets it to cuBLAS's
    pool, so it is set after each."""
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


# CupyRuntime's note that steps run without graphs, once a process
_said_no_capture = []


class NvmathCublas:
    """cuBLAS through nvmath.bindings.cublas under the names of CuPy's cublas module (the same
    arguments in the same order). CuPy's module refuses any call while a stream captures (its
    setStream raises NotImplementedError before every GEMM), which would keep the step's GEMMs out
    of a CUDA graph; nvmath's bindings call cuBLAS as they are told. setWorkspace is
    cublasSetWorkspace, which CuPy has no binding for."""

    CUBLAS_OP_N, CUBLAS_OP_T = 0, 1                         # cublasOperation_t
    CUBLAS_POINTER_MODE_HOST = 0                            # cublasPointerMode_t

    def __init__(self, bindings):
        b = bindings
        self.bindings = b
        self.create, self.destroy, self.setStream = b.create, b.destroy, b.set_stream
        (self.setPointerMode, self.setMathMode,
         self.setWorkspace) = b.set_pointer_mode, b.set_math_mode, b.set_workspace
        self.sgemm, self.sgemmStridedBatched = b.sgemm, b.sgemm_strided_batched
        self.gemmEx, self.gemmStridedBatchedEx = b.gemm_ex, b.gemm_strided_batched_ex


def load_cublas():
    """NvmathCublas where nvmath-python is installed (GEMMs can be captured), else CuPy's cublas
    module (they cannot: CupyRuntime.captures_gemms is False and the step runs eagerly)."""
    try:
        from nvmath.bindings import cublas as bindings
        return NvmathCublas(bindings)
    except Exception:               # not installed, or no libcublas for it
        from cupy_backends.cuda.libs import cublas
        return cublas


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
    on_gpu = True

    def __init__(self, tf32=False, cupy=None, cublas=None, cublaslt=None, set_workspace=None):
        """cupy, cublas, cublaslt, set_workspace (cublas_set_workspace's function): stand-ins for
        tests (default: the real ones; cublaslt=False: none)."""
        if cupy is None:
            import cupy
        chosen = cublas is None
        if chosen:
            cublas = load_cublas()
        self.cp = cupy
        self.device_id = cupy.cuda.runtime.getDevice()
        try:
            # ours alone: no other code changes its math mode or stream
            self.handle = cublas.create()
        except Exception:
            if not (chosen and isinstance(cublas, NvmathCublas)):
                raise
            # nvmath's bindings found no libcublas to load: CuPy's can
            from cupy_backends.cuda.libs import cublas
            self.handle = cublas.create()
        self.cublas = cublas
        # CuPy's own cublas module refuses calls during stream capture: graphs only
        # with nvmath's bindings
        self.captures_gemms = isinstance(cublas, NvmathCublas)
        if chosen and not self.captures_gemms and not _said_no_capture:
            _said_no_capture.append(True)
            print("gpt2np: nvmath-python unavailable: CuPy's cuBLAS cannot be captured, so steps "
                  "run without CUDA graphs (pip install nvmath-python)", file=sys.stderr)
        self.tf32 = bool(tf32)
        # the stream the handle is set to (set before each GEMM)
        self._stream = None
        cublas.setPointerMode(self.handle, cublas.CUBLAS_POINTER_MODE_HOST)
        cublas.setMathMode(self.handle, math_mode(cublas, self.tf32))
        # host scalars for alpha/beta (pointer mode host: cuBLAS reads them before returning)
        self._alpha = np.zeros(1, np.float32)
        self._beta = np.zeros(1, np.float32)
        # cuBLASLt for the epilogues: its own handle; layouts, descriptor and algorithm
        # cached per GEMM shape
        why = "turned off"
        if cublaslt is None:
            cublaslt, why = load_cublaslt()
        self.lt, self.lt_handle, self._lt_plans, self._workspace = None, None, {}, None
        if cublaslt:
            try:
                self.lt_handle = cublaslt.create()
                self.lt = cublaslt
            except Exception as e:          # no GPU, or a cuBLASLt too old for the bindings
                why = f"{type(e).__name__}: {e}"
        self.epilogues = self.lt is not None
        if not self.epilogues and cublaslt is not False and not _said_no_cublaslt:
            _said_no_cublaslt.append(why)
            print(f"gpt2np: cuBLASLt unavailable ({why}): GEMM epilogues run as separate kernels",
                  file=sys.stderr)
        if set_workspace is None and isinstance(cublas, NvmathCublas):
            set_workspace = cublas.setWorkspace
        self._set_workspace = set_workspace if set_workspace is not None else (
            cublas_set_workspace() if getattr(cupy, "__name__", "") == "cupy" else None)
        self._cublas_workspace = None
        self._staged = []            # (event, pinned memory) of uploads not known to be done yet
        # the stream a capture runs on (CUDA cannot capture the legacy default one)
        self._capture_stream = None
        self._outer_stream = None

    def close(self):
        """Destroy the cuBLAS handle (also done when the runtime is garbage collected)."""
        handle, self.handle = getattr(self, "handle", None), None
        lt_handle, self.lt_handle = getattr(self, "lt_handle", None), None
        try:
            with self.cp.cuda.Device(self.device_id):
                if handle is not None:
                    self.cublas.destroy(handle)
                if lt_handle is not None:
                    for plan in self._lt_plans.values():
                        plan.destroy(self.lt)
                    self.lt.destroy(lt_handle)
        except Exception:              # at interpreter exit the context may be gone already
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
                if self._cublas_workspace is None:
                    self._cublas_workspace = self.cp.empty(CUBLAS_WORKSPACE_BYTES, np.uint8)
                self._set_workspace(self.handle, self._cublas_workspace.data.ptr,
                                    CUBLAS_WORKSPACE_BYTES)

    def stream_ptr(self):
        """The current CUDA stream (cudaStream_t as an int), as NCCL takes it."""
        return self.cp.cuda.get_current_stream().ptr

    def free_memory(self):
        """Bytes a new allocation can still get on this device: the driver's free memory plus what
        CuPy's pool holds unused."""
        free, _total = self.cp.cuda.runtime.memGetInfo()
        return int(free) + int(self.cp.get_default_memory_pool().free_bytes())

    def total_memory(self):
        return int(self.cp.cuda.runtime.memGetInfo()[1])

    def compute_capability(self):
        """The current device's compute capability as an int, e.g. 80 for sm_80."""
        return int(self.cp.cuda.Device().compute_capability)

    def device_name(self):
        props = self.cp.cuda.runtime.getDeviceProperties(self.cp.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    # ---- kernels --------------------------------------------------------------------------
    def compile(self, path: Path, options=()):
        """kernels/<file>.cu -> cupy.RawModule (compiled on first get_function, cached on disk)."""
        path = Path(path)
        return self.cp.RawModule(code=path.read_text(),
                                 options=nvrtc_options(path.parent) + tuple(options))

    def launch(self, function, grid, block, args, shared_mem=0):
        """CuPy passes a Python int as a 64-bit integer and a float as a double: scalars must be
        np.int32 / np.float32 (CudaBackend._launch checks them against the kernel's signature; this
        catches the rest). An np.uint64 is a pointer's 8 bytes: backend.NULL, a null pointer
        argument (AdamW's master weights under -w 0)."""
        for i, a in enumerate(args):
            if isinstance(a, (int, float, np.integer,
                              np.floating)) and type(a) not in (np.int32, np.float32, np.uint64):
                raise TypeError(f"kernel argument {i} is {type(a).__name__} {a}: kernel scalars "
                                "must be np.int32 or np.float32")
        function(grid, block, args, shared_mem=shared_mem)

    # ---- GEMM -----------------------------------------------------------------------------
    def gemm(self, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
             stride_c, batch=1, epilogue="none", bias=None, aux=None, ld_aux=0):
        """Row-major, batched: C[i] (m,n) = alpha op(A[i]) @ op(B[i]) + beta C[i], i < batch.

        op(A) is (m,k): A[i] is stored (m,k) with row stride lda, or (k,m) when transa; likewise
        op(B) (k,n) from B[i] stored (k,n), or (n,k) when transb.

        cuBLAS is column-major: a row-major (r,c) matrix with row stride ld is, to cuBLAS, its
        (c,r) transpose with leading dimension ld. So we ask cuBLAS for C^T = op(B)^T op(A)^T:
        swap the operands and m <-> n; each operand keeps its own transpose flag.
        """
        if epilogue != "none":
            self._lt_gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, batch,
                          epilogue, bias, aux, ld_aux)
            return
        cublas = self.cublas
        op_a = cublas.CUBLAS_OP_T if transa else cublas.CUBLAS_OP_N
        op_b = cublas.CUBLAS_OP_T if transb else cublas.CUBLAS_OP_N
        self._alpha[0] = alpha
        self._beta[0] = beta
        alpha_ptr, beta_ptr = self._alpha.ctypes.data, self._beta.ctypes.data
        self._set_stream()
        if c.dtype != np.float32:
            # bf16 operands (the bf16 build): bf16 tensor cores, fp32 accumulation and fp32
            # alpha/beta, C rounded once; cublasGemmEx's compute type sets the math, so the handle's
            # TF32 mode plays no part
            t = _data_type(c.dtype, a, b)
            if batch == 1:
                cublas.gemmEx(self.handle, op_b, op_a, n, m, k, alpha_ptr, b.data.ptr, t,
                              ldb, a.data.ptr, t, lda,
                              beta_ptr, c.data.ptr, t, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
            else:
                cublas.gemmStridedBatchedEx(self.handle, op_b, op_a, n, m, k, alpha_ptr, b.data.ptr,
                                            t, ldb, stride_b, a.data.ptr, t, lda, stride_a,
                                            beta_ptr, c.data.ptr, t, ldc, stride_c, batch,
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
            return
        if batch == 1:
            cublas.sgemm(self.handle, op_b, op_a, n, m, k, alpha_ptr, b.data.ptr, ldb, a.data.ptr,
                         lda, beta_ptr, c.data.ptr, ldc)
        else:
            cublas.sgemmStridedBatched(self.handle, op_b, op_a, n, m, k, alpha_ptr,
                                       b.data.ptr, ldb, stride_b, a.data.ptr, lda, stride_a,
                                       beta_ptr, c.data.ptr, ldc, stride_c, batch)

    def _lt_gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, batch,
                 epilogue, bias, aux, ld_aux):
        """One GEMM with an epilogue through cublasLtMatmul, row-major as gemm: cuBLASLt computes
        the column-major D (n,m) = op(B)^T op(A)^T in place of C (D and C the same matrix), the
        epilogue reading bias/aux by pointer."""
        if self.lt is None:
            raise RuntimeError(f"gemm epilogue {epilogue}: cuBLASLt is not available "
                               "(CupyRuntime.epilogues is False)")
        check_epilogue(epilogue, m, n, alpha, batch, bias, aux, ld_aux)
        lt = self.lt
        ptrs = {"A": b.data.ptr, "B": a.data.ptr, "C": c.data.ptr, "D": c.data.ptr}
        data_type = _data_type(c.dtype, a, b)
        key = (transa, transb, m, n, k, lda, ldb, ldc, epilogue, ld_aux, data_type,
               tuple(pointer_alignment(p) for p in ptrs.values()))
        plan = self._lt_plans.get(key)
        if plan is None:
            plan = self._lt_plans[key] = LtPlan(lt, self.lt_handle, self.tf32, transa, transb, m, n,
                                                k, lda, ldb, ldc, epilogue, ld_aux, ptrs, data_type)
        plan.set_pointer(lt, MATMUL_DESC_BIAS_POINTER, bias)
        plan.set_pointer(lt, MATMUL_DESC_EPILOGUE_AUX_POINTER, aux)
        if self._workspace is None:
            self._workspace = self.cp.empty(LT_WORKSPACE, np.uint8)
        self._alpha[0] = alpha
        self._beta[0] = beta
        # cublasLtMatmul(handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo,
        # workspace, size, stream): nvmath/bindings/cublasLt.pxd's matmul, every pointer an int
        lt.matmul(self.lt_handle, plan.desc, self._alpha.ctypes.data, ptrs["A"], plan.layouts[0],
                  ptrs["B"], plan.layouts[1], self._beta.ctypes.data, ptrs["C"], plan.layouts[2],
                  ptrs["D"], plan.layouts[2],
                  plan.algo.ctypes.data, self._workspace.data.ptr, LT_WORKSPACE, self.stream_ptr())

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
        """Copy into pinned memory, then an asynchronous copy on the stream: the host never waits.
        The pinned block stays referenced until its copy is done (checked with event queries,
        never waited on)."""
        if self._outer_stream is not None:
            raise RuntimeError("CupyRuntime.upload while capturing: uploads go before "
                               "the graph's launch")
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
        return CupyReadback(host[:array.nbytes].view(array.dtype).reshape(array.shape),
                            event, memory)

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
        """Capture on a stream of our own (the legacy default stream cannot be captured), made
        current until end_capture so that kernels, copies and our cuBLAS handle all go to it. The
        capture stream first waits for the work already queued on the current stream."""
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


class LtPlan:
    """The cuBLASLt objects of one GEMM shape with an epilogue: the three matrix layouts, the matmul
    descriptor (its transposes, compute type, epilogue, aux ld; the bias/aux pointers are set per
    call) and the algorithm the heuristic picks for operands of these alignments."""

    def __init__(self, lt, handle, tf32, transa, transb, m, n, k, lda, ldb, ldc, epilogue, ld_aux,
                 ptrs, data_type=CUDA_R_32F):
        # column-major views of our row-major operands: our B (k,n) [or (n,k) when transb] is
        # cuBLASLt's A, stored (n,k) [(k,n)] with leading dimension ldb; our A is cuBLASLt's B; our
        # C (m,n) is D (n,m), ld ldc. bf16 operands (data_type CUDA_R_16BF): fp32 compute and scale;
        # bias and aux default to D's type, bf16.
        self.layouts = [lt.matrix_layout_create(data_type, *((k, n) if transb else (n, k)), ldb),
                        lt.matrix_layout_create(data_type, *((m, k) if transa else (k, m)), lda),
                        lt.matrix_layout_create(data_type, n, m, ldc)]
        fast = tf32 and data_type == CUDA_R_32F
        self.desc = lt.matmul_desc_create(CUBLAS_COMPUTE_32F_FAST_TF32 if fast
                                          else CUBLAS_COMPUTE_32F, CUDA_R_32F)
        self.set(lt, MATMUL_DESC_TRANSA, CUBLAS_OP_T if transb else CUBLAS_OP_N)
        self.set(lt, MATMUL_DESC_TRANSB, CUBLAS_OP_T if transa else CUBLAS_OP_N)
        self.set(lt, MATMUL_DESC_EPILOGUE, LT_EPILOGUES[epilogue])
        if epilogue in ("gelu_bias", "dgelu"):
            self.set(lt, MATMUL_DESC_EPILOGUE_AUX_LD, ld_aux)
        preference = lt.matmul_preference_create()
        try:
            _set_attribute(lt.matmul_preference_set_attribute,
                           lt.get_matmul_preference_attribute_dtype, preference,
                           MATMUL_PREF_MAX_WORKSPACE_BYTES, LT_WORKSPACE - 256)
            for operand, attr in MATMUL_PREF_MIN_ALIGNMENT_BYTES.items():
                _set_attribute(lt.matmul_preference_set_attribute,
                               lt.get_matmul_preference_attribute_dtype,
                               preference, attr, pointer_alignment(ptrs[operand]))
            # the algo struct is its first field
            self.algo = np.zeros(1, lt.matmul_heuristic_result_dtype)
            count = np.zeros(1, np.int32)
            try:
                lt.matmul_algo_get_heuristic(handle, self.desc, *self.layouts,
                                             self.layouts[2], preference, 1,
                                             self.algo.ctypes.data, count.ctypes.data)
            except Exception:
                # a status such as NOT_SUPPORTED raised, not a count of 0: the same answer
                count[0] = 0
        finally:
            lt.matmul_preference_destroy(preference)
        if count[0] < 1:
            self.destroy(lt)
            raise RuntimeError(f"cuBLASLt has no algorithm for a {m}x{n}x{k} GEMM with the "
                               f"{epilogue} epilogue (ld_aux {ld_aux}); run with --fuse 0")

    def set(self, lt, attr, value):
        _set_attribute(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, self.desc,
                       attr, value)

    def set_pointer(self, lt, attr, array):
        if array is not None:
            self.set(lt, attr, array.data.ptr)

    def destroy(self, lt):
        for layout in self.layouts:
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(self.desc)
        self.layouts = []


def _data_type(dtype, *operands):
    """cudaDataType_t of a GEMM whose operands all have numpy dtype `dtype`
    (float32, or bfloat16)."""
    if any(x.dtype != dtype for x in operands):
        raise ValueError("gemm operands of mixed dtypes "
                         f"({', '.join(str(x.dtype) for x in operands)}, {dtype})")
    if dtype == np.float32:
        return CUDA_R_32F
    if dtype.name == "bfloat16":
        return CUDA_R_16BF
    raise ValueError(f"gemm: no cuBLAS data type for {dtype}")


def _set_attribute(setter, dtype_of, obj, attr, value):
    """setter(obj, attr, buffer address, size): the attribute's value in the C type the
    bindings name for it."""
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.itemsize)
