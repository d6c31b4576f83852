"""A stop signal during a long in-training evaluation (HellaSwag, the val loss) ends it within
seconds, before its numbers: the checkpoint of the step reached is written and the run exits
128 + the signal, as a stop between two steps does. Tiny models; every wait is bounded."""
import json
import os
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
import test_reliability_runs as reliability

import train
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.datasets import hellaswag
from gpt2np.datasets.data import write_shard
from gpt2np.formats.checkpoint import save_model
from gpt2np.model import GPT2

REPO = Path(__file__).resolve().parent.parent
CFG = GPT2Config(64, 50257, 50304, 1, 2, 16)   # HellaSwag needs GPT-2's vocabulary
EXAMPLES = 400                                  # ~15 s of scoring at -b 4 on one core
TIMEOUT = 60
files = reliability.files                       # a tiny byte-level model, its shards and tokenizer


@pytest.fixture(scope="module")
def hellaswag_files(tmp_path_factory, data_dir):
    folder = tmp_path_factory.mktemp("hellaswag_stop")
    save_model(folder / "m.bin", CFG, GPT2(CFG, NumpyBackend(), 1, 1, seed=3).params_host())
    rng = np.random.default_rng(0)
    write_shard(folder / "train.bin", rng.integers(0, 2000, 4000))
    write_shard(folder / "val.bin", rng.integers(0, 2000, 1000))
    endings = ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
               "is holding a rubik's cube.", "starts pulling up roofing on a roof."]
    lines = [json.dumps({"ctx": f"Example {i}: a man is sitting on a roof. He", "label": i % 4,
                         "endings": endings}) for i in range(EXAMPLES)]
    (folder / "hs.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_sigterm_during_hellaswag_stops_it_and_writes_the_checkpoint(hellaswag_files, tmp_path,
                                                                     capsys, monkeypatch):
    """-h 1 -v 2: HellaSwag at step 2, 400 examples; SIGTERM as its scoring starts. The run stops
    within a piece of it (a batch's worth of examples), with no HellaSwag line, writes the
    checkpoint of step 2 and exits 143; main.log keeps step 2's val loss, not a HellaSwag score."""
    folder, out = hellaswag_files, tmp_path / "out"
    scored, signalled = [], []
    real_score = hellaswag.score

    def signal_then_score(model, examples, on_batch=None):
        if not signalled:                         # the first scoring: step 2's HellaSwag
            signalled.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
        scored.append(len(examples))
        return real_score(model, examples, on_batch)

    monkeypatch.setattr(hellaswag, "score", signal_then_score)
    code = train.main([str(a) for a in [
        "-e", folder / "m.bin", "-i", folder / "train.bin", "-j", folder / "val.bin", "-b", 4,
        "-t", 16, "-x", 4, "-v", 2, "-m", 1, "-h", 1, "--hellaswag-data", folder / "hs.jsonl",
        "-s", 0, "-o", out, "--device", "cpu"]])
    stopped_after = time.monotonic() - signalled[0]
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 128 + signal.SIGTERM, captured.err
    assert err[-1] == f"stopped by SIGTERM after 2 steps: checkpoint of step 2 written to {out} " \
                      f"(resume with -y 1)", err
    assert sum(scored) < EXAMPLES // 10, scored             # a piece, not the whole evaluation
    assert stopped_after < 5, f"{stopped_after:.1f} s after the signal"
    assert "HellaSwag:" not in captured.out
    assert (out / "DONE_00000002").is_file() and (out / "model_00000002.bin").is_file()
    log = (out / "main.log").read_text().splitlines()
    assert any(line.startswith("s:2 tel:") for line in log)
    assert not any(" eval:" in line for line in log), log


def test_sigterm_during_a_long_validation_stops_it_and_writes_the_checkpoint(files, tmp_path,
                                                                             capsys):
    """A resumed run validating 10^7 batches at step 3 (-v 3 -m 10000000: hours): SIGTERM from
    outside during it ends the run within seconds, with no val loss line, the checkpoint of step 3
    written and exit 143."""
    out = tmp_path / "out"
    code, _, err = reliability.run(reliability.args(files, out, "-x", 2, "-n", 2), capsys)
    assert code == 0, err
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "GPT2NP_TEST_"))}
    env.update(PYTHONPATH=str(REPO), GPT2NP_NVTX="0", PYTHONUNBUFFERED="1", GPT2NP_PROGRESS="off")
    argv = [sys.executable, str(REPO / "train.py"),
            *map(str, reliability.args(files, out, "-x", 4, "-n", 2, "-y", 1, "-v", 3,
                                       "-m", 10 ** 7))]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + TIMEOUT
    while not any(line.startswith("step    3/4") for line in lines) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)                                 # inside step 3's validation
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(TIMEOUT)
        pytest.fail("the run went on validating after SIGTERM")
    reader.join(TIMEOUT)
    stderr = proc.stderr.read()
    assert code == 128 + signal.SIGTERM, stderr
    assert stderr.splitlines()[-1] == f"stopped by SIGTERM after 3 steps: checkpoint of step 3 " \
                                      f"written to {out} (resume with -y 1)", stderr
    assert not any(line.startswith("val loss") for line in lines), lines
    assert (out / "DONE_00000003").is_file()


def test_sigterm_during_a_long_validation_under_mpiexec_stops_every_rank(files, tmp_path):
    """The same under mpiexec with 2 ranks: the ranks look at the signal together (one all-reduce a
    batch), so they leave the validation at the same batch, write the checkpoint of step 3 (a state
    file each) and exit 143, none left waiting in a collective."""
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install 'gpt2np[dist]')")
    here = Path(sysconfig.get_path("scripts")) / "mpiexec"
    mpiexec = str(here) if here.is_file() else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec found (pip install mpich)")
    out, args = tmp_path / "out", reliability.args
    launcher = (mpiexec, "-n", "2")
    job = reliability.Trainer(args(files, out, "-x", 2, "-n", 2, "-b", 1), tmp_path / "stderr",
                              launcher=launcher)
    code, _, stderr = job.finish()
    if code != 0 or not (out / "DONE_00000002").is_file():
        pytest.skip(f"{mpiexec} did not run 2 ranks (exit {code}): {stderr[-500:]}")
    job = reliability.Trainer(args(files, out, "-x", 4, "-n", 2, "-b", 1, "-y", 1, "-v", 3,
                                   "-m", 10 ** 7), tmp_path / "stderr2", launcher=launcher)
    assert job.wait_for(r"^step +3/4"), "no third step"
    time.sleep(0.5)                                 # inside step 3's validation
    job.proc.send_signal(signal.SIGTERM)
    try:
        code, stdout, stderr = job.finish()
    except subprocess.TimeoutExpired:
        job.proc.kill()
        pytest.fail("the ranks went on validating after SIGTERM")
    assert code == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("stopped by")]
    assert line == f"stopped by SIGTERM after 3 steps: checkpoint of step 3 written to {out} " \
                   f"(resume with -y 1)"
    assert "val loss" not in stdout
    assert {p.name for p in out.iterdir() if "00000003" in p.name} == {
        "DONE_00000003", "model_00000003.bin", "state_00000003_00000.bin",
        "state_00000003_00001.bin"}
