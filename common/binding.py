"""The Python binding shared by every flashladder step (copied into each step package as _binding.py).

It never links libtorch: the step's kernel is a plain C library (_kernel.so, see common/flashladder.cuh)
loaded with ctypes. This module checks the tensors, then hands the library raw device pointers, strides
and torch's current CUDA stream. Because nothing is compiled against torch's C++ ABI, one build works
with every torch version (no `undefined symbol` after a torch upgrade).

The call is a real torch op (torch.library.custom_op + register_fake): it works under
torch.compile(fullgraph=True) and inside CUDA-graph capture; it launches on the current stream and never
synchronizes. Bad input raises ValueError/TypeError/RuntimeError before any launch; a failed launch raises.
A GPU the step's library holds no code for (flashladder_archs: SASS it runs as is, PTX the driver compiles for
newer GPUs), or with less shared memory per block than the step asks for, is refused in one line before launch.
Each check runs once per call: the Python wrapper checks only the argument types (the op's schema would
turn True into 1.0), the op checks everything else, so torch.ops.flashladder.<step> called directly is
checked the same way (its fake implementation too, so torch.compile reports bad input while tracing).

Each step also offers `sdpa()`, a drop-in for torch's scaled_dot_product_attention (SdpaRouter, below): inside
`with step.sdpa():` the SDPA calls the step can take go to its op, decided from the calls' metadata by these same
checks, and the others to torch. Nothing is active on import.
"""
import collections
import ctypes
import functools
import math
import numbers
import operator
import os
import re
import struct
import sys
import threading
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

HEAD_DIM = 128
ABI_VERSION = 5      # must match FLASHLADDER_ABI_VERSION in common/flashladder.cuh
FEATURE_CAUSAL, FEATURE_GQA = 1, 2  # bits of flashladder_features() (common/flashladder.cuh)
# The `causal` argument: False (every key), or which corner the diagonal starts from when seqlen_q != seqlen_k:
# "top_left" (SDPA's is_causal=True: row i sees keys 0..i) or "bottom_right" (torch's causal_lower_right, a KV cache's:
# the last row sees every key). The op takes the code below; the kernel gets an offset instead (make_params: 0, or
# seqlen_k - seqlen_q): row i sees key j iff j <= i + offset.
CAUSAL = {"top_left": 1, "bottom_right": 2}
MAX_GRID_YZ = 65535  # heads and batch are the grid's y and z dimensions
MAX_ROW_STRIDE = 2**24  # in-tile offsets (row < 128) * row stride stay below 2^31
ALIGN = {"q": 16, "k": 16, "v": 16, "o": 16, "lse": 4}  # bytes: 16-byte vector copies of rows; lse is per float


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
    if hasattr(lib, "flashladder_workspace_bytes"):
        lib.flashladder_workspace_bytes.restype = ctypes.c_int64
        lib.flashladder_workspace_bytes.argtypes = [ctypes.c_int]
    if lib.flashladder_params_size() != ctypes.sizeof(FwdParams):
        raise ImportError(f"{path}: sizeof(FwdParams) is {lib.flashladder_params_size()} in the library but "
                          f"{ctypes.sizeof(FwdParams)} in the binding's ctypes mirror: the two disagree, fix the mirror")
    return lib


def kernel_strides(t: torch.Tensor) -> tuple:
    """The batch, head and row strides the kernel gets. A dimension of size <= 1 is never stepped over, so its
    stride means nothing (torch keeps odd ones, e.g. 1 for a batch of 1 after a transpose); it becomes the
    contiguous stride, a multiple of 8 elements, which later steps' TMA tensor maps need (16-byte strides)."""
    contiguous = (t.shape[1] * t.shape[2] * HEAD_DIM, t.shape[2] * HEAD_DIM, HEAD_DIM)
    return tuple(s if n > 1 else c for n, s, c in zip(t.shape[:3], t.stride()[:3], contiguous))


def check_types(step: str, scale, **tensors) -> float:
    """What the op's schema cannot say clearly: the arguments' Python types (the schema turns True into 1.0).
    Returns the scale as a float, None -> 1/sqrt(128); its value is the op's to check (check_scale)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashladder.{step}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if scale is None:
        return 1.0 / math.sqrt(HEAD_DIM)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"flashladder.{step}: scale must be a finite positive float, got {scale!r}")
    try:
        return float(scale)
    except OverflowError:  # an int beyond any float
        raise ValueError(f"flashladder.{step}: scale {scale!r} overflows float32 (the kernels take a float32 scale)") from None


def check_causal(step: str, causal, features: int) -> int:
    """The `causal` argument as the op's integer: 0 (False or None), 1 ("top_left"), 2 ("bottom_right"). Raises for
    anything else, and for causal attention on a step without it (flashladder_features)."""
    if causal is None or causal is False:
        return 0
    if isinstance(causal, str) and causal in CAUSAL:
        if not features & FEATURE_CAUSAL:
            raise ValueError(f"flashladder.{step}: this step is non-causal (causal={causal!r}); causal masks come in step15")
        return CAUSAL[causal]
    raise ValueError(f"flashladder.{step}: causal={causal!r}: give False, 'top_left' (SDPA's is_causal=True: row i sees "
                     "keys 0..i) or 'bottom_right' (torch's causal_lower_right: the last row sees every key)")


def check_causal_code(step: str, causal: int, features: int) -> None:
    """The op's integer form of `causal` (check_causal makes it), as the op receives it."""
    if isinstance(causal, bool) or causal not in (0, *CAUSAL.values()):
        raise ValueError(f"flashladder.{step}: causal={causal!r}: the op takes 0 (none), 1 (top left) or 2 (bottom right)")
    if causal and not features & FEATURE_CAUSAL:
        raise ValueError(f"flashladder.{step}: this step is non-causal (causal={causal}); causal masks come in step15")


def check_scale(step: str, scale: float) -> None:
    """Positive (the kernels take the running max on the raw scores: max(s*scale) = max(s)*scale) and finite
    and non-zero once rounded to float32, the kernels' type for it (1e39 would become inf, 1e-50 zero)."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flashladder.{step}: scale must be a finite positive float, got {scale!r}")
    try:
        scale32 = struct.unpack("f", struct.pack("f", scale))[0]
    except OverflowError:  # older Pythons raise where newer ones round to inf
        scale32 = math.inf
    if math.isinf(scale32):
        raise ValueError(f"flashladder.{step}: scale {scale!r} overflows float32 (the kernels take a float32 scale)")
    if scale32 == 0:
        raise ValueError(f"flashladder.{step}: scale {scale!r} rounds to 0 in float32 (the kernels take a float32 scale)")


def check_inputs(step: str, seqlen_multiple: tuple, q, k, v, o=None, lse=None, devices=("cuda",), features: int = 0) -> None:
    """Everything about the tensors' metadata that the kernel relies on. Raises, naming the problem.

    Works on fake tensors too (torch.compile traces it; `devices` then also admits meta tensors); pointer
    alignment, overlaps and the GPU's architecture are checked at launch (check_launch). Empty inputs (batch,
    heads or a seqlen of 0) pass: the op returns without a launch.
    """
    where = f"flashladder.{step}"
    named = {"q": q, "k": k, "v": v}
    for name, t in named.items():
        if t.dim() != 4:
            raise ValueError(f"{where}: {name} must be 4-D [batch, heads, seqlen, {HEAD_DIM}], got shape {tuple(t.shape)}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}; flashladder computes in torch.bfloat16 only")
        if t.shape[-1] != HEAD_DIM:
            raise ValueError(f"{where}: head dim must be {HEAD_DIM}, {name} has shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{where}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if features & FEATURE_GQA:  # grouped heads: k/v's heads divide q's
        heads, heads_k = q.shape[1], k.shape[1]
        if q.shape[0] != k.shape[0] or not (heads_k == heads or heads_k > 0 and heads % heads_k == 0):
            raise ValueError(f"{where}: q and k/v must agree on batch, and k/v's heads must divide q's, "
                             f"got {tuple(q.shape)} and {tuple(k.shape)}")
    elif q.shape[:2] != k.shape[:2]:
        raise ValueError(f"{where}: q and k/v must agree on [batch, heads], got {tuple(q.shape)} and {tuple(k.shape)} "
                         "(fewer key/value heads than query heads: step15 takes them)")
    batch, heads, seqlen_q, seqlen_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    for name, n, mult in (("q", seqlen_q, seqlen_multiple[0]), ("k/v", seqlen_k, seqlen_multiple[1])):
        if n % mult != 0:
            raise ValueError(f"{where}: {name} seqlen {n} is not supported: this step needs a multiple of {mult}")
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ or seqlen_q * heads * batch >= 2**31 or seqlen_k >= 2**31:
        raise ValueError(f"{where}: q {tuple(q.shape)} / k {tuple(k.shape)} too large: batch, heads <= {MAX_GRID_YZ}, "
                         "batch*heads*seqlen_q < 2^31, seqlen_k < 2^31")
    for name, t in named.items():
        strides = kernel_strides(t)
        if strides[2] >= MAX_ROW_STRIDE:
            raise ValueError(f"{where}: {name} has row stride {strides[2]}; the kernels address inside a tile with "
                             f"32-bit offsets and need it below {MAX_ROW_STRIDE}; call .contiguous() first")
        if t.stride(-1) != 1 or any(s % 8 != 0 for s in strides):
            raise ValueError(f"{where}: {name} has strides {t.stride()}: the last dim must be contiguous (stride 1) "
                             "and the other strides multiples of 8 elements (16 bytes); call .contiguous() first")
    tensors = dict(named)
    if o is not None:
        if o.shape != q.shape or o.dtype != torch.bfloat16 or not o.is_contiguous():
            raise ValueError(f"{where}: o must be a contiguous bf16 tensor of q's shape {tuple(q.shape)}, "
                             f"got {o.dtype} {tuple(o.shape)} strides {o.stride()}")
        if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous():
            raise ValueError(f"{where}: lse must be a contiguous float32 tensor of shape {tuple(q.shape[:3])}, "
                             f"got {lse.dtype} {tuple(lse.shape)} strides {lse.stride()}")
        tensors.update(o=o, lse=lse)
    for name, t in tensors.items():
        if t.device.type not in devices:
            raise ValueError(f"{where}: {name} is on {t.device}; flashladder runs on a CUDA device")
        if t.device != q.device:
            raise ValueError(f"{where}: all tensors must be on one device: q is on {q.device}, {name} on {t.device}")


def _span(t: torch.Tensor) -> tuple:
    """[first, last) bytes of memory a strided tensor can touch (empty for an empty tensor)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + last * t.element_size()


class Device(NamedTuple):
    """What the checks before a launch need to know of a GPU."""
    name: str
    major: int
    minor: int
    smem_per_block_optin: int  # bytes of shared memory a block may ask for (cudaDevAttrMaxSharedMemoryPerBlockOptin)

    @property
    def sm(self) -> str:
        return f"sm_{self.major}{self.minor}"


MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN in cuda.h


def _smem_optin_from_the_driver(index: int) -> int:
    """For a torch without shared_memory_per_block_optin: the driver's attribute, asked through libcuda (initialized
    by torch by the time a launch is checked)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device, value = ctypes.c_int(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(device), index) or cuda.cuDeviceGetAttribute(
            ctypes.byref(value), MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device):
        raise RuntimeError(f"cannot read the shared memory per block of CUDA device {index} from the driver")
    return value.value


@functools.lru_cache(maxsize=None)
def device_props(index: int) -> Device:
    """The GPU `index` as the checks see it (tests replace this function to play other GPUs)."""
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return Device(props.name, props.major, props.minor, int(optin) if optin else _smem_optin_from_the_driver(index))


def _arch_version(code: str) -> tuple:
    """'sm_86' -> (8, 6, ''), 'sm_90a' -> (9, 0, 'a'), 'sm_120' -> (12, 0, ''), 'compute_80' -> (8, 0, '')."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)(\d)([af]?)", code)
    if not m:
        raise ValueError(f"not an architecture: {code!r}")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def code_for(archs: list, major: int, minor: int) -> Optional[str]:
    """Which of a library's codes the driver runs on a GPU of compute capability major.minor, or None.

    SASS runs on GPUs of its major version and a minor one at least its own (sm_86 on 8.6, 8.7, 8.9), except an
    architecture-specific one ('a': sm_90a), which runs on its own version alone; the driver takes the closest.
    Failing that, PTX compute_XY is compiled by the driver for any GPU of version X.Y or later (the newest PTX
    that is not newer than the GPU)."""
    sass, ptx = [], []
    for code in archs:
        M, m, suffix = _arch_version(code)
        if code.startswith("sm_") and M == major and (m == minor if suffix else m <= minor):
            sass.append(((m, suffix != ""), code))  # the closest minor; on a tie, the specific code ('a')
        elif code.startswith("compute_") and ((M, m) == (major, minor) if suffix else (M, m) <= (major, minor)):
            ptx.append(((M, m), code))
    if sass:
        return max(sass)[1]
    return max(ptx)[1] if ptx else None


def runs_on(archs: list) -> str:
    """The GPUs a library with code for `archs` runs on, in words, naming the codes."""
    sass = [a for a in archs if a.startswith("sm_")]
    ptx = [a for a in archs if a.startswith("compute_")]
    if ptx:
        M, m, _ = min(_arch_version(a) for a in ptx)
        return (f"a GPU of compute capability {M}.{m} or later (built for {', '.join(sass)}, "
                f"and {', '.join(ptx)} PTX that the driver compiles for the others)")
    if len(sass) == 1:
        M, m, _ = _arch_version(sass[0])
        known = {"sm_90a": "H100/H200; "}.get(sass[0], "")
        return f"an sm_{M}{m} GPU ({known}built for {sass[0]} alone)"
    return f"a GPU that one of {', '.join(sass)} runs on (built for those alone)"


def check_device(step: str, archs: list, smem_bytes: Optional[int], device: Device, where: str) -> None:
    """Refuse, in one line, a GPU that the library has no code for or too little shared memory per block on."""
    if code_for(archs, device.major, device.minor) is None:
        raise RuntimeError(f"flashladder.{step}: needs {runs_on(archs)}, but {where} is {device.name} ({device.sm})")
    if smem_bytes is not None and smem_bytes > device.smem_per_block_optin:
        raise RuntimeError(f"flashladder.{step}: a block needs {smem_bytes} bytes ({smem_bytes / 1024:g} KB) of shared memory, "
                           f"but {where} ({device.name}, {device.sm}) offers {device.smem_per_block_optin} bytes "
                           f"({device.smem_per_block_optin / 1024:g} KB) per block")


def check_outputs_apart(step: str, tensors: dict) -> None:
    """The outputs may not share memory with an input or with each other (the kernel would read what it wrote)."""
    for out in ("o", "lse"):
        lo, hi = _span(tensors[out])
        for name in ("q", "k", "v", *(["o"] if out == "lse" else [])):
            a, b = _span(tensors[name])
            if lo < b and a < hi:
                raise ValueError(f"flashladder.{step}: {out} overlaps {name} in memory; outputs need buffers of their own")


def check_launch(step: str, tensors: dict, archs: list, smem_bytes: Optional[int]) -> None:
    """What only real tensors on a real GPU can tell: the GPU (check_device) and the pointers' alignment."""
    q = tensors["q"]
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    check_device(step, archs, smem_bytes, device_props(index), f"cuda:{index}")
    for tname, t in tensors.items():
        if t.data_ptr() % ALIGN[tname] != 0:
            raise ValueError(f"flashladder.{step}: {tname}'s data pointer is not {ALIGN[tname]}-byte aligned "
                             "(a view at an odd offset?); call .contiguous() first")


def output_like(q: torch.Tensor) -> torch.Tensor:
    """O for attention(), dense, its dimensions in memory in the order of q's (torch.empty_like): where q is a
    [batch, seqlen, heads, 128] tensor transposed, or a slice of a fused QKV one, as models pass it, O is [batch, seqlen,
    heads, 128] in memory too, and the model's transpose back to [batch, seqlen, heads * 128] is a view, not a copy; a
    contiguous q gives a contiguous O. The kernels take O's strides: a permutation of contiguous
    ones, the last dim innermost (q's is, check_inputs), so they meet the rules q's met."""
    return torch.empty_like(q, memory_format=torch.preserve_format)


def make_params(q, k, v, o, lse, scale: float, causal: int = 0, workspace: Optional[int] = None) -> FwdParams:
    """FwdParams for one launch; strides as the checks saw them (kernel_strides); causal as check_causal gives it;
    workspace: the address of the step's workspace (None: the step runs without one)."""
    def strides(t):
        return (ctypes.c_int64 * 3)(*kernel_strides(t))
    offset = k.shape[2] - q.shape[2] if causal == CAUSAL["bottom_right"] else 0
    return FwdParams(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                     strides(q), strides(k), strides(v), strides(o),
                     q.shape[0], q.shape[1], q.shape[2], k.shape[2], scale, k.shape[1], int(causal != 0), offset, workspace)


def no_cuda_reason() -> Optional[str]:
    """What this machine lacks to run a kernel (a CUDA build of torch, a driver, a GPU), or None. Called at import,
    so it avoids starting CUDA (the process may fork later): the driver's library is only loaded, not initialized,
    and torch.cuda.device_count() asks NVML where it can (unlike torch.cuda.is_available(), which calls cuInit)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver on this machine (libcuda.so.1 not found)"
    if torch.cuda.device_count() == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no CUDA GPU visible" + (f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else "")
    return None


# ---------------------------------------------------------------- the SDPA drop-in: `with step.sdpa(): model(x)`
#
# A model calls torch.nn.functional.scaled_dot_product_attention (SDPA); inside `with flashladder.stepNN.sdpa():`
# each call that the step can take goes to the step's op instead, and every other call to torch, unchanged.
# The mechanism is a torch function mode (torch.overrides.TorchFunctionMode): torch hands every call of a torch
# function to the innermost active mode first, however the function was imported (F.scaled_dot_product_attention,
# torch._C._nn.scaled_dot_product_attention: the same function), and torch.compile traces through modes.
#
# The decision is one pure function of the call's metadata (route_reason): shapes, strides, dtypes, devices and the
# other arguments, all plain constants (describe), so that the same code decides in eager, under torch.compile
# (where the tensors are fake and the decision is taken once, while tracing; the compiled code then runs the op
# or SDPA without asking again) and during CUDA-graph capture (where the captured call is what every replay runs).
# It reuses the checks the step's op makes (check_inputs, check_scale, check_device), on meta tensors of the same
# metadata, so the router and the op cannot disagree.

SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_POSITIONAL = 6  # scale and enable_gqa are keyword-only


class TensorMeta(NamedTuple):
    """What the router reads of a tensor argument: plain constants (under torch.compile: of the fake tensor)."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def describe(value):
    """One argument as route_reason reads it: a strided tensor as its TensorMeta, a nested or sparse tensor as a string
    saying so (SDPA takes nested tensors; the step does not), anything else as it is.

    Numbers are made plain constants (constant()), sizes and strides included, so that under torch.compile the
    decision stays a constant of the compiled code even with dynamic shapes."""
    if not isinstance(value, torch.Tensor):
        return constant(value)
    if (mask := _causal_mask(value)) is not None:
        return mask
    if value.is_nested:
        return "a nested tensor"
    if value.layout != torch.strided:
        return f"a {value.layout} tensor"
    return TensorMeta(tuple(constant(n) for n in value.shape), tuple(constant(s) for s in value.stride()),
                      value.dtype, value.device, bool(value.requires_grad))


def constant(value):
    """A number as a plain Python constant. Under torch.compile a size may be symbolic (dynamic shapes), and so may a
    float (one it chose not to specialize): this makes it concrete, the compiled code guarded on its value (another
    value recompiles). operator.index is how a symbolic int specializes (int() would leave it symbolic); a symbolic
    float has no such method, and math.fsum of it is specialized the same way (the tracer evaluates it on the value).
    Anything else comes back as it is."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, torch.SymInt)):
        return operator.index(value)
    if isinstance(value, (float, torch.SymFloat)):
        return math.fsum((value,))
    return value


def sdpa_arguments(args: tuple, kwargs: dict) -> Optional[dict]:
    """SDPA's arguments by parameter name, positional or keyword, defaults filled in; None where they do not bind
    (too many, an unknown name, one given twice, query/key/value missing): torch then raises its own error."""
    if len(args) > SDPA_POSITIONAL:
        return None
    call = dict(zip(SDPA_PARAMETERS, args))
    for name, value in kwargs.items():
        if name not in SDPA_PARAMETERS or name in call:
            return None
        call[name] = value
    if any(name not in call for name in SDPA_PARAMETERS[:3]):
        return None
    # SDPA's defaults, written here rather than read from a global dict: torch.compile takes a float it reads from a
    # dict for an input that may vary, where it takes a literal for the constant it is
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False, **call}


class SdpaLimits(NamedTuple):
    """What an attention kernel takes, as the router sees it (bind_step makes a step's from its library)."""
    step: str                    # the name in the reasons: the checks' messages say flashladder.<step>
    seqlen_multiple: tuple = (1, 1)  # (q, k/v): info["seqlen_multiple_q"], ["seqlen_multiple_k"]
    archs: Optional[tuple] = None  # the GPU codes of its library (info["archs"]), checked against a CUDA tensor's GPU
    smem_bytes: Optional[int] = None  # shared memory a block asks for (info["smem_bytes"]; None: fits every GPU)
    devices: tuple = ("cuda",)   # device types it runs on (the CPU tests add "cpu" or "meta" for a stand-in op)
    features: int = 0            # FEATURE_CAUSAL | FEATURE_GQA: info["causal"], info["gqa"]


class CausalMask(NamedTuple):
    """An attn_mask that is torch's causal bias (torch.nn.attention.bias.causal_upper_left / causal_lower_right), as
    describe() gives it to the router: which diagonal, and the lengths it was made for."""
    alignment: str  # "top_left" or "bottom_right" (CAUSAL)
    seqlen_q: int
    seqlen_k: int


def _causal_mask(value) -> Optional[CausalMask]:
    """value as a CausalMask if it is torch's CausalBias (imported only when a tensor subclass comes by)."""
    if type(value) is torch.Tensor:
        return None
    try:
        from torch.nn.attention.bias import CausalBias, CausalVariant
    except ImportError:  # a torch without it
        return None
    if not isinstance(value, CausalBias):
        return None
    alignment = "top_left" if value.variant == CausalVariant.UPPER_LEFT else "bottom_right"
    return CausalMask(alignment, constant(value.seq_len_q), constant(value.seq_len_kv))


def _reason(error: Exception, step: str) -> str:
    """A check's message without its 'flashladder.<step>: ' prefix (the router's counts and errors name the step)."""
    return str(error).removeprefix(f"flashladder.{step}: ")


def route_reason(call: Optional[dict], limits: SdpaLimits, grad_enabled: bool) -> Optional[str]:
    """Why the kernel of `limits` cannot take this SDPA call, in one line; None when it can.

    `call`: sdpa_arguments(...) with every value passed through describe(); `grad_enabled`: torch.is_grad_enabled().
    Pure: it reads nothing else (but the GPU's properties, cached), so tests call it with metadata alone.
    """
    if call is None:
        return "the arguments do not bind to SDPA's parameters"
    q, k, v = call["query"], call["key"], call["value"]
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, TensorMeta):
            return f"{name} is {t if isinstance(t, str) else type(t).__name__}, not a strided tensor"
    if len({q.device, k.device, v.device}) > 1:
        return f"query, key and value are on several devices ({q.device}, {k.device}, {v.device})"
    if q.device.type not in limits.devices:
        return f"the tensors are on {q.device.type}; the step runs on {' or '.join(limits.devices)} tensors"
    mask = call["attn_mask"]
    if isinstance(mask, CausalMask):
        if not limits.features & FEATURE_CAUSAL:
            return f"attn_mask is a causal bias ({mask.alignment}): the step is non-causal"
        if call["is_causal"] is not False:
            return "attn_mask and is_causal are both given"
        if len(q.shape) == len(k.shape) == 4 and (mask.seqlen_q, mask.seqlen_k) != (q.shape[2], k.shape[2]):
            return (f"the causal bias was made for {mask.seqlen_q} x {mask.seqlen_k}, the call has "
                    f"{q.shape[2]} x {k.shape[2]}")
    elif mask is not None:
        return "attn_mask is given: the step takes no mask"
    dropout = call["dropout_p"]
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or dropout != 0:
        return f"dropout_p={dropout!r}: the step has no dropout"
    if not isinstance(call["is_causal"], bool):  # torch's own call raises a TypeError for it: leave that to torch
        kind = "a tensor" if isinstance(call["is_causal"], TensorMeta) else f"{call['is_causal']!r} ({type(call['is_causal']).__name__})"
        return f"is_causal is {kind}, not a bool (torch refuses it)"
    if call["is_causal"] is not False and not (call["is_causal"] is True and limits.features & FEATURE_CAUSAL):
        return f"is_causal={call['is_causal']!r}: the step is non-causal"
    if len(q.shape) == len(k.shape) == 4 and q.shape[1] != k.shape[1]:
        if not call["enable_gqa"]:
            return (f"{q.shape[1]} query heads and {k.shape[1]} key/value heads without enable_gqa "
                    "(torch broadcasts a single key/value head and refuses other counts; the step leaves it to torch)")
        if not limits.features & FEATURE_GQA:
            return (f"enable_gqa with {q.shape[1]} query heads and {k.shape[1]} key/value heads: the step needs as many "
                    "key/value heads as query heads")
    if grad_enabled and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "gradients are needed: the step computes no backward (run the model under torch.no_grad())"
    try:
        check_scale(limits.step, check_types(limits.step, call["scale"]))
        # The op's own checks of the tensors, on meta tensors of the same shapes, strides and dtypes.
        stand_ins = [torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device="meta") for t in (q, k, v)]
        check_inputs(limits.step, limits.seqlen_multiple, *stand_ins, devices=("meta",), features=limits.features)
        if q.device.type == "cuda" and limits.archs is not None:  # the GPU: the library has code for it, and the memory
            index = q.device.index if q.device.index is not None else torch.cuda.current_device()
            check_device(limits.step, list(limits.archs), limits.smem_bytes, device_props(index), f"cuda:{index}")
    except (TypeError, ValueError, RuntimeError) as e:
        return _reason(e, limits.step)
    return None


class NotRouted(RuntimeError):
    """Raised by a strict router (`sdpa(strict=True)`) for a call that would fall back to torch."""


# The routers active in this thread, innermost last (torch's mode stack is per thread too), and the settings of
# each kind of router by its key (see SdpaRouter.key).
_active = threading.local()
_SETTINGS: dict = {}


def _active_routers() -> list:
    if not hasattr(_active, "routers"):
        _active.routers = []
    return _active.routers


def _decide(key: str, described: Optional[tuple], grad_enabled: bool) -> Optional[str]:
    """route_reason for the router `key`, counted in the innermost active router of that key; strict raises.

    Under torch.compile this runs as plain Python while tracing, once per traced call (SdpaRouter marks it with
    torch.compiler.assume_constant_result: its result becomes a constant of the compiled code), so its counting is
    real and the compiled code carries no trace of it. Its arguments are constants for that reason."""
    limits, strict, name = _SETTINGS[key]
    reason = route_reason(None if described is None else dict(described), limits, grad_enabled)
    router = next((r for r in reversed(_active_routers()) if r.key == key), None)
    if router is not None:
        if reason is None:
            router.routed += 1
        else:
            router.fallbacks[reason] += 1
    if reason is not None and strict:
        raise NotRouted(f"{name}(strict=True): a scaled_dot_product_attention call would fall back to torch: {reason}")
    return reason


class SdpaRouter(TorchFunctionMode):
    """`with router:` sends each torch.nn.functional.scaled_dot_product_attention call that `attention` can take
    (route_reason) to it, and every other call to torch unchanged; with strict=True a call it cannot take raises
    NotRouted instead. Made by a step's `sdpa()`; the capstone makes one for FlashAttention-3 the same way.

    Counts: `routed` (an int) and `fallbacks` (a collections.Counter of reasons) count the calls this router decided:
    in eager every call; under torch.compile every call it traced (a compiled model that runs again without
    retracing decides nothing, and counts nothing, again; a trace that torch.compile restarts, as it may to
    specialize a value, counts its calls again); in a CUDA graph every captured call (replays run no Python).
    Nested routers: the innermost decides first, and a call it does not take goes on to the next one out.
    """

    def __init__(self, attention, limits: SdpaLimits, strict: bool = False, name: Optional[str] = None):
        super().__init__()
        self.attention = attention  # (q, k, v, scale: float, causal=False | "top_left" | "bottom_right") -> o
        self.limits = limits
        self.strict = bool(strict)
        self.name = name or f"flashladder.{limits.step}.sdpa"
        self.routed = 0
        self.fallbacks = collections.Counter()
        # What torch.compile reads of the router while tracing (and guards on: a router that differs in any of these
        # recompiles the model) is this key and `attention`: both the same for every router of one step and
        # strictness, so that a new `with step.sdpa():` around a compiled model does not recompile it.
        self.key = repr((self.name, tuple(limits), self.strict))
        _SETTINGS[self.key] = (limits, self.strict, self.name)
        torch.compiler.assume_constant_result(_decide)  # marks it (importing torch._dynamo: here, never at import)

    def __enter__(self):
        _active_routers().append(self)
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            routers = _active_routers()
            del routers[len(routers) - 1 - routers[::-1].index(self)]  # this router's innermost entry

    def __repr__(self):
        return f"<{self.name}(strict={self.strict}): {self.routed} routed, {sum(self.fallbacks.values())} fell back>"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            if func is torch.Tensor.unflatten and torch.compiler.is_compiling():
                # The same call in a form torch.compile can trace under a torch function mode: through the method,
                # its super().unflatten() stops the tracer (pytorch/pytorch#179897; torch 2.13 still has it).
                return torch.unflatten(*args, **kwargs)
            return func(*args, **kwargs)  # (inside this method the mode is off: torch runs the call as it is)
        call = sdpa_arguments(args, kwargs)
        described = None if call is None else tuple((name, describe(value)) for name, value in call.items())
        if _decide(self.key, described, torch.is_grad_enabled()) is not None:
            return func(*args, **kwargs)
        scale, mask = call["scale"], describe(call["attn_mask"])
        causal = mask.alignment if isinstance(mask, CausalMask) else "top_left" if call["is_causal"] else False
        return self.attention(call["query"], call["key"], call["value"],
                              1.0 / math.sqrt(HEAD_DIM) if scale is None else float(scale), causal=causal)


def bind_step(module_name: str):
    """Build the public API of the step package `module_name` (e.g. 'flashladder.step01')."""
    step = module_name.rsplit(".", 1)[-1]
    lib = load_library(Path(sys.modules[module_name].__file__).resolve().parent / "_kernel.so")
    seqlen_multiple = (lib.flashladder_seqlen_multiple_q(), lib.flashladder_seqlen_multiple_k())  # (q, k/v)
    # The work tiles (q, k/v): exported by a step that takes any seqlen, else the multiples (common/flashladder.cuh).
    tile = ((lib.flashladder_tile_q(), lib.flashladder_tile_k()) if hasattr(lib, "flashladder_tile_q") else seqlen_multiple)
    archs = lib.flashladder_archs().decode().split(",")  # e.g. sm_80,...,sm_120,compute_80 (common/build_step.py)
    # Dynamic shared memory per block, exported by the steps that run on GPUs with less of it than Hopper's 227 KB.
    smem_bytes = lib.flashladder_smem_bytes() if hasattr(lib, "flashladder_smem_bytes") else None
    # A second tiling for long sequences, exported by the steps that have one (steps 16-20): its K/V tile, and the
    # seqlen_k from which the launcher picks it for calls without a mask (step17: causal ones too, by long_causal's rule)
    # and with an even number of Q tiles.
    long_tile = ((lib.flashladder_long_tile_k(), lib.flashladder_long_min_seqlen_k())
                 if hasattr(lib, "flashladder_long_tile_k") else (None, None))
    # Whether causal calls take it too (step17: with causal_offset >= 0 and whole quadruples of Q tiles per head).
    long_causal = bool(lib.flashladder_long_causal()) if hasattr(lib, "flashladder_long_causal") else False
    # What the step takes beyond dense attention with equal heads (FEATURE_CAUSAL, FEATURE_GQA).
    features = lib.flashladder_features() if hasattr(lib, "flashladder_features") else 0
    # A workspace, for the steps that export its size (steps 18-19: the split tail's partial outputs and flags): one per device
    # and stream, zeroed when made, and left zero by every call (eager calls on one stream run one after another).
    # Never during a CUDA graph's capture: a graph replayed on another stream, or beside eager calls, would share the
    # stream's workspace with them, so a captured call runs without one (steps 18-19: without the split). Made on a stream
    # of its own, which the call's stream then waits for: torch.compile's CUDA graphs route the allocations of the
    # stream they warm up on into their private pool, where a tensor kept for good would be overwritten.
    workspace_bytes = lib.flashladder_workspace_bytes if hasattr(lib, "flashladder_workspace_bytes") else None
    workspaces = {}

    def workspace_for(device: torch.device, stream: int) -> Optional[int]:
        if workspace_bytes is None or torch.cuda.is_current_stream_capturing():
            return None
        key = (device.index, stream)
        if key not in workspaces:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            maker = torch.cuda.Stream(device)
            with torch.cuda.stream(maker):
                workspaces[key] = torch.zeros(workspace_bytes(sms), dtype=torch.uint8, device=device)
            torch.cuda.current_stream(device).wait_stream(maker)
        return workspaces[key].data_ptr()

    # Said at import, so that it comes before torch's own error at the first CUDA call (e.g. torch.randn(device="cuda")).
    if why := no_cuda_reason():  # stacklevel 3: the line that imports the step (pkg/__init__.py calls this)
        warnings.warn(f"flashladder.{step}: {why}; the kernel runs on {runs_on(archs)} with a CUDA build of torch",
                      stacklevel=3)

    def launch(q, k, v, o, lse, scale: float, causal: int) -> None:
        if q.numel() == 0:  # batch, heads or seqlen_q is 0: nothing to compute (as SDPA: empty outputs)
            return
        tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse}
        check_outputs_apart(step, tensors)
        if k.shape[2] == 0:  # no key at all: verify/reference.py's convention for a row with no key
            o.zero_()
            lse.fill_(-math.inf)
            return
        check_launch(step, tensors, archs, smem_bytes)
        with torch.cuda.device(q.device):
            stream = torch.cuda.current_stream(q.device).cuda_stream
            params = make_params(q, k, v, o, lse, scale, causal, workspace_for(q.device, stream))
            err = lib.flashladder_fwd(ctypes.byref(params), ctypes.c_void_p(stream))
        if err != 0:
            raise RuntimeError(f"flashladder.{step}: kernel launch failed: {lib.flashladder_error_string(err).decode()} "
                               f"(cudaError {err})")

    # No device_types: the op takes tensors on any device, so that a CPU tensor meets check_inputs' clear
    # message instead of the dispatcher's "could not run ... with arguments from the 'CPU' backend".
    def checked(q, k, v, o, lse, scale, causal, devices=("cuda",)):
        check_scale(step, scale)
        check_causal_code(step, causal, features)
        check_inputs(step, seqlen_multiple, q, k, v, o, lse, devices=devices, features=features)

    @torch.library.custom_op(f"flashladder::{step}", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        checked(q, k, v, None, None, scale, causal)
        o = output_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        launch(q, k, v, o, lse, scale, causal)
        return o, lse

    @fwd.register_fake
    def _(q, k, v, scale, causal=0):
        checked(q, k, v, None, None, scale, causal, devices=("cuda", "meta"))
        return output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.custom_op(f"flashladder::{step}_out", mutates_args=("o", "lse"))
    def fwd_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, scale: float,
                causal: int = 0) -> None:
        checked(q, k, v, o, lse, scale, causal)
        launch(q, k, v, o, lse, scale, causal)

    @fwd_out.register_fake
    def _(q, k, v, o, lse, scale, causal=0):
        checked(q, k, v, o, lse, scale, causal, devices=("cuda", "meta"))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None, causal=False):
        """O = softmax(q k^T * scale + mask) v and LSE = logsumexp(q k^T * scale + mask) (natural log).

        q: bf16 [batch, heads, seqlen_q, 128]; k, v: bf16 [batch, heads_k, seqlen_k, 128], on one GPU that the step
        runs on (info["archs"]); heads_k = heads, or (info["gqa"]) a divisor of it: query head h reads key/value head
        h // (heads // heads_k).
        causal (info["causal"]): False, or the diagonal's corner: "top_left" (SDPA's is_causal=True: row i sees keys
        0..i) or "bottom_right" (torch's causal_lower_right: row i sees keys 0..i + seqlen_k - seqlen_q). A row that
        sees no key gets o = 0 and lse = -inf.
        Returns (o: bf16 [batch, heads, seqlen_q, 128], lse: float32 [batch, heads, seqlen_q]); o laid out in memory
        as q is (a [batch, seqlen, heads, 128] tensor transposed gives o the same; output_like).
        scale defaults to 1/sqrt(128). Runs on the current CUDA stream; never synchronizes.
        Empty inputs (batch, heads or seqlen_q of 0) give empty outputs without a launch; with seqlen_k = 0
        every row has no key: o = 0 and lse = -inf (what softmax over nothing tends to; no launch either).
        """
        scale = check_types(step, scale, q=q, k=k, v=v)
        return fwd(q, k, v, scale, check_causal(step, causal, features))

    def attention_out(q, k, v, o, lse, scale: Optional[float] = None, causal=False) -> None:
        """attention(), writing into caller-provided contiguous o (bf16) and lse (float32)."""
        scale = check_types(step, scale, q=q, k=k, v=v, o=o, lse=lse)
        fwd_out(q, k, v, o, lse, scale, check_causal(step, causal, features))

    limits = SdpaLimits(step, seqlen_multiple, tuple(archs), smem_bytes, features=features)

    def routed(q, k, v, scale: float, causal=False) -> torch.Tensor:
        return fwd(q, k, v, scale, check_causal(step, causal, features))[0]  # SDPA returns O alone

    def sdpa(strict: bool = False) -> SdpaRouter:
        """A drop-in for torch's SDPA: `with sdpa() as r: model(x)` sends each torch.nn.functional.scaled_dot_product_attention
        call that this step can take (CUDA, bf16, head dim 128, [batch, heads, seqlen, 128] with a contiguous last dim,
        equal heads (or, info["gqa"], fewer key/value heads with enable_gqa=True), no mask (info["causal"]: but is_causal=True
        or torch's causal bias), no dropout, no gradients needed, `scale` any positive float, the seqlens
        this step takes, a GPU it runs on) to it, and every other call to torch unchanged. r.routed counts the calls
        routed, r.fallbacks (a Counter) the others by reason; strict=True raises NotRouted for a call it cannot take
        instead. Works in eager, under torch.compile and in CUDA-graph capture (SdpaRouter says how each counts)."""
        return SdpaRouter(routed, limits, strict, name=f"{module_name}.sdpa")

    attention.__module__ = attention_out.__module__ = sdpa.__module__ = module_name
    info = {"step": step, "seqlen_multiple_q": seqlen_multiple[0], "seqlen_multiple_k": seqlen_multiple[1],
            "tile_q": tile[0], "tile_k": tile[1], "long_tile_k": long_tile[0], "long_min_seqlen_k": long_tile[1],
            "long_causal": long_causal, "workspace": workspace_bytes is not None,
            "archs": archs, "runs_on": runs_on(archs), "smem_bytes": smem_bytes,
            "causal": bool(features & FEATURE_CAUSAL), "gqa": bool(features & FEATURE_GQA),
            "library": lib._name,
            "ptxas_report": (Path(lib._name).parent / "_ptxas.txt").read_text()
            if (Path(lib._name).parent / "_ptxas.txt").exists() else ""}
    return attention, attention_out, sdpa, info
