"""bf16 GPU tests (pytest -m gpu): the bf16 kernel tests (tests/test_bf16_kernels.py) rerun on a
real GPU through CuPy, and the whole bf16 model on the GPU against fp32 with the emulator's criteria
(tests/test_bf16_cuda_model.py). Skipped without CuPy and a CUDA device with bf16
tensor cores (sm_80+)."""
import pytest
from test_bf16_cuda_model import fp32, loss_and_grads, rel  # noqa: F401  (fp32: a fixture)

# The emulator's bf16 kernel tests, rerun with a CuPy backend (the fixture below
# replaces the emulator one).
from test_bf16_kernels import *  # noqa: E402,F401,F403

from gpt2np.backends import cuda_problem, gpu_available
from gpt2np.tensors import PARAM_NAMES


def _sm80():
    if not gpu_available():
        return False
    from gpt2np.backends import compute_capability
    return compute_capability() >= 80


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(),
                                 reason=f"needs a usable CUDA GPU: {cuda_problem()}"),
              pytest.mark.skipif(gpu_available() and not _sm80(),
                                 reason="bf16 needs sm_80 or newer")]


@pytest.fixture(scope="module")
def cuda():
    """The bf16 kernel tests on CuPy, with the emulator tests' small launch shapes."""
    from test_bf16_kernels import small_launches

    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    from gpt2np.bf16 import BF16
    return small_launches(CudaBackend(CupyRuntime(tf32=False), dtype=BF16))


@pytest.mark.parametrize("attention", ["flash", "naive"])
def test_bf16_model_on_the_gpu_errs_like_the_reference(fp32, attention):  # noqa: F811
    from gpt2np.backends import get_backend
    ref_loss, ref = fp32
    gpu_loss, gpu = loss_and_grads(get_backend("cuda", "bf16"), attention)
    np_loss, npb = loss_and_grads(get_backend("numpy", "bf16"), attention)
    assert abs(gpu_loss - ref_loss) <= max(2 * abs(np_loss - ref_loss), 2e-3), (gpu_loss, np_loss,
                                                                                ref_loss)
    for name in PARAM_NAMES:
        ours, reference = rel(gpu[name], ref[name]), rel(npb[name], ref[name])
        assert ours <= 2 * reference + 1e-3 and ours < 0.05, (name, ours, reference)
