"""Host arrays in transparent huge pages (2 MiB) where Linux offers them on request (THP "madvise"
or "always").

The model's flat buffers (params, grads, m, v: 496 MB each at d12) are streamed whole by AdamW and
the gradient norm; on 4 KiB pages such a stream misses the TLB every 4 KiB, and in a VM each miss is
a two-level page walk; on 2 MiB pages the stream runs faster (docs/benchmarks.md has the
figures). The bandwidth the profiler and bench/cpu_step.py measure (cpu_roof.add_bandwidth) uses
the same memory, so their ceilings rise with it.
"""
import mmap

import numpy as np

HUGE_PAGE = 2 << 20
HUGE_MIN = 4 * HUGE_PAGE           # smaller arrays: np.zeros (a partly used huge page gains little)


def huge_zeros(shape, dtype):
    """np.zeros(shape, dtype); when it is HUGE_MIN bytes or more, in a private anonymous mapping the
    kernel is asked (madvise MADV_HUGEPAGE) to back with huge pages, 2 MiB-aligned so that every
    whole 2 MiB of it can be one. Where mmap offers no MADV_HUGEPAGE (not Linux) it is np.zeros;
    where the kernel refuses the advice the pages stay 4 KiB. The mapping is freed with the array
    (the array's base holds it)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN or advice is None:
        return np.zeros(shape, dtype)
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE,           # zero-filled
                            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:           # ENOMEM: np.zeros's error, so that callers see one kind
        raise MemoryError(f"cannot allocate {nbytes} bytes: {e.strerror}") from None
    raw = np.frombuffer(mapping, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    try:
        mapping.madvise(advice, start, nbytes - nbytes % HUGE_PAGE)
    except OSError:                # THP disabled in this kernel: 4 KiB pages, the same zeros
        pass
    return raw[start:start + nbytes].view(dtype).reshape(shape)
