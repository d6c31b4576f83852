"""The bf16 build of the kernels (CudaBackend(dtype=BF16) on the CPU emulator) against the
bf16 NumPy reference.

Both sides get the same bf16 inputs (random fp32 rounded to bf16). The reference upcasts them, runs
the fp32 op and rounds each bf16 output once (numpy_bf16.py); a bf16 kernel reads with to_float,
computes in float and rounds once at the store (kernels/common.cuh). So an output can differ only
where the two fp32 values before the rounding differ: by fp32 reordering (sums taken in another
order, tanh/exp from another libm), a few 2^-24 of the terms' magnitude, which moves the result
across a bf16 rounding boundary at most by one bf16 ulp (2^-7 of the value at most). The bound used
is |got - ref| <= 2^-7 |ref| + atol, atol a small multiple of 2^-24...2^-12 of the op's magnitude
(where a sum cancels, the reordering error is relative to the terms, not to the result).
Where the fp32 computation is the same sequence of operations (residual, add_bias, the encoder, the
permutes) the outputs are bitwise equal; where only the order of a sum differs most of them are.

Statistics stay fp32 (LayerNorm mean/rstd, losses, loss_mean's stats) and are
checked as fp32 values.
Launch tuning is shrunk as in test_kernels.py; both emulator schedules run, with the
two guard-page modes.
"""
import zlib

import numpy as np
import pytest

# the shapes and the launch tuning of the fp32 kernel tests
from test_kernels import SHAPES, small_launches  # noqa: F401

from gpt2np.backends.cuda.backend import (
    KERNEL_SIGNATURES,
    STORAGE,
    CudaBackend,
    KernelArgumentError,
)
from gpt2np.backends.numpy.bf16 import Bf16NumpyBackend
from gpt2np.bf16 import BF16

F32 = np.dtype(np.float32)
# one bf16 ulp, relative (the most a single rounding can move across)
ULP = 2.0 ** -7

REF = Bf16NumpyBackend(threads=1)



@pytest.fixture(scope="module", params=[("forward", "after"), ("reverse", "before")],
                ids=lambda p: "-".join(p))
def cuda(request):
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    schedule, guard = request.param
    return small_launches(CudaBackend(EmuRuntime(schedule=schedule, guard=guard), dtype=BF16))


@pytest.fixture(params=sorted(SHAPES))
def shape(request):
    return SHAPES[request.param]


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def randb(rng, *shape, scale=1.0, shift=0.0):
    """bf16 normal values (fp32 rounded to nearest even)."""
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32).astype(BF16)


def f32(a):
    return np.asarray(a).astype(F32)


def close(got, ref, atol=0.0, rel=ULP, dtype=BF16):
    """got has `dtype` and |got - ref| <= rel |ref| + atol elementwise (on the upcast values)."""
    assert got.dtype == dtype, (got.dtype, dtype)
    g, r = f32(got), f32(ref)
    assert g.shape == r.shape
    err = np.abs(g - r)
    bound = rel * np.abs(r) + atol
    bad = ~(err <= bound)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} off: worst err {err.max():.3g}, at "
                           f"{np.unravel_index(np.argmax(err - bound), err.shape)}")


def same(got, ref):
    assert got.dtype == ref.dtype
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def mostly_same(got, ref, fraction):
    """At least `fraction` of the elements bitwise equal (the rest within close()'s
    bound, checked apart)."""
    assert got.dtype == ref.dtype == BF16
    equal = np.mean(got.view(np.uint16) == ref.view(np.uint16))
    assert equal >= fraction, equal


def scale_of(ref):
    return float(np.abs(f32(ref)).max())


def on(be, *arrays):
    return [be.from_host(a) for a in arrays]


def host(be, a):
    return be.to_host(a)


# ---- signatures ------------------------------------------------------------------------------
# These kernels' pointer types in the fp32 build before the bf16 build existed
# (all float*): unchanged.
F, I = F32, np.dtype(np.int32)
FP32_SIGNATURES = {
    "encoder_forward": (F, I, F, F, np.int32, np.int32, np.int32),
    "encoder_backward_wte_grouped": (F, F, I, np.int32, np.int32),
    "encoder_backward_wpe": (F, F) + (np.int32,) * 4,
    "layernorm_forward": (F,) * 6 + (np.int32,) * 2,
    "fused_residual_layernorm_forward": (F,) * 8 + (np.int32,) * 2,
    "layernorm_backward_dinp": (F,) * 6 + (np.int32,) * 2,
    "layernorm_backward_params_partial": (F,) * 5 + (np.int32,) * 3,
    "layernorm_backward_params_finish": (F,) * 3 + (np.int32,) * 3,
    "layernorm_backward_fused": (F,) * 7 + (np.int32,) * 3,
    "residual_forward": (F,) * 3 + (np.int32,),
    "residual_backward": (F,) * 3 + (np.int32,),
    "gelu_forward": (F,) * 2 + (np.int32,),
    "gelu_backward": (F,) * 3 + (np.int32,),
    "add_bias": (F, F, np.int32, np.int32),
    "bias_grad_partial": (F, F) + (np.int32,) * 3,
    "bias_grad_finish": (F, F) + (np.int32,) * 3,
    "fused_classifier": (F, F, I, np.int32, np.int32, np.int32, np.float32, np.int32),
    "loss_mean": (F, F) + (np.int32,) * 3,
    "permute_qkv": (F, F) + (np.int32,) * 4,
    "unpermute": (F, F) + (np.int32,) * 4,
    "unpermute_backward": (F, F) + (np.int32,) * 4,
    "permute_backward": (F, F) + (np.int32,) * 4,
    "causal_softmax_forward": (F, np.int32, np.int32, np.float32),
    "causal_softmax_backward": (F, F, F, np.int32, np.int32, np.float32),
}
# The pointers that stay float in the bf16 build: statistics and partial sums (by
# parameter position).
FLOAT_IN_BF16 = {
    "layernorm_forward": (1, 2), "fused_residual_layernorm_forward": (2, 3),
    "layernorm_backward_dinp": (4, 5), "layernorm_backward_params_partial": (0, 3, 4),
    "layernorm_backward_params_finish": (2,), "layernorm_backward_fused": (0, 5, 6),
    "bias_grad_partial": (0,), "bias_grad_finish": (1,), "fused_classifier": (1,),
    "loss_mean": (0, 1),}


def resolved(name, dtype):
    return tuple(dtype if kind == STORAGE else kind for kind in KERNEL_SIGNATURES[name])


def test_fp32_signatures_are_unchanged_and_bf16_keeps_statistics_float():
    for name, expected in FP32_SIGNATURES.items():
        assert resolved(name, F32) == expected, name
        bf16 = resolved(name, BF16)
        for i, (kind, old) in enumerate(zip(bf16, expected)):
            # a float* pointer (not a float scalar)
            if isinstance(old, np.dtype) and old == F32:
                assert kind == (F32 if i in FLOAT_IN_BF16.get(name, ()) else BF16), (name, i, kind)
            else:
                assert kind == old, (name, i)


def test_float32_array_for_a_floatx_pointer_is_refused(cuda):
    n = 8
    with pytest.raises(KernelArgumentError, match=r"residual_forward: argument 1 is a float32 "
                                                  r"array, the kernel takes a pointer to bfloat16"):
        cuda.residual_forward(cuda.zeros(n), cuda.zeros(n, np.float32), cuda.zeros(n))
    # and a bf16 array for a float* (mean) is refused too
    B, T, C = 1, 2, 8
    with pytest.raises(KernelArgumentError, match=r"layernorm_forward: argument 1 is a bfloat16 "
                                                  r"array, the kernel takes a pointer to float32"):
        cuda.layernorm_forward(cuda.zeros((B, T, C)), cuda.zeros((B, T)),
                               cuda.zeros((B, T), np.float32),
                               cuda.zeros((B, T, C)), cuda.zeros(C), cuda.zeros(C))


# ---- encoder ---------------------------------------------------------------------------------
@pytest.mark.parametrize("accumulate", [True, False])
def test_encoder(cuda, shape, accumulate):
    """Forward: one add, one rounding: bitwise. dwte: each token's rows added in (b, t) order in
    fp32 onto the upcast row, rounded once (as np.add.at on the upcast rows): bitwise. dwpe: a sum
    over b (numpy may pair differently), then the add: within one ulp."""
    B, T, C, NH, V, Vp, maxT = shape
    rng = rng_for("encoder", shape, accumulate)
    wte, wpe = randb(rng, Vp, C), randb(rng, maxT, C)
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    inp[0, :3] = 5                                             # repeated tokens: grouped rows
    out_ref = np.zeros((B, T, C), BF16)
    REF.encoder_forward(out_ref, inp, wte, wpe)
    out = cuda.zeros((B, T, C))
    cuda.encoder_forward(out, *on(cuda, inp, wte, wpe))
    same(host(cuda, out), out_ref)

    dout, dwte0 = randb(rng, B, T, C), randb(rng, Vp, C)
    dwpe0 = randb(rng, maxT, C) if accumulate else np.full((maxT, C), np.nan, BF16)
    dwte_ref, dwpe_ref = dwte0.copy(), dwpe0.copy()
    REF.encoder_backward(dwte_ref, dwpe_ref, dout, inp, accumulate=accumulate)
    dwte, dwpe, D, INP = on(cuda, dwte0, dwpe0, dout, inp)
    cuda.encoder_backward(dwte, dwpe, D, INP, accumulate=accumulate)
    same(host(cuda, dwte), dwte_ref)
    close(host(cuda, dwpe), dwpe_ref, atol=2.0 ** -20)
    if not accumulate:
        assert np.all(f32(host(cuda, dwpe))[T:] == 0.0)


def test_encoder_alignment_is_four_bf16_values(cuda):
    """bf16 loads 4 channels = 8 bytes at once: an 8-byte aligned view works, a 2-byte
    offset is refused."""
    B, T, C, Vp = 1, 3, 8, 6
    rng = rng_for("encoder_alignment")
    wte, wpe = randb(rng, Vp * C + 4), randb(rng, T, C)
    inp = np.array([[0, 5, 2]], np.int32)
    flat = cuda.from_host(wte)
    out = cuda.zeros((B, T, C))
    # 8 bytes in
    cuda.encoder_forward(out, cuda.from_host(inp), flat[4:].reshape(Vp, C), cuda.from_host(wpe))
    out_ref = np.zeros((B, T, C), BF16)
    REF.encoder_forward(out_ref, inp, wte[4:].reshape(Vp, C), wpe)
    same(host(cuda, out), out_ref)
    with pytest.raises(KernelArgumentError,
                       match=r"wte is not 8-byte aligned .*4 channels at once \(8 bytes\)"):
        cuda.encoder_forward(out, cuda.from_host(inp), flat[1:1 + Vp * C].reshape(Vp, C),
                             cuda.from_host(wpe))


# ---- layernorm -------------------------------------------------------------------------------
def _layernorm_inputs(rng, B, T, C):
    return randb(rng, B, T, C, scale=2.0, shift=0.5), randb(rng, C), randb(rng, C)


def test_layernorm_forward(cuda, shape):
    """out within one ulp (mean and variance summed in another order); mean, rstd fp32
    to fp32 reordering."""
    B, T, C, *_ = shape
    x, w, b = _layernorm_inputs(rng_for("layernorm", shape), B, T, C)
    out_ref, mean_ref, rstd_ref = (np.zeros((B, T, C), BF16), np.zeros((B, T), F32),
                                   np.zeros((B, T), F32))
    REF.layernorm_forward(out_ref, mean_ref, rstd_ref, x, w, b)
    out, mean, rstd = cuda.zeros((B, T, C)), cuda.zeros((B, T), F32), cuda.zeros((B, T), F32)
    cuda.layernorm_forward(out, mean, rstd, *on(cuda, x, w, b))
    close(host(cuda, out), out_ref, atol=2.0 ** -16 * scale_of(out_ref))
    mostly_same(host(cuda, out), out_ref, 0.9)
    close(host(cuda, mean), mean_ref, rel=1e-5, atol=1e-6, dtype=F32)
    close(host(cuda, rstd), rstd_ref, rel=1e-5, dtype=F32)


def test_fused_residual_layernorm_forward(cuda, shape):
    """residual rounded once: bitwise the reference's; out normalizes the rounded residual (as the
    reference and as CUDA's residual_forward + layernorm_forward, which it matches bitwise)."""
    B, T, C, *_ = shape
    rng = rng_for("fused_residual_layernorm", shape)
    a, w, bias = _layernorm_inputs(rng, B, T, C)
    b = randb(rng, B, T, C)
    res_ref, out_ref = np.zeros((B, T, C), BF16), np.zeros((B, T, C), BF16)
    mean_ref, rstd_ref = np.zeros((B, T), F32), np.zeros((B, T), F32)
    REF.fused_residual_layernorm_forward(res_ref, out_ref, mean_ref, rstd_ref, a, b, w, bias)
    args = on(cuda, a, b, w, bias)
    outs = [(cuda.zeros((B, T, C)), cuda.zeros((B, T, C)), cuda.zeros((B, T), F32),
             cuda.zeros((B, T), F32))
            for _ in range(2)]
    cuda.fused_residual_layernorm_forward(*outs[0], *args)
    res, out, mean, rstd = (host(cuda, x) for x in outs[0])
    same(res, res_ref)
    close(out, out_ref, atol=2.0 ** -16 * scale_of(out_ref))
    close(mean, mean_ref, rel=1e-5, atol=1e-6, dtype=F32)
    close(rstd, rstd_ref, rel=1e-5, dtype=F32)
    res2, out2, mean2, rstd2 = outs[1]
    cuda.residual_forward(res2, args[0], args[1])
    cuda.layernorm_forward(out2, mean2, rstd2, res2, args[2], args[3])
    for fused, unfused in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(host(cuda, fused).view(np.uint8),
                                      host(cuda, unfused).view(np.uint8))


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_layernorm_backward(cuda, shape, accumulate, fused):
    """dinp (+=, rounded once), dweight and dbias (column sums, fp32 partials, rounded once): within
    one ulp plus an atol for the cancelling sums (2^-12 of the largest value); without accumulate
    dweight/dbias start NaN."""
    B, T, C, *_ = shape
    rng = rng_for("layernorm_backward", shape, accumulate, fused)
    x, w, b = _layernorm_inputs(rng, B, T, C)
    out, mean, rstd = np.zeros((B, T, C), BF16), np.zeros((B, T), F32), np.zeros((B, T), F32)
    REF.layernorm_forward(out, mean, rstd, x, w, b)
    dout, dinp0 = randb(rng, B, T, C), randb(rng, B, T, C)
    dw0, db0 = (randb(rng, C), randb(rng, C)) if accumulate else (np.full(C, np.nan, BF16),) * 2
    dinp_ref, dw_ref, db_ref = dinp0.copy(), dw0.copy(), db0.copy()
    REF.layernorm_backward(dinp_ref, dw_ref, db_ref, dout, x, w, mean, rstd, accumulate)
    dinp, dw, db = on(cuda, dinp0, dw0, db0)
    cuda.layernorm_backward(dinp, dw, db, *on(cuda, dout, x, w, mean, rstd), accumulate,
                            fused=fused)
    for got, ref in ((dinp, dinp_ref), (dw, dw_ref), (db, db_ref)):
        close(host(cuda, got), ref, atol=2.0 ** -12 * scale_of(ref))
    mostly_same(host(cuda, dinp), dinp_ref, 0.9)


# ---- matmul: add_bias, bias_grad ---------------------------------------------------------------
def test_add_bias_is_one_rounding(cuda):
    """out = round(out + bias), the fp32 add of the upcast values: bitwise."""
    N, OC = 7, 37
    rng = rng_for("add_bias")
    out0, bias = randb(rng, N, OC, scale=3.0), randb(rng, OC)
    expected = (f32(out0) + f32(bias)).astype(BF16)
    out, B = on(cuda, out0, bias)
    cuda._launch("add_bias", *cuda._elementwise(N * OC), (out, B, np.int32(N), np.int32(OC)))
    same(host(cuda, out), expected)


@pytest.mark.parametrize("fused", [False, True])
def test_matmul_forward(cuda, shape, fused):
    """fused: the emulator's bias epilogue, one rounding: within one ulp. Unfused: the GEMM's output
    is rounded (stored bf16) before add_bias rounds again, the reference rounds once: half an ulp of
    the GEMM's value more, so the atol is 2^-8 of the largest output."""
    B, T, C, *_ = shape
    OC = 3 * C + 5
    rng = rng_for("matmul_forward", shape, fused)
    x, w, b = randb(rng, B, T, C), randb(rng, OC, C), randb(rng, OC)
    out_ref = np.zeros((B, T, OC), BF16)
    REF.matmul_forward(out_ref, x, w, b)
    out = cuda.zeros((B, T, OC))
    cuda.matmul_forward(out, *on(cuda, x, w, b), fused=fused)
    close(host(cuda, out), out_ref, atol=(2.0 ** -16 if fused else 2.0 ** -8) * scale_of(out_ref))


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_matmul_backward(cuda, shape, accumulate, fused):
    """dbias: fp32 column sums (bias_grad_partial in chunks, or the bgrad epilogue), added and
    rounded once by bias_grad_finish; dinp, dweight: the emulator's GEMMs, rounded once. Each within
    one ulp plus 2^-12 of the largest value (the sums cancel); without accumulate dweight
    and dbias start NaN."""
    B, T, C, *_ = shape
    OC = 3 * C + 5
    rng = rng_for("matmul_backward", shape, accumulate, fused)
    x, w, dout = randb(rng, B, T, C), randb(rng, OC, C), randb(rng, B, T, OC)
    dw0, db0 = ((randb(rng, OC, C), randb(rng, OC)) if accumulate
                else (np.full((OC, C), np.nan, BF16), np.full(OC, np.nan, BF16)))
    dinp_ref, dw_ref, db_ref = np.zeros((B, T, C), BF16), dw0.copy(), db0.copy()
    REF.matmul_backward(dinp_ref, dw_ref, db_ref, dout, x, w, accumulate)
    dinp = cuda.from_host(np.full((B, T, C), 7.0, BF16))
    dw, db = on(cuda, dw0, db0)
    cuda.matmul_backward(dinp, dw, db, *on(cuda, dout, x, w), accumulate, fused=fused)
    for got, ref in ((dinp, dinp_ref), (dw, dw_ref), (db, db_ref)):
        close(host(cuda, got), ref, atol=2.0 ** -12 * scale_of(ref))


# ---- gelu, residual --------------------------------------------------------------------------
def test_gelu(cuda, shape):
    """Forward and backward (in place, as the model calls it): the kernel groups the polynomial as
    s (x + c x^3), the reference as x (1 + c x^2) s, and tanh comes from another libm: fp32 values a
    few ulps apart, so almost all outputs are bitwise the same and all within one bf16 ulp, plus an
    atol for the cancellations: 0.5 x (1 + tanh) at x << 0 (forward); 1 - th^2 at |x| >> 1, which
    multiplies tanh's fp32 ulp by about 0.2 |x|^3 (backward: 2^-14 of the largest gradient;
    measured up to ~2^-17)."""
    B, T, C, *_ = shape
    rng = rng_for("gelu", shape)
    x = randb(rng, B, T, 4 * C, scale=3.0)
    out_ref = np.zeros_like(x)
    REF.gelu_forward(out_ref, x)
    out, X = cuda.zeros(x.shape), cuda.from_host(x)
    cuda.gelu_forward(out, X)
    close(host(cuda, out), out_ref, atol=2.0 ** -20)
    mostly_same(host(cuda, out), out_ref, 0.97)

    dout = randb(rng, *x.shape)
    dinp_ref = np.zeros_like(x)
    REF.gelu_backward(dinp_ref, x, dout)
    d = cuda.from_host(dout)
    cuda.gelu_backward(d, X, d)
    close(host(cuda, d), dinp_ref, atol=2.0 ** -14 * scale_of(dinp_ref))
    mostly_same(host(cuda, d), dinp_ref, 0.97)


def test_residual(cuda, shape):
    """One fp32 add, one rounding: bitwise the reference, forward and backward; aliased dinp1 is
    dinp2 gains dout twice, each add rounded (the second reads the first's store)."""
    B, T, C, *_ = shape
    rng = rng_for("residual", shape)
    a, b, g = randb(rng, B, T, C), randb(rng, B, T, C), randb(rng, B, T, C)
    out_ref = np.zeros_like(a)
    REF.residual_forward(out_ref, a, b)
    out = cuda.zeros((B, T, C))
    cuda.residual_forward(out, *on(cuda, a, b))
    same(host(cuda, out), out_ref)

    d1_ref, d2_ref = a.copy(), b.copy()
    REF.residual_backward(d1_ref, d2_ref, g)
    d1, d2, G = on(cuda, a, b, g)
    cuda.residual_backward(d1, d2, G)
    same(host(cuda, d1), d1_ref)
    same(host(cuda, d2), d2_ref)
    both = cuda.from_host(a)
    cuda.residual_backward(both, both, G)
    once = (f32(a) + f32(g)).astype(BF16)
    same(host(cuda, both), (f32(once) + f32(g)).astype(BF16))


# ---- classifier ------------------------------------------------------------------------------
@pytest.mark.parametrize("write_dlogits", [False, True])
def test_fused_classifier(cuda, shape, write_dlogits):
    """losses: fp32 from the same upcast logits (online max/sum in another order): fp32 reordering.
    dlogits: one rounding of fp32 values that differ by reordering: within one ulp (+ 2^-24 of
    dloss, for the target's p - 1 cancellation); padding exactly 0; without write_dlogits the
    logits are untouched."""
    B, T, C, NH, V, Vp, _ = shape
    rng = rng_for("classifier", shape, write_dlogits)
    logits = randb(rng, B, T, Vp, scale=4.0)
    logits[..., V:] = 123.0                                    # padding must be ignored
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, 0] = V - 1
    dloss = 1.0 / (B * T)
    logits_ref, losses_ref = logits.copy(), np.zeros((B, T), F32)
    REF.fused_classifier(logits_ref, losses_ref, targets, V, dloss, write_dlogits)
    lg, losses, tg = cuda.from_host(logits), cuda.zeros((B, T), F32), cuda.from_host(targets)
    cuda.fused_classifier(lg, losses, tg, V, dloss, write_dlogits)
    close(host(cuda, losses), losses_ref, rel=1e-5, atol=1e-5, dtype=F32)
    got = host(cuda, lg)
    if write_dlogits:
        close(got, logits_ref, atol=2.0 ** -24 * dloss)
        assert np.all(f32(got)[..., V:] == 0.0)
        mostly_same(got, logits_ref, 0.9)
    else:
        same(got, logits)


def test_loss_mean_stays_fp32(cuda):
    """loss_mean reads fp32 losses and writes fp32 stats in the bf16 build too."""
    rng = rng_for("loss_mean")
    losses = (rng.random(37) * 10).astype(F32)
    stats = cuda.from_host(np.array([1.0, 0.0], F32))
    cuda.loss_mean(stats, cuda.from_host(losses), 2, accumulate=True)
    got = host(cuda, stats)
    assert got.dtype == F32
    assert got[0] == pytest.approx(1.0 + losses.astype(np.float64).mean() / 2, rel=1e-6)


# ---- attention (naive) -----------------------------------------------------------------------
# Looser than one ulp: the bf16 kernels store the scores q k^T rounded to bf16 before the softmax
# (the GEMM's output) and the probabilities rounded again before att @ v, where the reference keeps
# both in fp32 inside the op.
# A score s rounded moves exp(scale s) by up to scale |s| 2^-8 relative (|scale s| <= ~3 here), the
# probability by about twice that, plus its own rounding. out and dinp are sums of such terms
# (cancelling: their bound is relative to the largest value). The backward is given the same bf16
# att on both sides and differs by the roundings of dv, datt and dpreatt. Measured on SHAPES: att
# 0.011 relative, out 2^-7.6 and dinp 2^-9 of the largest value; the bounds below
# leave a 3-4x margin.
ATT_REL = 2.0 ** -5


def test_attention(cuda, shape):
    """qkvr: a permutation, bitwise. att: rows of T with exact zeros above the diagonal, each within
    ATT_REL (+ 2^-10 absolute) of the reference; out within 2^-6 of its largest value; dinp (from
    the same att) within 2^-7 of its largest value, and mostly much closer."""
    B, T, C, NH, *_ = shape
    HS = C // NH
    rng = rng_for("attention", shape)
    inp = randb(rng, B, T, 3 * C)
    out_ref, qkvr_ref, att_ref = (np.zeros((B, T, C), BF16), np.zeros((3, B, NH, T, HS), BF16),
                                  np.zeros((B, NH, T, T), BF16))
    REF.attention_forward(out_ref, qkvr_ref, att_ref, inp)
    out, qkvr = cuda.zeros((B, T, C)), cuda.zeros((3, B, NH, T, HS))
    att = cuda.from_host(np.full((B, NH, T, T), 9.0, BF16))    # stale values must vanish
    cuda.attention_forward(out, qkvr, att, cuda.from_host(inp))
    same(host(cuda, qkvr), qkvr_ref)
    att_host = host(cuda, att)
    close(att_host, att_ref, rel=ATT_REL, atol=2.0 ** -10)
    assert np.all(f32(att_host)[..., np.triu(np.ones((T, T), bool), k=1)] == 0.0)
    close(host(cuda, out), out_ref, rel=0.0, atol=2.0 ** -6 * scale_of(out_ref))

    dout = randb(rng, B, T, C)
    dinp_ref = np.zeros((B, T, 3 * C), BF16)
    REF.attention_backward(dinp_ref, dout, qkvr_ref, att_host)
    dinp = cuda.from_host(np.full((B, T, 3 * C), 3.0, BF16))   # "=": old contents vanish
    cuda.attention_backward(dinp, cuda.from_host(dout), qkvr, att)
    got = host(cuda, dinp)
    close(got, dinp_ref, rel=0.0, atol=2.0 ** -7 * scale_of(dinp_ref))
    err = np.abs(f32(got) - f32(dinp_ref))
    assert np.median(err) <= 2.0 ** -8 * scale_of(dinp_ref)


def test_attention_softmax_kernels_round_once(cuda):
    """causal_softmax_forward/backward on their own: from the same bf16 scores, the fp32 softmax
    (and its backward) of the upcast values rounded once: within one ulp, exact zeros
    above the diagonal."""
    BH, T, scale = 3, 37, 0.25
    rng = rng_for("softmax")
    scores = randb(rng, BH, T, T, scale=4.0)
    att = cuda.from_host(scores)
    rows = BH * T
    cuda._launch("causal_softmax_forward", *cuda._row_launch(rows),
                 (att, np.int32(rows), np.int32(T), np.float32(scale)))
    s = f32(scores) * np.float32(scale)
    mask = np.triu(np.ones((T, T), bool), k=1)
    s[:, mask] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(F32)
    got = host(cuda, att)
    close(got, p.astype(BF16), atol=2.0 ** -24)
    assert np.all(f32(got)[:, mask] == 0.0)

    datt = randb(rng, BH, T, T)
    a = f32(got)
    expected = ((f32(datt) - (f32(datt) * a).sum(-1, keepdims=True)) * a
                * np.float32(scale)).astype(BF16)
    d = cuda.from_host(datt)
    cuda._launch("causal_softmax_backward", *cuda._row_launch(rows),
                 (d, d, att, np.int32(rows), np.int32(T), np.float32(scale)))
    close(host(cuda, d), expected, atol=2.0 ** -16 * scale_of(expected))
