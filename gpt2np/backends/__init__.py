"""Pick a backend by name: 'numpy' (CPU reference), 'cuda' (CuPy on a GPU), 'emu' (CUDA kernels on the CPU
emulator, for tests) or 'auto' (cuda when a GPU is usable, else numpy), at a precision: 'fp32' everywhere,
'tf32' (TF32 tensor cores for the cuBLAS matmuls) on a GPU."""

PRECISIONS = {"numpy": ("fp32",), "cuda": ("fp32", "tf32"), "emu": ("fp32",)}


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine."""


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_name(name: str) -> str:
    """The backend a name selects: 'auto' -> 'cuda' or 'numpy'; 'cpu' -> 'numpy'; 'cuda-emu' -> 'emu'."""
    name = name.lower()
    if name == "auto":
        return "cuda" if gpu_available() else "numpy"
    return {"cpu": "numpy", "cuda-emu": "emu"}.get(name, name)


def get_backend(name: str = "numpy", precision: str = "fp32", **options):
    """A backend instance; options go to the backend (numpy: threads) or the emulator runtime (schedule)."""
    name = resolve_name(name)
    if name not in PRECISIONS:
        raise ValueError(f"unknown backend {name!r}: expected numpy, cuda, emu or auto")
    if precision not in PRECISIONS[name]:
        raise ValueError(f"backend {name} has no precision {precision!r}: expected {', '.join(PRECISIONS[name])}")
    if name == "numpy":
        from .numpy_backend import NumpyBackend
        return NumpyBackend(**options)
    from .cuda.backend import CudaBackend
    if name == "cuda":
        if not gpu_available():
            raise BackendUnavailable("--device cuda: no CUDA GPU usable through CuPy here "
                                     "(pip install 'gpt2np[cuda]' on a machine with an NVIDIA GPU)")
        from .cuda.runtime_cupy import CupyRuntime
        return CudaBackend(CupyRuntime(tf32=precision == "tf32", **options))
    from .cuda.runtime_emu import EmuRuntime
    return CudaBackend(EmuRuntime(**options))
