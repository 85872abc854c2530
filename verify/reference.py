"""Float64 ground truth for attention forward: O = softmax(Q K^T * scale + mask) V.

Deliberately naive (materialises the full score matrix) so that it is obviously
right. Everything the kernels and verify/model.py produce is compared to this.
causal_mask and repeat_kv say what the kernels' causal and grouped-head calls mean;
attention_reference_of puts the three together, a block of query rows at a time;
attention_reference_torch is the same in torch float64, for tensors on a GPU (the checks' inputs).
"""
import numpy as np

# The diagonal's corners (common/binding/abi.py's CAUSAL): row i sees key j iff j <= i + offset.
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
# Rows of a block in attention_reference_of: at most this many scores at a time (16M float64: 128 MiB a copy).
CHUNK_SCORES = 2**24


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


def causal_offset(nq, nk, alignment):
    """Row i sees key j iff j <= i + causal_offset: 0 for "top_left" (SDPA's is_causal=True), nk - nq for
    "bottom_right" (torch's causal_lower_right: the last row sees every key)."""
    if alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"alignment {alignment!r}: one of {', '.join(CAUSAL_ALIGNMENTS)}")
    return 0 if alignment == "top_left" else nk - nq


def causal_mask(nq, nk, alignment, rows=None):
    """The additive float64 mask [nq, nk] of a causal call: 0 where row i sees key j (j <= i + causal_offset), -inf
    elsewhere. rows: a range of rows (e.g. range(256, 512)) for just those rows of it."""
    rows = range(nq) if rows is None else rows
    i = np.arange(rows.start, rows.stop)[:, None]
    j = np.arange(nk)[None, :]
    return np.where(j <= i + causal_offset(nq, nk, alignment), 0.0, -np.inf)


def repeat_kv(x, heads):
    """k or v [..., heads_k, N, D] with its heads repeated to `heads` (a multiple of heads_k): query head h reads
    key/value head h // (heads // heads_k), so each head appears heads // heads_k times in a row."""
    heads_k = x.shape[-3]
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"{heads_k} key/value heads do not divide {heads} query heads")
    return np.repeat(x, heads // heads_k, axis=-3)


def attention_reference_of(q, k, v, scale=None, causal=False, chunk_scores=None):
    """attention_reference for a kernel call: q [B, H, Nq, D], k and v [B, H_k, Nk, D] with H_k dividing H
    (repeat_kv), causal False or an alignment (causal_mask). Computed in blocks of query rows (rows are
    independent), so that a block's scores stay under chunk_scores (CHUNK_SCORES) elements: a 32K x 32K call
    never holds its 8 GB score matrix. Returns (o [B, H, Nq, D], lse [B, H, Nq]), float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    k, v = repeat_kv(k, q.shape[-3]), repeat_kv(v, q.shape[-3])
    nq, nk = q.shape[-2], k.shape[-2]
    per_row = max(1, int(np.prod(q.shape[:-2])) * nk)
    block = max(1, (CHUNK_SCORES if chunk_scores is None else chunk_scores) // per_row)
    o = np.empty(q.shape[:-1] + v.shape[-1:])
    lse = np.empty(q.shape[:-1])
    for start in range(0, nq, block):
        rows = range(start, min(nq, start + block))
        mask = causal_mask(nq, nk, causal, rows) if causal else None
        o[..., rows.start:rows.stop, :], lse[..., rows.start:rows.stop] = attention_reference(
            q[..., rows.start:rows.stop, :], k, v, scale, mask)
    return o, lse


def attention_reference_torch(q, k, v, scale=None, causal=False, chunk_scores=None):
    """attention_reference_of, the same naive formula step for step, in torch float64 on the tensors' device: on a GPU
    its FP64 units compute a 32K x 32K call's reference in well under a second, where numpy takes a CPU core tens of
    seconds (np.exp and the masks run on one core). Float64 either way: the two agree to ~1e-15 relative
    (test_checks.py), a million times below the checks' bounds. q [B, H, Nq, D], k and v [B, H_k, Nk, D] tensors (any
    float dtype); returns numpy float64 (o [B, H, Nq, D], lse [B, H, Nq]), as attention_reference_of does."""
    import torch
    q, k, v = (x.to(torch.float64) for x in (q, k, v))
    heads, heads_k = q.shape[-3], k.shape[-3]
    if heads_k == 0 or heads % heads_k:
        raise ValueError(f"{heads_k} key/value heads do not divide {heads} query heads")
    k, v = (x.repeat_interleave(heads // heads_k, dim=-3) for x in (k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    o = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:-1], -np.inf, dtype=torch.float64, device=q.device)
    if nk == 0:  # no key at all: every row is dead (o = 0, lse = -inf)
        return o.cpu().numpy(), lse.cpu().numpy()
    offset = causal_offset(nq, nk, causal) if causal else None
    block = max(1, (CHUNK_SCORES if chunk_scores is None else chunk_scores) // max(1, int(np.prod(q.shape[:-2])) * nk))
    for start in range(0, nq, block):
        stop = min(nq, start + block)
        s = (q[..., start:stop, :] @ k.transpose(-1, -2)) * scale
        if causal:  # causal_mask: row i sees key j iff j <= i + offset
            i = torch.arange(start, stop, device=q.device)[:, None]
            s = s.masked_fill(torch.arange(nk, device=q.device)[None, :] > i + offset, -np.inf)
        m = s.amax(dim=-1, keepdim=True)
        dead = torch.isneginf(m)
        e = torch.exp(s - torch.where(dead, 0.0, m))
        row_sum = e.sum(dim=-1, keepdim=True)
        lse[..., start:stop] = torch.where(dead, -np.inf, m + torch.log(row_sum))[..., 0]
        o[..., start:stop, :] = torch.where(dead, 0.0, (e @ v) / row_sum)
    return o.cpu().numpy(), lse.cpu().numpy()
