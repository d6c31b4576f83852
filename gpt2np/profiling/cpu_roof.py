"""The CPU's roofline, measured where the profile runs: a CPU has no datasheet peak that a NumPy
program reaches (clocks, vector units, BLAS builds and memory channels differ), so the profiler
times the two ceilings itself.

    compute   the best of a few float32 GEMMs of 1536 x 1536 x 1536 through NumPy's BLAS on all its
              threads: what the step's matmuls could run at (and the ceiling for the C loops too,
              whose FMAs are the same units)
    memory    the best of a few `a += b` over two float32 arrays of 1, 4, 16 and 64 MiB (in huge
              pages where the kernel offers them, as the backend's buffers), split over the
              backend's threads: 3 arrays' bytes moved per pass, the traffic the op contract's bytes
              count. The fastest size is the one whose arrays fit the fastest cache that holds
              them: an op on a few MiB (AdamW on one small tensor) streams from a cache too, so the
              memory ceiling is the caches' bandwidth, not main memory's.

about 0.3 s. The Roofline's device names the figures and says they were measured, so a report read
later says what its "% of peak" is a percentage of. A measured ceiling is a good bound, not a proof
(a machine shared with other work, another access pattern): covering() raises it where an op of the
profile ran faster, and says so, so that no op shows more than 100% of it.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gpt2np.backends.numpy.huge_pages import huge_zeros
from gpt2np.profiling.gpu_specs import Roofline

GEMM_SIZE = 1536
STREAM_BYTES = 64 << 20          # the largest array of the bandwidth test: beyond the caches
STREAM_SIZES = 4                 # arrays of STREAM_BYTES, its quarter, its sixteenth, ...


def best_seconds(fn, repeats):
    """The fastest of `repeats` timed calls of fn(), after one untimed (pages touched, threads
    started)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_flops(repeats: int) -> float:
    """FLOP/s of the best of `repeats` float32 GEMMs of GEMM_SIZE^3 (NumPy's BLAS, its own
    threads)."""
    n = GEMM_SIZE
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    return 2 * n ** 3 / best_seconds(lambda: np.matmul(a, b, out=c), repeats)


def add_bandwidth(threads: int, repeats: int, nbytes: int = 0) -> float:
    """Bytes/s of the best of `repeats` x += y over arrays of nbytes (default STREAM_BYTES), split
    over `threads` threads (3 x the array size moved: x and y read, x written)."""
    x = huge_zeros((nbytes or STREAM_BYTES) // 4, np.float32)    # as the backend's buffers are
    y = huge_zeros(x.shape, np.float32)
    x += 1.0
    y += 1.0
    bounds = np.linspace(0, x.size, threads + 1).astype(int)
    parts = [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]

    def add(part):
        np.add(x[part], y[part], out=x[part])

    with ThreadPoolExecutor(threads) as pool:
        return 3 * x.nbytes / best_seconds(lambda: list(pool.map(add, parts)), repeats)


def stream_sizes() -> list:
    """The array sizes of the bandwidth test in bytes, smallest first: STREAM_BYTES, its quarter,
    its sixteenth, ..."""
    return [STREAM_BYTES >> 2 * i for i in reversed(range(STREAM_SIZES))]


def stream_bandwidth(threads: int, repeats: int) -> float:
    """Bytes/s of the fastest `a += b` over the arrays of stream_sizes(): the bandwidth of the
    fastest memory level that an op's data can sit in."""
    return max(add_bandwidth(threads, repeats, nbytes) for nbytes in stream_sizes())


def measure(threads: int, repeats: int = 3) -> Roofline:
    """The CPU's Roofline now: GEMM FLOP/s (both ceilings) and the best in-place add bandwidth
    over `threads` threads."""
    threads = max(1, threads)
    flops, bandwidth = gemm_flops(repeats), stream_bandwidth(threads, repeats)
    sizes = stream_sizes()
    device = (f"cpu ({threads} thread{'' if threads == 1 else 's'}; measured now: GEMM "
              f"{flops / 1e9:.0f} GFLOP/s, best a += b ({sizes[0] / 2**20:g}-{sizes[-1] / 2**20:g} "
              f"MiB arrays) {bandwidth / 1e9:.0f} GB/s)")
    return Roofline(device, flops, bandwidth, flops)


def fastest(records, amount):
    """(rate per second, record) of the record with the most amount(record) per second of its
    time, computed as report.classify computes a record's rate; (0.0, None) when no record took
    any time."""
    best = (0.0, None)
    for r in records:
        if r.duration_ns > 0:
            rate = amount(r) / (r.duration_ns * 1e-9)
            if rate > best[0]:
                best = (rate, r)
    return best


def covering(roof: Roofline, records) -> Roofline:
    """`roof` with each measured ceiling (bandwidth, FLOP/s) raised to the fastest record's rate
    where a record ran faster, so that no record is above 100% of it; its device name then says
    which record set which ceiling. The same `roof` where none ran faster."""
    bandwidth, by_bytes = fastest(records, lambda r: r.bytes)
    flops, by_flops = fastest(records, lambda r: r.flops)
    raised = []
    if roof.peak_bw and bandwidth > roof.peak_bw:
        raised.append(f"{by_bytes.op or by_bytes.kernel} at {bandwidth / 1e9:.0f} GB/s")
    if any(peak and flops > peak for peak in (roof.peak_flops, roof.matmul_peak_flops)):
        raised.append(f"{by_flops.op or by_flops.kernel} at {flops / 1e9:.0f} GFLOP/s")
    if not raised:
        return roof

    def lifted(peak, rate):
        return max(peak, rate) if peak else peak

    device = f"{roof.device.removesuffix(')')}; raised to the fastest op's: {' and '.join(raised)})"
    return Roofline(device, lifted(roof.peak_flops, flops), lifted(roof.peak_bw, bandwidth),
                    lifted(roof.matmul_peak_flops, flops))
