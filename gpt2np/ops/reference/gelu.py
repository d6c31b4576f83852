"""GELU, tanh form (kernels/gelu.cu)."""
import math

import numpy as np

GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBE = 0.044715


def gelu_forward(out, inp):
    """out = 0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3), x = inp (any shape).
    In float32 as u = ((x x 0.044715 + 1) x) sqrt(2/pi), out = ((tanh u + 1) x) 0.5: the emulator's
    GELU epilogue takes this order too, bit for bit."""
    x = inp
    np.multiply(x, x, out=out)
    out *= GELU_CUBE
    out += 1.0
    out *= x
    out *= GELU_SCALE                                          # u
    np.tanh(out, out=out)
    out += 1.0
    out *= x
    out *= 0.5


def gelu_backward(dinp, inp, dout):
    """dinp = dout * gelu'(x), x = inp (any shape); dinp may be dout.
    gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 x^2)."""
    x = inp
    th = np.tanh((x * x * GELU_CUBE + 1.0) * x * GELU_SCALE)
    slope = (x * x * (3.0 * GELU_CUBE) + 1.0) * (GELU_SCALE * 0.5) * x * (1.0 - th * th)
    np.multiply(dout, slope + (th + 1.0) * 0.5, out=dinp)
