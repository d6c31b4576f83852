"""The runtime interface the CUDA backend is written against. Two runtimes implement it: CupyRuntime
(runtime_cupy.py: NVRTC + cuBLAS through CuPy, on a GPU) and EmuRuntime (runtime_emu.py: the same
kernels compiled by g++ and run on the CPU emulator, GEMMs in NumPy), so the whole
CUDA path runs in CI.

Arrays are the runtime's own device arrays (CuPy arrays, or NumPy arrays on the emulator); kernels
take them as raw pointers, so they must be C-contiguous. A third runtime, runtime_plan.PlanRuntime,
does no work at all (the planner).

Host syncs (the host waiting for the device): to_host, synchronize, elapsed_ms and
Readback.result(). A training step makes none (gpt2np.train_step); EmuRuntime and PlanRuntime list
the ones made in `syncs`.
"""
from pathlib import Path
from typing import Any, Protocol, Tuple

import numpy as np

from gpt2np.bf16 import BF16


class Event(Protocol):
    def record(self) -> None: """Mark this point of the stream."""


class Readback(Protocol):
    """A device->host copy queued on the stream: nothing waits until result() is called."""
    def done(self) -> bool: """Whether the copy has finished (never waits)."""
    def result(self):
        """The host (NumPy) array; waits for the copy if it has not finished (a host sync)."""


class Graph(Protocol):
    """A captured sequence of launches, GEMMs, copies and fills (a CUDA graph)."""
    def launch(self) -> None:
        """Queue the whole sequence again, with the same arguments (the same buffers)."""


class Function(Protocol):
    """A compiled kernel; launched through Runtime.launch."""


class Module(Protocol):
    def get_function(self, name: str) -> Function: """The extern "C" kernel `name` of the module."""


# GEMM epilogues (Runtime.gemm's `epilogue`), row-major. GELU is GPT-2's tanh form, gelu(x) = 0.5 x
# (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), gelu' its derivative. Single GEMMs
# only (batch 1), alpha 1.
#   "none"       C = alpha op(A) op(B) + beta C
#   "bias"       C = op(A) op(B) + beta C + bias[None, :]
#                bias (n,): one value per column of C
#   "gelu_bias"  aux = op(A) op(B) + beta C + bias[None, :];  C = gelu(aux)
#                aux (m,n) written, row stride ld_aux
#   "dgelu"      C = (op(A) op(B) + beta C) * gelu'(aux)
#                aux (m,n) read: the saved pre-activation
#   "bgrad"      C = op(A) op(B) + beta C;  bias[i] = sum_k op(A)[i, k]
#                bias (m,) written (never added to)
EPILOGUES = ("none", "bias", "gelu_bias", "dgelu", "bgrad")
# GEMM operands and epilogue vectors: fp32, or bf16 (the bf16 build)
BIAS_DTYPES = (np.dtype(np.float32), BF16)


def check_epilogue(epilogue, m, n, alpha, batch, bias, aux, ld_aux):
    """The arguments an epilogue needs (runtime.EPILOGUES): a bias vector of the right
    length, an aux matrix."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"gemm: unknown epilogue {epilogue!r}; known: {', '.join(EPILOGUES)}")
    if epilogue == "none":
        return
    if batch != 1 or alpha != 1.0:
        raise ValueError(f"gemm epilogue {epilogue}: single GEMMs with alpha 1 only (batch "
                         f"{batch}, alpha {alpha})")
    want = m if epilogue == "bgrad" else n
    if epilogue != "dgelu" and (bias is None or bias.size != want or bias.dtype not in BIAS_DTYPES):
        raise ValueError(f"gemm epilogue {epilogue}: needs a float32 or bfloat16 bias vector "
                         f"of {want} elements")
    if epilogue in ("gelu_bias", "dgelu"):
        if aux is None or ld_aux < n:
            raise ValueError(f"gemm epilogue {epilogue}: needs the aux matrix ({m},{n}) "
                             f"with ld_aux >= {n}")


class Runtime(Protocol):
    name: str          # "cupy", "emulator" or "plan"
    tf32: bool         # GEMMs on TF32 tensor cores (else exact fp32)
    epilogues: bool    # gemm takes an epilogue other than "none" (CupyRuntime: when cuBLASLt loads)

    # ---- kernels ----------------------------------------------------------------------
    def compile(self, path: Path, options: Tuple[str, ...] = ()) -> Module:
        """Compile kernels/<file>.cu (with kernels/ on the include path) for the device in hand;
        options: more NVRTC options (CudaBackend passes -DGPT2NP_BF16 for the bf16
        build of a file)."""

    def launch(self, function: Function, grid: Tuple[int, ...], block: Tuple[int, ...],
               args: Tuple[Any, ...], shared_mem: int = 0) -> None:
        """Queue one kernel launch. args: device arrays (passed as pointers), np.int32 and
        np.float32 scalars."""

    def gemm(self, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float, a, lda: int,
             stride_a: int, b, ldb: int, stride_b: int, beta: float, c, ldc: int, stride_c: int,
             batch: int, epilogue: str = "none", bias=None, aux=None, ld_aux: int = 0) -> None:
        """Row-major, strided-batched: C[i] (m,n) = alpha op(A[i]) op(B[i]) + beta C[i], i < batch,
        where op(X) is X or X^T; ld* are row strides (elements), stride_* the distance
        between batch items.
        epilogue (EPILOGUES, batch 1): work done on C as the GEMM writes it, with the bias vector
        and the aux matrix it names."""

    # ---- memory -----------------------------------------------------------------------
    def zeros(self, shape, dtype): """A new zero-filled device array."""
    def empty(self, shape, dtype): """A new uninitialised device array."""
    def from_host(self, array): """A device copy of a host (NumPy) array."""
    def to_host(self, array): """A host (NumPy) copy of a device array (synchronizes)."""
    def upload(self, dst, array):
        """dst[...] = host array (same shape and dtype), queued; `array` may be reused at
    once and the host never waits (CupyRuntime stages it in pinned memory). Not
    allowed while capturing."""
    def read_async(self, array) -> Readback:
        """A host copy of `array` queued now (pinned memory and an event)."""
    def copy(self, dst, src): """dst[...] = src, device to device."""
    def fill(self, array, value): """array[...] = value."""
    def pointer(self, array) -> int: """The device address of the array's first element."""

    # ---- time and the device ----------------------------------------------------------
    def event(self) -> Event: """A timing event (record() it, then elapsed_ms between two)."""
    def elapsed_ms(self, start: Event, end: Event) -> float:
        """Milliseconds between two recorded events."""
    def synchronize(self) -> None: """Wait until all queued work is done."""

    # ---- CUDA graphs ------------------------------------------------------------------
    def begin_capture(self) -> None:
        """From now on launches, GEMMs, copies and fills are recorded, not run, until end_capture.
        The buffers they use must outlive the graph (they are preallocated); nothing may read back
        or wait meanwhile."""

    def end_capture(self) -> Graph:
        """Stop recording; the recorded work as a Graph to launch() any number of times."""
    def device_name(self) -> str: """The GPU's name ("NVIDIA H100 80GB HBM3"), or the emulator's."""
