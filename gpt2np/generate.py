"""Generating tokens from a GPT2 model: temperature and top-k over the real vocabulary, llm.c's
sampling rule.

generate() runs the full forward pass over the last T tokens for every new token (the trainer's
samples), or, with cache=True, a cache of keys and values (KVCache): the prompt goes through the
layers once, then each new token costs one position: its q, k, v, attention over the cached keys and
values, and the MLP of that one row.
"""
import math

import numpy as np

from gpt2np import ranges
from gpt2np.ops.reference.gelu import gelu_forward
from gpt2np.ops.reference.layernorm import layernorm_forward
from gpt2np.ops.reference.matmul import matmul_forward
from gpt2np.tensors import views


def sample_next(logits, rng, temperature=1.0, top_k=0):
    """One token id from a (V,) row of logits. temperature 0 = greedy; top_k 0 = the whole
    vocabulary. rng: anything with random() in [0, 1) (a NumPy Generator, LlmcCoins): one coin a
    token, and the first id whose cumulative probability exceeds it, llm.c's sample_softmax rule
    (and NumPy's Generator.choice's)."""
    logits = np.asarray(logits, np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.size:
        cut = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cut, logits, -np.inf)
    cdf = np.cumsum(np.exp(logits - logits.max()))
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.size - 1)


# ---- decoding with a cache of keys and values -----------------------------------------------
def layernorm(x, weight, bias):
    """LayerNorm of the rows of x (n, C): the reference op, into a new float32 array."""
    out, mean, rstd = np.empty(x.shape, np.float32), np.empty(len(x), np.float32), \
        np.empty(len(x), np.float32)
    layernorm_forward(out, mean, rstd, x, weight, bias)
    return out


def linear(x, weight, bias=None):
    """x (n, C) @ weight (OC, C)^T (+ bias): the reference op, into a new float32 array (n, OC)."""
    out = np.empty((len(x), weight.shape[0]), np.float32)
    matmul_forward(out, x, weight, bias)
    return out


def gelu(x):
    """GELU of x: the reference op, into a new float32 array."""
    out = np.empty(x.shape, np.float32)
    gelu_forward(out, x)
    return out


class KVCache:
    """The keys and values of every position decoded so far, per layer and head, on the host:
    (L, NH, maxT, HS).

    decode(tokens) appends tokens at positions length, length+1, ... and returns their logits; each
    runs through the layers alone, attending to the cached keys and values, so a new token costs one
    position, not the whole sequence. The math is the model's forward pass (the NumPy reference's
    ops, gpt2np/ops/reference) on the model's own parameters (shared on the numpy backend, a host
    copy on others), tested against the full forward.
    """

    def __init__(self, model, capacity=None):
        cfg = model.cfg
        self.cfg = cfg
        self.capacity = int(capacity or cfg.max_seq_len)
        if not 0 < self.capacity <= cfg.max_seq_len:
            raise ValueError(f"KV cache capacity {self.capacity} must be in 1..{cfg.max_seq_len}")
        params = model.params if isinstance(model.params, np.ndarray) \
            else model.backend.to_host(model.params)
        self.p = views(params, model.param_shapes)
        L, NH, HS = cfg.num_layers, cfg.num_heads, cfg.head_size
        self.k = np.zeros((L, NH, self.capacity, HS), np.float32)
        self.v = np.zeros((L, NH, self.capacity, HS), np.float32)
        self.length = 0

    def reset(self):
        """Forget every position (the next decode starts at position 0)."""
        self.length = 0

    def decode(self, tokens, all_logits=False):
        """Logits of the real vocabulary for new tokens at the next positions: (n, V) with
        all_logits, else the last token's (V,). The cache grows by n; more than its capacity is a
        ValueError."""
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        cfg, p = self.cfg, self.p
        n, t0 = tokens.size, self.length
        if n == 0:
            raise ValueError("decode needs at least one token")
        if t0 + n > self.capacity:
            raise ValueError(f"KV cache full: {t0} positions + {n} new > capacity {self.capacity}")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            bad = int(tokens.max() if tokens.max() >= cfg.vocab_size else tokens.min())
            raise ValueError(f"token id {bad} outside [0, {cfg.vocab_size})")
        NH, HS, C = cfg.num_heads, cfg.head_size, cfg.channels
        t1 = t0 + n
        scale = np.float32(1.0 / math.sqrt(HS))
        # query i (position t0+i) sees keys 0..t0+i: -inf above that diagonal
        future = np.arange(t1)[None, :] > (t0 + np.arange(n))[:, None]
        x = np.asarray(p["wte"][tokens] + p["wpe"][t0:t1], np.float32)          # (n, C)
        with ranges.range("decode"):
            for l in range(cfg.num_layers):
                h = layernorm(x, p["ln1w"][l], p["ln1b"][l])
                qkv = linear(h, p["qkvw"][l], p["qkvb"][l])                         # (n, 3C)
                q, k, v = qkv.reshape(n, 3, NH, HS).transpose(1, 2, 0, 3)         # each (NH, n, HS)
                self.k[l, :, t0:t1] = k
                self.v[l, :, t0:t1] = v
                att = (q @ self.k[l, :, :t1].transpose(0, 2, 1)) * scale          # (NH, n, t1)
                att[:, future] = -np.inf
                att -= att.max(axis=-1, keepdims=True)
                np.exp(att, out=att)
                att /= att.sum(axis=-1, keepdims=True)
                y = (att @ self.v[l, :, :t1]).transpose(1, 0, 2).reshape(n, C)   # heads joined
                x = x + linear(y, p["attprojw"][l], p["attprojb"][l])
                h = layernorm(x, p["ln2w"][l], p["ln2b"][l])
                f = gelu(linear(h, p["fcw"][l], p["fcb"][l]))
                x = x + linear(f, p["fcprojw"][l], p["fcprojb"][l])
            self.length = t1
            last = x if all_logits else x[-1:]
            logits = linear(layernorm(last, p["lnfw"], p["lnfb"]), p["wte"][:cfg.vocab_size])
        return logits if all_logits else logits[0]


def generate(model, prompt, max_new_tokens, rng, temperature=1.0, top_k=0, *, cache=False,
             on_token=None):
    """prompt: list of token ids -> prompt + max_new_tokens sampled ids; on_token(id) is called for
    each new one.

    cache=False: each step runs the model's forward pass on batch row 0 over the last T tokens
    (model.T).
    cache=True: a KVCache of the model's max_seq_len positions; when it is full, it restarts from
    the last half of the tokens (the context then holds max_seq_len/2 .. max_seq_len tokens).
    """
    tokens = list(prompt)
    if max_new_tokens <= 0:
        return tokens
    V, T = model.cfg.vocab_size, model.T
    with ranges.range("generation"):
        if cache:
            kv = KVCache(model)
            keep = max(kv.capacity // 2, 1)
            logits = kv.decode(tokens[-kv.capacity:])
        for i in range(max_new_tokens):
            if not cache:
                window = np.asarray(tokens[-T:], np.int32)[None, :]
                model.forward(window)
                logits = model.backend.to_host(model.act["logits"][0, window.shape[1] - 1, :V])
            tokens.append(sample_next(logits, rng, temperature, top_k))
            if on_token is not None:
                on_token(tokens[-1])
            if cache and i + 1 < max_new_tokens:
                if kv.length < kv.capacity:
                    logits = kv.decode(tokens[-1:])
                else:
                    kv.reset()
                    logits = kv.decode(tokens[-keep:])
    return tokens
