"""bfloat16 rounding: round-to-nearest-even (every op's output) and seeded stochastic rounding (the
parameters AdamW writes from the fp32 master weights).

bf16 is fp32's top 16 bits: 1 sign, 8 exponent, 7 stored mantissa bits, so one rounding moves a
value by at most 2^-8 of itself (half an ulp, RNE) or less than 2^-7 (stochastic). Storage is
ml_dtypes.bfloat16.

Stochastic rounding, the scheme a CUDA kernel reproduces bitwise (vectorized here, no per-element
loop):

    stream   = mix64(seed * 2^32 + t)                 seed, t (AdamW's step, from 1) taken mod 2^32
    bits(i)  = mix64(stream + (i + 1) * GAMMA)         i = the element's index in the flat
                                                        parameter buffer
    r(i)     = bits(i) >> 48                            16 uniform random bits
    bf16(x)  = (u >> 16) + (r(i) < (u & 0xFFFF))        u = x's fp32 bits: round the magnitude up
                                                        with probability (low 16 bits) / 2^16

all in uint64 arithmetic mod 2^64; mix64 is SplitMix64's finalizer and bits(i) is the i-th output of
SplitMix64 seeded with `stream` (GAMMA its golden-ratio increment). E[bf16(x)] = x exactly (the low
bits are the fraction of an ulp). The noise depends on (seed, t, i) only: not on the launch
configuration, the tensor split or a ZeRO shard, so every process and every resume draws the same
bits. NaN gives bf16's quiet NaN 0x7FC0; inf stays inf. (llm.c draws its noise from the thread and
block index and a per-tensor seed from its RNG; this scheme keeps its idea, an integer hash of a
counter, and makes the counter the parameter's index.)
"""
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
QUIET_NAN = 0x7FC0


def is_bf16(array) -> bool:
    """Whether an array holds bf16 values."""
    return np.dtype(array.dtype) == BF16


def round_nearest(x, out=None):
    """fp32 -> bf16, round to nearest even (ml_dtypes' cast, the same as checkpoint.fp32_to_bf16 bit
    for bit)."""
    if out is None:
        return np.asarray(x, np.float32).astype(BF16)
    np.copyto(out, x, casting="unsafe")
    return out


def mix64(z):
    """SplitMix64's finalizer on uint64 (array or scalar), wrapping mod 2^64."""
    with np.errstate(over="ignore"):
        z = np.uint64(z) if np.isscalar(z) else z
        z = (z ^ (z >> np.uint64(30))) * MIX1
        z = (z ^ (z >> np.uint64(27))) * MIX2
        return z ^ (z >> np.uint64(31))


def stream_key(seed: int, t: int) -> np.uint64:
    """The per-step stream: mix64(seed * 2^32 + t), seed and t mod 2^32."""
    return mix64(np.uint64(((int(seed) & 0xFFFFFFFF) << 32) | (int(t) & 0xFFFFFFFF)))


def random_bits16(key, offset: int, n: int):
    """(n,) uint64 holding r(i) for i = offset .. offset + n - 1 (16 random bits each, the hash's
    top bits). mix64 of `stream + (i + 1) * GAMMA`, written in place (one work array) to stay near
    memory speed."""
    z = np.arange(offset + 1, offset + n + 1, dtype=np.uint64)
    tmp = np.empty_like(z)
    with np.errstate(over="ignore"):
        z *= GAMMA
        z += np.uint64(key)
        for shift, mul in ((30, MIX1), (27, MIX2)):
            np.right_shift(z, np.uint64(shift), out=tmp)
            z ^= tmp
            z *= mul
        np.right_shift(z, np.uint64(31), out=tmp)
        z ^= tmp
    z >>= np.uint64(48)
    return z


def round_stochastic(x, out, seed: int, t: int, offset: int, kernels=None):
    """out (bf16, (n,)) = x (fp32, (n,)) stochastically rounded with the noise of elements offset..
    (see above). kernels: the numpy backend's C loops (cpu_kernels.load()), which hash and round in
    one pass, bit for bit."""
    x = np.ascontiguousarray(x, np.float32)
    if kernels is not None and out.flags.c_contiguous and out.size == x.size:
        kernels.round_stochastic(x.ctypes.data, out.ctypes.data, x.size, int(stream_key(seed, t)),
                                 int(offset) % (1 << 64), QUIET_NAN)
        return out
    u = x.view(np.uint32)
    r = random_bits16(stream_key(seed, t), offset, x.size)
    hi = (u >> np.uint32(16)).astype(np.uint16)
    hi += (r < (u & np.uint32(0xFFFF))).astype(np.uint16)    # a carry runs into the exponent
    nan = np.isnan(x)
    if nan.any():
        hi[nan] = QUIET_NAN
    out.view(np.uint16)[...] = hi
    return out
