"""Float64 ground truth for attention forward: O = softmax(Q K^T * scale + mask) V.

Deliberately naive (materialises the full score matrix) so that it is obviously
right. Everything the kernels and verify/model.py produce is compared to this.
"""
import numpy as np
from scipy.special import logsumexp, softmax


def attention_reference(q, k, v, scale=None, mask=None):
    """Exact attention in float64.

    q: [..., Nq, D], k: [..., Nk, D], v: [..., Nk, Dv] (any float dtype; leading
    dims broadcast). scale defaults to 1/sqrt(D). mask: optional additive bias
    broadcastable to [..., Nq, Nk]; use -inf to mask a key out.

    Returns (o [..., Nq, Dv], lse [..., Nq]), both float64, where
    lse = log(sum_j exp(S_ij)) is the natural-log logsumexp of the scores.

    Convention for a row whose scores are all -inf (every key masked):
    o = 0 and lse = -inf (softmax would be 0/0). Scores must not be +inf/nan.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if mask is not None:
        s = s + np.asarray(mask, dtype=np.float64)
    lse = logsumexp(s, axis=-1)
    dead = np.isneginf(lse)  # rows with no unmasked key
    p = softmax(np.where(dead[..., None], 0.0, s), axis=-1)  # dummy row for dead rows...
    o = np.where(dead[..., None], 0.0, p @ v)                # ...then zeroed
    return o, lse
