"""Bad input raises a clear Python exception naming the problem, before any launch.

The metadata checks run on CPU tensors too (so CI without a GPU tests them); the device checks need a GPU.
"""
import ctypes
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from verify.tests.conftest import has_cuda_gpu, needs_gpu  # noqa: E402

DEV = "cuda" if has_cuda_gpu() else "cpu"  # metadata errors come before the device check


def qkv(b=1, h=2, n=256, d=128, dtype=torch.bfloat16, device=DEV):
    return [torch.randn(b, h, n, d, device=device).to(dtype) for _ in range(3)]


def expect(mod, match, q, k, v, exc=(ValueError, TypeError), **kw):
    with pytest.raises(exc, match=match):
        mod.attention(q, k, v, **kw)


def test_dtype(mod):
    q, k, v = qkv(dtype=torch.float16)
    expect(mod, "dtype torch.float16.*bfloat16", q, k, v)
    q, k, v = qkv()
    expect(mod, "v has dtype torch.float32", q, k, v.float())


def test_head_dim(mod):
    expect(mod, "head dim must be 128", *qkv(d=64))


def test_rank(mod):
    q, k, v = qkv()
    expect(mod, "must be 4-D", q[0], k, v)


def test_not_a_tensor(mod):
    q, k, v = qkv()
    expect(mod, "must be a torch.Tensor", q, k.tolist(), v)


def test_shape_mismatch(mod):
    q, k, v = qkv()
    expect(mod, "k and v must have the same shape", q, k, v[:, :, :128])
    expect(mod, "agree on \\[batch, heads\\]", q, k[:, :1], v[:, :1])


def test_empty(mod):
    expect(mod, "is empty", *qkv(b=0))


def test_seqlen_multiple(mod):
    mult = max(mod.info["seqlen_multiple_q"], mod.info["seqlen_multiple_k"])
    expect(mod, f"seqlen {mult + 1} is not supported: this step needs a multiple of", *qkv(n=mult + 1))


def test_unsupported_strides(mod):
    q, k, v = qkv()
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    expect(mod, "strides", q_t, k, v)
    huge = torch.empty_strided(q.shape, (0, 0, 2**24, 1), dtype=torch.bfloat16, device="meta")  # no memory behind it
    expect(mod, "row stride 16777216", huge, k, v)


def test_bad_scale(mod):
    expect(mod, "scale must be a finite positive float", *qkv(), scale=float("nan"))
    expect(mod, "scale must be a finite positive float", *qkv(), scale=-0.1)


def test_too_long(mod):
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 2, 1, 128, dtype=torch.bfloat16, device="meta").expand(1, 2, 2**31, 128)  # no memory behind it
    expect(mod, "too large", q, k, k)


def test_cpu_tensors(mod):
    expect(mod, "is on cpu; flashladder runs on a CUDA device", *qkv(device="cpu"))


@needs_gpu
def test_device_mismatch(mod):
    q, k, v = qkv(device="cuda")
    expect(mod, "all tensors must be on one device|v is on cpu", q, k, v.cpu())


@needs_gpu
def test_misaligned_pointer(mod):
    q, k, v = qkv(device="cuda")
    flat = torch.empty(q.numel() + 8, dtype=torch.bfloat16, device="cuda")
    q_odd = flat[1:1 + q.numel()].view(q.shape)  # 2-byte offset: rows no longer 16-byte aligned
    expect(mod, "not 16-byte aligned", q_odd, k, v)


@needs_gpu
def test_wrong_gpu_architecture(mod, monkeypatch):
    binding = mod._binding
    monkeypatch.setattr(binding, "_device_arch", lambda index: ((8, 0), "NVIDIA A100 (pretend)"))
    expect(mod, "needs an sm_90 GPU.*sm_80", *qkv(device="cuda"), exc=RuntimeError)


@needs_gpu
def test_launcher_reports_launch_errors(mod):
    """A launch the GPU refuses (here an empty grid) comes back as an error code, never silently."""
    torch.zeros(1, device="cuda")  # make the primary context current
    lib = mod._binding._load_library(Path(mod.info["library"]))
    params = mod._binding.FwdParams(batch=1, heads=1, seqlen_q=0, seqlen_k=0, scale=1.0)
    err = lib.flashladder_fwd(ctypes.byref(params), None)
    assert err != 0, "an empty grid must be reported as a launch error"
    assert "invalid" in lib.flashladder_error_string(err).decode()


@needs_gpu
def test_output_overlapping_an_input(mod):
    q, k, v = qkv(device="cuda")
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="o overlaps q"):
        mod.attention_out(q, k, v, q, lse)


@needs_gpu
def test_op_called_directly_checks_scale(mod):
    """torch.ops.flashladder.<step> skips the Python wrapper; the op itself still refuses a bad scale."""
    q, k, v = qkv(device="cuda")
    op = getattr(torch.ops.flashladder, mod.info["step"])
    with pytest.raises(ValueError, match="scale must be a finite positive float"):
        op(q, k, v, -1.0)
