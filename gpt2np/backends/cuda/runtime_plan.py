"""The planning runtime: the Runtime Protocol with nothing behind it, so CudaBackend, GPT2 and
train_step run their real code (every check, every launch, every GEMM) without a GPU and
without doing any work.

    rt = PlanRuntime("H100 SXM", tf32=True)
    be = CudaBackend(rt)  # GPT2(cfg, be, B, T) + train_step(...): the launches of a real step

What each call does here:
  zeros/empty     float buffers are PlanArrays: shape, dtype and a device address from a bump
                  allocator, no contents (d12 at B=4, T=1024 needs ~10 GB of activations, none of
                  which is allocated); integer buffers (token ids, encoder_backward's token groups)
                  are small real NumPy arrays, so what the host reads of them (the token grouping)
                  is what a real step reads
  from_host       a PlanArray of the host array's shape (integers: a real copy); counted as an
                  upload
  to_host         a host sync: counted in `syncs` (with `where()`, which the planner points at the
                  range stack), returns the integer buffer's contents or zeros of the right shape;
                  so are synchronize and a read_async's result() (an event wait)
  upload          counted as an upload (integers: a real copy), no sync
  begin/end_capture  a PlanGraph; its launch() counts one graph launch (graph_launches)
  copy, fill      nothing (real for two integer arrays)
  compile         a module with every kernel the registry finds in that .cu file
  launch, gemm    nothing but the limits a real launch has: block and grid sizes, GEMM operands
                  large enough for their leading dimensions and batch strides (the emulator's check,
                  on sizes)
  pointer         the PlanArray's address (256-byte aligned allocations, as cudaMalloc's), so
                  alignment checks see what a GPU would
  event, elapsed  no time: 0 ms
Nothing here records launches: the profiler's on_launch hook does (gpt2np.profiling.plan).
"""
from pathlib import Path

import numpy as np

from gpt2np.backends.cuda.backend import KERNELS
from gpt2np.backends.cuda.runtime import BIAS_DTYPES, check_epilogue

ALLOCATION_ALIGNMENT = 256         # cudaMalloc returns 256-byte aligned addresses
# where the planned allocations start (any aligned, non-zero value)
BASE_ADDRESS = 0x7F0000000000
MAX_BLOCK_THREADS = 1024
GRID_X_LIMIT = 2 ** 31 - 1
GRID_YZ_LIMIT = 65535


class PlanFlags:
    """The flags of a PlanArray: planned arrays are always C-contiguous (views cut
    whole leading rows)."""
    c_contiguous = True
    f_contiguous = False


class PlanArray:
    """A device array that is never allocated: shape, dtype and address only. Supports what the
    model and the backend do with device arrays: size, ndim, nbytes, reshape, leading-axis integer
    and slice indexing (views sharing the address range), flags.c_contiguous. Anything that needs
    contents (np.asarray) raises."""

    __slots__ = ("shape", "dtype", "address")
    flags = PlanFlags()

    def __init__(self, shape, dtype, address):
        self.shape = tuple(int(d)
                           for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        self.dtype = np.dtype(dtype)
        self.address = int(address)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d planned array")
        return self.shape[0]

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = [int(d) for d in shape]
        if shape.count(-1) > 1:
            raise ValueError("can only specify one unknown dimension")
        if -1 in shape:
            known = 1
            for d in shape:
                if d != -1:
                    known *= d
            if known == 0 or self.size % known:
                raise ValueError(f"cannot reshape a planned array of size {self.size} into "
                                 f"shape {tuple(shape)}")
            shape[shape.index(-1)] = self.size // known
        new = PlanArray(shape, self.dtype, self.address)
        if new.size != self.size:
            raise ValueError(f"cannot reshape a planned array of size {self.size} into "
                             f"shape {tuple(shape)}")
        return new

    def __getitem__(self, key):
        if not self.shape:
            raise IndexError("a 0-d planned array cannot be indexed")
        rows, row = self.shape[0], self.size // self.shape[0] if self.shape[0] else 0
        step = row * self.dtype.itemsize
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            i = int(key) + (rows if key < 0 else 0)
            if not 0 <= i < rows:
                raise IndexError(f"index {int(key)} is out of bounds for axis 0 with size {rows}")
            return PlanArray(self.shape[1:], self.dtype, self.address + i * step)
        if isinstance(key, slice):
            start, stop, stride = key.indices(rows)
            if stride != 1:
                raise TypeError("planned arrays take slices with step 1 only (views "
                                "stay contiguous)")
            n = max(0, stop - start)
            return PlanArray((n,) + self.shape[1:], self.dtype, self.address + start * step)
        raise TypeError("planned arrays take an integer or a slice on their first "
                        f"axis, not {key!r}")

    def __array__(self, *args, **kwargs):
        raise TypeError("a planned array has no contents (the planning runtime allocates nothing)")

    def __repr__(self):
        return f"PlanArray(shape={self.shape}, dtype={self.dtype}, address={self.address:#x})"


class PlanFunction:
    """A kernel of the registry; launching it does nothing."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"PlanFunction({self.name})"


class PlanModule:
    """kernels/<stem>.cu as the registry reads it: every extern "C" __global__
    function defined there."""

    def __init__(self, stem, kernels):
        self.stem = stem
        self._names = {name for name, where in kernels.items() if where == stem}

    def get_function(self, name):
        if name not in self._names:
            raise KeyError(f"kernels/{self.stem}.cu defines no kernel {name!r}")
        return PlanFunction(name)


class PlanEvent:
    def record(self):
        pass

    def synchronize(self):
        pass


class PlanReadback:
    """A planned device->host copy: result() is a host sync (listed in the runtime's syncs)."""

    def __init__(self, runtime, array):
        self.runtime, self.array = runtime, array

    def done(self):
        return False

    def result(self):
        self.runtime._sync("event_wait", self.array)
        if _is_planned(self.array):
            return np.zeros(self.array.shape, self.array.dtype)
        return np.array(self.array, copy=True)


class PlanGraph:
    """A captured step: launching it counts one graph launch."""

    def __init__(self, runtime, launches):
        self.runtime, self.launches = runtime, launches

    def launch(self):
        self.runtime.graph_launches += 1


def _is_planned(array) -> bool:
    return isinstance(array, PlanArray)


class PlanRuntime:
    """The Runtime Protocol doing no work (see the module docstring). device: the GPU's name the
    plan is for; tf32: GEMMs on TF32 tensor cores (CudaBackend.precision reads it)."""

    name = "plan"
    on_gpu = False            # plans for a GPU, runs nothing
    epilogues = True          # plans the cuBLASLt path (bias, GELU, dGELU, bias-gradient epilogues)

    def __init__(self, device="H100", tf32=True):
        self.device = str(device)
        self.tf32 = bool(tf32)
        self.syncs = []                   # host syncs: {"kind", "bytes", "shape", "dtype", "where"}
        self.uploads = 0                  # from_host calls
        self.allocated = 0                # bytes handed out (nothing is ever freed)
        self.where = lambda: ""           # the planner points this at the range stack
        self.graph_launches = 0           # CUDA graph launches (a captured step is one)
        self._capturing = None            # launches recorded while capturing, else None
        self._next = BASE_ADDRESS

    def _sync(self, kind, array=None):
        nbytes = 0 if array is None else int(array.size) * int(array.dtype.itemsize)
        self.syncs.append({"kind": kind, "bytes": nbytes,
                           "shape": () if array is None else tuple(array.shape),
                           "dtype": "" if array is None else str(array.dtype),
                           "where": self.where()})

    # ---- CUDA graphs ----------------------------------------------------------------------
    def begin_capture(self):
        self._capturing = 0

    def end_capture(self):
        launches, self._capturing = self._capturing, None
        return PlanGraph(self, launches)

    def device_name(self):
        return self.device

    # ---- kernels --------------------------------------------------------------------------
    def compile(self, path: Path, options=()):
        return PlanModule(Path(path).stem, KERNELS)

    def launch(self, function, grid, block, args, shared_mem=0):
        if not isinstance(function, PlanFunction):
            raise TypeError(f"PlanRuntime.launch: {function!r} is not a kernel of this runtime")
        grid, block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        threads = 1
        for b in block:
            threads *= b
        if not (1 <= len(block) <= 3 and all(b >= 1 for b in block)
                and threads <= MAX_BLOCK_THREADS):
            raise ValueError(f"kernel {function.name}: block {block} is not "
                             f"1..{MAX_BLOCK_THREADS} threads")
        limits = (GRID_X_LIMIT, GRID_YZ_LIMIT, GRID_YZ_LIMIT)
        if not (1 <= len(grid) <= 3 and all(1 <= g <= lim for g, lim in zip(grid, limits))):
            raise ValueError(f"kernel {function.name}: grid {grid} is outside CUDA's limits "
                             f"(x <= {GRID_X_LIMIT}, y, z <= {GRID_YZ_LIMIT}, all >= 1)")
        if self._capturing is not None:
            self._capturing += 1

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
             stride_c, batch=1, epilogue="none", bias=None, aux=None, ld_aux=0):
        if len({a.dtype, b.dtype, c.dtype}) != 1:
            raise ValueError(f"gemm operands of mixed dtypes ({a.dtype}, {b.dtype}, {c.dtype})")
        _check_operand(a, batch, (k, m) if transa else (m, k), lda, stride_a, "A")
        _check_operand(b, batch, (n, k) if transb else (k, n), ldb, stride_b, "B")
        _check_operand(c, batch, (m, n), ldc, stride_c, "C")
        check_epilogue(epilogue, m, n, alpha, batch, bias, aux, ld_aux)
        if aux is not None:
            _check_operand(aux, 1, (m, n), ld_aux, 0, "aux")

    # ---- memory ---------------------------------------------------------------------------
    def _allocate(self, shape, dtype):
        dtype = np.dtype(dtype)
        # token ids and groups: small, and the host reads them
        if dtype.kind in "iu":
            return np.zeros(shape, dtype)
        array = PlanArray(shape, dtype, self._next)
        self.allocated += array.nbytes
        self._next += -(-max(array.nbytes, 1) // ALLOCATION_ALIGNMENT) * ALLOCATION_ALIGNMENT
        return array

    def zeros(self, shape, dtype):
        return self._allocate(shape, dtype)

    def empty(self, shape, dtype):
        return self._allocate(shape, dtype)

    def from_host(self, array):
        array = np.asarray(array)
        self.uploads += 1
        out = self._allocate(array.shape, array.dtype)
        if not _is_planned(out):
            out[...] = array
        return out

    def upload(self, dst, array):
        array = np.asarray(array)
        self.uploads += 1
        if not _is_planned(dst):
            np.copyto(dst, array)

    def read_async(self, array):
        return PlanReadback(self, array)

    def to_host(self, array):
        self._sync("to_host", array)
        if _is_planned(array):
            return np.zeros(array.shape, array.dtype)
        return np.array(array, copy=True)

    def copy(self, dst, src):
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"copy: shapes {tuple(dst.shape)} and {tuple(src.shape)} differ")
        if not (_is_planned(dst) or _is_planned(src)):
            np.copyto(dst, src)

    def fill(self, array, value):
        if not _is_planned(array):
            array.fill(value)

    def pointer(self, array):
        if _is_planned(array):
            return array.address
        return array.__array_interface__["data"][0]

    # ---- time and the device --------------------------------------------------------------
    def event(self):
        return PlanEvent()

    def elapsed_ms(self, start, end):
        return 0.0

    def synchronize(self):
        self._sync("synchronize")


def _check_operand(array, batch, shape, ld, stride, what):
    """The emulator's GEMM operand check on sizes: `batch` (rows, cols) matrices with row stride ld
    and batch stride `stride` must fit in the array."""
    if array.dtype not in BIAS_DTYPES:
        raise ValueError(f"gemm operand {what} must be a float32 or bfloat16 array, "
                         f"got {array.dtype}")
    rows, cols = shape
    extent = (batch - 1) * stride + (rows - 1) * ld + cols if batch and rows and cols else 0
    if extent > array.size or ld < cols:
        raise ValueError(f"gemm operand {what}: {batch}x({rows},{cols}) with ld={ld}, "
                         f"stride={stride} needs {extent} elements, the array has {array.size}")
