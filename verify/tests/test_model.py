"""CPU tests: the float64 tiled online-softmax model vs the float64 reference.

Tolerance: O relative to max|O_ref|, LSE absolute, both within
TOL + 16 * eps * max|S|. TOL = 1e-12; the second term is the rounding floor of
the problem itself: a float64 score of size |S| is only known to ~eps*|S|
(1e4 -> 2e-12), and exp() turns that into the same relative error in P and an
absolute error in LSE, whatever the algorithm. test_broken_models_are_caught
shows the same check rejects a wrong model.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verify.model import LN2, online_softmax_attention
from verify.reference import attention_reference

pytestmark = pytest.mark.filterwarnings("error")  # nan/overflow warnings are bugs
TOL = 1e-12
EPS = np.finfo(np.float64).eps
NEG_INF = -np.inf


def qkv(seed, nq=100, nk=100, d=64, dv=None, batch=(2,), mean=0.5):
    """Fresh normal(mean, 1) inputs; non-zero mean so scores have a common offset."""
    rng = np.random.default_rng(seed)
    return (rng.normal(mean, 1.0, batch + (nq, d)), rng.normal(mean, 1.0, batch + (nk, d)),
            rng.normal(mean, 1.0, batch + (nk, dv or d)))


def assert_matches(got, want, tol=TOL):
    (o, lse), (o_ref, lse_ref) = got, want
    assert o.dtype == lse.dtype == np.float64
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert np.isfinite(o).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))  # same dead rows
    assert np.abs(o - o_ref).max(initial=0) <= tol * np.abs(o_ref).max(initial=0)
    live = np.isfinite(lse_ref)
    assert np.abs(lse[live] - lse_ref[live]).max(initial=0) <= tol


def check(q, k, v, **kw):
    """Model(**kw) vs reference on the same inputs (scale/mask forwarded to both)."""
    ref_kw = {n: kw[n] for n in ("scale", "mask") if n in kw}
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = q64 @ np.swapaxes(k64, -1, -2) * kw.get("scale", 1 / np.sqrt(q64.shape[-1])) + kw.get("mask", 0.0)
    s_max = np.abs(s[np.isfinite(s)]).max(initial=0)
    got = online_softmax_attention(q, k, v, **kw)
    assert_matches(got, attention_reference(q, k, v, **ref_kw), TOL + 16 * EPS * s_max)
    return got


# ---------------------------------------------------------------- the reference itself

def test_reference_against_textbook_formula():
    q, k, v = qkv(0, nq=5, nk=7, d=4, dv=3, batch=())
    s = q @ k.T / 2.0  # 1/sqrt(4)
    o, lse = attention_reference(q, k, v)
    np.testing.assert_allclose(o, (np.exp(s) / np.exp(s).sum(1, keepdims=True)) @ v, rtol=1e-13)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(1)), rtol=1e-13)


def test_reference_fully_masked_row_is_zero_and_neg_inf():
    q, k, v = qkv(1, nq=3, nk=4, d=8, batch=())
    mask = np.zeros((3, 4))
    mask[1] = NEG_INF
    o, lse = attention_reference(q, k, v, mask=mask)
    assert (o[1] == 0).all() and lse[1] == NEG_INF and np.isfinite(lse[[0, 2]]).all()


# ---------------------------------------------------------------- tile sizes

@pytest.mark.parametrize("thr", [0.0, 8.0])
@pytest.mark.parametrize("block_m,block_n", [
    (16, 16), (32, 32), (64, 64), (128, 128),   # dividing and single-tile
    (48, 48), (64, 48), (48, 64), (16, 128),    # non-dividing N = 100
    (128, 16), (1, 7), (100, 100), (99, 99)])
def test_tile_sizes(block_m, block_n, thr):
    check(*qkv(10), block_m=block_m, block_n=block_n, rescale_threshold=thr)


@pytest.mark.parametrize("nq,nk,d,dv", [(100, 77, 64, 64), (33, 200, 128, 32), (1, 1, 1, 1), (130, 5, 16, 80)])
def test_ragged_shapes(nq, nk, d, dv):
    for thr in (0.0, 8.0):
        check(*qkv(11, nq, nk, d, dv), block_m=48, block_n=48, rescale_threshold=thr)


def test_low_precision_inputs_are_upcast():
    for dt in (np.float32, np.float16):
        q, k, v = (x.astype(dt) for x in qkv(12))
        check(q, k, v, block_m=64, block_n=48)


def test_broadcast_batch_dims():  # e.g. GQA-style: one K/V shared by 4 query heads
    q, _, _ = qkv(13, batch=(3, 4))
    _, k, v = qkv(14, batch=(3, 1))
    check(q, k, v, block_m=32, block_n=48, rescale_threshold=8.0)


# ---------------------------------------------------------------- adversarial inputs

@pytest.mark.parametrize("thr", [0.0, 8.0])
@pytest.mark.parametrize("logit", [1e2, 1e3, 1e4])
def test_huge_logits(logit, thr):
    """Scores spanning +-logit: exp() of them overflows/underflows without the max shift."""
    q, k, v = qkv(20)
    scale = logit / np.abs(q @ np.swapaxes(k, -1, -2)).max()
    check(q, k, v, scale=scale, block_m=48, block_n=48, rescale_threshold=thr)


@pytest.mark.parametrize("thr", [0.0, 8.0])
def test_all_scores_hugely_negative(thr):
    """Every score near -1e4: exp(s) == 0 in float64, lse ~ -1e4 must still come out."""
    q, k, v = qkv(21)
    q, k = np.abs(q), -np.abs(k) - 0.1
    scale = 1e4 / np.abs(q @ np.swapaxes(k, -1, -2)).min()
    _, lse = check(q, k, v, scale=scale, block_m=48, block_n=48, rescale_threshold=thr)
    assert (lse < -9e3).all()


@pytest.mark.parametrize("thr", [0.0, 8.0])
@pytest.mark.parametrize("j", [0, 47, 48, 99])  # first key, tile edges (block_n=48), last key
def test_row_dominated_by_one_key(j, thr):
    q, k, v = qkv(22)
    mask = np.zeros((100, 100))
    mask[:, j] = 60.0  # +60 nats: every other key gets weight < e^-50
    o, _ = check(q, k, v, mask=mask, block_m=48, block_n=48, rescale_threshold=thr)
    np.testing.assert_allclose(o, np.broadcast_to(v[:, j:j + 1], o.shape), atol=1e-15)


@pytest.mark.parametrize("thr", [0.0, 8.0])
@pytest.mark.parametrize("jump", [3.0, 30.0])  # nats: below / above 8 log2 units = 5.5 nats
def test_row_max_only_in_last_key_tile(jump, thr):
    """The max shows up only in the last (partial) key tile, after everything was
    accumulated against a smaller max: the final alpha rescale must be right."""
    q, k, v = qkv(23)
    qk = q @ np.swapaxes(k, -1, -2)
    scale = 1.0 / np.abs(qk).max()  # random part of the scores in [-1, 1]
    mask = np.zeros((100, 100))
    mask[:, 96:] = jump  # keys 96..99 = last tile for block_n = 32 (partial, 4 keys)
    assert ((qk * scale + mask).argmax(-1) >= 96).all()  # construction check
    check(q, k, v, scale=scale, mask=mask, block_m=32, block_n=32, rescale_threshold=thr)


@pytest.mark.parametrize("thr", [0.0, 8.0])
def test_row_max_grows_every_tile(thr):
    q, k, v = qkv(24)
    mask = np.linspace(0.0, 80.0, 100)[None, :]  # rising ramp: a new max in every tile
    check(q, k, v, mask=mask, block_m=48, block_n=16, rescale_threshold=thr)


def test_constant_rows():
    """All keys identical -> all scores in a row equal -> O = mean(V), lse = s + log(Nk)."""
    q, k, v = qkv(25)
    k = np.broadcast_to(k[..., :1, :], k.shape)
    for thr in (0.0, 8.0):
        o, lse = check(q, k, v, block_m=48, block_n=48, rescale_threshold=thr)
        np.testing.assert_allclose(o, np.broadcast_to(v.mean(-2, keepdims=True), o.shape), rtol=1e-12)
        s0 = (q @ np.swapaxes(k[..., :1, :], -1, -2))[..., 0] / 8.0
        np.testing.assert_allclose(lse, s0 + np.log(100), rtol=1e-12)


@pytest.mark.parametrize("thr", [0.0, 8.0])
@pytest.mark.parametrize("kind", ["random", "causal", "late_start", "with_dead_rows", "all_dead"])
def test_neg_inf_scores(kind, thr):
    q, k, v = qkv(26)
    rng = np.random.default_rng(27)
    mask = np.zeros((100, 100))
    if kind == "random":       # 30% of the scores are -inf
        mask[rng.random((100, 100)) < 0.3] = NEG_INF
    elif kind == "causal":     # row i sees keys 0..i: most key tiles fully -inf for early rows
        mask[np.triu_indices(100, 1)] = NEG_INF
    elif kind == "late_start":  # rows see only keys >= i: m_i stays -inf over whole tiles first
        mask[np.tril_indices(100, -1)] = NEG_INF
    elif kind == "with_dead_rows":
        mask[rng.random((100, 100)) < 0.3] = NEG_INF
        mask[[0, 5, 47, 48, 99]] = NEG_INF
    else:                      # nothing visible at all
        mask[:] = NEG_INF
    o, lse = check(q, k, v, mask=mask, block_m=48, block_n=32, rescale_threshold=thr)
    dead = np.isneginf(mask).all(-1)
    assert (o[..., dead, :] == 0).all() and np.isneginf(lse[..., dead]).all()


# ---------------------------------------------------------------- conditional rescaling

def test_rescale_threshold_is_exercised_and_p_is_bounded():
    """Spy on exp2: with threshold 0 every exponent is <= 0 (p <= 1); with threshold
    8 and a slowly rising max the stale shift is kept, so some exponents are > 0
    (p > 1) -- but never above 8 -- and the result is still exact."""
    q, k, v = qkv(30)
    mask = np.linspace(0.0, 5.0, 100)[None, :]  # max rises by < 8 log2 units overall
    for thr, expect_stale in ((0.0, False), (8.0, True)):
        seen = []
        exp2 = lambda x: (seen.append(np.max(x, initial=NEG_INF)), np.exp2(x))[1]
        check(q, k, v, mask=mask, block_m=32, block_n=16, rescale_threshold=thr, exp2=exp2)
        assert (max(seen) > 0) == expect_stale and max(seen) <= thr


def test_custom_exp2_hook():
    """exp2 computed another way (stand-in for a future polynomial exp2) plugs in."""
    check(*qkv(31), block_m=48, block_n=48, exp2=lambda x: np.exp(x * LN2))


# ---------------------------------------------------------------- property tests

@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.sampled_from([(), (2,), (2, 3)]),
       nq=st.integers(1, 70), nk=st.integers(1, 70), d=st.integers(1, 40), dv=st.integers(1, 40),
       block_m=st.integers(4, 80), block_n=st.integers(4, 80),
       thr=st.sampled_from([0.0, 0.5, 8.0, 20.0]), mean=st.floats(-3, 3),
       logit=st.sampled_from([0.1, 1.0, 10.0, 1e2, 1e4]), masked=st.sampled_from([0.0, 0.3, 0.9, 1.0]))
def test_property_model_matches_reference(seed, batch, nq, nk, d, dv, block_m, block_n, thr, mean, logit, masked):
    q, k, v = qkv(seed, nq, nk, d, dv, batch, mean)
    scale = logit / max(np.abs(q @ np.swapaxes(k, -1, -2)).max(), 1e-30)  # max |score| = logit
    mask = np.where(np.random.default_rng(seed + 1).random((nq, nk)) < masked, NEG_INF, 0.0)
    check(q, k, v, scale=scale, mask=mask, block_m=block_m, block_n=block_n, rescale_threshold=thr)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), block_m=st.integers(1, 4), block_n=st.integers(1, 4))
def test_property_tiny_tiles(seed, n, block_m, block_n):
    check(*qkv(seed, n, n + 3, 4, batch=()), block_m=block_m, block_n=block_n)


# ---------------------------------------------------------------- the tests can fail

def _broken_model(q, k, v, bug, block_n=48):
    """2-D online softmax with one deliberate bug (scale 1/sqrt(D), no query tiling)."""
    s_all = q @ k.T / np.sqrt(q.shape[-1]) / LN2  # base-2 scores
    m_i, l_i, acc = np.full(len(q), NEG_INF), np.zeros(len(q)), np.zeros((len(q), v.shape[1]))
    stop = len(k) - len(k) % block_n if bug == "drop_partial_tile" else len(k)
    for k0 in range(0, stop, block_n):
        s = s_all[:, k0:k0 + block_n]
        m_new = np.maximum(m_i, s.max(1))
        alpha = np.ones_like(m_i) if bug == "no_alpha" else np.exp2(m_i - m_new)
        p = np.exp2(s - m_new[:, None])
        l_i = alpha * l_i + p.sum(1)
        acc = (acc if bug == "no_alpha_on_acc" else alpha[:, None] * acc) + p @ v[k0:k0 + block_n]
        m_i = m_new
    lse = np.log(l_i) + m_i * LN2 if bug != "lse_base" else (m_i + np.log(l_i)) * LN2
    return acc / l_i[:, None], lse


@pytest.mark.parametrize("bug", ["none", "no_alpha", "no_alpha_on_acc", "drop_partial_tile", "lse_base", "exp2_1e-10"])
def test_broken_models_are_caught(bug):
    q, k, v = qkv(40, batch=())
    want = attention_reference(q, k, v)
    if bug == "exp2_1e-10":  # an exp2 off by 1e-10 relative (x-dependent, so it doesn't cancel)
        got = online_softmax_attention(q, k, v, block_n=48, exp2=lambda x: np.exp2(x) * (1 + 1e-10 * np.sin(np.nan_to_num(x))))
    else:
        got = _broken_model(q, k, v, bug)
    if bug == "none":  # the harness itself is right, so failures below are the bugs
        assert_matches(got, want)
    else:
        with pytest.raises(AssertionError):
            assert_matches(got, want)
