"""No behaviour change across refactors: a 10-step training run of a small model through train.py,
compared with a stored record of the same run (tests/golden_run.npz; `PYTHONPATH=. python
tests/test_golden_run.py --record` rewrites it).

The run touches every part of a step: gradient accumulation (-d), warmup then cosine decay, weight
decay, global-norm clipping (it triggers), validation, and a checkpoint at the end. The model file
and the shards are made here from a fixed NumPy seed, so gpt2np's own init is not
part of what is pinned.

Why the GEMMs are exact here. The BLAS picks its GEMM kernels per CPU, so the last bits of every
GEMM differ from one machine to another. AdamW then turns a last-bit difference in a near-zero
gradient into a difference of up to a few percent of the learning rate, so after 10 steps a run on
another CPU differs from the record by ~1e-5 in its weights: as much as a real change of the code
does. So this test runs every np.matmul and np.dot exactly rounded (products and sums in long
double, one rounding to float32), which gives the same bits on every machine. The rest of a step is
NumPy's float32 tanh, exp, log and reductions, and IEEE arithmetic. Those agree on x86-64 machines
(checked with every OpenBLAS core type and NumPy's SIMD levels down to SSE), but need not elsewhere:
a probe of them against the recording decides whether the final weights can be compared here.

The tolerance: every parameter and AdamW moment within 2 ulps of the record. A real change lands far
outside it: test_a_one_ulp_update_change_fails and test_a_swapped_op_order_fails plant one and watch
the comparison fail.
The printed losses and main.log are compared on any machine, within the rounding of
their printed digits.
"""
import contextlib
import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import write_shard
from gpt2np.formats.checkpoint import load_model, load_state, model_path, save_model, state_path
from gpt2np.model import GPT2
from gpt2np.ops.reference import layernorm
from gpt2np.tensors import param_shapes, views

SMALL = GPT2Config(max_seq_len=32, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=4,
                   channels=32)
RECORD = Path(__file__).with_name("golden_run.npz")
# the tolerance of the final parameters and moments, in float32 ulps
ULPS = 2

EXPECTED_STEP_LINES = [
    'step    1/10 | loss 5.342460 (+nanz)| norm 1.6188 (+nanz)| lr 1.50e-03',
    'step    2/10 | loss 5.381507 (+nanz)| norm 1.5092 (+nanz)| lr 3.00e-03',
    'step    3/10 | loss 5.285591 (+nanz)| norm 1.5238 (+nanz)| lr 3.00e-03',
    'step    4/10 | loss 5.333940 (+nanz)| norm 1.3350 (+nanz)| lr 2.90e-03',
    'step    5/10 | loss 5.342482 (+nanz)| norm 1.3483 (+nanz)| lr 2.60e-03',
    'step    6/10 | loss 5.308047 (+nanz)| norm 1.1251 (+nanz)| lr 2.17e-03',
    'step    7/10 | loss 5.339850 (+nanz)| norm 1.0671 (+nanz)| lr 1.65e-03',
    'step    8/10 | loss 5.351943 (+nanz)| norm 1.0494 (+nanz)| lr 1.13e-03',
    'step    9/10 | loss 5.294708 (+nanz)| norm 1.0804 (+nanz)| lr 6.95e-04',
    'step   10/10 | loss 5.299899 (+nanz)| norm 1.1648 (+nanz)| lr 4.03e-04',
]
EXPECTED_LOG = (
    's:0 tel:5.3635\n'
    's:0 trl:5.3425 lr:0.001500 norm:1.62\n'
    's:1 trl:5.3815 lr:0.003000 norm:1.51\n'
    's:2 trl:5.2856 lr:0.003000 norm:1.52\n'
    's:3 trl:5.3339 lr:0.002897 norm:1.34\n'
    's:4 trl:5.3425 lr:0.002605 norm:1.35\n'
    's:5 tel:5.4003\n'
    's:5 trl:5.3080 lr:0.002167 norm:1.13\n'
    's:6 trl:5.3398 lr:0.001650 norm:1.07\n'
    's:7 trl:5.3519 lr:0.001133 norm:1.05\n'
    's:8 trl:5.2947 lr:0.000695 norm:1.08\n'
    's:9 trl:5.2999 lr:0.000403 norm:1.16\n'
    's:10 tel:5.4207\n'
)
NUMBER = re.compile(r"(trl|tel|loss|norm|lr)[: ]([0-9.e+-]+)")


def exactly_rounded(blas_function):
    """blas_function (np.matmul or np.dot), exactly rounded: float32 products and their sums in long
    double, then one rounding to float32. The sums run in NumPy's own loop (not the BLAS), in a
    fixed order, so the result is the same on every machine."""
    def exact(a, b, out=None):
        result = blas_function(np.asarray(a, np.longdouble), np.asarray(b, np.longdouble))
        if out is None:
            return np.asarray(result).astype(np.result_type(a, b))[()]
        np.copyto(out, result, casting="unsafe")
        return out
    return exact


# the BLAS calls of a step
EXACT_GEMMS = {"matmul": exactly_rounded(np.matmul), "dot": exactly_rounded(np.dot)}


def probe():
    """The float32 functions a step uses besides GEMMs, on fixed inputs: {name: result}. Equal bits
    here and on the recording machine mean the exact-GEMM run must reproduce the record."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 96), dtype=np.float32) * np.float32(3)
    y = rng.standard_normal((64, 96), dtype=np.float32)
    return {"tanh": np.tanh(x), "exp": np.exp(-np.abs(x)), "log": np.log(np.abs(x) + np.float32(1)),
            "sum": x.sum(axis=-1), "sum0": x.sum(axis=0), "mean": x.mean(axis=-1),
            "rowdot": np.einsum("nc,nc->n", x, y), "coldot": np.einsum("nc,nc->c", x, y),
            "sqrt": np.sqrt(np.abs(x))}


def make_inputs(folder):
    rng = np.random.default_rng(2024)
    params = np.zeros(sum(int(np.prod(s)) for s in param_shapes(SMALL).values()), np.float32)
    for name, view in views(params, param_shapes(SMALL)).items():
        if name in ("ln1w", "ln2w", "lnfw"):
            view[...] = 1.0
        elif not name.endswith("b"):
            view[...] = rng.standard_normal(view.shape).astype(np.float32) * np.float32(0.05)
    views(params, param_shapes(SMALL))["wte"][SMALL.vocab_size:] = 0.0
    save_model(folder / "small.bin", SMALL, params)
    stream = rng.integers(0, SMALL.vocab_size, 6000).astype(np.uint16)
    write_shard(folder / "val.bin", stream[:1000])
    write_shard(folder / "train.bin", stream[1000:])


def run_golden(folder, cpu_math="exact"):
    """Train the golden run in `folder` with train.py: (step lines without their timings, main.log,
    {"params", "m", "v"} at the end). Raises on a failed run."""
    make_inputs(folder)
    out_dir = folder / "out"
    argv = ["-e", folder / "small.bin", "-i", folder / "train.bin", "-j", folder / "val.bin",
            "-b", 2, "-t", 16, "-d", 64, "-x", 10, "-l", 3e-3, "-u", 2, "-q", 0.1, "-k", "cosine",
            "-c", 0.1, "--grad-clip", 0.5, "-v", 5, "-m", 2, "-s", 0, "-n", 10, "-o", out_dir,
            # the recorded run read its shard in file order (llm.c's shuffle: test_data)
            "--device", "cpu", "--shuffle", 0,
            "--seed", 7, "--cpu-math", cpu_math]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = train.main([str(a) for a in argv])
    assert code == 0, printed.getvalue()
    step_lines = [re.sub(r" \| [0-9.]+ ms \|.*$", "", line)
                  for line in printed.getvalue().splitlines()
                  if line.startswith("step ")]
    _, params = load_model(model_path(out_dir, 10))
    _, m, v = load_state(state_path(out_dir, 10))
    return step_lines, (out_dir / "main.log").read_text(), {"params": params, "m": m, "v": v}


def ulps_off(got, want):
    """{name: the largest distance of got[name] from want[name], in float32 ulps of
    the recorded value}."""
    return {name: float(np.max(np.abs(got[name].astype(np.float64) - want[name].astype(np.float64))
                               / np.spacing(np.abs(want[name].astype(np.float32))).astype(
                                   np.float64)))
            for name in ("params", "m", "v")}


def record():
    """The stored record: the final parameters and moments of the exact-GEMM run, and the
    probe, of this machine."""
    with np.load(RECORD) as saved:
        return {name: saved[name] for name in saved.files}


def probe_differs():
    """None where this machine's probe is the record's bit for bit, else the names of the
    functions that differ."""
    want = record()
    differ = [name for name, got in probe().items()
              if not np.array_equal(got, want["probe_" + name])]
    return ", ".join(differ) or None


def assert_numbers_close(got_lines, want_lines, rel, slacks):
    """Each number of got_lines within rel (relative) plus its key's slack of want_lines' number."""
    assert len(got_lines) == len(want_lines)
    for got_line, want_line in zip(got_lines, want_lines):
        got, want = NUMBER.findall(got_line), NUMBER.findall(want_line)
        assert [k for k, _ in got] == [k for k, _ in want], (got_line, want_line)
        for (key, g), (_, w) in zip(got, want):
            assert (abs(float(g) - float(w))
                    <= rel * abs(float(w)) + slacks.get(key, 0.0)), (got_line, want_line)


def use_exact_gemms(patch):
    for name, exact in EXACT_GEMMS.items():
        patch.setattr(np, name, exact)


@pytest.fixture
def exact_gemms(monkeypatch):
    use_exact_gemms(monkeypatch)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The golden run with exact GEMMs, once for the module."""
    with pytest.MonkeyPatch.context() as patch:
        use_exact_gemms(patch)
        return run_golden(tmp_path_factory.mktemp("golden"))


def needs_recording_machine_math():
    differ = probe_differs()
    if differ:
        pytest.skip(f"NumPy's float32 {differ} differ here from the recording machine's in the "
                    "last bit, so the exact-GEMM run cannot reproduce the record's final weights; "
                    "the losses are still compared")


def test_ten_step_run_prints_the_recorded_losses(golden):
    """The step lines and main.log as recorded (any machine: within the last printed digit)."""
    step_lines, log, _ = golden
    assert len(step_lines) == 10
    assert_numbers_close(step_lines, EXPECTED_STEP_LINES, 1e-6,
                         {"loss": 1e-6, "norm": 1e-4, "lr": 0})
    assert_numbers_close(log.splitlines(), EXPECTED_LOG.splitlines(), 1e-6,
                         {"trl": 1e-4, "tel": 1e-4, "norm": 1e-2, "lr": 1e-6})


def test_ten_step_run_ends_at_the_recorded_weights(golden):
    """The final parameters and AdamW moments within ULPS of the record (where this machine's NumPy
    math is the recording machine's: see the module docstring)."""
    needs_recording_machine_math()
    off = ulps_off(golden[2], record())
    assert all(v <= ULPS for v in off.values()), f"ulps from the record: {off}"


def test_a_one_ulp_update_change_fails(tmp_path, exact_gemms, monkeypatch):
    """A planted change: every parameter one ulp up after each AdamW update. The
    comparison fails."""
    needs_recording_machine_math()
    update = GPT2.update

    def update_one_ulp_up(self, *args, **kwargs):
        norm = update(self, *args, **kwargs)
        np.copyto(self.params, np.nextafter(self.params, np.float32(np.inf)))
        return norm

    monkeypatch.setattr(GPT2, "update", update_one_ulp_up)
    off = ulps_off(run_golden(tmp_path)[2], record())
    assert min(off.values()) > 100 * ULPS, off


def test_a_swapped_op_order_fails(tmp_path, exact_gemms, monkeypatch):
    """A planted change: the reference LayerNorm's scale as (x - mean) * (rstd * weight), the same
    math in another order (the exact path runs the reference). The comparison fails."""
    needs_recording_machine_math()

    def layernorm_forward(out, mean, rstd, inp, weight, bias):
        C = inp.shape[-1]
        x, o, mu, rs = inp.reshape(-1, C), out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1)
        np.mean(x, axis=-1, out=mu)
        np.subtract(x, mu[:, None], out=o)
        np.divide(1.0, np.sqrt(np.einsum("nc,nc->n", o, o) / C + 1e-5), out=rs, casting="unsafe")
        o *= rs[:, None] * weight
        o += bias

    monkeypatch.setattr(layernorm, "layernorm_forward", layernorm_forward)
    off = ulps_off(run_golden(tmp_path)[2], record())
    assert min(off.values()) > 100 * ULPS, off


def test_ten_step_run_with_fast_cpu_math_tracks_the_recorded_run(tmp_path):
    """--cpu-math fast (the default; not bitwise), with the machine's own BLAS, follows the recorded
    exact run: every train and val loss within 2e-6 relative, every grad norm within the printed 4
    decimals' rounding plus 2e-6."""
    step_lines, log, final = run_golden(tmp_path, cpu_math="fast")
    assert not np.array_equal(final["params"], record()["params"])     # the fast path did run
    assert_numbers_close(step_lines, EXPECTED_STEP_LINES, 2e-6, {"norm": 1e-4, "lr": 0})
    assert_numbers_close(log.splitlines(), EXPECTED_LOG.splitlines(), 2e-6,
                         {"norm": 1e-2, "trl": 1e-4, "tel": 1e-4, "lr": 1e-6})


def write_record(folder):
    """Run the golden run with exact GEMMs in `folder` and store its final state and the
    probe as the record."""
    with pytest.MonkeyPatch.context() as patch:
        use_exact_gemms(patch)
        step_lines, log, final = run_golden(folder)
    np.savez_compressed(RECORD, **final, **{"probe_" + k: v for k, v in probe().items()})
    print("\n".join(step_lines) + "\n" + log + f"written: {RECORD}")


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile
    with tempfile.TemporaryDirectory() as scratch:
        write_record(Path(scratch))
