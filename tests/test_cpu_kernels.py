"""The fast path's C loops that stand for reference code (backends/numpy/csrc/bitwise.c: AdamW, the
bias gradient's column sums, the token embedding gradient, bf16's stochastic rounding) give BITWISE
the reference's results, op by op on awkward sizes and values. Also the exact path (the reference,
called on blocks of rows, classifier rows and GELU elements) against itself unsplit: op by op and
over whole training steps."""
import re

import numpy as np
import pytest

import gpt2np.backends.numpy.backend as numpy_backend
from gpt2np.backends.numpy import cpu_kernels, fast
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.train_step import AdamW, train_step

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None,
                                   reason="no C compiler: the fast path is off")

CFG = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                 channels=16)


def bits(array):
    return np.ascontiguousarray(array).view(np.uint32)


def awkward(rng, n, scale=1.0):
    """float32 normals with zeros, signed zeros, subnormals, huge values, infinities
    and NaN up front."""
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-40, -1e-42, 1e-45, 3e38, -3e38, np.inf, -np.inf, np.nan, 12.0,
                        -12.0, 1e-20, -4.5], np.float32)
    x[:min(n, special.size)] = special[:n]
    return x


def backends():
    """(the fast path, the reference)."""
    return NumpyBackend(threads=2, math="fast"), NumpyBackend(threads=2, math="exact")


class Spy:
    """The C library, recording which of its functions are called (so a test knows
    the C loops ran)."""

    def __init__(self, lib):
        self.lib, self.called = lib, set()

    def __getattr__(self, name):
        self.called.add(name)
        return getattr(self.lib, name)


@needs_kernels
# inf and NaN on purpose, also in worker threads
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, (1 << 17) + 13])
@pytest.mark.parametrize("weight_decay, grad_scale, t",
                         [(0.1, 0.37, 3), (0.0, 1.0, 1), (0.1, 1.0, 1000)])
def test_fused_adamw_is_bitwise_the_numpy_adamw(n, weight_decay, grad_scale, t):
    rng = np.random.default_rng(n)
    p, g = awkward(rng, n), awkward(rng, n)[::-1].copy()
    m, v = (rng.standard_normal(n).astype(np.float32) * 0.1,
            np.abs(rng.standard_normal(n)).astype(np.float32))
    fused, ref = backends()
    states = [[a.copy() for a in (p, g, m, v)] for _ in range(2)]
    with np.errstate(all="ignore"):
        for be, state in zip((fused, ref), states):
            be.adamw_update(*state, 3e-4, 0.9, 0.95, 1e-8, weight_decay, t, grad_scale)
    for got, want in zip(*states):
        np.testing.assert_array_equal(bits(got), bits(want))


@needs_kernels
@pytest.mark.parametrize("n, offset", [(1, 0), (9, 3), (1000, 2 ** 32 - 5), (70_001, 5 * 10 ** 9),
                                       (300, 2 ** 40 + 3)])
def test_fused_stochastic_rounding_is_bitwise_bf16s(n, offset):
    """bf16.round_stochastic through the C loop: the same bits as its NumPy hash for every element,
    at awkward offsets (past 2^32) and awkward values (NaN, infinities, signed zeros, carries into
    the exponent: low halves 0xFFFF)."""
    from gpt2np.bf16 import BF16, round_stochastic
    rng = np.random.default_rng(n)
    x = awkward(rng, n)
    x.view(np.uint32)[n // 2:] |= np.uint32(0xFFFF) * (rng.random(n - n // 2) < 0.3)   # carries
    want, got = np.empty(n, BF16), np.empty(n, BF16)
    for seed, t in ((1337, 1), (7, 2 ** 33 + 5)):
        round_stochastic(x, want, seed, t, offset)
        round_stochastic(x, got, seed, t, offset, kernels=cpu_kernels.load())
        assert np.array_equal(want.view(np.uint16), got.view(np.uint16)), (seed, t)


@needs_kernels
@pytest.mark.parametrize("N", [1, 3, 9, 1000])
@pytest.mark.parametrize("C", [2, 3, 17, 768])
def test_column_sums_add_as_numpy_does(N, C, monkeypatch):
    monkeypatch.setattr(numpy_backend, "PARALLEL_MIN", 1)      # the columns split over the threads
    rng = np.random.default_rng(N * C)
    x = (rng.standard_normal((N, C)) * 100).astype(np.float32)
    x[rng.random((N, C)) < 0.05] = -0.0
    be = NumpyBackend(threads=2, math="fast")
    sums = np.full(C, np.nan, np.float32)
    fast.matmul_backward_bias(be, be.fast_kernels(x), sums, x, accumulate=False)
    np.testing.assert_array_equal(bits(sums), bits(x.sum(axis=0)))


@needs_kernels
@pytest.mark.parametrize("accumulate", [True, False])
def test_fused_token_embedding_gradient_is_bitwise_np_add_at(accumulate):
    # repeated ids add in turn (the order of the adds is part of the bits), ids at
    # both ends of the table
    rng = np.random.default_rng(4)
    B, T, C, V = 3, 11, 17, 40
    ids = rng.integers(0, 5, (B, T)).astype(np.int32)
    ids[0, :3], ids[1, 0] = V - 1, 0
    dout = (rng.standard_normal((B, T, C)) * 10).astype(np.float32)
    dwte0 = (rng.standard_normal((V, C)) * 1e3).astype(np.float32)
    dwpe0 = rng.standard_normal((T + 2, C)).astype(np.float32)
    results = []
    for be in backends():
        be._kernels = Spy(be._kernels) if be._kernels else None
        dwte, dwpe = dwte0.copy(), dwpe0.copy()
        be.encoder_backward(dwte, dwpe, dout, ids, accumulate)
        results.append((dwte, dwpe, be))
    (got_wte, got_wpe, fused), (want_wte, want_wpe, _) = results
    assert "rows_add_at" in fused._kernels.called
    np.testing.assert_array_equal(bits(got_wte), bits(want_wte))
    np.testing.assert_array_equal(bits(got_wpe), bits(want_wpe))
    dwte = dwte0.copy()
    # an id past the table: NumPy's error, no stray write
    with pytest.raises(IndexError):
        fused.encoder_backward(dwte, dwpe0.copy(), dout, np.full((B, T), V, np.int32))
    np.testing.assert_array_equal(dwte, dwte0)
    # ids that do not match dout: NumPy's error too
    with pytest.raises(ValueError):
        fused.encoder_backward(dwte, dwpe0.copy(), dout, ids[:, :-1].copy())
    np.testing.assert_array_equal(dwte, dwte0)


@needs_kernels
def test_fast_path_skips_non_contiguous_or_other_dtypes():
    fused = NumpyBackend(threads=1, math="fast")
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    assert fused.fast_kernels(x) is not None
    assert fused.fast_kernels(x[:, :, ::2]) is None
    assert fused.fast_kernels(x.astype(np.float64)) is None
    assert NumpyBackend(dtype=np.float64).fused is False
    assert NumpyBackend(threads=1).fast_kernels(x) is None        # the exact path: the reference


def test_no_compiler_means_the_numpy_code(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2NP_CPU_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")                  # a "compiler" that always fails
    monkeypatch.setattr(cpu_kernels, "compiler", lambda: "false")
    assert cpu_kernels.load() is None
    assert NumpyBackend(threads=1).fused is False
    assert NumpyBackend(threads=1, math="fast").math == "exact"
    with pytest.raises(RuntimeError, match="did not build"):
        NumpyBackend(threads=1, fused=True)


@pytest.mark.parametrize("rows", [1, 3])
def test_classifier_row_blocks_change_no_bit(rows, monkeypatch):
    rng = np.random.default_rng(1)
    B, T, V, Vp = 3, 5, 37, 40
    logits = (rng.standard_normal((B, T, Vp)) * 3).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    be = NumpyBackend(threads=2)

    def run():
        losses, dlogits = np.zeros((B, T), np.float32), logits.copy()
        be.fused_classifier(dlogits, losses, targets, V, 0.1, write_dlogits=True)
        val = np.zeros((B, T), np.float32)
        be.fused_classifier(logits.copy(), val, targets, V, 0.1, write_dlogits=False)
        return losses, dlogits, val

    want = run()
    monkeypatch.setattr(numpy_backend, "CLASSIFIER_ROWS", rows)
    monkeypatch.setattr(numpy_backend, "PARALLEL_MIN", 1)
    for got, ref in zip(run(), want):
        np.testing.assert_array_equal(bits(got), bits(ref))


def run_steps(backend, steps=3, accum=2):
    model = GPT2(CFG, backend, 2, 8, seed=5)
    rng = np.random.default_rng(9)
    data = rng.integers(0, CFG.vocab_size, (steps * accum, 2, 9)).astype(np.int32)
    batches = iter((d[:, :-1], d[:, 1:]) for d in data)
    norms = [train_step(model, lambda: next(batches), step=s, lr=1e-3, accum_steps=accum,
                        adamw=AdamW(weight_decay=0.1, grad_clip=0.5)).grad_norm
             for s in range(steps)]
    return norms, model.params, model.m, model.v, model.grads


def test_training_steps_split_in_blocks_are_bitwise_the_unsplit_steps(monkeypatch):
    ref = run_steps(NumpyBackend(threads=1))
    monkeypatch.setattr(numpy_backend, "PARALLEL_MIN", 1)      # split every op over the threads
    monkeypatch.setattr(numpy_backend, "BLOCK", 24)            # and GELU in many blocks
    split = run_steps(NumpyBackend(threads=2))
    assert split[0] == ref[0]
    for got, want in zip(split[1:], ref[1:]):
        np.testing.assert_array_equal(bits(got), bits(want))


def load_cpu_step_bench():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "cpu_step.py"
    spec = importlib.util.spec_from_file_location("cpu_step_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_step_bench_floor_counts_the_steps_gemms_and_adamw_bytes():
    """The floor's parts: the GEMM shapes it times add up to the op contract's GEMM FLOPs of a step
    (matmuls and attention's batched products), and AdamW's bytes are 28 per parameter."""
    from gpt2np import ranges
    bench = load_cpu_step_bench()
    model = GPT2(CFG, NumpyBackend(threads=2), 2, 8, seed=1)
    x = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)).astype(np.int32)
    recorder = bench.Recorder()
    ranges.add_listener(recorder)
    try:
        train_step(model, lambda: (x[:, :-1], x[:, 1:]), step=0, lr=1e-3)
    finally:
        ranges.remove_listener(recorder)
    L, C, Vp, N, T, NH = (CFG.num_layers, CFG.channels, CFG.padded_vocab_size, 2 * 8, 8,
                          CFG.num_heads)
    # forward + 2 backward GEMMs
    matmul = 3 * 2 * N * (L * (3 * C * C + C * C + 4 * C * C + 4 * C * C) + Vp * C)
    # 2 forward + 4 backward
    attention = 6 * 2 * 2 * NH * T * T * (C // NH) * L
    assert recorder.matmul_flops == matmul and recorder.gemm_flops == matmul + attention
    assert recorder.timed_flops() == recorder.gemm_flops
    assert recorder.adamw_bytes == 28 * model.num_parameters
    assert {"matmul_forward", "attention_backward", "adamw", "global_norm"} <= set(recorder.op_ms)


def test_cpu_step_bench_round_ratios_use_each_rounds_own_floor():
    bench = load_cpu_step_bench()
    # the last field: calls per step
    gemms = [(2, 2, 2, 1, False, False, 3), (4, 4, 4, 1, False, True, 1)]
    gpt2np_runs = [{"times_ms": [99.0, 20.0, 22.0, 24.0]}, {"times_ms": [99.0, 40.0, 30.0, 50.0]}]
    numpy_floors = [{"gemm_s": [0.002, 0.004], "bandwidth": 1e9},
                    {"gemm_s": [0.004, 0.008], "bandwidth": 1e9}]
    torch_floors = [{"gemm_s": [0.001, 0.005], "bandwidth": 2e9}]          # one round only
    ratios = bench.round_ratios(gpt2np_runs, [numpy_floors, torch_floors], gemms, 4e6, warmup=1)
    # round 1: GEMMs 3 * 0.001 + 0.004 s, AdamW 4e6 B at 2e9 B/s -> 9 ms, step median 22 ms; round
    # 2: numpy's only, 3 * 0.004 + 0.008 + 0.004 = 24 ms, median 40 ms
    assert ratios == [pytest.approx((22 / 9, 22, 9)), pytest.approx((40 / 24, 40, 24))]


def test_cpu_step_bench_paired_floor_weights_each_shape_by_its_calls():
    bench = load_cpu_step_bench()
    gemms = [(2, 2, 2, 1, False, False, 3), (4, 4, 4, 1, False, True, 1)]
    # 3 calls * 2 ms + 1 call * 4 ms + AdamW's 4e6 B at 1e9 B/s (4 ms) = 14 ms
    assert (bench.floor_ms({"gemm_s": [0.002, 0.004], "bandwidth": 1e9}, gemms, 4e6)
            == pytest.approx(14.0))


def test_cpu_step_bench_times_its_steps_back_to_back_and_pairs_further_steps(monkeypatch):
    """The timed steps (the median and the strict ratio) run back to back, as in training; then
    --steps times two steps and a floor, the floor paired with the second step's time (the first
    follows the last floor)."""
    import argparse

    import gpt2np.train_step
    bench = load_cpu_step_bench()
    events = []
    # (bench_gpt2np imports it from the module when it runs)
    real_step = gpt2np.train_step.train_step

    def step_spy(*a, **k):
        events.append("step")
        return real_step(*a, **k)

    def floor_spy(gemms, args, reps=None):
        events.append("floor")
        return {"gemm_s": [0.001] * len(gemms), "bandwidth": 1e9}

    monkeypatch.setattr(gpt2np.train_step, "train_step", step_spy)
    monkeypatch.setattr(bench, "floor_numpy", floor_spy)
    args = argparse.Namespace(model="d6", b=1, t=8, steps=3, warmup=1, threads=1, cpu_math="exact",
                              paired=True)
    result = bench.bench_gpt2np(args)
    assert events == ["step"] * 4 + ["step", "step", "floor"] * 3
    assert len(result["times_ms"]) == 4 and len(result["paired_floor_ms"]) == 3
    assert all(t > 0 and f > 0 for t, f in result["paired_floor_ms"])
    events.clear()
    args.paired = False
    assert bench.bench_gpt2np(args)["paired_floor_ms"] == [] and events == ["step"] * 4


def test_norm_in_cache_bench_runs_both_ways_to_the_same_sum(capsys):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "norm_in_cache.py"
    spec = importlib.util.spec_from_file_location("norm_in_cache_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--layers", "1", "--rounds", "1", "--rows", "8"])
    out = capsys.readouterr().out
    assert "GEMMs + norm after" in out and "GEMMs + norm in cache" in out
    after, in_cache = re.search(r"sums of squares *: (\S+) after, (\S+) in cache", out).groups()
    assert float(after) == pytest.approx(float(in_cache), rel=1e-6) and float(after) > 0
