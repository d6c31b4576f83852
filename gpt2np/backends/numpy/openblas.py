"""A warning for the one case gpt2np cannot fix: NumPy loaded OpenBLAS before gpt2np set its thread
timeout.

gpt2np/__init__.py sets OPENBLAS_THREAD_TIMEOUT before NumPy loads, so that OpenBLAS's threads sleep
soon after each GEMM instead of spinning on the cores the NumPy work between GEMMs needs. Imported
after NumPy, it cannot: the numpy backend then warns once (warn_openblas_spin).
"""
import os
import sys
import warnings

import numpy as np

import gpt2np

_spin_warned = False


def warn_openblas_spin():
    """Warn once per process when NumPy loaded OpenBLAS before gpt2np set its thread timeout:
    OpenBLAS's threads then spin on the cores after every GEMM and slow a CPU step. Not where
    OpenBLAS runs one thread (OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS or OMP_NUM_THREADS, the first
    set, is 1) or NumPy's build names another BLAS (or none it can tell: a distribution's NumPy says
    "blas")."""
    global _spin_warned
    if _spin_warned or not gpt2np.OPENBLAS_TIMEOUT_MISSED or "openblas" not in blas_name():
        return
    names = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
    threads = next((os.environ[v] for v in names if os.environ.get(v)), "")
    if threads.strip() == "1":
        return
    _spin_warned = True
    warnings.warn("NumPy was imported before gpt2np, so OpenBLAS keeps its threads spinning after "
                  "every GEMM (a CPU training step ~5% slower): import gpt2np first, or set "
                  "OPENBLAS_THREAD_TIMEOUT=4 before NumPy loads", RuntimeWarning,
                  stacklevel=first_frame_outside(gpt2np))


def first_frame_outside(package) -> int:
    """warnings.warn's stacklevel that names the first caller outside `package` (the user's line,
    not get_backend's), counted from the function that calls warn."""
    root = os.path.dirname(os.path.abspath(package.__file__)) + os.sep
    frame, level = sys._getframe(2), 2          # 1 = this function's caller (the one calling warn)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def blas_name() -> str:
    """The name of NumPy's BLAS as its build configuration gives it (e.g. scipy-openblas), lower
    case; '' if unknown."""
    try:
        return str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]).lower()
    except Exception:                  # an older NumPy or another layout of its configuration
        return ""
