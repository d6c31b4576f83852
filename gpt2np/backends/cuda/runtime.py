"""The runtime interface the CUDA backend is written against. Two runtimes implement it: CupyRuntime
(runtime_cupy.py: NVRTC + cuBLAS through CuPy, on a GPU) and EmuRuntime (runtime_emu.py: the same kernels
compiled by g++ and run on the CPU emulator, GEMMs in NumPy), so the whole CUDA path runs in CI.

Arrays are the runtime's own device arrays (CuPy arrays, or NumPy arrays on the emulator); kernels take
them as raw pointers, so they must be C-contiguous.
"""
from pathlib import Path
from typing import Any, Protocol, Tuple


class Event(Protocol):
    def record(self) -> None: """Mark this point of the stream."""


class Function(Protocol):
    """A compiled kernel; launched through Runtime.launch."""


class Module(Protocol):
    def get_function(self, name: str) -> Function: """The extern "C" kernel `name` of the module."""


# GEMM epilogues (Runtime.gemm's `epilogue`), row-major. GELU is GPT-2's tanh form, gelu(x) = 0.5 x (1 +
# tanh(sqrt(2/pi) (x + 0.044715 x^3))), gelu' its derivative. Single GEMMs only (batch 1), alpha 1.
#   "none"       C = alpha op(A) op(B) + beta C
#   "bias"       C = op(A) op(B) + beta C + bias[None, :]           bias (n,): one value per column of C
#   "gelu_bias"  aux = op(A) op(B) + beta C + bias[None, :];  C = gelu(aux)     aux (m,n), row stride ld_aux
#   "dgelu"      C = (op(A) op(B) + beta C) * gelu'(aux)           aux (m,n) read: the saved pre-activation
#   "bgrad"      C = op(A) op(B) + beta C;  bias[i] = sum_k op(A)[i, k]   bias (m,) written (never added to)
EPILOGUES = ("none", "bias", "gelu_bias", "dgelu", "bgrad")


class Runtime(Protocol):
    name: str          # "cupy" or "emulator"
    tf32: bool         # GEMMs on TF32 tensor cores (else exact fp32)
    epilogues: bool    # gemm takes an epilogue other than "none" (CupyRuntime: when cuBLASLt loads)

    # ---- kernels ----------------------------------------------------------------------
    def compile(self, path: Path) -> Module:
        """Compile kernels/<file>.cu (with kernels/ on the include path) for the device in hand."""

    def launch(self, function: Function, grid: Tuple[int, ...], block: Tuple[int, ...], args: Tuple[Any, ...],
               shared_mem: int = 0) -> None:
        """Queue one kernel launch. args: device arrays (passed as pointers), np.int32 and np.float32 scalars."""

    def gemm(self, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float, a, lda: int, stride_a: int,
             b, ldb: int, stride_b: int, beta: float, c, ldc: int, stride_c: int, batch: int,
             epilogue: str = "none", bias=None, aux=None, ld_aux: int = 0) -> None:
        """Row-major, strided-batched: C[i] (m,n) = alpha op(A[i]) op(B[i]) + beta C[i], i < batch, where
        op(X) is X or X^T; ld* are row strides (elements), stride_* the distance between batch items.
        epilogue (EPILOGUES, batch 1): work done on C as the GEMM writes it, with the bias vector and the aux
        matrix it names."""

    # ---- memory -----------------------------------------------------------------------
    def zeros(self, shape, dtype): """A new zero-filled device array."""
    def empty(self, shape, dtype): """A new uninitialised device array."""
    def from_host(self, array): """A device copy of a host (NumPy) array."""
    def to_host(self, array): """A host (NumPy) copy of a device array (synchronizes)."""
    def copy(self, dst, src): """dst[...] = src, device to device."""
    def fill(self, array, value): """array[...] = value."""
    def pointer(self, array) -> int: """The device address of the array's first element."""

    # ---- time and the device ----------------------------------------------------------
    def event(self) -> Event: """A timing event (record() it, then elapsed_ms between two)."""
    def elapsed_ms(self, start: Event, end: Event) -> float: """Milliseconds between two recorded events."""
    def synchronize(self) -> None: """Wait until all queued work is done."""
    def device_name(self) -> str: """The GPU's name ("NVIDIA H100 80GB HBM3"), or the emulator's."""
