"""The NumPy backend: every layer's forward and backward pass, vectorized, float32.

This is the reference every other backend (and every CUDA kernel) is checked against. Each op writes
into buffers the caller preallocated; "=" overwrites, "+=" accumulates. Parameter gradients always
accumulate (gradient accumulation over micro-batches, and wte is used twice); activation gradients
are overwritten except layernorm_backward's dinp, which accumulates into the residual stream's gradient.

Shapes: B batch, T time, C channels, OC output channels, NH heads, HS = C/NH, V vocab, Vp padded vocab.
"""
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

LN_EPS = 1e-5
GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBE = 0.044715

# AdamW and the gradient norm stream over hundreds of MB; doing them in cache-sized chunks on
# all cores keeps them at memory speed (NumPy ufuncs release the GIL).
CHUNK = 1 << 17


class NumpyBackend:
    """CPU backend. Arrays are NumPy arrays; `dtype` is the activation/parameter dtype."""

    name = "numpy"

    def __init__(self, dtype=np.float32, threads=None):
        self.dtype = np.dtype(dtype)
        self.threads = threads or min(8, _cpu_count())
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._scratch = {}
        self._local = threading.local()

    # ---- memory -------------------------------------------------------------------------
    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype or self.dtype)

    def from_host(self, array, dtype=None):
        return np.ascontiguousarray(array, dtype=dtype)

    def to_host(self, array):
        return np.array(array, copy=True)

    def copy_(self, dst, src):
        np.copyto(dst, src)

    def fill_(self, array, value):
        array.fill(value)

    def synchronize(self):
        pass

    def scratch(self, key, shape, dtype=None):
        """A reusable work buffer (grown on demand), never part of the model's state."""
        dtype = np.dtype(dtype or self.dtype)
        size = int(np.prod(shape))
        buf = self._scratch.get((key, dtype))
        if buf is None or buf.size < size:
            buf = np.empty(size, dtype)
            self._scratch[(key, dtype)] = buf
        return buf[:size].reshape(shape)

    # ---- encoder ------------------------------------------------------------------------
    def encoder_forward(self, out, inp, wte, wpe):
        """out (B,T,C) = wte[inp] + wpe[:T];  inp (B,T) int32, wte (Vp,C), wpe (maxT,C)."""
        T = inp.shape[1]
        np.take(wte, inp, axis=0, out=out)
        out += wpe[:T]

    def encoder_backward(self, dwte, dwpe, dout, inp):
        """dwte[inp[b,t]] += dout[b,t];  dwpe[t] += sum_b dout[b,t]."""
        T, C = dout.shape[1], dout.shape[2]
        np.add.at(dwte, inp.reshape(-1), dout.reshape(-1, C))
        dwpe[:T] += dout.sum(axis=0)

    # ---- layernorm ----------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T)."""
        np.mean(inp, axis=-1, out=mean)
        np.subtract(inp, mean[..., None], out=out)            # out holds x - mean
        var = np.einsum("...c,...c->...", out, out) / inp.shape[-1]
        np.divide(1.0, np.sqrt(var + LN_EPS), out=rstd, casting="unsafe")
        out *= rstd[..., None]
        out *= weight
        out += bias

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        """dinp (B,T,C) +=, dweight (C) +=, dbias (C) +=, from dout and the saved mean, rstd."""
        C = inp.shape[-1]
        norm = self.scratch("ln_norm", inp.shape)
        np.subtract(inp, mean[..., None], out=norm)
        norm *= rstd[..., None]                                # x_hat
        dbias += dout.reshape(-1, C).sum(axis=0)
        dweight += np.einsum("nc,nc->c", dout.reshape(-1, C), norm.reshape(-1, C))
        dnorm = self.scratch("ln_dnorm", inp.shape)
        np.multiply(dout, weight, out=dnorm)                   # d x_hat
        dnorm_mean = dnorm.mean(axis=-1, keepdims=True)
        dnorm_norm_mean = np.einsum("...c,...c->...", dnorm, norm)[..., None] / C
        dnorm -= dnorm_mean
        norm *= dnorm_norm_mean
        dnorm -= norm
        dnorm *= rstd[..., None]
        dinp += dnorm

    # ---- matmul -------------------------------------------------------------------------
    def matmul_forward(self, out, inp, weight, bias):
        """out (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC)."""
        OC, C = weight.shape
        np.matmul(inp.reshape(-1, C), weight.T, out=out.reshape(-1, OC))
        if bias is not None:
            out += bias

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, accumulate=True):
        """dinp (B,T,C) = dout @ weight;  dweight (OC,C) += dout^T @ inp;  dbias (OC) += sum dout.

        accumulate=False overwrites dweight instead (the caller knows it holds zeros: one pass less).
        """
        OC, C = weight.shape
        dout2 = dout.reshape(-1, OC)
        np.matmul(dout2, weight, out=dinp.reshape(-1, C))
        if accumulate:
            dw = self.scratch("mm_dweight", weight.shape)
            np.matmul(dout2.T, inp.reshape(-1, C), out=dw)
            dweight += dw
        else:
            np.matmul(dout2.T, inp.reshape(-1, C), out=dweight)
        if dbias is not None:
            dbias += dout2.sum(axis=0)

    # ---- attention ----------------------------------------------------------------------
    def attention_forward(self, out, qkvr, att, inp):
        """Causal self-attention, heads batched.

        inp (B,T,3C) = [q | k | v];  qkvr (3,B,NH,T,HS) saves them per head;
        att (B,NH,T,T) = softmax(q k^T / sqrt(HS)) with the future masked (exact zeros);
        out (B,T,C) = att @ v with heads concatenated.
        """
        B, T, C3 = inp.shape
        _, _, NH, _, HS = qkvr.shape
        qkvr[...] = inp.reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4)
        q, k, v = qkvr
        np.matmul(q, k.transpose(0, 1, 3, 2), out=att)
        att *= 1.0 / math.sqrt(HS)
        att += self._causal_mask(T)                           # -inf above the diagonal
        att -= att.max(axis=-1, keepdims=True)
        np.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)
        y = self.scratch("att_y", (B, NH, T, HS))
        np.matmul(att, v, out=y)
        out.reshape(B, T, NH, HS)[...] = y.transpose(0, 2, 1, 3)

    def _causal_mask(self, T):
        """(T, T): 0 where a query may look (t2 <= t), -inf at the future."""
        mask = self._scratch.get(("causal", T))
        if mask is None:
            mask = np.triu(np.full((T, T), -np.inf, self.dtype), k=1)
            self._scratch[("causal", T)] = mask
        return mask

    def attention_backward(self, dinp, dout, qkvr, att):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), the saved qkvr (3,B,NH,T,HS) and att (B,NH,T,T)."""
        B, T, C = dout.shape
        _, _, NH, _, HS = qkvr.shape
        q, k, v = qkvr
        dy = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)          # (B,NH,T,HS)
        dqkvr = self.scratch("att_dqkvr", qkvr.shape)
        dq, dk, dv = dqkvr
        np.matmul(att.transpose(0, 1, 3, 2), dy, out=dv)
        datt = self.scratch("att_datt", att.shape)
        np.matmul(dy, v.transpose(0, 1, 3, 2), out=datt)
        # softmax backward: dpre = att * (datt - sum(datt * att)); masked entries have att == 0
        datt -= np.einsum("bhts,bhts->bht", datt, att)[..., None]
        datt *= att
        datt *= 1.0 / math.sqrt(HS)
        np.matmul(datt, k, out=dq)
        np.matmul(datt.transpose(0, 1, 3, 2), q, out=dk)
        dinp.reshape(B, T, 3, NH, HS)[...] = dqkvr.transpose(1, 3, 0, 2, 4)

    # ---- gelu ---------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
        np.multiply(inp, inp, out=out)
        out *= GELU_CUBE
        out += 1.0
        out *= inp
        out *= GELU_SCALE
        np.tanh(out, out=out)
        out += 1.0
        out *= inp
        out *= 0.5

    def gelu_backward(self, dinp, inp, dout):
        """dinp = dout * gelu'(inp); dinp may alias dout."""
        x2 = self.scratch("gelu_x2", inp.shape)
        np.multiply(inp, inp, out=x2)
        u = self.scratch("gelu_u", inp.shape)
        np.multiply(x2, GELU_CUBE, out=u)
        u += 1.0
        u *= inp
        u *= GELU_SCALE                                       # u = s (x + a x^3)
        th = np.tanh(u, out=u)
        # gelu' = 0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 a x^2)
        x2 *= 3.0 * GELU_CUBE
        x2 += 1.0
        x2 *= GELU_SCALE * 0.5
        x2 *= inp
        sech2 = np.multiply(th, th, out=self.scratch("gelu_sech2", inp.shape))
        np.subtract(1.0, sech2, out=sech2)
        x2 *= sech2
        th += 1.0
        th *= 0.5
        x2 += th
        np.multiply(dout, x2, out=dinp)

    # ---- residual -----------------------------------------------------------------------
    def residual_forward(self, out, inp1, inp2):
        """out = inp1 + inp2."""
        np.add(inp1, inp2, out=out)

    def residual_backward(self, dinp1, dinp2, dout):
        """dinp1 += dout; dinp2 += dout (the model realises this by accumulating into dresidual)."""
        dinp1 += dout
        dinp2 += dout

    # ---- classifier ---------------------------------------------------------------------
    def fused_classifier(self, logits, losses, targets, V, dloss, write_dlogits):
        """Softmax + cross-entropy over the real vocabulary, optionally dlogits in place.

        logits (B,T,Vp), losses (B,T) = logsumexp(logits[:V]) - logits[target], targets (B,T) int32.
        With write_dlogits, logits becomes dlogits = (softmax - onehot(target)) * dloss over [:V]
        and 0 over the padding [V:Vp].
        """
        B, T, Vp = logits.shape
        rows = logits.reshape(-1, Vp)
        flat_targets = targets.reshape(-1)
        real = rows[:, :V]
        row_max = real.max(axis=1)
        target_logit = rows[np.arange(rows.shape[0]), flat_targets]
        if write_dlogits:
            probs = real                                      # reuse the logits buffer
        else:
            probs = self.scratch("cls_exp", real.shape)
        np.subtract(real, row_max[:, None], out=probs)
        np.exp(probs, out=probs)
        row_sum = probs.sum(axis=1)
        losses.reshape(-1)[...] = np.log(row_sum) + row_max - target_logit
        if write_dlogits:
            probs *= (dloss / row_sum)[:, None]
            rows[np.arange(rows.shape[0]), flat_targets] -= dloss
            rows[:, V:] = 0.0

    # ---- optimizer ----------------------------------------------------------------------
    def adamw_update(self, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
        """AdamW (decoupled weight decay, bias correction) on flat float32 segments, in place."""
        bc1 = 1.0 - beta1 ** t
        bc2 = 1.0 - beta2 ** t
        step_size = lr / bc1
        inv_sqrt_bc2 = 1.0 / math.sqrt(bc2)
        decay = 1.0 - lr * weight_decay

        def chunk(lo, hi):
            p, g, mm, vv = params[lo:hi], grads[lo:hi], m[lo:hi], v[lo:hi]
            tmp, upd = self._thread_scratch(hi - lo, params.dtype)
            np.multiply(g, grad_scale * (1.0 - beta1), out=tmp)
            mm *= beta1
            mm += tmp                                         # m = b1 m + (1 - b1) g
            np.multiply(g, grad_scale, out=tmp)
            tmp *= tmp
            tmp *= 1.0 - beta2
            vv *= beta2
            vv += tmp                                         # v = b2 v + (1 - b2) g^2
            np.sqrt(vv, out=upd)
            upd *= inv_sqrt_bc2
            upd += eps                                        # sqrt(vhat) + eps
            np.divide(mm, upd, out=upd)
            upd *= step_size                                  # lr * mhat / (sqrt(vhat) + eps)
            if weight_decay != 0.0:
                p *= decay                                    # p -= lr * wd * p
            p -= upd

        self._chunked(chunk, params.size)

    def global_norm_squared(self, grads):
        """sum(grads^2) of a flat buffer, accumulated per chunk in float64."""
        parts = self._chunked(lambda lo, hi: float(np.dot(grads[lo:hi], grads[lo:hi])), grads.size)
        return math.fsum(parts)

    def _thread_scratch(self, size, dtype):
        """Two work buffers private to the calling thread (AdamW's temporaries)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].size < size or bufs[0].dtype != dtype:
            bufs = self._local.bufs = (np.empty(size, dtype), np.empty(size, dtype))
        return bufs[0][:size], bufs[1][:size]

    def _chunked(self, fn, n):
        bounds = [(lo, min(lo + CHUNK * 16, n)) for lo in range(0, n, CHUNK * 16)]

        def run(span):
            lo, hi = span
            return [fn(a, min(a + CHUNK, hi)) for a in range(lo, hi, CHUNK)]

        results = self._pool.map(run, bounds) if self._pool else map(run, bounds)
        return [r for part in results for r in part]


def _cpu_count():
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
