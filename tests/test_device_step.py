"""The device step (issues 13 and 14): a CUDA training step makes no host sync, and replaying it as
a captured CUDA graph gives bitwise the eager step. On the emulator: EmuRuntime lists every host
sync (to_host, synchronize, an event wait) and records/replays graphs."""
import math

import numpy as np
import pytest

from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_emu import EmuRuntime
from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.config import GPT2Config
from gpt2np.model import GPT2, STATS, STEP_SCALARS
from gpt2np.tensors import param_shapes, views
from gpt2np.train_step import AdamW, NonFiniteError, PendingStep, StepResult, train_step

CFG = GPT2Config(max_seq_len=8, vocab_size=37, padded_vocab_size=64, num_layers=2, num_heads=2,
                 channels=16)
B, T = 2, 5
ADAMW = AdamW(weight_decay=0.1, grad_clip=1.0)
REF = NumpyBackend(threads=1)


def emu():
    be = CudaBackend(EmuRuntime())
    be.elementwise_threads = 64
    be.reduce_rows_per_chunk = 4
    return be


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (n, B, T + 1)).astype(np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def feeder(items):
    it = iter(items)
    return lambda: next(it)


def state(model):
    be = model.backend
    return [be.to_host(a).tobytes() for a in (model.params, model.m, model.v)]


def host_values(model):
    """The model's plain host-side values (no buffers): what a step could leave on the host."""
    return {name: value for name, value in vars(model).items()
            if isinstance(value, (bool, int, float, str, tuple, type(None)))}


def test_a_device_step_makes_no_host_sync():
    model = GPT2(CFG, emu(), B, T, seed=0)
    rt = model.backend.rt
    data = batches(8)
    train_step(model, feeder(data[:2]), step=0, lr=1e-3, accum_steps=2, adamw=ADAMW)   # warm-up
    for step, graphs in ((1, False), (2, True), (3, True), (4, True)):
        rt.syncs.clear()
        result = train_step(model, feeder(data[2 * (step - 1):][:2]), step=step, lr=1e-3,
                            accum_steps=2, adamw=ADAMW, cuda_graphs=graphs)
        assert rt.syncs == [], (step, rt.syncs)
        assert isinstance(result, PendingStep)
        loss, norm = result                         # reading it is the one wait, after the step
        assert [s["kind"] for s in rt.syncs] == ["event_wait"]
        assert math.isfinite(loss) and norm > 0


@pytest.mark.parametrize("accum", [1, 3])
def test_graph_replay_is_bitwise_the_eager_step(accum):
    eager, graphed = GPT2(CFG, emu(), B, T, seed=1), GPT2(CFG, emu(), B, T, seed=1)
    steps = 5
    data = batches(steps * accum, seed=accum)
    lrs = [1e-3, 3e-3, 2e-4, 5e-3, 1e-3]
    launches = []
    for step in range(steps):
        part = data[step * accum:(step + 1) * accum]
        a = train_step(eager, feeder(part), step=step, lr=lrs[step], accum_steps=accum, adamw=ADAMW)
        before = graphed.backend.rt.graph_launches
        b = train_step(graphed, feeder(part), step=step, lr=lrs[step], accum_steps=accum,
                       adamw=ADAMW, cuda_graphs=True)
        launches.append(graphed.backend.rt.graph_launches - before)
        assert tuple(a) == tuple(b), step
        assert state(eager) == state(graphed), step
    # eager warm-up, then capture + launch, then replays
    assert launches == [0, 1, 1, 1, 1]
    assert eager.backend.rt.graph_launches == 0


def test_a_replayed_step_leaves_the_model_as_the_eager_step():
    """A replayed step runs none of the model's Python: the model must end as after the eager step.
    A zero_grad() before the step must not land on the gradients the replay wrote, and after the
    replay a further backward must add to them."""
    eager, graphed = GPT2(CFG, emu(), B, T, seed=3), GPT2(CFG, emu(), B, T, seed=3)
    data = batches(5, seed=6)
    for step in range(4):
        for model, graphs in ((eager, False), (graphed, True)):
            model.zero_grad()
            train_step(model, feeder(data[step:step + 1]), step=step, lr=1e-3, adamw=ADAMW,
                       cuda_graphs=graphs)
        assert graphed.backend.rt.graph_launches == max(0, step)
        assert host_values(graphed) == host_values(eager)
        np.testing.assert_array_equal(graphed.backend.to_host(graphed.grads),
                                      eager.backend.to_host(eager.grads))
        assert np.any(eager.backend.to_host(eager.grads))
    x, y = data[4]
    # one more backward accumulates into the step's gradients
    for model in (eager, graphed):
        model.forward(x, y, for_backward=True)
        model.backward()
    np.testing.assert_array_equal(graphed.backend.to_host(graphed.grads),
                                  eager.backend.to_host(eager.grads))


def test_a_step_that_refuses_capture_runs_eagerly_with_one_note(capsys):
    """A library call that refuses stream capture (CuPy's cuBLAS raises NotImplementedError) does
    not stop the run: the capture is ended, the step and every later one of that shape run eagerly,
    bitwise the eager step's."""
    eager, graphed = GPT2(CFG, emu(), B, T, seed=2), GPT2(CFG, emu(), B, T, seed=2)
    rt = graphed.backend.rt
    real_gemm = rt.gemm

    def refusing_gemm(*args, **kwargs):
        if rt._capture is not None:
            raise NotImplementedError("calling cuBLAS API during stream capture is "
                                      "currently unsupported")
        return real_gemm(*args, **kwargs)

    rt.gemm = refusing_gemm
    data = batches(4, seed=5)
    for step in range(4):
        a = train_step(eager, feeder(data[step:step + 1]), step=step, lr=1e-3, adamw=ADAMW)
        b = train_step(graphed, feeder(data[step:step + 1]), step=step, lr=1e-3, adamw=ADAMW,
                       cuda_graphs=True)
        assert tuple(a) == tuple(b), step
        assert state(eager) == state(graphed), step
    assert rt.graph_launches == 0 and rt._capture is None
    notes = [line for line in capsys.readouterr().err.splitlines()
             if "could not be captured" in line]
    assert len(notes) == 1 and "runs eagerly" in notes[0]


def test_nvmath_cublas_takes_cupys_arguments_in_cupys_order():
    """CupyRuntime calls NvmathCublas with CuPy's names and argument lists: nvmath's bindings must
    take the same arguments in the same order (their signatures, types position by position)."""
    import re
    nvmath_cublas = pytest.importorskip("nvmath.bindings.cublas")
    # the package preloads libcublas
    cupy_cublas = pytest.importorskip("cupy_backends.cuda.libs").cublas

    from gpt2np.backends.cuda.runtime_cupy import NvmathCublas

    def types(fn):
        params = re.search(r"\((.*)\)", fn.__doc__.splitlines()[0])[1]
        kinds = [p.strip().rsplit(" ", 1)[0] for p in params.split(",") if p.strip()]
        return ["ptr" if k in ("size_t", "intptr_t") else k for k in kinds]

    adapter = NvmathCublas(nvmath_cublas)
    for name in ("setStream", "setPointerMode", "setMathMode", "sgemm", "sgemmStridedBatched",
                 "gemmEx", "gemmStridedBatchedEx", "destroy"):
        assert types(getattr(adapter, name)) == types(getattr(cupy_cublas, name)), name
    assert (adapter.CUBLAS_OP_N, adapter.CUBLAS_OP_T) == (cupy_cublas.CUBLAS_OP_N,
                                                          cupy_cublas.CUBLAS_OP_T)
    assert adapter.CUBLAS_POINTER_MODE_HOST == cupy_cublas.CUBLAS_POINTER_MODE_HOST


def test_staged_and_host_tokens_run_the_same_forward_and_backward():
    """forward(tokens=stage_batch(...)) is forward(inputs, targets) on uploaded tokens: the same
    dlogits and gradients, bitwise; the loss stays on the device in stats[0] (set, then added)."""
    host, staged = GPT2(CFG, emu(), B, T, seed=4), GPT2(CFG, emu(), B, T, seed=4)
    (x, y), (x2, y2) = batches(2, seed=7)
    losses = []
    for i, (inputs, targets) in enumerate(((x, y), (x2, y2))):
        losses.append(host.forward(inputs, targets, for_backward=True, grad_accum_steps=2))
        host.backward(accumulate=i > 0)
        tokens = staged.stage_batch(i, inputs, targets)
        assert staged.forward(tokens=tokens, for_backward=True, grad_accum_steps=2,
                              device_loss=True, accumulate_loss=i > 0) is None
        dlogits = [m.backend.to_host(m.act["logits"]).tobytes() for m in (host, staged)]
        assert dlogits[0] == dlogits[1]
        staged.backward(tokens, accumulate=i > 0)
        be = host.backend
        assert be.to_host(host.grads).tobytes() == staged.backend.to_host(staged.grads).tobytes()
    assert staged.backend.to_host(staged.stats)[0] == pytest.approx(sum(losses) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="not both"):
        staged.forward(x, y, tokens=tokens)


def test_the_device_step_trains_like_the_host_step():
    host, device = GPT2(CFG, NumpyBackend(threads=1), B, T, seed=2), GPT2(CFG, emu(), B, T, seed=2)
    data = batches(6, seed=5)
    for step in range(3):
        part = data[2 * step:2 * step + 2]
        a = train_step(host, feeder(part), step=step, lr=2e-3, accum_steps=2, adamw=ADAMW)
        b = train_step(device, feeder(part), step=step, lr=2e-3, accum_steps=2, adamw=ADAMW,
                       cuda_graphs=True)
        assert isinstance(a, StepResult)
        assert (b.loss == pytest.approx(a.loss, rel=1e-6)
                and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5))
    np.testing.assert_allclose(device.params_host(), host.params_host(), rtol=0, atol=2e-6)


def adamw_case(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m, v = (rng.standard_normal(n).astype(np.float32) * 0.1,
            rng.random(n).astype(np.float32) * 0.01)
    return p, g, m, v


def scalars(lr, t, wd, beta1=0.9, beta2=0.95):
    """model.set_step_scalars' layout (t's slot 0 here: the fp32 build does not read it;
    no outlier limits)."""
    return np.array([lr / (1.0 - beta1 ** t), 1.0 / math.sqrt(1.0 - beta2 ** t), 1.0 - lr * wd, 0.0,
                     math.inf, math.inf], np.float32)


@pytest.mark.parametrize("norm, clip, decayed",
                         [(3.7, 1.0, True), (0.4, 1.0, False), (3.7, 0.0, True)])
def test_adamw_update_device_is_adamw_update_with_the_host_clip(norm, clip, decayed):
    """Same kernel math: the device kernel with the norm in stats gives bitwise what adamw_update
    gives with the host's clip scale (the formula train_step used before); the NumPy reference of
    the device op is close."""
    be = emu()
    lr, t, wd = 3e-3, 4, 0.1
    p, g, m, v = adamw_case()
    host = [be.from_host(a) for a in (p, g, m, v)]
    device = [be.from_host(a) for a in (p, g, m, v)]
    scale = clip / norm if clip > 0 and norm > clip else 1.0
    be.adamw_update(*host, lr, 0.9, 0.95, 1e-8, wd if decayed else 0.0, t, scale)
    stats = be.from_host(np.array([2.5, norm * norm], np.float32))
    be.adamw_update_device(*device, be.from_host(scalars(lr, t, wd)), stats, 0.9, 0.95, 1e-8,
                           decayed, clip)
    # the host took the norm from the float32 sum of squares, as the device does
    norm32 = math.sqrt(float(np.float32(norm * norm)))
    if clip > 0 and norm > clip:
        host = [be.from_host(a) for a in (p, g, m, v)]
        be.adamw_update(*host, lr, 0.9, 0.95, 1e-8, wd if decayed else 0.0, t, clip / norm32)
    for a, b in zip(host, device):
        assert be.to_host(a).tobytes() == be.to_host(b).tobytes()
    ref = [a.copy() for a in (p, g, m, v)]
    REF.adamw_update_device(*ref, scalars(lr, t, wd), np.array([2.5, norm * norm], np.float32), 0.9,
                            0.95, 1e-8, decayed, clip)
    for a, b in zip(ref, device):
        np.testing.assert_allclose(be.to_host(b), a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [(math.nan, 1.0), (1.0, math.inf), (math.inf, math.nan)])
@pytest.mark.parametrize("backend", ["numpy", "emu"])
def test_adamw_update_device_skips_a_non_finite_step(bad, backend):
    be = REF if backend == "numpy" else emu()
    arrays = [be.from_host(a) for a in adamw_case()]
    before = [be.to_host(a).tobytes() for a in arrays]
    be.adamw_update_device(*arrays, be.from_host(scalars(1e-3, 1, 0.1)),
                           be.from_host(np.array(bad, np.float32)), 0.9, 0.95, 1e-8, True, 1.0)
    assert [be.to_host(a).tobytes() for a in arrays] == before


@pytest.mark.parametrize("n", [1, 10, 33, 3000])
def test_loss_mean_on_the_device(n):
    be = emu()
    losses = np.random.default_rng(n).random(n).astype(np.float32) * 10
    for backend in (be, REF):
        stats = backend.from_host(np.array([7.0, 1.0], np.float32))
        backend.loss_mean(stats, backend.from_host(losses), 2, False)
        backend.loss_mean(stats, backend.from_host(losses[::-1].copy()), 2, True)
        got = backend.to_host(stats)
        assert (got[0] == pytest.approx(float(losses.astype(np.float64).mean()), rel=1e-6)
                and got[1] == 1.0)


def test_encoder_backward_with_uploaded_groups_is_bitwise_the_read_back_one():
    be = emu()
    rng = np.random.default_rng(3)
    Bx, Tx, C, Vp = 3, 7, 8, 16
    tokens = rng.integers(0, 5, (Bx, Tx)).astype(np.int32)             # many repeats
    dout = be.from_host(rng.standard_normal((Bx, Tx, C)).astype(np.float32))
    results = []
    for uploaded in (False, True):
        inp = be.zeros((Bx, Tx), np.int32)
        if uploaded:
            be.upload_tokens(inp, tokens)
        else:
            be.copy_(inp, be.from_host(tokens))
        dwte = be.from_host(np.ones((Vp, C), np.float32))
        dwpe = be.zeros((Tx, C))
        be.rt.syncs.clear()
        be.encoder_backward(dwte, dwpe, dout, inp)
        assert len(be.rt.syncs) == (0 if uploaded else 1)
        results.append(be.to_host(dwte).tobytes())
    assert results[0] == results[1]
    ref = np.ones((Vp, C), np.float32)
    REF.encoder_backward(ref, np.zeros((Tx, C), np.float32), be.to_host(dout), tokens)
    assert np.frombuffer(results[1], np.float32).reshape(Vp, C).tobytes() == ref.tobytes()


def test_a_non_finite_device_step_changes_nothing_and_raises_when_read():
    model = GPT2(CFG, emu(), B, T, seed=3)
    data = batches(2)
    train_step(model, feeder(data[:1]), step=0, lr=1e-3, adamw=ADAMW)
    params = model.params_host()
    views(params, param_shapes(CFG))["lnfw"][:] = 1e30
    model.load_params(params)
    m, v = model.optimizer_state_host()
    result = train_step(model, feeder(data[1:]), step=4, lr=1e-3, adamw=ADAMW, cuda_graphs=True)
    assert model.params_host().tobytes() == params.tobytes()            # not updated
    assert [a.tobytes() for a in model.optimizer_state_host()] == [m.tobytes(), v.tobytes()]
    with pytest.raises(NonFiniteError, match=r"^step 5: the ") as caught:
        _ = result.loss
    assert caught.value.step == 4
    assert model.stats.shape == (STATS,) and model.step_scalars.shape == (STEP_SCALARS,)


# ---- CupyRuntime's asynchronous copies and graph capture, on fakes -------------------------------

class _Pinned(bytearray):
    """alloc_pinned_memory's block: a buffer with its address in .ptr."""

    @property
    def ptr(self):
        import ctypes
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


class _Mem:
    def __init__(self, fake, array):
        self.fake, self.array = fake, array
        self.ptr = array.ctypes.data

    def copy_from_host_async(self, ptr, nbytes, stream):
        import ctypes
        self.fake.log.append(("HtoD", nbytes, stream.ptr))
        ctypes.memmove(self.array.ctypes.data, ptr, nbytes)

    def copy_to_host_async(self, ptr, nbytes, stream):
        import ctypes
        self.fake.log.append(("DtoH", nbytes, stream.ptr))
        ctypes.memmove(ptr, self.array.ctypes.data, nbytes)


class _Array:
    def __init__(self, fake, array):
        self.host, self.data = array, _Mem(fake, array)
        self.dtype, self.shape, self.size, self.nbytes = (array.dtype, array.shape, array.size,
                                                          array.nbytes)


def _async_cupy():
    """FakeCupy plus pinned memory, events, streams with capture, graphs; `log` lists what
    was queued where."""
    from fake_gpu import FakeCupy, FakeStream
    fake = FakeCupy(stream=7)
    fake.log = []

    class Event:
        def __init__(self, disable_timing=False):
            self.done, self.waited = False, 0

        def record(self, stream=None):
            fake.log.append(("record", (stream or fake.stream).ptr))

        def synchronize(self):
            self.waited += 1
            self.done = True

    class Graph:
        def launch(self, stream=None):
            fake.log.append(("graph", stream.ptr))

    class Stream(FakeStream):
        def __init__(self, non_blocking=False):
            super().__init__(99)

        def use(self):
            fake.stream = self

        def wait_event(self, event):
            fake.log.append(("wait", self.ptr))

        def begin_capture(self):
            fake.log.append(("begin_capture", self.ptr))

        def end_capture(self):
            fake.log.append(("end_capture", self.ptr))
            return Graph()

    def record(stream=fake.stream):
        event = Event()
        event.record(stream)
        return event

    fake.stream.record = record
    fake.stream.use = lambda: setattr(fake, "stream", fake_default)
    fake_default = fake.stream
    fake.cuda.alloc_pinned_memory = _Pinned
    fake.cuda.Event = Event
    fake.cuda.Stream = Stream
    fake.cuda.get_current_stream = lambda: fake.stream
    return fake


def test_cupy_runtime_uploads_and_reads_back_asynchronously_and_captures_on_its_own_stream():
    from fake_gpu import FakeCublas

    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    cupy, cublas = _async_cupy(), FakeCublas()
    workspaces = []
    cupy.empty = lambda n, dtype: _Array(cupy, np.zeros(n, dtype))
    rt = CupyRuntime(cupy=cupy, cublas=cublas, set_workspace=lambda *a: workspaces.append(a))
    dst = _Array(cupy, np.zeros(5, np.float32))
    values = np.arange(5, dtype=np.float32)
    rt.upload(dst, values)
    # reusable at once: it was staged in pinned memory
    values[:] = -1
    assert dst.host.tolist() == [0, 1, 2, 3, 4] and cupy.log[:2] == [("HtoD", 20, 7), ("record", 7)]
    readback = rt.read_async(dst)
    assert not readback.done()
    assert readback.result().tolist() == [0, 1, 2, 3, 4] and readback.done()
    rt.begin_capture()
    with pytest.raises(RuntimeError, match="while capturing"):
        rt.upload(dst, values)
    # a GEMM inside the capture: the handle goes to stream 99 ...
    rt._set_stream()
    # ... with our workspace
    assert cublas.of("setStream")[-1][2] == 99 and workspaces[-1][2] > 0
    graph = rt.end_capture()
    assert cupy.stream.ptr == 7                      # the current stream again
    graph.launch()
    assert [e for e in cupy.log if e[0] in ("wait", "begin_capture", "end_capture", "graph")] == [
        ("wait", 99), ("begin_capture", 99), ("end_capture", 99), ("graph", 7)]
