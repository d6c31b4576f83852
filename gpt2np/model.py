"""GPT-2: the network, written once against a backend's op contract.

The model owns flat buffers in llm.c's discipline: parameters and gradients are each one buffer with
named views (tensors.PARAM_NAMES order); the AdamW moments m, v are plain flat buffers, allocated at
the first update and sized to its shard (all parameters, or this process's ZeRO-1 shard);
activations are preallocated for (B, T). It knows the network, not the device: every op is a call on
`backend`.

A training step is llm.c's: forward(inputs, targets, for_backward=True) gives the loss and leaves
dlogits; backward() the gradients; grad_norm(); update(...). Each call takes what it does as
arguments: which tokens it reads, whether backward adds to the gradients or overwrites them (a
step's first micro-batch overwrites, which saves zeroing them), whether the loss is read back or
stays on the device. The model keeps its buffers and the last forward's (b, t), and no record of
where a step stands, so a CUDA graph's replay, which runs none of this Python, leaves nothing stale
(gpt2np.train_step).

Precision: the buffers take the backend's dtype (`backend.zeros`). With bf16 storage (precision
"bf16") what llm.c keeps in fp32 stays fp32: the LayerNorm statistics and the losses (a second
activation buffer, tensors.FP32_ACTIVATIONS), AdamW's m and v, and the master weights: an fp32 copy
of the parameters (this process's update shard), made from the bf16 parameters at the first update
as llm.c does; AdamW updates it and writes the bf16 parameters from it with stochastic rounding
seeded by (rounding_seed, step, index). Without master weights (master_weights=False, llm.c's -w 0)
no fp32 copy is allocated (4 bytes a parameter less): AdamW reads the bf16 parameters (upcast),
updates them in fp32 and writes them back with the same stochastic rounding.
"""
import math

import numpy as np

from gpt2np import ranges
from gpt2np.config import GPT2Config
from gpt2np.init import llmc_init
from gpt2np.tensors import (
    DECAYED_BY_DEFAULT,
    FP32_ACTIVATIONS,
    PARAM_NAMES,
    RECOMPUTE_LEVELS,
    activation_shapes,
    layout_size,
    num_parameters,
    param_shapes,
    views,
)

# the device step's buffers (CUDA backend: nothing read back inside a step, see gpt2np.train_step)
STATS = 2            # stats: [mean loss over the micro-batches, squared global gradient norm]
# step_scalars (float32): [lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t), 1 - lr weight_decay, t,
# loss limit, grad-norm limit], t (mod 2^32) stored as the bits of its float32 slot (a uint32
# view: every step number exact; the bf16 kernel's stochastic rounding reads it); AdamW skips the
# step when the loss or the norm exceeds its limit (gpt2np.outlier, -sl/-sg; inf = no limit)
STEP_SCALARS = 6


class TokenError(ValueError):
    """A token id outside [0, V)."""


def _batch_view(buf, b, t):
    """The front of a (B, T, ...) buffer as a (b, t, ...) view: a smaller batch's b*t rows."""
    rest = tuple(buf.shape[2:])
    return buf.reshape(-1)[:b * t * math.prod(rest)].reshape(b, t, *rest)


class GPT2:
    """GPT-2 with preallocated buffers for batches up to (B, T).

    One attribute per buffer, each allocated whole; a smaller batch (b, t) uses the front of it
    (_batch_view).
    params, grads: flat (num_parameters,) buffers; param[name], grad[name] are the tensors in them.
    m, v: flat fp32 buffers of the update shard (all parameters, or the ZeRO-1 shard), None until
    the first update.
    acts (and acts_fp32 with bf16 storage): the activations; act[name] are the tensors in them for
    the last forward's (b, t), batch_shape.
    dresidual, dbtc, dbt3c, dbt4c: (B, T, C/C/3C/4C) scratch every layer's backward reuses (naive
    attention's forward writes its qkv into dbt3c).
    token_slots: [(inputs, targets)] (B, T) int32 buffers, a pair per micro-batch of a device step;
    forward copies host tokens into slot 0.
    stats, step_scalars: the device step's buffers (STATS, STEP_SCALARS), made on first use.
    forward(inputs, targets) -> mean loss; backward(); grad_norm(); update(...).
    """

    def __init__(self, cfg: GPT2Config, backend, B: int, T: int, seed=None,
                 decay_tensors=DECAYED_BY_DEFAULT, attention="naive", fuse=None, gelu_fusion=None,
                 recompute=0, master_weights=True):
        """Allocate the buffers for batches up to (B, T); with `seed`, llm.c's random init.

        fuse: call the fused ops (GEMM epilogues, residual + LayerNorm, one-pass LayerNorm
        backward); None = on backends that launch kernels (CUDA), off on NumPy, where they would
        only compose the same ops.
        gelu_fusion (llm.c's -ge, with fuse): 0 = the fc GEMM and the GELU apart, 1 = GELU in the fc
        GEMM's epilogue (forward), 2 = also dGELU in c_proj's backward GEMM; None = 2 with fuse, 0
        without (which allows no other value: the epilogues are fused ops).
        recompute (llm.c's -r): 0 keeps every activation; 1 keeps one GELU output for all layers and
        recomputes each layer's in backward; 2 also the LayerNorm outputs
        (tensors.activation_shapes).
        master_weights: with bf16 storage, keep fp32 master weights for AdamW (llm.c's -w 1); False:
        AdamW updates the bf16 parameters directly (-w 0). fp32 parameters are their own master
        weights.
        """
        if not 0 < T <= cfg.max_seq_len:
            raise ValueError(f"sequence length T={T} must be in 1..{cfg.max_seq_len} (the model's "
                             f"max_seq_len)")
        if B < 1:
            raise ValueError(f"batch size B={B} must be positive")
        self.cfg, self.backend, self.B, self.T = cfg, backend, B, T
        self.attention = attention                   # "naive" or "flash" (tensors.ATTENTIONS)
        self.num_parameters = num_parameters(cfg)
        self.param_shapes = param_shapes(cfg)
        self.decay_tensors = tuple(decay_tensors)
        self.fuse = bool(backend.launches_kernels if fuse is None else fuse)
        if gelu_fusion is None:
            gelu_fusion = 2 if self.fuse else 0
        if gelu_fusion not in (0, 1, 2) or (gelu_fusion and not self.fuse):
            raise ValueError(f"gelu_fusion {gelu_fusion!r}: expected 0, 1 or 2, and 0 without fuse "
                             f"(the GELU epilogues are fused ops)")
        if recompute not in RECOMPUTE_LEVELS:
            raise ValueError(f"recompute {recompute!r}: expected 0, 1 or 2")
        self.gelu_fusion = int(gelu_fusion)
        self.recompute = int(recompute)
        self.params = backend.zeros(self.num_parameters)
        self.param = views(self.params, self.param_shapes)
        self.grads = backend.zeros(self.num_parameters)
        self.grad = views(self.grads, self.param_shapes)
        self.m = self.v = None                # AdamW moments, allocated at the first update
        self.master = None                    # fp32 master weights (bf16 storage, -w 1), ditto
        self.master_weights = bool(master_weights)      # -w: whether bf16 storage keeps them
        self.rounding_seed = 1337             # stochastic rounding's seed (bf16; trainer: --seed)
        # bf16 storage keeps the LayerNorm statistics and the losses in a second, fp32 buffer
        # (llm.c's floats)
        self._fp32_stats = np.dtype(backend.dtype) != np.float32
        main, fp32 = self._activation_layouts(B, T)
        self.acts = backend.zeros(layout_size(main))
        self.acts_fp32 = backend.zeros(layout_size(fp32), np.float32) if self._fp32_stats else None
        self.token_slots = [self._token_pair()]
        C = cfg.channels
        self.dresidual = backend.zeros((B, T, C))
        self.dbtc = backend.zeros((B, T, C))
        self.dbt3c = backend.zeros((B, T, 3 * C))
        self.dbt4c = backend.zeros((B, T, 4 * C))
        self.mean_loss = None        # the last forward's mean loss, read back (or None)
        # what the last forward left in act["logits"], for the checks of backward and logits_host
        # only: "logits", "logits+targets" (the classifier can still run) or
        # "dlogits" (for_backward)
        self.logits_hold = None
        self.stats = self.step_scalars = None        # the device step's buffers, made on first use
        self.batch_shape = self.act = None
        self._set_batch_shape(B, T)
        if seed is not None:
            self.init_random(seed)

    # ---- parameters ---------------------------------------------------------------------
    def init_random(self, seed: int):
        """Set the parameters to llm.c's random init, bit for bit.

        gpt2np.init.llmc_init, its mt19937 seeded `seed` (llm.c's is 42): N(0, 0.02) weights, N(0,
        0.02/sqrt(2L)) residual projections, LN weights 1, biases 0, the wte padding rows [V, Vp)
        zero; bf16 parameters are those values rounded to nearest even, as llm.c's cast.
        """
        self.load_params(llmc_init(self.cfg, seed))

    def load_params(self, flat):
        """Copy a host (num_parameters,) float array into the parameter buffer."""
        flat = np.asarray(flat)
        if flat.shape != (self.num_parameters,):
            raise ValueError(f"expected {self.num_parameters} parameters, got {flat.shape}")
        self.backend.copy_(self.params, self.backend.from_host(flat, self.params.dtype))
        self.master = None               # bf16: the next update makes the master weights from these

    def params_host(self):
        """A host copy of the flat parameter buffer."""
        return self.backend.to_host(self.params)

    def grads_host(self):
        """{name: host copy of the gradient} in llm.c shapes."""
        return views(self.backend.to_host(self.grads), self.param_shapes)

    def logits_host(self):
        """Return a (b, t, Vp) host copy of the last forward's logits."""
        if self.logits_hold == "dlogits":
            raise RuntimeError("logits were overwritten by dlogits in the fused classifier")
        return self.backend.to_host(self.act["logits"])

    # ---- activations and tokens ---------------------------------------------------------
    def _set_batch_shape(self, b, t):
        """Cut the activation views `act` for a (b, t) batch (b <= B, t <= T share the buffers)."""
        if self.batch_shape == (b, t):
            return
        self.batch_shape = (b, t)
        main, fp32 = self._activation_layouts(b, t)
        self.act = views(self.acts, main)
        if fp32:
            self.act.update(views(self.acts_fp32, fp32))

    def _activation_layouts(self, b, t):
        """Return the activations' {name: shape} for (b, t): the main buffer's and the fp32 one's.

        The second is empty when all activations have one dtype.
        """
        shapes = activation_shapes(self.cfg, b, t, self.attention, self.recompute)
        if not self._fp32_stats:
            return shapes, {}
        return ({n: s for n, s in shapes.items() if n not in FP32_ACTIVATIONS},
                {n: s for n, s in shapes.items() if n in FP32_ACTIVATIONS})

    def _token_pair(self):
        """A new token slot: (inputs, targets) (B, T) int32 device buffers."""
        return (self.backend.zeros((self.B, self.T), np.int32),
                self.backend.zeros((self.B, self.T), np.int32))

    def _make_step_buffers(self):
        """The device step's stats and step_scalars, made on first use."""
        if self.stats is None:
            self.stats = self.backend.zeros(STATS, np.float32)
            self.step_scalars = self.backend.zeros(STEP_SCALARS, np.float32)

    def _check_tokens(self, tokens, what):
        """Host (b, t) token ids as int32, checked against (B, T) and the vocabulary."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] > self.B or tokens.shape[1] > self.T:
            raise ValueError(f"{what} must be (b, t) with b <= {self.B}, t <= {self.T}; got "
                             f"{tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            bad = int(tokens.max() if tokens.max() >= self.cfg.vocab_size else tokens.min())
            raise TokenError(f"{what} contain token id {bad} outside [0, {self.cfg.vocab_size})")
        return tokens.astype(np.int32, copy=False)

    def _check_pair(self, inputs, targets):
        """_check_tokens of inputs and targets, which must have one shape."""
        inputs = self._check_tokens(inputs, "inputs")
        targets = self._check_tokens(targets, "targets")
        if targets.shape != inputs.shape:
            raise ValueError(f"targets {targets.shape} and inputs {inputs.shape} differ in shape")
        return inputs, targets

    def _load_tokens(self, inputs, targets):
        """Copy host (b, t) token ids into token slot 0 -> (inputs, targets) views there.

        targets None: no targets copied, None returned for them.
        """
        be = self.backend
        if targets is None:
            inputs = self._check_tokens(inputs, "inputs")
        else:
            inputs, targets = self._check_pair(inputs, targets)
        b, t = inputs.shape
        x, y = (_batch_view(buf, b, t) for buf in self.token_slots[0])
        be.copy_(x, be.from_host(inputs))
        if targets is None:
            return x, None
        be.copy_(y, be.from_host(targets))
        return x, y

    def stage_batch(self, slot, inputs, targets):
        """Queue host (b, t) tokens into token slot `slot` -> their (inputs, targets) device views.

        The device step's upload (slot: the 0-based micro-batch of the step): nothing is read back,
        and encoder_backward's grouping of the inputs goes up with them, made from this host copy
        (backend.upload_tokens). forward(tokens=...) and backward(tokens=...) then read the views.
        """
        be = self.backend
        inputs, targets = self._check_pair(inputs, targets)
        self._make_step_buffers()
        while len(self.token_slots) <= slot:
            self.token_slots.append(self._token_pair())
        b, t = inputs.shape
        x, y = (_batch_view(buf, b, t) for buf in self.token_slots[slot])
        be.upload_tokens(x, inputs)
        be.upload_(y, targets)
        return x, y

    def _ln(self, which, l):
        """Return layer l's LayerNorm output `which` ("ln1", "ln2").

        Its own slice, or with recompute 2 lnf, the buffer every LayerNorm writes in turn (as llm.c
        does).
        """
        return self.act["lnf"] if self.recompute >= 2 else self.act[which][l]

    def _gelu(self, l):
        """Return layer l's GELU output.

        Its own slice, or with recompute >= 1 the one (B,T,4C) buffer all layers share.
        """
        return self.act["fch_gelu"] if self.recompute >= 1 else self.act["fch_gelu"][l]

    # ---- one op -------------------------------------------------------------------------
    def _op(self, op, module, fn, *args, **keywords):
        """Run one backend op inside its range, named `op`.

        The range carries (module, args, keywords): the GPT-2 module and the op's arguments, for
        range listeners (the built-in profiler costs and attributes the op from them).
        """
        with ranges.range(op, (module, args, keywords)):
            fn(*args, **keywords)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, inputs=None, targets=None, *, tokens=None, for_backward=False,
                grad_accum_steps=1, device_loss=False, accumulate_loss=False):
        """Run the network on a (b, t) batch -> its mean loss (None: no targets, or device_loss).

        inputs, targets: host (b, t) token ids, copied into token slot 0 (no targets: the logits
        only). tokens: instead, the (inputs, targets) device views stage_batch returned (nothing to
        copy).
        The logits (b, t, Vp) are left in act["logits"]. for_backward: the fused classifier also
        writes dlogits over them, d(mean loss / grad_accum_steps), as llm.c's trainer does, so
        backward() starts from them.
        device_loss: the mean loss / grad_accum_steps stays on the device, written into stats[0], or
        added to it with accumulate_loss (the device step's later micro-batches); nothing is read
        back.
        """
        if (inputs is None) == (tokens is None):
            raise ValueError("forward() takes host inputs or staged tokens (stage_batch), not both")
        x, y = self._load_tokens(inputs, targets) if tokens is None else tokens
        if device_loss:
            self._make_step_buffers()
        self._set_batch_shape(*x.shape)
        be, a, p, L = self.backend, self.act, self.param, self.cfg.num_layers
        with ranges.range("gpt2_forward"):
            self._op("encoder_forward", "wte", be.encoder_forward, a["encoded"], x, p["wte"],
                     p["wpe"])
            for l in range(L):
                with ranges.range(f"Layer {l}"):
                    self._forward_layer(l)
            if not self.fuse:                # fused: the last layer's last op wrote ln_f
                self._op("layernorm_forward", "ln_f", be.layernorm_forward, a["lnf"], a["lnf_mean"],
                         a["lnf_rstd"], a["residual3"][L - 1], p["lnfw"], p["lnfb"])
            self._op("matmul_forward", "lm_head", be.matmul_forward, a["logits"], a["lnf"],
                     p["wte"], None, self.fuse)
            self.mean_loss = None
            self.logits_hold = ("logits" if y is None else "dlogits" if for_backward
                                else "logits+targets")
            if y is not None:
                self._classifier(y, for_backward, grad_accum_steps)
                if device_loss:              # the device step: the mean stays in stats[0]
                    self._op("loss_mean", "lm_head", be.loss_mean, self.stats, a["losses"],
                             grad_accum_steps, accumulate_loss)
                else:
                    self.mean_loss = float(be.to_host(a["losses"]).mean(dtype=np.float64))
        return self.mean_loss

    def _forward_layer(self, l):
        """Run layer l's forward: residual2 = residual + attn(ln_1(residual)), then residual3.

        residual3[l] = residual2 + mlp(ln_2(residual2)); residual is residual3[l - 1] (encoded for
        layer 0).
        """
        be, a, p, fuse, L = self.backend, self.act, self.param, self.fuse, self.cfg.num_layers
        h = f"h.{l}"
        residual = a["encoded"] if l == 0 else a["residual3"][l - 1]
        ln1, ln2, gelu = self._ln("ln1", l), self._ln("ln2", l), self._gelu(l)
        if l == 0 or not fuse:          # fused: the previous layer's last op normalized residual3
            self._op("layernorm_forward", f"{h}.ln_1", be.layernorm_forward, ln1, a["ln1_mean"][l],
                     a["ln1_rstd"][l], residual, p["ln1w"][l], p["ln1b"][l])
        flash = self.attention == "flash"    # flash keeps qkv; naive its permuted copy qkvr
        qkv = a["qkv"][l] if flash else _batch_view(self.dbt3c, *self.batch_shape)
        self._op("matmul_forward", f"{h}.attn.c_attn", be.matmul_forward, qkv, ln1, p["qkvw"][l],
                 p["qkvb"][l], fuse)
        if flash:
            self._op("flash_attention_forward", f"{h}.attn", be.flash_attention_forward,
                     a["atty"][l], a["lse"][l], qkv)
        else:
            self._op("attention_forward", f"{h}.attn", be.attention_forward, a["atty"][l],
                     a["qkvr"][l], a["att"][l], qkv)
        self._op("matmul_forward", f"{h}.attn.c_proj", be.matmul_forward, a["attproj"][l],
                 a["atty"][l], p["attprojw"][l], p["attprojb"][l], fuse)
        if fuse:
            self._op("fused_residual_layernorm_forward", f"{h}.ln_2",
                     be.fused_residual_layernorm_forward, a["residual2"][l], ln2, a["ln2_mean"][l],
                     a["ln2_rstd"][l], residual, a["attproj"][l], p["ln2w"][l], p["ln2b"][l])
        else:
            self._op("residual_forward", f"{h}.residual", be.residual_forward, a["residual2"][l],
                     residual, a["attproj"][l])
            self._op("layernorm_forward", f"{h}.ln_2", be.layernorm_forward, ln2, a["ln2_mean"][l],
                     a["ln2_rstd"][l], a["residual2"][l], p["ln2w"][l], p["ln2b"][l])
        if self.gelu_fusion >= 1:            # -ge 1, 2: bias and GELU in the fc GEMM's epilogue
            self._op("matmul_gelu_forward", f"{h}.mlp.c_fc", be.matmul_gelu_forward, gelu,
                     a["fch"][l], ln2, p["fcw"][l], p["fcb"][l])
        else:
            self._op("matmul_forward", f"{h}.mlp.c_fc", be.matmul_forward, a["fch"][l], ln2,
                     p["fcw"][l], p["fcb"][l], fuse)
            self._op("gelu_forward", f"{h}.mlp.gelu", be.gelu_forward, gelu, a["fch"][l])
        self._op("matmul_forward", f"{h}.mlp.c_proj", be.matmul_forward, a["fcproj"][l], gelu,
                 p["fcprojw"][l], p["fcprojb"][l], fuse)
        if fuse:                        # residual3 and the next LayerNorm (ln_1, ln_f at the end)
            nxt = ((f"h.{l + 1}.ln_1", self._ln("ln1", l + 1), a["ln1_mean"][l + 1],
                    a["ln1_rstd"][l + 1], p["ln1w"][l + 1], p["ln1b"][l + 1]) if l + 1 < L else
                   ("ln_f", a["lnf"], a["lnf_mean"], a["lnf_rstd"], p["lnfw"], p["lnfb"]))
            self._op("fused_residual_layernorm_forward", nxt[0],
                     be.fused_residual_layernorm_forward, a["residual3"][l], nxt[1], nxt[2], nxt[3],
                     a["residual2"][l], a["fcproj"][l], nxt[4], nxt[5])
        else:
            self._op("residual_forward", f"{h}.residual", be.residual_forward, a["residual3"][l],
                     a["residual2"][l], a["fcproj"][l])

    def _classifier(self, targets, write_dlogits, grad_accum_steps):
        """Run the fused classifier: per-token losses from the logits, and dlogits over them if
        asked."""
        b, t = self.batch_shape
        dloss = 1.0 / (b * t * grad_accum_steps)
        self._op("fused_classifier", "lm_head", self.backend.fused_classifier, self.act["logits"],
                 self.act["losses"], targets, self.cfg.vocab_size, dloss, write_dlogits)

    # ---- backward -----------------------------------------------------------------------
    def zero_grad(self):
        """Set the gradients to zero.

        train_step does not call it: a step's first backward(accumulate=False) overwrites them
        instead.
        """
        self.backend.fill_(self.grads, 0.0)

    def backward(self, tokens=None, *, accumulate=True, from_logits=False):
        """Compute the gradients of the last forward's loss: add them into grads, or write them.

        Starts from the dlogits that forward(..., for_backward=True) left in act["logits"].
        from_logits: the forward kept the logits; backward first turns them into dlogits of this
        batch's mean loss.
        tokens: the (inputs, targets) views the forward read (stage_batch's); default: token slot 0,
        where forward copies host tokens.
        accumulate=False: every op overwrites its gradient instead of adding to it, so what the
        buffer held does not matter (a step's first micro-batch: no zero_grad() pass over the
        buffer).
        """
        want = "logits+targets" if from_logits else "dlogits"
        if self.logits_hold != want:
            raise RuntimeError("backward() needs a forward() with targets first: with "
                               "for_backward=True, or "
                               "backward(from_logits=True) after a forward that kept the logits")
        b, t = self.batch_shape
        if tokens is None:
            tokens = [_batch_view(buf, b, t) for buf in self.token_slots[0]]
        x, y = tokens
        if tuple(x.shape) != (b, t):
            raise ValueError(f"backward: tokens {tuple(x.shape)}, the last forward ran on {(b, t)}")
        be, a, p, g, L = self.backend, self.act, self.param, self.grad, self.cfg.num_layers
        scratch = [_batch_view(buf, b, t)
                   for buf in (self.dresidual, self.dbtc, self.dbt3c, self.dbt4c)]
        dres, dbtc = scratch[:2]
        fuse = self.fuse
        with ranges.range("gpt2_backward"):
            if from_logits:
                self._classifier(y, True, 1)
                self.logits_hold = "dlogits"
            be.fill_(dres, 0.0)
            self._op("matmul_backward", "lm_head", be.matmul_backward, dbtc, g["wte"], None,
                     a["logits"], a["lnf"], p["wte"], accumulate, fuse)
            self._op("layernorm_backward", "ln_f", be.layernorm_backward, dres, g["lnfw"],
                     g["lnfb"], dbtc, a["residual3"][L - 1], p["lnfw"], a["lnf_mean"],
                     a["lnf_rstd"], accumulate, fuse)
            for l in reversed(range(L)):
                with ranges.range(f"Layer {l}"):
                    self._backward_layer(l, accumulate, *scratch)
            self._op("encoder_backward", "wte", be.encoder_backward, g["wte"], g["wpe"], dres, x,
                     accumulate)

    def _backward_layer(self, l, acc, dres, dbtc, dbt3c, dbt4c):
        """Add (or, without acc, write) layer l's gradients.

        dres holds d(residual3[l]) on the way in and d(residual3[l - 1]) on the way out (the
        residual's backward is the identity).
        """
        be, a, p, g, fuse = self.backend, self.act, self.param, self.grad, self.fuse
        h = f"h.{l}"
        residual = a["encoded"] if l == 0 else a["residual3"][l - 1]
        gelu, ln1, ln2 = self._gelu(l), self._ln("ln1", l), self._ln("ln2", l)
        if self.recompute >= 1:         # the shared buffer holds the last layer's: this one's again
            self._op("gelu_forward", f"{h}.mlp.gelu", be.gelu_forward, gelu, a["fch"][l])
        if self.gelu_fusion >= 2:       # c_proj's dinp GEMM applies gelu' (the saved fch) itself
            self._op("gelu_matmul_backward", f"{h}.mlp.c_proj", be.gelu_matmul_backward, dbt4c,
                     g["fcprojw"][l], g["fcprojb"][l], dres, gelu, p["fcprojw"][l], a["fch"][l],
                     acc)
        else:
            self._op("matmul_backward", f"{h}.mlp.c_proj", be.matmul_backward, dbt4c,
                     g["fcprojw"][l], g["fcprojb"][l], dres, gelu, p["fcprojw"][l], acc, fuse)
            self._op("gelu_backward", f"{h}.mlp.gelu", be.gelu_backward, dbt4c, a["fch"][l], dbt4c)
        if self.recompute >= 2:         # ln_2 from the kept residual2; mean, rstd rewritten alike
            self._op("layernorm_forward", f"{h}.ln_2", be.layernorm_forward, ln2, a["ln2_mean"][l],
                     a["ln2_rstd"][l], a["residual2"][l], p["ln2w"][l], p["ln2b"][l])
        self._op("matmul_backward", f"{h}.mlp.c_fc", be.matmul_backward, dbtc, g["fcw"][l],
                 g["fcb"][l], dbt4c, ln2, p["fcw"][l], acc, fuse)
        self._op("layernorm_backward", f"{h}.ln_2", be.layernorm_backward, dres, g["ln2w"][l],
                 g["ln2b"][l], dbtc, a["residual2"][l], p["ln2w"][l], a["ln2_mean"][l],
                 a["ln2_rstd"][l], acc, fuse)
        # dres now holds d(residual2[l])
        self._op("matmul_backward", f"{h}.attn.c_proj", be.matmul_backward, dbtc, g["attprojw"][l],
                 g["attprojb"][l], dres, a["atty"][l], p["attprojw"][l], acc, fuse)
        if self.attention == "flash":
            self._op("flash_attention_backward", f"{h}.attn", be.flash_attention_backward, dbt3c,
                     dbtc, a["qkv"][l], a["atty"][l], a["lse"][l])
        else:
            self._op("attention_backward", f"{h}.attn", be.attention_backward, dbt3c, dbtc,
                     a["qkvr"][l], a["att"][l])
        if self.recompute >= 2:         # ln_1 from the layer's input residual, likewise
            self._op("layernorm_forward", f"{h}.ln_1", be.layernorm_forward, ln1, a["ln1_mean"][l],
                     a["ln1_rstd"][l], residual, p["ln1w"][l], p["ln1b"][l])
        self._op("matmul_backward", f"{h}.attn.c_attn", be.matmul_backward, dbtc, g["qkvw"][l],
                 g["qkvb"][l], dbt3c, ln1, p["qkvw"][l], acc, fuse)
        self._op("layernorm_backward", f"{h}.ln_1", be.layernorm_backward, dres, g["ln1w"][l],
                 g["ln1b"][l], dbtc, residual, p["ln1w"][l], a["ln1_mean"][l], a["ln1_rstd"][l],
                 acc, fuse)

    # ---- update -------------------------------------------------------------------------
    def optimizer_state_host(self, shard=None):
        """Return (m, v): host copies of the AdamW moments over `shard` (lo, hi) (default: all).

        Zeros before the first update. Under ZeRO-1 a process holds the moments of its shard only.
        """
        if self.m is None:
            lo, hi = shard or (0, self.num_parameters)
            return np.zeros(hi - lo, np.float32), np.zeros(hi - lo, np.float32)
        return self.backend.to_host(self.m), self.backend.to_host(self.v)

    def load_optimizer_state(self, m, v, master=None):
        """Set the AdamW moments m, v and, for bf16 parameters, the fp32 master weights.

        m, v: host arrays, (num_parameters,) or, under ZeRO-1, this process's shard's size. master:
        the fp32 master weights of the same span (None: made from the parameters at the next update;
        a model without master weights, fp32 or -w 0, takes none).
        """
        if master is not None and not self.has_master_weights:
            raise ValueError("load_optimizer_state: this model keeps no fp32 master weights (fp32 "
                             "parameters, or bf16 with master_weights=False); pass master=None")
        self.m = self.backend.from_host(np.asarray(m, np.float32))
        self.v = self.backend.from_host(np.asarray(v, np.float32))
        self.master = (None if master is None
                       else self.backend.from_host(np.asarray(master, np.float32)))

    @property
    def low_precision(self) -> bool:
        """Whether the parameters are stored in a lower precision than fp32 (bf16).

        AdamW then rounds them stochastically, from the fp32 master weights or (-w 0) from their own
        upcast values.
        """
        return np.dtype(self.params.dtype) != np.float32

    @property
    def has_master_weights(self) -> bool:
        """Whether AdamW keeps fp32 master weights: bf16 parameters with master_weights (-w 1)."""
        return self.low_precision and self.master_weights

    def master_weights_host(self, shard=None):
        """Return a host fp32 copy of the master weights over `shard` (lo, hi).

        Before the first update, the parameters upcast (what the first update starts from). None
        when there are none (fp32 parameters, or -w 0).
        """
        if not self.has_master_weights:
            return None
        if self.master is not None:
            return self.backend.to_host(self.master)
        lo, hi = shard or (0, self.num_parameters)
        return np.asarray(self.backend.to_host(self.params[lo:hi]), np.float32)

    def grad_norm(self):
        """Global L2 norm of all gradients."""
        with ranges.range("gpt2_calculate_grad_norm"):
            box = []
            self._op("global_norm", "optimizer",
                     lambda g: box.append(self.backend.global_norm_squared(g)), self.grads)
        return math.sqrt(box[0])

    def grad_norm_device(self, shard=None):
        """Set stats[1] to the squared L2 norm of the gradients, left on the device.

        shard (lo, hi): the norm of params[lo:hi]'s gradients.
        """
        lo, hi = shard or (0, self.num_parameters)
        with ranges.range("gpt2_calculate_grad_norm"):
            self._op("global_norm", "optimizer", self.backend.global_norm_squared_device,
                     self.grads[lo:hi], self.stats)

    def set_step_scalars(self, lr, beta1, beta2, weight_decay, step, limits=None):
        """Queue the upload of the step's AdamW scalars (t = step >= 1) into step_scalars.

        Computed in double as update() computes them, rounded to float32 as its kernel arguments
        are; then t mod 2^32 as the bits of its slot, and the outlier limits (an outlier.Limits of
        float32 values, None = none: inf) (STEP_SCALARS).
        """
        if step < 1:
            raise ValueError("AdamW step t counts from 1")
        loss_limit, norm_limit = limits if limits is not None else (math.inf, math.inf)
        scalars = np.array([lr / (1.0 - beta1 ** step), 1.0 / math.sqrt(1.0 - beta2 ** step),
                            1.0 - lr * weight_decay, 0.0, loss_limit, norm_limit], np.float32)
        scalars.view(np.uint32)[3] = int(step) & 0xFFFFFFFF
        self.backend.upload_(self.step_scalars, scalars)

    def update_device(self, beta1=0.9, beta2=0.95, eps=1e-8, grad_clip=1.0, shard=None):
        """Run AdamW as the device step does: every decision on the device.

        lr, t and the decay come from step_scalars (set_step_scalars), the clipping from the norm in
        stats (grad_norm_device); there is no update at all when stats' loss or norm is not finite
        or above its outlier limit in step_scalars. bf16 parameters: the fp32 master weights and
        stochastic rounding (seed rounding_seed, t from step_scalars) as update() does.
        """
        be = self.backend
        lo, hi = self._update_shard(shard)
        with ranges.range("gpt2_update"):
            for name, a, b in self._shard_tensors(lo, hi):
                self._op("adamw", "optimizer", be.adamw_update_device, self.params[a:b],
                         self.grads[a:b], self.m[a - lo:b - lo], self.v[a - lo:b - lo],
                         self.step_scalars, self.stats, beta1, beta2, eps,
                         name in self.decay_tensors, grad_clip, **self._rounding(lo, a, b))

    def update(self, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1, grad_clip=1.0,
               grad_norm=None, shard=None):
        """One AdamW step (t = step >= 1) with global-norm clipping; returns the grad norm used.

        shard: (lo, hi), update only params[lo:hi] (ZeRO-1: each process updates its slice of the
        flat buffer; m and v then hold that slice only). Each tensor's part of the slice keeps its
        own weight decay. grad_norm must then be the norm over all processes (the default is this
        process's).
        """
        if step < 1:
            raise ValueError("AdamW step t counts from 1")
        if grad_norm is None:
            grad_norm = self.grad_norm()
        grad_scale = 1.0
        if grad_clip is not None and grad_clip > 0 and grad_norm > grad_clip:
            grad_scale = grad_clip / grad_norm
        be = self.backend
        lo, hi = self._update_shard(shard)
        with ranges.range("gpt2_update"):
            for name, a, b in self._shard_tensors(lo, hi):
                wd = weight_decay if name in self.decay_tensors else 0.0
                self._op("adamw", "optimizer", be.adamw_update, self.params[a:b], self.grads[a:b],
                         self.m[a - lo:b - lo], self.v[a - lo:b - lo], lr, beta1, beta2, eps, wd,
                         step, grad_scale, **self._rounding(lo, a, b))
        return grad_norm

    def _update_shard(self, shard):
        """Return (lo, hi) of the update shard (None: all parameters), its AdamW state made.

        AdamW's m and v (and the fp32 masters of bf16 parameters) are made on first use for the
        shard, and checked against it after.
        """
        be = self.backend
        lo, hi = shard or (0, self.num_parameters)
        if not 0 <= lo <= hi <= self.num_parameters:
            raise ValueError(f"update shard {shard} is not inside [0, {self.num_parameters}]")
        if self.m is None:
            self.m = be.zeros(hi - lo, np.float32)
            self.v = be.zeros(hi - lo, np.float32)
        if self.has_master_weights and self.master is None:   # llm.c: they start as the params
            self.master = be.zeros(hi - lo, np.float32)
            be.copy_(self.master, self.params[lo:hi])
        if self.m.size != hi - lo:
            raise ValueError(f"AdamW state holds {self.m.size} values, the update shard {lo}:{hi} "
                             f"has {hi - lo}")
        return lo, hi

    def _rounding(self, lo, a, b):
        """Return the AdamW op's keywords for params[a:b] (its shard starting at lo).

        With bf16 parameters, their stochastic rounding's seed and offset (a, the index in the flat
        buffer) and the fp32 masters of [a, b) (None: -w 0, the op updates the upcast parameters
        themselves); fp32 parameters: none.
        """
        if not self.low_precision:
            return {}
        master = None if self.master is None else self.master[a - lo:b - lo]
        return {"master": master, "seed": self.rounding_seed, "offset": a}

    def _shard_tensors(self, lo, hi):
        """Yield (name, a, b) for each parameter tensor that overlaps the flat slice [lo, hi).

        [a, b) is its part there, in llm.c's tensor order (each tensor keeps its own weight decay
        under ZeRO-1).
        """
        start = 0
        for name in PARAM_NAMES:
            end = start + int(np.prod(self.param_shapes[name]))
            a, b = max(start, lo), min(end, hi)
            if a < b:
                yield name, a, b
            start = end
