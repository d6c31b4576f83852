"""The built-in profiler: every op (NumPy) or kernel (CUDA) launch of a few training steps, attributed.

Each launch becomes a report.KernelRecord: which layer launched it, in which direction, the op and
module, shapes, kernel name, time (CUDA events on a GPU, the clock on the CPU and the emulator),
FLOPs and bytes moved. report.py renders the kernel table, the GPT-2 module tree, the range summary
and the files (CSV, JSON, Chrome trace, PNG).

    python -m gpt2np.profiling.profiler -e d12 -b 4 -t 64 --steps 2 [--device cpu|cuda|emu] [--out DIR]
    python train.py ... --profile 2          # the same, inside a training run
"""
import argparse
import os
import sys
import time

import numpy as np

from . import ranges
from .report import KernelRecord, ranges_from_records, render, write_chrome_trace, write_csv, write_json, \
    write_png

F32 = 4


def op_cost(op, args):
    """(params string, FLOPs, bytes) of one NumPy-backend op call, from its arguments' shapes."""
    def n(a):
        return int(np.prod(a.shape))

    if op in ("encoder_forward", "encoder_backward"):
        out = args[0] if op == "encoder_forward" else args[2]
        B, T, C = out.shape
        return f"B={B},T={T},C={C}", B * T * C, F32 * 3 * B * T * C + 4 * B * T
    if op in ("layernorm_forward", "layernorm_backward"):
        B, T, C = args[0].shape
        k = 8 if op == "layernorm_forward" else 14
        return f"B={B},T={T},C={C}", k * B * T * C, F32 * (2 if k == 8 else 4) * B * T * C
    if op == "matmul_forward":
        out, inp, w = args[0], args[1], args[2]
        OC, C = w.shape
        N = n(inp) // C
        return (f"B={inp.shape[0]},T={inp.shape[1]},C={C},OC={OC},M={N},N={OC},K={C}",
                2 * N * C * OC + (N * OC if args[3] is not None else 0), F32 * (N * C + OC * C + N * OC))
    if op == "matmul_backward":
        dinp, w = args[0], args[5]
        OC, C = w.shape
        N = n(dinp) // C
        return (f"B={dinp.shape[0]},T={dinp.shape[1]},C={C},OC={OC},M={N},N={OC},K={C}",
                4 * N * C * OC + N * OC, F32 * (N * OC + 2 * N * C + 3 * OC * C))
    if op in ("attention_forward", "attention_backward"):
        qkvr, att = (args[1], args[2]) if op == "attention_forward" else (args[2], args[3])
        _, B, NH, T, HS = qkvr.shape
        mm = 4 * B * NH * T * T * HS * (1 if op == "attention_forward" else 2)
        return (f"B={B},T={T},NH={NH},HS={HS}", mm + 5 * B * NH * T * T,
                F32 * (2 * 3 * B * T * NH * HS + 2 * B * NH * T * T + B * T * NH * HS))
    if op in ("gelu_forward", "gelu_backward"):
        size = n(args[0])
        return f"N={size}", (10 if op == "gelu_forward" else 20) * size, F32 * (2 if op == "gelu_forward" else 3) * size
    if op in ("residual_forward", "residual_backward"):
        size = n(args[0])
        return f"N={size}", size, F32 * 3 * size
    if op == "fused_classifier":
        logits, V = args[0], args[3]
        B, T, Vp = logits.shape
        return f"B={B},T={T},V={V},Vp={Vp}", 5 * B * T * V, F32 * 2 * B * T * Vp
    if op == "adamw":
        size = n(args[0])
        return f"N={size}", 12 * size, F32 * 7 * size
    if op == "global_norm":
        size = n(args[0])
        return f"N={size}", 2 * size, F32 * size
    return "", 0, 0


class Profiler:
    """Records every launch of `model` while attached; `records` and `ranges` hold the results."""

    def __init__(self, model):
        self.model, self.backend = model, model.backend
        self.records, self.ranges = [], []
        self.step = None
        self._open = []
        self._ctx = ("other", None, "", "", "")
        self._pending = []                       # CUDA: (record, start event, end event)
        self._t0 = time.perf_counter_ns()
        self._runtime = getattr(self.backend, "rt", None)

    # ---- attach ---------------------------------------------------------------------------
    def __enter__(self):
        self.model.profiler = self
        ranges.add_listener(self)
        if hasattr(self.backend, "on_launch"):
            self.backend.on_launch = self._on_launch
        return self

    def __exit__(self, *exc):
        self.model.profiler = None
        ranges.remove_listener(self)
        if hasattr(self.backend, "on_launch"):
            self.backend.on_launch = None
        self.resolve()
        return False

    def _now(self):
        return time.perf_counter_ns() - self._t0

    # ---- ranges.listener ------------------------------------------------------------------
    def on_push(self, name):
        if name.startswith("Train step "):
            self.step = int(name.rsplit(" ", 1)[1])
        self._open.append((name, self._now()))

    def on_pop(self, name):
        if self._open:
            opened, start = self._open.pop()
            self.ranges.append((opened, start, self._now()))

    # ---- launches -------------------------------------------------------------------------
    def run_op(self, op, module, direction, layer, fn, args):
        """Called by GPT2._op for every op: time it (NumPy) or let its kernels be recorded (CUDA)."""
        params, flops, nbytes = op_cost(op, args)
        self._ctx = (direction, layer, op, module, params)
        if self._runtime is not None:
            fn(*args)
            return
        start = self._now()
        fn(*args)
        self._add(f"numpy.{op}", start, self._now() - start, flops, nbytes)

    def _on_launch(self, name, kind, flops, nbytes, run):
        """CudaBackend's hook: one kernel or GEMM, bracketed by runtime events."""
        start, end = self._runtime.event(), self._runtime.event()
        start.record()
        run()
        end.record()
        kernel = f"cublasSgemm ({name})" if kind == "gemm" else name
        record = self._add(kernel, self._now(), 0, flops, nbytes)
        self._pending.append((record, start, end))

    def _add(self, kernel, start_ns, duration_ns, flops, nbytes):
        direction, layer, op, module, params = self._ctx
        record = KernelRecord(idx=len(self.records), step=self.step, direction=direction,
                              layer=-1 if layer is None else layer, op=op, module=module, params=params,
                              kernel=kernel, start_ns=int(start_ns), duration_ns=int(duration_ns), flops=int(flops),
                              bytes=int(nbytes), range_stack=tuple(ranges.current_stack()))
        self.records.append(record)
        return record

    def resolve(self):
        """Turn pending CUDA event pairs into durations (synchronizes once)."""
        if not self._pending:
            return
        self._runtime.synchronize()
        for record, start, end in self._pending:
            record.duration_ns = int(self._runtime.elapsed_ms(start, end) * 1e6)
        self._pending.clear()


def device_label(backend):
    name = getattr(backend, "device_name", None)
    return name() if callable(name) else (name or "cpu")


def device_roofline(backend):
    """The GPU's roofline (fp32 kernels, GEMMs at the backend's precision), or None on the CPU/unknown GPUs."""
    from .gpu_specs import UnknownDeviceError, roofline
    if backend.name != "cuda":
        return None
    try:
        return roofline(device_label(backend), "fp32", matmul_precision=getattr(backend, "precision", "fp32"))
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
    """Run `steps` training steps under the profiler (after one unprofiled warm-up step)."""
    def step(i, x, y):
        with ranges.range(f"Train step {i}"):
            model.zero_grad()
            model.forward(x, y, for_backward=True)
            model.backward()
            norm = model.grad_norm()
            model.update(lr, step=i + 1, grad_norm=norm)
        model.backend.synchronize()

    x, y = batches[0]
    step(0, x, y)
    with Profiler(model) as prof:
        for i in range(1, steps + 1):
            x, y = batches[i % len(batches)]
            step(i, x, y)
    return prof


def main(argv=None):
    from ..backends import get_backend
    from ..model import GPT2
    from ..starter import resolve_model

    ap = argparse.ArgumentParser(prog="python -m gpt2np.profiling.profiler", description=__doc__.split("\n")[0])
    ap.add_argument("-e", default="d12", help="llm.c model file or preset (default d12)")
    ap.add_argument("-b", type=int, default=4)
    ap.add_argument("-t", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1, help="profiled steps after one warm-up step")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "numpy", "cuda", "emu"])
    ap.add_argument("--out", default="profile", help="folder for CSV, JSON, trace and PNG (default ./profile)")
    ap.add_argument("--all-steps", action="store_true", help="kernel table of every profiled step, not the last")
    args = ap.parse_args(argv)
    try:
        backend = get_backend(args.device)
        cfg, params, desc = resolve_model(args.e)
        model = GPT2(cfg, backend, args.b, args.t, seed=0 if params is None else None)
        if params is not None:
            model.load_params(params)
        rng = np.random.default_rng(0)
        batch = rng.integers(0, cfg.vocab_size, (2, args.b, args.t + 1)).astype(np.int32)
        batches = [(b[:, :-1], b[:, 1:]) for b in batch]
        prof = profile_steps(model, batches, args.steps)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    roof = device_roofline(backend)
    label = device_label(backend)
    print(render(prof.records, roof, step=None if args.all_steps else "last", num_layers=cfg.num_layers,
                 ranges=prof.ranges))
    paths = write_outputs(prof, args.out, roof, title=f"{desc}, B={args.b}, T={args.t}, {label}")
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
