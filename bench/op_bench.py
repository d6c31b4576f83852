"""One op's kernels timed alone on the GPU, for every combination of the launch settings given.

The dev/cuda way of trying a kernel's tuning: one kernel per idea, timed against the last.

For each combination the op runs once eagerly (which allocates its scratch buffers), then --reps
calls are captured as one CUDA graph and timed by two CUDA events around its launch (after one
untimed launch), so the host's launch overhead stays out of the time: a Python launch takes longer
than a 20 us kernel, and timing eager calls measures the host. Printed: microseconds per call and
the bandwidth the op contract's minimum bytes give at that time.

    python bench/op_bench.py layernorm_backward -b 64 -t 1024 --precision bf16 \\
        --set layernorm_max_blocks=512,1000000 --set layernorm_finish_threads=1,8,32
    python bench/op_bench.py layernorm_backward --runtime emu -b 2 -t 16 -c 64 --reps 2  # dry run

Ops: layernorm_backward (--fuse 1: the one-pass kernel, as training runs it; 0: dinp, then column
sums), layernorm_forward, fused_residual_layernorm_forward, fused_classifier (softmax, loss and
dlogits over -v's vocabulary: classifier_threads). Settings: CudaBackend's launch
settings (LAUNCH_SETTINGS).
"""
import argparse
import itertools
import sys

import numpy as np

from gpt2np.backends import BackendUnavailable, get_backend
from gpt2np.backends.cuda.backend import LAUNCH_SETTINGS, KernelArgumentError
from gpt2np.ops.contract import op_cost

OPS = ("layernorm_backward", "layernorm_forward", "fused_residual_layernorm_forward",
       "fused_classifier")


def op_call(be, op, B, T, C, fuse, rng, V=50257):
    """(call, args): a function that runs `op` once on fixed device buffers of shape (B, T, C) (the
    classifier: logits (B, T, Vp) over a vocabulary of V, padded to a multiple of 128 as llm.c pads
    it), and the op's argument list (for its cost)."""
    def dev(*shape, scale=1.0):
        return be.from_host((rng.standard_normal(shape) * scale).astype(np.float32), be.dtype)

    # in place: each call turns the last call's dlogits into new ones, alike work
    if op == "fused_classifier":
        Vp = -(-V // 128) * 128
        targets = be.from_host(rng.integers(0, V, (B, T)).astype(np.int32))
        args = (dev(B, T, Vp), be.zeros((B, T), np.float32), targets, V, 1.0 / (B * T), True)
        return lambda: be.fused_classifier(*args), args

    x, w, b = dev(B, T, C, scale=2.0), dev(C), dev(C)
    out, mean, rstd = (be.zeros((B, T, C), be.dtype), be.zeros((B, T), np.float32),
                       be.zeros((B, T), np.float32))
    if op == "layernorm_forward":
        args = (out, mean, rstd, x, w, b)
        return lambda: be.layernorm_forward(*args), args
    if op == "fused_residual_layernorm_forward":
        residual = be.zeros((B, T, C), be.dtype)
        args = (residual, out, mean, rstd, x, dev(B, T, C), w, b)
        return lambda: be.fused_residual_layernorm_forward(*args), args
    # the saved statistics the backward reads
    be.layernorm_forward(out, mean, rstd, x, w, b)
    dinp, dw, db = dev(B, T, C), be.zeros(C, be.dtype), be.zeros(C, be.dtype)
    args = (dinp, dw, db, dev(B, T, C), x, w, mean, rstd)
    return lambda: be.layernorm_backward(*args, accumulate=False, fused=fuse), args + (False, fuse)


def time_op(be, call, reps):
    """Microseconds per call of call(), --reps calls captured as one graph (host
    launches not timed)."""
    rt = be.rt
    # eager first: scratch buffers allocated here
    call()
    rt.begin_capture()
    try:
        for _ in range(reps):
            call()
    except BaseException:
        rt.end_capture()
        raise
    graph = rt.end_capture()
    graph.launch()                                                # untimed: first-launch costs
    start, end = rt.event(), rt.event()
    start.record()
    graph.launch()
    end.record()
    return rt.elapsed_ms(start, end) * 1e3 / reps


def parse_set(text):
    """'name=v1,v2' -> (name, [v1, v2]), checked against the launch settings."""
    name, sep, values = text.partition("=")
    if not sep or name not in LAUNCH_SETTINGS:
        raise ValueError(f"--set {text}: expected NAME=V1,V2,... with NAME one of "
                         f"{', '.join(LAUNCH_SETTINGS)}")
    try:
        return name, [int(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(f"--set {text}: the values must be integers") from None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python bench/op_bench.py", description=__doc__.split("\n")[0])
    p.add_argument("op", choices=OPS)
    p.add_argument("-b", type=int, default=4, help="batch size B (default 4)")
    p.add_argument("-t", type=int, default=1024, help="sequence length T (default 1024)")
    p.add_argument("-c", type=int, default=768, help="channels C (default 768, d12's)")
    p.add_argument("-v", "--vocab", type=int, default=50257,
                   help="fused_classifier: vocabulary V (default GPT-2's)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="the kernels' build (storage)")
    p.add_argument("--fuse", type=int, choices=(0, 1), default=1,
                   help="layernorm_backward: the one-pass kernel")
    p.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2",
                   help="a launch setting and the values to try (several --set: every combination)")
    p.add_argument("--reps", type=int, default=100, help="calls in the timed graph (default 100)")
    p.add_argument("--runtime", choices=("cupy", "emu"), default="cupy",
                   help="emu: CPU emulator dry run")
    args = p.parse_args(argv)
    try:
        settings = [parse_set(s) for s in args.set]
    except ValueError as e:
        p.error(str(e))
    if min(args.b, args.t, args.c, args.vocab, args.reps) < 1:
        p.error("-b, -t, -c, -v and --reps must be >= 1")
    try:
        be = get_backend("emu" if args.runtime == "emu" else "cuda", precision=args.precision)
    except BackendUnavailable as e:
        p.error(f"--runtime {args.runtime}: {e}")
    names = [name for name, _ in settings]
    for name, values in settings:                 # every value checked before anything is timed
        for value in values:
            try:
                setattr(be, name, value)
            except KernelArgumentError as e:
                p.error(f"--set {name}: {e}")
    print(f"{args.op} on {be.rt.device_name()}, {args.precision} storage, B={args.b} "
          f"T={args.t} C={args.c}, "
          f"{args.reps} calls a graph" + (" [emulated on the CPU, times are not GPU times]"
                                          if args.runtime == "emu" else ""))
    print("  ".join(names + ["us/call", "GB/s"]))
    for values in itertools.product(*[vals for _, vals in settings]):
        for name, value in zip(names, values):
            setattr(be, name, value)
        call, op_args = op_call(be, args.op, args.b, args.t, args.c, bool(args.fuse),
                                np.random.default_rng(0), args.vocab)
        us = time_op(be, call, args.reps)
        cost = op_cost(args.op, op_args)
        print("  ".join([f"{v:>{len(n)}}" for n, v in zip(names, values)]
                        + [f"{us:7.2f}", f"{cost.bytes / us / 1e3:5.1f}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
