"""CPU: the checks' verdicts (verify/checks.py) fail where they must and pass what is right.

* Errors.failures on synthetic numbers: NaN, unwritten output, each bound;
* one corrupted row of one head (or one LSE entry) of a correct output is rejected, at x1 and x10; the
  correct output here is the float64 reference rounded to bf16/fp32, the yardstick runs on the CPU
  (test_steps_gpu.py does the same with every step's real output);
* a kernel-like computation in the kernels' precision class passes, so the bounds are not tighter than the class,
  with FlashAttention-4's conditional rescale too (and without O_P_ROUNDING it would not, on a peaked case);
* the adversarial inputs have the property each is built for;
* at ragged lengths, an output that let the zero-filled keys past seqlen_k into the softmax is rejected.
"""
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from verify import checks  # noqa: E402
from verify.checks import (  # noqa: E402
    ADVERSARIAL,
    CORRUPTIONS,
    O_ATOL,
    O_REL_FROB,
    Errors,
    adversarial_inputs,
    corrupted,
    errors_of,
    make_inputs,
    prepare,
    replay,
)

GOOD = dict(o_rel_frob=2e-3, o_max_abs=1e-2, o_max_abs_yardstick=1e-2, lse_max_abs=1e-5, lse_max_abs_yardstick=1e-5,
            lse_max_abs_ref=10.0, nonfinite_o=0, nonfinite_lse=0)


def test_good_errors_pass():
    assert Errors(**GOOD).failures() == []


@pytest.mark.parametrize("field,value,match", [
    ("o_rel_frob", 2 * O_REL_FROB, "relative Frobenius"),
    ("o_rel_frob", math.nan, "relative Frobenius"),
    ("o_max_abs", 2 * Errors(**GOOD).o_limit(), "O error"),
    ("o_max_abs", math.nan, "O error"),
    ("lse_max_abs", 2 * Errors(**GOOD).lse_limit(), "LSE max abs"),
    ("lse_max_abs", math.inf, "LSE max abs"),
    ("nonfinite_o", 1, "non-finite"),
    ("nonfinite_lse", 3, "non-finite"),
])
def test_bad_errors_fail(field, value, match):
    bad = Errors(**{**GOOD, field: value}).failures()
    assert bad and any(match in b for b in bad), bad


def test_limits_follow_the_yardstick():
    """The bounds scale with the yardstick's error (x10 inputs: x10 errors), not a fixed number."""
    base = Errors(**GOOD)
    tenfold = Errors(**{**GOOD, "o_max_abs_yardstick": 10 * GOOD["o_max_abs_yardstick"],
                        "lse_max_abs_yardstick": 10 * GOOD["lse_max_abs_yardstick"]})
    assert tenfold.o_limit() > 9 * base.o_limit() and tenfold.lse_limit() > 9 * base.lse_limit()
    assert Errors(**{**GOOD, "o_max_abs_yardstick": 0.0}).o_limit() == O_ATOL  # the floor


def rounded_reference(case):
    """The float64 reference rounded to the outputs' dtypes: a correct output, as good as it can be."""
    return torch.from_numpy(case.o_ref).to(torch.bfloat16), torch.from_numpy(case.lse_ref).to(torch.float32)


@pytest.fixture(scope="module", params=[(1.0, None), (10.0, None), (1.0, 0.3)], ids=["x1", "x10", "x1-scale0.3"])
def cpu_case(request):
    factor, scale = request.param
    return prepare(*make_inputs(2, 3, 128, 192, factor=factor, device="cpu"), scale=scale)


def test_correct_output_passes(cpu_case):
    err = errors_of(cpu_case, *rounded_reference(cpu_case))
    assert not err.failures(), f"{err.failures()} ({err}); {replay()}"


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_one_corrupted_row_is_rejected(cpu_case, kind):
    o, lse = rounded_reference(cpu_case)
    bad = errors_of(cpu_case, *corrupted(kind, cpu_case, o, lse)).failures()
    assert any(CORRUPTIONS[kind] in b for b in bad), f"{kind} not rejected: {bad}; {replay()}"


def tiled_attention_fp32(q, k, v, scale, tile_k, threshold=None):
    """A kernel in the precision class, on the CPU: online softmax over K tiles in fp32 (running max, alpha
    rescales), exp2 with the scale folded in, P rounded to bf16 for P.V, l from fp32 P, O = acc / l in bf16.
    threshold: FlashAttention-4's conditional rescale (steps 13-14): the shift moves only when a tile's max
    passes it by more than this (log2 units), so P runs up to 2^threshold."""
    q, k, v = q.float(), k.float(), v.float()
    scale_log2 = scale * math.log2(math.e)
    m = torch.full(q.shape[:-1], -math.inf)
    l_i, acc = torch.zeros(q.shape[:-1]), torch.zeros(q.shape)
    for j in range(0, k.shape[-2], tile_k):
        s = q @ k[..., j:j + tile_k, :].transpose(-1, -2)
        m_new = torch.maximum(m, s.amax(-1))
        if threshold is not None:
            m_new = torch.where((m_new - m) * scale_log2 > threshold, m_new, m)
        alpha = torch.exp2((m - m_new) * scale_log2)
        p = torch.exp2((s - m_new[..., None]) * scale_log2)
        l_i = alpha * l_i + p.sum(-1)
        acc = alpha[..., None] * acc + p.to(torch.bfloat16).float() @ v[..., j:j + tile_k, :]
        m = m_new
    return (acc / l_i[..., None]).to(torch.bfloat16), m * scale + torch.log(l_i)


@pytest.mark.parametrize("threshold", [None, 8.0], ids=["running-max", "fa4-rescale"])
def test_a_kernel_in_the_class_passes(cpu_case, threshold):
    err = errors_of(cpu_case, *tiled_attention_fp32(cpu_case.q, cpu_case.k, cpu_case.v, cpu_case.scale, 64, threshold))
    assert not err.failures(), f"{err.failures()} ({err}); {replay()}"


# Peaked rows (scale 0.3, the shape of test_steps_gpu.py's test_custom_scale for 128 x 128 tiles): the kernel-like
# computation with FA4's rescale passes the verdict at every seed below, and fails it at one or more of them when
# O_P_ROUNDING is 0 (the bound before it): the term is what lets a correct FA4 kernel through, not slack.
PEAKED_SEEDS = range(30)


@pytest.mark.parametrize("p_rounding", [checks.O_P_ROUNDING, 0.0], ids=["with", "without"])
def test_fa4_rescale_needs_the_p_rounding_term(monkeypatch, p_rounding):
    monkeypatch.setattr(checks, "O_P_ROUNDING", p_rounding)
    failed = []
    for seed in PEAKED_SEEDS:
        case = prepare(*make_inputs(2, 2, 256, 512, seed=seed, device="cpu"), scale=0.3)
        err = errors_of(case, *tiled_attention_fp32(case.q, case.k, case.v, case.scale, 128, threshold=8.0))
        failed += [(seed, round(err.o_max_abs / err.o_limit(), 2))] if err.failures() else []
        assert all("O error" in b for b in err.failures()), err.failures()
    if p_rounding > 0:
        assert failed == [], f"(seed, error / bound) of the seeds that failed: {failed}"
    else:  # more than one seed, and clearly over: not a tie that another CPU's rounding could flip
        assert len(failed) >= 2 and max(r for _, r in failed) > 1.05, failed


def test_the_o_bound_is_per_element():
    """The verdict judges each element against its own bound (2x the yardstick's max + O_P_ROUNDING x |O_ref|
    there): a large error where |O_ref| is large may pass while a smaller one where |O_ref| is small fails."""
    o_ref = np.zeros((1, 1, 2, 128))
    o_ref[0, 0, 0, 0], o_ref[0, 0, 1, 0] = 64.0, 1.0
    yard = 1e-3
    case = checks.Case("synthetic", None, None, None, 1.0, o_ref, np.zeros((1, 1, 2)), yard, 1e-6)
    def verdict(err_big, err_small):
        o = torch.from_numpy(o_ref.copy())
        o[0, 0, 0, 0] += err_big
        o[0, 0, 1, 0] += err_small
        return errors_of(case, o, torch.zeros(1, 1, 2, dtype=torch.float64)).failures()
    big_ok = 2 * yard + checks.O_P_ROUNDING * 64.0 * 0.9    # within the big element's own bound
    assert big_ok > 10 * (2 * yard + checks.O_P_ROUNDING + checks.O_ATOL)  # and far over the small one's
    assert verdict(big_ok, 0.0) == []
    small_bad = 2 * (2 * yard + checks.O_P_ROUNDING * 1.0 + checks.O_ATOL)  # twice the small element's bound
    bad = verdict(big_ok, small_bad)
    assert any("O error" in b and "[0, 0, 1, 0]" in b for b in bad), bad


TILES = [(64, 64), (128, 64), (128, 176)]  # steps 01, 02-07, and a tile that is not a power of two


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_adversarial_inputs(kind, tiles):
    """Each adversarial case has the property it is built for; the rounded reference and a kernel in the
    class pass the verdict on it."""
    tile_q, tile_k = tiles
    q, k, v = adversarial_inputs(kind, tile_q, tile_k, device="cpu")
    assert q.shape[2] == 2 * tile_q and k.shape[2] == checks.ADVERSARIAL_K_TILES * tile_k
    s = (q.double() @ k.double().transpose(-1, -2)).numpy() * checks.DEFAULT_SCALE  # [1, 2, nq, nk]
    tile_max = s.reshape(*s.shape[:-1], -1, tile_k).max(-1)                          # [1, 2, nq, tiles]
    if kind == "max_grows_every_tile":
        assert (np.diff(tile_max, axis=-1) > 0).all()
    elif kind.startswith("max_in_last_tile_by_"):
        jump = float(kind.rsplit("_", 1)[1])
        assert (tile_max[..., -1] - tile_max[..., :-1].max(-1) > jump - 1).all()
    elif kind.startswith("one_dominant_key_"):
        j = 0 if kind.endswith("first") else s.shape[-1] - 1
        others = np.delete(s, j, axis=-1)
        assert (np.exp(others - s[..., j:j + 1]).sum(-1) < 2**-9).all()  # together invisible next to key j in bf16
    elif kind == "equal_logits":
        assert (s.max(-1) == s.min(-1)).all()
    elif kind == "large_v_mean":
        assert abs(v.double().mean().item() - 100) < 1 and v.double().std().item() < 2
    case = prepare(q, k, v)
    for name, (o, lse) in {"rounded reference": rounded_reference(case),
                           "tiled fp32 kernel": tiled_attention_fp32(q, k, v, case.scale, tile_k)}.items():
        err = errors_of(case, o, lse)
        assert not err.failures(), f"{kind} {tiles}, {name}: {err.failures()} ({err}); {replay()}"


def test_run_seed_replays():
    """FLASHLADDER_SEED fixes every input; without it each run draws a new seed and exports it."""
    seed = checks.run_seed()
    assert replay() == f"replay: FLASHLADDER_SEED={seed}"
    a = make_inputs(1, 1, 8, 8, device="cpu")
    b = make_inputs(1, 1, 8, 8, device="cpu", seed=seed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = make_inputs(1, 1, 8, 8, device="cpu", seed=seed + 1)
    assert not torch.equal(a[0], c[0])
    assert os.environ["FLASHLADDER_SEED"] == str(seed)


def test_reference_cache_round_trip(tmp_path, monkeypatch):
    """The on-disk reference (shared by the steps of a run) is the reference; other seeds' files are dropped."""
    monkeypatch.setattr(checks, "CACHE_DIR", tmp_path)
    stale = tmp_path / f"{checks.run_seed() + 1}-abc.npz"
    stale.write_bytes(b"")
    q, k, v = make_inputs(1, 2, 64, 64, device="cpu")
    fresh = prepare(q, k, v)
    first = prepare(q, k, v, cache_key=("test", 1))
    monkeypatch.setattr(checks, "attention_reference", None)  # the second must come from the file
    again = prepare(q, k, v, cache_key=("test", 1))
    for case in (first, again):
        assert np.array_equal(case.o_ref, fresh.o_ref) and np.array_equal(case.lse_ref, fresh.lse_ref)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1 and files[0].name.startswith(f"{checks.run_seed()}-") and not stale.exists()


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 2, 5, 300), (2, 3, 129, 127), (2, 2, 1000, 77), (1, 4, 300, 4097)])
def test_unmasked_keys_past_seqlen_k_are_rejected(shape):
    """What test_steps_gpu.py::test_any_seqlen (x1) must catch: a step that forgets the mask of its last K/V tile
    takes TMA's zero rows of K and V as keys. Their output is the reference of the same inputs with K and V padded
    by zeros to whole 128-key tiles; the verdict rejects it (through the LSE: each zero key adds e^0 to l)."""
    from verify.reference import attention_reference
    q, k, v = make_inputs(*shape, device="cpu")
    case = prepare(q, k, v)
    zeros = torch.zeros(*k.shape[:2], -k.shape[2] % 128, k.shape[3], dtype=k.dtype)
    o_bad, lse_bad = attention_reference(*(t.double().numpy() for t in (q, torch.cat([k, zeros], 2), torch.cat([v, zeros], 2))),
                                         case.scale)
    bad = errors_of(case, torch.from_numpy(o_bad).to(torch.bfloat16), torch.from_numpy(lse_bad).float()).failures()
    assert any("LSE max abs error" in b for b in bad), f"an unmasked tail passed: {bad}; {replay()}"
