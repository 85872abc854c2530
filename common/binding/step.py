"""The step factory: a step package's public API, made when the package is imported.

steps/stepNN/pkg/__init__.py calls bind_step(__name__), which binds a Step to the package's _kernel.so and returns its
`attention`, `attention_out`, `sdpa` and `info`: the methods of the Step below, bound to that step's library (each step
registers ops of its own name, flashladder::stepNN and flashladder::stepNN_out, and keeps its own workspaces).
"""
import ctypes
import math
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from . import abi, checks
from .abi import FEATURE_CAUSAL, FEATURE_GQA
from .router import SdpaLimits, SdpaRouter


def output_like(q: torch.Tensor) -> torch.Tensor:
    """O for attention(), dense, its dimensions in memory in the order of q's (torch.empty_like): where q is a
    [batch, seqlen, heads, 128] tensor transposed, or a slice of a fused QKV one, as models pass it, O is [batch, seqlen,
    heads, 128] in memory too, and the model's transpose back to [batch, seqlen, heads * 128] is a view, not a copy; a
    contiguous q gives a contiguous O. The kernels take O's strides: a permutation of contiguous
    ones, the last dim innermost (q's is, check_inputs), so they meet the rules q's met."""
    return torch.empty_like(q, memory_format=torch.preserve_format)


class Step:
    """One step's library bound to torch: what `flashladder.<step>` offers (attention, attention_out, sdpa, info).

    The call is a real torch op (torch.library.custom_op + register_fake): it works under torch.compile(fullgraph=True)
    and inside CUDA-graph capture; it launches on the current stream and never synchronizes. Each check runs once per
    call: attention() and attention_out() check only the argument types (the op's schema would turn True into 1.0),
    the op checks everything else, so torch.ops.flashladder.<step> called directly is checked the same way (its fake
    implementation too, so torch.compile reports bad input while tracing).
    """

    def __init__(self, module_name: str):
        self.module_name = module_name
        self.step = step = module_name.rsplit(".", 1)[-1]
        self.lib = lib = abi.load_library(Path(sys.modules[module_name].__file__).resolve().parent / "_kernel.so")
        self.seqlen_multiple = (lib.flashladder_seqlen_multiple_q(), lib.flashladder_seqlen_multiple_k())  # (q, k/v)
        # The work tiles (q, k/v): exported by a step that takes any seqlen, else the multiples (common/flashladder.cuh).
        tile = ((lib.flashladder_tile_q(), lib.flashladder_tile_k()) if hasattr(lib, "flashladder_tile_q")
                else self.seqlen_multiple)
        self.archs = lib.flashladder_archs().decode().split(",")  # e.g. sm_80,...,sm_120,compute_80 (common/build_step.py)
        # Dynamic shared memory per block, exported by the steps that run on GPUs with less of it than Hopper's 227 KB.
        self.smem_bytes = lib.flashladder_smem_bytes() if hasattr(lib, "flashladder_smem_bytes") else None
        # CTA pairs, exported by the steps that run some calls in them: the seqlen_k from which the launcher takes them
        # for dense calls (with an even number of Q tiles) and for causal ones (the diagonal at or right of the top-left
        # one, a multiple of 4 Q tiles per head); None where it never does.
        pairs = ([lib.flashladder_pair_min_seqlen_k(causal) or None for causal in (0, 1)]
                 if hasattr(lib, "flashladder_pair_min_seqlen_k") else [None, None])
        # What the step takes beyond dense attention with equal heads (FEATURE_CAUSAL, FEATURE_GQA).
        self.features = lib.flashladder_features() if hasattr(lib, "flashladder_features") else 0
        # A workspace, for the steps that export its size (the split tail's partial outputs and flags): one per device
        # and stream (workspace_for).
        self.workspace_bytes = lib.flashladder_workspace_bytes if hasattr(lib, "flashladder_workspace_bytes") else None
        self.workspaces: dict = {}
        # A backward, exported by the steps that have one: attention() then has gradients (register_backward).
        self.has_backward = hasattr(lib, "flashladder_bwd")
        # Exported by the steps whose backward adds dQ up across CTAs, in any order: they take an fp32 accumulator, and
        # give the same bits every call only when asked (deterministic=True), by another way.
        self.bwd_accumulates_dq = hasattr(lib, "flashladder_bwd_accumulates_dq")
        # The head dims (q's, k's and v's last dim) of the forward and of the backward: 128 but where the library says.
        self.head_dims = abi.head_dims_of(lib)
        self.bwd_head_dims = abi.head_dims_of(lib, backward=True) if self.has_backward else ()
        # Exported by the steps that add dQ up in a fixed order when asked for the same bits: they take the accumulator
        # for deterministic calls too, with room after it for this many ints (the query tiles' turn counters).
        self.bwd_dq_turns = getattr(lib, "flashladder_bwd_dq_turns", None)
        if self.bwd_dq_turns is not None:
            self.bwd_dq_turns.restype = ctypes.c_int64
            self.bwd_dq_turns.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int)
        self.limits = SdpaLimits(step, self.seqlen_multiple, tuple(self.archs), self.smem_bytes, features=self.features,
                                 backward=self.has_backward, head_dims=self.head_dims, bwd_head_dims=self.bwd_head_dims)
        self.fwd, self.fwd_out = self.register_ops()
        self.bwd = self.register_backward() if self.has_backward else self.refuse_backward()
        # Said at import, so that it comes before torch's own error at the first CUDA call (e.g. torch.randn(device="cuda")).
        if why := checks.no_cuda_reason():  # stacklevel 4: the line that imports the step (pkg/__init__.py calls bind_step)
            warnings.warn(f"flashladder.{step}: {why}; the kernel runs on {checks.runs_on(self.archs)} with a CUDA build "
                          "of torch", stacklevel=4)
        ptxas = Path(lib._name).parent / "_ptxas.txt"
        self.info = {"step": step, "seqlen_multiple_q": self.seqlen_multiple[0], "seqlen_multiple_k": self.seqlen_multiple[1],
                     "tile_q": tile[0], "tile_k": tile[1], "pair_min_seqlen_k": pairs[0], "causal_pair_min_seqlen_k": pairs[1],
                     "workspace": self.workspace_bytes is not None,
                     "archs": self.archs, "runs_on": checks.runs_on(self.archs), "smem_bytes": self.smem_bytes,
                     "causal": bool(self.features & FEATURE_CAUSAL), "gqa": bool(self.features & FEATURE_GQA),
                     "dtypes": [str(t).removeprefix("torch.") for t in checks.dtypes_of(self.features)],
                     "head_dims": list(self.head_dims),  # q's, k's and v's last dim
                     "backward": self.has_backward, "backward_head_dims": list(self.bwd_head_dims),
                     "backward_deterministic": (None if not self.has_backward
                                                else "on request" if self.bwd_accumulates_dq else "always"),
                     "library": lib._name, "ptxas_report": str(ptxas) if ptxas.exists() else None}  # the path: print(info) stays short

    def __repr__(self):
        return f"<flashladder.{self.step}: {self.info['runs_on']}>"

    # ---------------------------------------------------------------- the public API

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                  causal=False, deterministic: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """O = softmax(q k^T * scale + mask) v and LSE = logsumexp(q k^T * scale + mask) (natural log).

        q: bf16 [batch, heads, seqlen_q, 128]; k, v: bf16 [batch, heads_k, seqlen_k, 128], on one GPU that the step
        runs on (info["archs"]); fp16 as well where info["dtypes"] says so (q, k and v of one type), and another head dim
        (q's, k's and v's last, one for all three) where info["head_dims"] says so; heads_k = heads,
        or (info["gqa"]) a divisor of it: query head h reads key/value head h // (heads // heads_k).
        causal (info["causal"]): False, or the diagonal's corner: "top_left" (SDPA's is_causal=True: row i sees keys
        0..i) or "bottom_right" (torch's causal_lower_right: row i sees keys 0..i + seqlen_k - seqlen_q). A row that
        sees no key gets o = 0 and lse = -inf.
        Returns (o: q's dtype [batch, heads, seqlen_q, 128], lse: float32 [batch, heads, seqlen_q]); o laid out in memory
        as q is (a [batch, seqlen, heads, 128] tensor transposed gives o the same; output_like).
        scale defaults to 1/sqrt(head dim). Runs on the current CUDA stream; never synchronizes.
        Gradients (info["backward"]): torch's autograd reaches q, k and v through o and lse (the step's backward, at
        the head dims of info["backward_head_dims"]); a step without one says so, in one line, when a gradient is asked
        of it. deterministic: the same gradient bits
        on every call (True) or whatever order is fastest (False); None follows torch.use_deterministic_algorithms.
        info["backward_deterministic"] says what it costs a step: "always" (nothing), "on request" (another way).
        Empty inputs (batch, heads or seqlen_q of 0) give empty outputs without a launch; with seqlen_k = 0
        every row has no key: o = 0 and lse = -inf (what softmax over nothing tends to; no launch either).
        """
        scale = checks.check_types(self.step, scale, q=q, k=k, v=v)
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        return self.fwd(q, k, v, scale, checks.check_causal(self.step, causal, self.features), bool(deterministic))

    def attention_out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                      scale: Optional[float] = None, causal=False) -> None:
        """attention(), writing into caller-provided contiguous o (q's dtype) and lse (float32)."""
        scale = checks.check_types(self.step, scale, q=q, k=k, v=v, o=o, lse=lse)
        self.fwd_out(q, k, v, o, lse, scale, checks.check_causal(self.step, causal, self.features))

    def sdpa(self, strict: bool = False, gradients: bool = True) -> SdpaRouter:
        """A drop-in for torch's SDPA: `with sdpa() as r: model(x)` sends each torch.nn.functional.scaled_dot_product_attention
        call that this step can take (CUDA, bf16 (info["dtypes"]: fp16 too), head dim 128 (info["head_dims"]: others too),
        [batch, heads, seqlen, head dim] with a contiguous last dim, equal heads (or, info["gqa"], fewer key/value heads
        with enable_gqa=True), no mask (info["causal"]: but is_causal=True or torch's causal bias), no dropout, no
        gradients needed (info["backward"]: gradients too, unless gradients=False, which leaves those calls, forward and
        backward, to torch), `scale` any positive float, the
        seqlens this step takes, a GPU it runs on) to it, and every other call to torch unchanged. r.routed counts the
        calls routed, r.fallbacks (a Counter) the others by reason; strict=True raises NotRouted for a call it cannot take
        instead. Works in eager, under torch.compile and in CUDA-graph capture (SdpaRouter says how each counts)."""
        limits = self.limits._replace(gradients=bool(gradients))
        return SdpaRouter(self.routed, limits, strict, name=f"{self.module_name}.sdpa")

    def routed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal=False) -> torch.Tensor:
        """What sdpa() calls for an SDPA call it takes: O alone, as SDPA returns it."""
        return self.fwd(q, k, v, scale, checks.check_causal(self.step, causal, self.features),
                        torch.are_deterministic_algorithms_enabled())[0]

    # ---------------------------------------------------------------- the ops and the launch

    def register_backward(self):
        """The backward op, flashladder::<step>_bwd (writes dq, dk, dv), and the forward op's autograd formula, which
        calls it: a real op, so torch.compile traces the backward graph and CUDA graphs capture it. Without a backward
        the forward op has no autograd formula, and torch raises where a gradient is asked of it."""
        step, checked, launch_bwd, head_dims = self.step, self.checked, self.launch_bwd, self.bwd_head_dims

        @torch.library.custom_op(f"flashladder::{step}_bwd", mutates_args=("dq", "dk", "dv"))
        def bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                d_o: torch.Tensor, d_lse: Optional[torch.Tensor], dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                scale: float, causal: int = 0, deterministic: bool = False) -> None:
            checked(q, k, v, None, None, scale, causal)
            checks.check_backward(step, q, k, v, o, lse, d_o, d_lse, dq, dk, dv, head_dims=head_dims)
            launch_bwd(q, k, v, o, lse, d_o, d_lse, dq, dk, dv, scale, causal, deterministic)

        @bwd.register_fake
        def _(q, k, v, o, lse, d_o, d_lse, dq, dk, dv, scale, causal=0, deterministic=False):
            checked(q, k, v, None, None, scale, causal, devices=("cuda", "meta"))
            checks.check_backward(step, q, k, v, o, lse, d_o, d_lse, dq, dk, dv, devices=("cuda", "meta"), head_dims=head_dims)

        def setup_context(ctx, inputs, output):
            q, k, v, scale, causal, deterministic = inputs
            ctx.save_for_backward(q, k, v, *output)
            ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic

        def backward(ctx, d_o, d_lse):
            q, k, v, o, lse = ctx.saved_tensors
            # autograd may hand a gradient of any layout (an expanded scalar's has stride 0, a slice any offset): the
            # kernels read dO's rows as they read q's (checks.check_inputs' rules: a contiguous last dim, strides and
            # offset in multiples of 8 elements, 16 bytes), so anything else is copied once.
            if d_o is None:
                d_o = torch.zeros_like(o)
            elif (d_o.stride(-1) != 1 or 0 in d_o.stride() or d_o.storage_offset() % 8
                  or any(s % 8 for s in abi.kernel_strides(d_o))):
                d_o = d_o.contiguous()
            d_lse = None if d_lse is None else d_lse.to(torch.float32).contiguous()
            dq, dk, dv = output_like(q), output_like(k), output_like(v)
            bwd(q, k, v, o, lse, d_o, d_lse, dq, dk, dv, ctx.scale, ctx.causal, ctx.deterministic)
            return dq, dk, dv, None, None, None

        self.fwd.register_autograd(backward, setup_context=setup_context)
        return bwd

    def refuse_backward(self) -> None:
        """The forward op's autograd formula in a step without a backward: a gradient asked of it raises, saying so
        (rather than torch's "no autograd formula was registered"). The forward itself runs, grad mode or not."""
        step = self.step

        def backward(ctx, d_o, d_lse):
            raise RuntimeError(f"flashladder.{step} computes no backward (info['backward'] is False): gradients come "
                               "from step23 on; or run the forward under torch.no_grad()")

        self.fwd.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)

    def launch_bwd(self, q, k, v, o, lse, d_o, d_lse, dq, dk, dv, scale: float, causal: int,
                   deterministic: bool = False) -> None:
        """One backward call of the library on checked tensors, on the current stream."""
        if q.numel() == 0 or k.shape[2] == 0:  # no query, or no key: every gradient is 0 (nothing reads anything)
            for t in (dq, dk, dv):
                t.zero_()
            return
        checks.check_gradients_apart(self.step, dict(dq=dq, dk=dk, dv=dv),
                                     dict(q=q, k=k, v=v, o=o, lse=lse, d_o=d_o, d_lse=d_lse))
        checks.check_launch(self.step, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, self.archs, self.smem_bytes)
        with torch.cuda.device(q.device):
            stream = torch.cuda.current_stream(q.device).cuda_stream
            delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)  # D = rowsum(dO * O) - dLSE
            turns = self.bwd_dq_turns(*q.shape[:3]) if deterministic and self.bwd_dq_turns is not None else 0
            dq_accum = (torch.empty(q.numel() + turns, dtype=torch.float32, device=q.device)  # zeroed by the library
                        if self.bwd_accumulates_dq and (not deterministic or self.bwd_dq_turns is not None) else None)
            params = abi.make_bwd_params(q, k, v, o, lse, d_o, d_lse, delta, dq, dk, dv, scale, causal,
                                         dq_accum, deterministic)
            err = self.lib.flashladder_bwd(ctypes.byref(params), ctypes.c_void_p(stream))
        if err != 0:
            raise RuntimeError(f"flashladder.{self.step}: backward launch failed: "
                               f"{self.lib.flashladder_error_string(err).decode()} (cudaError {err})")

    def register_ops(self):
        """The step's ops, flashladder::<step> (returns o, lse) and flashladder::<step>_out (writes them), each with its
        fake implementation (metadata only: what torch.compile traces with). The forward op's `deterministic` is kept
        for its backward (register_backward), which alone reads it. No device_types: the op takes tensors on
        any device, so that a CPU tensor meets check_inputs' clear message instead of the dispatcher's "could not run
        ... with arguments from the 'CPU' backend"."""
        checked, launch = self.checked, self.launch

        @torch.library.custom_op(f"flashladder::{self.step}", mutates_args=())
        def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                causal: int = 0, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            checked(q, k, v, None, None, scale, causal)
            o = output_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            launch(q, k, v, o, lse, scale, causal)
            return o, lse

        @fwd.register_fake
        def _(q, k, v, scale, causal=0, deterministic=False):
            checked(q, k, v, None, None, scale, causal, devices=("cuda", "meta"))
            return output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

        @torch.library.custom_op(f"flashladder::{self.step}_out", mutates_args=("o", "lse"))
        def fwd_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, scale: float,
                    causal: int = 0) -> None:
            checked(q, k, v, o, lse, scale, causal)
            launch(q, k, v, o, lse, scale, causal)

        @fwd_out.register_fake
        def _(q, k, v, o, lse, scale, causal=0):
            checked(q, k, v, o, lse, scale, causal, devices=("cuda", "meta"))

        return fwd, fwd_out

    def checked(self, q, k, v, o, lse, scale: float, causal: int, devices=("cuda",)) -> None:
        """The op's checks of its arguments (the scale, the causal code, the tensors' metadata)."""
        checks.check_scale(self.step, scale)
        checks.check_causal_code(self.step, causal, self.features)
        checks.check_inputs(self.step, self.seqlen_multiple, q, k, v, o, lse, devices=devices, features=self.features,
                            head_dims=self.head_dims)

    def launch(self, q, k, v, o, lse, scale: float, causal: int) -> None:
        """One call of the library on checked tensors, on the current stream: the checks only real tensors on a real
        GPU allow first (checks.check_outputs_apart, checks.check_launch)."""
        if q.numel() == 0:  # batch, heads or seqlen_q is 0: nothing to compute (as SDPA: empty outputs)
            return
        tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse}
        checks.check_outputs_apart(self.step, tensors)
        if k.shape[2] == 0:  # no key at all: verify/reference.py's convention for a row with no key
            o.zero_()
            lse.fill_(-math.inf)
            return
        checks.check_launch(self.step, tensors, self.archs, self.smem_bytes)
        with torch.cuda.device(q.device):
            stream = torch.cuda.current_stream(q.device).cuda_stream
            params = abi.make_params(q, k, v, o, lse, scale, causal, self.workspace_for(q.device, stream))
            err = self.lib.flashladder_fwd(ctypes.byref(params), ctypes.c_void_p(stream))
        if err != 0:
            raise RuntimeError(f"flashladder.{self.step}: kernel launch failed: "
                               f"{self.lib.flashladder_error_string(err).decode()} (cudaError {err})")

    def workspace_for(self, device: torch.device, stream: int) -> Optional[int]:
        """The address of the step's workspace for calls on `stream` (None for a step without one). One per device and
        stream, zeroed when made, and left zero by every call (eager calls on one stream run one after another). Never
        during a CUDA graph's capture: a graph replayed on another stream, or beside eager calls, would share the
        stream's workspace with them, so a captured call runs without one (and without the split tail). Made on a
        stream of its own, which the call's stream then waits for: torch.compile's CUDA graphs route the allocations
        of the stream they warm up on into their private pool, where a tensor kept for good would be overwritten."""
        if self.workspace_bytes is None or torch.cuda.is_current_stream_capturing():
            return None
        key = (device.index, stream)
        if key not in self.workspaces:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            maker = torch.cuda.Stream(device)
            with torch.cuda.stream(maker):
                self.workspaces[key] = torch.zeros(self.workspace_bytes(sms), dtype=torch.uint8, device=device)
            torch.cuda.current_stream(device).wait_stream(maker)
        return self.workspaces[key].data_ptr()


def bind_step(module_name: str):
    """The public API of the step package `module_name` (e.g. 'flashladder.step01'): (attention, attention_out, sdpa,
    info) of a Step bound to the package's library."""
    step = Step(module_name)
    return step.attention, step.attention_out, step.sdpa, step.info
