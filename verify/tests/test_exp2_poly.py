"""CPU: step13's FlashAttention-4 softmax in float64 -- the polynomial exp2 and the conditional rescale.

The polynomial's own error is bounded first; then the tiled online softmax (verify/model.py) runs with it in
place of every exponential (the worst case: the kernels use it for one 8-key block in 16) and with the
rescale threshold of step13 (8 log2 units), against the float64 reference. Each bound is set from what the
approximation can do, and a broken variant of each is shown to fail.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from verify.exp2_poly import COEFFS, exp2_poly3
from verify.model import online_softmax_attention
from verify.reference import attention_reference

ROOT = Path(__file__).resolve().parents[2]
POLY_REL = 1e-4      # the fit's max relative error on [-0.5, 0.5] is 7.5e-5; float32 evaluation adds ~1e-7
THRESHOLD = 8.0      # step13's RESCALE_THRESHOLD, log2 units


def rel_error(x):
    x = np.asarray(x, dtype=np.float64)
    return np.abs(exp2_poly3(x).astype(np.float64) / np.exp2(x) - 1.0)


def test_poly_relative_error_over_the_range_the_kernels_use():
    x = np.linspace(-125.0, THRESHOLD, 2_000_001)  # exponent arguments are <= threshold; below -125, P is 0 for bf16
    err = rel_error(x)
    assert err.max() <= POLY_REL, f"exp2_poly3 max relative error {err.max():.3g} at x = {x[err.argmax()]}"
    assert err.max() > 1e-6  # it is an approximation: the check would see a broken one


def test_poly_handles_integers_and_the_clamp():
    ints = np.arange(-125, 9, dtype=np.float32)  # at the clamp, -126, 2^x is subnormal: ~0 for P either way
    assert np.allclose(exp2_poly3(ints), np.exp2(ints), rtol=POLY_REL, atol=0)
    assert exp2_poly3(np.float32(-1e4)) <= np.exp2(np.float32(-125))  # clamped: tiny and non-negative
    assert exp2_poly3(np.float32(-np.inf)) >= 0
    assert np.isfinite(exp2_poly3(np.float32(-np.inf)))


def test_a_wrong_coefficient_is_caught(monkeypatch):
    import verify.exp2_poly as mod
    monkeypatch.setattr(mod, "COEFFS", COEFFS * np.float32(1.001))
    assert rel_error(np.linspace(-3, 3, 10001)).max() > POLY_REL


def test_the_kernel_uses_these_coefficients():
    """common/ptx.cuh's exp2_poly3 and this mirror must not drift apart."""
    src = (ROOT / "common" / "ptx.cuh").read_text()
    body = src[src.index("float exp2_poly3"):]
    found = re.search(r"C0 = ([0-9.e+-]+)f, C1 = ([0-9.e+-]+)f, C2 = ([0-9.e+-]+)f, C3 = ([0-9.e+-]+)f", body)
    assert found, "exp2_poly3's coefficients not found in common/ptx.cuh"
    assert np.array_equal(np.float32([float(g) for g in found.groups()]), COEFFS)
    assert "12582912.f" in body and "-126.f" in body


def qkv(seed, n=256, d=128, mean=0.5):
    rng = np.random.default_rng(seed)
    return (rng.normal(mean, 1.0, (2, n, d)), rng.normal(mean, 1.0, (2, n, d)), rng.normal(mean, 1.0, (2, n, d)))


@pytest.mark.parametrize("factor", [1.0, 10.0])
def test_fa4_softmax_in_the_tiled_model(factor):
    """Threshold 8 plus the polynomial for every exponential: O within ~POLY_REL of the reference, LSE too."""
    q, k, v = (factor * x for x in qkv(1))
    o_ref, lse_ref = attention_reference(q, k, v)
    o, lse = online_softmax_attention(q, k, v, block_m=128, block_n=128, rescale_threshold=THRESHOLD,
                                      exp2=lambda x: exp2_poly3(x).astype(np.float64))
    o_err = np.abs(o - o_ref).max() / np.abs(o_ref).max()
    lse_err = np.abs(lse - lse_ref).max()
    # A relative error e in every P moves O by at most ~2e relative to |O|max and LSE by ~e (natural log).
    assert o_err <= 2 * POLY_REL, o_err
    assert lse_err <= 2 * POLY_REL, lse_err
    assert o_err > 0  # the hook was used


def test_threshold_rescale_is_exact_with_exact_exp2():
    """The conditional rescale alone changes nothing but rounding (verify/model.py explains why)."""
    q, k, v = qkv(2)
    o_ref, lse_ref = attention_reference(q, k, v)
    o, lse = online_softmax_attention(q, k, v, block_m=128, block_n=128, rescale_threshold=THRESHOLD)
    assert np.abs(o - o_ref).max() <= 1e-12 * np.abs(o_ref).max() and np.abs(lse - lse_ref).max() <= 1e-12


def test_a_broken_poly_fails_the_model_check():
    q, k, v = qkv(3)
    o_ref, _ = attention_reference(q, k, v)
    o, _ = online_softmax_attention(q, k, v, block_m=128, block_n=128, rescale_threshold=THRESHOLD,
                                    exp2=lambda x: 1.01 * exp2_poly3(x + 0.01).astype(np.float64))
    assert np.abs(o - o_ref).max() / np.abs(o_ref).max() > 2 * POLY_REL
