"""The op contract: what every backend implements, with shapes, and what each op costs.

Each op writes into buffers the caller preallocated (llm.c's discipline): nothing is returned,
nothing is allocated per call. Shapes: B batch, T time, C channels, OC output channels, NH heads, HS
= C / NH head size, N = B * T rows, V vocabulary, Vp padded vocabulary, maxT the
model's longest sequence.

`fused` (matmul_forward, matmul_backward, layernorm_backward): the same math, asked of the backend
in fewer passes over memory: the bias added in the GEMM's epilogue, the bias gradient produced by
the weight-gradient GEMM, the LayerNorm backward in one pass. Backends without such kernels (NumPy)
compute the same thing either way; the op's cost (below) is that of the fused form. Three ops are
fusions by name: matmul_gelu_forward (matmul + bias + GELU), gelu_matmul_backward (matmul_backward
whose dinp is multiplied by gelu'), fused_residual_layernorm_forward (residual_forward +
layernorm_forward); each equals the sequence it replaces.

`accumulate`: parameter gradients (dweight, dbias, dwpe) are added to (gradient accumulation over
micro-batches, and wte is used twice) unless the op is called with accumulate=False, when it
overwrites them and ignores their old contents. The model passes accumulate=False right after
zero_grad(), so the gradient buffer is never filled with zeros. Activation gradients are
overwritten, except layernorm_backward's dinp, which adds into the residual stream's gradient, and
encoder_backward's dwte, which the tied lm_head wrote first.

Costs: `op_cost(op, args)` gives each op's work from the shapes of the arguments it is called with,
ONE formula per op, used by the profiler, the reports, the benches and any planner. An op's cost is
a sum of named terms, its stages (matmul_backward: "dinp", "dweight", "dbias"); each term's FLOPs
count the arithmetic of the math and its bytes are the minimum traffic of that stage (each input
read once, each output written once, 4 bytes per float32, a read-modify-write for what accumulates).
A backend that runs an op as several kernels says which term each kernel carries (CudaBackend:
`term=` on every launch), so the per-kernel figures add up to the op's. Where a backend's kernel
does less work than the formula's default (NumpyBackend's fast attention skips the masked half of
the (T,T) products), the formula takes a keyword for it and the backend names it (op_cost_variant;
backend_op_cost asks it): still one formula per op.
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

F32 = 4  # bytes per float32
I32 = 4  # bytes per int32 token id


class Backend(Protocol):
    """A device that runs the op contract. Arrays are the backend's own (NumPy
    arrays, device arrays)."""

    name: str                # "numpy" or "cuda"
    # dtype of parameters and activations (float32, or bf16 with precision "bf16")
    dtype: Any
    launches_kernels: bool   # whether ops run as kernel launches reported through on_launch
    # on_launch(kernel, kind, term, run): called instead of each launch;
    on_launch: Optional[Callable]
    #                                 must call run() once (kind "kernel" or "gemm";
    #                                 term: the op cost term)

    @property
    def precision(self) -> str:
        """Math of the matmuls: "fp32", "tf32" where TF32 tensor cores are on, or "bf16"
        with bf16 storage."""

    def device_name(self) -> str:
        """What runs the ops: "cpu" or the GPU's name."""

    # ---- memory ---------------------------------------------------------------------
    def zeros(self, shape, dtype=None): """A new zero-filled array."""
    def from_host(self, array, dtype=None): """A backend copy of a host (NumPy) array."""
    def to_host(self, array): """A host (NumPy) copy of a backend array."""
    def copy_(self, dst, src): """dst[...] = src (same shape)."""
    def fill_(self, array, value): """array[...] = value."""
    def upload_(self, dst, array):
        """dst[...] = host array, queued: no host wait, `array` may be reused at once."""
    def read_async(self, array):
        """A Readback of a host copy of `array` queued now: done(), result() (waits)."""
    def synchronize(self): """Wait until all queued work is done."""

    # ---- encoder --------------------------------------------------------------------
    def encoder_forward(self, out, inp, wte, wpe):
        """out (B,T,C) = wte (Vp,C)[inp (B,T) int32] + wpe (maxT,C)[:T]."""

    def encoder_backward(self, dwte, dwpe, dout, inp, accumulate=True):
        """dwte (Vp,C)[inp[b,t]] += dout (B,T,C)[b,t] (always adds); dwpe (maxT,C)[t] += sum_b
        dout[b,t]. accumulate=False overwrites dwpe: dwpe[:T] = the sums, dwpe[T:] = 0."""

    # ---- layernorm ------------------------------------------------------------------
    def layernorm_forward(self, out, mean, rstd, inp, weight, bias):
        """out (B,T,C) = (inp - mean) * rstd * weight (C) + bias (C); saves mean, rstd (B,T)."""

    def layernorm_backward(self, dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                           accumulate=True, fused=False):
        """dinp (B,T,C) += d inp; dweight (C), dbias (C) += (or = without accumulate), from dout
        (B,T,C), inp (B,T,C), weight (C) and the saved mean, rstd (B,T). fused: all three in one
        pass over the rows."""

    def fused_residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, weight, bias):
        """residual (B,T,C) = inp1 + inp2 (B,T,C); out (B,T,C) = layernorm(residual) with weight,
        bias (C), saving mean, rstd (B,T): residual_forward then layernorm_forward, in one pass."""

    # ---- matmul ---------------------------------------------------------------------
    def matmul_forward(self, out, inp, weight, bias, fused=False):
        """out (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC); bias may be None.
        fused: the bias is added by the GEMM (its epilogue), not by a second pass over out."""

    def matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, accumulate=True,
                        fused=False):
        """dinp (B,T,C) = dout (B,T,OC) @ weight (OC,C);  dweight (OC,C) += dout^T @ inp;
        dbias (OC) += sum of dout over (B,T) (dbias may be None). accumulate=False: = instead of +=.
        fused: dbias comes out of the dweight GEMM (its epilogue reads dout as it goes)."""

    def matmul_gelu_forward(self, out, pre, inp, weight, bias):
        """pre (B,T,OC) = inp (B,T,C) @ weight (OC,C)^T + bias (OC); out (B,T,OC) = gelu(pre):
        matmul_forward then gelu_forward, one GEMM with a bias + GELU epilogue that also writes pre
        (the backward needs it)."""

    def gelu_matmul_backward(self, dinp, dweight, dbias, dout, inp, weight, pre, accumulate=True):
        """The backward of out = gelu(pre) @ weight^T + bias, with inp = gelu(pre) (B,T,C):
        dinp (B,T,C) = (dout (B,T,OC) @ weight (OC,C)) * gelu'(pre (B,T,C)); dweight (OC,C), dbias
        (OC) as matmul_backward. matmul_backward(fused) then gelu_backward, the gelu' in the
        dinp GEMM's epilogue."""

    # ---- attention ------------------------------------------------------------------
    def attention_forward(self, out, qkvr, att, inp):
        """Causal self-attention, heads batched. inp (B,T,3C) = [q | k | v]; qkvr (3,B,NH,T,HS)
        saves them per head; att (B,NH,T,T) = softmax(q k^T / sqrt(HS)), future masked (exact
        zeros); out (B,T,C) = att @ v, heads concatenated."""

    def attention_backward(self, dinp, dout, qkvr, att):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C), the saved qkvr (3,B,NH,T,HS)
        and att (B,NH,T,T)."""

    def flash_attention_forward(self, out, lse, inp):
        """Causal self-attention without the (T,T) matrix. inp (B,T,3C) = [q | k | v] (heads of HS =
        C/NH channels, NH from lse); out (B,T,C) = softmax(q k^T / sqrt(HS), future masked) @ v,
        heads concatenated; lse (B,NH,T) = the log-sum-exp of each row of the scaled, masked scores
        (what backward needs to recompute the probabilities)."""

    def flash_attention_backward(self, dinp, dout, inp, out, lse):
        """dinp (B,T,3C) = d[q|k|v] from dout (B,T,C) and forward's inp (B,T,3C), out (B,T,C), lse
        (B,NH,T): the probabilities are recomputed from q, k and lse, with D = rowsum(dout * out)
        per head (FlashAttention-2's backward)."""

    # ---- gelu -----------------------------------------------------------------------
    def gelu_forward(self, out, inp):
        """out (B,T,4C) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), x = inp (B,T,4C)."""

    def gelu_backward(self, dinp, inp, dout):
        """dinp (B,T,4C) = dout * gelu'(inp); dinp may alias dout."""

    # ---- residual -------------------------------------------------------------------
    def residual_forward(self, out, inp1, inp2):
        """out = inp1 + inp2 (all (B,T,C))."""

    def residual_backward(self, dinp1, dinp2, dout):
        """dinp1 += dout; dinp2 += dout."""

    # ---- classifier -----------------------------------------------------------------
    def fused_classifier(self, logits, losses, targets, V, dloss, write_dlogits):
        """Per row of logits (B,T,Vp): losses (B,T) = logsumexp(logits[:V]) - logits[target],
        targets (B,T) int32. With write_dlogits, logits becomes dlogits = (softmax - onehot(target))
        * dloss over [:V] and 0 over the padding [V:Vp]."""

    def loss_mean(self, stats, losses, count, accumulate):
        """stats (STATS) float32, stats[0] = mean of losses (B,T) / count (+= with accumulate), on
        the device in a fixed order (the step's mean loss over `count` micro-batches, never read
        back during the step)."""

    # ---- optimizer ------------------------------------------------------------------
    def adamw_update(self, params, grads, m, v, lr, beta1, beta2, eps, weight_decay, t,
                     grad_scale=1.0, *, master=None, seed=0, offset=0):
        """AdamW on flat segments (n), in place: g = grad_scale * grads; m, v moments with bias
        correction for step t >= 1; params -= lr * (mhat / (sqrt(vhat) + eps) +
        weight_decay * params).
        m, v are float32. float32 params: master None (seed, offset unused). bf16 params (the bf16
        precision): master (n) float32, the master weights, gets the fp32 update from the upcast
        grads, and params = master stochastically rounded with the noise of (seed, t, offset + i)
        (bf16.round_stochastic; offset is params[0]'s index in the model's flat parameter buffer);
        bf16 params with master None (llm.c's -w 0): the upcast params take master's place and are
        rounded back the same way."""

    def adamw_update_device(self, params, grads, m, v, scalars, stats, beta1, beta2, eps, decayed,
                            grad_clip, *, master=None, seed=0, offset=0):
        """AdamW on flat segments (n) as the CUDA kernel computes it, with every per-step value in
        device buffers: scalars (STEP_SCALARS, float32) = [lr / (1 - beta1^t), 1 / sqrt(1 -
        beta2^t), 1 - lr weight_decay, t, loss limit, norm limit] (the decay where `decayed`; t mod
        2^32 as the bits of its slot, see model.set_step_scalars; a loss or norm above its limit,
        gpt2np.outlier, skips the update as below); stats (STATS) = [loss, squared grad norm], from
        which the clip scale (grad_clip / norm when norm > grad_clip > 0) is computed; a non-finite
        loss or norm leaves params, master, m, v untouched. master, seed,
        offset: as adamw_update."""

    def global_norm_squared(self, grads) -> float:
        """sum(grads^2) over a flat (n) buffer, as a Python float."""

    def global_norm_squared_device(self, grads, stats):
        """stats (STATS) float32, stats[1] = sum(grads^2) over a flat (n) buffer,
        left on the device."""


# ---------------------------------------------------------------------------------------------
# costs

Term = Tuple[int, int]   # (FLOPs, minimum bytes)


@dataclass(frozen=True)
class Cost:
    """One op call's work: `terms` {stage: (FLOPs, bytes)}; `params` its shapes, e.g.
    "B=4,T=64,C=768"."""
    params: str
    terms: Dict[str, Term] = field(default_factory=dict)

    @property
    def flops(self) -> int:
        return sum(f for f, _ in self.terms.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.terms.values())


def _size(array) -> int:
    n = 1
    for d in array.shape:
        n *= int(d)
    return n


def _item(array) -> int:
    """Bytes per element of a storage array (4 for float32, 2 for bf16): parameters, gradients and
    activations move in their storage precision; statistics, losses and AdamW's moments are float32
    (F32) in every build."""
    return int(array.dtype.itemsize)


def gemm_term(m, n, k, batch=1, accumulate=False, item=F32) -> Term:
    """C (m,n) = A (m,k) @ B (k,n), `batch` times, operands of `item` bytes: 2mnk FLOPs; reads A and
    B, writes C (reads it too when it accumulates)."""
    return 2 * m * n * k * batch, item * batch * (m * k + k * n + m * n * (2 if accumulate else 1))


def _btc(x):
    """'B=..,T=..,C=..' for a (B,T,C) array, 'N=..,C=..' for any other (..., C)."""
    if x.ndim == 3:
        return "B={},T={},C={}".format(*x.shape)
    return f"N={_size(x) // x.shape[-1]},C={x.shape[-1]}"


def _rmw(accumulate):
    """Passes over an output: a read and a write when it accumulates, a write when
    it is overwritten."""
    return 2 if accumulate else 1


def encoder_forward_cost(out, inp, wte, wpe) -> Cost:
    B, T, C = out.shape
    n = B * T * C
    # reads the B*T token ids and their wte rows, wpe[:T] once (each of its rows serves all B
    # sequences); writes out
    return Cost(f"B={B},T={T},C={C}", {"encode": (n, _item(out) * (2 * n + T * C) + I32 * B * T)})


def encoder_backward_cost(dwte, dwpe, dout, inp, accumulate=True) -> Cost:
    B, T, C = dout.shape
    n = B * T * C
    rows = min(B * T, dwte.shape[0])      # distinct tokens at most: the bound when no token repeats
    X = _item(dout)
    terms = {
        "dwte": (n, X * (n + 2 * rows * C) + I32 * B * T),
        "dwpe": (n, X * (n + _rmw(accumulate) * T * C)),
    }
    tail = (dwpe.shape[0] - T) * C
    if not accumulate and tail:           # overwriting dwpe zeroes its rows past T: a write of each
        terms["dwpe_tail"] = (0, X * tail)
    return Cost(f"B={B},T={T},C={C}", terms)


def layernorm_forward_cost(out, mean, rstd, inp, weight, bias) -> Cost:
    C = inp.shape[-1]
    N = _size(inp) // C
    return Cost(_btc(inp),
                {"normalize": (8 * N * C, _item(inp) * (2 * N * C + 2 * C) + F32 * 2 * N)})


def fused_residual_layernorm_forward_cost(residual, out, mean, rstd, inp1, inp2, weight,
                                          bias) -> Cost:
    C = inp1.shape[-1]
    N = _size(inp1) // C
    # reads inp1, inp2, weight, bias; writes residual, out, mean, rstd: the
    # residual is never read back
    return (Cost(_btc(inp1), {
        "residual_normalize": (9 * N * C, _item(inp1) * (4 * N * C + 2 * C) + F32 * 2 * N)}))


def layernorm_backward_cost(dinp, dweight, dbias, dout, inp, weight, mean, rstd, accumulate=True,
                            fused=False) -> Cost:
    C = inp.shape[-1]
    N = _size(inp) // C
    X = _item(inp)
    if fused:      # one pass: dout and inp read once for dinp and the parameter gradients together
        return Cost(_btc(inp), {"backward": (17 * N * C, X * (4 * N * C + C + _rmw(accumulate) * 2
                                                              * C) + F32 * 2 * N)})
    return Cost(_btc(inp), {
        "dinp": (14 * N * C, X * (4 * N * C + C) + F32 * 2 * N),
        "dparams": (3 * N * C, X * (2 * N * C + _rmw(accumulate) * 2 * C) + F32 * 2 * N),
    })


def _matmul_params(x, C, OC):
    N = _size(x) // C
    lead = f"B={x.shape[0]},T={x.shape[1]}," if x.ndim == 3 else ""
    return f"{lead}C={C},OC={OC},M={N},N={OC},K={C}"


def _plus(term, flops, nbytes) -> Term:
    return term[0] + flops, term[1] + nbytes


def matmul_forward_cost(out, inp, weight, bias, fused=False) -> Cost:
    OC, C = weight.shape
    N = _size(inp) // C
    X = _item(inp)
    terms = {"gemm": gemm_term(N, OC, C, item=X)}
    # the epilogue adds the bias as it writes out: one read of bias
    if bias is not None and fused:
        terms["gemm"] = _plus(terms["gemm"], N * OC, X * OC)
    elif bias is not None:                # a second pass: out read and written again
        terms["bias"] = (N * OC, X * (2 * N * OC + OC))
    return Cost(_matmul_params(inp, C, OC), terms)


def matmul_backward_cost(dinp, dweight, dbias, dout, inp, weight, accumulate=True,
                         fused=False) -> Cost:
    OC, C = weight.shape
    N = _size(inp) // C
    X = _item(inp)
    terms = {"dinp": gemm_term(N, C, OC, item=X),
             "dweight": gemm_term(OC, C, N, accumulate=accumulate, item=X)}
    if dbias is not None and fused and X == F32:
        # the dweight GEMM sums dout's columns as it reads dout and writes the OC sums; adding them
        # into an accumulating dbias is a small pass of its own (read the sums and dbias, write
        # dbias). (A bf16 build sums with the column-sum kernels, below: CudaBackend._weight_grads.)
        terms["dweight"] = _plus(terms["dweight"], N * OC, F32 * OC)
        if accumulate:
            terms["dbias"] = (OC, F32 * 3 * OC)
    elif dbias is not None:
        terms["dbias"] = (N * OC, X * (N * OC + _rmw(accumulate) * OC))
    return Cost(_matmul_params(inp, C, OC), terms)


def matmul_gelu_forward_cost(out, pre, inp, weight, bias) -> Cost:
    OC, C = weight.shape
    N = _size(inp) // C
    # the GEMM plus its epilogue: bias and GELU per output (gelu_forward's 10 FLOPs), bias
    # read, pre written too
    X = _item(inp)
    gemm = _plus(gemm_term(N, OC, C, item=X), N * OC * (1 + 10), X * (OC + N * OC))
    return Cost(_matmul_params(inp, C, OC), {"gemm": gemm})


def gelu_matmul_backward_cost(dinp, dweight, dbias, dout, inp, weight, pre,
                              accumulate=True) -> Cost:
    OC, C = weight.shape
    N = _size(inp) // C
    cost = matmul_backward_cost(dinp, dweight, dbias, dout, inp, weight, accumulate, True)
    # gelu' (gelu_backward's 20 FLOPs) applied by the dinp GEMM's epilogue, reading pre
    cost.terms["dinp"] = _plus(cost.terms["dinp"], 20 * N * C, _item(pre) * N * C)
    return cost


def _attention_product(term, HS, pairs, causal_half):
    """A (T,T)-sized product of attention: as the GEMM term says (the whole square, what a batched
    GEMM computes), or, with causal_half, its FLOPs over the (query, key) pairs the mask keeps only
    (a kernel that skips the masked half); its bytes either way."""
    return (2 * HS * pairs, term[1]) if causal_half else term


def attention_forward_cost(out, qkvr, att, inp, causal_half=False) -> Cost:
    """causal_half: the backend skips the masked half of q k^T and att v
    (NumpyBackend's fast path)."""
    _, B, NH, T, HS = qkvr.shape
    n, BH, rows = B * T * NH * HS, B * NH, B * NH * T
    pairs = BH * T * (T + 1) // 2
    X = _item(inp)
    return Cost(f"B={B},T={T},NH={NH},HS={HS}", {
        # inp (B,T,3C) -> qkvr (3,B,NH,T,HS)
        "permute": (0, X * 6 * n),
        # q k^T
        "scores": _attention_product(gemm_term(T, T, HS, BH, item=X), HS, pairs, causal_half),
        # scale, mask, max, exp, sum, divide
        "softmax": (5 * rows * (T + 1) // 2, X * 2 * rows * T),
        # att v
        "weighted_sum": _attention_product(gemm_term(T, HS, T, BH, item=X), HS, pairs, causal_half),
        "unpermute": (0, X * 2 * n),                              # (B,NH,T,HS) -> out (B,T,C)
    })


def attention_backward_cost(dinp, dout, qkvr, att, causal_half=False) -> Cost:
    """causal_half: as attention_forward_cost's, for dv, datt, dq and dk."""
    _, B, NH, T, HS = qkvr.shape
    n, BH, rows = B * T * NH * HS, B * NH, B * NH * T
    pairs = BH * T * (T + 1) // 2
    X = _item(dout)
    return Cost(f"B={B},T={T},NH={NH},HS={HS}", {
        "unpermute_backward": (0, X * 2 * n),
        "dv": _attention_product(gemm_term(T, HS, T, BH, item=X), HS, pairs, causal_half),
        "datt": _attention_product(gemm_term(T, T, HS, BH, item=X), HS, pairs, causal_half),
        "softmax_backward": (4 * rows * (T + 1) // 2, X * 3 * rows * T),
        "dq": _attention_product(gemm_term(T, HS, T, BH, item=X), HS, pairs, causal_half),
        "dk": _attention_product(gemm_term(T, HS, T, BH, item=X), HS, pairs, causal_half),
        "permute_backward": (0, X * 6 * n),
    })


def _flash_shape(inp, lse):
    B, T, C3 = inp.shape
    NH = lse.shape[1]
    HS = C3 // 3 // NH
    pairs = B * NH * T * (T + 1) // 2          # (query, key) pairs the causal mask keeps
    return B, T, NH, HS, pairs


def flash_attention_forward_cost(out, lse, inp) -> Cost:
    B, T, NH, HS, pairs = _flash_shape(inp, lse)
    n = B * T * NH * HS
    # q k^T and P v over the causal half; scale, max, exp, sum, divide per pair; reads
    # qkv, writes out and lse
    return Cost(f"B={B},T={T},NH={NH},HS={HS}", {
        "attention": (4 * HS * pairs + 5 * pairs, _item(inp) * (3 * n + n) + F32 * B * NH * T),
    })


def flash_attention_backward_cost(dinp, dout, inp, out, lse) -> Cost:
    """FlashAttention-2's backward as kernels/flash_attention.cu runs it: D, then two passes over
    the causal pairs that each recompute the probabilities P and dS (no atomics: one writes dK and
    dV, the other dQ)."""
    B, T, NH, HS, pairs = _flash_shape(inp, lse)
    n, rows = B * T * NH * HS, B * NH * T
    X = _item(inp)
    # per pair, each pass: S = q k^T and dP = dout v^T (2 HS FLOPs each), P = exp(S scale - lse) and
    # dS = P (dP - D) scale (6); reads q, k, v, dout (each once), lse and D
    recompute = 4 * HS * pairs + 6 * pairs
    reads = X * 4 * n + F32 * 2 * rows
    return Cost(f"B={B},T={T},NH={NH},HS={HS}", {
        # D = rowsum(dout * out): reads dout, out; writes D
        "delta": (2 * n, X * 2 * n + F32 * rows),
        # + dV = P^T dout, dK = dS^T q; writes dk, dv
        "dkv": (recompute + 4 * HS * pairs, reads + X * 2 * n),
        "dq": (recompute + 2 * HS * pairs, reads + X * n),       # + dQ = dS k; writes dq
    })


def gelu_forward_cost(out, inp) -> Cost:
    n = _size(inp)
    return Cost(f"N={n}", {"gelu": (10 * n, _item(inp) * 2 * n)})


def gelu_backward_cost(dinp, inp, dout) -> Cost:
    n = _size(inp)
    return Cost(f"N={n}", {"gelu_backward": (20 * n, _item(inp) * 3 * n)})


def residual_forward_cost(out, inp1, inp2) -> Cost:
    n = _size(out)
    return Cost(f"N={n}", {"add": (n, _item(out) * 3 * n)})


def residual_backward_cost(dinp1, dinp2, dout) -> Cost:
    n = _size(dout)
    return Cost(f"N={n}", {"add": (2 * n, _item(dout) * 5 * n)})


def fused_classifier_cost(logits, losses, targets, V, dloss, write_dlogits) -> Cost:
    *lead, Vp = logits.shape
    N = _size(logits) // Vp
    shape = f"B={lead[0]},T={lead[1]}," if len(lead) == 2 else f"N={N},"
    # max, exp, sum and the loss per logit; with dlogits also the softmax, its scaling and the write
    flops = N * V * (8 if write_dlogits else 4)
    return Cost(f"{shape}V={V},Vp={Vp}", {
        "classifier": (flops,
                       _item(logits) * N * (V + (Vp if write_dlogits else 0)) + F32 * N + I32 * N),
    })


# adamw_cost called without the op's keywords: bf16 counted with masters (-w 1)
_MASTER_UNSAID = object()


def adamw_cost(params, grads, m, v, *hyperparameters, master=_MASTER_UNSAID, seed=0,
               offset=0) -> Cost:
    """master, seed, offset: the op's keywords (Backend.adamw_update); master=None with
    bf16 params is -w 0."""
    n = _size(params)
    if _item(params) == F32:                  # reads p, g, m, v; writes p, m, v
        return Cost(f"N={n}", {"update": (14 * n, F32 * 7 * n)})
    # -w 0: reads p, g, m, v; writes p, m, v (no fp32 copy)
    if master is None:
        return Cost(f"N={n}",
                    {"update": (14 * n, (2 * _item(params) + _item(grads)) * n + F32 * 4 * n)})
    # with fp32 master weights: reads master, g, m, v; writes p, master, m, v
    return Cost(f"N={n}", {"update": (14 * n, (_item(params) + _item(grads)) * n + F32 * 6 * n)})


def loss_mean_cost(stats, losses, count, accumulate) -> Cost:
    n = _size(losses)
    return Cost(f"N={n}", {"mean": (n, F32 * (n + _rmw(accumulate)))})


def global_norm_cost(grads, *device_stats) -> Cost:
    n = _size(grads)
    return Cost(f"N={n}", {"sum_squares": (2 * n, _item(grads) * n)})


# op name (as the model's ranges and the profiler's records name it) -> its cost formula
COSTS: Dict[str, Callable[..., Cost]] = {
    "encoder_forward": encoder_forward_cost,
    "encoder_backward": encoder_backward_cost,
    "layernorm_forward": layernorm_forward_cost,
    "layernorm_backward": layernorm_backward_cost,
    "matmul_forward": matmul_forward_cost,
    "matmul_backward": matmul_backward_cost,
    "matmul_gelu_forward": matmul_gelu_forward_cost,
    "gelu_matmul_backward": gelu_matmul_backward_cost,
    "fused_residual_layernorm_forward": fused_residual_layernorm_forward_cost,
    "attention_forward": attention_forward_cost,
    "attention_backward": attention_backward_cost,
    "flash_attention_forward": flash_attention_forward_cost,
    "flash_attention_backward": flash_attention_backward_cost,
    "gelu_forward": gelu_forward_cost,
    "gelu_backward": gelu_backward_cost,
    "residual_forward": residual_forward_cost,
    "residual_backward": residual_backward_cost,
    "fused_classifier": fused_classifier_cost,
    # the device step only (the host step reads the losses back)
    "loss_mean": loss_mean_cost,
    "adamw": adamw_cost,                 # Backend.adamw_update, adamw_update_device
    "global_norm": global_norm_cost,     # Backend.global_norm_squared, global_norm_squared_device
}
# the op name -> the backend methods that run it, where they are named differently
OP_METHODS = {"adamw": ("adamw_update", "adamw_update_device"),
              "global_norm": ("global_norm_squared", "global_norm_squared_device")}
# ops that only the device step (train_step on a backend with upload_tokens) runs
DEVICE_STEP_OPS = ("loss_mean",)


def op_cost(op: str, args, keywords=None, **variant) -> Cost:
    """The cost of one call of `op` with these arguments (the op's own argument list) and keywords
    (AdamW's master, seed, offset); `variant`: the keywords a backend passes for how it runs the op
    (attention's causal_half), see backend_op_cost."""
    try:
        formula = COSTS[op]
    except KeyError:
        raise KeyError(f"no cost formula for op {op!r}; known: {', '.join(COSTS)}") from None
    return formula(*args, **(keywords or {}), **variant)


def backend_op_cost(backend, op: str, args, keywords=None) -> Cost:
    """The cost of `op` as `backend` runs it: the backend's op_cost_variant(op, args) names the
    formula's variant (a backend without one runs every op as the formula's default says)."""
    variant = getattr(backend, "op_cost_variant", None)
    return op_cost(op, args, keywords, **(variant(op, args) if variant else {}))
