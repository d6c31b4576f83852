"""huge_pages.huge_zeros: the numpy backends' large buffers (params, grads, m, v, activations) are
zero-filled arrays like np.zeros, 2 MiB-aligned, in a mapping the kernel was advised (MADV_HUGEPAGE)
to back with huge pages; small ones are plain np.zeros. Whether the kernel then hands out huge pages
depends on its memory, so the tests check the advice (the mapping's "hg" flag in
/proc/self/smaps), not the pages."""
import mmap
import sys

import numpy as np
import pytest

from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.backends.numpy.bf16 import Bf16NumpyBackend
from gpt2np.backends.numpy.huge_pages import HUGE_MIN, HUGE_PAGE, huge_zeros
from gpt2np.profiling import cpu_roof


def vm_flags(address):
    """The VmFlags of the mapping of this process that holds `address` (Linux /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


advice_offered = pytest.mark.skipif(not sys.platform.startswith("linux")
                                    or not hasattr(mmap, "MADV_HUGEPAGE"),
                                    reason="MADV_HUGEPAGE is Linux's")


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float64])
def test_large_array_is_zeros_aligned_and_writable(dtype):
    # just over HUGE_MIN, not whole pages
    shape = (HUGE_MIN // np.dtype(dtype).itemsize // 1000 + 3, 1000)
    a = huge_zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    assert a.ctypes.data % HUGE_PAGE == 0
    # the last element is ours
    a[-1, -1] = 7
    assert a.sum() == 7


def test_small_array_is_plain_zeros():
    a = huge_zeros((HUGE_MIN // 4 - 1,), np.float32)
    assert isinstance(a.base, np.ndarray) is False and a.flags.owndata and not a.any()


@advice_offered
def test_large_array_is_advised():
    big = huge_zeros((HUGE_MIN // 4,), np.float32)
    assert "hg" in vm_flags(big.ctypes.data)
    assert "hg" in vm_flags(big.ctypes.data + big.nbytes - 1)


@advice_offered
@pytest.mark.parametrize("backend", [NumpyBackend(threads=1, fused=False),
                                     Bf16NumpyBackend(threads=1)], ids=["fp32", "bf16"])
def test_backends_allocate_large_buffers_advised(backend):
    a = backend.zeros((HUGE_MIN // 2,))                  # >= HUGE_MIN bytes in either dtype
    assert a.dtype == backend.dtype and not a.any() and a.ctypes.data % HUGE_PAGE == 0
    assert "hg" in vm_flags(a.ctypes.data)


def test_bandwidth_probe_runs_on_the_same_memory(monkeypatch):
    made = []

    def spy(shape, dtype):
        made.append(huge_zeros(shape, dtype))
        return made[-1]

    monkeypatch.setattr(cpu_roof, "huge_zeros", spy)
    assert cpu_roof.add_bandwidth(threads=2, repeats=1, nbytes=HUGE_MIN) > 0
    assert [a.nbytes for a in made] == [HUGE_MIN, HUGE_MIN]


def test_a_mapping_that_fails_is_a_memory_error(monkeypatch):
    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_memory)
    with pytest.raises(MemoryError, match="Cannot allocate memory"):
        huge_zeros((HUGE_MIN,), np.float32)
