"""The binding's edge cases (common/binding/): its guard of the C ABI, the strides it hands the kernel,
empty and keyless inputs, the alignment it asks of lse, one check per call, what it says at import on a machine
that cannot run a kernel; the causal and grouped-heads arguments (check_causal, check_causal_code, check_inputs'
features, make_params' heads_k, causal and causal_offset). CPU where it can be, else GPU."""
import ctypes
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from verify import steps as steps_mod  # noqa: E402
from verify.checks import make_inputs, replay  # noqa: E402
from verify.reference import attention_reference  # noqa: E402
from verify.tests.conftest import has_cuda_gpu, needs_gpu, selected_steps  # noqa: E402

BF16 = torch.bfloat16


def seqlen(mod):
    return math.lcm(mod.info["tile_q"], mod.info["tile_k"])


def meta(shape, strides=None):
    return torch.empty_strided(shape, strides or torch.empty(shape, device="meta").stride(), dtype=BF16, device="meta")


# ---------------------------------------------------------------- the ABI guard

def test_abi_version_mismatch_is_refused(mod, monkeypatch):
    abi = mod._binding.abi  # where load_library reads it
    monkeypatch.setattr(abi, "ABI_VERSION", abi.ABI_VERSION + 1)
    with pytest.raises(ImportError, match=f"built for ABI {abi.ABI_VERSION - 1}, this binding speaks {abi.ABI_VERSION}"):
        abi.load_library(Path(mod.info["library"]))


def test_params_mirror_mismatch_is_refused(mod, monkeypatch):
    """A ctypes mirror of FwdParams that disagrees with the library's struct (here: one field too many)."""
    binding = mod._binding

    class Mirror(ctypes.Structure):
        _fields_ = [*binding.FwdParams._fields_, ("extra", ctypes.c_int64)]
    monkeypatch.setattr(binding.abi, "FwdParams", Mirror)
    with pytest.raises(ImportError, match="sizeof\\(FwdParams\\) is .* the two disagree"):
        binding.load_library(Path(mod.info["library"]))


def test_missing_library_is_refused(mod, tmp_path):
    with pytest.raises(ImportError, match="_kernel.so is missing: build the step first"):
        mod._binding.load_library(tmp_path / "_kernel.so")


def test_kernel_library_links_no_torch(mod):
    """The binding talks to a plain C library: nothing in it depends on libtorch's C++ ABI."""
    deps = subprocess.run(["ldd", mod.info["library"]], capture_output=True, text=True).stdout
    assert deps and not any(lib in deps for lib in ("libtorch", "libc10")), deps


# ---------------------------------------------------------------- a machine that cannot run a kernel

def no_libcuda(name, *args, **kwargs):
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")


@pytest.mark.parametrize("cuda, libcuda, gpus, why", [
    (None, None, 0, "torch .* is a CPU build"),
    ("13.0", no_libcuda, 0, "no NVIDIA driver on this machine \\(libcuda.so.1 not found\\)"),
    ("13.0", lambda name: None, 0, "no CUDA GPU visible \\(CUDA_VISIBLE_DEVICES=''\\)"),
    ("13.0", lambda name: None, 1, None),
], ids=["cpu-torch", "no-driver", "no-gpu", "gpu"])
def test_no_cuda_reason_names_what_is_missing(built, monkeypatch, cuda, libcuda, gpus, why):
    binding = steps_mod.load(selected_steps()[0])._binding  # common/binding/, as a step has it: one step will do
    monkeypatch.setattr(torch.version, "cuda", cuda)
    if libcuda:
        monkeypatch.setattr(binding.checks.ctypes, "CDLL", libcuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = binding.no_cuda_reason()
    assert reason is None if why is None else re.fullmatch(why, reason), reason


def test_the_step_says_what_is_missing_before_torchs_own_error(built):
    """Importing a step where no kernel can run warns in one line; the first CUDA call then fails in torch, after it.
    CUDA_VISIBLE_DEVICES='' hides the GPU, so this also runs (and must pass) on the GPU machine."""
    step = selected_steps()[0]
    code = f"import torch\nfrom flashladder.{step} import attention\ntorch.zeros(1, device='cuda')\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=steps_mod.ROOT,
                         env={**os.environ, "PYTHONPATH": str(steps_mod.DEV), "CUDA_VISIBLE_DEVICES": ""})
    lines = res.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if f"UserWarning: flashladder.{step}: " in line]
    assert res.returncode != 0 and len(said) == 1 and "Traceback (most recent call last):" in lines, res.stderr
    runs_on = steps_mod.load(step)._binding.runs_on(steps_mod.targets(step).archs())  # the step's architectures
    assert lines[said[0]].startswith("<string>:2: ") and f"the kernel runs on {runs_on} " in lines[said[0]], res.stderr
    assert said[0] < lines.index("Traceback (most recent call last):"), res.stderr


# ---------------------------------------------------------------- which code a GPU runs

def test_device_props_read_the_shared_memory_from_the_driver_where_torch_does_not_say(monkeypatch):
    """torch's device properties give shared_memory_per_block_optin in recent versions; without it (an older torch
    >= 2.4), the driver's attribute 97 (cudaDevAttrMaxSharedMemoryPerBlockOptin), through libcuda."""
    import types

    import binding
    asked = []

    class FakeLibcuda:
        def cuDeviceGet(self, device, index):
            device._obj.value = 10 + index
            return 0

        def cuDeviceGetAttribute(self, value, attribute, device):
            asked.append((attribute, device.value))
            value._obj.value = 101376
            return 0
    old_torch = types.SimpleNamespace(name="NVIDIA GeForce RTX 4090", major=8, minor=9)
    monkeypatch.setattr(binding.checks.torch.cuda, "get_device_properties", lambda index: old_torch)
    monkeypatch.setattr(binding.checks.ctypes, "CDLL", lambda name: FakeLibcuda())
    binding.device_props.cache_clear()
    try:
        assert binding.device_props(1) == binding.Device("NVIDIA GeForce RTX 4090", 8, 9, 101376)
        assert asked == [(97, 11)]
        new_torch = types.SimpleNamespace(**vars(old_torch), shared_memory_per_block_optin=232448)
        monkeypatch.setattr(binding.checks.torch.cuda, "get_device_properties", lambda index: new_torch)
        binding.device_props.cache_clear()
        assert binding.device_props(0).smem_per_block_optin == 232448 and len(asked) == 1
    finally:
        binding.device_props.cache_clear()


PORTABLE = ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_120", "compute_80"]  # steps 01-07's targets


@pytest.mark.parametrize("archs, cc, code", [
    (PORTABLE, (8, 0), "sm_80"), (PORTABLE, (8, 6), "sm_86"), (PORTABLE, (8, 7), "sm_86"),  # Orin: Ampere's SASS
    (PORTABLE, (8, 9), "sm_89"), (PORTABLE, (9, 0), "sm_90a"), (PORTABLE, (12, 0), "sm_120"),
    (PORTABLE, (12, 1), "sm_120"), (PORTABLE, (10, 0), "compute_80"), (PORTABLE, (11, 0), "compute_80"),  # B200, Thor: JIT
    (PORTABLE, (7, 5), None),
    (["sm_90a"], (9, 0), "sm_90a"), (["sm_90a"], (8, 9), None), (["sm_90a"], (10, 0), None),  # 'a': its own GPU alone
    (["compute_80"], (9, 0), "compute_80"), (["compute_80"], (7, 5), None),  # the PTX-JIT build
    (["compute_90a"], (9, 0), "compute_90a"), (["compute_90a"], (10, 0), None),
    (["sm_80", "compute_80", "compute_86"], (8, 9), "sm_80"), (["compute_80", "compute_86"], (8, 9), "compute_86"),
])
def test_code_for_picks_what_the_driver_runs(archs, cc, code):
    """SASS of the GPU's major version and a minor one up to its own ('a': its own alone), the closest; else the
    newest PTX not newer than the GPU; else nothing."""
    import binding  # common/binding/, which every step's package carries as _binding
    assert binding.code_for(archs, *cc) == code


# ---------------------------------------------------------------- strides

def test_kernel_strides_of_size_one_dims(mod):
    """Strides of size-1 dims become the contiguous ones (multiples of 8: TMA needs 16-byte strides); the others,
    stride 0 of a broadcast included, go to FwdParams as they are."""
    binding, n = mod._binding, seqlen(mod)
    q = meta((1, 2, n, 128), (1, 128 * n, 128, 1))     # batch 1 with stride 1, as torch leaves it after a transpose
    k = meta((1, 1, n, 128), (3, 5, 128, 1)).expand(1, 2, n, 128)  # heads broadcast: stride 0
    v = meta((1, 2, n, 128), (2 * 128 * n, 128 * n, 128, 1))
    o = meta((1, 2, n, 128), (5, 128 * n, 128, 1))
    lse = torch.empty(1, 2, n, device="meta")
    params = binding.make_params(q, k, v, o, lse, 0.5)
    assert tuple(params.q_stride) == (2 * 128 * n, 128 * n, 128)
    assert tuple(params.k_stride) == (2 * 128 * n, 0, 128)
    assert tuple(params.v_stride) == v.stride()[:3]
    assert tuple(params.o_stride) == (2 * 128 * n, 128 * n, 128)
    assert binding.kernel_strides(meta((1, 2, 1, 128), (7, 128, 11, 1))) == (2 * 128, 128, 128)  # one row, too
    assert all(s % 8 == 0 for f in ("q_stride", "k_stride", "v_stride", "o_stride") for s in getattr(params, f))
    assert (params.batch, params.heads, params.seqlen_q, params.seqlen_k) == (1, 2, n, n)


# ---------------------------------------------------------------- causal masks and grouped heads

def test_a_step_s_features_are_its_library_s(mod):
    """info["causal"], info["gqa"] and info["dtypes"] are the bits of the library's flashladder_features; a library
    without that export (steps 01-14) takes none of them; fp16 comes in step40."""
    binding = mod._binding
    lib = binding.load_library(Path(mod.info["library"]))
    features = lib.flashladder_features() if hasattr(lib, "flashladder_features") else 0
    assert (mod.info["causal"], mod.info["gqa"]) == (bool(features & binding.FEATURE_CAUSAL), bool(features & binding.FEATURE_GQA))
    assert mod.info["dtypes"] == (["bfloat16", "float16"] if features & binding.FEATURE_FP16 else ["bfloat16"])
    assert mod.info["head_dims"] == list(binding.head_dims_of(lib))
    assert mod.info["backward_head_dims"] == (list(binding.head_dims_of(lib, backward=True)) if mod.info["backward"] else [])
    assert set(mod.info["head_dims"]) <= set(binding.HEAD_DIMS) and 128 in mod.info["head_dims"]
    assert (mod.sdpa().limits.head_dims, mod.sdpa().limits.bwd_head_dims) == (tuple(mod.info["head_dims"]),
                                                                             tuple(mod.info["backward_head_dims"]))
    if int(mod.info["step"][4:]) < 41:
        assert not hasattr(lib, "flashladder_head_dims") and mod.info["head_dims"] == [128]
    known = binding.FEATURE_CAUSAL | binding.FEATURE_GQA | binding.FEATURE_FP16
    assert features & ~known == 0, f"unknown feature bits {features:#x}"
    assert mod.sdpa().limits.features == features
    if int(mod.info["step"][4:]) < 15:
        assert features == 0 and not hasattr(lib, "flashladder_features"), mod.info["step"]
    assert bool(features & binding.FEATURE_FP16) == (int(mod.info["step"][4:]) >= 40), mod.info["step"]


def test_the_params_mirror_puts_the_new_fields_after_the_scale():
    """FwdParams' ABI-4 fields follow `scale` in the C struct's order, each an int32, ABI 5's workspace pointer
    follows them, 8-byte aligned as the C compiler puts it (the library checks the size only), then ABI 6's dtype and
    ABI 7's head_dim and head_dim_v, int32s, come last (in BwdParams too)."""
    import binding
    names = [name for name, _ in binding.FwdParams._fields_]
    assert names[-8:] == ["scale", "heads_k", "causal", "causal_offset", "workspace", "dtype", "head_dim", "head_dim_v"]
    assert all(dict(binding.FwdParams._fields_)[f] is ctypes.c_int32 for f in ("dtype", "head_dim", "head_dim_v"))
    assert binding.FwdParams.dtype.offset == binding.FwdParams.workspace.offset + 8
    assert binding.FwdParams.head_dim_v.offset == binding.FwdParams.head_dim.offset + 4 == binding.FwdParams.dtype.offset + 8
    assert binding.abi.BwdParams._fields_[-4:] == [("deterministic", ctypes.c_int32), ("dtype", ctypes.c_int32),
                                                   ("head_dim", ctypes.c_int32), ("head_dim_v", ctypes.c_int32)]
    assert binding.DTYPE_CODE == {torch.bfloat16: 0, torch.float16: 1}  # FLASHLADDER_BF16, FLASHLADDER_FP16
    assert all(getattr(binding.FwdParams, f).offset == binding.FwdParams.scale.offset + 4 * (i + 1)
               for i, f in enumerate(("heads_k", "causal", "causal_offset")))
    assert all(dict(binding.FwdParams._fields_)[f] is ctypes.c_int32 for f in ("heads_k", "causal", "causal_offset"))
    assert dict(binding.FwdParams._fields_)["workspace"] is ctypes.c_void_p
    assert binding.FwdParams.workspace.offset == -(-(binding.FwdParams.causal_offset.offset + 4) // 8) * 8


CAUSAL_OK = {False: 0, None: 0, "top_left": 1, "bottom_right": 2}


@pytest.mark.parametrize("causal", CAUSAL_OK, ids=repr)
def test_check_causal_gives_the_op_s_code(causal):
    import binding
    assert binding.check_causal("stepX", causal, binding.FEATURE_CAUSAL) == CAUSAL_OK[causal]
    assert binding.check_causal("stepX", causal, binding.FEATURE_CAUSAL | binding.FEATURE_GQA) == CAUSAL_OK[causal]
    if CAUSAL_OK[causal]:  # refused without the feature (GQA alone is not enough), in one line naming the value
        for features in (0, binding.FEATURE_GQA):
            with pytest.raises(ValueError) as e:
                binding.check_causal("stepX", causal, features)
            assert str(e.value) == f"flashladder.stepX: this step is non-causal (causal={causal!r}); causal masks come in step15"
    else:
        assert binding.check_causal("stepX", causal, 0) == 0


@pytest.mark.parametrize("causal", [True, 0, 1, 2, 1.0, "", "top-left", "Top_Left", "bottom_left", "upper_left",
                                    "lower_right", ["top_left"], np.bool_(False)], ids=repr)
@pytest.mark.parametrize("features", [0, 1, 3])
def test_check_causal_refuses_anything_else_saying_what_it_takes(causal, features):
    import binding
    with pytest.raises(ValueError) as e:
        binding.check_causal("stepX", causal, features)
    assert str(e.value) == (f"flashladder.stepX: causal={causal!r}: give False, 'top_left' (SDPA's is_causal=True: row i "
                            "sees keys 0..i) or 'bottom_right' (torch's causal_lower_right: the last row sees every key)")


def test_check_causal_code():
    """The op's integer: 0 always; 1 and 2 with FEATURE_CAUSAL; nothing else (a bool neither: the wrapper's job)."""
    import binding
    for features in (0, binding.FEATURE_GQA, binding.FEATURE_CAUSAL, binding.FEATURE_CAUSAL | binding.FEATURE_GQA):
        binding.check_causal_code("stepX", 0, features)
        for code in (1, 2):
            if features & binding.FEATURE_CAUSAL:
                binding.check_causal_code("stepX", code, features)
            else:
                with pytest.raises(ValueError) as e:
                    binding.check_causal_code("stepX", code, features)
                assert str(e.value) == f"flashladder.stepX: this step is non-causal (causal={code}); causal masks come in step15"
        for code in (-1, 3, 255, True, False, "1"):  # (the op's schema makes it an int: a float cannot come)
            with pytest.raises(ValueError) as e:
                binding.check_causal_code("stepX", code, features)
            assert str(e.value) == (f"flashladder.stepX: causal={code!r}: the op takes 0 (none), 1 (top left) or 2 "
                                    "(bottom right)"), code


@pytest.mark.parametrize("q_shape, kv_shape, ok", [
    ((2, 8, 64, 128), (2, 8, 64, 128), True),     # equal heads
    ((2, 8, 64, 128), (2, 4, 64, 128), True),     # GQA
    ((2, 32, 64, 128), (2, 8, 100, 128), True),   # 32/8, other seqlen_k
    ((2, 8, 64, 128), (2, 1, 64, 128), True),     # MQA
    ((2, 0, 64, 128), (2, 0, 64, 128), True),     # no heads at all
    ((2, 8, 64, 128), (2, 3, 64, 128), False),    # 3 does not divide 8
    ((2, 4, 64, 128), (2, 8, 64, 128), False),    # more key/value heads than query heads
    ((2, 8, 64, 128), (2, 0, 64, 128), False),    # no key/value heads for 8 query heads
    ((2, 8, 64, 128), (1, 4, 64, 128), False),    # batch differs
    ((1, 8, 64, 128), (2, 8, 64, 128), False),    # batch differs, heads equal
])
def test_check_inputs_with_grouped_heads(q_shape, kv_shape, ok):
    import binding
    q, kv = meta(q_shape), meta(kv_shape)
    if ok:
        binding.check_inputs("stepX", (1, 1), q, kv, kv, devices=("meta",), features=binding.FEATURE_GQA)
    else:
        with pytest.raises(ValueError) as e:
            binding.check_inputs("stepX", (1, 1), q, kv, kv, devices=("meta",), features=binding.FEATURE_GQA)
        assert str(e.value) == ("flashladder.stepX: q and k/v must agree on batch, and k/v's heads must divide q's, got "
                                f"{q_shape} and {kv_shape}")
    # without the feature (or with causal masks alone) only equal [batch, heads] pass
    for features in (0, binding.FEATURE_CAUSAL):
        if q_shape[:2] == kv_shape[:2]:
            binding.check_inputs("stepX", (1, 1), q, kv, kv, devices=("meta",), features=features)
            continue
        with pytest.raises(ValueError) as e:
            binding.check_inputs("stepX", (1, 1), q, kv, kv, devices=("meta",), features=features)
        assert str(e.value) == (f"flashladder.stepX: q and k/v must agree on [batch, heads], got {q_shape} and {kv_shape} "
                                "(fewer key/value heads than query heads: step15 takes them)")


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(64, 64), (64, 192), (192, 64), (1, 32760), (32760, 1)])
@pytest.mark.parametrize("causal", [0, 1, 2], ids=["none", "top_left", "bottom_right"])
def test_make_params_causal_offset(seqlen_q, seqlen_k, causal):
    """causal = 1 for either corner; row i sees key j iff j <= i + causal_offset: 0 from the top left, seqlen_k - seqlen_q
    (negative when seqlen_q > seqlen_k) from the bottom right; heads_k is k's."""
    import binding
    q, kv = meta((2, 8, seqlen_q, 128)), meta((2, 2, seqlen_k, 128))
    o, lse = meta((2, 8, seqlen_q, 128)), torch.empty(2, 8, seqlen_q, device="meta")
    params = binding.make_params(q, kv, kv, o, lse, 0.5, causal)
    assert (params.batch, params.heads, params.heads_k, params.seqlen_q, params.seqlen_k) == (2, 8, 2, seqlen_q, seqlen_k)
    assert params.causal == int(causal != 0)
    assert params.causal_offset == (seqlen_k - seqlen_q if causal == 2 else 0)
    assert params.scale == 0.5
    if causal == 2:  # the last row sees every key, the row before one fewer
        assert (seqlen_q - 1) + params.causal_offset == seqlen_k - 1
    assert binding.make_params(q, kv, kv, o, lse, 0.5).causal == 0  # the default: not causal


# ---------------------------------------------------------------- one check per call

def test_checks_run_once_per_call(mod, monkeypatch):
    """attention() checks the argument types, the op everything else: each check once per call."""
    binding, n = mod._binding, seqlen(mod)
    calls = {"check_inputs": 0, "check_scale": 0, "check_types": 0, "check_causal": 0, "check_causal_code": 0}
    for name in calls:
        real = getattr(binding.checks, name)
        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)
        monkeypatch.setattr(binding.checks, name, counted)
    device = "cuda" if has_cuda_gpu() else "meta"  # meta: the op's fake implementation, which checks the same
    q = torch.zeros(1, 2, n, 128, dtype=BF16, device=device)
    mod.attention(q, q, q)
    assert calls == {"check_inputs": 1, "check_scale": 1, "check_types": 1, "check_causal": 1, "check_causal_code": 1}
    mod.attention_out(q, q, q, torch.empty_like(q), torch.empty(q.shape[:3], device=device))
    assert calls == {"check_inputs": 2, "check_scale": 2, "check_types": 2, "check_causal": 2, "check_causal_code": 2}


# ---------------------------------------------------------------- empty and keyless inputs, on the GPU

@needs_gpu
@pytest.mark.parametrize("which", ["batch", "heads", "seqlen_q"])
def test_empty_inputs_give_empty_outputs(mod, which):
    """As SDPA: empty outputs, no launch (a launch with an empty grid would fail: test_errors.py)."""
    n = seqlen(mod)
    shape = {"batch": (0, 2, n, 128), "heads": (1, 0, n, 128), "seqlen_q": (1, 2, 0, 128)}[which]
    q = torch.zeros(shape, dtype=BF16, device="cuda")
    k = v = torch.zeros(*shape[:2], n, 128, dtype=BF16, device="cuda")
    o, lse = mod.attention(q, k, v)
    assert o.shape == shape and o.dtype == BF16 and o.device == q.device
    assert lse.shape == shape[:3] and lse.dtype == torch.float32 and lse.device == q.device
    mod.attention_out(q, k, v, torch.empty_like(q), torch.empty(shape[:3], device="cuda"))
    torch.cuda.synchronize()


@needs_gpu
def test_no_key_gives_zero_and_minus_inf(mod):
    """seqlen_k = 0: every row has no key; verify/reference.py's convention (o = 0, lse = -inf), no launch."""
    n = seqlen(mod)
    q, k, v = make_inputs(2, 3, n, 0)
    o_ref, lse_ref = attention_reference(q.double().cpu().numpy(), k.double().cpu().numpy(), v.double().cpu().numpy())
    o, lse = mod.attention(q, k, v)
    assert np.array_equal(o.double().cpu().numpy(), o_ref) and np.array_equal(lse.double().cpu().numpy(), lse_ref), replay()
    o2 = torch.full_like(q, math.nan)
    lse2 = torch.full(q.shape[:3], math.nan, device="cuda")
    mod.attention_out(q, k, v, o2, lse2)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


@needs_gpu
def test_lse_needs_only_4_byte_alignment(mod):
    """lse is written one float at a time: a buffer 4 bytes (not 16) into an allocation is fine."""
    n = seqlen(mod)
    q, k, v = make_inputs(1, 2, n, n)
    lse = torch.empty(2 * n + 1, device="cuda")[1:].view(1, 2, n)
    assert lse.data_ptr() % 16 != 0
    o = torch.empty_like(q)
    mod.attention_out(q, k, v, o, lse)
    o_ref, lse_ref = mod.attention(q, k, v)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), replay()


# ---------------------------------------------------------------- gradients (CPU: the ops' fake implementations)

def test_bwd_params_mirror_mismatch_is_refused(mod, monkeypatch):
    """A ctypes mirror of BwdParams that disagrees with the library's struct, in a step with a backward."""
    if not mod.info["backward"]:
        pytest.skip(f"{mod.__name__} has no backward")
    binding = mod._binding

    class Mirror(ctypes.Structure):
        _fields_ = [*binding.abi.BwdParams._fields_, ("extra", ctypes.c_int64)]
    monkeypatch.setattr(binding.abi, "BwdParams", Mirror)
    with pytest.raises(ImportError, match="sizeof\\(BwdParams\\) is .* the two disagree"):
        binding.load_library(Path(mod.info["library"]))


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_gradients_reach_q_k_v_through_the_backward_op(mod, causal):
    """On meta tensors (the ops' fake implementations, what torch.compile traces): autograd of (o, lse) runs the
    step's backward op and gives dq, dk, dv of q's, k's and v's shapes and layouts; grouped heads included."""
    if not mod.info["backward"]:
        pytest.skip(f"{mod.__name__} has no backward")
    q = meta((2, 8, 96, 128)).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # a model's layout
    k, v = (meta((2, 2, 160, 128)).requires_grad_() for _ in range(2))
    o, lse = mod.attention(q, k, v, causal=causal)
    dq, dk, dv = torch.autograd.grad((o, lse), (q, k, v), (torch.ones_like(o), torch.ones_like(lse)))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.stride() == q.stride() and dq.dtype == BF16


def test_a_step_without_a_backward_says_so(mod):
    if mod.info["backward"]:
        pytest.skip(f"{mod.__name__} has a backward")
    n = seqlen(mod)
    q = meta((1, 2, n, 128)).requires_grad_()
    o, _ = mod.attention(q, q, q)  # the forward runs in grad mode
    with pytest.raises(RuntimeError, match=f"flashladder.{mod.info['step']} computes no backward"):
        torch.autograd.grad(o, q, torch.ones_like(o))


@pytest.mark.parametrize("bad, says", [
    ("d_o", "d_o must be a torch.bfloat16 tensor of shape"),
    ("d_lse", "d_lse must be a contiguous float32 tensor"),
    ("dk", "dk must be a torch.bfloat16 tensor of shape"),
])
def test_the_backward_op_checks_its_tensors(mod, bad, says):
    if not mod.info["backward"]:
        pytest.skip(f"{mod.__name__} has no backward")
    q, kv = meta((1, 4, 64, 128)), meta((1, 2, 80, 128))
    o, lse = meta((1, 4, 64, 128)), torch.empty(1, 4, 64, device="meta")
    args = dict(d_o=meta((1, 4, 64, 128)), d_lse=None, dq=meta((1, 4, 64, 128)), dk=meta((1, 2, 80, 128)),
                dv=meta((1, 2, 80, 128)))
    args[bad] = {"d_o": meta((1, 4, 65, 128)), "d_lse": torch.empty(1, 4, 64, device="meta", dtype=torch.float64),
                 "dk": meta((1, 4, 80, 128))}[bad]
    op = getattr(torch.ops.flashladder, f"{mod.info['step']}_bwd")
    with pytest.raises(ValueError, match=f"flashladder.{mod.info['step']}: {says}"):
        op(q, kv, kv, o, lse, args["d_o"], args["d_lse"], args["dq"], args["dk"], args["dv"], 0.1, 0)


def test_torch_compile_traces_the_backward(mod):
    """fullgraph torch.compile (AOTAutograd traces the joint graph) through the forward op and the backward op, on
    meta tensors: no graph break, gradients of the inputs' shapes."""
    if not mod.info["backward"]:
        pytest.skip(f"{mod.__name__} has no backward")
    leaves = [meta((1, 4, 256, 128)).requires_grad_(), meta((1, 2, 320, 128)).requires_grad_(),
              meta((1, 2, 320, 128)).requires_grad_()]

    def loss(q, k, v):
        o, lse = mod.attention(q, k, v, causal="bottom_right")
        return (o.float() ** 2).sum() + lse.sum()
    # One code object for every step: each step's compile is a recompile of it, and dynamo stops at its limit (8),
    # which the steps with a backward have passed. Each step starts from a clean cache.
    torch._dynamo.reset()
    grads = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    assert [g.shape for g in grads] == [t.shape for t in leaves]
