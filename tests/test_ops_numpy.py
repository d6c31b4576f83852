"""Each NumPy op's backward against float64 central finite differences of its forward, on tiny shapes."""
import math

import numpy as np
import pytest

from gpt2np.backend_numpy import NumpyBackend

be = NumpyBackend(dtype=np.float64, threads=1)
B, T, C, NH, OC = 2, 5, 8, 2, 6


def rand(*shape, seed=[0]):
    seed[0] += 1
    return np.random.default_rng(seed[0]).standard_normal(shape)


def numeric_grad(loss, x, eps=1e-6):
    """d loss / d x by central differences, perturbing x in place."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        up = loss()
        flat[i] = old - eps
        down = loss()
        flat[i] = old
        gflat[i] = (up - down) / (2 * eps)
    return g


def check(analytic, numeric, tol=1e-6):
    scale = max(1.0, np.abs(numeric).max())
    assert np.abs(analytic - numeric).max() / scale < tol


def test_encoder():
    Vp, maxT = 7, 6
    wte, wpe = rand(Vp, C), rand(maxT, C)
    inp = np.array([[1, 3, 3, 0, 6], [2, 1, 5, 5, 5]], np.int32)
    w = rand(B, T, C)
    out = np.zeros((B, T, C))

    def loss():
        be.encoder_forward(out, inp, wte, wpe)
        return float((out * w).sum())

    loss()
    np.testing.assert_allclose(out, wte[inp] + wpe[:T])
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    be.encoder_backward(dwte, dwpe, w, inp)
    check(dwte, numeric_grad(loss, wte))
    check(dwpe, numeric_grad(loss, wpe))


def test_layernorm():
    x, weight, bias, w = rand(B, T, C), rand(C), rand(C), rand(B, T, C)
    out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))

    def loss():
        be.layernorm_forward(out, mean, rstd, x, weight, bias)
        return float((out * w).sum())

    loss()
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * weight + bias
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    prior = rand(B, T, C)                       # dinp accumulates: start from a non-zero buffer
    dx, dweight, dbias = prior.copy(), np.ones(C), np.ones(C)
    be.layernorm_backward(dx, dweight, dbias, w, x, weight, mean, rstd)
    check(dx - prior, numeric_grad(loss, x))
    check(dweight - 1, numeric_grad(loss, weight))
    check(dbias - 1, numeric_grad(loss, bias))


@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul(with_bias):
    x, weight, w = rand(B, T, C), rand(OC, C), rand(B, T, OC)
    bias = rand(OC) if with_bias else None
    out = np.zeros((B, T, OC))

    def loss():
        be.matmul_forward(out, x, weight, bias)
        return float((out * w).sum())

    loss()
    np.testing.assert_allclose(out, x @ weight.T + (bias if with_bias else 0), rtol=1e-12)
    dx, dweight = np.full_like(x, 7.0), np.ones_like(weight)    # dinp is overwritten, dweight accumulates
    dbias = np.ones(OC) if with_bias else None
    be.matmul_backward(dx, dweight, dbias, w, x, weight)
    check(dx, numeric_grad(loss, x))
    check(dweight - 1, numeric_grad(loss, weight))
    if with_bias:
        check(dbias - 1, numeric_grad(loss, bias))
    fresh = np.full_like(weight, np.nan)                     # accumulate=False overwrites dweight
    be.matmul_backward(dx, fresh, None, w, x, weight, accumulate=False)
    np.testing.assert_allclose(fresh, dweight - 1, rtol=1e-12)


def test_attention():
    HS = C // NH
    x, w = rand(B, T, 3 * C), rand(B, T, C)
    out, qkvr, att = np.zeros((B, T, C)), np.zeros((3, B, NH, T, HS)), np.zeros((B, NH, T, T))

    def loss():
        be.attention_forward(out, qkvr, att, x)
        return float((out * w).sum())

    loss()
    # independent reference: explicit per-head loops
    q, k, v = np.split(x, 3, axis=-1)
    ref = np.zeros((B, T, C))
    for b in range(B):
        for h in range(NH):
            s = slice(h * HS, (h + 1) * HS)
            scores = q[b, :, s] @ k[b, :, s].T / math.sqrt(HS)
            scores[np.triu_indices(T, 1)] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            ref[b, :, s] = p @ v[b, :, s]
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)
    assert np.all(att[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)
    dx = np.zeros_like(x)
    be.attention_backward(dx, w, qkvr, att)
    check(dx, numeric_grad(loss, x))


def test_gelu():
    x, w = rand(B, T, 4 * C) * 2, rand(B, T, 4 * C)
    out = np.zeros_like(x)

    def loss():
        be.gelu_forward(out, x)
        return float((out * w).sum())

    loss()
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    dx = np.zeros_like(x)
    be.gelu_backward(dx, x, w)
    check(dx, numeric_grad(loss, x))
    aliased = w.copy()                          # dinp may alias dout
    be.gelu_backward(aliased, x, aliased)
    np.testing.assert_allclose(aliased, dx)


def test_residual():
    a, b_, w = rand(B, T, C), rand(B, T, C), rand(B, T, C)
    out = np.zeros_like(a)

    def loss():
        be.residual_forward(out, a, b_)
        return float((out * w).sum())

    loss()
    np.testing.assert_allclose(out, a + b_)
    da, db = np.ones_like(a), np.ones_like(b_)
    be.residual_backward(da, db, w)
    check(da - 1, numeric_grad(loss, a))
    check(db - 1, numeric_grad(loss, b_))


def test_fused_classifier():
    V, Vp = 11, 16
    logits = rand(B, T, Vp) * 3
    targets = np.random.default_rng(1).integers(0, V, (B, T)).astype(np.int32)
    dloss = 1.0 / (B * T)
    losses = np.zeros((B, T))

    def loss():
        be.fused_classifier(logits.copy(), losses, targets, V, dloss, write_dlogits=False)
        return float(losses.sum() * dloss)

    mean = loss()
    real = logits[..., :V]
    lse = np.log(np.exp(real - real.max(-1, keepdims=True)).sum(-1)) + real.max(-1)
    ref = lse - np.take_along_axis(real, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(losses, ref, rtol=1e-12)
    assert math.isclose(mean, ref.mean(), rel_tol=1e-12)
    untouched = logits.copy()
    be.fused_classifier(untouched, losses, targets, V, dloss, write_dlogits=False)
    np.testing.assert_array_equal(untouched, logits)          # no dlogits unless asked
    dlogits = logits.copy()
    be.fused_classifier(dlogits, losses, targets, V, dloss, write_dlogits=True)
    numeric = numeric_grad(loss, logits)
    check(dlogits, numeric)
    assert np.all(dlogits[..., V:] == 0)


def test_adamw_matches_formula():
    n = 1000
    p, g, m, v = rand(n), rand(n), rand(n) * 0.1, np.abs(rand(n)) * 0.1
    lr, b1, b2, eps, wd, t, scale = 1e-3, 0.9, 0.95, 1e-8, 0.1, 3, 0.5
    gs = g * scale
    m_ref = b1 * m + (1 - b1) * gs
    v_ref = b2 * v + (1 - b2) * gs * gs
    p_ref = p - lr * ((m_ref / (1 - b1 ** t)) / (np.sqrt(v_ref / (1 - b2 ** t)) + eps) + wd * p)
    be.adamw_update(p, g, m, v, lr, b1, b2, eps, wd, t, scale)
    np.testing.assert_allclose(m, m_ref, rtol=1e-12)
    np.testing.assert_allclose(v, v_ref, rtol=1e-12)
    np.testing.assert_allclose(p, p_ref, rtol=1e-10)


def test_global_norm_squared_large_and_threaded():
    g = np.random.default_rng(0).standard_normal(3_000_001).astype(np.float32)
    threaded = NumpyBackend(threads=2)
    assert math.isclose(threaded.global_norm_squared(g), float(np.dot(g.astype(np.float64), g)), rel_tol=1e-6)
