"""The CUDA backend: the op contract on hand-written kernels (kernels/*.cu) plus cuBLAS GEMMs.

Written once against a small runtime interface (runtime.Runtime: compile, launch, gemm, memory,
events), so the same code drives a real GPU (runtime_cupy.CupyRuntime: NVRTC + cuBLAS through CuPy)
and the CPU emulator used by the tests (runtime_emu.EmuRuntime).

Every kernel launch goes through CudaBackend._launch and every GEMM through CudaBackend._gemm,
each with a name and the term of its op's cost it carries (backends.contract: the op's cost is one
formula there, a sum of named terms; helper kernels such as a reduction's
finishing stage carry none).
Set `on_launch` to observe them: on_launch(name, kind, term, run) is called instead of running the
work, with kind "kernel" or "gemm", and must call run() exactly once (a measuring profiler times it:
under CUPTI, else between events).

Kernel arguments: arrays are passed as device pointers (they must be C-contiguous), scalars as
np.int32 / np.float32. Every launch is checked against the kernel's signature read from its .cu file
(KERNEL_SIGNATURES): the count, a scalar's exact type (CuPy would pass a Python float as a double
and a Python int as 64 bits, and the kernel would read garbage), an array's dtype against the
pointer's element type; a mismatch is a KernelArgumentError on every runtime. Shapes follow the op
contract (B, T, C, OC, NH, HS = C/NH, V, Vp).

Launch tuning (the attributes listed in LAUNCH_SETTINGS) is checked when set: block sizes are
multiples of 32 and at most 1024 threads (kernels/common.cuh's convention), counts are positive,
gridDim.y at most 65535.

Memory: memory_needed() adds up what a training run of a model allocates on the device (the model's
flat buffers from gpt2np.tensors, its gradient scratch, AdamW's moments, this backend's scratch),
and check_memory_fits() compares that with the device's free memory before anything is allocated, so
a batch that does not fit ends in one line naming the largest B that does (DeviceMemoryError), not
in CuPy's traceback.
Limits checked here, each with a one-line KernelArgumentError (a ValueError): buffers indexed
with int must have < 2^31 elements; encoder_forward needs C % 4 == 0 and 4-element alignment (16
bytes in fp32); encoder_backward needs token ids in [0, Vp) (checked on the host copy grouped by
_group_tokens: the one upload_tokens had when it filled inp, as the device step does, else inp read
back to the host, a sync).
"""
import math
import re
from pathlib import Path

import numpy as np

from gpt2np.backends.cuda.runtime import Runtime
from gpt2np.bf16 import BF16
from gpt2np.paths import KERNEL_DIR
from gpt2np.tensors import FP32_ACTIVATIONS, activation_shapes, num_parameters

# An entry point: extern "C" __global__ void [__launch_bounds__(...)] name(
KERNEL_ENTRY = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


def kernel_registry(kernel_dir=KERNEL_DIR):
    """{kernel name: the stem of the kernels/<stem>.cu that defines it}, read from the
    files themselves."""
    registry = {}
    for path in sorted(Path(kernel_dir).glob("*.cu")):
        for name in KERNEL_ENTRY.findall(path.read_text()):
            if name in registry:
                raise ValueError(f"{path}: kernel {name} is also defined in {registry[name]}.cu")
            registry[name] = path.stem
    return registry


KERNELS = kernel_registry()
KERNEL_FILES = tuple(sorted(set(KERNELS.values())))

# An entry point with its parameter list
KERNEL_DEFINITION = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)')
# A floatX* parameter: an array of the backend's storage dtype (float32, or
# bfloat16 in the bf16 build)
STORAGE = "floatX"
# a parameter's C type -> what the Python side passes: a dtype's array for pointers,
# an exact scalar type
PARAMETER_KINDS = {"float*": np.dtype(np.float32), "int*": np.dtype(np.int32), "float": np.float32,
                   "int": np.int32, "floatX*": STORAGE}
# A null pointer argument (AdamW's master weights under -w 0): CuPy passes an 8-byte integer as the
# pointer's value (None it does not turn into NULL), the emulator takes the integer 0
NULL = np.uint64(0)
# what -r N recomputes (the up-front memory check suggests it when it keeps the asked B)
RECOMPUTE_HINT = {1: "the GELU outputs recomputed", 2: "the GELU and LayerNorm outputs recomputed"}
# NVRTC options of the bf16 build of every kernel file (kernels/common.cuh: floatX = __nv_bfloat16)
BF16_OPTIONS = ("-DGPT2NP_BF16=1",)


def kernel_signatures(kernel_dir=KERNEL_DIR):
    """{kernel name: (parameter kinds...)} read from kernels/*.cu: np.dtype(float32/int32) for a
    float*/int* pointer (const and __restrict__ dropped), STORAGE for a floatX* pointer (the
    backend's dtype), np.float32 / np.int32 for a float / int scalar."""
    signatures = {}
    for path in sorted(Path(kernel_dir).glob("*.cu")):
        for name, params in KERNEL_DEFINITION.findall(path.read_text()):
            kinds = []
            for param in filter(None, (" ".join(p.split()) for p in params.split(","))):
                words = [w for w in re.findall(r"\w+|\*", param)
                         if w not in ("const", "__restrict__")][:-1]
                ctype = "".join(words) if words[-1:] == ["*"] else " ".join(words)
                if ctype not in PARAMETER_KINDS:
                    raise ValueError(f"{path}: kernel {name}: parameter {param!r} of a type the "
                                     f"launcher does not know ({ctype}); kernels take "
                                     "float*/floatX*/int* pointers and int/float scalars")
                kinds.append(PARAMETER_KINDS[ctype])
            signatures[name] = tuple(kinds)
    return signatures


KERNEL_SIGNATURES = kernel_signatures()

INT_LIMIT = 2 ** 31 - 1
# adamw_update_device's scalars: gpt2np.model.STEP_SCALARS (kernels/adamw.cu's SCALAR_*)
STEP_SCALAR_SLOTS = 6
GRID_Y_LIMIT = 65535  # gridDim.y (and .z) maximum
MAX_BLOCK = 1024      # threads per block

# launch setting -> (smallest, largest, multiple of, what it is)
LAUNCH_SETTINGS = {
    "elementwise_threads": (32, MAX_BLOCK, 32, "threads per block of the elementwise kernels"),
    "row_warps": (1, MAX_BLOCK // 32, 1, "warps (rows) per block of the row kernels"),
    "classifier_threads": (32, MAX_BLOCK, 32, "most threads per block of fused_classifier"),
    "reduce_warps": (1, MAX_BLOCK // 32, 1, "warps per block of the column reductions"),
    "reduce_rows_per_chunk": (1, INT_LIMIT, 1, "rows per chunk of the column reductions"),
    "norm_threads": (32, MAX_BLOCK, 32, "threads per block of the global norm"),
    "norm_max_blocks": (1, INT_LIMIT, 1, "most blocks of the global norm's first stage"),
    "encoder_token_blocks": (1, GRID_Y_LIMIT, 1, "most block rows of encoder_backward_wte_grouped"),
    "layernorm_rows_per_block": (1, INT_LIMIT, 1,
                                 "rows per block of the one-pass LayerNorm backward"),
    "layernorm_max_blocks": (1, INT_LIMIT, 1,
                             "most blocks (row chunks) of the one-pass LayerNorm backward"),
    "layernorm_finish_threads": (1, 32, 1,
                                 "threads per column of the LayerNorm parameter gradients' finish"),
}
# kernels/flash_attention.cu's compile-time shape: head size, rows per tile, threads per block
# FLASH_ROWS: rows a block owns (FLASH_BM)
FLASH_HEAD_SIZE, FLASH_ROWS, FLASH_THREADS = 64, 64, 128
SHARED_LIMIT = 48 << 10          # dynamic shared memory a kernel gets without opting in to more
# bytes: what we ask of the bias and aux pointers of a GEMM epilogue
EPILOGUE_ALIGNMENT = 16
# cuBLAS's default workspace per handle on Hopper (4 MiB before): an allowance
CUBLAS_WORKSPACE = 32 << 20
# the cuBLASLt workspace of the epilogue GEMMs (runtime_cupy.LT_WORKSPACE)
CUBLASLT_WORKSPACE = 32 << 20
MEMORY_HEADROOM = 256 << 20      # CUDA context growth, NVRTC modules, allocator rounding: kept free


class KernelArgumentError(ValueError):
    """Arguments a kernel cannot take (size over int range, misalignment, shape mismatch, a scalar
    of the wrong type), or a launch setting no kernel can run with."""


class DeviceMemoryError(RuntimeError):
    """A training run would not fit in the device's free memory; the message says what fits."""


def _i32(x):
    return np.int32(x)


def _f32(x):
    return np.float32(x)


def _blocks(n, threads):
    return (max(1, -(-n // threads)),)


def _threads_for(width, limit):
    """Threads for a block working on `width` items: a multiple of 32, at most `limit`."""
    return int(min(limit, max(32, -(-width // 32) * 32)))


class CudaBackend:
    """The op contract on CUDA kernels + cuBLAS. Arrays live in the runtime's memory.

    Launch tuning (attributes, may be changed per instance):
      elementwise_threads: block size of one-thread-per-element kernels
      row_warps: rows (one warp each) per block of the row kernels (layernorm, softmax)
      classifier_threads: maximum block size of fused_classifier (one block per row)
      reduce_warps, reduce_rows_per_chunk: layout of the column-sum reductions (parameter grads)
      norm_threads, norm_max_blocks: the global norm's first stage
      encoder_token_blocks: most block rows (gridDim.y) of encoder_backward_wte_grouped; each row
        loops over every gridDim.y-th unique token (at most GRID_Y_LIMIT)
      layernorm_rows_per_block, layernorm_max_blocks: rows each block of layernorm_backward_fused
        owns (its partial sums' row chunk), raised where the rows would need more blocks than the
        most (then ceil(N / most))
      layernorm_finish_threads: threads per column of layernorm_backward_params_finish (each adds
        every Y-th chunk)

    Fusion (the ops' `fused` flag and the fused ops): bias, bias + GELU, dGELU and bias-gradient
    GEMM epilogues where the runtime has them (runtime.epilogues: the emulator, the planner,
    CupyRuntime with cuBLASLt), else the same math as a GEMM plus the unfused kernels (which then
    carry no cost term but the op's first).
    """

    name = "cuda"
    launches_kernels = True
    has_cpu_math = False

    @property
    def on_gpu(self) -> bool:
        """Whether the kernels run on a real GPU (CuPy), not the CPU emulator or the planner."""
        return self.rt.on_gpu

    @property
    def label(self) -> str:
        return "cuda" if self.rt.on_gpu else "cuda (the CPU emulator)"

    def __setattr__(self, name, value):
        if name in LAUNCH_SETTINGS:
            low, high, multiple, what = LAUNCH_SETTINGS[name]
            ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            if not (ok and low <= value <= high and value % multiple == 0):
                rule = (f"a multiple of {multiple} in {low}..{high}" if multiple > 1
                        else f"an integer in {low}..{high}")
                raise KernelArgumentError(f"CudaBackend.{name} = {value!r}: the "
                                          f"{what} must be {rule}")
            value = int(value)
        object.__setattr__(self, name, value)

    def __init__(self, runtime: Runtime, dtype=np.float32):
        if np.dtype(dtype) not in (np.dtype(np.float32), BF16):
            raise ValueError(f"CudaBackend: storage is float32 or bfloat16, got {np.dtype(dtype)}")
        self.rt = runtime
        # storage of parameters, gradients, activations (kernels' floatX)
        self.dtype = np.dtype(dtype)
        self.bf16 = self.dtype == BF16
        self.on_launch = None
        self.elementwise_threads = 256
        self.row_warps = 8
        self.classifier_threads = 1024
        self.reduce_warps = 8
        self.reduce_rows_per_chunk = 128
        self.norm_threads = 512
        self.norm_max_blocks = 1024
        self.encoder_token_blocks = GRID_Y_LIMIT
        self.layernorm_rows_per_block = 16    # faster than 32 at d12 (docs/benchmarks.md)
        # a large batch (B=64, T=1024: 4096 chunks of 16 rows) in about one wave of blocks instead:
        # 4 blocks of 8 warps (48 KiB of accumulators at C=768) fit an SM; fewer partial
        # sums to write and add up
        self.layernorm_max_blocks = 512
        # the finish is latency-bound (a load, then the next): 32 threads a column, 1024 a block of
        # 32 columns, keep 32 loads of a column in flight (24 blocks at C=768)
        self.layernorm_finish_threads = 32
        self._modules = {}
        self._functions = {}
        self._scratch = {}
        self.scratch_generation = 0       # bumped when a scratch buffer is (re)allocated
        # device address of a token buffer -> (shape, groups, max id, min id)
        self._token_groups = {}
        # device address of a token buffer -> its fixed token-groups buffer
        self._group_buffers = {}

    def device_name(self):
        return self.rt.device_name()

    @property
    def precision(self):
        """"bf16" with bf16 storage (bf16 tensor-core GEMMs, fp32 accumulation); else the math of
        the fp32 GEMMs: "tf32" when the runtime enables TF32 tensor cores, "fp32" otherwise."""
        return "bf16" if self.bf16 else "tf32" if self.rt.tf32 else "fp32"

    # ---- memory -------------------------------------------------------------------------
    def zeros(self, shape, dtype=None):
        return self.rt.zeros(shape, np.dtype(dtype or self.dtype))

    def empty(self, shape, dtype=None):
        return self.rt.empty(shape, np.dtype(dtype or self.dtype))

    def from_host(self, array, dtype=None):
        return self.rt.from_host(np.ascontiguousarray(array, dtype=dtype))

    def to_host(self, array):
        return self.rt.to_host(array)

    def copy_(self, dst, src):
        self._forget_groups(dst)
        self.rt.copy(dst, src)

    def upload_(self, dst, array):
        """dst[...] = host array, queued on the stream (no host wait; `array` may
        be reused at once)."""
        self._forget_groups(dst)
        self.rt.upload(dst, np.ascontiguousarray(array, dtype=dst.dtype).reshape(dst.shape))

    def _forget_groups(self, dst):
        """dst is written by other means than upload_tokens: token groups kept for it are stale."""
        if self._token_groups and dst.dtype == np.int32:
            self._token_groups.pop(self.rt.pointer(dst), None)

    def read_async(self, array):
        """A Readback of a copy of `array` queued now; its result() waits for it (a host
        sync), done() does not."""
        return self.rt.read_async(array)

    def fill_(self, array, value):
        self.rt.fill(array, value)

    def synchronize(self):
        self.rt.synchronize()

    def event(self):
        return self.rt.event()

    def elapsed_ms(self, start, end):
        return self.rt.elapsed_ms(start, end)

    def scratch(self, key, shape, dtype=None):
        """A reusable work buffer (grown on demand), never part of the model's state."""
        dtype = np.dtype(dtype or self.dtype)
        size = int(np.prod(shape))
        buf = self._scratch.get((key, dtype))
        if buf is None or buf.size < size:
            buf = self.rt.empty(max(size, 1), dtype)
            self._scratch[(key, dtype)] = buf
            # captured CUDA graphs that used the old buffer are stale
            self.scratch_generation += 1
        return buf[:size].reshape(shape)

    def free_memory(self):
        """Bytes the device can still allocate, or None where the runtime knows no
        limit (the emulator)."""
        free = getattr(self.rt, "free_memory", None)
        return None if free is None else free()

    def scratch_needed(self, cfg, B, T, attention="naive"):
        """Peak bytes of this backend's scratch buffers (scratch()) for a training step of model cfg
        at (B, T): the attention work buffers (flash: only D), the column reductions' partial sums,
        the global norm's partials, the upload of encoder_backward's token groups, and cuBLAS's (and
        cuBLASLt's) workspace (an allowance)."""
        C, NH = cfg.channels, cfg.num_heads
        N = B * T
        chunk = max(1, self.reduce_rows_per_chunk, -(-N // GRID_Y_LIMIT))     # as in _column_sums
        # partial sums per chunk: layernorm (2, C), bias gradients (1, OC <= 4C)
        widest = 4 * C
        attention_floats = (B * NH * T if attention == "flash"         # flash_delta
                            # attention_y, _dy, _dqkvr, _datt
                            else 2 * N * C + 3 * N * C + B * NH * T * T)
        floats = (attention_floats
                  + -(-N // chunk) * widest        # column_partial (the widest reduction)
                  + self._layernorm_chunks(N)[1] * 2 * C    # layernorm_partial (one-pass backward)
                  # bias_grad (an epilogue's bias gradient, before it is added)
                  + 4 * C
                  + self.norm_max_blocks + 1)      # norm_partial, norm_total
        # inputs, targets; encoder_backward's token groups (int32)
        uploads = 2 * N + (3 * N + 2)
        lt = CUBLASLT_WORKSPACE if getattr(self.rt, "epilogues", False) else 0
        # (all at 4 bytes: the partial sums are fp32 in every build; bf16 attention
        # buffers are overcounted 2x)
        return 4 * (floats + uploads) + CUBLAS_WORKSPACE + lt

    def memory_needed(self, cfg, B, T, optimizer_elements=None, attention="naive",
                      master_weights=True, recompute=0):
        """{part: bytes} a training run of model cfg at micro-batch (B, T) allocates on this device:
        the model's parameters and gradients, AdamW's m and v (optimizer_elements each: this rank's
        ZeRO-1 shard, default all parameters) and, with bf16 storage, the fp32 master weights of
        that shard, the activations and token buffers, the backward's gradient scratch, this
        backend's scratch. gpt2np.model.GPT2 allocates exactly the model's parts
        (tests/test_gpu_ready.py checks it). attention: the model's ("naive" or "flash": its
        activations and scratch differ); recompute: the model's (-r: 1 and 2
        keep fewer activations).
        master_weights False (-w 0): bf16 storage keeps no fp32 masters, 4 bytes a parameter
        (of the shard) less.
        Sizes in the storage dtype (self.dtype: 4 bytes, bf16 2), except what is fp32 in every build
        (tensors.FP32_ACTIVATIONS, AdamW's state)."""
        P = num_parameters(cfg)
        opt = P if optimizer_elements is None else int(optimizer_elements)
        C, X = cfg.channels, self.dtype.itemsize
        acts = activation_shapes(cfg, B, T, attention, recompute)
        act_bytes = sum((4 if name in FP32_ACTIVATIONS else X) * int(np.prod(shape))
                        for name, shape in acts.items())
        masters = opt if self.bf16 and master_weights else 0
        return {
            "parameters and gradients": X * 2 * P,
            # m, v (and masters); at least the one-time fp32 upload of loaded weights
            "AdamW m, v" + (", master weights" if masters else ""): 4 * max(2 * opt + masters, P),
            "activations": act_bytes + 4 * 2 * B * T,
            "backward scratch": X * B * T * C * (1 + 1 + 3 + 4),
            "kernel scratch": self.scratch_needed(cfg, B, T, attention),
        }

    def check_memory_fits(self, cfg, B, T, optimizer_elements=None, model_name="the model",
                          reserved=0, sharers=1,
                          attention="naive", master_weights=True, recompute=0):
        """Raise DeviceMemoryError with one line when a training run at (B, T) needs more than its
        share of the device's free memory (split between `sharers` processes on this GPU, less
        MEMORY_HEADROOM and `reserved`, e.g. NCCL's buffers); the line says what is needed, what is
        free, and the largest B that fits at this T (or the longest T at B=1). Returns the bytes
        needed; None (no check) without a known limit."""
        free = self.free_memory()
        if free is None:
            return None
        budget = free // max(1, sharers) - MEMORY_HEADROOM - reserved

        def needed(b, t, r=recompute):
            return sum(self.memory_needed(cfg, b, t, optimizer_elements, attention, master_weights,
                                          r).values())

        total = needed(B, T)
        if total <= budget:
            return total
        gb = 1e9
        parts = self.memory_needed(cfg, B, T, optimizer_elements, attention, master_weights,
                                   recompute)
        biggest = max(parts, key=parts.get)
        line = (f"-b {B} -t {T}: {model_name} needs {total / gb:.1f} GB on {self.device_name()} "
                f"({biggest} {parts[biggest] / gb:.1f} GB), {free / gb:.1f} GB is free"
                + (f" for {sharers} ranks sharing the GPU" if sharers > 1 else ""))
        fits_b = next((b for b in range(B - 1, 0, -1) if needed(b, T) <= budget), None)
        fits_r = next((r for r in range(recompute + 1, 3) if needed(B, T, r) <= budget), None)
        keep_b = (f"-b {B} with -r {fits_r} ({RECOMPUTE_HINT[fits_r]} in backward "
                  "instead of keeping them)"
                  # recomputing activations in backward keeps this B
                  if fits_r else None)
        if fits_b:
            line += (f": the largest B that fits at T={T} is {fits_b} (-b {fits_b}; keep the "
                     "tokens per step with "
                     f"-d, gradient accumulation)" + (f", or {keep_b}" if keep_b else ""))
        elif keep_b:
            line += f": {keep_b} fits"
        else:
            fits_t = next((t for t in range(T - 1, 0, -1) if needed(1, t) <= budget), None)
            line += (f": not even -b 1 fits at T={T}; the longest T that fits at B=1 is {fits_t} "
                     f"(-b 1 -t {fits_t})"
                     if fits_t
                     else ": not even -b 1 -t 1 fits; free the GPU or use a smaller model")
        raise DeviceMemoryError(line)

    # ---- the two choke points -----------------------------------------------------------
    def function(self, name):
        """The compiled kernel `name` (compiles its kernels/<file>.cu on first use)."""
        fn = self._functions.get(name)
        if fn is None:
            if name not in KERNELS:
                raise KeyError(f"unknown kernel {name!r}")
            stem = KERNELS[name]
            module = self._modules.get(stem)
            if module is None:
                path = KERNEL_DIR / f"{stem}.cu"
                module = self._modules[stem] = (self.rt.compile(path, BF16_OPTIONS) if self.bf16
                                                else self.rt.compile(path))
            fn = self._functions[name] = module.get_function(name)
        return fn

    def _launch(self, name, grid, block, args, *, term=None, shared_mem=0):
        """Launch kernel `name` on (grid, block) with args, carrying `term` of its op's cost; the
        one place kernels are run."""
        fn = self.function(name)
        self._check_args(name, args)

        def run():
            self.rt.launch(fn, grid, block, args, shared_mem)

        if self.on_launch is None:
            run()
        else:
            self.on_launch(name, "kernel", term, run)

    def _gemm(self, name, transa, transb, m, n, k, a, lda, b, ldb, c, ldc, *, term, alpha=1.0,
              beta=0.0, batch=1, stride_a=0, stride_b=0, stride_c=0, epilogue="none", bias=None,
              aux=None, ld_aux=0):
        """Row-major C[i] (m,n) = alpha op(A[i]) op(B[i]) + beta C[i] via the runtime's
        cuBLAS/NumPy, then `epilogue` (runtime.EPILOGUES) with its bias vector and aux matrix,
        carrying `term` of its op's cost; the one place GEMMs are run."""
        if epilogue == "none":
            def run():
                self.rt.gemm(transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b,
                             beta, c, ldc, stride_c, batch)
        else:
            def run():
                self.rt.gemm(transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb,
                             stride_b, beta, c, ldc,
                             stride_c, batch, epilogue=epilogue, bias=bias, aux=aux, ld_aux=ld_aux)

        if self.on_launch is None:
            run()
        else:
            self.on_launch(name, "gemm", term, run)

    # ---- checks -------------------------------------------------------------------------
    def _check_args(self, name, args):
        """args against kernel `name`'s signature (KERNEL_SIGNATURES): count, exact scalar types,
        array dtypes (floatX*: this backend's dtype), contiguity. Raises KernelArgumentError naming
        the kernel and the argument."""
        kinds = KERNEL_SIGNATURES[name]
        if len(args) != len(kinds):
            raise KernelArgumentError(f"CudaBackend: kernel {name} takes {len(kinds)} "
                                      f"arguments, got {len(args)}")
        for i, (a, kind) in enumerate(zip(args, kinds)):
            if kind == STORAGE:
                kind = self.dtype
            if isinstance(kind, np.dtype):
                if a is NULL:
                    continue
                dtype = getattr(a, "dtype", None)
                if dtype is None or not hasattr(a, "flags"):
                    raise KernelArgumentError(f"CudaBackend: kernel {name}: argument {i} must "
                                              f"be a {kind} device "
                                              f"array (a pointer), got {type(a).__name__}")
                if dtype != kind:
                    raise KernelArgumentError(f"CudaBackend: kernel {name}: argument {i} is a "
                                              f"{dtype} array, the "
                                              f"kernel takes a pointer to {kind}")
                if not a.flags.c_contiguous:
                    raise KernelArgumentError(f"CudaBackend: kernel {name}: argument {i} is not "
                                              "C-contiguous (kernels take raw pointers)")
            elif type(a) is not kind:
                raise KernelArgumentError(f"CudaBackend: kernel {name}: argument {i} is "
                                          f"{type(a).__name__} {a}, the kernel takes "
                                          f"{kind.__name__}: pass np.{kind.__name__}(...) (CuPy "
                                          "passes a Python float as a double, an int as 64 bits)")

    @staticmethod
    def _check_shape(op, what, array, shape):
        if tuple(array.shape) != tuple(shape):
            raise KernelArgumentError(f"CudaBackend.{op}: {what} has shape {tuple(array.shape)}, "
                                      f"expected {tuple(shape)}")

    @staticmethod
    def _check_int_size(op, what, n):
        if n > INT_LIMIT:
            raise KernelArgumentError(f"CudaBackend.{op}: {what} has {n} elements; "
                                      "the kernels index it "
                                      f"with 32-bit ints (limit {INT_LIMIT}), use a smaller batch")

    def _check_aligned(self, op, what, array, alignment=16, why="the kernel loads float4"):
        address = self.rt.pointer(array)
        if address % alignment:
            raise KernelArgumentError(f"CudaBackend.{op}: {what} is not {alignment}-byte aligned "
                                      f"(address {address:#x}); {why}")

    def _epilogues_ok(self, *arrays, ld_aux=8):
        """Whether a GEMM epilogue can run here on these bias/aux arrays: the runtime has epilogues,
        each array starts EPILOGUE_ALIGNMENT-aligned (the model's views are; a stray view falls back
        to separate kernels), and the aux matrix's row stride is a multiple of 8 (cuBLASLt's rule
        for CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)."""
        return bool(getattr(self.rt, "epilogues", False)) and ld_aux % 8 == 0 and all(
            self.rt.pointer(x) % EPILOGUE_ALIGNMENT == 0 for x in arrays if x is not None)

    def _row_launch(self, rows):
        """(grid, block) for one-warp-per-row kernels."""
        warps = int(max(1, min(self.row_warps, rows)))
        return _blocks(rows, warps), (32 * warps,)

    def _elementwise(self, n):
        return _blocks(n, self.elementwise_threads), (self.elementwise_threads,)

    def _column_sums(self, partial_kernel, finish_kernel, rows, cols, partial_cols, partial_args,
                     finish_outputs, accumulate, term, finish_shared_floats=0):
        """Two-stage deterministic column reduction over `rows` of a (rows, cols) matrix; the finish
        kernel adds the sums into finish_outputs (accumulate) or overwrites them (not accumulate),
        one thread a column (finish_shared_floats: the dynamic shared memory it takes, in floats per
        thread). The partial stage carries the op's cost `term`, the finish is its helper."""
        chunk = max(1, int(self.reduce_rows_per_chunk), -(-rows // 65535))   # gridDim.y <= 65535
        chunks = -(-rows // chunk)
        partial = self.scratch("column_partial", (chunks, partial_cols, cols), np.float32)
        warps = int(max(1, min(self.reduce_warps, chunk)))
        self._launch(partial_kernel, (-(-cols // 32), chunks), (32 * warps,),
                     (partial, *partial_args, _i32(rows), _i32(cols), _i32(chunk)), term=term)
        threads = _threads_for(cols, 256)
        self._launch(finish_kernel, _blocks(cols, threads), (threads,),
                     (*finish_outputs, partial, _i32(chunks), _i32(cols), _i32(bool(accumulate))),
                     shared_mem=4 * finish_shared_floats * threads)

    # ---- encoder ------------------------------------------------------------------------
    def encoder_forward(self, out, inp, wte, wpe):
        """out (B,T,C) = wte (Vp,C)[inp (B,T) int32] + wpe (maxT,C)[:T]."""
        op = "encoder_forward"
        B, T = inp.shape
        C = wte.shape[1]
        self._check_shape(op, "out", out, (B, T, C))
        # encoder.cu's floatX4: 4 channels, 16 bytes (fp32) or 8 (bf16)
        vector = 4 * self.dtype.itemsize
        if C % 4:
            raise KernelArgumentError(f"CudaBackend.{op}: channels C={C} must be a multiple of 4 "
                                      "(kernels/encoder.cu loads 4 channels at "
                                      f"once, {vector} bytes)")
        for what, array in (("out", out), ("wte", wte), ("wpe", wpe)):
            self._check_aligned(op, what, array, vector,
                                f"the kernel loads 4 channels at once ({vector} bytes)")
        n = B * T * C
        self._check_int_size(op, "out", n)
        self._launch(op, *self._elementwise(n // 4),
                     (out, inp, wte, wpe, _i32(B), _i32(T), _i32(C)), term="encode")

    @staticmethod
    def _group_tokens(inp, capacity=None):
        """The B*T positions of host inp (B,T) grouped by token id, in
        encoder_backward_wte_grouped's layout: one int32 array [U | offsets (capacity+1) | positions
        (capacity) | tokens (capacity)] (capacity >= B*T, default B*T): tokens[:U] the distinct ids
        ascending; positions[:B*T] the flat positions b*T+t, those of tokens[u] at
        positions[offsets[u]:offsets[u+1]], ascending (a stable sort). Unused entries are 0."""
        flat = np.ascontiguousarray(inp, dtype=np.int32).reshape(-1)
        N = flat.size
        cap = N if capacity is None else int(capacity)
        if cap < N:
            raise KernelArgumentError(f"CudaBackend.encoder_backward: {N} positions, token "
                                      f"groups hold {cap}")
        tokens, counts = np.unique(flat, return_counts=True)
        U = len(tokens)
        groups = np.zeros(3 * cap + 2, np.int32)
        groups[0] = U
        offsets = groups[1:cap + 2]
        np.cumsum(counts, out=offsets[1:U + 1])
        offsets[U + 1:] = N
        groups[cap + 2:cap + 2 + N] = np.argsort(flat, kind="stable")
        groups[2 * cap + 2:2 * cap + 2 + U] = tokens
        return groups

    def upload_tokens(self, dst, tokens, group=True):
        """dst (b,t) int32 device buffer := host tokens (b,t), queued (no host wait). With `group`,
        the positions grouped by token id (_group_tokens, on the host copy) go up with them into a
        fixed buffer kept for dst's address (sized by its first, largest, batch), which
        encoder_backward(inp=dst) then uses instead of reading inp back (a sync). encoder_backward
        checks the ids against dwte's rows; the model against V first."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self._check_shape("upload_tokens", "tokens", tokens, dst.shape)
        self.upload_(dst, tokens)                 # (forgets dst's old groups)
        if not group:
            return
        key = self.rt.pointer(dst)
        buf = self._group_buffers.get(key)
        if buf is None or (buf.size - 2) // 3 < tokens.size:
            buf = self._group_buffers[key] = self.rt.zeros(3 * tokens.size + 2, np.dtype(np.int32))
            self.scratch_generation += 1
        self.rt.upload(buf, self._group_tokens(tokens, (buf.size - 2) // 3))
        self._token_groups[key] = (tuple(dst.shape), buf, int(tokens.max(initial=0)),
                                   int(tokens.min(initial=0)))

    def encoder_backward(self, dwte, dwpe, dout, inp, accumulate=True):
        """dwte[inp[b,t]] += dout[b,t] (always accumulates: the tied lm_head wrote it first);
        dwpe[t] += sum_b dout[b,t]. accumulate=False overwrites dwpe instead (its old contents are
        ignored): dwpe[:T] = the sums, dwpe[T:] = 0.

        Both are deterministic (bitwise, whatever the schedule): dwte without atomics, from the
        positions grouped by token id on the host (_group_tokens), adding each token's dout rows
        into dwte in ascending (b, t) order, one thread per (token, channel). The groups come up
        with the batch when inp was filled by upload_tokens (no host wait); otherwise inp is copied
        to the host here to group it (a sync)."""
        op = "encoder_backward"
        B, T, C = dout.shape
        self._check_shape(op, "inp", inp, (B, T))
        if dwpe.ndim != 2 or dwpe.shape[1] != C or dwpe.shape[0] < T:
            raise KernelArgumentError(f"CudaBackend.{op}: dwpe has shape {tuple(dwpe.shape)}, "
                                      f"expected (maxT >= {T}, {C})")
        if dwte.ndim != 2 or dwte.shape[1] != C:
            raise KernelArgumentError(f"CudaBackend.{op}: dwte has shape {tuple(dwte.shape)}, "
                                      f"expected (Vp, {C})")
        n = B * T * C
        self._check_int_size(op, "dout", n)
        self._check_int_size(op, "dwte", dwte.size)
        held = self._token_groups.get(self.rt.pointer(inp))
        if held is not None and held[0] == (B, T):
            _, groups, high, low = held
        else:
            host = self._group_tokens(self.to_host(inp))
            U = int(host[0])
            low, high = (int(host[2 * B * T + 2]), int(host[2 * B * T + 1 + U])) if U else (0, 0)
            groups = self.scratch("encoder_token_groups", host.shape, np.int32)
            self.upload_(groups, host)
        if low < 0 or high >= dwte.shape[0]:
            bad = low if low < 0 else high
            raise KernelArgumentError(f"CudaBackend.{op}: inp holds token id {bad}, outside [0, "
                                      f"{dwte.shape[0]}) (the rows of dwte)")
        capacity = (groups.size - 2) // 3
        threads = _threads_for(C, self.elementwise_threads)
        # the worst case: U = B*T
        rows = int(max(1, min(B * T, self.encoder_token_blocks, GRID_Y_LIMIT)))
        self._launch("encoder_backward_wte_grouped", (-(-C // threads), rows), (threads,),
                     (dwte, dout, groups, _i32(capacity), _i32(C)), term="dwte")
        self._launch("encoder_backward_wpe", *self._elementwise(T * C),
                     (dwpe, dout, _i32(B), _i32(T), _i32(C), _i32(bool(accumulate))), term="dwpe")
        tail = dwpe.shape[0] - T
        if not accumulate and tail:
            # dwpe[T:] = 0: the same kernel over the rows past T with no sequence to sum (B = 0
            # writes 0.0 without accumulate; dout is not read), a launch carrying its term of the
            # op's cost, where a memset would be a copy-engine record outside the op's kernels
            self._launch("encoder_backward_wpe", *self._elementwise(tail * C),
                         (dwpe[T:], dout, _i32(0), _i32(tail), _i32(C), _i32(0)), term="dwpe_tail")

    # ---- layernorm ----------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T)."""
        op = "layernorm_forward"
        *lead, C = inp.shape
        N = int(np.prod(lead))
        self._check_shape(op, "out", out, inp.shape)
        self._check_shape(op, "mean", mean, lead)
        self._check_shape(op, "rstd", rstd, lead)
        self._check_int_size(op, "inp", N * C)
        self._launch(op, *self._row_launch(N),
                     (out, mean, rstd, inp, weight, bias, _i32(N), _i32(C)), term="normalize")

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias):
        """residual = inp1 + inp2 (B,T,C); out = layernorm(residual), saving mean, rstd
        (B,T): one kernel."""
        op = "fused_residual_layernorm_forward"
        *lead, C = inp1.shape
        N = int(np.prod(lead))
        for what, array in (("residual", residual), ("out", out), ("inp2", inp2)):
            self._check_shape(op, what, array, inp1.shape)
        self._check_shape(op, "mean", mean, lead)
        self._check_shape(op, "rstd", rstd, lead)
        self._check_int_size(op, "inp1", N * C)
        self._launch(op, *self._row_launch(N),
                     (residual, out, mean, rstd, inp1, inp2, weight, bias, _i32(N), _i32(C)),
                     term="residual_normalize")

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                           accumulate=True, fused=False):
        """dinp (B,T,C) +=, dweight (C) +=, dbias (C) +=, from dout and the saved mean, rstd.
        accumulate=False overwrites dweight and dbias (their old contents are
        ignored); dinp always +=.
        fused: one pass (layernorm_backward_fused: dinp and per-block partial sums, then the
        fixed-order finish); else a row kernel for dinp and a two-stage column reduction that reads
        dout and inp again."""
        op = "layernorm_backward"
        *lead, C = inp.shape
        N = int(np.prod(lead))
        for what, array in (("dinp", dinp), ("dout", dout)):
            self._check_shape(op, what, array, inp.shape)
        self._check_int_size(op, "inp", N * C)
        rows, blocks = self._layernorm_chunks(N)
        warps = min(self.row_warps, rows, SHARED_LIMIT // (4 * 2 * C))    # acc: W*2*C floats
        if fused and warps >= 1:
            partial = self.scratch("layernorm_partial", (blocks, 2, C), np.float32)
            self._launch("layernorm_backward_fused", (blocks,), (32 * warps,),
                         (partial, dinp, dout, inp, weight, mean, rstd, _i32(N),
                          _i32(C), _i32(rows)),
                         term="backward", shared_mem=4 * 2 * C * warps)
            # threads per column: at most one per chunk
            Y = min(int(self.layernorm_finish_threads), blocks)
            self._launch("layernorm_backward_params_finish", (-(-C // 32),), (32, Y),
                         (dweight, dbias, partial, _i32(blocks), _i32(C), _i32(bool(accumulate))),
                         shared_mem=4 * 2 * 32 * Y)
            return
        self._launch("layernorm_backward_dinp", *self._row_launch(N),
                     (dinp, dout, inp, weight, mean, rstd, _i32(N), _i32(C)),
                     term="backward" if fused else "dinp")
        self._column_sums("layernorm_backward_params_partial", "layernorm_backward_params_finish",
                          N, C, 2, (dout, inp, mean, rstd), (dweight, dbias), accumulate,
                          None if fused else "dparams", finish_shared_floats=2)

    def _layernorm_chunks(self, N):
        """(rows a block owns, blocks) of the one-pass LayerNorm backward over N rows:
        layernorm_rows_per_block rows a block, or more where that would take more than
        layernorm_max_blocks blocks."""
        rows = max(int(self.layernorm_rows_per_block), -(-N // int(self.layernorm_max_blocks)))
        return rows, -(-N // rows)

    # ---- matmul -------------------------------------------------------------------------
    def matmul_forward(self, out, inp, weight, bias, fused=False):
        """out (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC) (bias may be None).
        fused: the bias is added by the GEMM's epilogue (else by add_bias, a
        second pass over out)."""
        op = "matmul_forward"
        OC, C = weight.shape
        N = inp.size // C
        self._check_shape(op, "inp", inp, (*inp.shape[:-1], C))
        self._check_shape(op, "out", out, (*inp.shape[:-1], OC))
        if bias is not None and fused and self._epilogues_ok(bias):
            self._gemm("gemm_" + op, False, True, N, OC, C, inp, C, weight, C, out, OC, term="gemm",
                       epilogue="bias", bias=bias)
            return
        self._gemm("gemm_" + op, False, True, N, OC, C, inp, C, weight, C, out, OC, term="gemm")
        if bias is not None:
            self._check_int_size(op, "out", N * OC)
            self._launch("add_bias", *self._elementwise(N * OC), (out, bias, _i32(N), _i32(OC)),
                         term=None if fused else "bias")

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, accumulate=True,
                        fused=False):
        """dinp (B,T,C) = dout @ weight;  dweight (OC,C) += dout^T @ inp;  dbias (OC) += sum dout.
        accumulate=False overwrites dweight (cuBLAS beta 0) and dbias instead
        (old contents ignored).
        fused: dbias from the dweight GEMM's bias-gradient epilogue (else a two-stage
        column reduction)."""
        op = "matmul_backward"
        OC, C = weight.shape
        N = inp.size // C
        self._check_shape(op, "inp", inp, (*inp.shape[:-1], C))
        self._check_shape(op, "dout", dout, (*inp.shape[:-1], OC))
        self._check_shape(op, "dinp", dinp, inp.shape)
        self._check_shape(op, "dweight", dweight, weight.shape)
        self._gemm("gemm_matmul_backward_dinp", False, False, N, C, OC, dout, OC, weight, C, dinp,
                   C, term="dinp")
        self._weight_grads(op, dweight, dbias, dout, inp, N, C, OC, accumulate, fused)

    def _weight_grads(self, op, dweight, dbias, dout, inp, N, C, OC, accumulate, fused):
        """dweight (OC,C) += dout^T @ inp and dbias (OC) += the column sums of dout (N,OC) (=
        without accumulate). Fused: the GEMM's "bgrad" epilogue sums dout's columns while it reads
        them; it writes (never adds), so an accumulating dbias gets the sums in a scratch vector,
        then one small add (bias_grad_finish over 1 chunk)."""
        beta = 1.0 if accumulate else 0.0
        # bf16: no bias-gradient epilogue (cuBLASLt's BGRADB would sum into a bf16 vector, or an
        # fp32 one on a path its documentation does not promise); the column-sum kernels sum
        # in fp32, as llm.c does
        if dbias is not None and fused and not self.bf16 and self._epilogues_ok(dbias):
            sums = self.scratch("bias_grad", (OC,), np.float32) if accumulate else dbias
            self._gemm("gemm_matmul_backward_dweight", True, False, OC, C, N, dout, OC, inp, C,
                       dweight, C, term="dweight", beta=beta, epilogue="bgrad", bias=sums)
            if accumulate:
                threads = _threads_for(OC, 256)
                self._launch("bias_grad_finish", _blocks(OC, threads), (threads,),
                             (dbias, sums, _i32(1), _i32(OC), _i32(1)), term="dbias")
            return
        self._gemm("gemm_matmul_backward_dweight", True, False, OC, C, N, dout, OC, inp, C, dweight,
                   C, term="dweight", beta=beta)
        if dbias is not None:
            self._check_int_size(op, "dout", N * OC)
            # the cost's dbias term (contract.matmul_backward_cost) is these column sums unfused and
            # in bf16 (which sums with these kernels even when fused); a fused fp32 cost counts the
            # sums in its dweight term (an epilogue's) and has a dbias term only for the add into
            # an accumulating dbias
            term = "dbias" if not fused or self.bf16 or accumulate else None
            self._column_sums("bias_grad_partial", "bias_grad_finish", N, OC, 1, (dout,), (dbias,),
                              accumulate, term)

    def matmul_gelu_forward(self, out, pre, inp, weight, bias):
        """pre (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC); out = gelu(pre): one GEMM whose
        epilogue adds the bias, writes pre (aux) and out = gelu(pre)."""
        op = "matmul_gelu_forward"
        OC, C = weight.shape
        N = inp.size // C
        self._check_shape(op, "inp", inp, (*inp.shape[:-1], C))
        for what, array in (("out", out), ("pre", pre)):
            self._check_shape(op, what, array, (*inp.shape[:-1], OC))
        self._check_shape(op, "bias", bias, (OC,))
        if self._epilogues_ok(bias, pre, ld_aux=OC):
            self._gemm("gemm_" + op, False, True, N, OC, C, inp, C, weight, C, out, OC, term="gemm",
                       epilogue="gelu_bias", bias=bias, aux=pre, ld_aux=OC)
            return
        self._gemm("gemm_" + op, False, True, N, OC, C, inp, C, weight, C, pre, OC, term="gemm")
        self._check_int_size(op, "out", N * OC)
        self._launch("add_bias", *self._elementwise(N * OC), (pre, bias, _i32(N), _i32(OC)))
        self._launch("gelu_forward", *self._elementwise(N * OC), (out, pre, _i32(N * OC)))

    def gelu_matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre, accumulate=True):
        """dinp (B,T,C) = (dout (B,T,OC) @ weight (OC,C)) * gelu'(pre (B,T,C)), the gelu' in the
        GEMM's epilogue; dweight += dout^T @ inp (inp = gelu(pre)), dbias += sum dout, as
        matmul_backward(fused=True)."""
        op = "gelu_matmul_backward"
        OC, C = weight.shape
        N = inp.size // C
        self._check_shape(op, "inp", inp, (*inp.shape[:-1], C))
        self._check_shape(op, "dout", dout, (*inp.shape[:-1], OC))
        self._check_shape(op, "dinp", dinp, inp.shape)
        self._check_shape(op, "pre", pre, inp.shape)
        self._check_shape(op, "dweight", dweight, weight.shape)
        if self._epilogues_ok(pre, ld_aux=C):
            self._gemm("gemm_" + op + "_dinp", False, False, N, C, OC, dout, OC, weight, C, dinp, C,
                       term="dinp", epilogue="dgelu", aux=pre, ld_aux=C)
        else:
            self._gemm("gemm_" + op + "_dinp", False, False, N, C, OC, dout, OC, weight, C, dinp, C,
                       term="dinp")
            self._check_int_size(op, "dinp", N * C)
            self._launch("gelu_backward", *self._elementwise(N * C), (dinp, pre, dinp, _i32(N * C)))
        self._weight_grads(op, dweight, dbias, dout, inp, N, C, OC, accumulate, True)

    # ---- attention ----------------------------------------------------------------------
    def attention_forward(self, out, qkvr, att, inp):
        """Causal self-attention: inp (B,T,3C) -> qkvr (3,B,NH,T,HS), att (B,NH,T,T)
        probs, out (B,T,C)."""
        op = "attention_forward"
        B, T, C3 = inp.shape
        _, _, NH, _, HS = qkvr.shape
        C = C3 // 3
        self._check_shape(op, "qkvr", qkvr, (3, B, NH, T, HS))
        self._check_shape(op, "att", att, (B, NH, T, T))
        self._check_shape(op, "out", out, (B, T, C))
        if NH * HS != C:
            raise KernelArgumentError(f"CudaBackend.{op}: NH*HS={NH}*{HS} != C={C}")
        self._check_int_size(op, "inp", B * T * C3)
        self._check_int_size(op, "att", B * NH * T * T)
        BH, n = B * NH, B * T * C
        self._launch("permute_qkv", *self._elementwise(3 * n),
                     (qkvr, inp, _i32(B), _i32(T), _i32(NH), _i32(HS)), term="permute")
        q, k, v = qkvr[0], qkvr[1], qkvr[2]
        self._gemm("gemm_attention_qk", False, True, T, T, HS, q, HS, k, HS, att, T, term="scores",
                   batch=BH, stride_a=T * HS, stride_b=T * HS, stride_c=T * T)
        rows = BH * T
        self._launch("causal_softmax_forward", *self._row_launch(rows),
                     (att, _i32(rows), _i32(T), _f32(1 / math.sqrt(HS))), term="softmax")
        y = self.scratch("attention_y", (B, NH, T, HS))
        self._gemm("gemm_attention_av", False, False, T, HS, T, att, T, v, HS, y, HS,
                   term="weighted_sum", batch=BH, stride_a=T * T, stride_b=T * HS, stride_c=T * HS)
        self._launch("unpermute", *self._elementwise(n),
                     (out, y, _i32(B), _i32(T), _i32(NH), _i32(HS)), term="unpermute")

    def attention_backward(self, dinp, dout, qkvr, att):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), the saved qkvr (3,B,NH,T,HS)
        and att (B,NH,T,T)."""
        op = "attention_backward"
        B, T, C = dout.shape
        _, _, NH, _, HS = qkvr.shape
        self._check_shape(op, "qkvr", qkvr, (3, B, NH, T, HS))
        self._check_shape(op, "att", att, (B, NH, T, T))
        self._check_shape(op, "dinp", dinp, (B, T, 3 * C))
        self._check_int_size(op, "dinp", 3 * B * T * C)
        self._check_int_size(op, "att", B * NH * T * T)
        BH, n = B * NH, B * T * C
        dy = self.scratch("attention_dy", (B, NH, T, HS))
        self._launch("unpermute_backward", *self._elementwise(n),
                     (dy, dout, _i32(B), _i32(T), _i32(NH), _i32(HS)), term="unpermute_backward")
        dqkvr = self.scratch("attention_dqkvr", (3, B, NH, T, HS))
        dq, dk, dv = dqkvr[0], dqkvr[1], dqkvr[2]
        q, k, v = qkvr[0], qkvr[1], qkvr[2]
        datt = self.scratch("attention_datt", (B, NH, T, T))
        mat, head = T * T, T * HS
        self._gemm("gemm_attention_dv", True, False, T, HS, T, att, T, dy, HS, dv, HS, term="dv",
                   batch=BH, stride_a=mat, stride_b=head, stride_c=head)
        self._gemm("gemm_attention_datt", False, True, T, T, HS, dy, HS, v, HS, datt, T,
                   term="datt", batch=BH, stride_a=head, stride_b=head, stride_c=mat)
        rows = BH * T
        self._launch("causal_softmax_backward", *self._row_launch(rows),
                     (datt, datt, att, _i32(rows), _i32(T), _f32(1 / math.sqrt(HS))),
                     term="softmax_backward")
        self._gemm("gemm_attention_dq", False, False, T, HS, T, datt, T, k, HS, dq, HS, term="dq",
                   batch=BH, stride_a=mat, stride_b=head, stride_c=head)
        self._gemm("gemm_attention_dk", True, False, T, HS, T, datt, T, q, HS, dk, HS, term="dk",
                   batch=BH, stride_a=mat, stride_b=head, stride_c=head)
        self._launch("permute_backward", *self._elementwise(3 * n),
                     (dinp, dqkvr, _i32(B), _i32(T), _i32(NH), _i32(HS)), term="permute_backward")

    # ---- flash attention ----------------------------------------------------------------
    def _flash_shapes(self, op, inp, lse):
        """(B, T, NH, C) of a flash attention call, checked against what
        kernels/flash_attention.cu can run."""
        B, T, C3 = inp.shape
        C = C3 // 3
        NH = lse.shape[1] if lse.ndim == 3 else 0
        self._check_shape(op, "lse", lse, (B, NH, T))
        if C3 != 3 * C or NH < 1 or NH * FLASH_HEAD_SIZE != C:
            raise KernelArgumentError(f"CudaBackend.{op}: the flash attention kernels need head "
                                      f"size {FLASH_HEAD_SIZE} (kernels/flash_attention.cu), got "
                                      f"C={C}, NH={NH} (HS={C / max(NH, 1):g}); "
                                      f"use --attention naive")
        if B * NH > GRID_Y_LIMIT:
            raise KernelArgumentError(f"CudaBackend.{op}: B*NH={B * NH} blocks per column exceeds "
                                      f"gridDim.y's limit {GRID_Y_LIMIT}; use a smaller batch")
        self._check_int_size(op, "inp", B * T * C3)
        capability = getattr(self.rt, "compute_capability", None)
        if capability is not None and capability() < 80:
            raise KernelArgumentError(f"CudaBackend.{op}: the flash attention kernels need bf16 or "
                                      f"TF32 tensor cores (sm_80 or newer), {self.device_name()} "
                                      f"is sm_{capability()}; use --attention naive")
        return B, T, NH, C

    def flash_attention_forward(self, out, lse, inp):
        """Causal self-attention without the (T,T) matrix: inp (B,T,3C) -> out (B,T,C), lse (B,NH,T)
        (the log-sum-exp of each row of the scaled, masked scores). One kernel: a block per (64
        queries, batch*head), 16 per warp, online softmax over steps of 32 keys, tensor-core
        products (WMMA TF32, or bf16 in the bf16 build: qkv, out bf16, lse fp32);
        head size 64 only."""
        op = "flash_attention_forward"
        B, T, NH, C = self._flash_shapes(op, inp, lse)
        self._check_shape(op, "out", out, (B, T, C))
        self._launch(op, (-(-T // FLASH_ROWS), B * NH), (FLASH_THREADS,),
                     (out, lse, inp, _i32(B), _i32(T), _i32(NH),
                      _f32(1 / math.sqrt(FLASH_HEAD_SIZE))),
                     term="attention")

    def flash_attention_backward(self, dinp, dout, inp, out, lse):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C) and forward's inp, out, lse;
        probabilities recomputed.
        Three kernels, no atomics (bitwise reproducible): D = rowsum(dout * out) per head, then dK
        and dV (a block per 64 keys walking the queries after them 32 at a time), then dQ (a block
        per 64 queries walking the keys up to them)."""
        op = "flash_attention_backward"
        B, T, NH, C = self._flash_shapes(op, inp, lse)
        self._check_shape(op, "dinp", dinp, inp.shape)
        self._check_shape(op, "dout", dout, (B, T, C))
        self._check_shape(op, "out", out, (B, T, C))
        delta = self.scratch("flash_delta", (B, NH, T), np.float32)
        rows = B * NH * T
        self._launch("flash_attention_backward_delta", *self._row_launch(rows),
                     (delta, dout, out, _i32(B), _i32(T), _i32(NH), _i32(FLASH_HEAD_SIZE)),
                     term="delta")
        grid, block = (-(-T // FLASH_ROWS), B * NH), (FLASH_THREADS,)
        args = (dinp, dout, inp, lse, delta, _i32(B), _i32(T), _i32(NH),
                _f32(1 / math.sqrt(FLASH_HEAD_SIZE)))
        self._launch("flash_attention_backward_dkv", grid, block, args, term="dkv")
        self._launch("flash_attention_backward_dq", grid, block, args, term="dq")

    # ---- gelu ---------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
        self._check_shape("gelu_forward", "out", out, inp.shape)
        n = inp.size
        self._check_int_size("gelu_forward", "inp", n)
        self._launch("gelu_forward", *self._elementwise(n), (out, inp, _i32(n)), term="gelu")

    def gelu_backward(self, dinp, inp, dout):
        """dinp = dout * gelu'(inp); dinp may alias dout."""
        self._check_shape("gelu_backward", "dinp", dinp, inp.shape)
        self._check_shape("gelu_backward", "dout", dout, inp.shape)
        n = inp.size
        self._check_int_size("gelu_backward", "inp", n)
        self._launch("gelu_backward", *self._elementwise(n), (dinp, inp, dout, _i32(n)),
                     term="gelu_backward")

    # ---- residual -----------------------------------------------------------------------
    def residual_forward(self, out, inp1, inp2):
        """out = inp1 + inp2."""
        self._check_shape("residual_forward", "inp1", inp1, out.shape)
        self._check_shape("residual_forward", "inp2", inp2, out.shape)
        n = out.size
        self._check_int_size("residual_forward", "out", n)
        self._launch("residual_forward", *self._elementwise(n), (out, inp1, inp2, _i32(n)),
                     term="add")

    def residual_backward(self, dinp1, dinp2, dout):
        """dinp1 += dout; dinp2 += dout."""
        self._check_shape("residual_backward", "dinp1", dinp1, dout.shape)
        self._check_shape("residual_backward", "dinp2", dinp2, dout.shape)
        n = dout.size
        self._check_int_size("residual_backward", "dout", n)
        self._launch("residual_backward", *self._elementwise(n), (dinp1, dinp2, dout, _i32(n)),
                     term="add")

    # ---- classifier ---------------------------------------------------------------------
    def fused_classifier(self, logits, losses, targets, V, dloss, write_dlogits):
        """Per row of logits (B,T,Vp): losses (B,T) = logsumexp(logits[:V]) - logits[target];
        with write_dlogits, logits becomes (softmax - onehot(target)) * dloss over
        [:V], 0 over [V:Vp]."""
        op = "fused_classifier"
        *lead, Vp = logits.shape
        N = int(np.prod(lead))
        self._check_shape(op, "losses", losses, lead)
        self._check_shape(op, "targets", targets, lead)
        if not 0 < V <= Vp:
            raise KernelArgumentError(f"CudaBackend.{op}: V={V} must be in 1..Vp={Vp}")
        threads = _threads_for(V, self.classifier_threads)
        self._launch(op, (N,), (threads,),
                     (logits, losses, targets, _i32(N), _i32(V), _i32(Vp), _f32(dloss),
                      _i32(bool(write_dlogits))),
                     term="classifier")

    # ---- optimizer ----------------------------------------------------------------------
    def _adamw_check(self, op, params, grads, m, v, master, seed, offset):
        """Shapes, sizes and the master weights of an AdamW launch -> (n, the master pointer, the
        seed as an int32 holding its 32 bits, the offset). bf16 parameters: master (fp32, params'
        size) is updated and params written from it by stochastic rounding; master None (-w 0)
        passes a null pointer, and the kernel updates the upcast params themselves. fp32 parameters
        take none (the kernel is handed params there and does not touch it)."""
        n = params.size
        for what, array in (("grads", grads), ("m", m), ("v", v)):
            self._check_shape(op, what, array, params.shape)
        self._check_int_size(op, "params", n)
        if self.bf16:
            if master is not None and master.size != n:
                raise KernelArgumentError(f"CudaBackend.{op}: {master.size} fp32 master weights "
                                          f"(master=) for {n} bf16 parameters")
            if master is not None:
                self._check_shape(op, "master", master, params.shape)
            if not 0 <= offset <= INT_LIMIT:
                raise KernelArgumentError(f"CudaBackend.{op}: offset {offset} (params[0]'s index "
                                          "in the flat parameter buffer) must be in [0, 2^31)")
        elif master is not None:
            raise KernelArgumentError(f"CudaBackend.{op}: float32 parameters are their own master "
                                      "weights (master= is for bf16 storage)")
        # the seed's 32 bits (bf16.stream_key)
        seed32 = np.uint32(int(seed) & 0xFFFFFFFF).view(np.int32)
        pointer = master if master is not None else NULL if self.bf16 else params
        return n, pointer, seed32, _i32(offset if self.bf16 else 0)

    def adamw_update(self, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t,
                     grad_scale=1.0, *, master=None, seed=0, offset=0):
        """AdamW (decoupled weight decay, bias correction) on flat segments, in place. fp32 storage:
        params, grads float32, no master. bf16 storage (Bf16NumpyBackend.adamw_update's contract):
        params, grads bf16, master (fp32) updated from the upcast grads by the fp32 arithmetic,
        params = master stochastically rounded with the noise of (seed, t, offset + i), offset =
        params[0]'s index in the model's flat buffer; master None (-w 0): the upcast params are
        updated and rounded back. m, v are float32 in both."""
        op = "adamw_update"
        n, master, seed32, offset = self._adamw_check(op, params, grads, m, v, master, seed, offset)
        bias_correction1 = 1.0 - beta1 ** t
        bias_correction2 = 1.0 - beta2 ** t
        # t mod 2^32 (bf16.stream_key)
        t32 = np.uint32(int(t) & 0xFFFFFFFF).view(np.int32)
        args = (params, grads, m, v, master, _i32(n), _f32(beta1), _f32(1.0 - beta1), _f32(beta2),
                _f32(1.0 - beta2), _f32(eps), _f32(lr / bias_correction1),
                _f32(1.0 / math.sqrt(bias_correction2)),
                _f32(1.0 - lr * weight_decay), _f32(grad_scale), t32, seed32, offset)
        self._launch(op, *self._elementwise(n), args, term="update")

    def adamw_update_device(self, params, grads, m, v, scalars, stats, beta1, beta2, eps, decayed,
                            grad_clip, *, master=None, seed=0, offset=0):
        """adamw_update with the step's scalars and clipping from device buffers (no host value
        changes per step, so a captured graph replays it): scalars (model.STEP_SCALARS, float32) =
        [lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t), 1 - lr weight_decay, t, loss limit, norm limit]
        (model.step_scalars: the first three rounded to float32 from double on the host, t mod 2^32
        stored as the bits of its slot, read by the bf16 build only; the limits: gpt2np.outlier, inf
        = none); stats (STATS) = [loss, squared grad norm]; grad_scale = grad_clip / norm when norm
        > grad_clip > 0 (clip <= 0: off); the decay applies when `decayed`. A non-finite loss or
        norm, or one above its limit, leaves params, master, m, v untouched.
        master, seed, offset: as adamw_update (bf16 storage only; constant over a run, so
        graphs replay them)."""
        op = "adamw_update"
        n, master, seed32, offset = self._adamw_check(op, params, grads, m, v, master, seed, offset)
        if scalars.dtype != np.float32 or scalars.size < STEP_SCALAR_SLOTS:
            raise KernelArgumentError(f"CudaBackend.{op}: scalars must be the float32 step-scalars "
                                      "buffer [step size, 1/sqrt(bias correction 2), decay, t "
                                      "bits, loss limit, norm "
                                      f"limit], got {scalars.size} {scalars.dtype}")
        clip = grad_clip if grad_clip is not None and grad_clip > 0 else 0.0
        args = (params, grads, m, v, master, _i32(n), scalars, stats, _i32(bool(decayed)),
                _f32(beta1), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2), _f32(eps),
                _f32(clip), seed32, offset)
        self._launch("adamw_update_device", *self._elementwise(n), args, term="update")

    def loss_mean(self, stats, losses, count, accumulate):
        """stats[LOSS] = mean(losses (B,T)) / count (+= with accumulate), on the
        device, deterministic."""
        N = losses.size
        self._check_int_size("loss_mean", "losses", N)
        threads = 1 << max(5, min(10, (N - 1).bit_length()))      # a power of two, 32..1024
        self._launch("loss_mean", (1,), (threads,),
                     (stats[:1], losses.reshape(-1), _i32(N), _i32(count), _i32(bool(accumulate))),
                     term="mean")

    def global_norm_squared_device(self, grads, stats):
        """stats[NORM_SQUARED] = sum(grads^2) of a flat buffer, left on the device (no sync)."""
        self._global_norm_squared(grads, stats[1:2])

    def global_norm_squared(self, grads):
        """sum(grads^2) of a flat buffer, as a Python float (synchronizes)."""
        total = self.scratch("norm_total", (1,), np.float32)
        self._global_norm_squared(grads, total)
        return float(self.rt.to_host(total)[0])

    def _global_norm_squared(self, grads, total):
        """total (1) = sum(grads^2): two deterministic stages."""
        op = "global_norm_squared"
        n = grads.size
        self._check_int_size(op, "grads", n)
        threads = int(self.norm_threads)
        blocks = int(max(1, min(self.norm_max_blocks, -(-n // threads))))
        partial = self.scratch("norm_partial", (blocks,), np.float32)
        self._launch("global_norm_squared_partial", (blocks,), (threads,),
                     (partial, grads, _i32(n)), term="sum_squares")
        finish_threads = _threads_for(blocks, 1024)
        self._launch("global_norm_squared_finish", (1,), (finish_threads,),
                     (total, partial, _i32(blocks)))
