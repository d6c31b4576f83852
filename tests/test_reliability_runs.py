"""Runs that end other than by finishing: a run folder holding another run, an incomplete or damaged
checkpoint, a NaN loss, a NaN weight, SIGTERM/SIGINT, kill -9 at random moments. Each ends in the
documented behaviour or one clear line, and a resumed run is bit-identical to an uninterrupted one.
Tiny models: the file runs in well under a minute on two cores; every wait on a
subprocess is bounded.
"""
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import train
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.backends.runtime_base import Ready
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import write_shard
from gpt2np.datasets.starter import write_byte_tokenizer
from gpt2np.dist import LAUNCHER_RANK_VARS
from gpt2np.fileio import atomic_write
from gpt2np.formats.checkpoint import (
    CheckpointError,
    load_model,
    load_state,
    model_path,
    save_model,
    save_state,
    state_path,
)
from gpt2np.formats.tokenizer import TOKENIZER_BIN
from gpt2np.model import GPT2
from gpt2np.tensors import offsets, param_shapes, views
from gpt2np.train import loop
from gpt2np.train.rundir import TEMP_FILE
from gpt2np.train_step import NonFiniteError, PendingStep, train_step

REPO = Path(__file__).resolve().parent.parent
# byte-level vocabulary (256 bytes + <|endoftext|> = 256), so samples decode with a tokenizer
# file beside the data
SMALL = GPT2Config(max_seq_len=32, vocab_size=257, padded_vocab_size=384, num_layers=2, num_heads=4,
                   channels=32)
TIMEOUT = 60                     # seconds any one subprocess may take
STEP_LINE = re.compile(r"^step ", re.M)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reliability")
    save_model(folder / "small.bin", SMALL, GPT2(SMALL, NumpyBackend(), 1, 8, seed=3).params_host())
    save_model(folder / "other.bin", SMALL, GPT2(SMALL, NumpyBackend(), 1, 8, seed=4).params_host())
    tokens = np.random.default_rng(0).integers(0, SMALL.vocab_size, 24000)
    write_shard(folder / "train.bin", tokens[2000:])
    write_shard(folder / "val.bin", tokens[:2000])
    write_byte_tokenizer(folder / TOKENIZER_BIN)
    return folder


def args(files, out, *extra, model="small.bin"):
    return ["-e", files / model, "-i", files / "train.bin", "-j", files / "val.bin", "-b", 2, "-t",
            16, "--device", "cpu", "-s", 0, "-v", 0, "-o", out, *extra]


def run(argv, capsys):
    """train.py in this process: (exit code, stdout, stderr lines that are not empty)."""
    code = train.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if line.strip()]


def one_error_line(err, *fragments):
    errors = [line for line in err if not line.startswith("note:")]
    assert len(errors) == 1 and errors[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


def snapshot(folder):
    """{relative path: bytes} of every file under folder."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def same_checkpoint(a, b, step):
    """Model bytes, optimizer moments and resume info of step in folders a and b are identical."""
    assert Path(model_path(a, step)).read_bytes() == Path(model_path(b, step)).read_bytes()
    info_a, m_a, v_a = load_state(state_path(a, step))
    info_b, m_b, v_b = load_state(state_path(b, step))
    assert info_a == info_b
    assert m_a.tobytes() == m_b.tobytes() and v_a.tobytes() == v_b.tobytes()


# ---- run folders ---------------------------------------------------------------------------------
def test_fresh_run_refuses_a_folder_with_checkpoints(files, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 1), capsys)
    assert code == 0, err
    assert (out / "run.json").is_file()
    before = snapshot(out)
    # the same run again
    code, _, err = run(args(files, out, "-x", 2, "-n", 1), capsys)
    assert code != 0
    one_error_line(err, str(out), "checkpoints of this run", "-y 1", "--overwrite")
    code, _, err = run(args(files, out, "-x", 2, "-n", 1, "-l", 1e-3), capsys)      # another run
    assert code != 0
    one_error_line(err, str(out), "another run's checkpoints", "--overwrite")
    assert snapshot(out) == before


def test_overwrite_moves_the_old_run_aside(files, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "mine.txt").write_text("not a run file")
    code, _, err = run(args(files, out, "-x", 2, "-n", 1), capsys)
    assert code == 0, err
    old = snapshot(out)
    code, _, err = run(args(files, out, "-x", 1, "-n", 1, "-l", 1e-3, "--overwrite"), capsys)
    assert code == 0, err
    (previous,) = out.glob("previous-*")
    assert any("moved the previous run's files" in line for line in err)
    moved = {name: data for name, data in old.items() if not name.startswith("notes/")}
    # every old run file, byte for byte
    assert snapshot(previous) == moved
    # other files stay where they were
    assert (out / "notes" / "mine.txt").read_text() == "not a run file"
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == [
        "DONE_00000001", "main.log", "model_00000001.bin", "run.json", "state_00000001_00000.bin"]


def test_resume_refuses_another_runs_checkpoints(files, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 1), capsys)
    assert code == 0, err
    before = snapshot(out)
    code, _, err = run(args(files, out, "-x", 4, "-n", 1, "-y", 1, "-l", 1e-3, "-b", 1), capsys)
    assert code != 0
    one_error_line(err, str(out), "another run's", "-b 2 there, 1 here",
                   "-l 0.0003 there, 0.001 here")
    code, _, err = run(args(files, out, "-x", 4, "-n", 1, "-y", 1, model="other.bin"), capsys)
    assert code != 0
    one_error_line(err, "the model -e")
    code, _, err = run(args(files, out, "-x", 4, "-y", 1, "--overwrite"), capsys)
    assert code != 0
    one_error_line(err, "give one of them")
    assert snapshot(out) == before


def test_resume_past_or_at_max_steps(files, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 3, "-n", 3), capsys)
    assert code == 0, err
    before = snapshot(out)
    # the run is complete
    code, stdout, err = run(args(files, out, "-x", 3, "-n", 3, "-y", 1), capsys)
    assert code == 0 and "no step to train" in stdout and not STEP_LINE.search(stdout), err
    assert "training for" not in stdout
    # it is already past -x
    code, _, err = run(args(files, out, "-x", 2, "-n", 3, "-y", 1), capsys)
    assert code != 0
    one_error_line(err, "latest checkpoint is at step 3, past -x 2")
    # rewritten (same run)
    del before["run.json"]
    after = snapshot(out)
    assert {name: after[name] for name in before} == before


def test_the_resumed_step_is_evaluated_as_llmcs(files, tmp_path, capsys):
    """As llm.c's loop, a resume evaluates its step when due (the checkpoint a stop by signal writes
    comes before that step's evaluations; here the first attempt ran with -v 0), then trains on; at
    the last step of a finished run it evaluates it again. main.log holds each line once."""
    out = tmp_path / "out"
    # -v 0: no val line
    assert run(args(files, out, "-x", 2, "-n", 2), capsys)[0] == 0
    code, stdout, err = run(args(files, out, "-x", 4, "-n", 2, "-y", 1, "-v", 2, "-m", 2), capsys)
    assert code == 0, err
    assert stdout.index("val loss") < stdout.index("step    3/4")
    log = (out / "main.log").read_text().splitlines()
    assert [line.split()[0] for line in log if "tel:" in line] == ["s:2", "s:4"], log
    code, stdout, err = run(args(files, out, "-x", 4, "-n", 2, "-y", 1, "-v", 2, "-m", 2), capsys)
    assert code == 0 and "no step to train" in stdout and stdout.count("val loss") == 1, err
    assert (out / "main.log").read_text().splitlines() == log
    # -v 0: no val again
    code, stdout, err = run(args(files, out, "-x", 4, "-n", 2, "-y", 1), capsys)
    assert code == 0 and "val loss" not in stdout, err
    # s:4 tel kept
    assert (out / "main.log").read_text().splitlines() == log


def test_resume_skips_incomplete_and_damaged_checkpoints(files, tmp_path, capsys):
    reference, out = tmp_path / "reference", tmp_path / "out"
    code, _, err = run(args(files, reference, "-x", 4, "-n", 1), capsys)
    assert code == 0, err
    shutil.copytree(reference, out)
    # step 4: a crash between model_4 and state_4 (no state, no DONE); step 3: damaged
    # after it was complete
    os.remove(out / "DONE_00000004")
    os.remove(out / "state_00000004_00000.bin")
    state3 = out / "state_00000003_00000.bin"
    state3.write_bytes(state3.read_bytes()[:-8])
    code, stdout, err = run(args(files, out, "-x", 4, "-n", 1, "-y", 1), capsys)
    assert code == 0, err
    notes = [line for line in err if line.startswith("note: skipping")]
    assert len(notes) == 2 and "step 4" in notes[0] and "DONE_00000004" in notes[0], err
    assert "step 3" in notes[1] and "truncated or corrupt" in notes[1], err
    assert "resuming from step 2" in stdout
    for step in (3, 4):
        same_checkpoint(reference, out, step)
    assert (out / "main.log").read_text() == (reference / "main.log").read_text()


def test_stale_temp_files_are_removed_only_ours(files, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # the pattern is atomic_write's naming
    with atomic_write(out / "model_00000001.bin") as f:
        f.write(b"x")
        (name,) = [n for n in os.listdir(out) if n.endswith(".tmp")]
        assert TEMP_FILE.fullmatch(name)
    os.remove(out / "model_00000001.bin")
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [f".model_00000007.bin.{2**22 + 12345}.0123abcd.tmp",
                 f".main.log.{os.getpid()}.89abcdef.tmp"]
        kept = [f".state_00000002_00000.bin.{writer.pid}.00ff00ff.tmp", ".notes.tmp",
                "x.1.deadbeef.tmp"]
        for name in stale + kept:
            (out / name).write_bytes(b"partial")
        code, _, err = run(args(files, out, "-x", 1), capsys)
        assert code == 0, err
        assert any(f"removed {len(stale)} temporary file(s)" in line for line in err), err
        left = sorted(n for n in os.listdir(out) if n.endswith(".tmp"))
        assert left == sorted(kept)
    finally:
        writer.kill()
        writer.wait(TIMEOUT)


def test_output_dir_that_is_a_file(files, tmp_path, capsys):
    not_a_folder = tmp_path / "out"
    not_a_folder.write_text("a file")
    code, _, err = run(args(files, not_a_folder, "-x", 1), capsys)
    assert code == 2
    one_error_line(err, f"-o {not_a_folder} is a file, not a folder")
    # a folder under a file
    code, _, err = run(args(files, not_a_folder / "run" / "a", "-x", 1), capsys)
    assert code == 2
    one_error_line(err, f"-o {not_a_folder / 'run' / 'a'}: {not_a_folder} is a file, so the "
                        "folder cannot be made")


def test_state_file_missing_a_key(files, tmp_path, capsys):
    path = tmp_path / "state.bin"
    save_state(path, {"step": 3}, np.zeros(4), np.zeros(4))
    with pytest.raises(CheckpointError,
                       match=re.escape(f"{path}: the state lacks the key 'train_loader'")):
        load_state(path)
    # in a run folder the checkpoint counts as damaged: skipped with a note naming
    # the file and the key
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 1), capsys)
    assert code == 0, err
    info, m, v = load_state(state_path(out, 2))
    del info["train_loader"]
    save_state(state_path(out, 2), info, m, v)
    code, stdout, err = run(args(files, out, "-x", 2, "-n", 1, "-y", 1), capsys)
    assert code == 0, err
    assert any("state_00000002_00000.bin: the state lacks the key 'train_loader'" in line
               for line in err), err
    assert "resuming from step 1" in stdout


# ---- non-finite values ---------------------------------------------------------------------------
def test_nan_loss_stops_and_keeps_the_last_checkpoint(files, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(args(files, out, "-x", 8, "-n", 1, "-l", 1e9), capsys)
    assert code == 1
    line = one_error_line(err)
    m = re.fullmatch(r"error: step (\d+): the (loss|gradient norm) is (nan|inf)[^;]*; stopping "
                     r"\(the last checkpoint, step (\d+), is untouched\)", line)
    assert m, line
    bad_step, last = int(m[1]), int(m[4])
    assert last == bad_step - 1 >= 1
    assert f"step {last:4d}/8" in stdout and f"step {bad_step:4d}/8" not in stdout
    # nothing after it
    assert sorted(p.name for p in out.glob("DONE_*"))[-1] == f"DONE_{last:08d}"
    assert not (out / f"model_{bad_step:08d}.bin").exists()
    # finite: loads
    load_model(model_path(out, last))
    assert f"s:{bad_step - 1} trl" not in (out / "main.log").read_text()


def test_huge_weights_stop_at_the_first_step(files, tmp_path, capsys):
    params = load_model(files / "small.bin")[1]
    views(params, param_shapes(SMALL))["lnfw"][:] = 1e30
    save_model(tmp_path / "huge.bin", SMALL, params)
    code, _, err = run(args(files, tmp_path / "out", "-x", 3, "-n", 1, model=tmp_path / "huge.bin"),
                       capsys)
    assert code == 1
    one_error_line(err, "error: step 1: the ", "(no checkpoint was written)")
    assert not list((tmp_path / "out").glob("model_*"))


def test_model_file_with_a_nan_weight_is_rejected(files, tmp_path, capsys):
    params = load_model(files / "small.bin")[1]
    offset = offsets(param_shapes(SMALL))["qkvw"][0]
    params[offset + np.ravel_multi_index((1, 5, 3), param_shapes(SMALL)["qkvw"])] = np.nan
    params[offset + np.ravel_multi_index((1, 7, 0), param_shapes(SMALL)["qkvw"])] = np.inf
    bad = tmp_path / "nan.bin"
    save_model(bad, SMALL, params)
    code, _, err = run(args(files, tmp_path / "out", "-x", 1, model=bad), capsys)
    assert code != 0
    one_error_line(err, str(bad), "weight qkvw[1, 5, 3] is nan", "and 1 more non-finite")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_train_step_raises_before_the_update():
    model = GPT2(SMALL, NumpyBackend(), 2, 16, seed=3)
    params = model.params_host()
    views(params, param_shapes(SMALL))["lnfw"][:] = 1e30
    model.load_params(params)
    tokens = np.random.default_rng(1).integers(0, SMALL.vocab_size, (2, 17))
    with pytest.raises(NonFiniteError, match=r"^step 5: the ") as caught:
        train_step(model, lambda: (tokens[:, :-1], tokens[:, 1:]), step=4, lr=1e-3)
    assert caught.value.step == 4 and not np.isfinite(caught.value.grad_norm)
    assert model.params_host().tobytes() == params.tobytes()            # not updated
    m, v = model.optimizer_state_host()
    assert not m.any() and not v.any()


@pytest.mark.parametrize("deferred", [False, True])
def test_skip_nonfinite(files, tmp_path, capsys, monkeypatch, deferred):
    """--skip-nonfinite N: the step is skipped (not applied, not logged), the count survives a
    resume, the N+1-th stops the run. deferred: as the device step (CUDA) reports it, a PendingStep
    that raises when read, after the trainer has queued the next step."""
    real_step = loop.train_step
    bad_steps = {2, 5}

    def flaky_step(model, next_batch, *, step, **kwargs):
        # what train_step does with a NaN loss: consume the batch, raise
        if step in bad_steps:
            next_batch()
            if deferred:
                return PendingStep(step, Ready(np.array([np.nan, np.nan], np.float32)))
            raise NonFiniteError(step, float("nan"), float("nan"))
        result = real_step(model, next_batch, step=step, **kwargs)
        return (PendingStep(step, Ready(np.array([result.loss, result.grad_norm ** 2]))) if deferred
                else result)

    monkeypatch.setattr(loop, "train_step", flaky_step)
    out = tmp_path / "out"
    code, stdout, err = run(args(files, out, "-x", 4, "-n", 1, "--skip-nonfinite", 2), capsys)
    assert code == 0, err
    assert re.search(r"step    3/4 \| loss nan \| norm nan \| .*skipped: not finite \(1 of "
                     r"--skip-nonfinite 2\)",
                     stdout)
    assert ("s:2 trl" not in (out / "main.log").read_text()
            and "s:3 trl" in (out / "main.log").read_text())
    assert load_state(state_path(out, 4))[0]["nonfinite_skipped"] == 1
    # resumed: step 5 is the second skip (allowed), step 6 the third (not)
    bad_steps.add(6)
    code, stdout, err = (run(args(files, out, "-x", 8, "-n", 1, "--skip-nonfinite", 2, "-y", 1),
                             capsys))
    assert code == 1
    one_error_line(err, "step 7: the loss is nan; stopping after skipping 2 (--skip-nonfinite 2) "
                        "(the last checkpoint, step 6, is untouched)")
    assert "(2 of --skip-nonfinite 2)" in stdout


def test_only_incomplete_checkpoints_are_named_as_such(files, tmp_path, capsys):
    """A run whose only checkpoint never completed (a full disk while writing its state file): a
    fresh run there says so, and that -y 1 starts over (which it then does), rather than telling to
    resume what -y 1 cannot."""
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 2), capsys)
    assert code == 0, err
    (out / "DONE_00000002").unlink()
    (out / "state_00000002_00000.bin").unlink()
    code, _, err = run(args(files, out, "-x", 2, "-n", 2), capsys)
    assert code == 2
    one_error_line(err, f"{out} holds only incomplete checkpoint files of this run (step 2: "
                        "no DONE_00000002", "-y 1 starts the run over there")
    code, stdout, err = run(args(files, out, "-x", 2, "-n", 2, "-y", 1), capsys)
    assert code == 0 and any("nothing to resume" in line for line in err), err
    assert (out / "DONE_00000002").is_file()


def test_another_runs_main_log_is_not_overwritten(files, tmp_path, capsys):
    """A run that wrote no checkpoint still leaves its main.log: a different run into the same -o is
    refused (one line) unless --overwrite moves it aside; the same run again starts over there, its
    old log moved aside (a -n 0 run's log is all it wrote)."""
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2), capsys)
    assert code == 0, err
    log = (out / "main.log").read_text()
    assert log and not list(out.glob("model_*"))
    # another run (its lr)
    code, _, err = run(args(files, out, "-x", 2, "-l", 1e-3), capsys)
    assert code == 2 and (out / "main.log").read_text() == log
    one_error_line(err, f"{out} holds another run's main.log (no checkpoints;", "--overwrite")
    # -y 1, nothing to resume
    code, _, err = run(args(files, out, "-x", 2, "-l", 1e-3, "-y", 1), capsys)
    assert code == 2 and (out / "main.log").read_text() == log
    one_error_line(err, f"{out} holds another run's main.log (no checkpoints;", "--overwrite")
    # the same run starts over, its old log kept
    code, _, err = run(args(files, out, "-x", 2), capsys)
    assert code == 0, err
    assert any("holds no complete checkpoint to resume: moved what an earlier attempt left" in line
               for line in err)
    assert [p.read_text() for p in out.glob("previous-*/main.log")] == [log]
    log = (out / "main.log").read_text()
    code, _, err = run(args(files, out, "-x", 2, "-l", 1e-3, "--overwrite"), capsys)
    assert code == 0, err
    # the same losses twice
    assert sorted(p.read_text() for p in out.glob("previous-*/main.log")) == [log, log]


def test_an_output_folder_that_cannot_be_made_is_one_line_naming_o(files, tmp_path, capsys,
                                                                   monkeypatch):
    """-o where the folder cannot be made (no permission; /proc) names -o and why (was
    the bare OSError)."""
    from gpt2np.train import rundir

    def refused(path, exist_ok=False):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(rundir.os, "makedirs", refused)
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 1), capsys)
    assert code == 2 and not out.exists()
    one_error_line(err, f"-o {out}: the folder cannot be made (Permission denied)")


def test_a_resume_that_fails_to_load_does_not_claim_the_run(files, tmp_path, capsys):
    """-y 1 on checkpoints without run.json resumes unchecked; when the checkpoint does not load
    (another -e's config) the folder is left as it was, so the right -e resumes it (run.json was
    written before the load)."""
    out = tmp_path / "out"
    # s:1 tel: the last step's
    code, _, err = run(args(files, out, "-x", 1, "-n", 1, "-v", 1, "-m", 1), capsys)
    assert code == 0, err
    (out / "run.json").unlink()
    deeper = GPT2Config(**{**SMALL.__dict__, "num_layers": 3})
    save_model(tmp_path / "deeper.bin", deeper,
               GPT2(deeper, NumpyBackend(), 1, 8, seed=3).params_host())
    log = (out / "main.log").read_text()
    code, _, err = run(args(files, out, "-x", 2, "-n", 1, "-y", 1, "-v", 1,
                            model=tmp_path / "deeper.bin"), capsys)
    # untouched
    assert code == 2 and not (out / "run.json").exists() and (out / "main.log").read_text() == log
    one_error_line(err, "model_00000001.bin")
    code, stdout, err = run(args(files, out, "-x", 2, "-n", 1, "-y", 1, "-v", 1, "-m", 1), capsys)
    assert code == 0 and "resuming from step 1" in stdout, err
    assert (out / "run.json").is_file() and (out / "main.log").read_text().count("s:1 tel:") == 1


def test_resume_keeps_the_optimizer_settings(files, tmp_path, capsys):
    """-y 1 with another weight decay, clipping or AdamW beta/eps than the run's is refused in one
    line naming both values (the result would differ from the run's)."""
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 1, "-c", 0.1), capsys)
    assert code == 0, err
    for flag, value, says in (("-c", 0.5, "-c 0.1 there, 0.5 here"),
                              ("--grad-clip", 2, "--grad-clip 1 there, 2 here"),
                              ("--beta2", 0.99, "--beta2 0.95 there, 0.99 here")):
        code, _, err = (run(args(files, out, "-x", 3, "-n", 1, "-c", 0.1, flag, value, "-y", 1),
                            capsys))
        assert code == 2
        one_error_line(err, "holds another run's checkpoints, not this one's", says)


# ---- -x 0 ----------------------------------------------------------------------------------------
def test_x0_validates_and_samples_without_training(files, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(args(files, out, "-x", 0, "-s", 1, "-g", 8, "-v", 1, "-m", 2), capsys)
    assert code == 0, err
    assert "val loss" in stdout and "generating:" in stdout and not STEP_LINE.search(stdout)
    assert not out.exists()                                     # nothing trained, nothing written
    code, _, err = run(args(files, out, "-x", 2, "-n", 2), capsys)
    assert code == 0, err
    before = snapshot(out)
    code, stdout, err = (run(args(files, out, "-x", 0, "-s", 1, "-g", 8, "-v", 1, "-m", 2, "-y", 1),
                             capsys))
    assert code == 0, err
    assert ("resuming from step 2" in stdout and "generating:" in stdout
            and not STEP_LINE.search(stdout))
    assert "-x 0: no training (-o is not written); validating and sampling the model once" in stdout
    assert snapshot(out) == before
    # says what it does
    code, stdout, err = run(args(files, out, "-x", 0, "-s", 0, "-v", 0, "-y", 1), capsys)
    assert (code == 0
            and "-x 0: no training (-o is not written); nothing else asked for either (-v 0, -s 0)"
            in stdout), stdout + err
    code, stdout, err = run(args(files, tmp_path / "empty", "-x", 0, "-v", 0, "-y", 1), capsys)
    assert code == 0 and err == [f"note: nothing to resume in {tmp_path / 'empty'}; "
                                 "evaluating -e's model"], err


# ---- signals and kill -9 -------------------------------------------------------------------------
def subprocess_env():
    from test_dist import ompi_env  # Open MPI as root, or without ssh (as in containers)
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_RANK_VARS and not k.startswith(("PMI_", "PMIX_", "OMPI_",
                                                                "GPT2NP_TEST_"))}
    env.update(ompi_env())
    env.update(PYTHONPATH=str(REPO), GPT2NP_NVTX="0", PYTHONUNBUFFERED="1")
    return env


class Trainer:
    """train.py in a subprocess (launcher: e.g. [mpiexec, -n, 2]); its stdout lines arrive in a
    queue (read by a thread), stderr goes to a file."""

    def __init__(self, argv, stderr_path, launcher=()):
        self.stderr_path = stderr_path
        command = [*launcher, sys.executable, str(REPO / "train.py"), *map(str, argv)]
        with open(stderr_path, "w") as err:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                                         text=True, env=subprocess_env())
        self.lines = queue.Queue()
        self.stdout = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern, timeout=TIMEOUT):
        """The first match of pattern in a new stdout line; None if the process ended first."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            if line is None:
                return None
            self.stdout.append(line)
            if m := re.search(pattern, line):
                return m

    def finish(self):
        self.proc.wait(TIMEOUT)
        while (line := self.lines.get(timeout=TIMEOUT)) is not None:
            self.stdout.append(line)
        return self.proc.returncode, "".join(self.stdout), Path(self.stderr_path).read_text()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_and_exits(signum, files, tmp_path, capsys):
    out = tmp_path / "out"
    # constant lr: the schedule does not depend on -x
    common = ["-k", "constant", "-n", 0]
    job = Trainer(args(files, out, "-x", 100000, *common), tmp_path / "stderr")
    assert job.wait_for(r"^step +3/"), "no third step"
    job.proc.send_signal(signum)
    code, _, stderr = job.finish()
    assert code == 128 + signum, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    m = re.fullmatch(rf"stopped by {signal.Signals(signum).name} after (\d+) steps: "
                     r"checkpoint of step (\d+) "
                     rf"written to {re.escape(str(out))} \(resume with -y 1\)", lines[-1])
    assert m and m[1] == m[2] and len(lines) == 1, stderr
    step = int(m[1])
    assert (out / f"DONE_{step:08d}").is_file()
    # resumable, and the same as an uninterrupted run
    code, stdout, err = run(args(files, out, "-x", step + 2, "-n", 1, "-y", 1, *common[:2]), capsys)
    assert code == 0 and f"resuming from step {step}" in stdout, err
    code, _, err = (run(args(files, tmp_path / "reference", "-x", step + 2, "-n", 1, *common[:2]),
                        capsys))
    assert code == 0, err
    same_checkpoint(tmp_path / "reference", out, step + 2)


def test_sigterm_under_mpiexec_stops_every_rank_at_the_same_step(files, tmp_path):
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install 'gpt2np[dist]')")
    here = Path(sysconfig.get_path("scripts")) / "mpiexec"
    mpiexec = str(here) if here.is_file() else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    out = tmp_path / "out"
    job = Trainer(args(files, out, "-x", 100000, "-b", 1, "-z", 1), tmp_path / "stderr",
                  launcher=(mpiexec, "-n", "2"))
    if not job.wait_for(r"^step +3/"):
        code, stdout, stderr = job.finish()
        pytest.skip(f"{mpiexec} did not run 2 ranks (exit {code}): {stderr[-500:]}")
    job.proc.send_signal(signal.SIGTERM)
    code, _, stderr = job.finish()
    assert code == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr
    # rank 0 alone says it
    (line,) = [line for line in stderr.splitlines() if line.startswith("stopped by")]
    step = int(re.search(r"checkpoint of step (\d+) written", line)[1])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("DONE", "state"))) == [
        f"DONE_{step:08d}", f"state_{step:08d}_00000.bin", f"state_{step:08d}_00001.bin"]
    job = Trainer(args(files, out, "-x", step + 1, "-b", 1, "-z", 1, "-y", 1, "-n", 1),
                  tmp_path / "stderr2", launcher=(mpiexec, "-n", "2"))
    code, stdout, stderr = job.finish()
    assert (code == 0 and f"resuming from step {step}" in stdout
            and (out / f"DONE_{step + 1:08d}").is_file()), stderr


SECOND_SIGNAL = """
import os, signal, time
from gpt2np.train.interrupts import StopSignals
with StopSignals() as signals:
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 10
    while signals.signum is None and time.monotonic() < deadline:
        time.sleep(0.001)                   # the handler runs between bytecodes of the main thread
    print("first:", signals.name, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
print("not reached")
"""


def test_second_signal_exits_at_once():
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True,
                         timeout=TIMEOUT, env=subprocess_env(), cwd=REPO)
    assert res.returncode == 130 and time.monotonic() - t0 < 8
    assert res.stdout == "first: SIGINT\n"
    assert res.stderr == "error: SIGINT again: exiting now, without a checkpoint\n"


def test_kill_9_at_random_moments_then_resume_is_bit_identical(files, tmp_path, capsys):
    """kill -9 a -n 1 run at random moments (inside steps, checkpoint writes, validation, startup),
    resume with -y 1 until it finishes: the final model, optimizer state and main.log equal an
    uninterrupted run's."""
    steps, kills = 16, 6
    def run_args(out):
        return args(files, out, "-x", steps, "-n", 1, "-v", 4, "-m", 1, "-y", 1)
    reference, out = tmp_path / "reference", tmp_path / "out"
    code, _, err = run(run_args(reference), capsys)
    assert code == 0, err
    rng = random.Random(1234)
    rounds = []
    for k in range(kills):
        job = Trainer(run_args(out), tmp_path / f"stderr{k}")
        resumed = job.wait_for(r"^(?:resuming from step (\d+)|training for)")
        start = int(resumed[1] or 0) if resumed else steps
        # kill only once checkpoint start + 1 is complete (step start + 2 is printed after it):
        # every round makes progress, so the loop ends however the kills land
        if start + 2 <= steps and job.wait_for(rf"^step +{start + 2}/"):
            time.sleep(rng.uniform(0, 0.015))              # a step and a checkpoint take a few ms
            job.proc.kill()
        code, _, stderr = job.finish()
        assert "Traceback" not in stderr, stderr
        rounds.append((start, code))
        if code == 0:
            break
    code, stdout, stderr = Trainer(run_args(out), tmp_path / "stderr_last").finish()
    assert code == 0, stderr
    assert any(c == -signal.SIGKILL for _, c in rounds), rounds
    same_checkpoint(reference, out, steps)
    assert (out / "main.log").read_text() == (reference / "main.log").read_text()
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


def test_a_deferred_non_finite_step_stops_the_run_before_its_successor_is_reported(
        files, tmp_path, capsys, monkeypatch):
    """A device step's numbers arrive one step late: the run stops at the bad step's line (the next
    step was queued, its line never comes and nothing is written after it)."""
    real_step = loop.train_step
    queued = []

    def deferred_step(model, next_batch, *, step, **kwargs):
        queued.append(step)
        if step == 2:
            next_batch()
            return PendingStep(step, Ready(np.array([np.inf, 1.0], np.float32)))
        result = real_step(model, next_batch, step=step, **kwargs)
        return PendingStep(step, Ready(np.array([result.loss, result.grad_norm ** 2])))

    monkeypatch.setattr(loop, "train_step", deferred_step)
    out = tmp_path / "out"
    code, stdout, err = run(args(files, out, "-x", 6), capsys)
    assert code == 1
    one_error_line(err, "step 3: the loss is inf; stopping (no checkpoint was written)")
    # step 3 was queued before step 2's numbers were read
    assert queued == [0, 1, 2, 3]
    assert ([line.split()[0] for line in (out / "main.log").read_text().splitlines()]
            == ["s:0", "s:1"])
    assert re.findall(r"step +(\d)/6", stdout) == ["1", "2"]


def test_trim_log_drops_every_kind_of_line_after_the_resumed_step(tmp_path):
    """A resume from the checkpoint of step 2 keeps the log before it and drops the lines the
    resumed run writes again: every line of step 2 on (as llm.c's, it evaluates step 2 again
    before training it)."""
    from gpt2np.train.rundir import trim_log
    lines = ["s:0 tel:5.0000", "s:0 eval:0.2000", "s:0 trl:5.1000 lr:0.000300 norm:1.00",
             "s:1 trl:5.0000 lr:0.000300 norm:1.00", "s:2 tel:4.9000", "s:2 eval:0.4000",
             "s:2 trl:4.9500 lr:0.000300 norm:1.00", "s:3 trl:4.9000 lr:0.000300 norm:1.00",
             "s:4 tel:4.8000", "s:4 eval:0.6000"]
    (tmp_path / "main.log").write_text("\n".join(lines) + "\n")
    trim_log(tmp_path, 2)
    assert (tmp_path / "main.log").read_text().splitlines() == lines[:4]
    # only val again at step 2: eval kept
    (tmp_path / "main.log").write_text("\n".join(lines) + "\n")
    trim_log(tmp_path, 2, rewritten=("tel",))
    assert (tmp_path / "main.log").read_text().splitlines() == lines[:4] + ["s:2 eval:0.4000"]


def test_a_resumed_val_line_goes_before_its_steps_kept_hellaswag_line(tmp_path):
    """A resume that evaluates only val at its step again (HellaSwag not due: trim_log kept that
    step's eval line) writes its val line before the kept eval line, llm.c's order; any other first
    line is appended."""
    from gpt2np.train.log import Logger
    from gpt2np.train.rundir import trim_log
    lines = ["s:0 tel:5.0000", "s:0 trl:5.1000 lr:0.000300 norm:1.00", "s:2 tel:4.9000",
             "s:2 eval:0.4000", "s:2 trl:4.9500 lr:0.000300 norm:1.00"]
    log = tmp_path / "main.log"
    log.write_text("\n".join(lines) + "\n")
    trim_log(tmp_path, 2, rewritten=("tel",))
    logger = Logger(str(tmp_path), 0, resume=True)
    logger.log("s:2 tel:4.8000")
    logger.log("s:2 trl:4.8500 lr:0.000300 norm:1.00")
    assert log.read_text().splitlines() == lines[:2] + ["s:2 tel:4.8000", "s:2 eval:0.4000",
                                                        "s:2 trl:4.8500 lr:0.000300 norm:1.00"]
    # a first line of another kind or step: appended
    log.write_text("\n".join(lines[:4]) + "\n")
    Logger(str(tmp_path), 0, resume=True).log("s:3 tel:4.7000")
    assert log.read_text().splitlines() == lines[:4] + ["s:3 tel:4.7000"]


def test_zero1_is_off_where_the_parameters_do_not_divide_evenly():
    """llm.c turns ZeRO-1 off when the parameters do not divide over the ranks, and so does gpt2np
    (setup.zero_stage, the stage the trainer runs)."""
    from gpt2np.train.setup import zero_stage
    uneven = 3 * 1000 + 1
    assert zero_stage(1, 3, 3000) == (1, None)                                      # even: as asked
    stage, note = zero_stage(1, 3, uneven)                                          # uneven: off
    assert stage == 0 and "do not divide evenly over 3 processes: ZeRO is off" in note


def test_init_seed_is_part_of_a_random_inits_run():
    """--init-seed makes a random init's run: a resume with another one is another run."""
    from gpt2np.train.rundir import identity_differences
    ours = {"model": {"sha256": "ab"}, "data": {"train": [], "val": None},
            "settings": {"batch_size": 4}}
    random_init = {"model": {"init": "random"}, "data": ours["data"],
                   "settings": {"batch_size": 4, "init_seed": 7}}
    assert identity_differences(dict(random_init, settings={"batch_size": 4, "init_seed": 42}),
                                random_init) == ["--init-seed 42 there, 7 here"]


def test_a_folder_in_use_by_another_run_is_refused(files, tmp_path, capsys):
    """A run holds a lock on its -o for as long as it runs: a second run there, or a resume, stops
    in one line (they mixed their main.log lines, run.json and checkpoints); evaluating the latest
    checkpoint (-x 0 -y 1) writes nothing and may, with a note (the run's rotation may remove its
    checkpoint), and holds a shared lock that keeps a run from starting there meanwhile; once the
    holder ends the folder is free again."""
    import fcntl
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 1), capsys)
    assert code == 0, err
    before = snapshot(out)
    # another process's run, as the lock sees it
    holder = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for extra in (["-y", 1, "-x", 3], ["--overwrite", "-x", 1]):
            code, _, err = run(args(files, out, "-n", 1, *extra), capsys)
            assert code == 2
            one_error_line(err, f"{out} is in use by another gpt2np run", "use another -o")
        assert snapshot(out) == before
        code, stdout, err = run(args(files, out, "-x", 0, "-y", 1, "-v", 1, "-m", 1), capsys)
        assert code == 0 and "val loss" in stdout, err
        assert any(f"note: {out} is in use by another gpt2np run: its checkpoint rotation "
                   "(-nk) may remove" in line
                   for line in err), err
    finally:
        os.close(holder)
    # an evaluation there (-x 0 -y 1, a shared lock) keeps a run from starting until it ends
    reader = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH | fcntl.LOCK_NB)
        code, _, err = run(args(files, out, "-n", 1, "-y", 1, "-x", 3), capsys)
        assert code == 2
        one_error_line(err, f"{out} is in use by another gpt2np run", "use another -o")
    finally:
        os.close(reader)
    code, stdout, err = run(args(files, out, "-x", 0, "-y", 1, "-v", 1, "-m", 1), capsys)
    assert code == 0 and not any("in use" in line for line in err), err
    code, stdout, err = run(args(files, out, "-x", 3, "-n", 1, "-y", 1), capsys)
    assert code == 0 and "resuming from step 2" in stdout, err


@pytest.mark.parametrize("damage", [{"data": [1]}, {"data": "x"}, {"settings": [1]}, {"model": "m"},
                                    {"data": {"train": "a.bin", "val": None}}])
def test_a_run_json_of_the_wrong_shape_is_one_line(files, tmp_path, capsys, damage):
    """run.json whose model, data or settings are not what gpt2np writes: one line naming it
    (was a traceback)."""
    import json
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 1, "-n", 1), capsys)
    assert code == 0, err
    (out / "run.json").write_text(json.dumps(json.loads((out / "run.json").read_text()) | damage))
    for extra in (["-y", 1, "-x", 2], ["-x", 2]):
        code, _, err = run(args(files, out, "-n", 1, *extra), capsys)
        assert code == 2
        one_error_line(err, f"{out / 'run.json'}: damaged", "move it away")


def test_a_resume_with_only_incomplete_checkpoints_moves_the_attempts_files_aside(files, tmp_path,
                                                                                  capsys):
    """-y 1 where the only checkpoint is incomplete (a kill inside the first checkpoint) starts
    over: that attempt's main.log and checkpoint files go into previous-TIME/ (the
    log was truncated)."""
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 2), capsys)
    assert code == 0, err
    log = (out / "main.log").read_text()
    os.remove(out / "DONE_00000002")
    code, stdout, err = run(args(files, out, "-x", 1, "-n", 0, "-y", 1), capsys)
    assert code == 0 and any("nothing to resume" in line for line in err), err
    (previous,) = out.glob("previous-*")
    assert ((previous / "main.log").read_text() == log
            and (previous / "model_00000002.bin").is_file())
    assert not (out / "model_00000002.bin").exists()


def test_a_resume_with_only_incomplete_checkpoints_and_no_log_moves_them_aside(files, tmp_path,
                                                                               capsys):
    """The same without a main.log (-v 0 logs no line before the first step's): the incomplete
    checkpoint files go aside too, not left to be skipped with a note by every later resume."""
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 2, "-n", 2), capsys)
    assert code == 0, err
    os.remove(out / "DONE_00000002")
    os.remove(out / "main.log")
    code, stdout, err = run(args(files, out, "-x", 1, "-n", 0, "-y", 1), capsys)
    assert code == 0, err
    (previous,) = out.glob("previous-*")
    assert (previous / "model_00000002.bin").is_file() and not list(out.glob("*_00000002*"))


def test_signal_tests_pass_when_pytest_starts_with_signals_ignored():
    """pytest started with SIGINT and SIGTERM ignored (nohup, `cmd &` in a script, some CI runners):
    the signal tests, in this process and in child trainers, still pass (conftest gives the tests
    the default dispositions)."""
    rotation = "tests/test_checkpoint_rotation.py::"
    selected = ["tests/test_reliability_runs.py::test_signal_checkpoints_and_exits",
                rotation + "test_x0_stops_at_the_first_signal",
                rotation + "test_two_quick_signals_during_one_c_call_count_as_two",
                rotation + "test_nk_counts_checkpoints_that_exist_and_keeps_the_major_ones"]

    def ignore_signals():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *selected], cwd=REPO, capture_output=True, text=True,
                          timeout=20 * TIMEOUT, preexec_fn=ignore_signals)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]
