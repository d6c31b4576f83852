"""The AdamW kernel tests (tests/test_bf16_optimizer.py: the bf16 build's update with fp32 master
weights or none (-w 0, a null master pointer through CuPy), stochastic rounding bit for bit the
reference's, skipped non-finite steps, graph replay, the fp32 build's step scalars) rerun on a real
GPU through CuPy (pytest -m gpu). NVRTC compiles without FMA contraction
(runtime_cupy.nvrtc_options), so the bitwise comparisons with the NumPy reference are meant to hold
on the GPU as on the emulator. Skipped without CuPy and a CUDA device; the bf16 ones need sm_80+."""
import pytest

# The emulator's optimizer tests, rerun with CuPy backends (the fixtures below
# replace the emulator ones).
from test_bf16_optimizer import *  # noqa: F401,F403

from gpt2np.backends import cuda_problem, gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a usable CUDA "
                                                  f"GPU: {cuda_problem()}")]


@pytest.fixture(scope="module")
def be():
    """The bf16 build on CuPy, with the emulator tests' launch settings (several blocks
    on small arrays)."""
    from gpt2np.backends import compute_capability
    if compute_capability() < 80:
        pytest.skip("bf16 needs sm_80 or newer")
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    from gpt2np.bf16 import BF16
    backend = CudaBackend(CupyRuntime(tf32=False), dtype=BF16)
    backend.elementwise_threads = 64
    backend.norm_threads, backend.norm_max_blocks = 64, 7
    return backend


@pytest.fixture(scope="module")
def be32():
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    backend = CudaBackend(CupyRuntime(tf32=False))
    backend.elementwise_threads = 64
    return backend
