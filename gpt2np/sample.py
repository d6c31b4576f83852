"""Autoregressive sampling from a GPT2 model: temperature and top-k over the real vocabulary."""
import numpy as np

from .profiling import ranges


def sample_next(logits, rng, temperature=1.0, top_k=0):
    """One token id from a (V,) row of logits. temperature 0 = greedy; top_k 0 = the whole vocabulary."""
    logits = np.asarray(logits, np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.size:
        cut = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cut, logits, -np.inf)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def generate(model, prompt, max_new_tokens, rng, temperature=1.0, top_k=0):
    """prompt: list of token ids -> prompt + max_new_tokens sampled ids.

    Each step runs the model on batch row 0 only, over the last T tokens (no KV cache: the forward
    pass is the one training uses, at (1, t)).
    """
    tokens = list(prompt)
    V, T = model.cfg.vocab_size, model.T
    with ranges.range("generation"):
        for _ in range(max_new_tokens):
            window = np.asarray(tokens[-T:], np.int32)[None, :]
            model.forward(window)
            last = model.backend.to_host(model.act["logits"][0, window.shape[1] - 1, :V])
            tokens.append(sample_next(last, rng, temperature, top_k))
    return tokens
