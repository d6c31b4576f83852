"""A step's first backward overwrites every gradient instead of adding to it.

train_step's first micro-batch calls backward(accumulate=False), which saves zero_grad()'s pass over
the buffer; zero_grad() then backward() (adding to the zeros) must give the same. Checked on the
NumPy backend and on the CUDA backend (kernels on the CPU emulator): a gradient buffer full of NaN
before the step must leave no trace, including the rows no op writes to at a smaller (b, t) (wpe
rows t.., the wte padding rows), and reading the gradients after zero_grad() sees zeros.
"""
import numpy as np
import pytest

from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2

CFG = GPT2Config(max_seq_len=8, vocab_size=37, padded_vocab_size=40, num_layers=2, num_heads=2,
                 channels=16)
B, T = 2, 6
STARTS = ["overwrite", "zero_grad"]     # a step's start: backward(accumulate=False), or zero_grad()


@pytest.fixture(params=["numpy", "emulated-cuda"])
def backend(request):
    if request.param == "numpy":
        return NumpyBackend(threads=2)
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    be = CudaBackend(EmuRuntime())
    be.elementwise_threads = 64
    return be


def batch(b, t, seed):
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def grads_from_zero(backend, *batches):
    """Reference: gradients accumulated over `batches` into a buffer that really holds zeros."""
    model = GPT2(CFG, backend, B, T, seed=0)
    model.backend.fill_(model.grads, 0.0)
    for x, y in batches:                                        # the "+=" path throughout
        model.forward(x, y, for_backward=True, grad_accum_steps=len(batches))
        model.backward(accumulate=True)
    return model.backend.to_host(model.grads)


def poisoned_model(backend):
    model = GPT2(CFG, backend, B, T, seed=0)
    model.backend.fill_(model.grads, float("nan"))
    return model


def start_step(model, start):
    """Begin a step as `start` says -> the first backward's accumulate."""
    if start == "zero_grad":
        model.zero_grad()
    return start == "zero_grad"


@pytest.mark.parametrize("start", STARTS)
def test_first_backward_overwrites_everything(backend, start):
    # smaller than (B, T): wpe rows t.. unwritten
    x, y = batch(B - 1, T - 2, seed=1)
    model = poisoned_model(backend)
    accumulate = start_step(model, start)
    model.forward(x, y, for_backward=True)
    model.backward(accumulate=accumulate)
    got = model.backend.to_host(model.grads)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, grads_from_zero(backend, (x, y)))
    grad = model.grads_host()
    assert np.all(grad["wpe"][T - 2:] == 0.0) and np.all(grad["wte"][CFG.vocab_size:] == 0.0)


@pytest.mark.parametrize("start", STARTS)
def test_accumulation_after_the_first_backward(backend, start):
    batches = [batch(B, T, seed=s) for s in (2, 3)]
    model = poisoned_model(backend)
    accumulate = start_step(model, start)
    for x, y in batches:
        model.forward(x, y, for_backward=True, grad_accum_steps=2)
        model.backward(accumulate=accumulate)
        accumulate = True
    np.testing.assert_array_equal(model.backend.to_host(model.grads),
                                  grads_from_zero(backend, *batches))


def test_reading_grads_after_zero_grad_sees_zeros(backend):
    model = poisoned_model(backend)
    model.zero_grad()
    assert model.grad_norm() == 0.0
    assert np.all(model.backend.to_host(model.grads) == 0.0)
    model = poisoned_model(backend)
    model.zero_grad()
    assert all(np.all(g == 0.0) for g in model.grads_host().values())


def test_backward_refuses_a_forward_that_left_no_dlogits():
    """backward() starts from the dlogits of forward(for_backward=True); after a forward that kept
    the logits it needs from_logits=True, and after one without targets it cannot run: one
    RuntimeError each, never gradients of the wrong thing. logits_host() refuses once dlogits were
    written over the logits."""
    cfg = GPT2Config(max_seq_len=8, vocab_size=32, padded_vocab_size=32, num_layers=1, num_heads=2,
                     channels=8)
    model = GPT2(cfg, NumpyBackend(threads=1), 2, 8, seed=1)
    x = np.arange(16, dtype=np.int32).reshape(2, 8) % 32
    model.forward(x)
    with pytest.raises(RuntimeError, match="with targets"):
        model.backward()
    model.forward(x, x)
    with pytest.raises(RuntimeError, match="from_logits"):
        model.backward()
    model.backward(from_logits=True)
    with pytest.raises(RuntimeError, match="dlogits"):
        model.logits_host()
    model.forward(x, x, for_backward=True)
    with pytest.raises(RuntimeError, match="with targets"):
        model.backward(from_logits=True)
    model.backward()
