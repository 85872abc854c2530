"""CPU: the checks' verdicts (verify/checks.py) fail where they must and pass what is right.

* Errors.failures on synthetic numbers: NaN, unwritten output, each bound;
* one corrupted row of one head (or one LSE entry) of a correct output is rejected, at x1 and x10; the
  correct output here is the float64 reference rounded to bf16/fp32, the yardstick runs on the CPU
  (test_steps_gpu.py does the same with every step's real output);
* a kernel-like computation in the kernels' precision class passes, so the bounds are not tighter than the class,
  with FlashAttention-4's conditional rescale too (and without O_P_ROUNDING it would not, on a peaked case);
* the adversarial inputs have the property each is built for;
* at ragged lengths, an output that let the zero-filled keys past seqlen_k into the softmax is rejected;
* causal masks and grouped key/value heads: the reference agrees with torch's own SDPA (is_causal, causal_lower_right,
  enable_gqa) and is the same in row blocks; a CPU kernel in the class with the mask and the heads right passes, and
  the same kernel with its diagonal one key off either way, the other corner's diagonal, or query head h reading
  key/value head h % heads_k (instead of h // group) fails; rows that see no key must be o = 0 and lse = -inf exactly.
"""
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from verify import checks, reference  # noqa: E402
from verify.checks import (  # noqa: E402
    ADVERSARIAL,
    CAUSAL_ADVERSARIAL,
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
    yardstick_attention,
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
    return torch.from_numpy(case.o_ref).to(case.q.dtype), torch.from_numpy(case.lse_ref).to(torch.float32)


@pytest.fixture(scope="module", params=[(1.0, None, torch.bfloat16, 128), (10.0, None, torch.bfloat16, 128),
                                        (1.0, 0.3, torch.bfloat16, 128), (1.0, None, torch.float16, 128),
                                        (10.0, None, torch.float16, 128), (1.0, None, torch.bfloat16, 64),
                                        (10.0, None, torch.bfloat16, 64)],
                ids=["x1", "x10", "x1-scale0.3", "fp16-x1", "fp16-x10", "d64-x1", "d64-x10"])
def cpu_case(request):
    factor, scale, dtype, head_dim = request.param
    return prepare(*make_inputs(2, 3, 128, 192, factor=factor, device="cpu", dtype=dtype, head_dim=head_dim), scale=scale)


def test_correct_output_passes(cpu_case):
    err = errors_of(cpu_case, *rounded_reference(cpu_case))
    assert not err.failures(), f"{err.failures()} ({err}); {replay()}"


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_one_corrupted_row_is_rejected(cpu_case, kind):
    o, lse = rounded_reference(cpu_case)
    bad = errors_of(cpu_case, *corrupted(kind, cpu_case, o, lse)).failures()
    assert any(CORRUPTIONS[kind] in b for b in bad), f"{kind} not rejected: {bad}; {replay()}"


def tiled_attention_fp32(q, k, v, scale, tile_k, threshold=None, rounding=None):
    """A kernel in the precision class, on the CPU: online softmax over K tiles in fp32 (running max, alpha
    rescales), exp2 with the scale folded in, P rounded to the inputs' dtype (or `rounding`) for P.V, l from fp32 P,
    O = acc / l in that dtype, returned in the inputs'. threshold: FlashAttention-4's conditional rescale (steps
    13-14): the shift moves only when a tile's max passes it by more than this (log2 units), so P runs up to
    2^threshold."""
    dtype, rounding = q.dtype, rounding or q.dtype
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
        acc = alpha[..., None] * acc + p.to(rounding).float() @ v[..., j:j + tile_k, :]
        m = m_new
    return (acc / l_i[..., None]).to(rounding).to(dtype), m * scale + torch.log(l_i)


@pytest.mark.parametrize("threshold", [None, 8.0], ids=["running-max", "fa4-rescale"])
def test_a_kernel_in_the_class_passes(cpu_case, threshold):
    err = errors_of(cpu_case, *tiled_attention_fp32(cpu_case.q, cpu_case.k, cpu_case.v, cpu_case.scale, 64, threshold))
    assert not err.failures(), f"{err.failures()} ({err}); {replay()}"


def test_the_fp16_verdict_rejects_bf16_precision():
    """fp16 inputs are judged in fp16's class (the yardstick rounds P and O to fp16, P_ROUNDING 2^-11): the same
    kernel-like computation passes with P and O in fp16 and fails with them in bf16, 3 bits coarser (a step that
    computes fp16 calls in bf16 somewhere)."""
    for factor in (1.0, 10.0):
        case = prepare(*make_inputs(2, 3, 128, 192, factor=factor, device="cpu", dtype=torch.float16))
        good = errors_of(case, *tiled_attention_fp32(case.q, case.k, case.v, case.scale, 64))
        assert not good.failures(), f"x{factor}: {good.failures()}; {replay()}"
        bad = errors_of(case, *tiled_attention_fp32(case.q, case.k, case.v, case.scale, 64, rounding=torch.bfloat16))
        assert any("O error" in b for b in bad.failures()), f"x{factor}: bf16 precision passed the fp16 verdict; {replay()}"


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


@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_adversarial_inputs(kind, tiles, head_dim):
    """Each adversarial case has the property it is built for, at head dim 128 and 64 (step41 on); the rounded
    reference and a kernel in the class pass the verdict on it."""
    tile_q, tile_k = tiles
    q, k, v = adversarial_inputs(kind, tile_q, tile_k, device="cpu", head_dim=head_dim)
    assert q.shape[2] == 2 * tile_q and k.shape[2] == checks.ADVERSARIAL_K_TILES * tile_k and q.shape[3] == head_dim
    s = (q.double() @ k.double().transpose(-1, -2)).numpy() * checks.default_scale(head_dim)  # [1, 2, nq, nk]
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
    monkeypatch.setattr(checks, "attention_reference_of", None)  # the second must come from the file
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


# ---------------------------------------------------------------- causal masks and grouped key/value heads

def test_causal_mask_by_hand():
    """Row i sees key j iff j <= i + offset: offset 0 from the top left, seqlen_k - seqlen_q from the bottom right."""
    inf = -np.inf
    assert np.array_equal(reference.causal_mask(2, 3, "top_left"), [[0, inf, inf], [0, 0, inf]])
    assert np.array_equal(reference.causal_mask(2, 3, "bottom_right"), [[0, 0, inf], [0, 0, 0]])
    assert np.array_equal(reference.causal_mask(3, 2, "top_left"), [[0, inf], [0, 0], [0, 0]])
    assert np.array_equal(reference.causal_mask(3, 2, "bottom_right"), [[inf, inf], [0, inf], [0, 0]])
    assert np.array_equal(reference.causal_mask(3, 3, "bottom_right"), reference.causal_mask(3, 3, "top_left"))
    assert np.array_equal(reference.causal_mask(5, 7, "bottom_right", range(2, 4)), reference.causal_mask(5, 7, "bottom_right")[2:4])
    with pytest.raises(ValueError, match="alignment 'lower_right'"):
        reference.causal_mask(2, 2, "lower_right")


def test_repeat_kv_maps_query_head_h_to_h_over_the_group():
    kv = np.arange(3)[None, :, None, None] * np.ones((1, 3, 2, 4))  # key/value head j holds j everywhere
    assert [int(x) for x in reference.repeat_kv(kv, 6)[0, :, 0, 0]] == [0, 0, 1, 1, 2, 2]
    assert reference.repeat_kv(kv, 3) is not None and reference.repeat_kv(kv, 3).shape == kv.shape
    with pytest.raises(ValueError, match="3 key/value heads do not divide 4 query heads"):
        reference.repeat_kv(kv, 4)


TORCH_KWARGS = {False: lambda nq, nk: {}, "top_left": lambda nq, nk: {"is_causal": True},
                "bottom_right": lambda nq, nk: {"attn_mask": causal_lower_right(nq, nk)}}


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("causal", TORCH_KWARGS, ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 4, 5, 300), (1, 4, 2, 129, 127), (2, 6, 1, 200, 64), (1, 2, 2, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_the_reference_is_torch_s_sdpa(shape, causal):
    """The float64 reference (causal_mask, repeat_kv) against torch's own float64 SDPA with is_causal=True (the top left),
    causal_lower_right (the bottom right) and enable_gqa: the same rows see the same keys; rows that see none are o = 0
    and lse = -inf in the reference (torch's are 0 or NaN, by version: not compared)."""
    batch, heads, heads_k, nq, nk = shape
    q, k, v = make_inputs(batch, heads, nq, nk, heads_k=heads_k, device="cpu")
    o, lse = reference.attention_reference_of(*(t.double().numpy() for t in (q, k, v)), causal=causal)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True,
                                                            **TORCH_KWARGS[causal](nq, nk)).numpy()
    seen = ~np.isneginf(lse)
    assert np.allclose(o[seen], want[seen], rtol=1e-12, atol=1e-12)
    assert (o[~seen] == 0).all()
    if causal == "bottom_right" and nq > nk:
        assert (~seen).sum() == batch * heads * (nq - nk)  # the first nq - nk rows of every head
    else:
        assert seen.all()


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 4, 5, 300), (1, 4, 2, 129, 127), (2, 6, 1, 200, 64), (1, 2, 2, 300, 44),
                                   (1, 2, 2, 3, 0)], ids=lambda s: "x".join(map(str, s)))
def test_the_torch_reference_is_the_numpy_reference(shape, causal):
    """attention_reference_torch (what the checks use for inputs on a GPU; here in torch float64 on the CPU) against
    numpy's attention_reference_of: the same values to ~1e-15, the same rows that see no key (o = 0, lse = -inf
    exactly), in blocks of rows or in one; at x10 too (peaked rows)."""
    batch, heads, heads_k, nq, nk = shape
    for factor in (1.0, 10.0):
        q, k, v = make_inputs(batch, heads, nq, nk, heads_k=heads_k, factor=factor, device="cpu")
        want = reference.attention_reference_of(*(t.double().numpy() for t in (q, k, v)), 0.1, causal)
        for chunk in (None, 2 * heads * max(nk, 1) * 7):  # 7 rows a block
            got = reference.attention_reference_torch(q, k, v, 0.1, causal, chunk_scores=chunk)
            for a, b in zip(got, want):
                assert a.dtype == np.float64 and a.shape == b.shape
                assert np.array_equal(np.isneginf(a), np.isneginf(b)) and np.allclose(a, b, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="do not divide"):
        reference.attention_reference_torch(*make_inputs(1, 3, 4, 4, heads_k=2, device="cpu"))


def test_the_reference_in_row_blocks_is_the_reference(monkeypatch):
    """attention_reference_of computes blocks of rows of at most chunk_scores scores (a 32K x 32K call would need
    8 GB at once); the blocks give what one block gives, and none is over the limit."""
    q, k, v = (t.double().numpy() for t in make_inputs(2, 4, 300, 200, heads_k=2, device="cpu"))
    blocks = []
    real = reference.attention_reference

    def spy(q, k, v, scale=None, mask=None):
        blocks.append(q.shape[:-1] + k.shape[-2:-1])
        return real(q, k, v, scale, mask)
    for causal in (False, "top_left", "bottom_right"):
        whole = reference.attention_reference_of(q, k, v, 0.1, causal, chunk_scores=10**9)
        monkeypatch.setattr(reference, "attention_reference", spy)
        blocks.clear()
        parts = reference.attention_reference_of(q, k, v, 0.1, causal, chunk_scores=2 * 4 * 200 * 7)  # 7 rows a block
        monkeypatch.setattr(reference, "attention_reference", real)
        assert len(blocks) == -(-300 // 7) and all(int(np.prod(b)) <= 2 * 4 * 200 * 7 for b in blocks), blocks
        for a, b in zip(whole, parts):
            assert np.allclose(a, b, rtol=1e-13, atol=1e-13) and np.array_equal(np.isneginf(a), np.isneginf(b))
    # the default: a 32K x 32K head's scores in blocks of CHUNK_SCORES
    assert reference.CHUNK_SCORES * 8 <= 2**30  # 128 MiB a float64 copy: a few copies of a block fit anywhere


def test_the_yardstick_in_row_blocks_is_the_yardstick(monkeypatch):
    q, k, v = make_inputs(1, 4, 300, 200, heads_k=1, device="cpu")
    for causal in (False, "top_left", "bottom_right"):
        whole = yardstick_attention(q, k, v, 0.1, causal)
        monkeypatch.setattr(checks, "CHUNK_SCORES", 4 * 200 * 7)
        parts = yardstick_attention(q, k, v, 0.1, causal)
        monkeypatch.undo()
        assert torch.allclose(whole[0].float(), parts[0].float(), atol=1e-2) and torch.allclose(whole[1], parts[1], atol=1e-5)
        assert torch.equal(torch.isneginf(whole[1]), torch.isneginf(parts[1]))


def kernel_on_cpu(q, k, v, scale, causal=False, tile_k=64, diagonal_shift=0, alignment=None, kv_head=None, keyless="exact",
                  max_before_mask=False):
    """A causal, grouped-heads kernel in the class on the CPU: tiled_attention_fp32's online softmax in fp32 over K tiles,
    each tile's scores masked (-inf) before its max, the shift of a row that has seen nothing yet held at 0, so that
    a row that sees no key ends with l = 0: o = 0 and lse = -inf.
    Ways to get it wrong, for the tests that the verdict rejects them: diagonal_shift (row i sees j <= i + offset +
    shift: +1 one key too many, -1 one too few), alignment (the other corner's offset), kv_head(heads, heads_k) (the
    key/value head each query head reads; right: h // (heads // heads_k)), keyless="nan" (no care for l = 0: 0/0) or
    "lse_zero" (o = 0 but lse = 0 there), max_before_mask (the row max of a tile taken over its unmasked scores)."""
    heads, heads_k = q.shape[1], k.shape[1]
    index = torch.arange(heads) // (heads // heads_k) if kv_head is None else kv_head(heads, heads_k)
    q, k, v = q.float(), k[:, index].float(), v[:, index].float()
    nq, nk = q.shape[2], k.shape[2]
    offset = reference.causal_offset(nq, nk, alignment or causal) if causal else None
    scale_log2 = scale * math.log2(math.e)
    m = torch.full(q.shape[:-1], -math.inf)
    l_i, acc = torch.zeros(q.shape[:-1]), torch.zeros(q.shape)
    rows = torch.arange(nq)[:, None]
    for j in range(0, nk, tile_k):
        s = unmasked = q @ k[..., j:j + tile_k, :].transpose(-1, -2)
        if causal:
            keys = torch.arange(j, min(nk, j + tile_k))[None, :]
            s = s.masked_fill(keys > rows + offset + diagonal_shift, -math.inf)
        m_new = torch.maximum(m, (unmasked if max_before_mask else s).amax(-1))
        shift = torch.where(torch.isneginf(m_new), 0.0, m_new)  # nothing seen yet: exp2(-inf) = 0, not NaN
        alpha = torch.exp2((m - shift) * scale_log2)
        p = torch.exp2((s - shift[..., None]) * scale_log2)
        l_i = alpha * l_i + p.sum(-1)
        acc = alpha[..., None] * acc + p.to(torch.bfloat16).float() @ v[..., j:j + tile_k, :]
        m = m_new
    none = l_i == 0
    if keyless == "nan":
        return (acc / l_i[..., None]).to(torch.bfloat16), m * scale + torch.log(l_i)
    o = torch.where(none[..., None], 0.0, acc / torch.where(none, 1.0, l_i)[..., None])
    lse = torch.where(none, -math.inf if keyless == "exact" else 0.0, m * scale + torch.log(l_i))
    return o.to(torch.bfloat16), lse


# (batch, heads, heads_k, seqlen_q, seqlen_k): equal heads, GQA, MQA; seqlen_q <, =, > seqlen_k; one K tile and several
GROUPED_SHAPES = [(1, 4, 4, 5, 300), (2, 4, 2, 129, 127), (1, 8, 2, 200, 100), (1, 4, 1, 100, 200), (1, 4, 2, 128, 128),
                  (1, 2, 1, 300, 64)]


@pytest.fixture(scope="module", params=GROUPED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def grouped_inputs(request):
    batch, heads, heads_k, nq, nk = request.param
    return make_inputs(batch, heads, nq, nk, heads_k=heads_k, device="cpu", seed=checks.run_seed() + 7)


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"], ids=str)
def test_a_causal_grouped_kernel_in_the_class_passes_and_each_mistake_fails(grouped_inputs, causal):
    q, k, v = grouped_inputs
    case = prepare(q, k, v, causal=causal)
    nq, nk, heads, heads_k = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    keyless = int(np.isneginf(case.lse_ref).sum())
    assert keyless == (q.shape[0] * heads * max(0, nq - nk) if causal == "bottom_right" else 0)
    for name, (o, lse) in {"rounded reference": rounded_reference(case), "yardstick": yardstick_attention(q, k, v, case.scale, causal),
                           "kernel": kernel_on_cpu(q, k, v, case.scale, causal)}.items():
        err = errors_of(case, o, lse)
        assert not err.failures(), f"{name} ({causal}): {err.failures()} ({err}); {replay()}"
        assert err.nonfinite_lse == 0 and err.wrong_keyless == 0
    wrong = {}
    if causal:
        wrong["row i sees j <= i + 1 (one key past the diagonal)"] = dict(diagonal_shift=1)
        wrong["row i sees j < i (the diagonal's own key missed)"] = dict(diagonal_shift=-1)
        if nq != nk:  # the corners' diagonals differ only then
            wrong["the other corner's diagonal"] = dict(alignment="top_left" if causal == "bottom_right" else "bottom_right")
        if keyless:
            wrong["0/0 in the rows that see no key"] = dict(keyless="nan")
            wrong["lse = 0 in the rows that see no key"] = dict(keyless="lse_zero")
    if 1 < heads_k < heads:  # (one key/value head, or one per query head: any map is the right one)
        wrong["query head h reads key/value head h % heads_k"] = dict(kv_head=lambda h, hk: torch.arange(h) % hk)
    for what, mistake in wrong.items():
        bad = errors_of(case, *kernel_on_cpu(q, k, v, case.scale, causal, **mistake)).failures()
        assert bad, f"{what} ({causal}, {tuple(q.shape)} x {tuple(k.shape)}) passed the verdict; {replay()}"


@pytest.mark.parametrize("what", ["o 2^-100 in one keyless row", "lse -inf in a row that sees keys", "lse +inf in a keyless row",
                                  "lse NaN in a keyless row"])
def test_rows_that_see_no_key_are_exact_or_fail(what):
    """bottom_right with seqlen_q > seqlen_k: the first rows see no key. o = 0 and lse = -inf there pass, and count as
    neither an error nor non-finite; anything else there (a tiny o, a NaN) fails, as does -inf in a row that sees keys."""
    q, k, v = make_inputs(1, 2, 100, 40, device="cpu")
    case = prepare(q, k, v, causal="bottom_right")
    assert np.isneginf(case.lse_ref[:, :, :60]).all() and np.isfinite(case.lse_ref[:, :, 60:]).all()
    assert (case.o_ref[:, :, :60] == 0).all()
    o, lse = rounded_reference(case)
    err = errors_of(case, o, lse)
    assert err.failures() == [] and err.lse_max_abs < 1e-5 and err.nonfinite_lse == 0 and err.wrong_keyless == 0
    if what == "o 2^-100 in one keyless row":
        o[0, 1, 7, 3] = 2.0**-100
    elif what == "lse -inf in a row that sees keys":
        lse[0, 0, 60] = -math.inf
    elif what == "lse +inf in a keyless row":
        lse[0, 0, 3] = math.inf
    else:
        lse[0, 1, 0] = math.nan
    bad = errors_of(case, o, lse).failures()
    assert bad, f"{what}: passed"
    if what != "lse -inf in a row that sees keys":
        assert any("rows that see no key have o != 0 or lse != -inf" in b for b in bad), bad
    else:
        assert any("non-finite" in b for b in bad) and any("LSE max abs error inf" in b for b in bad), bad


def test_the_causal_adversarial_case_has_its_property():
    """masked_keys_above_by_100: in each row's diagonal K tile the keys past the diagonal score above every key the row
    sees there, by up to 100 nats (row 0, top left: its one key against the rest of tile 0); the rounded reference, the
    yardstick and the CPU kernel pass the verdict on it (both corners); a kernel with the diagonal one off fails, and so
    does one that takes a tile's max before its mask (top left)."""
    tile_q = tile_k = 64
    q, k, v = checks.adversarial_inputs("masked_keys_above_by_100", tile_q, tile_k, device="cpu")
    s = (q.double() @ k.double().transpose(-1, -2)).numpy() * checks.DEFAULT_SCALE
    row0 = s[0, 0, 0, :tile_k]
    assert row0[1:].max() - row0[0] > 90  # top left: row 0 sees key 0 alone, the masked rest of its tile ~100 nats up
    assert set(CAUSAL_ADVERSARIAL) == {"masked_keys_above_by_100"}
    for causal in ("top_left", "bottom_right"):
        case = prepare(q, k, v, causal=causal)
        for name, (o, lse) in {"rounded reference": rounded_reference(case),
                               "yardstick": yardstick_attention(q, k, v, case.scale, causal),
                               "kernel": kernel_on_cpu(q, k, v, case.scale, causal, tile_k=tile_k)}.items():
            err = errors_of(case, o, lse)
            assert not err.failures(), f"{name} ({causal}): {err.failures()} ({err}); {replay()}"
        for shift in (1, -1):
            assert errors_of(case, *kernel_on_cpu(q, k, v, case.scale, causal, tile_k=tile_k, diagonal_shift=shift)).failures()
    # what the case is for: a kernel that takes each tile's max before masking it loses the first rows' keys in
    # the masked ones' shadow (random inputs hide it: their masked keys are a few nats up at most)
    case = prepare(q, k, v, causal="top_left")
    bad = errors_of(case, *kernel_on_cpu(q, k, v, case.scale, "top_left", tile_k=tile_k, max_before_mask=True)).failures()
    assert any("O error" in b for b in bad), bad


def test_the_reference_cache_knows_causal_and_the_key_value_heads(tmp_path, monkeypatch):
    """One cache_key, other causal masks or other key/value heads: other files, never another call's reference."""
    monkeypatch.setattr(checks, "CACHE_DIR", tmp_path)
    q, k, v = make_inputs(1, 4, 64, 64, device="cpu")
    key = ("test", "same key")
    dense = prepare(q, k, v, cache_key=key)
    top_left = prepare(q, k, v, cache_key=key, causal="top_left")
    grouped = prepare(q, k[:, :2], v[:, :2], cache_key=key)
    assert not np.array_equal(dense.lse_ref, top_left.lse_ref) and not np.array_equal(dense.lse_ref, grouped.lse_ref)
    assert len(list(tmp_path.glob("*.npz"))) == 3
    for case, causal, kv in ((dense, False, (k, v)), (top_left, "top_left", (k, v)), (grouped, False, (k[:, :2], v[:, :2]))):
        fresh = prepare(q, *kv, causal=causal)
        assert np.array_equal(case.o_ref, fresh.o_ref) and np.array_equal(case.lse_ref, fresh.lse_ref)
    monkeypatch.setattr(checks, "attention_reference_of", None)  # from the files now
    again = prepare(q, k, v, cache_key=key, causal="top_left")
    assert np.array_equal(again.lse_ref, top_left.lse_ref)


def test_random_case_labels_and_keys_name_causal_and_the_heads(monkeypatch, tmp_path):
    monkeypatch.setattr(checks, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(checks, "make_inputs", lambda *a, **kw: make_inputs(*a, **{**kw, "device": "cpu"}))
    checks.random_case.cache_clear()
    try:
        case = checks.random_case(1, 4, 30, 50, 1.0, "bottom_right", 2)
        assert case.label == "random x1 1x4x30x50, 2 kv heads, causal bottom_right" and case.causal == "bottom_right"
        assert case.k.shape == (1, 2, 50, 128) and case.q.shape == (1, 4, 30, 128)
        assert checks.random_case(1, 4, 30, 50).label == "random x1 1x4x30x50" and len(list(tmp_path.glob("*.npz"))) == 2
    finally:
        checks.random_case.cache_clear()


def test_bad_causal_values_are_refused_by_the_checks():
    q, k, v = make_inputs(1, 2, 4, 4, device="cpu")
    for causal in ("lower_right", True, 1):
        with pytest.raises(ValueError, match="alignment"):
            prepare(q, k, v, causal=causal)
