"""GPU: the backward of every step that has one (info["backward"]) against float64 autograd (skipped without a GPU).

The reference: torch's autograd of the float64 attention (verify/reference.py's formula, on the GPU), given the same
dO (and dLSE where a case sends a gradient into the LSE). The bound: each of dQ, dK, dV within 2x the error of a
plain bf16 implementation (plain_bf16_attention: bf16 GEMMs with fp32 accumulation, the softmax in fp32, P rounded to
bf16; torch's autograd through it), in the largest error and in the relative Frobenius norm, plus a floor of a few
bf16 roundings of the gradient's largest element (where the plain implementation happens to be exact), each element's
error first less an fp32 floor (FP32_FLOOR of what the element sums before cancellation: a gradient that is zero by
cancellation, dS = P (dP - D) with one key, is exact in the plain implementation and ~1e-7 in any kernel that makes D
from O as FlashAttention does). Gradients are
written into NaN-poisoned buffers (the backward op called directly), so an element the kernel never writes fails as
non-finite. The cases: ragged lengths (1, 127, 129, 1000), seqlen_q != seqlen_k, both causal corners (rows that see
no key: zero gradients), grouped (32/8) and multi-query heads (dK, dV summed over the query heads that read them),
large V and peaked logits, strided and fused-QKV views, a gradient into the LSE, two calls bitwise equal. Each way
of being wrong that the judge must see (CORRUPTIONS) is shown to fail it. A step that takes fp16 (info["dtypes"]:
step40) is judged in fp16 too, against a plain fp16 implementation (P rounded to fp16) and floors of fp16 roundings; one
whose backward takes head dim 64 (info["backward_head_dims"]: step42) at 64 too (the bwd_head_dim fixture).
"""
import math

import pytest

torch = pytest.importorskip("torch")

from verify.checks import DEFAULT_SCALE, default_scale, make_inputs, replay, run_seed  # noqa: E402
from verify.tests.conftest import needs_gpu  # noqa: E402

pytestmark = needs_gpu

GRADS = ("dq", "dk", "dv")
FACTOR = 2.0            # the step's error may be this many times the plain bf16 implementation's
FLOOR_MAX = 2.0**-8     # plus this much of the gradient's largest |element| (one or two bf16 roundings of it) ...
FLOOR_FROB = 2.0**-9    # ... and this much relative Frobenius error
# The same floors for fp16 gradients: 3 more bits of precision than bf16, so 8x smaller.
FLOORS = {torch.bfloat16: (FLOOR_MAX, FLOOR_FROB), torch.float16: (FLOOR_MAX / 8, FLOOR_FROB / 8)}
# Subtracted from each element's error first: 16 fp32 ulps of the sum of |terms| behind the element (magnitudes_of),
# which no cancellation shrinks. Where the gradient is not a cancellation, this is far below a bf16 rounding of it.
FP32_FLOOR = 2.0**-20


@pytest.fixture
def bwd_mod(mod):
    if not mod.info.get("backward"):
        pytest.skip(f"{mod.__name__} computes no backward")
    return mod


@pytest.fixture(params=[128, 64], ids=lambda d: f"d{d}")
def bwd_head_dim(request, bwd_mod):
    """The head dim of a backward test: 128, then 64 for the steps whose backward takes it (step42 on)."""
    if request.param not in bwd_mod.info.get("backward_head_dims", [128]):
        pytest.skip(f"{bwd_mod.__name__}'s backward takes head dim {bwd_mod.info.get('backward_head_dims', [128])}")
    return request.param


def _mask(nq, nk, causal, device):
    if not causal:
        return None
    offset = 0 if causal == "top_left" else nk - nq
    i = torch.arange(nq, device=device)[:, None]
    return torch.arange(nk, device=device)[None, :] > i + offset  # True: the key is not seen


def attention_of(q, k, v, scale, causal, p_dtype=None):
    """O and LSE by the textbook formula in q's dtype (float64 for the reference; bf16 for the plain implementation,
    whose scores and softmax are fp32 and whose P is rounded to bf16: p_dtype), differentiable by autograd. A row that
    sees no key: O = 0, LSE = -inf, and no gradient flows through it (its scores are made 0 before the softmax, so
    that no -inf - -inf turns a zero gradient into NaN, then its P is masked to 0)."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    s = torch.matmul(q, k.transpose(-1, -2))
    s = (s.float() if p_dtype else s) * scale
    mask = _mask(q.shape[2], k.shape[2], causal, q.device)
    if mask is not None:
        keyless = mask.all(dim=-1, keepdim=True)  # [seqlen_q, 1]
        s = s.masked_fill(mask & ~keyless, -math.inf).masked_fill(keyless, 0.0)
    p = torch.softmax(s, dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    if mask is not None:
        p = p.masked_fill(mask, 0.0)
        lse = lse.masked_fill(keyless[..., 0], -math.inf)
    o = torch.matmul(p.to(p_dtype) if p_dtype else p, v)
    return o, lse


def grads_of(q, k, v, d_o, d_lse, scale, causal, p_dtype=None):
    """dq, dk, dv of sum(O dO) + sum(LSE dLSE) through attention_of, in the inputs' dtype."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = attention_of(*leaves, scale, causal, p_dtype)
    outputs, grads = [o], [d_o.to(o.dtype)]
    if d_lse is not None:
        live = ~torch.isneginf(lse)  # a keyless row's LSE is a constant -inf: no gradient through it
        outputs.append(torch.where(live, lse, 0.0))
        grads.append(torch.where(live, d_lse.to(lse.dtype), 0.0))
    return torch.autograd.grad(outputs, leaves, grads)


def magnitudes_of(q, k, v, d_o, d_lse, scale, causal):
    """Float64, per element of dq, dk, dv: the sum of the absolute values of the terms that make it, before any of
    them cancel. dS = P (dP - D), D = rowsum(dO O) - dLSE: |dS| <= P (|dO| |V|^T + rowsum(|dO| |O|) + |dLSE|) =: M;
    |dq| <= scale M |K|, |dk| <= scale M^T |Q|, |dv| <= P^T |dO|, dk and dv summed over the group's heads."""
    q, k, v, d_o = (t.double() for t in (q, k, v, d_o))
    with torch.no_grad():
        o, lse = attention_of(q, k, v, scale, causal)
        heads, group = q.shape[1], q.shape[1] // k.shape[1]
        ke, ve = (t.repeat_interleave(group, dim=1) for t in (k, v))
        live = ~torch.isneginf(lse)
        p = torch.exp(torch.matmul(q, ke.transpose(-1, -2)) * scale - torch.where(live, lse, 0.0)[..., None])
        mask = _mask(q.shape[2], k.shape[2], causal, q.device)
        p = p * live[..., None]
        if mask is not None:
            p = p.masked_fill(mask, 0.0)
        m = torch.matmul(d_o.abs(), ve.abs().transpose(-1, -2)) + (d_o.abs() * o.abs()).sum(-1, keepdim=True)
        if d_lse is not None:
            m = m + d_lse.double().abs()[..., None]
        m = p * m
        dq = scale * torch.matmul(m, ke.abs())
        dk = scale * torch.matmul(m.transpose(-1, -2), q.abs())
        dv = torch.matmul(p.transpose(-1, -2), d_o.abs())
        b, _, nk, d = dk.shape
        dk, dv = (t.view(b, heads // group, group, nk, d).sum(2) for t in (dk, dv))
    return dq, dk, dv


class Case:
    """Inputs, dO (and dLSE), the float64 reference's gradients and the plain implementation's errors, all in the
    inputs' dtype (bf16, or fp16)."""

    def __init__(self, label, q, k, v, causal=False, with_d_lse=False, scale=None):
        scale = default_scale(q.shape[-1]) if scale is None else scale  # 1/sqrt(head dim), as the steps' default
        self.label, self.q, self.k, self.v, self.causal, self.scale = label, q, k, v, causal, scale
        gen = torch.Generator(device="cpu").manual_seed(run_seed() + q.shape[2] * 7919 + k.shape[2])
        self.d_o = torch.randn(q.shape, generator=gen).to(q.device, q.dtype)
        self.d_lse = torch.randn(q.shape[:3], generator=gen).to(q.device) if with_d_lse else None
        self.ref = grads_of(*(t.double() for t in (q, k, v)), self.d_o.double(),
                            None if self.d_lse is None else self.d_lse.double(), scale, causal)
        self.magnitudes = magnitudes_of(q, k, v, self.d_o, self.d_lse, scale, causal)
        plain = grads_of(q, k, v, self.d_o, self.d_lse, scale, causal, p_dtype=q.dtype)
        self.floor_max, self.floor_frob = FLOORS[q.dtype]
        self.plain = [self.errors(name, g) for name, g in zip(GRADS, plain)]

    def errors(self, name, got):
        ref, magnitude = self.ref[GRADS.index(name)], self.magnitudes[GRADS.index(name)]
        diff = ((got.double() - ref).abs() - FP32_FLOOR * magnitude).clamp(min=0)  # NaN stays NaN
        norm = ref.norm().item()
        return {"max_abs": diff.max().item() if diff.numel() else 0.0,
                "rel_frob": diff.norm().item() / norm if norm > 0 else (0.0 if diff.norm().item() == 0 else math.inf),
                "ref_max": ref.abs().max().item() if ref.numel() else 0.0}

    def failures(self, grads) -> list[str]:
        bad = []
        for name, got, plain in zip(GRADS, grads, self.plain):
            if (nonfinite := int((~torch.isfinite(got)).sum())):
                bad.append(f"{name}: {nonfinite} non-finite elements (NaN-poisoned and not written, or NaN/Inf computed)")
                continue
            err = self.errors(name, got)
            floor, kind = self.floor_max * err["ref_max"], str(self.q.dtype).removeprefix("torch.")
            if not err["max_abs"] <= FACTOR * plain["max_abs"] + floor:
                bad.append(f"{name}: max error {err['max_abs']:.3g} > {FACTOR:g} x plain {kind}'s {plain['max_abs']:.3g} "
                           f"+ {floor:.3g}")
            if not err["rel_frob"] <= FACTOR * plain["rel_frob"] + self.floor_frob:
                bad.append(f"{name}: relative Frobenius error {err['rel_frob']:.3g} > {FACTOR:g} x plain {kind}'s "
                           f"{plain['rel_frob']:.3g} + {self.floor_frob:g}")
        return bad


def run_backward(mod, case: Case, deterministic=False):
    """The step's forward (o, lse), then its backward op into NaN-poisoned dq, dk, dv."""
    q, k, v = case.q, case.k, case.v
    o, lse = mod.attention(q, k, v, case.scale, causal=case.causal)
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    code = {False: 0, "top_left": 1, "bottom_right": 2}[case.causal]
    getattr(torch.ops.flashladder, f"{mod.info['step']}_bwd")(q, k, v, o, lse, case.d_o, case.d_lse, dq, dk, dv,
                                                              case.scale, code, deterministic)
    torch.cuda.synchronize()
    return dq, dk, dv


def assert_passes(mod, case, grads):
    bad = case.failures(grads)
    assert not bad, f"{mod.__name__} backward, {case.label}: {'; '.join(bad)}; {replay()}"


# (batch, heads, heads_k, seqlen_q, seqlen_k, causal)
CASES = [
    (1, 2, 2, 1, 1, False),          # one query, one key
    (2, 3, 3, 127, 127, False),      # a tile's worth minus one
    (1, 2, 2, 129, 129, False),      # one past a tile
    (1, 2, 2, 1000, 1000, False),    # ragged, many tiles
    (2, 2, 2, 65, 300, False),       # seqlen_q < seqlen_k
    (1, 2, 2, 300, 65, False),       # seqlen_q > seqlen_k
    (1, 2, 2, 333, 333, "top_left"),
    (1, 2, 2, 200, 333, "top_left"),
    (1, 2, 2, 200, 333, "bottom_right"),
    (1, 2, 2, 333, 200, "bottom_right"),  # the first 133 rows see no key: zero gradients from them
    (1, 2, 2, 333, 200, "top_left"),
    (1, 32, 8, 256, 256, False),     # Llama-3-8B's grouped heads
    (1, 32, 8, 256, 384, "bottom_right"),
    (2, 8, 1, 160, 160, "top_left"),  # multi-query
]


@pytest.mark.parametrize("shape", CASES, ids=lambda c: "x".join(map(str, c[:5])) + (f"-{c[5]}" if c[5] else ""))
def test_backward_against_float64(bwd_mod, shape, dtype, bwd_head_dim):
    batch, heads, heads_k, nq, nk, causal = shape
    q, k, v = make_inputs(batch, heads, nq, nk, heads_k=heads_k, dtype=dtype, head_dim=bwd_head_dim)
    case = Case(f"{shape}" + (f", head dim {bwd_head_dim}" if bwd_head_dim != 128 else ""), q, k, v, causal)
    assert_passes(bwd_mod, case, run_backward(bwd_mod, case))


@pytest.mark.parametrize("kind", ["large_v", "peaked"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_backward_adversarial(bwd_mod, kind, causal, dtype, bwd_head_dim):
    """V 30x larger (large gradients into P); Q and K scaled so that each row's softmax is nearly one-hot."""
    q, k, v = make_inputs(1, 2, 256, 320, dtype=dtype, head_dim=bwd_head_dim)
    if kind == "large_v":
        v = (v.float() * 30).to(dtype)
    else:
        q, k = ((t.float() * 3).to(dtype) for t in (q, k))
    case = Case(kind, q, k, v, causal)
    assert_passes(bwd_mod, case, run_backward(bwd_mod, case))


def test_backward_with_a_gradient_into_the_lse(bwd_mod, dtype, bwd_head_dim):
    """A loss that reads the LSE too (dLSE != 0): dS gains P dLSE."""
    q, k, v = make_inputs(1, 2, 200, 250, dtype=dtype, head_dim=bwd_head_dim)
    case = Case("d_lse", q, k, v, "bottom_right", with_d_lse=True)
    assert_passes(bwd_mod, case, run_backward(bwd_mod, case))


def test_autograd_through_attention(bwd_mod, dtype, bwd_head_dim):
    """attention() is differentiable: torch.autograd.grad of a loss on (o, lse) gives the reference's gradients,
    for strided q, k, v (a [batch, seqlen, heads, 128] tensor transposed, as models pass it) and a fused QKV view."""
    b, n, h = 2, 192, 4
    qkv = make_inputs(b, 3 * h, n, n, dtype=dtype, head_dim=bwd_head_dim)[0].transpose(1, 2).contiguous()  # [b, n, 3h, d]
    q, k, v = qkv.transpose(1, 2).split(h, dim=1)                      # views of one buffer, strided
    case = Case("fused qkv", q, k, v, "top_left", with_d_lse=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse = bwd_mod.attention(*leaves, causal="top_left")
    grads = torch.autograd.grad([o, lse], leaves, [case.d_o, case.d_lse])
    assert all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))
    assert_passes(bwd_mod, case, grads)


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", [(1, 8, 300, 300, 2), (2, 4, 1000, 1100, 2), (1, 4, 1100, 1000, 2)],
                         ids=["300", "1000x1100", "1100x1000"])
def test_the_backward_is_deterministic(bwd_mod, causal, shape, dtype, bwd_head_dim):
    """deterministic=True: two calls give the same bits, and pass the judge (a step whose fast way adds dQ up in any
    order takes another way for it: info["backward_deterministic"] == "on request"). At 1000 x 1100 nine key tiles
    add to each query tile's dQ: there the fast way's bits vary from call to call. Both causal corners with more keys
    than queries and fewer: the key tiles that add to a query tile, whose turns step39 counts from the last, differ."""
    batch, heads, seqlen_q, seqlen_k, heads_k = shape
    q, k, v = make_inputs(batch, heads, seqlen_q, seqlen_k, heads_k=heads_k, dtype=dtype, head_dim=bwd_head_dim)
    case = Case("determinism", q, k, v, causal)
    first, second = run_backward(bwd_mod, case, True), run_backward(bwd_mod, case, True)
    for name, a, b in zip(GRADS, first, second):
        assert torch.equal(a, b), f"{bwd_mod.__name__}: two backward calls gave different {name}"
    assert_passes(bwd_mod, case, first)


def test_deterministic_follows_torch(bwd_mod, monkeypatch):
    """attention(deterministic=None) takes torch.use_deterministic_algorithms' setting to the backward op; True and
    False given are passed as given."""
    seen = []
    step = bwd_mod.attention.__self__

    class Spy:  # the library, its backward's params read on the way in
        def __getattr__(self, name):
            return getattr(lib, name)

        def flashladder_bwd(self, params, stream):
            seen.append(bool(params._obj.deterministic))
            return lib.flashladder_bwd(params, stream)
    lib = step.lib
    monkeypatch.setattr(step, "lib", Spy())
    leaves = [t.detach().requires_grad_() for t in make_inputs(1, 2, 64, 64)]
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for setting, given in ((True, None), (False, None), (False, True), (True, False)):
            torch.use_deterministic_algorithms(setting)
            o, _ = bwd_mod.attention(*leaves, deterministic=given)
            torch.autograd.grad(o.float().sum(), leaves)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [True, False, True, False]


def test_the_backward_under_torch_compile(bwd_mod):
    """The backward is a real op: torch.compile (AOTAutograd, which traces the backward graph) gives the eager
    gradients, bit for bit (deterministic=True, and aot_eager runs the same ops around them)."""
    leaves = [t.detach().requires_grad_() for t in make_inputs(1, 4, 256, 320, heads_k=2)]

    def loss(q, k, v):
        o, lse = bwd_mod.attention(q, k, v, causal="bottom_right", deterministic=True)
        return (o.float() ** 2).sum() + lse.sum()
    eager = torch.autograd.grad(loss(*leaves), leaves)
    torch._dynamo.reset()  # one code object for every step: without a clean cache, dynamo's recompile limit (8) stops it
    compiled = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    for name, a, b in zip(GRADS, eager, compiled):
        assert torch.equal(a, b), f"{bwd_mod.__name__}: {name} under torch.compile differs from eager"


def test_the_sdpa_drop_in_routes_calls_that_need_gradients(bwd_mod):
    """Inside sdpa(strict=True), a training step's SDPA call goes to the step, and its gradients are the step's."""
    import torch.nn.functional as F
    q, k, v = (t.detach().requires_grad_() for t in make_inputs(1, 4, 256, 256))
    with bwd_mod.sdpa(strict=True) as router:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert router.routed == 1
    out.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    with bwd_mod.sdpa(gradients=False) as router:  # the forward alone: calls that need gradients stay with torch
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert router.routed == 0 and list(router.fallbacks) == [
        "gradients are needed: sdpa(gradients=False) leaves such calls to torch"]


# Ways of being wrong that the judge must reject, applied to the step's own (correct) gradients.
CORRUPTIONS = {
    "dq_unscaled": lambda g: (g[0] / DEFAULT_SCALE, g[1], g[2]),      # the scale left out of dQ
    "dk_one_key_zero": lambda g: (g[0], g[1].index_fill(2, torch.tensor([5], device=g[1].device), 0), g[2]),
    "dv_off_5pct": lambda g: (g[0], g[1], g[2] * 1.05),
    "dq_one_nan": lambda g: (g[0].index_fill(2, torch.tensor([7], device=g[0].device), math.nan), g[1], g[2]),
    "dk_dv_swapped": lambda g: (g[0], g[2], g[1]),
    "dk_of_one_query_head": lambda g: (g[0], g[1] / 4, g[2]),        # GQA: one of the group's four heads summed
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_the_judge_rejects_wrong_gradients(bwd_mod, kind, dtype):
    q, k, v = make_inputs(1, 8, 160, 192, heads_k=2, dtype=dtype)
    case = Case(kind, q, k, v, "top_left")
    grads = run_backward(bwd_mod, case)
    assert not case.failures(grads), "the step's own gradients must pass before the corrupted ones are judged"
    assert case.failures(CORRUPTIONS[kind](grads)), f"the judge passed gradients corrupted by {kind}"
