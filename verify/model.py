"""Float64 numpy model of the tiled online-softmax attention forward.

Same loop structure and variable names as the CUDA kernels, so a kernel bug can
be reproduced (and a numerical trick tried) here first:

    for each query tile Q_i (block_m rows):            # one CTA / warpgroup
        m_i = -inf, l_i = 0, acc = 0
        for each key tile K_j, V_j (block_n rows):     # the mainloop
            s     = Q_i K_j^T * scale * log2(e)         # base-2 logits (scale folded in)
            m_new = max(m_i, rowmax(s))
            alpha = exp2(m_i - m_new)                   # rescale for the old partials
            p     = exp2(s - m_new)
            l_i   = alpha * l_i + rowsum(p)
            acc   = alpha * acc + p @ V_j
            m_i   = m_new
        O_i = acc / l_i;  lse_i = (m_i + log2(l_i)) * ln(2)

Why it is exact: for ANY per-row shift c,
    softmax(s) V = sum_j 2^(s_j - c) v_j / sum_j 2^(s_j - c),
    lse          = (c + log2(sum_j 2^(s_j - c))) * ln 2.
The loop keeps l_i and acc as those sums relative to the current shift m_i;
alpha = 2^(m_old - m_new) re-bases them whenever the shift changes. Using the
running max as the shift just keeps every p <= 1 so nothing overflows.

That also means the shift need not be the true max. With rescale_threshold > 0
(FlashAttention-4's conditional rescaling) the shift is moved only when the new
row max exceeds it by more than `threshold` (log2 units); otherwise the stale
shift is kept, alpha == 1 and the O rescale is skipped. The result is still
exact because the same shift is used for both l_i and acc, and p stays bounded
by 2^threshold (so fp32 accumulators in the kernels cannot overflow).
"""
import numpy as np

LOG2E = 1.0 / np.log(2.0)  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = np.log(2.0)


def online_softmax_attention(q, k, v, scale=None, block_m=64, block_n=64,
                             rescale_threshold=0.0, exp2=np.exp2, mask=None):
    """Tiled online-softmax attention; same contract as attention_reference.

    q: [..., Nq, D], k: [..., Nk, D], v: [..., Nk, Dv]; mask: optional additive
    bias (natural-log units, -inf = masked) broadcastable to [..., Nq, Nk].
    block_m / block_n need not divide Nq / Nk (the last tile is partial).
    rescale_threshold: finite >= 0; 0 gives the classic algorithm.
    exp2: the base-2 exponential to use (hook for polynomial approximations).
    Returns (o, lse) in float64; fully masked rows give o = 0, lse = -inf.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    assert 0.0 <= rescale_threshold < np.inf
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    if mask is not None:  # bias goes into the base-2 domain too; -inf stays -inf
        mask = np.broadcast_to(np.asarray(mask, dtype=np.float64), batch + (n_q, n_k)) * LOG2E
    o = np.zeros(batch + (n_q, d_v))
    lse = np.zeros(batch + (n_q,))

    for q0 in range(0, n_q, block_m):                  # ---- query tile (one CTA)
        q1 = min(q0 + block_m, n_q)
        q_tile = q[..., q0:q1, :]
        m_i = np.full(batch + (q1 - q0,), -np.inf)     # running row max (the shift)
        l_i = np.zeros(batch + (q1 - q0,))             # running row sum of p
        acc = np.zeros(batch + (q1 - q0, d_v))         # O_acc: unnormalised output

        for k0 in range(0, n_k, block_n):              # ---- key/value tile (mainloop)
            k1 = min(k0 + block_n, n_k)
            s = (q_tile @ np.swapaxes(k[..., k0:k1, :], -1, -2)) * (scale * LOG2E)
            if mask is not None:
                s = s + mask[..., q0:q1, k0:k1]
            m_tile = s.max(axis=-1)
            # Move the shift only if the tile max beats it by > threshold.
            # threshold == 0 is the plain running max. From m_i = -inf any finite
            # m_tile moves it (-inf + threshold == -inf).
            m_new = np.where(m_tile > m_i + rescale_threshold, m_tile, m_i)
            # "Safe" shift: a row with nothing unmasked yet has m_new = -inf and
            # exp2(-inf - -inf) would be nan. Shifting by 0 instead gives
            # alpha = exp2(-inf) = 0 and p = exp2(-inf) = 0, which is correct.
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
            alpha = exp2(m_i - m_safe)                 # 1 when the shift did not move
            p = exp2(s - m_safe[..., None])            # <= 2^threshold
            l_i = alpha * l_i + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ v[..., k0:k1, :]
            m_i = m_new

        # ---- epilogue: normalise once; rows with l_i == 0 were fully masked.
        live = l_i > 0
        l_safe = np.where(live, l_i, 1.0)
        o[..., q0:q1, :] = np.where(live[..., None], acc / l_safe[..., None], 0.0)
        lse[..., q0:q1] = np.where(live, (m_i + np.log2(l_safe)) * LN2, -np.inf)
    return o, lse
