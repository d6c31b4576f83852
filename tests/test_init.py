"""gpt2np.init: llm.c's random init (train_gpt2.cu's gpt2_build_from_random with llmc/rand.h),
checked against PyTorch's generator (which llm.c's rand.h follows: torch.manual_seed +
Tensor.normal_ in PyTorch's GPT-2 module order) and llm.c's published rand.h outputs.

PyTorch's CPU normal_ on a float tensor of 16 or more values runs an AVX2 Box-Muller of its own (the
angle 2 pi u multiplied in float32, its own log/sin/cos), where llm.c's C takes the angle in double
and calls the C library: so the two agree to a few float32 ulps of the Box-Muller's inputs, 3e-6 x
std here, not bit for bit; under 16 values both take the double-precision path. Bit for bit against
llm.c itself was checked by hand (llm.c's rand.h and its init loop compiled with g++ -O3: d6, d12
and two tiny configs equal in every bit) and is not a test, as llm.c's code is not part
of this repository."""
import numpy as np
import pytest
import torch

from gpt2np.backends.numpy import cpu_kernels
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.backends.numpy.bf16 import Bf16NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.init import LLMC_INIT_SEED, llmc_init, llmc_normal, llmc_normal_numpy
from gpt2np.model import GPT2
from gpt2np.rng import llmc_generator
from gpt2np.tensors import param_shapes, views

TINY = GPT2Config(max_seq_len=16, vocab_size=37, padded_vocab_size=64, num_layers=2, num_heads=2,
                  channels=8)
SMALL = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=3, num_heads=2,
                   channels=16)


def test_rand_h_published_outputs():
    """llmc/rand.h's comment: seed 137, five randint32, normal_ of 8, one randint32, normal_ of 16,
    one randint32. The printed normals are PyTorch's: under 16 values PyTorch works in double where
    llm.c's C takes logf, sqrtf and the products in float (within 2 ulps), from 16 on its own AVX2
    Box-Muller (within 3e-6)."""
    g = llmc_generator(137)
    assert g.random_raw(5).tolist() == [4053805790, 2173880614, 380293709, 1237255315, 2986595568]
    t8 = [0.7947664260864258, 1.4369317293167114, -0.2292192131280899, 0.47556325793266296,
          -0.6334410905838013, -0.5791953802108765, -0.0925704762339592, -0.8659197092056274]
    np.testing.assert_allclose(llmc_normal(8, 1.0, g), t8, rtol=0, atol=2.5e-7)
    assert int(g.random_raw()) == 2186503452
    t16 = [-1.2813878059387207, -2.646395683288574, -0.06569503247737885, 0.2180829495191574,
           -0.46536165475845337, -0.33108410239219666, 2.5485482215881348, 0.10425379872322083,
           0.8460659980773926, 0.9462448358535767, -0.2913765013217926, 0.34313806891441345,
           -1.1186704635620117, -0.18305328488349915, -2.3153159618377686, 0.3961987793445587]
    np.testing.assert_allclose(llmc_normal(16, 1.0, g), t16, rtol=0, atol=3e-6)
    assert int(g.random_raw()) == 2756748748


def torch_init(cfg, seed=LLMC_INIT_SEED):
    """The init as PyTorch would draw it: one generator, wte's V rows, wpe, then per layer qkvw,
    attprojw, fcw, fcprojw (the residual projections' std 0.02 / sqrt(2L)), ones for the
    LayerNorm weights."""
    torch.manual_seed(seed)
    p = views(np.zeros(sum(int(np.prod(s)) for s in param_shapes(cfg).values()), np.float32),
              param_shapes(cfg))
    std, residual = 0.02, float(np.float32(0.02)
                                * (np.float32(1) / np.sqrt(np.float32(2 * cfg.num_layers))))

    def draw(shape, s):
        return torch.empty(shape).normal_(0.0, s).numpy()

    p["wte"][:cfg.vocab_size] = draw((cfg.vocab_size, cfg.channels), std)
    p["wpe"][...] = draw(p["wpe"].shape, std)
    for layer in range(cfg.num_layers):
        for name, s in (("qkvw", std), ("attprojw", residual), ("fcw", std), ("fcprojw", residual)):
            p[name][layer] = draw(p[name][layer].shape, s)
    for name in ("ln1w", "ln2w", "lnfw"):
        p[name][...] = 1.0
    return p


@pytest.mark.parametrize("cfg", [TINY, SMALL], ids=["tiny", "small"])
def test_init_is_pytorchs_draws_in_pytorchs_order(cfg):
    ours, theirs = views(llmc_init(cfg), param_shapes(cfg)), torch_init(cfg)
    for name in theirs:
        scale = 0.02 if name not in ("ln1w", "ln2w", "lnfw") else 1.0
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=3e-6 * scale,
                                   err_msg=name)
        # biases and wte's padding rows
        assert np.array_equal(ours[name] == 0, theirs[name] == 0), name
    assert not ours["wte"][cfg.vocab_size:].any() and (ours["ln1w"] == 1).all()


def test_another_seed_draws_other_weights_and_the_same_seed_the_same():
    a, b = llmc_init(TINY, 42), llmc_init(TINY, 7)
    assert np.array_equal(a, llmc_init(TINY, 42)) and np.mean(a == b) < 0.5
    np.testing.assert_allclose(b.reshape(-1)[:TINY.vocab_size * TINY.channels],
                               torch_init(TINY, 7)["wte"][:TINY.vocab_size].reshape(-1),
                               atol=3e-6 * 0.02)


@pytest.mark.parametrize("n", [16, 296, 1000, 5, 7, 1])
def test_numpy_fallback_is_the_c_kernels_but_for_the_last_bit_of_a_few(n):
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: only the NumPy path runs here")
    c = llmc_normal(n, 0.02, llmc_generator(3))
    draws = llmc_generator(3).random_raw(n + (16 if n % 16 else 0) if n >= 16
                                         else 4 * ((n + 1) // 2))
    ours = llmc_normal_numpy(draws.astype(np.uint32), n, np.float32(0.0), np.float32(0.02))
    assert ours.dtype == np.float32 and ours.shape == (n,)
    ulps = np.abs(c.view(np.int32).astype(np.int64) - ours.view(np.int32).astype(np.int64))
    assert ulps.max() <= 2 and np.mean(ulps == 0) > 0.9


def test_model_random_init_is_llmcs_fp32_and_bf16_rounded_to_nearest():
    fp32 = GPT2(TINY, NumpyBackend(threads=1), 1, 4, seed=42).params_host()
    assert np.array_equal(fp32, llmc_init(TINY, 42))
    bf16 = GPT2(TINY, Bf16NumpyBackend(threads=1), 1, 4, seed=42).params_host()
    import ml_dtypes
    assert np.array_equal(bf16.view(np.uint16),
                          llmc_init(TINY, 42).astype(ml_dtypes.bfloat16).view(np.uint16))
