"""Causal self-attention that keeps the (T,T) probabilities for its backward pass
(kernels/attention.cu)."""
import functools
import math

import numpy as np


@functools.lru_cache(maxsize=8)
def causal_mask(T, dtype):
    """(T,T), read-only: 0 where query t may look (s <= t), -inf at the future."""
    mask = np.triu(np.full((T, T), -np.inf, dtype), k=1)
    mask.flags.writeable = False
    return mask


def attention_forward(out, qkvr, att, inp):
    """inp (B,T,3C) = [q | k | v];  qkvr (3,B,NH,T,HS) = them per head;
    att (B,NH,T,T) = softmax(q k^T / sqrt(HS)), the future masked (exact zeros);
    out (B,T,C) = att @ v, heads concatenated."""
    B, T, _ = inp.shape
    _, _, NH, _, HS = qkvr.shape
    qkvr[...] = inp.reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4)
    q, k, v = qkvr
    np.matmul(q, k.transpose(0, 1, 3, 2), out=att)
    att *= 1.0 / math.sqrt(HS)
    att += causal_mask(T, att.dtype)
    att -= att.max(axis=-1, keepdims=True)
    np.exp(att, out=att)
    att /= att.sum(axis=-1, keepdims=True)
    y = np.matmul(att, v)                                      # (B,NH,T,HS)
    out.reshape(B, T, NH, HS)[...] = y.transpose(0, 2, 1, 3)


def attention_backward(dinp, dout, qkvr, att):
    """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), the saved qkvr (3,B,NH,T,HS) and att (B,NH,T,T):
    dv = att^T dy;  datt = dy v^T;  dpre = att (datt - sum(datt att)) / sqrt(HS);
    dq = dpre k;  dk = dpre^T q."""
    B, T, C = dout.shape
    _, _, NH, _, HS = qkvr.shape
    q, k, v = qkvr
    dy = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)     # (B,NH,T,HS)
    dv = np.matmul(att.transpose(0, 1, 3, 2), dy)
    datt = np.matmul(dy, v.transpose(0, 1, 3, 2))
    datt -= np.einsum("bhts,bhts->bht", datt, att)[..., None]  # the masked entries have att == 0
    datt *= att
    datt *= 1.0 / math.sqrt(HS)
    dq = np.matmul(datt, k)
    dk = np.matmul(datt.transpose(0, 1, 3, 2), q)
    dinp.reshape(B, T, 3, NH, HS)[...] = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4)
