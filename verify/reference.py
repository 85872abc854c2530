"""Float64 ground truth for attention forward: O = softmax(Q K^T * scale + mask) V.

Deliberately naive (materialises the full score matrix) so that it is obviously
right. Everything the kernels and verify/model.py produce is compared to this.
"""
import numpy as np


def attention_reference(q, k, v, scale=None, mask=None):
    """Exact attention in float64.

    q: [..., Nq, D], k: [..., Nk, D], v: [..., Nk, Dv] (any float dtype; leading
    dims broadcast). scale defaults to 1/sqrt(D). mask: optional additive bias
    broadcastable to [..., Nq, Nk]; use -inf to mask a key out.

    Returns (o [..., Nq, Dv], lse [..., Nq]), both float64, where
    lse = log(sum_j exp(S_ij)) is the natural-log logsumexp of the scores.

    Convention for a row whose scores are all -inf (every key masked, or no key
    at all): o = 0 and lse = -inf (softmax would be 0/0). Scores must not be +inf/nan.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if mask is not None:
        s = s + np.asarray(mask, dtype=np.float64)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # row max: exp(s - m) <= 1 cannot overflow
    dead = np.isneginf(m)                                 # rows with no unmasked key
    e = np.exp(s - np.where(dead, 0.0, m))                # (a dead row: exp(-inf) = 0 everywhere)
    row_sum = e.sum(axis=-1, keepdims=True)               # >= 1 for a live row: its max gives exp(0)
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) and 0/0 of dead rows, replaced here:
        lse = np.where(dead, -np.inf, m + np.log(row_sum))[..., 0]
        o = np.where(dead, 0.0, (e @ v) / row_sum)
    return o, lse
