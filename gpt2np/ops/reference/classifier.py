"""Softmax, cross-entropy and the logits' gradient in place, over the real vocabulary
(kernels/classifier.cu)."""
import numpy as np


def fused_classifier(logits, losses, targets, V, dloss, write_dlogits):
    """Per row of logits (N,Vp): losses (N) = logsumexp(logits[:V]) - logits[target], with targets
    (N) int32. With write_dlogits, logits becomes dlogits = (softmax - onehot(target)) * dloss over
    [:V] and 0 over the padding [V:Vp]. Rows may be (B,T). Without write_dlogits the softmax goes to
    a (N,V) work array: the numpy backend calls this a few rows at a time."""
    Vp = logits.shape[-1]
    rows, targets, losses = logits.reshape(-1, Vp), targets.reshape(-1), losses.reshape(-1)
    each = np.arange(rows.shape[0])
    real = rows[:, :V]
    row_max = real.max(axis=1)
    target_logit = rows[each, targets]
    probs = real if write_dlogits else np.empty(real.shape, real.dtype)   # dlogits replace logits
    np.subtract(real, row_max[:, None], out=probs)
    np.exp(probs, out=probs)
    row_sum = probs.sum(axis=1)
    losses[...] = np.log(row_sum) + row_max - target_logit
    if write_dlogits:
        probs *= (dloss / row_sum)[:, None]
        rows[each, targets] -= dloss
        rows[:, V:] = 0.0
