"""The whole GPT-2 on the CUDA backend (kernels on the CPU emulator) against the NumPy backend.

A tiny config with odd sizes (T=5, V=37 padded to 64): logits, loss, every parameter gradient,
the gradient norm and the parameters after 3 AdamW steps must match. test_gpu.py reruns these on
CuPy by overriding the `cuda_backend` fixture.
"""
import numpy as np
import pytest
from noise_params import key_bias_mask

from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.tensors import PARAM_NAMES
from gpt2np.train_step import AdamW, train_step

CFG = GPT2Config(max_seq_len=8, vocab_size=37, padded_vocab_size=64, num_layers=2, num_heads=2,
                 channels=16)
B, T = 2, 5


@pytest.fixture(scope="module", params=["forward", "reverse"])
def cuda_backend(request):
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    be = CudaBackend(EmuRuntime(schedule=request.param))
    be.elementwise_threads = 64                     # small blocks: quicker on the emulator
    be.reduce_rows_per_chunk = 4
    return be


def batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def models(cuda_backend):
    return (GPT2(CFG, NumpyBackend(threads=1), B, T, seed=0), GPT2(CFG, cuda_backend, B, T, seed=0))


def test_forward_logits_and_loss(cuda_backend):
    ref, gpu = models(cuda_backend)
    x, y = batch()
    loss_ref, loss = ref.forward(x, y), gpu.forward(x, y)
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    np.testing.assert_allclose(gpu.logits_host(), ref.logits_host(), rtol=1e-4, atol=1e-5)
    # inference without targets, on a shorter batch than allocated
    ref.forward(x[:1, :3]), gpu.forward(x[:1, :3])
    np.testing.assert_allclose(gpu.logits_host(), ref.logits_host(), rtol=1e-4, atol=1e-5)


def test_backward_gradients(cuda_backend):
    ref, gpu = models(cuda_backend)
    x, y = batch(1)
    for model in (ref, gpu):
        # both paths: dlogits in forward, or in backward
        model.forward(x, y, for_backward=model is gpu)
        model.zero_grad()
        model.backward(from_logits=model is not gpu)
    g_ref, g = ref.grads_host(), gpu.grads_host()
    for name in PARAM_NAMES:
        scale = max(1e-3, float(np.abs(g_ref[name]).max()))
        err = float(np.abs(g[name] - g_ref[name]).max()) / scale
        assert err < 2e-4, f"{name}: max error {err:.2e} relative to max |grad| {scale:.2e}"
    assert np.all(g["wte"][CFG.vocab_size:] == 0.0)
    assert gpu.grad_norm() == pytest.approx(ref.grad_norm(), rel=1e-5)


def test_three_adamw_steps(cuda_backend):
    ref, gpu = models(cuda_backend)
    losses = {id(ref): [], id(gpu): []}
    for step in range(1, 4):
        x, y = batch(10 + step)
        for model in (ref, gpu):
            loss, _ = train_step(model, lambda x=x, y=y: (x, y), step=step - 1, lr=3e-3,
                                 # clipping active on tiny models too
                                 adamw=AdamW(weight_decay=0.1, grad_clip=0.5))
            losses[id(model)].append(loss)
    np.testing.assert_allclose(losses[id(gpu)], losses[id(ref)], rtol=1e-5)
    noise = key_bias_mask(CFG)
    np.testing.assert_allclose(gpu.params_host()[~noise], ref.params_host()[~noise], rtol=1e-4,
                               atol=2e-6)
    # 2 lr a step
    assert np.all(np.abs(gpu.params_host()[noise] - ref.params_host()[noise]) <= 2 * 3 * 3e-3)


def test_gradients_do_not_depend_on_the_thread_schedule():
    """Every reduction is fixed-order (encoder_backward's dwte too: grouped by token, no atomics),
    so every gradient is bitwise identical whichever order the emulator runs
    threads and blocks in."""
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    grads = []
    for schedule in ("forward", "reverse"):
        model = GPT2(CFG, CudaBackend(EmuRuntime(schedule=schedule)), B, T, seed=0)
        x, y = batch(2)
        # repeated token ids: several rows into one dwte row
        x[0, :3] = x[1, 1] = 4
        model.forward(x, y, for_backward=True)
        model.zero_grad()
        model.backward()
        grads.append(model.grads_host())
    for name in PARAM_NAMES:
        assert np.array_equal(grads[0][name], grads[1][name]), name


# ---- fusion (GPT2(fuse=...), --fuse): the same model, fewer passes -------------------------------

def fused_pair(tf32):
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    return [GPT2(CFG, CudaBackend(EmuRuntime(tf32=tf32)), B, T, seed=0, fuse=fuse)
            for fuse in (False, True)]


@pytest.mark.parametrize("tf32", [False, True])
def test_fused_and_unfused_loss_and_gradients_agree(tf32):
    """The emulated CUDA path with and without the fused ops (GEMM epilogues, residual + LayerNorm,
    one-pass LayerNorm backward): the loss and every gradient, accumulated over two micro-batches
    (the bias gradients' epilogue writes a scratch sum that is then added), within
    fp32 / TF32 rounding."""
    unfused, fused = fused_pair(tf32)
    losses = []
    for model in (unfused, fused):
        model.zero_grad()
        for micro in range(2):
            x, y = batch(20 + micro)
            losses.append(model.forward(x, y, for_backward=True, grad_accum_steps=2))
            model.backward()
    assert losses[2:] == pytest.approx(losses[:2], rel=1e-6 if not tf32 else 1e-5)
    g_unfused, g_fused = unfused.grads_host(), fused.grads_host()
    # both paths round the same GEMM inputs to TF32; the rest is fp32 order (seen: 2e-7)
    tolerance = 2e-5
    for name in PARAM_NAMES:
        scale = max(1e-3, float(np.abs(g_unfused[name]).max()))
        err = float(np.abs(g_fused[name] - g_unfused[name]).max()) / scale
        assert err < tolerance, f"{name}: max error {err:.2e} relative to max |grad| {scale:.2e}"


def test_fused_and_unfused_stay_close_over_ten_steps():
    unfused, fused = fused_pair(tf32=True)
    losses = {False: [], True: []}
    for step in range(10):
        x, y = batch(30 + step)
        for model in (unfused, fused):
            loss, _ = train_step(model, lambda x=x, y=y: (x, y), step=step, lr=3e-3,
                                 adamw=AdamW(weight_decay=0.1))
            losses[model.fuse].append(loss)
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-4)
    noise = key_bias_mask(CFG)
    np.testing.assert_allclose(fused.params_host()[~noise], unfused.params_host()[~noise],
                               rtol=1e-3, atol=1e-5)
    assert np.all(np.abs(fused.params_host()[noise] - unfused.params_host()[noise])
                  <= 2 * 10 * 3e-3)


def test_fused_ops_on_numpy_are_the_unfused_sequence_bitwise():
    """On the NumPy backend the fused ops compose the ops they replace: --fuse 1
    gives the same bits."""
    runs = []
    for fuse in (False, True):
        model = GPT2(CFG, NumpyBackend(threads=1), B, T, seed=0, fuse=fuse)
        losses = [train_step(model, lambda s=s: batch(40 + s), step=s, lr=3e-3,
                             adamw=AdamW(weight_decay=0.1))[0]
                  for s in range(2)]
        runs.append((losses, model.grads_host(), model.params_host()))
    (l0, g0, p0), (l1, g1, p1) = runs
    assert l0 == l1 and np.array_equal(p0, p1)
    assert all(np.array_equal(g0[name], g1[name]) for name in PARAM_NAMES)
