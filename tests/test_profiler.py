"""The built-in profiler attributes every launch of a step to its layer,
direction, op and module."""
import json
import re
from collections import Counter

import numpy as np
import pytest

from gpt2np.backends import device_traits
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.cli import profile as profile_cli
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.profiling.profiler import profile_steps, write_outputs
from gpt2np.profiling.render.report import KernelRecord, render

CFG = GPT2Config(32, 100, 128, 2, 2, 16)
B, T = 2, 8


def batches():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, CFG.vocab_size, (2, B, T + 1)).astype(np.int32)
    return [(b[:, :-1], b[:, 1:]) for b in raw]


@pytest.fixture(scope="module")
def prof():
    model = GPT2(CFG, NumpyBackend(threads=1), B, T, seed=0)
    return profile_steps(model, batches(), steps=2)


def test_one_record_per_op_launch_with_attribution(prof):
    step = [r for r in prof.records if r.step == 2]
    L = CFG.num_layers
    # forward: encoder + 10 per layer + ln_f + lm_head + classifier; backward: 2 + 8 per layer +
    # encoder; update: the norm + one AdamW per tensor
    assert len(step) == (1 + 10 * L + 3) + (2 + 8 * L + 1) + (1 + 16)
    assert [r.idx for r in prof.records] == list(range(len(prof.records)))
    dirs = Counter(r.direction for r in step)
    assert dirs == {"fprop": 1 + 10 * L + 3, "bprop": 2 + 8 * L + 1, "update": 17}
    for l in range(L):
        fwd = [r.op for r in step if r.layer == l and r.direction == "fprop"]
        assert fwd == ["layernorm_forward", "matmul_forward", "attention_forward", "matmul_forward",
                       "residual_forward", "layernorm_forward", "matmul_forward", "gelu_forward",
                       "matmul_forward", "residual_forward"]
        mods = [r.module for r in step if r.layer == l and r.direction == "bprop"]
        assert mods == [f"h.{l}.mlp.c_proj", f"h.{l}.mlp.gelu", f"h.{l}.mlp.c_fc", f"h.{l}.ln_2",
                        f"h.{l}.attn.c_proj", f"h.{l}.attn", f"h.{l}.attn.c_attn", f"h.{l}.ln_1"]
    qkv = next(r for r in step if r.module == "h.1.attn.c_attn" and r.direction == "fprop")
    assert qkv.params == f"B={B},T={T},C=16,OC=48,M={B * T},N=48,K=16"
    assert qkv.flops == 2 * B * T * 16 * 48 + B * T * 48
    assert qkv.range_stack == ("Train step 2", "gpt2_forward", "Layer 1", "matmul_forward")
    assert all(r.duration_ns > 0 for r in step)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("math", ["exact", "fast"])
def test_attention_flops_are_what_the_backend_computes(math, precision):
    """The exact path's batched GEMMs compute the whole (T,T) square of q k^T, att v and their
    gradients; the fast path's kernels the causal half only (the bf16 reference runs the same fp32
    ops): the records' FLOPs say which (a FLOP rate read off them is then true)."""
    from gpt2np.backends import get_backend
    backend = get_backend("numpy", precision, threads=1, math=math)
    if backend.math != math:
        pytest.skip("no C compiler: the fast path is off")
    result = profile_steps(GPT2(CFG, backend, B, T, seed=0), batches()[:1], steps=1)
    NH, HS = CFG.num_heads, CFG.channels // CFG.num_heads
    # one (T,T)-sized product
    products = B * NH * (T * T if math == "exact" else T * (T + 1) // 2) * 2 * HS
    rows = B * NH * T
    for op, count, softmax in (("attention_forward", 2, 5), ("attention_backward", 4, 4)):
        rec = next(r for r in result.records if r.op == op)
        assert rec.flops == count * products + softmax * rows * (T + 1) // 2, op


def test_ranges_recorded_like_nvtx(prof):
    names = Counter(name for name, start, end in prof.ranges)
    assert names["Train step 1"] == names["Train step 2"] == 1
    assert names["gpt2_forward"] == names["gpt2_backward"] == 2
    assert names["Layer 0"] == 4                       # forward and backward, two steps
    assert all(end >= start for _, start, end in prof.ranges)


def test_report_and_files(prof, tmp_path):
    text = render(prof.records, None, step="last", num_layers=CFG.num_layers, ranges=prof.ranges)
    for heading in ("Kernels of step 2", "Time per GPT-2 module", "Time per op", "NVTX ranges"):
        assert heading in text
    for module in ("h.1", "c_attn", "lm_head", "optimizer"):
        assert module in text
    paths = write_outputs(prof, tmp_path)
    rows = open(paths["csv"]).read().splitlines()
    assert len(rows) == 1 + len(prof.records)
    trace = json.load(open(paths["trace.json"]))
    assert any(e.get("name") == "Layer 1" for e in trace["traceEvents"])
    if "png" in paths:
        assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_cuda_backend_records_every_kernel_and_gemm_on_the_emulator():
    from gpt2np.backends import get_backend
    model = GPT2(CFG, get_backend("emu"), B, T, seed=0)
    prof = profile_steps(model, batches(), steps=1)
    step = [r for r in prof.records if r.step == 1]
    ops = {(r.direction, r.layer, r.op) for r in step}
    assert ("fprop", 1, "attention_forward") in ops and ("bprop", 0, "layernorm_backward") in ops
    attn = [r for r in step if r.module == "h.1.attn" and r.direction == "fprop"]
    kernels = [r.kernel for r in attn]
    # permute -> cuBLAS QK^T -> causal softmax -> cuBLAS att.V -> unpermute, all attributed
    # to layer 1's attention
    assert kernels[0] == "permute_qkv" and kernels[-1] == "unpermute"
    assert sum("cublasSgemm" in k for k in kernels) == 2 and "causal_softmax_forward" in kernels
    gemm = next(r for r in step
                if r.module == "h.0.mlp.c_fc" and r.direction == "fprop" and "cublas" in r.kernel)
    # + its epilogue's bias and GELU per output
    assert gemm.flops == 2 * B * T * 16 * 64 + 11 * B * T * 64
    assert all(r.duration_ns > 0 for r in step)
    assert all(r.range_stack[0] == "Train step 1" for r in step)


def test_cpu_roofline_is_measured_and_fills_bound_and_percent_of_peak(monkeypatch):
    """On the numpy backend the profiler's roofline is measured where it runs (a GEMM's FLOP/s, an
    in-place add's GB/s), named as measured, so the tables get a bound and a % of
    peak as on a GPU."""
    from gpt2np.profiling import cpu_roof
    from gpt2np.profiling.profiler import device_roofline
    from gpt2np.profiling.render.report import classify
    # small: the test checks the plumbing, not speed
    monkeypatch.setattr(cpu_roof, "GEMM_SIZE", 64)
    monkeypatch.setattr(cpu_roof, "STREAM_BYTES", 1 << 20)
    roof = device_roofline(NumpyBackend(threads=2))
    assert roof.device.startswith("cpu (2 threads; measured now: GEMM ") and " GB/s)" in roof.device
    assert 0 < roof.peak_flops == roof.matmul_peak_flops < 1e14 and 0 < roof.peak_bw < 1e13
    assert f"GEMM {roof.peak_flops / 1e9:.0f} GFLOP/s" in roof.device
    # an op that moves 1 GB in a second at a 10 GB/s roof is memory bound at 10% of it
    fixed = cpu_roof.Roofline("cpu (test)", 100e9, 10e9, 100e9)
    assert classify(10**6, 10**9, 10**9, fixed) == ("memory", 10.0)
    assert classify(50 * 10**9, 10**6, 10**9, fixed, is_gemm=True) == ("compute", 50.0)


PERCENT = re.compile(r"(\d[\d,]*\.\d+)%")


def percentages(text):
    return [float(p.replace(",", "")) for p in PERCENT.findall(text)]


@pytest.mark.parametrize("ceilings", ["measured", "too low"])
def test_no_op_of_a_cpu_step_is_above_100_percent_of_the_roof(prof, ceilings, tmp_path, capsys,
                                                              monkeypatch):
    """The CPU's roof bounds every op held against it: its bandwidth is the best a += b over array
    sizes from the caches out to memory (an op on data in a cache beats a roof measured in main
    memory alone), and a measured roof an op beats anyway (a noisy machine, say; here one measured
    far too low) is raised to that op's rate and says so. In the views, the files and `report`
    alike."""
    from gpt2np.cli import report as report_cli
    from gpt2np.profiling import cpu_roof
    from gpt2np.profiling.profiler import device_roofline, report_text
    monkeypatch.setattr(cpu_roof, "GEMM_SIZE", 64)
    monkeypatch.setattr(cpu_roof, "STREAM_BYTES", 1 << 20)
    if ceilings == "measured":
        roof = device_roofline(prof.backend)
    else:
        device = "cpu (1 thread; measured now: GEMM 1 MFLOP/s, a += b 1 MB/s)"
        roof = cpu_roof.Roofline(device, 1e6, 1e6, 1e6)
    text = report_text(prof, roof, ("ops", "kernels", "pyprof"), step=None)
    assert "%peak" in text and max(percentages(text)) <= 100.0, text
    if ceilings == "too low":
        assert "raised to the fastest op's: " in text and " GB/s" in text and " GFLOP/s" in text
    paths = write_outputs(prof, tmp_path, roof)
    rows = json.load(open(paths["json"]))["records"]
    assert all(r["pct_peak"] is None or r["pct_peak"] <= 100.0 for r in rows)
    capsys.readouterr()
    assert report_cli.main([paths["json"], "--step", "all"]) == 0
    assert max(percentages(capsys.readouterr().out)) <= 100.0


def test_the_cpu_bandwidth_is_the_best_over_array_sizes_and_a_gpu_roof_is_never_raised(monkeypatch):
    from gpt2np.backends.cuda.backend import CudaBackend
    from gpt2np.backends.cuda.runtime_emu import EmuRuntime
    from gpt2np.profiling import cpu_roof
    from gpt2np.profiling.profiler import Profiler, bounding_roof
    assert cpu_roof.stream_sizes() == [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    sizes = []
    monkeypatch.setattr(cpu_roof, "add_bandwidth",
                        lambda threads, repeats, nbytes: sizes.append(nbytes) or nbytes)
    assert cpu_roof.stream_bandwidth(2, 1) == 64 << 20 and sizes == cpu_roof.stream_sizes()
    h100 = cpu_roof.Roofline("H100 SXM", 67e12, 3.35e12, 494.5e12)
    assert bounding_roof(Profiler(CudaBackend(EmuRuntime())), h100) is h100
    slow = KernelRecord(0, 1, "update", None, "adamw", "optimizer", "", "numpy.adamw", 0, 10**6, 10,
                        10**6)
    assert cpu_roof.covering(h100, [slow]) is h100                # no record beat it: the same roof


@pytest.fixture(scope="module")
def emu_fused():
    """One step on the emulated CUDA path with the GPU's fused ops (residual + LayerNorm in one
    kernel), 3 layers (a first, a middle and a last one) and maxT > T (encoder_backward
    zeroes dwpe[T:])."""
    from gpt2np.backends import get_backend
    cfg = GPT2Config(32, 100, 128, 3, 2, 16)
    model = GPT2(cfg, get_backend("emu"), B, T, seed=0)
    assert model.fuse and cfg.max_seq_len > T
    prof = profile_steps(model, batches(), steps=1)
    return cfg, [r for r in prof.records if r.step == 1]


def test_a_fused_op_belongs_to_the_layer_of_the_module_it_computes(emu_fused):
    """The fused residual + LayerNorm that ends "Layer l" (llm.c's range tree) computes
    h.{l+1}.ln_1, or ln_f after the last layer: its launches count in that module's layer (ln_f's
    outside the layers, as the numpy backend's unfused ln_f), so every layer has the same launches
    and the per-layer view and the module tree agree."""
    from gpt2np.profiling.render.report import layer_rows, module_tree
    cfg, step = emu_fused
    L = cfg.num_layers
    kernels = [r for r in step if r.kind == "kernel"]
    for r in kernels:
        inside = re.match(r"h\.(\d+)\.", r.module)
        assert r.layer == (int(inside.group(1)) if inside else -1), (r.module, r.layer, r.op)
    fused = [r for r in kernels if r.op == "fused_residual_layernorm_forward"]
    assert [r.module for r in fused] == [m for l in range(L)
                                         for m in (f"h.{l}.ln_2", f"h.{l + 1}.ln_1")][:-1] + [
        "ln_f"]
    assert fused[-1].range_stack[-2] == f"Layer {L - 1}" and fused[-1].layer == -1
    per_layer = Counter(r.layer for r in kernels if r.layer >= 0)
    assert sorted(per_layer) == list(range(L)) and len(set(per_layer.values())) == 1, per_layer
    _, columns, rows = layer_rows(kernels)
    names = [c[0] for c in columns]
    nodes = {node.path: node for _, node in module_tree(kernels, L).walk()}
    for row in rows:
        layer = row[names.index("layer")]
        if layer == "-":
            outside = [n for path, n in nodes.items() if path and "." not in path and path != "h"]
            launches, ns = sum(n.calls for n in outside), sum(n.time() for n in outside)
        else:
            launches, ns = nodes[f"h.{layer}"].calls, nodes[f"h.{layer}"].time()
        assert row[names.index("launches")] == launches, (layer, row)
        assert ns == sum(r.duration_ns for r in kernels
                         if r.layer == (-1 if layer == "-" else layer))
    assert sum(row[names.index("launches")] for row in rows) == nodes[""].calls == len(kernels)


def test_encoder_backward_counts_the_zeroed_rows_of_dwpe_as_wpe(emu_fused):
    """Without accumulate (the first micro-batch after zero_grad) encoder_backward zeroes dwpe[T:]:
    a launch that carries its writes as a term of the op's cost, in module wpe (not a memset outside
    the op's kernels, in wte)."""
    cfg, step = emu_fused
    C, maxT = cfg.channels, cfg.max_seq_len
    enc = [r for r in step if r.op == "encoder_backward"]
    assert all(r.kind == "kernel" for r in enc)
    wpe = [r for r in enc if r.module == "wpe"]
    assert [r.kernel for r in wpe] == ["encoder_backward_wpe"] * 2
    assert sum(r.bytes for r in wpe) == 4 * (B * T * C + T * C) + 4 * (maxT - T) * C
    assert sum(r.flops for r in wpe) == B * T * C
    assert [r.kernel for r in enc if r.module == "wte"] == ["encoder_backward_wte_grouped"]


def test_profile_defaults_to_train_pys_recompute(monkeypatch, tmp_path, capsys):
    """profile without -r builds the model with train.py's -r default on that device
    (config.TrainConfig: 0 on the CPU and on a GPU), as its help says and as --plan does
    (plan_step's default)."""
    import inspect

    from gpt2np.config import TrainConfig
    from gpt2np.formats.checkpoint import save_model
    from gpt2np.profiling import plan as planner
    from gpt2np.profiling import profiler

    path = tmp_path / "tiny.bin"
    save_model(path, CFG, GPT2(CFG, NumpyBackend(threads=1), 1, 8, seed=0).params_host())
    built = []

    class Stop(Exception):
        pass

    def stop(model, batches, steps, **keywords):
        built.append(model.recompute)
        raise Stop

    monkeypatch.setattr(profiler, "profile_steps", stop)
    devices = ("emu", "cpu")
    for device in devices:
        with pytest.raises(Stop):
            profile_cli.main(["-e", str(path), "-b", "1", "-t", "8", "--device", device, "--out",
                              str(tmp_path)])
    train = {name: TrainConfig().with_device_defaults(device_traits(name)).recompute
             for name in ("cuda", "emu", "cpu")}
    assert built == [train[d] for d in devices] and train == {"cuda": 0, "emu": 0, "cpu": 0}
    assert inspect.signature(planner.plan_step).parameters["recompute"].default == train["cuda"]
    assert planner.GPU_RECOMPUTE == train["cuda"]
    capsys.readouterr()
    assert profile_cli.main(["--help"]) == 0
    assert "(default: train.py's, 0)" in " ".join(capsys.readouterr().out.split())


def test_a_measured_profile_runs_at_train_pys_precision(monkeypatch, tmp_path, capsys):
    """Without --plan the profiler builds its backend at the precision train.py trains in on that
    device (backends.resolve_precision: tf32 on a GPU with tensor cores), or at --precision; a
    precision the device has no implementation of is one line. The GPU is a stand-in:
    resolve_precision asks it for its compute capability, and get_backend builds the emulator at
    the precision asked."""
    import gpt2np.backends as backends
    from gpt2np.formats.checkpoint import save_model
    from gpt2np.profiling import profiler

    path = tmp_path / "tiny.bin"
    save_model(path, CFG, GPT2(CFG, NumpyBackend(threads=1), 1, 8, seed=0).params_host())
    real_get_backend, capability = backends.get_backend, [90]
    asked, built = [], []

    def get_backend(name="numpy", precision="fp32", **options):
        asked.append((name, precision))
        return real_get_backend("emu" if name == "cuda" else name, precision=precision, **options)

    class Stop(Exception):
        pass

    def stop(model, batches, steps, **keywords):
        built.append(model.backend.precision)
        raise Stop

    monkeypatch.setattr(backends, "get_backend", get_backend)
    monkeypatch.setattr(backends, "cuda_problem", lambda *a, **k: None)
    monkeypatch.setattr(backends, "compute_capability", lambda: capability[0])
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    monkeypatch.setattr(profiler, "profile_steps", stop)

    def profile(device, *precision):
        asked.clear()
        built.clear()
        with pytest.raises(Stop):
            profile_cli.main(["-e", str(path), "-b", "1", "-t", "8", "--device", device, "--out",
                              str(tmp_path), *(("--precision", *precision) if precision else ())])
        assert len(asked) == 1 and asked[0][1] == built[0]
        return built[0]

    # what train.py trains in
    assert profile("cuda") == "tf32" == backends.resolve_precision("cuda")[0]
    assert [profile("cuda", p) for p in ("fp32", "bf16", "tf32")] == ["fp32", "bf16", "tf32"]
    assert profile("emu") == "fp32" and profile("emu", "tf32") == "tf32"
    assert profile("cpu") == "fp32" and profile("cpu", "bf16") == "bf16"
    # no TF32 tensor cores: fp32, as train.py, with its note
    capability[0] = 75
    capsys.readouterr()
    assert profile("cuda") == "fp32" and profile("cuda", "tf32") == "fp32"
    assert "note: this GPU (sm_75) has no TF32 tensor cores" in capsys.readouterr().err
    for device, precision, words in (
            ("cpu", "tf32", ["--precision tf32: --device cpu has no tf32, only fp32 or bf16"]),
            ("cuda", "bf16", ["--precision bf16", "sm_75", "no bf16 tensor cores"])):
        assert profile_cli.main(["-e", str(path), "-b", "1", "-t", "8", "--device", device,
                                 "--precision", precision, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert (err.startswith("error: ") and err.count("\n") == 1
                and all(w in err for w in words)), err


def test_the_views_say_the_precision_the_run_computed_in(tmp_path, capsys):
    """The GPU activities, cuda_gpu_kern_sum and kernel table titles say the precision of the
    profiled run (the cuBLAS kernel names do too, but only on a GPU)."""
    from gpt2np.formats.checkpoint import save_model

    path = tmp_path / "tiny.bin"
    save_model(path, CFG, GPT2(CFG, NumpyBackend(threads=1), 1, 8, seed=0).params_host())
    assert profile_cli.main(["-e", str(path), "-b", "1", "-t", "8", "--device", "emu",
                             "--precision", "tf32", "--out", str(tmp_path / "out"),
                             "--views", "gpu_activities,cuda_gpu_kern_sum,kernels"]) == 0
    titles = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith(("GPU activities", "cuda_gpu_kern_sum", "Kernels of"))]
    assert len(titles) == 3 and all(", precision tf32" in line for line in titles), titles
    meta = json.load(open(tmp_path / "out" / "profile.json"))["meta"]
    assert meta["precision"] == "tf32"
