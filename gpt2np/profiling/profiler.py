"""The built-in profiler: every op (NumPy) or kernel, copy and memset (CUDA) of a few
training steps, attributed.

Each launch becomes a report.KernelRecord: which layer launched it, in which direction, the op and
module, shapes, kernel name, grid and block, time, FLOPs and bytes moved; host<->device copies and
memsets become records of kind "memcpy"/"memset" ([CUDA memcpy HtoD], [CUDA memset]) with their
bytes. Besides the records the profiler keeps every range instance (id, parent, host start/end), the
runtime/driver API calls, the collectives of multi-rank runs (views.CommRecord) and the
model's memory by buffer.

Timing, by backend:
  numpy      the CPU clock around each op.
  emulator   the host clock around each emulated launch: CPU times, and every view says so.
  GPU        CUPTI activity records (cupti-python installed): device start/end of every kernel, copy
             and memset, and the API calls, correlated to the launching op by external correlation
             ids. Without CUPTI: CUDA events around each launch (a fallback that perturbs what it
             measures, and the views say so); device start times come from the events' offsets to a
             reference event.

    gpt2np profile -e d12 -b 4 -t 64 --steps 2 [--device cpu|cuda|emu] [--out DIR]
                   [--precision tf32|fp32|bf16] [--views all|NAME,NAME...]
                   # at train.py's precision on the device unless --precision says
    python train.py ... --profile 2          # the same, inside a training run
    gpt2np plan --gpu H100 -e d12 [--measure]  # a roofline plan of a step, no GPU needed (plan.py)
"""
import os
import re
import sys
import threading
import time

import numpy as np

from gpt2np import ranges
from gpt2np.ops.contract import backend_op_cost
from gpt2np.profiling import cpu_roof, cupti
from gpt2np.profiling.gpu_specs import UnknownDeviceError, roofline
from gpt2np.profiling.memory import memory_summary, module_parameters
from gpt2np.profiling.render import views as V
from gpt2np.profiling.render.report import KernelRecord, write_chrome_trace, write_csv, write_json
from gpt2np.train_step import train_step

DIRECTIONS = {"gpt2_forward": "fprop", "gpt2_backward": "bprop",
              "gpt2_calculate_grad_norm": "update", "gpt2_update": "update"}

# a module inside a transformer block: h.l.* (the layer l)
MODULE_LAYER = re.compile(r"(?:transformer\.)?h\.(\d+)(?:\.|$)")

# a kernel whose op cost term belongs to another module than its op
# (encoder_backward's dwpe kernels: wpe)
TERM_MODULES = {("encoder_backward", "dwpe"): "wpe", ("encoder_backward", "dwpe_tail"): "wpe"}

# the CUDA call each Runtime method stands for (API rows when CUPTI does not record the real ones)
API_NAMES = {"launch": "cuLaunchKernel", "gemm": "cublasSgemm_v2",
             "gemm_batched": "cublasSgemmStridedBatched", "gemm_ex": "cublasGemmEx",
             "gemm_batched_ex": "cublasGemmStridedBatchedEx",      # bf16 operands
             "gemm_epilogue": "cublasLtMatmul",
             "from_host": "cudaMemcpyAsync", "to_host": "cudaMemcpy", "copy": "cudaMemcpyAsync",
             "upload": "cudaMemcpyAsync", "read_async": "cudaMemcpyAsync",
             "fill": "cudaMemsetAsync", "zeros": "cudaMalloc", "empty": "cudaMalloc",
             "synchronize": "cudaStreamSynchronize", "event": "cudaEventCreate",
             "compile": "cuModuleLoadData"}

TIMING_CPU = "CPU clock around each NumPy op"
TIMING_EMU = "host clock around each emulated launch"
TIMING_EVENTS = ("CUDA events around each launch (fallback: {why}); the events "
                 "perturb what they time")
TIMING_NONE = "not measured (a plan: nothing ran)"


def attribution(stack, module=None):
    """(direction, layer) of an op from the ranges open around it: the innermost gpt2_* range gives
    the direction (fprop, bprop, update; "other" outside them), a "Layer l" range the
    layer (None outside).
    An op that names its GPT-2 module belongs to that module's layer instead: h.l.* to layer l, any
    other module (wte, wpe, ln_f, lm_head, optimizer) to none. They differ where a fused op computes
    the next module's work: the fused residual + LayerNorm at the end of "Layer l" (llm.c's range
    tree) produces h.{l+1}.ln_1, or ln_f after the last layer, and is counted there, so the
    per-layer and the per-module views agree."""
    direction, layer = "other", None
    for name in stack:
        if name in DIRECTIONS:
            direction = DIRECTIONS[name]
        elif name.startswith("Layer "):
            layer = int(name[6:])
    if module:
        match = MODULE_LAYER.match(module)
        layer = int(match.group(1)) if match else None
    return direction, layer


class RecordingRuntime:
    """The backend's runtime (cuda.runtime.Runtime), wrapped while the profiler is attached: copies
    and memsets become records (with their bytes), each call an API row, each launch's grid and
    block go to the record of the launch. Everything else passes through."""

    def __init__(self, rt, profiler):
        self._rt = rt
        self._prof = profiler

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def _call(self, api, fn, *args):
        return self._prof._api(api, fn, *args)

    def launch(self, function, grid, block, args, shared_mem=0):
        self._prof._set_dims(grid, block)
        return self._call(API_NAMES["launch"], self._rt.launch, function, grid, block, args,
                          shared_mem)

    def gemm(self, *args, **epilogue):
        # Runtime.gemm(transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c,
        # ldc, stride_c, batch): 17 positional arguments, batch last (16: batch
        # left at its default, 1)
        batch = args[16] if len(args) > 16 else epilogue.pop("batch", 1)
        if epilogue and any(v is not None and v != "none" for v in epilogue.values()):
            return self._call(API_NAMES["gemm_epilogue"],
                              lambda *a: self._rt.gemm(*a, **epilogue), *args)
        # C's dtype: bf16 -> GemmEx
        ex = "_ex" if getattr(args[13], "dtype", np.float32) != np.float32 else ""
        call = self._rt.gemm if len(args) > 16 else (lambda *a: self._rt.gemm(*a, batch))
        return self._call(API_NAMES[("gemm_batched" if batch > 1 else "gemm") + ex], call, *args)

    def from_host(self, array):
        return self._prof._transfer("memcpy", "HtoD", int(np.asarray(array).nbytes),
                                    API_NAMES["from_host"], lambda: self._rt.from_host(array))

    def to_host(self, array):
        return self._prof._transfer("memcpy", "DtoH", _nbytes(array), API_NAMES["to_host"],
                                    lambda: self._rt.to_host(array))

    def upload(self, dst, array):
        return self._prof._transfer("memcpy", "HtoD", _nbytes(dst), API_NAMES["upload"],
                                    lambda: self._rt.upload(dst, array))

    def read_async(self, array):
        return self._prof._transfer("memcpy", "DtoH", _nbytes(array), API_NAMES["read_async"],
                                    lambda: self._rt.read_async(array))

    def copy(self, dst, src):
        return self._prof._transfer("memcpy", "DtoD", _nbytes(dst), API_NAMES["copy"],
                                    lambda: self._rt.copy(dst, src))

    def fill(self, array, value):
        return self._prof._transfer("memset", None, _nbytes(array), API_NAMES["fill"],
                                    lambda: self._rt.fill(array, value))

    def zeros(self, shape, dtype):
        return self._call(API_NAMES["zeros"], self._rt.zeros, shape, dtype)

    def empty(self, shape, dtype):
        return self._call(API_NAMES["empty"], self._rt.empty, shape, dtype)

    def synchronize(self):
        return self._call(API_NAMES["synchronize"], self._rt.synchronize)


def _nbytes(array) -> int:
    return int(array.size) * int(array.dtype.itemsize)


class Profiler:
    """Records every op (NumPy) or kernel launch, copy and memset (CUDA) on `backend` while attached
    (`with Profiler(be, model=model):`); `records`, `range_instances`, `api`, `comms` and `memory`
    hold the results, `profile()` bundles them (views.Profile).

    It attaches through hooks only: the range stack (ranges.add_listener: the model opens one range
    per op carrying its module and arguments, "Train step N", "gpt2_forward", "Layer l" around them;
    the dist module's collectives carry a ranges.Collective), the backend's launch hook
    (backend.on_launch) and, on the CUDA backend, its runtime (wrapped in a RecordingRuntime). Each
    op is costed once by the contract's formula, as the backend runs it (contract.backend_op_cost);
    each kernel record carries the term of that cost its kernel names, so the kernels of an
    op add up to the op.

    activity_source: "auto" (CUPTI where cupti-python and a GPU are there), None (never), or an
    object with start/now/push/pop/stop/api_name like cupti.CuptiSource (tests pass a fake one).
    measure: False plans instead (gpt2np.profiling.plan): every launch, copy and memset is recorded,
    attributed and costed as usual, nothing is timed (no events, no CUPTI; durations 0) and no
    memory peak is measured.
    """

    def __init__(self, backend, model=None, activity_source="auto", measure=True):
        self.backend = backend
        self.model = model
        self.measure = bool(measure)
        self.records, self.ranges, self.range_instances = [], [], []
        self.api, self.comms = [], []
        self.memory = None
        self.step = None
        self._open = []                           # (name, start, detail, instance id)
        # (direction, layer, op, module, Cost) of the op running
        self._op = None
        self._pending = []                        # (record, start event, end event)
        # the record of the launch in progress (grid/block go there)
        self._launch_record = None
        self._in_api = False
        self._next_range = 0
        self._rt = None
        self._ref = None                          # (reference event, host ns at it)
        self._thread = threading.get_ident()
        self.source, self.timing = None, TIMING_CPU
        # CUPTI records the device had not finished (left out)
        self.incomplete = 0
        self._choose_timing(activity_source)
        self._t0 = time.perf_counter_ns()

    def _choose_timing(self, activity_source):
        be = self.backend
        if not self.measure:
            self.timing = TIMING_NONE
            return
        if not be.launches_kernels:
            return
        why = "CUPTI not requested"
        if activity_source == "auto":
            why = "cupti-python is not installed" if be.on_gpu else "no GPU"
            activity_source = None
            if cupti.available(be):
                try:
                    activity_source = cupti.CuptiSource()
                except cupti.CuptiUnavailable as e:
                    why = str(e)
        if activity_source is not None:
            self.source, self.timing = activity_source, activity_source.timing
        elif not be.on_gpu:
            self.timing = TIMING_EMU
        else:
            self.timing = TIMING_EVENTS.format(why=why)

    @property
    def emulated(self) -> bool:
        """Whether the kernels ran on the CPU emulator, timed by the host clock (a plan runs
        none)."""
        return self.timing == TIMING_EMU

    # ---- attach ---------------------------------------------------------------------------
    def __enter__(self):
        be = self.backend
        if self.source is not None:
            try:
                self.source.start()
            except RuntimeError as e:
                # CuptiUnavailable: fall back to events, and say why
                self.source = None
                self.timing = TIMING_EVENTS.format(why=str(e))
        ranges.add_listener(self)
        if be.launches_kernels:
            be.on_launch = self._on_launch
            if hasattr(be, "rt"):
                self._rt = be.rt
                be.rt = RecordingRuntime(self._rt, self)
                if self.source is None and self.measure:
                    ref = self._rt.event()
                    ref.record()
                    self._ref = (ref, self._now())
        return self

    def __exit__(self, *exc):
        ranges.remove_listener(self)
        be = self.backend
        if be.launches_kernels:
            be.on_launch = None
            if self._rt is not None:
                be.rt = self._rt
        self.resolve()
        if self.model is not None:
            self.memory = memory_summary(self.model, None if self.measure
                                         else {"bytes": None, "what": TIMING_NONE})
        return False

    def _now(self):
        if self.source is not None:
            return self.source.now()
        return time.perf_counter_ns() - self._t0

    # ---- ranges.listener ------------------------------------------------------------------
    def on_push(self, name, detail):
        if name.startswith("Train step "):
            self.step = int(name.rsplit(" ", 1)[1])
        now = self._now()
        rid = self._next_range
        self._next_range += 1
        self._open.append((name, now, detail, rid))
        # an op: the model passes (module, arguments, keywords)
        if isinstance(detail, tuple):
            module, args, keywords = detail
            direction, layer = attribution(ranges.current_stack(), module)
            self._op = (direction, layer, name, module,
                        backend_op_cost(self.backend, name, args, keywords))

    def on_pop(self, name):
        if not self._open:
            return
        opened, start, detail, rid = self._open[-1]
        end = self._now()
        if isinstance(detail, ranges.Collective):
            self.comms.append(V.CommRecord(len(self.comms), self.step, opened,
                                           detail.op, int(detail.nbytes),
                                           int(detail.ranks), start, end - start))
        elif isinstance(detail, tuple) and self._op is not None:
            # the op is the unit: one record, its whole cost
            if not self.backend.launches_kernels:
                cost = self._op[4]
                self._add(f"numpy.{opened}", start, end - start, cost.flops, cost.bytes)
            self._op = None
        self._open.pop()
        self.ranges.append((opened, start, end))
        parent = self._open[-1][3] if self._open else None
        self.range_instances.append(V.RangeInstance(rid, opened, parent, len(self._open), start,
                                                    end, self.step))

    # ---- launches, copies, API calls --------------------------------------------------------
    def _on_launch(self, kernel, kind, term, run):
        """The backend's launch hook: one kernel or GEMM; it carries `term` of its op's cost (none
        for helper kernels such as the finishing stage of a reduction)."""
        flops, nbytes = (0, 0)
        if term is not None and self._op is not None:
            flops, nbytes = self._op[4].terms[term]
        if kind == "gemm":
            name = (f"{'cublasGemmEx' if self.backend.dtype != np.float32 else 'cublasSgemm'} "
                    f"({kernel})")
        else:
            name = kernel
        record = self._add(name, self._now(), 0, flops, nbytes)
        if self._op is not None and (self._op[2], term) in TERM_MODULES:
            record.module = TERM_MODULES[(self._op[2], term)]
        self._launch_record = record
        try:
            self._timed(record, run)
        finally:
            self._launch_record = None

    def _timed(self, record, run):
        """Run one activity: under CUPTI inside its external correlation id, else between two events
        (a plan: just run it)."""
        if not self.measure:
            return run()
        if self.source is not None:
            self.source.push(record.idx)
            try:
                return run()
            finally:
                self.source.pop()
        start, end = self._rt.event(), self._rt.event()
        start.record()
        result = run()
        end.record()
        self._pending.append((record, start, end))
        return result

    def _transfer(self, kind, direction, nbytes, api, run):
        """A copy (direction HtoD, DtoH, DtoD) or memset issued through the runtime: a
        record with its bytes."""
        if self._in_api or threading.get_ident() != self._thread:
            return run()
        name = f"[CUDA memcpy {direction}]" if kind == "memcpy" else "[CUDA memset]"
        record = self._add(name, self._now(), 0, 0, nbytes, kind=kind)
        return self._timed(record, lambda: self._api(api, run, record=record))

    def _api(self, name, fn, *args, record=None):
        """One runtime call, timed on the host as an API row (CUPTI's own API
        records replace these)."""
        if self._in_api or self.source is not None:
            return fn(*args)
        self._in_api = True
        start = self._now()
        try:
            return fn(*args)
        finally:
            self._in_api = False
            owner = record if record is not None else self._launch_record
            self.api.append(V.ApiCall(name, start, self._now() - start,
                                      None if owner is None else owner.idx, self._thread))

    def _set_dims(self, grid, block):
        if self._launch_record is not None:
            self._launch_record.grid = _dims(grid)
            self._launch_record.block = _dims(block)

    def _add(self, kernel, start_ns, duration_ns, flops, nbytes, kind="kernel"):
        stack = tuple(ranges.current_stack())
        # outside any op (a copy, say): the ranges still tell
        if self._op is None:
            direction, layer = attribution(stack)
            op, module, cost = "", "", None
        else:
            direction, layer, op, module, cost = self._op
        ids = tuple(rid for *_, rid in self._open)
        ids = (-1,) * (len(stack) - len(ids)) + ids[-len(stack):] if stack else ()
        record = KernelRecord(idx=len(self.records), step=self.step, direction=direction,
                              layer=-1 if layer is None else layer, op=op, module=module,
                              params=cost.params if cost else "", kernel=kernel,
                              start_ns=int(start_ns),
                              duration_ns=int(duration_ns), flops=int(flops), bytes=int(nbytes),
                              range_stack=stack, kind=kind, range_ids=ids)
        self.records.append(record)
        return record

    # ---- results --------------------------------------------------------------------------
    def resolve(self):
        """Turn pending event pairs (or CUPTI's records) into device times (synchronizes once)."""
        if self.source is not None:
            # the step returns before the device is done, and CUPTI's final (forced) flush hands
            # over the records of unfinished work with start = end = 0: wait for the device first
            try:
                self.backend.synchronize()
            finally:
                activities = self.source.stop()
            self._merge_cupti(activities)
            if self.incomplete:
                print(f"note: {V.incomplete_note(self.incomplete)}", file=sys.stderr)
            return
        if not self._pending:
            return
        self._rt.synchronize()
        ref, ref_host = self._ref if self._ref is not None else (None, 0)
        for record, start, end in self._pending:
            record.duration_ns = int(self._rt.elapsed_ms(start, end) * 1e6)
            # device start: the event's offset to the reference event
            if ref is not None:
                record.start_ns = int(ref_host + self._rt.elapsed_ms(ref, start) * 1e6)
        self._pending.clear()

    def _merge_cupti(self, activities):
        """Device times, real kernel names and grids from CUPTI; activities CUPTI saw that no record
        issued (a library's extra kernels, say) become records of the op that was running. An
        incomplete activity (start 0 or end before start: unfinished at the flush) is counted in
        self.incomplete and left out, with the record it was to fill: no view shows it as
        a kernel of 0 ns."""
        acts = cupti.parse(activities, getattr(self.source, "api_name", None))
        external = acts["external"]
        filled = set()
        # idx of records whose activity came back incomplete
        unfinished = set()
        extras = {}                                # record idx -> records to insert after it
        orphans = []

        def place(act, kind, name, nbytes=0):
            idx = external.get(act["correlation"])
            if not cupti.complete(act):
                self.incomplete += 1
                unfinished.add(idx)
                return
            owner = self.records[idx] if idx is not None and idx < len(self.records) else None
            if owner is not None and owner.idx not in filled and owner.kind == kind:
                filled.add(owner.idx)
                record = owner
                if kind == "kernel":
                    record.kernel = name
            else:
                record = KernelRecord(idx=-1, step=owner.step if owner else None,
                                      direction=owner.direction if owner else "other",
                                      layer=owner.layer if owner else -1,
                                      op=owner.op if owner else "",
                                      module=owner.module if owner else "", params="", kernel=name,
                                      start_ns=0, duration_ns=0, bytes=nbytes,
                                      range_stack=owner.range_stack if owner else (), kind=kind,
                                      range_ids=owner.range_ids if owner else ())
                (extras.setdefault(owner.idx, []) if owner else orphans).append(record)
            record.start_ns, record.duration_ns = act["start"], act["end"] - act["start"]
            if kind == "kernel":
                record.grid, record.block = act["grid"], act["block"]
            elif nbytes:
                record.bytes = nbytes

        for act in acts["kernels"]:
            place(act, "kernel", act["name"])
        for act in acts["memcpy"]:
            place(act, "memcpy", f"[CUDA memcpy {act['direction']}]", act["bytes"])
        for act in acts["memset"]:
            place(act, "memset", "[CUDA memset]", act["bytes"])
        dropped = unfinished - filled
        merged = []
        for r in self.records:
            if r.idx not in dropped:
                merged.append(r)
            merged.extend(extras.get(r.idx, ()))
        merged.extend(sorted(orphans, key=lambda r: r.start_ns))
        for i, r in enumerate(merged):
            r.idx = i
        old_to_new = {id(r): r.idx for r in merged}
        by_old = {old: old_to_new[id(r)] for old, r in enumerate(self.records)
                  if id(r) in old_to_new}
        self.records = merged
        self.api = [V.ApiCall(a["name"], a["start"], a["end"] - a["start"],
                              by_old.get(external.get(a["correlation"])), a["thread"])
                    for a in acts["api"]]

    def meta(self) -> dict:
        be = self.backend
        meta = {"device": device_label(be), "backend": be.name, "timing": self.timing,
                "runtime": getattr(getattr(be, "rt", None), "name", None),
                "emulated": self.emulated, "precision": getattr(be, "precision", "fp32")}
        if getattr(be, "math", None):
            meta["cpu_math"] = be.math                  # the numpy backend's --cpu-math, as it ran
        if self.incomplete:
            meta["incomplete_records"] = self.incomplete
        if self.model is not None:
            meta["num_layers"] = self.model.cfg.num_layers
            meta["module_params"] = module_parameters(self.model.cfg)
        return meta

    def profile(self) -> "V.Profile":
        """Everything recorded, as one views.Profile."""
        return V.Profile(self.records, self.range_instances, self.api, self.comms, self.memory,
                         self.meta())


def _dims(dims) -> str:
    dims = tuple(int(d) for d in dims) + (1,) * (3 - len(tuple(dims)))
    return "(" + ",".join(map(str, dims[:3])) + ")"


def device_label(backend):
    """The backend's device: "cpu" or the GPU's name."""
    return backend.device_name()


def device_roofline(backend):
    """The GPU's roofline (fp32 kernels, GEMMs at the backend's precision; None on GPUs gpu_specs
    does not know); on the CPU (numpy backend) the one measured now (cpu_roof: GEMM rate and
    bandwidth). The emulator's device is gpu_specs' "cpu", which knows no peaks."""
    if not backend.launches_kernels:
        return cpu_roof.measure(backend.threads)
    try:
        return roofline(device_label(backend), "fp32", matmul_precision=backend.precision)
    except UnknownDeviceError:
        return None


def bounding_roof(profiler, roof):
    """The roof the views hold the profiler's records against: a GPU's datasheet peaks as they
    are; the CPU's measured roof raised where a record ran faster (cpu_roof.covering), so that no
    record shows above 100% of it."""
    if roof is None or profiler.backend.launches_kernels:
        return roof
    return cpu_roof.covering(roof, profiler.records)


def write_outputs(profiler, out_dir, roof=None, title=""):
    """CSV, JSON, Chrome trace, PNG plots and one CSV per view of the records in out_dir;
    returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    profile = profiler.profile()
    roof = bounding_roof(profiler, roof)
    paths = {k: os.path.join(out_dir, f"profile.{k}") for k in ("csv", "json", "trace.json")}
    write_csv(profile.records, paths["csv"], roof)
    write_json(profile.records, paths["json"], roof, profile.meta, V.profile_doc(profile))
    write_chrome_trace(profile.records, paths["trace.json"], V.trace_ranges(profile),
                       extra_events=V.trace_extra_events(profile))
    paths.update(V.write_view_files(profile, roof, out_dir))
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    paths.update(V.write_plots(profile, roof, out_dir, title=title or "Time by op and direction",
                               log=log))
    return paths


def report_text(profiler, roof=None, views=None, step="last"):
    """The text report of a profiler's records: the views named (default views.DEFAULT_VIEWS)."""
    roof = bounding_roof(profiler, roof)
    return V.render_views(profiler.profile(), roof, views or V.DEFAULT_VIEWS, step=step)


def profile_steps(model, batches, steps, lr=1e-4, activity_source="auto"):
    """Run `steps` training steps (train_step, batches in turn) under the profiler, after one
    unprofiled warm-up step (step 0)."""
    def step(i):
        train_step(model, lambda: batches[i % len(batches)], step=i, lr=lr)

    step(0)
    with Profiler(model.backend, model=model, activity_source=activity_source) as prof:
        for i in range(1, steps + 1):
            step(i)
    return prof
