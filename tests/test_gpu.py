"""GPU tests (pytest -m gpu): the kernel and model parity tests on a real GPU through CuPy, plus a
d12 (GPT-2 124M) training smoke test. Skipped without CuPy and a CUDA device."""
import numpy as np
import pytest
from test_cuda_model import (  # noqa: E402,F401
    test_backward_gradients,
    test_forward_logits_and_loss,
    test_three_adamw_steps,
)

# The emulator tests, rerun with CuPy backends (the fixtures below replace the emulator ones).
from test_kernels import *  # noqa: E402,F401,F403

from gpt2np.backends import cuda_problem, gpu_available

# without a usable GPU (or with an incomplete CUDA install) the tests skip with the
# startup check's one line
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(),
                                 reason=f"needs a usable CUDA GPU: {cuda_problem()}")]


@pytest.fixture(scope="module")
def cuda():
    """Kernel tests on CuPy, with the same small launch shapes as on the emulator."""
    from test_kernels import small_launches

    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    return small_launches(CudaBackend(CupyRuntime(tf32=False)))


@pytest.fixture(scope="module")
def cuda_backend():
    """Model tests on CuPy with the default (production) launch shapes."""
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    return CudaBackend(CupyRuntime(tf32=False))


def test_default_launch_shapes_match_numpy():
    """The production launch configuration (big blocks, 128-row chunks) on a mid-size problem."""
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    from gpt2np.backends.numpy.backend import NumpyBackend
    from gpt2np.config import GPT2Config
    from gpt2np.model import GPT2
    cfg = GPT2Config(max_seq_len=256, vocab_size=1000, padded_vocab_size=1024, num_layers=2,
                     num_heads=4, channels=128)
    B, T = 4, 200
    ref = GPT2(cfg, NumpyBackend(), B, T, seed=1)
    gpu = GPT2(cfg, CudaBackend(CupyRuntime()), B, T, seed=1)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for model in (ref, gpu):
        model.forward(x, y, for_backward=True)
        model.zero_grad()
        model.backward()
    g_ref, g = ref.grads_host(), gpu.grads_host()
    assert gpu.mean_loss == pytest.approx(ref.mean_loss, rel=1e-5)
    for name in g_ref:
        scale = max(1e-3, float(np.abs(g_ref[name]).max()))
        assert float(np.abs(g[name] - g_ref[name]).max()) / scale < 1e-3, name


def test_d12_training_smoke():
    """GPT-2 124M at B=4, T=128: the first loss matches NumPy and 20 steps on one
    batch overfit it."""
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    from gpt2np.backends.numpy.backend import NumpyBackend
    from gpt2np.config import preset
    from gpt2np.model import GPT2
    from gpt2np.train_step import train_step
    cfg = preset("d12")
    B, T = 4, 128
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    gpu = GPT2(cfg, CudaBackend(CupyRuntime()), B, T, seed=0)
    ref = GPT2(cfg, NumpyBackend(), 1, 16, seed=0)
    gpu_first = gpu.forward(x[:1, :16], y[:1, :16])
    assert gpu_first == pytest.approx(ref.forward(x[:1, :16], y[:1, :16]), rel=1e-4)
    losses = []
    for step in range(20):
        loss, norm = train_step(gpu, lambda: (x, y), step=step, lr=3e-4)
        losses.append(loss)
        assert np.isfinite(norm)
    assert all(np.isfinite(losses))
    assert losses[0] == pytest.approx(np.log(cfg.vocab_size), rel=0.05)
    assert losses[-1] < losses[0] - 1.0
