"""train.py end to end on a tiny model: loss falls, resume is bit-identical, bad input
gives one error line."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import read_shard, write_shard
from gpt2np.formats.checkpoint import load_model, load_state, model_path, save_model, state_path
from gpt2np.model import GPT2
from gpt2np.tensors import num_parameters

REPO = Path(__file__).resolve().parent.parent
TINY = GPT2Config(max_seq_len=64, vocab_size=50257, padded_vocab_size=50304, num_layers=2,
                  num_heads=2, channels=32)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.bin"
    model = GPT2(TINY, NumpyBackend(), 1, 8, seed=3)
    save_model(path, TINY, model.params_host())
    return path


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory):
    """Token shards of a repetitive synthetic 'language' the tiny model can learn fast."""
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 2000, size=rng.integers(3, 9)) for _ in range(40)]
    stream = np.concatenate([phrases[i]
                             for i in rng.integers(0, len(phrases), 4000)]).astype(np.uint16)
    write_shard(folder / "syn_val.bin", stream[:3000])
    write_shard(folder / "syn_train.bin", stream[3000:])
    return folder


def run(argv, capsys):
    code = train.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def losses(text):
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+)", text)]


def base_args(tiny_model, tiny_shards):
    return ["-e", tiny_model, "-i", tiny_shards / "syn_train.bin", "-j",
            tiny_shards / "syn_val.bin", "-b", 4, "-t", 32, "--device", "cpu", "-s", 0]


def test_loss_falls_and_log_written(tiny_model, tiny_shards, tmp_path, capsys):
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 30, "-l", 3e-3, "-v", 10, "-m",
                                                               2, "-o", tmp_path], capsys)
    assert code == 0, err
    steps = losses(out)
    assert len(steps) == 30
    assert np.mean(steps[-5:]) < np.mean(steps[:5]) - 1.0
    log = (tmp_path / "main.log").read_text().splitlines()
    assert sum(1 for line in log if " trl:" in line) == 30
    vals = [float(line.split("tel:")[1]) for line in log if "tel:" in line]
    assert len(vals) == 4 and vals[-1] < vals[0]          # steps 0, 10, 20, 30
    assert "num_parameters" in out and "tok/s" in out
    # llm.c's tok/s column: the first step's own rate, then a bias-corrected EMA
    # (0.95) of the steps' rates
    lines = re.findall(r"\| ([0-9.]+) ms \| [^|]+ \| ([0-9]+) tok/s", out)
    assert len(lines) == 30
    ema = 0.0
    for k, (ms, shown) in enumerate(lines):
        rate = 4 * 32 / (float(ms) / 1e3)
        ema = 0.95 * ema + 0.05 * rate if k else 0.0
        expected = ema / (1 - 0.95 ** k) if k else rate
        assert abs(int(shown) - expected) <= 0.01 * expected + 1, (k, ms, shown, expected)


def test_resume_is_bit_identical(tiny_model, tiny_shards, tmp_path, capsys):
    args = base_args(tiny_model, tiny_shards) + ["-x", 6, "-n", 3, "-l", 1e-3, "-q", 0.1, "-u", 2,
                                                 "-v", 3, "-m", 1, "-s", 3, "-g", 4, "--shuffle", 1,
                                                 "-c", 0.1]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    code, out_full, err = run(args + ["-o", full], capsys)
    assert code == 0, err
    resumed.mkdir()
    for name in ("model_00000003.bin", "state_00000003_00000.bin", "DONE_00000003"):
        shutil.copy(full / name, resumed / name)
    code, out_resumed, err = run(args + ["-o", resumed, "-y", 1], capsys)
    assert code == 0, err
    assert "resuming from step 3" in out_resumed
    assert losses(out_resumed) == losses(out_full)[3:]
    assert ((full / "model_00000006.bin").read_bytes()
            == (resumed / "model_00000006.bin").read_bytes())
    info_a, m_a, v_a = load_state(state_path(full, 6))
    info_b, m_b, v_b = load_state(state_path(resumed, 6))
    assert info_a == info_b
    np.testing.assert_array_equal(m_a, m_b)
    np.testing.assert_array_equal(v_a, v_b)
    # the samples after the resume point are the same text too
    assert (out_full.split("step    6/6")[1].split("---")[1]
            == out_resumed.split("step    6/6")[1].split("---")[1])


def test_gradient_accumulation_equals_big_batch(tiny_model, tiny_shards, tmp_path, capsys):
    common = ["-e", tiny_model, "-i", tiny_shards / "syn_train.bin", "-t", 32, "--device", "cpu",
              # shuffled samples are B*T wide: file order
              "-s", 0, "-v", 0, "-x", 2, "-n", 2, "--shuffle", 0]
    code, _, err = run(common + ["-b", 4, "-o", tmp_path / "big"], capsys)
    assert code == 0, err
    code, out, err = run(common + ["-b", 2, "-d", 128, "-o", tmp_path / "accum"], capsys)
    assert code == 0, err
    assert "=> setting grad_accum_steps=2" in out
    _, big = load_model(model_path(tmp_path / "big", 2))
    _, acc = load_model(model_path(tmp_path / "accum", 2))
    np.testing.assert_allclose(acc, big, atol=2e-6)


@pytest.mark.parametrize("problem", ["missing", "magic", "truncated", "token_range",
                                     "bad_total_batch", "cuda_channels"])
def test_bad_input_is_one_clear_line(problem, tiny_model, tiny_shards, tmp_path, capsys):
    args = base_args(tiny_model, tiny_shards) + ["-x", 1, "-v", 0]
    bad = tmp_path / "bad.bin"
    if problem == "missing":
        args[1], expect = tmp_path / "nope.bin", "nope.bin"
    elif problem == "magic":
        data = bytearray(Path(tiny_model).read_bytes())
        data[:4] = (123).to_bytes(4, "little")
        bad.write_bytes(bytes(data))
        args[1], expect = bad, "bad magic"
    elif problem == "truncated":
        bad.write_bytes(Path(tiny_model).read_bytes()[:5000])
        args[1], expect = bad, "truncated"
    elif problem == "token_range":
        small = GPT2Config(64, 100, 128, 1, 2, 16)
        save_model(bad, small, GPT2(small, NumpyBackend(), 1, 4, seed=0).params_host())
        args[1], expect = bad, "syn_train.bin"
    elif problem == "cuda_channels":
        # the CUDA kernels' C % 4: said before the run, not at its first kernel
        odd = GPT2Config(64, 50257, 50304, 1, 2, 6)
        save_model(bad, odd, GPT2(odd, NumpyBackend(), 1, 4, seed=0).params_host())
        args[1], expect = bad, "channels 6 is not a multiple of 4"
        args += ["--device", "emu"]
    else:
        # flags that contradict each other: bad input, found before the run
        args += ["-d", 100]
        expect = "must be a multiple"
    code, out, err = run(args, capsys)
    # bad input, found before or during the run: exit 2 (a failed run: 1)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], err
    if problem == "cuda_channels":
        assert "training for" not in out


def test_readme_main_command_smoke(tmp_path):
    """The README's main command, shortened to one step: it runs offline with no model
    file or corpus flags."""
    readme = (REPO / "README.md").read_text()
    first = next(line for line in readme.splitlines()
                 if "train.py" in line and line.strip().startswith("pip"))
    command = first.split("&&")[-1].strip()
    assert command.startswith("python train.py")
    argv = command.split()[2:] + ["-x", "1", "-v", "1", "-m", "1", "-s", "1", "-g", "4", "-b", "1",
                                  "-t", "16"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "train.py", *argv], cwd=REPO, capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step    1/1" in res.stdout and "val loss" in res.stdout and "generating:" in res.stdout


def test_ctrl_c_while_train_py_imports_is_one_line(monkeypatch, capsys):
    """A Ctrl-C that lands while train.py is still importing gpt2np (before the run's own handling)
    is one line and exit 130, not a traceback."""
    import runpy
    import types

    class Interrupted(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "gpt2np.cli.train", Interrupted("gpt2np.cli.train"))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"


def loss_on_file_batches(model_path, shard, batch_indices, B=4, T=32):
    """Mean loss of the tiny model on the given (B, T) batches of a shard, read
    straight from the file."""
    tokens = np.fromfile(shard, dtype="<u2", offset=1024).astype(np.int32)
    model = GPT2(TINY, NumpyBackend(), B, T)
    model.load_params(load_model(model_path)[1])
    losses_ = [model.forward(tokens[k * B * T:(k + 1) * B * T].reshape(B, T),
                             tokens[k * B * T + 1:(k + 1) * B * T + 1].reshape(B, T))
               for k in batch_indices]
    return float(np.mean(losses_))


def test_overfit_single_batch_is_llmc(tiny_model, tiny_shards, capsys):
    """-a 1 as llm.c's: every step trains on the val data's first -d tokens (two micro-batches
    here), from the start again each step; not the train data, not one micro-batch repeated."""
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 3, "-a", 1, "-d", 256,
                                                               "-l", 1e-9, "-v", 0],
                         capsys)
    assert code == 0, err
    steps = losses(out)
    expected = loss_on_file_batches(tiny_model, tiny_shards / "syn_val.bin", [0, 1])
    assert len(steps) == 3 and all(loss == pytest.approx(expected, abs=2e-6)
                                   for loss in steps), (steps, expected)
    train_first = loss_on_file_batches(tiny_model, tiny_shards / "syn_train.bin", [0])
    # the check can tell the two data sets apart
    assert abs(train_first - expected) > 1e-3


def test_val_batches_past_the_end_wrap_around_as_llmc(tiny_model, tiny_shards, capsys):
    """-m more than the val data holds (23 batches of 4x32 in 3000 tokens) reads from its
    start again, as llm.c."""
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 0, "-m", 25], capsys)
    assert code == 0, err
    shown = float(re.search(r"val loss ([0-9.]+)", out)[1])
    assert shown == pytest.approx(loss_on_file_batches(tiny_model, tiny_shards / "syn_val.bin",
                                                       [*range(23), 0, 1]), abs=2e-6)


def test_resume_from_llmc_state_file(tiny_model, tiny_shards, tmp_path, capsys):
    """-y 1 from a state file as llm.c writes it (its layout, no gpt2np footer): the same weights
    and AdamW moments as the uninterrupted run, the shuffled data order taken from the file's
    permutations and mt19937 state."""
    args = base_args(tiny_model, tiny_shards) + ["-x", 6, "-n", 3, "-l", 1e-3, "-v", 0,
                                                 "--shuffle", 1]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    code, out_full, err = run(args + ["-o", full], capsys)
    assert code == 0, err
    resumed.mkdir()
    for name in ("model_00000003.bin", "DONE_00000003"):
        shutil.copy(full / name, resumed / name)
    raw = (full / "state_00000003_00000.bin").read_bytes()
    footer_len = int(np.frombuffer(raw[-16:-8], "<u8")[0])
    llmc = bytearray(raw[:len(raw) - 16 - footer_len])
    llmc[4 * 40:4 * 46] = bytes(24)                 # llm.c leaves these header ints 0
    (resumed / "state_00000003_00000.bin").write_bytes(bytes(llmc))
    code, out_resumed, err = run(args + ["-o", resumed, "-y", 1], capsys)
    assert code == 0, err
    assert "resuming from step 3" in out_resumed and "is llm.c's: the outlier window" in out_resumed
    assert losses(out_resumed) == losses(out_full)[3:]
    assert ((full / "model_00000006.bin").read_bytes()
            == (resumed / "model_00000006.bin").read_bytes())
    _, m_a, v_a = load_state(state_path(full, 6))
    _, m_b, v_b = load_state(state_path(resumed, 6))
    np.testing.assert_array_equal(m_a, m_b)
    np.testing.assert_array_equal(v_a, v_b)

    # such a file cut short, or with a damaged header, is an incomplete checkpoint, skipped for the
    # one before (its size is checked against the model's parameter count: the file
    # alone cannot say it)
    from gpt2np.train.rundir import latest_complete_checkpoint
    cut = tmp_path / "cut"
    cut.mkdir()
    for step in (3, 6):
        for name in (f"model_{step:08d}.bin", f"DONE_{step:08d}"):
            shutil.copy(full / name, cut / name)
        raw = (full / f"state_{step:08d}_00000.bin").read_bytes()
        llmc = bytearray(raw[:len(raw) - 16 - int(np.frombuffer(raw[-16:-8], "<u8")[0])])
        llmc[4 * 40:4 * 46] = bytes(24)
        (cut / f"state_{step:08d}_00000.bin").write_bytes(bytes(llmc[:-100] if step == 6 else llmc))
    step, notes = latest_complete_checkpoint(cut)
    assert step == 3 and len(notes) == 1 and "step 6" in notes[0] and "truncated" in notes[0], notes
    state6 = cut / "state_00000006_00000.bin"
    whole = bytearray((cut / "state_00000003_00000.bin").read_bytes())
    # the header's world_size damaged
    for world in (0, -1):
        whole[8:12] = np.array([world], "<i4").tobytes()
        state6.write_bytes(bytes(whole))
        step, notes = latest_complete_checkpoint(cut)
        assert step == 3 and "damaged" in notes[0], notes


def test_a_footer_less_unshuffled_llmc_state_cut_by_whole_parameters_is_skipped(
        tiny_model, tiny_shards, tmp_path, capsys):
    """An llm.c state in file order whose size is still a whole number of (m, v) pairs: its
    parameter count is checked against the model's, so a cut one is skipped for the checkpoint
    before, with a note."""
    from gpt2np.train.rundir import latest_complete_checkpoint
    out = tmp_path / "run"
    args = base_args(tiny_model, tiny_shards) + ["-x", 4, "-n", 2, "-v", 0, "--shuffle", 0,
                                                 "-o", out]
    assert run(args, capsys)[0] == 0
    for step in (2, 4):
        path = out / f"state_{step:08d}_00000.bin"
        raw = path.read_bytes()
        llmc = bytearray(raw[:len(raw) - 16 - int(np.frombuffer(raw[-16:-8], "<u8")[0])])
        llmc[4 * 40:4 * 46] = bytes(24)
        # one parameter's m and v fewer
        path.write_bytes(bytes(llmc[:-8] if step == 4 else llmc))
    step, notes = latest_complete_checkpoint(out)
    assert (step == 2 and len(notes) == 1 and "step 4" in notes[0]
            and "truncated or corrupt" in notes[0]), notes


def test_training_samples_are_llmcs(tiny_model):
    """A training sample as llm.c's: -g counts the EOT it starts from (genT - 1 new tokens), the
    coins restart from --seed (llm.c: 1337) every sample, each token is the first id whose
    cumulative probability exceeds its coin."""
    from gpt2np.config import TrainConfig
    from gpt2np.train.evaluate import sample_text
    model = GPT2(TINY, NumpyBackend(), 1, 32)
    model.load_params(load_model(tiny_model)[1])

    class Ids:
        eot_token = 50256
        decode = staticmethod(lambda ids: " ".join(map(str, ids)))

    cfg = TrainConfig(gen_tokens=9, seed=1337)
    first, again = sample_text(model, Ids, cfg), sample_text(model, Ids, cfg)
    ids = [int(t) for t in first.split("---")[1].split()]
    assert first == again and len(ids) == 8
    model.forward(np.full((1, 1), 50256, np.int32))
    logits = model.logits_host()[0, 0, :TINY.vocab_size].astype(np.float64)
    cdf = np.cumsum(np.exp(logits - logits.max()))
    s = 1337                                            # llm.c's random_f32, the first coin
    s ^= s >> 12
    s ^= (s << 25) & (2**64 - 1)
    s ^= s >> 27
    coin = ((((s * 0x2545F4914F6CDD1D) & (2**64 - 1)) >> 32) >> 8) / 16777216
    assert ids[0] == int(np.argmax(cdf / cdf[-1] > coin))


def test_resume_without_e_takes_the_runs_model(tiny_model, tiny_shards, tmp_path, capsys):
    """As llm.c's -y 1 (the weights from the checkpoint whatever -e says): without -e, -y 1 resumes
    the run in -o with its own model (run.json), bitwise the uninterrupted run; with no complete
    checkpoint it is one line."""
    common = ["-i", tiny_shards / "syn_train.bin", "-j", tiny_shards / "syn_val.bin", "-b", 4, "-t",
              32, "--device", "cpu", "-s", 0, "-v", 0, "-n", 2, "-l", 1e-3]
    full, part = tmp_path / "full", tmp_path / "part"
    assert run(["-e", tiny_model, *common, "-x", 4, "-o", full], capsys)[0] == 0
    assert run(["-e", tiny_model, *common, "-x", 2, "-o", part], capsys)[0] == 0
    code, out, err = run([*common, "-x", 4, "-o", part, "-y", 1], capsys)          # no -e
    assert code == 0, err
    assert "resuming from step 2" in out
    assert (full / "model_00000004.bin").read_bytes() == (part / "model_00000004.bin").read_bytes()
    empty = tmp_path / "empty"
    # run.json, no checkpoint
    assert run(["-e", tiny_model, *common, "-x", 1, "-n", 0, "-o", empty], capsys)[0] == 0
    code, out, err = run([*common, "-x", 4, "-o", empty, "-y", 1], capsys)
    assert code == 2 and "-y 1 without -e" in err and "no complete checkpoint" in err, err
    # a damaged model config
    run_file = part / "run.json"
    saved = json.loads(run_file.read_text())
    for damaged in ({**saved["model"]["config"], "channels": "768"}, {"layers": 2}, [1, 2],
                    {**saved["model"]["config"],
                     "num_layers": float(saved["model"]["config"]["num_layers"])}):
        run_file.write_text(json.dumps({**saved, "model": {**saved["model"], "config": damaged}}))
        code, out, err = run([*common, "-x", 4, "-o", part, "-y", 1], capsys)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{run_file}: its model config is not a GPT-2 config" in err, err


def test_a_descriptor_starts_from_llmcs_init_with_init_seed(tiny_model, tiny_shards, tmp_path,
                                                            capsys, monkeypatch):
    """-e d6: the weights are llm.c's random init (gpt2np.init) from --init-seed (default llm.c's
    42; --seed, the sampler's, leaves them alone); the run records the seed, and a resume with
    another --init-seed is another run."""
    import gpt2np.model
    from gpt2np.init import llmc_init
    seeds = []
    monkeypatch.setattr(gpt2np.model, "llmc_init",
                        lambda cfg, seed: seeds.append(seed) or llmc_init(cfg, seed))
    args = ["-e", "d6", "-i", tiny_shards / "syn_train.bin", "-j", tiny_shards / "syn_val.bin",
            "-b", 1, "-t", 8, "--device", "cpu", "-s", 0, "-v", 0, "-x", 1, "-n", 1]
    assert run(args + ["-o", tmp_path / "a", "--seed", 5], capsys)[0] == 0
    assert run(args + ["-o", tmp_path / "b", "--init-seed", 7], capsys)[0] == 0
    assert seeds == [42, 7]
    assert json.loads((tmp_path / "b" / "run.json").read_text())["settings"]["init_seed"] == 7
    code, out, err = run(["-e", tiny_model] + args[2:] + ["-o", tmp_path / "f"], capsys)
    # a model file:
    assert code == 0, err
    # no init seed
    assert "init_seed" not in json.loads((tmp_path / "f" / "run.json").read_text())["settings"]
    assert run(["-e", tiny_model] + args[2:] + ["-o", tmp_path / "f", "-y", 1, "-x",
                                                2, "--init-seed", 9],
               capsys)[0] == 0
    code, out, err = run(args + ["-o", tmp_path / "b", "--init-seed", 8, "-y", 1, "-x", 2], capsys)
    assert code == 2 and "--init-seed 7 there, 8 here" in err, err
    code, out, err = run(args + ["-o", tmp_path / "c", "--init-seed", -1], capsys)
    assert code == 2 and "--init-seed" in err and err.count("\n") == 1, err


def test_step_line_mfu_is_one_gpus_share_under_mpiexec():
    """llm.c's MFU: one process's tokens (B*T*grad_accum) against one GPU's peak; tok/s
    counts every process."""
    from types import SimpleNamespace

    from gpt2np.profiling.gpu_specs import mfu
    from gpt2np.train.log import throughput_text
    gpu = SimpleNamespace(name="cuda", launches_kernels=True, precision="bf16")
    one, two = (throughput_text(gpu, 1e9, 200_000.0, n, "H100 SXM") for n in (1, 2))
    expected = mfu(1e9, 100_000.0, "H100 SXM", "bf16")
    assert two == f"{100 * expected:.1f}% MFU" and one == f"{200 * expected:.1f}% MFU"
    cpu = SimpleNamespace(name="numpy", launches_kernels=False, precision="fp32")
    assert throughput_text(cpu, 1e9, 200.0, 2, "cpu") == "200.0 GFLOP/s"


def test_lg_logs_gpu_memory_under_the_step_line(tiny_model, tiny_shards, capsys):
    """llm.c's -lg N: every N steps a line under the step line (here the device memory in use); on
    the CPU one note that there is no GPU; a fake CUDA runtime's figures come out as they are."""
    from types import SimpleNamespace

    from gpt2np.train.log import gpu_memory_line
    args = base_args(tiny_model, tiny_shards) + ["-x", 2, "-v", 0, "-lg", 1]
    code, out, err = run(args, capsys)
    assert code == 0 and "note: -lg 1: this run is on the CPU, there is no GPU to log" in out, err
    code, out, err = run(args[:args.index("--device")] + ["--device", "emu", "-s", 0, "-x", 2, "-v",
                                                          0, "-lg", 2, "-b", 1, "-t", 8], capsys)
    assert code == 0, err
    lines = out.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert len(at) == 2 and lines[at[1] + 1].strip().startswith("memory:") and \
        not lines[at[0] + 1].strip().startswith("memory:")
    gib = 2 ** 30
    fake = SimpleNamespace(rt=SimpleNamespace(total_memory=lambda: 80 * gib),
                           free_memory=lambda: 60 * gib)
    assert gpu_memory_line(fake).strip() == "memory: 25.0% | 20.00 GiB used of 80.00 GiB"


def test_zero_stages_2_and_3_run_as_stage_0(tiny_model, tiny_shards, tmp_path, capsys):
    """llm.c's set_zero_configs: -z 2 and -z 3 are taken and run as stage 0, with a note."""
    for stage in (2, 3):
        code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 1, "-v", 0, "-z", stage,
                                                                    "-o", tmp_path / str(stage)],
                             capsys)
        assert code == 0, err
        assert (f"note: -z {stage}: ZeRO stages 2 and 3 are not supported (nor in "
                "llm.c): running stage 0" in out)
        assert json.loads((tmp_path / str(stage)
                           / "run.json").read_text())["settings"]["zero_stage"] == 0


def test_x_minus_one_counts_llmcs_epoch_which_can_be_zero(tiny_model, tiny_shards, capsys):
    """-x -1 trains llm.c's train_num_batches = tokens // total batch; fewer tokens than one step:
    no step (a note; the model is evaluated as with -x 0)."""
    tokens = read_shard(tiny_shards / "syn_train.bin").size
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", -1, "-v", 0, "-b", 4, "-t", 32,
                                                               "-d", 128, "-s", 0], capsys)
    assert code == 0 and f"training for {tokens // 128} steps" in out, err
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", -1, "-b", 4, "-t", 32,
                                                                "-d", 128 * (tokens // 128 + 1)],
                         capsys)
    assert code == 0 and "no step to train" in out and not re.search(r"^step ", out, re.M), err
    assert "-x -1: no training" in out and "val loss" in out


def test_header_names_the_offline_stand_in_as_the_weight_init(tiny_shards, tmp_path, monkeypatch,
                                                              capsys):
    """Offline, the default gpt2_124M.bin is stood in for by a random init: the header's weight init
    method says so (it named gpt2_124M.bin); -e as given otherwise (llm.c prints its -e)."""
    from gpt2np.datasets import starter
    from gpt2np.datasets.fetch import FetchError

    def offline(name, folder, timeout=None):
        raise FetchError(f"could not download {name} (offline?)")

    monkeypatch.setattr(starter, "CHECKPOINTS", tmp_path)
    monkeypatch.setattr(starter, "ensure", offline)
    # the stand-in, smaller for the test
    monkeypatch.setattr(starter, "FALLBACK_PRESET", "d6")
    monkeypatch.chdir(tmp_path)
    data = ["-i", tiny_shards / "syn_train.bin", "-j", tiny_shards / "syn_val.bin", "-b", 1, "-t",
            16, "--device", "cpu", "-s", 0, "-v", 0, "-x", 0]
    code, out, err = run(data, capsys)
    assert code == 0, err
    assert re.search(r"^\| weight init method +\| d6 \(random init; gpt2_124M\.bin "
                     r"unavailable\) +\|$", out, re.M), out
    code, out, err = run(data + ["-e", "d6"], capsys)
    assert code == 0, err
    assert re.search(r"^\| weight init method +\| d6 +\|$", out, re.M), out


def test_a_final_lr_fraction_with_the_constant_schedule_is_noted(tiny_model, tiny_shards, capsys):
    """-k constant never decays: a -q given with it is said to be unused (llm.c
    ignores it silently)."""
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 1, "-v", 0, "-k", "constant",
                                                               "-q", 0.5], capsys)
    assert code == 0, err
    assert ("note: -q 0.5: -k constant keeps the learning rate at -l; -q is not used"
            in out.splitlines())
    code, out, err = (run(base_args(tiny_model, tiny_shards) + ["-x", 1, "-v", 0, "-k", "constant"],
                          capsys))
    assert code == 0 and "-q is not used" not in out, err


def test_header_is_llmcs_tables_then_gpt2nps(tiny_model, tiny_shards, capsys):
    """train_gpt2.cu's header: its six tables' rows in its order (keys padded to 21, values to 50),
    its four lines, then gpt2np's own settings in a table of their own."""
    code, out, err = run(base_args(tiny_model, tiny_shards) + ["-x", 1, "-v", 0, "-d", 256], capsys)
    assert code == 0, err
    lines = out.splitlines()
    end = lines.index("=> setting grad_accum_steps=2")
    rows = [line for line in lines[:end] if line.startswith("| ")]
    assert [row[2:23].rstrip() for row in rows] == [
        "Parameter", "train data pattern", "val data pattern", "output log dir", "checkpoint_every",
        "resume", "micro batch size B", "sequence length T", "total batch size", "LR scheduler",
        "learning rate (LR)", "warmup iterations", "final LR fraction", "weight decay",
        "skip update lossz", "skip update gradz", "max_steps", "val_loss_every", "val_max_steps",
        "sample_every", "genT", "overfit_single_batch",
        "use_master_weights", "gelu_fusion", "recompute", "device", "peak TFlops", "precision",
        "weight init method", "max_sequence_length T", "vocab_size V", "padded_vocab_size Vp",
        "num_layers L", "num_heads NH", "channels C", "num_parameters", "train_num_batches",
        "val_num_batches", "run hellaswag", "num_processes", "zero_stage"]
    assert all(len(row) == len("| " + 21 * "x" + " | " + 50 * "x" + " |") for row in rows)
    n = num_parameters(TINY)
    assert lines[end - 3:end + 1] == [f"num_parameters: {n} => bytes: {4 * n}",
                                      f"allocated {4 * n // 2 ** 20} MiB for model parameters",
                                      "batch_size B=4 * seq_len T=32 * num_processes=1 and "
                                      "total_batch_size=256",
                                      "=> setting grad_accum_steps=2"]
    assert ("| gpt2np                | Value" in out
            and out.index("| gpt2np ") > out.index("grad_accum_steps=2"))


def test_device_steps_are_timed_on_the_device(tiny_model, tiny_shards, capsys, monkeypatch):
    """A device step's line shows its time between two events around its queueing
    (CudaBackend.elapsed_ms), not host clocks between results, which show the bursts in which
    results arrive while the host runs ahead (0.4 ms once on an H100); host steps (CPU)
    keep the host clock."""
    from gpt2np.backends.cuda.backend import CudaBackend
    spans = []

    def elapsed(self, start, end):
        spans.append((start, end))
        return 123.25

    monkeypatch.setattr(CudaBackend, "elapsed_ms", elapsed)
    args = base_args(tiny_model, tiny_shards)
    code, out, err = run(args[:args.index("--device")] + ["--device", "emu", "-s", 0, "-x", 3, "-v",
                                                          0, "-b", 1, "-t", 8], capsys)
    assert code == 0, err
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("| 123.25 ms |" in line for line in steps), steps
    assert len(spans) == 3 and all(s.t is not None and e.t is not None and s.t <= e.t
                                   for s, e in spans)
    assert "total average iteration time: 123.250000 ms" in out
    # a host step (the CPU): its own clock, no events
    spans.clear()
    code, out, err = run(args + ["-x", 2, "-v", 0], capsys)
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert (code == 0 and len(steps) == 2 and spans == []
            and not any("| 123.25 ms |" in line for line in steps))
