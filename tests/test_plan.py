"""The roofline planner (gpt2np.profiling.plan) plans the launches a real step runs, costs them with
the op contract, counts the memory the model allocates and the host syncs, all without a GPU and
without allocating."""
import csv
import json
import re
import time
import tracemalloc

import numpy as np
import pytest
from test_train import tiny_model  # noqa: F401  (fixture)

from gpt2np import ranges
from gpt2np.backends import device_traits, get_backend
from gpt2np.backends.cuda.runtime_plan import PlanArray, PlanRuntime
from gpt2np.cli.profile import main
from gpt2np.config import GPT2Config, TrainConfig, preset
from gpt2np.errors import BadInput
from gpt2np.model import GPT2, STATS
from gpt2np.ops.contract import op_cost
from gpt2np.profiling import plan as P
from gpt2np.profiling.gpu_specs import lookup
from gpt2np.profiling.profiler import attribution
from gpt2np.profiling.render.report import EMULATED_NOTE, si
from gpt2np.tensors import activation_shapes, layout_size, num_parameters

CFG = GPT2Config(32, 100, 128, 2, 2, 16)          # maxT > T: encoder_backward also clears dwpe[T:]
B, T = 2, 8
TOTAL = re.compile(r"^total: ([\d.]+) GB, ([\d,.]+) GFLOP, floor ([\d.]+) ms, (\d+) launches, "
                   r"(\d+) host syncs, (\d+) graph launches per step$")


@pytest.fixture(scope="module")
def small_plan():
    return P.plan_step(CFG, B, T, "H100", "tf32")


@pytest.fixture(scope="module")
def emulated():
    """One real step on the emulated CUDA path, recorded as the planner records (step 1 after a
    warm-up), with the planner's default -r (train.py's)."""
    model = GPT2(CFG, get_backend("emu"), B, T, seed=0, recompute=P.GPU_RECOMPUTE)
    prof, terms = P.profiled_step(model, P.random_batches(CFG, B, T))
    return prof, terms


def test_the_plan_is_the_launch_list_of_a_real_emulated_step(small_plan, emulated):
    prof, terms = emulated
    planned = [x.record for x in small_plan.launches]
    assert len(planned) == len(prof.records)
    fields = ("kind", "kernel", "op", "module", "direction", "layer", "params", "flops", "bytes",
              "grid", "block", "range_stack")
    for p, r in zip(planned, prof.records):
        assert [getattr(p, f) for f in fields] == [getattr(r, f) for f in fields], (p, r)
    assert [x.term for x in small_plan.kernels] == terms
    assert all(x.term is not None for x in small_plan.kernels if x.record.flops or x.record.bytes)
    # the step makes no host sync: its one device->host read is the asynchronous
    # copy of its statistics
    reads = [r for r in prof.records if r.kernel == "[CUDA memcpy DtoH]"]
    assert small_plan.syncs == [] and [r.bytes for r in reads] == [4 * STATS]
    assert small_plan.graph_launches == 1


def test_memory_is_the_models_buffers(small_plan, emulated):
    prof, _ = emulated
    assert small_plan.memory["buffers"] == prof.memory["buffers"]
    assert small_plan.memory["activations"] == prof.memory["activations"]
    sizes = {b["buffer"]: b["bytes"] for b in small_plan.memory["buffers"]}
    P_ = num_parameters(CFG)
    assert (sizes["parameters"] == sizes["gradients"] == sizes["AdamW m"] == sizes["AdamW v"]
            == 4 * P_)
    assert (sizes["activations"]
            == 4 * layout_size(activation_shapes(CFG, B, T, recompute=P.GPU_RECOMPUTE)))


class OpCalls:
    """A range listener: every op call of step 1 with its direction (independent
    of the Profiler)."""

    def __init__(self):
        self.calls = []

    def on_push(self, name, detail):
        stack = ranges.current_stack()
        if isinstance(detail, tuple) and stack and stack[0] == "Train step 1":
            self.calls.append((attribution(stack)[0], name, op_cost(name, detail[1], detail[2])))

    def on_pop(self, name):
        pass


def test_per_op_sums_are_the_op_contracts_costs():
    listener = OpCalls()
    ranges.add_listener(listener)
    try:
        plan = P.plan_step(CFG, B, T, "A100 80GB", "fp32")
    finally:
        ranges.remove_listener(listener)
    expected = {}
    for direction, op, cost in listener.calls:
        e = expected.setdefault((direction, op), [0, 0, 0])
        e[0] += 1
        e[1] += cost.flops
        e[2] += cost.bytes
    got = {(g["direction"], g["op"]): [g["calls"], g["flops"], g["bytes"]] for g in P.op_rows(plan)
           if not g["op"].startswith("[")}
    assert got == expected
    assert plan.flops == sum(c.flops for *_, c in listener.calls)
    assert plan.bytes == sum(c.bytes for *_, c in listener.calls)


def test_host_copies_show_their_bytes_outside_the_floor(small_plan):
    """The token uploads cross the host link: no device memory traffic and no floor, their bytes in
    the bound column (at least the int32 inputs and targets of the batch; the step's statistics come
    back as a few bytes)."""
    rows = {g["op"]: g for g in P.op_rows(small_plan) if g["op"].startswith("[CUDA memcpy")}
    htod, dtoh = rows["[CUDA memcpy HtoD]"], rows["[CUDA memcpy DtoH]"]
    assert (htod["hbm_bytes"] == dtoh["hbm_bytes"] == 0 and not htod["floor_ns"]
            and not dtoh["floor_ns"])
    assert htod["host_bytes"] >= 2 * 4 * B * T and dtoh["host_bytes"] > 0
    # plan_ops.csv's word; its bytes in host_bytes
    assert htod["bound"] == dtoh["bound"] == "host link"
    shown = {row[1]: row[-1] for row in P.op_table(small_plan).rows}
    assert shown["[CUDA memcpy HtoD]"] == f"host link: {si(htod['host_bytes'])}B, not in the floor"
    assert shown["[CUDA memcpy DtoH]"].startswith("host link: ")


def test_floors_are_the_roofline_of_the_named_gpu(small_plan):
    h100 = lookup("H100")
    fp32, tf32, bw = h100.fp32 * 1e12, h100.tf32 * 1e12, h100.mem_gbps * 1e9
    for x in small_plan.kernels:
        r = x.record
        peak = tf32 if r.kernel.startswith("cublasSgemm") else fp32
        want = max(r.flops / peak, r.bytes / bw) * 1e9 if (r.flops or r.bytes) else None
        assert x.floor_ns == pytest.approx(want) if want else x.floor_ns is None
    d12 = {p: P.plan_step(preset("d12"), 4, 1024, "H100", p) for p in ("tf32", "fp32")}
    # GEMMs and our WMMA (flash attention) kernels are held against the matmul ceiling,
    # which --precision sets
    gemm = [i for i, x in enumerate(d12["tf32"].launches) if x.record.is_gemm]
    assert all(d12["fp32"].launches[i].floor_ns > d12["tf32"].launches[i].floor_ns for i in gemm)
    assert all(d12["fp32"].launches[i].floor_ns >= d12["tf32"].launches[i].floor_ns
               for i, x in enumerate(d12["tf32"].launches) if x.record.matmul_ceiling)
    assert all(d12["fp32"].launches[i].floor_ns == d12["tf32"].launches[i].floor_ns
               for i, x in enumerate(d12["tf32"].launches)
               if not x.record.matmul_ceiling and x.floor_ns)
    # fp32 GEMMs: 67 instead of 494.5 TFLOP/s
    assert d12["fp32"].floor_ns > 2 * d12["tf32"].floor_ns
    # no TF32 tensor cores: fp32 GEMMs, and a note
    v100 = P.plan_step(CFG, B, T, "V100", "tf32")
    assert v100.precision == "fp32" and "no TF32" in v100.notes[0]


def test_d12_b4_t1024_on_h100_plans_in_seconds_without_allocating(tmp_path, capsys):
    tracemalloc.start()
    start = time.perf_counter()
    try:
        code = main(["--plan", "--gpu", "H100", "-e", "d12", "-b", "4", "-t", "1024", "--out",
                     str(tmp_path)])
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = capsys.readouterr().out
    assert code == 0
    assert seconds < 30 and peak < 200e6, (seconds, peak)       # a real step would hold ~8 GB
    last = out.rstrip("\n").splitlines()[-1]
    m = TOTAL.match(last)
    assert m, last
    gb, gflop, floor_ms, launches, syncs, graphs = (float(v.replace(",", "")) for v in m.groups())
    # nothing read back inside the step; one graph replayed
    assert int(syncs) == 0 and int(graphs) == 1
    assert last.endswith(", 0 host syncs, 1 graph launches per step")
    # issue 14's planner targets for the default GPU step (flash attention, fused
    # epilogues, CUDA graphs, -r 0)
    assert launches <= 300 and floor_ms <= 12.0, (launches, floor_ms)
    for title in ("Per op and direction on H100 SXM (tf32 GEMMs)", "Per direction",
                  "Memory the run needs",
                  "Activations by name", "Host syncs in the step: 0", "not a measurement"):
        assert title in out
    doc = json.load(open(tmp_path / "plan.json"))
    total = doc["total"]
    assert (total["launches"] == launches and total["host_syncs"] == 0
            and total["graph_launches_per_step"] == 1)
    assert round(total["memory_bytes"] / 1e9, 2) == gb and round(total["flops"] / 1e9, 1) == gflop
    assert round(total["floor_ns"] / 1e6, 2) == floor_ms
    assert total["bytes"] <= 30e9, total["bytes"]                     # minimum traffic of the step
    cfg = preset("d12")
    sizes = {b["buffer"]: b["bytes"] for b in doc["memory"]["buffers"]}
    assert sizes["parameters"] == sizes["AdamW v"] == 4 * num_parameters(cfg)
    assert doc["attention"] == "flash" and "flash attention" in out       # a GPU's default
    assert doc["recompute"] == 0 and "-r 0 (every activation kept)" in out
    assert sizes["activations"] == 4 * layout_size(activation_shapes(cfg, 4, 1024, "flash", 0))
    acts = {a["buffer"]: a["bytes"] for a in doc["memory"]["activations"]}
    assert acts["lse"] == 4 * 12 * 4 * 12 * 1024 and "att" not in acts
    assert acts["fch_gelu"] == 12 * 4 * 4 * 1024 * 3072                  # one per layer (-r 0)
    rows = list(csv.DictReader(open(tmp_path / "plan.csv")))
    kernels = [r for r in rows if r["kind"] == "kernel"]
    assert len(kernels) == launches
    assert sum(float(r["floor_ns"] or 0) for r in rows) == pytest.approx(total["floor_ns"])
    # the model's GEMM work dominates: 6 FLOPs per parameter and token, within the attention's share
    tokens = 4 * 1024
    assert (6 * num_parameters(cfg) * tokens < total["flops"]
            < 1.2 * 6 * num_parameters(cfg) * tokens)
    ops = list(csv.DictReader(open(tmp_path / "plan_ops.csv")))
    assert {r["direction"] for r in ops} >= {"fprop", "bprop", "update"}
    assert {"flash_attention_forward", "flash_attention_backward"} <= {r["op"] for r in ops}

    # the naive attention keeps the (T,T) probabilities: more memory, twice the
    # traffic, a slower floor
    naive_dir = tmp_path / "naive"
    assert main(["--plan", "--gpu", "H100", "-e", "d12", "-b", "4", "-t", "1024", "--attention",
                 "naive", "--out", str(naive_dir)]) == 0
    naive = json.load(open(naive_dir / "plan.json"))
    assert naive["attention"] == "naive"
    naive_acts = {a["buffer"]: a["bytes"] for a in naive["memory"]["activations"]}
    assert naive_acts["att"] == 4 * 12 * 4 * 12 * 1024 * 1024
    assert naive["total"]["bytes"] > 1.5 * total["bytes"]
    assert naive["total"]["memory_bytes"] > total["memory_bytes"] + 2e9
    assert naive["total"]["floor_ns"] > total["floor_ns"]


def test_every_launch_is_printed_when_asked(tmp_path, capsys):
    assert main(["--plan", "--plan-launches", "-e", "d12", "-b", "1", "-t", "64", "--out",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Every launch of the step" in out and "cublasSgemm (gemm_matmul_backward_dweight)" in out
    assert "encoder_backward_wte_grouped" in out and "dweight" in out


def test_measure_on_the_emulator_puts_measured_times_beside_the_floors(tiny_model, tmp_path,
                                                                       capsys):
    assert main(["--plan", "--measure", "--device", "emu", "--plan-launches", "-e", str(tiny_model),
                 "-b", "1", "-t", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"[{EMULATED_NOTE}]" in out and "measured (emulated) (us)" in out
    assert TOTAL.match(out.rstrip("\n").splitlines()[-1])
    doc = json.load(open(tmp_path / "plan.json"))
    assert doc["measured"]["emulated"] is True
    launches = doc["launches"]
    assert all(x["measured_ns"] is not None and x["measured_ns"] > 0 for x in launches
               if x["kind"] == "kernel")
    assert all(g["measured_ns"] for g in doc["ops"] if g["launches"])


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "H1000"], "--gpu H1000: unknown device"),
    (["--gpu", "cpu"], "no peak numbers"),
    (["-b", "0"], "-b 0"),
    (["-t", "0"], "-t 0"),
    (["-t", "4096"], "-t 4096: longer than"),
    (["-b", "x"], "argument -b"),
    (["--precision", "fp16"], "argument --precision"),
    (["--measure", "--device", "cpu"], "--measure runs the step's kernels"),
])
def test_bad_flags_end_in_one_line_and_exit_2(argv, words, tmp_path, capsys):
    assert main(["--plan", "-e", "d12", "-b", "4", "-t", "1024", "--out", str(tmp_path)]
                + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_plan_flags_need_plan(capsys):
    assert main(["--gpu", "H100", "-e", "d12"]) == 2
    assert "--gpu needs --plan" in capsys.readouterr().err


def test_planned_arrays_are_shapes_and_addresses_only():
    rt = PlanRuntime("H100")
    a = rt.zeros(1000, np.float32)
    assert isinstance(a, PlanArray) and a.flags.c_contiguous and a.nbytes == 4000
    assert rt.pointer(a) % 256 == 0
    v = a[100:400].reshape(3, -1)
    assert (v.shape == (3, 100) and rt.pointer(v) == rt.pointer(a) + 400
            and rt.pointer(v[2]) == rt.pointer(a) + 1200)
    b = rt.zeros((8, 8), np.float32)
    assert rt.pointer(b) >= rt.pointer(a) + 4000                 # allocations do not overlap
    with pytest.raises(TypeError):
        np.asarray(a)
    with pytest.raises(ValueError):
        a.reshape(7, -1)
    tokens = rt.from_host(np.arange(6, dtype=np.int32).reshape(2, 3))   # integer buffers are real
    assert rt.to_host(tokens).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert rt.to_host(a).shape == (1000,) and len(rt.syncs) == 2
    with pytest.raises(ValueError, match="operand B"):
        rt.gemm(False, False, 10, 10, 10, 1.0, a, 10, 0, b, 10, 0, 0.0, a, 10, 0, 1)
    rt.gemm(False, False, 10, 10, 10, 1.0, a, 10, 100, a, 10, 100, 0.0, a, 10, 100, 3)
    module = rt.compile("kernels/gelu.cu")
    with pytest.raises(ValueError, match="block"):
        rt.launch(module.get_function("gelu_forward"), (1,), (2048,), ())
    with pytest.raises(KeyError):
        module.get_function("layernorm_forward")


def test_fusion_plans_fewer_launches_and_less_traffic(small_plan):
    """--fuse 1 (the default) against --fuse 0: the same FLOPs (the epilogues do the bias and GELU
    arithmetic), fewer launches and fewer bytes; no separate bias, bias-gradient, GELU or
    residual kernels."""
    unfused = P.plan_step(CFG, B, T, "H100", "tf32", fuse=False)
    assert small_plan.fuse and not unfused.fuse
    assert len(small_plan.kernels) < len(unfused.kernels) and small_plan.bytes < unfused.bytes
    assert small_plan.flops == unfused.flops
    ops = {x.record.op for x in small_plan.kernels}
    assert {"matmul_gelu_forward", "gelu_matmul_backward",
            "fused_residual_layernorm_forward"} <= ops
    assert not {"gelu_forward", "gelu_backward", "residual_forward"} & ops
    assert not {x.record.kernel for x in small_plan.kernels} & {"add_bias", "bias_grad_partial",
                                                                "gelu_forward"}


def test_fuse_flag_needs_plan(capsys):
    assert main(["--fuse", "0", "-e", "d12"]) == 2
    assert "--fuse needs --plan" in capsys.readouterr().err


def test_flash_kernels_are_held_against_the_tensor_core_peak():
    """Our WMMA kernels (flash attention) run their products on tensor cores: their floor uses the
    matmul (tensor-core) ceiling, as cuBLAS's GEMMs do; the other kernels of ours stay on the fp32
    CUDA-core ceiling."""
    from gpt2np.profiling.gpu_specs import roofline
    from gpt2np.profiling.render.report import KernelRecord
    roof = roofline(lookup("H100"), "fp32", matmul_precision="tf32")

    def record(kernel):
        return KernelRecord(0, 1, "fprop", 0, "op", "h.0.attn", "", kernel, 0, 0, flops=int(1e12),
                            bytes=1)
    flash, softmax = record("flash_attention_forward"), record("softmax_forward")
    assert flash.matmul_ceiling and not flash.is_gemm and not softmax.matmul_ceiling
    floor_flash, _ = P.launch_floor(flash, roof)
    floor_softmax, _ = P.launch_floor(softmax, roof)
    assert floor_flash == pytest.approx(1e12 / roof.matmul_peak_flops * 1e9)
    assert floor_softmax > 5 * floor_flash


def test_bf16_plan_of_d12_meets_issue_15s_floor_and_halves_the_storage():
    """Issue 15's planner target: d12 B4 T1024 bf16 on H100 has a floor <= 8 ms. Its parameters,
    gradients and activations are bf16 (half the bytes; the LayerNorm statistics, losses, lse,
    AdamW's moments and the master weights stay fp32), so the activation memory halves and the bytes
    a step moves drop by well over a third; no host sync, one graph launch; GEMMs and the WMMA flash
    kernels held against the bf16 tensor-core peak."""
    d12 = {p: P.plan_step(preset("d12"), 4, 1024, "H100", p) for p in ("tf32", "bf16")}
    bf16, tf32 = d12["bf16"], d12["tf32"]
    assert bf16.precision == "bf16" and bf16.floor_ns <= 8e6 and bf16.floor_ns < tf32.floor_ns
    assert bf16.bytes <= 0.62 * tf32.bytes                        # moved per step
    # allocated (the fp32 masters are new)
    assert bf16.memory_bytes <= 0.7 * tf32.memory_bytes
    acts = {p: next(b["bytes"] for b in d12[p].memory["buffers"] if b["buffer"] == "activations")
            for p in d12}
    assert 0.5 <= acts["bf16"] / acts["tf32"] < 0.51
    assert bf16.host_syncs == 0 and bf16.graph_launches == 1
    h100 = lookup("H100")
    for x in bf16.launches:
        r = x.record
        if r.is_gemm or r.matmul_ceiling:
            peak, bw = h100.bf16 * 1e12, h100.mem_gbps * 1e9
            assert x.floor_ns == pytest.approx(max(r.flops / peak, r.bytes / bw) * 1e9)
    with pytest.raises(BadInput, match="no bf16 tensor cores"):
        P.plan_step(CFG, B, T, "V100", "bf16")


def test_recompute_plans_less_activation_memory_and_more_backward_launches(tmp_path, capsys):
    """--recompute (train.py's -r) on d12 B4 T1024: -r 1 keeps one fch_gelu instead of 12 and adds a
    gelu_forward per layer to the backward; -r 2 also keeps no ln1/ln2 and adds two
    layernorm_forward per layer (the README's figures: activations 3,405 / 2,877 / 2,589 MiB, 293 /
    305 / 329 launches)."""
    plans = {}
    for r in (0, 1, 2):
        assert main(["--plan", "-e", "d12", "-b", "4", "-t", "1024", "--recompute", str(r),
                     "--out", str(tmp_path / str(r))]) == 0
        plans[r] = json.load(open(tmp_path / str(r) / "plan.json"))
        assert plans[r]["recompute"] == r
    capsys.readouterr()
    acts = {r: next(b["bytes"] for b in p["memory"]["buffers"] if b["buffer"] == "activations")
            for r, p in plans.items()}
    assert [round(a / 2 ** 20, 2) for a in acts.values()] == [3405.05, 2877.05, 2589.05]
    assert acts[0] - acts[1] == 4 * 11 * 4 * 1024 * 3072                   # 11 of the 12 fch_gelu
    assert acts[1] - acts[2] == 4 * 2 * 12 * 4 * 1024 * 768                # ln1 and ln2
    assert [p["total"]["launches"] for p in plans.values()] == [293, 305, 329]
    floors = [p["total"]["floor_ns"] for p in plans.values()]
    assert floors[0] < floors[1] < floors[2]

    def backward_ops(plan):
        return [(x["op"], x["kernel"]) for x in plan["launches"]
                if x["direction"] == "bprop" and x["kind"] == "kernel"]
    extra = {r: [k for k in backward_ops(plans[r]) if k[0] in ("gelu_forward", "layernorm_forward")]
             for r in plans}
    assert extra[0] == [] and extra[1] == [("gelu_forward", "gelu_forward")] * 12
    assert sorted(extra[2]) == sorted([("gelu_forward", "gelu_forward")] * 12
                                      + [("layernorm_forward", "layernorm_forward")] * 24)
    forward = [[(x["op"], x["kernel"]) for x in p["launches"] if x["direction"] == "fprop"]
               for p in plans.values()]
    # the forward launches do not change
    assert forward[0] == forward[1] == forward[2]


def test_profile_and_plan_take_the_long_flag_names_too(tmp_path, capsys):
    """gpt2np profile/plan: -e/--model, -b/--batch-size, -t/--seq-len, as the other
    commands take them."""
    outs = []
    for flags in (["-e", "d12", "-b", "2", "-t", "32"],
                  ["--model", "d12", "--batch-size", "2", "--seq-len", "32"]):
        assert main(["--plan", "--gpu", "H100", *flags, "--out", str(tmp_path)]) == 0
        outs.append(capsys.readouterr().out.splitlines()[0])
    assert outs[0] == outs[1] and "d12 (random init), B=2, T=32" in outs[0]


def test_a_batch_too_large_for_host_memory_is_refused_before_allocating(tmp_path, capsys,
                                                                        monkeypatch):
    tracemalloc.start()
    try:
        start = time.perf_counter()
        # 1e17 bytes of tokens: more than any machine has (numpy would fail with a
        # traceback, or the OS kill us)
        assert main(["--plan", "-e", "d12", "-b", "100000000000", "-t", "1024", "--out",
                     str(tmp_path)]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and err.startswith("error: -b 100000000000 -t 1024: ")
            and "GiB" in err), err
    assert peak < 200 << 20 and time.perf_counter() - start < 30
    monkeypatch.setattr(P, "physical_memory", lambda: 1 << 30)           # a 1 GiB machine
    assert main(["--plan", "-e", "d12", "-b", "1000000", "-t", "64", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and "-b 1000000 -t 64" in err
            and "this machine has 1.0 GiB" in err), err
    with pytest.raises(BadInput, match="-b 4 -t 1024"):
        P.check_host_memory(4, 1024, memory=4 * 1025 * P.HOST_BYTES_PER_TOKEN - 1)
    P.check_host_memory(4, 1024, memory=4 * 1025 * P.HOST_BYTES_PER_TOKEN)
    # large but sane: fits here
    P.check_host_memory(1024, 1024)


def test_measure_on_the_emulator_refuses_a_step_larger_than_host_memory(tmp_path, capsys,
                                                                        monkeypatch):
    # room for the tokens, not the model
    monkeypatch.setattr(P, "physical_memory", lambda: 64 << 20)
    assert main(["--plan", "--measure", "--device", "emu", "-e", "d12", "-b", "1", "-t", "64",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and "--measure --device emu -b 1 -t 64" in err
            and "host memory" in err), err


def test_a_plan_takes_train_pys_gpu_defaults(tmp_path, capsys, monkeypatch):
    """`gpt2np plan --gpu H100 -e d12` plans train.py's B and T on a GPU (TrainConfig's: 4 and
    1024), not the CPU's T=64 that profile takes; so does profile --plan."""
    from gpt2np.cli import main as commands
    from gpt2np.cli import plan as plan_cli
    from gpt2np.cli import profile as profile_cli
    gpu = TrainConfig().with_device_defaults(device_traits("cuda"))
    assert (gpu.batch_size, gpu.seq_len) == (4, 1024)
    for argv in (["plan"], ["profile", "--plan"]):
        assert commands.main(argv + ["--gpu", "H100", "-e", "d12", "--out", str(tmp_path)]) == 0
        assert "d12 (random init), B=4, T=1024," in capsys.readouterr().out.splitlines()[0]
    monkeypatch.chdir(tmp_path)
    for parser, T in ((plan_cli.parser, 1024), (profile_cli.parser, 64)):
        args = parser().parse_args([])
        plan_cli.check_flags(args)
        assert (args.batch_size, args.seq_len) == (4, T)


def test_plan_has_its_own_help_and_every_flag_says_what_it_does(capsys):
    """plan --help is plan's, not profile's word for word; every flag of profile, plan, report,
    nsys and ncu has a help text."""
    from gpt2np.cli import main as commands
    from gpt2np.cli import ncu, nsys, profile, report
    from gpt2np.cli import plan as plan_cli
    helps = {}
    for name in ("profile", "plan"):
        assert commands.main([name, "--help"]) == 0
        helps[name] = " ".join(capsys.readouterr().out.split())
    assert helps["plan"] != helps["profile"]
    assert "Plan one training step on a GPU, without one" in helps["plan"]
    assert "--steps" not in helps["plan"] and "--cpu-math" not in helps["plan"]
    assert "sequence length T (default 1024, train.py's on a GPU)" in helps["plan"]
    assert "Profile a few training steps" in helps["profile"]
    assert "--steps STEPS training steps" in helps["profile"]
    for module in (profile, plan_cli, report, nsys, ncu):
        for action in module.parser()._actions:
            assert action.help, (module.__name__, action.option_strings or action.dest)


def test_gpu_names_ignore_spaces_hyphens_and_case(tmp_path, capsys):
    """--gpu RTX4090 is the RTX 4090, as "RTX 4090" is."""
    for name in ("RTX4090", "rtx 4090", "RTX-4090", "NVIDIA GeForce RTX 4090", "rtx_4090"):
        assert P.resolve_gpu(name)[0].name == "RTX 4090", name
    assert main(["--plan", "--gpu", "RTX4090", "-e", "d12", "-b", "1", "-t", "64",
                 "--out", str(tmp_path)]) == 0
    assert " on RTX 4090 [" in capsys.readouterr().out


def test_gpu_names_still_match_whole_words_only():
    assert lookup("A10G") is None
    names = {"NVIDIA A10": "A10", "a100": "A100 40GB", "NVIDIA H100 PCIe": "H100 PCIe",
             "H100-80GB-HBM3": "H100 SXM", "V100S-PCIE-32GB": "V100S PCIe",
             "rtx 4070ti": "RTX 4070 Ti", "NVIDIA L40S": "L40S", "Tesla T4": "T4"}
    assert {name: lookup(name).name for name in names} == names
