"""Bad input raises a clear Python exception naming the problem, before any launch: every check of the binding
(common/binding/) is reached by a test here.

The metadata checks run on CPU tensors too (so CI without a GPU tests them), and on meta tensors (no memory
behind them) for sizes no GPU could hold; the alignment and overlap checks need a GPU. The GPU's own check (its
architecture against the step's library, its shared memory per block against the step's) runs on CPU with a faked
device: the binding's device-properties function replaced by one that plays an RTX 4090, a T4, an H200.
Causal masks and grouped key/value heads: a step without them (info["causal"], info["gqa"] False) refuses them in one
clear ValueError; a step with them takes them (meta tensors), and refuses heads that do not divide.
"""
import ctypes
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from verify import steps as steps_mod  # noqa: E402
from verify.tests.conftest import has_cuda_gpu, needs_gpu  # noqa: E402

DEV = "cuda" if has_cuda_gpu() else "cpu"  # metadata errors come before the device check
BF16 = torch.bfloat16


def seqlen(mod):
    """The shortest seqlen that fills whole tiles of this step, for both q and k/v."""
    return math.lcm(mod.info["tile_q"], mod.info["tile_k"])


def qkv(mod, b=1, h=2, n=None, d=128, dtype=BF16, device=DEV):
    n = seqlen(mod) if n is None else n
    return [torch.randn(b, h, n, d, device=device).to(dtype) for _ in range(3)]


def meta(shape, strides=None):
    """A bf16 tensor with no memory behind it: any size, any strides."""
    return torch.empty_strided(shape, strides or torch.empty(shape, device="meta").stride(), dtype=BF16, device="meta")


def expect(mod, match, q, k, v, exc=(ValueError, TypeError), **kw):
    with pytest.raises(exc, match=match):
        mod.attention(q, k, v, **kw)


def expect_out(mod, match, q, k, v, o, lse, exc=ValueError):
    with pytest.raises(exc, match=match):
        mod.attention_out(q, k, v, o, lse)


def test_dtype(mod):
    """bf16, and fp16 in the steps that take it (info["dtypes"], step40 on); anything else, or a mix, in one line."""
    if "float16" in mod.info["dtypes"]:
        q, k, v = qkv(mod, dtype=torch.float32)
        expect(mod, "q has dtype torch.float32; this step computes in torch.bfloat16 or torch.float16$", q, k, v,
               exc=TypeError)
        q, k, v = qkv(mod)
        expect(mod, "q, k and v must share one dtype, got torch.bfloat16, torch.float16 and torch.bfloat16", q, k.half(),
               v, exc=TypeError)
    else:
        q, k, v = qkv(mod, dtype=torch.float16)
        expect(mod, r"q has dtype torch.float16; this step computes in torch.bfloat16 only \(fp16: step40 on\)", q, k, v,
               exc=TypeError)
    q, k, v = qkv(mod)
    expect(mod, "v has dtype torch.float32", q, k, v.float(), exc=TypeError)


def test_head_dim(mod):
    """128, and 64 in the steps that take it (info["head_dims"], step41 on); another, or q, k and v apart, in one line."""
    if 64 in mod.info["head_dims"]:
        expect(mod, r"q has head dim 96 \(shape \(1, 2, \d+, 96\)\); this step takes 64 or 128$", *qkv(mod, d=96))
        q, k, v = qkv(mod)
        expect(mod, "q, k and v must share one head dim", q[..., :64], k[..., :64], v)
    else:
        expect(mod, r"q has head dim 64 \(shape \(1, 2, \d+, 64\)\); this step takes 128 \(64: step41 on\)$", *qkv(mod, d=64))


def test_rank(mod):
    q, k, v = qkv(mod)
    expect(mod, "must be 4-D", q[0], k, v)


def test_not_a_tensor(mod):
    q, k, v = qkv(mod)
    expect(mod, "k must be a torch.Tensor, got list", q, k.tolist(), v, exc=TypeError)
    with pytest.raises(TypeError, match="lse must be a torch.Tensor, got NoneType"):
        mod.attention_out(q, k, v, torch.empty_like(q), None)


def test_shape_mismatch(mod):
    q, k, v = qkv(mod)
    expect(mod, "k and v must have the same shape", q, k, v[:, :1])
    if mod.info["gqa"]:  # one key/value head of two query heads is multi-query attention; three do not divide two
        three = qkv(mod, h=3)
        expect(mod, "k/v's heads must divide q's", q, three[1], three[2])
        expect(mod, "must agree on batch", *qkv(mod, b=2)[:1], k, v)
    else:
        expect(mod, "agree on \\[batch, heads\\]", q, k[:, :1], v[:, :1])


# ---- causal masks and grouped key/value heads ----

NOT_A_CAUSAL = "causal=.*: give False, 'top_left' \\(SDPA's is_causal=True: row i sees keys 0..i\\) or 'bottom_right'"


@pytest.mark.parametrize("causal", [True, 1, 2, "causal", "TOP_LEFT", "lower_right", "upper_left", 0.0, torch.tensor(True)],
                         ids=repr)
def test_causal_must_be_false_or_an_alignment(mod, causal):
    """Every step, causal or not, says what `causal` takes (True is refused: which corner would it mean?)."""
    q, k, v = (meta(t.shape) for t in qkv(mod))
    with pytest.raises(ValueError, match=NOT_A_CAUSAL):
        mod.attention(q, k, v, causal=causal)
    with pytest.raises(ValueError, match=NOT_A_CAUSAL):
        mod.attention_out(q, k, v, torch.empty_like(q), torch.empty(q.shape[:3], device="meta"), causal=causal)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_causal_masks_are_refused_by_a_step_without_them(mod, causal):
    q, k, v = qkv(mod)  # on DEV: the refusal comes before any device check
    if mod.info["causal"]:
        o, lse = mod.attention(*(meta(t.shape) for t in (q, k, v)), causal=causal)
        assert o.shape == q.shape and lse.shape == q.shape[:3]
        return
    expect(mod, f"flashladder.{mod.info['step']}: this step is non-causal \\(causal='{causal}'\\); causal masks come in step15",
           q, k, v, exc=ValueError, causal=causal)
    with pytest.raises(ValueError, match="this step is non-causal"):
        mod.attention_out(q, k, v, torch.empty_like(q), torch.empty(q.shape[:3], device=q.device), causal=causal)


@pytest.mark.parametrize("causal", [False, None])
def test_no_causal_mask_is_every_step_s(mod, causal):
    q, k, v = (meta(t.shape) for t in qkv(mod))
    o, lse = mod.attention(q, k, v, causal=causal)
    assert o.shape == q.shape and lse.shape == q.shape[:3]


def test_op_called_directly_checks_causal(mod):
    """torch.ops.flashladder.<step>(q, k, v, scale, causal): the op's own check of its integer (meta tensors: its fake)."""
    q, k, v = (meta(t.shape) for t in qkv(mod))
    op = getattr(torch.ops.flashladder, mod.info["step"])
    for code in (3, -1, 7):
        with pytest.raises(ValueError, match="the op takes 0 \\(none\\), 1 \\(top left\\) or 2 \\(bottom right\\)"):
            op(q, k, v, 0.1, code)
    o, lse = op(q, k, v, 0.1, 0)
    assert o.shape == q.shape
    for code in (1, 2):
        if mod.info["causal"]:
            assert op(q, k, v, 0.1, code)[0].shape == q.shape
        else:
            with pytest.raises(ValueError, match=f"this step is non-causal \\(causal={code}\\); causal masks come in step15"):
                op(q, k, v, 0.1, code)


@pytest.mark.parametrize("heads, heads_k", [(4, 2), (4, 1), (32, 8), (6, 3)])
def test_fewer_key_value_heads(mod, heads, heads_k):
    """GQA (a divisor of the query heads) and MQA (one): taken by a step with info["gqa"], refused in one line by the
    others (meta tensors: no GPU needed)."""
    n = seqlen(mod)
    q, kv = meta((2, heads, n, 128)), meta((2, heads_k, n, 128))
    if mod.info["gqa"]:
        o, lse = mod.attention(q, kv, kv)
        assert o.shape == q.shape and lse.shape == q.shape[:3]
        mod.attention_out(q, kv, kv, torch.empty_like(q), torch.empty(q.shape[:3], device="meta"))
        return
    match = (f"flashladder.{mod.info['step']}: q and k/v must agree on \\[batch, heads\\], got \\(2, {heads}, {n}, 128\\) and "
             f"\\(2, {heads_k}, {n}, 128\\) \\(fewer key/value heads than query heads: step15 takes them\\)")
    expect(mod, match, q, kv, kv, exc=ValueError)


@pytest.mark.parametrize("q_shape, kv_shape", [((1, 4, None, 128), (1, 3, None, 128)), ((1, 2, None, 128), (1, 4, None, 128)),
                                               ((2, 4, None, 128), (1, 2, None, 128)), ((1, 4, None, 128), (1, 0, None, 128))],
                         ids=["3-of-4", "more-kv-heads", "batch", "no-kv-heads"])
def test_key_value_heads_that_do_not_divide_are_refused(mod, q_shape, kv_shape):
    n = seqlen(mod)
    q, kv = meta(tuple(n if d is None else d for d in q_shape)), meta(tuple(n if d is None else d for d in kv_shape))
    match = "k/v's heads must divide q's" if mod.info["gqa"] else "must agree on \\[batch, heads\\]"
    expect(mod, match, q, kv, kv, exc=ValueError)


def test_seqlen_multiple(mod):
    mult_q, mult_k = mod.info["seqlen_multiple_q"], mod.info["seqlen_multiple_k"]
    if mult_q == mult_k == 1:
        pytest.skip("this step takes any seqlen (test_steps_gpu.py::test_any_seqlen)")
    n = seqlen(mod)
    q, k, v = qkv(mod, n=n + 1)
    expect(mod, f"q seqlen {n + 1} is not supported: this step needs a multiple of {mult_q}", q, k, v)
    q, k, v = qkv(mod, n=n)
    k, v = qkv(mod, n=n + mult_k // 2)[1:]  # q fine, k/v not
    expect(mod, f"k/v seqlen {n + mult_k // 2} is not supported: this step needs a multiple of {mult_k}", q, k, v)


def test_unsupported_strides(mod):
    q, k, v = qkv(mod)
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    expect(mod, "q has strides .*the last dim must be contiguous", q_t, k, v)
    n = seqlen(mod)
    huge = meta((1, 2, n, 128), (0, 0, 2**24, 1))
    expect(mod, "q has row stride 16777216", huge, k, v)
    # batch and head strides that are not multiples of 8 elements (16 bytes), on dims of size > 1
    two = meta((2, 2, n, 128))
    expect(mod, "k has strides .*multiples of 8", two, meta((2, 2, n, 128), (2 * 128 * n + 4, 128 * n, 128, 1)), two)
    expect(mod, "v has strides .*multiples of 8", q, k, meta((1, 2, n, 128), (2 * 128 * n, 128 * n + 4, 128, 1)))


def test_odd_strides_of_size_one_dims_are_valid(mod):
    """A (1, 2, n, 128) tensor with strides (1, 128 n, 128, 1) is valid: batch 1 is never stepped over."""
    n = seqlen(mod)
    q = meta((1, 2, n, 128), (1, 128 * n, 128, 1))
    o, lse = mod.attention(q, meta((1, 2, n, 128)), meta((1, 1, n, 128), (3, 5, 128, 1)).expand(1, 2, n, 128))
    assert o.shape == q.shape and lse.shape == q.shape[:3]


def test_bad_scale(mod):
    for scale in (math.nan, -0.1, 0.0, math.inf, -math.inf):
        expect(mod, "scale must be a finite positive float", *qkv(mod), scale=scale, exc=ValueError)
    for scale in (True, "0.1", torch.tensor(0.1)):
        expect(mod, "scale must be a finite positive float", *qkv(mod), scale=scale, exc=TypeError)
    expect(mod, "scale 1e\\+39 overflows float32", *qkv(mod), scale=1e39, exc=ValueError)
    expect(mod, "overflows float32", *qkv(mod), scale=10**400, exc=ValueError)
    expect(mod, "scale 1e-50 rounds to 0 in float32", *qkv(mod), scale=1e-50, exc=ValueError)


def test_grid_limits(mod):
    """Batch and heads are the grid's z and y: above 65535 a launch would fail; meta tensors cost no memory."""
    n = seqlen(mod)
    for shape in ((65536, 1, n, 128), (1, 65536, n, 128)):
        q = meta(shape)
        expect(mod, "too large: batch, heads <= 65535", q, q, q)
    long = n * -(-2**31 // (65535 * n))  # batch * heads * seqlen_q >= 2^31: the lse index would overflow int32
    q, kv = meta((1, 65535, long, 128)), meta((1, 65535, n, 128))
    expect(mod, "too large", q, kv, kv)


def test_too_long(mod):
    n = seqlen(mod)
    q = meta((1, 2, n, 128))
    k = meta((1, 2, 1, 128)).expand(1, 2, (2**31 // n + 1) * n, 128)  # no memory behind it
    expect(mod, "too large", q, k, k)


def test_cpu_tensors(mod):
    expect(mod, "q is on cpu; flashladder runs on a CUDA device", *qkv(mod, device="cpu"))


def test_out_buffers(mod):
    """attention_out's o and lse: shape, dtype, contiguity (device: test_out_buffer_on_another_device)."""
    q, k, v = qkv(mod)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    expect_out(mod, "o must be a contiguous tensor of q's dtype and shape", q, k, v, o[:, :1], lse)
    expect_out(mod, "o must be a contiguous tensor of q's dtype.*got torch.float16", q, k, v, o.half(), lse)
    expect_out(mod, "o must be a contiguous tensor of q's dtype.*strides", q, k, v,
               o.transpose(1, 2).contiguous().transpose(1, 2), lse)
    expect_out(mod, "lse must be a contiguous float32 tensor of shape", q, k, v, o, lse[..., :1])
    expect_out(mod, "lse must be a contiguous float32 tensor.*got torch.float64", q, k, v, o, lse.double())
    lse_strided = torch.empty(*q.shape[:2], 2 * q.shape[2], device=q.device)[..., ::2]
    expect_out(mod, "lse must be a contiguous float32 tensor.*strides", q, k, v, o, lse_strided)


def test_empty_and_keyless_inputs_pass_the_checks(mod):
    """Batch, heads or seqlen_q of 0, and seqlen_k of 0, are valid (meta tensors: the checks and output shapes;
    test_binding_edges.py runs them on the GPU)."""
    n = seqlen(mod)
    for q_shape, kv_shape in (((0, 2, n, 128), (0, 2, n, 128)), ((1, 0, n, 128), (1, 0, n, 128)),
                              ((1, 2, 0, 128), (1, 2, n, 128)), ((1, 2, n, 128), (1, 2, 0, 128))):
        o, lse = mod.attention(meta(q_shape), meta(kv_shape), meta(kv_shape))
        assert o.shape == q_shape and lse.shape == q_shape[:3]


@needs_gpu
def test_device_mismatch(mod):
    q, k, v = qkv(mod, device="cuda")
    expect(mod, "v is on cpu; flashladder runs on a CUDA device", q, k, v.cpu())
    # meta beside cuda: the op's fake implementation (meta tensors welcome) sees two devices
    expect(mod, "all tensors must be on one device: q is on meta, k on cuda:0", meta(tuple(q.shape)), k, v)


@needs_gpu
def test_out_buffer_on_another_device(mod):
    q, k, v = qkv(mod, device="cuda")
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    expect_out(mod, "o is on cpu", q, k, v, o.cpu(), lse)
    expect_out(mod, "lse is on cpu", q, k, v, o, lse.cpu())


@needs_gpu
def test_misaligned_pointer(mod):
    q, k, v = qkv(mod, device="cuda")
    flat = torch.empty(q.numel() + 8, dtype=BF16, device="cuda")
    q_odd = flat[1:1 + q.numel()].view(q.shape)  # 2-byte offset: rows no longer 16-byte aligned
    expect(mod, "q's data pointer is not 16-byte aligned", q_odd, k, v)
    o_odd = torch.empty(q.numel() + 8, dtype=BF16, device="cuda")[1:1 + q.numel()].view(q.shape)
    expect_out(mod, "o's data pointer is not 16-byte aligned", q, k, v, o_odd, torch.empty(q.shape[:3], device="cuda"))


# ---- the GPU's own check, on a faked device (CPU) ----

RTX_4090 = ("NVIDIA GeForce RTX 4090", 8, 9, 99 * 1024)  # sm_89; 99 KB of shared memory per block (opt-in)
TESLA_T4 = ("Tesla T4", 7, 5, 64 * 1024)                 # sm_75: Turing, before every step's targets
H200 = ("NVIDIA H200", 9, 0, 227 * 1024)


def fake_gpu(mod, monkeypatch, name, major, minor, smem_per_block_optin):
    """Replace the binding's device-properties function (its only source for the GPU's properties)."""
    device = mod._binding.Device(name, major, minor, smem_per_block_optin)
    monkeypatch.setattr(mod._binding.checks, "device_props", lambda index: device)
    return device


def call_on_cpu_past_the_metadata_checks(mod, monkeypatch):
    """The op's own launch path, with CPU tensors: the metadata checks (which refuse CPU tensors) waved through, so
    that the GPU check before the launch is what the call meets (device index 0)."""
    monkeypatch.setattr(mod._binding.checks, "check_inputs", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mod.attention(*qkv(mod, device="cpu"))


def check_gpu(mod):
    """The check the launch makes, alone: the step's architectures and shared memory against the (faked) GPU."""
    info = mod.info
    checks = mod._binding.checks
    checks.check_device(info["step"], info["archs"], info["smem_bytes"], checks.device_props(0), "cuda:0")


def portable(mod) -> bool:
    return steps_mod.build_step.targets_of(steps_mod.step_dir(mod.info["step"])).name == "sm80_and_later"


def test_an_rtx_4090_runs_steps_01_to_07_and_refuses_the_hopper_steps(mod, monkeypatch):
    """sm_89 with 99 KB per block: every step whose targets reach beyond Hopper runs (its shared memory fits: at
    most 96 KB); a step built for sm_90a alone is refused in one line that names sm_90a and the GPU's sm_89."""
    fake_gpu(mod, monkeypatch, *RTX_4090)
    if portable(mod):
        assert mod.info["smem_bytes"] <= RTX_4090[3], mod.info
        check_gpu(mod)  # accepted: no exception
        return
    with pytest.raises(RuntimeError) as e:
        call_on_cpu_past_the_metadata_checks(mod, monkeypatch)
    assert str(e.value) == (f"flashladder.{mod.info['step']}: needs an sm_90 GPU (H100/H200; built for sm_90a alone), "
                            "but cuda:0 is NVIDIA GeForce RTX 4090 (sm_89)"), str(e.value)


def test_a_gpu_older_than_every_target_is_refused_naming_both(mod, monkeypatch):
    fake_gpu(mod, monkeypatch, *TESLA_T4)
    with pytest.raises(RuntimeError) as e:
        call_on_cpu_past_the_metadata_checks(mod, monkeypatch)
    message = str(e.value)
    assert message.startswith(f"flashladder.{mod.info['step']}: needs ") and "\n" not in message, message
    assert "Tesla T4 (sm_75)" in message and all(a in message for a in mod.info["archs"]), message


def test_a_block_that_needs_more_shared_memory_than_the_gpu_offers_is_refused_in_one_line(mod, monkeypatch):
    """An sm_86 card that offered 48 KB per block (none does: Ampere's give 99 KB or more; it stands in for any GPU
    short of a step's need): a step that runs there but asks for more says so, naming both figures."""
    if not portable(mod):  # sm_90 GPUs all offer 227 KB per block: such a step does not say what it takes
        assert mod.info["smem_bytes"] is None, mod.info
        return
    fake_gpu(mod, monkeypatch, "NVIDIA RTX A2000 (48 KB, pretend)", 8, 6, 48 * 1024)
    need = mod.info["smem_bytes"]
    with pytest.raises(RuntimeError) as e:
        call_on_cpu_past_the_metadata_checks(mod, monkeypatch)
    assert str(e.value) == (f"flashladder.{mod.info['step']}: a block needs {need} bytes ({need / 1024:g} KB) of shared "
                            f"memory, but cuda:0 (NVIDIA RTX A2000 (48 KB, pretend), sm_86) offers 49152 bytes (48 KB) per block")
    # and on the RTX 4090, the step's architectures and a need of 100 KB: refused the same way
    device = fake_gpu(mod, monkeypatch, *RTX_4090)
    with pytest.raises(RuntimeError, match=r"a block needs 102400 bytes \(100 KB\) of shared memory, but cuda:0 \(NVIDIA "
                                           r"GeForce RTX 4090, sm_89\) offers 101376 bytes \(99 KB\) per block$"):
        mod._binding.check_device(mod.info["step"], mod.info["archs"], 100 * 1024, device, "cuda:0")


def test_an_h200_runs_every_step(mod, monkeypatch):
    fake_gpu(mod, monkeypatch, *H200)
    check_gpu(mod)


@needs_gpu
def test_wrong_gpu_architecture(mod, monkeypatch):
    """On the GPU: a real launch meets the same check (here the GPU plays a Turing card)."""
    fake_gpu(mod, monkeypatch, "Tesla T4 (pretend)", 7, 5, 64 * 1024)
    expect(mod, "needs .*, but cuda:0 is Tesla T4 \\(pretend\\) \\(sm_75\\)", *qkv(mod, device="cuda"), exc=RuntimeError)


@needs_gpu
def test_launcher_reports_launch_errors(mod):
    """A launch the GPU refuses (here an empty grid) comes back as an error code, never silently."""
    torch.zeros(1, device="cuda")  # make the primary context current
    lib = mod._binding.load_library(Path(mod.info["library"]))
    params = mod._binding.FwdParams(batch=1, heads=1, seqlen_q=0, seqlen_k=0, scale=1.0)
    err = lib.flashladder_fwd(ctypes.byref(params), None)
    assert err != 0, "an empty grid must be reported as a launch error"
    assert "invalid" in lib.flashladder_error_string(err).decode()


@needs_gpu
def test_binding_raises_on_a_failed_launch(mod, monkeypatch):
    """The binding turns the launcher's error code into an exception (here: params with an empty grid)."""
    binding = mod._binding
    real = binding.make_params

    def no_query_blocks(*args):
        params = real(*args)
        params.seqlen_q = 0
        return params
    monkeypatch.setattr(binding.abi, "make_params", no_query_blocks)
    expect(mod, "kernel launch failed: .*invalid.*\\(cudaError \\d+\\)", *qkv(mod, device="cuda"), exc=RuntimeError)


@needs_gpu
def test_output_overlapping_an_input(mod):
    q, k, v = qkv(mod, device="cuda")
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    expect_out(mod, "o overlaps q", q, k, v, q, lse)
    expect_out(mod, "o overlaps v", q, k, v, v, lse)
    expect_out(mod, "lse overlaps o", q, k, v, o, o.view(torch.float32).view(-1)[:lse.numel()].view(lse.shape))


@needs_gpu
def test_op_called_directly_checks_scale(mod):
    """torch.ops.flashladder.<step> skips the Python wrapper; the op itself still refuses a bad scale value
    (its schema turns True into 1.0 before the op sees it: the wrapper refuses True)."""
    q, k, v = qkv(mod, device="cuda")
    op = getattr(torch.ops.flashladder, mod.info["step"])
    with pytest.raises(ValueError, match="scale must be a finite positive float"):
        op(q, k, v, -1.0)
    with pytest.raises(ValueError, match="overflows float32"):
        op(q, k, v, 1e39)


def test_op_called_directly_checks_the_tensors(mod):
    """Without the wrapper, the op (eager: its real implementation; meta or under torch.compile: its fake one)
    checks the tensors the same way."""
    q, k, v = qkv(mod)
    op = getattr(torch.ops.flashladder, mod.info["step"])
    with pytest.raises(ValueError, match="head dim"):
        op(q, k, v[..., :64], 0.1)
    n = seqlen(mod)
    with pytest.raises(ValueError, match="too large"):
        op(meta((65536, 1, n, 128)), meta((65536, 1, n, 128)), meta((65536, 1, n, 128)), 0.1)


@pytest.mark.parametrize("layout", ["bnhd", "fused_qkv", "contiguous"])
def test_attention_returns_o_laid_out_as_q(mod, layout):
    """attention() allocates O in q's memory order (binding.output_like): from a [b, n, h, d] tensor transposed, or a slice
    of a fused [b, n, 3, h, d] one, O is [b, n, h, d] in memory, so a model's transpose back is a view; from a contiguous
    q, contiguous. Meta tensors: the op's fake, which torch.compile sees, allocates it the same way as the op."""
    n = seqlen(mod)
    if layout == "bnhd":
        q = torch.empty(2, n, 4, 128, dtype=BF16, device="meta").transpose(1, 2)
    elif layout == "fused_qkv":
        q = torch.empty(2, n, 3, 4, 128, dtype=BF16, device="meta")[:, :, 0].transpose(1, 2)
    else:
        q = meta((2, 4, n, 128))
    k = v = meta((2, 4, n, 128))
    o, lse = mod.attention(q, k, v)
    assert o.shape == q.shape and lse.is_contiguous()
    want = (4 * n * 128, 128, 4 * 128, 1) if layout != "contiguous" else (4 * n * 128, n * 128, 128, 1)
    assert o.stride() == want, (layout, o.stride())
    assert o.transpose(1, 2).is_contiguous() == (layout != "contiguous")
