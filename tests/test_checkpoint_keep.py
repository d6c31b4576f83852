"""-nk N / -nm M (llm.c's checkpoint rotation): once the checkpoint of step s is complete, the one
of step s - N*n goes (model file, this process's state file, DONE marker) unless that step is a
multiple of M; nothing else in -o is touched, and -y 1 still resumes from the newest complete
checkpoint, bit for bit."""
import re

import numpy as np
import pytest

import train
from gpt2np.backends import get_backend
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import write_shard
from gpt2np.formats.checkpoint import (
    checkpoint_to_delete,
    delete_checkpoint,
    done_path,
    model_path,
    save_model,
    state_path,
)
from gpt2np.model import GPT2

TINY = GPT2Config(max_seq_len=32, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=4,
                  channels=32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keep")
    save_model(folder / "tiny.bin", TINY,
               GPT2(TINY, get_backend("numpy"), 1, 8, seed=3).params_host())
    rng = np.random.default_rng(0)
    write_shard(folder / "train.bin", rng.integers(0, 200, 4000).astype(np.uint16))
    return folder


def args(files, out, *more):
    return [str(a) for a in ["-e", files / "tiny.bin", "-i", files / "train.bin", "-b", 2, "-t", 16,
                             "--device", "cpu", "--precision", "fp32", "-s", 0, "-v", 0, "-l", 1e-3,
                             "-n", 1, "-o", out, *more]]


def checkpoints(out):
    """{step: the checkpoint's file names} in out."""
    found = {}
    for path in out.iterdir():
        if m := re.fullmatch(r"(?:model_(\d{8})\.bin|state_(\d{8})_\d{5}\.bin|DONE_(\d{8}))",
                             path.name):
            found.setdefault(int(next(g for g in m.groups() if g)), set()).add(path.name)
    return found


def whole(step):
    return {f"model_{step:08d}.bin", f"state_{step:08d}_00000.bin", f"DONE_{step:08d}"}


def test_the_rule_is_llmc_s():
    assert [checkpoint_to_delete(s, 1, 2) for s in range(1, 6)] == [None, None, 1, 2, 3]
    assert [checkpoint_to_delete(s, 10, 3, 20) for s in (30, 40, 50, 60)] == [None, 10, None, 30]
    # -nk 0, -n 0
    assert checkpoint_to_delete(9, 1, 0) is None and checkpoint_to_delete(9, 0, 2) is None
    # the last step off the -n grid: a step never written
    assert checkpoint_to_delete(7, 3, 1) == 4


def test_each_rank_deletes_only_its_own_files(tmp_path):
    names = ["model_00000004.bin", "state_00000004_00000.bin", "state_00000004_00001.bin",
             "DONE_00000004", "model_00000005.bin", "state_00000005_00001.bin",
             "model_00000004.bin.orig", "notes.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert delete_checkpoint(tmp_path, 4, rank=1) == [state_path(tmp_path, 4, 1)]
    assert delete_checkpoint(tmp_path, 4, rank=0) == [done_path(tmp_path, 4),
                                                      model_path(tmp_path, 4),
                                                      state_path(tmp_path, 4, 0)]
    assert delete_checkpoint(tmp_path, 4, rank=0) == []      # already gone: nothing, no error
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[4:])


def test_nk_keeps_the_last_n_and_touches_nothing_else(files, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    others = {"notes.txt": b"mine", "model_best.bin": b"a", "DONE_00000003.txt": b"b",
              "model_00000003.bin.orig": b"c"}
    for name, data in others.items():
        (out / name).write_bytes(data)
    (out / "old").mkdir()
    (out / "old" / "model_00000001.bin").write_bytes(b"d")
    assert train.main(args(files, out, "-x", 5, "-nk", 2)) == 0
    stdout = capsys.readouterr().out
    assert checkpoints(out) == {4: whole(4), 5: whole(5)}
    assert [line for line in stdout.splitlines() if line.startswith("Deleting")] == [
        f"Deleting checkpoint at step {s}" for s in (1, 2, 3)]          # llm.c's lines
    assert [line for line in stdout.splitlines() if line.startswith("Writing")] == [
        f"Writing checkpoint at step {s}" for s in range(1, 6)]
    assert all((out / name).read_bytes() == data for name, data in others.items())
    assert (out / "old" / "model_00000001.bin").read_bytes() == b"d"
    assert ({p.name for p in out.iterdir()}
            == set(others) | whole(4) | whole(5) | {"old", "run.json", "main.log"})


def test_nm_keeps_the_major_checkpoints(files, tmp_path, capsys):
    assert train.main(args(files, tmp_path, "-x", 7, "-nk", 2, "-nm", 3)) == 0
    assert checkpoints(tmp_path) == {3: whole(3), 6: whole(6), 7: whole(7)}
    assert "Deleting checkpoint at step 3" not in capsys.readouterr().out


def test_resume_after_rotation_is_bitwise(files, tmp_path, capsys):
    """-x 4 then -y 1 -x 6 (the lr is constant, so -x changes nothing else) equals one -x 6 run; a
    crash that leaves the newest checkpoint without its DONE marker resumes from the one before,
    also after rotation."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train.main(args(files, straight, "-x", 6, "-nk", 2)) == 0
    assert train.main(args(files, split, "-x", 4, "-nk", 2)) == 0
    assert checkpoints(split) == {3: whole(3), 4: whole(4)}
    capsys.readouterr()
    assert train.main(args(files, split, "-x", 6, "-nk", 2, "-y", 1)) == 0
    out = capsys.readouterr().out
    assert "resuming from step 4" in out and "Deleting checkpoint at step 4" in out
    assert checkpoints(split) == checkpoints(straight) == {5: whole(5), 6: whole(6)}
    for name in whole(6) - {"DONE_00000006"}:
        assert (split / name).read_bytes() == (straight / name).read_bytes(), name
    (split / "DONE_00000006").unlink()                                    # a crash before DONE_6
    assert train.main(args(files, split, "-x", 6, "-nk", 2, "-y", 1)) == 0
    out = capsys.readouterr()
    assert "resuming from step 5" in out.out and "skipping the checkpoint of step 6" in out.err
    assert ((split / "model_00000006.bin").read_bytes()
            == (straight / "model_00000006.bin").read_bytes())
    # step 6 - 2 = 4 is gone already
    assert checkpoints(split) == {5: whole(5), 6: whole(6)}
