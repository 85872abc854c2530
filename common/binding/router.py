"""The SDPA drop-in: `with step.sdpa(): model(x)`.

A model calls torch.nn.functional.scaled_dot_product_attention (SDPA); inside `with flashladder.stepNN.sdpa():`
each call that the step can take goes to the step's op instead, and every other call to torch, unchanged.
The mechanism is a torch function mode (torch.overrides.TorchFunctionMode): torch hands every call of a torch
function to the innermost active mode first, however the function was imported (F.scaled_dot_product_attention,
torch._C._nn.scaled_dot_product_attention: the same function), and torch.compile traces through modes.

The decision is one pure function of the call's metadata (route_reason): shapes, strides, dtypes, devices and the
other arguments, all plain constants (describe), so that the same code decides in eager, under torch.compile
(where the tensors are fake and the decision is taken once, while tracing; the compiled code then runs the op
or SDPA without asking again) and during CUDA-graph capture (where the captured call is what every replay runs).
It reuses the checks the step's op makes (check_inputs, check_scale, check_device), on meta tensors of the same
metadata, so the router and the op cannot disagree.
"""
import collections
import contextlib
import math
import numbers
import operator
import threading
from typing import NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import checks
from .abi import FEATURE_CAUSAL, FEATURE_GQA, HEAD_DIM

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
    backward: bool = False       # gradients through it (info["backward"]): calls that need them are routed too ...
    gradients: bool = True       # ... unless the drop-in was asked to leave them to torch (sdpa(gradients=False))
    head_dims: tuple = (HEAD_DIM,)      # the last dims of q, k and v it takes (info["head_dims"]) ...
    bwd_head_dims: tuple = (HEAD_DIM,)  # ... and those its backward takes (info["backward_head_dims"])


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


CHECKPOINTED = ("gradients are needed inside activation checkpointing (saved-tensor hooks are active): its recompute in "
                "the backward would not reach the drop-in, a torch function mode, so the call stays with torch (give "
                "the checkpoint the router's contexts: router.checkpoint)")


def route_reason(call: Optional[dict], limits: SdpaLimits, grad_enabled: bool,
                 checkpointed: bool = False) -> Optional[str]:
    """Why the kernel of `limits` cannot take this SDPA call, in one line; None when it can.

    `call`: sdpa_arguments(...) with every value passed through describe(); `grad_enabled`: torch.is_grad_enabled();
    `checkpointed`: saved_tensor_hooks_active().
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
        if not limits.backward:
            return "gradients are needed: the step computes no backward (run the model under torch.no_grad())"
        if not limits.gradients:
            return "gradients are needed: sdpa(gradients=False) leaves such calls to torch"
        if checkpointed:
            return CHECKPOINTED
        if len(q.shape) == 4 and q.shape[-1] in limits.head_dims and q.shape[-1] not in limits.bwd_head_dims:
            return (f"gradients are needed at head dim {q.shape[-1]}: the step's backward takes "
                    f"{' or '.join(map(str, limits.bwd_head_dims))} (run the model under torch.no_grad())")
    try:
        checks.check_scale(limits.step, checks.check_types(limits.step, call["scale"]))
        # The op's own checks of the tensors, on meta tensors of the same shapes, strides and dtypes.
        stand_ins = [torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device="meta") for t in (q, k, v)]
        checks.check_inputs(limits.step, limits.seqlen_multiple, *stand_ins, devices=("meta",), features=limits.features,
                            head_dims=limits.head_dims)
        if q.device.type == "cuda" and limits.archs is not None:  # the GPU: the library has code for it, and the memory
            index = q.device.index if q.device.index is not None else torch.cuda.current_device()
            checks.check_device(limits.step, list(limits.archs), limits.smem_bytes, checks.device_props(index),
                                f"cuda:{index}")
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


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active, as inside non-reentrant activation checkpointing
    (torch.utils.checkpoint.checkpoint(use_reentrant=False), diffusers' and transformers' gradient checkpointing).
    There the region's forward runs again in the backward, where no torch function mode is active (torch 2.13): a
    call routed in the forward would meet torch's SDPA in the recompute (torch.utils.checkpoint.CheckpointError). The
    reentrant kind runs its forward without gradients, which the router routes as a forward alone. False while
    torch.compile traces (it cannot read the hooks)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and not torch.compiler.is_compiling() and top(False) is not None


# The routers (by key) whose checkpointed regions are recomputed under a router of the same key: the checkpoint was
# given router.checkpoint_contexts. Per thread, as the torch function modes are: the recompute runs in the autograd
# engine's thread, and enters its own there.
_recomputed = threading.local()


def _recompute_routed(key: str) -> bool:
    return key in getattr(_recomputed, "keys", ())


@contextlib.contextmanager
def _routes_its_recompute(key: str):
    """Inside: checkpointed calls of the router `key` are routed, since the recompute will be too."""
    keys = _recomputed.__dict__.setdefault("keys", [])
    keys.append(key)
    try:
        yield
    finally:
        keys.remove(key)


def _decide(key: str, described: Optional[tuple], grad_enabled: bool, checkpointed: bool = False) -> Optional[str]:
    """route_reason for the router `key`, counted in the innermost active router of that key; strict raises.

    Under torch.compile this runs as plain Python while tracing, once per traced call (SdpaRouter marks it with
    torch.compiler.assume_constant_result: its result becomes a constant of the compiled code), so its counting is
    real and the compiled code carries no trace of it. Its arguments are constants for that reason."""
    limits, strict, name = _SETTINGS[key]
    reason = route_reason(None if described is None else dict(described), limits, grad_enabled, checkpointed)
    router = next((r for r in reversed(_active_routers()) if r.key == key), None)
    if router is not None:
        if reason is None:
            router.routed += 1
        else:
            router.fallbacks[reason] += 1
    if reason is not None and strict:
        raise NotRouted(f"{name}(strict=True): a scaled_dot_product_attention call would fall back to torch: {reason}")
    return reason


def checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs) with the contexts of the innermost
    SDPA drop-in active in this thread (SdpaRouter.checkpoint): the region's SDPA calls that need gradients go to the
    step in the forward and in the recompute. Without an active drop-in, torch's checkpoint as it is. A model's
    checkpointing function can call it whichever drop-in a step is run under, e.g. diffusers':
    model.enable_gradient_checkpointing(lambda module, *args: checkpoint(module.__call__, *args))."""
    routers = _active_routers()
    if routers:
        return routers[-1].checkpoint(function, *args, **kwargs)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


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
        self.recomputed = 0  # calls routed again in a checkpoint's recompute (checkpoint_contexts), not in `routed`
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

    # ---- activation checkpointing ----
    def checkpoint_contexts(self):
        """torch.utils.checkpoint's context_fn (non-reentrant: use_reentrant=False): the region's forward routes its SDPA
        calls that need gradients, and its recompute in the backward, where this router is not active (torch function
        modes are per thread, and the backward runs in autograd's), runs under a router of the same step and settings,
        which routes them the same way (counted in `recomputed` of the router of that key active in the forward). Without
        it such calls stay with torch (CHECKPOINTED). E.g. transformers:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
        "context_fn": router.checkpoint_contexts})."""
        owner = next((r for r in reversed(_active_routers()) if r.key == self.key), None)  # counts the recompute
        if owner is None:  # no such drop-in in the forward: it went to torch, and so must the recompute
            return contextlib.nullcontext(), contextlib.nullcontext()
        return _routes_its_recompute(self.key), owner._recompute()

    @contextlib.contextmanager
    def _recompute(self):
        again = SdpaRouter(self.attention, self.limits, self.strict, self.name)
        try:
            with _routes_its_recompute(self.key), again:
                yield
        finally:  # torch stops a recompute early by raising through its context (checkpoint's early_stop)
            self.recomputed += again.routed
            self.fallbacks.update(again.fallbacks)

    def checkpoint(self, function, *args, **kwargs):
        """torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=self.checkpoint_contexts,
        **kwargs): a checkpointed region whose SDPA calls go to the step in the forward and in the recompute. E.g.
        diffusers: model.enable_gradient_checkpointing(lambda module, *args: router.checkpoint(module.__call__, *args))."""
        from torch.utils.checkpoint import checkpoint
        return checkpoint(function, *args, use_reentrant=False, context_fn=self.checkpoint_contexts, **kwargs)

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
        checkpointed = saved_tensor_hooks_active() and not _recompute_routed(self.key)
        if _decide(self.key, described, torch.is_grad_enabled(), checkpointed) is not None:
            return func(*args, **kwargs)
        scale, mask = call["scale"], describe(call["attn_mask"])
        causal = mask.alignment if isinstance(mask, CausalMask) else "top_left" if call["is_causal"] else False
        return self.attention(call["query"], call["key"], call["value"],
                              1.0 / math.sqrt(call["query"].shape[-1]) if scale is None else float(scale), causal=causal)

