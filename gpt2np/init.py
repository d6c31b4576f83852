"""llm.c's random init of a GPT-2 (`-e d12` and the other model descriptors), bit for bit.

llm.c's train_gpt2.cu (gpt2_build_from_random) draws every weight from one mt19937 stream seeded 42
(llmc/rand.h, PyTorch's generator), in the order PyTorch's GPT-2 initializes its modules: wte (its V
real rows; the padding rows stay 0), wpe, then layer by layer qkvw, attprojw, fcw, fcprojw; N(0,
0.02), the two projections back into the residual stream N(0, 0.02 / sqrt(2 L)) (that std computed
in float32); LayerNorm weights 1, every bias 0. A tensor is filled as PyTorch's CPU normal_ fills a
float tensor: n uniforms u = (draw & (2^24 - 1)) / 2^24, then Box-Muller over each block of 16
(radius sqrt(-2 log(1 - u[t] + 1e-12)), angle 2 pi u[t + 8]: cos to t, sin to t + 8), the last 16
values redone from 16 more draws when 16 does not divide n; under 16 values, pairs from 53-bit
doubles.

The transcendental functions are the C library's logf, cosf and sinf (glibc's here, as llm.c's host
code calls them), through the C loop llmc_normal (gpt2np/backends/numpy/csrc/llmc_normal.c, built by
cpu_kernels); where it cannot be built, the same steps in NumPy with log, cos and sin taken in
float64 and rounded (llmc_normal_numpy), which can differ from the C library's in the last bit of a
few values.
"""
import math

import numpy as np

from gpt2np.backends.numpy import cpu_kernels
from gpt2np.config import GPT2Config
from gpt2np.rng import llmc_generator
from gpt2np.tensors import param_shapes, views

LLMC_INIT_SEED = 42              # llm.c's manual_seed(&init_rng, 42)


def llmc_normal(n: int, std: float, generator: np.random.MT19937, mean: float = 0.0) -> np.ndarray:
    """(n,) float32 from llm.c's normal_(data, n, mean, std, state), taking its draws from
    `generator` (llm.c's mt19937: rng.llmc_generator)."""
    count = (n + (16 if n % 16 else 0)) if n >= 16 else 4 * ((n + 1) // 2)
    draws = generator.random_raw(count).astype(np.uint32)
    out = np.empty(n, np.float32)
    lib = cpu_kernels.load()
    if lib is not None:
        lib.llmc_normal(out.ctypes.data, draws.ctypes.data, n, mean, std)
        return out
    return llmc_normal_numpy(draws, n, np.float32(mean), np.float32(std))


def llmc_normal_numpy(draws, n, mean, std):
    """llmc_normal's steps in NumPy (no C compiler): float32 arithmetic, log/cos/sin in float64
    rounded once."""
    f32 = np.float32
    if n < 16:
        words = draws.astype(np.uint64).reshape(-1, 2)
        bits53 = (words[:, 0] << np.uint64(32) | words[:, 1]) & np.uint64((1 << 53) - 1)
        doubles = bits53 * (1.0 / (1 << 53))
        u1, u2 = doubles[0::2].astype(f32), doubles[1::2].astype(f32)
        radius = np.sqrt(f32(-2.0) * _f32(np.log, (f32(1.0) - u2) + f32(1e-12)))
        theta = ((2.0 * math.pi) * u1.astype(np.float64)).astype(f32)
        first = radius * _f32(np.cos, theta) * std + mean
        second = ((radius * _f32(np.sin, theta)).astype(np.float64) * std + mean).astype(f32)
        return np.stack([first, second], axis=1).reshape(-1)[:n]
    uniform = (draws & np.uint32(0xFFFFFF)).astype(f32) * f32(1.0 / (1 << 24))
    out = uniform[:n].copy()
    whole = n - n % 16
    out[:whole] = _box_muller16(out[:whole], mean, std)
    if n % 16:
        out[n - 16:] = _box_muller16(uniform[n:], mean, std)
    return out


def _box_muller16(u, mean, std):
    """Blocks of 16 uniforms -> normals (u's length a multiple of 16)."""
    f32 = np.float32
    blocks = u.reshape(-1, 16)
    first, second = blocks[:, :8], blocks[:, 8:]
    radius = np.sqrt(f32(-2.0) * _f32(np.log, (f32(1.0) - first) + f32(1e-12)))
    theta = ((2.0 * math.pi) * second.astype(np.float64)).astype(f32)
    out = np.empty_like(blocks)
    out[:, :8] = radius * _f32(np.cos, theta) * std + mean
    out[:, 8:] = radius * _f32(np.sin, theta) * std + mean
    return out.reshape(-1)


def _f32(fn, x):
    """fn (log, cos, sin) of float32 x, taken in float64 and rounded to float32."""
    return fn(x.astype(np.float64)).astype(np.float32)


def llmc_init(cfg: GPT2Config, seed: int = LLMC_INIT_SEED) -> np.ndarray:
    """The flat float32 parameters (llm.c's tensor order) of llm.c's random init of cfg, its mt19937
    seeded `seed` (llm.c's: 42)."""
    shapes = param_shapes(cfg)
    flat = np.zeros(sum(math.prod(s) for s in shapes.values()), np.float32)
    p = views(flat, shapes)
    L, C, V = cfg.num_layers, cfg.channels, cfg.vocab_size
    generator = llmc_generator(seed)
    std = np.float32(0.02)
    residual_std = std * (np.float32(1.0) / np.sqrt(np.float32(2.0 * L)))   # 0.02f / sqrtf(2.0f L)
    for name in ("ln1w", "ln2w", "lnfw"):
        p[name][...] = 1.0
    p["wte"][:V] = llmc_normal(V * C, std, generator).reshape(V, C)
    p["wpe"][...] = llmc_normal(p["wpe"].size, std, generator).reshape(p["wpe"].shape)
    for layer in range(L):
        for name, scale in (("qkvw", std), ("attprojw", residual_std), ("fcw", std),
                            ("fcprojw", residual_std)):
            w = p[name][layer]
            w[...] = llmc_normal(w.size, scale, generator).reshape(w.shape)
    return flat
