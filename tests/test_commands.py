"""The `gpt2np` console script: every subcommand answers --help under its own name (`usage: gpt2np
NAME`), dispatches to its tool (train is train.py), and bad input to any of them ends in one
`error:` line, exit 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import train
from gpt2np.cli import main as commands

REPO = Path(__file__).resolve().parent.parent
NAMES = ["train", "prepare", "fetch", "compare", "profile", "plan", "nsys", "ncu", "report", "hf",
         "eval", "sample", "plot"]


def one_error_line(err):
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n") and lines[0].startswith("error: "), err
    return lines[0]


def test_the_issue_17_commands_are_all_there():
    assert list(commands.COMMANDS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_help_of_every_command_under_its_own_name(name, capsys):
    assert commands.main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: gpt2np {name} "), out[:200]


def test_help_of_hf_subcommands_and_the_command_list(capsys):
    for action in ("import", "export"):
        assert commands.main(["hf", action, "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"usage: gpt2np hf {action} ")
    assert commands.main(["--help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"\n  {name} " in listing for name in NAMES)
    assert commands.main(["help", "eval"]) == 0
    assert "hellaswag" in capsys.readouterr().out


def test_eval_help_names_hellaswag(capsys):
    assert commands.main(["eval", "--help"]) == 0
    assert "hellaswag: acc and acc_norm on HellaSwag" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, expected", [
    (["train", "-l", "nan"], "error: -l nan: the learning rate must be a finite number > 0"),
    (["prepare", "--val-tokens", "-1"], "--val-tokens -1"),
    (["fetch", "bogus"], "unknown WHAT 'bogus'"),
    (["compare", "-e", "missing.bin"], "missing.bin: no such model file"),
    (["profile", "--out", "a_file"], "--out a_file: is a file"),
    (["plan", "-b", "0"], "-b 0"),
    (["nsys", "missing.sqlite"], "missing.sqlite"),
    (["ncu", "missing.csv"], "missing.csv"),
    (["report", "missing.json"], "missing.json"),
    (["hf", "import", "./no/such/dir", "-o", "x.bin"], "./no/such/dir: no such folder"),
    (["hf", "export", "missing.bin", "-o", "out"], "missing.bin"),
    (["eval", "hellaswag", "-e", "m.bin", "-j", "no.jsonl"], "-j no.jsonl: no such file"),
    (["sample", "-e", "m.bin", "-g", "-1"], "-g -1"),
    (["plot", "no_run"], "no_run: no such run folder"),
    # '' was tinyshakespeare
    (["prepare", "--input", ""], "--input '': must be a non-empty text"),
    # '' was the folder here
    (["hf", "export", "m.bin", "-o", ""], "-o/--output '': must be a non-empty text"),
    (["eval", "hellaswag", "-e", "m.bin", "-j", ""], "-j/--val-data '': must be a non-empty text"),
    (["plot", "run", "-o", ""], "-o/--output '': must be a non-empty text"),
    (["profile", "--out", ""], "--out '': must be a non-empty text"),
    (["sample", "-e", ""], "-e/--model '': must be a non-empty text"),
    (["plot", ""], "RUN_DIR '': must be a non-empty text"),
    (["nope"], "unknown command 'nope'"),
    ([], "no command"),
    (["--bogus"], "--bogus before a command"),
])
def test_bad_input_to_every_command_is_one_line(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPT2NP_DEBUG", raising=False)
    (tmp_path / "a_file").write_text("x")
    assert commands.main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line, line


def test_train_is_train_py(capsys):
    assert commands.main(["train", "-k", "step"]) == 2
    via_command = capsys.readouterr().err
    assert train.main(["-k", "step"]) == 2
    assert capsys.readouterr().err == via_command
    assert train.main is commands.importlib.import_module("gpt2np.cli.train").main


def test_console_script_entry_point():
    tomllib = pytest.importorskip("tomllib")                     # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"gpt2np": "gpt2np.cli.main:main"}
    env = {k: v for k, v in os.environ.items() if k != "GPT2NP_DEBUG"}
    done = subprocess.run([sys.executable, "-m", "gpt2np", "sample", "-g", "x", "-e", "m.bin"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert (done.returncode == 2
            and one_error_line(done.stderr).startswith("error: argument -g/--gen-tokens"))
    # pip install -e . puts the script beside python
    installed = Path(sys.executable).parent / "gpt2np"
    if installed.is_file():
        done = subprocess.run([str(installed), "eval", "gsm8k"], capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 2 and "invalid choice: 'gsm8k'" in one_error_line(done.stderr)


def test_fetch_knows_the_starter_packs_bf16_model():
    """llm.c's starter pack (dev/download_starter_pack.sh) has gpt2_124M_bf16.bin beside
    gpt2_124M.bin: -e and `gpt2np fetch model-bf16` can fetch it."""
    from gpt2np.cli import fetch as fetch_cli
    from gpt2np.datasets import fetch
    assert fetch.KNOWN_FILES["gpt2_124M_bf16.bin"] == fetch.STARTER_PACK_URL + "gpt2_124M_bf16.bin"
    assert fetch_cli.GROUPS["model-bf16"] == ["gpt2_124M_bf16.bin"]


# ---- a reader that stops early (`gpt2np sample ... | head`) ---------------------------------
def test_a_closed_pipe_ends_a_command_quietly_with_141(tmp_path, data_dir):
    """`gpt2np sample ... | head`: once head has read enough and exited, sample ends at its next
    write with no error line and exit 141, as a Unix filter that SIGPIPE ends (128 + 13)."""
    from gpt2np.backends import get_backend
    from gpt2np.config import GPT2Config
    from gpt2np.formats.checkpoint import save_model
    from gpt2np.model import GPT2
    cfg = GPT2Config(32, 50257, 50304, 1, 2, 16)
    save_model(tmp_path / "m.bin", cfg, GPT2(cfg, get_backend("numpy"), 1, 1, seed=1).params_host())
    env = {k: v for k, v in os.environ.items() if k != "GPT2NP_DEBUG"}
    command = [sys.executable, "-m", "gpt2np", "sample", "-e", str(tmp_path / "m.bin"), "--bpe-dir",
               str(data_dir), "-g", "5000", "--device", "cpu"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                          env=env) as sample:
        assert len(sample.stdout.read(20)) == 20          # head -c 20
        sample.stdout.close()
        err = sample.stderr.read().decode()
        assert sample.wait(timeout=120) == 141, err
    assert "error" not in err and "Broken pipe" not in err and "Traceback" not in err, err
    assert err.startswith("model ") and len(err.splitlines()) == 1, err


def test_a_closed_pipe_in_the_interpreters_last_flush(monkeypatch, capsys):
    """Output still in stdout's buffer when a command returns meets the closed pipe in the tool's
    own flush: exit 141, nothing on stderr, and stdout then writes to /dev/null (the interpreter's
    last flush stays quiet). Under GPT2NP_DEBUG=1 the BrokenPipeError itself."""
    monkeypatch.delenv("GPT2NP_DEBUG", raising=False)
    read_end, write_end = os.pipe()
    os.close(read_end)
    pipe = open(write_end, "w")
    try:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert commands.main(["--help"]) == 141
        pipe.write("more")
        pipe.flush()                                     # /dev/null now: no BrokenPipeError
    finally:
        pipe.close()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("GPT2NP_DEBUG", "1")
    read_end, write_end = os.pipe()
    os.close(read_end)
    pipe = open(write_end, "w")
    try:
        monkeypatch.setattr(sys, "stdout", pipe)
        with pytest.raises(BrokenPipeError):
            commands.main(["--help"])
    finally:
        with pytest.raises(BrokenPipeError):             # the help still in its buffer
            pipe.close()
    assert pipe.closed


def test_a_broken_pipe_that_is_not_the_output_is_an_error(monkeypatch, capsys):
    """A BrokenPipeError from elsewhere (a worker process that died) while stdout is fine stays an
    error line."""
    from gpt2np.errors import tool
    monkeypatch.delenv("GPT2NP_DEBUG", raising=False)

    @tool
    def worker_died(argv=None):
        raise BrokenPipeError(32, "Broken pipe")

    assert worker_died() == 2
    assert capsys.readouterr().err == "error: [Errno 32] Broken pipe\n"
