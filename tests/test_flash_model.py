"""The whole model with flash attention (GPT2(attention="flash")) against the naive attention, on
the emulated CUDA path and on NumPy: the loss and every gradient after one forward/backward, and
bitwise reproducibility.

The flash kernels (kernels/flash_attention.cu) multiply on TF32 tensor cores. With TF32 on (the
GEMMs too) the two attentions agree within the TF32 tolerance that gpt2np.cli.compare uses against
PyTorch; with TF32 off (GEMMs exact and the emulator's WMMA in fp32, a test aid:
EmuRuntime(wmma_tf32=False)) they agree to fp32 rounding, which checks the kernels' algorithm
(tiles, online softmax, masks, recomputation) apart from TF32. Two runs give bitwise the same
gradients, also under the other thread schedule and another WMMA fragment layout: no
atomics, fixed orders."""
import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.cli.compare import REL_TOL, TF32_LOSS_ABS_TOL, TF32_REL_TOL
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.tensors import PARAM_NAMES

CFG = GPT2Config(max_seq_len=48, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                 channels=128)
# one partial block of 64 rows, two key steps of 32 (the second partial)
B, T = 2, 40


def batch():
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(backend, attention):
    """(loss, {name: gradient}) of one forward/backward from the same random init."""
    model = GPT2(CFG, backend, B, T, seed=0, attention=attention)
    x, y = batch()
    model.zero_grad()
    loss = model.forward(x, y, for_backward=True)
    model.backward()
    return loss, {name: np.array(g) for name, g in model.grads_host().items()}


def assert_close(got, ref, rel, loss_abs):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert abs(loss - ref_loss) <= loss_abs, (loss, ref_loss)
    for name in PARAM_NAMES:
        scale = np.abs(ref_grads[name]).max()
        err = np.abs(grads[name] - ref_grads[name]).max() / max(scale, 1e-30)
        assert err <= rel, (name, err, rel)


def test_flash_matches_naive_with_tf32():
    """Emulated CUDA, TF32 on everywhere: within compare's TF32 tolerances (measured: 7e-4 of a
    gradient's scale, 6e-7 on the loss)."""
    flash = loss_and_grads(get_backend("emu", precision="tf32"), "flash")
    naive = loss_and_grads(get_backend("emu", precision="tf32"), "naive")
    assert_close(flash, naive, TF32_REL_TOL, TF32_LOSS_ABS_TOL)


def test_flash_matches_naive_to_fp32_rounding_without_tf32():
    """Emulated CUDA with exact GEMMs and fp32 WMMA: the flash kernels' algorithm agrees with the
    naive attention to fp32 rounding (compare's fp32 tolerance; measured: 6e-7 of a
    gradient's scale)."""
    flash = loss_and_grads(get_backend("emu", precision="fp32", wmma_tf32=False), "flash")
    naive = loss_and_grads(get_backend("emu", precision="fp32"), "naive")
    assert_close(flash, naive, REL_TOL, 1e-5)


def test_numpy_flash_matches_naive():
    flash = loss_and_grads(get_backend("numpy"), "flash")
    naive = loss_and_grads(get_backend("numpy"), "naive")
    assert_close(flash, naive, REL_TOL, 1e-5)


def test_flash_gradients_are_bitwise_reproducible():
    """Two runs, the reverse thread schedule and another WMMA fragment layout: bitwise the same
    loss and gradients."""
    runs = [loss_and_grads(get_backend("emu", precision="tf32", **options), "flash")
            for options in ({}, {}, {"schedule": "reverse"}, {"wmma_layout": 0xF1A5})]
    loss, grads = runs[0]
    for other_loss, other_grads in runs[1:]:
        assert other_loss == loss
        for name in PARAM_NAMES:
            np.testing.assert_array_equal(other_grads[name], grads[name])


def test_flash_activations_keep_lse_not_the_probabilities():
    model = GPT2(CFG, get_backend("numpy"), B, T, attention="flash")
    assert {"qkv", "lse"} <= set(model.act) and not {"att", "qkvr"} & set(model.act)
    assert model.act["lse"].shape == (CFG.num_layers, B, CFG.num_heads, T)
    with pytest.raises(ValueError, match="unknown attention 'fast'"):
        GPT2(CFG, get_backend("numpy"), B, T, attention="fast")


def test_resolve_attention_defaults_and_fallbacks():
    from gpt2np.backends import resolve_attention
    from gpt2np.errors import BadInput
    numpy_be, emu = get_backend("numpy"), get_backend("emu")
    assert resolve_attention(numpy_be, 64) == ("naive", None)
    # NumPy runs any head size
    assert resolve_attention(numpy_be, 48, "flash") == ("flash", None)
    assert resolve_attention(emu, 64) == ("flash", None)
    assert resolve_attention(emu, 64, "naive") == ("naive", None)
    attention, note = resolve_attention(emu, 48)
    assert attention == "naive" and "head size 64, this model's is 48" in note
    attention, note = resolve_attention(emu, 64, capability=75)
    assert attention == "naive" and "sm_75" in note
    with pytest.raises(BadInput, match="--attention flash: .*sm_75.*use --attention naive"):
        resolve_attention(emu, 64, "flash", capability=75)


@pytest.mark.parametrize("L, NH, B_, T_", [(1, 1, 1, 3), (2, 1, 1, 7), (1, 2, 1, 5)])
def test_flash_with_activations_off_16_bytes(L, NH, B_, T_):
    """The model's activations are views of one buffer: with L*B*T odd, the fp32 build's qkv and
    atty start 4 or 8 bytes past a 16-byte boundary, where the kernels' 16-byte vector loads and
    stores would fault (seen on an H100: CUDA_ERROR_MISALIGNED_ADDRESS); they fall back to single
    elements there. Flash against naive attention with exact GEMMs and fp32 WMMA
    (fp32 rounding apart)."""
    cfg = GPT2Config(max_seq_len=16, vocab_size=100, padded_vocab_size=128, num_layers=L,
                     num_heads=NH, channels=64 * NH)
    tokens = np.random.default_rng(L * 100 + T_).integers(0, cfg.vocab_size,
                                                          (B_, T_ + 1)).astype(np.int32)
    results = []
    for attention, options in (("flash", {"wmma_tf32": False}), ("naive", {})):
        model = GPT2(cfg, get_backend("emu", precision="fp32", **options), B_, T_, seed=0,
                     attention=attention)
        if attention == "flash":
            qkv = model.act["qkv"]
            # the case this tests
            assert qkv.ctypes.data % 16 != 0 or model.act["atty"].ctypes.data % 16 != 0
        model.zero_grad()
        loss = model.forward(tokens[:, :-1], tokens[:, 1:], for_backward=True)
        model.backward()
        results.append((loss, {name: np.array(g) for name, g in model.grads_host().items()}))
    assert_close(results[0], results[1], REL_TOL, 1e-5)
