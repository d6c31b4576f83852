"""The roofline planner: one training step's launches, their work, their floors on a named GPU and
the memory the run needs, without a GPU and without running a kernel.

    gpt2np plan --gpu H100 -e d12 -b 4 -t 1024 [--precision tf32|fp32|bf16]   (gpt2np/cli/plan.py)
                [--plan-launches] [--measure [--device cuda|emu]] [--out DIR]

How: the real GPT2 and train_step run on the real CudaBackend over runtime_plan.PlanRuntime, a
runtime that does no work (float buffers are never allocated, launches and GEMMs only checked),
under the built-in Profiler in its planning mode (measure=False). So the launch list is the one a
GPU would run, in its order, with its grids and blocks, each launch attributed to its op, module,
direction and layer by the range stack and costed by the op contract's one formula per op
(contract.op_cost: the kernel carries its term's FLOPs and minimum bytes). Like profile_steps, one
unrecorded warm-up step (step 0) runs first and step 1 is the plan.

Floor of a launch on the GPU (gpu_specs): max(FLOPs / peak, bytes / HBM bandwidth), the peak being
the GEMM peak at the precision in use for cuBLAS calls (tf32 tensor cores by default, --precision
fp32 for CUDA cores, bf16 tensor cores for --precision bf16, whose buffers are bf16: parameters,
gradients and activations at 2 bytes, the backend's bf16 build of every kernel) and the fp32
CUDA-core peak for the hand-written kernels; a memset counts its bytes, a device-to-device copy its
bytes twice (read and write); host<->device copies go over PCIe and get no floor. Helper kernels
that carry no term of their op's cost (a reduction's finishing stage) have no work, so no floor.
Host syncs: every point where the host waits for the device inside the step (a device->host read, a
stream synchronize, an event wait). The single-process CUDA step makes none (gpt2np.train_step: the
token grouping goes up with the batch, the loss and the grad norm stay on the device, the results
come back asynchronously); a multi-rank step waits after each NCCL collective (gpt2np.dist), which
a plan does not run.
CUDA graphs: after the planned (eager, so every launch is attributed) step, two more steps run with
cuda_graphs on: step 2 eagerly (train_step runs a shape's first such step eagerly: it allocates what
the step needs), step 3 capturing the step and launching the graph once; the graph launches of step
3 are counted (1: the whole step).
Memory: the model's buffers (profiling.memory.memory_summary: parameters, gradients, AdamW m and v,
activations by name, gradient scratch, tokens, the backend's work buffers) as the
planned run allocates them.

--measure (on a GPU, or on the emulator where the times are CPU times and are labelled so) runs the
same step for real under the Profiler and puts the measured time beside each floor: per op and
direction, and per launch where the measured launches of an op match the planned ones.

Output: per op and direction sums, a per-direction summary, the memory, the host syncs, optionally
every launch (--plan-launches), then plan.csv (every launch), plan_ops.csv and plan.json in --out,
and a last line `total: X GB, Y GFLOP, floor Z ms, N launches, S host syncs, G
graph launches per step`.
"""
import csv
import io
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np

from gpt2np import backends, ranges
from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.backends.cuda.runtime_plan import PlanRuntime
from gpt2np.bf16 import BF16
from gpt2np.config import TrainConfig
from gpt2np.errors import BadInput
from gpt2np.init import LLMC_INIT_SEED
from gpt2np.model import GPT2
from gpt2np.profiling.gpu_specs import DeviceSpec, Roofline, UnknownDeviceError, require, roofline
from gpt2np.profiling.profiler import Profiler
from gpt2np.profiling.render.report import EMULATED_NOTE, KernelRecord, label, si, write_file
from gpt2np.profiling.render.views import MiB, Table, floor_ns
from gpt2np.train_step import train_step

GB = 1e9
GiB = 1 << 30
# Host bytes a plan holds per token of its (B, T + 1) batches at its peak: two random batches (drawn
# as int64, kept as int32), the model's int32 token and target buffers (real NumPy arrays: the
# planning runtime allocates integer buffers for real, so the host's token grouping is what a real
# step's is) and encoder_backward's grouping of them (3 int32 per token, and np.unique's and
# np.argsort's temporaries while it is made). Measured (tracemalloc) at 55-67 bytes per token from
# B*T = 64k to 2M, d12 and a 64-channel model alike.
HOST_BYTES_PER_TOKEN = 80
LR = 1e-4                         # profile_steps' learning rate (it changes no launch)
DIRECTIONS = ("fprop", "bprop", "update", "other")
DIRECTION_WORDS = {"fprop": "forward", "bprop": "backward", "update": "optimizer: grad norm, AdamW",
                   "other": "outside the passes: token uploads"}
PLAN_NOTE = "a model from peak rates, not a measurement"


def train_recompute(device: str = "cuda") -> int:
    """train.py's -r default on `device` ("cuda", "emu", or the CPU's "numpy"/"cpu"):
    gpt2np.config.TrainConfig's (0 on both, every activation kept; llm.c's is 1), which profile and
    plan take when no -r is given."""
    return TrainConfig().with_device_defaults(backends.device_traits(device)).recompute


GPU_RECOMPUTE = train_recompute("cuda")       # train.py's -r on a GPU: a plan's default
# train.py's B, T, ... on a GPU
GPU_DEFAULTS = TrainConfig().with_device_defaults(backends.TRAITS["cuda"])
RECOMPUTE_WORDS = {0: "every activation kept", 1: "GELU recomputed in backward",
                   2: "GELU and LayerNorms recomputed in backward"}


@dataclass
class Launch:
    """One planned launch (or copy, or memset) of the step: the profiler's record, the term of its
    op's cost it carries (None for helper kernels and copies), its roofline floor and bound,
    and a measured time."""
    record: KernelRecord
    term: Optional[str]
    floor_ns: Optional[float]
    bound: str                          # "compute", "memory", "-" (no work) or "host" (a PCIe copy)
    measured_ns: Optional[int] = None

    @property
    def is_launch(self) -> bool:
        return self.record.kind == "kernel"

    @property
    def hbm_bytes(self) -> int:
        """Device memory traffic the floor counts: a kernel's minimum bytes, a memset's, a
        device copy's twice."""
        r = self.record
        if r.kind == "memcpy":
            return 2 * r.bytes if "DtoD" in r.kernel else 0
        return r.bytes

    @property
    def group(self):
        """(direction, op): the op, or the copy's name for a copy outside the ops."""
        return self.record.direction, self.record.op or self.record.kernel


@dataclass
class Plan:
    """One planned training step of model `cfg` at (B, T) on `gpu` (a gpu_specs.DeviceSpec)."""
    model: str
    cfg: object
    B: int
    T: int
    gpu: DeviceSpec
    precision: str
    roof: Roofline
    launches: List[Launch]
    memory: dict
    syncs: List[dict]
    notes: List[str] = field(default_factory=list)
    measured: Optional[dict] = None     # {"device", "timing", "emulated", "precision", "records"}
    # the model's attention: "flash" or "naive" (tensors.ATTENTIONS)
    attention: str = "naive"
    # the model's fused ops (GEMM epilogues, residual + LayerNorm): --fuse
    fuse: bool = True
    # the model's -r: activations recomputed in backward instead of kept
    recompute: int = GPU_RECOMPUTE
    # the model's -ge: GELU in the fc GEMM's epilogue (1 forward, 2 also backward)
    gelu_fusion: int = 2
    # CUDA graph launches of a captured step (cuda_graphs on), 0 if not planned
    graph_launches: int = 0

    @property
    def kernels(self) -> List[Launch]:
        return [x for x in self.launches if x.is_launch]

    @property
    def flops(self) -> int:
        return sum(x.record.flops for x in self.kernels)

    @property
    def bytes(self) -> int:
        return sum(x.record.bytes for x in self.kernels)

    @property
    def floor_ns(self) -> float:
        return sum(x.floor_ns or 0.0 for x in self.launches)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory["total"])

    @property
    def host_syncs(self) -> int:
        return len(self.syncs)

    def total_line(self) -> str:
        return (f"total: {self.memory_bytes / GB:.2f} GB, {self.flops / 1e9:,.1f} GFLOP, floor "
                f"{self.floor_ns / 1e6:.2f} ms, {len(self.kernels)} launches, {self.host_syncs} "
                f"host syncs, {self.graph_launches} graph launches per step")


# ---------------------------------------------------------------------------------------------
# the GPU and the step

def resolve_gpu(name: str, precision: str = "tf32"):
    """(DeviceSpec, GEMM precision, notes) for --gpu NAME --precision P; BadInput for a name
    gpu_specs does not know or a device without peak numbers (or, for bf16, without bf16 tensor
    cores). A tf32 plan for a GPU without TF32 tensor cores plans fp32 GEMMs."""
    if precision not in ("tf32", "fp32", "bf16"):
        raise BadInput(f"--precision {precision}: expected tf32, fp32 or bf16")
    try:
        spec = require(name)
    except UnknownDeviceError as e:
        raise BadInput(f"--gpu {name}: {e}") from None
    if spec.fp32 is None or spec.mem_gbps is None:
        raise BadInput(f"--gpu {name}: no peak numbers for {spec.name}; name a GPU (H100, "
                       "A100 80GB, L4, ...)")
    notes = []
    if precision == "bf16" and (spec.bf16 is None or spec.tf32 is None):
        raise BadInput(f"--gpu {name} --precision bf16: {spec.name} has no bf16 tensor cores "
                       "(sm_80 and newer have them)")
    if precision == "tf32" and spec.tf32 is None:
        notes.append(f"{spec.name} has no TF32 tensor cores: its GEMMs are planned at fp32")
        precision = "fp32"
    return spec, precision, notes


def physical_memory() -> Optional[int]:
    """This machine's physical memory in bytes, None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_memory(B: int, T: int, memory: Optional[int] = None) -> None:
    """BadInput naming -b and -t, before anything is allocated, when the host arrays a plan of (B,
    T) builds (random token batches, the token buffers and their grouping: HOST_BYTES_PER_TOKEN)
    would not fit in this machine's physical memory (or `memory` bytes): numpy would fail with a
    traceback, or the OS kill the process."""
    memory = physical_memory() if memory is None else memory
    need = B * (T + 1) * HOST_BYTES_PER_TOKEN
    if memory and need > memory:
        raise BadInput(f"-b {B} -t {T}: planning {B * T:,} tokens needs about {need / GiB:,.1f} "
                       "GiB of host memory (the token ids and their grouping are real arrays); "
                       f"this machine has {memory / GiB:,.1f} GiB; use a smaller batch")


def random_batches(cfg, B, T, seed=0):
    """Two (inputs, targets) batches of random tokens, as `gpt2np profile` makes them."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, cfg.vocab_size, (2, B, T + 1)).astype(np.int32)
    return [(b[:, :-1], b[:, 1:]) for b in raw]


def profiled_step(model, batches, measure=True, activity_source="auto", before=None):
    """Step 0 unrecorded (a warm-up, as profile_steps does), then step 1 under the Profiler
    (measure=False: the planning mode). Returns (profiler, terms): terms[i] is the cost term the
    i-th kernel launch carried."""
    def step(i):
        train_step(model, lambda: batches[i % len(batches)], step=i, lr=LR)

    step(0)
    if before is not None:
        before()
    terms = []
    with Profiler(model.backend, model=model, activity_source=activity_source,
                  measure=measure) as prof:
        hook = model.backend.on_launch

        def on_launch(name, kind, term, run):
            terms.append(term)
            return hook(name, kind, term, run)

        model.backend.on_launch = on_launch
        step(1)
    return prof, terms


def launch_floor(record: KernelRecord, roof: Roofline):
    """(floor in ns or None, bound) of one record on the roofline (see the module docstring)."""
    bw = roof.peak_bw
    if record.kind == "memset":
        return record.bytes / bw * 1e9, "memory"
    if record.kind == "memcpy":
        if "DtoD" in record.kernel:
            return 2 * record.bytes / bw * 1e9, "memory"
        return None, "host"
    floor = floor_ns(record, roof)
    if floor is None:
        return None, "-"
    compute = record.flops / roof.flops_ceiling(record.matmul_ceiling)
    return floor, "compute" if compute * 1e9 >= floor else "memory"


def plan_step(cfg, B, T, gpu="H100", precision="tf32", batches=None, model_name="", attention=None,
              fuse=True, recompute=GPU_RECOMPUTE, gelu_fusion=None) -> Plan:
    """Plan one training step of GPT-2 `cfg` at micro-batch (B, T) on `gpu` (see the module
    docstring), with `attention` "flash" or "naive" (None: training's default on a GPU, see
    backends.resolve_attention); fuse: the model's fused ops (GPT2's `fuse`, the trainer's --fuse);
    recompute: GPT2's, the trainer's -r (default: its default on a GPU, GPU_RECOMPUTE: 0);
    gelu_fusion: GPT2's, the trainer's -ge (None: 2 with fuse, else 0)."""
    spec, precision, notes = resolve_gpu(gpu, precision)
    roof = roofline(spec, "fp32", matmul_precision=precision)
    rt = PlanRuntime(spec.name, tf32=precision == "tf32")
    backend = CudaBackend(rt, dtype=BF16 if precision == "bf16" else np.float32)
    # a GPU without TF32 tensor cores has no flash kernels
    capability = 80 if spec.tf32 is not None else 75
    head_size = cfg.channels // cfg.num_heads
    attention, note = backends.resolve_attention(backend, head_size, attention, capability)
    notes = notes + ([note] if note else [])
    if batches is None:
        check_host_memory(B, T)
    # no seed: nothing to initialise or upload
    model = GPT2(cfg, backend, B, T, attention=attention, fuse=fuse,
                 gelu_fusion=gelu_fusion, recompute=recompute)
    batches = batches or random_batches(cfg, B, T)

    def before():
        rt.syncs.clear()
        rt.where = lambda: tuple(ranges.current_stack())

    prof, terms = profiled_step(model, batches, measure=False, activity_source=None, before=before)
    kernels = iter(terms)
    launches = []
    for record in prof.records:
        term = next(kernels) if record.kind == "kernel" else None
        launches.append(Launch(record, term, *launch_floor(record, roof)))
    syncs = [dict(s, where=list(s["where"])) for s in rt.syncs]
    return Plan(model_name or "GPT-2", cfg, B, T, spec, precision, roof, launches, prof.memory,
                syncs, notes, attention=attention, fuse=bool(fuse), recompute=int(recompute),
                gelu_fusion=model.gelu_fusion,
                graph_launches=graph_launches_per_step(model, batches))


def graph_launches_per_step(model, batches) -> int:
    """Graph launches of one step with cuda_graphs on (step 2 runs eagerly, step 3 captures the step
    and launches the graph once: step 3's are counted); raises if step 3 syncs the host."""
    rt = model.backend.rt
    train_step(model, lambda: batches[0], step=2, lr=LR, cuda_graphs=True)
    launched, synced = rt.graph_launches, len(rt.syncs)
    train_step(model, lambda: batches[1 % len(batches)], step=3, lr=LR, cuda_graphs=True)
    if len(rt.syncs) != synced:
        raise AssertionError(f"a replayed step synced the host: {rt.syncs[synced:]}")
    return rt.graph_launches - launched


def measure(plan: Plan, backend, params=None, batches=None, activity_source="auto") -> Plan:
    """Run the planned step for real on `backend` (a GPU, or the emulator) under the Profiler and
    put the measured time of each launch beside its floor (plan.measured, Launch.measured_ns).
    params: the model's weights (host array), else a random init."""
    model = GPT2(plan.cfg, backend, plan.B, plan.T, seed=LLMC_INIT_SEED if params is None else None,
                 attention=plan.attention,
                 fuse=plan.fuse, gelu_fusion=plan.gelu_fusion, recompute=plan.recompute)
    if params is not None:
        model.load_params(params)
    prof, _ = profiled_step(model, batches or random_batches(plan.cfg, plan.B, plan.T),
                            activity_source=activity_source)
    records = [r for r in prof.records if r.step == 1]
    _pair(plan.launches, records)
    plan.measured = {"device": backend.device_name(), "timing": prof.timing,
                     "emulated": prof.emulated, "precision": backend.precision, "records": records}
    return plan


def _pair(launches: List[Launch], records: List[KernelRecord]):
    """Measured times onto planned launches: per op instance (the range ids around it), in order,
    where the instance's measured records are the planned ones (CUPTI may add library kernels, which
    stay unpaired; the per-op sums count them)."""
    def by_instance(items, record_of):
        groups: Dict[tuple, list] = {}
        for item in items:
            groups.setdefault(tuple(record_of(item).range_ids), []).append(item)
        return groups

    got = by_instance(records, lambda r: r)
    for key, planned in by_instance(launches, lambda x: x.record).items():
        measured = got.get(key, [])
        if len(measured) == len(planned) and all(m.kind == p.record.kind
                                                 for m, p in zip(measured, planned)):
            for p, m in zip(planned, measured):
                p.measured_ns = m.duration_ns


# ---------------------------------------------------------------------------------------------
# sums

def _on_device(record: KernelRecord) -> bool:
    """What the roofline and the measured device time count: kernels, memsets,
    device-to-device copies."""
    return record.kind != "memcpy" or "DtoD" in record.kernel


def op_rows(plan: Plan) -> List[dict]:
    """Per (direction, op): op calls, launches, copies, FLOPs and bytes of the launches (the op
    contract's costs), hbm_bytes (those bytes plus the memsets' and device copies' traffic), floor,
    bound, measured time; directions in step order, the largest floor first within each."""
    groups: Dict[tuple, dict] = {}
    for x in plan.launches:
        r = x.record
        g = groups.setdefault(x.group, {"direction": r.direction, "op": x.group[1],
                                        "instances": set(), "launches": 0, "copies": 0,
                                        "flops": 0, "bytes": 0, "hbm_bytes": 0, "host_bytes": 0,
                                        "floor_ns": 0.0, "compute_ns": 0.0, "measured_ns": None})
        if r.op:
            g["instances"].add(tuple(r.range_ids))
        if x.is_launch:
            g["launches"] += 1
            g["flops"] += r.flops
            g["bytes"] += r.bytes
        else:
            g["copies"] += 1
            if not _on_device(r):
                # over the host link: no device memory traffic, no floor
                g["host_bytes"] += r.bytes
        g["hbm_bytes"] += x.hbm_bytes
        g["floor_ns"] += x.floor_ns or 0.0
        if x.bound == "compute":
            g["compute_ns"] += x.floor_ns
    if plan.measured is not None:
        for r in plan.measured["records"]:
            if not _on_device(r):
                continue
            key = (r.direction, r.op or r.kernel)
            if key in groups:
                groups[key]["measured_ns"] = (groups[key]["measured_ns"] or 0) + r.duration_ns
    rows = []
    for g in groups.values():
        g["calls"] = len(g.pop("instances")) or g["copies"]
        c = g.pop("compute_ns")
        g["bound"] = ("-" if not g["floor_ns"] else "compute" if c >= g["floor_ns"] else
                      "memory" if c == 0 else "mixed")
        if g["host_bytes"] and not g["floor_ns"]:
            # host <-> device copies: bytes over PCIe/NVLink-C2C, not in the floor
            g["bound"] = "host link"
        rows.append(g)
    order = {d: i for i, d in enumerate(DIRECTIONS)}
    rows.sort(key=lambda g: (order.get(g["direction"], len(order)), -g["floor_ns"]))
    return rows


def direction_rows(plan: Plan) -> List[dict]:
    """Per direction: launches, FLOPs, bytes, floor (its compute- and memory-bound
    parts), measured time."""
    out = {}
    for x in plan.launches:
        d = out.setdefault(x.record.direction, {"direction": x.record.direction, "launches": 0,
                                                "flops": 0, "bytes": 0, "hbm_bytes": 0,
                                                "floor_ns": 0.0, "compute_ns": 0.0,
                                                "memory_ns": 0.0, "measured_ns": None})
        if x.is_launch:
            d["launches"] += 1
            d["flops"] += x.record.flops
            d["bytes"] += x.record.bytes
        d["hbm_bytes"] += x.hbm_bytes
        d["floor_ns"] += x.floor_ns or 0.0
        if x.bound == "compute":
            d["compute_ns"] += x.floor_ns
        elif x.bound == "memory":
            d["memory_ns"] += x.floor_ns
    if plan.measured is not None:
        for r in plan.measured["records"]:
            if _on_device(r) and r.direction in out:
                out[r.direction]["measured_ns"] = ((out[r.direction]["measured_ns"] or 0)
                                                   + r.duration_ns)
    return [out[d] for d in DIRECTIONS if d in out]


# ---------------------------------------------------------------------------------------------
# text

def _us(ns) -> str:
    return "-" if ns is None else f"{ns / 1e3:,.1f}"


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:,.3f}"


def _eff(floor, measured) -> str:
    return f"{100.0 * floor / measured:.3g}%" if measured and floor else "-"


def _measured_word(plan: Plan) -> str:
    m = plan.measured
    return "measured (emulated)" if m and m["emulated"] else "measured"


def header(plan: Plan) -> str:
    spec, roof = plan.gpu, plan.roof
    gemm = f"{roof.matmul_peak_flops / 1e12:g} TFLOP/s {plan.precision} GEMMs" + (
        " on tensor cores" if plan.precision != "fp32" else " on CUDA cores")
    lines = [f"Plan of one training step: {plan.model}, B={plan.B}, T={plan.T}, {plan.attention} "
             f"attention, -r {plan.recompute} ({RECOMPUTE_WORDS[plan.recompute]}), on "
             f"{spec.name}{'' if plan.fuse else ' (--fuse 0: one kernel per op)'} [{PLAN_NOTE}]",
             f"peaks: {spec.fp32:g} TFLOP/s fp32 kernels, {gemm}, {spec.mem_gbps:g} GB/s HBM",
             "floor of a launch = max(FLOPs / peak, minimum bytes / bandwidth), FLOPs and bytes "
             "from the op contract's cost formulas"]
    lines += [f"note: {n}" for n in plan.notes]
    if plan.measured:
        m = plan.measured
        what = f"{m['device']}, {m['precision']}, {m['timing']}"
        lines.append(f"measured: one real step on {what}"
                     + (f" [{EMULATED_NOTE}]" if m["emulated"] else ""))
    return "\n".join(lines)


def op_table(plan: Plan) -> Table:
    rows = op_rows(plan)
    floor = plan.floor_ns or 1.0
    measured = plan.measured is not None
    columns = [("direction", "l"), ("op", "l"), ("calls", "r"), ("launches", "r"),
               ("GFLOP", "r"), ("MB moved", "r"),
               ("FLOP/B", "r"), ("floor (us)", "r"), ("% step", "r"), ("bound", "l")]
    if measured:
        columns += [(f"{_measured_word(plan)} (us)", "r"), ("floor/measured", "r")]
    out = []
    for g in rows:
        bound = g["bound"]
        # their bytes cross it, not device memory: said here, not in MB moved
        if bound == "host link":
            bound = f"host link: {si(g['host_bytes'])}B, not in the floor"
        row = [g["direction"], g["op"], g["calls"], g["launches"], f"{g['flops'] / 1e9:,.2f}",
               f"{g['hbm_bytes'] / 1e6:,.1f}",
               f"{g['flops'] / g['hbm_bytes']:.1f}" if g["hbm_bytes"] else "-",
               _us(g["floor_ns"]) if g["floor_ns"] else "-",
               f"{100.0 * g['floor_ns'] / floor:.1f}", bound]
        if measured:
            row += [_us(g["measured_ns"]), _eff(g["floor_ns"], g["measured_ns"])]
        out.append(row)
    title = f"Per op and direction on {plan.gpu.name} ({plan.precision} GEMMs)"
    return Table(label(title, EMULATED_NOTE if measured and plan.measured["emulated"] else None),
                 columns, out)


def direction_table(plan: Plan) -> Table:
    measured = plan.measured is not None
    columns = [("direction", "l"), ("what", "l"), ("launches", "r"), ("GFLOP", "r"),
               ("GB moved", "r"), ("floor (ms)", "r"), ("compute-bound (ms)", "r"),
               ("memory-bound (ms)", "r"), ("%", "r")]
    if measured:
        columns += [(f"{_measured_word(plan)} (ms)", "r"), ("floor/measured", "r")]
    floor = plan.floor_ns or 1.0
    rows = []
    for d in direction_rows(plan):
        row = [d["direction"], DIRECTION_WORDS.get(d["direction"], ""), d["launches"],
               f"{d['flops'] / 1e9:,.1f}", f"{d['hbm_bytes'] / GB:,.2f}", _ms(d["floor_ns"]),
               _ms(d["compute_ns"]), _ms(d["memory_ns"]), f"{100.0 * d['floor_ns'] / floor:.1f}"]
        if measured:
            row += [_ms(d["measured_ns"]), _eff(d["floor_ns"], d["measured_ns"])]
        rows.append(row)
    tokens = plan.B * plan.T
    footer = (f"step floor {plan.floor_ns / 1e6:.2f} ms: at most "
              f"{tokens / (plan.floor_ns * 1e-9):,.0f} tokens/s "
              f"on {plan.gpu.name}" if plan.floor_ns else "")
    if measured:
        total = sum(r.duration_ns for r in plan.measured["records"] if _on_device(r))
        footer += (f"; {_measured_word(plan)} device time {total / 1e6:.2f} ms "
                   f"({_eff(plan.floor_ns, total)} of it)")
    title = "Per direction"
    return Table(label(title, EMULATED_NOTE if measured and plan.measured["emulated"] else None),
                 columns, rows, footer)


def memory_tables(plan: Plan) -> List[Table]:
    mem = plan.memory
    rows = [[b["buffer"], f"{b['bytes'] / MiB:,.2f}", b["what"]] for b in mem["buffers"]]
    rows.append(["total", f"{mem['total'] / MiB:,.2f}",
                 f"{mem['total'] / GB:.2f} GB (1 GB = 1e9 bytes)"])
    acts = [[a["buffer"], "x".join(map(str, a["shape"])), f"{a['bytes'] / MiB:,.2f}"]
            for a in mem["activations"]]
    return [Table(f"Memory the run needs, by buffer ({plan.cfg.num_layers} layers, "
                  f"B={plan.B}, T={plan.T})",
                  [("buffer", "l"), ("MiB", "r"), ("what", "l")], rows),
            Table("Activations by name (kept for the backward pass)",
                  [("activation", "l"), ("shape", "l"), ("MiB", "r")], acts)]


# what the step reads back, by the innermost range around the read (the model's and the
# backend's code today)
SYNC_REASONS = {"encoder_backward": "token ids, grouped by id on the host (deterministic dwte)",
                "gpt2_forward": "the losses, for the mean loss",
                "gpt2_backward": "the losses, for the mean loss",
                "global_norm": "the squared gradient norm (clipping, the NaN/Inf check)"}


def sync_reason(sync: dict) -> str:
    where = sync["where"]
    if sync["kind"] == "synchronize":
        return ("backend.synchronize() at the end of the step" if len(where) == 1
                else "backend.synchronize()")
    return SYNC_REASONS.get(where[-1] if where else "", "-")


def sync_table(plan: Plan) -> Table:
    rows = []
    for i, s in enumerate(plan.syncs):
        where = s["where"]
        read = (f"{s['dtype']} {'x'.join(map(str, s['shape'])) or 'scalar'}"
                if s["kind"] == "to_host" else "-")
        rows.append([i, s["kind"], read, s["bytes"], " > ".join(where) or "-", sync_reason(s)])
    return Table(f"Host syncs in the step: {plan.host_syncs} "
                 "(each one a wait of the host for the device)",
                 [("#", "r"), ("call", "l"), ("reads", "l"), ("bytes", "r"), ("ranges", "l"),
                  ("what", "l")], rows)


def launch_table(plan: Plan) -> Table:
    measured = plan.measured is not None
    columns = [("idx", "r"), ("dir", "l"), ("layer", "r"), ("op", "l"), ("module", "l"),
               ("kernel", "l"), ("term", "l"), ("grid", "l"), ("block", "l"), ("FLOPs", "r"),
               ("bytes", "r"), ("floor (us)", "r"), ("bound", "l")]
    if measured:
        columns += [(f"{_measured_word(plan)} (us)", "r")]
    rows = []
    for x in plan.launches:
        r = x.record
        row = [r.idx, r.direction, "-" if r.layer_index is None else r.layer_index, r.op or "-",
               r.module or "-", r.kernel, x.term or "-", r.grid or "-", r.block or "-", si(r.flops),
               si(r.bytes), "-" if x.floor_ns is None else f"{x.floor_ns / 1e3:.2f}", x.bound]
        if measured:
            row += [_us(x.measured_ns)]
        rows.append(row)
    return Table(f"Every launch of the step ({len(plan.kernels)} launches, "
                 f"{len(plan.launches) - len(plan.kernels)} copies and memsets)", columns, rows)


def render(plan: Plan, launches: bool = False) -> str:
    """The plan as text (without the total line): header, per op and direction, per direction,
    memory, host syncs, and every launch when asked."""
    tables = [op_table(plan), direction_table(plan), *memory_tables(plan), sync_table(plan)]
    if launches:
        tables.append(launch_table(plan))
    return header(plan) + "\n\n" + "\n\n".join(t.text() for t in tables) + "\n"


# ---------------------------------------------------------------------------------------------
# files

LAUNCH_FIELDS = ["idx", "step", "direction", "layer", "op", "module", "params", "kernel", "kind",
                 "term", "grid", "block", "flops", "bytes", "floor_ns", "bound", "measured_ns"]
OP_FIELDS = ["direction", "op", "calls", "launches", "copies", "flops", "bytes", "hbm_bytes",
             "host_bytes", "floor_ns", "bound", "measured_ns"]


def launch_dicts(plan: Plan) -> List[dict]:
    out = []
    for x in plan.launches:
        r = x.record
        out.append({"idx": r.idx, "step": r.step, "direction": r.direction, "layer": r.layer_index,
                    "op": r.op, "module": r.module, "params": r.params, "kernel": r.kernel,
                    "kind": r.kind, "term": x.term, "grid": r.grid, "block": r.block,
                    "flops": r.flops, "bytes": r.bytes, "floor_ns": x.floor_ns,
                    "bound": x.bound, "measured_ns": x.measured_ns})
    return out


def _csv(rows: List[dict], fields: List[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in fields})
    return buf.getvalue()


def to_json(plan: Plan) -> dict:
    spec = plan.gpu
    measured = None
    if plan.measured is not None:
        measured = {k: v for k, v in plan.measured.items() if k != "records"}
    return {
        "what": PLAN_NOTE,
        "model": plan.model, "config": asdict(plan.cfg), "B": plan.B, "T": plan.T,
        "gpu": {"name": spec.name, "fp32_tflops": spec.fp32,
                "tf32_tflops": spec.tf32, "hbm_gbps": spec.mem_gbps},
        "precision": plan.precision, "attention": plan.attention, "fuse": plan.fuse,
        "gelu_fusion": plan.gelu_fusion,
        "recompute": plan.recompute,
        "notes": plan.notes,
        "total": {"memory_bytes": plan.memory_bytes, "flops": plan.flops, "bytes": plan.bytes,
                  "floor_ns": plan.floor_ns, "launches": len(plan.kernels),
                  "host_syncs": plan.host_syncs, "graph_launches_per_step": plan.graph_launches},
        "directions": direction_rows(plan), "ops": op_rows(plan), "memory": plan.memory,
        "host_syncs": plan.syncs, "measured": measured, "launches": launch_dicts(plan),}


def write_files(plan: Plan, out_dir: str) -> Dict[str, str]:
    """plan.csv (every launch), plan_ops.csv (per op and direction), plan.json
    (everything) in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, name) for k, name in
             (("csv", "plan.csv"), ("ops", "plan_ops.csv"), ("json", "plan.json"))}
    write_file(paths["csv"], _csv(launch_dicts(plan), LAUNCH_FIELDS))
    write_file(paths["ops"], _csv(op_rows(plan), OP_FIELDS))
    write_file(paths["json"], json.dumps(to_json(plan), indent=1, default=_jsonable) + "\n")
    return paths


def _jsonable(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# --measure

def check_measured_memory(plan: Plan, backend) -> None:
    """BadInput naming --measure, -b and -t when the emulator would hold the step's buffers in more
    host memory than this machine has (a GPU holds them in its own)."""
    memory = physical_memory()
    if not backend.on_gpu and memory and plan.memory_bytes > memory:
        raise BadInput(f"--measure --device emu -b {plan.B} -t {plan.T}: the emulator holds the "
                       f"step's {plan.memory_bytes / GiB:,.1f} GiB of buffers in host memory; this "
                       f"machine has {memory / GiB:,.1f} GiB; plan without --measure, or use a "
                       f"smaller batch")


def measuring_backend(device: str, precision: str):
    """The backend --measure runs the step on: the GPU (--device cuda, or auto with one) or the
    emulator (--device emu); at the plan's precision where that backend has it."""
    name = backends.resolve_name(device)
    if not backends.device_traits(name).launches_kernels:
        raise BadInput("--measure runs the step's kernels: --device cuda (a GPU) or --device emu "
                       f"(the CPU emulator){'; no usable GPU here' if device == 'auto' else ''}")
    if precision not in backends.PRECISIONS[name]:
        precision = "fp32"
    return backends.get_backend(name, precision=precision)
