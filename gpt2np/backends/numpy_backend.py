"""The NumPy backend: every layer's forward and backward pass, vectorized, float32.

This is the reference every other backend (and every CUDA kernel) is checked against. Each op writes
into buffers the caller preallocated; "=" overwrites, "+=" accumulates. Parameter gradients accumulate
(gradient accumulation over micro-batches, and wte is used twice) unless the op is called with
accumulate=False: right after zero_grad() the model has every op overwrite its gradient, so the buffer is
never filled with zeros. Activation gradients are overwritten except layernorm_backward's dinp, which
accumulates into the residual stream's gradient.

Shapes: B batch, T time, C channels, OC output channels, NH heads, HS = C/NH, V vocab, Vp padded vocab.

NumPy runs a ufunc on one core, so the ops split their rows (tokens, or batch entries for attention)
into one contiguous block per thread (ufuncs and BLAS release the GIL). Every row is computed the same
way whatever the split, and column sums (bias and LayerNorm gradients) run over all rows at once, so
results do not depend on the thread count.
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
# An op that touches fewer elements than this runs on the calling thread: a hand-off costs more
# (measured on 2 cores: LayerNorm at B*T = 256, C = 768 is faster inline, GELU and attention are not).
PARALLEL_MIN = 1 << 19


class NumpyBackend:
    """CPU backend. Arrays are NumPy arrays; `dtype` is the activation/parameter dtype."""

    name = "numpy"
    precision = "fp32"
    launches_kernels = False      # an op is one unit of work here; on_launch is never called
    on_launch = None

    def __init__(self, dtype=np.float32, threads=None):
        self.dtype = np.dtype(dtype)
        self.threads = threads or min(8, _cpu_count())
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._scratch = {}
        self._local = threading.local()

    def device_name(self):
        return "cpu"

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

    def encoder_backward(self, dwte, dwpe, dout, inp, accumulate=True):
        """dwte[inp[b,t]] += dout[b,t];  dwpe[t] += sum_b dout[b,t].

        accumulate=False overwrites dwpe (maxT,C) instead (rows T.. become 0); dwte always accumulates,
        since the tied lm_head wrote it first.
        """
        T, C = dout.shape[1], dout.shape[2]
        np.add.at(dwte, inp.reshape(-1), dout.reshape(-1, C))
        if accumulate:
            dwpe[:T] += dout.sum(axis=0)
        else:
            np.sum(dout, axis=0, out=dwpe[:T])
            dwpe[T:] = 0.0

    # ---- layernorm ----------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T)."""
        C = inp.shape[-1]
        out, mean, rstd, inp = out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1), inp.reshape(-1, C)

        def rows(lo, hi):                                      # out, mean, rstd, x of rows lo:hi
            o, mu, rs, x = out[lo:hi], mean[lo:hi], rstd[lo:hi], inp[lo:hi]
            np.mean(x, axis=-1, out=mu)
            np.subtract(x, mu[:, None], out=o)                 # o holds x - mean
            var = np.einsum("nc,nc->n", o, o) / C
            np.divide(1.0, np.sqrt(var + LN_EPS), out=rs, casting="unsafe")
            o *= rs[:, None]
            o *= weight
            o += bias

        self._parallel(rows, inp.shape[0], 2 * C)

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True):
        """dinp (B,T,C) +=, dweight (C) +=, dbias (C) +=, from dout and the saved mean, rstd.

        accumulate=False overwrites dweight and dbias instead (dinp always accumulates).
        """
        C = inp.shape[-1]
        N = inp.size // C
        dinp, dout, inp = dinp.reshape(N, C), dout.reshape(N, C), inp.reshape(N, C)
        mean, rstd = mean.reshape(N, 1), rstd.reshape(N, 1)
        norm = self.scratch("ln_norm", (N, C))                 # x_hat, kept for dweight
        dnorm = self.scratch("ln_dnorm", (N, C))
        work = self.scratch("ln_work", (N, C))

        def rows(lo, hi):
            xh, dxh, tmp, rs = norm[lo:hi], dnorm[lo:hi], work[lo:hi], rstd[lo:hi]
            np.subtract(inp[lo:hi], mean[lo:hi], out=xh)
            xh *= rs                                           # x_hat
            np.multiply(dout[lo:hi], weight, out=dxh)          # d x_hat
            dxh_mean = dxh.mean(axis=-1, keepdims=True)
            dxh_xh_mean = np.einsum("nc,nc->n", dxh, xh)[:, None] / C
            dxh -= dxh_mean
            np.multiply(xh, dxh_xh_mean, out=tmp)
            dxh -= tmp
            dxh *= rs
            dinp[lo:hi] += dxh

        self._parallel(rows, N, 3 * C)
        write_or_add(dbias, dout.sum(axis=0), accumulate)
        write_or_add(dweight, np.einsum("nc,nc->c", dout, norm), accumulate)

    # ---- matmul -------------------------------------------------------------------------
    def matmul_forward(self, out, inp, weight, bias):
        """out (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC)."""
        OC, C = weight.shape
        np.matmul(inp.reshape(-1, C), weight.T, out=out.reshape(-1, OC))
        if bias is not None:
            out += bias

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, accumulate=True):
        """dinp (B,T,C) = dout @ weight;  dweight (OC,C) += dout^T @ inp;  dbias (OC) += sum dout over (B,T).

        accumulate=False overwrites dweight and dbias instead (their old contents are ignored).
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
            write_or_add(dbias, dout2.sum(axis=0), accumulate)

    # ---- attention ----------------------------------------------------------------------
    def attention_forward(self, out, qkvr, att, inp):
        """Causal self-attention, heads batched.

        inp (B,T,3C) = [q | k | v];  qkvr (3,B,NH,T,HS) saves them per head;
        att (B,NH,T,T) = softmax(q k^T / sqrt(HS)) with the future masked (exact zeros);
        out (B,T,C) = att @ v with heads concatenated.
        """
        B, T, C3 = inp.shape
        _, _, NH, _, HS = qkvr.shape
        mask = self._causal_mask(T)                            # -inf above the diagonal
        y_all = self.scratch("att_y", (B, NH, T, HS))

        def batch(lo, hi):                                     # batch entries lo:hi
            qkvr[:, lo:hi] = inp[lo:hi].reshape(hi - lo, T, 3, NH, HS).transpose(2, 0, 3, 1, 4)
            q, k, v = qkvr[:, lo:hi]
            a, y = att[lo:hi], y_all[lo:hi]
            np.matmul(q, k.transpose(0, 1, 3, 2), out=a)
            a *= 1.0 / math.sqrt(HS)
            a += mask
            a -= a.max(axis=-1, keepdims=True)
            np.exp(a, out=a)
            a /= a.sum(axis=-1, keepdims=True)
            np.matmul(a, v, out=y)
            out[lo:hi].reshape(hi - lo, T, NH, HS)[...] = y.transpose(0, 2, 1, 3)

        self._parallel(batch, B, NH * T * (T + 4 * HS))

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
        dqkvr_all = self.scratch("att_dqkvr", qkvr.shape)
        datt_all = self.scratch("att_datt", att.shape)

        def batch(lo, hi):                                     # batch entries lo:hi
            q, k, v = qkvr[:, lo:hi]
            a, datt, dqkvr = att[lo:hi], datt_all[lo:hi], dqkvr_all[:, lo:hi]
            dq, dk, dv = dqkvr
            dy = dout[lo:hi].reshape(hi - lo, T, NH, HS).transpose(0, 2, 1, 3)   # (b,NH,T,HS)
            np.matmul(a.transpose(0, 1, 3, 2), dy, out=dv)
            np.matmul(dy, v.transpose(0, 1, 3, 2), out=datt)
            # softmax backward: dpre = att * (datt - sum(datt * att)); masked entries have att == 0
            datt -= np.einsum("bhts,bhts->bht", datt, a)[..., None]
            datt *= a
            datt *= 1.0 / math.sqrt(HS)
            np.matmul(datt, k, out=dq)
            np.matmul(datt.transpose(0, 1, 3, 2), q, out=dk)
            dinp[lo:hi].reshape(hi - lo, T, 3, NH, HS)[...] = dqkvr.transpose(1, 3, 0, 2, 4)

        self._parallel(batch, B, NH * T * (2 * T + 6 * HS))

    # ---- gelu ---------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        """out (B,T,4C) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x = inp."""
        out_flat, inp_flat = out.reshape(-1), inp.reshape(-1)

        def part(lo, hi):
            y, x = out_flat[lo:hi], inp_flat[lo:hi]
            np.multiply(x, x, out=y)
            y *= GELU_CUBE
            y += 1.0
            y *= x
            y *= GELU_SCALE
            np.tanh(y, out=y)
            y += 1.0
            y *= x
            y *= 0.5

        self._parallel(part, inp_flat.size, 2)

    def gelu_backward(self, dinp, inp, dout):
        """dinp (B,T,4C) = dout * gelu'(inp); dinp may alias dout."""
        dinp_flat, inp_flat, dout_flat = dinp.reshape(-1), inp.reshape(-1), dout.reshape(-1)
        n = inp_flat.size
        x2_all, u_all, sech2_all = (self.scratch(key, n) for key in ("gelu_x2", "gelu_u", "gelu_sech2"))

        def part(lo, hi):
            x, x2, u, sech2 = inp_flat[lo:hi], x2_all[lo:hi], u_all[lo:hi], sech2_all[lo:hi]
            np.multiply(x, x, out=x2)
            np.multiply(x2, GELU_CUBE, out=u)
            u += 1.0
            u *= x
            u *= GELU_SCALE                                    # u = s (x + a x^3)
            th = np.tanh(u, out=u)
            # gelu' = 0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 a x^2)
            x2 *= 3.0 * GELU_CUBE
            x2 += 1.0
            x2 *= GELU_SCALE * 0.5
            x2 *= x
            np.multiply(th, th, out=sech2)
            np.subtract(1.0, sech2, out=sech2)
            x2 *= sech2
            th += 1.0
            th *= 0.5
            x2 += th
            np.multiply(dout_flat[lo:hi], x2, out=dinp_flat[lo:hi])

        self._parallel(part, n, 3)

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
        all_rows = logits.reshape(-1, Vp)
        all_targets, all_losses = targets.reshape(-1), losses.reshape(-1)
        exp_all = None if write_dlogits else self.scratch("cls_exp", (B * T, V))

        def part(lo, hi):                                      # rows (tokens) lo:hi
            rows, target = all_rows[lo:hi], all_targets[lo:hi]
            real = rows[:, :V]
            row_max = real.max(axis=1)
            target_logit = rows[np.arange(hi - lo), target]
            probs = real if write_dlogits else exp_all[lo:hi]  # dlogits reuse the logits buffer
            np.subtract(real, row_max[:, None], out=probs)
            np.exp(probs, out=probs)
            row_sum = probs.sum(axis=1)
            all_losses[lo:hi] = np.log(row_sum) + row_max - target_logit
            if write_dlogits:
                probs *= (dloss / row_sum)[:, None]
                rows[np.arange(hi - lo), target] -= dloss
                rows[:, V:] = 0.0

        self._parallel(part, B * T, 2 * Vp)

    # ---- optimizer ----------------------------------------------------------------------
    def adamw_update(self, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
        """AdamW (decoupled weight decay, bias correction) on flat float32 segments, in place."""
        # g = grad_scale * grads.  mhat / (sqrt(vhat) + eps) with mhat = m / bc1, vhat = v / bc2 equals
        # (sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2)): two passes fewer over each chunk.
        sqrt_bc2 = math.sqrt(1.0 - beta2 ** t)
        step_size = lr * sqrt_bc2 / (1.0 - beta1 ** t)
        eps_v = eps * sqrt_bc2
        decay = 1.0 - lr * weight_decay

        def chunk(lo, hi):
            p, g, mm, vv = params[lo:hi], grads[lo:hi], m[lo:hi], v[lo:hi]
            tmp, upd = self._thread_scratch(hi - lo, params.dtype)
            np.multiply(g, grad_scale * (1.0 - beta1), out=tmp)
            mm *= beta1
            mm += tmp                                         # m = b1 m + (1 - b1) g
            np.square(g, out=tmp)
            tmp *= grad_scale * grad_scale * (1.0 - beta2)
            vv *= beta2
            vv += tmp                                         # v = b2 v + (1 - b2) g^2
            np.sqrt(vv, out=upd)
            upd += eps_v
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
        """[fn(lo, hi) for each CHUNK of range(n)]; each thread takes an equal run of chunks in order."""
        chunks = [(lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK)]
        if self._pool is None or len(chunks) < 2:
            return [fn(lo, hi) for lo, hi in chunks]
        parts = min(self.threads, len(chunks))
        runs = [chunks[len(chunks) * i // parts:len(chunks) * (i + 1) // parts] for i in range(parts)]
        results = self._pool.map(lambda run: [fn(lo, hi) for lo, hi in run], runs)
        return [r for part in results for r in part]

    def _parallel(self, fn, rows, row_elements):
        """fn(lo, hi) over [0, rows) in one contiguous block of rows per thread.

        row_elements: how many array elements one row's work reads and writes; an op that touches
        fewer than PARALLEL_MIN elements in all runs inline.
        """
        parts = min(self.threads, rows) if rows * row_elements >= PARALLEL_MIN else 1
        if parts < 2 or self._pool is None:
            fn(0, rows)
            return
        bounds = [rows * i // parts for i in range(parts + 1)]
        futures = [self._pool.submit(fn, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
        fn(bounds[0], bounds[1])                              # the calling thread takes the first block
        for future in futures:
            future.result()


def write_or_add(out, value, accumulate):
    """out += value, or out = value when not accumulate."""
    if accumulate:
        out += value
    else:
        out[...] = value


def _cpu_count():
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
