"""bench/gpu_acceptance.sh without a GPU: its syntax, the dry run (every stage's command, with flags
the real CLIs accept), the summary and exit-status logic (a failing stage gives FAIL and exit 1, a
time limit FAIL, a missing tool SKIP with the wheel to bring), and a smoke of the stages that run on
the CPU emulator (--device emu)."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_acceptance.sh"
HELPER = REPO / "bench" / "gpu_acceptance.py"
STAGES = ["preflight", "setup", "pytest_gpu", "compare_fp32", "compare_tf32", "compare_bf16",
          "train", "train_loss", "gpu_step", "gpu_step_bf16", "op_bench", "kernels", "plan_measure",
          "memcheck", "racecheck", "ncu", "ncu_agrees"]


def env(**extra):
    e = dict(os.environ, PYTHON=sys.executable)
    e.update(extra)
    return e


def run_script(*args, timeout=120, **extra):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], cwd=REPO, env=env(**extra),
                          capture_output=True, text=True, timeout=timeout)


def source(body, tmp_path, **extra):
    """Run bash code with the script sourced (its functions defined, nothing run)."""
    code = (f"source {shlex.quote(str(SCRIPT))}\nacc_init {shlex.quote(str(tmp_path))} "
            f"|| exit 2\n{body}")
    return subprocess.run(["bash", "-c", code], cwd=REPO, env=env(**extra), capture_output=True,
                          text=True, timeout=60)


def summary(folder):
    data = json.loads((Path(folder) / "summary.json").read_text())
    return data, {s["stage"]: s for s in data["stages"]}


def test_syntax():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    assert "--quick" in run_script("--help").stdout


def test_dry_run_prints_every_stage_with_the_real_clis(tmp_path):
    r = run_script("--dry-run", "--out", tmp_path / "acc")
    assert r.returncode == 0, r.stderr
    data, stages = summary(tmp_path / "acc")
    assert list(stages) == STAGES
    assert all(s["status"] == "SKIP" and s["reason"] == "dry run" for s in stages.values())
    cmd = {name: shlex.split(s["command"]) for name, s in stages.items() if s["command"]}
    assert cmd["pytest_gpu"][1:5] == ["-m", "pytest", "-m", "gpu"]
    assert "--backend" in cmd["compare_fp32"] and "cuda" in cmd["compare_fp32"]
    assert cmd["compare_tf32"][-2:] == ["--precision", "tf32"]
    assert cmd["memcheck"][:3] == ["compute-sanitizer", "--tool", "memcheck"]
    assert cmd["racecheck"][:3] == ["compute-sanitizer", "--tool", "racecheck"]
    assert "--plan" in cmd["plan_measure"] and "--measure" in cmd["plan_measure"]
    assert cmd["ncu"][0] == "env" and "TIME_ONLY=1" in cmd["ncu"] and "T=1024" in cmd["ncu"]
    assert cmd["ncu"][-1].endswith("bench/ncu.sh")
    assert cmd["ncu_agrees"][2] == "ncu-agrees" and cmd["ncu_agrees"][3].endswith("ncu.log")
    # the flags are the CLIs' own: their parsers accept them
    from gpt2np.cli import compare
    from gpt2np.cli.train import parse_config
    for name in ("compare_fp32", "compare_tf32"):
        argv = cmd[name][cmd[name].index("compare") + 1:]
        assert compare.parse_args(argv).backend == "cuda"
    assert compare.parse_args(cmd["compare_tf32"][4:]).rel_tol == compare.TF32_REL_TOL
    train = parse_config(cmd["train"][cmd["train"].index("train.py") + 1:])
    assert (train.batch_size, train.seq_len, train.max_steps, train.device) == (4, 1024, 20, "cuda")
    step = parse_config(cmd["memcheck"][cmd["memcheck"].index("train.py") + 1:])
    assert step.max_steps == 1 and step.device == "cuda"
    assert "gpu_step.py" in cmd["gpu_step"][1] and "--torch" in cmd["gpu_step"]
    assert cmd["compare_bf16"][-2:] == ["--precision", "bf16"] and compare.parse_args(
        cmd["compare_bf16"][4:]).precision == "bf16"
    assert cmd["gpu_step_bf16"][cmd["gpu_step_bf16"].index("--precision") + 1] == "bf16"
    assert (cmd["op_bench"][1].endswith("bench/op_bench.py")
            and cmd["op_bench"][2] == "layernorm_backward")
    ob = cmd["op_bench"]
    assert "layernorm_finish_threads=1,8,32" in ob and ob[ob.index("-b") + 1] == "64"


def test_full_runs_longer(tmp_path):
    r = run_script("--dry-run", "--full", "--out", tmp_path)
    assert r.returncode == 0
    _, stages = summary(tmp_path)
    assert "-x 200" in stages["train"]["command"] and "--steps 50" in stages["gpu_step"]["command"]
    assert "-b 64" in stages["gpu_step_bf16"]["command"]              # llm.c's d12 batch


def test_a_failing_stage_fails_the_run_and_the_rest_go_on(tmp_path):
    r = source("acc_run good 10 true\n"
               "acc_run bad 10 bash -c 'echo something broke; exit 3'\n"
               "acc_run slow 1 sleep 30\n"
               "acc_skip missing 'compute-sanitizer is not on PATH'\n"
               "acc_run after 10 true\n"
               "acc_finish", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    data, stages = summary(tmp_path)
    assert data["result"] == "FAIL" and (data["PASS"], data["FAIL"], data["SKIP"]) == (2, 2, 1)
    assert (stages["bad"]["status"] == "FAIL"
            and stages["bad"]["reason"] == "exit status 3: something broke")
    assert stages["slow"]["status"] == "FAIL" and "timed out after 1s" in stages["slow"]["reason"]
    assert (stages["missing"]["status"] == "SKIP"
            and "compute-sanitizer" in stages["missing"]["reason"])
    assert stages["after"]["status"] == "PASS"
    assert "something broke" in (tmp_path / "bad.log").read_text()
    text = (tmp_path / "summary.txt").read_text()
    assert text.startswith("gpt2np GPU acceptance: FAIL  (2 passed, 2 failed, 1 skipped)")


LOG_LINE = ("built-in vs ncu kernel times: 365 kernels matched, median ratio {median}, 78% within "
            "10%, step total ratio {total}\n")


@pytest.mark.parametrize("median, total, passes",
                         [("0.978", "0.981", True), ("0.815", "0.834", False),
                          ("0.978", "1.130", False), ("1.080", "0.950", True)])
def test_ncu_agrees_holds_the_step_total_and_the_median_to_10_percent(tmp_path, median, total,
                                                                      passes):
    """The ncu_agrees stage reads bench/ncu.sh's agreement line: it passes when the median ratio and
    the step total are both within 10% of 1 (an ncu run at T=64 with CUDA graphs, whose GEMMs
    differ, gives the second case)."""
    log = tmp_path / "ncu.log"
    log.write_text("...\n" + LOG_LINE.format(median=median, total=total))
    r = subprocess.run([sys.executable, str(HELPER), "ncu-agrees", str(log)], capture_output=True,
                       text=True)
    assert r.returncode == (0 if passes else 1), r.stdout
    assert (r.stdout.startswith("PASS" if passes else "FAIL")
            and f"step total {float(total):.3f}" in r.stdout)
    log.write_text("ncu finished but nothing matched\n")
    r = subprocess.run([sys.executable, str(HELPER), "ncu-agrees", str(log)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "no 'built-in vs ncu kernel times' line" in r.stdout


@pytest.mark.parametrize("stages, tools", [
    ("ncu,ncu_agrees", "PYTEST_OK=1 SAN_OK=1 NCU_OK=0 NCU_WHY='ncu is not on PATH'"),
    ("memcheck,racecheck", "PYTEST_OK=1 SAN_OK=0 SAN_WHY='compute-sanitizer is not on PATH'")])
def test_a_missing_tool_skips_its_stages(tmp_path, stages, tools):
    """No ncu: the ncu stages SKIP; no compute-sanitizer: memcheck and racecheck; each
    naming what is missing."""
    body = (f"MODE=quick DEVICE=cuda ONLY={stages}\n"
            f"CUDA_OK=1 TORCH_OK=1 TORCH_CPU_OK=1 {tools}\n"
            "acc_stages\nacc_finish")
    r = source(body, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    _, result = summary(tmp_path)
    assert list(result) == stages.split(",")
    assert all(s["status"] == "SKIP" and "not on PATH" in s["reason"] for s in result.values())


def test_skips_pass_unless_strict(tmp_path):
    body = "acc_run good 10 true\nacc_skip gone 'no GPU'\nacc_finish"
    assert source(body, tmp_path / "a").returncode == 0
    assert source(body, tmp_path / "b", STRICT="1").returncode == 1


def test_budget_skips_what_does_not_fit(tmp_path):
    r = source("BUDGET=20\nACC_T0=$((SECONDS - 10))\nacc_run late 10 true\nacc_finish", tmp_path)
    assert r.returncode == 0
    _, stages = summary(tmp_path)
    assert stages["late"]["status"] == "SKIP" and "time budget" in stages["late"]["reason"]



@pytest.fixture
def no_cupy_no_torch(tmp_path):
    """A PYTHONPATH on which `import cupy` and `import torch` fail, as on a machine without them."""
    fake = tmp_path / "fake"
    for name in ("cupy", "torch"):
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(f'raise ImportError("No module named {name}")\n')
    return str(fake) + os.pathsep + str(REPO)


def test_preflight_names_the_wheels_to_bring(no_cupy_no_torch):
    r = subprocess.run([sys.executable, str(HELPER), "preflight", "--device", "cuda"],
                       capture_output=True,
                       text=True, env=env(PYTHONPATH=no_cupy_no_torch), timeout=60)
    assert r.returncode == 0, r.stderr
    values = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert values["CUDA_OK"] == "0" and "CuPy is not installed" in values["CUDA_WHY"]
    assert values["TORCH_OK"] == "0" and values["TORCH_CPU_OK"] == "0"
    assert values["WHEELS_NEEDED"].strip("'").split() == ["cupy-cuda13x", "torch"]


def test_preflight_names_the_fast_paths_missing_plumbing(tmp_path):
    """nvmath-python (GEMM epilogues, GEMMs in CUDA graphs), cupti-python (with its pyelftools) and
    nvtx: the GPU path runs without them, each with a note, but then is not the fast path; the
    preflight names them among the wheels to bring."""
    fake = tmp_path / "fake"
    for name in ("nvmath", "cupti", "nvtx", "elftools"):
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(f'raise ImportError("No module named {name}")\n')
    r = subprocess.run([sys.executable, str(HELPER), "preflight", "--device", "cuda"],
                       capture_output=True, text=True,
                       env=env(PYTHONPATH=str(fake) + os.pathsep + str(REPO)), timeout=60)
    assert r.returncode == 0, r.stderr
    values = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert values["EXTRAS_OK"] == "0" and "no CUDA graphs" in values["EXTRAS_WHY"]
    assert values["WHEELS_NEEDED"].strip("'").split()[-4:] == ["nvmath-python", "cupti-python",
                                                               "pyelftools", "nvtx"]
    r = subprocess.run([sys.executable, str(HELPER), "preflight", "--device", "cuda"],
                       # this machine has them
                       capture_output=True, text=True, env=env(PYTHONPATH=str(REPO)), timeout=60)
    assert "EXTRAS_OK=1" in r.stdout.splitlines()


def test_missing_gpu_packages_skip_with_the_pip_line(tmp_path, no_cupy_no_torch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    r = run_script("--out", tmp_path / "acc", "--only", "preflight,pytest_gpu,memcheck", "--wheels",
                   wheels, PYTHONPATH=no_cupy_no_torch)
    assert r.returncode == 0, r.stdout + r.stderr
    _, stages = summary(tmp_path / "acc")
    pre = stages["preflight"]
    assert pre["status"] == "SKIP"
    assert "pip install --no-index --find-links WHEELS cupy-cuda13x torch" in pre["reason"]
    assert "CuPy is not installed" in stages["pytest_gpu"]["reason"]
    assert stages["memcheck"]["status"] == "SKIP"
    log = (tmp_path / "acc" / "preflight.log").read_text()
    # tried the wheel folder
    assert f"pip install --no-index --find-links {wheels} cupy-cuda13x torch" in log


def test_bad_flags_exit_2(tmp_path):
    assert run_script("--bogus").returncode == 2
    assert run_script("--only", "nosuchstage", "--out", tmp_path).returncode == 2


def test_loss_falls_check(tmp_path):
    log = tmp_path / "main.log"
    log.write_text("s:0 trl:10.9 lr:0.0003 norm:1\ns:0 tel:10.8\ns:1 trl:9.0 lr:0.0003 norm:1\n")
    check = [sys.executable, str(HELPER), "loss-falls", str(log)]
    assert subprocess.run(check + ["--min-drop", "1.0"], capture_output=True).returncode == 0
    assert subprocess.run(check + ["--min-drop", "2.0"], capture_output=True).returncode == 1
    log.write_text("s:0 trl:10.9 lr:0.0003 norm:1\ns:1 trl:nan lr:0.0003 norm:1\n")
    assert subprocess.run(check, capture_output=True).returncode == 1


def test_emulator_smoke(tmp_path):
    """The stages that run without a GPU, through the same CLIs: data and models written by the
    script, PyTorch parity in TF32 on the emulator, a short training run on the emulator whose loss
    falls, gpu_step's dry runs (tf32, bf16) with the PyTorch side on the CPU."""
    r = run_script("--device", "emu", "--out", tmp_path, "--only",
                   "setup,compare_tf32,train,train_loss,gpu_step,gpu_step_bf16", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    data, stages = summary(tmp_path)
    assert [s["status"] for s in data["stages"]] == ["PASS"] * 7, data["stages"]
    assert "OK: all" in (tmp_path / "compare_tf32.log").read_text()
    assert "OK: the loss falls" in (tmp_path / "train_loss.log").read_text()
    step = (tmp_path / "gpu_step.log").read_text()
    assert "PyTorch runs eager on the CPU" in step and "ratio" in step


def test_gpu_wheels_downloads_the_fast_paths_plumbing_without_dependencies(tmp_path):
    """bench/gpu_wheels.sh (run online, for an offline GPU machine): its pip command, shown by
    --dry-run (no network in tests); bad arguments are one line and exit 2."""
    script = REPO / "bench" / "gpu_wheels.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    r = subprocess.run(["bash", str(script), str(tmp_path / "w"), "--python", "3.11", "--dry-run"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert (cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
            and "--only-binary=:all:" in cmd)
    assert (cmd[cmd.index("--python-version") + 1] == "3.11"
            and cmd[cmd.index("-d") + 1] == str(tmp_path / "w"))
    assert [c.split(">")[0] for c in cmd[-4:]] == ["nvtx", "cupti-python", "nvmath-python",
                                                   "pyelftools"]
    assert not (tmp_path / "w").exists()
    for bad in ([], ["--python", "twelve", "x"], ["--bogus", "x"]):
        r = subprocess.run(["bash", str(script), *bad], capture_output=True, text=True)
        assert (r.returncode == 2 and r.stderr.startswith("error:")
                and len(r.stderr.strip().splitlines()) == 1)
