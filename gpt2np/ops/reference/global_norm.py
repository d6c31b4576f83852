"""The gradients' squared global norm (kernels/global_norm.cu)."""
import math

import numpy as np

# One float32 partial sum per CHUNK elements: its rounding depends on CHUNK, so CHUNK is part of the
# results.
CHUNK = 1 << 17


def sum_squares(grads):
    """sum(grads^2) of one chunk (n), as float32 (np.dot), returned as a Python float."""
    return float(np.dot(grads, grads))


def global_norm_squared(grads):
    """sum(grads^2) of a flat buffer (n): one float32 sum per CHUNK, the chunks added exactly
    (math.fsum)."""
    return math.fsum(sum_squares(grads[lo:lo + CHUNK]) for lo in range(0, grads.size, CHUNK))
