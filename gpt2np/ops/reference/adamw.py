"""AdamW: Adam with decoupled weight decay and bias correction (kernels/adamw.cu)."""
import math

import numpy as np


def adamw_update(params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step t >= 1 on flat float32 segments (n), in place, with g = grad_scale * grads:
        m = beta1 m + (1 - beta1) g
        v = beta2 v + (1 - beta2) g^2
        params -= lr (mhat / (sqrt(vhat) + eps) + weight_decay params)
    with mhat = m / bc1, vhat = v / bc2, bc1 = 1 - beta1^t, bc2 = 1 - beta2^t. The update is
    computed as lr (sqrt(bc2) / bc1) m / (sqrt(v) + eps sqrt(bc2)): the same value, two passes
    fewer."""
    sqrt_bc2 = math.sqrt(1.0 - beta2 ** t)
    step_size = lr * sqrt_bc2 / (1.0 - beta1 ** t)
    m *= beta1
    m += grads * (grad_scale * (1.0 - beta1))                   # the scale folded into 1 - beta1
    v *= beta2
    v += np.square(grads) * (grad_scale * grad_scale * (1.0 - beta2))
    if weight_decay != 0.0:
        params *= 1.0 - lr * weight_decay
    params -= m / (np.sqrt(v) + eps * sqrt_bc2) * step_size
