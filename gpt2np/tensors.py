"""Flat-buffer layouts: the 16 parameter tensors in llm.c's order, and the activations for (B, T).

Parameters and gradients are each ONE flat buffer of `num_parameters(cfg)` elements; `views(flat,
layout)` cuts named, shaped views out of it. The AdamW moments m, v are flat buffers too, without
views, sized to the update shard (gpt2np.model).
"""
import numpy as np

from gpt2np.config import GPT2Config

# llm.c's parameter order; indices matter (checkpoints store tensors in this order).
PARAM_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")


def param_shapes(cfg: GPT2Config):
    """{name: shape} in llm.c's order. Weights are (out_features, in_features)."""
    Vp, maxT, L, C = cfg.padded_vocab_size, cfg.max_seq_len, cfg.num_layers, cfg.channels
    return {
        "wte": (Vp, C), "wpe": (maxT, C),
        "ln1w": (L, C), "ln1b": (L, C),
        "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C),
        "attprojw": (L, C, C), "attprojb": (L, C),
        "ln2w": (L, C), "ln2b": (L, C),
        "fcw": (L, 4 * C, C), "fcb": (L, 4 * C),
        "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
        "lnfw": (C,), "lnfb": (C,),
    }


# Tensors that get weight decay by default: the 2-D matrices (llm.c's CUDA trainer's choice).
DECAYED_BY_DEFAULT = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw")


# the attention implementations: naive (the (T,T) probabilities saved) and flash
# (recomputed in backward)
ATTENTIONS = ("flash", "naive")

# llm.c's -r: 0 keep every activation, 1 recompute the GELU in backward, 2 the
# GELU and the LayerNorms
RECOMPUTE_LEVELS = (0, 1, 2)


def activation_shapes(cfg: GPT2Config, B: int, T: int, attention: str = "naive",
                      recompute: int = 0):
    """{name: shape} of every activation kept for the backward pass, for a (B, T) batch.

    encoded (B,T,C) = wte[x] + wpe;  per layer l: ln1, ln1_mean, ln1_rstd, qkvr (3,B,NH,T,HS)
    q, k, v split per head, att (B,NH,T,T) softmax probabilities, atty (B,T,C) attention output,
    attproj, residual2, ln2..., fch (B,T,4C) pre-GELU, fch_gelu, fcproj, residual3;
    lnf, lnf_mean, lnf_rstd; logits (B,T,Vp); losses (B,T).
    attention "flash" keeps qkv (B,T,3C) (the c_attn output) and lse (B,NH,T) instead of qkvr and
    att: the flash attention backward recomputes the probabilities from them.
    recompute (llm.c's -r): 0 keeps every layer's activations; >= 1 keeps one fch_gelu (B,T,4C) that
    every layer writes in turn (the backward recomputes each layer's GELU from its kept fch); 2 also
    keeps no ln1/ln2 (shape (0,B,T,C)): every LayerNorm writes into lnf, and the backward recomputes
    ln1/ln2 there from the kept residual (their mean and rstd stay per layer). llm.c's layout: same
    names and order, the dropped tensors of size 0.
    """
    L, NH, C, Vp = cfg.num_layers, cfg.num_heads, cfg.channels, cfg.padded_vocab_size
    HS = C // NH
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}: expected one of "
                         f"{', '.join(ATTENTIONS)}")
    if recompute not in RECOMPUTE_LEVELS:
        raise ValueError(f"recompute {recompute!r}: expected 0, 1 or 2")
    # -r 2: the LayerNorm outputs live in lnf, one at a time
    ln_layers = L if recompute < 2 else 0
    fch_gelu = (L, B, T, 4 * C) if recompute < 1 else (B, T, 4 * C)
    saved = ({"qkv": (L, B, T, 3 * C), "lse": (L, B, NH, T)} if attention == "flash"
             else {"qkvr": (L, 3, B, NH, T, HS), "att": (L, B, NH, T, T)})
    return {
        "encoded": (B, T, C),
        "ln1": (ln_layers, B, T, C), "ln1_mean": (L, B, T), "ln1_rstd": (L, B, T),
        **saved, "atty": (L, B, T, C),
        "attproj": (L, B, T, C), "residual2": (L, B, T, C),
        "ln2": (ln_layers, B, T, C), "ln2_mean": (L, B, T), "ln2_rstd": (L, B, T),
        "fch": (L, B, T, 4 * C), "fch_gelu": fch_gelu,
        "fcproj": (L, B, T, C), "residual3": (L, B, T, C),
        "lnf": (B, T, C), "lnf_mean": (B, T), "lnf_rstd": (B, T),
        "logits": (B, T, Vp), "losses": (B, T),
    }


# Activations that stay float32 when the others are stored in bf16 (llm.c's train_gpt2.cu keeps them
# `float`): the LayerNorm statistics and the per-token losses.
FP32_ACTIVATIONS = ("ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd", "lnf_mean", "lnf_rstd",
                    "losses", "lse")


def layout_size(shapes) -> int:
    return int(sum(int(np.prod(s)) for s in shapes.values()))


def num_parameters(cfg: GPT2Config) -> int:
    """Total elements of the flat parameter buffer (wte padded to Vp rows)."""
    return layout_size(param_shapes(cfg))


def offsets(shapes):
    """{name: (offset, size)} for tensors packed one after another in dict order."""
    out, pos = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        out[name] = (pos, size)
        pos += size
    return out


def views(flat, shapes):
    """{name: view of `flat` with that shape}; works for NumPy and CuPy arrays alike."""
    return {name: flat[off:off + size].reshape(shapes[name])
            for name, (off, size) in offsets(shapes).items()}
