"""Causal self-attention without keeping the (T,T) matrix (kernels/flash_attention.cu): the forward
pass saves lse, the log-sum-exp of each row of scores, and the backward pass recomputes the
probabilities from it, P = exp(q k^T / sqrt(HS) - lse). Here the scores of the rows given live only
during the call; the CUDA kernels never hold more than a tile of them."""
import math

import numpy as np


def heads(x, NH, part=0, parts=1):
    """(B,NH,T,HS) view of part `part` of x (B,T,parts*NH*HS): [q | k | v] has parts=3."""
    B, T, width = x.shape
    return x.reshape(B, T, parts, NH, width // parts // NH)[:, :, part].transpose(0, 2, 1, 3)


def causal_scores(q, k, scale):
    """(B,NH,T,T) = q k^T scale, -inf at the future (s > t)."""
    T = q.shape[2]
    scores = np.matmul(q, k.transpose(0, 1, 3, 2))
    scores *= scale
    scores += np.triu(np.full((T, T), -np.inf, scores.dtype), k=1)
    return scores


def flash_attention_forward(out, lse, inp):
    """inp (B,T,3C) = [q | k | v];  out (B,T,C) = softmax(q k^T / sqrt(HS), future masked) @ v,
    heads concatenated;  lse (B,NH,T) = logsumexp of each row of the scaled, masked scores."""
    NH = lse.shape[1]
    q, k, v = (heads(inp, NH, i, 3) for i in range(3))
    probs = causal_scores(q, k, 1.0 / math.sqrt(q.shape[-1]))
    row_max = probs.max(axis=-1, keepdims=True)
    probs -= row_max
    np.exp(probs, out=probs)
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total
    np.log(total[..., 0], out=lse)
    lse += row_max[..., 0]
    heads(out, NH)[...] = np.matmul(probs, v)


def flash_attention_backward(dinp, dout, inp, out, lse):
    """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), inp (B,T,3C), out (B,T,C), lse (B,NH,T):
    P = exp(scale q k^T - lse) (0 in the future);  dV = P^T dout;  dP = dout v^T;
    D = rowsum(dout * out);  dS = P (dP - D) scale;  dQ = dS k;  dK = dS^T q."""
    NH = lse.shape[1]
    q, k, v = (heads(inp, NH, i, 3) for i in range(3))
    dq, dk, dv = (heads(dinp, NH, i, 3) for i in range(3))
    do, o = heads(dout, NH), heads(out, NH)
    scale = 1.0 / math.sqrt(q.shape[-1])
    probs = causal_scores(q, k, scale)
    probs -= lse[..., None]
    np.exp(probs, out=probs)                                   # the forward's probabilities
    dv[...] = np.matmul(probs.transpose(0, 1, 3, 2), do)
    dprobs = np.matmul(do, v.transpose(0, 1, 3, 2))
    dprobs -= np.einsum("bhtd,bhtd->bht", do, o)[..., None]    # D = rowsum(dout out) = rowsum(P dP)
    dprobs *= probs
    dprobs *= scale
    dq[...] = np.matmul(dprobs, k)
    dk[...] = np.matmul(dprobs.transpose(0, 1, 3, 2), q)
