"""bench/op_bench.py without a GPU (--runtime emu): every op in both builds, one row per combination
of the settings tried, the settings really set on the backend while the op is timed, graphs of
--reps calls; bad --set is one line."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "op_bench.py"


@pytest.fixture(scope="module")
def op_bench():
    spec = importlib.util.spec_from_file_location("op_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("op", ["layernorm_backward", "layernorm_forward",
                                "fused_residual_layernorm_forward", "fused_classifier"])
def test_each_op_times_on_the_emulator(op_bench, capsys, op, precision):
    assert op_bench.main([op, "--runtime", "emu", "-b", "2", "-t", "4", "-c", "64", "-v", "300",
                          "--reps", "2", "--precision", precision]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{op} on cpu, {precision} storage, B=2 T=4 C=64, 2 calls "
                               "a graph [emulated")
    us, gbs = lines[2].split()
    assert float(us) > 0 and float(gbs) >= 0 and len(lines) == 3


def test_every_combination_of_the_settings_runs_with_them_set(op_bench, capsys, monkeypatch):
    """Two settings of two values: four rows, and each timed call saw its row's
    values on the backend."""
    seen, launches = [], []
    real_time_op = op_bench.time_op

    def recording(be, call, reps):
        seen.append((be.layernorm_max_blocks, be.layernorm_finish_threads))
        before = be.rt.graph_launches
        us = real_time_op(be, call, reps)
        launches.append(be.rt.graph_launches - before)
        return us

    monkeypatch.setattr(op_bench, "time_op", recording)
    assert op_bench.main(["layernorm_backward", "--runtime", "emu", "-b", "2", "-t", "8", "-c",
                          "64", "--reps", "3", "--set", "layernorm_max_blocks=512,2", "--set",
                          "layernorm_finish_threads=1,8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["layernorm_max_blocks", "layernorm_finish_threads",
                                "us/call", "GB/s"]
    assert [line.split()[:2] for line in lines[2:]] == [["512", "1"], ["512", "8"], ["2", "1"],
                                                        ["2", "8"]]
    assert seen == [(512, 1), (512, 8), (2, 1), (2, 8)]
    # one untimed launch of the captured graph, one timed
    assert launches == [2] * 4


@pytest.mark.parametrize("fuse", [0, 1])
def test_the_bandwidth_is_the_contracts_bytes_of_the_path_run(op_bench, fuse):
    """--fuse 1 is costed as the one-pass kernel (fewer bytes), --fuse 0 as the two passes."""
    import numpy as np

    from gpt2np.backends import get_backend
    from gpt2np.ops.contract import op_cost
    be = get_backend("emu")
    _, args = op_bench.op_call(be, "layernorm_backward", 2, 4, 64, bool(fuse),
                               np.random.default_rng(0))
    assert (op_cost("layernorm_backward", args).bytes
            == op_cost("layernorm_backward", args[:-1], fused=bool(fuse)).bytes)


@pytest.mark.parametrize("flag, words", [("nope=1", "NAME one of"),
                                         ("row_warps=x", "must be integers"),
                                         ("row_warps", "expected NAME=V1,V2"),
                                         ("layernorm_finish_threads=8,64", "an integer in 1..32")])
def test_a_bad_set_is_one_line(op_bench, capsys, flag, words):
    with pytest.raises(SystemExit) as stop:
        op_bench.main(["layernorm_backward", "--runtime", "emu", "--set", flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and words in err[-1] and f"--set {flag.split('=')[0]}" in err[-1]


def test_the_script_runs_as_a_command():
    import subprocess
    done = subprocess.run([sys.executable, str(SCRIPT), "layernorm_forward", "--runtime", "emu",
                           "-b", "1", "-t", "2",
                           "-c", "32", "--reps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "us/call" in done.stdout, done.stderr
