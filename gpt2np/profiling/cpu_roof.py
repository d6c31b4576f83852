"""The CPU's roofline, measured where the profile runs: a CPU has no datasheet peak that a NumPy program reaches
(clocks, vector units, BLAS builds and memory channels differ), so the profiler times the two ceilings itself.

    compute   the best of a few float32 GEMMs of 1536 x 1536 x 1536 through NumPy's BLAS on all its threads: what
              the step's matmuls could run at (and the ceiling for the C loops too, whose FMAs are the same units)
    memory    the best of a few `a += b` over two 64 MiB float32 arrays (beyond the caches), split over the
              backend's threads: 3 x 64 MiB moved per pass, the traffic the op contract's bytes count

about 0.3 s. The Roofline's device names the figures and says they were measured, so a report read later says what
its "% of peak" is a percentage of. On a machine shared with other work the ceilings move with it; a kernel can then
read above 100%.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .gpu_specs import Roofline

GEMM_SIZE = 1536
STREAM_BYTES = 64 << 20


def _best(fn, repeats):
    import time
    fn()                                                   # warm-up: pages touched, threads started
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(threads: int, repeats: int = 3) -> Roofline:
    """The CPU's Roofline now: GEMM FLOP/s (both ceilings) and in-place add bandwidth over `threads` threads."""
    n = GEMM_SIZE
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    gemm_flops = 2 * n ** 3 / _best(lambda: np.matmul(a, b, out=c), repeats)
    del a, b, c
    x = np.ones(STREAM_BYTES // 4, np.float32)
    y = np.ones_like(x)
    bounds = np.linspace(0, x.size, max(1, threads) + 1).astype(int)
    parts = [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        def add():
            list(pool.map(lambda s: np.add(x[s], y[s], out=x[s]), parts))
        bandwidth = 3 * x.nbytes / _best(add, repeats)
    device = (f"cpu ({threads} thread{'' if threads == 1 else 's'}; measured now: GEMM {gemm_flops / 1e9:.0f} "
              f"GFLOP/s, a += b {bandwidth / 1e9:.0f} GB/s)")
    return Roofline(device, gemm_flops, bandwidth, gemm_flops)
