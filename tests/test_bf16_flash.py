"""The bf16 build of the flash attention kernels (kernels/flash_attention.cu with -DGPT2NP_BF16:
bf16 qkv, out, dout, dinp; bf16 WMMA m16n16k16 fragments, fp32 accumulators and softmax statistics,
fp32 lse and D) on the CUDA emulator, against the bf16 NumPy reference (Bf16NumpyBackend: the fp32
op on the upcast inputs, out and dinp rounded once, lse fp32), under two WMMA fragment layouts.

Tolerance. The kernels' first products (S = Q K^T, dP = dO V^T) take the bf16 inputs as they are
(exact products, fp32 sums), and the softmax runs in fp32, so S, P, lse, D agree with the reference
to fp32 rounding: lse within a few fp32 ulps. The second products read P and dS rounded to bf16 (as
FlashAttention does), which moves each term p_k v_k (or ds_k k_k, ...) by at most 2^-8 of itself;
and both sides round their output to bf16 once (2^-8 of each). So element by element

    |got - ref| <= 2^-8 (|got| + |ref|) + 2^-8 sum_k |a_k| |b_k| + fp32 slack

where a_k b_k are the terms of the second product (P V for out, P^T dO for dV, dS K for dQ, dS^T Q
for dK), and the fp32 slack covers the fp32-rounding differences of S, P, dP, D (2^-16 of the terms'
magnitude |P| (|dP| + |D|), generous); measured: at most 0.69 of that bound. Against the scale of
each output (max |ref|): 1.9e-3 to 4.0e-3 here (other seeds and shapes: up to 7.6e-3, about 2^-7);
asserted below 2^-6. The two layouts give bitwise the same results, the second also with the threads
run in reverse (no dependence on the fragment layout, no missing barrier).
"""
import math

import numpy as np
import pytest
from test_emulator import needs_gpp

from gpt2np.backends.cuda.backend import CudaBackend, KernelArgumentError
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.backends.numpy.bf16 import Bf16NumpyBackend
from gpt2np.bf16 import BF16

HS = 64
LAYOUTS = (0, 0xC0FFEE)
SCHEDULES = ("forward", "reverse")   # the second run: another layout and the threads reversed
ONE_ROUNDING = 2.0 ** -8
# fp32 rounding differences of S, P, dP, D, relative to the terms' magnitude
SLACK = 2.0 ** -16
SCALE_TOL = 2.0 ** -6              # max error over max |ref| of each output

pytestmark = needs_gpp


def up(a):
    return np.asarray(a, np.float64)


def heads(x, NH, part=0, parts=1):
    """(B, T, parts*C) -> (B, NH, T, HS) of one part, float64."""
    B, T, _ = x.shape
    C = NH * HS
    return up(x[..., part * C:(part + 1) * C]).reshape(B, T, NH, HS).transpose(0, 2, 1, 3)


def run_kernels(inp, dout, NH, layout, schedule):
    """out, lse, dinp of the bf16 CUDA kernels on the emulator (one WMMA layout and
    thread schedule)."""
    be = CudaBackend(EmuRuntime(schedule=schedule, wmma_layout=layout), dtype=BF16)
    B, T, C3 = inp.shape
    out, lse = be.zeros((B, T, C3 // 3), BF16), be.zeros((B, NH, T), np.float32)
    be.flash_attention_forward(out, lse, be.rt.from_host(inp))
    dinp = be.zeros((B, T, C3), BF16)
    be.flash_attention_backward(dinp, be.rt.from_host(dout), be.rt.from_host(inp), out, lse)
    return [np.array(be.rt.to_host(x)) for x in (out, lse, dinp)]


def bound_terms(inp, dout, out, lse, NH):
    """For each output, sum_k |a_k| |b_k| of its second product and the fp32 slack term, (B,
    NH, T, HS) float64."""
    q, k, v = (heads(inp, NH, i, 3) for i in range(3))
    do, o = heads(dout, NH), heads(out, NH)
    T = q.shape[2]
    scale = 1 / math.sqrt(HS)
    causal = np.tril(np.ones((T, T), bool))
    p = np.where(causal, np.exp(q @ k.transpose(0, 1, 3, 2) * scale - up(lse)[..., None]), 0.0)
    dp = do @ v.transpose(0, 1, 3, 2)
    D = (do * o).sum(-1, keepdims=True)
    ds = p * (dp - D) * scale
    # what the fp32 slack of dS is relative to
    mag = p * (np.abs(dp) + np.abs(D)) * scale
    pt, dst, magt = (x.transpose(0, 1, 3, 2) for x in (p, np.abs(ds), mag))
    return {
        "out": (p @ np.abs(v), 0 * v),
        "dq": (np.abs(ds) @ np.abs(k), mag @ np.abs(k)),
        "dk": (dst @ np.abs(q), magt @ np.abs(q)),
        "dv": (pt @ np.abs(do), pt @ np.abs(do)),
    }


@pytest.mark.parametrize("B, NH, T", [(1, 1, 37), (2, 2, 70), (1, 1, 150)])
def test_bf16_flash_matches_the_bf16_reference(B, NH, T):
    C = NH * HS
    rng = np.random.default_rng(T)
    inp = rng.standard_normal((B, T, 3 * C)).astype(np.float32).astype(BF16)
    dout = rng.standard_normal((B, T, C)).astype(np.float32).astype(BF16)
    runs = [run_kernels(inp, dout, NH, layout, schedule)
            for layout, schedule in zip(LAYOUTS, SCHEDULES)]
    # no dependence on the fragment layout or schedule
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    out, lse, dinp = runs[0]
    assert out.dtype == BF16 and dinp.dtype == BF16 and lse.dtype == np.float32

    ref = Bf16NumpyBackend()
    rout, rlse = np.zeros((B, T, C), BF16), np.zeros((B, NH, T), np.float32)
    ref.flash_attention_forward(rout, rlse, inp)
    rdinp = np.zeros((B, T, 3 * C), BF16)
    # the same forward outputs on both sides
    ref.flash_attention_backward(rdinp, dout, inp, out, lse)

    # lse: fp32 statistics from exact products, within a few fp32 ulps of the lse's scale
    assert np.abs(lse - rlse).max() <= 8 * np.spacing(np.abs(rlse).max())

    terms = bound_terms(inp, dout, out, lse, NH)
    results = {"out": (heads(out, NH), heads(rout, NH))}
    for i, name in enumerate(("dq", "dk", "dv")):
        results[name] = (heads(dinp, NH, i, 3), heads(rdinp, NH, i, 3))
    for name, (got, want) in results.items():
        rounded, slack = terms[name]
        err = np.abs(got - want)
        bound = ONE_ROUNDING * (np.abs(got) + np.abs(want) + rounded) + SLACK * slack + 1e-30
        assert np.all(err <= bound), (name, (err / bound).max())
        assert err.max() <= SCALE_TOL * np.abs(want).max(), (name, err.max() / np.abs(want).max())
        assert np.isfinite(got).all()


def test_bf16_flash_rejects_fp32_arrays():
    """The bf16 build's floatX* parameters take bf16 arrays only (the backend checks
    against its dtype)."""
    be = CudaBackend(EmuRuntime(), dtype=BF16)
    inp = be.zeros((1, 8, 3 * HS), np.float32)
    with pytest.raises(KernelArgumentError,
                       match="argument 2 is a float32 array, the kernel takes a pointer to bf"):
        be.flash_attention_forward(be.zeros((1, 8, HS), BF16), be.zeros((1, 1, 8), np.float32), inp)
