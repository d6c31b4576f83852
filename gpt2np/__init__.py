"""gpt2np: GPT-2 training from scratch with hand-written NumPy and CUDA forward/backward passes."""
import os
import sys

# After each GEMM, OpenBLAS's worker threads spin for 2**28 cycles (its default) before they sleep.
# On a few cores that spinning takes the cores from the NumPy work between GEMMs (AdamW, GELU,
# attention): a few percent of a CPU step (docs/benchmarks.md). OpenBLAS reads this once, when NumPy
# loads it, so it only takes effect when gpt2np is imported before NumPy (train.py does); a
# value the user set wins.
# Imported after NumPy, gpt2np cannot set it: the numpy backend then warns once.
OPENBLAS_TIMEOUT_MISSED = "numpy" in sys.modules and "OPENBLAS_THREAD_TIMEOUT" not in os.environ
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from gpt2np.config import GPT2Config, preset  # noqa: E402

__all__ = ["GPT2Config", "preset"]
__version__ = "0.1.0"
