"""gpt2np.profiling.ncu: Nsight Compute exports in ncu's own CSV layouts (written here) and .ncu-rep reports
(through a stand-in for NVIDIA's ncu_report module) attributed to layer, op and direction."""
import json

import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.profiling import ncu, report
from gpt2np.profiling.profiler import profile_steps, write_outputs

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC"')


def details_csv(rows):
    """ncu --csv (details page): a ==PROF== preamble, one row per kernel and metric."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.11)",
             "==PROF== Profiling \"layernorm_forward\" - 0: 0%....50%....100% - 9 passes",
             HEAD + ',"Section Name","Metric Name","Metric Unit","Metric Value"']
    for kid, name, grid, block, metric, unit, value in rows:
        lines.append(f'"{kid}","4242","python3.11","127.0.0.1","{name}","1","7","{block}","{grid}","0","9.0",'
                     f'"Command line profiler metrics","{metric}","{unit}","{value}"')
    return "\n".join(lines) + "\n"


def raw_csv(metrics, units, rows, nvtx=False):
    """ncu --csv --page raw: one column per metric, a units row under the header."""
    head = HEAD + "".join(f',"{m}"' for m in metrics) + (',"NVTX Push/Pop Stack"' if nvtx else "")
    lines = ["==PROF== Disconnected from process 4242", head,
             '"","","","","","","","","","",""' + "".join(f',"{u}"' for u in units) + (',""' if nvtx else "")]
    for kid, name, grid, block, values, *stack in rows:
        cells = [str(kid), "4242", "python3.11", "h", name, "1", "7", block, grid, "NVIDIA H100 80GB HBM3", "9.0"]
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
    assert matched == {} and [r.op for r in records] == ["layernorm_forward", "gelu_forward"]   # by name


def test_raw_page_with_nvtx_stacks_attributes_by_our_range_names(tmp_path):
    metrics = [ncu.TIME, ncu.DRAM, ncu.OCCUPANCY, ncu.SM_PCT]
    units = ["nsecond", "byte", "%", "%"]
    step = "Train step 1 > gpt2_forward > Layer 0 > "
    path = tmp_path / "raw.csv"
    path.write_text(raw_csv(metrics, units, [
        (0, "layernorm_forward", "(2,1,1)", "(256,1,1)", ["1,000", "4,096", "50.5", "12.0"],
         step + "layernorm_forward"),
        (1, "ampere_sgemm_32x32_sliced1x4_tn", "(3,1,1)", "(128,1,1)", ["2,000", "8,192", "30", "55"],
         step + "matmul_forward"),
        (2, "add_bias", "(6,1,1)", "(256,1,1)", ["500", "2,048", "80", "10"], step + "matmul_forward"),
        (3, "permute_qkv", "(6,1,1)", "(256,1,1)", ["500", "2,048", "80", "10"], step + "attention_forward"),
        (4, "ampere_sgemm_32x32_sliced1x4_tn", "(3,1,1)", "(128,1,1)", ["2,000", "8,192", "30", "55"],
         step + "matmul_forward"),
        (5, "ampere_sgemm_32x32_sliced1x4_nn", "(3,1,1)", "(128,1,1)", ["3,000", "8,192", "30", "55"],
         "Train step 1 > gpt2_backward > Layer 0 > matmul_backward"),
    ], nvtx=True))
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
    assert float(rows[0][14]) == pytest.approx(100 * 4096 / 3.35e12 * 1e9 / 1000, abs=0.05)   # % roofline


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
            rows.append((len(rows), "splitKreduce_kernel", "(1,1,1)", "(32,1,1)", ["1,000"]))  # cuBLAS's extra
    path = tmp_path / "step.csv"
    path.write_text(raw_csv([ncu.TIME], ["nsecond"], rows))
    assert ncu.main([str(path), "--records", profile_json, "--json", str(tmp_path / "k.json")]) == 0
    out = capsys.readouterr().out
    assert f"{len(kernels)} kernels matched" in out and "100% within 10%" in out
    doc = json.load(open(tmp_path / "k.json"))["records"]
    extra = [r for r in doc if r["kernel"] == "splitKreduce_kernel"]
    assert extra and all(r["op"] == "" for r in extra)
    matched = [r for r in doc if r["kernel"] != "splitKreduce_kernel"]
    assert [(r["op"], r["module"], r["direction"]) for r in matched] == [(r.op, r.module, r.direction)
                                                                         for r in kernels]
    gemm = next(r for r in matched if r["kernel"].startswith("ampere") and r["module"] == "h.0.mlp.c_fc")
    assert gemm["flops"] == next(r.flops for r in kernels if r.module == "h.0.mlp.c_fc" and r.kernel.startswith("cu"))


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
    """What gpt2np uses of ncu_report: load_report -> IContext(num_ranges, range_by_idx) -> IRange(num_actions,
    action_by_idx) -> IAction(name, metric_names, metric_by_name, nvtx_state)."""

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
    actions = [FakeAction("fused_classifier", {ncu.TIME: (2.5, "usecond"), ncu.GRID: (16, ""), ncu.BLOCK: (1024, "")},
                          ("Train step 2", "gpt2_forward", "fused_classifier")),
               FakeAction("adamw_update", {ncu.TIME: (900, "nsecond"), ncu.DRAM: (1.0, "Kbyte")},
                          ("Train step 2", "gpt2_update", "adamw"))]
    kernels = ncu.read_rep(str(tmp_path / "x.ncu-rep"), FakeNcuReport(actions))
    assert [(k.name, k.time_ns, k.grid, k.block) for k in kernels] == [("fused_classifier", 2500, "(16)", "(1024)"),
                                                                      ("adamw_update", 900, "", "")]
    records, _ = ncu.attribute(kernels)
    assert [(r.step, r.direction, r.module) for r in records] == [(2, "fprop", "lm_head"), (2, "update", "optimizer")]
    assert records[1].bytes == 1000


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    missing = tmp_path / "none.csv"
    assert ncu.main([str(missing)]) == 2
    junk = tmp_path / "junk.csv"
    junk.write_text("hello\n")
    assert ncu.main([str(junk)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "no such file" in err[0] and "no ncu CSV table" in err[1]
