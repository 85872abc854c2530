"""The SDPA drop-in (common/binding/router.py's route_reason and SdpaRouter; every step's `sdpa()`).

CPU: what routes and what falls back, and why, from the call's metadata alone (route_reason on described meta
tensors, a GPU faked where it matters); positional and keyword calls; the counts; strict mode; nested routers; a router
inactive after its `with`, an exception included; nothing active after a step's import. A stand-in op (plain torch
attention, on CPU) takes the routed calls, so that the routing runs end to end on CPU, in eager and under
torch.compile (aot_eager: the graph as inductor would get it, without a C++ compiler), and the steps' own ops run on
fake CUDA tensors and, under torch.compile, on meta tensors. A step with causal masks and grouped heads
(info["causal"], info["gqa"]: limits with FEATURE_CAUSAL | FEATURE_GQA) takes is_causal=True, torch's causal biases and
enable_gqa with fewer key/value heads, and its attention function gets causal="top_left" or "bottom_right".
GPU: a small DiT-like module routed to each step: every call within the step's bounds against the float64 reference
(verify/checks.py), under torch.compile and in a CUDA graph too.
"""
import collections
import gc
import importlib
import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from torch.nn.attention.bias import causal_lower_right, causal_upper_left  # noqa: E402

from verify import steps as steps_mod  # noqa: E402
from verify.tests.conftest import needs_gpu  # noqa: E402

binding = importlib.import_module("binding")  # common/binding/, on sys.path through verify.steps

BF16 = torch.bfloat16
LIMITS = binding.SdpaLimits("stepX", seqlen_multiple=(64, 64), archs=("sm_90a",))  # a step built for Hopper alone
FEATURES = binding.FEATURE_CAUSAL | binding.FEATURE_GQA
CAUSAL_LIMITS = LIMITS._replace(step="stepY", seqlen_multiple=(1, 1), features=FEATURES)  # step15's kind
H200 = binding.Device("NVIDIA H200 (pretend)", 9, 0, 227 * 1024)
RTX_4090 = binding.Device("NVIDIA GeForce RTX 4090 (pretend)", 8, 9, 99 * 1024)


def meta(*shape, dtype=BF16, requires_grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


def described(args, kwargs=None, device="cuda:0"):
    """An SDPA call as route_reason reads it, its tensors moved (in their description) onto `device`."""
    call = binding.sdpa_arguments(args, kwargs or {})
    if call is None:
        return None
    out = {}
    for name, value in call.items():
        d = binding.describe(value)
        out[name] = d._replace(device=torch.device(device)) if isinstance(d, binding.TensorMeta) else d
    return out


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(binding.checks, "device_props", lambda index: H200)


def qkv(b=1, h=2, n=128, nk=None, d=128, **kw):
    nk = n if nk is None else nk
    return meta(b, h, n, d, **kw), meta(b, h, nk, d, **kw), meta(b, h, nk, d, **kw)


def transposed(b=1, n=128, h=2, d=128):
    """The layout models pass: [batch, seqlen, heads, dim] storage, viewed as [batch, heads, seqlen, dim]."""
    return meta(b, n, h, d).transpose(1, 2)


ROUTES = {
    "contiguous": lambda: (qkv(), {}),
    "strided views (diffusers' layout)": lambda: ((transposed(), transposed(n=256), transposed(n=256)), {}),
    "seqlen_q != seqlen_k": lambda: (qkv(n=64, nk=192), {}),
    "scale as a keyword": lambda: (qkv(), {"scale": 0.05}),
    "every default given": lambda: (qkv(), {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                                            "enable_gqa": False}),
    "all positional": lambda: ((*qkv(), None, 0.0, False), {}),
    "enable_gqa with equal heads": lambda: (qkv(), {"enable_gqa": True}),
    "needs grad, grad off": lambda: (qkv(requires_grad=True), {}),
}


@pytest.mark.parametrize("case", ROUTES)
def test_what_routes(case, on_h200):
    args, kwargs = ROUTES[case]()
    assert binding.route_reason(described(args, kwargs), LIMITS, grad_enabled=False) is None


FALLS_BACK = {
    "cpu tensors": (lambda: (qkv(), {}), "cpu", "the tensors are on cpu; the step runs on cuda tensors"),
    "attn_mask": (lambda: (qkv(), {"attn_mask": meta(128, 128)}), "cuda:0", "attn_mask is given: the step takes no mask"),
    "dropout": (lambda: (qkv(), {"dropout_p": 0.1}), "cuda:0", "dropout_p=0.1: the step has no dropout"),
    "causal": (lambda: (qkv(), {"is_causal": True}), "cuda:0", "is_causal=True: the step is non-causal"),
    "gqa": (lambda: ((meta(1, 4, 128, 128), meta(1, 2, 128, 128), meta(1, 2, 128, 128)), {"enable_gqa": True}), "cuda:0",
            "enable_gqa with 4 query heads and 2 key/value heads: the step needs as many key/value heads as query heads"),
    "heads differ": (lambda: ((meta(1, 4, 128, 128), meta(1, 2, 128, 128), meta(1, 2, 128, 128)), {}), "cuda:0",
                     "4 query heads and 2 key/value heads without enable_gqa (torch broadcasts a single key/value head "
                     "and refuses other counts; the step leaves it to torch)"),
    "causal bias": (lambda: (qkv(), {"attn_mask": causal_lower_right(128, 128)}), "cuda:0",
                    "attn_mask is a causal bias (bottom_right): the step is non-causal"),
    "causal bias, upper left": (lambda: (qkv(), {"attn_mask": causal_upper_left(128, 128)}), "cuda:0",
                                "attn_mask is a causal bias (top_left): the step is non-causal"),
    "fp16": (lambda: (qkv(dtype=torch.float16), {}), "cuda:0",
             "q has dtype torch.float16; this step computes in torch.bfloat16 only (fp16: step40 on)"),
    "head dim 64": (lambda: (qkv(d=64), {}), "cuda:0",
                    "q has head dim 64 (shape (1, 2, 128, 64)); this step takes 128 (64: step41 on)"),
    "3-D": (lambda: ((meta(2, 128, 128),) * 3, {}), "cuda:0",
            "q must be 4-D [batch, heads, seqlen, head dim], got shape (2, 128, 128)"),
    "seqlen not a multiple": (lambda: (qkv(n=100), {}), "cuda:0",
                              "q seqlen 100 is not supported: this step needs a multiple of 64"),
    "last dim strided": (lambda: ((meta(1, 2, 128, 256)[..., ::2],) * 3, {}), "cuda:0",
                         "q has strides (65536, 32768, 256, 2): the last dim must be contiguous (stride 1) and the other "
                         "strides multiples of 8 elements (16 bytes); call .contiguous() first"),
    "negative scale": (lambda: (qkv(), {"scale": -0.1}), "cuda:0", "scale must be a finite positive float, got -0.1"),
    "bool scale": (lambda: (qkv(), {"scale": True}), "cuda:0", "scale must be a finite positive float, got True"),
    "needs grad": (lambda: (qkv(requires_grad=True), {}), "cuda:0",
                   "gradients are needed: the step computes no backward (run the model under torch.no_grad())"),
    "not a tensor": (lambda: (([1.0], *qkv()[1:]), {}), "cuda:0", "query is list, not a strided tensor"),
    "unknown keyword": (lambda: (qkv(), {"window": 3}), "cuda:0", "the arguments do not bind to SDPA's parameters"),
    "scale by position": (lambda: ((*qkv(), None, 0.0, False, 0.3), {}), "cuda:0",  # keyword-only in SDPA
                          "the arguments do not bind to SDPA's parameters"),
    "too many arguments": (lambda: ((*qkv(), None, 0.0, False, None, False, 1), {}), "cuda:0",
                           "the arguments do not bind to SDPA's parameters"),
    "given twice": (lambda: (qkv(), {"query": meta(1, 2, 128, 128)}), "cuda:0", "the arguments do not bind to SDPA's parameters"),
}


@pytest.mark.parametrize("case", FALLS_BACK)
def test_what_falls_back_and_why(case, on_h200):
    make, device, reason = FALLS_BACK[case]
    args, kwargs = make()
    assert binding.route_reason(described(args, kwargs, device), LIMITS, grad_enabled=True) == reason


def test_a_step_with_a_backward_takes_the_calls_that_need_gradients(on_h200):
    """info["backward"] (SdpaLimits.backward): a call that needs gradients is routed; without it, it falls back."""
    call = described(qkv(requires_grad=True), {})
    assert binding.route_reason(call, LIMITS._replace(backward=True), grad_enabled=True) is None
    assert binding.route_reason(call, LIMITS, grad_enabled=True).startswith("gradients are needed")
    assert binding.route_reason(call, LIMITS._replace(backward=True, gradients=False), grad_enabled=True) == \
        "gradients are needed: sdpa(gradients=False) leaves such calls to torch"
    assert binding.route_reason(call, LIMITS._replace(backward=True, gradients=False), grad_enabled=False) is None


def gqa(heads=4, heads_k=2, n=128, nk=None, b=1, b_k=None):
    nk = n if nk is None else nk
    return meta(b, heads, n, 128), meta(b if b_k is None else b_k, heads_k, nk, 128), meta(b if b_k is None else b_k, heads_k, nk, 128)


CAUSAL_ROUTES = {
    "is_causal": lambda: (qkv(), {"is_causal": True}),
    "is_causal, seqlen_q < seqlen_k": lambda: (qkv(n=100, nk=300), {"is_causal": True}),
    "is_causal by position": lambda: ((*qkv(), None, 0.0, True), {}),
    "causal_upper_left": lambda: (qkv(n=64, nk=192), {"attn_mask": causal_upper_left(64, 192)}),
    "causal_lower_right": lambda: (qkv(n=64, nk=192), {"attn_mask": causal_lower_right(64, 192)}),
    "causal_lower_right, seqlen_q > seqlen_k": lambda: (qkv(n=300, nk=100), {"attn_mask": causal_lower_right(300, 100)}),
    "enable_gqa 4/2": lambda: (gqa(), {"enable_gqa": True}),
    "enable_gqa 32/8": lambda: (gqa(32, 8), {"enable_gqa": True}),
    "enable_gqa, one key/value head (MQA)": lambda: (gqa(8, 1), {"enable_gqa": True}),
    "enable_gqa and is_causal": lambda: (gqa(32, 8, n=100, nk=300), {"enable_gqa": True, "is_causal": True}),
    "enable_gqa and causal_lower_right": lambda: (gqa(4, 1, n=64, nk=192),
                                                  {"enable_gqa": True, "attn_mask": causal_lower_right(64, 192)}),
    "enable_gqa with equal heads": lambda: (qkv(), {"enable_gqa": True}),
    "strided views": lambda: ((transposed(), transposed(n=256), transposed(n=256)), {"is_causal": True}),
}


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # torch's; the step gives o = 0 there
@pytest.mark.parametrize("case", CAUSAL_ROUTES)
def test_what_routes_to_a_step_with_causal_masks_and_grouped_heads(case, on_h200):
    args, kwargs = CAUSAL_ROUTES[case]()
    assert binding.route_reason(described(args, kwargs), CAUSAL_LIMITS, grad_enabled=False) is None


CAUSAL_FALLS_BACK = {
    "a mask that is not a causal bias": (lambda: (qkv(), {"attn_mask": meta(128, 128)}),
                                         "attn_mask is given: the step takes no mask"),
    "a causal bias and is_causal": (lambda: (qkv(), {"attn_mask": causal_upper_left(128, 128), "is_causal": True}),
                                    "attn_mask and is_causal are both given"),
    "a causal bias of other lengths": (lambda: (qkv(n=128, nk=256), {"attn_mask": causal_lower_right(128, 128)}),
                                       "the causal bias was made for 128 x 128, the call has 128 x 256"),
    "heads that do not divide": (lambda: (gqa(4, 3), {"enable_gqa": True}),
                                 "q and k/v must agree on batch, and k/v's heads must divide q's, got (1, 4, 128, 128) "
                                 "and (1, 3, 128, 128)"),
    "more key/value heads than query heads": (lambda: (gqa(2, 4), {"enable_gqa": True}),
                                              "q and k/v must agree on batch, and k/v's heads must divide q's, got "
                                              "(1, 2, 128, 128) and (1, 4, 128, 128)"),
    "batch differs": (lambda: (gqa(4, 2, b=2, b_k=1), {"enable_gqa": True}),
                      "q and k/v must agree on batch, and k/v's heads must divide q's, got (2, 4, 128, 128) and "
                      "(1, 2, 128, 128)"),
    "heads differ without enable_gqa": (lambda: (gqa(4, 2), {}),
                                        "4 query heads and 2 key/value heads without enable_gqa (torch broadcasts a "
                                        "single key/value head and refuses other counts; the step leaves it to torch)"),
    "one key/value head without enable_gqa": (lambda: (gqa(4, 1), {}),
                                              "4 query heads and 1 key/value heads without enable_gqa (torch broadcasts a "
                                              "single key/value head and refuses other counts; the step leaves it to torch)"),
    "is_causal not a bool": (lambda: (qkv(), {"is_causal": 1}), "is_causal is 1 (int), not a bool (torch refuses it)"),
    "is_causal a tensor": (lambda: (qkv(), {"is_causal": torch.tensor(True)}), "is_causal is a tensor, not a bool (torch refuses it)"),
    "dropout": (lambda: (qkv(), {"is_causal": True, "dropout_p": 0.1}), "dropout_p=0.1: the step has no dropout"),
    "needs grad": (lambda: (qkv(requires_grad=True), {"is_causal": True}),
                   "gradients are needed: the step computes no backward (run the model under torch.no_grad())"),
}


@pytest.mark.parametrize("case", CAUSAL_FALLS_BACK)
def test_what_falls_back_from_a_step_with_causal_masks_and_grouped_heads(case, on_h200):
    make, reason = CAUSAL_FALLS_BACK[case]
    args, kwargs = make()
    assert binding.route_reason(described(args, kwargs), CAUSAL_LIMITS, grad_enabled=True) == reason


@pytest.mark.parametrize("features, reason", [
    (0, "is_causal=True: the step is non-causal"),
    (binding.FEATURE_GQA, "is_causal=True: the step is non-causal"),
    (binding.FEATURE_CAUSAL, "enable_gqa with 4 query heads and 2 key/value heads: the step needs as many key/value heads "
                             "as query heads"),
    (FEATURES, None),
], ids=["none", "gqa-only", "causal-only", "both"])
def test_each_feature_lets_through_its_own_calls(features, reason, on_h200):
    """is_causal with grouped heads needs both features; each alone refuses what the other one takes."""
    call = described(gqa(), {"enable_gqa": True, "is_causal": True})
    assert binding.route_reason(call, LIMITS._replace(features=features), grad_enabled=False) == reason
    if features & binding.FEATURE_GQA:
        assert binding.route_reason(described(gqa(), {"enable_gqa": True}), LIMITS._replace(features=features), False) is None
    if features & binding.FEATURE_CAUSAL:
        assert binding.route_reason(described(qkv(), {"is_causal": True}), LIMITS._replace(features=features), False) is None


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
def test_torch_s_causal_biases_are_described_as_causal_masks():
    assert binding.describe(causal_upper_left(3, 5)) == binding.CausalMask("top_left", 3, 5)
    assert binding.describe(causal_lower_right(5, 3)) == binding.CausalMask("bottom_right", 5, 3)
    assert binding.describe(meta(3, 5)) != binding.CausalMask("top_left", 3, 5)  # a plain tensor stays a TensorMeta
    assert described(qkv(), {"attn_mask": causal_lower_right(128, 128)})["attn_mask"] == \
        binding.CausalMask("bottom_right", 128, 128)


def test_tensors_on_several_devices_fall_back():
    call = described(qkv())
    call["key"] = call["key"]._replace(device=torch.device("cuda", 1))
    assert binding.route_reason(call, LIMITS, True) == \
        "query, key and value are on several devices (cuda:0, cuda:1, cuda:0)"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_falls_back():
    nested = torch.nested.nested_tensor([torch.zeros(2, 64, 128), torch.zeros(2, 32, 128)], dtype=BF16)
    assert binding.route_reason(described((nested, nested, nested)), LIMITS, False) == \
        "query is a nested tensor, not a strided tensor"


def test_a_gpu_the_step_cannot_run_on_falls_back_naming_it(monkeypatch):
    monkeypatch.setattr(binding.checks, "device_props", lambda index: RTX_4090)
    assert binding.route_reason(described(qkv()), LIMITS, False) == \
        "needs an sm_90 GPU (H100/H200; built for sm_90a alone), but cuda:0 is NVIDIA GeForce RTX 4090 (pretend) (sm_89)"
    small = LIMITS._replace(archs=("sm_80", "compute_80"), smem_bytes=100 * 1024)
    assert binding.route_reason(described(qkv()), small, False) == (
        "a block needs 102400 bytes (100 KB) of shared memory, but cuda:0 (NVIDIA GeForce RTX 4090 (pretend), sm_89) "
        "offers 101376 bytes (99 KB) per block")


def test_positional_and_keyword_calls_are_the_same_call():
    q, k, v = qkv()
    by_position = binding.sdpa_arguments((q, k, v, None, 0.0, False), {"scale": 0.5})
    by_name = binding.sdpa_arguments((), {"value": v, "key": k, "query": q, "scale": 0.5})
    mixed = binding.sdpa_arguments((q, k), {"value": v, "scale": 0.5})
    assert by_position == by_name == mixed
    assert by_name["query"] is q and by_name["scale"] == 0.5 and by_name["enable_gqa"] is False
    assert binding.sdpa_arguments((q, k), {}) is None  # value missing: torch says so itself


# ---------------------------------------------------------------- the router, end to end on CPU, with a stand-in op

CALLS = collections.Counter()  # how often each stand-in op ran (eagerly, or its fake while tracing)


@torch.library.custom_op("flashladder_test::attention", mutates_args=())
def stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in float32, bf16 out: plays a step's op on CPU (causal as the steps' ops take it: 0, 1 top left,
    2 bottom right; k, v with a divisor of q's heads: head h reads key/value head h // (heads // heads_k))."""
    CALLS["stand_in"] += 1
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        nq, nk = s.shape[-2:]
        offset = 0 if causal == binding.CAUSAL["top_left"] else nk - nq
        s = s.masked_fill(torch.arange(nk) > torch.arange(nq)[:, None] + offset, -math.inf)
    return torch.matmul(s.softmax(-1), v.float()).to(q.dtype), s.logsumexp(-1)


@stand_in.register_fake
def _(q, k, v, scale, causal=0):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashladder_test::zeros", mutates_args=())
def zeros_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Another stand-in, wrong on purpose: shows which op a compiled model calls."""
    return torch.zeros_like(q), q.new_zeros(q.shape[:3], dtype=torch.float32)


@zeros_op.register_fake
def _(q, k, v, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def stand_in_attention(q, k, v, scale, causal=False):
    """The router's attention function: (q, k, v, scale, causal=False | "top_left" | "bottom_right") -> o."""
    return stand_in(q, k, v, scale, binding.check_causal("stand_in", causal, FEATURES))[0]


def zeros_attention(q, k, v, scale, causal=False):
    return zeros_op(q, k, v, scale)[0]


CPU_LIMITS = binding.SdpaLimits("cpu_stand_in", seqlen_multiple=(1, 1), devices=("cpu",))
CPU_CAUSAL_LIMITS = CPU_LIMITS._replace(step="cpu_causal_stand_in", features=FEATURES)


def router(strict=False, attention=stand_in_attention, limits=CPU_LIMITS):
    return binding.SdpaRouter(attention, limits, strict, name="stand_in.sdpa")


def cpu_qkv(b=1, h=2, n=40, nk=None, dtype=BF16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    return tuple(torch.randn(b, h, m, 128, generator=gen).to(dtype) for m in (n, nk, nk))


def reference(q, k, v, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return stand_in(q, k, v, scale)[0]


def stack_depth() -> int:
    return torch._C._len_torch_function_stack()


def test_a_routed_call_runs_the_op_and_returns_o():
    q, k, v = cpu_qkv(nk=24)
    with router() as r:
        before = CALLS["stand_in"]
        o = F.scaled_dot_product_attention(q, k, v)
        assert CALLS["stand_in"] == before + 1, "the routed call did not reach the op"
    assert r.routed == 1 and not r.fallbacks
    assert o.shape == q.shape and o.dtype == BF16
    assert torch.equal(o, reference(q, k, v))


def test_the_scale_goes_to_the_op():
    q, k, v = cpu_qkv()
    with router() as r:
        o_kw = F.scaled_dot_product_attention(q, k, v, scale=0.3)
        o_pos = F.scaled_dot_product_attention(q, k, v, None, 0.0, False, scale=0.3)
        o_default = F.scaled_dot_product_attention(q, k, v)
    assert r.routed == 3
    assert torch.equal(o_kw, reference(q, k, v, 0.3)) and torch.equal(o_pos, o_kw)
    assert torch.equal(o_default, reference(q, k, v, 1 / math.sqrt(128))) and not torch.equal(o_default, o_kw)


def test_a_call_that_falls_back_is_torch_s_own():
    q, k, v = cpu_qkv()
    mask = torch.zeros(40, 40, dtype=BF16)
    want = [F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            F.scaled_dot_product_attention(q, k, v, is_causal=True)]
    before = CALLS["stand_in"]
    with router() as r:
        got = [F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
               F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
               F.scaled_dot_product_attention(q, k, v, is_causal=True)]
    assert CALLS["stand_in"] == before, "a call that falls back reached the op"
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert r.routed == 0 and r.fallbacks == collections.Counter({
        "q has dtype torch.float32; this step computes in torch.bfloat16 only": 1,
        "attn_mask is given: the step takes no mask": 1,
        "is_causal=True: the step is non-causal": 1})


def test_a_causal_call_reaches_the_attention_function_with_its_alignment():
    """A router of a step with causal masks and grouped heads: is_causal=True and causal_upper_left give the attention
    function causal="top_left", causal_lower_right "bottom_right", any other call causal=False; each output is what
    torch computes for the call (in float64), and the two corners differ where seqlen_q != seqlen_k."""
    q, k, v = cpu_qkv(n=24, nk=40)
    got = []

    def attention(q, k, v, scale, causal=False):
        got.append(causal)
        return stand_in_attention(q, k, v, scale, causal)
    calls = [({}, False), ({"is_causal": True}, "top_left"), ({"attn_mask": causal_upper_left(24, 40)}, "top_left"),
             ({"attn_mask": causal_lower_right(24, 40)}, "bottom_right"), ({"is_causal": False}, False)]
    with router(attention=attention, limits=CPU_CAUSAL_LIMITS) as r:
        outs = [F.scaled_dot_product_attention(q, k, v, **kwargs) for kwargs, _ in calls]
    assert got == [alignment for _, alignment in calls] and r.routed == len(calls) and not r.fallbacks, (got, r.fallbacks)
    for (kwargs, _), o in zip(calls, outs):
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)
        assert torch.allclose(o.double(), want, atol=1e-2, rtol=1e-2), (kwargs, (o.double() - want).abs().max())
    assert not torch.allclose(outs[1], outs[3], atol=1e-2), "top left and bottom right gave the same output"


def test_a_grouped_heads_call_reaches_the_attention_function():
    """enable_gqa with 4 query heads and 2 (or 1) key/value heads, causal or not: routed as it is (no repeated heads),
    and the output is torch's."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 24, 128, generator=gen).to(BF16)
    kvs = {heads_k: tuple(torch.randn(2, heads_k, 40, 128, generator=gen).to(BF16) for _ in range(2)) for heads_k in (2, 1)}
    calls = [(heads_k, kwargs) for heads_k in kvs for kwargs in ({}, {"is_causal": True},
                                                                 {"attn_mask": causal_lower_right(24, 40)})]
    with router(limits=CPU_CAUSAL_LIMITS) as r:
        outs = [F.scaled_dot_product_attention(q, *kvs[heads_k], enable_gqa=True, **kwargs) for heads_k, kwargs in calls]
        # without enable_gqa, torch broadcasts one key/value head: its own call
        broadcast = F.scaled_dot_product_attention(q, *kvs[1])
    assert r.routed == len(calls) and r.fallbacks == collections.Counter({
        "4 query heads and 1 key/value heads without enable_gqa (torch broadcasts a single key/value head and refuses "
        "other counts; the step leaves it to torch)": 1})
    for (heads_k, kwargs), o in zip(calls, outs):
        k, v = kvs[heads_k]
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True, **kwargs)
        assert torch.allclose(o.double(), want, atol=1e-2, rtol=1e-2), (heads_k, kwargs)
    assert torch.equal(broadcast, F.scaled_dot_product_attention(q, *kvs[1]))


def test_a_causal_call_falls_back_from_a_step_without_causal_masks():
    q, k, v = cpu_qkv(n=24, nk=40)
    with router() as r:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(24, 40))
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(24, 40)))
    assert r.routed == 0 and r.fallbacks == collections.Counter(
        {"attn_mask is a causal bias (bottom_right): the step is non-causal": 1})


def test_calls_are_caught_however_sdpa_was_imported():
    from torch.nn.functional import scaled_dot_product_attention as imported_early
    q, k, v = cpu_qkv()
    with router() as r:
        imported_early(q, k, v)
        torch._C._nn.scaled_dot_product_attention(q, k, v)
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert r.routed == 3


def test_counts_and_repr():
    q, k, v = cpu_qkv()
    with router() as r:
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert r.routed == 3 and r.fallbacks == collections.Counter({"dropout_p=0.5: the step has no dropout": 2})
    assert repr(r) == "<stand_in.sdpa(strict=False): 3 routed, 2 fell back>"


def test_strict_raises_naming_the_reason_in_one_line_and_routes_the_rest():
    q, k, v = cpu_qkv()
    with router(strict=True) as r:
        o = F.scaled_dot_product_attention(q, k, v)
        with pytest.raises(binding.NotRouted) as e:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert str(e.value) == ("stand_in.sdpa(strict=True): a scaled_dot_product_attention call would fall back to torch: "
                            "is_causal=True: the step is non-causal")
    assert torch.equal(o, reference(q, k, v)) and r.routed == 1 and sum(r.fallbacks.values()) == 1


def test_nested_routers_the_inner_decides_first():
    """An inner router for seqlens of multiples of 64 only, in an outer one that takes any: a call of 40 queries falls
    back from the inner to the outer, which routes it; a call of 64 the inner routes itself."""
    inner_limits = CPU_LIMITS._replace(step="inner", seqlen_multiple=(64, 64))
    with router() as outer, router(limits=inner_limits) as inner:
        F.scaled_dot_product_attention(*cpu_qkv(n=40))
        F.scaled_dot_product_attention(*cpu_qkv(n=64))
    assert inner.routed == 1 and inner.fallbacks == collections.Counter(
        {"q seqlen 40 is not supported: this step needs a multiple of 64": 1})
    assert outer.routed == 1 and not outer.fallbacks


def test_nested_routers_of_one_kind_the_innermost_counts():
    q, k, v = cpu_qkv()
    with router() as outer:
        with router() as inner:
            F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert inner.routed == 1 and not inner.fallbacks
    assert outer.routed == 0 and sum(outer.fallbacks.values()) == 1


def test_a_router_is_off_after_its_with_and_after_an_exception():
    q, k, v = cpu_qkv()
    depth = stack_depth()
    with router() as r:
        assert stack_depth() == depth + 1
        F.scaled_dot_product_attention(q, k, v)
    assert stack_depth() == depth
    F.scaled_dot_product_attention(q, k, v)
    assert r.routed == 1, "a call after the with was routed"
    with pytest.raises(ZeroDivisionError):
        with router() as r2:
            F.scaled_dot_product_attention(q, k, v)
            1 / 0
    assert stack_depth() == depth and not binding.router._active_routers()
    F.scaled_dot_product_attention(q, k, v)
    assert r2.routed == 1


def test_importing_a_step_activates_nothing_and_its_router_falls_back_on_cpu(mod):
    assert stack_depth() == 0, "importing a step left a torch function mode active"
    q, k, v = cpu_qkv(n=mod.info["seqlen_multiple_q"] * mod.info["seqlen_multiple_k"])
    with mod.sdpa() as r:
        o = F.scaled_dot_product_attention(q, k, v)
    assert isinstance(r, mod._binding.SdpaRouter) and r.name == f"{mod.__name__}.sdpa" and not r.strict
    assert torch.equal(o, F.scaled_dot_product_attention(q, k, v))
    assert r.routed == 0 and r.fallbacks == collections.Counter({"the tensors are on cpu; the step runs on cuda tensors": 1})
    assert mod.sdpa(strict=True).strict


def portable(mod) -> bool:
    return steps_mod.build_step.targets_of(steps_mod.step_dir(mod.info["step"])).name == "sm80_and_later"


@pytest.mark.parametrize("gpu", [H200, RTX_4090], ids=["h200", "rtx4090"])
def test_a_step_takes_fake_cuda_tensors_on_a_gpu_it_runs_on(mod, monkeypatch, gpu):
    """The step's own op behind its router, on fake CUDA tensors (no GPU needed): on a faked H200 every step routes
    (its op's fake implementation gives O); on a faked RTX 4090 steps 01-07 route and the Hopper steps fall back,
    saying why."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(mod._binding.checks, "device_props", lambda index: gpu)
    n = math.lcm(mod.info["seqlen_multiple_q"], mod.info["seqlen_multiple_k"], 64)
    with FakeTensorMode():
        q = torch.empty(1, 2, n, 128, dtype=BF16, device="cuda")
        with mod.sdpa() as r:
            o = F.scaled_dot_product_attention(q, q, q)
    assert o.shape == q.shape and o.dtype == BF16
    if gpu is H200 or portable(mod):
        assert r.routed == 1 and not r.fallbacks, r.fallbacks
    else:
        assert r.routed == 0 and list(r.fallbacks) == [
            "needs an sm_90 GPU (H100/H200; built for sm_90a alone), but cuda:0 is NVIDIA GeForce RTX 4090 (pretend) (sm_89)"]


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
def test_a_step_s_router_takes_causal_and_grouped_calls_where_the_step_does(mod, monkeypatch):
    """On fake CUDA tensors (a faked H200): is_causal=True, torch's causal bias and enable_gqa with fewer key/value heads
    go to a step with info["causal"] and info["gqa"] (its op's fake implementation, causal code and all), and fall back
    from the others, saying why."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(mod._binding.checks, "device_props", lambda index: H200)
    n = math.lcm(mod.info["seqlen_multiple_q"], mod.info["seqlen_multiple_k"], 64)
    bias = causal_lower_right(n, n)  # made outside the fake mode (a tensor subclass of its own)
    with FakeTensorMode():
        q = torch.empty(1, 4, n, 128, dtype=BF16, device="cuda")
        kv = torch.empty(1, 2, n, 128, dtype=BF16, device="cuda")
        with mod.sdpa() as r:
            outs = [F.scaled_dot_product_attention(q, q, q, is_causal=True),
                    F.scaled_dot_product_attention(q, q, q, attn_mask=bias),
                    F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True),
                    F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True, is_causal=True)]
    assert all(o.shape == q.shape and o.dtype == BF16 for o in outs)
    causal, gqa = mod.info["causal"], mod.info["gqa"]
    assert r.routed == int(causal) * 2 + int(gqa) + int(causal and gqa), (mod.info["step"], r.fallbacks)
    expected = collections.Counter()
    if not causal:
        expected["is_causal=True: the step is non-causal"] += 2
        expected["attn_mask is a causal bias (bottom_right): the step is non-causal"] += 1
    if not gqa:
        expected["enable_gqa with 4 query heads and 2 key/value heads: the step needs as many key/value heads as query "
                 "heads"] += 1 + int(causal)
    assert r.fallbacks == expected, r.fallbacks


# ---------------------------------------------------------------- under torch.compile (CPU: aot_eager)

class TwoAttentions(torch.nn.Module):
    """Self-attention of bf16 heads of 128 (routes), then one in float32 (falls back), over a projection."""

    def __init__(self, heads=2, scale=0.1):
        super().__init__()
        self.heads, self.scale = heads, scale
        self.qkv = torch.nn.Linear(heads * 128, 3 * heads * 128, dtype=BF16)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, 128)).unbind(2)  # [batch, seqlen, heads, 128] views
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        o32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        return (o.float() + o32).transpose(1, 2).flatten(2)


@pytest.fixture
def fresh_compile():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def recording_backend(graphs):
    """aot_eager, keeping each graph dynamo hands it (to see which ops the compiled code calls)."""
    from torch._dynamo.backends.registry import lookup_backend
    aot_eager = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)
    return backend


def test_under_torch_compile_the_decisions_are_traced_once(fresh_compile):
    torch.manual_seed(0)
    model = TwoAttentions()
    x = torch.randn(1, 40, 256, dtype=BF16)
    with torch.no_grad():
        with router() as r_eager:
            want = model(x)
        graphs = []
        compiled = torch.compile(model, backend=recording_backend(graphs), fullgraph=True)
        with router() as r1:
            got = compiled(x)
        assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), (got - want).abs().max()
        assert r_eager.routed == r1.routed == 1 and r_eager.fallbacks == r1.fallbacks and sum(r1.fallbacks.values()) == 1
        assert len(graphs) == 1 and "flashladder_test.attention" in str(graphs[0].graph), graphs[0].graph
        # a new router of the same kind runs the compiled code as it is: nothing recompiles, nothing is decided again
        with router() as r2:
            again = compiled(x)
        assert len(graphs) == 1, "a new router of the same kind recompiled the model"
        assert torch.equal(again, got) and r2.routed == 0 and not r2.fallbacks
        # another attention function is another router: the model recompiles, and calls that one
        with router(attention=zeros_attention) as r3:
            other = compiled(x)
        assert len(graphs) == 2 and r3.routed == 1 and not torch.equal(other, got)
        # and without a router, the model's SDPA calls go to torch again
        plain = compiled(x)
        assert len(graphs) == 3 and "flashladder_test" not in str(graphs[2].graph)
        assert torch.allclose(plain, model(x), atol=1e-2, rtol=1e-2)


def test_dynamic_shapes_are_made_static_for_the_decision(fresh_compile):
    """torch.compile(dynamic=True): the sizes (and the scale, a float it need not specialize) are symbolic while it
    traces; the router makes them concrete (guards), so each seqlen is decided, and compiled, for itself. (Making the
    float concrete restarts the first trace, which then counts its calls twice: the counts of the traced calls.)"""
    torch.manual_seed(0)
    model = TwoAttentions(scale=0.07)
    graphs = []
    compiled = torch.compile(model, backend=recording_backend(graphs), fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n in (40, 56, 72):
            x = torch.randn(1, n, 256, dtype=BF16)
            with router() as r:
                got = compiled(x)
            with router():
                want = model(x)
            assert r.routed >= 1 and list(r.fallbacks) == [
                "q has dtype torch.float32; this step computes in torch.bfloat16 only"], (n, r)
            assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), n
    assert len(graphs) >= 3  # one for each seqlen at least (the specialized float may add one)


def test_a_causal_call_under_torch_compile(fresh_compile):
    """is_causal=True (and grouped heads) in a compiled function: traced once, into the stand-in op with its causal
    argument, and the same output as eager."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 24, 128, generator=gen).to(BF16)
    k, v = (torch.randn(1, 2, 40, 128, generator=gen).to(BF16) for _ in range(2))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2
    with router(limits=CPU_CAUSAL_LIMITS) as r_eager:
        want = f(q, k, v)
    graphs = []
    with router(limits=CPU_CAUSAL_LIMITS) as r:
        got = torch.compile(f, backend=recording_backend(graphs), fullgraph=True)(q, k, v)
    assert r_eager.routed == r.routed == 1 and not r.fallbacks
    assert len(graphs) == 1 and "flashladder_test.attention" in str(graphs[0].graph), graphs[0].graph
    assert torch.equal(got, want)


def test_strict_under_torch_compile_raises_while_tracing(fresh_compile):
    """Even around a model compiled under a router that falls back: a strict one is another kind, and recompiles."""
    model = TwoAttentions()
    x = torch.randn(1, 40, 256, dtype=BF16)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), router() as r:
        compiled(x)
    assert sum(r.fallbacks.values()) == 1
    with torch.no_grad(), pytest.raises(Exception) as e:
        with router(strict=True):
            compiled(x)
    assert ("stand_in.sdpa(strict=True): a scaled_dot_product_attention call would fall back to torch: q has dtype "
            "torch.float32; this step computes in torch.bfloat16 only") in str(e.value), str(e.value)


def test_a_step_s_own_op_under_torch_compile_on_meta_tensors(mod, fresh_compile):
    """The step's op in a compiled graph (fullgraph), traced and run on meta tensors: its router told that meta tensors
    are what it takes, the step's limits otherwise."""
    plain = mod.sdpa()
    meta_router = mod._binding.SdpaRouter(plain.attention, plain.limits._replace(devices=("meta",)), True, name="meta.sdpa")
    n = math.lcm(mod.info["seqlen_multiple_q"], mod.info["seqlen_multiple_k"], 64)
    with torch.device("meta"):
        model = TwoAttentions()
        x = torch.empty(1, n, 256, dtype=BF16)
    graphs = []
    with torch.no_grad(), mod._binding.SdpaRouter(plain.attention, meta_router.limits, False, name="meta.sdpa") as r:
        out = torch.compile(model, backend=recording_backend(graphs), fullgraph=True)(x)
    assert out.shape == (1, n, 256) and out.device.type == "meta"
    assert r.routed == 1 and sum(r.fallbacks.values()) == 1
    assert len(graphs) == 1 and f"flashladder.{mod.info['step']}" in str(graphs[0].graph), graphs[0].graph
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="q has dtype torch.float32"):
        with meta_router:  # strict: the float32 attention cannot go to the step
            torch.compile(model, backend="aot_eager", fullgraph=True)(x)


# ---------------------------------------------------------------- GPU: a small DiT, routed to the step

class TinyDiT(torch.nn.Module):
    """A few DiT-like blocks (bf16, heads of 128): self-attention over the tokens, cross-attention to a context, an MLP,
    in the layout diffusers' models pass to SDPA ([batch, seqlen, heads, 128] views)."""

    def __init__(self, blocks=2, heads=2, context_dim=64):
        super().__init__()
        dim = heads * 128
        self.heads = heads
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "qkv": torch.nn.Linear(dim, 3 * dim), "q": torch.nn.Linear(dim, dim), "kv": torch.nn.Linear(context_dim, 2 * dim),
            "out1": torch.nn.Linear(dim, dim), "out2": torch.nn.Linear(dim, dim),
            "norm": torch.nn.LayerNorm(dim), "mlp": torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                                                        torch.nn.Linear(2 * dim, dim)),
        }) for _ in range(blocks))

    def split_heads(self, t, parts):
        """[batch, seqlen, parts * heads * 128] -> `parts` views [batch, heads, seqlen, 128]."""
        return [p.transpose(1, 2) for p in t.unflatten(-1, (parts, self.heads, 128)).unbind(2)]

    def forward(self, x, context):
        for b in self.blocks:
            q, k, v = self.split_heads(b["qkv"](b["norm"](x)), 3)
            x = x + b["out1"](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
            (q,), (k, v) = self.split_heads(b["q"](x), 1), self.split_heads(b["kv"](context), 2)
            x = x + b["out2"](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
            x = x + b["mlp"](x)
        return x


def dit_inputs(mod, seed=0):
    """Tokens and context lengths the step takes: ragged where it takes any seqlen, else multiples of its own."""
    mq, mk = mod.info["seqlen_multiple_q"], mod.info["seqlen_multiple_k"]
    n, ctx = (1000, 77) if mq == mk == 1 else (8 * math.lcm(mq, mk), 2 * mk)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, 256, generator=gen).to("cuda", BF16)
    context = torch.randn(1, ctx, 64, generator=gen).to("cuda", BF16)
    return x, context


def tiny_dit():
    torch.manual_seed(0)
    return TinyDiT().to("cuda", BF16).eval().requires_grad_(False)


class Recorder(torch.overrides.TorchFunctionMode):
    """Innermost: sees each SDPA call first, passes it on (to the router), keeps its inputs and output."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            self.calls.append((args, kwargs, out))
        return out


@needs_gpu
def test_routed_calls_in_a_dit_are_within_the_step_s_bounds(mod):
    from verify.checks import errors_of, prepare, replay
    model, (x, context) = tiny_dit(), dit_inputs(mod)
    with torch.no_grad(), mod.sdpa(strict=True) as r, Recorder() as rec:
        model(x, context)
    assert r.routed == len(rec.calls) == 4 and not r.fallbacks
    for i, (args, kwargs, o) in enumerate(rec.calls):
        q, k, v = args[:3]
        case = prepare(q, k, v)
        err = errors_of(case, o, torch.from_numpy(case.lse_ref))  # O judged; the drop-in returns no LSE
        assert not err.failures(), f"call {i} ({tuple(q.shape)} x {tuple(k.shape)}): {'; '.join(err.failures())}; {replay()}"


@needs_gpu
def test_a_compiled_dit_routes_every_call(mod, fresh_compile):
    model, (x, context) = tiny_dit(), dit_inputs(mod)
    with torch.no_grad():
        with mod.sdpa(strict=True) as r_eager:
            want = model(x, context)
        with mod.sdpa(strict=True) as r:
            got = torch.compile(model, fullgraph=True)(x, context)
    assert r.routed == r_eager.routed == 4 and not r.fallbacks
    a, b = got.double().flatten(), want.double().flatten()
    rel, cos = float((a - b).norm() / b.norm()), float(F.cosine_similarity(a, b, dim=0))
    # inductor fuses the rest of the block (norms, GELU, residuals) otherwise than eager: close, not bitwise
    assert rel < 2e-2 and cos > 0.9998, f"compiled against eager, both routed: relative error {rel:.3g}, cosine {cos:.6f}"


@needs_gpu
def test_a_dit_in_a_cuda_graph_routes_every_call(mod):
    model, (x, context) = tiny_dit(), dit_inputs(mod)
    static_x, static_ctx = x.clone(), context.clone()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), mod.sdpa(strict=True):
            model(static_x, static_ctx)  # warm-up on a side stream, as CUDA-graph capture asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with mod.sdpa(strict=True) as r, torch.cuda.graph(graph):
            static_out = model(static_x, static_ctx)
        assert r.routed == 4 and not r.fallbacks
        x2, ctx2 = dit_inputs(mod, seed=1)
        static_x.copy_(x2)
        static_ctx.copy_(ctx2)
        graph.replay()
        with mod.sdpa(strict=True):
            want, first = model(x2, ctx2), model(x, context)
        torch.cuda.synchronize()
    a, b = static_out.double(), want.double()
    rel = float((a - b).norm() / b.norm())  # the same kernels on the same inputs (cuBLAS may pick other algorithms)
    assert rel < 1e-3, f"the graph's replay against the same model run eagerly with the router: relative error {rel:.3g}"
    assert not torch.equal(static_out, first), "the replay did not compute on the new inputs"


@needs_gpu
@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
def test_routed_causal_and_grouped_calls_are_within_the_step_s_bounds(mod):
    """is_causal=True, torch's two causal biases and enable_gqa (8 query heads, 2 key/value heads), through the step's
    own router: each call routed, its O within the step's bounds for that mask (verify/checks.py)."""
    if not (mod.info["causal"] and mod.info["gqa"]):
        pytest.skip(f"{mod.info['step']} takes no causal masks or grouped heads: its router falls back (CPU tests say why)")
    from verify.checks import errors_of, make_inputs, prepare, replay
    for nq, nk in ((300, 1000), (1000, 300)):
        q, k, v = make_inputs(2, 8, nq, nk, heads_k=2)
        calls = [({"is_causal": True}, "top_left"), ({"attn_mask": causal_upper_left(nq, nk)}, "top_left"),
                 ({"attn_mask": causal_lower_right(nq, nk)}, "bottom_right"), ({}, False)]
        with torch.no_grad(), mod.sdpa(strict=True) as r:
            outs = [F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs) for kwargs, _ in calls]
        assert r.routed == len(calls) and not r.fallbacks
        for (kwargs, causal), o in zip(calls, outs):
            case = prepare(q, k, v, causal=causal)
            err = errors_of(case, o, torch.from_numpy(case.lse_ref))  # O judged; the drop-in returns no LSE
            assert not err.failures(), f"{nq}x{nk} {kwargs}: {'; '.join(err.failures())}; {replay()}"


def plain_attention(q, k, v, scale, causal=False):
    """Attention in torch's own ops, differentiable: a stand-in for a step with a backward."""
    return torch.matmul((torch.matmul(q, k.transpose(-1, -2)) * scale).softmax(-1), v)


def test_inside_activation_checkpointing_a_call_that_needs_gradients_stays_with_torch():
    """Non-reentrant checkpointing runs the region's forward again in the backward, where no torch function mode is
    active: a call the router took in the forward would meet torch's SDPA in the recompute (CheckpointError). So the
    router leaves it to torch there, saying why (strict: raises); outside checkpointing it takes the same call."""
    from torch.utils.checkpoint import checkpoint
    limits = CPU_LIMITS._replace(step="cpu_backward_stand_in", backward=True)
    q, k, v = (t.requires_grad_() for t in cpu_qkv(n=16))

    def block(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)
    with router(attention=plain_attention, limits=limits) as plain:
        block(q, k, v).sum().backward()
    assert plain.routed == 1 and not plain.fallbacks
    with router(attention=plain_attention, limits=limits) as r:
        checkpoint(block, q, k, v, use_reentrant=False).sum().backward()
    assert r.routed == 0 and list(r.fallbacks) == [binding.CHECKPOINTED]
    with router(strict=True, attention=plain_attention, limits=limits), pytest.raises(binding.NotRouted) as e:
        checkpoint(block, q, k, v, use_reentrant=False)
    assert binding.CHECKPOINTED in str(e.value)
    # torch before 2.13 closes the checkpoint's saved-tensor hooks, when its region raises, only once the checkpoint's
    # frame goes, which the exception's traceback holds (here in a cycle with this frame): until then every autograd
    # graph saves its tensors through them, and the next test's backward met a CheckpointError (seen on torch 2.11).
    del e
    gc.collect()


def test_a_checkpoint_given_the_router_s_contexts_routes_its_recompute_too():
    """router.checkpoint (torch.utils.checkpoint with context_fn=router.checkpoint_contexts): the call that needs
    gradients is routed in the forward and again in the recompute, and the gradients are those of the same model
    without checkpointing; transformers' way (the context_fn in checkpoint's kwargs) does the same. Without the
    contexts the router still leaves the call to torch (the test above)."""
    from torch.utils.checkpoint import checkpoint
    limits = CPU_LIMITS._replace(step="cpu_backward_stand_in", backward=True)
    ran = []

    def counted(q, k, v, scale, causal=False):
        ran.append(torch.is_grad_enabled())
        return plain_attention(q, k, v, scale, causal)
    q, k, v = cpu_qkv(n=16)

    def block(q, k, v):
        return F.scaled_dot_product_attention(q, k, v) * 2

    def grads(run):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        run(*leaves).float().square().sum().backward()
        return [t.grad for t in leaves]
    with router(attention=counted, limits=limits) as plain:
        want = grads(block)
    assert plain.routed == 1 and ran == [True]
    for how in ("router.checkpoint", "context_fn"):
        ran.clear()
        with router(attention=counted, limits=limits) as r:
            got = grads((lambda *a: r.checkpoint(block, *a)) if how == "router.checkpoint" else
                        (lambda *a: checkpoint(block, *a, use_reentrant=False, context_fn=r.checkpoint_contexts)))
        assert (r.routed, r.recomputed, dict(r.fallbacks)) == (1, 1, {}), (how, r)
        assert ran == [True, True], how  # the forward, then the recompute, both through the step
        assert all(torch.equal(a, b) for a, b in zip(got, want)), how
    with router(strict=True, attention=counted, limits=limits) as r:  # strict: nothing falls back, nothing raises
        grads(lambda *a: r.checkpoint(block, *a))
    assert r.routed == r.recomputed == 1
    ran.clear()  # the contexts of a drop-in that is not active in the forward (set on a model once, run without it):
    stale = router(attention=counted, limits=limits)  # the forward goes to torch, and so does the recompute
    got = grads(lambda *a: stale.checkpoint(block, *a))
    assert ran == [] and stale.routed == stale.recomputed == 0
    torch_only = grads(lambda *a: checkpoint(block, *a, use_reentrant=False))
    assert all(torch.equal(a, b) for a, b in zip(got, torch_only))


@pytest.mark.parametrize("features, dtype, reason", [
    (FEATURES, torch.float16, "q has dtype torch.float16; this step computes in torch.bfloat16 only (fp16: step40 on)"),
    (FEATURES | binding.FEATURE_FP16, torch.float16, None),
    (FEATURES | binding.FEATURE_FP16, BF16, None),
    (FEATURES | binding.FEATURE_FP16, torch.float32,
     "q has dtype torch.float32; this step computes in torch.bfloat16 or torch.float16"),
], ids=["bf16-step-fp16", "fp16-step-fp16", "fp16-step-bf16", "fp16-step-fp32"])
def test_a_step_with_fp16_takes_fp16_calls(features, dtype, reason, on_h200):
    """FEATURE_FP16 (step40 on) routes fp16 calls, causal and grouped ones too; a step without it leaves them to torch,
    saying so; float32 stays with torch either way."""
    limits = CAUSAL_LIMITS._replace(features=features)
    for args, kwargs in ((qkv(dtype=dtype), {}), (qkv(dtype=dtype), {"is_causal": True}),
                         ((meta(1, 4, 128, 128, dtype=dtype), *qkv(dtype=dtype)[1:]), {"enable_gqa": True})):
        assert binding.route_reason(described(args, kwargs), limits, grad_enabled=False) == reason
    mixed = (meta(1, 2, 128, 128), meta(1, 2, 128, 128, dtype=torch.float16), meta(1, 2, 128, 128))
    assert binding.route_reason(described(mixed), CAUSAL_LIMITS._replace(features=FEATURES | binding.FEATURE_FP16),
                                grad_enabled=False) == ("q, k and v must share one dtype, got torch.bfloat16, "
                                                        "torch.float16 and torch.bfloat16")


@pytest.mark.parametrize("head_dims, bwd_head_dims, d, grad, reason", [
    ((128,), (128,), 64, False, "q has head dim 64 (shape (1, {h}, 128, 64)); this step takes 128 (64: step41 on)"),
    ((64, 128), (128,), 64, False, None),
    ((64, 128), (128,), 128, True, None),
    ((64, 128), (128,), 64, True, "gradients are needed at head dim 64: the step's backward takes 128 (run the model "
                                  "under torch.no_grad())"),
    ((64, 128), (64, 128), 64, True, None),
    ((64, 128), (128,), 96, True, "q has head dim 96 (shape (1, {h}, 128, 96)); this step takes 64 or 128"),
], ids=["step-128-call-64", "step-64-call-64", "step-64-grad-128", "step-64-grad-64", "bwd-64-grad-64", "call-96"])
def test_a_step_takes_the_head_dims_it_names(head_dims, bwd_head_dims, d, grad, reason, on_h200):
    """info["head_dims"] (step41 on: 64 and 128) routes calls of those head dims, causal and grouped ones too; those
    that need gradients only where the backward takes their head dim (info["backward_head_dims"]); the others stay
    with torch, saying why."""
    limits = CAUSAL_LIMITS._replace(features=FEATURES, backward=True, head_dims=head_dims, bwd_head_dims=bwd_head_dims)
    q, k, v = (meta(1, 2, 128, d, requires_grad=grad) for _ in range(3))
    grouped = meta(1, 4, 128, d, requires_grad=grad)
    for args, kwargs in (((q, k, v), {}), ((q, k, v), {"is_causal": True}), ((grouped, k, v), {"enable_gqa": True})):
        want = reason and reason.format(h=args[0].shape[1])
        assert binding.route_reason(described(args, kwargs), limits, grad_enabled=True) == want, (args[0].shape, kwargs)
    mixed = (meta(1, 2, 128, 64), meta(1, 2, 128, 64), meta(1, 2, 128, 128))
    assert binding.route_reason(described(mixed), limits, grad_enabled=False) == (
        "q, k and v must share one head dim, got shapes (1, 2, 128, 64), (1, 2, 128, 64) and (1, 2, 128, 128)"
        if 64 in head_dims else "q has head dim 64 (shape (1, 2, 128, 64)); this step takes 128 (64: step41 on)")
