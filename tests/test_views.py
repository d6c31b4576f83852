"""The profiler's views (nvprof, nsys stats, PyProf, PyTorch profiler, model summary) on the numpy
backend and the CUDA backend on the emulator: what each row says is checked against the records and
the model's buffers."""
import json
from collections import Counter

import numpy as np
import pytest

from gpt2np.backends import get_backend
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.cli import report as report_cli
from gpt2np.cli.profile import main as profiler_main
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2, STATS, STEP_SCALARS
from gpt2np.profiling import memory
from gpt2np.profiling.profiler import profile_steps, write_outputs
from gpt2np.profiling.render import report
from gpt2np.profiling.render import views as V

CFG = GPT2Config(32, 100, 128, 2, 2, 16)
B, T = 2, 8


def batches():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, CFG.vocab_size, (2, B, T + 1)).astype(np.int32)
    return [(b[:, :-1], b[:, 1:]) for b in raw]


@pytest.fixture(scope="module")
def emu():
    # one kernel per op: the counts below
    model = GPT2(CFG, get_backend("emu"), B, T, seed=0, fuse=False)
    prof = profile_steps(model, batches(), steps=1)
    return model, prof, prof.profile()


@pytest.fixture(scope="module")
def cpu():
    model = GPT2(CFG, NumpyBackend(threads=1), B, T, seed=0)
    prof = profile_steps(model, batches(), steps=1)
    return model, prof, prof.profile()


def table(profile, name, i=0):
    return V.tables(V.select(profile, "last"), name)[i]


def column(t, header):
    return [row[[c for c, _ in t.columns].index(header)] for row in t.rows]


def title_lines(text):
    """The first line of every view (views are separated by blank lines)."""
    return [block.splitlines()[0] for block in text.strip().split("\n\n")]


def test_every_view_of_an_emulated_run_says_so_on_its_title_line(emu, cpu):
    text = V.render_views(emu[2], None, V.VIEWS)
    titles = title_lines(text)
    assert len(titles) >= len(V.VIEWS)
    assert all(line.endswith(f"[{report.EMULATED_NOTE}]") for line in titles), titles
    assert report.EMULATED_NOTE not in V.render_views(cpu[2], None, V.VIEWS)
    # the numpy backend's: CPU times, said on every title line too
    numpy_titles = title_lines(V.render_views(cpu[2], None, V.VIEWS))
    note = f"{report.NUMPY_NOTE}; {cpu[0].backend.math} CPU math"      # and which --cpu-math ran
    assert all(line.endswith(f"[{note}]") for line in numpy_titles), numpy_titles
    # the JSON file and the per-view CSVs carry it too, and report.render
    # (train.py --profile) as well
    legacy = report.render(emu[1].records, note=emu[2].note, num_layers=CFG.num_layers)
    assert all(line.endswith(f"[{report.EMULATED_NOTE}]") for line in title_lines(legacy))


def test_module_tree_gives_parameters_per_module_and_time_to_wpe(emu):
    model, _, profile = emu
    t = table(profile, "modules")
    params = {name.strip(): int(count.replace(",", "")) for name, count in zip(column(t, "module"),
                                                                               column(t, "params"))}
    C, Vp, maxT = CFG.channels, CFG.padded_vocab_size, CFG.max_seq_len
    assert params["gpt2"] == model.num_parameters
    assert params["wte"] == Vp * C and params["wpe"] == maxT * C
    assert params["c_attn"] == 3 * C * C + 3 * C and params["lm_head"] == 0      # tied to wte
    assert params["h"] == CFG.num_layers * (12 * C * C + 13 * C)
    wpe = next(row for row in t.rows if row[0].strip() == "wpe")
    assert float(wpe[3]) > 0            # encoder_backward's dwpe kernel is wpe's backward time
    assert memory.module_parameters(CFG)["h.1.mlp.c_proj"] == 4 * C * C + C


def test_module_tree_says_what_it_leaves_out(emu, cpu):
    """The tree holds kernels only: its title counts the copies and memsets (in
    gpu_activities and phases)."""
    _, _, profile = emu
    (t,) = V.modules(profile)
    others = [r for r in profile.records if r.kind != "kernel"]
    assert (
        others
        and f"{len(others)} copies and memsets, {sum(r.duration_ns for r in others) / 1e3:,.1f} us"
        in t.title)
    (t,) = V.modules(cpu[2])                     # the numpy backend has none: nothing said
    assert "copies" not in t.title


def test_model_summary_is_the_models_buffers(emu, cpu):
    for model, prof, profile in (emu, cpu):
        mem = prof.memory
        got = {b["buffer"]: b["bytes"] for b in mem["buffers"]}
        assert got["parameters"] == got["gradients"] == model.num_parameters * 4
        assert got["AdamW m"] == got["AdamW v"] == model.num_parameters * 4
        assert got["activations"] == model.acts.nbytes
        assert got["gradient scratch"] == B * T * CFG.channels * 4 * (1 + 1 + 3 + 4)
        assert mem["total"] == sum(got.values())
        assert mem["peak"]["bytes"] > mem["total"] and "RSS" in mem["peak"]["what"]
        assert sum(a["bytes"] for a in mem["activations"]) == model.acts.nbytes
        t = table(profile, "model")
        assert column(t, "buffer")[-1] == "total" and "measured peak" in t.footer


def test_gpu_memory_peak_is_the_cupy_pools_high_water_mark():
    class Pool:
        def total_bytes(self):
            return 3 << 30

        def used_bytes(self):
            return 1 << 30

    class CuPy:
        def get_default_memory_pool(self):
            return Pool()

    peak = memory.cupy_pool_peak(CuPy())
    assert peak["bytes"] == 3 << 30 and peak["used_bytes"] == 1 << 30 and "pool" in peak["what"]


def test_gpu_activities_have_copy_and_memset_rows_with_their_bytes(emu):
    _, prof, profile = emu
    step = [r for r in prof.records if r.step == 1]
    copies = [r for r in step if r.kind == "memcpy"]
    # the device step uploads the inputs with their token groups (encoder_backward's), the targets
    # and the step's AdamW scalars before its passes; the only copy back is the asynchronous one of
    # its statistics, at the end
    htod = [r for r in copies if r.kernel == "[CUDA memcpy HtoD]"]
    assert [r.bytes for r in htod] == [B * T * 4, (3 * B * T + 2) * 4, B * T * 4, 4 * STEP_SCALARS]
    assert all(r.direction == "other" for r in htod)
    (stats,) = [r for r in copies if r.kernel == "[CUDA memcpy DtoH]"]
    assert stats.bytes == 4 * STATS and stats.range_stack[-1] == "Train step 1"
    t = table(profile, "gpu_activities")
    calls = dict(zip(column(t, "Name"), column(t, "Calls")))
    assert calls["[CUDA memcpy HtoD]"] == len(htod)
    assert calls["[CUDA memset]"] == sum(r.kind == "memset" for r in step)
    assert calls["layernorm_forward"] == 2 * CFG.num_layers + 1
    assert sum(float(p.rstrip("%")) for p in column(t, "Time(%)")) == pytest.approx(100, abs=0.1)
    size = table(profile, "cuda_gpu_mem_size_sum")
    total = dict(zip(column(size, "Operation"), column(size, "Total (MB)")))
    assert (float(total["[CUDA memcpy Host-to-Device]"])
            == pytest.approx(sum(r.bytes for r in htod) / 1e6, abs=1e-3))
    counts = dict(zip(column(table(profile, "cuda_gpu_mem_time_sum"), "Operation"),
                      column(table(profile, "cuda_gpu_mem_time_sum"), "Count")))
    assert counts["[CUDA memcpy Host-to-Device]"] == str(len(htod))


def test_api_calls_one_per_launch_and_copy(emu):
    _, prof, profile = emu
    step = V.select(profile, "last")
    kernels = [r for r in step.records if r.kind == "kernel"]
    api = Counter(a.name for a in step.api)
    assert api["cuLaunchKernel"] == sum(not r.kernel.startswith("cublas") for r in kernels)
    assert api["cublasSgemm_v2"] + api["cublasSgemmStridedBatched"] + api["cublasLtMatmul"] == sum(
        r.kernel.startswith("cublas") for r in kernels)
    batched = sum(r.kernel.startswith("cublas") and "gemm_attention" in r.kernel for r in kernels)
    # the naive attention's per-head GEMMs
    assert api["cublasSgemmStridedBatched"] == batched > 0
    # the device step never waits for the device
    assert api["cudaStreamSynchronize"] == 0
    by_idx = {r.idx: r for r in step.records}
    for a in step.api:
        if a.name == "cuLaunchKernel":
            assert by_idx[a.record].kind == "kernel" and by_idx[a.record].grid.startswith("(")
    t = table(profile, "api_calls")
    assert (dict(zip(column(t, "Name"), column(t, "Calls")))["cuLaunchKernel"]
            == api["cuLaunchKernel"])
    nsys = table(profile, "cuda_api_sum")
    assert (dict(zip(column(nsys, "Name"), column(nsys, "Num Calls")))["cuLaunchKernel"]
            == str(api["cuLaunchKernel"]))


def test_gemms_with_an_epilogue_are_cublaslt_calls():
    """--fuse 1: the matmuls with a bias, GELU, dGELU or bias-gradient epilogue are
    cublasLtMatmul API rows."""
    prof = profile_steps(GPT2(CFG, get_backend("emu"), B, T, seed=0, fuse=True), batches(), steps=1)
    step = V.select(prof.profile(), "last")
    api = Counter(a.name for a in step.api)
    # per layer: the 4 forward GEMMs (bias; c_fc's bias + GELU), mlp.c_proj's dinp (dGELU), the 4
    # dweights (bias gradient); lm_head has no bias: plain cuBLAS
    assert api["cublasLtMatmul"] == CFG.num_layers * (4 + 1 + 4)


def test_nvtx_kern_sum_groups_activities_by_the_ranges_that_launched_them(emu):
    _, prof, profile = emu
    t = table(profile, "nvtx_kern_sum")
    step = [r for r in prof.records if r.step == 1]
    rows = {(row[0], row[-1]): row for row in t.rows}
    fwd = Counter(r.kernel for r in step if "gpt2_forward" in r.range_stack)
    assert {k for (rng, k) in rows if rng == "gpt2_forward"} == set(fwd)
    for kernel, n in fwd.items():
        assert rows[("gpt2_forward", kernel)][3] == n                       # Kern Inst
        # one gpt2_forward instance
        assert rows[("gpt2_forward", kernel)][2] == 1
    ln = rows[("Layer 0", "layernorm_forward")]
    # ln_1 and ln_2 of layer 0
    assert ln[2] == 1 and ln[3] == 2
    matmul = rows[("Layer 0", "cublasSgemm (gemm_matmul_forward)")]
    assert matmul[3] == 4
    total = sum(r.duration_ns for r in step if "gpt2_backward" in r.range_stack)
    assert sum(int(row[4].replace(",", "")) for (rng, _), row in rows.items()
               if rng == "gpt2_backward") == total


def test_phases_split_device_time_into_forward_backward_optimizer(emu):
    _, prof, profile = emu
    t = table(profile, "phases")
    got = dict(zip(column(t, "phase"), column(t, "launches")))
    step = [r for r in prof.records if r.step == 1 and r.kind == "kernel"]
    assert got["forward"] == sum(r.direction == "fprop" for r in step)
    assert got["backward"] == sum(r.direction == "bprop" for r in step)
    assert got["optimizer"] == sum(r.direction == "update" for r in step)


def test_user_ranges_in_the_pytorch_layout(emu):
    _, prof, profile = emu
    step = V.select(profile, "last")
    t = table(profile, "user_ranges")
    rows = {row[0]: row for row in t.rows}
    for name in ("train_step-1", "forward", "backward", "optimizer"):
        assert name in rows
    assert rows["train_step-1"][-1] == 1 and rows["forward"][-1] == 1
    top = next(r for r in step.ranges if r.name == "Train step 1")
    children = sum(r.duration_ns for r in step.ranges if r.parent == top.id)
    assert rows["train_step-1"][4] == V.nvprof_time(top.duration_ns)                     # CPU total
    assert rows["train_step-1"][2] == V.nvprof_time(top.duration_ns - children)          # Self CPU
    fwd = sum(r.duration_ns for r in step.records if r.direction == "fprop")
    # CUDA total
    assert rows["forward"][8] == V.nvprof_time(fwd)
    assert rows["cuLaunchKernel"][-1] == sum(a.name == "cuLaunchKernel" for a in step.api)
    assert [c for c, _ in t.columns][:3] == ["Name", "Self CPU %", "Self CPU"]


def test_numpy_backend_views(cpu):
    _, prof, profile = cpu
    t = table(profile, "gpu_activities")
    assert t.title.startswith("CPU activities")
    assert "numpy.matmul_forward" in column(t, "Name")
    assert table(profile, "api_calls").rows == []
    assert table(profile, "comm").rows == []
    rows = {row[0]: row for row in table(profile, "user_ranges").rows}
    assert rows["forward"][8] == V.nvprof_time(sum(r.duration_ns for r in prof.records
                                                    if r.step == 1 and r.direction == "fprop"))


def test_files_round_trip_and_trace_tracks(emu, tmp_path):
    _, prof, profile = emu
    paths = write_outputs(prof, tmp_path)
    again, roof = V.read_profile(paths["json"])
    assert V.render_views(again, roof, V.VIEWS) == V.render_views(profile, None, V.VIEWS)
    doc = json.load(open(paths["views.json"]))
    assert doc["note"] == report.EMULATED_NOTE
    assert doc["views"]["gpu_activities"][0]["columns"][:3] == ["Time(%)", "Time", "Calls"]
    assert (tmp_path / "views"
            / "nvtx_kern_sum.csv").read_text().startswith("NVTX Range,Style,NVTX Inst")
    trace = json.load(open(paths["trace.json"]))["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e.get("name") == "thread_name"}
    assert {"kernels", "copies and memsets", "CUDA API"} <= set(tracks)
    cats = {e["cat"]: e["tid"] for e in trace if e.get("ph") == "X"}
    assert cats["memcpy"] == cats["memset"] == tracks["copies and memsets"]
    assert cats["api"] == tracks["CUDA API"] and cats["kernel"] == tracks["kernels"]
    if "png" in paths:
        for key in ("png", "layers.png", "roofline.png"):
            assert open(paths[key], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_views_flag_names_unknown_views(capsys):
    assert profiler_main(["--views", "gpu_activities,bogus"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "nvtx_kern_sum" in err and err.count("\n") == 1
    assert V.parse_views("all") == tuple(V.VIEWS)


class FourRanks:
    """An MPI communicator stand-in: rank 0 of 4 identical ranks (sums are 4x, 1
    ms per collective)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 4

    def Allreduce(self, sendbuf, recvbuf, op=None):
        import time
        time.sleep(0.001)
        recvbuf *= 4

    def allreduce(self, value):
        return 4 * value


@pytest.mark.parametrize("zero", [0])
def test_communication_rows_with_bus_bandwidth(zero):
    from gpt2np.dist import MpiProcessGroup
    from gpt2np.profiling.profiler import Profiler
    from gpt2np.train_step import train_step
    model = GPT2(CFG, NumpyBackend(threads=1), B, T, seed=0)
    dist = MpiProcessGroup(FourRanks(), zero_stage=zero, timeout=0)
    (x, y), _ = batches()
    with Profiler(model.backend, model=model) as prof:
        train_step(model, lambda: (x, y), step=1, lr=1e-4, dist=dist)
    grads = [c for c in prof.comms if c.name == "allreduce_grads"]
    assert len(grads) == 1 and grads[0].collective == "all_reduce" and grads[0].ranks == 4
    assert grads[0].bytes == model.num_parameters * 4 and grads[0].duration_ns >= 1_000_000
    assert grads[0].busbw == pytest.approx(grads[0].algbw * 2 * 3 / 4)
    assert {c.name for c in prof.comms} == {"allreduce_grads", "allreduce_scalar"}
    t = table(prof.profile(), "comm")
    row = next(r for r in t.rows if r[1] == "allreduce_grads")
    assert row[0] == "all_reduce" and row[3] == f"{model.num_parameters * 4:,}"
    assert float(row[6]) == pytest.approx(grads[0].algbw / 1e9, rel=1e-3)
    assert float(row[7]) == pytest.approx(grads[0].busbw / 1e9, rel=1e-3)
    phases = dict(zip(column(table(prof.profile(), "phases"), "phase"),
                      column(table(prof.profile(), "phases"), "%")))
    assert "communication" in phases
    users = {r[0] for r in table(prof.profile(), "user_ranges").rows}
    assert "mpi:all_reduce" in users


def test_report_tool_re_renders_a_saved_profile(emu, tmp_path, capsys, monkeypatch):
    _, prof, profile = emu
    paths = write_outputs(prof, tmp_path)
    loads = []
    real_load = json.load
    monkeypatch.setattr(json, "load", lambda f, **kw: loads.append(f.name) or real_load(f, **kw))
    assert report_cli.main([paths["json"], "--views", "all"]) == 0
    assert capsys.readouterr().out == V.render_views(profile, None, V.VIEWS)
    assert report_cli.main([paths["json"]]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(f"[{report.EMULATED_NOTE}]") and "params" in out
    # the file parsed once a run (a GPU step's profile is megabytes)
    assert loads == [paths["json"]] * 2


COMM = {"idx": 0, "step": 1, "name": "allreduce_grads", "collective": "all_reduce", "bytes": 4096,
        "ranks": 4, "start_ns": 100, "duration_ns": 5000}


def saved(emu, tmp_path, change):
    """The emulated run's profile.json (ranges, API calls, memory, and COMM as its one collective)
    with change(doc) applied."""
    profile = emu[2]
    path = tmp_path / "profile.json"
    report.write_json(profile.records, str(path), None, profile.meta, V.profile_doc(profile))
    doc = json.loads(path.read_text())
    doc["comms"] = [dict(COMM)]
    change(doc)
    path.write_text(json.dumps(doc))
    return path


def test_saved_profile_with_a_collective_renders(emu, tmp_path, capsys):
    path = saved(emu, tmp_path, lambda doc: None)
    assert report_cli.main([str(path), "--views", "all"]) == 0
    assert "allreduce_grads" in capsys.readouterr().out
    for mem in (None, {}):                   # not recorded
        path = saved(emu, tmp_path, lambda doc, mem=mem: doc.update(memory=mem))
        assert report_cli.main([str(path), "--views", "model"]) == 0
        assert "Model summary: not recorded" in capsys.readouterr().out


def end_before_start(doc):
    doc["ranges"][2]["end_ns"] = doc["ranges"][2]["start_ns"] - 1


@pytest.mark.parametrize("change, expected", [
    # a text time was a TypeError naming no file; a negative duration was rendered
    (lambda doc: doc["ranges"][3].update(start_ns="12"),
     "'ranges' row 3: field 'start_ns' must be an integer, got \"12\""),
    (end_before_start, "'ranges' row 2: field 'end_ns' ("),
    (lambda doc: doc["ranges"][0].update(name=7),
     "'ranges' row 0: field 'name' must be text, got 7"),
    (lambda doc: doc["ranges"][0].update(parent="1"),
     "'ranges' row 0: field 'parent' must be an integer or null"),
    (lambda doc: doc["ranges"][1].pop("end_ns"), "'ranges' row 1: lacks the field 'end_ns'"),
    (lambda doc: doc["ranges"][1].update(bogus=1), "'ranges' row 1: has an unknown field 'bogus'"),
    (lambda doc: doc.update(ranges={"a": 1}), "'ranges' must be a list of objects, got {\"a\": 1}"),
    (lambda doc: doc["api"][1].update(duration_ns=-7),
     "'api' row 1: field 'duration_ns' must be an integer >= 0, got -7"),
    (lambda doc: doc["api"][0].update(start_ns=1.5),
     "'api' row 0: field 'start_ns' must be an integer, got 1.5"),
    (lambda doc: doc["api"][0].update(record="0"),
     "'api' row 0: field 'record' must be an integer or null"),
    (lambda doc: doc["api"].__setitem__(0, [1]),
     "'api' row 0: expected an object of fields, got [1]"),
    (lambda doc: doc["comms"][0].update(bytes="4k"),
     "'comms' row 0: field 'bytes' must be an integer >= 0"),
    (lambda doc: doc["comms"][0].update(duration_ns=-1),
     "'comms' row 0: field 'duration_ns' must be an integer >= 0"),
    (lambda doc: doc["comms"][0].update(collective=None),
     "'comms' row 0: field 'collective' must be text"),
    (lambda doc: doc.update(memory=[1]), "'memory': must be an object or null, got [1]"),
    (lambda doc: doc["memory"].pop("total"), "'memory': lacks the field 'total'"),
    (lambda doc: doc["memory"]["buffers"][0].update(bytes="many"),
     "'memory': 'buffers' row 0: field 'bytes' must be an integer >= 0"),
    (lambda doc: doc["memory"]["activations"][0].update(shape="2x8"),
     "'memory': 'activations' row 0: field 'shape' must be a list of integers >= 0"),
    (lambda doc: doc["memory"].update(peak={"bytes": "1G", "what": "rss"}),
     "'memory': 'peak': field 'bytes' must be an integer >= 0 or null"),
])
def test_ranges_api_calls_collectives_and_memory_of_the_wrong_shape_are_errors_naming_the_file(
        emu, tmp_path, capsys, change, expected):
    path = saved(emu, tmp_path, change)
    with pytest.raises(report.ReportError, match="^" + str(path)):
        V.read_profile(str(path))
    assert report_cli.main([str(path), "--views", "all"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and expected in err, err


def test_pyprof_view_gives_grid_block_tensor_cores_floor_and_percent_of_roofline():
    from gpt2np.profiling.gpu_specs import roofline
    roof = roofline("H100", "fp32", matmul_precision="tf32")
    gemm = report.KernelRecord(0, 1, "fprop", 0, "matmul_forward", "h.0.attn.c_attn",
                               "M=256,N=192,K=64", "cublasSgemm (gemm_matmul_forward)", 0, 20_000,
                               flops=2 * 10**9, bytes=10**6)
    ln = report.KernelRecord(1, 1, "fprop", 0, "layernorm_forward", "h.0.ln_1", "B=4,T=64,C=64",
                             "layernorm_forward", 20_000, 5_000, flops=10**5, bytes=3 * 10**6,
                             grid="(256,1,1)", block="(128,1,1)")
    sm80 = report.KernelRecord(2, 1, "bprop", 0, "matmul_backward", "h.0.mlp.c_fc", "",
                               "ampere_s16816gemm_tn", 25_000, 1_000)
    for precision, tc in (("tf32", "yes"), ("fp32", "no")):
        t = V.tables(V.Profile([gemm, ln, sm80], meta={"precision": precision}), "pyprof", roof)[0]
        rows = {row[0]: dict(zip([c for c, _ in t.columns], row)) for row in t.rows}
        assert rows[0]["TC"] == tc and rows[1]["TC"] == "no" and rows[2]["TC"] == "yes"
    floor_gemm = max(gemm.flops / roof.flops_ceiling(True), gemm.bytes / roof.peak_bw) * 1e9
    floor_ln = max(ln.flops / roof.flops_ceiling(False), ln.bytes / roof.peak_bw) * 1e9
    assert (rows[0]["Floor (us)"] == f"{floor_gemm / 1e3:.2f}"
            and rows[1]["Floor (us)"] == f"{floor_ln / 1e3:.2f}")
    assert rows[0]["% of roofline"] == f"{100 * floor_gemm / gemm.duration_ns:.1f}%"
    assert (rows[1]["% of roofline"] == f"{100 * floor_ln / ln.duration_ns:.1f}%"
            and rows[1]["Bound"] == "memory")
    assert (rows[1]["Grid"], rows[1]["Block"], rows[0]["Grid"]) == ("(256,1,1)", "(128,1,1)", "-")
    assert rows[2]["Floor (us)"] == "-" and "H100" in t.title
    assert "no floor" in V.tables(V.Profile([gemm]), "pyprof", None)[0].title


def test_every_view_is_in_the_json_and_csv_files(cpu, tmp_path):
    _, prof, profile = cpu
    write_outputs(prof, tmp_path)
    doc = json.load(open(tmp_path / "views.json"))
    assert set(doc["views"]) == set(V.VIEWS)
    ops = (tmp_path / "views" / "ops.csv").read_text().splitlines()
    assert ops[0].startswith("op,dir,launches,total (us)") and any(line.startswith(
        "matmul_backward,bprop")
                                                                   for line in ops)
    for name in ("kernels", "layers", "top_kernels"):
        assert (tmp_path / "views" / f"{name}.csv").is_file()
    assert doc["views"]["kernels"][0]["rows"][-1][0] == "total"


def test_train_profile_on_the_emulated_cuda_path_labels_every_view(tmp_path, capsys):
    """train.py --device emu --profile: the CUDA backend over the emulator, every view
    labelled as emulated."""
    import train
    from gpt2np.datasets.data import write_shard
    from gpt2np.formats.checkpoint import save_model
    model_path = tmp_path / "tiny.bin"
    save_model(model_path, CFG, GPT2(CFG, NumpyBackend(), B, T, seed=0).params_host())
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, 2000).astype(np.uint16)
    write_shard(tmp_path / "val.bin", tokens[:500])
    write_shard(tmp_path / "train.bin", tokens[500:])
    args = ["-e", model_path, "-i", tmp_path / "train.bin", "-j",
            tmp_path / "val.bin", "-b", B, "-t", T,
            "-x", 3, "-v", 0, "-s", 0, "--profile", 1, "-o", tmp_path / "run", "--device", "emu"]
    assert train.main([str(a) for a in args]) == 0
    out = capsys.readouterr().out
    titles = [line for line in out.splitlines()
              if line.startswith(("Model summary", "GPT-2 modules", "Phases", "GPU activities",
                                  "API calls", "User ranges"))]
    assert len(titles) == 6 and all(t.endswith(f"[{report.EMULATED_NOTE}]") for t in titles), titles
    saved = str(tmp_path / "run" / "profile" / "profile.json")
    assert report_cli.main([saved, "--views", "all"]) == 0
    every = title_lines(capsys.readouterr().out)
    assert len(every) >= len(V.VIEWS) and all(t.endswith(f"[{report.EMULATED_NOTE}]")
                                              for t in every), every


def test_the_kernel_reports_ranges_are_the_recorded_ones(cpu, tmp_path, capsys):
    """`report` without --views shows the range instances the run recorded (one adamw per tensor, as
    the nvtx_sum view counts them), not ones rebuilt from the launches' stacks (which merged
    back-to-back adamw calls into one); a profile.json without ranges still gets the
    rebuilt ones, titled so."""
    profile = cpu[2]
    path = tmp_path / "profile.json"
    report.write_json(profile.records, str(path), None, profile.meta, V.profile_doc(profile))

    def instances(text, title, name):
        section = text[text.index(title):]
        return [line.split() for line in section.splitlines() if line.split()[-1:] == [name]][0][2]

    assert report_cli.main([str(path)]) == 0
    text = capsys.readouterr().out
    adamw = sum(1 for r in V.select(profile, "last").ranges if r.name == "adamw")
    assert adamw == 16 and instances(text, "NVTX ranges", "adamw") == "16"
    doc = json.loads(path.read_text())
    del doc["ranges"]
    path.write_text(json.dumps(doc))
    assert report_cli.main([str(path)]) == 0
    assert "NVTX ranges (rebuilt from the launches' range stacks)" in capsys.readouterr().out


def test_pyprof_marks_no_tensor_cores_on_the_cpu_in_bf16(cpu):
    """The numpy backend's bf16 run computes its matmuls in fp32 on the CPU: TC no; the same records
    labelled a CUDA bf16 run mark their GEMMs yes."""
    profile = cpu[2]

    def tc_column(meta):
        labelled = V.Profile(profile.records, profile.ranges, profile.api, profile.comms,
                             profile.memory, meta)
        (pyprof,) = V.pyprof(V.select(labelled, "last"))
        at = [c for c, _ in pyprof.columns].index("TC")
        return {(row[3], row[at]) for row in pyprof.rows}

    assert {tc for _, tc in tc_column({**profile.meta, "precision": "bf16"})} == {"no"}
    marked = tc_column({**profile.meta, "backend": "cuda", "precision": "bf16"})
    assert ("matmul_forward", "yes") in marked and ("layernorm_forward", "no") in marked
