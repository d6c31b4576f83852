"""Parameters whose gradient is zero in exact arithmetic, so that two correct
implementations train them apart.

The key bias (qkvb's middle third) adds q . b_k to every score of a query's row, which the softmax
ignores: its gradient is round-off (~1e-9), and AdamW's m / (sqrt(v) + eps) turns round-off of the
size of eps into updates up to about lr a step, of either sign, different in every implementation.
Compare these against 2 x steps x lr; the rest element by element."""
import numpy as np

from gpt2np.tensors import param_shapes


def key_bias_mask(cfg) -> np.ndarray:
    """(num_parameters,) bool: True on the key biases."""
    masks = []
    for name, shape in param_shapes(cfg).items():
        mask = np.zeros(shape, bool)
        if name == "qkvb":
            mask[:, cfg.channels:2 * cfg.channels] = True
        masks.append(mask.reshape(-1))
    return np.concatenate(masks)
