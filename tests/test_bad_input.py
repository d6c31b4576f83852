"""Bad input to every tool ends in ONE line on stderr, `error: ...`, naming the flag or file, the
value and what is allowed, and exit code 2, never a traceback; GPT2NP_DEBUG=1 shows the traceback
instead. Mostly in-process (main(argv) returns the exit code), a few through a real subprocess for
the codes a shell sees."""
import json
import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
from test_nsys import training_step_export

import train
from gpt2np import errors as cli
from gpt2np.backends import device_traits
from gpt2np.backends.cuda import nvrtc_check
from gpt2np.cli import compare, nsys, profile
from gpt2np.cli import fetch as fetch_cli
from gpt2np.cli import prepare as prepare_cli
from gpt2np.cli import report as report_cli
from gpt2np.config import TrainConfig, value_type
from gpt2np.profiling.render import report

REPO = Path(__file__).resolve().parent.parent


def one_error_line(err):
    """The single line on stderr (asserting it is one non-empty `error:` line
    without a traceback)."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert (len(lines) == 1 and err.endswith("\n") and lines[0].startswith("error: ")
            and lines[0][7:].strip()), err
    return lines[0]


def assert_bad_input(main, argv, expected, capsys, code=2):
    """main(argv) exits with `code` and one error line holding every expected piece
    (flag, value, allowed)."""
    assert main([str(a) for a in argv]) == code
    line = one_error_line(capsys.readouterr().err)
    missing = [piece for piece in expected if piece not in line]
    assert not missing, f"{line!r} lacks {missing}"


# ---- train.py: every flag's range, and flags that contradict each other --------------------------
TRAIN_CASES = {  # id: (argv, pieces the line must hold: the flag, the value, what is allowed)
    "lr nan": (["-l", "nan"], ["-l nan", "the learning rate must be a finite number > 0"]),
    "lr negative": (["-l", "-1"], ["-l -1", "> 0"]),
    "lr inf": (["-l", "inf"], ["-l inf", "finite"]),
    "final lr fraction": (["-q", "-2"], ["-q -2", "final lr fraction", "[0, 1]"]),
    "final lr fraction > 1": (["-q", "1.5"], ["-q 1.5", "[0, 1]"]),
    "eps 0": (["--eps", "0"], ["--eps 0", "> 0"]),
    # a negative value in exponent notation is a value, not an unknown flag (argparse's
    # own pattern misses it)
    "eps negative exponent": (["--eps", "-1e-8"], ["--eps -1e-08", "AdamW's epsilon", "> 0"]),
    "lr negative exponent": (["-l", "-6E-4"], ["-l -0.0006", "> 0"]),
    "beta2 1.5": (["--beta2", "1.5"], ["--beta2 1.5", "[0, 1)"]),
    "beta1 negative": (["--beta1", "-0.1"], ["--beta1 -0.1", "[0, 1)"]),
    "temperature nan": (["--temperature", "nan"], ["--temperature nan", "finite number >= 0"]),
    "temperature negative": (["--temperature", "-1"], ["--temperature -1", ">= 0"]),
    "batch 0": (["-b", "0"], ["-b 0", "micro batch size", "integer >= 1"]),
    "seq len 0": (["-t", "0"], ["-t 0", "sequence length", "integer >= 1"]),
    "max steps -5": (["-x", "-5"], ["-x -5", "-1 (one epoch)", "0 (no training", ">= 1"]),
    "val batches 0": (["-m", "0"], ["-m 0", "-1 (all)", ">= 1", "use -v 0 to turn validation off"]),
    "val batches -2": (["-m", "-2"], ["-m -2", "-1 (all)"]),
    "val every": (["-v", "-1"], ["-v -1", ">= 0"]),
    "sample every": (["-s", "-1"], ["-s -1", ">= 0"]),
    "checkpoint every": (["-n", "-1"], ["-n -1", ">= 0"]),
    "gen tokens": (["-g", "-1"], ["-g -1", ">= 0"]),
    "top-k": (["--top-k", "-1"], ["--top-k -1", ">= 0"]),
    "warmup": (["-u", "-1"], ["-u -1", ">= 0"]),
    "seed": (["--seed", "-1"], ["--seed -1", ">= 0"]),
    "total batch 0": (["-d", "0"], ["-d 0", "-1 (B*T*processes)", ">= 1"]),
    "total batch -2": (["-d", "-2"], ["-d -2", "-1 (B*T*processes)"]),
    "grad clip negative": (["--grad-clip", "-1"], ["--grad-clip -1", "finite number >= 0"]),
    "grad clip nan": (["--grad-clip", "nan"], ["--grad-clip nan", "finite"]),
    "weight decay negative": (["-c", "-0.1"], ["-c -0.1", "weight decay", ">= 0"]),
    "weight decay inf": (["-c", "inf"], ["-c inf", "finite"]),
    "dist timeout": (["--dist-timeout", "-1"], ["--dist-timeout -1", ">= 0"]),
    "profile negative": (["--profile", "-1"], ["--profile -1", ">= 0"]),
    # consistency between flags: both named, and what would make them agree
    "profile longer than the run": (["--profile", "1", "-x", "1"],
                                    ["--profile 1", "-x 1", "warm-up", "-x must be >= 2"]),
    "profile without training": (["--profile", "3", "-x", "0"], ["--profile 3", "-x 0", ">= 4"]),
    "resume without -o": (["-y", "1"], ["-y 1", "without -o"]),
    "checkpoints without -o": (["-n", "5"], ["-n 5", "without -o"]),
    "overwrite without -o": (["--overwrite"], ["--overwrite without -o"]),
    "hellaswag data without hellaswag": (["--hellaswag-data", "hs.jsonl"],
                                         ["--hellaswag-data hs.jsonl",
                                          "without -h 1 or --hellaswag N"]),
    "total batch not a multiple": (["-d", "100", "-b", "4", "-t", "64"],
                                   ["-d 100", "-b 4", "-t 64", "multiple of B*T = 256"]),
    # argparse's own errors: one line too
    "not an int": (["-b", "four"], ["-b", "'four'", "invalid int"]),
    "unknown schedule": (["-k", "step"], ["-k", "'step'", "cosine"]),
    "unknown device": (["--device", "tpu"], ["--device", "'tpu'"]),
    "unknown flag": (["--learning-rate", "1"], ["--learning-rate"]),
}


@pytest.mark.parametrize("argv, expected", TRAIN_CASES.values(), ids=TRAIN_CASES.keys())
def test_train_flag_errors(argv, expected, capsys):
    assert_bad_input(train.main, argv, expected, capsys)


@pytest.mark.parametrize(
    "argv", [["-x", "0"], ["-x", "-1"], ["-m", "-1"], ["--profile", "1", "-x", "2"],
             ["--profile", "5"], ["-d", "512", "-b", "4", "-t", "64"], ["-n", "5", "-o", "out"],
             ["-y", "1", "-o", "out"], ["-q", "0"], ["--beta2", "0"], ["--temperature", "0"],
             ["-v", "0", "-s", "0", "-g", "0", "--grad-clip", "0", "--dist-timeout", "0"]])
def test_train_flags_at_the_limits_are_accepted(argv):
    cfg = train.parse_config(argv)
    assert cfg.validate() is cfg


def test_defaults_are_valid_on_either_device():
    for cfg in (TrainConfig(), TrainConfig().with_device_defaults(device_traits("numpy")),
                TrainConfig().with_device_defaults(device_traits("cuda"))):
        cfg.validate()


def test_device_defaults_are_checked_once_filled():
    """A device-dependent default still None is not judged; once filled (CPU: -x 40) the
    same rules apply."""
    cfg = TrainConfig(profile_steps=50)
    cfg.validate()
    with pytest.raises(cli.BadInput, match=r"--profile 50 with -x 40"):
        cfg.with_device_defaults(device_traits("numpy")).validate()
    TrainConfig(total_batch_size=1000).validate()                           # B and T not known yet
    with pytest.raises(cli.BadInput, match=r"-d 1000 with -b 4 -t 64"):
        TrainConfig(total_batch_size=1000).with_device_defaults(device_traits("numpy")).validate()


@pytest.mark.parametrize("name, value, expected", [
    ("learning_rate", "3e-4", "-l '3e-4'"),         # text, not a number
    ("batch_size", True, "-b True"),                # a bool is no count
    ("batch_size", 2.5, "-b 2.5"),
    ("resume", True, "-y True: must be one of 0, 1"),
    ("lr_schedule", "step", "-k 'step': must be one of cosine"),
    ("model", None, "-e None: must be a non-empty text"),
    ("shuffle", 2, "--shuffle 2: must be one of 0, 1"),
    ("shuffle", True, "--shuffle True: must be one of 0, 1"),
])
def test_validate_checks_types_for_callers_without_argparse(name, value, expected):
    with pytest.raises(cli.BadInput) as error:
        replace(TrainConfig(), **{name: value}).validate()
    assert expected in str(error.value)


def test_every_number_setting_has_a_rule():
    """A rule says what a number may be (a range, its special values); a new
    setting must bring one."""
    loose = [f.metadata["flag"] for f in fields(TrainConfig) if value_type(f) in (int, float)
             and not f.metadata["choices"] and not (f.metadata["allowed"] and f.metadata["what"])]
    assert not loose, ("give these TrainConfig fields allowed=... and what=... in "
                       f"gpt2np/config.py: {loose}")


# ---- the tools -----------------------------------------------------------------------------------
@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a folder\n")
    return path


@pytest.fixture
def records_json(tmp_path):
    """A valid records file with steps 1 and 2."""
    rows = [report.KernelRecord(idx=i, step=1 + i // 2, direction="fprop", layer=0,
                                op="matmul_forward", module="h.0.mlp.c_fc", params="B=1",
                                kernel="k", start_ns=100 * i, duration_ns=50,
                                flops=10, bytes=10) for i in range(4)]
    path = tmp_path / "records.json"
    report.write_json(rows, str(path))
    return path


def with_record_field(path, name, value):
    """The records file with one field of its first record replaced."""
    doc = json.loads(path.read_text())
    doc["records"][0][name] = value
    path.write_text(json.dumps(doc))
    return path


def test_prepare_errors(tmp_path, a_file, capsys):
    assert_bad_input(prepare_cli.main, ["--input", tmp_path],
                     ["--input", str(tmp_path), "is a folder", "text file"], capsys)
    assert_bad_input(prepare_cli.main, ["--input", a_file, "--output-dir", a_file],
                     ["--output-dir", str(a_file), "is a file", "folder"], capsys)
    assert_bad_input(prepare_cli.main, ["--val-tokens", "-1"], ["--val-tokens -1", ">= 0"], capsys)
    assert_bad_input(prepare_cli.main, ["tinyshakespeare", "--input", a_file],
                     ["either --input", "not both"], capsys)


def test_fetch_errors(a_file, capsys):
    assert_bad_input(fetch_cli.main, ["--timeout", "0"], ["--timeout 0", "> 0"], capsys)
    assert_bad_input(fetch_cli.main, ["--timeout", "nan"], ["--timeout nan", "finite"], capsys)
    assert_bad_input(fetch_cli.main, ["--dir", a_file], ["--dir", str(a_file), "is a file"], capsys)
    assert_bad_input(fetch_cli.main, ["bogus"], ["'bogus'", "tinyshakespeare"], capsys)


def test_compare_errors(tmp_path, capsys):
    model = tmp_path / "none.bin"
    assert_bad_input(compare.main, ["-e", model], [str(model), "no such"], capsys)
    assert_bad_input(compare.main, ["-e", model, "--steps", "-1"], ["--steps -1", ">= 0"], capsys)
    assert_bad_input(compare.main, ["-e", model, "-b", "0"], ["-b 0", ">= 1"], capsys)
    assert_bad_input(compare.main, ["-e", model, "-l", "nan"], ["-l nan", "finite"], capsys)
    assert_bad_input(compare.main, ["-e", model, "--rel-tol", "0"], ["--rel-tol 0", "> 0"], capsys)
    assert_bad_input(compare.main, ["-e", model, "--tol", "fcw=inf"],
                     ["--tol", "fcw=inf", "finite number > 0"], capsys)
    # the required model
    assert_bad_input(compare.main, ["--steps", "1"], ["-e"], capsys)


def test_profiler_errors(a_file, capsys):
    assert_bad_input(profile.main, ["--steps", "0"], ["--steps 0", "integer >= 1"], capsys)
    assert_bad_input(profile.main, ["-b", "0"], ["-b 0", ">= 1"], capsys)
    assert_bad_input(profile.main, ["-t", "-3"], ["-t -3", ">= 1"], capsys)
    assert_bad_input(profile.main, ["--out", a_file], ["--out", str(a_file), "is a file"], capsys)
    assert_bad_input(profile.main, ["-e", a_file.parent / "none.bin"],
                     ["none.bin", "no such model file"], capsys)
    assert_bad_input(profile.main, ["-e", "d12", "-t", "2048"],
                     ["-t 2048", "max_seq_len 1024"], capsys)


@pytest.mark.parametrize("name, value, expected", [
    ("duration_ns", "fast", "'duration_ns' must be an integer"),
    ("step", "1", "'step' must be an integer or null"),
    ("layer", 1.5, "'layer' must be an integer or null"),
    ("kernel", 7, "'kernel' must be text"),
    ("flops", None, "'flops' must be an integer"),
    ("range_stack", "Train step 1", "'range_stack' must be a list"),
])
def test_report_records_of_the_wrong_type(records_json, name, value, expected, capsys):
    path = with_record_field(records_json, name, value)
    assert_bad_input(report_cli.main, [path], [str(path), "record 0", expected], capsys)


def test_report_errors(records_json, tmp_path, capsys):
    assert_bad_input(report_cli.main, [records_json, "--step", "9"],
                     ["--step 9", str(records_json), "its steps are 1, 2"], capsys)
    assert_bad_input(report_cli.main, [records_json, "--step", "first"],
                     ["--step 'first'", "'last' or 'all'"], capsys)
    assert_bad_input(report_cli.main, [records_json, "--device", "Voodoo5"],
                     ["unknown device 'Voodoo5'"], capsys)
    assert_bad_input(report_cli.main, [tmp_path / "none.json"],
                     ["none.json", "no such file"], capsys)
    doc = json.loads(records_json.read_text())
    records_json.write_text(json.dumps({**doc, "roofline": {"device": 3}}))
    assert_bad_input(report_cli.main, [records_json],
                     [str(records_json), "'roofline' must be"], capsys)
    records_json.write_text(json.dumps({"records": [[1, 2]]}))
    assert_bad_input(report_cli.main, [records_json],
                     [str(records_json), "record 0", "object"], capsys)
    # the file is named, then the step
    assert report_cli.main([str(tmp_path / "none.json"), "--step", "1"]) == 2
    assert "none.json" in one_error_line(capsys.readouterr().err)


def test_nsys_errors(tmp_path, capsys):
    export = training_step_export().write(tmp_path / "prof.sqlite")
    assert_bad_input(nsys.main, [export, "--step", "7"], ["--step 7", "its steps are 1"], capsys)
    assert_bad_input(nsys.main, [export, "--top", "0"], ["--top 0", ">= 1"], capsys)
    assert_bad_input(nsys.main, [export, "--csv", tmp_path],
                     ["--csv", str(tmp_path), "is a folder"], capsys)
    assert_bad_input(nsys.main, [tmp_path / "none.sqlite"], ["none.sqlite", "no such file"], capsys)


def test_nvrtc_check_errors(capsys):
    assert_bad_input(nvrtc_check.main, ["bogus"], ["bogus", "attention"], capsys)
    assert_bad_input(nvrtc_check.main, ["--jobs", "0"], ["--jobs 0", ">= 1"], capsys)
    assert_bad_input(nvrtc_check.main, ["--arch", "sm_90"], ["--arch sm_90", "90a"], capsys)


# ---- the helper: exit codes, Ctrl-C, GPT2NP_DEBUG ------------------------------------------------
def failing_tool(error):
    """A tool whose main raises `error`."""
    def main(argv=None):
        raise error
    return cli.tool(main)


@pytest.mark.parametrize("error, code, expected", [
    (ValueError("bad.bin: bad magic"), 2, "error: bad.bin: bad magic"),
    (FileNotFoundError(2, "No such file or directory", "x.bin"), 2,
     "error: [Errno 2] No such file or directory: 'x.bin'"),
    (KeyError("records"), 2, "error: KeyError: 'records'"),
    (ValueError("line one\nline two"), 2, "error: line one; line two"),
    (RuntimeError("the GPU fell off the bus"), 1, "error: the GPU fell off the bus"),
    (KeyboardInterrupt(), 130, "error: interrupted"),
    (MemoryError("cannot allocate 33930608640 bytes"), 1,
     "error: out of memory (cannot allocate 33930608640 bytes): give a smaller model, "
     "batch or context"),
    (MemoryError(), 1, "error: out of memory: give a smaller model, batch or context"),
])
def test_helper_maps_errors_to_one_line_and_a_code(error, code, expected, capsys, monkeypatch):
    monkeypatch.delenv("GPT2NP_DEBUG", raising=False)
    assert failing_tool(error)([]) == code
    assert one_error_line(capsys.readouterr().err) == expected


def test_debug_reraises_in_process(monkeypatch, capsys):
    monkeypatch.setenv("GPT2NP_DEBUG", "1")
    with pytest.raises(cli.BadInput, match="-l nan"):
        train.main(["-l", "nan"])
    with pytest.raises(KeyError):
        failing_tool(KeyError("records"))([])
    assert capsys.readouterr().err == ""


def run_cli(args, **env):
    """A real process: (exit code, stderr)."""
    environment = {k: v for k, v in os.environ.items() if k != "GPT2NP_DEBUG"} | env
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=environment)
    return done.returncode, done.stderr


def test_shell_sees_exit_2_and_one_line(a_file):
    code, err = run_cli(["train.py", "-l", "nan"])
    assert (code == 2 and one_error_line(err) == "error: -l nan: the learning rate must be a "
                                                 "finite number > 0")
    code, err = run_cli(["-m", "gpt2np.cli.profile", "--out", str(a_file)])
    assert code == 2 and "--out" in one_error_line(err)


def test_gpt2np_debug_shows_the_traceback(a_file):
    code, err = run_cli(["-m", "gpt2np.cli.profile", "--out", str(a_file)], GPT2NP_DEBUG="1")
    assert code == 1 and "Traceback (most recent call last)" in err and "BadInput: --out" in err
