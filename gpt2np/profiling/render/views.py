"""The views of a profile that users know from nvprof, nsys stats, PyProf and the PyTorch profiler.

A Profile is everything the built-in profiler recorded: activity records (report.KernelRecord:
kernels, copies, memsets), range instances (with their parent and host times), API calls,
collectives and the model's memory. Each view turns it into one or more Tables (title, columns,
rows), printed as text and written as CSV and JSON:

    model                 parameters by tensor, memory by buffer (MiB), the largest activations, the
                          peak
    modules               GPT-2 module tree: parameters and time per module (fwd, bwd, update)
    phases                the split into forward / backward / optimizer / communication
    gpu_activities        nvprof's "GPU activities": Time(%), Time, Calls, Avg, Min, Max, Name,
                          copies included
    api_calls             nvprof's "API calls"
    nvtx_sum, cuda_gpu_kern_sum, cuda_gpu_mem_time_sum, cuda_gpu_mem_size_sum, cuda_api_sum,
    nvtx_kern_sum         the `nsys stats` reports of the same names
    user_ranges           the PyTorch profiler's table of user ranges (train_step-N, forward,
                          backward, optimizer): Self/Total CPU and CUDA, calls
    pyprof                PyProf's kernel table plus grid, block, tensor cores, roofline floor, % of
                          roofline
    comm                  collectives of multi-rank runs: bytes, time, algorithm and bus bandwidth
    kernels, layers, ops, top_kernels     report.py's kernel table, per-layer / per-op totals, top
                                          kernels

Every title line of an emulated run says that it was emulated on the CPU (report.EMULATED_NOTE),
every title line of a numpy-backend run that its times are CPU times (report.NUMPY_NOTE).
"""
import bisect
import csv
import io
import json
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Dict, List, Optional, Tuple

from gpt2np.profiling.render.report import (
    SUMMARY_COLUMNS,
    KernelRecord,
    ReportError,
    classify,
    duration_stats,
    fields_problem,
    format_table,
    kernel_rows,
    kernel_summary_rows,
    kernels_only,
    label,
    layer_rows,
    load_json_doc,
    module_tree_rows,
    op_rows,
    profile_note,
    read_json,
    summary_rows,
    us,
    write_file,
    write_png,
)

MiB = 1024 * 1024


@dataclass
class RangeInstance:
    """One range as it ran: id (unique in the profile), name, parent id (None at the top), depth,
    host start/end (ns), the training step in effect when it closed, and NVTX's style: PushPop
    (nested, ours) or StartEnd (an nsys import's start/end ranges)."""
    id: int
    name: str
    parent: Optional[int]
    depth: int
    start_ns: int
    end_ns: int
    step: Optional[int] = None
    style: str = "PushPop"

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass
class ApiCall:
    """One runtime/driver API call: name, host start and duration, the record (idx) of the activity
    it issued (None for calls that issue none), the calling thread."""
    name: str
    start_ns: int
    duration_ns: int
    record: Optional[int] = None
    thread: Optional[int] = None


@dataclass
class CommRecord:
    """One collective: the range around it (allreduce_grads...), the collective, bytes of the
    buffer, the ranks, host start and duration (the call returns when the
    collective has finished)."""
    idx: int
    step: Optional[int]
    name: str
    collective: str
    bytes: int
    ranks: int
    start_ns: int
    duration_ns: int

    @property
    def algbw(self) -> Optional[float]:
        """Algorithm bandwidth in bytes/s: size / time (as nccl-tests)."""
        return self.bytes / (self.duration_ns * 1e-9) if self.duration_ns > 0 else None

    @property
    def busbw(self) -> Optional[float]:
        """Bus bandwidth in bytes/s, nccl-tests' factor: all-reduce 2(n-1)/n, reduce-scatter and
        all-gather (n-1)/n, broadcast 1."""
        alg = self.algbw
        if alg is None:
            return None
        n = max(self.ranks, 1)
        factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
                  "all_gather": (n - 1) / n}.get(self.collective, 1.0)
        return alg * factor


@dataclass
class Profile:
    records: List[KernelRecord]
    ranges: List[RangeInstance] = field(default_factory=list)
    api: List[ApiCall] = field(default_factory=list)
    comms: List[CommRecord] = field(default_factory=list)
    memory: Optional[dict] = None
    meta: Dict = field(default_factory=dict)

    @property
    def note(self) -> Optional[str]:
        return profile_note(self.meta)

    @property
    def on_device(self) -> bool:
        return self.meta.get("backend", "cuda") == "cuda"


@dataclass
class Table:
    title: str
    columns: List[Tuple[str, str]]          # (header, 'l' or 'r')
    rows: List[list]
    footer: str = ""

    def text(self, note=None) -> str:
        body = (format_table(self.columns, self.rows, self.title) if self.rows
                else f"{self.title}\n  (none)")
        return label(body, note) + (f"\n{self.footer}" if self.footer else "")


# ---------------------------------------------------------------------------------------------
# selecting one step

def _step_of(profile: Profile, step):
    if step is None:
        return None
    if step == "last":
        steps = [r.step for r in profile.records if r.step is not None]
        steps += [r.step for r in profile.ranges if r.step is not None]
        return max(steps) if steps else None
    return step


def select(profile: Profile, step) -> Profile:
    """The part of the profile that belongs to one step (None: all; 'last': the highest)."""
    n = _step_of(profile, step)
    if n is None:
        return profile
    recs = [r for r in profile.records if r.step == n]
    rngs = [r for r in profile.ranges if r.step == n]
    keep = {r.idx for r in recs}
    span = [(r.start_ns, r.end_ns) for r in rngs if r.name == f"Train step {n}"]
    api = [a for a in profile.api if (a.record in keep) if a.record is not None]
    api += [a for a in profile.api
            if a.record is None and any(s <= a.start_ns <= e for s, e in span)]
    comms = [c for c in profile.comms if c.step == n]
    return Profile(recs, rngs, sorted(api, key=lambda a: a.start_ns), comms, profile.memory,
                   profile.meta)


# ---------------------------------------------------------------------------------------------
# formatting

def nvprof_time(ns: float) -> str:
    """nvprof's time cells: 4.9106s, 2.2224ms, 398.93us, 640ns (five significant digits)."""
    for scale, unit in ((1e9, "s"), (1e6, "ms"), (1e3, "us")):
        if abs(ns) >= scale:
            return f"{ns / scale:.5g}{unit}"
    return f"{ns:.5g}ns"


def _n(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _grouped(pairs) -> Dict[str, List[float]]:
    out: Dict[str, List[float]] = {}
    for key, value in pairs:
        out.setdefault(key, []).append(value)
    return out


def _device_word(profile: Profile) -> str:
    return "GPU" if profile.on_device else "CPU"


def _precision(profile: Profile) -> str:
    """A title's ', precision tf32': the precision the profiled run computed in ('' where the
    profile does not know it: an nsys export's precision is the one its roofline assumes)."""
    precision = profile.meta.get("precision")
    return f", precision {precision}" if precision and profile.meta.get("runtime") != "nsys" else ""


def incomplete_note(count: int) -> str:
    """The line saying that `count` CUPTI records came back without device times and are
    not in the views."""
    return (f"{count} CUPTI activity record{'s' if count != 1 else ''} came back incomplete "
            "(unfinished at the flush, "
            f"no device times) and {'are' if count != 1 else 'is'} left out")


def _incomplete_footer(profile: Profile) -> str:
    count = profile.meta.get("incomplete_records")
    return f"note: {incomplete_note(count)}" if count else ""


# ---------------------------------------------------------------------------------------------
# nvprof

def _nvprof_table(title: str, groups: Dict[str, List[float]]) -> Table:
    stats = {name: duration_stats(d) for name, d in groups.items() if d}
    grand = sum(s["total"] for s in stats.values()) or 1
    rows = [[f"{100.0 * s['total'] / grand:.2f}%", nvprof_time(s["total"]), s["instances"],
             nvprof_time(s["avg"]), nvprof_time(s["min"]), nvprof_time(s["max"]), name]
            for name, s in sorted(stats.items(), key=lambda kv: (-kv[1]["total"], kv[0]))]
    columns = [("Time(%)", "r"), ("Time", "r"), ("Calls", "r"), ("Avg", "r"), ("Min", "r"),
               ("Max", "r"), ("Name", "l")]
    return Table(title, columns, rows)


def gpu_activities(profile: Profile, roof=None) -> List[Table]:
    """nvprof's GPU activities: every kernel name, [CUDA memcpy HtoD/DtoH/DtoD]
    and [CUDA memset]."""
    title = ("GPU activities (kernels, copies, memsets)" if profile.on_device
             else "CPU activities (NumPy ops; no device, so no copies)")
    table = _nvprof_table(f"{title}{_precision(profile)}; timing: "
                          f"{profile.meta.get('timing', '?')}",
                          _grouped((r.kernel, r.duration_ns) for r in profile.records))
    table.footer = _incomplete_footer(profile)
    return [table]


def api_calls(profile: Profile, roof=None) -> List[Table]:
    """nvprof's API calls: the runtime/driver calls, host time."""
    if not profile.on_device:
        return [Table("API calls: none (the numpy backend makes no CUDA calls)", [], [])]
    return [_nvprof_table("API calls (host time)",
                          _grouped((a.name, a.duration_ns) for a in profile.api))]


# ---------------------------------------------------------------------------------------------
# nsys stats

def _nsys_table(title, groups, count="Instances", extra=(), name="Name") -> Table:
    """An nsys stats summary (report.summary_rows); extra: (header, cell of the key)
    columns before the name."""
    columns = [(h, a) if h != "Instances" else (count, a) for h, a in SUMMARY_COLUMNS]
    columns += [(h, "l") for h, _ in extra] + [(name, "l")]
    return Table(title, columns, summary_rows(groups, [cell for _, cell in extra]))


def nvtx_sum(profile: Profile, roof=None) -> List[Table]:
    """nsys nvtx_sum: every range name, its instances' host times (PushPop: ranges are nested)."""
    return [_nsys_table("nvtx_sum: NVTX ranges (host time)",
                        _grouped(((r.style, r.name), r.duration_ns) for r in profile.ranges),
                        extra=[("Style", lambda k: k[0])], name="Range")]


def cuda_gpu_kern_sum(profile: Profile, roof=None) -> List[Table]:
    kernels = kernels_only(profile.records)
    table = _nsys_table(f"cuda_gpu_kern_sum: {_device_word(profile)} kernels{_precision(profile)}",
                        _grouped((r.kernel, r.duration_ns) for r in kernels))
    table.footer = _incomplete_footer(profile)
    return [table]


_MEM_ENDS = {"H": "Host", "D": "Device", "A": "Array", "P": "Peer"}


def nsys_mem_name(name: str) -> str:
    """nvprof's row name -> nsys's: "[CUDA memcpy HtoD]" -> "[CUDA memcpy Host-to-Device]" (also
    Unified HtoD, DtoD, PtoP ...); other names unchanged."""
    m = re.fullmatch(r"\[CUDA memcpy (Unified )?([HDAP])to([HDAP])\]", name)
    if not m:
        return name
    return f"[CUDA memcpy {m.group(1) or ''}{_MEM_ENDS[m.group(2)]}-to-{_MEM_ENDS[m.group(3)]}]"


def _mem_records(profile):
    return [r for r in profile.records if r.kind in ("memcpy", "memset")]


def cuda_gpu_mem_time_sum(profile: Profile, roof=None) -> List[Table]:
    groups = _grouped((nsys_mem_name(r.kernel), r.duration_ns) for r in _mem_records(profile))
    return [_nsys_table("cuda_gpu_mem_time_sum: copies and memsets by time", groups, count="Count",
                        name="Operation")]


def cuda_gpu_mem_size_sum(profile: Profile, roof=None) -> List[Table]:
    groups = _grouped((nsys_mem_name(r.kernel), r.bytes / 1e6) for r in _mem_records(profile))
    rows = []
    for op, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        s = duration_stats(sizes)
        rows.append([f"{s['total']:,.3f}", s["instances"], f"{s['avg']:,.3f}", f"{s['med']:,.3f}",
                     f"{s['min']:,.3f}", f"{s['max']:,.3f}", f"{s['stddev']:,.3f}", op])
    columns = [("Total (MB)", "r"), ("Count", "r"), ("Avg (MB)", "r"), ("Med (MB)", "r"),
               ("Min (MB)", "r"), ("Max (MB)", "r"), ("StdDev (MB)", "r"), ("Operation", "l")]
    return [Table("cuda_gpu_mem_size_sum: copies and memsets by size", columns, rows)]


def cuda_api_sum(profile: Profile, roof=None) -> List[Table]:
    if not profile.on_device:
        return [Table("cuda_api_sum: none (the numpy backend makes no CUDA calls)", [], [])]
    return [_nsys_table("cuda_api_sum: CUDA API calls (host time)",
                        _grouped((a.name, a.duration_ns) for a in profile.api), count="Num Calls")]


def nvtx_kern_sum(profile: Profile, roof=None) -> List[Table]:
    """nsys nvtx_kern_sum: device activities grouped by each NVTX range that launched them (a launch
    counts for every range around it), with how many instances of the range and of the kernel."""
    groups: Dict[Tuple[str, str], List[float]] = {}
    instances: Dict[Tuple[str, str], set] = {}
    order: Dict[str, int] = {}
    for r in profile.records:
        ids = (r.range_ids if len(r.range_ids) == len(r.range_stack)
               else (None,) * len(r.range_stack))
        seen = set()
        for name, rid in zip(r.range_stack, ids):
            if name in seen:
                continue
            seen.add(name)
            order.setdefault(name, len(order))
            key = (name, r.kernel)
            groups.setdefault(key, []).append(r.duration_ns)
            instances.setdefault(key, set()).add(rid)
    rows = []
    for (rng, kernel), d in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], -sum(kv[1]))):
        s = duration_stats(d)
        nvtx_inst = len(instances[(rng, kernel)] - {None, -1}) or "-"
        rows.append([rng, "PushPop", nvtx_inst, s["instances"], f"{s['total']:,.0f}", _n(s["avg"]),
                     _n(s["med"]), f"{s['min']:,.0f}", f"{s['max']:,.0f}", _n(s["stddev"]), kernel])
    columns = [("NVTX Range", "l"), ("Style", "l"), ("NVTX Inst", "r"), ("Kern Inst", "r"),
               ("Total Time (ns)", "r"), ("Avg (ns)", "r"), ("Med (ns)", "r"), ("Min (ns)", "r"),
               ("Max (ns)", "r"), ("StdDev (ns)", "r"), ("Kernel Name", "l")]
    return [Table(f"nvtx_kern_sum: {_device_word(profile)} activities by the NVTX range "
                  "that launched them",
                  columns, rows)]


# ---------------------------------------------------------------------------------------------
# the split into forward / backward / optimizer / communication

# (phase, direction, the host ranges of the phase: ours, and llm.c's gpt2_backward_and_reduce)
PHASES = (("forward", "fprop", ("gpt2_forward",)),
          ("backward", "bprop", ("gpt2_backward", "gpt2_backward_and_reduce")),
          ("optimizer", "update", ("gpt2_update", "gpt2_calculate_grad_norm")),
          ("other", "other", ()))


def phases(profile: Profile, roof=None) -> List[Table]:
    """Device time, launches, copies and host time per phase; communication from the collectives."""
    total = sum(r.duration_ns for r in profile.records) + sum(c.duration_ns
                                                              for c in profile.comms) or 1
    rows = []
    for label_, direction, rng in PHASES:
        recs = [r for r in profile.records if r.direction == direction]
        host = sum(r.duration_ns for r in profile.ranges if r.name in rng)
        t = sum(r.duration_ns for r in recs)
        rows.append([label_, us(t), f"{100.0 * t / total:.1f}",
                     sum(r.kind == "kernel" for r in recs), sum(r.kind != "kernel" for r in recs),
                     us(host) if rng else "-"])
    if profile.comms:
        t = sum(c.duration_ns for c in profile.comms)
        rows.append(["communication", us(t), f"{100.0 * t / total:.1f}", len(profile.comms), 0,
                     us(t)])
    columns = [("phase", "l"), (f"{_device_word(profile)} time (us)", "r"), ("%", "r"),
               ("launches", "r"), ("copies+memsets", "r"), ("host range time (us)", "r")]
    return [Table("Phases: forward / backward / optimizer / communication", columns, rows)]


# ---------------------------------------------------------------------------------------------
# the PyTorch profiler's user ranges

TORCH_NAMES = {"gpt2_forward": "forward", "gpt2_backward": "backward", "gpt2_update": "optimizer",
               "gpt2_calculate_grad_norm": "clip-grads", "gpt2_backward_and_reduce": "backward"}


def torch_name(name: str) -> str:
    """Our range names in the PyTorch profiler's spelling: train_step-N, forward,
    backward, optimizer."""
    if name.startswith("Train step "):
        return "train_step-" + name[len("Train step "):]
    return TORCH_NAMES.get(name, name)


def host_time(profile: Profile) -> int:
    """The host time of a selection: its outermost ranges (a step's "Train step N" may sit inside a
    user's own range) and the API calls and collectives outside them (an export without NVTX ranges
    has only those)."""
    ids = {r.id for r in profile.ranges}
    spans = []                                  # the union of the outermost ranges, in time order
    for r in sorted((r for r in profile.ranges if r.parent not in ids), key=lambda r: r.start_ns):
        if spans and r.start_ns <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], r.end_ns)
        else:
            spans.append([r.start_ns, r.end_ns])
    starts = [start for start, _ in spans]

    def outside(start, duration):
        i = bisect.bisect_right(starts, start) - 1
        return i < 0 or start + duration > spans[i][1]

    calls = [(a.start_ns, a.duration_ns) for a in profile.api]
    calls += [(c.start_ns, c.duration_ns) for c in profile.comms]
    return (sum(r.duration_ns for r in profile.ranges if r.parent not in ids)
            + sum(duration for start, duration in calls if outside(start, duration)))


def user_ranges(profile: Profile, roof=None, row_limit: int = 30) -> List[Table]:
    """Name, Self CPU %, Self CPU, CPU total %, CPU total, CPU time avg, Self CUDA, Self CUDA %,
    CUDA total, CUDA time avg, # of Calls: ranges (self = minus child ranges), API
    calls and collectives."""
    children: Dict[int, int] = {}
    for r in profile.ranges:
        if r.parent is not None:
            children[r.parent] = children.get(r.parent, 0) + r.duration_ns
    by_id = {r.id: r for r in profile.ranges}
    dev_self: Dict[int, int] = {}
    dev_total: Dict[int, int] = {}
    for rec in profile.records:
        ids = [i for i in rec.range_ids if i in by_id]
        for i in set(ids):
            dev_total[i] = dev_total.get(i, 0) + rec.duration_ns
        if ids:
            dev_self[ids[-1]] = dev_self.get(ids[-1], 0) + rec.duration_ns
    # name -> [self cpu, cpu total, self dev, dev total, calls]
    rows: Dict[str, list] = {}

    def add(name, self_cpu, cpu, self_dev, dev):
        row = rows.setdefault(name, [0, 0, 0, 0, 0])
        for i, v in enumerate((self_cpu, cpu, self_dev, dev, 1)):
            row[i] += v

    for r in profile.ranges:
        add(torch_name(r.name), r.duration_ns - children.get(r.id, 0), r.duration_ns,
            dev_self.get(r.id, 0), dev_total.get(r.id, 0))
    for a in profile.api:
        add(a.name, a.duration_ns, a.duration_ns, 0, 0)
    for c in profile.comms:
        add(f"nccl:{c.collective}" if profile.on_device else f"mpi:{c.collective}", 0,
            c.duration_ns, 0, 0)
    # at least the largest row: a range nested in one of its own name counts twice in its row
    cpu_all = max([host_time(profile)] + [row[1] for row in rows.values()]) or 1
    dev_all = sum(r.duration_ns for r in profile.records) or 1
    dev = "CUDA" if profile.on_device else "op"
    out = []
    for name, (self_cpu, cpu, self_dev, dev_t,
               calls) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:row_limit]:
        out.append([name, f"{100.0 * self_cpu / cpu_all:.2f}%", nvprof_time(self_cpu),
                    f"{100.0 * cpu / cpu_all:.2f}%",
                    nvprof_time(cpu), nvprof_time(cpu / calls), nvprof_time(self_dev),
                    f"{100.0 * self_dev / dev_all:.2f}%", nvprof_time(dev_t),
                    nvprof_time(dev_t / calls), calls])
    columns = [("Name", "l"), ("Self CPU %", "r"), ("Self CPU", "r"), ("CPU total %", "r"),
               ("CPU total", "r"), ("CPU time avg", "r"), (f"Self {dev}", "r"),
               (f"Self {dev} %", "r"), (f"{dev} total", "r"),
               (f"{dev} time avg", "r"), ("# of Calls", "r")]
    shown = f"top {row_limit} by CPU total" if len(rows) > row_limit else "all"
    return [Table(f"User ranges, PyTorch profiler layout ({shown}; {dev} = {_device_word(profile)} "
                  "activity inside the range)", columns, out)]


# ---------------------------------------------------------------------------------------------
# PyProf's kernel table with the roofline

TENSOR_CORE_MARKERS = ("s1688", "s16816", "h1688", "h16816", "884", "hmma", "tf32", "bf16", "xmma",
                       "gmma", "wgmma", "tensorop")


def tensor_cores(record: KernelRecord, precision: str) -> bool:
    """Whether a launch runs on tensor cores: a GEMM at tf32/bf16/fp16 precision, or a kernel whose
    (CUPTI) name says so."""
    name = record.kernel.lower()
    return ((record.matmul_ceiling and precision in ("tf32", "bf16", "fp16"))
            or any(m in name for m in TENSOR_CORE_MARKERS))


def floor_ns(record: KernelRecord, roof) -> Optional[float]:
    """The roofline's lower bound on the launch's time: max(FLOPs / compute ceiling,
    bytes / bandwidth)."""
    if roof is None or not (record.flops or record.bytes):
        return None
    ceiling = roof.flops_ceiling(record.matmul_ceiling)
    if not ceiling or not roof.peak_bw:
        return None
    return max(record.flops / ceiling, record.bytes / roof.peak_bw) * 1e9


def pyprof(profile: Profile, roof=None) -> List[Table]:
    # the CPU has no tensor cores: its bf16 run computes in fp32 (its matmuls are NumPy's)
    precision = ("fp32" if profile.meta.get("backend") == "numpy"
                 else profile.meta.get("precision", "fp32"))
    rows = []
    for r in sorted(profile.records, key=lambda r: r.idx):
        floor = floor_ns(r, roof)
        pct = 100.0 * floor / r.duration_ns if floor is not None and r.duration_ns > 0 else None
        bound, _ = classify(r.flops, r.bytes, r.duration_ns, roof, r.matmul_ceiling)
        rows.append([r.idx, r.direction, "-" if r.layer_index is None else r.layer_index,
                     r.op or "-", r.module or "-", r.params or "-", r.kernel, r.grid or "-",
                     r.block or "-", "yes" if tensor_cores(r, precision) else "no",
                     us(r.duration_ns), "-" if floor is None else us(floor),
                     "-" if pct is None else f"{pct:.1f}%", bound])
    columns = [("Idx", "r"), ("Direction", "l"), ("Layer", "r"), ("Op", "l"), ("Module", "l"),
               ("Params", "l"), ("Kernel", "l"), ("Grid", "l"), ("Block", "l"), ("TC", "l"),
               ("Time (us)", "r"), ("Floor (us)", "r"), ("% of roofline", "r"), ("Bound", "l")]
    where = (f"against {roof.device}" if roof is not None and roof.peak_bw
             else "no roofline for this device, so no floor")
    return [Table(f"Kernels, PyProf layout ({where}; floor = max(FLOPs/peak, bytes/bandwidth))",
                  columns, rows)]


# ---------------------------------------------------------------------------------------------
# the model: parameters, memory, module tree

def model_summary(profile: Profile, roof=None) -> List[Table]:
    mem = profile.memory
    if not mem:
        return [Table("Model summary: not recorded (the profile was made without the model)",
                      [], [])]
    total = mem["total"] or 1
    rows = [[b["buffer"], f"{b['bytes'] / MiB:,.2f}",
             f"{100.0 * b['bytes'] / total:.1f}", b["what"]]
            for b in mem["buffers"]]
    rows.append(["total", f"{mem['total'] / MiB:,.2f}", "100.0", "the model's buffers"])
    peak = mem.get("peak") or {}
    footer = (f"measured peak: {peak['bytes'] / MiB:,.2f} MiB ({peak['what']})"
              if peak.get("bytes") is not None
              else f"measured peak: unknown ({peak.get('what', 'not measured')})")
    columns = [("buffer", "l"), ("MiB", "r"), ("%", "r"), ("what", "l")]
    params = profile.meta.get("module_params") or {}
    n = sum(params.values())
    tables = [Table(f"Model summary: memory by buffer ({n:,} parameters)", columns, rows, footer)]
    acts = mem.get("activations") or []
    if acts:
        act_total = sum(a["bytes"] for a in acts) or 1
        act_rows = [[a["buffer"], "x".join(map(str, a["shape"])), f"{a['bytes'] / MiB:,.2f}",
                     f"{100.0 * a['bytes'] / act_total:.1f}"] for a in acts[:8]]
        tables.append(Table("Largest activations (kept for the backward pass)",
                            [("activation", "l"), ("shape", "l"), ("MiB", "r"), ("%", "r")],
                            act_rows))
    return tables


def modules(profile: Profile, roof=None) -> List[Table]:
    """The GPT-2 module tree: parameters (lm_head is tied to wte), time per direction, calls."""
    params = profile.meta.get("module_params")
    columns, rows = module_tree_rows(kernels_only(profile.records), profile.meta.get("num_layers"),
                                     params=params or None)
    where = "" if params else " (parameters unknown: the profile was made without the model)"
    # copies and memsets belong to no module: said, so that the tree's total is not
    # taken for the phases' one
    left_out = [r for r in profile.records if r.kind != "kernel"]
    if left_out:
        where += (f" (kernels; {len(left_out)} copies and memsets, "
                  f"{sum(r.duration_ns for r in left_out) / 1e3:,.1f} "
                  f"us, are in gpu_activities and phases)")
    return [Table(f"GPT-2 modules: parameters and time{where}", columns, rows)]


# ---------------------------------------------------------------------------------------------
# communication

def comm(profile: Profile, roof=None) -> List[Table]:
    if not profile.comms:
        if profile.meta.get("runtime") == "nsys":
            return [Table("Communication: not in an nsys export's NVTX and CUDA tables (NCCL "
                          "kernels are op nccl, module comm, in the kernel views)", [], [])]
        return [Table("Communication: none (one process)", [], [])]
    groups: Dict[Tuple[str, str, int, int], List[CommRecord]] = {}
    for c in profile.comms:
        groups.setdefault((c.name, c.collective, c.bytes, c.ranks), []).append(c)
    rows = []
    for (name, coll, nbytes,
         ranks), cs in sorted(groups.items(), key=lambda kv: -sum(c.duration_ns for c in kv[1])):
        t = sum(c.duration_ns for c in cs) / len(cs)
        avg = CommRecord(0, None, name, coll, nbytes, ranks, 0, int(round(t)))
        alg, bus = avg.algbw, avg.busbw
        rows.append([coll, name, ranks, f"{nbytes:,}", len(cs), us(t),
                     "-" if alg is None else f"{alg / 1e9:.4g}",
                     "-" if bus is None else f"{bus / 1e9:.4g}"])
    columns = [("collective", "l"), ("range", "l"), ("ranks", "r"), ("bytes", "r"), ("calls", "r"),
               ("avg time (us)", "r"), ("algbw (GB/s)", "r"), ("busbw (GB/s)", "r")]
    return [Table("Communication (bus bandwidth as nccl-tests: all-reduce algbw*2(n-1)/n, "
                  "reduce-scatter and all-gather algbw*(n-1)/n)", columns, rows)]


# ---------------------------------------------------------------------------------------------
# report.py's tables as views (the same rows as its text report)

def _report_view(rows_of, per_launch=False):
    """per_launch: the table of every launch, whose title says the precision and whose footer the
    launches left out."""
    def view(profile: Profile, roof=None):
        title, columns, rows = rows_of(kernels_only(profile.records), roof)
        if not per_launch:
            return [Table(title, columns, rows)]
        return [Table(title + _precision(profile), columns, rows, _incomplete_footer(profile))]
    return view


VIEWS = {
    "model": model_summary, "modules": modules, "phases": phases,
    "gpu_activities": gpu_activities, "api_calls": api_calls,
    "nvtx_sum": nvtx_sum, "cuda_gpu_kern_sum": cuda_gpu_kern_sum,
    "cuda_gpu_mem_time_sum": cuda_gpu_mem_time_sum, "cuda_gpu_mem_size_sum": cuda_gpu_mem_size_sum,
    "cuda_api_sum": cuda_api_sum, "nvtx_kern_sum": nvtx_kern_sum,
    "user_ranges": user_ranges, "pyprof": pyprof, "comm": comm,
    "kernels": _report_view(lambda recs, roof: kernel_rows(recs, roof), per_launch=True),
    "layers": _report_view(lambda recs, roof: layer_rows(recs)),
    "ops": _report_view(lambda recs, roof: op_rows(recs, roof)),
    "top_kernels": _report_view(lambda recs, roof: kernel_summary_rows(recs, top=15)),}
DEFAULT_VIEWS = ("model", "modules", "phases", "gpu_activities", "api_calls", "ops",
                 "user_ranges", "comm")


def parse_views(text: str) -> Tuple[str, ...]:
    """'all', or comma-separated view names (ReportError naming the unknown ones and the known)."""
    if text.strip() == "all":
        return tuple(VIEWS)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in VIEWS]
    if unknown or not names:
        raise ReportError(f"--views {text!r}: unknown view {', '.join(unknown) or '(none given)'}; "
                          f"known: {', '.join(VIEWS)} or 'all'")
    return names


def tables(profile: Profile, name: str, roof=None) -> List[Table]:
    """The Tables of one view."""
    return VIEWS[name](profile, roof)


def render_views(profile: Profile, roof=None, names=DEFAULT_VIEWS, step="last") -> str:
    """The views named, as text, each title line labelled when the run was emulated."""
    part = select(profile, step)
    note = profile.note
    out = []
    for name in names:
        out.extend(t.text(note) for t in tables(part, name, roof))
    return "\n\n".join(out) + "\n"


def write_view_files(profile: Profile, roof, out_dir: str, step="last") -> Dict[str, str]:
    """views.json (every Table view: title, columns, rows) and one CSV per Table
    (views/<name>.csv)."""
    part = select(profile, step)
    doc, paths = {}, {}
    folder = os.path.join(out_dir, "views")
    os.makedirs(folder, exist_ok=True)
    note = profile.note
    for name in VIEWS:
        result = tables(part, name, roof)
        doc[name] = [{"title": label(t.title, note), "columns": [c for c, _ in t.columns],
                      "rows": t.rows, "footer": t.footer} for t in result]
        for i, t in enumerate(result):
            if not t.columns:
                continue
            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerow([c for c, _ in t.columns])
            writer.writerows(t.rows)
            path = os.path.join(folder, f"{name}{'' if i == 0 else f'_{i}'}.csv")
            write_file(path, buf.getvalue())
    paths["views.json"] = os.path.join(out_dir, "views.json")
    write_file(paths["views.json"], json.dumps({"note": note, "views": doc}, indent=1) + "\n")
    paths["views/"] = folder
    return paths


# ---------------------------------------------------------------------------------------------
# the JSON file and the trace

def profile_doc(profile: Profile) -> dict:
    """The parts of a profile besides records and meta, for report.write_json(extra=...)."""
    return {"ranges": [asdict(r) for r in profile.ranges], "api": [asdict(a) for a in profile.api],
            "comms": [asdict(c) for c in profile.comms], "memory": profile.memory}


# the rows of profile.json besides the records: part -> (row class, field -> kind (report.KINDS));
# times in ns, durations, sizes and counts >= 0 (the views sum and divide them: text would fail deep
# inside, negative ones print)
PARTS = {"ranges": (RangeInstance, {"id": "integer", "name": "text", "parent": "integer?",
                                    "depth": "count", "start_ns": "integer",
                                    "end_ns": "integer", "step": "integer?", "style": "text"}),
         "api": (ApiCall, {"name": "text", "start_ns": "integer", "duration_ns": "count",
                           "record": "integer?", "thread": "integer?"}),
         "comms": (CommRecord, {"idx": "integer", "step": "integer?", "name": "text",
                                "collective": "text", "bytes": "count", "ranks": "count",
                                "start_ns": "integer", "duration_ns": "count"})}
# the memory model_summary reads: its fields, and the fields of the rows of its
# lists and of its peak
MEMORY = {"total": "count", "buffers": "list", "activations": "list?", "peak": "object?"}
MEMORY_ROWS = {"buffers": {"buffer": "text", "bytes": "count", "what": "text"},
               "activations": {"buffer": "text", "shape": "shape", "bytes": "count"}}
PEAK = {"bytes": "count?", "what": "text"}


def _row_problem(part: str, row) -> Optional[str]:
    """What is wrong with one row of `part` (PARTS) of profile.json (None: nothing)."""
    cls, kinds = PARTS[part]
    required = [f.name for f in fields(cls) if f.default is MISSING]
    problem = fields_problem(row, kinds, required, others=False)
    if problem is None and part == "ranges" and row["end_ns"] < row["start_ns"]:
        problem = f"field 'end_ns' ({row['end_ns']}) must be >= its 'start_ns' ({row['start_ns']})"
    return problem


def _memory_problem(mem) -> Optional[str]:
    """What is wrong with profile.json's 'memory' (None: nothing; {}: not recorded, as null)."""
    if not isinstance(mem, dict):
        return f"must be an object or null, got {json.dumps(mem)[:40]}"
    problem = fields_problem(mem, MEMORY, required=("total", "buffers")) if mem else None
    if problem:
        return problem
    for name, kinds in MEMORY_ROWS.items():
        for i, row in enumerate(mem.get(name) or ()):
            problem = fields_problem(row, kinds, required=kinds)
            if problem:
                return f"{name!r} row {i}: {problem}"
    peak = mem.get("peak") or {}
    problem = fields_problem(peak, PEAK, required=() if peak.get("bytes") is None else ("what",))
    return problem and f"'peak': {problem}"


def read_profile(path: str) -> Tuple[Profile, object]:
    """(Profile, roofline) from a profile.json written by the profiler (an ncu records file:
    records only). A row of the wrong shape is a ReportError naming the file, the part, the row
    and the field."""
    doc = load_json_doc(path)
    records, roof, meta = read_json(path, doc)
    parts = {}
    for part, (cls, _) in PARTS.items():
        rows = [] if doc.get(part) is None else doc[part]
        if not isinstance(rows, list):
            raise ReportError(f"{path}: {part!r} must be a list of objects, got "
                              f"{json.dumps(rows)[:40]}")
        for i, row in enumerate(rows):
            problem = _row_problem(part, row)
            if problem:
                raise ReportError(f"{path}: {part!r} row {i}: {problem}")
        parts[part] = [cls(**row) for row in rows]
    problem = None if doc.get("memory") is None else _memory_problem(doc["memory"])
    if problem:
        raise ReportError(f"{path}: 'memory': {problem}")
    return Profile(records, parts["ranges"], parts["api"], parts["comms"], doc.get("memory"),
                   meta), roof


def trace_ranges(profile: Profile):
    return [(r.name, r.start_ns, r.end_ns)
            for r in sorted(profile.ranges, key=lambda r: (r.start_ns, -r.end_ns))]


TRACK_API, TRACK_COMM = 101, 102


def trace_extra_events(profile: Profile) -> List[dict]:
    """API calls and collectives for report.chrome_trace, each kind on its own track."""
    events = []
    if profile.api:
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": TRACK_API,
                       "args": {"name": "CUDA API"}})
    if profile.comms:
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": TRACK_COMM,
                       "args": {"name": "communication"}})
    for a in profile.api:
        events.append({"name": a.name, "cat": "api", "ph": "X", "ts_ns": a.start_ns,
                       "dur": a.duration_ns / 1e3,
                       "pid": 1, "tid": TRACK_API, "args": {"record": a.record}})
    for c in profile.comms:
        events.append({"name": f"{c.collective} ({c.name})", "cat": "comm", "ph": "X",
                       "ts_ns": c.start_ns, "dur": c.duration_ns / 1e3, "pid": 1, "tid": TRACK_COMM,
                       "args": {"bytes": c.bytes, "ranks": c.ranks}})
    return events


# ---------------------------------------------------------------------------------------------
# plots

def write_plots(profile: Profile, roof, out_dir: str, title: str = "", log=print,
                step="last") -> Dict[str, str]:
    """profile.png (time by op and direction), profile_layers.png (time per layer and op) and
    profile_roofline.png (achieved FLOP/s against arithmetic intensity, with the device's ceilings).
    Needs matplotlib (the plot extra); without it one notice and no files."""
    part = select(profile, step)
    kernels = kernels_only(part.records)
    note = f" [{profile.note}]" if profile.note else ""
    paths = {}
    png = os.path.join(out_dir, "profile.png")
    if not write_png(kernels, png, title=title + note, log=log):
        return paths
    paths["png"] = png
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # time per layer, stacked by op
    by_layer: Dict[str, Dict[str, float]] = {}
    for r in kernels:
        key = "-" if r.layer_index is None else str(r.layer_index)
        by_layer.setdefault(key, {}).setdefault(r.op or "(none)", 0.0)
        by_layer[key][r.op or "(none)"] += r.duration_ns / 1e6
    layers = sorted(by_layer, key=lambda k: (k == "-", int(k) if k != "-" else 0))
    ops = sorted({op for d in by_layer.values() for op in d})
    fig = Figure(figsize=(10, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(layers)
    colors = list(colormaps["tab20"].colors) + list(colormaps["tab20b"].colors)
    if len(ops) > len(colors):
        colors = [colormaps["hsv"](i / len(ops)) for i in range(len(ops))]
    for op, color in zip(ops, colors):     # a colour for every op (the default cycle has 10)
        heights = [by_layer[k].get(op, 0.0) for k in layers]
        ax.bar(layers, heights, bottom=bottom, label=op, color=color)
        bottom = [a + b for a, b in zip(bottom, heights)]
    ax.set_xlabel("layer ('-': outside the blocks)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"Time per layer and op{note}")
    ax.legend(fontsize=8, ncol=1 + len(ops) // 25, title="op", loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)        # beside the bars, not over them
    fig.tight_layout()
    path = os.path.join(out_dir, "profile_layers.png")
    write_file(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    paths["layers.png"] = path

    # roofline scatter
    pts = [(r.intensity, r.gflops_per_s, r.is_gemm) for r in kernels
           if r.intensity and r.gflops_per_s and r.flops > 0]
    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for gemm, color, name in ((True, "#DD8452", "GEMM"), (False, "#4C72B0", "other kernels")):
        xs = [p[0] for p in pts if p[2] == gemm]
        ys = [p[1] for p in pts if p[2] == gemm]
        if xs:
            ax.scatter(xs, ys, s=10, color=color, label=name)
    if roof is not None and roof.peak_bw and pts:
        lo, hi = min(p[0] for p in pts) / 2, max(p[0] for p in pts) * 2
        for gemm, style in ((False, "-"), (True, "--")):
            peak = roof.flops_ceiling(gemm)
            if peak:
                xs = [lo, peak / roof.peak_bw, hi]
                ax.plot(xs, [min(peak, x * roof.peak_bw) / 1e9 for x in xs], "k" + style,
                        linewidth=1, label=f"{roof.device} {'matmul ' if gemm else ''}roof")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"Roofline{note}")
    if pts:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, "profile_roofline.png")
    write_file(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    paths["roofline.png"] = path
    return paths


__all__ = ["ApiCall", "CommRecord", "DEFAULT_VIEWS", "Profile", "RangeInstance", "Table", "VIEWS",
           "parse_views", "read_profile", "render_views", "select"]
