"""--cpu-math fast (NumpyBackend(math="fast"), cpu_kernels' fast set) is not bitwise the NumPy
reference; this file is its documented tolerance. Each op is checked against the same op computed in
float64 by the NumPy reference code (NumpyBackend(np.float64), an independent implementation of the
same formulas), beside the exact float32 path:

  e^x                     within 1.02 ulp of the float64 value (NumPy's float32 exp: about 2.5 here)
  GELU forward            |error| <= 2^-22 |x| (x normal);  backward |error| <= 2^-21 |dout| (the
                          exact path's is ~1.3e-6)
  LayerNorm fwd / bwd     |error| <= 2^-20 of the largest |value| of the output (dinp: of dinp)
  attention fwd / bwd     probabilities and outputs |error| <= 2^-19 of the largest |value| (the
                          exact float32 path's own error reaches 1.7 x 2^-20 with heads of 64);
                          masked entries exactly 0
  classifier              losses within 2^-21 relative; dlogits |error| <= 2^-20 of dloss; padding
                          exactly 0
  gradient norm           within 2^-20 relative

and as a whole: training steps track the exact path's (the golden run's fast twin, in
test_golden_run.py, holds a 10-step run to the recorded curve). Results do not depend on the thread
count: every row is computed alone."""
import re

import numpy as np
import pytest

# run_steps: (norms, params, m, v, grads) of 3 steps of a tiny model
from test_cpu_kernels import Spy, run_steps

import gpt2np.backends.numpy.backend as numpy_backend
from gpt2np.backends import get_backend
from gpt2np.backends.numpy import cpu_kernels
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.model import GPT2

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None,
                                reason="no C compiler: the fast path is off")

def three():
    """(fast, exact, float64 truth) backends; the fast one's library is a Spy."""
    fast = NumpyBackend(threads=2, math="fast")
    fast._kernels = Spy(fast._kernels)
    return fast, NumpyBackend(threads=2, math="exact"), NumpyBackend(np.float64, threads=1)


def f64(*arrays):
    return [a.astype(np.float64) for a in arrays]


def max_error(got, want):
    return float(np.max(np.abs(got.astype(np.float64) - want)))


def test_exp_is_within_1_02_ulp_and_keeps_inf_nan_and_zero():
    """Every float32 in +-[1, 64) (where the error peaks: 1.0115 ulp near -5.857), and random ones
    over the range where e^x is a normal float32."""
    lib = cpu_kernels.load()
    rng = np.random.default_rng(0)
    every = np.arange(np.float32(1.0).view(np.uint32), np.float32(64.0).view(np.uint32),
                      dtype=np.uint32)
    sample = np.concatenate([rng.uniform(-87.3, 88.7, 1 << 20),
                             rng.standard_normal(1 << 16)]).astype(np.float32)
    worst = 0.0
    for x in [sample, *(sign * every[i:i + (1 << 22)].view(np.float32) for sign in (1, -1)
                        for i in range(0, every.size, 1 << 22))]:
        x = np.ascontiguousarray(x, np.float32)
        y = np.empty_like(x)
        lib.exp_fast_array(x.ctypes.data, y.ctypes.data, x.size)
        want = np.exp(x.astype(np.float64))
        worst = max(worst, float((np.abs(y - want)
                                  / np.spacing(want.astype(np.float32)).astype(np.float64)).max()))
    assert worst <= 1.02
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.8, -87.4, -200.0, 1e30], np.float32)
    out = np.empty_like(special)
    lib.exp_fast_array(special.ctypes.data, out.ctypes.data, special.size)
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[1:], [np.inf, 0.0, 1.0, 1.0, np.inf, 0.0, 0.0, np.inf])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")    # x**3 of |x| = 1e15 overflows float32
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 100_003])
def test_gelu_forward_and_backward_within_tolerance(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 4).astype(np.float32).reshape(1, 1, n)
    # |x| ~ 1e11: e^{-2u} clamped
    special = [0.0, -0.0, 30.0, -30.0, 1e-30, -9.0, 1e11, -1e11, 1e15, -1e15]
    x.reshape(-1)[:min(n, len(special))] = special[:min(n, len(special))]
    dout = rng.standard_normal(x.shape).astype(np.float32)
    fast, exact, truth = three()
    results = {}
    for name, be in (("fast", fast), ("exact", exact), ("truth", truth)):
        xi, di = (x, dout) if name != "truth" else f64(x, dout)
        out, dinp = np.empty_like(xi), np.empty_like(xi)
        be.gelu_forward(out, xi)
        be.gelu_backward(dinp, xi, di)
        results[name] = out, dinp
    (out, dinp), (want_out, want_dinp) = results["fast"], results["truth"]
    assert np.all(np.abs(out - want_out) <= 2.0 ** -22 * np.abs(x))
    assert np.all(np.abs(dinp - want_dinp) <= 2.0 ** -21 * np.abs(dout))
    assert {"gelu_forward_fast", "gelu_backward_fast"} <= fast._kernels.called
    in_place = dout.copy()                                    # dinp may be dout
    fast.gelu_backward(in_place, x, in_place)
    np.testing.assert_array_equal(in_place, dinp)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_gelu_keeps_the_references_inf_and_nan():
    x = np.array([np.inf, -np.inf, np.nan, 0.0], np.float32).reshape(1, 1, 4)
    fast, exact, _ = three()
    got, want = np.empty_like(x), np.empty_like(x)
    fast.gelu_forward(got, x)
    exact.gelu_forward(want, x)
    np.testing.assert_array_equal(got, want)                   # inf, NaN, NaN, 0
    dout = np.full_like(x, 2.0)
    fast.gelu_backward(got, x, dout)
    exact.gelu_backward(want, x, dout)
    np.testing.assert_array_equal(got, want)                   # NaN, NaN, NaN, 1


@pytest.mark.parametrize("C, T", [(5, 7), (16, 7), (768, 7), (32, 23)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_layernorm_within_tolerance(C, T, accumulate, monkeypatch):
    # the row blocks split over the threads
    monkeypatch.setattr(numpy_backend, "PARALLEL_MIN", 1)
    rng = np.random.default_rng(C)
    B = 3
    x = (rng.standard_normal((B, T, C)) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    base = rng.standard_normal((B, T, C)).astype(np.float32)    # dinp accumulates into this
    fast, _, truth = three()
    runs = {}
    for name, be in (("fast", fast), ("truth", truth)):
        xi, wi, bi, di, dinp = ((x, w, b, dout, base.copy()) if name == "fast"
                                else f64(x, w, b, dout, base))
        out, mean, rstd = np.empty_like(xi), np.empty((B, T), xi.dtype), np.empty((B, T), xi.dtype)
        be.layernorm_forward(out, mean, rstd, xi, wi, bi)
        dw, db = np.full_like(wi, 0.5), np.full_like(wi, -2.0)   # added to, or overwritten
        be.layernorm_backward(dinp, dw, db, di, xi, wi, mean, rstd, accumulate=accumulate)
        runs[name] = out, mean, rstd, dinp, dw, db
    for got, want in zip(runs["fast"], runs["truth"]):
        assert max_error(got, want) <= 2.0 ** -20 * np.abs(want).max()
    assert {"layernorm_forward_fast", "layernorm_backward_fast"} <= fast._kernels.called


@pytest.mark.parametrize("B, T, NH, HS",
                         [(1, 1, 1, 4), (2, 9, 3, 5), (2, 33, 2, 8), (1, 70, 3, 64)])
def test_attention_within_tolerance_masked_entries_zero(B, T, NH, HS):
    rng = np.random.default_rng(T)
    C = NH * HS
    inp = (rng.standard_normal((B, T, 3 * C)) * 2).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    fast, _, truth = three()
    runs = {}
    for name, be in (("fast", fast), ("truth", truth)):
        xi, di = (inp, dout) if name == "fast" else f64(inp, dout)
        # NaN-filled outputs: every element must be written, not added to
        out, qkvr = np.full((B, T, C), np.nan, xi.dtype), np.full((3, B, NH, T, HS), np.nan,
                                                                  xi.dtype)
        att, dinp = np.full((B, NH, T, T), np.nan, xi.dtype), np.full_like(xi, np.nan)
        be.attention_forward(out, qkvr, att, xi)
        be.attention_backward(dinp, di, qkvr, att)
        runs[name] = out, att, dinp
    for got, want in zip(runs["fast"], runs["truth"]):
        assert max_error(got, want) <= 2.0 ** -19 * np.abs(want).max()
    assert {"attention_forward_fast", "attention_backward_fast"} <= fast._kernels.called
    att = runs["fast"][1]
    assert np.all(att[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0.0)
    np.testing.assert_allclose(att.sum(axis=-1), 1.0, rtol=2.0 ** -20)


@pytest.mark.parametrize("V, Vp", [(1, 8), (100, 128), (5000, 5008)])
def test_classifier_within_tolerance(V, Vp):
    rng = np.random.default_rng(V)
    B, T, dloss = 2, 5, 1.0 / 10
    logits = (rng.standard_normal((B, T, Vp)) * 4).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    fast, _, truth = three()
    runs = {}
    for name, be in (("fast", fast), ("truth", truth)):
        x = logits.copy() if name == "fast" else logits.astype(np.float64)
        evaluated = x.copy()
        val, losses = np.zeros((B, T), x.dtype), np.zeros((B, T), x.dtype)
        be.fused_classifier(evaluated, val, targets, V, dloss, write_dlogits=False)
        be.fused_classifier(x, losses, targets, V, dloss, write_dlogits=True)
        runs[name] = val, losses, x, evaluated
    (val, losses, dlogits, evaluated), (want_val, want_losses, want_dlogits, _) = (runs["fast"],
                                                                                   runs["truth"])
    np.testing.assert_array_equal(want_val, want_losses)
    # write_dlogits=False leaves the logits alone
    np.testing.assert_array_equal(evaluated, logits)
    np.testing.assert_allclose(val, want_val, rtol=2.0 ** -21)
    np.testing.assert_array_equal(val, losses)
    assert max_error(dlogits, want_dlogits) <= 2.0 ** -20 * dloss
    assert np.all(dlogits[..., V:] == 0.0)
    assert "classifier_fast" in fast._kernels.called


def test_classifier_nan_logit_gives_a_nan_loss_and_bad_targets_are_refused():
    logits = np.random.default_rng(1).standard_normal((1, 2, 16)).astype(np.float32)
    logits[0, 1, 3] = np.nan
    losses = np.zeros((1, 2), np.float32)
    fast = three()[0]
    fast.fused_classifier(logits, losses, np.array([[1, 2]], np.int32), 16, 0.5, write_dlogits=True)
    assert "classifier_fast" in fast._kernels.called
    assert np.isfinite(losses[0, 0]) and np.isnan(losses[0, 1])
    for bad in (-1, 16):
        with pytest.raises(IndexError, match=r"targets must be in \[0, 16\)"):
            fast.fused_classifier(logits, losses, np.array([[1, bad]], np.int32), 16, 0.5,
                                  write_dlogits=True)


def test_nan_in_gives_nan_out():
    lib = cpu_kernels.load()
    x = np.array([np.nan, -np.nan, 1.0], np.float32)
    y = np.empty_like(x)
    lib.exp_fast_array(x.ctypes.data, y.ctypes.data, x.size)
    assert np.isnan(y[:2]).all() and y[2] == np.float32(np.e)


def test_gradient_norm_within_tolerance_and_overflow_is_inf(monkeypatch):
    # every thread takes a run of the chunks
    monkeypatch.setattr(numpy_backend, "PARALLEL_MIN", 1)
    g = (np.random.default_rng(2).standard_normal(3 * numpy_backend.CHUNK + 17)
         * 3).astype(np.float32)
    fast, _, _ = three()
    want = float(np.sum(g.astype(np.float64) ** 2))
    got = fast.global_norm_squared(g)
    assert abs(got - want) <= 2.0 ** -20 * want
    assert "sum_squares_chunks" in fast._kernels.called
    assert all(NumpyBackend(threads=n, math="fast").global_norm_squared(g) == got
               for n in (1, 3, 4))
    # its square overflows float32, as on the GPU
    g[5] = 3e30
    assert fast.global_norm_squared(g) == np.inf
    g[-1] = np.nan
    assert np.isnan(fast.global_norm_squared(g))


def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setattr(numpy_backend, "PARALLEL_MIN", 1)      # split every op over the threads
    backends = [NumpyBackend(threads=n, math="fast") for n in (1, 2, 3)]
    for backend in backends:
        backend._kernels = Spy(backend._kernels)
    runs = [run_steps(backend) for backend in backends]
    assert all("layernorm_backward_fast" in backend._kernels.called for backend in backends)
    for other in runs[1:]:
        assert other[0] == runs[0][0]
        for got, want in zip(other[1:], runs[0][1:]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("N", [1, 17, 33, 69])
def test_layernorm_backward_is_bitwise_the_same_on_any_thread_count(N, monkeypatch):
    """The row blocks of dweight/dbias partial sums split over 1-4 threads (blocks of 16 rows: N=17
    puts a thread's range mid-array, 69 ends in a short block): the same bits,
    accumulating or not."""
    monkeypatch.setattr(numpy_backend, "PARALLEL_MIN", 1)
    rng = np.random.default_rng(N)
    C = 24
    x, dout = ((rng.standard_normal((N, C)) * 3).astype(np.float32),
               rng.standard_normal((N, C)).astype(np.float32))
    w, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    mean, rstd = np.empty(N, np.float32), np.empty(N, np.float32)
    NumpyBackend(threads=1, math="fast").layernorm_forward(np.empty_like(x), mean, rstd, x, w, b)
    for accumulate in (True, False):
        runs = []
        for threads in (1, 2, 3, 4):
            be = NumpyBackend(threads=threads, math="fast")
            dinp, dw, db = (np.full_like(x, 0.25), np.full(C, 0.5, np.float32),
                            np.full(C, -2.0, np.float32))
            be.layernorm_backward(dinp, dw, db, dout, x, w, mean, rstd, accumulate=accumulate)
            runs.append((dinp, dw, db))
        for other in runs[1:]:
            for got, want in zip(other, runs[0]):
                np.testing.assert_array_equal(got, want)


def test_training_steps_track_the_exact_path():
    backend = three()[0]
    fast, exact = run_steps(backend), run_steps(NumpyBackend(threads=2, math="exact"))
    assert {"gelu_forward_fast", "layernorm_backward_fast", "attention_forward_fast",
            "attention_backward_fast",
            "classifier_fast", "sum_squares_chunks"} <= backend._kernels.called
    # not the exact path under another name
    assert not np.array_equal(fast[1], exact[1])
    np.testing.assert_allclose(fast[0], exact[0], rtol=1e-5)     # grad norms
    for got, want in zip(fast[1:], exact[1:]):
        assert max_error(got, want.astype(np.float64)) <= 1e-5 * np.abs(want).max()


def test_defaults_class_exact_trainer_fast_and_bad_values_refused():
    assert NumpyBackend().math == "exact"                       # the class is the reference
    # training's default (train.py --cpu-math)
    assert get_backend("numpy").math == "fast"
    assert get_backend("numpy", math="exact").math == "exact"
    assert get_backend("numpy", precision="bf16").math == "fast"
    assert NumpyBackend(fused=False, math="fast").math == "exact"   # no C loops: the NumPy code
    with pytest.raises(ValueError, match="math='quick'"):
        NumpyBackend(math="quick")


def test_train_py_says_when_fast_math_cannot_run(tmp_path, capsys, monkeypatch):
    """No C loops (no compiler): --cpu-math fast trains on the NumPy code, says so in one note, and
    the header's "cpu math" row says exact."""
    from test_golden_run import make_inputs

    import train
    make_inputs(tmp_path)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    code = train.main([str(a) for a in ["-e", tmp_path / "small.bin", "-i",
                                        tmp_path / "train.bin", "-b", 2, "-t", 16,
                                        "-x", 1, "-v", 0, "-s", 0, "--device", "cpu"]])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert ("note: --cpu-math fast: the C loops did not build here (no working C compiler?), "
            "running the NumPy reference code" in out)
    assert re.search(r"\| cpu math +\| exact +\|", out)


def test_profiler_cpu_math_flag(monkeypatch, capsys):
    """The profiler takes --cpu-math on the CPU (default: training's fast) and refuses it
    elsewhere in one line."""
    import gpt2np.backends as backends
    from gpt2np.cli.profile import main as profiler_main
    asked = []

    class Stop(Exception):
        pass

    def fake_get_backend(name, **options):
        asked.append(options)
        raise Stop
    monkeypatch.setattr(backends, "get_backend", fake_get_backend)
    for flags in ([], ["--cpu-math", "exact"]):
        with pytest.raises(Stop):
            profiler_main(["--device", "cpu", *flags])
    # no math: get_backend's numpy default, fast; fp32: train.py's precision on the CPU
    assert asked == [{"precision": "fp32"}, {"precision": "fp32", "math": "exact"}]
    assert profiler_main(["--device", "emu", "--cpu-math", "fast"]) == 2
    assert profiler_main(["--plan", "--cpu-math", "exact"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --cpu-math fast: only for the CPU (numpy backend), not --device emu",
                   "error: --cpu-math exact: not with --plan (a plan is for a GPU)"]


def test_compare_cpu_math_flag(capsys):
    """compare builds gpt2np with train.py's CPU math (fast unless --cpu-math exact) and refuses the
    flag on another backend in one line."""
    from test_cpu_kernels import CFG

    from gpt2np.cli.compare import build_model
    from gpt2np.cli.compare import main as compare_main
    params = GPT2(CFG, NumpyBackend(), 1, 1, seed=1).params_host()
    assert build_model(CFG, "numpy", 1, 8, params).backend.math == "fast"
    assert build_model(CFG, "numpy", 1, 8, params, cpu_math="exact").backend.math == "exact"
    assert compare_main(["-e", "no.bin", "--backend", "emu", "--cpu-math", "exact"]) == 2
    assert (capsys.readouterr().err.strip()
            == "error: --cpu-math exact: only for the numpy backend, not --backend emu")


def test_train_py_notes_cpu_math_off_the_cpu(tmp_path, capsys):
    """--cpu-math on the emulated GPU path changes nothing there: one note says so,
    and the run goes on."""
    from test_golden_run import make_inputs

    import train
    make_inputs(tmp_path)
    code = train.main([str(a) for a in ["-e", tmp_path / "small.bin", "-i", tmp_path / "train.bin",
                                        "-b", 1, "-t", 4, "-x", 1, "-v", 0, "-s", 0, "--device",
                                        "emu", "--cpu-math", "exact"]])
    out = capsys.readouterr().out
    assert code == 0
    assert ("note: --cpu-math exact is for the CPU; this run is on emu, where "
            "--precision sets the math" in out)
    assert "cpu math" not in out
