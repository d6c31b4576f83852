"""The bf16 reference (precision "bf16" on the numpy backend): llm.c's mixed precision, op by op, in
NumPy.

Storage: parameters, gradients, activations and the gradient scratch are bfloat16 (ml_dtypes), as
llm.c's `floatX` buffers are. These stay float32, as they are `float` in llm.c's train_gpt2.cu: the
LayerNorm statistics (ln1/ln2/lnf mean and rstd), the per-token losses, the fp32 master weights and
AdamW's m and v (the model allocates them; see model.py), and the gradient norm.

Math: every op runs the fp32 NumpyBackend's op (backend.py, unchanged) on fp32 copies: each bf16
input is upcast (exact) into an fp32 work buffer, the fp32 op computes with fp32 accumulation in
every sum and matmul, and each bf16 output is rounded once, to nearest even, at the op's boundary:
where a bf16 CUDA kernel stores its result. So one op's output differs from the fp32 op's on the
same (bf16-representable) inputs by one rounding, at most 2^-8 of its magnitude. What accumulates
(`accumulate`: parameter gradients over micro-batches and the tied wte; layernorm_backward's dinp
into the residual stream's gradient) is upcast, added to in fp32 and rounded once, as a bf16 kernel
reading, adding and storing does. Inside an op nothing is rounded (attention keeps its scores,
probabilities and att @ v in fp32; a flash-attention kernel that feeds bf16 probabilities to its
second matmul differs from this by about one rounding of att).

AdamW: adamw_update takes the fp32 master weights (`master=`) beside the bf16 parameters: the bf16
gradients are upcast, the fp32 op updates master, m and v exactly as in an fp32 run, and the bf16
parameters are written from master with seeded stochastic rounding (bf16.round_stochastic: noise
from (seed, t, flat index)), so runs and resumes are reproducible bit for bit. Without master
weights (master=None, llm.c's -w 0) the bf16 parameters themselves are upcast (exact), updated by
the same fp32 op and rounded back with the same noise: a step from parameters p is bitwise the
master-weights step from masters equal to p upcast. global_norm_squared upcasts and sums in fp32 per
chunk, as the fp32 backend does.
"""
import math

import numpy as np

from gpt2np.backends.numpy.backend import NumpyBackend
from gpt2np.backends.numpy.huge_pages import huge_zeros
from gpt2np.bf16 import BF16, round_stochastic

F32 = np.dtype(np.float32)
ADAMW_PIECE = 1 << 22            # AdamW upcasts this many gradients at a time (bounded buffers)


class Bf16NumpyBackend:
    """The bf16 reference: bf16 storage, fp32 compute through NumpyBackend's ops, RNE rounding at op
    outputs."""

    name = "numpy"
    precision = "bf16"
    dtype = BF16                  # storage of parameters, gradients and activations
    launches_kernels = False
    on_gpu = False
    has_cpu_math = True
    label = "cpu"
    on_launch = None

    def __init__(self, threads=None, fused=None, math="exact"):
        """threads, fused, math: as NumpyBackend's (its fp32 ops do the work)."""
        self.f = NumpyBackend(np.float32, threads=threads, fused=fused, math=math)
        self.threads, self.fused, self.math = self.f.threads, self.f.fused, self.f.math
        self._scratch = self.f._scratch    # one set of work buffers (the memory summary counts)

    def device_name(self):
        return "cpu"

    def op_cost_variant(self, op, args):
        """As NumpyBackend's: the fp32 op runs on contiguous fp32 work copies, so under math="fast"
        attention's kernels compute the causal half of its (T,T) products only."""
        if op in ("attention_forward", "attention_backward") and self.math == "fast":
            return {"causal_half": True}
        return {}

    # ---- memory -------------------------------------------------------------------------
    def zeros(self, shape, dtype=None):
        return huge_zeros(shape, dtype or self.dtype)

    def from_host(self, array, dtype=None):
        """A copy; float32 into a bf16 array rounds to nearest even."""
        return np.ascontiguousarray(array, dtype=dtype)

    def to_host(self, array):
        return np.array(array, copy=True)

    def copy_(self, dst, src):
        np.copyto(dst, src, casting="unsafe" if dst.dtype != np.asarray(src).dtype else "same_kind")

    def fill_(self, array, value):
        array.fill(value)

    def synchronize(self):
        pass

    def scratch(self, key, shape, dtype=None):
        return self.f.scratch(key, shape, dtype or self.dtype)

    # ---- the bf16 layer -----------------------------------------------------------------
    def _run(self, op, args, write=(), add=()):
        """op(*args) on fp32: bf16 arrays among args are replaced by fp32 work buffers (upcast
        copies, or left unset for the positions in `write`: pure outputs); afterwards the positions
        in write and add (read, then written) are rounded back into their bf16 arrays. fp32 arrays
        and other values pass as they are."""
        call, back = list(args), []
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray) and a.dtype == BF16:
                work = self.f.scratch(f"bf16_arg{i}", a.shape, F32)
                if i not in write:
                    np.copyto(work, a)                         # exact
                call[i] = work
                if i in write or i in add:
                    back.append((a, work))
        op(*call)
        for a, work in back:
            np.copyto(a, work, casting="unsafe")               # round to nearest even, once

    # ---- encoder ------------------------------------------------------------------------
    def encoder_forward(self, out, inp, wte, wpe):
        """out (B,T,C) = wte[inp] + wpe[:T]; only the rows of wte the batch uses are upcast."""
        rows, index = _used_rows(inp)
        used = np.ascontiguousarray(wte[rows])
        self._run(self.f.encoder_forward, (out, index, used, wpe), write=(0,))

    def encoder_backward(self, dwte, dwpe, dout, inp, accumulate=True):
        """dwte[inp] += dout (fp32 sums per used row, each row rounded once); dwpe as the fp32
        op."""
        rows, index = _used_rows(inp)
        used = dwte[rows]                                      # a copy: the rows the batch adds to
        dwpe_mode = {} if accumulate else {"write": (1,)}
        self._run(self.f.encoder_backward, (used, dwpe, dout, index, accumulate), add=(0, 1),
                  **dwpe_mode)
        dwte[rows] = used

    # ---- layernorm ----------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        self._run(self.f.layernorm_forward, (out, mean, rstd, inp, weight, bias), write=(0, 1, 2))

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                           accumulate=True, fused=False):
        params = (1, 2)
        self._run(self.f.layernorm_backward,
                  (dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate),
                  write=() if accumulate else params, add=(0,) + (params if accumulate else ()))

    # ---- matmul -------------------------------------------------------------------------
    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias):
        """residual_forward then layernorm_forward: the residual is rounded to bf16 before it is
        normalized, as the stored residual stream is."""
        self.residual_forward(residual, inp1, inp2)
        self.layernorm_forward(out, mean, rstd, residual, weight, bias)

    def matmul_forward(self, out, inp, weight, bias, fused=False):
        self._run(self.f.matmul_forward, (out, inp, weight, bias), write=(0,))

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, accumulate=True,
                        fused=False):
        params = (1, 2)
        self._run(self.f.matmul_backward, (dinp, dweight, dbias, dout, inp, weight, accumulate),
                  write=(0,) + (() if accumulate else params), add=params if accumulate else ())

    def matmul_gelu_forward(self, out, pre, inp, weight, bias):
        """matmul_forward then gelu_forward (pre rounded to bf16 first, as it is stored)."""
        self.matmul_forward(pre, inp, weight, bias)
        self.gelu_forward(out, pre)

    def gelu_matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre, accumulate=True):
        """matmul_backward then gelu_backward in place."""
        self.matmul_backward(dinp, dweight, dbias, dout, inp, weight, accumulate)
        self.gelu_backward(dinp, pre, dinp)

    # ---- attention, gelu, residual ------------------------------------------------------
    def attention_forward(self, out, qkvr, att, inp):
        self._run(self.f.attention_forward, (out, qkvr, att, inp), write=(0, 1, 2))

    def attention_backward(self, dinp, dout, qkvr, att):
        self._run(self.f.attention_backward, (dinp, dout, qkvr, att), write=(0,))

    def flash_attention_forward(self, out, lse, inp):
        self._run(self.f.flash_attention_forward, (out, lse, inp), write=(0,))       # lse is fp32

    def flash_attention_backward(self, dinp, dout, inp, out, lse):
        self._run(self.f.flash_attention_backward, (dinp, dout, inp, out, lse), write=(0,))

    def gelu_forward(self, out, inp):
        self._run(self.f.gelu_forward, (out, inp), write=(0,))

    def gelu_backward(self, dinp, inp, dout):
        self._run(self.f.gelu_backward, (dinp, inp, dout), write=(0,))   # dinp may be dout: copies

    def residual_forward(self, out, inp1, inp2):
        self._run(self.f.residual_forward, (out, inp1, inp2), write=(0,))

    def residual_backward(self, dinp1, dinp2, dout):
        """dinp1 += dout, then dinp2 += dout, each rounded once; one after the other, as the
        kernel's two stores, so that dinp1 and dinp2 may be the same buffer (it then gains dout
        twice)."""
        for dinp in (dinp1, dinp2):
            self._run(lambda d, g: np.add(d, g, out=d), (dinp, dout), add=(0,))

    # ---- classifier ---------------------------------------------------------------------
    def fused_classifier(self, logits, losses, targets, V, dloss, write_dlogits):
        """losses (fp32) from the upcast logits; with write_dlogits, dlogits rounded once into
        logits."""
        self._run(self.f.fused_classifier, (logits, losses, targets, V, dloss, write_dlogits),
                  add=(0,) if write_dlogits else ())

    # ---- optimizer ----------------------------------------------------------------------
    def adamw_update(self, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t,
                     grad_scale=1.0, *, master=None, seed=0, offset=0):
        """AdamW with fp32 master weights: master (n) fp32, m, v fp32 updated by the fp32 op from
        the upcast bf16 grads; params (n) bf16 = master stochastically rounded with the noise of
        (seed, t, offset + i): offset is params[0]'s index in the model's flat parameter buffer.
        master None with bf16 params (-w 0): the params, upcast, take master's place (per CHUNK, in
        a temporary: no fp32 copy of the whole segment). fp32 params (master None): the fp32 op."""
        if params.dtype == F32:
            self.f.adamw_update(params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t,
                                grad_scale)
            return
        if master is not None and master.size != params.size:
            raise ValueError(f"AdamW: {master.size} fp32 master weights for {params.size} bf16 "
                             f"parameters")
        hyper = (lr, beta1, beta2, eps, weight_decay, t, grad_scale)
        kernels = self.f.fast_kernels()                # the rounding as one C loop on the fast path
        for lo in range(0, params.size, ADAMW_PIECE):
            hi = min(lo + ADAMW_PIECE, params.size)
            g = self.f.scratch("bf16_adamw_grads", hi - lo, F32)
            np.copyto(g, grads[lo:hi])
            if master is not None:
                self.f.adamw_update(master[lo:hi], g, m[lo:hi], v[lo:hi], *hyper)
                self.f.chunked(lambda a, b, lo=lo: round_stochastic(
                    master[lo + a:lo + b], params[lo + a:lo + b], seed, t, offset + lo + a,
                    kernels), hi - lo)
                continue

            def no_master(a, b, lo=lo, g=g):   # one CHUNK: the same elementwise op, the same bits
                p = params[lo + a:lo + b].astype(F32)
                self.f.adamw_update(p, g[a:b], m[lo + a:lo + b], v[lo + a:lo + b], *hyper)
                round_stochastic(p, params[lo + a:lo + b], seed, t, offset + lo + a, kernels)

            self.f.chunked(no_master, hi - lo)

    # ---- the device step's (contract.Backend; the host step uses the ops above) ---------------
    def upload_(self, dst, array):
        """dst[...] = host array (rounded to nearest even into bf16)."""
        self.f.upload_(dst, array)

    def read_async(self, array):
        return self.f.read_async(array)

    def loss_mean(self, stats, losses, count, accumulate):
        """As NumpyBackend's: losses and stats are fp32."""
        self.f.loss_mean(stats, losses, count, accumulate)

    def adamw_update_device(self, params, grads, m, v, scalars, stats, beta1, beta2, eps, decayed,
                            grad_clip, *, master=None, seed=0, offset=0):
        """NumpyBackend.adamw_update_device: the CUDA kernel's arithmetic, which takes bf16 params
        and grads."""
        self.f.adamw_update_device(params, grads, m, v, scalars, stats, beta1, beta2, eps, decayed,
                                   grad_clip, master=master, seed=seed, offset=offset)

    def global_norm_squared_device(self, grads, stats):
        stats[1] = self.global_norm_squared(grads)

    def global_norm_squared(self, grads):
        """sum(grads^2), each CHUNK upcast and summed in fp32 (as the fp32 backend sums), the chunks
        in float64."""
        if grads.dtype == F32:
            return self.f.global_norm_squared(grads)

        def part(lo, hi):
            g = grads[lo:hi].astype(F32)
            return float(np.dot(g, g))

        return math.fsum(self.f.chunked(part, grads.size))


def _used_rows(inp):
    """(rows, index): the distinct token ids of inp (sorted) and inp (B,T) as int32 indices into
    them."""
    rows, index = np.unique(inp, return_inverse=True)
    return rows, index.reshape(inp.shape).astype(np.int32)
