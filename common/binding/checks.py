"""The checks before a launch: the arguments' types, the tensors' metadata (what the kernels rely on), the scale and
the causal mask, the GPU (the library holds code for it, and enough shared memory per block), the pointers'
alignment, outputs that overlap inputs; and what this machine lacks to run a kernel at all. Each raises in one line,
naming the step, the argument and what to do."""
import ctypes
import functools
import math
import numbers
import os
import re
import struct
from typing import NamedTuple, Optional

import torch

from .abi import CAUSAL, FEATURE_CAUSAL, FEATURE_FP16, FEATURE_GQA, HEAD_DIM, kernel_strides

MAX_GRID_YZ = 65535  # heads and batch are the grid's y and z dimensions
MAX_ROW_STRIDE = 2**24  # in-tile offsets (row < 128) * row stride stay below 2^31
ALIGN = {"q": 16, "k": 16, "v": 16, "o": 16, "lse": 4}  # bytes: 16-byte vector copies of rows; lse is per float


def check_types(step: str, scale, **tensors) -> float:
    """What the op's schema cannot say clearly: the arguments' Python types (the schema turns True into 1.0).
    Returns the scale as a float, None -> 1/sqrt(head dim) (q's last dim; 128 without a q); its value is the op's to
    check (check_scale)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashladder.{step}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if scale is None:
        q = tensors.get("q")
        return 1.0 / math.sqrt(q.shape[-1] if q is not None and q.dim() > 0 and q.shape[-1] > 0 else HEAD_DIM)
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


def dtypes_of(features: int) -> tuple:
    """The input types a step takes: bf16, and fp16 where it has FEATURE_FP16 (O comes in q's type, the LSE in fp32)."""
    return (torch.bfloat16, torch.float16) if features & FEATURE_FP16 else (torch.bfloat16,)


def head_dim_hint(head_dim: int) -> str:
    """Where the ladder first takes a head dim other than 128, for an error that refuses it."""
    return " (64: step41 on)" if head_dim == 64 else ""


def check_inputs(step: str, seqlen_multiple: tuple, q, k, v, o=None, lse=None, devices=("cuda",), features: int = 0,
                 head_dims: tuple = (HEAD_DIM,)) -> None:
    """Everything about the tensors' metadata that the kernel relies on. Raises, naming the problem.
    `head_dims`: the last dims the step takes (q, k and v alike; abi.head_dims_of).

    Works on fake tensors too (torch.compile traces it; `devices` then also admits meta tensors); pointer
    alignment, overlaps and the GPU's architecture are checked at launch (check_launch). Empty inputs (batch,
    heads or a seqlen of 0) pass: the op returns without a launch.
    """
    where = f"flashladder.{step}"
    named = {"q": q, "k": k, "v": v}
    dtypes = dtypes_of(features)
    for name, t in named.items():
        if t.dim() != 4:
            raise ValueError(f"{where}: {name} must be 4-D [batch, heads, seqlen, head dim], got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            takes = " or ".join(map(str, dtypes)) if len(dtypes) > 1 else f"{dtypes[0]} only"
            later = " (fp16: step40 on)" if t.dtype == torch.float16 else ""
            raise TypeError(f"{where}: {name} has dtype {t.dtype}; this step computes in {takes}{later}")
        if t.shape[-1] not in head_dims:
            takes = " or ".join(map(str, head_dims))
            raise ValueError(f"{where}: {name} has head dim {t.shape[-1]} (shape {tuple(t.shape)}); this step takes "
                             f"{takes}{head_dim_hint(t.shape[-1])}")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(f"{where}: q, k and v must share one head dim, got shapes {tuple(q.shape)}, {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{where}: q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
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
        if o.shape != q.shape or o.dtype != q.dtype or not o.is_contiguous():
            raise ValueError(f"{where}: o must be a contiguous tensor of q's dtype and shape ({q.dtype}, {tuple(q.shape)}), "
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


def check_backward(step: str, q, k, v, o, lse, d_o, d_lse, dq, dk, dv, devices=("cuda",),
                   head_dims: tuple = (HEAD_DIM,)) -> None:
    """The backward's tensors beside the forward's q, k, v (check_inputs has seen those): a head dim of the backward's
    (`head_dims`: abi.head_dims_of(lib, backward=True)); o and d_o of q's shape, dq, dk and dv of q's, k's and v's, all
    of q's dtype with a contiguous last dim; lse and d_lse (None: no gradient reaches the LSE) float32
    [batch, heads, seqlen_q], contiguous; all on q's device. Raises, naming the problem."""
    where = f"flashladder.{step}"
    if q.shape[-1] not in head_dims:
        raise ValueError(f"{where}: the backward takes head dim {' or '.join(map(str, head_dims))}, this call's is "
                         f"{q.shape[-1]} (the forward takes it: run it under torch.no_grad(), or detach q, k and v)")
    for name, t, like in (("o", o, q), ("d_o", d_o, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t.shape != like.shape or t.dtype != q.dtype or t.stride(-1) != 1 or 0 in t.stride():
            raise ValueError(f"{where}: {name} must be a {q.dtype} tensor of shape {tuple(like.shape)} with a contiguous "
                             f"last dim, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    for name, t in (("lse", lse), ("d_lse", d_lse)):
        if t is not None and (t.shape != q.shape[:3] or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"{where}: {name} must be a contiguous float32 tensor of shape {tuple(q.shape[:3])}, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    for name, t in dict(o=o, lse=lse, d_o=d_o, d_lse=d_lse, dq=dq, dk=dk, dv=dv).items():
        if t is not None and (t.device.type not in devices or t.device != q.device):
            raise ValueError(f"{where}: {name} is on {t.device}, q on {q.device}: all tensors must be on one CUDA device")


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


def check_gradients_apart(step: str, outputs: dict, inputs: dict) -> None:
    """The backward's outputs (dq, dk, dv) may not share memory with its inputs or with each other."""
    names = list(outputs)
    for n, out in enumerate(names):
        lo, hi = _span(outputs[out])
        for name, t in [*((x, outputs[x]) for x in names[n + 1:]), *inputs.items()]:
            a, b = _span(t) if t is not None else (0, 0)
            if lo < b and a < hi:
                raise ValueError(f"flashladder.{step}: {out} overlaps {name} in memory; gradients need buffers of their own")


def check_launch(step: str, tensors: dict, archs: list, smem_bytes: Optional[int]) -> None:
    """What only real tensors on a real GPU can tell: the GPU (check_device) and the pointers' alignment."""
    q = tensors["q"]
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    check_device(step, archs, smem_bytes, device_props(index), f"cuda:{index}")
    for tname, t in tensors.items():
        if t.data_ptr() % ALIGN[tname] != 0:
            raise ValueError(f"flashladder.{step}: {tname}'s data pointer is not {ALIGN[tname]}-byte aligned "
                             "(a view at an odd offset?); call .contiguous() first")


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
