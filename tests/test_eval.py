"""gpt2np eval: the val loss of a model on token shards is the trainer's (the mean of each batch's
mean loss), with progress in plain lines when stderr is not a terminal; bad
flags end in one line."""
import re

import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.backends.numpy import cpu_kernels
from gpt2np.cli import eval as evaluate
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import DataLoader, write_shard
from gpt2np.formats.checkpoint import load_model, save_model
from gpt2np.model import GPT2
from gpt2np.train.evaluate import val_loss as trainer_evaluate

CFG = GPT2Config(32, 100, 128, 2, 2, 16)


@pytest.fixture()
def files(tmp_path):
    model = GPT2(CFG, get_backend("numpy"), 1, 1, seed=5)
    save_model(tmp_path / "m.bin", CFG, model.params_host())
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "val_000.bin", rng.integers(0, 100, 2000))
    write_shard(tmp_path / "val_001.bin", rng.integers(0, 100, 1000))
    return tmp_path


def test_eval_loss_is_the_trainers_val_loss(files, capsys, monkeypatch):
    monkeypatch.setenv("GPT2NP_PROGRESS", "plain")
    pattern = str(files / "val_*.bin")
    assert evaluate.main(["-e", str(files / "m.bin"), "-j", pattern, "-b", "2", "-t", "16"]) == 0
    out, err = capsys.readouterr()
    loss = float(re.search(r"val loss (\S+)", out).group(1))
    model = GPT2(CFG, get_backend("numpy"), 2, 16)
    model.load_params(load_model(files / "m.bin")[1])
    loader = DataLoader(pattern, 2, 16, vocab_size=100)
    assert loss == pytest.approx(trainer_evaluate(model, loader, -1), abs=1e-6)
    assert f"over {loader.num_batches} batches" in out and "2 shard(s), 3,000 tokens" in out
    assert err.splitlines()[-1].startswith(f"val: {loader.num_batches}/{loader.num_batches} "
                                           "batch (100%)")
    assert "\r" not in err


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the fast path is off")
def test_cpu_math_exact_is_the_exact_trainers_val_loss(files, capsys):
    """--cpu-math exact: the val loss of the exact NumPy path, as a run trained with --cpu-math
    exact logs it, to the last printed digit; the default is training's fast math, and the output
    line says which ran."""
    pattern = str(files / "val_*.bin")
    losses = {}
    for flags in ([], ["--cpu-math", "exact"]):
        assert evaluate.main(["-e", str(files / "m.bin"), "-j", pattern, "-b", "2", "-t", "16",
                              *flags]) == 0
        out = capsys.readouterr().out
        math_ = flags[1] if flags else "fast"
        assert f"on numpy ({math_} CPU math)" in out
        losses[math_] = re.search(r"val loss (\S+)", out).group(1)
    model = GPT2(CFG, get_backend("numpy", math="exact"), 2, 16)
    model.load_params(load_model(files / "m.bin")[1])
    assert model.backend.math == "exact"
    assert losses["exact"] == f"{trainer_evaluate(model, model_loader(pattern), -1):.6f}"
    assert float(losses["fast"]) == pytest.approx(float(losses["exact"]), abs=1e-5)


def model_loader(pattern):
    return DataLoader(pattern, 2, 16, vocab_size=100)


def test_the_last_progress_line_shows_the_final_mean(files, capsys, monkeypatch):
    """Every batch shows a progress line here (a clock that moves 10 s a call): the last one shows
    the mean over all the batches, the loss printed below it, not the mean before the last batch."""
    from itertools import count

    from gpt2np import progress
    monkeypatch.setenv("GPT2NP_PROGRESS", "plain")
    ticks = count()
    monkeypatch.setattr(progress.time, "monotonic", lambda: 10.0 * next(ticks))
    argv = ["-e", str(files / "m.bin"), "-j", str(files / "val_*.bin"), "-b", "2", "-t", "16"]
    assert evaluate.main(argv) == 0
    out, err = capsys.readouterr()
    loss = float(re.search(r"val loss (\S+)", out).group(1))
    lines = err.splitlines()
    assert len(lines) > 2 and lines[-1].endswith(f", loss {loss:.4f}"), err


def test_max_batches(files, capsys):
    assert evaluate.main(["loss", "-e", str(files / "m.bin"), "-j", str(files / "val_000.bin"),
                          "-b", "1", "-t", "8", "-m", "3"]) == 0
    assert "over 3 batches of B=1 x T=8 = 24 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["-b", "0"], ["-b 0", ">= 1"]),
    (["-t", "64"], ["-t 64", "max_seq_len 32"]),
    (["-m", "0"], ["-m 0", "-1 (all)"]),
    (["-j", "nothing_*.bin"], ["nothing_*.bin"]),
    (["-t", "0"], ["-t 0"]),
    (["gsm8k"], ["invalid choice", "'gsm8k'"]),
    (["--cpu-math", "exact", "--device", "emu"],
     ["--cpu-math exact", "only for the CPU", "--device emu"]),
    (["--cpu-math", "slow"], ["--cpu-math", "invalid choice", "'slow'"]),
    (["--dir", "cache"], ["--dir cache", "only for eval hellaswag"]),
])
def test_bad_input_is_one_line(argv, expected, files, capsys):
    full = ["-e", str(files / "m.bin"), "-j", str(files / "val_*.bin")] + argv
    if argv[0] in ("hellaswag", "gsm8k"):
        full = argv + full[:4]
    if argv[0] == "-j":
        full = ["-e", str(files / "m.bin")] + argv
    assert evaluate.main(full) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert all(piece in lines[0] for piece in expected), lines[0]


def test_eval_on_the_emulated_cuda_path_takes_trainings_defaults(tmp_path, capsys):
    """--device emu: the CUDA backend with training's defaults (flash attention where the head size
    is 64): the val loss of a head-size-64 model is the NumPy one within the flash
    kernels' TF32 tolerance."""
    from gpt2np.backends import inference_backend
    from gpt2np.cli.compare import TF32_LOSS_ABS_TOL
    cfg = GPT2Config(32, 100, 128, 1, 2, 128)                       # head size 64
    save_model(tmp_path / "m64.bin", cfg,
               GPT2(cfg, get_backend("numpy"), 1, 1, seed=5).params_host())
    write_shard(tmp_path / "val_000.bin", np.random.default_rng(0).integers(0, 100, 400))
    assert inference_backend("emu", 64)[1] == "flash" and inference_backend("cpu", 64)[1] == "naive"
    losses = {}
    for device in ("cpu", "emu"):
        assert evaluate.main(["-e", str(tmp_path / "m64.bin"), "-j", str(tmp_path / "val_000.bin"),
                              "-b", "2", "-t", "32", "-m", "2", "--device", device]) == 0
        losses[device] = float(re.search(r"val loss (\S+)", capsys.readouterr().out).group(1))
    assert losses["emu"] == pytest.approx(losses["cpu"], abs=TF32_LOSS_ABS_TOL)


def test_precision_bf16_reproduces_a_bf16_runs_logged_val_loss(files, tmp_path, capsys):
    """A tiny run trained with --precision bf16 logs its val loss at its last step, where it
    writes its checkpoint: eval --precision bf16 of that checkpoint gives the same val loss to every
    printed digit (the trainer's line and main.log's tel); eval's default, fp32 on the CPU as
    training's, gives another."""
    import train
    rng = np.random.default_rng(1)
    write_shard(tmp_path / "train.bin", rng.integers(0, 100, 3000))
    run = tmp_path / "run"
    flags = ["-e", files / "m.bin", "-i", tmp_path / "train.bin", "-j", files / "val_000.bin",
             "-b", 2, "-t", 16, "-x", 3, "-v", 3, "-m", 4, "-s", 0, "-n", 3, "--precision", "bf16",
             "--device", "cpu", "-o", run]
    assert train.main([str(a) for a in flags]) == 0
    logged = re.findall(r"val loss (\S+)", capsys.readouterr().out)[-1]
    tel = (run / "main.log").read_text().split("s:3 tel:")[1].split()[0]
    argv = ["-e", str(run / "model_00000003.bin"), "-j", str(files / "val_000.bin"), "-b", "2",
            "-t", "16", "-m", "4", "--device", "cpu"]
    assert evaluate.main(argv + ["--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "on numpy (fast CPU math, bf16)" in out
    loss = re.search(r"val loss (\S+)", out).group(1)
    assert loss == logged and f"{float(loss):.4f}" == tel, (loss, logged, tel)
    assert evaluate.main(argv) == 0
    out = capsys.readouterr().out
    assert "on numpy (fast CPU math)\n" in out
    assert re.search(r"val loss (\S+)", out).group(1) != logged


def test_precision_flag(files, capsys):
    """--precision: train's choices; tf32 on the CPU runs in fp32 with train's note; not a choice:
    one line."""
    argv = ["-e", str(files / "m.bin"), "-j", str(files / "val_000.bin"), "-b", "1", "-t", "8",
            "-m", "1", "--device", "cpu"]
    assert evaluate.main(argv + ["--precision", "tf32"]) == 0
    out, err = capsys.readouterr()
    assert "on numpy (fast CPU math)\n" in out
    assert err.splitlines()[0] == ("note: --precision tf32 is a GPU precision; the CPU computes "
                                   "in fp32")
    assert evaluate.main(argv + ["--precision", "fp16"]) == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "sample"])
def test_model_help_names_hugging_face_folders_and_ids(command, capsys):
    from gpt2np.cli import main as commands
    assert commands.main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "a Hugging Face GPT-2 folder (config.json + model.safetensors" in text, text
    assert "a Hugging Face Hub id (gpt2, openai-community/gpt2-medium" in text, text
