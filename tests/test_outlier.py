"""-sl / -sg, llm.c's outlier guard (gpt2np.outlier): the window's statistics against direct NumPy,
the limits against llm.c's z-score rule, the device kernel's comparisons against the host's, a
skipped step that changes nothing (parameters and AdamW moments bitwise) with the next step normal,
a loss spike skipped with -sl and not without, the NumPy and the emulated CUDA trainer skipping the
same steps, resume keeping the window, every thread rank deciding alike, and -sl 0 leaving a run bit
for bit as without the guard. Tiny models."""
import hashlib
import math
import re

import numpy as np
import pytest
from fake_gpu import FakeNccl, Group, ThreadComm

import train
from gpt2np import outlier
from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.bf16 import BF16
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import write_shard
from gpt2np.dist import MpiProcessGroup, NcclCollectives
from gpt2np.formats.checkpoint import load_state, model_path, save_model, state_path
from gpt2np.model import GPT2, STEP_SCALARS
from gpt2np.outlier import NO_LIMITS, Limits, OutlierGuard, exceeded, value_limit, zscore
from gpt2np.tensors import param_shapes, views
from gpt2np.train_step import AdamW, train_step

F32 = np.float32
CFG = GPT2Config(max_seq_len=16, vocab_size=64, padded_vocab_size=64, num_layers=1, num_heads=2,
                 channels=16)
B, T = 2, 16
# the 0-based step whose batch holds tokens the model never saw: its loss jumps
SPIKE = 130
# steps whose batch has this fraction of such tokens
SMALLER_SPIKES = {133: 0.5, 136: 0.25, 139: 0.125}


def emu(dtype=None):
    be = CudaBackend(EmuRuntime(), dtype=dtype) if dtype is not None else CudaBackend(EmuRuntime())
    be.elementwise_threads = 64
    return be


# ---- the window ----------------------------------------------------------------------------------
def llmc_z(window):
    """llm.c's update_detector's z-score of window[-1] over the whole window (running sums,
    population variance)."""
    window = np.asarray(window, np.float64)
    mean = window.sum() / window.size
    std = math.sqrt((window * window).sum() / window.size - mean * mean)
    return 0.0 if std == 0 else (window[-1] - mean) / std


def test_zscore_and_limits_against_numpy():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(3, 200))
        others = rng.standard_normal(n - 1) * rng.uniform(0.01, 3) + rng.uniform(-5, 5)
        value = float(rng.standard_normal() * 4)
        window = np.append(others, value)
        # NumPy's std: the population one
        direct = (value - window.mean()) / window.std()
        assert zscore(others, value) == pytest.approx(direct, rel=1e-9, abs=1e-12)
        assert zscore(others, value) == pytest.approx(llmc_z(window), rel=1e-6, abs=1e-9)
        z = float(rng.uniform(0.5, 4))
        limit = value_limit(others, z)
        # no z-score gets there: never skipped
        if z * z >= n - 1:
            assert limit == math.inf and zscore(others, 1e30) < z
            continue
        # a float32, as the kernel reads it
        assert limit == float(F32(limit))
        # the limit is the exact threshold rounded up to float32: the float32 below it is not above
        # Z, the limit itself is (to rounding), and whatever is above it (what skips) is
        below = float(np.nextafter(F32(limit), F32(-np.inf)))
        assert zscore(others, below) <= z + 1e-12 and zscore(others, limit) >= z - 1e-12
        assert zscore(others, float(np.nextafter(F32(limit), F32(np.inf)))) > z
        for v in rng.uniform(others.min() - 1, limit + 2 * abs(limit - others.mean()), 20):
            # the limit decides as llm.c's z > Z does
            if abs(zscore(others, v) - z) > 1e-6:
                assert (v > limit) == (zscore(others, v) > z)
    # std 0: equal is z 0, anything above skips
    flat = np.full(127, 2.5)
    assert value_limit(flat, 3.0) == 2.5 and zscore(flat, 2.5) == 0.0
    assert value_limit(flat, 0.0) == math.inf                        # 0 = off


def test_guard_window_is_one_step_late():
    """limits(s) come from the WINDOW - 1 finite values of steps <= s - 2 (the rest of the window is
    step s); none until there are that many; non-finite steps stay out; the state round-trips."""
    rng = np.random.default_rng(2)
    losses, norms = rng.uniform(2, 3, 300), rng.uniform(0.5, 1.5, 300)
    losses[[40, 41]] = [math.nan, math.inf]
    guard = OutlierGuard(3.0, 2.0)
    assert guard.window == outlier.WINDOW == 128 and outlier.LAG == 2
    finite = []
    for s in range(300):
        known = [i for i in finite if i <= s - 2][-127:]
        limits = guard.limits(s)
        if len(known) < 127:
            assert limits == NO_LIMITS and math.isnan(guard.zscores(s, 1.0, 1.0)[0])
        else:
            assert limits == Limits(value_limit(losses[known], 3.0), value_limit(norms[known], 2.0))
            assert guard.zscores(s, 2.9, 1.2) == (zscore(losses[known], 2.9),
                                                  zscore(norms[known], 1.2))
        guard.observe(s, losses[s], norms[s])
        if math.isfinite(losses[s]):
            finite.append(s)
    first = OutlierGuard(3.0)
    for s in range(127):
        first.observe(s, 1.0 + s % 3, 1.0)
    # step 128 first, as in llm.c
    assert first.limits(127) == NO_LIMITS and first.limits(128) != NO_LIMITS
    copy = OutlierGuard(3.0, 2.0)
    copy.load_state(guard.state())
    assert copy.limits(300) == guard.limits(300) and copy.state() == guard.state()
    assert OutlierGuard(0.0, 0.0).limits(500) == NO_LIMITS and not OutlierGuard().active
    with pytest.raises(ValueError):
        guard.observe(10, 1.0, 1.0)                                  # out of order


# ---- the device kernel decides as the host -------------------------------------------------------
@pytest.mark.parametrize("which", ["numpy", "emu", "emu-bf16"])
def test_adamw_update_device_compares_as_the_host(which):
    """A loss or norm equal to its limit updates, one float32 above it skips (params, m, v, master
    untouched), in the NumPy reference, the fp32 kernel and the bf16 kernel: the comparisons of
    outlier.exceeded."""
    be = NumpyBackend(threads=1) if which == "numpy" else emu(BF16 if which == "emu-bf16" else None)
    rng = np.random.default_rng(3)
    n, loss, norm_squared = 300, F32(2.75), F32(6.5)
    # the double the host reads back and the kernel computes
    norm = math.sqrt(float(norm_squared))
    norm_limit_at = float(F32(norm))
    norm_below = (float(np.nextafter(F32(norm), F32(0))) if float(F32(norm)) >= norm
                  else float(F32(norm)))
    norm_at = (norm_limit_at if norm_limit_at >= norm
               else float(np.nextafter(F32(norm), F32(np.inf))))
    cases = [(Limits(float(loss), norm_at), None),
             (Limits(float(np.nextafter(loss, F32(0))), math.inf), "loss"),
             (Limits(math.inf, norm_below), "norm"),
             (NO_LIMITS, None)]
    for limits, want in cases:
        assert exceeded(float(loss), norm, limits) == want
        master = rng.standard_normal(n).astype(F32)
        host = [master.astype(be.dtype) if which != "numpy" else master.copy(),
                rng.standard_normal(n).astype(F32).astype(be.dtype if which != "numpy" else F32),
                np.zeros(n, F32), np.zeros(n, F32)]
        arrays = [be.from_host(a) for a in host]
        extra = ({"master": be.from_host(master), "seed": 1, "offset": 0} if which == "emu-bf16"
                 else {})
        scalars = np.array([1e-2, 1.0, 1.0, 0.0, *limits], F32)
        scalars.view(np.uint32)[3] = 1
        before = [be.to_host(a).tobytes() for a in arrays + list(extra.values())[:1]]
        be.adamw_update_device(*arrays, be.from_host(scalars),
                               be.from_host(np.array([loss, norm_squared], F32)),
                               0.9, 0.95, 1e-8, True, 1.0, **extra)
        after = [be.to_host(a).tobytes() for a in arrays + list(extra.values())[:1]]
        changed = [a != b for a, b in zip(before, after)]
        assert changed == ([False] * len(before) if want
                           else [True, False, True, True] + [True] * bool(extra))


def test_step_scalars_carry_the_limits():
    model = GPT2(CFG, emu(), B, T)
    model.stage_batch(0, np.zeros((B, T), np.int32), np.zeros((B, T), np.int32))
    assert STEP_SCALARS == 6
    model.set_step_scalars(1e-3, 0.9, 0.95, 0.1, 5)
    assert np.all(np.isinf(model.backend.to_host(model.step_scalars)[4:]))
    model.set_step_scalars(1e-3, 0.9, 0.95, 0.1, 5, Limits(3.25, 1.5))
    got = model.backend.to_host(model.step_scalars)
    assert got[4] == F32(3.25) and got[5] == F32(1.5) and int(got.view(np.uint32)[3]) == 5


# ---- a skipped step changes nothing --------------------------------------------------------------
def make_params(seed=2024):
    """Initial parameters from a fixed NumPy seed (not gpt2np's init, so that is
    not pinned here)."""
    rng = np.random.default_rng(seed)
    shapes = param_shapes(CFG)
    params = np.zeros(sum(int(np.prod(s)) for s in shapes.values()), F32)
    for name, view in views(params, shapes).items():
        if name in ("ln1w", "ln2w", "lnfw"):
            view[...] = 1.0
        elif not name.endswith("b"):
            view[...] = rng.standard_normal(view.shape).astype(F32) * F32(0.05)
    return params


def token_stream(steps, spike=SPIKE, seed=0, fractions=None):
    """A learnable stream (phrases over tokens 0..31) for `steps` steps of B x T; the batch of step
    `spike` holds tokens 32..63 only, which the model never sees otherwise. fractions: {step: f},
    spikes of the first f of their batch's tokens."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 32, size=rng.integers(3, 7)) for _ in range(8)]
    stream = np.concatenate([phrases[i]
                             for i in rng.integers(0, len(phrases), steps * B * T // 3 + 100)])
    stream = stream[:steps * B * T + 1].copy()
    spikes = dict(fractions or {})
    if spike is not None:
        spikes[spike] = 1.0
    for step, fraction in spikes.items():
        if step < steps:
            n = int(round(fraction * B * T)) + 1
            stream[step * B * T:step * B * T + n] = rng.integers(32, 64, n)
    return stream


def state_of(model):
    be = model.backend
    return [be.to_host(a).tobytes() for a in (model.params, model.m, model.v)]


@pytest.mark.parametrize("device", ["numpy", "emu"])
def test_a_skipped_step_changes_nothing_and_the_next_is_normal(device):
    """Step 2 skipped as an outlier: params and AdamW's m, v bitwise as after step 1; step 3 (AdamW
    t = 4: the count goes on, as llm.c's) gives bitwise what a model that never ran step 2 gives.
    The emulated device step runs as CUDA graphs (captured at step 1, replayed from step 2: the
    limits travel in step_scalars)."""
    stream = token_stream(4, spike=None)
    batches = [(stream[i * B * T:(i + 1) * B * T].reshape(B, T).astype(np.int32),
                stream[i * B * T + 1:(i + 1) * B * T + 1].reshape(B, T).astype(np.int32))
               for i in range(4)]
    models = []
    for skip in (True, False):
        be = NumpyBackend(threads=1) if device == "numpy" else emu()
        model = GPT2(CFG, be, B, T)
        model.load_params(make_params())
        for step, batch in enumerate(batches):
            if step == 2 and not skip:
                # the other model: step 2 never happened
                continue
            limits = Limits(loss=0.0) if step == 2 else None   # every loss is above 0: skipped
            before = state_of(model) if step == 2 else None
            result = train_step(model, lambda b=batch: b, step=step, lr=1e-2,
                                adamw=AdamW(weight_decay=0.1), cuda_graphs=True, limits=limits)
            loss, norm = result                               # (waits for the device step)
            if step == 2:
                assert exceeded(loss, norm, limits) == "loss" and math.isfinite(norm)
                assert state_of(model) == before
        models.append(model)
    assert state_of(models[0]) == state_of(models[1])


# ---- train.py ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outlier")
    save_model(folder / "tiny.bin", CFG, make_params())
    write_shard(folder / "train.bin", token_stream(SPIKE + 8).astype(np.uint16))
    write_shard(folder / "nospike.bin", token_stream(40, spike=None).astype(np.uint16))
    write_shard(folder / "spikes.bin",
                token_stream(SPIKE + 16, fractions=SMALLER_SPIKES).astype(np.uint16))
    return folder


def run(files, capsys, *flags, steps=SPIKE + 4, device="cpu", data="train.bin"):
    argv = ["-e", files / "tiny.bin", "-i", files / data, "-b", B, "-t", T, "-x", steps, "-v", 0,
            # the spikes at their steps
            "-s", 0, "-l", 1e-2, "--device", device, "--shuffle", 0, *flags]
    code = train.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


STEP = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) .*$", re.M)


def skipped_steps(out):
    """{0-based step: what for} of the step lines that say skipped."""
    return {int(m.group(1)) - 1: re.search(r"skipped: (\w+) z-score", m.group(0)).group(1)
            for m in STEP.finditer(out) if "skipped:" in m.group(0)}


def read(path):
    with open(path, "rb") as f:
        return f.read()


def step_losses(out):
    return [float(m.group(2)) for m in STEP.finditer(out)]


def test_a_loss_spike_is_skipped_with_sl_and_not_without(files, tmp_path, capsys):
    guarded = run(files, capsys, "-sl", 3, "-o", tmp_path / "sl")
    assert skipped_steps(guarded) == {SPIKE: "loss"}
    z = float(re.search(r"^skipping update due to loss z-score of ([0-9.]+)$", guarded,
                        re.M).group(1))
    assert z > 3
    assert f"| skipped: loss z-score {z:.2f} > -sl 3 (1 outliers skipped)" in guarded
    assert "updates skipped as outliers (-sl 3 -sg 0): 1" in guarded
    assert re.search(r"\| skip update lossz +\| 3\.000000 ", guarded)
    plain = run(files, capsys, "-o", tmp_path / "plain")
    assert not skipped_steps(plain) and "skipping update" not in plain and "outliers" not in plain
    # every step line has llm.c's z-scores, -sl or not: nan while the window fills (steps 0-127),
    # then the loss's over the 127 values of steps s - 127 .. s - 1 and its own, as llm.c's
    # detector; the skip decision's (the skip lines') over steps s - 128 .. s - 2 (one step
    # late, gpt2np.outlier)
    zs = [m.groups() for m in re.finditer(r"^step +\d+/\d+ \| loss [0-9.]+ \((\S+)z\)\| norm "
                                          r"[0-9.]+ \((\S+)z\)\|",
                                          plain, re.M)]
    assert len(zs) == SPIKE + 4 and all(z == ("+nan", "+nan") for z in zs[:128])
    b = step_losses(plain)
    llmc_window = np.array(b[SPIKE - 127:SPIKE] + [b[SPIKE]])
    assert abs(float(zs[SPIKE][0]) - (b[SPIKE] - llmc_window.mean()) / llmc_window.std()) < 0.01
    lagged = np.array(b[SPIKE - 128:SPIKE - 1] + [b[SPIKE]])
    # the skip line's z: the decision's
    assert abs(z - (b[SPIKE] - lagged.mean()) / lagged.std()) < 1e-4
    assert all(abs(float(x)) < 11.3 for z_ in zs[128:] for x in z_)
    a, b = step_losses(guarded), step_losses(plain)
    # the same until the spike's update
    assert a[:SPIKE + 1] == b[:SPIKE + 1] and a[SPIKE + 1] != b[SPIKE + 1]
    assert a[SPIKE] > max(a[SPIKE - 127:SPIKE]) + 1
    log = (tmp_path / "sl" / "main.log").read_text()
    # llm.c logs a skipped step's loss too
    assert f"s:{SPIKE} trl:{a[SPIKE]:.4f} " in log
    assert sum(" trl:" in line for line in log.splitlines()) == SPIKE + 4


def test_sl_and_sg_on_the_command_line(files, capsys):
    """train.py -sl 3 -sg 3 on a run shorter than the window: it trains, says so in the
    header and at the end."""
    out = run(files, capsys, "-sl", 3, "-sg", 3, steps=5)
    assert re.search(r"\| skip update gradz +\| 3\.000000 ", out) and len(step_losses(out)) == 5
    assert "updates skipped as outliers (-sl 3 -sg 3): 0" in out
    assert train.main(["-sl", "-1"]) == 2
    assert "error: -sl -1" in capsys.readouterr().err


@pytest.mark.parametrize("flags, skipped", [(("-sl", 3, "-sg", 3), {130: "loss", 133: "loss"}),
                                            (("-sg", 1.5),
                                             {130: "norm", 133: "norm", 136: "norm"})])
def test_numpy_and_emulated_cuda_skip_the_same_steps(files, capsys, flags, skipped):
    """Spikes of decreasing size (SMALLER_SPIKES after SPIKE; z-scores from about 8 to 1) on the
    NumPy step (the host decides) and on the emulated CUDA step (the AdamW kernel decides, with CUDA
    graphs): the same steps skipped for the same reason, the smaller spikes kept alike."""
    cpu, gpu = (run(files, capsys, *flags, device=d, data="spikes.bin", steps=SPIKE + 12)
                for d in ("cpu", "emu"))
    assert skipped_steps(cpu) == skipped_steps(gpu) == skipped
    np.testing.assert_allclose(step_losses(cpu), step_losses(gpu), rtol=1e-4)


def test_resume_keeps_the_window(files, tmp_path, capsys):
    """A run stopped at step SPIKE - 1 and resumed skips the spike as the whole run does (the window
    is in the checkpoint), with the same files at the end."""
    flags = ("-sl", 3, "-n", SPIKE - 1)
    full = run(files, capsys, *flags, "-o", tmp_path / "full", steps=SPIKE + 2)
    (tmp_path / "resumed").mkdir()
    for name in (f"model_{SPIKE - 1:08d}.bin", f"state_{SPIKE - 1:08d}_00000.bin",
                 f"DONE_{SPIKE - 1:08d}", "run.json", "main.log"):
        (tmp_path / "resumed" / name).write_bytes((tmp_path / "full" / name).read_bytes())
    resumed = run(files, capsys, *flags, "-o", tmp_path / "resumed", "-y", 1, steps=SPIKE + 2)
    assert skipped_steps(full) == skipped_steps(resumed) == {SPIKE: "loss"}
    info, _, _ = load_state(state_path(tmp_path / "full", SPIKE - 1))
    assert len(info["outliers"]["window"]) == 128 and info["outliers"]["skipped"] == 0
    end = SPIKE + 2
    assert read(model_path(tmp_path / "full", end)) == read(model_path(tmp_path / "resumed", end))
    assert load_state(state_path(tmp_path / "full", end))[0]["outliers"]["skipped"] == 1


@pytest.mark.parametrize("device", ["cpu", "emu"])
def test_sl_0_changes_nothing(files, tmp_path, capsys, device):
    """-sl 0 -sg 0 (the default) is the run without the guard, bit for bit; so is a guard that
    cannot fire (-sl 12: z-scores over 128 values stay below sqrt(127) < 12), which does track the
    window and hands its limits to every step (the CUDA step compares them in its AdamW kernel).
    Three runs on this machine, compared with each other."""
    hashes = []
    exact = ("--cpu-math", "exact") if device == "cpu" else ()
    for flags in ((), ("-sl", 0, "-sg", 0), ("-sl", 12, "-sg", 12)):
        out_dir = tmp_path / f"run{len(hashes)}"
        out = run(files, capsys, *flags, *exact, "-o", out_dir, "-n", 40, steps=40, device=device,
                  data="nospike.bin")
        assert not skipped_steps(out)
        hashes.append(hashlib.sha256(read(model_path(out_dir, 40))).hexdigest())
    assert hashes[0] == hashes[1] == hashes[2]


# ---- every rank decides alike --------------------------------------------------------------------
@pytest.mark.parametrize("zero", [0, 1])
def test_thread_ranks_skip_the_same_steps(zero, monkeypatch):
    """2 thread ranks on the emulator (fake NCCL), each its half of every batch, the spike in rank
    0's half only: the averaged loss and global norm are the same on both, so both guards skip the
    same steps, and the ranks keep the same model. The guard is driven as the trainer drives it:
    limits before a step, the previous step's values read back after the next was launched. A
    32-value window keeps it short."""
    monkeypatch.setattr(outlier, "WINDOW", 32)
    steps, spike = 38, 35
    stream = token_stream(steps, spike=None)
    spiked = token_stream(steps, spike=spike)
    group = Group(2)
    nccl = FakeNccl()

    def rank_main(rank):
        comm = ThreadComm(group, rank)
        dist = MpiProcessGroup(comm, zero_stage=zero, timeout=0,
                               collectives=lambda backend, buf: NcclCollectives(
            comm, backend.rt, nccl=nccl, stream_ptr=lambda: 0))
        model = GPT2(CFG, emu(), 1, T)
        model.load_params(make_params())
        data = spiked if rank == 0 else stream
        guard, pending, skips = OutlierGuard(3.0, 3.0), None, []

        def report(entry):
            step, limits, result = entry
            loss, norm = result
            if exceeded(loss, norm, limits):
                skips.append(step)
            guard.observe(step, loss, norm)

        for step in range(steps):
            # rank r's row of the step's B x T batch (B = 2 ranks)
            lo = step * B * T + rank * T
            batch = (data[lo:lo + T].reshape(1, T).astype(np.int32),
                     data[lo + 1:lo + T + 1].reshape(1, T).astype(np.int32))
            limits = guard.limits(step)
            result = train_step(model, lambda b=batch: b, step=step, lr=1e-2, dist=dist,
                                limits=limits)
            if pending:
                report(pending)
            pending = (step, limits, result)
        report(pending)
        return skips, model.params_host()

    (skips0, params0), (skips1, params1) = group.run(rank_main)
    assert skips0 == skips1 and spike in skips0
    np.testing.assert_array_equal(params0, params1)


def test_the_step_lines_z_is_llmcs_detector():
    """zscores(lag=1), the step line's, equals llm.c's OutlierDetector (a 128-slot ring buffer of
    running sums: NaN for its first 128 values, then the new value against the buffer holding it),
    modelled here from its description, on a random sequence; lag 2 (the decision's) scores from
    the same first step."""
    rng = np.random.default_rng(5)
    values = rng.normal(3.0, 0.5, 300)
    values[200] += 6.0
    buffer, count, index, total, total_sq = [0.0] * 128, 0, 0, 0.0, 0.0
    guard = OutlierGuard()
    for s, v in enumerate(values):
        if count < 128:
            buffer[count], count = v, count + 1
            total, total_sq, expected = total + v, total_sq + v * v, math.nan
        else:
            old, buffer[index], index = buffer[index], v, (index + 1) % 128
            total, total_sq = total - old + v, total_sq - old * old + v * v
            mean = total / 128
            sd = math.sqrt(total_sq / 128 - mean * mean)
            expected = 0.0 if sd == 0 else (v - mean) / sd
        got = guard.zscores(s, v, v, lag=1)[0]
        assert (math.isnan(got) and math.isnan(expected)) or abs(got - expected) < 1e-9, (s, got,
                                                                                          expected)
        assert math.isnan(guard.zscores(s, v, v)[0]) == math.isnan(expected)
        guard.observe(s, v, v)
