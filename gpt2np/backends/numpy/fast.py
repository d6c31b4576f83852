"""The numpy backend's fast path (--cpu-math fast, NumpyBackend(math="fast")): ops run as
cpu_kernels' C loops.

GELU, LayerNorm, causal attention (per head, the masked half skipped), the classifier and the
gradient norm are csrc/fast.c's loops: not bitwise the reference, within the tolerances
tests/test_cpu_fast.py documents. AdamW, the bias gradient's column sums, the token embedding
gradient and bf16's stochastic rounding are csrc/bitwise.c's loops: bitwise the reference, in one
pass over memory. Each function takes the backend `be` (its threads: be.parallel, be.thread_buffer,
be.scratch) and the loaded library `lib`, and is called only with C-contiguous float32 arrays
(NumpyBackend.fast_kernels checks). The ops this module lacks (the GEMMs, flash attention, the
encoder forward, the residual) run the reference on the fast path too.
"""
import math

import numpy as np

from gpt2np.ops.reference.gelu import GELU_CUBE, GELU_SCALE
from gpt2np.ops.reference.layernorm import EPS

# rows per block of the LayerNorm backward's parameter-gradient partial sums (part of its results'
# rounding)
LN_BLOCK = 16


def address(array):
    """The address of an array's first element (for the C loops)."""
    return array.__array_interface__["data"][0]


def encoder_backward(lib, dwte, dwpe, dout, inp, accumulate):
    """The reference encoder_backward with dwte's adds (np.add.at's, in the same order) as one C
    loop; False (nothing done) where the token ids do not fit (not int32, not contiguous, out of the
    table): the caller then runs the reference, which raises NumPy's error before it writes."""
    T, C = dout.shape[1], dout.shape[2]
    ids = inp.reshape(-1)
    if not (ids.dtype == np.int32 and ids.flags.c_contiguous and ids.size
            and ids.size * C == dout.size and dwte.ndim == 2 and dwte.shape[1] == C
            and 0 <= ids.min() and ids.max() < dwte.shape[0]):
        return False
    lib.rows_add_at(address(dwte), address(ids), address(dout), ids.size, C)
    if accumulate:
        dwpe[:T] += dout.sum(axis=0)
    else:
        np.sum(dout, axis=0, out=dwpe[:T])
        dwpe[T:] = 0.0
    return True


def layernorm_forward(be, lib, out, mean, rstd, inp, weight, bias):
    """Each row in one C call: mean and variance in double."""
    C = inp.shape[-1]
    po, pm, pr, px = (address(a) for a in (out, mean, rstd, inp))
    be.parallel(lambda lo, hi: lib.layernorm_forward_fast(
        px + 4 * lo * C, po + 4 * lo * C, pm + 4 * lo, pr + 4 * lo, address(weight), address(bias),
        hi - lo, C, EPS), inp.size // C, 2 * C)


def layernorm_backward(be, lib, dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate):
    """layernorm_backward in one pass over the rows: dinp, and dweight and dbias summed in double
    per block of LN_BLOCK rows as each row goes by, the blocks then added in order (no x_hat buffer,
    no second pass for the column sums; the same results whatever the thread count)."""
    C = inp.shape[-1]
    N = inp.size // C
    dinp, dout, inp, mean, rstd = dinp.reshape(N, C), dout.reshape(N, C), inp.reshape(N, C), \
        mean.reshape(N), rstd.reshape(N)
    parts = be.scratch("ln_parts", (-(-N // LN_BLOCK), 2, C), np.float64)

    def blocks(lo, hi):                                        # rows of blocks lo:hi
        a, b = lo * LN_BLOCK, min(hi * LN_BLOCK, N)
        work = be.thread_buffer("ln_work", 2 * C, np.float32)
        lib.layernorm_backward_fast(address(inp[a]), address(dout[a]), address(weight),
                                    address(mean[a:]), address(rstd[a:]), address(work),
                                    address(dinp[a]), address(parts[lo]), b - a, C, LN_BLOCK)

    be.parallel(blocks, parts.shape[0], 3 * C * LN_BLOCK)
    dots, sums = parts.sum(axis=0)                             # the blocks in order, in double
    write_or_add(dbias, sums, accumulate)
    write_or_add(dweight, dots, accumulate)


def matmul_backward_bias(be, lib, dbias, dout, accumulate):
    """dbias (OC) += the column sums of dout (N,OC) (= without accumulate): NumPy's additions in
    NumPy's order (from 0, row after row; for more than one column), the columns split over the
    threads."""
    OC = dbias.shape[0]
    rows = dout.size // OC
    sums = np.empty(OC, np.float32)
    px, ps = address(dout), address(sums)
    be.parallel(lambda lo, hi: lib.col_sums(px, ps, rows, OC, lo, hi), OC, rows)
    write_or_add(dbias, sums, accumulate)


def attention_forward(be, lib, out, qkvr, att, inp):
    """One C loop per head, the masked half skipped."""
    B, T, _ = inp.shape
    _, _, NH, _, HS = qkvr.shape
    per_head(be, lib.attention_forward_fast, (inp, qkvr, att, out), B, T, NH, HS, 0, 2 * T * T * HS)


def attention_backward(be, lib, dinp, dout, qkvr, att):
    """One C loop per head, the masked half skipped."""
    B, T, _ = dout.shape
    _, _, NH, _, HS = qkvr.shape
    per_head(be, lib.attention_backward_fast, (dout, qkvr, att, dinp), B, T, NH, HS, T * T + T * HS,
             4 * T * T * HS)


def per_head(be, kernel, arrays, B, T, NH, HS, extra_work, head_elements):
    """kernel(*arrays, lo, hi, T, NH, HS, plane, scale, work) over the B*NH heads, a run of heads
    per thread. work: a thread's (HS + 4) * Tp + 4 * HS + extra_work floats (Tp = T rounded up to
    16), as the kernel's comment gives them."""
    Tp = -(-T // 16) * 16
    addresses = [address(a) for a in arrays]

    def heads(lo, hi):
        work = be.thread_buffer("att_work", (HS + 4) * Tp + 4 * HS + extra_work, np.float32)
        kernel(*addresses, lo, hi, T, NH, HS, B * NH * T * HS, 1.0 / math.sqrt(HS), address(work))

    be.parallel(heads, B * NH, head_elements)


def gelu_forward(be, lib, out, inp):
    """x sigmoid(2u) in one loop."""
    x, y = address(inp), address(out)
    be.parallel(lambda lo, hi: lib.gelu_forward_fast(x + 4 * lo, y + 4 * lo, hi - lo, GELU_CUBE,
                                                     GELU_SCALE), inp.size, 2)


def gelu_backward(be, lib, dinp, inp, dout):
    """dout * gelu'(x) in one loop; dinp may be dout."""
    x, d, di = address(inp), address(dout), address(dinp)
    be.parallel(lambda lo, hi: lib.gelu_backward_fast(x + 4 * lo, d + 4 * lo, di + 4 * lo, hi - lo,
                                                      GELU_CUBE, GELU_SCALE), inp.size, 3)


def fused_classifier(be, lib, logits, losses, targets, V, dloss, write_dlogits):
    """Each row: max, e^x and its sum (double), dlogits. targets must be int32 and C-contiguous."""
    B, T, Vp = logits.shape
    if targets.size and not 0 <= int(targets.min()) <= int(targets.max()) < V:
        raise IndexError(f"fused_classifier: targets must be in [0, {V}), got "
                         f"{int(targets.min())}..{int(targets.max())}")
    pl, ploss, pt = address(logits), address(losses), address(targets)
    be.parallel(lambda lo, hi: lib.classifier_fast(pl + 4 * lo * Vp, ploss + 4 * lo, pt + 4 * lo,
                                                   hi - lo, V, Vp, dloss, bool(write_dlogits)),
                B * T, 2 * Vp)


def adamw_update(be, lib, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t, grad_scale):
    """The reference adamw_update's operations per element in one pass, a block of elements per
    thread."""
    sqrt_bc2 = math.sqrt(1.0 - beta2 ** t)
    step_size = lr * sqrt_bc2 / (1.0 - beta1 ** t)
    c_m, c_v = grad_scale * (1.0 - beta1), grad_scale * grad_scale * (1.0 - beta2)
    addresses = [address(a) for a in (params, grads, m, v)]

    def block(lo, hi):
        p, g, mm, vv = (a + 4 * lo for a in addresses)
        lib.adamw(p, g, mm, vv, hi - lo, c_m, beta1, c_v, beta2, eps * sqrt_bc2, step_size,
                  1.0 - lr * weight_decay, weight_decay != 0.0)

    be.parallel(block, params.size, 7)


def global_norm_squared(be, lib, grads, chunk):
    """Each chunk's sum (float blocks added in double) rounded to float32, as np.dot's: one that
    overflows float32 makes the norm inf (a non-finite step, as on the exact path and the GPU); the
    chunks added exactly. One C call per thread for its run of chunks."""
    n = grads.size
    parts = np.empty(-(-n // chunk), np.float32)
    g, out = address(grads), address(parts)

    def run(lo, hi):                                           # chunks lo:hi
        a, b = lo * chunk, min(hi * chunk, n)
        lib.sum_squares_chunks(g + 4 * a, b - a, chunk, out + 4 * lo)

    be.parallel(run, parts.size, chunk)
    return math.fsum(parts.tolist())


def write_or_add(out, value, accumulate):
    """out += value, or out = value when not accumulate."""
    if accumulate:
        out += value
    else:
        out[...] = value
