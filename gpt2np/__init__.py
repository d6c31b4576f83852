"""gpt2np: GPT-2 training from scratch with hand-written NumPy and CUDA forward/backward passes."""
import os

# After each GEMM, OpenBLAS's worker threads spin for 2**28 cycles (its default) before they sleep. On a
# few cores that spinning takes the cores from the NumPy work between GEMMs (AdamW, GELU, attention):
# measured ~9% of a d12 CPU step on 2 cores. OpenBLAS reads this once, when NumPy loads it, so it only
# takes effect when gpt2np is imported before NumPy (train.py does); a value the user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .config import GPT2Config, preset  # noqa: E402

__all__ = ["GPT2Config", "preset"]
__version__ = "0.1.0"
