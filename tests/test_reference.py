"""The PyTorch reference (gpt2np/torch_gpt2.py) against independent checks.

Its forward pass against a loop-by-loop NumPy transcription of the equations, its gradients against
central finite differences, and its AdamW against llm.c's update rule written out in NumPy; all in
float64 on a tiny config.
"""
import math
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="the PyTorch reference needs torch")

from gpt2np.config import GPT2Config
from gpt2np.tensors import DECAYED_BY_DEFAULT, PARAM_NAMES, num_parameters, param_shapes, views
from gpt2np.torch_gpt2 import ReferenceUnavailableError, TorchGPT2, require_torch

TINY = GPT2Config(max_seq_len=8, vocab_size=13, padded_vocab_size=16, num_layers=2, num_heads=2,
                  channels=8)
B, T = 2, 5


def random_params(cfg, seed=0, scale=0.3):
    """Flat float64 parameters with every tensor distinct (so swapped tensors would show)."""
    rng = np.random.default_rng(seed)
    flat = rng.normal(0.0, scale, num_parameters(cfg))
    p = views(flat, param_shapes(cfg))
    for name in ("ln1w", "ln2w", "lnfw"):
        p[name] += 1.0
    p["wte"][cfg.vocab_size:] = 0.0    # llm.c pads wte with zero rows
    return flat


def random_batch(cfg, seed=1, b=B, t=T):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32))


def naive_forward(flat, cfg, x, y):
    """GPT-2 one position, one head, one key at a time, in float64 NumPy ->
    (logits (B,T,V), loss)."""
    p = views(flat, param_shapes(cfg))
    C, NH, V = cfg.channels, cfg.num_heads, cfg.vocab_size
    HS = C // NH

    def ln(v, w, b):
        mu = v.sum() / C
        var = ((v - mu) ** 2).sum() / C
        return (v - mu) / math.sqrt(var + 1e-5) * w + b

    def gelu(u):
        return 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))

    nb, nt = x.shape
    logits = np.zeros((nb, nt, V))
    for b in range(nb):
        h = [p["wte"][x[b, t]] + p["wpe"][t] for t in range(nt)]
        for l in range(cfg.num_layers):
            qkv = [p["qkvw"][l] @ ln(h[t], p["ln1w"][l], p["ln1b"][l]) + p["qkvb"][l]
                   for t in range(nt)]
            for t in range(nt):
                atty = np.zeros(C)
                for hd in range(NH):
                    q = qkv[t][hd * HS:(hd + 1) * HS]
                    keys = [qkv[s][C + hd * HS:C + (hd + 1) * HS] for s in range(t + 1)]
                    vals = [qkv[s][2 * C + hd * HS:2 * C + (hd + 1) * HS] for s in range(t + 1)]
                    scores = np.array([q @ k / math.sqrt(HS) for k in keys])
                    w = np.exp(scores - scores.max())
                    w /= w.sum()
                    atty[hd * HS:(hd + 1) * HS] = sum(ws * v for ws, v in zip(w, vals))
                h[t] = h[t] + p["attprojw"][l] @ atty + p["attprojb"][l]
            for t in range(nt):
                u = gelu(p["fcw"][l] @ ln(h[t], p["ln2w"][l], p["ln2b"][l]) + p["fcb"][l])
                h[t] = h[t] + p["fcprojw"][l] @ u + p["fcprojb"][l]
        for t in range(nt):
            logits[b, t] = p["wte"][:V] @ ln(h[t], p["lnfw"], p["lnfb"])
    z = logits - logits.max(-1, keepdims=True)
    logsumexp = np.log(np.exp(z).sum(-1)) + logits.max(-1)
    loss = np.mean(logsumexp - np.take_along_axis(logits, y[..., None], -1)[..., 0])
    return logits, loss


def test_forward_matches_loop_transcription_of_the_equations():
    flat = random_params(TINY)
    x, y = random_batch(TINY)
    out = TorchGPT2(TINY, flat, "float64").forward_backward(x, y)
    logits, loss = naive_forward(flat, TINY, x, y)
    assert out.logits.shape == (B, T, TINY.vocab_size)
    np.testing.assert_allclose(out.logits, logits, rtol=0, atol=1e-12)
    assert abs(out.loss - loss) < 1e-12


def test_gradients_match_finite_differences():
    flat = random_params(TINY, seed=2)
    x, y = random_batch(TINY, seed=3)
    ref = TorchGPT2(TINY, flat, "float64")
    grads = ref.forward_backward(x, y).grads
    shapes = param_shapes(TINY)
    assert list(grads) == list(PARAM_NAMES)
    for name in PARAM_NAMES:
        assert grads[name].shape == shapes[name]

    def loss_at(delta_name, index, h):
        f = flat.copy()
        views(f, shapes)[delta_name][index] += h
        return naive_forward(f, TINY, x, y)[1]

    rng = np.random.default_rng(4)
    h = 1e-5
    for name in PARAM_NAMES:
        shape = shapes[name]
        picks = [tuple(int(rng.integers(0, n)) for n in shape) for _ in range(3)]
        if name == "wte":   # a row the batch reads through x, one only lm_head reads
            picks[0] = (int(x[0, 1]), int(rng.integers(0, TINY.channels)))
            picks[1] = (int(np.setdiff1d(np.arange(TINY.vocab_size), x)[0]), 0)
        for index in picks:
            fd = (loss_at(name, index, h) - loss_at(name, index, -h)) / (2 * h)
            assert abs(grads[name][index] - fd) <= 1e-7 + 1e-6 * abs(fd), (name, index, fd)


def test_padding_rows_and_unused_positions_get_zero_gradient():
    flat = random_params(TINY)
    x, y = random_batch(TINY)
    grads = TorchGPT2(TINY, flat, "float64").forward_backward(x, y).grads
    assert grads["wte"].shape == (TINY.padded_vocab_size, TINY.channels)
    assert not grads["wte"][TINY.vocab_size:].any()
    assert not grads["wpe"][T:].any() and grads["wpe"][:T].any()


def test_logits_are_causal():
    ref = TorchGPT2(TINY, random_params(TINY), "float64")
    x, y = random_batch(TINY)
    x2 = x.copy()
    x2[:, 3] = (x2[:, 3] + 1) % TINY.vocab_size
    a, b = ref.forward_backward(x, y).logits, ref.forward_backward(x2, y).logits
    np.testing.assert_array_equal(a[:, :3], b[:, :3])
    assert np.abs(a[:, 3:] - b[:, 3:]).min() > 0


def test_zero_weights_give_uniform_loss():
    flat = np.zeros(num_parameters(TINY))
    p = views(flat, param_shapes(TINY))
    for name in ("ln1w", "ln2w", "lnfw"):
        p[name][...] = 1.0
    out = TorchGPT2(TINY, flat, "float64").forward_backward(*random_batch(TINY))
    assert abs(out.loss - math.log(TINY.vocab_size)) < 1e-12


def test_float32_agrees_with_float64():
    flat = random_params(TINY)
    x, y = random_batch(TINY)
    o64 = TorchGPT2(TINY, flat, "float64").forward_backward(x, y)
    o32 = TorchGPT2(TINY, flat.astype(np.float32), "float32").forward_backward(x, y)
    assert o32.logits.dtype == np.float32 and o32.grads["qkvw"].dtype == np.float32
    assert np.abs(o32.logits - o64.logits).max() <= 1e-5 * np.abs(o64.logits).max()
    for name in PARAM_NAMES:
        assert (np.abs(o32.grads[name] - o64.grads[name]).max()
                <= 1e-5 * np.abs(o64.grads[name]).max())


def llmc_adamw_numpy(flat, grads_flat, m, v, t, lr, b1, b2, eps, wd, grad_scale):
    """llm.c's AdamW over the flat buffer, in NumPy (the per-tensor weight decay
    set by the caller)."""
    g = grads_flat * grad_scale
    m[:] = b1 * m + (1 - b1) * g
    v[:] = b2 * v + (1 - b2) * g * g
    mhat = m / (1 - b1 ** t)
    vhat = v / (1 - b2 ** t)
    flat -= lr * (mhat / (np.sqrt(vhat) + eps) + wd * flat)


@pytest.mark.parametrize("grad_clip", [0.05, 1e6])   # clipping active / inactive
def test_take_steps_follows_llmc_adamw(grad_clip):
    flat = random_params(TINY, seed=5)
    x, y = random_batch(TINY, seed=6)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ref = TorchGPT2(TINY, flat, "float64")
    losses = ref.take_steps(x, y, 3, **hp, decay_tensors=DECAYED_BY_DEFAULT, grad_clip=grad_clip)

    want = flat.copy()
    m, v = np.zeros_like(want), np.zeros_like(want)
    wd = np.zeros_like(want)
    for name, view in views(wd, param_shapes(TINY)).items():
        view[...] = hp["weight_decay"] if name in DECAYED_BY_DEFAULT else 0.0
    want_losses, clipped = [], []
    for t in range(1, 4):
        out = TorchGPT2(TINY, want, "float64").forward_backward(x, y)
        g = np.concatenate([out.grads[n].ravel() for n in PARAM_NAMES])
        norm = np.sqrt(np.sum(g * g))
        scale = grad_clip / norm if norm > grad_clip else 1.0
        clipped.append(norm > grad_clip)
        want_losses.append(out.loss)
        llmc_adamw_numpy(want, g, m, v, t, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], wd, scale)
    assert all(clipped) == (grad_clip < 1)
    np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-12)
    assert losses[2] < losses[0]
    # atol 1e-10, not 1e-12: the key-bias gradient is exactly 0 in exact arithmetic (softmax ignores
    # a shift shared by all scores), so both sides hold ~1e-17 rounding noise there, which AdamW
    # scales up to ~lr * noise / eps ~ 1e-11.
    np.testing.assert_allclose(ref.params_host(), want, rtol=0, atol=1e-10)


def test_bad_inputs_raise_one_line_errors():
    ref = TorchGPT2(TINY, random_params(TINY), "float64")
    x, y = random_batch(TINY)
    with pytest.raises(ValueError, match="outside"):
        ref.forward_backward(x, np.full_like(y, TINY.vocab_size))
    with pytest.raises(ValueError, match="max_seq_len"):
        ref.forward_backward(*random_batch(TINY, t=TINY.max_seq_len + 1))
    with pytest.raises(ValueError, match="parameters"):
        TorchGPT2(TINY, np.zeros(10))
    with pytest.raises(ValueError, match="dtype"):
        TorchGPT2(TINY, random_params(TINY), "float16")


def test_missing_torch_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ReferenceUnavailableError) as e:
        require_torch()
    assert "pip install torch" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ImportError):
        TorchGPT2(TINY, random_params(TINY))
