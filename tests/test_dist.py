"""Data-parallel training on the CPU under mpiexec (MPICH from pip, numpy backend, MPI collectives).

2 ranks x B equals 1 rank x 2B over 5 steps (losses, val loss, weights); ZeRO-1 equals plain data
parallel, also with 3 ranks whose shards do not divide the parameters evenly; its sharded AdamW
state concatenates to the unsharded one; resume per rank is bit-identical; a rank that dies, raises
or hangs ends the job non-zero with a clear message instead of hanging.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.datasets.data import write_shard
from gpt2np.dist import LAUNCHER_RANK_VARS, shard_bounds
from gpt2np.formats.checkpoint import load_model, load_state, model_path, save_model, state_path
from gpt2np.model import GPT2
from gpt2np.tensors import num_parameters

REPO = Path(__file__).resolve().parent.parent
# maxT=17 makes num_parameters = 34208, not a multiple of 3: the 3-rank ZeRO run has
# an uneven last shard
TINY = GPT2Config(max_seq_len=17, vocab_size=200, padded_vocab_size=256, num_layers=2, num_heads=2,
                  channels=32)
GLOBAL_B, T, STEPS = 6, 16, 5
RUN_TIMEOUT = 60


def find_mpiexec():
    """mpiexec beside this Python (the mpich wheel installs it there), else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "mpiexec"
    return str(here) if here.is_file() else shutil.which("mpiexec")


def mpiexec_problem(exe):
    """None when `exe -n 2` starts 2 ranks that mpi4py sees as one job, else why not (the
    fixture's skip reason)."""
    probe = subprocess.run([exe, "-n", "2", sys.executable, "-c",
                            "from mpi4py import MPI; c = MPI.COMM_WORLD; c.Get_rank() or "
                            "print(c.Get_size())"],
                           capture_output=True, text=True, timeout=RUN_TIMEOUT, env=clean_env())
    if probe.returncode != 0 or probe.stdout.split() != ["2"]:
        return (f"{exe} does not start 2 ranks that mpi4py sees as one job: {probe.stdout!r} "
                f"{probe.stderr!r}")
    return None


@pytest.fixture(scope="module")
def mpiexec():
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install 'gpt2np[dist]')")
    exe = find_mpiexec()
    if exe is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    problem = mpiexec_problem(exe)
    if problem:
        pytest.skip(problem)
    return exe


# Open MPI's mpiexec refuses to start as root (as in many containers) unless both say it is
# meant; MPICH ignores them
OMPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# Open MPI 4 looks for ssh or rsh at start even for a job on this machine alone, and stops without
# either ("The value of the MCA parameter "plm_rsh_agent" was set to a path that could not be
# found", seen on an H100 machine lent to a session); its single-node launcher takes over when the
# rsh one is excluded (open-mpi/ompi#12386)
OMPI_NO_RSH = {"OMPI_MCA_plm": "^rsh"}


def ompi_env() -> dict:
    """The Open MPI settings a local test job needs here (MPICH ignores them): consent to run as
    root where we are root, and no rsh launcher where neither ssh nor rsh is installed."""
    env = dict(OMPI_AS_ROOT) if os.geteuid() == 0 else {}
    if shutil.which("ssh") is None and shutil.which("rsh") is None:
        env.update(OMPI_NO_RSH)
    return env


def clean_env(**extra):
    """The environment of a launched job: no launcher's variables from the job pytest may run in (a
    rank's own would confuse the job's), ompi_env()'s settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_RANK_VARS and not k.startswith(("PMI_", "PMIX_", "OMPI_",
                                                                "GPT2NP_TEST_"))}
    env.update(ompi_env())
    env.update(GPT2NP_NVTX="0", PYTHONPATH=str(REPO), **extra)
    return env


def test_open_mpi_starts_as_root_and_other_launcher_failures_still_skip_with_their_reason(
        tmp_path, monkeypatch):
    """As root (as in many containers) Open MPI's mpiexec refuses to start unless
    OMPI_ALLOW_RUN_AS_ROOT and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM say it is meant: the probe and the
    launched jobs carry both there, and only there. The stand-in mpiexec answers the probe as 2
    ranks would, once both are set."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\n"
                    'if [ "$OMPI_ALLOW_RUN_AS_ROOT" = 1 ] && [ '
                    '"$OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" = 1 ]; then\n'
                    "  echo 2; exit 0\nfi\n"
                    "echo 'mpiexec has detected an attempt to run as root.' >&2; exit 1\n")
    fake.chmod(0o755)
    # a launcher's own variables never pass on
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    # ssh is there
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    assert mpiexec_problem(str(fake)) is None
    assert launch(str(fake), 2, ["true"])[:2] == (0, "2\n")
    env = clean_env()
    assert {k: v for k, v in env.items() if k.startswith("OMPI_")} == OMPI_AS_ROOT
    # not root: nothing added, and a refusal is the reason
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert not any(k.startswith("OMPI_") for k in clean_env())
    problem = mpiexec_problem(str(fake))
    assert (problem.startswith(f"{fake} does not start 2 ranks")
            and "attempt to run as root" in problem)


def test_open_mpi_gets_its_single_node_launcher_where_there_is_no_ssh(tmp_path, monkeypatch):
    """Without ssh and rsh Open MPI 4 stops at start, even for a job on this machine alone: the
    stand-in mpiexec refuses as it does unless its rsh launcher is excluded, which the jobs'
    environment then does."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\n"
                    'if [ "$OMPI_MCA_plm" = "^rsh" ]; then echo 2; exit 0; fi\n'
                    "echo 'The value of the MCA parameter \"plm_rsh_agent\" was set to a "
                    "path' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name in ("ssh", "rsh")
                        else f"/usr/bin/{name}")
    assert mpiexec_problem(str(fake)) is None
    assert {k: v for k, v in clean_env().items() if k.startswith("OMPI_")} == OMPI_NO_RSH
    # ssh installed: unchanged
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    assert "plm_rsh_agent" in mpiexec_problem(str(fake))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist")
    model = GPT2(TINY, NumpyBackend(), 1, T, seed=5)
    save_model(folder / "tiny.bin", TINY, model.params_host())
    rng = np.random.default_rng(0)
    write_shard(folder / "train.bin", rng.integers(0, TINY.vocab_size, 12000))
    write_shard(folder / "val.bin", rng.integers(0, TINY.vocab_size, 2000))
    return folder


def train_argv(files, out, ranks, *extra):
    return [sys.executable, str(REPO / "train.py"), "-e", files / "tiny.bin", "-i",
            files / "train.bin", "-j", files / "val.bin", "-b", GLOBAL_B // ranks, "-t", T, "-x",
            STEPS, "-v", STEPS, "-m", 2,
            "-s", 0, "-l", 3e-3, "-u", 2, "-q", 0.1, "-c", 0.1, "--device", "cpu",
            # file order: llm.c's shuffle draws each rank's own order (seed 42 + rank)
            "--shuffle", 0,
            "-n", 3, "-o", out, *extra]


def launch(mpiexec, ranks, argv, env=None, launcher_flags=()):
    """Run argv under `mpiexec -n ranks` (ranks=None: a plain process); (returncode, stdout,
    stderr, seconds)."""
    cmd = [str(a) for a in argv]
    if ranks is not None:
        cmd = [mpiexec, *launcher_flags, "-n", str(ranks), *cmd]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          env=env or clean_env())
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


def step_losses(text):
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+)", text)]


def val_losses(text):
    return [float(x) for x in re.findall(r"val loss ([0-9.]+)", text)]


@pytest.fixture(scope="module")
def runs(mpiexec, files):
    """The same 5 steps, 6 sequences per step, split four ways: {name: (out_dir, stdout)}."""
    plans = {"1x6": (None, ()), "2x3": (2, ()), "2x3 zero1": (2, ("-z", 1)),
             "3x2 zero1": (3, ("-z", 1))}
    results = {}
    for name, (ranks, extra) in plans.items():
        out = files / name.replace(" ", "_")
        code, stdout, stderr, _ = launch(mpiexec, ranks, train_argv(files, out, ranks or 1, *extra))
        assert code == 0, f"{name}: {stderr}"
        assert len(step_losses(stdout)) == STEPS, (f"{name}: rank 0 alone prints the "
                                                   f"steps:\n{stdout}")
        results[name] = (out, stdout)
    return results


def params_of(out):
    return load_model(model_path(out, STEPS))[1]


def test_two_ranks_equal_one_rank_with_twice_the_batch(runs, files):
    (one, out1), (two, out2) = runs["1x6"], runs["2x3"]
    assert "batch_size B=3 * seq_len T=16 * num_processes=2 and total_batch_size=96" in out2
    np.testing.assert_allclose(step_losses(out2), step_losses(out1), rtol=1e-5)
    np.testing.assert_allclose(val_losses(out2), val_losses(out1), rtol=1e-5)
    np.testing.assert_allclose(params_of(two), params_of(one), rtol=0, atol=2e-5)
    # it did train
    assert np.abs(params_of(two) - load_model(files / "tiny.bin")[1]).max() > 1e-3
    # every rank wrote its own state, and plain data parallel keeps the ranks'
    # AdamW moments identical
    _, m0, v0 = load_state(state_path(two, STEPS, 0))
    info1, m1, v1 = load_state(state_path(two, STEPS, 1))
    assert info1["rank"] == 1 and info1["world_size"] == 2 and info1["zero_stage"] == 0
    assert np.array_equal(m0, m1) and np.array_equal(v0, v1)


@pytest.mark.parametrize("zero, plain", [("2x3 zero1", "2x3"), ("3x2 zero1", "1x6")])
def test_zero1_equals_plain_data_parallel(runs, zero, plain):
    (z_out, z_text), (p_out, p_text) = runs[zero], runs[plain]
    np.testing.assert_allclose(step_losses(z_text), step_losses(p_text), rtol=1e-5)
    np.testing.assert_allclose(params_of(z_out), params_of(p_out), rtol=0, atol=2e-5)
    # each rank holds the AdamW moments of its shard only; together they are the unsharded moments
    ranks = int(zero[0])
    bounds = shard_bounds(num_parameters(TINY), ranks)
    # llm.c's rule: parameters that do not divide evenly: stage 0
    if num_parameters(TINY) % ranks:
        assert "do not divide evenly over 3 processes: ZeRO is off (stage 0)" in z_text
        info, m, _ = load_state(state_path(z_out, STEPS, 2))
        assert info["zero_stage"] == 0 and m.size == num_parameters(TINY)
        return
    states = [load_state(state_path(z_out, STEPS, r)) for r in range(ranks)]
    for r, (info, m, _) in enumerate(states):
        assert (info["zero_stage"] == 1 and tuple(info["shard"]) == bounds[r]
                and m.size == bounds[r][1] - bounds[r][0])
    _, m_full, v_full = load_state(state_path(p_out, STEPS, 0))
    np.testing.assert_allclose(np.concatenate([m for _, m, _ in states]), m_full, rtol=1e-3,
                               atol=1e-7)
    np.testing.assert_allclose(np.concatenate([v for _, _, v in states]), v_full, rtol=1e-3,
                               atol=1e-9)


def test_resume_per_rank_is_bit_identical(mpiexec, files, runs, tmp_path):
    full, _ = runs["2x3 zero1"]
    for name in ("model_00000003.bin", "state_00000003_00000.bin", "state_00000003_00001.bin",
                 "DONE_00000003"):
        shutil.copy(full / name, tmp_path / name)
    code, out, err, _ = launch(mpiexec, 2, train_argv(files, tmp_path, 2, "-z", 1, "-y", 1))
    assert code == 0, err
    assert "resuming from step 3" in out and len(step_losses(out)) == 2
    assert ((tmp_path / "model_00000005.bin").read_bytes()
            == (full / "model_00000005.bin").read_bytes())
    # another world size or ZeRO stage cannot take over these per-rank states: one clear line
    code, _, err, _ = launch(mpiexec, None, train_argv(files, tmp_path, 1, "-z", 1, "-y", 1))
    assert code != 0 and "written by 2 processes; resume needs the same number, got 1" in err
    code, _, err, _ = launch(mpiexec, 2, train_argv(files, tmp_path, 2, "-y", 1))
    assert code != 0 and "written with ZeRO stage 1 (-z); resume needs the same, got -z 0" in err


def test_checkpoint_rotation_under_mpiexec(mpiexec, files, tmp_path):
    """-n 1 -nk 2 with 2 ranks: each rank deletes its own state file of the old checkpoint, rank 0
    the model and DONE files and prints the line; the last 2 checkpoints stay whole, and -y 1
    resumes from the newest."""
    code, out, err, _ = launch(mpiexec, 2, train_argv(files, tmp_path, 2, "-n", 1, "-nk", 2))
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("Deleting")] == [
        f"Deleting checkpoint at step {s}" for s in range(1, STEPS - 1)]
    kept = {f"{kind}_{s:08d}{tail}" for s in (STEPS - 1, STEPS)
            for kind, tail in (("model", ".bin"), ("state", "_00000.bin"), ("state", "_00001.bin"),
                               ("DONE", ""))}
    assert {p.name for p in tmp_path.iterdir()} == kept | {"run.json", "main.log"}
    code, out, err, _ = launch(mpiexec, 2,
                               train_argv(files, tmp_path, 2, "-n", 1, "-nk", 2, "-y", 1))
    assert code == 0 and f"resuming from step {STEPS}" in out, err


# The collectives on their own, on buffers whose size does not divide by the number of ranks.
# argv[1]: numpy (MPI on host buffers) or cuda (NCCL on CuPy buffers, one GPU per rank; used
# by test_gpu_dist.py).
COLLECTIVES_CHECK = """
import sys
import numpy as np
from mpi4py import MPI
from gpt2np.dist import HostCollectives, NcclCollectives, select_gpu, shard_bounds

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
if sys.argv[1] == "cuda":
    import cupy as xp
    select_gpu(comm)
    coll, to_host = NcclCollectives(comm), xp.asnumpy
else:
    xp, coll, to_host = np, HostCollectives(comm), np.asarray
n = 1000 * world + world - 1                     # the last rank's shard is world - 1 longer
grads = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(world)]
mean = np.mean(grads, axis=0)
bounds = shard_bounds(n, world)
lo, hi = bounds[rank]

buf = xp.asarray(grads[rank])
coll.all_reduce_mean(buf)
np.testing.assert_allclose(to_host(buf), mean, rtol=1e-6, atol=1e-6)

buf = xp.asarray(grads[rank])
coll.reduce_scatter_mean(buf, bounds)
np.testing.assert_allclose(to_host(buf)[lo:hi], mean[lo:hi], rtol=1e-6, atol=1e-6)

params = np.full(n, -1.0, np.float32)
params[lo:hi] = np.arange(lo, hi)
buf = xp.asarray(params)
coll.all_gather(buf, bounds)
assert np.array_equal(to_host(buf), np.arange(n, dtype=np.float32)), to_host(buf)
comm.Barrier()
print(f"rank {rank} of {world}: collectives ok")
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_host_collectives_on_uneven_shards(mpiexec, ranks):
    code, out, err, _ = launch(mpiexec, ranks, [sys.executable, "-c", COLLECTIVES_CHECK, "numpy"])
    assert code == 0, out + err
    assert out.count("collectives ok") == ranks


FAULTS = [  # (mode, launcher flags, what stderr must say)
    ("raise", (), ["error: GPT2NP_TEST_FAULT: simulated failure on rank 1",
                   "rank 1 of 2 failed; aborting all ranks"]),
    ("hang", (), ["error: rank 0 of 2: all-reduce of the gradients did not finish within 3 s"]),
    # hydra's default: when a rank exits, the launcher itself kills the others at once
    ("exit", (), []),
    # a launcher that leaves the other ranks running (as when a node vanishes):
    # our watchdog ends them
    ("exit", ("-disable-auto-cleanup",),
     ["error: rank 0 of 2: all-reduce of the gradients did not finish"]),
]


@pytest.mark.parametrize("mode, launcher_flags, expected", FAULTS,
                         ids=["raise", "hang", "exit", "exit-no-cleanup"])
def test_a_failing_rank_ends_the_job_with_a_clear_error(mpiexec, files, tmp_path, mode,
                                                        launcher_flags, expected):
    if launcher_flags and "HYDRA" not in subprocess.run([mpiexec, "--version"], capture_output=True,
                                                        text=True).stdout:
        pytest.skip("-disable-auto-cleanup is a flag of MPICH's hydra launcher")
    env = clean_env(GPT2NP_TEST_FAULT=f"1:2:{mode}")
    code, out, err, seconds = launch(mpiexec, 2,
                                     train_argv(files, tmp_path, 2, "--dist-timeout", 3), env=env,
                                     launcher_flags=launcher_flags)
    assert code != 0, out + err
    assert seconds < 30
    assert len(step_losses(out)) == 2                 # steps 1 and 2 ran, step 3 never finished
    for line in expected:
        assert line in err, err


def test_a_nan_loss_under_mpiexec_is_one_line_and_every_rank_stops_without_an_abort(mpiexec, files,
                                                                                    tmp_path):
    """Every rank sees the same averaged loss and global norm, so every rank stops at the same step:
    rank 0 says why in one line, the others exit 1 quietly, nobody MPI_Aborts
    (dist.stop_together)."""
    code, out, err, seconds = launch(mpiexec, 2, train_argv(files, tmp_path, 2, "-l", 1e9, "-x", 8))
    assert code == 1, out + err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(r"error: step \d+: the (loss|gradient norm) is (nan|inf)",
                                         errors[0]), err
    assert "aborting all ranks" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("extra, says", [
    # before MPI starts
    (("-b", "0"), "error: -b 0: the micro batch size B must be an integer >= 1"),
    # argparse's own
    (("-k", "foo"), "error: argument -k: invalid choice: 'foo'"),
    (("-d", 48), "error: -d 48 with -b 3 -t 16 on 2 process(es): the total batch size must be a "
                 # known with MPI only
                 "multiple of B*T*processes = 96")])
def test_bad_flags_under_mpiexec_are_one_line(mpiexec, files, tmp_path, extra, says):
    """Every rank parses the same flags and finds the same fault: rank 0 alone says it, in one line,
    exit 2, and no rank aborts the job."""
    code, out, err, _ = launch(mpiexec, 2, train_argv(files, tmp_path, 2, *extra))
    assert code == 2, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(says), err


@pytest.mark.parametrize("case", ["missing train data", "another run's checkpoints",
                                  "another process count", "-o a file", "-o under a file"])
def test_bad_files_under_mpiexec_are_one_line(mpiexec, files, tmp_path, case):
    """Bad input found in the files (a missing -i, -o holding another run's checkpoints, a resume by
    another number of processes): one line, from rank 0, exit 2, no abort (dist.stop_on_problem; was
    every rank's line, then MPI's abort lines)."""
    out = tmp_path / "out"
    if case == "missing train data":
        argv = train_argv(files, out, 2, "-i", tmp_path / "missing.bin")
        says = f"error: {tmp_path / 'missing.bin'}"
    elif case.startswith("-o"):
        (tmp_path / "afile").write_text("x")
        target = tmp_path / "afile" / ("sub" if case.endswith("under a file") else "")
        argv, says = train_argv(files, str(target).rstrip("/"), 2), "error: -o "
    else:
        code, _, err, _ = launch(mpiexec, 2, train_argv(files, out, 2, "-x", 3))
        assert code == 0, err
        if case == "another run's checkpoints":
            argv, says = (train_argv(files, out, 2, "-x", 3, "-l", 1e-3),
                          f"error: {out} holds another run's checkpoints")
        else:
            argv, says = train_argv(files, out, 3, "-x", 6, "-y", 1), "error: "
    code, stdout, err, _ = launch(mpiexec, 3 if case == "another process count" else 2, argv)
    assert code == 2, stdout + err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith(says), err
    assert "aborting" not in err and "Abort" not in err, err


def test_a_signal_during_x0_under_mpiexec_stops_every_rank_at_the_end(mpiexec, files, tmp_path):
    """-x 0 under mpiexec: a SIGTERM (mpiexec passes it to every rank) lets the evaluation finish on
    every rank together (one rank stopping alone would leave the others in a collective), then the
    stop's line, exit 143."""
    argv = [mpiexec, "-n", "2",
            *map(str, train_argv(files, tmp_path / "out", 2, "-x", 0, "-v", 1, "-m", 3000))]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(PYTHONUNBUFFERED="1", GPT2NP_PROGRESS="off"))
    try:
        # the evaluation starts after this line
        for line in proc.stdout:
            if line.startswith("-x 0: no training"):
                break
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 143, stdout + err
    assert "val loss" in stdout and "aborting" not in err, stdout + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["stopped by SIGTERM after 0 steps: -x 0 trains nothing, nothing to save"], err


def test_the_profile_command_under_mpiexec_is_one_line(mpiexec, files, tmp_path):
    """`gpt2np profile` is one process: under mpiexec each rank would profile alone into the same
    --out. One line from rank 0 naming train.py --profile, exit 2, nothing written."""
    argv = [sys.executable, "-m", "gpt2np", "profile", "-e", files / "tiny.bin", "-b", 2, "-t", T,
            "--steps", 1, "--device", "cpu", "--out", tmp_path / "p"]
    code, out, err, _ = launch(mpiexec, 2, argv)
    assert code == 2, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: gpt2np profile runs one process, "
                                                   "not 2 under mpiexec")
    assert "train.py ... --profile" in lines[0] and not (tmp_path / "p").exists()
