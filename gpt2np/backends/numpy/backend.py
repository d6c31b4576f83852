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
results do not depend on the thread count. The GEMMs are the BLAS's: OpenBLAS's own thread count
(OPENBLAS_NUM_THREADS, else the cores) can change their last bits (measured: 1 against 2 threads).
"""
import math
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gpt2np.backends.numpy.huge_pages import huge_zeros

LN_EPS = 1e-5
GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBE = 0.044715

# AdamW and the gradient norm stream over hundreds of MB; doing them in chunks on all cores keeps them
# at memory speed (NumPy ufuncs and the fused loops release the GIL). The gradient norm sums one partial
# sum per CHUNK: its rounding depends on CHUNK, so CHUNK is part of the results (the golden run pins it).
CHUNK = 1 << 17
# Element-wise work in the fused path (GELU around np.tanh) goes in blocks that stay in a core's L2 cache.
BLOCK = 1 << 15
# The classifier's rows (Vp floats each) go CLASSIFIER_ROWS at a time for the same reason.
CLASSIFIER_ROWS = 2
# An op that does less work than this (in element operations) runs on the calling thread: a hand-off
# (~30 us here) and moving the rows between the cores' caches cost more (measured on 2 cores at d12, B*T =
# 256: LayerNorm both ways, the bias add and the bias gradient's column sums are faster inline; GELU,
# attention and the classifier are not).
PARALLEL_MIN = 1 << 20
# rows per block of the fast LayerNorm backward's parameter-gradient partial sums (part of its results' rounding)
LN_BLOCK = 16
MATHS = ("exact", "fast")        # NumpyBackend(math=): bitwise the NumPy code, or cpu_kernels' fast set


_spin_warned = False


def warn_openblas_spin():
    """Warn once per process when NumPy loaded OpenBLAS before gpt2np set its thread timeout (gpt2np/__init__.py):
    OpenBLAS's threads then spin on the cores after every GEMM, and a d12 CPU step ran ~5% slower on 2 cores. Not
    where OpenBLAS runs one thread (OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS or OMP_NUM_THREADS, the first set, is 1)
    or NumPy's build names another BLAS (or none it can tell: a distribution's NumPy says "blas")."""
    global _spin_warned
    import gpt2np
    if _spin_warned or not gpt2np.OPENBLAS_TIMEOUT_MISSED or "openblas" not in _blas_name():
        return
    threads = next((os.environ[v] for v in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
                    if os.environ.get(v)), "")
    if threads.strip() == "1":
        return
    _spin_warned = True
    warnings.warn("NumPy was imported before gpt2np, so OpenBLAS keeps its threads spinning after every GEMM (a "
                  "CPU training step ~5% slower): import gpt2np first, or set OPENBLAS_THREAD_TIMEOUT=4 before "
                  "NumPy loads", RuntimeWarning, stacklevel=_first_frame_outside(gpt2np))


def _first_frame_outside(package) -> int:
    """warnings.warn's stacklevel that names the first caller outside `package` (the user's line, not
    get_backend's), counted from the function that calls warn."""
    root = os.path.dirname(os.path.abspath(package.__file__)) + os.sep
    frame, level = sys._getframe(2), 2          # 1 = the caller of this function (the one calling warn)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def _blas_name() -> str:
    """The name of NumPy's BLAS as its build configuration gives it (e.g. scipy-openblas), lower case; '' if unknown."""
    try:
        return str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]).lower()
    except Exception:                  # an older NumPy or another layout of its configuration: no warning
        return ""


def gelu_into(y, x):
    """y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), float32, in this order of operations (the reference
    GELU: the fused C path, the emulator's GEMM epilogue and the tests match it bitwise)."""
    np.multiply(x, x, out=y)
    y *= GELU_CUBE
    y += 1.0
    y *= x
    y *= GELU_SCALE
    np.tanh(y, out=y)
    y += 1.0
    y *= x
    y *= 0.5


class NumpyBackend:
    """CPU backend. Arrays are NumPy arrays; `dtype` is the activation/parameter dtype."""

    name = "numpy"
    precision = "fp32"
    launches_kernels = False      # an op is one unit of work here; on_launch is never called
    on_gpu = False
    has_cpu_math = True
    label = "cpu"
    on_launch = None

    def __init__(self, dtype=np.float32, threads=None, fused=None, math="exact"):
        """fused: run the element-wise arithmetic of AdamW, GELU, LayerNorm, attention and the bias gradients as the
        C loops of cpu_kernels (bitwise the results of the NumPy code here, which stays the reference; np.tanh,
        np.exp and the row sums stay NumPy's); None = when they build here (float32 only), False = never.
        math: "exact" = that; "fast" = GELU, LayerNorm, causal attention (per head, the masked half skipped), the
        classifier and the gradient norm each as one C loop of cpu_kernels' fast set, with its own e^x and row sums in
        double (not bitwise the NumPy code: within the tolerance tests/test_cpu_fast.py documents); needs the fused
        path, else exact."""
        if math not in MATHS:
            raise ValueError(f"math={math!r}: expected {' or '.join(MATHS)}")
        self.dtype = np.dtype(dtype)
        self.threads = threads or min(8, _cpu_count())
        if self.threads > 1:
            warn_openblas_spin()
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._scratch = {}
        self._local = threading.local()
        self._kernels = None
        if fused is not False and self.dtype == np.float32:
            from gpt2np.backends.numpy import cpu_kernels
            self._kernels = cpu_kernels.load()
            if fused and self._kernels is None:
                raise RuntimeError("fused=True: the C kernels did not build (no working C compiler?)")
        self.fused = self._kernels is not None
        self.math = math if self.fused else "exact"

    def device_name(self):
        return "cpu"

    def op_cost_variant(self, op, args):
        """How this backend runs `op` with these arguments, as keywords of its contract cost formula: the fast
        attention (math="fast", contiguous float32) computes the causal half of its (T,T) products only."""
        if op in ("attention_forward", "attention_backward") and self._fast(*args[:4]):
            return {"causal_half": True}
        return {}

    # ---- memory -------------------------------------------------------------------------
    def zeros(self, shape, dtype=None):
        """Zeros; a large array in transparent huge pages where the kernel offers them (huge_pages.huge_zeros)."""
        return huge_zeros(shape, dtype or self.dtype)

    def from_host(self, array, dtype=None):
        return np.ascontiguousarray(array, dtype=dtype)

    def to_host(self, array):
        return np.array(array, copy=True)

    def copy_(self, dst, src):
        np.copyto(dst, src)

    def fill_(self, array, value):
        array.fill(value)

    def upload_(self, dst, array):
        np.copyto(dst, np.asarray(array, dst.dtype).reshape(dst.shape))

    def read_async(self, array):
        from gpt2np.backends.runtime_base import Ready
        return Ready(np.array(array, copy=True))

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
        ids = inp.reshape(-1)
        kernels = self._fusable(dwte, dout)
        if kernels and ids.dtype == np.int32 and ids.flags.c_contiguous and ids.size and ids.size * C == dout.size \
                and dwte.ndim == 2 and dwte.shape[1] == C and 0 <= ids.min() and ids.max() < dwte.shape[0]:
            kernels.rows_add_at(_address(dwte), _address(ids), _address(dout), ids.size, C)   # np.add.at's adds
        else:
            np.add.at(dwte, ids, dout.reshape(-1, C))
        if accumulate:
            dwpe[:T] += dout.sum(axis=0)
        else:
            np.sum(dout, axis=0, out=dwpe[:T])
            dwpe[T:] = 0.0

    # ---- layernorm ----------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T)."""
        C = inp.shape[-1]
        fast = self._fast(out, mean, rstd, inp, weight, bias)
        if fast:                                               # each row in one call, mean and variance in double
            po, pm, pr, px = (_address(a) for a in (out, mean, rstd, inp))
            self._parallel(lambda lo, hi: fast.layernorm_forward_fast(
                px + 4 * lo * C, po + 4 * lo * C, pm + 4 * lo, pr + 4 * lo, _address(weight), _address(bias),
                hi - lo, C, LN_EPS), inp.size // C, 2 * C)
            return
        kernels = self._fusable(out, mean, rstd, inp, weight, bias)
        out, mean, rstd, inp = out.reshape(-1, C), mean.reshape(-1), rstd.reshape(-1), inp.reshape(-1, C)

        def fused(lo, hi):                                     # the same operations; the sums stay NumPy's
            o, mu, rs, x = out[lo:hi], mean[lo:hi], rstd[lo:hi], inp[lo:hi]
            np.mean(x, axis=-1, out=mu)
            kernels.ln_center(_address(x), _address(mu), _address(o), hi - lo, C)
            var = np.einsum("nc,nc->n", o, o) / C
            np.divide(1.0, np.sqrt(var + LN_EPS), out=rs)
            kernels.ln_scale(_address(o), _address(rs), _address(weight), _address(bias), hi - lo, C)

        def rows(lo, hi):                                      # out, mean, rstd, x of rows lo:hi
            o, mu, rs, x = out[lo:hi], mean[lo:hi], rstd[lo:hi], inp[lo:hi]
            np.mean(x, axis=-1, out=mu)
            np.subtract(x, mu[:, None], out=o)                 # o holds x - mean
            var = np.einsum("nc,nc->n", o, o) / C
            np.divide(1.0, np.sqrt(var + LN_EPS), out=rs, casting="unsafe")
            o *= rs[:, None]
            o *= weight
            o += bias

        self._parallel(fused if kernels else rows, inp.shape[0], 2 * C)

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True, fused=False):
        """dinp (B,T,C) +=, dweight (C) +=, dbias (C) +=, from dout and the saved mean, rstd.

        accumulate=False overwrites dweight and dbias instead (dinp always accumulates). `fused` (the CUDA
        backend's one-pass kernel) changes nothing here.
        """
        C = inp.shape[-1]
        N = inp.size // C
        dinp, dout, inp = dinp.reshape(N, C), dout.reshape(N, C), inp.reshape(N, C)
        mean, rstd = mean.reshape(N, 1), rstd.reshape(N, 1)
        fast = self._fast(dinp, dout, inp, weight, mean, rstd)
        if fast:
            self._layernorm_backward_fast(fast, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate)
            return
        norm = self.scratch("ln_norm", (N, C))                 # x_hat, kept for dweight
        dnorm = self.scratch("ln_dnorm", (N, C))
        kernels = self._fusable(dinp, dout, inp, weight, mean, rstd)
        work = None if kernels else self.scratch("ln_work", (N, C))

        def fused(lo, hi):                                     # the same operations; the sums stay NumPy's
            xh, dxh, rs = norm[lo:hi], dnorm[lo:hi], rstd[lo:hi]
            kernels.ln_xhat(_address(inp[lo:hi]), _address(mean[lo:hi]), _address(rs), _address(xh), hi - lo, C)
            np.multiply(dout[lo:hi], weight, out=dxh)
            dxh_mean = dxh.mean(axis=-1)
            dxh_xh_mean = np.einsum("nc,nc->n", dxh, xh) / C
            kernels.ln_dinp(_address(dxh), _address(xh), _address(dxh_mean), _address(dxh_xh_mean), _address(rs),
                            _address(dinp[lo:hi]), hi - lo, C)

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

        self._parallel(fused if kernels else rows, N, 3 * C)
        if kernels and C > 1:
            sums, dots = self._column_sums(dout, norm)
        else:
            sums, dots = dout.sum(axis=0), np.einsum("nc,nc->c", dout, norm)
        write_or_add(dbias, sums, accumulate)
        write_or_add(dweight, dots, accumulate)

    def _layernorm_backward_fast(self, fast, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate):
        """layernorm_backward in one pass over the rows (2-D dinp, dout, inp; (N,1) mean, rstd): dinp, and dweight and
        dbias summed in double per block of LN_BLOCK rows as each row goes by, the blocks then added in order (no x_hat
        buffer, no second pass for the column sums; the same results whatever the thread count)."""
        N, C = inp.shape
        parts = self.scratch("ln_parts", (-(-N // LN_BLOCK), 2, C), np.float64)

        def blocks(lo, hi):                                    # rows of blocks lo:hi
            a, b = lo * LN_BLOCK, min(hi * LN_BLOCK, N)
            work = self._thread_buffer("ln_work", 2 * C, np.float32)
            fast.layernorm_backward_fast(_address(inp[a]), _address(dout[a]), _address(weight), _address(mean[a]),
                                         _address(rstd[a]), _address(work), _address(dinp[a]), _address(parts[lo]),
                                         b - a, C, LN_BLOCK)

        self._parallel(blocks, parts.shape[0], 3 * C * LN_BLOCK)
        dots, sums = parts.sum(axis=0)                         # the blocks in order, in double
        write_or_add(dbias, sums, accumulate)
        write_or_add(dweight, dots, accumulate)

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias):
        """residual = inp1 + inp2; out = layernorm(residual): residual_forward then layernorm_forward (the
        same results bitwise)."""
        self.residual_forward(residual, inp1, inp2)
        self.layernorm_forward(out, mean, rstd, residual, weight, bias)

    # ---- matmul -------------------------------------------------------------------------
    def matmul_forward(self, out, inp, weight, bias, fused=False):
        """out (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC); `fused` changes nothing here."""
        OC, C = weight.shape
        out2 = out.reshape(-1, OC)
        np.matmul(inp.reshape(-1, C), weight.T, out=out2)
        if bias is not None:
            self._parallel(lambda lo, hi: np.add(out2[lo:hi], bias, out=out2[lo:hi]), out2.shape[0], OC)

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, accumulate=True, fused=False):
        """dinp (B,T,C) = dout @ weight;  dweight (OC,C) += dout^T @ inp;  dbias (OC) += sum dout over (B,T).

        accumulate=False overwrites dweight and dbias instead (their old contents are ignored). `fused` changes
        nothing here.
        """
        OC, C = weight.shape
        dout2 = dout.reshape(-1, OC)
        if dbias is not None:       # first, while dout is in this core's cache (after a GEMM: 2-3x slower here)
            sums = self._column_sums(dout2)[0] if OC > 1 and self._fusable(dout2) else dout2.sum(axis=0)
            write_or_add(dbias, sums, accumulate)
        np.matmul(dout2, weight, out=dinp.reshape(-1, C))
        if accumulate:
            dw = self.scratch("mm_dweight", weight.shape)
            np.matmul(dout2.T, inp.reshape(-1, C), out=dw)
            dweight += dw
        else:
            np.matmul(dout2.T, inp.reshape(-1, C), out=dweight)

    def matmul_gelu_forward(self, out, pre, inp, weight, bias):
        """pre (B,T,OC) = inp @ weight^T + bias; out = gelu(pre): matmul_forward then gelu_forward (bitwise)."""
        self.matmul_forward(pre, inp, weight, bias)
        self.gelu_forward(out, pre)

    def gelu_matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre, accumulate=True):
        """dinp (B,T,C) = (dout @ weight) * gelu'(pre); dweight, dbias as matmul_backward: matmul_backward then
        gelu_backward in place (bitwise)."""
        self.matmul_backward(dinp, dweight, dbias, dout, inp, weight, accumulate)
        self.gelu_backward(dinp, pre, dinp)

    # ---- attention ----------------------------------------------------------------------
    def attention_forward(self, out, qkvr, att, inp):
        """Causal self-attention, heads batched.

        inp (B,T,3C) = [q | k | v];  qkvr (3,B,NH,T,HS) saves them per head;
        att (B,NH,T,T) = softmax(q k^T / sqrt(HS)) with the future masked (exact zeros);
        out (B,T,C) = att @ v with heads concatenated.
        """
        B, T, C3 = inp.shape
        _, _, NH, _, HS = qkvr.shape
        kernels = self._fusable(out, qkvr, att, inp)
        fast = self._fast(out, qkvr, att, inp)
        if fast:                                               # one C loop per head, the masked half skipped
            self._per_head(fast.attention_forward_fast, (inp, qkvr, att, out), B, T, NH, HS, 0, 2 * T * T * HS)
            return
        mask = self._causal_mask(T)                            # -inf above the diagonal
        y_all = self.scratch("att_y", (B, NH, T, HS))

        def fused(lo, hi):                                     # the same operations; exp and sums stay NumPy's
            n, plane = hi - lo, B * NH * T * HS
            kernels.att_split(_address(inp[lo:hi]), _address(qkvr[0, lo:hi]), n, T, NH, HS, plane)
            q, k, v = qkvr[:, lo:hi]
            a, y = att[lo:hi], y_all[lo:hi]
            np.matmul(q, k.transpose(0, 1, 3, 2), out=a)
            kernels.softmax_shift(_address(a), n * NH * T, T, 1.0 / math.sqrt(HS))
            np.exp(a, out=a)
            sums = a.sum(axis=-1)                              # (a named array: alive during the call)
            kernels.rows_divide(_address(a), _address(sums), n * NH * T, T)
            np.matmul(a, v, out=y)
            kernels.att_merge(_address(y), _address(out[lo:hi]), n, T, NH, HS, 1, 0)

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

        self._parallel(fused if kernels else batch, B, 2 * NH * T * T * HS)          # the batched GEMMs' work

    def _per_head(self, kernel, arrays, B, T, NH, HS, extra_work, head_elements):
        """kernel(*arrays, lo, hi, T, NH, HS, plane, scale, work) over the B*NH heads, a run of heads per thread:
        attention's fast C loops. work: a thread's (HS + 4) * Tp + 4 * HS + extra_work floats (Tp = T rounded up
        to 16), as the kernel's comment gives them."""
        Tp = -(-T // 16) * 16
        addresses = [_address(a) for a in arrays]

        def heads(lo, hi):
            work = self._thread_buffer("att_work", (HS + 4) * Tp + 4 * HS + extra_work, np.float32)
            kernel(*addresses, lo, hi, T, NH, HS, B * NH * T * HS, 1.0 / math.sqrt(HS), _address(work))

        self._parallel(heads, B * NH, head_elements)

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
        kernels = self._fusable(dinp, dout, qkvr, att)
        fast = self._fast(dinp, dout, qkvr, att)
        if fast:                                               # one C loop per head, the masked half skipped
            self._per_head(fast.attention_backward_fast, (dout, qkvr, att, dinp), B, T, NH, HS, T * T + T * HS,
                           4 * T * T * HS)
            return
        dqkvr_all = self.scratch("att_dqkvr", qkvr.shape)
        datt_all = self.scratch("att_datt", att.shape)

        def fused(lo, hi):                                     # the same operations; the sums stay NumPy's
            n = hi - lo
            q, k, v = qkvr[:, lo:hi]
            a, datt, dqkvr = att[lo:hi], datt_all[lo:hi], dqkvr_all[:, lo:hi]
            dq, dk, dv = dqkvr
            dy = dout[lo:hi].reshape(n, T, NH, HS).transpose(0, 2, 1, 3)
            np.matmul(a.transpose(0, 1, 3, 2), dy, out=dv)
            np.matmul(dy, v.transpose(0, 1, 3, 2), out=datt)
            dots = np.einsum("bhts,bhts->bht", datt, a)
            kernels.softmax_grad(_address(datt), _address(a), _address(dots), n * NH * T, T, 1.0 / math.sqrt(HS))
            np.matmul(datt, k, out=dq)
            np.matmul(datt.transpose(0, 1, 3, 2), q, out=dk)
            kernels.att_merge(_address(dq), _address(dinp[lo:hi]), n, T, NH, HS, 3, B * NH * T * HS)

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

        self._parallel(fused if kernels else batch, B, 4 * NH * T * T * HS)

    # ---- flash attention ------------------------------------------------------------------
    # The same math as attention_forward/backward, saving lse (B,NH,T) instead of the probabilities: backward
    # recomputes them as P = exp(scale * q k^T - lse). Here the (T,T) scores of a batch slice live in scratch
    # only during the call; the CUDA kernels never hold more than a tile of them.
    @staticmethod
    def _heads(x, lo, hi, NH, HS, part=0, parts=1):
        """(b,NH,T,HS) view of part `part` of x[lo:hi] (B,T,parts*NH*HS)."""
        b, T = hi - lo, x.shape[1]
        return x[lo:hi].reshape(b, T, parts, NH, HS)[:, :, part].transpose(0, 2, 1, 3)

    def flash_attention_forward(self, out, lse, inp):
        """Causal self-attention. inp (B,T,3C) = [q | k | v];  out (B,T,C) = softmax(q k^T / sqrt(HS), future
        masked) @ v with heads concatenated;  lse (B,NH,T) = logsumexp of each row of the scaled, masked scores."""
        B, T, C3 = inp.shape
        NH = lse.shape[1]
        HS = C3 // 3 // NH
        scale = 1.0 / math.sqrt(HS)
        mask = self._causal_mask(T)
        scores = self.scratch("flash_scores", (B, NH, T, T))

        def batch(lo, hi):
            q, k, v = (self._heads(inp, lo, hi, NH, HS, i, 3) for i in range(3))
            s = scores[lo:hi]
            np.matmul(q, k.transpose(0, 1, 3, 2), out=s)
            s *= scale
            s += mask
            m = s.max(axis=-1, keepdims=True)
            s -= m
            np.exp(s, out=s)
            total = s.sum(axis=-1, keepdims=True)
            s /= total
            np.log(total[..., 0], out=lse[lo:hi])
            lse[lo:hi] += m[..., 0]
            self._heads(out, lo, hi, NH, HS)[...] = np.matmul(s, v)

        self._parallel(batch, B, 2 * NH * T * T * HS)

    def flash_attention_backward(self, dinp, dout, inp, out, lse):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), inp (B,T,3C), out (B,T,C), lse (B,NH,T): P = exp(scale q k^T
        - lse) (0 in the future), dV = P^T dout, dP = dout v^T, D = rowsum(dout * out), dS = P (dP - D) scale,
        dQ = dS k, dK = dS^T q."""
        B, T, C = dout.shape
        NH = lse.shape[1]
        HS = C // NH
        scale = 1.0 / math.sqrt(HS)
        mask = self._causal_mask(T)
        probs = self.scratch("flash_probs", (B, NH, T, T))
        dprobs = self.scratch("flash_dprobs", (B, NH, T, T))

        def batch(lo, hi):
            q, k, v = (self._heads(inp, lo, hi, NH, HS, i, 3) for i in range(3))
            dq, dk, dv = (self._heads(dinp, lo, hi, NH, HS, i, 3) for i in range(3))
            do, o = self._heads(dout, lo, hi, NH, HS), self._heads(out, lo, hi, NH, HS)
            p, dp = probs[lo:hi], dprobs[lo:hi]
            np.matmul(q, k.transpose(0, 1, 3, 2), out=p)
            p *= scale
            p += mask
            p -= lse[lo:hi, ..., None]
            np.exp(p, out=p)                                   # the forward's probabilities, recomputed
            dv[...] = np.matmul(p.transpose(0, 1, 3, 2), do)
            np.matmul(do, v.transpose(0, 1, 3, 2), out=dp)
            dp -= np.einsum("bhtd,bhtd->bht", do, o)[..., None]  # D = rowsum(dout * out) = rowsum(P * dP)
            dp *= p
            dp *= scale
            dq[...] = np.matmul(dp, k)
            dk[...] = np.matmul(dp.transpose(0, 1, 3, 2), q)

        self._parallel(batch, B, 4 * NH * T * T * HS)

    # ---- gelu ---------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        """out (B,T,4C) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x = inp."""
        out_flat, inp_flat = out.reshape(-1), inp.reshape(-1)
        fast = self._fast(out, inp)
        if fast:                                               # x sigmoid(2u) in one loop
            x, y = _address(inp_flat), _address(out_flat)
            self._parallel(lambda lo, hi: fast.gelu_forward_fast(x + 4 * lo, y + 4 * lo, hi - lo, GELU_CUBE,
                                                                 GELU_SCALE), inp_flat.size, 2)
            return
        kernels = self._fusable(out, inp)

        def fused(lo, hi):                                     # the same operations, around NumPy's tanh
            x, y = _address(inp_flat), _address(out_flat)
            for a, b in _blocks(lo, hi, BLOCK):
                kernels.gelu_arg(x + 4 * a, y + 4 * a, b - a, GELU_CUBE, GELU_SCALE)
                np.tanh(out_flat[a:b], out=out_flat[a:b])
                kernels.gelu_out(x + 4 * a, y + 4 * a, b - a)

        def part(lo, hi):
            gelu_into(out_flat[lo:hi], inp_flat[lo:hi])

        self._parallel(fused if kernels else part, inp_flat.size, 2)

    def gelu_backward(self, dinp, inp, dout):
        """dinp (B,T,4C) = dout * gelu'(inp); dinp may alias dout."""
        dinp_flat, inp_flat, dout_flat = dinp.reshape(-1), inp.reshape(-1), dout.reshape(-1)
        n = inp_flat.size
        fast = self._fast(dinp, inp, dout)
        if fast:
            x, d, di = _address(inp_flat), _address(dout_flat), _address(dinp_flat)
            self._parallel(lambda lo, hi: fast.gelu_backward_fast(x + 4 * lo, d + 4 * lo, di + 4 * lo, hi - lo,
                                                                  GELU_CUBE, GELU_SCALE), n, 3)
            return
        kernels = self._fusable(dinp, inp, dout)
        if kernels:
            def fused(lo, hi):                                 # the same operations, around NumPy's tanh
                x, d, di = _address(inp_flat), _address(dout_flat), _address(dinp_flat)
                th = self._thread_buffer("gelu_tanh", BLOCK, np.float32)
                t = _address(th)
                for a, b in _blocks(lo, hi, BLOCK):
                    kernels.gelu_arg(x + 4 * a, t, b - a, GELU_CUBE, GELU_SCALE)
                    np.tanh(th[:b - a], out=th[:b - a])
                    kernels.gelu_grad(x + 4 * a, t, d + 4 * a, di + 4 * a, b - a, 3.0 * GELU_CUBE, GELU_SCALE * 0.5)

            self._parallel(fused, n, 3)
            return
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
        fast = self._fast(logits, losses) if targets.dtype == np.int32 and targets.flags.c_contiguous else None
        if fast:                                               # each row: max, e^x and its sum (double), dlogits
            if targets.size and not 0 <= int(targets.min()) <= int(targets.max()) < V:
                raise IndexError(f"fused_classifier: targets must be in [0, {V}), got {int(targets.min())}.."
                                 f"{int(targets.max())}")
            pl, ploss, pt = _address(logits), _address(losses), _address(targets)
            self._parallel(lambda lo, hi: fast.classifier_fast(pl + 4 * lo * Vp, ploss + 4 * lo, pt + 4 * lo, hi - lo,
                                                               V, Vp, dloss, bool(write_dlogits)), B * T, 2 * Vp)
            return

        def part(lo, hi):                                      # rows (tokens) lo:hi, a few at a time
            exp_rows = None if write_dlogits else self._thread_buffer("cls_exp", CLASSIFIER_ROWS * V, logits.dtype)
            for a, b in _blocks(lo, hi, CLASSIFIER_ROWS):     # rows that stay in cache through the passes
                rows, target = all_rows[a:b], all_targets[a:b]
                real = rows[:, :V]
                row_max = real.max(axis=1)
                target_logit = rows[np.arange(b - a), target]
                probs = real if write_dlogits else exp_rows[:(b - a) * V].reshape(b - a, V)   # dlogits reuse logits
                np.subtract(real, row_max[:, None], out=probs)
                np.exp(probs, out=probs)
                row_sum = probs.sum(axis=1)
                all_losses[a:b] = np.log(row_sum) + row_max - target_logit
                if write_dlogits:
                    probs *= (dloss / row_sum)[:, None]
                    rows[np.arange(b - a), target] -= dloss
                    rows[:, V:] = 0.0

        self._parallel(part, B * T, 2 * Vp)

    # ---- optimizer ----------------------------------------------------------------------
    def adamw_update(self, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t, grad_scale=1.0, *,
                     master=None, seed=0, offset=0):
        """AdamW (decoupled weight decay, bias correction) on flat float32 segments, in place. float32 parameters
        are their own master weights: master must be None (bf16 storage is Bf16NumpyBackend's); seed, offset are
        unused."""
        if master is not None:
            raise ValueError("NumpyBackend.adamw_update: float32 parameters take no master weights (master= is for "
                             "bf16 storage)")
        # g = grad_scale * grads.  mhat / (sqrt(vhat) + eps) with mhat = m / bc1, vhat = v / bc2 equals
        # (sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2)): two passes fewer over each chunk.
        sqrt_bc2 = math.sqrt(1.0 - beta2 ** t)
        step_size = lr * sqrt_bc2 / (1.0 - beta1 ** t)
        eps_v = eps * sqrt_bc2
        decay = 1.0 - lr * weight_decay
        kernels = self._fusable(params, grads, m, v)
        if kernels:
            c_m, c_v = grad_scale * (1.0 - beta1), grad_scale * grad_scale * (1.0 - beta2)
            addresses = [_address(a) for a in (params, grads, m, v)]

            def fused(lo, hi):                                 # one pass: the same operations per element
                p, g, mm, vv = (a + 4 * lo for a in addresses)
                kernels.adamw(p, g, mm, vv, hi - lo, c_m, beta1, c_v, beta2, eps_v, step_size, decay,
                              weight_decay != 0.0)

            self._parallel(fused, params.size, 7)              # a block per thread: no per-chunk calls
            return

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

    def adamw_update_device(self, params, grads, m, v, scalars, stats, beta1, beta2, eps, decayed, grad_clip, *,
                            master=None, seed=0, offset=0):
        """The CUDA kernel adamw_update_device's arithmetic in float32 (the reference its emulated runs are checked
        against; the NumPy training step runs adamw_update): scalars = [lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t),
        1 - lr wd, t (its bits), loss limit, norm limit], stats = [loss, squared grad norm]; nothing changes when
        either statistic is not finite or above its outlier limit (the float32 loss, the norm in double). bf16
        params and grads (as the bf16 build of the kernel takes them): the grads are upcast, master gets the update
        and params = bf16.round_stochastic(master, seed, t, offset); without master (-w 0) the upcast params are
        what is updated, then rounded the same way."""
        f32 = np.float32
        loss, norm_squared = f32(stats[0]), f32(stats[1])
        if not (np.isfinite(loss) and np.isfinite(norm_squared)) or loss > f32(scalars[4]):
            return
        norm = math.sqrt(float(norm_squared))
        if norm > float(f32(scalars[5])):                     # an outlier (gpt2np.outlier): no update
            return
        clip = float(f32(grad_clip)) if grad_clip is not None and grad_clip > 0 else 0.0
        scale = f32(clip / norm) if clip > 0 and norm > clip else f32(1.0)
        step_size, inv_sqrt_bc2 = f32(scalars[0]), f32(scalars[1])
        decay = f32(scalars[2]) if decayed else f32(1.0)
        g = np.asarray(grads, f32) * scale
        m[...] = f32(beta1) * m + f32(1.0 - beta1) * g
        v[...] = f32(beta2) * v + f32(1.0 - beta2) * (g * g)
        denom = np.sqrt(v) * inv_sqrt_bc2 + f32(eps)
        if np.dtype(params.dtype) == f32:
            params[...] = params * decay - step_size * (m / denom)
            return
        from gpt2np.bf16 import round_stochastic
        old = master if master is not None else np.asarray(params, f32)
        updated = old * decay - step_size * (m / denom)
        if master is not None:
            master[...] = updated
        t = int(np.ascontiguousarray(scalars, f32).view(np.uint32)[3])
        round_stochastic(updated, params, seed, t, offset)

    def loss_mean(self, stats, losses, count, accumulate):
        """stats[0] = mean(losses) / count as float32 (+= with accumulate); the sum in float64."""
        mean = np.float32(float(np.sum(losses, dtype=np.float64)) / losses.size / count)
        stats[0] = stats[0] + mean if accumulate else mean

    def global_norm_squared_device(self, grads, stats):
        stats[1] = self.global_norm_squared(grads)

    def global_norm_squared(self, grads):
        """sum(grads^2) of a flat buffer, accumulated per chunk in float64."""
        fast = self._fast(grads)
        if fast:
            # each CHUNK's sum (float blocks added in double) rounded to float32, as np.dot's: one that overflows
            # float32 makes the norm inf, the step a non-finite one, as on the exact path and the GPU. One C call
            # per thread for its run of chunks (a call per chunk cost ~25% of the pass in Python overhead).
            n = grads.size
            parts = np.empty(-(-n // CHUNK), np.float32)
            g, out = _address(grads), _address(parts)

            def run(lo, hi):                                   # chunks lo:hi
                a, b = lo * CHUNK, min(hi * CHUNK, n)
                fast.sum_squares_chunks(g + 4 * a, b - a, CHUNK, out + 4 * lo)

            self._parallel(run, parts.size, CHUNK)
            return math.fsum(parts.tolist())
        parts = self._chunked(lambda lo, hi: float(np.dot(grads[lo:hi], grads[lo:hi])), grads.size)
        return math.fsum(parts)

    def _column_sums(self, x, y=None):
        """(x.sum(axis=0), einsum("nc,nc->c", x, y) or None) of 2-D C-contiguous float32 arrays, by the C kernel
        (the same additions in the same order as NumPy's: from 0, row after row; with more than one column, as
        here, NumPy adds along axis 0 that way), the columns split over the threads."""
        rows, C = x.shape
        sums = np.empty(C, np.float32)
        dots = np.empty(C, np.float32) if y is not None else None
        px, py, ps, pd = _address(x), _address(y) if y is not None else None, _address(sums), \
            _address(dots) if dots is not None else None
        self._parallel(lambda lo, hi: self._kernels.col_sums(px, py, ps, pd, rows, C, lo, hi), C, rows)
        return sums, dots

    def _fusable(self, *arrays):
        """The C kernels when they are loaded and every array is C-contiguous float32, else None."""
        if self._kernels is None:
            return None
        if all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays):
            return self._kernels
        return None

    def _fast(self, *arrays):
        """The C kernels when math="fast" and every array is C-contiguous float32, else None."""
        return self._fusable(*arrays) if self.math == "fast" else None

    def _thread_buffer(self, key, size, dtype):
        """A work buffer of `size` elements private to the calling thread."""
        bufs = getattr(self._local, "named", None)
        if bufs is None:
            bufs = self._local.named = {}
        buf = bufs.get(key)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = bufs[key] = np.empty(size, dtype)
        return buf[:size]

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


def _address(array):
    """The address of an array's first element (for the C kernels)."""
    return array.__array_interface__["data"][0]


def _blocks(lo, hi, size):
    """(a, b) pieces of [lo, hi), `size` long but the last."""
    return ((a, min(a + size, hi)) for a in range(lo, hi, size))


def write_or_add(out, value, accumulate):
    """out += value, or out = value when not accumulate."""
    if accumulate:
        out += value
    else:
        out[...] = value


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
