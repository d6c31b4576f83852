"""Attribute every kernel, copy and memset of an Nsight Systems profile to its NVTX range stack, and
show the profiler's views of it (gpt2np.profiling.render.views: the same renderers as the
built-in profiler's).

    nsys profile -t cuda,nvtx -o prof python train.py ...
    nsys export -t sqlite prof.nsys-rep            (or: nsys stats prof.nsys-rep, which also writes
                                                   it)
    gpt2np nsys prof.sqlite [--views all|NAME,...] [--step N|last|all]    (gpt2np/cli/nsys.py)

What the views read (the export's schema, nsys 2023-2025):
    CUPTI_ACTIVITY_KIND_KERNEL / _MEMCPY (bytes, copyKind -> ENUM_CUDA_MEMCPY_OPER.name, e.g.
    CUDA_MEMCPY_KIND_HTOD -> "[CUDA memcpy HtoD]") / _MEMSET (bytes): device start/end -> GPU
    activities, cuda_gpu_kern_sum, cuda_gpu_mem_time_sum, cuda_gpu_mem_size_sum, nvtx_kern_sum;
    CUPTI_ACTIVITY_KIND_RUNTIME (nameId -> StringIds, "_v7000" suffix dropped): API calls,
    cuda_api_sum;
    NVTX_EVENTS: nvtx_sum and, nested per thread, the PyTorch-profiler-style user ranges.

How a kernel finds its ranges (the rule of `nsys stats --report nvtx_kern_sum`):
    CUPTI_ACTIVITY_KIND_KERNEL  (start, end, correlationId, globalPid, demangledName/shortName ->
                                StringIds.id, gridX..Z, blockX..Z)
      -> CUPTI_ACTIVITY_KIND_RUNTIME row of the same correlationId (and process): the CPU-side
         launch call (start, end, globalTid)
      -> every NVTX push/pop or start/end range (NVTX_EVENTS eventType 59/70 and 60/71; name from
         `text`, or `textId` -> StringIds for registered strings) of the same globalTid whose
         [start, end] contains the launch call. Outermost first, that is the range stack.
From the stack: step ("Train step N"), direction (gpt2_forward -> fprop, gpt2_backward -> bprop,
gpt2_update -> update), layer ("Layer l"), op (innermost other range, e.g. "matmul_forward")
and the GPT-2 module (an explicit module-path range such as "h.3.attn.c_attn", else inferred
from the op and the op ranges before it in the same "Layer l" range: NVTX carries op names only).
gpt2np's own op orders, for every fuse / GELU fusion / attention / recompute setting, are read off
gpt2np.model itself (model_op_modules), so a fused run's matmul_gelu_forward is mlp.c_fc and the
matmul_forward after it mlp.c_proj, and the fused residual + LayerNorm that ends "Layer l" is
h.{l+1}.ln_1 (ln_f after the last layer; its layer is that module's, as the built-in profiler counts
it). Any other order (llm.c's) goes by how many ranges of the op came before it in the layer: the
1st..4th matmul_forward of a layer are c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj (LAYER_MODULES).
Nsight records no FLOPs or bytes of kernels, so those columns stay empty (0).
"""
import functools
import itertools
import os
import re
import sqlite3
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from gpt2np.config import DESCRIPTORS, GPT2Config, descriptor
from gpt2np.errors import BadInput, is_int
from gpt2np.model import GPT2
from gpt2np.profiling.cupti import MEMCPY_KINDS
from gpt2np.profiling.memory import module_parameters
from gpt2np.profiling.render import views as V
from gpt2np.profiling.render.report import KernelRecord
from gpt2np.ranges import add_listener, current_stack, remove_listener
from gpt2np.tensors import ATTENTIONS, RECOMPUTE_LEVELS

# NVTX_EVENTS.eventType values (Nsight Systems export schema)
NVTX_PUSHPOP = 59
NVTX_STARTEND = 60
NVTXT_PUSHPOP = 70
NVTXT_STARTEND = 71
NVTX_DOMAIN_CREATE = 75
RANGE_EVENT_TYPES = (NVTX_PUSHPOP, NVTX_STARTEND, NVTXT_PUSHPOP, NVTXT_STARTEND)

DIRECTION_RANGES = {"gpt2_forward": "fprop", "gpt2_backward": "bprop", "gpt2_update": "update",
                    "gpt2_calculate_grad_norm": "update",
                    "gpt2_backward_and_reduce": "bprop"}          # llm.c's train_gpt2cu
# ranges that group work but are no op (llm.c: classifier_and_loss spans the rest
# of the backward pass)
STRUCTURAL_RANGES = ("classifier_and_loss", "validation", "evaluation", "generation", "InitOpt")
GENERATION_STEP_RE = re.compile(r"generation step\s*\d+", re.IGNORECASE)
STEP_RE = re.compile(r"\bstep\s*(\d+)", re.IGNORECASE)
LAYER_RE = re.compile(r"layer\s*(\d+)", re.IGNORECASE)
MODULE_RE = re.compile(
    r"(?:transformer\.)?(wte|wpe|ln_f|lm_head|optimizer|h\.(\d+)(?:\.[A-Za-z_0-9]+)*)")

# llm.c op names (longest first, so 'matmul_forward_cublaslt' canonicalises to 'matmul_forward')
KNOWN_OPS = sorted(("encoder_forward", "encoder_backward", "layernorm_forward",
                    "layernorm_backward",
                    "matmul_forward", "matmul_backward", "attention_forward", "attention_backward",
                    "gelu_forward", "gelu_backward", "residual_forward", "residual_backward",
                    "fused_residual_forward", "fused_classifier", "crossentropy_forward",
                    "softmax_forward", "adamw", "global_norm"), key=len, reverse=True)

# llm.c's generic GEMM range: which linear layer it is comes from the enclosing op range
# (attention_*, matmul_backward) or, at the top of a layer, from its position there (qkv,
# attn proj, fc, mlp proj)
GENERIC_OPS = {"matmul_cublaslt": "matmul"}

# kernels that run outside any op range (or inside a generic one), by name: llm.c's own kernels,
# cuBLAS, cuDNN, NCCL -> (op, module of the op outside the layers or None, module override or None)
KERNEL_OPS = [(re.compile(p), op, module) for p, op, module in (
    (r"^encoder_forward", "encoder_forward", None),
    (r"wte_backward", "encoder_backward", "wte"),
    # llm.c's, gpt2np's
    (r"wpe_backward|encoder_backward_wpe", "encoder_backward", "wpe"),
    (r"fused_residual_forward", "fused_residual_forward", None),
    (r"^residual_forward", "residual_forward", None),
    (r"^layernorm_forward", "layernorm_forward", None),
    (r"^layernorm_backward", "layernorm_backward", None),
    (r"^gelu_forward", "gelu_forward", None), (r"^gelu_backward", "gelu_backward", None),
    (r"softmax_autoregressive_backward|permute_kernel_backward|unpermute_kernel_backward",
     "attention_backward", None),
    (r"softmax_forward|^permute_kernel|^unpermute_kernel", "attention_forward", None),
    (r"matmul_backward_bias|reduce_add_sum", "matmul_backward", None),
    (r"fused_classifier", "fused_classifier", None), (r"adamw|copy_and_cast", "adamw", None),
    (r"global_norm|global_sum", "global_norm", None), (r"nccl", "nccl", "comm"),)]


def kernel_op(kernel_name: str):
    """(op, module override) that a kernel's name tells (llm.c's kernels, NCCL), or (None, None)."""
    base = kernel_name.removeprefix("void ").strip()
    for pattern, op, module in KERNEL_OPS:
        if pattern.search(base):
            return op, module
    return None, None

# the n-th range of an op inside one layer -> the module it computes (llm.c's call order; gpt2np's
# own orders come from gpt2np.model: model_op_modules)
LAYER_MODULES = {
    "fprop": {"layernorm_forward": ("ln_1", "ln_2"),
              "matmul_forward": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
              "attention_forward": ("attn",), "gelu_forward": ("mlp.gelu",),
              "residual_forward": ("residual", "residual"),
              "fused_residual_forward": ("ln_2", "ln_1")},
    "bprop": {"matmul_backward": ("mlp.c_proj", "mlp.c_fc", "attn.c_proj", "attn.c_attn"),
              "gelu_backward": ("mlp.gelu",), "layernorm_backward": ("ln_2", "ln_1"),
              "attention_backward": ("attn",), "residual_backward": ("residual", "residual")},
}
OUTSIDE_MODULES = {"encoder_forward": "wte", "encoder_backward": "wte", "layernorm_forward": "ln_f",
                   "layernorm_backward": "ln_f", "matmul_forward": "lm_head",
                   "matmul_backward": "lm_head",
                   "fused_classifier": "lm_head", "crossentropy_forward": "lm_head",
                   "softmax_forward": "lm_head", "adamw": "optimizer", "global_norm": "optimizer",
                   "fused_residual_forward": "ln_f"}

REQUIRED_TABLES = {
    "StringIds": "no StringIds table (not an Nsight Systems SQLite export?)",
    "CUPTI_ACTIVITY_KIND_KERNEL": "no CUDA kernel data (table CUPTI_ACTIVITY_KIND_KERNEL; "
                                  "profile with -t cuda)",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "no CUDA API data (table CUPTI_ACTIVITY_KIND_RUNTIME; "
                                   "profile with -t cuda)",
    "NVTX_EVENTS": "no NVTX data (table NVTX_EVENTS; profile with -t cuda,nvtx)",
}


class NsysReportError(ValueError):
    """An nsys SQLite export that cannot be used; the message names the file and the problem."""


class NsysReportMissing(NsysReportError, FileNotFoundError):
    """The export file does not exist."""


@dataclass
class NvtxRange:
    """One NVTX range instance: name (domain-prefixed for named domains), [start, end] in ns."""
    row: int
    name: str
    start: int
    end: int
    tid: int
    style: str          # 'PushPop' or 'StartEnd'


@dataclass
class Kernel:
    """One GPU kernel execution and, when found, the CPU call that launched it."""
    start: int
    end: int
    correlation_id: int
    name: str
    params: str
    launch_start: Optional[int]
    launch_end: Optional[int]
    tid: Optional[int]
    stack: Tuple[NvtxRange, ...] = ()
    # or "memcpy", "memset" (named like nvprof's rows: "[CUDA memcpy HtoD]")
    kind: str = "kernel"
    bytes: int = 0                  # bytes copied or set
    grid: str = ""
    block: str = ""


@dataclass
class ApiRow:
    """One CUDA runtime/driver API call (CUPTI_ACTIVITY_KIND_RUNTIME): name without
    nsys's version suffix."""
    name: str
    start: int
    end: int
    tid: Optional[int]
    correlation_id: Optional[int]


@dataclass
class Profile:
    """Everything read from one export: kernels, copies and memsets (activities of kind
    memcpy/memset, in GPU start order), NVTX ranges, API calls."""
    path: str
    kernels: List[Kernel]
    ranges: List[NvtxRange]
    device: Optional[str]
    copies: List[Kernel] = field(default_factory=list)
    api: List[ApiRow] = field(default_factory=list)

    @property
    def activities(self) -> List[Kernel]:
        return sorted(self.kernels + self.copies, key=lambda k: (k.start, k.correlation_id))


# ---------------------------------------------------------------------------------------------
# reading the export

def _connect(path: str) -> sqlite3.Connection:
    if os.path.isdir(path):
        raise NsysReportError(f"{path}: is a folder; expected an Nsight Systems SQLite export "
                              "(nsys export -t sqlite)")
    if not os.path.isfile(path):
        raise NsysReportMissing(f"{path}: no such file")
    try:
        con = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True)
        tables = {row[0]
                  for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as e:
        raise NsysReportError(f"{path}: not an SQLite file ({e}); export the report with "
                              "`nsys export -t sqlite`") from None
    for table, problem in REQUIRED_TABLES.items():
        if table not in tables:
            con.close()
            raise NsysReportError(f"{path}: {problem}")
    return con


def _columns(con: sqlite3.Connection, table: str) -> set:
    return {row[1] for row in con.execute(f"PRAGMA table_info({table})")}


def _integer(table: str, row: int, column: str, value, what: str = "an integer") -> None:
    """NsysReportError (load names the file) unless a cell is an integer: nsys declares its times
    and sizes INTEGER NOT NULL, and a NULL or text one (a damaged export, another tool's) would fail
    deep in the sorting and arithmetic, with no file named."""
    if not is_int(value):
        raise NsysReportError(f"{table} row {row}: column {column!r} must be {what}, got "
                              f"{'NULL' if value is None else repr(value)}")


def _times(table: str, row: int, start, end, open_end: bool = False) -> None:
    """_integer for a row's start and end (ns; open_end: end may be NULL, an unclosed NVTX range),
    and end >= start: a reversed pair would be a negative duration."""
    _integer(table, row, "start", start, "an integer timestamp (ns)")
    if end is None and open_end:
        return
    _integer(table, row, "end", end, "an integer timestamp (ns)")
    if end < start:
        raise NsysReportError(f"{table} row {row}: end {end} is before start {start}")


def _strings(con) -> Dict[int, str]:
    return dict(con.execute("SELECT id, value FROM StringIds"))


def read_ranges(con, strings: Dict[int, str]) -> List[NvtxRange]:
    """All push/pop and start/end ranges; an unclosed range ends at the last NVTX timestamp."""
    cols = _columns(con, "NVTX_EVENTS")
    text_id = "textId" if "textId" in cols else "NULL"
    domain = "domainId" if "domainId" in cols else "0"
    end_tid = "endGlobalTid" if "endGlobalTid" in cols else "NULL"
    domains = {}
    for dom_id, text, tid in con.execute(
            f"SELECT {domain}, coalesce(text, ''), {text_id} FROM NVTX_EVENTS WHERE eventType = ?",
            (NVTX_DOMAIN_CREATE,)):
        domains.setdefault(dom_id, strings.get(tid, text) if tid is not None else text)
    # integer cells only: SQL sorts text after every number, and a row that is no range (a
    # domain) is not checked
    last = con.execute("SELECT max(coalesce(max(CASE WHEN typeof(start) = 'integer' THEN start "
                       "END), 0), coalesce(max(CASE WHEN typeof(end) = 'integer' THEN end END), "
                       "0)) FROM NVTX_EVENTS"
                       ).fetchone()[0]
    ranges = []
    query = (f"SELECT rowid, start, end, eventType, text, {text_id}, globalTid, {domain}, "
             f"{end_tid} FROM NVTX_EVENTS WHERE eventType IN "
             f"({','.join('?' * len(RANGE_EVENT_TYPES))}) ORDER BY start, rowid")
    for row, start, end, etype, text, tid_text, tid, dom, end_tid_value in con.execute(
            query, RANGE_EVENT_TYPES):
        _times("NVTX_EVENTS", row, start, end, open_end=True)
        name = strings.get(tid_text) if tid_text is not None else None
        if name is None:
            name = text or ""
        if dom and domains.get(dom):
            name = f"{domains[dom]}:{name}"
        style = "PushPop" if etype in (NVTX_PUSHPOP, NVTXT_PUSHPOP) else "StartEnd"
        if style == "StartEnd" and end_tid_value is not None and end_tid_value != tid:
            tid = None        # ended on another thread: not on any one thread's stack
        ranges.append(NvtxRange(row, name, start, end if end is not None else last, tid, style))
    return ranges


def _launch_join(con, table: str):
    """(FROM ... LEFT JOIN clause, thread expression) joining an activity table (alias a) to the
    launch calls (alias r) of the same correlationId and process."""
    acols, rcols = _columns(con, table), _columns(con, "CUPTI_ACTIVITY_KIND_RUNTIME")
    same_process = ("AND a.globalPid = ((r.globalTid >> 24) << 24)"
                    if "globalPid" in acols and "globalTid" in rcols else "")
    tid = "r.globalTid" if "globalTid" in rcols else "NULL"
    return (f"FROM {table} AS a LEFT JOIN CUPTI_ACTIVITY_KIND_RUNTIME AS r "
            f"ON a.correlationId = r.correlationId {same_process}"), tid


def read_kernels(con, strings: Dict[int, str], name_column: str = "demangledName") -> List[Kernel]:
    """Kernels in GPU start order, joined to their launch call by correlationId (same process)."""
    kcols = _columns(con, "CUPTI_ACTIVITY_KIND_KERNEL")
    names = [c for c in (name_column, "demangledName", "shortName") if c in kcols]
    name_expr = f"coalesce({', '.join('a.' + c for c in names)})" if names else "NULL"
    if len(names) == 1:
        name_expr = f"a.{names[0]}"
    dims = [f"a.{c}" if c in kcols else "1"
            for c in ("gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ")]
    join, tid = _launch_join(con, "CUPTI_ACTIVITY_KIND_KERNEL")
    query = (f"SELECT a.rowid, a.start, a.end, a.correlationId, {name_expr}, {', '.join(dims)}, "
             f"r.start, r.end, {tid} {join} ORDER BY a.start, a.correlationId")
    kernels = []
    for row, start, end, corr, name_id, gx, gy, gz, bx, by, bz, rs, re_, thread in (
            con.execute(query)):
        # the launch's r.start, r.end: read_api checks
        _times("CUPTI_ACTIVITY_KIND_KERNEL", row, start, end)
        name = strings.get(name_id, f"kernel#{corr}") if name_id is not None else f"kernel#{corr}"
        grid, block = f"({gx},{gy},{gz})", f"({bx},{by},{bz})"
        kernels.append(Kernel(start, end, corr, name, f"grid={grid} block={block}", rs, re_, thread,
                              grid=grid, block=block))
    return kernels


def copy_kind_name(symbol: str) -> str:
    """ENUM_CUDA_MEMCPY_OPER's symbol -> nvprof's spelling: CUDA_MEMCPY_KIND_HTOD -> HtoD,
    CUDA_MEMCPY_KIND_UVM_DTOH -> Unified DtoH, CUDA_MEMCPY_KIND_UNKNOWN -> Unknown."""
    text = symbol.removeprefix("CUDA_MEMCPY_KIND_")
    unified = text.startswith("UVM_")
    text = text.removeprefix("UVM_")
    m = re.fullmatch(r"([A-Z])TO([A-Z])", text)
    text = f"{m.group(1)}to{m.group(2)}" if m else text.capitalize()
    return ("Unified " if unified else "") + text


def _copy_kinds(con, tables) -> Dict[int, str]:
    """copyKind -> HtoD, DtoH, ...: the export's own ENUM_CUDA_MEMCPY_OPER, else
    CUPTI's numbering."""
    if "ENUM_CUDA_MEMCPY_OPER" in tables:
        return {i: copy_kind_name(name or "")
                for i, name in con.execute("SELECT id, name FROM ENUM_CUDA_MEMCPY_OPER")}
    return dict(MEMCPY_KINDS)


def read_copies(con) -> List[Kernel]:
    """Copies and memsets (CUPTI_ACTIVITY_KIND_MEMCPY / _MEMSET, when the export has them) as
    activities named like nvprof's rows, "[CUDA memcpy HtoD]", "[CUDA memset]", with their bytes
    and launch calls."""
    tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    out = []
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        kinds = _copy_kinds(con, tables)
        join, tid = _launch_join(con, "CUPTI_ACTIVITY_KIND_MEMCPY")
        for row, start, end, corr, nbytes, kind, rs, re_, thread in con.execute(
                "SELECT a.rowid, a.start, a.end, a.correlationId, a.bytes, a.copyKind, r.start, "
                f"r.end, {tid} {join}"):
            _times("CUPTI_ACTIVITY_KIND_MEMCPY", row, start, end)
            _integer("CUPTI_ACTIVITY_KIND_MEMCPY", row, "bytes", nbytes)
            out.append(Kernel(start, end, corr, f"[CUDA memcpy {kinds.get(kind, kind)}]",
                              f"bytes={nbytes}", rs, re_,
                              thread, kind="memcpy", bytes=int(nbytes or 0)))
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        join, tid = _launch_join(con, "CUPTI_ACTIVITY_KIND_MEMSET")
        for row, start, end, corr, nbytes, rs, re_, thread in con.execute(
                "SELECT a.rowid, a.start, a.end, a.correlationId, a.bytes, r.start, "
                f"r.end, {tid} {join}"):
            _times("CUPTI_ACTIVITY_KIND_MEMSET", row, start, end)
            _integer("CUPTI_ACTIVITY_KIND_MEMSET", row, "bytes", nbytes)
            out.append(Kernel(start, end, corr, "[CUDA memset]", f"bytes={nbytes}", rs, re_, thread,
                              kind="memset", bytes=int(nbytes or 0)))
    return sorted(out, key=lambda k: (k.start, k.correlation_id))


API_VERSION_RE = re.compile(r"_v\d+$")


def read_api(con, strings: Dict[int, str]) -> List[ApiRow]:
    """Every runtime/driver call, in host start order; "cudaLaunchKernel_v7000" ->
    "cudaLaunchKernel" (as nsys stats and nvprof name them)."""
    rcols = _columns(con, "CUPTI_ACTIVITY_KIND_RUNTIME")
    tid = "globalTid" if "globalTid" in rcols else "NULL"
    rows = con.execute(f"SELECT rowid, start, end, {tid}, correlationId, nameId FROM "
                       "CUPTI_ACTIVITY_KIND_RUNTIME ORDER BY start, correlationId")
    api = []
    for row, start, end, thread, corr, name_id in rows:
        # also the launch times read_kernels joined
        _times("CUPTI_ACTIVITY_KIND_RUNTIME", row, start, end)
        api.append(ApiRow(API_VERSION_RE.sub("", strings.get(name_id, f"api#{name_id}")), start,
                          end, thread, corr))
    return api


def read_device(con) -> Optional[str]:
    """The first GPU's name from TARGET_INFO_GPU, when the export has it."""
    try:
        row = con.execute("SELECT name FROM TARGET_INFO_GPU ORDER BY id LIMIT 1").fetchone()
    except sqlite3.Error:
        return None
    return row[0] if row and row[0] else None


def load(path: str, name_column: str = "demangledName") -> Profile:
    """Read an export and give every kernel its range stack (outermost first)."""
    con = _connect(path)
    try:
        strings = _strings(con)
        ranges = read_ranges(con, strings)
        kernels = read_kernels(con, strings, name_column)
        copies = read_copies(con)
        api = read_api(con, strings)
        device = read_device(con)
    except sqlite3.Error as e:
        raise NsysReportError(f"{path}: cannot read the export ({e})") from None
    except NsysReportError as e:            # a reader's bad row (table, row, column): name the file
        raise NsysReportError(f"{path}: {e}") from None
    finally:
        con.close()
    assign_stacks(kernels + copies, ranges)
    return Profile(path, kernels, ranges, device, copies, api)


def assign_stacks(kernels: Sequence[Kernel], ranges: Sequence[NvtxRange]) -> None:
    """Set kernel.stack to the ranges of the launching thread that contain its launch call.

    A sweep per thread: ranges enter the active set when they start at or before the launch and
    leave it once they have ended before a launch begins (launches on a thread are sequential).
    """
    by_thread: Dict[int, List[NvtxRange]] = {}
    for rng in ranges:
        if rng.tid is not None:
            by_thread.setdefault(rng.tid, []).append(rng)
    launches: Dict[int, List[Kernel]] = {}
    for k in kernels:
        if k.tid is not None and k.launch_start is not None:
            launches.setdefault(k.tid, []).append(k)
    for tid, thread_kernels in launches.items():
        thread_ranges = sorted(by_thread.get(tid, []), key=lambda r: (r.start, r.row))
        thread_kernels.sort(key=lambda k: (k.launch_start, k.correlation_id))
        active: List[NvtxRange] = []
        nxt = 0
        for k in thread_kernels:
            while nxt < len(thread_ranges) and thread_ranges[nxt].start <= k.launch_start:
                active.append(thread_ranges[nxt])
                nxt += 1
            active = [r for r in active if r.end >= k.launch_start]
            inside = [r for r in active if r.end >= k.launch_end]
            k.stack = tuple(sorted(inside, key=lambda r: (r.start, -r.end, r.row)))


# ---------------------------------------------------------------------------------------------
# from range stacks to records

def canonical_op(name: str, direction: Optional[str] = None) -> str:
    """'matmul_forward_cublaslt' -> 'matmul_forward'; llm.c's generic 'matmul_cublaslt' ->
    matmul_forward (matmul_backward in the backward pass); unknown names are kept as they are."""
    if name in GENERIC_OPS:
        return "matmul_backward" if direction == "bprop" else "matmul_forward"
    for op in KNOWN_OPS:
        if name.startswith(op):
            return op
    return name


def _direction_of(op: str) -> str:
    if op.endswith("_forward") or op == "fused_classifier":
        return "fprop"
    if op.endswith("_backward"):
        return "bprop"
    if op in ("adamw", "global_norm"):
        return "update"
    return "other"


def parse_stack(names: Sequence[str]):
    """(step, direction, layer, index of the layer range, index of the op range, explicit module).

    The op is the innermost range deeper than every step/direction/layer/module range, so an
    enclosing range of the user's own (an 'epoch') is not taken for an op.
    """
    step = direction = layer = module = None
    op_at = layer_at = None
    candidates = []
    for i, full in enumerate(names):
        name = full.rpartition(":")[2] if ":" in full and not MODULE_RE.fullmatch(full) else full
        m_step, m_layer, m_module = (STEP_RE.search(name), LAYER_RE.fullmatch(name),
                                     MODULE_RE.fullmatch(name))
        if name in STRUCTURAL_RANGES or GENERATION_STEP_RE.fullmatch(name):
            pass
        elif m_step:
            step = int(m_step.group(1))
        elif name in DIRECTION_RANGES:
            direction = DIRECTION_RANGES[name]
        elif m_layer:
            layer, layer_at = int(m_layer.group(1)), i
        elif m_module:
            module = m_module.group(0).removeprefix("transformer.")
            if m_module.group(2) is not None:
                layer = int(m_module.group(2))
        else:
            candidates.append(i)
            continue
        candidates = []
    # the innermost op range, unless it is llm.c's generic GEMM range inside a named op
    # (attention_forward, matmul_backward): then the named op it serves
    if candidates:
        op_at = candidates[-1]
        bare = [names[i].rpartition(":")[2] for i in candidates]
        if bare[-1] in GENERIC_OPS:
            named = [i for i, b in zip(candidates, bare) if b not in GENERIC_OPS]
            if named:
                op_at = named[-1]
    return step, direction, layer, layer_at, op_at, module


def to_records(kernels: Sequence[Kernel]) -> List[KernelRecord]:
    """KernelRecords in GPU order (copies and memsets among `kernels` become records of their kind).

    Without an explicit module range, the module of an op inside a layer is told by the op ranges
    before it within the same "Layer l" range instance (so gradient accumulation's repeated
    forward/backward passes each count from the start): infer_module.
    """
    order = sorted(kernels, key=lambda k: (k.launch_start
                                           if k.launch_start is not None else k.start,
                                           k.correlation_id))
    stacks = {id(k): parse_stack([r.name for r in k.stack]) for k in order}
    # the layers of the profiled model, as far as the export shows them (what is
    # past the last one: ln_f)
    num_layers = 1 + max((s[2] for s in stacks.values() if s[2] is not None), default=-1)
    # "Layer l" range instance -> {op instance: (op, the ops before it there, how many
    # of them are this op)}
    in_layer: Dict[int, Dict[object, tuple]] = {}
    attributed = {}
    for k in order:
        names = [r.name for r in k.stack]
        step, direction, layer, layer_at, op_at, module = stacks[id(k)]
        op = names[op_at].rpartition(":")[2] if op_at is not None else ""
        canon = canonical_op(op, direction)
        by_name, override = kernel_op(k.name)
        instance = k.stack[op_at].row if op_at is not None else None
        if by_name and (not op or op in GENERIC_OPS and by_name not in ("matmul_backward",)):
            # no op range (llm.c's fused residual, adamw): the name
            op = canon = by_name
            instance = ("kernel", k.correlation_id)
        if direction is None:
            direction = _direction_of(canon) if op else "other"
        if module is None and override:
            module = override
        if module is None:
            before, nth = (), 0
            if op and layer_at is not None:
                seen = in_layer.setdefault(k.stack[layer_at].row, {})
                if instance not in seen:
                    ops = [o for o, _, _ in seen.values()]
                    seen[instance] = (canon, tuple(ops), ops.count(canon))
                _, before, nth = seen[instance]
            module, layer = infer_module(canon, direction, layer, nth, before, num_layers)
        attributed[id(k)] = (step, direction, layer, op, module or "")
    records = []
    for idx, k in enumerate(kernels):
        step, direction, layer, op, module = attributed[id(k)]
        records.append(KernelRecord(idx=idx, step=step, direction=direction, layer=layer, op=op,
                                    module=module, params=k.params, kernel=k.name, start_ns=k.start,
                                    duration_ns=k.end - k.start, flops=0, bytes=k.bytes,
                                    range_stack=tuple(r.name for r in k.stack),
                                    kind=k.kind, grid=k.grid,
                                    block=k.block, range_ids=tuple(r.row for r in k.stack)))
    return records


def infer_module(op: str, direction: str, layer: Optional[int], nth: int,
                 before: Tuple[str, ...] = (),
                 num_layers: Optional[int] = None) -> Tuple[str, Optional[int]]:
    """(module, layer) of canonical op `op` inside "Layer l" (layer), after the op ranges `before`
    there, the nth range of that op in it; or of an op outside the layers (layer None).

    gpt2np's own op orders (model_op_modules) first: a module of the next layer (the fused residual
    + LayerNorm that ends a layer computes h.{l+1}.ln_1) belongs to that layer, and past the last of
    the num_layers it is ln_f, outside them (the built-in profiler's attribution); where some of the
    layer's ops left no kernel in the export, the one place those orders agree on. Else llm.c's
    order by position (LAYER_MODULES).
    """
    layers, outside = model_op_modules()
    if layer is None:
        if direction == "update":
            return "optimizer", None
        return outside.get(op) or OUTSIDE_MODULES.get(op, ""), None
    known = layers.get((direction, tuple(before), op))
    if known is None and before is not None:
        known = _place_with_ops_missing(direction, tuple(before), op, nth)
    if known is not None:
        offset, name = known
        if offset and num_layers is not None and layer + offset >= num_layers:
            return "ln_f", None
        return f"h.{layer + offset}.{name}", layer + offset
    names = LAYER_MODULES.get(direction, {}).get(op, ())
    return (f"h.{layer}.{names[nth]}" if nth < len(names) else f"h.{layer}"), layer


def _is_subsequence(part: tuple, whole: tuple) -> bool:
    rest = iter(whole)
    return all(item in rest for item in part)


@functools.cache
def _place_with_ops_missing(direction: str, before: tuple, op: str, nth: int):
    """(layer offset, module) of the nth `op` after the ops `before` where some of the layer's ops
    left no kernel in the export (filtered out of the capture, by name or kind): the one place of
    gpt2np's op orders whose ops before it hold `before` in order, with `op` nth times among them;
    None where no order or more than one place fits."""
    layers, _ = model_op_modules()
    places = {place for (d, ops, o), place in layers.items()
              if d == direction and o == op and ops.count(op) == nth and _is_subsequence(before,
                                                                                         ops)}
    return places.pop() if len(places) == 1 else None


class _NullBackend:
    """A backend that runs nothing: enough for gpt2np.model to walk its passes and
    open its op ranges."""
    launches_kernels, on_gpu, has_cpu_math = True, False, False
    dtype = np.float32

    def zeros(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _OpLog:
    """A ranges listener: (range stack with the op innermost, module) of each op the model
    opens on this thread."""

    def __init__(self):
        self.ops, self.thread, self.stack = [], threading.get_ident(), current_stack

    def on_push(self, name, detail):
        # an op: (module, args, keywords)
        if isinstance(detail, tuple) and threading.get_ident() == self.thread:
            self.ops.append((self.stack(), detail[0]))

    def on_pop(self, name):
        pass


@functools.cache
def model_op_modules():
    """gpt2np.model's op orders, read off the model itself: one micro-step (forward, backward) of a
    3-layer model (a first, a middle and a last layer) on a backend that runs nothing, for every
    fuse / gelu_fusion / attention / recompute setting, with the module the model
    names for each op range.

    Returns (layers, outside). layers: {(direction, the ops before it in its "Layer l" range, op):
    (layer offset, module in that layer)}, e.g. ("fprop", ("matmul_forward",
    "flash_attention_forward", "matmul_forward", "fused_residual_layernorm_forward",
    "matmul_gelu_forward"), "matmul_forward") -> (0, "mlp.c_proj"); the fused residual + LayerNorm
    ending a layer -> (1, "ln_1"), ln_f after the last layer included (it stands where the next
    layer's ln_1 would). outside: {op: module} of the ops outside the layers (loss_mean -> lm_head).
    An order that does not tell one module is a RuntimeError."""
    cfg = GPT2Config(max_seq_len=2, vocab_size=2, padded_vocab_size=2, num_layers=3, num_heads=1,
                     channels=1)
    tokens = np.zeros((1, 2), np.int32)
    layers: Dict[tuple, Tuple[int, str]] = {}
    outside: Dict[str, str] = {}
    for fuse, gelu_fusion, attention, recompute in itertools.product((False, True), (0, 1, 2),
                                                                     ATTENTIONS, RECOMPUTE_LEVELS):
        if gelu_fusion and not fuse:
            continue                                    # the GELU epilogues are fused ops
        model = GPT2(cfg, _NullBackend(), 1, 2, attention=attention, fuse=fuse,
                     gelu_fusion=gelu_fusion, recompute=recompute)
        log = _OpLog()
        add_listener(log)
        try:                                            # train_step's device step: loss_mean too
            staged = model.stage_batch(0, tokens, tokens)
            model.forward(tokens=staged, for_backward=True, device_loss=True)
            model.backward(staged, accumulate=False)
        finally:
            remove_listener(log)
        before: Dict[tuple, List[str]] = {}
        for stack, module in log.ops:
            _, direction, layer, _, op_at, _ = parse_stack(stack)
            op = canonical_op(stack[op_at], direction)
            if layer is None:
                outside[op] = module
                continue
            m = MODULE_RE.fullmatch(module)
            if module == "ln_f":
                place = (1, "ln_1")
            elif m and m.group(2) is not None:
                place = (int(m.group(2)) - layer, module.split(".", 2)[2])
            else:
                raise RuntimeError(f"gpt2np.model: op {op} in Layer {layer} names "
                                   f"module {module!r}")
            ops = before.setdefault((direction, layer), [])
            key = (direction, tuple(ops), op)
            if layers.setdefault(key, place) != place:
                raise RuntimeError(f"gpt2np.model's op orders do not tell the module of {key}: "
                                   f"{layers[key]} or {place}")
            ops.append(op)
    return layers, outside


def gpu_projection(kernels: Sequence[Kernel]) -> List[Tuple[str, int, int]]:
    """Each range instance that launched kernels, as (name, first kernel start, last kernel end):
    the range's time on the GPU (what `nsys stats --report nvtx_gpu_proj_sum` measures)."""
    spans: Dict[int, list] = {}
    for k in kernels:
        for rng in k.stack:
            span = spans.setdefault(rng.row, [rng.name, k.start, k.end, rng.start])
            span[1], span[2] = min(span[1], k.start), max(span[2], k.end)
    return [(name, start, end)
            for name, start, end, _ in sorted(spans.values(), key=lambda s: (s[1], s[3]))]


def read_report(path: str, name_column: str = "demangledName"):
    """(records, ranges as (name, start, end, thread), device name or None, profile) of an export.

    records: kernels, copies and memsets in GPU start order (record idx = position in
    profile.activities); thread: the Linux thread id (low 24 bits of globalTid), None for a
    start/end range that ended on another thread.
    """
    profile = load(path, name_column)
    ranges = [(r.name, r.start, r.end, None if r.tid is None else r.tid & 0xFFFFFF)
              for r in profile.ranges]
    return to_records(profile.activities), ranges, profile.device, profile


# ---------------------------------------------------------------------------------------------
# the profiler's views (gpt2np.profiling.render.views) of an export

TIMING = "Nsight Systems export (CUPTI device timestamps)"


def _step_of_name(name: str) -> Optional[int]:
    bare = name.rpartition(":")[2]
    if GENERATION_STEP_RE.fullmatch(bare):
        return None
    m = STEP_RE.search(bare)
    return int(m.group(1)) if m else None


def range_instances(ranges: Sequence[NvtxRange]) -> List[V.RangeInstance]:
    """Every NVTX range as a views.RangeInstance: id = its NVTX_EVENTS row (what records' range_ids
    hold), parent = the innermost range of the same thread that contains it, step = its own "Train
    step N" or its parent's. A start/end range that ended on another thread has no parent."""
    out = []
    by_thread: Dict[Optional[int], List[NvtxRange]] = {}
    for r in sorted(ranges, key=lambda r: (r.start, -r.end, r.row)):
        by_thread.setdefault(r.tid, []).append(r)
    for tid, thread_ranges in by_thread.items():
        open_: List[Tuple[NvtxRange, V.RangeInstance]] = []
        for r in thread_ranges:
            while open_ and (tid is None or open_[-1][0].end < r.end):
                open_.pop()
            parent = open_[-1][1] if open_ else None
            step = _step_of_name(r.name)
            if step is None and parent is not None:
                step = parent.step
            instance = V.RangeInstance(r.row, r.name, None if parent is None else parent.id,
                                       len(open_), r.start, r.end, step, r.style)
            out.append(instance)
            open_.append((r, instance))
    return sorted(out, key=lambda i: (i.start_ns, i.depth, i.id))


def views_profile(profile: Profile, records: Sequence[KernelRecord], precision: str = "fp32",
                  module_params: Optional[Dict[str, int]] = None) -> V.Profile:
    """The export as a views.Profile: its activities (records), NVTX ranges with parents and steps,
    and API calls tied to the activity they issued (same correlationId and thread). No memory or
    collectives: an export does not know the model's buffers."""
    owner = {(k.correlation_id, k.tid): i for i, k in enumerate(profile.activities)
             if k.tid is not None}
    api = [V.ApiCall(a.name, a.start, a.end - a.start, owner.get((a.correlation_id, a.tid)),
                     None if a.tid is None else a.tid & 0xFFFFFF) for a in profile.api]
    meta = {"device": profile.device, "backend": "cuda", "runtime": "nsys", "timing": TIMING,
            "emulated": False, "precision": precision, "source": os.path.abspath(profile.path)}
    if module_params:
        meta["module_params"] = dict(module_params)
        meta["num_layers"] = 1 + max((int(p.split(".")[1]) for p in module_params
                                      if p.startswith("h.")),
                                     default=-1)
    return V.Profile(list(records), range_instances(profile.ranges), api, [], None, meta)


def preset_parameters(name: str) -> Dict[str, int]:
    """Parameters per module of llm.c's model descriptor (d12, gpt2:d24, gpt3:c768, ...) for the
    module tree; BadInput naming --model."""
    try:
        cfg = descriptor(name)
    except ValueError as e:
        raise BadInput(f"--model {e}") from None
    if cfg is None:
        raise BadInput(f"--model {name}: not a model descriptor; expected {DESCRIPTORS}")
    return module_parameters(cfg)


def summary_line(profile: Profile) -> str:
    """One line of what the export holds: kernels inside and outside NVTX ranges, copies, API
    calls, ranges."""
    n = len(profile.kernels)
    no_launch = sum(1 for k in profile.kernels if k.launch_start is None)
    inside = sum(1 for k in profile.kernels if k.stack)
    return (f"{profile.path}: {n} kernels on {profile.device or 'an unknown device'}: {inside} "
            f"launched inside NVTX ranges, {n - inside - no_launch} outside any range, "
            f"{no_launch} without a launch record; {len(profile.copies)} copies and memsets; "
            f"{len(profile.api)} CUDA API calls; {len(profile.ranges)} NVTX ranges")
