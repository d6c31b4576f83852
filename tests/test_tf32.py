"""TF32 on the CPU emulator (EmuRuntime(tf32=True), get_backend("emu", precision="tf32")), bounded
against PyTorch with the same TF32 rounding emulated independently here (tf32_round below, and every
matmul of the PyTorch reference, forward and backward, taking TF32-rounded inputs).

What the emulator does, and the tensor cores: each GEMM input rounded to TF32 (10-bit mantissa,
round to nearest, ties away from zero: CUTLASS's round_half_ulp_truncate, PTX cvt.rna.tf32.f32),
products accumulated in fp32. Tolerances, and why:
  * rounding: bitwise equal to the independent PyTorch rounding on random bit patterns;
  * one GEMM against the exact (float64) product of the rounded inputs: a product of two TF32 values
    is exact in fp32 (11 + 11 significant bits <= 24), so the only error is the fp32 accumulation of
    K terms, at most K * 2^-24 * (|A| @ |B|) elementwise (the classic gamma_K bound); the PyTorch
    product meets the same bound;
  * one GEMM against the exact product of the unrounded inputs: each input moves by at most 2^-11
    relative (2^-10 if the hardware truncated instead), so each product by at most 2 * 2^-10 + 2^-20
    with truncation, plus the accumulation: that bound holds for either conversion; and the error is
    above the fp32 bound somewhere, so TF32 is really on;
  * the whole model (logits, loss, the 16 gradients) against the PyTorch GPT-2 with TF32 matmuls:
    both round the same inputs, but an fp32-level difference upstream (another summation order in a
    kernel) flips the rounding of a few inputs by one TF32 ulp (2^-10), and layernorm amplifies
    that: the measured worst case is about 5e-4 of a tensor's largest value (on this model), so 2e-3
    = 4 * 2^-11 bounds it with room; the loss, a mean over B*T positions, agrees to 1e-5 absolute.
    Against float64 the emulated and the PyTorch TF32 errors are of the same size (within a factor
    3), and far above the fp32 path's.
"""
import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_emu import EmuRuntime, round_to_tf32
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2

torch = pytest.importorskip("torch", reason="PyTorch is the reference (pip install -e '.[test]')")
U32 = 2.0 ** -24          # fp32 unit roundoff
U_TF32 = 2.0 ** -11       # TF32 unit roundoff (round to nearest); truncation: 2^-10


def tf32_round(t):
    """PyTorch, independent of gpt2np: float32 tensor -> TF32, round to nearest with
    ties away from zero."""
    bits = t.contiguous().view(torch.int32)
    rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded, t)


class TF32MatMul(torch.autograd.Function):
    """a @ b on TF32-rounded inputs, and its backward the same way (what cuBLAS does for each GEMM
    the CUDA backend runs: dA = dC @ B^T, dB = A^T @ dC, a weight's gradient as one
    GEMM over all rows)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.matmul(tf32_round(a), tf32_round(b))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ra, rb, rg = tf32_round(a), tf32_round(b), tf32_round(g)
        ga = torch.matmul(rg, rb.transpose(-1, -2))
        if b.dim() == 2:
            gb = torch.matmul(ra.reshape(-1, a.shape[-1]).transpose(0, 1),
                              rg.reshape(-1, g.shape[-1]))
        else:
            gb = torch.matmul(ra.transpose(-1, -2), rg)
        return ga, gb


class TF32Matmuls(torch.overrides.TorchFunctionMode):
    """Every `@` / torch.matmul inside the block goes through TF32MatMul."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
            return TF32MatMul.apply(*args)
        return func(*args, **(kwargs or {}))


# ---- the rounding --------------------------------------------------------------------------------

def f32(bits):
    return np.array([bits], np.uint32).view(np.float32)


def test_round_to_tf32_is_round_to_nearest_ties_away():
    one = 1.0
    cases = {
        one + 2 ** -11: one + 2 ** -10,                 # a tie rounds away from zero
        -(one + 2 ** -11): -(one + 2 ** -10),
        one + 2 ** -11 - 2 ** -23: one,                 # just below the tie: down
        # a tie above an odd mantissa: away (not to even)
        one + 3 * 2 ** -11: one + 2 * 2 ** -10,
        one + 2 ** -10 + 2 ** -12: one + 2 ** -10,      # below half: down
        3.0: 3.0, 0.0: 0.0,
    }
    for value, expected in cases.items():
        assert round_to_tf32(np.float32(value)) == np.float32(expected), value
    assert np.signbit(round_to_tf32(np.float32(-0.0)))
    # within half an ulp of the max
    assert np.isposinf(round_to_tf32(np.finfo(np.float32).max))
    special = np.array([np.inf, -np.inf, np.nan], np.float32)
    out = round_to_tf32(special)
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2])
    # a NaN stays that NaN
    assert (round_to_tf32(f32(0x7F800001)).view(np.uint32) == 0x7F800001).all()
    assert (round_to_tf32(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
            # 13 low bits cleared
            .view(np.uint32) & 0x1FFF == 0).all()


def test_round_to_tf32_matches_the_pytorch_rounding_bitwise():
    bits = np.random.default_rng(1).integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    ours = round_to_tf32(x)
    theirs = tf32_round(torch.from_numpy(x.copy())).numpy()
    finite = np.isfinite(x)
    assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))
    assert np.array_equal(np.isnan(ours), np.isnan(x))


# ---- one GEMM ------------------------------------------------------------------------------------

def emu_gemm(a, b, tf32, transa=False, transb=False, batch=1, alpha=1.0, beta=0.0, c=None):
    """C = alpha op(A) op(B) + beta C through EmuRuntime.gemm, (batch, m, k) x
    (batch, k, n) views."""
    A = np.ascontiguousarray(np.swapaxes(a, -1, -2) if transa else a)
    B = np.ascontiguousarray(np.swapaxes(b, -1, -2) if transb else b)
    m, k = a.shape[-2:]
    n = b.shape[-1]
    C = np.zeros((batch, m, n), np.float32) if c is None else c.copy()
    EmuRuntime(tf32=tf32, guard="off").gemm(transa, transb, m, n, k, alpha, A,
                                            A.shape[-1], A[0].size,
                                            B, B.shape[-1], B[0].size, beta, C, n, m * n, batch)
    return C


@pytest.mark.parametrize("transa, transb, batch",
                         [(False, False, 1), (False, True, 1), (True, False, 3)])
def test_tf32_gemm_against_pytorch_and_the_exact_product(transa, transb, batch):
    rng = np.random.default_rng(2)
    m, n, k = 48, 40, 200
    a = (rng.standard_normal((batch, m, k))
         * rng.uniform(0.1, 10, (batch, m, 1))).astype(np.float32)
    b = rng.standard_normal((batch, k, n)).astype(np.float32)
    ours = emu_gemm(a, b, tf32=True, transa=transa, transb=transb, batch=batch)
    theirs = TF32MatMul.apply(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    ra, rb = round_to_tf32(a).astype(np.float64), round_to_tf32(b).astype(np.float64)
    exact_rounded = ra @ rb
    accumulation = k * U32 * (np.abs(ra) @ np.abs(rb))
    assert (np.abs(ours - exact_rounded) <= accumulation).all()
    assert (np.abs(theirs - exact_rounded) <= accumulation).all()
    exact = a.astype(np.float64) @ b.astype(np.float64)
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    truncation_bound = (2 * 2 * U_TF32 + (2 * U_TF32) ** 2 + k * U32) * magnitude
    error = np.abs(ours - exact)
    assert (error <= truncation_bound).all()
    assert (error > k * U32 * magnitude).any()                    # not an fp32 result: TF32 is on
    fp32 = emu_gemm(a, b, tf32=False, transa=transa, transb=transb, batch=batch)
    assert (np.abs(fp32 - exact) <= k * U32 * magnitude).all()


def test_tf32_gemm_keeps_alpha_beta_and_c_in_fp32():
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((1, 8, 16)).astype(np.float32),
            rng.standard_normal((1, 16, 8)).astype(np.float32))
    c = (1 + 2 ** -20 * np.arange(64, dtype=np.float32)).reshape(1, 8, 8)      # not TF32 values
    out = emu_gemm(a, b, tf32=True, alpha=0.5, beta=1.0, c=c)
    expected = c + np.float32(0.5) * (round_to_tf32(a) @ round_to_tf32(b))
    np.testing.assert_allclose(out, expected, rtol=0, atol=16 * U32 * 16)


# ---- the model -----------------------------------------------------------------------------------

CFG = GPT2Config(max_seq_len=64, vocab_size=300, padded_vocab_size=384, num_layers=2, num_heads=4,
                 channels=64)
B, T = 2, 32


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def runs():
    from gpt2np.torch_gpt2 import TorchGPT2
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def emulated(precision):
        model = GPT2(CFG, get_backend("emu", precision=precision), B, T, seed=1)
        assert model.backend.precision == precision
        model.forward(x, y)
        logits = model.logits_host()[..., :CFG.vocab_size]
        loss = model.forward(x, y, for_backward=True)
        model.zero_grad()
        model.backward()
        return model.params_host(), logits, loss, model.grads_host()

    params, *tf32 = emulated("tf32")
    _, *fp32 = emulated("fp32")
    with TF32Matmuls():
        ref_tf32 = TorchGPT2(CFG, params).forward_backward(x, y)
    ref_fp64 = TorchGPT2(CFG, params, "float64").forward_backward(x, y)
    return tf32, fp32, ref_tf32, ref_fp64


def test_tf32_model_matches_pytorch_with_tf32_matmuls(runs):
    (logits, loss, grads), _, ref, _ = runs
    assert abs(loss - ref.loss) <= 1e-5
    assert rel(logits, ref.logits) <= 2e-3
    for name, grad in grads.items():
        assert rel(grad, ref.grads[name]) <= 2e-3, name


def test_tf32_error_is_pytorchs_tf32_error(runs):
    (logits, _, grads), (fp32_logits, _, fp32_grads), ref, exact = runs
    pairs = [(logits, ref.logits, exact.logits, fp32_logits)]
    pairs += [(grads[n], ref.grads[n], exact.grads[n], fp32_grads[n]) for n in grads]
    for ours, torch_tf32, fp64, fp32 in pairs:
        ours_err, torch_err = rel(ours, fp64), rel(torch_tf32, fp64)
        assert torch_err / 3 <= ours_err <= 3 * torch_err
        assert rel(fp32, fp64) < ours_err / 20                   # the fp32 path is far more exact


def test_emu_backend_precision_and_default():
    assert get_backend("emu").precision == "fp32"
    assert get_backend("emu", precision="tf32").precision == "tf32"
    assert CudaBackend(EmuRuntime(tf32=True)).rt.tf32
    with pytest.raises(ValueError, match="backend numpy has no precision 'tf32'"):
        get_backend("numpy", precision="tf32")
