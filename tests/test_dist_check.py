"""Ranks started differently (another -b, -l, model file, model size or data) stop together with one
line naming the rank and the difference, instead of training on silently or failing
vaguely in a collective.

The launches use mpiexec's MPMD form, `mpiexec -n 1 ARGV0 : -n 1 ARGV1`, to give rank 1 other flags.
The comparison itself (dist.run_fingerprint, fingerprint_differences, mismatch_line, check_same_run)
is also tested without MPI.
"""
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from test_dist import REPO, TINY, clean_env, find_mpiexec

from gpt2np import dist as dist_mod
from gpt2np.backends import device_traits
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import TrainConfig
from gpt2np.datasets.data import DataLoader, write_shard
from gpt2np.dist import (
    RunMismatch,
    SingleProcess,
    check_same_run,
    fingerprint_differences,
    mismatch_line,
    run_fingerprint,
)
from gpt2np.formats.checkpoint import save_model
from gpt2np.model import GPT2

T = 16
RUN_TIMEOUT = 60


@pytest.fixture(scope="module")
def mpiexec():
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install 'gpt2np[dist]')")
    exe = find_mpiexec()
    if exe is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    probe = [sys.executable, "-c", "from mpi4py import MPI; "
             "print(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())"]
    # a launcher that failed once under a loaded CI machine may start the next
    for _ in range(3):
        code, out, err, _ = launch_ranks(exe, probe)
        if code == 0 and sorted(out.splitlines()) == ["0 2", "1 2"]:
            return exe
        time.sleep(1.0)
    pytest.skip(f"{exe} does not start an MPMD job of 2 ranks that mpi4py sees as one (3 tries): "
                f"exit {code}, {out!r} {err[-2000:]!r}")


def launch_ranks(mpiexec, argv0, argv1=None):
    """Rank 0 runs argv0, rank 1 argv1 (default: the same); (returncode, stdout,
    stderr, seconds)."""
    argv1 = argv0 if argv1 is None else argv1
    cmd = [mpiexec, "-n", "1", *map(str, argv0), ":", "-n", "1", *map(str, argv1)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT, env=clean_env())
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist_check")
    for name, cfg, seed in (("tiny.bin", TINY, 5), ("tiny_other_weights.bin", TINY, 6),
                            ("wider.bin", replace(TINY, channels=64), 5)):
        save_model(folder / name, cfg, GPT2(cfg, NumpyBackend(), 1, T, seed=seed).params_host())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TINY.vocab_size, 6000)
    write_shard(folder / "train.bin", tokens)
    write_shard(folder / "val.bin", rng.integers(0, TINY.vocab_size, 1000))
    (folder / "other").mkdir()
    # same name and size, other tokens
    write_shard(folder / "other" / "train.bin", tokens[::-1])
    return folder


def train_argv(files, *changes):
    """train.py's argv for a 2-step run with `changes` (flag, value) pairs
    replacing the defaults."""
    flags = {"-e": files / "tiny.bin", "-i": files / "train.bin", "-j": files / "val.bin", "-b": 3,
             "-t": T, "-x": 2, "-v": 2, "-m": 1, "-s": 0, "-l": 0.003, "--device": "cpu"}
    flags.update(dict(changes))
    return [sys.executable, REPO / "train.py", *[str(x) for kv in flags.items() for x in kv]]


SUM = "maxT=17 V=200 Vp=256 L=2 NH=2"
MISMATCHES = {  # name: (rank 1's change, the line every run must print)
    "-b": (("-b", 2), "error: rank 1 of 2: -b 2 differs from rank 0's -b 3"),
    "-l": (("-l", 0.001), "error: rank 1 of 2: -l 0.001 differs from rank 0's -l 0.003"),
    "model file": (("-e", "{files}/tiny_other_weights.bin"),
                   "error: rank 1 of 2: -e weights sha256 "),
    "model size": (("-e", "{files}/wider.bin"),
                   f"error: rank 1 of 2: -e model {SUM} C=64 differs from rank 0's -e model {SUM} "
                   "C=32; its -e weights differs too"),
    "data": (("-i", "{files}/other/train.bin"),
             "error: rank 1 of 2: -i shard 0 train.bin (6000 tokens, sha256 "),
}


@pytest.mark.parametrize("name", MISMATCHES)
def test_ranks_started_differently_stop_with_one_line(mpiexec, files, name):
    (flag, value), expected = MISMATCHES[name]
    value = value.format(files=files) if isinstance(value, str) else value
    code, out, err, seconds = launch_ranks(mpiexec, train_argv(files),
                                           train_argv(files, (flag, value)))
    assert code != 0, out + err
    assert seconds < 30
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    # one line, from rank 0 alone
    assert len(errors) == 1 and errors[0].startswith(expected), err
    # stopped before the first step
    assert "Traceback" not in err and "step" not in out


def test_ranks_started_alike_train(mpiexec, files):
    """The MPMD form itself is fine: equal flags (and a per-rank setting such as
    --dist-timeout) train."""
    code, out, err, _ = launch_ranks(mpiexec, train_argv(files),
                                     train_argv(files, ("--dist-timeout", 300)))
    assert code == 0, err
    assert "step    2/2" in out


# ---- the comparison without MPI ------------------------------------------------------------------

def fingerprint(files, cfg=None, params_from="tiny.bin", train="train.bin"):
    from gpt2np.formats.checkpoint import load_model
    cfg = (cfg or TrainConfig(batch_size=3, seq_len=T, learning_rate=0.003))
    cfg = cfg.with_device_defaults(device_traits("numpy"))
    model_cfg, params = load_model(files / params_from)
    loader = DataLoader(str(files / train), cfg.batch_size, T)
    return run_fingerprint(cfg, NumpyBackend(), model_cfg, params, loader)


def test_fingerprint_holds_settings_model_and_data(files):
    fp = fingerprint(files)
    assert fp["-b"] == "3" and fp["-l"] == "0.003" and fp["--shuffle"] == "1" and fp["-o"] == "none"
    assert fp["--device"] == "numpy (fp32, exact math)" and fp["-e model"] == f"{SUM} C=32"
    from gpt2np.formats.checkpoint import load_model
    model_cfg, params = load_model(files / "tiny.bin")
    fast = NumpyBackend(math="fast")                        # exact where the C loops do not build
    assert run_fingerprint(TrainConfig().with_device_defaults(device_traits("numpy")), fast,
                           model_cfg, params, None)["--device"] == f"numpy (fp32, {fast.math} math)"
    assert (fp["-e weights"].startswith("sha256 ") and fp["-i shards"] == "1"
            and fp["-j shards"] == "none")
    assert fp["-i shard 0"].startswith("train.bin (6000 tokens, sha256 ")
    for per_rank in ("--dist-timeout", "--nvtx", "--profile", "-s", "-g", "--temperature",
                     "--top-k"):
        assert per_rank not in fp
    for by_content in ("-i", "-j"):             # compared by the shards they name
        assert by_content not in fp


def test_differences_and_the_line(files):
    ref = fingerprint(files)
    assert fingerprint_differences(fingerprint(files), ref) == []
    other = fingerprint(files,
                        TrainConfig(batch_size=3, seq_len=T, learning_rate=0.003, dist_timeout=5))
    # the timeout is each rank's own
    assert fingerprint_differences(other, ref) == []
    wider = fingerprint(files, params_from="wider.bin")
    diffs = fingerprint_differences(wider, ref)
    assert [d[0] for d in diffs] == ["-e model", "-e weights"]
    one_shard_more = dict(ref, **{"-i shards": "2", "-i shard 1": "x.bin (9 tokens, sha256 0)"})
    assert (fingerprint_differences(one_shard_more, ref)[1]
            == ("-i shard 1", "x.bin (9 tokens, sha256 0)", "(none)"))
    assert mismatch_line([[], [], []]) is None
    b = [("-b", "2", "3")]
    assert mismatch_line([[], b]) == "rank 1 of 2: -b 2 differs from rank 0's -b 3"
    many = [("-b", "2", "3")] + [(f"-{c}", "1", "0") for c in "lukqc"]
    assert mismatch_line([[], [], many, b, [], b]) == (
        "rank 2 of 6: -b 2 differs from rank 0's -b 3; its -l, -u, -k, -q and 1 more differ too; "
        "ranks 3, 5 differ from rank 0 too")


class FakeGroup:
    """Rank `rank` of 2, with rank 0's fingerprint `reference` and the other rank's
    differences given."""

    def __init__(self, rank, reference, others_differences):
        self.rank, self.world_size = rank, 2
        self.reference, self.others = reference, others_differences

    def broadcast_object(self, obj):
        return obj if self.rank == 0 else self.reference

    def all_gather_object(self, obj):
        return [obj, self.others] if self.rank == 0 else [self.others, obj]


def test_check_same_run_stops_every_rank_together(monkeypatch):
    monkeypatch.setattr(dist_mod, "_ranks_stopping", False)
    ref, mine = {"-b": "3"}, {"-b": "2"}
    # all agree: nothing happens
    check_same_run(FakeGroup(0, ref, []), ref)
    check_same_run(SingleProcess(), lambda: pytest.fail("one process: no fingerprint needed"))
    with pytest.raises(RunMismatch, match="^rank 1 of 2: -b 2 differs from rank 0's -b 3$"):
        check_same_run(FakeGroup(0, ref, [("-b", "2", "3")]), ref)             # rank 0 says it
    with pytest.raises(SystemExit) as e:
        # the others end without a word
        check_same_run(FakeGroup(1, ref, []), mine)
    assert e.value.code == 1
    # abort_job will not MPI_Abort
    assert dist_mod._ranks_stopping
