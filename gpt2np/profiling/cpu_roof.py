"""The CPU's roofline, measured where the profile runs: a CPU has no datasheet peak that a NumPy program reaches
(clocks, vector units, BLAS builds and memory channels differ), so the profiler times the two ceilings itself.

    compute   the best of a few float32 GEMMs of 1536 x 1536 x 1536 through NumPy's BLAS on all its threads: what
              the step's matmuls could run at (and the ceiling for the C loops too, whose FMAs are the same units)
    memory    the best of a few `a += b` over two 64 MiB float32 arrays (beyond the caches; in huge pages where the
              kernel offers them, as the backend's buffers), split over the backend's threads: 3 x 64 MiB moved
              per pass, the traffic the op contract's bytes count

about 0.3 s. The Roofline's device names the figures and says they were measured, so a report read later says what
its "% of peak" is a percentage of. On a machine shared with other work the ceilings move with it; a kernel can then
read above 100%.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gpt2np.backends.numpy.huge_pages import huge_zeros
from gpt2np.profiling.gpu_specs import Roofline

GEMM_SIZE = 1536
STREAM_BYTES = 64 << 20


def best_seconds(fn, repeats):
    """The fastest of `repeats` timed calls of fn(), after one untimed (pages touched, threads started)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_flops(repeats: int) -> float:
    """FLOP/s of the best of `repeats` float32 GEMMs of GEMM_SIZE^3 (NumPy's BLAS, its own threads)."""
    n = GEMM_SIZE
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    return 2 * n ** 3 / best_seconds(lambda: np.matmul(a, b, out=c), repeats)


def add_bandwidth(threads: int, repeats: int, nbytes: int = 0) -> float:
    """Bytes/s of the best of `repeats` x += y over arrays of nbytes (default STREAM_BYTES), split over `threads`
    threads (3 x the array size moved: x and y read, x written)."""
    x = huge_zeros((nbytes or STREAM_BYTES) // 4, np.float32)    # the memory the backend's buffers are in
    y = huge_zeros(x.shape, np.float32)
    x += 1.0
    y += 1.0
    bounds = np.linspace(0, x.size, threads + 1).astype(int)
    parts = [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(threads) as pool:
        return 3 * x.nbytes / best_seconds(lambda: list(pool.map(lambda s: np.add(x[s], y[s], out=x[s]), parts)),
                                            repeats)


def measure(threads: int, repeats: int = 3) -> Roofline:
    """The CPU's Roofline now: GEMM FLOP/s (both ceilings) and in-place add bandwidth over `threads` threads."""
    threads = max(1, threads)
    flops, bandwidth = gemm_flops(repeats), add_bandwidth(threads, repeats)
    device = (f"cpu ({threads} thread{'' if threads == 1 else 's'}; measured now: GEMM {flops / 1e9:.0f} "
              f"GFLOP/s, a += b {bandwidth / 1e9:.0f} GB/s)")
    return Roofline(device, flops, bandwidth, flops)
