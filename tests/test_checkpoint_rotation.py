"""Checkpoint rotation and rewriting beyond llm.c's -n grid, and signals during -x 0.

-nk K keeps the K newest checkpoints in -o, whatever steps they are at (a stop by signal, or a last
step off the -n grid, writes one llm.c's rule, step - K*n, never reaches), plus -nm's major ones; it
names only checkpoints that exist. A checkpoint rewritten (a resume from before it) loses its DONE
marker before any of its files is written again. -x 0 stops at the first SIGINT/SIGTERM. Tiny
models, in this process (the signals are sent to it).
"""
import errno
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import test_reliability_runs as reliability

from gpt2np.errors import WriteError
from gpt2np.formats import checkpoint
from gpt2np.formats.checkpoint import checkpoint_files, checkpoint_to_delete, checkpoints_to_delete
from gpt2np.train import checkpoints as run_checkpoints
from gpt2np.train import evaluate, loop
from gpt2np.train import setup as train_setup
from gpt2np.train.rundir import latest_complete_checkpoint

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 60                     # seconds any one subprocess may take
files = reliability.files        # the fixture: a tiny model, its shards and tokenizer
args, run = reliability.args, reliability.run


def checkpoints(out):
    """{step: the names of its checkpoint files} in out."""
    found = {}
    for path in Path(out).iterdir():
        if m := re.fullmatch(r"(?:model_(\d{8})\.bin|state_(\d{8})_\d{5}\.bin|DONE_(\d{8}))",
                             path.name):
            found.setdefault(int(next(g for g in m.groups() if g)), set()).add(path.name)
    return found


def whole(step):
    return {f"model_{step:08d}.bin", f"state_{step:08d}_00000.bin", f"DONE_{step:08d}"}


def deleted(stdout):
    return [int(m) for m in re.findall(r"^Deleting checkpoint at step (\d+)$", stdout, re.M)]


def signal_during_step(monkeypatch, at, signum=signal.SIGTERM):
    """SIGTERM (signum) to this process while step `at` (0-based) trains: the run stops after
    it, at step at + 1."""
    real = loop.train_step

    def step_then_signal(model, next_batch, *, step, **kwargs):
        if step == at:
            os.kill(os.getpid(), signum)
        return real(model, next_batch, step=step, **kwargs)

    monkeypatch.setattr(loop, "train_step", step_then_signal)


# ---- -nk beyond the -n grid ----------------------------------------------------------------------
def test_a_stop_off_the_grid_is_rotated_away(files, tmp_path, capsys, monkeypatch):
    """-n 2 -nk 1, SIGTERM during step 3: the stop's checkpoint 3 replaces 2 (llm.c's rule would
    name step 1, which never existed), and once resumed to 6 only checkpoint 6 is left, as in an
    uninterrupted run."""
    straight, out = tmp_path / "straight", tmp_path / "out"
    code, stdout, err = run(args(files, straight, "-x", 6, "-n", 2, "-nk", 1), capsys)
    assert code == 0, err
    assert checkpoints(straight) == {6: whole(6)} and deleted(stdout) == [2, 4]
    with monkeypatch.context() as patch:
        signal_during_step(patch, 2)
        code, stdout, err = run(args(files, out, "-x", 6, "-n", 2, "-nk", 1), capsys)
    assert code == 128 + signal.SIGTERM, err
    assert err == [f"stopped by SIGTERM after 3 steps: checkpoint of step 3 written to {out} "
                   "(resume with -y 1)"]
    assert deleted(stdout) == [2]                           # not "step 1"
    assert checkpoints(out) == {3: whole(3)}
    code, stdout, err = run(args(files, out, "-x", 6, "-n", 2, "-nk", 1, "-y", 1), capsys)
    assert code == 0 and "resuming from step 3" in stdout, err
    assert deleted(stdout) == [3, 4]
    assert checkpoints(out) == checkpoints(straight) == {6: whole(6)}
    for name in whole(6) - {"DONE_00000006"}:
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name


def test_a_last_step_off_the_grid_is_rotated_away(files, tmp_path, capsys):
    """-n 2 -nk 1 -x 5: the last step's checkpoint 5 replaces 4 (llm.c names step 3, never written,
    and keeps 4 for good); resumed to -x 8, checkpoint 5 goes too."""
    out = tmp_path / "out"
    code, stdout, err = run(args(files, out, "-x", 5, "-n", 2, "-nk", 1, "-k", "constant"), capsys)
    assert code == 0, err
    assert deleted(stdout) == [2, 4] and checkpoints(out) == {5: whole(5)}
    code, stdout, err = run(args(files, out, "-x", 8, "-n", 2, "-nk", 1, "-k", "constant", "-y", 1),
                            capsys)
    assert code == 0 and "resuming from step 5" in stdout, err
    assert deleted(stdout) == [5, 6] and checkpoints(out) == {8: whole(8)}


def test_nk_counts_checkpoints_that_exist_and_keeps_the_major_ones(files, tmp_path, capsys,
                                                                   monkeypatch):
    """-n 2 -nk 2 -nm 4: a stop at step 3 keeps 2 and 3; resumed to -x 9, the newest two (8, 9) and
    the major one (4) are left."""
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        signal_during_step(patch, 2, signal.SIGINT)
        code, stdout, err = run(args(files, out, "-x", 9, "-n", 2, "-nk", 2, "-nm", 4), capsys)
    assert code == 128 + signal.SIGINT, err
    assert deleted(stdout) == [] and checkpoints(out) == {2: whole(2), 3: whole(3)}
    code, stdout, err = run(args(files, out, "-x", 9, "-n", 2, "-nk", 2, "-nm", 4, "-y", 1), capsys)
    assert code == 0, err
    assert deleted(stdout) == [2, 3, 6]
    assert checkpoints(out) == {4: whole(4), 8: whole(8), 9: whole(9)}


def llmc_keeps(steps, every, keep, major):
    """The checkpoints llm.c's rule leaves after writing `steps` in order (every one of
    them is written)."""
    kept = set()
    for step in steps:
        kept.add(step)
        kept.discard(checkpoint_to_delete(step, every, keep, major))
    return kept


def test_on_the_grid_the_rule_is_llmcs():
    """Checkpoints on the -n grid only (the last step too): the same deletions as llm.c's step
    - K*n, every time."""
    for every, keep, major, steps in [(1, 2, 0, 12), (2, 3, 0, 20), (3, 1, 6, 30), (1, 2, 3, 10),
                                      (5, 2, 10, 60), (2, 1, 0, 2), (4, 4, 4, 40)]:
        found = {}
        for step in range(every, steps + 1, every):
            gone = checkpoints_to_delete(step, found, keep, major)
            assert gone == [s for s in [checkpoint_to_delete(step, every, keep, major)]
                            if s in found], (step, found)
            found = {s: True for s in found if s not in gone} | {step: True}
        assert set(found) == llmc_keeps(range(every, steps + 1, every), every, keep, major)


def test_the_rule_keeps_the_newest_that_exist():
    rng = random.Random(5)
    for _ in range(500):
        keep, major = rng.randint(1, 4), rng.choice([0, 0, 2, 3, 5])
        step = rng.randint(1, 40)
        found = {s: rng.random() < 0.8 for s in rng.sample(range(1, 50), rng.randint(0, 12))
                 if s != step}
        gone = checkpoints_to_delete(step, found, keep, major)
        assert gone == sorted(gone) and all(s in found and s < step for s in gone)
        assert not [s for s in gone if major and s % major == 0]                     # -nm's: never
        left = {s: done for s, done in found.items() if s not in gone} | {step: True}
        older_complete = sorted((s for s, done in left.items() if done and s <= step), reverse=True)
        assert step in older_complete[:keep]
        # of the complete ones up to step: the newest `keep`, and the major ones; incomplete
        # ones older than step go
        assert [s for s in older_complete[keep:] if not (major and s % major == 0)] == []
        assert [s for s, done in left.items()
                if not done and s < step and not (major and s % major == 0)] == []
        # newer: untouched
        assert all(s in left for s in found if s > step)
    # -nk 0: keep all
    assert checkpoints_to_delete(7, {5: True, 6: True}, 0) == []
    assert checkpoints_to_delete(3, {2: True, 1: True}, 1) == [1, 2]


def test_checkpoint_files_lists_the_steps_of_our_names_only(tmp_path):
    for name in ["model_00000004.bin", "state_00000004_00000.bin", "DONE_00000004",
                 "state_00000005_00001.bin", "model_00000006.bin", "DONE_00000007",
                 "model_00000003.bin.orig", "DONE_00000008.txt",
                 "model_8.bin", "notes.txt", ".model_00000009.bin.123.abcdef12.tmp"]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "DONE_00000010").mkdir()
    assert checkpoint_files(tmp_path) == {4: True, 5: False, 6: False, 7: True}
    assert checkpoint_files(tmp_path / "missing") == {}


# ---- a checkpoint rewritten ----------------------------------------------------------------------
def test_a_rewritten_checkpoint_loses_its_done_marker_first(files, tmp_path, capsys, monkeypatch):
    """Checkpoint 6 is damaged (its model file cut), so -y 1 resumes from 4 and writes 6 again; the
    write fails between the model and the state file (disk full): DONE_6 must be gone, else the new
    model_6 with the old state_6 would pass as the complete checkpoint of step 6."""
    out = tmp_path / "out"
    code, _, err = run(args(files, out, "-x", 6, "-n", 2), capsys)
    assert code == 0, err
    model6 = out / "model_00000006.bin"
    size = model6.stat().st_size
    model6.write_bytes(model6.read_bytes()[:-4])
    assert latest_complete_checkpoint(out)[0] == 4
    real = run_checkpoints.save_state

    def disk_full_at_state_6(path, *a, **k):
        if os.path.basename(path) == "state_00000006_00000.bin":
            assert model6.stat().st_size == size and not os.path.exists(out / "DONE_00000006")
            raise WriteError(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return real(path, *a, **k)

    monkeypatch.setattr(run_checkpoints, "save_state", disk_full_at_state_6)
    code, stdout, err = run(args(files, out, "-x", 6, "-n", 2, "-y", 1), capsys)
    assert code == 1 and "resuming from step 4" in stdout, err
    assert (err[-1] == f"error: writing {out / 'state_00000006_00000.bin'}: [Errno {errno.ENOSPC}] "
                       f"{os.strerror(errno.ENOSPC)}"), err
    assert not (out / "DONE_00000006").exists()
    # not the mix of two step 6's
    assert latest_complete_checkpoint(out)[0] == 4
    monkeypatch.undo()
    code, stdout, err = run(args(files, out, "-x", 6, "-n", 2, "-y", 1), capsys)
    assert code == 0 and "resuming from step 4" in stdout, err
    assert latest_complete_checkpoint(out)[0] == 6


def test_each_done_marker_is_synced_to_disk_with_its_folder(files, tmp_path, capsys, monkeypatch):
    """After DONE_s is made, -o is fsynced (so that a crash cannot lose the marker of a checkpoint
    the run reported as written); the model and state files before it are synced with their
    folder by atomic_write."""
    out = tmp_path / "out"
    synced = []
    real = run_checkpoints.sync_folder

    def sync_folder(folder):
        synced.append(sorted(p.name for p in Path(folder).glob("DONE_*")))
        real(folder)

    monkeypatch.setattr(run_checkpoints, "sync_folder", sync_folder)
    code, _, err = run(args(files, out, "-x", 4, "-n", 2), capsys)
    assert code == 0, err
    assert synced == [["DONE_00000002"], ["DONE_00000002", "DONE_00000004"]]


def test_a_done_marker_that_cannot_be_synced_is_not_left_behind(files, tmp_path, capsys,
                                                                monkeypatch):
    """EIO while syncing -o after DONE_2 is made: one line naming the marker, exit 1, and no DONE_2
    vouching for a checkpoint whose marker may not be on disk; removing a marker whose removal
    cannot be synced is one line too."""
    out = tmp_path / "out"

    def eio(folder):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(run_checkpoints, "sync_folder", eio)
    code, _, err = run(args(files, out, "-x", 2, "-n", 2), capsys)
    assert (code == 1 and err[-1] == f"error: writing {out / 'DONE_00000002'}: [Errno {errno.EIO}] "
                                     f"{os.strerror(errno.EIO)}"), err
    assert not (out / "DONE_00000002").exists() and (out / "model_00000002.bin").exists()
    (out / "DONE_00000002").touch()
    monkeypatch.setattr(checkpoint, "sync_folder", eio)
    with pytest.raises(WriteError) as e:
        checkpoint.remove_done_marker(out, 2)
    assert (str(e.value) == f"writing {out / 'DONE_00000002'}: [Errno {errno.EIO}] "
                            f"{os.strerror(errno.EIO)}")


# ---- -x 0 and signals ----------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("when", ["validation", "startup"])
def test_x0_stops_at_the_first_signal(signum, when, files, tmp_path, capsys, monkeypatch):
    """-x 0 has nothing to checkpoint: the first SIGINT/SIGTERM ends it where it is (during the
    validation, or before it starts), with the stop's one line and exit code."""
    real, evaluated = evaluate.val_loss, []

    def signal_then_evaluate(*a, **k):
        if when == "validation":
            os.kill(os.getpid(), signum)
        evaluated.append(real(*a, **k))
        return evaluated[-1]

    def signal_then_load(*a, **k):
        os.kill(os.getpid(), signum)
        return real_load(*a, **k)

    real_load = train_setup.load_hellaswag
    monkeypatch.setattr(evaluate, "val_loss", signal_then_evaluate)
    if when == "startup":
        monkeypatch.setattr(train_setup, "load_hellaswag", signal_then_load)
    code, stdout, err = run(args(files, tmp_path / "out", "-x", 0, "-v", 1, "-m", 4, "-s", 1, "-g",
                                 4), capsys)
    assert code == 128 + signum, (stdout, err)
    name = signal.Signals(signum).name
    assert err == [f"stopped by {name} after 0 steps: -x 0 trains nothing, nothing to save"], err
    assert evaluated == [] and "val loss" not in stdout and "generating" not in stdout
    assert not (tmp_path / "out").exists()


def test_x0_stops_at_a_signal_from_outside_during_a_long_validation(files, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "GPT2NP_TEST_"))}
    env.update(PYTHONPATH=str(REPO), GPT2NP_NVTX="0", PYTHONUNBUFFERED="1", GPT2NP_PROGRESS="off")
    argv = [sys.executable, str(REPO / "train.py"),
            *map(str, args(files, tmp_path / "out", "-x", 0, "-v", 1, "-m", 10 ** 7))]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + TIMEOUT
    while not any(line.startswith("-x 0: no training") for line in lines) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    # inside the validation (10^7 batches: minutes)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(TIMEOUT)
        pytest.fail("-x 0 went on validating after SIGTERM")
    reader.join(TIMEOUT)
    stderr = proc.stderr.read()
    assert code == 128 + signal.SIGTERM, stderr
    assert stderr.splitlines() == ["stopped by SIGTERM after 0 steps: -x 0 trains "
                                   "nothing, nothing to save"], stderr
    assert not any(line.startswith("val loss") for line in lines)


def test_the_trainers_reach_is_llmcs():
    """The trainer deletes back to step - K*n (llm.c's reach) only: a run that kept every checkpoint
    and is resumed with -nk 2 -n 1 loses one a step, as llm.c's would; off-grid checkpoints inside
    the reach go (a stop's at 3)."""
    everything = dict.fromkeys(range(1, 11), True)
    assert checkpoints_to_delete(11, everything, 2, reach=2) == [9]
    # no reach: all but 10
    assert checkpoints_to_delete(11, everything, 2) == list(range(1, 10))
    # -n 2 -nk 1, a stop at 3
    assert checkpoints_to_delete(4, {2: True, 3: True}, 1, reach=2) == [2, 3]
    # an incomplete one too
    assert checkpoints_to_delete(6, {4: True, 5: False}, 1, reach=2) == [4, 5]


def test_a_signal_ignored_by_whoever_started_us_stays_ignored():
    """`cmd &` in a script starts cmd with SIGINT ignored: StopSignals leaves it so (it took it over
    before), and still handles SIGTERM; both are as they were afterwards."""
    from gpt2np.train.interrupts import StopSignals
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not old_term
        assert (signal.getsignal(signal.SIGINT) is signal.SIG_IGN
                and signal.getsignal(signal.SIGTERM) is old_term)
    finally:
        signal.signal(signal.SIGINT, old_int)


TWO_QUICK_SIGNALS = r"""
import os, signal, sys, threading, time
import numpy as np
from gpt2np.train.interrupts import StopSignals
count, signum = int(sys.argv[1]), getattr(signal, sys.argv[2])
a = np.random.default_rng(0).random(30_000_000)
with StopSignals() as signals:
    def send():
        time.sleep(0.3)                  # the main thread is inside np.sort by now
        for _ in range(count):
            os.kill(os.getpid(), signum)
            time.sleep(0.01)
    started = time.monotonic()
    threading.Thread(target=send).start()
    while time.monotonic() - started < 0.5:
        np.sort(a)                       # one C call of ~1 s: Python's handlers wait for it
    print("recorded", signals.name, flush=True)
"""


@pytest.mark.parametrize("count, name", [(1, "SIGINT"), (2, "SIGINT"), (2, "SIGTERM")])
def test_two_quick_signals_during_one_c_call_count_as_two(tmp_path, count, name):
    """Python runs a handler once for signals that arrive while the main thread is in one C call (a
    checkpoint's write): two Ctrl-C 10 ms apart still exit at once (the wakeup fd counts them); one
    is recorded, as always. Two SIGTERMs at once are one stop: mpiexec passes on the one a scheduler
    sent the whole job, ranks included."""
    script = tmp_path / "two.py"
    script.write_text(TWO_QUICK_SIGNALS)
    done = subprocess.run([sys.executable, str(script), str(count), name], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    if count == 1 or name == "SIGTERM":
        assert done.returncode == 0 and done.stdout == f"recorded {name}\n", done.stderr
    else:
        assert done.returncode == 130 and done.stdout == "", done.stdout + done.stderr
        assert (done.stderr
                == "error: SIGINT again: exiting now, without a checkpoint\n"), done.stderr
