"""A PyTorch GPT-2 written from the equations: the independent reference gpt2np is checked against.

It holds llm.c's flat parameter buffer, and the 16 tensors as autograd leaves that are views of it;
their gradients, concatenated in llm.c's order, are llm.c's flat gradient buffer (wte rows padded to
Vp; the padding rows get zero gradient because lm_head only reads wte[:V] and token ids are < V).
Forward and backward use autograd; AdamW is written out by hand with llm.c's update rule.

    ref = TorchGPT2(cfg, params_flat)        # params_flat: (num_parameters(cfg),), an llm.c file's
    out = ref.forward_backward(x, y)         # x, y: (B,T) ints
    out.logits (B,T,V), out.loss (float), out.grads {name: array in tensors.param_shapes(cfg)}
    losses = ref.take_steps(x, y, 10, lr=1e-4)   # the loss before each update, as llm.c's loop
    ac = TorchGPT2(cfg, params_flat, autocast=True)   # PyTorch's bf16 mixed precision (compare)

autocast=True runs the forward pass under torch.autocast("cpu", dtype=torch.bfloat16), as a PyTorch
user trains in bf16: fp32 parameters, gradients and AdamW; matmuls on bf16 inputs; LayerNorm and
GELU as PyTorch's own ops (F.layer_norm, F.gelu: fp32 math inside, bf16 out under autocast); the
loss in fp32 from the bf16 logits.

PyTorch is optional: importing this module works without it; building a TorchGPT2 without it raises
ReferenceUnavailableError with a one-line install hint.
"""
import math
from dataclasses import dataclass

import numpy as np

from gpt2np.config import GPT2Config
from gpt2np.tensors import (
    DECAYED_BY_DEFAULT,
    PARAM_NAMES,
    num_parameters,
    offsets,
    param_shapes,
    views,
)

LN_EPS = 1e-5


class ReferenceUnavailableError(ImportError):
    """PyTorch is not installed, so the reference model cannot run."""


def require_torch():
    """Import torch, or raise ReferenceUnavailableError with a one-line hint."""
    try:
        import torch
    except ImportError as e:
        raise ReferenceUnavailableError(
            f"the PyTorch reference needs torch, which is not installed ({e}); "
            "install it with: pip install torch  (or pip install 'gpt2np[test]')") from None
    return torch


# ----------------------------------------------------------------------------------------------
# the network, one function per equation; p is {name: tensor in llm.c's shape}

def layernorm(x, w, b):
    """x (B,T,C), w (C), b (C) -> (x - mean) / sqrt(var + 1e-5) * w + b, biased variance over C."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / (var + LN_EPS).sqrt() * w + b


def gelu_tanh(x):
    """GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + (math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)).tanh())


def torch_layernorm(x, w, b):
    """layernorm by PyTorch's F.layer_norm."""
    import torch.nn.functional as F
    return F.layer_norm(x, (x.shape[-1],), w, b, LN_EPS)


def torch_gelu_tanh(x):
    """gelu_tanh by PyTorch's F.gelu."""
    import torch.nn.functional as F
    return F.gelu(x, approximate="tanh")


def linear(x, w, b):
    """x (..., IN), w (OUT, IN), b (OUT) -> x @ w^T + b  (llm.c stores weights as (out, in))."""
    return x @ w.transpose(0, 1) + b


def causal_self_attention(qkv, num_heads):
    """qkv (B,T,3C) = [q | k | v], head h in columns h*HS:(h+1)*HS of each -> (B,T,C).

    att = softmax(q k^T / sqrt(HS)) with s > t masked out; y = att v, heads concatenated.
    """
    import torch
    B, T, C3 = qkv.shape
    C = C3 // 3
    HS = C // num_heads
    q, k, v = (t.reshape(B, T, num_heads, HS).transpose(1, 2) for t in qkv.split(C, dim=-1))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))                  # (B,NH,T,T)
    future = torch.ones(T, T, dtype=torch.bool, device=qkv.device).triu(diagonal=1)
    att = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (att @ v).transpose(1, 2).reshape(B, T, C)                            # (B,T,C)


def gpt2_logits(p, cfg: GPT2Config, x, torch_ops=False, bf16_residual=False):
    """x (B,T) int64 token ids -> logits (B,T,V) over the real vocabulary (lm_head tied to wte[:V]).
    torch_ops: LayerNorm and GELU by F.layer_norm and F.gelu (what autocast gives
    its bf16 policy to).
    bf16_residual: the residual stream rounded to bf16 after the embedding and after every add, its
    gradient too on the way back (the casts' backward), as llm.c's bf16 scheme stores both;
    autocast keeps them fp32."""
    ln, gelu = (torch_layernorm, torch_gelu_tanh) if torch_ops else (layernorm, gelu_tanh)
    T = x.shape[1]
    torch = require_torch()

    def residual(h):
        return h.to(torch.bfloat16).to(torch.float32) if bf16_residual else h

    # unbind (not p[name][l]) so that backward stacks each (L, ...) gradient once
    layer = {name: p[name].unbind(0) for name in PARAM_NAMES[2:14]}
    h = residual(p["wte"][x] + p["wpe"][:T])                                     # (B,T,C)
    for l in range(cfg.num_layers):
        w = {name: tensors[l] for name, tensors in layer.items()}
        qkv = linear(ln(h, w["ln1w"], w["ln1b"]), w["qkvw"], w["qkvb"])
        h = residual(h + linear(causal_self_attention(qkv, cfg.num_heads), w["attprojw"],
                                w["attprojb"]))
        fch = linear(ln(h, w["ln2w"], w["ln2b"]), w["fcw"], w["fcb"])
        h = residual(h + linear(gelu(fch), w["fcprojw"], w["fcprojb"]))
    h = ln(h, p["lnfw"], p["lnfb"])
    return h @ p["wte"][:cfg.vocab_size].transpose(0, 1)                         # (B,T,V)


def cross_entropy(logits, y):
    """logits (B,T,V), y (B,T) -> mean over B*T of logsumexp(logits) - logits[y]."""
    target = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return (logits.logsumexp(dim=-1) - target).mean()


# ----------------------------------------------------------------------------------------------

@dataclass
class ReferenceOutput:
    """One forward + backward: logits (B,T,V), mean loss, grads {name: llm.c shape} (wte padded)."""
    logits: np.ndarray
    loss: float
    grads: dict


class TorchGPT2:
    """GPT-2 on llm.c's flat parameter buffer, in float32 (or float64 for tests), on the CPU."""

    def __init__(self, cfg: GPT2Config, params_flat, dtype: str = "float32", autocast: bool = False,
                 bf16_residual: bool = False):
        """bf16_residual (with autocast): the residual stream and its gradient rounded to
        bf16 (gpt2_logits)."""
        torch = require_torch()
        self.torch = torch
        self.autocast = autocast
        self.bf16_residual = bf16_residual
        if dtype not in ("float32", "float64"):
            raise ValueError(f"reference dtype must be float32 or float64, got {dtype!r}")
        params_flat = np.asarray(params_flat)
        if params_flat.shape != (num_parameters(cfg),):
            raise ValueError(f"reference: expected {num_parameters(cfg)} parameters for {cfg}, "
                             f"got an array of shape {params_flat.shape}")
        self.cfg = cfg
        self.shapes = param_shapes(cfg)
        self.flat = torch.from_numpy(params_flat.astype(dtype, copy=True))
        # leaves sharing self.flat's memory: updating self.flat in place updates them
        self.params = {name: v.detach().requires_grad_(True)
                       for name, v in views(self.flat, self.shapes).items()}
        self.m = self.v = None    # AdamW moments, created on the first update
        self.t = 0                # AdamW step count (llm.c's t, starts at 1)

    # -- inputs -----------------------------------------------------------------------------
    def _tokens(self, a, what):
        a = np.asarray(a)
        if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"reference: {what} must be a (B,T) integer array, got "
                             f"{a.dtype} {a.shape}")
        if a.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"reference: T={a.shape[1]} exceeds "
                             f"max_seq_len={self.cfg.max_seq_len}")
        if a.size and (a.min() < 0 or a.max() >= self.cfg.vocab_size):
            raise ValueError(f"reference: {what} has token ids outside [0, {self.cfg.vocab_size})")
        return self.torch.from_numpy(a.astype(np.int64))

    # -- forward / backward -----------------------------------------------------------------
    def forward(self, x, y=None):
        """-> (logits (B,T,V) tensor, mean loss tensor or None); differentiable
        w.r.t. self.params."""
        x_t = self._tokens(x, "x")
        if self.autocast:
            with self.torch.autocast("cpu", dtype=self.torch.bfloat16):
                logits = gpt2_logits(self.params, self.cfg, x_t, torch_ops=True,
                                     bf16_residual=self.bf16_residual)
            # the loss in fp32, as F.cross_entropy under autocast
            logits = logits.float()
        else:
            logits = gpt2_logits(self.params, self.cfg, x_t)
        if y is None:
            return logits, None
        y_t = self._tokens(y, "y")
        if y_t.shape != x_t.shape:
            raise ValueError(f"reference: x {tuple(x_t.shape)} and y "
                             f"{tuple(y_t.shape)} differ in shape")
        return logits, cross_entropy(logits, y_t)

    def _backward(self, x, y):
        for p in self.params.values():
            p.grad = None
        logits, loss = self.forward(x, y)
        loss.backward()
        return logits.detach(), loss.detach()

    def flat_grad(self):
        """The gradient as one flat tensor in llm.c's order (zeros for tensors
        it does not reach)."""
        torch = self.torch
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params.values()])

    def forward_backward(self, x, y) -> ReferenceOutput:
        """Logits, loss and the 16 gradients for one batch, as numpy arrays in llm.c's layout."""
        logits, loss = self._backward(x, y)
        grads = {name: p.grad.numpy().copy() for name, p in self.params.items()}
        return ReferenceOutput(logits.numpy(), float(loss), grads)

    def grad_norm(self) -> float:
        """sqrt(sum of squared gradients) over the flat buffer, accumulated in float64."""
        torch = self.torch
        squares = sum(float(torch.sum(p.grad.double() ** 2)) for p in self.params.values()
                      if p.grad is not None)
        return squares ** 0.5

    # -- optimisation -----------------------------------------------------------------------
    def adamw_update(self, lr, beta1, beta2, eps, weight_decay, decay_tensors=DECAYED_BY_DEFAULT,
                     grad_scale=1.0):
        """llm.c's AdamW on the flat buffer, with g = grad * grad_scale and t += 1 first:

        m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  mhat = m / (1-b1^t);  vhat = v / (1-b2^t)
        p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p)
        with wd = weight_decay on decay_tensors, else 0
        """
        torch = self.torch
        unknown = set(decay_tensors) - set(PARAM_NAMES)
        if unknown:
            raise ValueError(f"reference: unknown tensors in decay_tensors: {sorted(unknown)}")
        with torch.no_grad():
            if self.m is None:
                self.m, self.v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
            self.t += 1
            g = self.flat_grad().mul_(grad_scale)
            self.m.mul_(beta1).add_(g, alpha=1.0 - beta1)
            self.v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            del g
            update = self.m / (1.0 - beta1 ** self.t)
            update.div_((self.v / (1.0 - beta2 ** self.t)).sqrt_().add_(eps))
            for name, (off, size) in offsets(self.shapes).items():
                if name in decay_tensors and weight_decay != 0.0:
                    update[off:off + size].add_(self.flat[off:off + size], alpha=weight_decay)
            self.flat.sub_(update, alpha=lr)

    def step(self, x, y, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
             decay_tensors=DECAYED_BY_DEFAULT, grad_clip=1.0):
        """One llm.c training step on (x, y): forward, backward, clip, AdamW -> (loss, grad norm).

        The loss is the one computed before the update. As in llm.c, grad_scale = grad_clip / norm
        when norm > grad_clip, else 1; grad_clip None or <= 0 disables clipping.
        """
        _, loss = self._backward(x, y)
        norm = self.grad_norm()
        clip = grad_clip is not None and grad_clip > 0 and norm > grad_clip
        grad_scale = grad_clip / norm if clip else 1.0
        self.adamw_update(lr, beta1, beta2, eps, weight_decay, decay_tensors, grad_scale)
        return float(loss), norm

    def take_steps(self, x, y, n, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                   decay_tensors=DECAYED_BY_DEFAULT, grad_clip=1.0):
        """n AdamW steps on the same batch -> the n losses, each computed before its update."""
        return [self.step(x, y, lr, beta1, beta2, eps, weight_decay, decay_tensors, grad_clip)[0]
                for _ in range(n)]

    def params_host(self) -> np.ndarray:
        """A numpy copy of the flat parameter buffer (llm.c order)."""
        return self.flat.numpy().copy()
