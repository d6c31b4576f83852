"""gpt2np.profiling.ncu: Nsight Compute exports in ncu's own CSV layouts (written here) and .ncu-rep
reports (through a stand-in for NVIDIA's ncu_report module) attributed to layer,
op and direction."""
import errno
import json
import os

import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.cli import ncu as ncu_cli
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.profiling import ncu
from gpt2np.profiling.profiler import profile_steps, write_outputs
from gpt2np.profiling.render import report

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block '
        'Size","Grid Size","Device","CC"')


def details_csv(rows):
    """ncu --csv (details page): a ==PROF== preamble, one row per kernel and metric."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.11)",
             "==PROF== Profiling \"layernorm_forward\" - 0: 0%....50%....100% - 9 passes",
             HEAD + ',"Section Name","Metric Name","Metric Unit","Metric Value"']
    for kid, name, grid, block, metric, unit, value in rows:
        lines.append(f'"{kid}","4242","python3.11","127.0.0.1","{name}","1","7","{block}",'
                     f'"{grid}","0","9.0",'
                     f'"Command line profiler metrics","{metric}","{unit}","{value}"')
    return "\n".join(lines) + "\n"


def raw_csv(metrics, units, rows, nvtx=False):
    """ncu --csv --page raw: one column per metric, a units row under the header."""
    head = HEAD + "".join(f',"{m}"' for m in metrics) + (',"NVTX Push/Pop Stack"' if nvtx else "")
    lines = ["==PROF== Disconnected from process 4242", head,
             '"","","","","","","","","","",""' + "".join(f',"{u}"' for u in units) + (',""' if nvtx
                                                                                       else "")]
    for kid, name, grid, block, values, *stack in rows:
        cells = [str(kid), "4242", "python3.11", "h", name, "1", "7", block, grid,
                 "NVIDIA H100 80GB HBM3", "9.0"]
        cells += values + (stack if nvtx else [])
        lines.append(",".join(f'"{c}"' for c in cells))
    return "\n".join(lines) + "\n"


def test_details_page_with_units_separators_and_na(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text(details_csv([
        (0, "layernorm_forward", "(1, 1, 1)", "(256, 1, 1)", ncu.TIME, "usecond", "12.50"),
        (0, "layernorm_forward", "(1, 1, 1)", "(256, 1, 1)", ncu.DRAM, "Mbyte", "1.5"),
        (0, "layernorm_forward", "(1, 1, 1)", "(256, 1, 1)", ncu.OCCUPANCY, "%", "n/a"),
        (1, "gelu_forward", "(96, 1, 1)", "(256, 1, 1)", ncu.TIME, "nsecond", "1,215,000"),
        (1, "gelu_forward", "(96, 1, 1)", "(256, 1, 1)", ncu.FFMA, "inst", "2,000,000"),
        (1, "gelu_forward", "(96, 1, 1)", "(256, 1, 1)", ncu.FMUL, "inst", "1,000"),
    ]))
    k0, k1 = ncu.read(str(path))
    assert (k0.name, k0.grid, k0.block) == ("layernorm_forward", "(1,1,1)", "(256,1,1)")
    assert k0.time_ns == pytest.approx(12_500) and k0.dram_bytes == pytest.approx(1.5e6)
    assert k0.metric(ncu.OCCUPANCY) is None and k0.fp32_flops is None
    assert k1.time_ns == 1_215_000 and k1.fp32_flops == 2 * 2_000_000 + 1_000
    records, matched = ncu.attribute([k0, k1])
    # by name
    assert matched == {} and [r.op for r in records] == ["layernorm_forward", "gelu_forward"]


def test_raw_page_with_nvtx_stacks_attributes_by_our_range_names(tmp_path):
    metrics = [ncu.TIME, ncu.DRAM, ncu.OCCUPANCY, ncu.SM_PCT]
    units = ["nsecond", "byte", "%", "%"]
    step = "Train step 1 > gpt2_forward > Layer 0 > "
    path = tmp_path / "raw.csv"
    path.write_text(raw_csv(metrics, units, [
        (0, "layernorm_forward", "(2,1,1)", "(256,1,1)", ["1,000", "4,096", "50.5", "12.0"],
         step + "layernorm_forward"),
        (1, "ampere_sgemm_32x32_sliced1x4_tn", "(3,1,1)", "(128,1,1)",
         ["2,000", "8,192", "30", "55"], step + "matmul_forward"),
        (2, "add_bias", "(6,1,1)", "(256,1,1)",
         ["500", "2,048", "80", "10"], step + "matmul_forward"),
        (3, "permute_qkv", "(6,1,1)", "(256,1,1)",
         ["500", "2,048", "80", "10"], step + "attention_forward"),
        (4, "ampere_sgemm_32x32_sliced1x4_tn", "(3,1,1)", "(128,1,1)",
         ["2,000", "8,192", "30", "55"],
         step + "matmul_forward"),
        (5, "ampere_sgemm_32x32_sliced1x4_nn",
         "(3,1,1)", "(128,1,1)", ["3,000", "8,192", "30", "55"],
         "Train step 1 > gpt2_backward > Layer 0 > matmul_backward"),], nvtx=True))
    kernels = ncu.read(str(path))
    assert [k.nvtx[-1] for k in kernels][:2] == ["layernorm_forward", "matmul_forward"]
    records, _ = ncu.attribute(kernels)
    assert [(r.direction, r.layer_index, r.module) for r in records] == [
        ("fprop", 0, "h.0.ln_1"), ("fprop", 0, "h.0.attn.c_attn"), ("fprop", 0, "h.0.attn.c_attn"),
        ("fprop", 0, "h.0.attn"), ("fprop", 0, "h.0.attn.c_proj"), ("bprop", 0, "h.0.mlp.c_proj")]
    assert records[0].bytes == 4096 and records[0].duration_ns == 1000 and records[0].step == 1
    roof = report.Roofline("H100 SXM", 67e12, 3.35e12, 494.5e12)
    rows = ncu.kernel_rows(kernels, records, {}, roof)
    assert rows[0][11] == "50.5" and rows[0][12] == "12.0"                      # occupancy, SM %
    # % roofline
    assert float(rows[0][14]) == pytest.approx(100 * 4096 / 3.35e12 * 1e9 / 1000, abs=0.05)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    cfg = GPT2Config(32, 100, 128, 1, 2, 16)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, cfg.vocab_size, (2, 2, 9)).astype(np.int32)
    model = GPT2(cfg, get_backend("emu"), 2, 8, seed=0)
    prof = profile_steps(model, [(b[:, :-1], b[:, 1:]) for b in raw], steps=1)
    out = tmp_path_factory.mktemp("builtin")
    return prof, write_outputs(prof, out)["json"]


def test_records_alignment_and_agreement_with_the_built_in_times(builtin, tmp_path, capsys):
    prof, profile_json = builtin
    kernels = [r for r in prof.records if r.step == 1 and r.kind == "kernel"]
    rows = []
    for r in kernels:
        name = "ampere_sgemm_64x32_sliced1x4_nn" if r.kernel.startswith("cublas") else r.kernel
        rows.append((len(rows), name, "(1,1,1)", "(32,1,1)", [str(r.duration_ns * 1.05)]))
        if r.kernel == "cublasSgemm (gemm_matmul_backward_dweight)" and len(rows) < 60:
            # cuBLAS's extra
            rows.append((len(rows), "splitKreduce_kernel", "(1,1,1)", "(32,1,1)", ["1,000"]))
    path = tmp_path / "step.csv"
    path.write_text(raw_csv([ncu.TIME], ["nsecond"], rows))
    assert ncu_cli.main([str(path), "--records", profile_json, "--json",
                         str(tmp_path / "k.json")]) == 0
    out = capsys.readouterr().out
    assert f"{len(kernels)} kernels matched" in out and "100% within 10%" in out
    doc = json.load(open(tmp_path / "k.json"))["records"]
    extra = [r for r in doc if r["kernel"] == "splitKreduce_kernel"]
    assert extra and all(r["op"] == "" for r in extra)
    matched = [r for r in doc if r["kernel"] != "splitKreduce_kernel"]
    assert [(r["op"], r["module"], r["direction"]) for r in matched] == [(r.op,
                                                                          r.module, r.direction)
                                                                         for r in kernels]
    gemm = next(r for r in matched
                if r["kernel"].startswith("ampere") and r["module"] == "h.0.mlp.c_fc")
    assert gemm["flops"] == next(r.flops for r in kernels
                                 if r.module == "h.0.mlp.c_fc" and r.kernel.startswith("cu"))


class FakeMetric:
    def __init__(self, value, unit):
        self._value, self._unit = value, unit

    def has_value(self):
        return self._value is not None

    def value(self):
        return self._value

    def unit(self):
        return self._unit


class FakeAction:
    def __init__(self, name, metrics, stack):
        self._name, self._metrics, self._stack = name, metrics, stack

    def name(self):
        return self._name

    def metric_names(self):
        return tuple(self._metrics)

    def metric_by_name(self, name):
        return FakeMetric(*self._metrics[name])

    def nvtx_state(self):
        stack = self._stack

        class Domain:
            def push_pop_ranges(self):
                return stack

        class State:
            def domains(self):
                return (0,)

            def domain_by_id(self, i):
                return Domain()

        return State()


class FakeNcuReport:
    """What gpt2np uses of ncu_report: load_report -> IContext(num_ranges, range_by_idx) ->
    IRange(num_actions, action_by_idx) -> IAction(name, metric_names,
    metric_by_name, nvtx_state)."""

    def __init__(self, actions):
        self.actions = actions

    def load_report(self, path):
        actions = self.actions

        class Range:
            def num_actions(self):
                return len(actions)

            def action_by_idx(self, i):
                return actions[i]

        class Context:
            def num_ranges(self):
                return 1

            def range_by_idx(self, i):
                return Range()

        return Context()


def test_ncu_rep_through_ncu_report(tmp_path):
    actions = [FakeAction("fused_classifier",
                          {ncu.TIME: (2.5, "usecond"), ncu.GRID: (16, ""), ncu.BLOCK: (1024, "")},
                          ("Train step 2", "gpt2_forward", "fused_classifier")),
               FakeAction("adamw_update", {ncu.TIME: (900, "nsecond"), ncu.DRAM: (1.0, "Kbyte")},
                          ("Train step 2", "gpt2_update", "adamw"))]
    kernels = ncu.read_rep(str(tmp_path / "x.ncu-rep"), FakeNcuReport(actions))
    assert [
        (
            k.name, k.time_ns, k.grid, k.block) for k in kernels] == [("fused_classifier",
                                                                       2500, "(16)", "(1024)"),
                                                                      ("adamw_update", 900, "", "")]
    records, _ = ncu.attribute(kernels)
    assert [(r.step, r.direction, r.module) for r in records] == [(2, "fprop", "lm_head"),
                                                                  (2, "update", "optimizer")]
    assert records[1].bytes == 1000


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    missing = tmp_path / "none.csv"
    assert ncu_cli.main([str(missing)]) == 2
    junk = tmp_path / "junk.csv"
    junk.write_text("hello\n")
    assert ncu_cli.main([str(junk)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "no such file" in err[0] and "no ncu CSV table" in err[1]


def good_raw(tmp_path, name="good.csv", value="1,000", unit="nsecond", metric=ncu.TIME):
    path = tmp_path / name
    path.write_text(raw_csv([metric], [unit],
                            [(0, "layernorm_forward", "(2,1,1)", "(256,1,1)", [value])]))
    return str(path)


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("value, unit, words", [
    ("abc", "nsecond", "line 4 (kernel 0): metric gpu__time_duration.sum: 'abc' is not a number"),
    ("-5", "nsecond", "metric gpu__time_duration.sum: -5: must be a finite number >= 0"),
    ("inf", "nsecond", "must be a finite number >= 0"),
    ("5", "parsecs", "unit 'parsecs' is not a time unit"),
])
def test_bad_metric_values_and_units_name_the_file_line_and_metric(tmp_path, capsys, value,
                                                                   unit, words):
    path = good_raw(tmp_path, "bad.csv", value, unit)
    assert ncu_cli.main([path]) == 2
    err = one_error(capsys)
    assert path in err and words in err
    # the details page too
    details = tmp_path / "details.csv"
    details.write_text(details_csv([(0, "gelu_forward", "(1,1,1)", "(256,1,1)", ncu.TIME, unit,
                                     value)]))
    with pytest.raises(ncu.NcuReportError, match="line 4 .*metric gpu__time_duration.sum"):
        ncu.read(str(details))


def test_bytes_in_a_time_unit_and_garbage_in_an_unused_metric(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text(raw_csv([ncu.TIME, ncu.DRAM], ["nsecond", "nsecond"],
                            [(0, "k", "(1,1,1)", "(32,1,1)", ["7", "10"])]))
    with pytest.raises(ncu.NcuReportError, match="unit 'nsecond' is not a size unit"):
        ncu.read(str(path))
    # a metric the report does not use may be text (the raw page has such columns): read as unknown
    path = tmp_path / "text.csv"
    path.write_text(raw_csv([ncu.TIME, "launch__func_cache_config"], ["nsecond", ""],
                            [(0, "k", "(1,1,1)", "(32,1,1)", ["7", "CachePreferNone"])]))
    [k] = ncu.read(str(path))
    assert k.time_ns == 7 and k.metric("launch__func_cache_config") is None


def test_an_export_without_times_is_an_error_not_zeros(tmp_path, capsys):
    path = tmp_path / "idname.csv"
    path.write_text('"ID","Kernel Name"\n"0","foo"\n')
    assert ncu_cli.main([str(path)]) == 2
    assert "no 'gpu__time_duration.sum' column" in one_error(capsys)
    details = tmp_path / "details.csv"
    details.write_text(details_csv([(0, "gelu_forward", "(1,1,1)", "(256,1,1)", ncu.DRAM, "byte",
                                     "64")]))
    assert ncu_cli.main([str(details)]) == 2
    assert "no gpu__time_duration.sum values" in one_error(capsys)


def test_an_ncu_rep_without_kernels_is_an_error(tmp_path, capsys, monkeypatch):
    path = tmp_path / "fake.ncu-rep"
    path.write_bytes(b"garbage")
    with pytest.raises(ncu.NcuReportError, match="no profiled kernels"):
        ncu.read_rep(str(path), FakeNcuReport([]))
    monkeypatch.setitem(__import__("sys").modules, "ncu_report", FakeNcuReport([]))
    assert ncu_cli.main([str(path)]) == 2
    err = one_error(capsys)
    assert str(path) in err and "no profiled kernels" in err
    bad = [FakeAction("k", {ncu.TIME: (-1.0, "nsecond")}, ())]
    with pytest.raises(ncu.NcuReportError,
                       match="kernel 0 \\(k\\): metric gpu__time_duration.sum: -1.0"):
        ncu.read_rep(str(path), FakeNcuReport(bad))


def test_a_folder_for_the_report_is_called_a_folder(tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    assert ncu_cli.main([str(tmp_path / "adir")]) == 2
    assert "is a folder" in one_error(capsys)


def test_step_needs_records(tmp_path, capsys):
    assert ncu_cli.main([good_raw(tmp_path), "--step", "3"]) == 2
    assert "--step 3: needs --records" in one_error(capsys)


def test_empty_records_profile_is_an_error(tmp_path, capsys):
    records = tmp_path / "profile.json"
    records.write_text('{"records": []}')
    assert ncu_cli.main([good_raw(tmp_path), "--records", str(records)]) == 2
    err = one_error(capsys)
    assert str(records) in err and "no records" in err


def test_a_records_profile_that_matches_no_kernel_is_named_in_the_note(builtin, tmp_path, capsys):
    # a note, not an error, as for every other mismatch (align skips kernels the profile lacks): the
    # kernels are still attributed, by their NVTX stacks or names
    _, profile_json = builtin
    path = tmp_path / "other.csv"
    path.write_text(raw_csv([ncu.TIME], ["nsecond"],
                            [(0, "foo_kernel", "(1,1,1)", "(32,1,1)", ["7"])]))
    assert ncu_cli.main([str(path), "--records", profile_json]) == 0
    out = capsys.readouterr().out
    assert (f"--records {profile_json}: matched none of the 1 kernels" in out
            and "by name only" in out)
    # was "no NVTX stacks and no --records profile"
    assert "no --records profile" not in out
    assert ncu_cli.main([str(path)]) == 0
    assert ("no NVTX stacks and no --records profile: kernels attributed by name only"
            in capsys.readouterr().out)
    # with NVTX stacks the unmatched profile is named too (it was not mentioned at all)
    path.write_text(raw_csv([ncu.TIME], ["nsecond"],
                            [(0, "foo_kernel", "(1,1,1)", "(32,1,1)", ["7"],
                              "Train step 1 > gpt2_forward > layernorm_forward")], nvtx=True))
    assert ncu_cli.main([str(path), "--records", profile_json]) == 0
    out = capsys.readouterr().out
    assert (f"--records {profile_json}: matched none of the 1 kernels" in out
            and "by their NVTX stacks" in out)


def test_output_paths_name_the_flag_and_missing_folders_are_made(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = good_raw(tmp_path)
    assert ncu_cli.main([good, "--json", "new/deeper/x.json", "--csv", "other/x.csv"]) == 0
    capsys.readouterr()
    assert (json.loads((tmp_path / "new/deeper/x.json").read_text())["records"][0]["duration_ns"]
            == 1000)
    assert (os.listdir(tmp_path / "new/deeper") == ["x.json"]
            and os.listdir(tmp_path / "other") == ["x.csv"])
    (tmp_path / "afile.txt").write_text("x")
    assert ncu_cli.main([good, "--json", "afile.txt/x.json"]) == 2
    assert "--json afile.txt/x.json: afile.txt is a file, not a folder" in one_error(capsys)
    assert ncu_cli.main([good, "--csv", "new"]) == 2
    assert "--csv new: is a folder" in one_error(capsys)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    # a failed write: the run failed
    assert ncu_cli.main([good, "--json", "full.json"]) == 1
    err = one_error(capsys)
    assert "--json full.json: cannot write it ([Errno 28]" in err and ".tmp" not in err
    assert not any(name.startswith(".full.json") for name in os.listdir(tmp_path))
