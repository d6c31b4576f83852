"""CUPTI activity records in the profiler, with a fake activity source that behaves like CUPTI: it
sees every runtime call, stamps device times, ties each call to the external correlation id pushed
around it, and reports kernels, copies, memsets and API calls with cupti-python's attribute names.
Also the calls CuptiSource makes into cupti-python, against a stand-in module with its names."""
import itertools
import sys
import types
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2
from gpt2np.profiling import cupti as C
from gpt2np.profiling.profiler import TIMING_EMU, Profiler
from gpt2np.profiling.render import views as V

CFG = GPT2Config(32, 100, 128, 2, 2, 16)
B, T = 2, 8
API = {1: "cudaLaunchKernel", 2: "cublasSgemm_v2", 3: "cudaMemcpyAsync", 4: "cudaMemsetAsync",
       5: "cudaMalloc", 6: "cudaStreamSynchronize"}


class FakeCupti:
    """The activity source: push/pop external ids; `emit` is called by FakeGpu for every runtime
    call. Its device runs `lag` activities behind the host (a kernel is done once `lag` more were
    issued after it, or at a host sync: finish()), and stop() is CUPTI's forced flush: the records
    of unfinished work come back with start = end = 0."""

    timing = C.TIMING

    def __init__(self, lag=40):
        self.external, self.activities, self.started = [], [], False
        self.clock = itertools.count(1_000_000, 1_000)
        self.corr = itertools.count(500)
        self.lag, self.running = lag, []

    def start(self):
        self.started = True
        # a kernel of someone else's (no external id): CUPTI reports it, nothing of ours issued it
        self.activities.append(SimpleNamespace(kind=C.KIND_CONCURRENT_KERNEL, name="foreign_kernel",
                                               start=1, end=11, correlation_id=1, grid_x=1,
                                               grid_y=1, grid_z=1, block_x=32,
                                               block_y=1, block_z=1))

    def now(self):
        return next(self.clock)

    def push(self, external_id):
        self.external.append(external_id)

    def pop(self):
        self.external.pop()

    def api_name(self, kind, cbid):
        return API[cbid]

    def stop(self):
        self.started = False
        for a in self.running:
            a.start = a.end = 0
        self.running = []
        out, self.activities = self.activities, []
        return out

    def finish(self):
        self.running = []

    def emit(self, cbid, *activities):
        # CUPTI records only while its activity kinds are enabled
        if not self.started:
            return
        corr = next(self.corr)
        start = next(self.clock)
        self.activities.append(SimpleNamespace(kind=C.KIND_RUNTIME, cbid=cbid, start=start,
                                               end=start + 200, correlation_id=corr, thread_id=7))
        if self.external:
            self.activities.append(SimpleNamespace(kind=C.KIND_EXTERNAL_CORRELATION,
                                                   correlation_id=corr,
                                                   external_id=self.external[-1], external_kind=3))
        for a in activities:
            t = next(self.clock)
            a.start, a.end, a.correlation_id = t, t + 500, corr
            self.activities.append(a)
            self.running.append(a)
        del self.running[:max(0, len(self.running) - self.lag)]


def kernel(name, grid=(4, 1, 1), block=(128, 1, 1)):
    return SimpleNamespace(kind=C.KIND_CONCURRENT_KERNEL, name=name, grid_x=grid[0], grid_y=grid[1],
                           grid_z=grid[2], block_x=block[0], block_y=block[1], block_z=block[2])


class FakeGpu(EmuRuntime):
    """The emulator, with CUPTI watching: every call is reported to the fake source. Batched GEMMs
    report a second kernel (as cuBLAS's split-K reduction would)."""

    name = "fake-gpu"

    def __init__(self, source):
        super().__init__()
        self.source, self.events = source, 0

    def launch(self, function, grid, block, args, shared_mem=0):
        super().launch(function, grid, block, args, shared_mem)
        self.source.emit(1, kernel(self.names[id(function)], tuple(grid) + (1,) * (3 - len(grid))))

    def compile(self, path, options=()):
        module = super().compile(path, options)
        runtime = self

        class Named:
            def get_function(self, name):
                fn = module.get_function(name)
                runtime.names = getattr(runtime, "names", {})
                runtime.names[id(fn)] = name
                return fn
        return Named()

    def gemm(self, *args, **epilogue):
        super().gemm(*args, **epilogue)
        extra = [kernel("splitKreduce_kernel")] if args[16] > 1 else []
        self.source.emit(2, kernel("ampere_sgemm_128x64_tn", (8, 2, 1), (256, 1, 1)), *extra)

    def from_host(self, array):
        out = super().from_host(array)
        self.source.emit(3, SimpleNamespace(kind=C.KIND_MEMCPY, copy_kind=1, bytes=out.nbytes))
        return out

    # cudaMemcpy: returns when the device has done all before it
    def to_host(self, array):
        self.source.emit(3, SimpleNamespace(kind=C.KIND_MEMCPY, copy_kind=2, bytes=array.nbytes))
        self.source.finish()
        return super().to_host(array)

    def upload(self, dst, array):
        super().upload(dst, array)
        self.source.emit(3, SimpleNamespace(kind=C.KIND_MEMCPY, copy_kind=1, bytes=dst.nbytes))

    def read_async(self, array):
        self.source.emit(3, SimpleNamespace(kind=C.KIND_MEMCPY, copy_kind=2, bytes=array.nbytes))
        return super().read_async(array)

    def copy(self, dst, src):
        super().copy(dst, src)
        self.source.emit(3, SimpleNamespace(kind=C.KIND_MEMCPY, copy_kind=8, bytes=dst.nbytes))

    def fill(self, array, value):
        super().fill(array, value)
        self.source.emit(4, SimpleNamespace(kind=C.KIND_MEMSET, bytes=array.nbytes, value=0))

    def synchronize(self):
        self.source.emit(6)
        self.source.finish()

    def event(self):
        self.events += 1
        return super().event()


def profiled_step(source):
    """(profiler, runtime, events made before it): step 0 unprofiled, step 1 under the
    Profiler, on FakeGpu."""
    rt = FakeGpu(source)
    model = GPT2(CFG, CudaBackend(rt), B, T, seed=0)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, CFG.vocab_size, (2, B, T + 1)).astype(np.int32)
    from gpt2np.train_step import train_step
    train_step(model, lambda: (raw[0, :, :-1], raw[0, :, 1:]), step=0, lr=1e-4)
    events_before = rt.events
    with Profiler(model.backend, model=model, activity_source=source) as prof:
        train_step(model, lambda: (raw[1, :, :-1], raw[1, :, 1:]), step=1, lr=1e-4)
    return prof, rt, events_before


@pytest.fixture(scope="module")
def run():
    return profiled_step(FakeCupti())


def test_device_times_and_names_come_from_cupti_and_no_events_are_used(run):
    prof, rt, events_before = run
    # no event bracketed any launch
    assert prof.timing == C.TIMING and rt.events == events_before
    step = [r for r in prof.records if r.step == 1]
    assert step and all(r.duration_ns == 500 and r.start_ns >= 1_000_000 for r in step)
    gemms = [r for r in step if r.kernel == "ampere_sgemm_128x64_tn"]
    assert gemms and all(r.grid == "(8,2,1)" and r.block == "(256,1,1)" and r.flops > 0
                         for r in gemms)
    # our labels gave way to the real names
    assert not any(r.kernel.startswith("cublasSgemm (") for r in step)
    assert next(r for r in step if r.kernel == "layernorm_forward").grid.startswith("(")
    assert [r.idx for r in prof.records] == list(range(len(prof.records)))


def test_the_device_is_synchronized_before_the_final_flush(run):
    """The step returns with work still queued (the device step does not wait), and CUPTI's forced
    flush hands over unfinished work without times: the profiler waits for the device first, so
    every activity of the step, the last optimizer kernel and the stats readback included, has its
    device times (the H100's run showed 0 ns for everything after the first forward kernels)."""
    prof = run[0]
    step = [r for r in prof.records if r.step == 1]
    assert len(step) > FakeCupti().lag and all(r.start_ns >= 1_000_000 and r.duration_ns == 500
                                               for r in step)
    assert prof.incomplete == 0
    # the step's stats readback
    assert step[-1].kind == "memcpy" and step[-1].kernel == "[CUDA memcpy DtoH]"
    assert any(r.op.startswith("adamw") for r in step[-6:])
    assert "incomplete" not in V.render_views(prof.profile(), None, V.VIEWS)


class StuckCupti(FakeCupti):
    """A device whose last `lag` activities never finish, a sync or not: CUPTI's flush
    has them incomplete."""

    def finish(self):
        pass


def test_incomplete_records_are_left_out_with_a_note_not_shown_as_0_ns(capsys, tmp_path):
    prof, _, _ = profiled_step(StuckCupti(lag=7))
    step = [r for r in prof.records if r.step == 1]
    # no 0 ns row
    assert step and all(r.start_ns >= 1_000_000 and r.duration_ns == 500 for r in step)
    err = capsys.readouterr().err
    assert prof.incomplete == 7
    assert err.count("\n") == 1 and "note: 7 CUPTI activity records came back incomplete" in err
    assert [r.idx for r in prof.records] == list(range(len(prof.records)))
    assert all(a.record is None or 0 <= a.record < len(prof.records) for a in prof.api)
    complete, _, _ = profiled_step(FakeCupti(lag=7))
    # the 7 launches and copies they were to time
    assert len(complete.records) - len(prof.records) == 7
    profile = prof.profile()
    assert profile.meta["incomplete_records"] == 7
    for name in ("gpu_activities", "cuda_gpu_kern_sum", "kernels"):
        t = V.tables(V.select(profile, "last"), name)[0]
        assert (t.footer == "note: 7 CUPTI activity records came back incomplete (unfinished at "
                            "the flush, no device times) and are left out"), name
    mins = [row[5] for row in V.tables(V.select(profile, "last"), "gpu_activities")[0].rows]
    assert mins and "0ns" not in mins
    # the note survives the files: re-rendered from profile.json, the views still say it
    from gpt2np.profiling.profiler import write_outputs
    paths = write_outputs(prof, tmp_path)
    again, roof = V.read_profile(paths["json"])
    assert (V.render_views(again, roof, ("gpu_activities",))
            == V.render_views(profile, None, ("gpu_activities",)))
    assert ("7 CUPTI activity records came back incomplete"
            in V.render_views(again, roof, ("gpu_activities",)))


def test_extra_kernels_belong_to_the_op_that_launched_them_and_foreign_ones_to_none(run):
    prof = run[0]
    recs = prof.records
    splits = [i for i, r in enumerate(recs) if r.kernel == "splitKreduce_kernel"]
    assert splits
    for i in splits:
        gemm = recs[i - 1]
        # batched: attention's
        assert gemm.kernel == "ampere_sgemm_128x64_tn" and recs[i].op == gemm.op
        assert gemm.op in ("attention_forward", "attention_backward")
        assert (recs[i].module == gemm.module and recs[i].flops == 0
                and recs[i].range_stack == gemm.range_stack)
    foreign = [r for r in recs if r.kernel == "foreign_kernel"]
    assert len(foreign) == 1 and foreign[0].direction == "other" and foreign[0].op == ""


def test_copies_memsets_and_api_calls_are_correlated(run):
    prof = run[0]
    kinds = Counter(r.kind for r in prof.records if r.step == 1)
    assert kinds["memcpy"] >= 4 and kinds["memset"] >= 1
    htod = [r for r in prof.records if r.kernel == "[CUDA memcpy HtoD]" and r.step == 1]
    assert htod[0].bytes == B * T * 4 and htod[0].duration_ns == 500
    by_idx = {r.idx: r for r in prof.records}
    owned = [a for a in prof.api if a.record is not None]
    assert owned and all(a.duration_ns == 200 for a in prof.api)
    for a in owned:
        r = by_idx[a.record]
        expected = {"cudaLaunchKernel": "kernel", "cublasSgemm_v2": "kernel",
                    "cudaMemsetAsync": "memset", "cudaMemcpyAsync": "memcpy"}[a.name]
        assert r.kind == expected
    launches = sum(a.name == "cudaLaunchKernel" for a in owned)
    assert launches == sum(r.kind == "kernel"
                           and r.kernel not in ("ampere_sgemm_128x64_tn", "splitKreduce_kernel",
                                                "foreign_kernel") for r in prof.records)


def test_views_of_a_cupti_profile(run):
    prof = run[0]
    text = V.render_views(prof.profile(), None,
                          ("gpu_activities", "api_calls", "cuda_gpu_kern_sum"))
    assert ("ampere_sgemm_128x64_tn" in text and "[CUDA memcpy HtoD]" in text
            and "cudaLaunchKernel" in text)
    assert C.TIMING in text and "emulated" not in text


def test_events_fallback_says_so_and_cupti_is_off_the_emulator():
    rt = EmuRuntime()
    prof = Profiler(CudaBackend(rt))
    assert prof.source is None and prof.timing == TIMING_EMU
    assert not C.available(CudaBackend(rt))
    gpu_like = CudaBackend(rt)
    gpu_like.rt = SimpleNamespace(name="cupy", on_gpu=True)
    prof = Profiler(gpu_like, activity_source=None)
    assert prof.timing.startswith("CUDA events around each launch (fallback")


def test_cupti_source_calls_cupti_python_by_its_names(monkeypatch):
    calls = []

    def record(name):
        def f(*args):
            calls.append((name, args))
            return 123
        return f

    enum = SimpleNamespace
    fake = types.ModuleType("cupti.cupti")
    fake.ActivityKind = enum(CONCURRENT_KERNEL=10, MEMCPY=1, MEMSET=2, RUNTIME=5, DRIVER=4,
                             EXTERNAL_CORRELATION=39)
    fake.ExternalCorrelationKind = enum(CUSTOM0=3)
    fake.CallbackDomain = enum(DRIVER_API=1, RUNTIME_API=2)
    for name in ("activity_register_callbacks", "activity_enable", "activity_disable",
                 "get_timestamp", "activity_push_external_correlation_id",
                 "activity_pop_external_correlation_id", "activity_flush_all"):
        setattr(fake, name, record(name))
    fake.get_callback_name = lambda domain, cbid: f"api{domain}.{cbid}"
    package = types.ModuleType("cupti")
    package.cupti = fake
    monkeypatch.setitem(sys.modules, "cupti", package)
    monkeypatch.setitem(sys.modules, "cupti.cupti", fake)
    src = C.CuptiSource()
    src.start()
    assert [args[0] for name, args in calls if name == "activity_enable"] == [10, 1, 2, 5, 4, 39]
    requested, completed = next(args for name, args in calls
                                if name == "activity_register_callbacks")
    assert requested() == (C.BUFFER_BYTES, 0)
    completed([SimpleNamespace(kind=5, cbid=3, start=1, end=2, correlation_id=9, thread_id=1)])
    src.push(41)
    src.pop()
    assert src.now() == 123
    got = src.stop()
    assert ("activity_push_external_correlation_id", (3, 41)) in calls
    assert (("activity_flush_all", (1,)) in calls
            and [n for n, _ in calls].count("activity_disable") == 6)
    assert C.parse(got, src.api_name)["api"][0]["name"] == "api2.3"


def test_the_installed_cupti_python_has_the_calls_we_make():
    cupti = pytest.importorskip("cupti.cupti")
    for name in ("activity_register_callbacks", "activity_enable", "activity_disable",
                 "get_timestamp", "activity_push_external_correlation_id",
                 "activity_pop_external_correlation_id", "activity_flush_all", "get_callback_name"):
        assert hasattr(cupti, name), name
    assert int(cupti.ActivityKind.CONCURRENT_KERNEL) == C.KIND_CONCURRENT_KERNEL
    assert int(cupti.ActivityKind.EXTERNAL_CORRELATION) == C.KIND_EXTERNAL_CORRELATION
    assert int(cupti.ExternalCorrelationKind.CUSTOM0) == C.EXTERNAL_KIND_CUSTOM0
    for cls, attrs in (("ActivityKernel9",
                        ("name", "start", "end", "correlation_id", "grid_x", "block_z")),
                       ("ActivityMemcpy5", ("copy_kind", "bytes", "correlation_id")),
                       ("ActivityMemset4", ("bytes", "correlation_id")),
                       ("ActivityAPI", ("cbid", "thread_id", "correlation_id")),
                       ("ActivityExternalCorrelation", ("external_id", "correlation_id"))):
        assert all(hasattr(getattr(cupti, cls), a) for a in attrs), cls
