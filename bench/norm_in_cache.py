"""Is the gradient norm cheaper taken while each weight gradient is still in cache?

The backward pass of d12's 12 blocks at B*T rows, as the step runs it: for each layer's four linear
layers (c_proj, c_fc, attn c_proj, c_attn: the model's backward order) the dinp GEMM and the dweight
GEMM, the dweights written into one flat gradient buffer. Two ways to get the sum of squares of
those 85M gradients:

  after     the step's way: the GEMMs, then one pass over the flat buffer
            (NumpyBackend.global_norm_squared)
  in cache  each dweight's sum of squares right after the GEMM that wrote it (the same C loop),
            summed at the end

Each round runs both, in turn; the medians over the rounds are printed with the norm's share of each
(time of the whole minus the GEMMs alone, measured in the same round). The two sums are the same
numbers up to rounding.

    python bench/norm_in_cache.py [--rounds 7] [--rows 256] [--threads 2] [--layers 12]
"""
import argparse
import math
import statistics
import time

# before NumPy: gpt2np sets OpenBLAS's thread timeout, which OpenBLAS reads when NumPy loads it
import gpt2np  # noqa: F401

# isort: split
import numpy as np

from gpt2np.backends.numpy.backend import NumpyBackend

C = 768
# (OC, IC) of c_proj, c_fc, attn c_proj, c_attn
SHAPES = [(C, 4 * C), (4 * C, C), (C, C), (3 * C, C)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, default=256, help="B*T (default 256: B=4, T=64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args(argv)
    be = NumpyBackend(threads=args.threads, math="fast")
    rng = np.random.default_rng(0)
    N = args.rows
    sizes = [oc * ic for oc, ic in SHAPES] * args.layers
    grads = np.empty(sum(sizes), np.float32)
    views, offset = [], 0
    for (oc, ic), size in zip(SHAPES * args.layers, sizes):
        views.append(grads[offset:offset + size].reshape(oc, ic))
        offset += size
    weights = [rng.standard_normal(v.shape).astype(np.float32) * 0.02 for v in views]
    douts = {oc: rng.standard_normal((N, oc)).astype(np.float32) for oc, _ in SHAPES}
    inps = {ic: rng.standard_normal((N, ic)).astype(np.float32) for _, ic in SHAPES}
    dinps = {ic: np.empty((N, ic), np.float32) for _, ic in SHAPES}

    def backward(in_cache):
        parts = []
        for w, dw in zip(weights, views):
            oc, ic = w.shape
            np.matmul(douts[oc], w, out=dinps[ic])
            np.matmul(douts[oc].T, inps[ic], out=dw)
            if in_cache:
                parts.append(be.global_norm_squared(dw.reshape(-1)))
        return math.fsum(parts) if in_cache else (be.global_norm_squared(grads) if in_cache is False
                                                  else None)

    def timed(in_cache):
        t0 = time.perf_counter()
        total = backward(in_cache)
        return time.perf_counter() - t0, total

    for mode in (None, False, True):                          # warm up
        timed(mode)
    runs = {None: [], False: [], True: []}
    sums = {}
    for _ in range(args.rounds):
        for mode in (None, False, True):
            seconds, sums[mode] = timed(mode)
            runs[mode].append(seconds)
    gemm = statistics.median(runs[None]) * 1e3
    print(f"d12 backward GEMMs of {args.layers} layers, {N} rows, {args.threads} threads, "
          f"{grads.size / 1e6:.0f}M weight gradients, median of {args.rounds} rounds")
    print(f"  GEMMs alone              : {gemm:8.1f} ms")
    for mode, name in ((False, "norm after"), (True, "norm in cache")):
        ms = statistics.median(runs[mode]) * 1e3
        norm = [(r - g) * 1e3 for r, g in zip(runs[mode], runs[None])]
        print(f"  GEMMs + {name:<15}  : {ms:8.1f} ms   the norm's share "
              f"{statistics.median(norm):6.1f} ms "
              f"(round by round {min(norm):.1f} to {max(norm):.1f})")
    print(f"  the sums of squares      : {sums[False]!r} after, {sums[True]!r} in cache")


if __name__ == "__main__":
    main()
