"""Profiling reports from per-launch kernel records: tables, a GPT-2 module tree,
range summaries, files.

One KernelRecord per kernel launch (the model's profiler or gpt2np.profiling.nsys produce them).
From a list of records and a Roofline (gpt2np.profiling.gpu_specs) this module renders:
    kernel_table      every launch of a step: time, FLOPs, bytes, GFLOP/s, GB/s, bound, % of peak
    module_tree       wte, wpe, h.0..h.{L-1} (ln_1, attn (c_attn, core, c_proj), ln_2, mlp
                      (c_fc, gelu, c_proj), residual), ln_f, lm_head, optimizer: forward and
                      backward time, calls
    layer_table, op_table     totals per layer and per (op, direction)
    range_table       like `nsys stats --report nvtx_sum`, from (name, start_ns, end_ns) ranges
    kernel_summary_table      like `nsys stats --report cuda_gpu_kern_sum`
and writes CSV, JSON, a Chrome/Perfetto trace and a PNG bar chart (all written atomically).
`gpt2np report RECORDS.json` (gpt2np/cli/report.py) re-renders the text report from a file
written by write_json.
"""
import csv
import io
import json
import math
import os
import re
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from gpt2np.errors import BadInput
from gpt2np.fileio import atomic_write, file_in_the_way
from gpt2np.profiling.gpu_specs import Roofline

DIRECTIONS = ("fprop", "bprop", "update", "other")
GEMM_MARKERS = ("gemm", "cublas", "cutlass", "xmma", "numpy.matmul", "numpy.dot")
# our own kernels whose products run on tensor cores (WMMA): measured against the matmul
# ceiling, as GEMMs are
TENSOR_CORE_KERNELS = ("flash_attention_forward", "flash_attention_backward_dkv",
                       "flash_attention_backward_dq")


class ReportError(ValueError):
    """Bad input to a report (an unreadable records file, a bad option): one line naming it."""


@dataclass
class KernelRecord:
    """One kernel launch.

    idx: launch order; step: training step (None if unknown); direction: fprop|bprop|update|other;
    layer: transformer block (None or -1 outside the blocks); op: llm.c op name
    ('matmul_forward'); module: GPT-2 module path ('h.3.attn.c_attn', 'h.3.attn' = core attention,
    'lm_head', 'optimizer'); params: shapes ('B=4,T=64,C=768,OC=2304'); kernel: kernel name;
    start_ns, duration_ns: GPU (or CPU) time; flops, bytes: work and DRAM traffic of the launch
    (0 = unknown); range_stack: enclosing range names, outermost first; kind: "kernel", "memcpy" or
    "memset" (copies and memsets are named like nvprof's rows, "[CUDA memcpy HtoD]", and their bytes
    are the bytes copied or set); grid, block: launch dimensions ("(96,1,1)"; empty when unknown);
    range_ids: the instance ids of the ranges in range_stack (empty when unknown).
    """
    idx: int
    step: Optional[int]
    direction: str
    layer: Optional[int]
    op: str
    module: str
    params: str
    kernel: str
    start_ns: int
    duration_ns: int
    flops: int = 0
    bytes: int = 0
    range_stack: Tuple[str, ...] = field(default_factory=tuple)
    kind: str = "kernel"
    grid: str = ""
    block: str = ""
    range_ids: Tuple[int, ...] = field(default_factory=tuple)

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns

    @property
    def layer_index(self) -> Optional[int]:
        """The block index, or None for ops outside the transformer blocks."""
        return None if self.layer is None or self.layer < 0 else int(self.layer)

    @property
    def is_gemm(self) -> bool:
        """A matrix multiply measured against the matmul (tensor-core) ceiling."""
        name = self.kernel.lower()
        return any(marker in name for marker in GEMM_MARKERS)

    @property
    def matmul_ceiling(self) -> bool:
        """Whether the launch's FLOPs are held against the matmul (tensor-core) peak: a GEMM, or one
        of our WMMA kernels (flash attention)."""
        return self.is_gemm or self.kernel in TENSOR_CORE_KERNELS

    @property
    def gflops_per_s(self) -> Optional[float]:
        return _rate(self.flops, self.bytes, self.flops, self.duration_ns)

    @property
    def gbytes_per_s(self) -> Optional[float]:
        return _rate(self.flops, self.bytes, self.bytes, self.duration_ns)

    @property
    def intensity(self) -> Optional[float]:
        """Arithmetic intensity in FLOP per byte (None when bytes are unknown)."""
        return self.flops / self.bytes if self.bytes > 0 else None


def _rate(flops, nbytes, amount, duration_ns) -> Optional[float]:
    """amount per ns = G-amount per s; None when nothing is known or no time passed."""
    if (flops == 0 and nbytes == 0) or duration_ns <= 0:
        return None
    return amount / duration_ns


def classify(flops: int, nbytes: int, duration_ns: int, roof: Optional[Roofline],
             is_gemm: bool = False) -> Tuple[str, Optional[float]]:
    """(bound, percent of peak): 'compute' when FLOP/byte exceeds the ridge point, else 'memory';
    the percent is of the bound resource's ceiling. ('-', None) when the roofline or
    the work is unknown.
    """
    if roof is None or (flops == 0 and nbytes == 0):
        return "-", None
    ridge = roof.ridge(is_gemm)
    if ridge is None:
        return "-", None
    intensity = flops / nbytes if nbytes > 0 else math.inf
    seconds = duration_ns * 1e-9
    # the rate first, then its share of the ceiling: a ceiling set to a record's own rate
    # (cpu_roof.covering) gives that record exactly 100%
    if intensity > ridge:
        return "compute", (100.0 * (flops / seconds / roof.flops_ceiling(is_gemm)) if seconds > 0
                           else None)
    return "memory", (100.0 * (nbytes / seconds / roof.peak_bw) if seconds > 0 else None)


# ---------------------------------------------------------------------------------------------
# text formatting

def si(value: float) -> str:
    """12_600_000 -> '12.6M' (three significant digits, k M G T P)."""
    if value == 0:
        return "0"
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def us(ns: float) -> str:
    """A time in ns as microseconds with two decimals: 1234.5 -> '1.23'."""
    return f"{ns / 1e3:.2f}"


def or_dash(value: Optional[float], fmt: str = "{:.1f}") -> str:
    """value formatted with fmt, or '-' when it is unknown (None)."""
    return "-" if value is None else fmt.format(value)


def clip(text: str, width: Optional[int]) -> str:
    """text cut to `width` characters, ending in '..' when cut (width None: as it is)."""
    if width is None or len(text) <= width:
        return text
    return text[: width - 2] + ".."


def format_table(columns: Sequence[Tuple[str, str]], rows: Iterable[Sequence],
                 title: str = "") -> str:
    """Aligned text columns. columns: (header, 'l' or 'r'); rows: sequences of cells (str())."""
    rows = [[str(cell) for cell in row] for row in rows]
    widths = [len(header) for header, _ in columns]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]

    def line(cells):
        out = [cell.rjust(w) if align == "r" else cell.ljust(w)
               for cell, w, (_, align) in zip(cells, widths, columns)]
        return "  ".join(out).rstrip()

    lines = [title] if title else []
    lines.append(line([header for header, _ in columns]))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(row) for row in rows)
    return "\n".join(lines)


def select_step(records: Sequence[KernelRecord], step) -> List[KernelRecord]:
    """The records of one step; step None keeps them all, 'last' picks the highest step seen."""
    if step is None:
        return list(records)
    if step == "last":
        steps = [r.step for r in records if r.step is not None]
        if not steps:
            return list(records)
        step = max(steps)
    return [r for r in records if r.step == step]


# ---------------------------------------------------------------------------------------------
# (a) the kernel table

def kernel_table(records: Sequence[KernelRecord], roof: Optional[Roofline] = None, step=None,
                 kernel_width: Optional[int] = 40, params_width: Optional[int] = 40) -> str:
    """The kernel table as text (kernel_rows)."""
    title, columns, rows = kernel_rows(records, roof, step, kernel_width, params_width)
    return format_table(columns, rows, title)


def kernel_rows(records: Sequence[KernelRecord], roof: Optional[Roofline] = None, step=None,
                kernel_width: Optional[int] = 40, params_width: Optional[int] = 40):
    """(title, columns, rows): one row per launch, in launch order, and a total row.

    Columns: idx, dir, layer, op, module, params, kernel, time (us), FLOPs, bytes, GFLOP/s, GB/s,
    FLOP/B, bound, %peak (the work columns are left out when no record knows its FLOPs or bytes,
    as with Nsight Systems data).
    """
    recs = sorted(select_step(records, step), key=lambda r: r.idx)
    with_work = any(r.flops or r.bytes for r in recs)
    columns = [("idx", "r"), ("dir", "l"), ("layer", "r"), ("op", "l"), ("module", "l"),
               ("params", "l"), ("kernel", "l"), ("time (us)", "r")]
    if with_work:
        columns += [("FLOPs", "r"), ("bytes", "r"), ("GFLOP/s", "r"), ("GB/s", "r"),
                    ("FLOP/B", "r"), ("bound", "l"), ("%peak", "r")]
    rows = []
    for r in recs:
        row = [r.idx, r.direction, or_dash(r.layer_index, "{}"), r.op or "-", r.module or "-",
               clip(r.params, params_width) or "-", clip(r.kernel, kernel_width), us(r.duration_ns)]
        if with_work:
            bound, pct = classify(r.flops, r.bytes, r.duration_ns, roof, r.matmul_ceiling)
            row += [si(r.flops), si(r.bytes), or_dash(r.gflops_per_s), or_dash(r.gbytes_per_s),
                    or_dash(r.intensity, "{:.2f}"), bound, or_dash(pct, "{:.1f}%")]
        rows.append(row)
    total_ns = sum(r.duration_ns for r in recs)
    flops, nbytes = sum(r.flops for r in recs), sum(r.bytes for r in recs)
    total = ["total", "", "", f"{len(recs)} launches", "", "", "", us(total_ns)]
    if with_work:
        total += [si(flops), si(nbytes), or_dash(_rate(flops, nbytes, flops, total_ns)),
                  or_dash(_rate(flops, nbytes, nbytes, total_ns)), "", "", ""]
    rows.append(total)
    return _title("Kernels", recs, roof), columns, rows


def _title(what: str, recs: Sequence[KernelRecord], roof: Optional[Roofline]) -> str:
    steps = sorted({r.step for r in recs if r.step is not None})
    where = ""
    if len(steps) == 1:
        where = f" of step {steps[0]}"
    elif steps:
        where = f" of steps {steps[0]}..{steps[-1]}"
    device = f" on {roof.device}" if roof is not None else ""
    return f"{what}{where}{device}"


# ---------------------------------------------------------------------------------------------
# totals per layer, per op, per kernel name

def _group(records, key) -> Dict:
    groups: Dict = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return groups


def layer_table(records: Sequence[KernelRecord], step=None) -> str:
    """Time per transformer block as text (layer_rows)."""
    title, columns, rows = layer_rows(records, step)
    return format_table(columns, rows, title)


def layer_rows(records: Sequence[KernelRecord], step=None):
    """(title, columns, rows): time per transformer block (and '-' for everything outside them),
    forward/backward/update."""
    recs = select_step(records, step)
    total = sum(r.duration_ns for r in recs) or 1
    groups = _group(recs, lambda r: -1 if r.layer_index is None else r.layer_index)
    rows = []
    for layer in sorted(groups):
        g = groups[layer]
        by_dir = {d: sum(r.duration_ns for r in g if r.direction == d) for d in DIRECTIONS}
        t = sum(r.duration_ns for r in g)
        rows.append(["-" if layer < 0 else layer, us(by_dir["fprop"]), us(by_dir["bprop"]),
                     us(by_dir["update"] + by_dir["other"]), us(t), f"{100.0 * t / total:.1f}",
                     len(g)])
    columns = [("layer", "r"), ("fwd (us)", "r"), ("bwd (us)", "r"), ("upd+other (us)", "r"),
               ("total (us)", "r"), ("%", "r"), ("launches", "r")]
    return _title("Time per layer", recs, None), columns, rows


def op_table(records: Sequence[KernelRecord], roof: Optional[Roofline] = None, step=None) -> str:
    """Totals per op and direction as text (op_rows)."""
    title, columns, rows = op_rows(records, roof, step)
    return format_table(columns, rows, title)


def op_rows(records: Sequence[KernelRecord], roof: Optional[Roofline] = None, step=None):
    """(title, columns, rows): totals per (op, direction), most time first: launches, time, %, avg,
    GFLOP/s, GB/s, bound.

    The bound of a group is judged on its summed FLOPs and bytes, against the matmul ceiling when
    any of its kernels is a GEMM.
    """
    recs = select_step(records, step)
    total = sum(r.duration_ns for r in recs) or 1
    with_work = any(r.flops or r.bytes for r in recs)
    groups = _group(recs, lambda r: (r.op or "-", r.direction))
    rows = []
    for (op, direction), g in sorted(groups.items(),
                                     key=lambda kv: -sum(r.duration_ns for r in kv[1])):
        t = sum(r.duration_ns for r in g)
        row = [op, direction, len(g), us(t), f"{100.0 * t / total:.1f}", us(t / len(g))]
        if with_work:
            flops, nbytes = sum(r.flops for r in g), sum(r.bytes for r in g)
            bound, pct = classify(flops, nbytes, t, roof, any(r.matmul_ceiling for r in g))
            row += [or_dash(_rate(flops, nbytes, flops, t)),
                    or_dash(_rate(flops, nbytes, nbytes, t)), bound, or_dash(pct, "{:.1f}%")]
        rows.append(row)
    columns = [("op", "l"), ("dir", "l"), ("launches", "r"), ("total (us)", "r"), ("%", "r"),
               ("avg (us)", "r")]
    if with_work:
        columns += [("GFLOP/s", "r"), ("GB/s", "r"), ("bound", "l"), ("%peak", "r")]
    return _title("Time per op", recs, roof), columns, rows


def duration_stats(durations: Sequence[float]) -> Dict[str, float]:
    """total, instances, avg, med, min, max, stddev (sample, 0 for one instance) of durations."""
    d = list(durations)
    return {"total": sum(d), "instances": len(d), "avg": statistics.fmean(d),
            "med": statistics.median(d), "min": min(d), "max": max(d),
            "stddev": statistics.stdev(d) if len(d) > 1 else 0.0}


def summary_rows(groups: Dict, extra=()):
    """nsys stats rows (Time (%), Total, count, Avg, Med, Min, Max, StdDev in ns, as nsys prints
    them, with thousands separators) sorted by total time, largest first: the one renderer of nsys's
    summary layout (range_table, the top kernels, and views' nvtx_sum, cuda_gpu_kern_sum,
    cuda_gpu_mem_time_sum, cuda_api_sum).
    groups: key -> durations; the last cell is the key (a tuple key: its last element); extra:
    functions of the key giving cells before it."""
    stats = {key: duration_stats(d) for key, d in groups.items() if d}
    grand = sum(s["total"] for s in stats.values()) or 1
    ordered = sorted(stats.items(), key=lambda kv: (-kv[1]["total"], str(kv[0])))
    return [[f"{100.0 * s['total'] / grand:.1f}", f"{s['total']:,.0f}", f"{s['instances']:,}",
             f"{s['avg']:,.1f}", f"{s['med']:,.1f}", f"{s['min']:,.0f}", f"{s['max']:,.0f}",
             f"{s['stddev']:,.1f}"] + [cell(key) for cell in extra]
            + [key[-1] if isinstance(key, tuple) else key]
            for key, s in ordered]


SUMMARY_COLUMNS = [("Time (%)", "r"), ("Total Time (ns)", "r"), ("Instances", "r"),
                    ("Avg (ns)", "r"), ("Med (ns)", "r"), ("Min (ns)", "r"), ("Max (ns)", "r"),
                    ("StdDev (ns)", "r")]


def kernel_summary_table(records: Sequence[KernelRecord], step=None, top: Optional[int] = None,
                         title: Optional[str] = None) -> str:
    """Per kernel name as text (kernel_summary_rows)."""
    title, columns, rows = kernel_summary_rows(records, step, top, title)
    return format_table(columns, rows, title)


def kernel_summary_rows(records: Sequence[KernelRecord], step=None, top: Optional[int] = None,
                        title: Optional[str] = None):
    """(title, columns, rows) per kernel name, like `nsys stats --report cuda_gpu_kern_sum` (top:
    keep the N biggest)."""
    recs = select_step(records, step)
    rows = summary_rows(_group_durations((r.kernel, r.duration_ns) for r in recs))
    if top is not None:
        rows = rows[:top]
    return title or _title("Top kernels", recs, None), SUMMARY_COLUMNS + [("Name", "l")], rows


def _group_durations(pairs) -> Dict[str, List[float]]:
    groups: Dict[str, List[float]] = {}
    for name, duration in pairs:
        groups.setdefault(name, []).append(duration)
    return groups


# ---------------------------------------------------------------------------------------------
# (c) ranges

# (name, start_ns, end_ns) or (name, start_ns, end_ns, thread): the thread picks the trace track
Range = Tuple


def ranges_from_records(records: Sequence[KernelRecord]) -> List[Range]:
    """Range instances rebuilt from the records' range stacks, as GPU-time projections.

    Walking the launches in order, a range instance at depth d lasts while consecutive launches
    share the stack down to d; at a launch's innermost depth a change of module also starts a
    new instance (two back-to-back matmul_forward calls are two instances). Its interval runs
    from its first launch's start to its last launch's end.
    """
    out = []                        # (name, start, end, depth)
    open_: List[dict] = []          # per depth: prefix, leaf module, start, end

    def same(node, stack, d, r):
        if node["prefix"] != stack[: d + 1]:
            return False
        innermost = d == len(stack) - 1
        return not (innermost and node["leaf"] is not None and node["leaf"] != r.module)

    for r in sorted(records, key=lambda r: (r.idx, r.start_ns)):
        stack = tuple(r.range_stack)
        depth = 0
        while depth < min(len(stack), len(open_)) and same(open_[depth], stack, depth, r):
            depth += 1
        for node in reversed(open_[depth:]):
            out.append((node["prefix"][-1], node["start"], node["end"], len(node["prefix"])))
        del open_[depth:]
        for d in range(depth, len(stack)):
            open_.append({"prefix": stack[: d + 1], "leaf": None, "start": r.start_ns,
                          "end": r.end_ns})
        for node in open_:
            node["start"], node["end"] = min(node["start"], r.start_ns), max(node["end"], r.end_ns)
        if open_:
            open_[-1]["leaf"] = r.module
    for node in reversed(open_):
        out.append((node["prefix"][-1], node["start"], node["end"], len(node["prefix"])))
    return [(name, start, end)
            for name, start, end, _ in sorted(out, key=lambda x: (x[1], -x[2], x[3]))]


def range_table(ranges: Sequence[Range], title: str = "NVTX ranges") -> str:
    """Like `nsys stats --report nvtx_sum`: one row per range name, most total time first."""
    rows = summary_rows(_group_durations((r[0], r[2] - r[1]) for r in ranges))
    return format_table(SUMMARY_COLUMNS + [("Range", "l")], rows, title)


# ---------------------------------------------------------------------------------------------
# (b) the GPT-2 module tree

_LAYER_LAYOUT = (("ln_1", ()), ("attn", ("c_attn", "core", "c_proj")), ("ln_2", ()),
                 ("mlp", ("c_fc", "gelu", "c_proj")), ("residual", ()))


@dataclass
class ModuleNode:
    """Time of one module: its own launches plus (in the totals) its children's."""
    path: str
    name: str
    children: List["ModuleNode"] = field(default_factory=list)
    own: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    own_calls: int = 0

    def time(self, direction: Optional[str] = None) -> int:
        mine = sum(self.own.values()) if direction is None else self.own.get(direction, 0)
        return mine + sum(child.time(direction) for child in self.children)

    @property
    def calls(self) -> int:
        return self.own_calls + sum(child.calls for child in self.children)

    def walk(self, depth: int = 0):
        yield depth, self
        for child in self.children:
            yield from child.walk(depth + 1)


def normalise_module(module: str, layer: Optional[int] = None, op: str = "") -> str:
    """A tree path for a record's module: 'transformer.' dropped, 'h.3.attn' -> 'h.3.attn.core';
    an empty module falls back to 'h.{layer}' or 'other.{op}'."""
    path = module.strip()
    if path.startswith("transformer."):
        path = path[len("transformer."):]
    if re.fullmatch(r"h\.\d+\.attn", path):
        path += ".core"
    if not path:
        path = f"h.{layer}" if layer is not None and layer >= 0 else f"other.{op or 'unknown'}"
    return path


def module_tree(records: Sequence[KernelRecord], num_layers: Optional[int] = None,
                step=None) -> ModuleNode:
    """gpt2 > wte, wpe, h > h.0..h.{L-1} > ln_1, attn > (c_attn, core, c_proj), ln_2,
    mlp > (c_fc, gelu, c_proj), residual; ln_f, lm_head, optimizer (and 'other' for the rest)."""
    recs = select_step(records, step)
    if num_layers is None:
        layers = [r.layer_index for r in recs if r.layer_index is not None]
        layers += [int(m.group(1)) for r in recs
                   for m in [re.match(r"(?:transformer\.)?h\.(\d+)", r.module)] if m]
        num_layers = max(layers) + 1 if layers else 0
    root = ModuleNode("", "gpt2")
    nodes = {"": root}

    def add(path: str) -> ModuleNode:
        if path in nodes:
            return nodes[path]
        parent_path, _, name = path.rpartition(".")
        parent = add(parent_path)
        node = ModuleNode(path, path if parent_path == "h" else name)
        parent.children.append(node)
        nodes[path] = node
        return node

    for top in ("wte", "wpe"):
        add(top)
    for layer in range(num_layers):
        for name, children in _LAYER_LAYOUT:
            add(f"h.{layer}.{name}")
            for child in children:
                add(f"h.{layer}.{name}.{child}")
    for top in ("ln_f", "lm_head", "optimizer"):
        add(top)
    if num_layers == 0:
        add("h")
    for r in recs:
        path = normalise_module(r.module, r.layer_index, r.op)
        if not re.match(r"(wte|wpe|h|ln_f|lm_head|optimizer|other)(\.|$)", path):
            path = "other." + path
        node = add(path)
        direction = r.direction if r.direction in DIRECTIONS else "other"
        node.own[direction] += r.duration_ns
        node.own_calls += 1
    # keep a fixed order at the top: embeddings, blocks, final norm, head, optimizer, other
    order = {name: i
             for i, name in enumerate(("wte", "wpe", "h", "ln_f", "lm_head", "optimizer", "other"))}
    root.children.sort(key=lambda n: order.get(n.name, len(order)))
    return root


def module_tree_rows(records: Sequence[KernelRecord], num_layers: Optional[int] = None, step=None,
                     max_depth: Optional[int] = None, params: Optional[Dict[str, int]] = None):
    """(columns, rows) of the module tree, one row per module, indented: parameters (when `params`
    gives them per leaf module, as memory.module_parameters does), fwd, bwd, update+other time,
    total, % and launches.
    The one renderer of the tree: module_tree_table and the profiler's `modules`
    view both use it."""
    root = module_tree(records, num_layers, step)
    total = root.time() or 1
    rows = []
    for depth, node in root.walk():
        if max_depth is not None and depth > max_depth:
            continue
        t = node.time()
        row = ["  " * depth + node.name]
        if params is not None:
            count = sum(n for path, n in params.items()
                        if path == node.path or path.startswith(node.path + ".") or node.path == "")
            # 0 for modules without weights (gelu, core attention)
            row.append(f"{count:,}")
        rows.append(row + [us(node.time("fprop")), us(node.time("bprop")),
                           us(node.time("update") + node.time("other")), us(t),
                           f"{100.0 * t / total:.1f}", node.calls])
    columns = [("module", "l")] + ([("params", "r")] if params is not None else [])
    columns += [("fwd (us)", "r"), ("bwd (us)", "r"), ("upd+other (us)", "r"), ("total (us)", "r"),
                ("%", "r"), ("calls", "r")]
    return columns, rows


def module_tree_table(records: Sequence[KernelRecord], num_layers: Optional[int] = None, step=None,
                      max_depth: Optional[int] = None,
                      params: Optional[Dict[str, int]] = None) -> str:
    """The module tree as indented text (module_tree_rows)."""
    columns, rows = module_tree_rows(records, num_layers, step, max_depth, params)
    return format_table(columns, rows,
                        _title("Time per GPT-2 module", select_step(records, step), None))


# ---------------------------------------------------------------------------------------------
# the whole text report

EMULATED_NOTE = "emulated on the CPU, times are not GPU times"
NUMPY_NOTE = "numpy backend: CPU times, no GPU"


def profile_note(meta: Dict) -> Optional[str]:
    """The note every title line of a profile carries: EMULATED_NOTE for the emulator, NUMPY_NOTE
    for the numpy backend (and its --cpu-math, where the profile recorded it), none for GPU times (a
    GPU run, an nsys or CUPTI import)."""
    if meta.get("emulated"):
        return EMULATED_NOTE
    if meta.get("backend") != "numpy":
        return None
    return NUMPY_NOTE + (f"; {meta['cpu_math']} CPU math" if meta.get("cpu_math") else "")


def label(text: str, note: Optional[str]) -> str:
    """A view with `note` appended to its title line (the first line), e.g. EMULATED_NOTE."""
    if not note:
        return text
    first, sep, rest = text.partition("\n")
    return f"{first} [{note}]{sep}{rest}"


def kernels_only(records: Sequence[KernelRecord]) -> List[KernelRecord]:
    """The kernel launches among records (copies and memsets left out)."""
    return [r for r in records if r.kind == "kernel"]


def render(records: Sequence[KernelRecord], roof: Optional[Roofline] = None, step="last",
           ranges: Optional[Sequence[Range]] = None, num_layers: Optional[int] = None,
           top_kernels: int = 15, note: Optional[str] = None,
           params: Optional[Dict[str, int]] = None) -> str:
    """Kernel table, module tree, per-layer and per-op totals, top kernels and range summary
    for one step (default: the last one), separated by blank lines; `note` goes on every title line
    (EMULATED_NOTE for a run on the emulator)."""
    recs = kernels_only(select_step(records, step))
    title = "NVTX ranges"
    if ranges is None:      # none recorded (an ncu records file): rebuilt from the launches' stacks
        ranges, title = (ranges_from_records(recs),
                         "NVTX ranges (rebuilt from the launches' range stacks)")
    parts = [kernel_table(recs, roof), module_tree_table(recs, num_layers, params=params),
             layer_table(recs), op_table(recs, roof), kernel_summary_table(recs, top=top_kernels)]
    if ranges:
        parts.append(range_table(ranges, title))
    return "\n\n".join(label(part, note) for part in parts) + "\n"


# ---------------------------------------------------------------------------------------------
# files

def write_file(path: str, data) -> None:
    """Write data (str/bytes, or a callable taking the open binary file) atomically:
    fileio.atomic_write, which makes missing parent folders and raises a failed write as WriteError
    naming `path` (never its temp file)."""
    with atomic_write(path, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def check_output(flag: str, path: str, folder: bool = False) -> None:
    """BadInput naming `flag` unless `path` can be made as a file (folder=True: as a folder),
    checked before any work so a bad output path does not fail after the tables are printed: a
    folder given for a file, a file for a folder, or a path that runs through a file. Missing
    folders are fine: the writers make them."""
    if not folder and os.path.isdir(path):
        raise BadInput(f"{flag} {path}: is a folder; expected a file name")
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"{flag} {path}: is a file; expected a folder (made if missing)")
    blocking = file_in_the_way(os.path.normpath(path))
    if blocking is not None:
        raise BadInput(f"{flag} {path}: {blocking} is a file, not a folder")


@contextmanager
def writing(flag: str, path: str):
    """Inside: a failed write of the output `flag` names (disk full, no permission) is one line
    naming the flag and the path the user gave: `--json out/x.json: cannot write it ([Errno 28] No
    space left on device)`; a run failure (exit 1, as every command's failed write), the path itself
    having been checked (check_output)."""
    try:
        yield
    except OSError as e:
        reason = (f"[Errno {e.errno}] {e.strerror}" if e.errno is not None
                  else (e.strerror or str(e)))
        raise RuntimeError(f"{flag} {path}: cannot write it ({reason})") from e


CSV_FIELDS = [f.name for f in fields(KernelRecord)] + ["gflops_per_s", "gbytes_per_s", "intensity",
                                                      "bound", "pct_peak"]


def record_row(r: KernelRecord, roof: Optional[Roofline] = None) -> Dict:
    """A record as a flat dict with the derived columns (None where unknown)."""
    bound, pct = classify(r.flops, r.bytes, r.duration_ns, roof, r.matmul_ceiling)
    row = {f.name: getattr(r, f.name) for f in fields(KernelRecord)}
    row["range_stack"] = list(r.range_stack)
    row["range_ids"] = list(r.range_ids)
    row.update(gflops_per_s=r.gflops_per_s, gbytes_per_s=r.gbytes_per_s, intensity=r.intensity,
               bound=None if bound == "-" else bound, pct_peak=pct)
    return row


def write_csv(records: Sequence[KernelRecord], path: str, roof: Optional[Roofline] = None) -> None:
    """One row per launch; range_stack joined by ' > '; empty cells for unknown values."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in records:
        row = record_row(r, roof)
        row["range_stack"] = " > ".join(r.range_stack)
        row["range_ids"] = " ".join(map(str, r.range_ids))
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    write_file(path, buf.getvalue())


def write_json(records: Sequence[KernelRecord], path: str, roof: Optional[Roofline] = None,
               meta: Optional[Dict] = None, extra: Optional[Dict] = None) -> None:
    """{"meta": {...}, "roofline": {...} or null, "records": [record_row...], **extra} (extra: the
    range instances, API calls, communication and memory of a profile, see views.profile_doc)."""
    doc = {"meta": dict(meta or {}),
           "roofline": None if roof is None
           else {"device": roof.device, "peak_flops": roof.peak_flops, "peak_bw": roof.peak_bw,
                 "matmul_peak_flops": roof.matmul_peak_flops},
           "records": [record_row(r, roof) for r in records]}
    doc.update(extra or {})
    write_file(path, json.dumps(doc, indent=1) + "\n")


def load_json_doc(path: str):
    """The parsed JSON of a records file; ReportError naming the file when it cannot
    be read or parsed."""
    if os.path.isdir(path):
        raise ReportError(f"{path}: is a folder; expected a JSON records file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: not a JSON records file ({e})") from None


def read_json(path: str, doc=None) -> Tuple[List[KernelRecord], Optional[Roofline], Dict]:
    """Records, roofline and meta from a file written by write_json (doc: its parsed JSON,
    when read already)."""
    if doc is None:
        doc = load_json_doc(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("records"), list):
        raise ReportError(f"{path}: no 'records' list (expected a profile.json written "
                          "by gpt2np profile)")
    names = [f.name for f in fields(KernelRecord)]
    for i, row in enumerate(doc["records"]):
        problem = _record_problem(row)
        if problem:
            raise ReportError(f"{path}: record {i}: {problem}")
    try:
        records = [KernelRecord(**{**{k: row[k] for k in names if k in row},
                                   "range_stack": tuple(row.get("range_stack") or ()),
                                   "range_ids": tuple(row.get("range_ids") or ())})
                   for row in doc["records"]]
    except TypeError as e:
        raise ReportError(f"{path}: a record lacks a field ({e})") from None
    roof = doc.get("roofline")
    if roof is not None and not (isinstance(roof, dict) and isinstance(roof.get("device"), str)):
        raise ReportError(f"{path}: 'roofline' must be null or {{device: text, "
                          "peak_flops, peak_bw, "
                          f"matmul_peak_flops: numbers or null}}, got {json.dumps(roof)[:80]}")
    for name in ("peak_flops", "peak_bw", "matmul_peak_flops") if roof else ():
        # a ceiling divides the achieved rate (% of peak): 0 would divide by zero, < 0 give
        # negative percentages
        value = roof.get(name)
        if value is not None and not (_is_number(value) and value > 0):
            raise ReportError(f"{path}: roofline field {name!r} must be a finite number > 0 or "
                              f"null (unknown), got {json.dumps(value)[:40]}")
    roof = Roofline(roof["device"], roof.get("peak_flops"), roof.get("peak_bw"),
                    roof.get("matmul_peak_flops")) if roof else None
    meta = doc.get("meta")
    problem = None if meta is None else fields_problem(meta, META_FIELDS)
    if problem:
        raise ReportError(f"{path}: 'meta': {problem}")
    return records, roof, meta or {}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


# a record's time and amounts: negative ones would print as negative times, rates
# and percentages of peak
NON_NEGATIVE = ("duration_ns", "flops", "bytes")

# what a field of a profile's JSON must be: kind -> (test, words); "kind?" also
# allows null (unknown)
KINDS = {"text": (lambda v: isinstance(v, str), "text"),
         "integer": (_is_int, "an integer"),
         "count": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
         "flag": (lambda v: isinstance(v, bool), "true/false"),
         "counts": (lambda v: isinstance(v, dict) and all(_is_int(n) and n >= 0
                                                          for n in v.values()),
                    "an object of integers >= 0"),
         "shape": (lambda v: isinstance(v, list) and all(_is_int(n) and n >= 0 for n in v),
                   "a list of integers >= 0"),
         "list": (lambda v: isinstance(v, list), "a list"),
         "object": (lambda v: isinstance(v, dict), "an object")}
# the meta fields the renderers read (profile_note, the module tree, the views' titles and
# footers, PyProf's precision)
META_FIELDS = {"emulated": "flag?", "backend": "text?", "runtime": "text?", "timing": "text?",
               "precision": "text?", "cpu_math": "text?", "num_layers": "count?",
               "module_params": "counts?", "incomplete_records": "count?"}


def fields_problem(row, kinds: Dict[str, str], required: Iterable[str] = (),
                   others: bool = True) -> Optional[str]:
    """What is wrong with a JSON object's fields (None: nothing): kinds maps a field to its kind
    (KINDS); an absent field is fine unless `required` names it; a field kinds lacks is ignored, or
    (others=False) a problem."""
    if not isinstance(row, dict):
        return f"expected an object of fields, got {json.dumps(row)[:40]}"
    missing = [name for name in required if name not in row]
    unknown = [] if others else [name for name in row if name not in kinds]
    if missing or unknown:
        return (f"{'lacks the field' if missing else 'has an unknown field'} "
                f"{(missing or unknown)[0]!r}")
    for name, kind in kinds.items():
        test, words = KINDS[kind.rstrip("?")]
        value = row.get(name)
        if name in row and not (test(value) or (kind.endswith("?") and value is None)):
            shown = json.dumps(value)[:40]
            if kind.rstrip("?") == "counts" and isinstance(value, dict):        # name the entry
                key = next(k for k, n in value.items() if not KINDS["count"][0](n))
                shown = f"{json.dumps(value[key])[:40]} for {key!r}"
            return (f"field {name!r} must be "
                    f"{words}{' or null' if kind.endswith('?') else ''}, got {shown}")
    return None


def _record_problem(row) -> Optional[str]:
    """What is wrong with the types of a JSON record row (None: nothing): the renderers do
    arithmetic on its counts and times and format its names, so a string for a number would fail
    deep inside them."""
    if not isinstance(row, dict):
        return f"expected an object of fields, got {json.dumps(row)[:40]}"
    for f in fields(KernelRecord):
        if f.name not in row:
            # missing fields: KernelRecord's own TypeError says which
            continue
        value = row[f.name]
        if f.name == "range_stack":
            ok = value is None or (isinstance(value, list)
                                   and all(isinstance(v, str) for v in value))
            wanted = "a list of range names"
        elif f.name == "range_ids":
            ok = value is None or (isinstance(value, list) and all(_is_int(v) for v in value))
            wanted = "a list of range instance ids"
        elif f.type is str:
            ok, wanted = isinstance(value, str), "text"
        elif f.name in NON_NEGATIVE:
            ok, wanted = _is_int(value) and value >= 0, "an integer >= 0"
        elif f.type is int:
            ok, wanted = _is_int(value), "an integer"
        else:                                         # Optional[int]: step, layer
            ok, wanted = value is None or _is_int(value), "an integer or null"
        if not ok:
            return f"field {f.name!r} must be {wanted}, got {json.dumps(value)[:40]}"
    return None


TRACK_COPIES = 100


def chrome_trace(records: Sequence[KernelRecord], ranges: Optional[Sequence[Range]] = None,
                 process_name: str = "gpt2np", extra_events: Sequence[Dict] = ()) -> Dict:
    """A Chrome/Perfetto trace: complete ('X') events, ts and dur in us from the first event.

    Kernels go on track (tid) 1 of process 1, copies and memsets on their own track (TRACK_COPIES),
    ranges on track 2 (one more track per further thread when ranges carry a 4th element, their
    thread); kernel args carry step, direction, layer, op, module, params, FLOPs, bytes, grid, block
    and the range stack. extra_events: more events (API calls, collectives:
    views.trace_extra_events), with their start in "ts_ns" (ns, the records' clock) or
    metadata ('M') events.
    """
    if ranges is None:
        ranges = ranges_from_records(kernels_only(records))
    starts = ([r.start_ns for r in records] + [rng[1] for rng in ranges]
              + [e["ts_ns"] for e in extra_events if "ts_ns" in e])
    t0 = min(starts) if starts else 0
    threads = {}
    for rng in ranges:
        threads.setdefault(rng[3] if len(rng) > 3 else None, 2 + len(threads))
    events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
               "args": {"name": process_name}},
              {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "kernels"}}]
    if any(r.kind != "kernel" for r in records):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": TRACK_COPIES,
                       "args": {"name": "copies and memsets"}})
    for thread, track in threads.items():
        label = "ranges" if thread is None else f"ranges (thread {thread})"
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": track,
                       "args": {"name": label}})
    timed = []
    for rng in ranges:
        name, start, end = rng[0], rng[1], rng[2]
        track = threads[rng[3] if len(rng) > 3 else None]
        timed.append({"name": name, "cat": "range", "ph": "X", "ts": (start - t0) / 1e3,
                      "dur": (end - start) / 1e3, "pid": 1, "tid": track, "args": {}})
    for r in records:
        timed.append({"name": r.kernel, "cat": r.kind, "ph": "X", "ts": (r.start_ns - t0) / 1e3,
                      "dur": r.duration_ns / 1e3, "pid": 1,
                      "tid": 1 if r.kind == "kernel" else TRACK_COPIES,
                      "args": {"idx": r.idx, "step": r.step, "direction": r.direction,
                               "layer": r.layer_index, "op": r.op, "module": r.module,
                               "params": r.params, "flops": r.flops,
                               "bytes": r.bytes, "grid": r.grid,
                               "block": r.block, "range_stack": list(r.range_stack)}})
    for e in extra_events:
        if "ts_ns" in e:
            e = {k: v for k, v in e.items() if k != "ts_ns"} | {"ts": (e["ts_ns"] - t0) / 1e3}
            timed.append(e)
        else:
            events.append(e)
    timed.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    return {"traceEvents": events + timed, "displayTimeUnit": "ns"}


def write_chrome_trace(records: Sequence[KernelRecord], path: str,
                       ranges: Optional[Sequence[Range]] = None, process_name: str = "gpt2np",
                       extra_events: Sequence[Dict] = ()) -> None:
    """Write chrome_trace(...) as JSON (open in ui.perfetto.dev or chrome://tracing)."""
    write_file(path, json.dumps(chrome_trace(records, ranges, process_name, extra_events)) + "\n")


def write_png(records: Sequence[KernelRecord], path: str, title: str = "Time by op and direction",
              log=print) -> bool:
    """Horizontal stacked bars: time (ms) per op, split by direction. Needs matplotlib; without it
    prints one notice and returns False."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        log(f"note: matplotlib is not installed, skipping the chart {path}")
        return False
    totals: Dict[str, Dict[str, float]] = {}
    for r in records:
        direction = r.direction if r.direction in DIRECTIONS else "other"
        per = totals.setdefault(r.op or "(no op range)", dict.fromkeys(DIRECTIONS, 0.0))
        per[direction] += r.duration_ns / 1e6
    ops = sorted(totals, key=lambda op: sum(totals[op].values()))
    fig = Figure(figsize=(9, 1.5 + 0.35 * max(len(ops), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    left = [0.0] * len(ops)
    colors = {"fprop": "#4C72B0", "bprop": "#DD8452", "update": "#55A868", "other": "#8C8C8C"}
    for direction in DIRECTIONS:
        widths = [totals[op][direction] for op in ops]
        if any(widths):
            ax.barh(ops, widths, left=left, label=direction, color=colors[direction])
            left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    if ops:
        ax.legend(loc="lower right")
    fig.tight_layout()
    write_file(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return True


def require_records(records: Sequence[KernelRecord], source: str) -> None:
    """ReportError naming the file when it holds no records: a profile of nothing has no
    report to render."""
    if not records:
        raise ReportError(f"{source}: no records (an empty 'records' list); expected a "
                          "profile.json with the launches of at least one step")


def check_step(records: Sequence[KernelRecord], step, source: str) -> None:
    """ReportError unless --step (a number) names a step the records have; the message lists
    the ones they do."""
    if not isinstance(step, int):
        return
    steps = sorted({r.step for r in records if r.step is not None})
    if step not in steps:
        have = (f"its steps are {', '.join(map(str, steps))}" if steps
                else "its records carry no step numbers")
        raise ReportError(f"--step {step}: {source} has no step {step}; {have} (or use "
                          "'last' or 'all')")


def parse_step(text: str):
    """'all' -> None, 'last' -> 'last', '7' -> 7 (ValueError-derived ReportError otherwise)."""
    if text == "all":
        return None
    if text == "last":
        return "last"
    try:
        return int(text)
    except ValueError:
        raise ReportError(f"--step {text!r}: expected a step number, 'last' or 'all'") from None

