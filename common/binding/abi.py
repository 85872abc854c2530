"""The C ABI of a step's library (common/flashladder.cuh), as ctypes sees it: loading _kernel.so and declaring its
functions, the mirror of `struct FwdParams` and the checks that the library and this binding agree (the ABI version,
the struct's size), and the FwdParams of one launch."""
import ctypes
from pathlib import Path
from typing import Optional

import torch

HEAD_DIM = 128       # the head dim of every step before step41; the steps that take others say which (head_dims_of)
ABI_VERSION = 7      # must match FLASHLADDER_ABI_VERSION in common/flashladder.cuh
# FLASHLADDER_HEAD_DIMS: bit i of flashladder_head_dims() / flashladder_bwd_head_dims() is the head dim HEAD_DIMS[i].
HEAD_DIMS = (64, 96, 128, 192, 256)
FEATURE_CAUSAL, FEATURE_GQA, FEATURE_FP16 = 1, 2, 4  # bits of flashladder_features() (common/flashladder.cuh)
# FwdParams' and BwdParams' dtype: the code of q's type (FLASHLADDER_BF16, FLASHLADDER_FP16).
DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1}
# The `causal` argument: False (every key), or which corner the diagonal starts from when seqlen_q != seqlen_k:
# "top_left" (SDPA's is_causal=True: row i sees keys 0..i) or "bottom_right" (torch's causal_lower_right, a KV cache's:
# the last row sees every key). The op takes the code below; the kernel gets an offset instead (make_params: 0, or
# seqlen_k - seqlen_q): row i sees key j iff j <= i + offset.
CAUSAL = {"top_left": 1, "bottom_right": 2}


class FwdParams(ctypes.Structure):
    """Mirror of `struct FwdParams` in common/flashladder.cuh, field by field."""
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("q_stride", ctypes.c_int64 * 3), ("k_stride", ctypes.c_int64 * 3),
        ("v_stride", ctypes.c_int64 * 3), ("o_stride", ctypes.c_int64 * 3),
        ("batch", ctypes.c_int32), ("heads", ctypes.c_int32),
        ("seqlen_q", ctypes.c_int32), ("seqlen_k", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("heads_k", ctypes.c_int32), ("causal", ctypes.c_int32), ("causal_offset", ctypes.c_int32),
        ("workspace", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("head_dim", ctypes.c_int32), ("head_dim_v", ctypes.c_int32),
    ]


class BwdParams(ctypes.Structure):
    """Mirror of `struct BwdParams` in common/flashladder.cuh (the steps that export flashladder_bwd), field by field."""
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p), ("d_o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p), ("d_lse", ctypes.c_void_p), ("delta", ctypes.c_void_p), ("dq_accum", ctypes.c_void_p),
        ("dq", ctypes.c_void_p), ("dk", ctypes.c_void_p), ("dv", ctypes.c_void_p),
        *((f"{name}_stride", ctypes.c_int64 * 3) for name in ("q", "k", "v", "o", "do", "dq", "dk", "dv")),
        ("batch", ctypes.c_int32), ("heads", ctypes.c_int32),
        ("seqlen_q", ctypes.c_int32), ("seqlen_k", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("heads_k", ctypes.c_int32), ("causal", ctypes.c_int32), ("causal_offset", ctypes.c_int32),
        ("deterministic", ctypes.c_int32), ("dtype", ctypes.c_int32),
        ("head_dim", ctypes.c_int32), ("head_dim_v", ctypes.c_int32),
    ]


def load_library(path: Path) -> ctypes.CDLL:
    """A step's _kernel.so, its C ABI declared to ctypes and checked against this binding (version, FwdParams).
    Public: verify.trace loads a step's normal build with it, beside the traced one it imports."""
    if not path.exists():
        raise ImportError(f"{path} is missing: build the step first (pip install steps/<step>, or python -m verify)")
    lib = ctypes.CDLL(str(path))
    lib.flashladder_abi_version.restype = ctypes.c_int
    lib.flashladder_params_size.restype = ctypes.c_int
    lib.flashladder_seqlen_multiple_q.restype = ctypes.c_int
    lib.flashladder_seqlen_multiple_k.restype = ctypes.c_int
    lib.flashladder_error_string.restype = ctypes.c_char_p
    lib.flashladder_error_string.argtypes = [ctypes.c_int]
    lib.flashladder_fwd.restype = ctypes.c_int
    lib.flashladder_fwd.argtypes = [ctypes.POINTER(FwdParams), ctypes.c_void_p]
    if lib.flashladder_abi_version() != ABI_VERSION:
        raise ImportError(f"{path} was built for ABI {lib.flashladder_abi_version()}, this binding speaks {ABI_VERSION}: rebuild it")
    lib.flashladder_archs.restype = ctypes.c_char_p
    lib.flashladder_loaded_code.restype = ctypes.c_int
    lib.flashladder_loaded_code.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    if hasattr(lib, "flashladder_smem_bytes"):
        lib.flashladder_smem_bytes.restype = ctypes.c_int
    if hasattr(lib, "flashladder_features"):
        lib.flashladder_features.restype = ctypes.c_int
    for name in ("flashladder_head_dims", "flashladder_bwd_head_dims"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
    if hasattr(lib, "flashladder_workspace_bytes"):
        lib.flashladder_workspace_bytes.restype = ctypes.c_int64
        lib.flashladder_workspace_bytes.argtypes = [ctypes.c_int]
    if hasattr(lib, "flashladder_pair_min_seqlen_k"):
        lib.flashladder_pair_min_seqlen_k.restype = ctypes.c_int
        lib.flashladder_pair_min_seqlen_k.argtypes = [ctypes.c_int]
    if hasattr(lib, "flashladder_bwd"):  # the steps with a backward
        lib.flashladder_bwd.restype = ctypes.c_int
        lib.flashladder_bwd.argtypes = [ctypes.POINTER(BwdParams), ctypes.c_void_p]
        lib.flashladder_bwd_params_size.restype = ctypes.c_int
        if lib.flashladder_bwd_params_size() != ctypes.sizeof(BwdParams):
            raise ImportError(f"{path}: sizeof(BwdParams) is {lib.flashladder_bwd_params_size()} in the library but "
                              f"{ctypes.sizeof(BwdParams)} in the binding's ctypes mirror: the two disagree, fix the mirror")
    if lib.flashladder_params_size() != ctypes.sizeof(FwdParams):
        raise ImportError(f"{path}: sizeof(FwdParams) is {lib.flashladder_params_size()} in the library but "
                          f"{ctypes.sizeof(FwdParams)} in the binding's ctypes mirror: the two disagree, fix the mirror")
    return lib


def head_dims_of(lib: ctypes.CDLL, backward: bool = False) -> tuple:
    """The head dims a step's forward (or backward) takes: those its library exports (flashladder_head_dims,
    flashladder_bwd_head_dims), else HEAD_DIM alone."""
    name = "flashladder_bwd_head_dims" if backward else "flashladder_head_dims"
    if not hasattr(lib, name):
        return (HEAD_DIM,)
    bits = getattr(lib, name)()
    return tuple(d for i, d in enumerate(HEAD_DIMS) if bits >> i & 1)


def kernel_strides(t: torch.Tensor) -> tuple:
    """The batch, head and row strides the kernel gets. A dimension of size <= 1 is never stepped over, so its
    stride means nothing (torch keeps odd ones, e.g. 1 for a batch of 1 after a transpose); it becomes the
    contiguous stride, a multiple of 8 elements, which later steps' TMA tensor maps need (16-byte strides)."""
    d = t.shape[3]
    contiguous = (t.shape[1] * t.shape[2] * d, t.shape[2] * d, d)
    return tuple(s if n > 1 else c for n, s, c in zip(t.shape[:3], t.stride()[:3], contiguous))


def make_params(q, k, v, o, lse, scale: float, causal: int = 0, workspace: Optional[int] = None) -> FwdParams:
    """FwdParams for one launch; strides as the checks saw them (kernel_strides); causal as checks.check_causal gives it;
    workspace: the address of the step's workspace (None: the step runs without one)."""
    def strides(t):
        return (ctypes.c_int64 * 3)(*kernel_strides(t))
    offset = k.shape[2] - q.shape[2] if causal == CAUSAL["bottom_right"] else 0
    return FwdParams(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                     strides(q), strides(k), strides(v), strides(o),
                     q.shape[0], q.shape[1], q.shape[2], k.shape[2], scale, k.shape[1], int(causal != 0), offset, workspace,
                     DTYPE_CODE[q.dtype], q.shape[3], v.shape[3])


def make_bwd_params(q, k, v, o, lse, d_o, d_lse, delta, dq, dk, dv, scale: float, causal: int = 0,
                    dq_accum=None, deterministic: bool = False) -> BwdParams:
    """BwdParams for one backward launch: the forward's tensors (q, k, v, o, lse), the gradients reaching its outputs
    (d_o, and d_lse or None), the fp32 scratch `delta` (one float per query row), the gradients to write, and, for a
    step that adds dQ up across CTAs, the fp32 scratch `dq_accum` (q's shape, contiguous; None otherwise)."""
    def strides(t):
        return (ctypes.c_int64 * 3)(*kernel_strides(t))
    offset = k.shape[2] - q.shape[2] if causal == CAUSAL["bottom_right"] else 0
    return BwdParams(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), lse.data_ptr(),
                     None if d_lse is None else d_lse.data_ptr(), delta.data_ptr(),
                     None if dq_accum is None else dq_accum.data_ptr(),
                     dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                     *(strides(t) for t in (q, k, v, o, d_o, dq, dk, dv)),
                     q.shape[0], q.shape[1], q.shape[2], k.shape[2], scale, k.shape[1], int(causal != 0), offset,
                     int(bool(deterministic)), DTYPE_CODE[q.dtype], q.shape[3], v.shape[3])
