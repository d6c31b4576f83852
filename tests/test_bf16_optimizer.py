"""The bf16 build of the optimizer kernels (kernels/adamw.cu, kernels/global_norm.cu)
on the CPU emulator.

adamw_update / adamw_update_device with bf16 params and grads update fp32 master weights, m and v
and write the params by stochastic rounding (bf16.round_stochastic, noise of (seed, t, offset +
i)). Two references:

* the kernel's own fp32 arithmetic in NumPy (the same operations in the same order;
  NumpyBackend.adamw_update_device for the device kernel): master, m, v and params BITWISE equal
  (the emulator's g++ build does plain IEEE fp32 operations, no FMA contraction, so the same
  sequence gives the same bits);
* Bf16NumpyBackend.adamw_update, the bf16 reference of the trainer: it runs NumpyBackend's fp32
  AdamW, whose algebra differs from the kernel's (step size and eps folded with sqrt(1 - beta2^t),
  the clip scale folded into the moment coefficients; the fp32 kernel test, test_kernels.test_adamw,
  holds the same tolerance). So master, m, v agree to fp32 rounding (rtol 1e-6, atol 1e-7), and
  params are the stochastic rounding of the kernel's master bit for bit, equal to the reference's
  wherever the two masters are bitwise equal, and everywhere at most one bf16 ulp from it (a master
  off by an fp32 ulp can land on the other side of the noise threshold).

global_norm_squared of bf16 grads: fp32 squares and sums in another order than the reference's
per-chunk np.dot, so it agrees to fp32 reordering (rtol 1e-5 for these sizes; the float64 sum of the
upcast values is the truth).
"""
import math

import numpy as np
import pytest

from gpt2np.backends.cuda.backend import CudaBackend, KernelArgumentError
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.backends.numpy.bf16 import Bf16NumpyBackend
from gpt2np.bf16 import BF16, round_stochastic
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2, STATS, STEP_SCALARS

B1, B2, EPS = 0.9, 0.95, 1e-8
REF32 = NumpyBackend(threads=1)
REF16 = Bf16NumpyBackend(threads=1)
F32 = np.float32


@pytest.fixture(scope="module")
def be():
    be = CudaBackend(EmuRuntime(), dtype=BF16)
    be.elementwise_threads = 64
    be.norm_threads, be.norm_max_blocks = 64, 7
    return be


@pytest.fixture(scope="module")
def be32():
    be = CudaBackend(EmuRuntime())
    be.elementwise_threads = 64
    return be


def case(n, seed):
    """(master fp32, params = master rounded to nearest, grads bf16, m, v)."""
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(n).astype(F32)
    grads = rng.standard_normal(n).astype(F32).astype(BF16)
    m = (rng.standard_normal(n) * 0.1).astype(F32)
    v = (rng.random(n) * 0.01).astype(F32)
    return master, master.astype(BF16), grads, m, v


def step_scalars(lr, t, wd):
    """model.set_step_scalars' layout: three float32 values, t's bits and no
    outlier limits (inf)."""
    s = np.array([lr / (1.0 - B1 ** t), 1.0 / math.sqrt(1.0 - B2 ** t), 1.0 - lr * wd, 0.0, np.inf,
                  np.inf], F32)
    s.view(np.uint32)[3] = t & 0xFFFFFFFF
    return s


def kernel_arithmetic(master, params, grads, m, v, lr, wd, t, scale, seed, offset):
    """kernels/adamw.cu's adamw_update (bf16 build) in NumPy fp32: the same operations
    in the same order."""
    step_size, inv_sqrt_bc2 = F32(lr / (1.0 - B1 ** t)), F32(1.0 / math.sqrt(1.0 - B2 ** t))
    g = grads.astype(F32) * F32(scale)
    m[...] = F32(B1) * m + F32(1.0 - B1) * g
    v[...] = F32(B2) * v + F32(1.0 - B2) * (g * g)
    denom = np.sqrt(v) * inv_sqrt_bc2 + F32(EPS)
    master[...] = master * F32(1.0 - lr * wd) - step_size * (m / denom)
    round_stochastic(master, params, seed, t, offset)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype == BF16 else np.uint32)


def assert_bitwise(got, want):
    np.testing.assert_array_equal(bits(got), bits(want))


def assert_near_reference(master, params, m, v, r_master, r_params, r_m, r_v):
    """Against Bf16NumpyBackend: fp32 state to fp32 rounding, params one stochastic
    rounding of the masters."""
    for got, want in ((master, r_master), (m, r_m), (v, r_v)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    same = bits(master) == bits(r_master)
    assert same.mean() > 0.9
    np.testing.assert_array_equal(bits(params)[same], bits(r_params)[same])
    assert np.abs(bits(params).astype(np.int64) - bits(r_params).astype(np.int64)).max() <= 1


# ---- adamw_update ----------------------------------------------------------------------------
@pytest.mark.parametrize("t, wd, scale, offset", [(1, 0.0, 1.0, 0), (3, 0.1, 0.5, 1000),
                                                  (1000, 0.1, 1.0, 77),
                                                  (2 ** 32 + 5, 0.0, 0.25, 2 ** 31 - 2000)])
def test_adamw_update_bf16(be, t, wd, scale, offset):
    # an unaligned segment; the seed is taken mod 2^32
    n, lo, lr, seed = 1203, 3, 3e-3, 2 ** 32 + 1337
    master, params, grads, m, v = case(n, t % 1000)
    dev = [be.from_host(a) for a in (master, params, grads, m, v)]
    D_master, D_params, D_grads, D_m, D_v = dev
    be.adamw_update(D_params[lo:], D_grads[lo:], D_m[lo:], D_v[lo:], lr, B1, B2, EPS, wd, t, scale,
                    master=D_master[lo:], seed=seed, offset=offset)
    got = [be.to_host(a) for a in (D_master, D_params, D_m, D_v)]

    want = [a.copy() for a in (master, params, m, v)]
    kernel_arithmetic(want[0][lo:], want[1][lo:], grads[lo:], want[2][lo:], want[3][lo:], lr, wd, t,
                      scale, seed, offset)
    for g, w in zip(got, want):
        assert_bitwise(g, w)
    # the elements before the segment: untouched
    for g, w in zip(got, (master, params, m, v)):
        assert_bitwise(g[:lo], w[:lo])

    r_master, r_params, r_m, r_v = (a.copy() for a in (master, params, m, v))
    REF16.adamw_update(r_params[lo:], grads[lo:], r_m[lo:], r_v[lo:], lr, B1, B2, EPS, wd, t, scale,
                       master=r_master[lo:], seed=seed, offset=offset)
    assert_near_reference(*got, r_master, r_params, r_m, r_v)


def test_stochastic_rounding_of_special_values(be):
    """Zero grads, m, v and no decay leave master as it is, so params = round_stochastic(master)
    alone: NaN -> 0x7FC0, +-inf stay, the largest float may round up to inf, subnormals and exact
    bf16 values (low bits 0: kept)."""
    rng = np.random.default_rng(5)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-40,
                        -1e-45, 0.0, -0.0, 1.0, -2.5, 1.00390625], F32)
    master = np.concatenate([special, rng.standard_normal(500).astype(F32) * F32(1e3)])
    n = master.size
    zeros = np.zeros(n, F32)
    D_master, D_params = be.from_host(master), be.zeros(n)
    be.adamw_update(D_params, be.zeros(n), be.from_host(zeros), be.from_host(zeros), 1e-3, B1, B2,
                    EPS, 0.0, 9, master=D_master, seed=11, offset=5)
    got = be.to_host(D_master)
    if be.rt.name == "cupy":
        # On a GPU (CuPy builds every kernel with -ftz=true, as llm.c's --use_fast_math does)
        # arithmetic flushes subnormals to a signed zero, and a NaN result is the canonical
        # 0x7FFFFFFF whatever the input's payload
        master = np.where(np.abs(master) < np.finfo(F32).tiny, np.copysign(F32(0), master),
                          master).astype(F32)
        master[np.isnan(master)] = np.uint32(0x7FFFFFFF).view(F32)
    assert_bitwise(got, master)
    want = np.zeros(n, BF16)
    round_stochastic(master, want, 11, 9, 5)
    assert_bitwise(be.to_host(D_params), want)
    assert bits(want)[0] == 0x7FC0 and bits(want)[1] == 0x7FC0 and np.isposinf(want[2].astype(F32))


def test_the_noise_depends_on_seed_t_and_index(be):
    """Across many draws the rounding is unbiased, and seed, t and offset each change the draws."""
    n = 4000
    master = np.full(n, 1.0 + 2.0 ** -9, F32)                  # a quarter of a bf16 ulp above 1.0
    draws = {}
    for key in ((1, 1, 0), (2, 1, 0), (1, 2, 0), (1, 1, 1)):
        seed, t, offset = key
        D_params, zeros = be.zeros(n), np.zeros(n, F32)
        be.adamw_update(D_params, be.zeros(n), be.from_host(zeros), be.from_host(zeros), 1e-3, B1,
                        B2, EPS, 0.0, t, master=be.from_host(master), seed=seed, offset=offset)
        draws[key] = be.to_host(D_params).astype(F32)
        assert abs(draws[key].mean() - master[0]) < 4 * 2.0 ** -7 * math.sqrt(0.25 * 0.75 / n)
    keys = list(draws)
    assert all(not np.array_equal(draws[a], draws[b]) for a in keys for b in keys if a < b)
    # offset shifts the index
    np.testing.assert_array_equal(draws[(1, 1, 1)][:-1], draws[(1, 1, 0)][1:])


def test_adamw_argument_checks(be, be32):
    n = 10
    f = np.zeros(n, F32)
    p16, g16 = be.zeros(n), be.zeros(n)
    with pytest.raises(KernelArgumentError, match="master"):
        be.adamw_update(p16, g16, be.from_host(f), be.from_host(f), 1e-3, B1, B2, EPS, 0.0, 1,
                        master=be.from_host(np.zeros(n - 1, F32)))
    with pytest.raises(KernelArgumentError):                  # the master weights are fp32
        be.adamw_update(p16, g16, be.from_host(f), be.from_host(f), 1e-3, B1, B2, EPS, 0.0, 1,
                        master=be.zeros(n))
    with pytest.raises(KernelArgumentError, match="offset"):
        be.adamw_update(p16, g16, be.from_host(f), be.from_host(f), 1e-3, B1, B2, EPS, 0.0, 1,
                        master=be.from_host(f), offset=-1)
    # t, the outlier limits: all 6 slots are read
    with pytest.raises(KernelArgumentError, match="scalars"):
        be.adamw_update_device(p16, g16, be.from_host(f), be.from_host(f),
                               be.from_host(step_scalars(1e-3, 1, 0)[:4]),
                               be.from_host(np.ones(2, F32)), B1, B2, EPS, True, 1.0,
                               master=be.from_host(f))
    p32 = be32.from_host(f)
    with pytest.raises(KernelArgumentError, match="master"):
        be32.adamw_update(p32, be32.from_host(f), be32.from_host(f), be32.from_host(f), 1e-3, B1,
                          B2, EPS, 0.0, 1, master=be32.from_host(f))
    with pytest.raises(ValueError, match="master"):
        REF32.adamw_update(f.copy(), f, f.copy(), f.copy(), 1e-3, B1, B2, EPS, 0.0, 1,
                           master=f.copy())


# ---- adamw_update_device -----------------------------------------------------------------------
@pytest.mark.parametrize("t, norm, clip, decayed, offset",
                         [(1, 0.4, 1.0, True, 0), (7, 3.7, 1.0, True, 12345),
                          (123456, 3.7, 0.0, False, 9), (2 ** 31 + 3, 2.0, 1.0, True, 1)])
def test_adamw_update_device_bf16(be, t, norm, clip, decayed, offset):
    n, lo, lr, wd, seed = 1203, 5, 2e-3, 0.1, 4242
    master, params, grads, m, v = case(n, 100 + t % 1000)
    stats = np.array([2.5, norm * norm], F32)
    scalars = step_scalars(lr, t, wd)
    dev = [be.from_host(a) for a in (master, params, grads, m, v)]
    D_master, D_params, D_grads, D_m, D_v = dev
    be.adamw_update_device(D_params[lo:], D_grads[lo:], D_m[lo:], D_v[lo:], be.from_host(scalars),
                           be.from_host(stats), B1, B2, EPS, decayed, clip, master=D_master[lo:],
                           seed=seed, offset=offset)
    got = [be.to_host(a) for a in (D_master, D_params, D_m, D_v)]

    want = [a.copy() for a in (master, params, m, v)]          # the kernel's arithmetic: bitwise
    REF32.adamw_update_device(want[1][lo:], grads[lo:], want[2][lo:], want[3][lo:],
                              scalars, stats, B1, B2, EPS,
                              decayed, clip, master=want[0][lo:], seed=seed, offset=offset)
    for g, w in zip(got, want):
        assert_bitwise(g, w)

    # the trainer's reference with the host's clip scale (from the float32 squared norm,
    # as the device has it)
    norm32 = math.sqrt(float(F32(norm * norm)))
    scale = clip / norm32 if clip > 0 and norm32 > clip else 1.0
    r_master, r_params, r_m, r_v = (a.copy() for a in (master, params, m, v))
    REF16.adamw_update(r_params[lo:], grads[lo:], r_m[lo:], r_v[lo:], lr, B1, B2, EPS,
                       wd if decayed else 0.0, t,
                       scale, master=r_master[lo:], seed=seed, offset=offset)
    assert_near_reference(*got, r_master, r_params, r_m, r_v)


@pytest.mark.parametrize("bad", [(math.nan, 1.0), (1.0, math.inf), (math.inf, math.nan)])
def test_adamw_update_device_bf16_skips_a_non_finite_step(be, bad):
    arrays = [be.from_host(a) for a in case(300, 1)]
    before = [be.to_host(a).tobytes() for a in arrays]
    D_master, D_params, D_grads, D_m, D_v = arrays
    be.adamw_update_device(D_params, D_grads, D_m, D_v, be.from_host(step_scalars(1e-3, 2, 0.1)),
                           be.from_host(np.array(bad, F32)), B1, B2, EPS, True, 1.0,
                           master=D_master, seed=3, offset=0)
    assert [be.to_host(a).tobytes() for a in arrays] == before


# ---- without master weights (-w 0, llm.c's use_master_weights 0) ---------------------------------
# A null master: the kernel reads the bf16 parameter (upcast, exact) where it read the master, so
# one step from params p is bitwise the master-weights step from masters equal to p upcast: that
# is the reference here.
@pytest.mark.parametrize("t, wd, scale, offset", [(1, 0.0, 1.0, 0), (1000, 0.1, 0.5, 77)])
def test_adamw_update_bf16_without_master(be, t, wd, scale, offset):
    n, lo, lr, seed = 1203, 3, 3e-3, 1337
    _, params, grads, m, v = case(n, t)
    D_params, D_grads, D_m, D_v = (be.from_host(a) for a in (params, grads, m, v))
    be.adamw_update(D_params[lo:], D_grads[lo:], D_m[lo:], D_v[lo:], lr, B1, B2, EPS, wd, t, scale,
                    seed=seed, offset=offset)
    got = [be.to_host(a) for a in (D_params, D_m, D_v)]
    want = [a.copy() for a in (params, m, v)]
    kernel_arithmetic(params[lo:].astype(F32), want[0][lo:], grads[lo:], want[1][lo:], want[2][lo:],
                      lr, wd, t, scale, seed, offset)
    for g, w in zip(got, want):
        assert_bitwise(g, w)
    # the bf16 reference without masters: bitwise its own master-weights step from the upcast
    # params, and at most one bf16 ulp from the kernel (NumpyBackend's fp32 AdamW folds its algebra
    # differently, see the top)
    r_params, r_m, r_v = (a.copy() for a in (params, m, v))
    REF16.adamw_update(r_params[lo:], grads[lo:], r_m[lo:], r_v[lo:], lr, B1, B2, EPS, wd, t, scale,
                       seed=seed, offset=offset)
    w_params, w_m, w_v, w_master = params.copy(), m.copy(), v.copy(), params.astype(F32)
    REF16.adamw_update(w_params[lo:], grads[lo:], w_m[lo:], w_v[lo:], lr, B1, B2, EPS, wd, t, scale,
                       master=w_master[lo:], seed=seed, offset=offset)
    for r, w in ((r_params, w_params), (r_m, w_m), (r_v, w_v)):
        assert_bitwise(r, w)
    for g, r in zip(got[1:], (r_m, r_v)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)
    assert np.abs(bits(got[0]).astype(np.int64) - bits(r_params).astype(np.int64)).max() <= 1


def test_bf16_reference_without_master_in_pieces_and_chunks(monkeypatch):
    """Bf16NumpyBackend.adamw_update(master=None) splits a segment into ADAMW_PIECE pieces and
    CHUNKs: the same bits as one master-weights update of the whole segment (upcast
    params as masters)."""
    from gpt2np.backends.numpy import backend as numpy_backend
    from gpt2np.backends.numpy import bf16 as numpy_bf16
    monkeypatch.setattr(numpy_bf16, "ADAMW_PIECE", 500)
    monkeypatch.setattr(numpy_backend, "CHUNK", 128)
    ref = Bf16NumpyBackend(threads=2)
    _, params, grads, m, v = case(1203, 4)
    a = [x.copy() for x in (params, m, v)]
    ref.adamw_update(a[0], grads, a[1], a[2], 2e-3, B1, B2, EPS, 0.1, 5, 0.7, seed=9, offset=11)
    b, master = [x.copy() for x in (params, m, v)], params.astype(F32)
    REF16.adamw_update(b[0], grads, b[1], b[2], 2e-3, B1, B2, EPS, 0.1, 5, 0.7, master=master,
                       seed=9, offset=11)
    for x, y in zip(a, b):
        assert_bitwise(x, y)
    assert not np.array_equal(bits(a[0]), bits(params))


@pytest.mark.parametrize("stats", [(2.5, 3.7 ** 2), (math.nan, 1.0)])
def test_adamw_update_device_bf16_without_master(be, stats):
    n, lo, lr, wd, seed, t = 1203, 5, 2e-3, 0.1, 4242, 7
    _, params, grads, m, v = case(n, 200)
    stats, scalars = np.array(stats, F32), step_scalars(lr, t, wd)
    D_params, D_grads, D_m, D_v = (be.from_host(a) for a in (params, grads, m, v))
    be.adamw_update_device(D_params[lo:], D_grads[lo:], D_m[lo:], D_v[lo:], be.from_host(scalars),
                           be.from_host(stats), B1, B2, EPS, True, 1.0, seed=seed, offset=9)
    got = [be.to_host(a) for a in (D_params, D_m, D_v)]
    want = [a.copy() for a in (params, m, v)]
    REF32.adamw_update_device(want[0][lo:], grads[lo:], want[1][lo:], want[2][lo:], scalars, stats,
                              B1, B2, EPS, True, 1.0, seed=seed, offset=9)
    for g, w in zip(got, want):
        assert_bitwise(g, w)
    # a non-finite step: untouched
    assert np.isfinite(stats[0]) != np.array_equal(bits(got[0]), bits(params))


def prepare_device_update(be, models):
    """Each model ready for update_device: rounding seed 99, stats = [loss 2, squared
    norm 9] uploaded."""
    for model in models:
        model.rounding_seed = 99
        model.stats, model.step_scalars = be.zeros(STATS, F32), be.zeros(STEP_SCALARS, F32)
        be.upload_(model.stats, np.array([2.0, 9.0], F32))


def reference_update(model, params, g, m, v, t, master=None):
    """The kernel's arithmetic per tensor of `model`, in NumPy, on host copies
    (master None: -w 0)."""
    for name, a, b in model._shard_tensors(0, model.num_parameters):
        REF32.adamw_update_device(params[a:b], g[a:b], m[a:b], v[a:b], step_scalars(1e-2, t, 0.1),
                                  np.array([2.0, 9.0], F32), B1, B2, EPS,
                                  name in model.decay_tensors, 1.0,
                                  master=None if master is None else master[a:b], seed=99, offset=a)


def device_updates(be, models, graphed, graph, g, t):
    """AdamW step t (lr 1e-2, wd 0.1, clip 1) on every model from gradient g: grads and step scalars
    uploaded, each model but `graphed` updated eagerly; `graphed` through `graph`, which its first
    call captures after one eager update (that allocates its master, m and v) and later calls
    replay. Returns the graph."""
    for model in models:
        be.copy_(model.grads, be.from_host(g))
        model.set_step_scalars(1e-2, B1, B2, 0.1, t)
    for model in models:
        if model is not graphed:
            model.update_device(B1, B2, EPS, 1.0)
    if graph is not None:
        graph.launch()
        return graph
    graphed.update_device(B1, B2, EPS, 1.0)
    be.rt.begin_capture()
    graphed.update_device(B1, B2, EPS, 1.0)
    return be.rt.end_capture()


def test_model_update_device_bf16_without_master_replays_as_a_graph(be):
    """GPT2(master_weights=False).update_device: no master buffer, each tensor's update bitwise the
    kernel's arithmetic (REF32.adamw_update_device without master), a captured graph replays it
    bitwise; the first step is bitwise the master-weights model's (its masters start as the params),
    later ones differ."""
    rng = np.random.default_rng(9)
    eager, graphed = (GPT2(CFG, be, 2, 4, seed=0, master_weights=False) for _ in range(2))
    masters = GPT2(CFG, be, 2, 4, seed=0)
    n = eager.num_parameters
    grads = [rng.standard_normal(n).astype(F32).astype(BF16) for _ in range(3)]
    models = (eager, graphed, masters)
    prepare_device_update(be, models)
    r_params, r_m, r_v = be.to_host(eager.params), np.zeros(n, F32), np.zeros(n, F32)
    graph = None
    for t, g in enumerate(grads, start=1):
        graph = device_updates(be, models, graphed, graph, g, t)
        reference_update(eager, r_params, g, r_m, r_v, t)
        for got, want in ((eager.params, r_params), (eager.m, r_m), (eager.v, r_v),
                          (graphed.params, r_params)):
            assert_bitwise(be.to_host(got), want)
        same = np.array_equal(bits(be.to_host(masters.params)), bits(r_params))
        assert same == (t == 1), t
    assert eager.master is None and graphed.master is None and masters.master is not None


# ---- the model's device update -----------------------------------------------------------------
CFG = GPT2Config(max_seq_len=8, vocab_size=37, padded_vocab_size=64, num_layers=2, num_heads=2,
                 channels=16)


def test_model_update_device_bf16_is_per_tensor_adamw_and_replays_as_a_graph(be):
    """GPT2.update_device on bf16 storage: fp32 masters made from the params, each tensor's update
    with its own decay and offset (its index in the flat buffer), t read from step_scalars: a graph
    captured once and replayed after set_step_scalars(t) uploads gives bitwise the eager updates of
    those steps, and matches the kernel's arithmetic tensor by tensor."""
    rng = np.random.default_rng(9)
    models = [GPT2(CFG, be, 2, 4, seed=0) for _ in range(2)]
    n = models[0].num_parameters
    grads = [rng.standard_normal(n).astype(F32).astype(BF16) for _ in range(3)]
    prepare_device_update(be, models)                         # norm 3 > clip 1: clipping on
    eager, graphed = models
    params0 = be.to_host(eager.params)
    # the reference: the kernel arithmetic per tensor, in NumPy
    r_params, r_master = params0.copy(), params0.astype(F32)
    r_m, r_v = np.zeros(n, F32), np.zeros(n, F32)
    graph = None
    for t, g in enumerate(grads, start=1):
        graph = device_updates(be, models, graphed, graph, g, t)
        reference_update(eager, r_params, g, r_m, r_v, t, r_master)
        assert_bitwise(be.to_host(eager.params), r_params)
        assert_bitwise(be.to_host(eager.master), r_master)
        assert_bitwise(be.to_host(eager.m), r_m)
        assert_bitwise(be.to_host(eager.v), r_v)
        for x, y in ((eager.params, graphed.params), (eager.master, graphed.master),
                     (eager.m, graphed.m)):
            assert_bitwise(be.to_host(y), be.to_host(x))
    assert eager.master.dtype == np.float32 and eager.m.dtype == np.float32


def test_set_step_scalars_layout(be32):
    model = GPT2(CFG, be32, 2, 4)
    model.stage_batch(0, np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32))
    assert model.step_scalars.dtype == np.float32 and model.stats.dtype == np.float32
    for t in (1, 2 ** 24 + 1, 2 ** 32 + 7):
        model.set_step_scalars(3e-4, B1, B2, 0.1, t)
        got = be32.to_host(model.step_scalars)
        assert_bitwise(got[:3], np.array([3e-4 / (1 - B1 ** t), 1 / math.sqrt(1 - B2 ** t),
                                          1 - 3e-4 * 0.1], F32))
        assert int(got.view(np.uint32)[3]) == t % 2 ** 32


# ---- global norm -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 100, 5000, 40000])
def test_global_norm_squared_bf16(be, n):
    rng = np.random.default_rng(n)
    grads = (rng.standard_normal(n) * 3).astype(F32).astype(BF16)
    exact = math.fsum(float(x) ** 2 for x in grads.astype(np.float64))
    got = be.global_norm_squared(be.from_host(grads))
    assert got == pytest.approx(REF16.global_norm_squared(grads), rel=1e-5)
    assert got == pytest.approx(exact, rel=1e-5)
    stats = be.zeros(STATS, F32)
    be.global_norm_squared_device(be.from_host(grads), stats)
    assert float(be.to_host(stats)[1]) == F32(got)


def test_the_bf16_reference_runs_the_device_steps_ops_as_the_fp32_reference():
    """Bf16NumpyBackend satisfies the whole contract: its device-step ops are NumpyBackend's (which
    take bf16 params and grads), bitwise; its norm into stats is its own global_norm_squared."""
    n, t, seed = 1203, 9, 77
    master, params, grads, m, v = case(n, 5)
    stats = np.array([2.5, 3.7 ** 2], F32)
    scalars = step_scalars(2e-3, t, 0.1)
    got, want = ([a.copy() for a in (master, params, m, v)] for _ in range(2))
    REF16.adamw_update_device(got[1], grads, got[2], got[3], scalars, stats, B1, B2, EPS, True, 1.0,
                              master=got[0], seed=seed, offset=3)
    REF32.adamw_update_device(want[1], grads, want[2], want[3], scalars, stats, B1, B2, EPS, True,
                              1.0, master=want[0], seed=seed, offset=3)
    for g, w in zip(got, want):
        assert_bitwise(g, w)
    norm = np.zeros(STATS, F32)
    REF16.global_norm_squared_device(grads, norm)
    assert float(norm[1]) == F32(REF16.global_norm_squared(grads))
    losses, mean = np.array([1.0, 2.0, 4.5], F32), np.zeros(STATS, F32)
    REF16.loss_mean(mean, losses, 2, accumulate=False)
    assert mean[0] == F32(7.5 / 3 / 2)
    dst = np.zeros(3, BF16)
    REF16.upload_(dst, np.array([1.0, 2.0, 3.0 + 2 ** -9], F32))          # rounded to nearest even
    assert (dst.astype(F32).tolist() == [1.0, 2.0, 3.0]
            and REF16.read_async(dst).result().tolist() == dst.tolist())
