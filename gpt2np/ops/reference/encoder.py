"""Token and position embeddings (kernels/encoder.cu)."""
import numpy as np


def encoder_forward(out, inp, wte, wpe):
    """out (B,T,C) = wte (Vp,C)[inp (B,T) int32] + wpe (maxT,C)[:T]."""
    T = inp.shape[1]
    np.take(wte, inp, axis=0, out=out)
    out += wpe[:T]


def encoder_backward(dwte, dwpe, dout, inp, accumulate=True):
    """dwte[inp[b,t]] += dout[b,t] (always adds: the tied lm_head wrote dwte first);
    dwpe[t] += sum_b dout[b,t], or = with accumulate=False (then rows T.. of dwpe become 0)."""
    T, C = dout.shape[1], dout.shape[2]
    np.add.at(dwte, inp.reshape(-1), dout.reshape(-1, C))      # a repeated token adds in turn
    if accumulate:
        dwpe[:T] += dout.sum(axis=0)
    else:
        np.sum(dout, axis=0, out=dwpe[:T])
        dwpe[T:] = 0.0
