"""gpt2np.profiling.render.report and .gpu_specs: roofline numbers, tables, module tree, range
summaries, files."""
import builtins
import csv
import json
import math
import os

import pytest

from gpt2np.cli import report as report_cli
from gpt2np.config import preset
from gpt2np.profiling import gpu_specs
from gpt2np.profiling.gpu_specs import Roofline
from gpt2np.profiling.render import report
from gpt2np.profiling.render.report import KernelRecord
from gpt2np.tensors import num_parameters

# ---------------------------------------------------------------------------------------------
# gpu_specs


@pytest.mark.parametrize("name, entry", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"), ("Tesla V100-SXM2-16GB", "V100 SXM2"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"), ("NVIDIA L4", "L4"), ("NVIDIA A10", "A10"),
    ("NVIDIA GeForce RTX 3090", "RTX 3090"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 4070 Ti", "RTX 4070 Ti"), ("cpu", "cpu"),])
def test_lookup_by_name_fragment(name, entry):
    assert gpu_specs.lookup(name).name == entry


@pytest.mark.parametrize("name", ["NVIDIA A10G", "Quadro P1000", "NVIDIA GeForce GTX 1080"])
def test_lookup_unknown(name):
    assert gpu_specs.lookup(name) is None
    with pytest.raises(gpu_specs.UnknownDeviceError, match="unknown device"):
        gpu_specs.require(name)


def test_peaks_are_dense_datasheet_numbers():
    assert gpu_specs.peak_flops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(67e12)
    assert gpu_specs.peak_flops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(494.5e12)
    assert gpu_specs.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert gpu_specs.peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert gpu_specs.peak_bandwidth("NVIDIA A100-SXM4-80GB") == pytest.approx(2039e9)
    assert gpu_specs.peak_flops("Tesla V100-SXM2-16GB", "tf32") is None        # no TF32 on Volta
    assert gpu_specs.peak_flops("cpu") is None and gpu_specs.peak_bandwidth("cpu") is None
    assert gpu_specs.peak_flops("Voodoo5") is None
    with pytest.raises(ValueError, match="unknown precision"):
        gpu_specs.peak_flops("NVIDIA L4", "fp8")
    for spec in gpu_specs.DEVICES.values():    # tensor cores are never slower than the CUDA cores
        for p in ("tf32", "bf16", "fp16"):
            if spec.fp32 and spec.tflops(p):
                assert spec.tflops(p) >= spec.fp32


def test_roofline_and_ridge():
    roof = gpu_specs.roofline("NVIDIA H100 80GB HBM3", "fp32", matmul_precision="tf32")
    assert roof.device == "H100 SXM"
    assert roof.ridge() == pytest.approx(67e12 / 3350e9)
    assert roof.ridge(is_gemm=True) == pytest.approx(494.5e12 / 3350e9)
    cpu = gpu_specs.roofline("cpu")
    assert cpu.peak_flops is None and cpu.ridge() is None
    with pytest.raises(gpu_specs.UnknownDeviceError):
        gpu_specs.roofline("Voodoo5")


def test_flops_per_token_and_mfu():
    cfg = preset("d12")
    n = num_parameters(cfg)
    assert gpu_specs.flops_per_token(n, 12, 768, 1024) == 6 * n + 6 * 12 * 768 * 1024
    # 1e5 tok/s of a 1e9 FLOP/token model is 1e14 FLOP/s: 20% of 500 TFLOP/s
    spec = gpu_specs.DeviceSpec("test", 50.0, 500.0, 1000.0, 1000.0, 1000.0)
    assert gpu_specs.mfu(1e9, 1e5, spec, "tf32") == pytest.approx(0.2)
    assert gpu_specs.mfu(1e9, 1e5, spec, "bf16") == pytest.approx(0.1)
    assert gpu_specs.mfu(1e9, 1e5, "cpu") is None


# ---------------------------------------------------------------------------------------------
# records and the roofline classification

# ridges 10 and 100
ROOF = Roofline("test GPU", peak_flops=10e12, peak_bw=1e12, matmul_peak_flops=100e12)


def rec(idx, op="layernorm_forward", module="h.0.ln_1", direction="fprop", layer=0, step=1,
        kernel="k", start=None, dur=1000, flops=0, nbytes=0, stack=()):
    return KernelRecord(idx=idx, step=step, direction=direction, layer=layer, op=op, module=module,
                        params="B=4,T=64,C=768", kernel=kernel,
                        start_ns=idx * 10_000 if start is None else start,
                        duration_ns=dur, flops=flops, bytes=nbytes, range_stack=tuple(stack))


def test_derived_rates():
    r = rec(0, dur=1_000_000, flops=2_000_000_000, nbytes=50_000_000)     # 1 ms
    assert r.gflops_per_s == pytest.approx(2000.0) and r.gbytes_per_s == pytest.approx(50.0)
    assert r.intensity == pytest.approx(40.0) and r.end_ns == r.start_ns + 1_000_000
    unknown = rec(1)
    assert (unknown.gflops_per_s is None and unknown.gbytes_per_s is None
            and unknown.intensity is None)
    assert rec(2, layer=-1).layer_index is None and rec(3, layer=None).layer_index is None


def test_classify_compute_and_memory_bound():
    # intensity 100 > ridge 10: compute bound, 1e12 FLOP/s of 10e12 = 10%
    assert report.classify(10**9, 10**7, 10**6, ROOF) == ("compute", pytest.approx(10.0))
    # intensity 0.01: memory bound, 1e11 B/s of 1e12 = 10%
    assert report.classify(10**6, 10**8, 10**6, ROOF) == ("memory", pytest.approx(10.0))
    # a GEMM is held to the matmul ceiling: intensity 50 < ridge 100 -> memory bound
    assert (report.classify(5 * 10**8, 10**7, 10**6, ROOF, is_gemm=True)
            == ("memory", pytest.approx(1.0)))
    assert (report.classify(2 * 10**10, 10**7, 10**6, ROOF, is_gemm=True)
            == ("compute", pytest.approx(20.0)))
    # no bytes at all: infinitely intense
    assert report.classify(10**9, 0, 10**6, ROOF)[0] == "compute"
    # unknown work or roofline
    assert report.classify(0, 0, 10**6, ROOF) == ("-", None)
    assert report.classify(10**9, 10**7, 10**6, None) == ("-", None)
    assert report.classify(10**9, 10**7, 10**6, gpu_specs.roofline("cpu")) == ("-", None)


def test_gemm_detection():
    assert rec(0, kernel="cublasSgemm").is_gemm and rec(0, kernel="numpy.matmul").is_gemm
    assert rec(0, kernel="void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64>").is_gemm
    assert not rec(0, kernel="matmul_backward_bias_kernel").is_gemm


# ---------------------------------------------------------------------------------------------
# tables

def cells(table, first):
    """The cells of the table row whose first cell is `first`."""
    for line in table.splitlines():
        parts = line.split()
        if parts and parts[0] == str(first):
            return parts
    raise AssertionError(f"no row {first!r} in\n{table}")


def test_format_table_alignment():
    text = report.format_table([("name", "l"), ("n", "r")], [["a", 1], ["bbbb", 100]], title="T")
    assert text.splitlines() == ["T", "name    n", "----  ---", "a       1", "bbbb  100"]


def test_kernel_table_rows():
    records = [rec(0, flops=10**9, nbytes=10**7, dur=10**6, kernel="layernorm_forward_kernel"),
               rec(1, op="matmul_forward", module="h.0.attn.c_attn", kernel="cublasSgemm",
                   flops=2 * 10**10, nbytes=10**7, dur=10**6),
               rec(2, step=2, flops=1, nbytes=1)]
    table = report.kernel_table(records, ROOF, step=1)
    assert table.splitlines()[0] == "Kernels of step 1 on test GPU"
    header = table.splitlines()[1].split()
    assert header[:7] == ["idx", "dir", "layer", "op", "module", "params", "kernel"]
    assert cells(table, 0) == ["0", "fprop", "0", "layernorm_forward", "h.0.ln_1", "B=4,T=64,C=768",
                               "layernorm_forward_kernel", "1000.00", "1G", "10M", "1000.0", "10.0",
                               "100.00", "compute", "10.0%"]
    assert cells(table, 1)[-2:] == ["compute", "20.0%"]
    assert cells(table, "total") == ["total", "2", "launches", "2000.00", "21G", "20M",
                                     "10500.0", "10.0"]
    assert "  2  " not in table             # step 2 left out


def test_kernel_table_without_work_hides_those_columns():
    table = report.kernel_table([rec(0), rec(1)], ROOF)
    assert "FLOPs" not in table and "%peak" not in table
    assert cells(table, 0)[-1] == "1.00"


def test_long_kernel_names_are_clipped():
    name = "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_256x128_32x3_nn_align4>(Params)"
    table = report.kernel_table([rec(0, kernel=name)], kernel_width=20)
    assert name[:18] + ".." in table and name not in table


def test_select_step():
    records = [rec(0, step=1), rec(1, step=3), rec(2, step=2), rec(3, step=None)]
    assert [r.idx for r in report.select_step(records, "last")] == [1]
    assert [r.idx for r in report.select_step(records, 2)] == [2]
    assert len(report.select_step(records, None)) == 4
    assert report.parse_step("all") is None and report.parse_step("7") == 7
    with pytest.raises(report.ReportError, match="--step"):
        report.parse_step("seven")


def test_layer_and_op_tables():
    records = [rec(0, dur=1000, flops=10**6, nbytes=10**6),
               rec(1, direction="bprop", op="layernorm_backward", dur=3000),
               rec(2, layer=1, dur=2000), rec(3, layer=None, op="adamw", module="optimizer",
                                              direction="update", dur=4000, flops=10, nbytes=100)]
    layers = report.layer_table(records)
    assert cells(layers, "-") == ["-", "0.00", "0.00", "4.00", "4.00", "40.0", "1"]
    assert cells(layers, "0") == ["0", "1.00", "3.00", "0.00", "4.00", "40.0", "2"]
    assert cells(layers, "1") == ["1", "2.00", "0.00", "0.00", "2.00", "20.0", "1"]
    ops = report.op_table(records, ROOF)
    rows = [line.split()[:2] for line in ops.splitlines()[3:]]
    assert rows == [["adamw", "update"], ["layernorm_forward", "fprop"],
                    ["layernorm_backward", "bprop"]]
    # layernorm_forward: 2 launches, 3 us, 1e6 FLOP and 1e6 bytes in 3000 ns
    assert cells(ops, "layernorm_forward") == ["layernorm_forward", "fprop", "2", "3.00", "30.0",
                                               "1.50", "333.3", "333.3", "memory", "33.3%"]


def test_nsys_style_summaries():
    ranges = [("Layer 0", 0, 100), ("Layer 0", 1000, 1200), ("Layer 0", 5000, 5600),
              ("gpt2_forward", 0, 2100)]
    table = report.range_table(ranges)
    assert table.splitlines()[1].split()[:3] == ["Time", "(%)", "Total"]
    # gpt2_forward first (2100 ns of 3000 = 70%), then Layer 0: 100, 200, 600 ns
    assert table.splitlines()[3].split() == ["70.0", "2,100", "1", "2,100.0", "2,100.0", "2,100",
                                             # nsys's thousands separators
                                             "2,100", "0.0", "gpt2_forward"]
    assert cells(table, "30.0") == ["30.0", "900", "3", "300.0", "200.0", "100", "600",
                                    f"{math.sqrt(70000):.1f}", "Layer", "0"]
    kernels = report.kernel_summary_table([rec(0, kernel="a", dur=10), rec(1, kernel="b", dur=40),
                                           rec(2, kernel="a", dur=20)], top=1)
    assert len(kernels.splitlines()) == 4 and kernels.splitlines()[3].split()[-1] == "b"
    assert report.duration_stats([5])["stddev"] == 0.0


def test_ranges_from_records():
    S, F = "Train step 1", "gpt2_forward"
    records = [
        rec(0, start=0, dur=10, stack=(S, F, "encoder_forward"), module="wte"),
        rec(1, start=20, dur=10,
            stack=(S, F, "Layer 0", "matmul_forward"), module="h.0.attn.c_attn"),
        rec(2, start=40, dur=10, stack=(S, F, "Layer 0", "matmul_forward"),
            module="h.0.attn.c_attn"),
        rec(3, start=60, dur=10, stack=(S, F, "Layer 0", "matmul_forward"),
            module="h.0.attn.c_proj"),
        rec(4, start=80, dur=10, stack=(S, F, "Layer 1", "matmul_forward"),
            module="h.1.attn.c_attn"),
        rec(5, start=100, dur=10, stack=(S, "gpt2_update", "adamw"), module="optimizer"),
        rec(6, start=200, dur=10, stack=(), module=""),
        rec(7, start=300, dur=10, stack=("Train step 2",), module="optimizer"),
    ]
    assert report.ranges_from_records(records) == [
        (S, 0, 110), (F, 0, 90), ("encoder_forward", 0, 10), ("Layer 0", 20, 70),
        ("matmul_forward", 20, 50),          # two launches of one call (same module)
        ("matmul_forward", 60, 70),          # the next call, back to back: a new instance
        ("Layer 1", 80, 90), ("matmul_forward", 80, 90), ("gpt2_update", 100, 110),
        ("adamw", 100, 110), ("Train step 2", 300, 310)]


# ---------------------------------------------------------------------------------------------
# the module tree

def test_module_tree_structure_and_sums():
    records = [rec(0, op="encoder_forward", module="wte", layer=None, dur=100),
               rec(1, module="h.1.ln_1", layer=1, dur=200),
               rec(2, op="attention_forward", module="h.1.attn", layer=1, dur=300),
               rec(3, op="attention_backward", module="transformer.h.1.attn", layer=1,
                   direction="bprop", dur=600),
               rec(4, op="matmul_forward", module="h.1.mlp.c_fc", layer=1, dur=50),
               rec(5, op="adamw", module="optimizer", layer=None, direction="update", dur=70),
               rec(6, op="mystery", module="", layer=None, direction="other", dur=5),
               rec(7, op="matmul_forward", module="lm_head", layer=None, dur=40)]
    root = report.module_tree(records, num_layers=3)
    by_path = {node.path: node for _, node in root.walk()}
    assert [c.name for c in root.children] == ["wte", "wpe", "h", "ln_f", "lm_head", "optimizer",
                                               "other"]
    assert [c.name for c in by_path["h"].children] == ["h.0", "h.1", "h.2"]
    assert [c.name for c in by_path["h.1"].children] == ["ln_1", "attn", "ln_2", "mlp", "residual"]
    assert [c.name for c in by_path["h.1.attn"].children] == ["c_attn", "core", "c_proj"]
    assert [c.name for c in by_path["h.1.mlp"].children] == ["c_fc", "gelu", "c_proj"]
    core = by_path["h.1.attn.core"]
    assert (core.time("fprop"), core.time("bprop"), core.calls) == (300, 600, 2)
    assert by_path["h.1"].time() == 200 + 300 + 600 + 50 and by_path["h.1"].calls == 4
    assert by_path["h"].time() == by_path["h.1"].time() and by_path["h.0"].calls == 0
    assert by_path["other.mystery"].time("other") == 5
    assert root.time() == sum(r.duration_ns for r in records) and root.calls == len(records)
    for _, node in root.walk():            # every parent is the sum of its children plus its own
        assert node.time() == sum(node.own.values()) + sum(c.time() for c in node.children)


def test_module_tree_infers_layers_and_renders():
    records = [rec(0, module="h.0.ln_1", dur=1000),
               rec(1, module="h.1.mlp.gelu", op="gelu_backward", direction="bprop", dur=3000,
                   layer=1)]
    text = report.module_tree_table(records)
    lines = text.splitlines()
    assert lines[0] == "Time per GPT-2 module of step 1"
    assert lines[3].split() == ["gpt2", "1.00", "3.00", "0.00", "4.00", "100.0", "2"]
    assert "    h.1" in text and "h.2" not in text
    gelu_rows = [line.split() for line in lines if line.split()[0] == "gelu"]
    assert gelu_rows == [["gelu", "0.00", "0.00", "0.00", "0.00", "0.0", "0"],
                         ["gelu", "0.00", "3.00", "0.00", "3.00", "75.0", "1"]]
    assert len(report.module_tree_table(records, max_depth=1).splitlines()) == 3 + 1 + 6


def test_render_has_every_section():
    text = report.render([rec(0, stack=("Train step 1", "gpt2_forward")),
                          rec(1, stack=("Train step 1",))], ROOF)
    for heading in ("Kernels of step 1", "Time per GPT-2 module", "Time per layer", "Time per op",
                    "Top kernels", "NVTX ranges"):
        assert heading in text


# ---------------------------------------------------------------------------------------------
# files

def sample_records():
    return [rec(0, flops=10**9, nbytes=10**7, dur=10**6,
                stack=("Train step 1", "gpt2_forward", "Layer 0")),
            rec(1, op="adamw", module="optimizer", layer=None, direction="update",
                kernel="adamw_kernel",
                stack=("Train step 1", "gpt2_update"))]


def test_csv(tmp_path):
    path = tmp_path / "k.csv"
    report.write_csv(sample_records(), str(path), ROOF)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == report.CSV_FIELDS
    assert rows[0]["range_stack"] == "Train step 1 > gpt2_forward > Layer 0"
    assert rows[0]["params"] == "B=4,T=64,C=768" and rows[0]["bound"] == "compute"
    assert (float(rows[0]["pct_peak"]) == pytest.approx(10.0)
            and float(rows[0]["gflops_per_s"]) == 1000.0)
    assert rows[1]["layer"] == "" and rows[1]["gflops_per_s"] == "" and rows[1]["bound"] == ""
    assert os.listdir(tmp_path) == ["k.csv"]          # no temp file left behind


def test_json_round_trip(tmp_path):
    path = str(tmp_path / "k.json")
    records = sample_records()
    report.write_json(records, path, ROOF, meta={"B": 4})
    back, roof, meta = report.read_json(path)
    assert back == records and roof == ROOF and meta == {"B": 4}
    doc = json.loads(open(path).read())
    assert (doc["records"][0]["bound"] == "compute"
            and doc["records"][0]["range_stack"][0] == "Train step 1")


@pytest.mark.parametrize("content, problem", [(None, "no such file"),
                                              ("{not json", "not a JSON records file"),
                                              ('{"rows": []}', "no 'records' list"),
                                              ('{"records": [{"idx": 1}]}', "lacks a field")])
def test_read_json_errors(tmp_path, content, problem, capsys):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(report.ReportError, match=problem):
        report.read_json(str(path))
    assert report_cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and problem in err


def damaged(tmp_path, change):
    """A records file of sample_records (roofline ROOF) with change(doc) applied."""
    path = tmp_path / "damaged.json"
    report.write_json(sample_records(), str(path), ROOF)
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("name, value", [("peak_flops", 0),
                                         ("matmul_peak_flops", 0), ("peak_bw", -1e12),
                                         ("peak_flops", "fast"), ("peak_bw", math.inf)])
def test_a_roofline_ceiling_that_is_not_a_number_above_0_is_an_error_naming_the_file_and_field(
        tmp_path, capsys, name, value):
    # a ceiling divides the achieved rate (% of peak): 0 was a ZeroDivisionError traceback, <
    # 0 a negative percent
    path = damaged(tmp_path, lambda doc: doc["roofline"].update({name: value}))
    with pytest.raises(report.ReportError,
                       match=f"roofline field '{name}' must be a finite number > 0 or null"):
        report.read_json(str(path))
    assert report_cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and f"'{name}'" in err
    # unknown
    assert report_cli.main([str(damaged(tmp_path,
                                        lambda doc: doc["roofline"].update({name: None})))]) == 0


@pytest.mark.parametrize("name", ["duration_ns", "flops", "bytes"])
def test_a_negative_time_or_amount_is_an_error_naming_the_file(tmp_path, capsys, name):
    path = damaged(tmp_path, lambda doc: doc["records"][1].update({name: -5000}))
    # was rendered: negative times, rates and percentages
    assert report_cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and str(path) in err
            and f"record 1: field '{name}' must be an integer >= 0" in err)


@pytest.mark.parametrize("meta, expected", [
    # was an AttributeError traceback
    ([1, 2], "'meta': expected an object of fields, got [1, 2]"),
    ("d12", "'meta': expected an object of fields"),
    # traceback
    ({"module_params": [1, 2]}, "field 'module_params' must be an object of integers >= 0 or null"),
    ({"module_params": {"wte": "big"}},
     # was a TypeError naming no file
     "field 'module_params' must be an object of integers >= 0 or null, got \"big\" for 'wte'"),
    # the same
    ({"num_layers": "six"}, "field 'num_layers' must be an integer >= 0 or null, got \"six\""),
    ({"num_layers": -2}, "field 'num_layers' must be an integer >= 0 or null"),      # was rendered
    # was labelled as emulated
    ({"emulated": "no"}, "field 'emulated' must be true/false or null"),
    ({"backend": 3}, "field 'backend' must be text or null"),
    ({"precision": ["tf32"]}, "field 'precision' must be text or null"),
    ({"timing": {}}, "field 'timing' must be text or null"),
    ({"cpu_math": 1}, "field 'cpu_math' must be text or null"),
    ({"runtime": False}, "field 'runtime' must be text or null"),
])
def test_meta_of_the_wrong_type_is_an_error_naming_the_file_and_field(tmp_path, capsys, meta,
                                                                      expected):
    path = damaged(tmp_path, lambda doc: doc.update(meta=meta))
    with pytest.raises(report.ReportError, match="'meta': "):
        report.read_json(str(path))
    for views in ([], ["--views", "all"]):
        assert report_cli.main([str(path)] + views) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and expected in err, err


def test_meta_fields_may_be_null_or_absent(tmp_path, capsys):
    unknown = dict.fromkeys(report.META_FIELDS)            # null: unknown, as if absent
    for meta in (unknown, None, {}, {"num_layers": 1,
                                     "module_params": {"h.0.ln_1": 4}, "emulated": True,
                                     "backend": "cuda", "precision": "tf32", "source": 3}):
        path = damaged(tmp_path, lambda doc, meta=meta: doc.update(meta=meta))
        for views in ([], ["--views", "all"]):
            assert report_cli.main([str(path)] + views) == 0, capsys.readouterr().err


def test_report_cli(tmp_path, capsys):
    path = str(tmp_path / "k.json")
    report.write_json(sample_records(), path, ROOF)
    assert report_cli.main([path]) == 0
    assert "Kernels of step 1 on test GPU" in capsys.readouterr().out
    assert report_cli.main([path, "--device", "NVIDIA L4", "--step", "all"]) == 0
    assert "Kernels of step 1 on L4" in capsys.readouterr().out
    assert report_cli.main([path, "--device", "Voodoo5"]) == 2
    assert "unknown device" in capsys.readouterr().err


def test_chrome_trace(tmp_path):
    records = [rec(0, start=5_000, dur=2_000, stack=("Train step 1", "gpt2_forward")),
               rec(1, start=9_000, dur=1_000, stack=("Train step 1", "gpt2_update"),
                   module="optimizer")]
    path = tmp_path / "trace.json"
    report.write_chrome_trace(records, str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    ranges = [e for e in events if e.get("cat") == "range"]
    assert ([(e["ts"], e["dur"], e["ph"], e["tid"]) for e in kernels]
            == [(0.0, 2.0, "X", 1), (4.0, 1.0, "X", 1)])
    assert kernels[0]["args"]["layer"] == 0 and kernels[0]["args"]["params"] == "B=4,T=64,C=768"
    assert kernels[0]["args"]["range_stack"] == ["Train step 1", "gpt2_forward"]
    assert [(e["name"], e["ts"], e["dur"]) for e in ranges] == [("Train step 1", 0.0, 5.0),
                                                                ("gpt2_forward", 0.0, 2.0),
                                                                ("gpt2_update", 4.0, 1.0)]
    assert {e["tid"] for e in ranges} == {2}
    # ranges from two threads get a track each
    trace = report.chrome_trace(records, [("a", 0, 10, 11), ("b", 0, 10, 12), ("c", 2, 3, 11)])
    tracks = {e["name"]: e["tid"] for e in trace["traceEvents"] if e.get("cat") == "range"}
    assert tracks["a"] == tracks["c"] != tracks["b"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"ranges (thread 11)", "ranges (thread 12)", "kernels"} <= names


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ops.png"
    assert report.write_png(sample_records(), str(path)) is True
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["ops.png"]


def test_png_without_matplotlib(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    notes = []
    assert report.write_png(sample_records(), str(tmp_path / "ops.png"), log=notes.append) is False
    assert len(notes) == 1 and "matplotlib" in notes[0]
    assert os.listdir(tmp_path) == []


def test_a_profile_without_records_is_an_error_naming_the_file(tmp_path, capsys):
    path = tmp_path / "empty.json"
    path.write_text('{"meta": {}, "roofline": null, "records": []}')
    for argv in ([str(path)], [str(path), "--views", "all"]):
        assert report_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and "no records" in err
    # a real (one-record) profile still renders
    report.write_json(sample_records()[:1], str(path), ROOF)
    assert report_cli.main([str(path)]) == 0


def test_a_folder_for_the_records_is_called_a_folder(tmp_path, capsys):
    assert report_cli.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a folder" in err


def test_writers_make_missing_folders_and_name_the_path_on_failure(tmp_path):
    path = tmp_path / "new" / "deeper" / "k.json"
    report.write_json(sample_records(), str(path), ROOF)
    assert (report.read_json(str(path))[0] == sample_records()
            and os.listdir(path.parent) == ["k.json"])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError) as failed:
        report.write_csv(sample_records(), str(tmp_path / "afile" / "k.csv"))
    assert (str(tmp_path / "afile" / "k.csv") in str(failed.value)
            and ".tmp" not in str(failed.value))


@pytest.mark.parametrize("folder", [False, True])
def test_check_output_names_the_flag(tmp_path, folder):
    (tmp_path / "afile").write_text("x")
    # made when written
    report.check_output("--x", str(tmp_path / "missing" / "y"), folder=folder)
    with pytest.raises(report.BadInput, match="--x .*afile is a file, not a folder"):
        report.check_output("--x", str(tmp_path / "afile" / "y" / "z"), folder=folder)
    with pytest.raises(report.BadInput,
                       match="is a file; expected a folder" if folder else "is a folder"):
        report.check_output("--x", str(tmp_path / ("afile" if folder else "")), folder=folder)
