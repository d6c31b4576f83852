"""The NumPy backend: every op of the contract on the CPU (float32; float64 for gradient checks).

Two ways to run an op. math="exact" (the class's default) runs the plain NumPy reference,
gpt2np/ops/reference, the readable one that every other backend and CUDA kernel is checked against.
math="fast" (the trainer's default, --cpu-math) runs the C loops of fast.py where it has them, and
the reference for the rest (the GEMMs, flash attention, the encoder forward, the residual).

NumPy runs a ufunc on one core, so the backend splits an op's rows (tokens, or batch entries for
attention) into one contiguous block per thread and calls the reference on each block (ufuncs and
BLAS release the GIL). Every row is computed the same way whatever the split, and column sums (bias
and LayerNorm gradients) run over all rows at once, so results do not depend on the thread count.
The GEMMs are the BLAS's: OpenBLAS's own thread count (OPENBLAS_NUM_THREADS, else the cores) can
change their last bits (1 against 2 threads, for one).
"""
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gpt2np.backends.numpy import cpu_kernels, fast
from gpt2np.backends.numpy.huge_pages import huge_zeros
from gpt2np.backends.numpy.openblas import warn_openblas_spin
from gpt2np.backends.runtime_base import Ready
from gpt2np.bf16 import round_stochastic
from gpt2np.ops.reference import (
    adamw,
    attention,
    classifier,
    encoder,
    flash_attention,
    gelu,
    global_norm,
    layernorm,
    matmul,
    residual,
)

# AdamW and the gradient norm stream over hundreds of MB: in chunks, a run of chunks per thread.
# The gradient norm sums one partial sum per CHUNK: its rounding depends on CHUNK (the golden run
# pins it).
CHUNK = global_norm.CHUNK
# GELU and AdamW go to the reference in blocks of this many elements, which stay in a core's L2
# cache with their temporaries.
BLOCK = 1 << 15
# The classifier's rows (Vp floats each) go CLASSIFIER_ROWS at a time for the same reason.
CLASSIFIER_ROWS = 2
# An op that does less work than this (in element operations) runs on the calling thread: a hand-off
# and moving the rows between the cores' caches cost more than they save on small ops.
PARALLEL_MIN = 1 << 20
MATHS = ("exact", "fast")        # NumpyBackend(math=): the reference, or the fast path's C loops


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
        """math: "exact" = the NumPy reference (gpt2np/ops/reference); "fast" = the fast path's C
        loops (fast.py: not bitwise the reference, within the tolerances tests/test_cpu_fast.py
        documents), float32 only. fused: whether the C loops (cpu_kernels) are loaded: None = for
        math="fast" where they build, False = never (math="fast" then runs the reference: self.math
        says "exact"), True = they must build (a RuntimeError where they do not)."""
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
        if fused is not False and self.dtype == np.float32 and (math == "fast" or fused):
            self._kernels = cpu_kernels.load()
            if fused and self._kernels is None:
                raise RuntimeError("fused=True: the C kernels did not build (no working C "
                                   "compiler?)")
        self.fused = self._kernels is not None
        self.math = math if self.fused else "exact"

    def device_name(self):
        return "cpu"

    def op_cost_variant(self, op, args):
        """How this backend runs `op` with these arguments, as keywords of its contract cost
        formula: the fast attention (math="fast", contiguous float32) computes the causal half of
        its (T,T) products only."""
        if op in ("attention_forward", "attention_backward") and self.fast_kernels(*args[:4]):
            return {"causal_half": True}
        return {}

    # ---- memory -------------------------------------------------------------------------
    def zeros(self, shape, dtype=None):
        """Zeros; a large array in transparent huge pages where the kernel offers them
        (huge_pages.huge_zeros)."""
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
        encoder.encoder_forward(out, inp, wte, wpe)

    def encoder_backward(self, dwte, dwpe, dout, inp, accumulate=True):
        """dwte[inp[b,t]] += dout[b,t];  dwpe[t] += sum_b dout[b,t] (= with accumulate=False)."""
        lib = self.fast_kernels(dwte, dout)
        if lib and fast.encoder_backward(lib, dwte, dwpe, dout, inp, accumulate):
            return
        encoder.encoder_backward(dwte, dwpe, dout, inp, accumulate)

    # ---- layernorm ----------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        """out (B,T,C) = (inp - mean) * rstd * weight + bias; saves mean, rstd (B,T)."""
        lib = self.fast_kernels(out, mean, rstd, inp, weight, bias)
        if lib:
            fast.layernorm_forward(self, lib, out, mean, rstd, inp, weight, bias)
            return
        C = inp.shape[-1]
        out, inp = out.reshape(-1, C), inp.reshape(-1, C)
        mean, rstd = mean.reshape(-1), rstd.reshape(-1)
        self.parallel(lambda lo, hi: layernorm.layernorm_forward(
            out[lo:hi], mean[lo:hi], rstd[lo:hi], inp[lo:hi], weight, bias), inp.shape[0], 2 * C)

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                           accumulate=True, fused=False):
        """dinp (B,T,C) +=, dweight (C) +=, dbias (C) +=, from dout and the saved mean, rstd.

        accumulate=False overwrites dweight and dbias instead (dinp always accumulates). `fused`
        (the CUDA backend's one-pass kernel) changes nothing here.
        """
        lib = self.fast_kernels(dinp, dout, inp, weight, mean, rstd)
        if lib:
            fast.layernorm_backward(self, lib, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                    accumulate)
            return
        C = inp.shape[-1]
        N = inp.size // C
        dinp, dout, inp, mean, rstd = dinp.reshape(N, C), dout.reshape(N, C), inp.reshape(N, C), \
            mean.reshape(N), rstd.reshape(N)
        x_hat = self.scratch("ln_x_hat", (N, C))
        self.parallel(lambda lo, hi: layernorm.layernorm_backward_rows(
            dinp[lo:hi], x_hat[lo:hi], dout[lo:hi], inp[lo:hi], weight, mean[lo:hi], rstd[lo:hi]),
            N, 3 * C)
        layernorm.layernorm_backward_params(dweight, dbias, dout, x_hat, accumulate)    # all rows

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias):
        """residual = inp1 + inp2; out = layernorm(residual): residual_forward then
        layernorm_forward (the same results bitwise)."""
        self.residual_forward(residual, inp1, inp2)
        self.layernorm_forward(out, mean, rstd, residual, weight, bias)

    # ---- matmul -------------------------------------------------------------------------
    def matmul_forward(self, out, inp, weight, bias, fused=False):
        """out (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC); `fused` changes nothing here.
        """
        matmul.matmul_forward(out, inp, weight, bias)

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, accumulate=True,
                        fused=False):
        """dinp (B,T,C) = dout @ weight;  dweight (OC,C) += dout^T @ inp;
        dbias (OC) += sum dout over (B,T).

        accumulate=False overwrites dweight and dbias instead (their old contents are ignored).
        `fused` changes nothing here.
        """
        lib = self.fast_kernels(dout)
        if lib and dbias is not None and dbias.shape[0] > 1:   # first, while dout is in cache
            fast.matmul_backward_bias(self, lib, dbias, dout, accumulate)
            dbias = None
        matmul.matmul_backward(dinp, dweight, dbias, dout, inp, weight, accumulate)

    def matmul_gelu_forward(self, out, pre, inp, weight, bias):
        """pre (B,T,OC) = inp @ weight^T + bias; out = gelu(pre): matmul_forward then gelu_forward
        (bitwise)."""
        self.matmul_forward(pre, inp, weight, bias)
        self.gelu_forward(out, pre)

    def gelu_matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre, accumulate=True):
        """dinp (B,T,C) = (dout @ weight) * gelu'(pre); dweight, dbias as matmul_backward:
        matmul_backward then gelu_backward in place (bitwise)."""
        self.matmul_backward(dinp, dweight, dbias, dout, inp, weight, accumulate)
        self.gelu_backward(dinp, pre, dinp)

    # ---- attention ----------------------------------------------------------------------
    def attention_forward(self, out, qkvr, att, inp):
        """Causal self-attention, heads batched.

        inp (B,T,3C) = [q | k | v];  qkvr (3,B,NH,T,HS) saves them per head;
        att (B,NH,T,T) = softmax(q k^T / sqrt(HS)) with the future masked (exact zeros);
        out (B,T,C) = att @ v with heads concatenated.
        """
        lib = self.fast_kernels(out, qkvr, att, inp)
        if lib:
            fast.attention_forward(self, lib, out, qkvr, att, inp)
            return
        B, T, _ = inp.shape
        _, _, NH, _, HS = qkvr.shape
        self.parallel(lambda lo, hi: attention.attention_forward(
            out[lo:hi], qkvr[:, lo:hi], att[lo:hi], inp[lo:hi]), B, 2 * NH * T * T * HS)

    def attention_backward(self, dinp, dout, qkvr, att):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), the saved qkvr (3,B,NH,T,HS) and att
        (B,NH,T,T)."""
        lib = self.fast_kernels(dinp, dout, qkvr, att)
        if lib:
            fast.attention_backward(self, lib, dinp, dout, qkvr, att)
            return
        B, T, _ = dout.shape
        _, _, NH, _, HS = qkvr.shape
        self.parallel(lambda lo, hi: attention.attention_backward(
            dinp[lo:hi], dout[lo:hi], qkvr[:, lo:hi], att[lo:hi]), B, 4 * NH * T * T * HS)

    # ---- flash attention ------------------------------------------------------------------
    def flash_attention_forward(self, out, lse, inp):
        """Causal self-attention. inp (B,T,3C) = [q | k | v];  out (B,T,C) = softmax(q k^T /
        sqrt(HS), future masked) @ v with heads concatenated;  lse (B,NH,T) = logsumexp of each row
        of the scaled, masked scores."""
        B, T, C3 = inp.shape
        self.parallel(lambda lo, hi: flash_attention.flash_attention_forward(
            out[lo:hi], lse[lo:hi], inp[lo:hi]), B, 2 * T * T * C3 // 3)

    def flash_attention_backward(self, dinp, dout, inp, out, lse):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), inp (B,T,3C), out (B,T,C), lse (B,NH,T): the
        probabilities recomputed from q, k and lse."""
        B, T, C = dout.shape
        self.parallel(lambda lo, hi: flash_attention.flash_attention_backward(
            dinp[lo:hi], dout[lo:hi], inp[lo:hi], out[lo:hi], lse[lo:hi]), B, 4 * T * T * C)

    # ---- gelu ---------------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        """out (B,T,4C) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x = inp."""
        lib = self.fast_kernels(out, inp)
        if lib:
            fast.gelu_forward(self, lib, out, inp)
            return
        out, inp = out.reshape(-1), inp.reshape(-1)

        def part(lo, hi):
            for a, b in _blocks(lo, hi, BLOCK):
                gelu.gelu_forward(out[a:b], inp[a:b])

        self.parallel(part, inp.size, 2)

    def gelu_backward(self, dinp, inp, dout):
        """dinp (B,T,4C) = dout * gelu'(inp); dinp may alias dout."""
        lib = self.fast_kernels(dinp, inp, dout)
        if lib:
            fast.gelu_backward(self, lib, dinp, inp, dout)
            return
        dinp, inp, dout = dinp.reshape(-1), inp.reshape(-1), dout.reshape(-1)

        def part(lo, hi):
            for a, b in _blocks(lo, hi, BLOCK):
                gelu.gelu_backward(dinp[a:b], inp[a:b], dout[a:b])

        self.parallel(part, inp.size, 3)

    # ---- residual -----------------------------------------------------------------------
    def residual_forward(self, out, inp1, inp2):
        """out = inp1 + inp2."""
        residual.residual_forward(out, inp1, inp2)

    def residual_backward(self, dinp1, dinp2, dout):
        """dinp1 += dout; dinp2 += dout (the model realises this by accumulating into dresidual)."""
        residual.residual_backward(dinp1, dinp2, dout)

    # ---- classifier ---------------------------------------------------------------------
    def fused_classifier(self, logits, losses, targets, V, dloss, write_dlogits):
        """Softmax + cross-entropy over the real vocabulary, optionally dlogits in place.

        logits (B,T,Vp), losses (B,T) = logsumexp(logits[:V]) - logits[target], targets (B,T) int32.
        With write_dlogits, logits becomes dlogits = (softmax - onehot(target)) * dloss over [:V]
        and 0 over the padding [V:Vp].
        """
        contiguous_ids = targets.dtype == np.int32 and targets.flags.c_contiguous
        lib = self.fast_kernels(logits, losses) if contiguous_ids else None
        if lib:
            fast.fused_classifier(self, lib, logits, losses, targets, V, dloss, write_dlogits)
            return
        Vp = logits.shape[-1]
        rows, losses, targets = logits.reshape(-1, Vp), losses.reshape(-1), targets.reshape(-1)

        def part(lo, hi):                                      # a few rows at a time, in cache
            for a, b in _blocks(lo, hi, CLASSIFIER_ROWS):
                classifier.fused_classifier(rows[a:b], losses[a:b], targets[a:b], V, dloss,
                                            write_dlogits)

        self.parallel(part, rows.shape[0], 2 * Vp)

    # ---- optimizer ----------------------------------------------------------------------
    def adamw_update(self, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t,
                     grad_scale=1.0, *, master=None, seed=0, offset=0):
        """AdamW (decoupled weight decay, bias correction) on flat float32 segments, in place.
        float32 parameters are their own master weights: master must be None (bf16 storage is
        Bf16NumpyBackend's); seed, offset are unused."""
        if master is not None:
            raise ValueError("NumpyBackend.adamw_update: float32 parameters take no master weights "
                             "(master= is for bf16 storage)")
        lib = self.fast_kernels(params, grads, m, v)
        if lib:
            fast.adamw_update(self, lib, params, grads, m, v, lr, beta1, beta2, eps, weight_decay,
                              t, grad_scale)
            return

        def chunk(lo, hi):                                     # in blocks that stay in cache
            for a, b in _blocks(lo, hi, BLOCK):
                adamw.adamw_update(params[a:b], grads[a:b], m[a:b], v[a:b], lr, beta1, beta2, eps,
                                   weight_decay, t, grad_scale)

        self.chunked(chunk, params.size)

    def adamw_update_device(self, params, grads, m, v, scalars, stats, beta1, beta2, eps, decayed,
                            grad_clip, *, master=None, seed=0, offset=0):
        """The CUDA kernel adamw_update_device's arithmetic in float32 (the reference its emulated
        runs are checked against; the NumPy training step runs adamw_update): scalars = [lr / (1 -
        beta1^t), 1 / sqrt(1 - beta2^t), 1 - lr wd, t (its bits), loss limit, norm limit], stats =
        [loss, squared grad norm]; nothing changes when either statistic is not finite or above its
        outlier limit (the float32 loss, the norm in double). bf16 params and grads (as the bf16
        build of the kernel takes them): the grads are upcast, master gets the update and params =
        bf16.round_stochastic(master, seed, t, offset); without master (-w 0) the upcast params are
        what is updated, then rounded the same way."""
        f32 = np.float32
        loss, norm_squared = f32(stats[0]), f32(stats[1])
        if not (np.isfinite(loss) and np.isfinite(norm_squared)) or loss > f32(scalars[4]):
            return
        norm = math.sqrt(float(norm_squared))
        if norm > float(f32(scalars[5])):             # an outlier (gpt2np.outlier): no update
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
        """sum(grads^2) of a flat buffer: one float32 sum per CHUNK, the chunks added exactly."""
        lib = self.fast_kernels(grads)
        if lib:
            return fast.global_norm_squared(self, lib, grads, CHUNK)
        parts = self.chunked(lambda lo, hi: global_norm.sum_squares(grads[lo:hi]), grads.size)
        return math.fsum(parts)

    # ---- the threads --------------------------------------------------------------------
    def fast_kernels(self, *arrays):
        """cpu_kernels' library when math="fast" and every array is C-contiguous float32, else None.
        """
        if self.math != "fast" or self._kernels is None:
            return None
        if all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays):
            return self._kernels
        return None

    def thread_buffer(self, key, size, dtype):
        """A work buffer of `size` elements private to the calling thread."""
        bufs = getattr(self._local, "named", None)
        if bufs is None:
            bufs = self._local.named = {}
        buf = bufs.get(key)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = bufs[key] = np.empty(size, dtype)
        return buf[:size]

    def chunked(self, fn, n):
        """[fn(lo, hi) for each CHUNK of range(n)]; each thread takes an equal run of chunks in
        order."""
        chunks = [(lo, min(lo + CHUNK, n)) for lo in range(0, n, CHUNK)]
        if self._pool is None or len(chunks) < 2:
            return [fn(lo, hi) for lo, hi in chunks]
        parts = min(self.threads, len(chunks))
        runs = [chunks[len(chunks) * i // parts:len(chunks) * (i + 1) // parts]
                for i in range(parts)]
        results = self._pool.map(lambda run: [fn(lo, hi) for lo, hi in run], runs)
        return [r for part in results for r in part]

    def parallel(self, fn, rows, row_elements):
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
        fn(bounds[0], bounds[1])                  # the calling thread takes the first block
        for future in futures:
            future.result()


def _blocks(lo, hi, size):
    """(a, b) pieces of [lo, hi), `size` long but the last."""
    return ((a, min(a + size, hi)) for a in range(lo, hi, size))


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
