"""Pick a backend by name: 'numpy' (CPU reference), 'cuda' (CuPy on a GPU), 'emu' (CUDA kernels on
the CPU emulator, for tests) or 'auto' (cuda when a GPU is usable, else numpy), at a precision:
'fp32' everywhere, 'tf32' (TF32 tensor cores for the cuBLAS matmuls; the emulator rounds the GEMM
inputs the same way), 'bf16' (llm.c's mixed precision: bf16 storage, fp32 compute and accumulation,
fp32 master weights; numpy_bf16.py is the reference, the CUDA backend's bf16 build of its kernels
(kernels/common.cuh's floatX) with bf16 cuBLAS GEMMs runs it on a GPU with bf16 tensor cores
(sm_80+) and on the emulator).

Whether the GPU can be used is one function, cuda_problem(): None, or one line saying what is
missing or wrong (CuPy, the driver, a GPU, cuBLAS, NVRTC) and how to fix it; `--device cuda` without
a usable GPU ends with it. Training's default precision is resolve_precision(): tf32 on a GPU with
tensor cores (sm_80+), fp32 elsewhere.
"""
import importlib
import os
from dataclasses import dataclass

from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.backends.numpy.bf16 import Bf16NumpyBackend
from gpt2np.bf16 import BF16
from gpt2np.errors import BadInput
from gpt2np.tensors import ATTENTIONS

PRECISIONS = {"numpy": ("fp32", "bf16"), "cuda": ("fp32", "tf32", "bf16"),
              "emu": ("fp32", "tf32", "bf16")}

# the CUDA that cupy-cuda13x and the nvidia-*-cu13 wheels are built for
CUDA_MAJOR = 13
MIN_DRIVER_CUDA = 13000          # cudaDriverGetVersion() of a driver for CUDA 13.0 (R580 and newer)
MIN_COMPUTE_CAPABILITY = 75      # CUDA 13 builds for Turing (sm_75) and newer
TENSOR_CORE_TF32 = 80            # TF32 and bf16 tensor cores: Ampere (sm_80) and newer
INSTALL = 'pip install -e ".[cuda]"'


@dataclass(frozen=True)
class Traits:
    """What the code above the backends may ask of a device: the attributes every backend instance
    has too, and for a --device name before there is a backend (device_traits). Nothing outside
    backends/ checks a name."""
    on_gpu: bool              # a real GPU: device memory, CUDA events, MFU against the GPU's peak
    launches_kernels: bool    # runs kernels/*.cu, on a GPU or on the CPU emulator
    has_cpu_math: bool        # takes --cpu-math (the NumPy backend)
    label: str                # the device as the training header names it


TRAITS = {"numpy": Traits(False, False, True, "cpu"), "cuda": Traits(True, True, False, "cuda"),
          "emu": Traits(False, True, False, "cuda (the CPU emulator)")}


def device_traits(name: str) -> Traits:
    """The Traits of the backend a --device name selects (resolve_name: auto, cpu, cuda-emu)."""
    resolved = resolve_name(name)
    if resolved not in TRAITS:
        raise ValueError(f"unknown backend {resolved!r}: expected numpy, cuda, emu or auto")
    return TRAITS[resolved]


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine."""


class PrecisionUnavailable(ValueError):
    """The requested precision has no implementation on that backend (bad input:
    exit 2, one line)."""


def cuda_status(cupy=None, import_module=importlib.import_module):
    """(problem, gpu_seen): problem is None when CuPy can run gpt2np's CUDA backend here, else one
    line saying what is missing or wrong and how to fix it; gpu_seen says whether a driver and a GPU
    were found (so a problem past that point is a broken install on a GPU machine, not a
    machine without a GPU).

    cupy / import_module: stand-ins for tests; by default the real CuPy and importlib."""
    if cupy is None:
        try:
            cupy = import_module("cupy")
        except ImportError as e:
            return (f"CuPy is not installed ({e}): {INSTALL} installs CuPy for CUDA {CUDA_MAJOR} "
                    "and its libraries", False)
        except Exception as e:
            # e.g. two CuPy packages installed side by side
            return f"CuPy cannot be imported ({_short(e)}): reinstall it with {INSTALL}", False
    runtime = cupy.cuda.runtime
    try:
        driver = int(runtime.driverGetVersion())
    except Exception as e:
        driver, error = 0, e
    else:
        error = None
    if driver <= 0:
        why = f" ({_short(error)})" if error else ""
        return (f"no NVIDIA driver found{why}: this machine has no NVIDIA GPU, or its driver is "
                f"not installed (CUDA {CUDA_MAJOR} needs driver R580 or newer)"), False
    if driver < MIN_DRIVER_CUDA:
        return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, CuPy for CUDA "
                f"{CUDA_MAJOR} needs a driver for CUDA {_cuda_version(MIN_DRIVER_CUDA)} or newer: "
                "update the driver to R580 or newer (nvidia-smi shows its version)"), False
    try:
        count = int(runtime.getDeviceCount())
    except Exception as e:
        count, error = 0, e
    if count <= 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f"CUDA_VISIBLE_DEVICES={visible!r} may hide them; " if visible is not None else ""
        hint = hidden + "nvidia-smi shows whether the driver sees one"
        why = f" ({_short(error)})" if error else ""
        return f"the NVIDIA driver sees no GPU{why}: {hint}", False
    try:
        device = runtime.getDevice()
        props = runtime.getDeviceProperties(device)
        capability = int(props["major"]) * 10 + int(props["minor"])
    except Exception as e:
        return (f"GPU {_short(e)}: cannot read the GPU's properties (nvidia-smi shows "
                "whether it is healthy)", True)
    if capability < MIN_COMPUTE_CAPABILITY:
        return (f"{_text(props.get('name', 'the GPU'))} is sm_{capability}; CUDA {CUDA_MAJOR} runs "
                "on sm_75 (Turing) and newer: use a newer GPU, or --device cpu"), True
    try:
        # through the package: its __getattr__ preloads the wheel's libcublas (the module alone has
        # no RPATH)
        import_module("cupy_backends.cuda.libs").cublas  # noqa: B018 (the access loads it)
    except Exception as e:
        return (f"cuBLAS for CUDA {CUDA_MAJOR} not found ({_short(e)}): pip install "
                f"'nvidia-cublas>=13,<14' (or {INSTALL})"), True
    try:
        version = tuple(cupy.cuda.nvrtc.getVersion())
    except Exception as e:
        return (f"NVRTC for CUDA {CUDA_MAJOR} not found ({_short(e)}): pip install "
                f"'nvidia-cuda-nvrtc>=13,<14' (or {INSTALL})"), True
    if version[0] != CUDA_MAJOR:
        return (f"NVRTC {version[0]}.{version[1]} found, CuPy for CUDA {CUDA_MAJOR} needs NVRTC "
                f"{CUDA_MAJOR}: pip install 'nvidia-cuda-nvrtc>=13,<14'"), True
    return None, True


_status = None


def cuda_problem(cupy=None, import_module=importlib.import_module):
    """One line saying why the CUDA backend cannot run here and how to fix it, or None when it can
    (see cuda_status). The answer for the real CuPy is computed once per process."""
    global _status
    if cupy is not None or import_module is not importlib.import_module:
        return cuda_status(cupy, import_module)[0]
    if _status is None:
        _status = cuda_status()
    return _status[0]


def gpu_present() -> bool:
    """Whether a driver and a GPU were found, usable or not (cuda_status's gpu_seen)."""
    cuda_problem()
    return _status[1]


def gpu_available() -> bool:
    """Whether the CUDA backend can run here (a GPU, a new enough driver, CuPy,
    cuBLAS and NVRTC)."""
    return cuda_problem() is None


def _short(error) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def compute_capability():
    """The current GPU's compute capability as an int (80 for sm_80)."""
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    return int(props["major"]) * 10 + int(props["minor"])


def resolve_name(name: str) -> str:
    """The backend a name selects: 'auto' -> 'cuda' or 'numpy'; 'cpu' -> 'numpy';
    'cuda-emu' -> 'emu'."""
    name = name.lower()
    if name == "auto":
        return "cuda" if gpu_available() else "numpy"
    return {"cpu": "numpy", "cuda-emu": "emu"}.get(name, name)


def resolve_precision(name: str, requested: str | None = None, capability=None):
    """(precision, note) a run on backend `name` computes in, for a requested precision
    (None: the default).

    The default is tf32 on a GPU with TF32 tensor cores (sm_80+), as llm.c and PyTorch's
    set_float32_matmul_precision("high") do, and fp32 elsewhere (older GPUs, the CPU, the emulator).
    A tf32 request that cannot be honoured runs in fp32 with a note saying why: on the CPU, on a GPU
    without TF32 tensor cores, and under NVIDIA_TF32_OVERRIDE=0 (which turns TF32 off inside
    cuBLAS). note is None otherwise. capability: the GPU's compute capability (default: asked from
    the current device)."""
    name = resolve_name(name)
    if name not in PRECISIONS:
        raise ValueError(f"unknown backend {name!r}: expected numpy, cuda, emu or auto")
    if requested not in (None, "fp32", "tf32", "bf16"):
        raise ValueError(f"unknown precision {requested!r}: expected fp32, tf32 or bf16")
    if requested == "bf16":
        if name == "cuda":
            if capability is None:
                problem = cuda_problem()
                if problem:
                    raise BackendUnavailable(f"--device cuda: {problem}")
                capability = compute_capability()
            if int(capability) < TENSOR_CORE_TF32:
                raise PrecisionUnavailable(f"--precision bf16: this GPU (sm_{int(capability)}) has "
                                           "no bf16 tensor cores (sm_80 and newer have them); use "
                                           "--precision fp32 on it, or bf16 "
                                           f"on the CPU (--device cpu)")
        return "bf16", None
    if name == "emu":
        return requested or "fp32", None
    if name == "numpy":
        note = ("--precision tf32 is a GPU precision; the CPU computes in fp32"
                if requested == "tf32" else None)
        return "fp32", note
    if capability is None:
        problem = cuda_problem()
        if problem:
            raise BackendUnavailable(f"--device cuda: {problem}")
        capability = compute_capability()
    if requested == "fp32":
        return "fp32", None
    capability = int(capability)
    if capability < TENSOR_CORE_TF32:
        note = (f"this GPU (sm_{capability}) has no TF32 tensor cores (sm_80 and newer have them); "
                "the matmuls run in fp32") if requested == "tf32" else None
        return "fp32", note
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return "fp32", "NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS; the matmuls run in fp32"
    return "tf32", None


def resolve_attention(backend, head_size: int, requested: str | None = None, capability=None):
    """(attention, note) for a model of this head size on `backend`, for a requested attention
    (None: the default, flash on the cuda backend and naive on the CPU, as
    TrainConfig's --attention says).

    The CUDA flash kernels need head size 64 and TF32 tensor cores (sm_80+): where they cannot run,
    the default falls back to naive with a note, and an explicit --attention flash is BadInput (one
    line). The NumPy backend runs either at any head size. capability: the GPU's compute capability
    (default: asked from its runtime)."""
    if requested not in (None, *ATTENTIONS):
        raise BadInput(f"--attention {requested}: expected {' or '.join(ATTENTIONS)}")
    attention = requested or ("flash" if backend.name == "cuda" else "naive")
    if attention == "naive" or backend.name != "cuda":
        return attention, None
    if capability is None:
        ask = getattr(getattr(backend, "rt", None), "compute_capability", None)
        capability = ask() if ask else None
    problem = None
    if head_size != 64:
        problem = f"the flash attention kernels need head size 64, this model's is {head_size}"
    elif capability is not None and int(capability) < TENSOR_CORE_TF32:
        problem = ("the flash attention kernels need TF32 tensor cores (sm_80 and newer), this GPU "
                   f"is sm_{capability}")
    if problem is None:
        return "flash", None
    if requested == "flash":
        raise BadInput(f"--attention flash: {problem}; use --attention naive")
    return "naive", f"{problem}: attention runs naive"


def inference_backend(device: str, head_size: int, cpu_math: str | None = None):
    """(backend, attention) for sampling and evaluation on --device: training's defaults there
    (resolve_precision: tf32 on a GPU with tensor cores; resolve_attention: flash where its kernels
    can run), notes dropped. cpu_math: the numpy backend's math (train.py's --cpu-math; None: its
    default, fast); a ValueError off the CPU."""
    name = resolve_name(device)
    if cpu_math and name != "numpy":
        raise ValueError(f"--cpu-math {cpu_math}: only for the CPU (numpy backend), not "
                         f"--device {device}")
    backend = get_backend(name, precision=resolve_precision(name)[0],
                          **({"math": cpu_math} if cpu_math else {}))
    return backend, resolve_attention(backend, head_size)[0]


def get_backend(name: str = "numpy", precision: str = "fp32", **options):
    """A backend instance; options go to the backend (numpy: threads, math) or the runtime
    (emulator: schedule).

    precision is taken as given (fp32 unless asked); resolve_precision gives training's default.
    numpy's math is training's default, "fast" (the class NumpyBackend's own default is the
    exact reference)."""
    name = resolve_name(name)
    if name == "numpy":
        options.setdefault("math", "fast")
    if name not in PRECISIONS:
        raise ValueError(f"unknown backend {name!r}: expected numpy, cuda, emu or auto")
    if precision not in PRECISIONS[name]:
        raise ValueError(f"backend {name} has no precision {precision!r}: expected "
                         f"{', '.join(PRECISIONS[name])}")
    if name == "numpy" and precision == "bf16":
        return Bf16NumpyBackend(**options)
    if name == "numpy":
        return NumpyBackend(**options)
    dtype = BF16 if precision == "bf16" else "float32"        # bf16: the bf16 build of every kernel
    if name == "cuda":
        problem = cuda_problem()
        if problem:
            raise BackendUnavailable(f"--device cuda: {problem}")
        return CudaBackend(CupyRuntime(tf32=precision == "tf32", **options), dtype=dtype)
    return CudaBackend(EmuRuntime(tf32=precision == "tf32", **options), dtype=dtype)
