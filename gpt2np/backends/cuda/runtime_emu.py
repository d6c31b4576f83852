"""The emulator runtime: CudaBackend's kernels on the CPU, for tests without a GPU.

Memory is NumPy arrays, each device allocation in its own mapping against a PROT_NONE guard page
(after its last byte or before its first: `guard`, see emulator.device_array), so out-of-bounds
kernels fault; kernels are compiled and run by gpt2np.backends.cuda.emulator.EmuModule (every CUDA
thread a fiber, `schedule` "forward" or "reverse" picks the order threads are run in, which shakes
out races); GEMMs are np.matmul over strided views with cuBLAS's semantics; timing is
time.perf_counter. Same interface as runtime_cupy.CupyRuntime (see gpt2np.backends.cuda.backend).

TF32 (EmuRuntime(tf32=True)): the GEMM inputs A and B are rounded to TF32 (10-bit mantissa, round to
nearest with ties away from zero: round_to_tf32) and multiplied with fp32 accumulation, as TF32
tensor cores do; C (the accumulator, beta != 0) and alpha/beta stay fp32. Why this rounding: cuBLAS
is closed source, but CUTLASS, whose tensor-op kernels cuBLAS's derive from, converts fp32 to tf32
with PreferredRoundingMode<tfloat32_t, float> = round_half_ulp_truncate (add half a TF32 ulp, drop
the 13 low bits), the same as PTX's cvt.rna.tf32.f32. A kernel that fed raw fp32 bits (truncation)
would differ by at most one TF32 ulp per input (2^-10 relative instead of 2^-11); tests/test_tf32.py
bounds the error so that either passes.

Epilogues (runtime.EPILOGUES): applied in NumPy float32 to the fp32 product, after the TF32 rounding
of the inputs (the epilogue's own math is fp32 on the GPU too); GELU and its derivative are written
as numpy_backend's gelu_forward / gelu_backward compute them. The bias gradient ("bgrad") sums the
fp32 values of op(A) (cuBLASLt's order of that sum is not documented; a kernel's order
differs in the last bits).

bf16 operands (the bf16 build, CUBLAS_COMPUTE_32F with CUDA_R_16BF matrices): A, B and C are upcast
(exactly), the product and the epilogue computed in fp32 as above, and each bf16 output (C, the aux
matrix) rounded once to nearest even; the bias vector is bf16 or fp32 (a bias gradient is written in
its own dtype). GELU's output is computed from the fp32 pre-activation, before aux is rounded, as
cuBLASLt's fused epilogue does.
"""
import time
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import as_strided

from gpt2np.backends.cuda.emulator import EmuModule, device_array, guard_mode, resolve_wmma_layout
from gpt2np.backends.cuda.runtime import BIAS_DTYPES, check_epilogue
from gpt2np.ops.reference.gelu import GELU_CUBE, GELU_SCALE, gelu_forward


class EmuEvent:
    """A point in time (perf_counter seconds), recorded by record()."""

    def __init__(self):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class EmuReadback:
    """A read-back: the copy is taken when queued (the emulator runs everything at once); result()
    is still a host wait on a GPU, so it is listed in the runtime's syncs."""

    def __init__(self, runtime, value):
        self.runtime, self.value = runtime, value

    def done(self):
        return True

    def result(self):
        self.runtime._sync("event_wait", self.value)
        return self.value


class EmuGraph:
    """The launches, GEMMs, copies and fills recorded between begin_capture and end_capture,
    replayed in order with the same arguments (the same arrays: every buffer a step uses
    is preallocated)."""

    def __init__(self, runtime, work):
        self.runtime, self.work = runtime, tuple(work)

    def launch(self):
        if self.runtime._capture is not None:
            raise RuntimeError("EmuGraph.launch while capturing")
        self.runtime.graph_launches += 1
        for run in self.work:
            run()

    def __len__(self):
        return len(self.work)


def round_to_tf32(x):
    """float32 array -> a float32 copy rounded to TF32 (1 sign, 8 exponent, 10 mantissa bits): round
    to nearest, ties away from zero (add half a TF32 ulp, 0x1000, to the bits, clear the 13 low
    bits). Inf and NaN are kept as they are; a value within half a TF32 ulp of FLT_MAX rounds to
    inf, as the hardware conversion does."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x)


class EmuRuntime:
    """Runs kernels on the CPU emulator; arrays are NumPy arrays."""

    name = "emulator"
    on_gpu = False
    # bias, GELU, dGELU and bias-gradient epilogues, in NumPy after the product
    epilogues = True
    # GEMMs in exact fp32 NumPy; EmuRuntime(tf32=True) rounds their inputs to TF32
    tf32 = False

    def __init__(self, schedule=None, guard=None, tf32=False, wmma_layout=None, wmma_tf32=True):
        """schedule: "forward", "reverse", or None for the emulator's default
        ($GPT2NP_EMU_SCHEDULE or forward).
        guard: where each device allocation's PROT_NONE guard page goes: "after" (the last byte
        touches it, so an overrun faults), "before" (the first byte follows it: underruns fault) or
        "off" (plain NumPy arrays); None for $GPT2NP_EMU_GUARD or "after". See
        emulator.device_array.
        tf32: round the GEMM inputs to TF32 as tensor cores do (see the module docstring).
        wmma_layout: the element layout of WMMA fragments in kernels (0 natural, any other integer a
        seeded permutation; None for $GPT2NP_EMU_WMMA_LAYOUT or 0): results must not depend on it.
        wmma_tf32: kernels' WMMA (tensor core) inputs are TF32, as on every GPU; False computes them
        in fp32, a test aid that checks a kernel's algorithm to fp32 rounding
        (emu/include/mma.h)."""
        if schedule not in (None, "forward", "reverse"):
            raise ValueError("EmuRuntime: schedule must be 'forward' or 'reverse', "
                             f"got {schedule!r}")
        self.schedule = schedule
        self.wmma_layout = resolve_wmma_layout(wmma_layout)
        self.wmma_tf32 = bool(wmma_tf32)
        self.tf32 = bool(tf32)
        self.guard = guard_mode(guard)
        # host syncs: {"kind", "bytes"} (to_host, synchronize, elapsed, event_wait)
        self.syncs = []
        self.graph_launches = 0
        self._capture = None           # the work recorded while capturing (a list), else None

    def _sync(self, kind, array=None):
        if self._capture is not None:
            raise RuntimeError(f"EmuRuntime: a host sync ({kind}) while capturing a graph")
        self.syncs.append({"kind": kind,
                           "bytes": 0 if array is None else int(np.asarray(array).nbytes)})

    def _queue(self, run):
        """Run now, or record for the graph being captured."""
        if self._capture is None:
            run()
        else:
            self._capture.append(run)

    # ---- CUDA graphs ----------------------------------------------------------------------
    def begin_capture(self):
        if self._capture is not None:
            raise RuntimeError("EmuRuntime.begin_capture: already capturing")
        self._capture = []

    def end_capture(self):
        if self._capture is None:
            raise RuntimeError("EmuRuntime.end_capture without begin_capture")
        work, self._capture = self._capture, None
        return EmuGraph(self, work)

    def device_name(self):
        return "cpu"

    # ---- kernels --------------------------------------------------------------------------
    def compile(self, path: Path, options=()):
        """Compile kernels/<file>.cu (its directory is the include path; options: -D/-U/-I as
        NVRTC's) -> module."""
        path = Path(path)
        return EmuModule(path.read_text(), tuple(options), include_dirs=(str(path.parent),),
                         schedule=self.schedule, name=path.name,
                         wmma_layout=self.wmma_layout, wmma_tf32=self.wmma_tf32)

    def launch(self, function, grid, block, args, shared_mem=0):
        args = tuple(args)
        self._queue(lambda: function(grid, block, args, shared_mem=shared_mem))

    # ---- GEMM -----------------------------------------------------------------------------
    def gemm(self, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
             stride_c, batch=1, epilogue="none", bias=None, aux=None, ld_aux=0):
        """Row-major, batched: C[i] (m,n) = alpha op(A[i]) @ op(B[i]) + beta C[i], i < batch.

        op(A) is (m,k): A[i] is stored (m,k) with row stride lda, or (k,m) when transa. Likewise
        op(B) (k,n) from B[i] stored (k,n), or (n,k) when transb. Matrix i starts stride_* elements
        after matrix i-1 of the same operand.
        """
        self._queue(lambda: self._gemm(transa, transb, m, n, k, alpha, a, lda, stride_a, b,
                                       ldb, stride_b, beta, c,
                                       ldc, stride_c, batch, epilogue, bias, aux, ld_aux))

    def _gemm(self, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c,
              ldc, stride_c, batch, epilogue="none", bias=None, aux=None, ld_aux=0):
        if len({a.dtype, b.dtype, c.dtype}) != 1:
            raise ValueError(f"gemm operands of mixed dtypes ({a.dtype}, {b.dtype}, {c.dtype})")
        A = _matrices(a, batch, (k, m) if transa else (m, k), lda, stride_a, "A")
        B = _matrices(b, batch, (n, k) if transb else (k, n), ldb, stride_b, "B")
        Cm = _matrices(c, batch, (m, n), ldc, stride_c, "C")
        if transa:
            A = A.transpose(0, 2, 1)
        if transb:
            B = B.transpose(0, 2, 1)
        # bf16: fp32 math on exact upcasts, C rounded once
        if c.dtype != np.float32:
            A, B = A.astype(np.float32), B.astype(np.float32)
            C32 = Cm.astype(np.float32)
            self._gemm_fp32(A, B, A, alpha, beta, C32, m, n, batch, epilogue, bias, aux, ld_aux)
            np.copyto(Cm, C32, casting="unsafe")
            return
        exact_a = A
        if self.tf32:
            A, B = round_to_tf32(A), round_to_tf32(B)
        self._gemm_fp32(A, B, exact_a, alpha, beta, Cm, m, n, batch, epilogue, bias, aux, ld_aux)

    def _gemm_fp32(self, A, B, exact_a, alpha, beta, Cm, m, n, batch, epilogue, bias, aux, ld_aux):
        """Cm (batch,m,n) fp32 = alpha A @ B + beta Cm, or the epilogue's result (exact_a: A before
        TF32 rounding, what a bias gradient sums)."""
        prod = np.matmul(A, B)
        if epilogue != "none":
            self._epilogue(epilogue, prod[0], exact_a[0], beta, Cm[0], m, n, alpha, batch, bias,
                           aux, ld_aux)
            return
        if alpha != 1.0:
            prod *= np.float32(alpha)
        if beta == 0.0:
            Cm[...] = prod
        else:
            if beta != 1.0:
                Cm *= np.float32(beta)
            Cm += prod

    @staticmethod
    def _epilogue(epilogue, prod, A, beta, C, m, n, alpha, batch, bias, aux, ld_aux):
        """C (m,n) = epilogue(prod + beta C): see runtime.EPILOGUES."""
        check_epilogue(epilogue, m, n, alpha, batch, bias, aux, ld_aux)
        if beta != 0.0:
            prod += np.float32(beta) * C
        if epilogue == "bias":
            np.add(prod, bias.astype(np.float32, copy=False), out=C)
        elif epilogue == "gelu_bias":
            aux_view = _matrices(aux, 1, (m, n), ld_aux, 0, "aux")[0]
            pre = prod + bias.astype(np.float32, copy=False)
            # bf16 aux: rounded once; gelu reads the fp32 pre
            np.copyto(aux_view, pre, casting="unsafe")
            C[...] = gelu(pre)
        elif epilogue == "dgelu":
            pre = _matrices(aux, 1, (m, n), ld_aux, 0, "aux")[0].astype(np.float32, copy=False)
            np.multiply(prod, gelu_grad(pre), out=C)
        else:                                              # bgrad: the row sums of op(A) (m,k)
            C[...] = prod
            np.copyto(bias.reshape(m), np.sum(A, axis=1, dtype=np.float32), casting="unsafe")

    # ---- memory ---------------------------------------------------------------------------
    def zeros(self, shape, dtype):
        if self.guard == "off":
            return np.zeros(shape, dtype)
        # guarded (fresh mappings are zero-filled)
        return device_array(shape, dtype, self.guard)

    def empty(self, shape, dtype):
        if self.guard == "off":
            return np.empty(shape, dtype)
        return self.zeros(shape, dtype)

    def from_host(self, array):
        if self.guard == "off":
            return np.array(array, copy=True, order="C")
        array = np.asarray(array)
        out = self.zeros(array.shape, array.dtype)
        out[...] = array
        return out

    def to_host(self, array):
        self._sync("to_host", array)
        return np.array(array, copy=True)

    def upload(self, dst, array):
        if self._capture is not None:
            raise RuntimeError("EmuRuntime.upload while capturing: uploads go before "
                               "the graph's launch")
        np.copyto(dst, array)

    def read_async(self, array):
        if self._capture is not None:
            raise RuntimeError("EmuRuntime.read_async while capturing")
        return EmuReadback(self, np.array(array, copy=True))

    def copy(self, dst, src):
        self._queue(lambda: np.copyto(dst, src))

    def fill(self, array, value):
        self._queue(lambda: array.fill(value))

    def pointer(self, array):
        return array.__array_interface__["data"][0]

    # ---- time -----------------------------------------------------------------------------
    def event(self):
        return EmuEvent()

    def elapsed_ms(self, start, end):
        self._sync("elapsed")
        return (end.t - start.t) * 1e3

    def synchronize(self):
        self._sync("synchronize")


def gelu(x):
    """GPT-2's GELU (tanh form) in float32, the reference gelu_forward's operations."""
    y = np.empty_like(x)
    gelu_forward(y, x)
    return y


def gelu_grad(x):
    """gelu'(x) in float32, the reference gelu_backward's operations."""
    x2 = np.multiply(x, x)
    th = np.tanh(GELU_SCALE * ((x2 * np.float32(GELU_CUBE) + 1.0) * x))
    slope = ((x2 * np.float32(3.0 * GELU_CUBE) + 1.0) * np.float32(GELU_SCALE * 0.5) * x
             * (1.0 - th * th))
    return (slope + (th + 1.0) * 0.5).astype(np.float32, copy=False)


def _matrices(array, batch, shape, ld, stride, what):
    """(batch, rows, cols) strided view of the float32 (or bfloat16) memory starting at
    array's first element."""
    if array.dtype not in BIAS_DTYPES or not array.flags.c_contiguous:
        raise ValueError(f"gemm operand {what} must be a contiguous float32 or bfloat16 array")
    rows, cols = shape
    extent = (batch - 1) * stride + (rows - 1) * ld + cols if batch and rows and cols else 0
    if extent > array.size or ld < cols:
        raise ValueError(f"gemm operand {what}: {batch}x({rows},{cols}) with ld={ld}, "
                         f"stride={stride} needs {extent} elements, the array has {array.size}")
    flat = array.reshape(-1)
    item = flat.itemsize
    return as_strided(flat, shape=(batch, rows, cols), strides=(stride * item, ld * item, item))
