"""GPU training-step benchmark: ms/step, tokens/s, MFU and per-kernel times for gpt2np's CUDA backend.

A step = forward (with dlogits) + backward + global-norm clipping + AdamW, on random tokens, d12 (124M)
at B=4, T=1024 by default. Step time is measured with CUDA events over --steps steps after --warmup
steps. MFU = flops_per_token (6N + 6LCT, llm.c's estimate) * tokens/s / the device's peak: the peak
of the GEMM precision in use (fp32, or tf32 with --tf32) and, as llm.c reports it, the TF32 peak.
Then one more step runs with every kernel and GEMM bracketed by CUDA events (the CudaBackend
on_launch hook) for the per-kernel table.

    python bench/gpu_step.py [--model d12] [-b 4] [-t 1024] [--steps 10] [--warmup 3] [--tf32] [--top 25]
    python bench/gpu_step.py --runtime emu --model tiny -t 16 --steps 1 --warmup 0   # dry run, no GPU
"""
import argparse
import sys
from collections import defaultdict

import numpy as np

from gpt2np.backends.cuda.backend import CudaBackend
from gpt2np.config import GPT2Config, preset
from gpt2np.model import GPT2
from gpt2np.profiling.gpu_specs import flops_per_token, lookup, mfu
from gpt2np.profiling.profiler import Profiler
from gpt2np.train_step import AdamW, train_step

ADAMW = AdamW(weight_decay=0.1)
TINY = GPT2Config(max_seq_len=64, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2, channels=32)


def make_backend(args):
    if args.runtime == "emu":
        from gpt2np.backends.cuda.runtime_emu import EmuRuntime
        return CudaBackend(EmuRuntime())
    from gpt2np.backends.cuda.runtime_cupy import CupyRuntime
    return CudaBackend(CupyRuntime(tf32=args.tf32))


def run_step(model, x, y, step):
    """One training step (gpt2np's train_step): lr 3e-4, weight decay 0.1, clipping at 1.0."""
    train_step(model, lambda: (x, y), step=step, lr=3e-4, adamw=ADAMW)


def time_steps(model, be, x, y, first_step, steps):
    """Mean milliseconds per step over `steps` steps, by CUDA events around the whole run."""
    start, end = be.event(), be.event()
    be.synchronize()
    start.record()
    for i in range(steps):
        run_step(model, x, y, first_step + i)
    end.record()
    return be.elapsed_ms(start, end) / steps


def kernel_times(model, be, x, y, step):
    """One step under the built-in profiler -> {kernel: [kind, calls, ms, flops, bytes]} (FLOPs and bytes
    from the op contract's cost formulas, split over each op's kernels)."""
    with Profiler(be) as prof:
        run_step(model, x, y, step)
    table = defaultdict(lambda: [None, 0, 0.0, 0, 0])
    for r in prof.records:
        row = table[r.kernel]
        row[0] = "gemm" if r.is_gemm else "kernel"
        row[1] += 1
        row[2] += r.duration_ns / 1e6
        row[3] += r.flops
        row[4] += r.bytes
    return dict(table)


def print_kernel_table(table, step_ms, top):
    total = sum(row[2] for row in table.values())
    print(f"\nper-kernel times, one step ({len(table)} kernels, {sum(r[1] for r in table.values())} launches, "
          f"{total:.2f} ms inside launches of a {step_ms:.2f} ms step)")
    print(f"{'kernel':34} {'kind':6} {'calls':>5} {'ms':>9} {'%':>6} {'GFLOP/s':>9} {'GB/s':>8}")
    rows = sorted(table.items(), key=lambda item: -item[1][2])
    for name, (kind, calls, ms, flops, nbytes) in rows[:top]:
        secs = ms / 1e3
        gflops = flops / secs / 1e9 if secs > 0 else float("nan")
        gbps = nbytes / secs / 1e9 if secs > 0 else float("nan")
        print(f"{name:34} {kind:6} {calls:5d} {ms:9.3f} {100 * ms / total:6.1f} {gflops:9.1f} {gbps:8.1f}")
    if len(rows) > top:
        rest = sum(row[2] for _, row in rows[top:])
        print(f"{'(' + str(len(rows) - top) + ' more)':34} {'':6} {'':5} {rest:9.3f} {100 * rest / total:6.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="d12", help="preset (d12, d24, d36, d48) or 'tiny'")
    parser.add_argument("-b", type=int, default=4, help="batch size B")
    parser.add_argument("-t", type=int, default=1024, help="sequence length T")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, cuBLAS heuristics)")
    parser.add_argument("--tf32", action="store_true", help="TF32 tensor cores for the GEMMs (default: exact fp32)")
    parser.add_argument("--top", type=int, default=25, help="rows of the per-kernel table")
    parser.add_argument("--runtime", choices=("cupy", "emu"), default="cupy", help="emu: CPU emulator dry run")
    args = parser.parse_args(argv)

    cfg = TINY if args.model == "tiny" else preset(args.model)
    if not 0 < args.t <= cfg.max_seq_len:
        parser.error(f"-t {args.t} must be in 1..{cfg.max_seq_len}")
    be = make_backend(args)
    device = be.device_name()
    B, T = args.b, args.t
    model = GPT2(cfg, be, B, T, seed=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]

    for step in range(args.warmup):
        run_step(model, x, y, step)
    step_ms = time_steps(model, be, x, y, args.warmup, max(1, args.steps))
    tokens_per_s = B * T / (step_ms / 1e3)
    fpt = flops_per_token(model.num_parameters, cfg.num_layers, cfg.channels, T)
    precision = be.precision
    spec = lookup(device)
    mfu_used = mfu(fpt, tokens_per_s, device, precision)
    mfu_tf32 = mfu(fpt, tokens_per_s, device, "tf32")

    print(f"device: {device} ({spec.name if spec else 'no peak numbers known'}), runtime {be.rt.name}, "
          f"GEMMs {precision}")
    print(f"model: {args.model} ({model.num_parameters / 1e6:.2f}M parameters), B={B}, T={T}, "
          f"{args.steps} timed steps after {args.warmup} warmup")
    print(f"step: {step_ms:.2f} ms, {tokens_per_s:,.0f} tokens/s, {fpt * tokens_per_s / 1e12:.2f} TFLOP/s "
          f"({fpt / 1e6:.1f} MFLOP/token)")

    def fmt(value):
        return "n/a" if value is None else f"{100 * value:.1f}%"

    print(f"MFU: {fmt(mfu_used)} of the {precision} peak, {fmt(mfu_tf32)} of the tf32 peak (llm.c's convention)")

    table = kernel_times(model, be, x, y, args.warmup + args.steps)
    print_kernel_table(table, step_ms, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
