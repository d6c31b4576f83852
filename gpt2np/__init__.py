"""gpt2np: GPT-2 training from scratch with hand-written NumPy and CUDA forward/backward passes."""
from .config import GPT2Config, preset

__all__ = ["GPT2Config", "preset"]
__version__ = "0.1.0"
