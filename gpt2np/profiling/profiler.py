"""The built-in profiler: every op (NumPy) or kernel (CUDA) launch of a few training steps, attributed.

Each launch becomes a report.KernelRecord: which layer launched it, in which direction, the op and
module, shapes, kernel name, time (CUDA events on a GPU, the clock on the CPU and the emulator),
FLOPs and bytes moved. report.py renders the kernel table, the GPT-2 module tree, the range summary
and the files (CSV, JSON, Chrome trace, PNG).

    python -m gpt2np.profiling.profiler -e d12 -b 4 -t 64 --steps 2 [--device cpu|cuda|emu] [--out DIR]
    python train.py ... --profile 2          # the same, inside a training run
"""
import os
import sys
import time

import numpy as np

from ..backends.contract import op_cost
from ..cli import ArgumentParser, BadInput, integer, tool
from . import ranges
from .report import KernelRecord, ranges_from_records, render, write_chrome_trace, write_csv, write_json, write_png

DIRECTIONS = {"gpt2_forward": "fprop", "gpt2_backward": "bprop", "gpt2_calculate_grad_norm": "update",
              "gpt2_update": "update"}


def attribution(stack):
    """(direction, layer) of an op from the ranges open around it: the innermost gpt2_* range gives the
    direction (fprop, bprop, update; "other" outside them), a "Layer l" range the layer (None outside)."""
    direction, layer = "other", None
    for name in stack:
        if name in DIRECTIONS:
            direction = DIRECTIONS[name]
        elif name.startswith("Layer "):
            layer = int(name[6:])
    return direction, layer


class Profiler:
    """Records every op (NumPy) or kernel launch (CUDA) on `backend` while attached (`with Profiler(be):`);
    `records` and `ranges` hold the results.

    It attaches through two hooks only: the range stack (ranges.add_listener: the model opens one range per
    op carrying its module and arguments, and "Train step N", "gpt2_forward", "Layer l" around them) and the
    backend's launch hook (backend.on_launch, for backends whose ops are kernel launches). Each op is costed
    once by the contract's formula (contract.op_cost); each kernel record carries the term of that cost its
    kernel names, so the kernels of an op add up to the op.
    """

    def __init__(self, backend):
        self.backend = backend
        self.records, self.ranges = [], []
        self.step = None
        self._open = []
        self._op = None                          # (direction, layer, op, module, Cost) of the op running
        self._pending = []                       # kernels: (record, start event, end event)
        self._t0 = time.perf_counter_ns()

    # ---- attach ---------------------------------------------------------------------------
    def __enter__(self):
        ranges.add_listener(self)
        if self.backend.launches_kernels:
            self.backend.on_launch = self._on_launch
        return self

    def __exit__(self, *exc):
        ranges.remove_listener(self)
        if self.backend.launches_kernels:
            self.backend.on_launch = None
        self.resolve()
        return False

    def _now(self):
        return time.perf_counter_ns() - self._t0

    # ---- ranges.listener ------------------------------------------------------------------
    def on_push(self, name, detail):
        if name.startswith("Train step "):
            self.step = int(name.rsplit(" ", 1)[1])
        now = self._now()
        self._open.append((name, now, detail))
        if detail is not None:                   # an op: the model passes (module, arguments)
            module, args = detail
            direction, layer = attribution(ranges.current_stack())
            self._op = (direction, layer, name, module, op_cost(name, args))

    def on_pop(self, name):
        if not self._open:
            return
        opened, start, detail = self._open.pop()
        end = self._now()
        self.ranges.append((opened, start, end))
        if detail is not None and self._op is not None:
            if not self.backend.launches_kernels:          # the op is the unit: one record, its whole cost
                cost = self._op[4]
                self._add(f"numpy.{opened}", start, end - start, cost.flops, cost.bytes)
            self._op = None

    # ---- launches -------------------------------------------------------------------------
    def _on_launch(self, kernel, kind, term, run):
        """The backend's launch hook: one kernel or GEMM, bracketed by events; it carries `term` of its op's
        cost (none for helper kernels such as the finishing stage of a reduction)."""
        start, end = self.backend.event(), self.backend.event()
        start.record()
        run()
        end.record()
        flops, nbytes = (0, 0)
        if term is not None and self._op is not None:
            flops, nbytes = self._op[4].terms[term]
        name = f"cublasSgemm ({kernel})" if kind == "gemm" else kernel
        record = self._add(name, self._now(), 0, flops, nbytes)
        self._pending.append((record, start, end))

    def _add(self, kernel, start_ns, duration_ns, flops, nbytes):
        direction, layer, op, module, cost = self._op or ("other", None, "", "", None)
        record = KernelRecord(idx=len(self.records), step=self.step, direction=direction,
                              layer=-1 if layer is None else layer, op=op, module=module,
                              params=cost.params if cost else "", kernel=kernel, start_ns=int(start_ns),
                              duration_ns=int(duration_ns), flops=int(flops), bytes=int(nbytes),
                              range_stack=tuple(ranges.current_stack()))
        self.records.append(record)
        return record

    def resolve(self):
        """Turn pending event pairs into durations (synchronizes once)."""
        if not self._pending:
            return
        self.backend.synchronize()
        for record, start, end in self._pending:
            record.duration_ns = int(self.backend.elapsed_ms(start, end) * 1e6)
        self._pending.clear()


def device_label(backend):
    """The backend's device: "cpu" or the GPU's name."""
    return backend.device_name()


def device_roofline(backend):
    """The GPU's roofline (fp32 kernels, GEMMs at the backend's precision), or None on the CPU/unknown GPUs."""
    from .gpu_specs import UnknownDeviceError, roofline
    if backend.name != "cuda":
        return None
    try:
        return roofline(device_label(backend), "fp32", matmul_precision=backend.precision)
    except UnknownDeviceError:
        return None


def write_outputs(profiler, out_dir, roof=None, title=""):
    """CSV, JSON, Chrome trace and PNG of the records in out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"profile.{k}") for k in ("csv", "json", "trace.json", "png")}
    write_csv(profiler.records, paths["csv"], roof)
    write_json(profiler.records, paths["json"], roof)
    write_chrome_trace(profiler.records, paths["trace.json"], profiler.ranges or ranges_from_records(profiler.records))
    if not write_png(profiler.records, paths["png"], title=title or "Time by op and direction",
                     log=lambda msg: print(msg, file=sys.stderr)):
        paths.pop("png")
    return paths


def profile_steps(model, batches, steps, lr=1e-4):
    """Run `steps` training steps (train_step, batches in turn) under the profiler, after one unprofiled
    warm-up step (step 0)."""
    from ..train_step import train_step

    def step(i):
        train_step(model, lambda: batches[i % len(batches)], step=i, lr=lr)

    step(0)
    with Profiler(model.backend) as prof:
        for i in range(1, steps + 1):
            step(i)
    return prof


@tool
def main(argv=None):
    """Profile a few training steps and write the report; bad flags and files: one line, exit 2."""
    from ..backends import get_backend
    from ..model import GPT2
    from ..starter import resolve_model

    ap = ArgumentParser(prog="python -m gpt2np.profiling.profiler", description=__doc__.split("\n")[0])
    ap.add_argument("-e", dest="model", default="d12", help="llm.c model file or preset (default d12)")
    ap.add_argument("-b", dest="batch_size", type=int, default=4, help="batch size B (default 4)")
    ap.add_argument("-t", dest="seq_len", type=int, default=64, help="sequence length T (default 64)")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps after one warm-up step")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "numpy", "cuda", "emu"])
    ap.add_argument("--out", default="profile", help="folder for CSV, JSON, trace and PNG (default ./profile)")
    ap.add_argument("--all-steps", action="store_true", help="kernel table of every profiled step, not the last")
    args = ap.parse_args(argv)
    integer(1).check("-b", args.batch_size, "the batch size B")
    integer(1).check("-t", args.seq_len, "the sequence length T")
    integer(1).check("--steps", args.steps, "the number of profiled steps")
    # before the run, not after it: the files go into --out
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise BadInput(f"--out {args.out}: is a file; expected a folder (made if missing)")
    backend = get_backend(args.device)
    cfg, params, desc = resolve_model(args.model)
    if args.seq_len > cfg.max_seq_len:
        raise BadInput(f"-t {args.seq_len}: longer than the model's max_seq_len {cfg.max_seq_len}")
    model = GPT2(cfg, backend, args.batch_size, args.seq_len, seed=0 if params is None else None)
    if params is not None:
        model.load_params(params)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.vocab_size, (2, args.batch_size, args.seq_len + 1)).astype(np.int32)
    batches = [(b[:, :-1], b[:, 1:]) for b in batch]
    prof = profile_steps(model, batches, args.steps)
    roof = device_roofline(backend)
    label = device_label(backend)
    print(render(prof.records, roof, step=None if args.all_steps else "last", num_layers=cfg.num_layers,
                 ranges=prof.ranges))
    paths = write_outputs(prof, args.out, roof, title=f"{desc}, B={args.batch_size}, T={args.seq_len}, {label}")
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
