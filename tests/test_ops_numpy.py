"""Each reference op's backward (gpt2np/ops/reference) against float64 central finite differences of
its forward, on tiny shapes; and the numpy backend, which runs them on its threads, against itself
on one thread."""
import math

import numpy as np
import pytest

from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.ops.reference import (
    adamw,
    attention,
    classifier,
    encoder,
    flash_attention,
    gelu,
    layernorm,
    matmul,
    residual,
)

B, T, C, NH, OC = 2, 5, 8, 2, 6


_SEEDS = iter(range(1, 1 << 30))


def rand(*shape):
    """Standard normal values, a fresh seed per call."""
    return np.random.default_rng(next(_SEEDS)).standard_normal(shape)


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
        encoder.encoder_forward(out, inp, wte, wpe)
        return float((out * w).sum())

    loss()
    np.testing.assert_allclose(out, wte[inp] + wpe[:T])
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    encoder.encoder_backward(dwte, dwpe, w, inp)
    check(dwte, numeric_grad(loss, wte))
    check(dwpe, numeric_grad(loss, wpe))


def test_layernorm():
    x, weight, bias, w = rand(B, T, C), rand(C), rand(C), rand(B, T, C)
    out, mean, rstd = np.zeros((B, T, C)), np.zeros((B, T)), np.zeros((B, T))

    def loss():
        layernorm.layernorm_forward(out, mean, rstd, x, weight, bias)
        return float((out * w).sum())

    loss()
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * weight + bias
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    prior = rand(B, T, C)                       # dinp accumulates: start from a non-zero buffer
    dx, dweight, dbias = prior.copy(), np.ones(C), np.ones(C)
    layernorm.layernorm_backward(dx, dweight, dbias, w, x, weight, mean, rstd)
    check(dx - prior, numeric_grad(loss, x))
    check(dweight - 1, numeric_grad(loss, weight))
    check(dbias - 1, numeric_grad(loss, bias))


@pytest.mark.parametrize("with_bias", [True, False])
def test_matmul(with_bias):
    x, weight, w = rand(B, T, C), rand(OC, C), rand(B, T, OC)
    bias = rand(OC) if with_bias else None
    out = np.zeros((B, T, OC))

    def loss():
        matmul.matmul_forward(out, x, weight, bias)
        return float((out * w).sum())

    loss()
    np.testing.assert_allclose(out, x @ weight.T + (bias if with_bias else 0), rtol=1e-12)
    # dinp is overwritten, dweight accumulates
    dx, dweight = np.full_like(x, 7.0), np.ones_like(weight)
    dbias = np.ones(OC) if with_bias else None
    matmul.matmul_backward(dx, dweight, dbias, w, x, weight)
    check(dx, numeric_grad(loss, x))
    check(dweight - 1, numeric_grad(loss, weight))
    if with_bias:
        check(dbias - 1, numeric_grad(loss, bias))
    fresh = np.full_like(weight, np.nan)                     # accumulate=False overwrites dweight
    matmul.matmul_backward(dx, fresh, None, w, x, weight, accumulate=False)
    np.testing.assert_allclose(fresh, dweight - 1, rtol=1e-12)


def test_attention():
    HS = C // NH
    x, w = rand(B, T, 3 * C), rand(B, T, C)
    out, qkvr, att = np.zeros((B, T, C)), np.zeros((3, B, NH, T, HS)), np.zeros((B, NH, T, T))

    def loss():
        attention.attention_forward(out, qkvr, att, x)
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
    attention.attention_backward(dx, w, qkvr, att)
    check(dx, numeric_grad(loss, x))


def test_flash_attention():
    HS = C // NH
    x, w = rand(B, T, 3 * C), rand(B, T, C)
    out, lse = np.zeros((B, T, C)), np.zeros((B, NH, T))

    def loss():
        flash_attention.flash_attention_forward(out, lse, x)
        return float((out * w).sum())

    loss()
    # the naive op's output, and lse = logsumexp of each row of the scaled, masked scores
    ref, qkvr, att = np.zeros((B, T, C)), np.zeros((3, B, NH, T, HS)), np.zeros((B, NH, T, T))
    attention.attention_forward(ref, qkvr, att, x)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    q, k, _ = qkvr
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HS)
    scores[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    np.testing.assert_allclose(lse, np.log(np.exp(scores).sum(-1)), rtol=1e-12)
    dx = np.zeros_like(x)
    flash_attention.flash_attention_backward(dx, w, x, out, lse)
    check(dx, numeric_grad(loss, x))
    dx_naive = np.zeros_like(x)
    attention.attention_backward(dx_naive, w, qkvr, att)
    np.testing.assert_allclose(dx, dx_naive, rtol=1e-10, atol=1e-12)


def test_flash_attention_matches_naive_in_float32():
    """The two attentions in float32: the same output and gradient within float32 rounding."""
    Bt, Tt, NHt, HSt = 2, 33, 3, 8
    Ct = NHt * HSt
    r = np.random.default_rng(7)
    x, w = (r.standard_normal((Bt, Tt, 3 * Ct)).astype(np.float32),
            r.standard_normal((Bt, Tt, Ct)).astype(np.float32))
    out, lse = np.zeros((Bt, Tt, Ct), np.float32), np.zeros((Bt, NHt, Tt), np.float32)
    flash_attention.flash_attention_forward(out, lse, x)
    ref, qkvr, att = (np.zeros(s, np.float32)
                      for s in ((Bt, Tt, Ct), (3, Bt, NHt, Tt, HSt), (Bt, NHt, Tt, Tt)))
    attention.attention_forward(ref, qkvr, att, x)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    dx, dref = np.zeros_like(x), np.zeros_like(x)
    flash_attention.flash_attention_backward(dx, w, x, out, lse)
    attention.attention_backward(dref, w, qkvr, att)
    np.testing.assert_allclose(dx, dref, rtol=1e-4, atol=1e-5)


def test_gelu():
    x, w = rand(B, T, 4 * C) * 2, rand(B, T, 4 * C)
    out = np.zeros_like(x)

    def loss():
        gelu.gelu_forward(out, x)
        return float((out * w).sum())

    loss()
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    dx = np.zeros_like(x)
    gelu.gelu_backward(dx, x, w)
    check(dx, numeric_grad(loss, x))
    aliased = w.copy()                          # dinp may alias dout
    gelu.gelu_backward(aliased, x, aliased)
    np.testing.assert_allclose(aliased, dx)


def test_residual():
    a, b_, w = rand(B, T, C), rand(B, T, C), rand(B, T, C)
    out = np.zeros_like(a)

    def loss():
        residual.residual_forward(out, a, b_)
        return float((out * w).sum())

    loss()
    np.testing.assert_allclose(out, a + b_)
    da, db = np.ones_like(a), np.ones_like(b_)
    residual.residual_backward(da, db, w)
    check(da - 1, numeric_grad(loss, a))
    check(db - 1, numeric_grad(loss, b_))


def test_fused_classifier():
    V, Vp = 11, 16
    logits = rand(B, T, Vp) * 3
    targets = np.random.default_rng(1).integers(0, V, (B, T)).astype(np.int32)
    dloss = 1.0 / (B * T)
    losses = np.zeros((B, T))

    def loss():
        classifier.fused_classifier(logits.copy(), losses, targets, V, dloss, write_dlogits=False)
        return float(losses.sum() * dloss)

    mean = loss()
    real = logits[..., :V]
    lse = np.log(np.exp(real - real.max(-1, keepdims=True)).sum(-1)) + real.max(-1)
    ref = lse - np.take_along_axis(real, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(losses, ref, rtol=1e-12)
    assert math.isclose(mean, ref.mean(), rel_tol=1e-12)
    untouched = logits.copy()
    classifier.fused_classifier(untouched, losses, targets, V, dloss, write_dlogits=False)
    np.testing.assert_array_equal(untouched, logits)          # no dlogits unless asked
    dlogits = logits.copy()
    classifier.fused_classifier(dlogits, losses, targets, V, dloss, write_dlogits=True)
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
    adamw.adamw_update(p, g, m, v, lr, b1, b2, eps, wd, t, scale)
    np.testing.assert_allclose(m, m_ref, rtol=1e-12)
    np.testing.assert_allclose(v, v_ref, rtol=1e-12)
    np.testing.assert_allclose(p, p_ref, rtol=1e-10)


def test_global_norm_squared_large_and_threaded():
    g = np.random.default_rng(0).standard_normal(3_000_001).astype(np.float32)
    threaded = NumpyBackend(threads=2)
    assert math.isclose(threaded.global_norm_squared(g), float(np.dot(g.astype(np.float64), g)),
                        rel_tol=1e-6)


def test_accumulate_false_overwrites_parameter_gradients():
    """accumulate=False ignores the old gradient (garbage here) and writes what "+="
    onto zeros writes."""
    Vp, maxT = 7, 6
    inp = np.array([[1, 3, 3, 0, 6], [2, 1, 5, 5, 5]], np.int32)
    dout = rand(B, T, C)
    dwte0 = rand(Vp, C)
    dwte_ref, dwpe_ref = dwte0.copy(), np.zeros((maxT, C))
    encoder.encoder_backward(dwte_ref, dwpe_ref, dout, inp)
    dwte, dwpe = dwte0.copy(), np.full((maxT, C), np.nan)
    encoder.encoder_backward(dwte, dwpe, dout, inp, accumulate=False)
    # dwte always accumulates (tied lm_head)
    np.testing.assert_array_equal(dwte, dwte_ref)
    np.testing.assert_array_equal(dwpe, dwpe_ref)              # rows T.. are zero, not NaN

    x, weight, mean, rstd = rand(B, T, C), rand(C), rand(B, T), np.abs(rand(B, T)) + 0.5
    dinp0 = rand(B, T, C)
    ref = [dinp0.copy(), np.zeros(C), np.zeros(C)]
    layernorm.layernorm_backward(*ref, dout, x, weight, mean, rstd)
    got = [dinp0.copy(), np.full(C, np.nan), np.full(C, np.nan)]
    layernorm.layernorm_backward(*got, dout, x, weight, mean, rstd, accumulate=False)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)

    w, d = rand(OC, C), rand(B, T, OC)
    ref = [np.zeros((B, T, C)), np.zeros((OC, C)), np.zeros(OC)]
    matmul.matmul_backward(*ref, d, x, w)
    got = [np.zeros((B, T, C)), np.full((OC, C), np.nan), np.full(OC, np.nan)]
    matmul.matmul_backward(*got, d, x, w, accumulate=False)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def test_threaded_ops_bitwise_equal_single_thread(monkeypatch):
    """Splitting rows over threads changes no bit of any op's result (every op, both directions)."""
    import gpt2np.backends.numpy.backend as backend_numpy
    monkeypatch.setattr(backend_numpy, "PARALLEL_MIN", 1)      # split even these small shapes
    monkeypatch.setattr(backend_numpy, "CHUNK", 1000)          # AdamW and the norm: many chunks
    single, threaded = NumpyBackend(threads=1), NumpyBackend(threads=3)
    splits = []
    submit = threaded._pool.submit
    monkeypatch.setattr(threaded._pool, "submit", lambda *a: splits.append(a) or submit(*a))

    Bt, Tt, Ct, NHt, V, Vp = 5, 7, 16, 2, 37, 40
    r = np.random.default_rng(3)

    def f32(*shape):
        return r.standard_normal(shape).astype(np.float32)

    x, w, b, dout = f32(Bt, Tt, Ct), f32(Ct), f32(Ct), f32(Bt, Tt, Ct)
    h, dh = f32(Bt, Tt, 4 * Ct), f32(Bt, Tt, 4 * Ct)
    qkv, datt_out = f32(Bt, Tt, 3 * Ct), f32(Bt, Tt, Ct)
    logits, targets = f32(Bt, Tt, Vp), r.integers(0, V, (Bt, Tt)).astype(np.int32)
    n = 12_345
    p, g, m, v = f32(n), f32(n), f32(n), np.abs(f32(n))

    def run(be):
        out, mean, rstd = (np.zeros(s, np.float32) for s in ((Bt, Tt, Ct), (Bt, Tt), (Bt, Tt)))
        be.layernorm_forward(out, mean, rstd, x, w, b)
        dinp, dw, db = (np.ones((Bt, Tt, Ct), np.float32), np.ones(Ct, np.float32),
                        np.ones(Ct, np.float32))
        be.layernorm_backward(dinp, dw, db, dout, x, w, mean, rstd)
        gelu, dgelu = np.zeros_like(h), np.zeros_like(h)
        be.gelu_forward(gelu, h)
        be.gelu_backward(dgelu, h, dh)
        qkvr, att, y = (np.zeros(s, np.float32)
                        for s in ((3, Bt, NHt, Tt, Ct // NHt), (Bt, NHt, Tt, Tt), (Bt, Tt, Ct)))
        be.attention_forward(y, qkvr, att, qkv)
        dqkv = np.zeros_like(qkv)
        be.attention_backward(dqkv, datt_out, qkvr, att)
        losses, dlogits = np.zeros((Bt, Tt), np.float32), logits.copy()
        be.fused_classifier(logits.copy(), losses, targets, V, 0.1, write_dlogits=False)
        losses2 = np.zeros_like(losses)
        be.fused_classifier(dlogits, losses2, targets, V, 0.1, write_dlogits=True)
        state = [p.copy(), g.copy(), m.copy(), v.copy()]
        be.adamw_update(*state, 1e-3, 0.9, 0.95, 1e-8, 0.1, 2, 0.7)
        norm = be.global_norm_squared(g)
        return [out, mean, rstd, dinp, dw, db, gelu, dgelu, qkvr, att, y, dqkv, losses, losses2,
                dlogits, *state, np.float64(norm)]

    ref = run(single)
    got = run(threaded)
    assert splits, "the threaded backend never split an op"
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("preset_value", [None, "9"])
def test_import_sets_openblas_thread_timeout_unless_the_user_did(preset_value):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset_value:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset_value
    code = "import gpt2np, os; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == (preset_value or "4")
