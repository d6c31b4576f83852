"""Pick a backend by name: 'numpy' (CPU reference), 'cuda' (CuPy on a GPU), 'emu' (CUDA kernels on the CPU
emulator, for tests) or 'auto' (cuda when a GPU is usable, else numpy)."""


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine."""


def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get_backend(name: str = "numpy", **options):
    name = name.lower()
    if name == "auto":
        name = "cuda" if gpu_available() else "numpy"
    if name in ("numpy", "cpu"):
        from .numpy_backend import NumpyBackend
        return NumpyBackend(**options)
    if name == "cuda":
        if not gpu_available():
            raise BackendUnavailable("--device cuda: no CUDA GPU usable through CuPy here "
                                     "(pip install 'gpt2np[cuda]' on a machine with an NVIDIA GPU)")
        from .cuda.backend import CudaBackend
        from .cuda.runtime_cupy import CupyRuntime
        return CudaBackend(CupyRuntime(**options))
    if name in ("emu", "cuda-emu"):
        from .cuda.backend import CudaBackend
        from .cuda.runtime_emu import EmuRuntime
        return CudaBackend(EmuRuntime(**options))
    raise ValueError(f"unknown backend {name!r}: expected numpy, cuda, emu or auto")
