"""python -m verify.capstone --cp ulysses|ring --gpus N: the final step inside diffusers' context parallelism (issue 19).

    torchrun --standalone --nproc-per-node 4 -m verify.capstone --cp ulysses --gpus 4
    torchrun --standalone --nproc-per-node 4 -m verify.capstone --cp ring --gpus 4
    torchrun --standalone --nproc-per-node 2 -m verify.capstone --cp ring --gpus 2 --quick   # a smoke run

The capstone's Wan2.1-T2V-1.3B denoiser (verify/models.py: its configuration, seeded random weights, inputs), one
forward timed at 32760 tokens (480p, 81 frames) and 75600 (720p, 81 frames: a 21 x 90 x 160 latent grid, 21 x 45 x 80
patches), on one GPU and on N through diffusers' own context parallelism (`model.enable_parallelism(config=
ContextParallelConfig(ulysses_degree=N))` or `ring_degree=N`), nothing of diffusers patched:

  * Ulysses: an all-to-all gives each rank whole sequences of 12/N heads; diffusers' default attention backend,
    `native`, then calls torch's scaled_dot_product_attention on each rank's share, so the step's SDPA drop-in
    (`with step.sdpa(strict=True):`) serves it as it is.
  * Ring: each rank keeps 1/N of the queries and meets every rank's K/V shard in turn, merging the partial results
    by their log-sum-exp. diffusers asks the attention op for that LSE (return_lse=True); its `native` backend refuses
    ("Native attention does not support return_lse=True"), its `_native_cudnn` backend (chosen with
    model.set_attention_backend("_native_cudnn")) calls torch.ops.aten._scaled_dot_product_cudnn_attention and reads
    the output and the LSE from that op's result. `ring_sdpa(step)` (CudnnRouter, below) is a torch function mode that
    takes those aten calls the step can compute and answers them in the op's own result format with the step's O and
    LSE; it is also the step's SDPA drop-in, for the calls diffusers makes without context parallelism (Wan's
    cross-attention, whose 512 text tokens are not split).

Rank 0 first runs the one-GPU rows (SDPA's default, SDPA forced to cuDNN for ring's baseline, the step through its
drop-in) while the others wait; then every rank builds the same model, enables the parallelism, and runs the N-GPU
rows: diffusers' backend as it is (Ulysses: `native`, i.e. SDPA's default; ring: `_native_cudnn`, i.e. cuDNN) and the
step. Each row: a first forward (the router's counts are its decisions), warm-up forwards, timed ones (CUDA events on
every rank; the row's time is the slowest rank's median). Every output is compared with the one-GPU SDPA default's.
Eager only. Writes results/<gpu>/cp-<mode>-<N>gpu-<timestamp>.json (--quick: under build/capstone/).

merge_partials and sharded_attention are the ring's arithmetic as a function of its own: partial attentions over
disjoint key sets merged by their LSE (the CPU tests check them against the float64 reference, the GPU tests with the
step's shards).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from verify import models
from verify import steps as steps_mod

PROG = "python -m verify.capstone --cp"
MODES = ("ulysses", "ring")
# tokens -> the latent grid (frames x height x width of the latents): 480p and 720p, 81 frames, as Wan's VAE makes them
# (4x in time after the first frame, 8x in space); the transformer's 1x2x2 patchify gives 21 x 30 x 52 = 32760 and
# 21 x 45 x 80 = 75600 tokens.
SHAPES = {32760: (21, 60, 104), 75600: (21, 90, 160)}
QUICK_GRID = (4, 32, 32)  # 1024 tokens: divides among 2, 4 or 8 ranks
SKIP = "skip"  # shard_causal: a key shard that no query row sees
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
CUDNN_PARAMETERS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask")
CUDNN_DEFAULTS = {"dropout_p": 0.0, "is_causal": False, "return_debug_mask": False, "scale": None}


# ---------------------------------------------------------------- the ring's arithmetic

def merge_partials(parts, dtype=None):
    """Attention over a union of disjoint key sets, from each set's partial result: parts = [(o_i, lse_i)], o_i
    [..., N, D], lse_i [..., N] the natural-log LSE of that set's scores (a row that sees no key of it: lse_i = -inf,
    o_i then unread). Returns (o, lse): lse = log(sum_i exp(lse_i)), o = sum_i exp(lse_i - lse) o_i, computed in
    float32 shifted by each row's largest lse_i (no overflow, whatever the scores' size); a row that sees no key in any
    part gets o = 0 and lse = -inf (verify/reference.py's convention). o comes back in `dtype` (default: the first
    part's), lse in float32."""
    import torch
    if not parts:
        raise ValueError("merge_partials: no partial results to merge")
    shape = tuple(parts[0][0].shape)
    for o_i, lse_i in parts:
        if tuple(o_i.shape) != shape or tuple(lse_i.shape) != shape[:-1]:
            raise ValueError(f"merge_partials: every part must be o {shape} with lse {shape[:-1]}, got "
                             f"{tuple(o_i.shape)} and {tuple(lse_i.shape)}")
    lses = torch.stack([lse_i.float() for _, lse_i in parts])
    top = lses.amax(dim=0)
    keyless = torch.isneginf(top)  # no part has a key for this row
    weights = torch.exp(lses - torch.where(keyless, 0.0, top))  # <= 1; 0 for a part without keys for the row
    total = weights.sum(dim=0)  # >= 1 where a row has a key: its largest part weighs exp(0)
    o = torch.zeros(shape, dtype=torch.float32, device=parts[0][0].device)
    for (o_i, _), w in zip(parts, weights):
        w = w.unsqueeze(-1)
        o += torch.where(w > 0, w * o_i.float(), 0.0)  # a part's o where it has no key is no number to use
    o = torch.where(keyless.unsqueeze(-1), 0.0, o / torch.where(keyless, 1.0, total).unsqueeze(-1))
    lse = torch.where(keyless, -math.inf, top + torch.log(total))
    return o.to(parts[0][0].dtype if dtype is None else dtype), lse


def shard_causal(nq: int, start: int, length: int, offset: int):
    """How a causal call's mask looks from one key shard, the keys [start, start + length) of the call's, when its row i
    sees key j iff j <= i + offset (offset 0: top left; seqlen_k - seqlen_q: bottom right). In the shard's own indices
    row i sees key j' iff j' <= i + offset - start: False when every row sees every key of the shard (a ring's shard
    before the queries' own), "top_left" or "bottom_right" when that diagonal is one of the step's (a ring's own
    shard: both, it is square), SKIP when no row sees any of its keys (a shard after the queries'), None for any
    other diagonal (the step cannot compute it in one call)."""
    d = offset - start
    if length == 0 or nq == 0 or d + nq - 1 < 0:
        return SKIP
    if d >= length - 1:
        return False
    if d == 0:
        return "top_left"
    if d == length - nq:
        return "bottom_right"
    return None


def sharded_attention(attention, q, k, v, sizes, scale=None, causal=False, dtype=None):
    """attention(q, k, v, scale, causal) over k, v split along the keys into shards of `sizes` (summing to seqlen_k),
    one partial call per shard (its causal alignment from shard_causal; a shard no row sees is not called: it adds a
    part of -inf), merged by merge_partials: what a ring computes for one rank's queries. attention: (q, k, v, scale,
    causal=False | "top_left" | "bottom_right") -> (o, lse), e.g. a step's `attention`. Returns (o, lse)."""
    import torch
    nq, nk = q.shape[2], k.shape[2]
    if sum(sizes) != nk or any(n < 0 for n in sizes):
        raise ValueError(f"sharded_attention: shard sizes {list(sizes)} do not split {nk} keys")
    offset = 0 if causal in (False, None, "top_left") else nk - nq
    if causal not in (False, None, "top_left", "bottom_right"):
        raise ValueError(f"sharded_attention: causal={causal!r}: give False, 'top_left' or 'bottom_right'")
    parts, start = [], 0
    for n in sizes:
        how = shard_causal(nq, start, n, offset) if causal else False
        if how is None:
            raise ValueError(f"sharded_attention: the keys [{start}, {start + n}) of a {causal} call of {nq} x {nk} need "
                             "a diagonal that is neither top left nor bottom right")
        if how == SKIP:
            parts.append((torch.zeros(q.shape[:3] + v.shape[3:], dtype=q.dtype, device=q.device),
                          torch.full(q.shape[:3], -math.inf, device=q.device)))
        else:
            parts.append(attention(q, k[:, :, start:start + n], v[:, :, start:start + n], scale, causal=how))
        start += n
    return merge_partials(parts, dtype)


# ---------------------------------------------------------------- the ring drop-in: aten's cuDNN attention op

def cudnn_op():
    """torch.ops.aten._scaled_dot_product_cudnn_attention, the op diffusers' `_native_cudnn` backend calls."""
    import torch
    return torch.ops.aten._scaled_dot_product_cudnn_attention


def cudnn_arguments(args: tuple, kwargs: dict):
    """The cuDNN op's arguments by name, defaults filled in (its schema: query, key, value, attn_bias,
    compute_log_sumexp, dropout_p=0., is_causal=False, return_debug_mask=False, *, scale=None); None where they do not
    bind (torch then raises its own error)."""
    if len(args) > len(CUDNN_PARAMETERS):
        return None
    call = dict(zip(CUDNN_PARAMETERS, args))
    for name, value in kwargs.items():
        if name in call or name not in (*CUDNN_PARAMETERS, "scale"):
            return None
        call[name] = value
    if any(name not in call for name in CUDNN_PARAMETERS[:5]):
        return None
    return {**CUDNN_DEFAULTS, **call}


@functools.lru_cache(maxsize=None)
def cudnn_lse_has_trailing_dim() -> bool:
    """Whether this torch's cuDNN op returns its LSE as [B, H, N, 1] (torch >= 2.9) rather than [B, H, N]: asked of
    the op's own meta kernel, so the answer is this torch's, whatever its version."""
    import torch
    q = torch.empty(1, 1, 8, 128, dtype=torch.bfloat16, device="meta")
    lse = cudnn_op()(q, q, q, None, True)[1]
    return lse.dim() == 4


def cudnn_result(o, lse, q, k):
    """(o, lse) of one attention call in the cuDNN op's result format: (output, logsumexp, cum_seq_q, cum_seq_k, max_q,
    max_k, philox_seed, philox_offset, debug_attn_mask), as its meta kernel makes it: the LSE float32 [B, H, N, 1] (or
    [B, H, N] where this torch's op has no trailing dim), no cumulative sequence lengths (dense batches), the
    seqlens, a seed and offset of 0 (no dropout), no debug mask. diffusers reads the output and the LSE, and keeps the
    rest for a backward that inference never runs."""
    import torch
    if cudnn_lse_has_trailing_dim():
        lse = lse.unsqueeze(-1)
    seed = torch.zeros((), dtype=torch.long, device=q.device)
    return o, lse, None, None, q.shape[2], k.shape[2], seed, torch.zeros_like(seed), None


@functools.lru_cache(maxsize=None)
def router_class(binding):
    """CudnnRouter for one binding module (each step package holds its own copy of common/binding/, and so its own
    SdpaRouter class): an SdpaRouter that takes the cuDNN op's calls too."""

    import torch

    class CudnnRouter(binding.SdpaRouter):
        """`with router:` sends each torch.ops.aten._scaled_dot_product_cudnn_attention call that `attention` can take
        to it and answers it in the op's result format (cudnn_result), and each SDPA call as the step's SDPA drop-in
        does (SdpaRouter); every other call goes to torch unchanged. A cuDNN op call is decided by the SDPA drop-in's
        own rules (binding.route_reason: bf16, head dim 128, no mask, no dropout, no gradients needed, is_causal only
        where the step has causal masks, the seqlens and GPU the step takes), with three more: return_debug_mask=True
        falls back (the step has no attention matrix to return), any attn_bias does (torch's causal biases too), and
        is_causal with seqlen_q != seqlen_k does (the corner the op means there is unchecked; with equal lengths
        both corners are one). Counted in
        `routed` and `fallbacks` with the SDPA calls (by this router itself: nested routers of its kind are not
        looked for); strict=True raises NotRouted for a call it cannot take. Tried in eager alone (the context-parallel
        capstone is eager): under torch.compile its cuDNN path is untried."""

        def __init__(self, attention, limits, strict=False, name=None):
            super().__init__(lambda q, k, v, scale, causal=False: attention(q, k, v, scale, causal=causal)[0], limits,
                             strict, name)
            self.attention_lse = attention  # (q, k, v, scale, causal) -> (o, lse)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            op = cudnn_op()
            if func is not op and func is not op.default:
                return super().__torch_function__(func, types, args, kwargs)
            kwargs = kwargs or {}
            call = cudnn_arguments(args, kwargs)
            reason = self.cudnn_reason(call, torch.is_grad_enabled())
            if reason is None:
                self.routed += 1
            else:
                self.fallbacks[reason] += 1
                if self.strict:
                    raise binding.NotRouted(f"{self.name}(strict=True): a cuDNN attention call "
                                            f"(aten._scaled_dot_product_cudnn_attention) would fall back to torch: {reason}")
                return func(*args, **kwargs)
            q, k, v = call["query"], call["key"], call["value"]
            scale = 1.0 / math.sqrt(binding.HEAD_DIM) if call["scale"] is None else float(call["scale"])
            o, lse = self.attention_lse(q, k, v, scale, causal="top_left" if call["is_causal"] else False)
            return cudnn_result(o, lse, q, k)

        def cudnn_reason(self, call, grad_enabled):
            """Why the step cannot take this cuDNN op call (binding.route_reason's words), or None."""
            if call is None:
                return "the arguments do not bind to the cuDNN attention op's parameters"
            if call["return_debug_mask"] is not False:
                return f"return_debug_mask={call['return_debug_mask']!r}: the step returns no attention matrix"
            if call["attn_bias"] is not None:  # torch's causal biases included: the answer would ignore them
                return "attn_bias is given: the ring drop-in takes the cuDNN op without a bias"
            q, k = call["query"], call["key"]
            if call["is_causal"] and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4 \
                    and q.shape[2] != k.shape[2]:
                return "is_causal with seqlen_q != seqlen_k: which corner the cuDNN op means there is unchecked"
            as_sdpa = {"query": call["query"], "key": call["key"], "value": call["value"], "attn_mask": call["attn_bias"],
                       "dropout_p": call["dropout_p"], "is_causal": call["is_causal"], "scale": call["scale"],
                       "enable_gqa": False}
            return binding.route_reason({n: binding.describe(x) for n, x in as_sdpa.items()}, self.limits, grad_enabled)

    CudnnRouter.__qualname__ = CudnnRouter.__name__
    return CudnnRouter


def make_ring_router(binding, attention, limits, strict: bool = False, name: str | None = None):
    """A CudnnRouter of `binding` (common/binding, of which each step package holds a copy) for `attention` ((q, k, v,
    scale, causal) -> (o, lse)) within `limits` (binding.SdpaLimits)."""
    return router_class(binding)(attention, limits, strict, name or f"flashladder.{limits.step}.ring_sdpa")


def ring_sdpa(step_mod, strict: bool = False):
    """The ring drop-in for a step module: `with ring_sdpa(step):` around a model whose attention backend is diffusers'
    `_native_cudnn` (ring attention), the step's own limits (those of its sdpa() drop-in)."""
    import binding  # common/binding (on sys.path through verify.steps), of which every step's drop-in is made
    return make_ring_router(binding, step_mod.attention, step_mod.sdpa().limits, strict,
                            name=f"{step_mod.__name__}.ring_sdpa")


# ---------------------------------------------------------------- the command line

def parse_shapes(text: str) -> list[tuple]:
    """'32760,75600' (the shapes of this run, by tokens) or latent grids FxHxW (models.parse_grid)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part.isdigit() and int(part) in SHAPES:
            out.append(SHAPES[int(part)])
            continue
        try:
            out.append(models.parse_grid(part))
        except ValueError:
            raise ValueError(f"cannot read {part!r}: give {' or '.join(map(str, SHAPES))} (tokens) or a latent grid FxHxW "
                             f"whose sizes are multiples of the patch {'x'.join(map(str, models.PATCH))} (e.g. 4x32x32)") from None
    if not out:
        raise ValueError("no shape given")
    return out


def make_parser():
    ap = steps_mod.ArgumentParser(prog="python -m verify.capstone", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", choices=MODES, required=True, help="diffusers' context parallelism: ulysses or ring")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs (torchrun processes, one GPU each): at least 2")
    ap.add_argument("--step", type=steps_mod.steps_arg, help="the step to put in the model (default: the last, the final step)")
    ap.add_argument("--shapes", type=models.arg_type(parse_shapes), help="32760,75600 (default), or latent grids FxHxW")
    ap.add_argument("--iters", type=int, default=5, help="timed forwards per row and shape; the median is reported (default: 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed forwards after the first call (default: 2)")
    ap.add_argument("--layers", type=int, help="transformer blocks (default: the configuration's 30)")
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: 2 layers, a {models.tokens_of(QUICK_GRID)}-token grid "
                    f"({'x'.join(map(str, QUICK_GRID))}), 1 warm-up + 2 timed")
    ap.add_argument("--out", type=Path, metavar="DIR", help="also copy the results JSON here")
    return ap


def check_args(ap, args) -> None:
    """What the parser cannot say alone: the counts that must divide, in one line each (argparse's error)."""
    if args.gpus < 2:
        ap.error(f"--gpus {args.gpus}: context parallelism needs at least 2 GPUs (the one-GPU rows run anyway)")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be at least 1 and --warmup at least 0")
    heads = models.WAN_T2V_1_3B["num_attention_heads"]
    if args.cp == "ulysses" and heads % args.gpus:
        ap.error(f"--cp ulysses --gpus {args.gpus}: Ulysses splits the model's {heads} heads among the GPUs, and {args.gpus} "
                 f"does not divide {heads} (give 2, 3, 4, 6 or 12, or --cp ring)")
    for grid in args.shapes:
        tokens = models.tokens_of(grid)
        if tokens % args.gpus:
            ap.error(f"--gpus {args.gpus}: the {tokens} tokens of {'x'.join(map(str, grid))} do not split evenly among "
                     f"{args.gpus} GPUs (diffusers' context parallelism shards the sequence in equal parts)")


def environment_reason(gpus: int, argv: list, environ=None, visible=None) -> str | None:
    """Why this process cannot be a rank of a --gpus run, in one line; None when it can. argv: the command line's
    arguments (said back in the torchrun command to run); `visible`: the GPUs torch sees (default: asks torch)."""
    environ = os.environ if environ is None else environ
    again = f"torchrun --standalone --nproc-per-node {gpus} -m verify.capstone {' '.join(argv)}"
    missing = [name for name in TORCHRUN_ENV if name not in environ]
    if missing:
        return f"not launched by torchrun (no {', '.join(missing)} in the environment): run {again}"
    if int(environ["WORLD_SIZE"]) != gpus:
        return (f"torchrun started {environ['WORLD_SIZE']} processes but --gpus is {gpus}: one process per GPU, "
                f"--nproc-per-node {gpus}")
    if visible is None:
        if why := steps_mod.missing_modules_reason(("torch",)):
            return why
        import torch
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU build: --gpus {gpus} needs {gpus} CUDA GPUs"
        visible = torch.cuda.device_count()
    if visible < gpus:
        hidden = environ.get("CUDA_VISIBLE_DEVICES")
        return (f"--gpus {gpus} but {visible} GPU{'s' * (visible != 1)} visible"
                + (f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""))
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = make_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.layers = args.shapes or [QUICK_GRID], args.layers or 2
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 2)
    args.shapes = args.shapes or list(SHAPES.values())
    check_args(ap, args)
    if why := environment_reason(args.gpus, argv):
        raise SystemExit(f"{PROG}: error: {why}")
    for name in ("diffusers", "transformers"):
        models.need(name, PROG)
    return run(args)


# ---------------------------------------------------------------- the run, on every rank

def parallel_config(mode: str, n: int):
    """diffusers' ContextParallelConfig for `mode` over n ranks."""
    config = models.need("diffusers", PROG).ContextParallelConfig
    return config(**{"ulysses_degree" if mode == "ulysses" else "ring_degree": n})


def parallel_transformer(config: dict, device, mode: str, n: int):
    """The capstone's model (same seed: the same weights on every rank), with diffusers' context parallelism over the
    n ranks of the default process group; for ring, the attention backend set to `_native_cudnn` first (the only
    backend of torch's own that gives the LSE ring needs); for Ulysses, left at `native`."""
    model = models.build_transformer(config, device)
    if mode == "ring":
        model.set_attention_backend("_native_cudnn")
    model.enable_parallelism(config=parallel_config(mode, n))
    return model


def cp_rows(mode: str, step_mod) -> list:
    """The N-GPU rows: diffusers' backend as it is, then the step through the drop-in that the backend needs."""
    step = step_mod.info["step"]
    if mode == "ulysses":
        return [models.Backend("sdpa_default", "SDPA default (native)", contextlib.nullcontext),
                models.Backend(step, step, lambda: step_mod.sdpa(strict=True))]
    return [models.Backend("cudnn", "cuDNN (_native_cudnn)", contextlib.nullcontext),
            models.Backend(step, step, lambda: ring_sdpa(step_mod, strict=True))]


def one_gpu_rows(mode: str, step_mod) -> list:
    """The one-GPU rows: SDPA's default (every output's reference), SDPA forced to cuDNN (ring's baseline: the kernel
    of diffusers' _native_cudnn), the step through its SDPA drop-in."""
    rows = {r.name: r for r in models.backends(step_mod, fa3=(None, ""))}
    names = ["sdpa_default", *(["sdpa_cudnn"] if mode == "ring" else []), step_mod.info["step"]]
    return [rows[n] for n in names]


def calls_per_rank(mode: str, config: dict, n: int) -> int:
    """Attention calls per forward on each rank: a cross-attention per block (not split: one SDPA call), and a
    self-attention per block: one SDPA call (Ulysses), or one cuDNN op call per K/V shard (ring: n)."""
    return config["num_layers"] * (1 + (n if mode == "ring" else 1))


def run_cp_row(model, args: dict, row, warmup: int, iters: int, device, where: str, log) -> tuple[dict, object]:
    """One N-GPU cell on this rank: the first forward (the router's counts are its decisions), warm-up, timed ones.
    No exception is caught: a rank that fails exits, and torchrun stops the others (which would otherwise wait in a
    collective). Returns (cell, the first forward's output)."""
    import torch
    with torch.no_grad():
        t0 = time.perf_counter()
        with row.context() as ctx:
            out = model(**args)[0]
        models.synchronize(device)
        first_s = time.perf_counter() - t0
        with row.context():
            for _ in range(warmup):
                model(**args)
            models.synchronize(device)
            times = models.time_forwards(lambda: model(**args), iters, device)
    cell = {"status": "ok", "ms": statistics.median(times), "times_ms": times, "first_s": first_s,
            **models.counts_of(ctx), "finite": bool(torch.isfinite(out).all())}
    log(f"{where}: {cell['ms']:.1f} ms on this rank (median of {iters})"
        + (f"; {cell['routed']} routed, {sum(cell['fallbacks'].values())} fell back" if "routed" in cell else ""))
    return cell, out


def gathered(cell: dict, dist) -> dict:
    """A cell of every rank: the slowest rank's median as the row's time, each rank's median and counts beside it."""
    cells = [None] * dist.get_world_size()
    dist.all_gather_object(cells, cell)
    out = dict(cells[0])
    out["ms"] = max(c["ms"] for c in cells)
    out["rank_ms"] = [c["ms"] for c in cells]
    if "routed" in cell:
        out["rank_routed"] = [c["routed"] for c in cells]
    out["finite"] = all(c["finite"] for c in cells)
    return out


def speedups(runs: dict, base_gpus: str, base_row: str) -> dict:
    """{gpus: {tokens: {row: the base cell's ms / the row's ms}}}, the base the one-GPU (or same-GPU) row `base_row`."""
    out: dict = {}
    for gpus, by_tokens in runs.items():
        for tokens, cells in by_tokens.items():
            base = runs.get(base_gpus or gpus, {}).get(tokens, {}).get(base_row, {}).get("ms")
            out.setdefault(gpus, {})[tokens] = {n: base / c["ms"] for n, c in cells.items() if c.get("ms") and base}
    return out


def run(args, log=None) -> int:
    """Every rank of `torchrun ... -m verify.capstone --cp MODE --gpus N`."""
    import datetime as dt

    import torch
    import torch.distributed as dist
    rank, local_rank, world = (int(os.environ[n]) for n in TORCHRUN_ENV)
    say = log or (lambda m: print(f"[rank {rank}] {m}", file=sys.stderr, flush=True))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device, timeout=dt.timedelta(minutes=30))
    try:
        return _run(args, rank, world, device, dist, say)
    finally:
        dist.destroy_process_group()


def _run(args, rank: int, world: int, device, dist, log, step_mod=None, config=None, root=None) -> int:
    """The run on one rank of a process group of `world` (NCCL under torchrun; the CPU tests: gloo with a stand-in
    step_mod, a tiny `config` and a `root` of their own). Rank 0 writes the results and returns 0 or 1 (a one-GPU row
    that failed); the others return 0."""
    import torch
    cuda = torch.device(device).type == "cuda"
    step = step_mod.info["step"] if step_mod is not None else (args.step or steps_mod.all_steps())[-1]
    config = config or dict(models.WAN_T2V_1_3B, **({"num_layers": args.layers} if args.layers else {}))
    shapes = args.shapes
    t0 = time.time()
    if step_mod is None:
        if rank == 0:  # builds the step (nvcc, cached by content) while the others wait: one build, not N racing
            models.load_step(step)
        dist.barrier()
        step_mod = models.load_step(step)
    inputs = {models.tokens_of(g): models.make_inputs(config, g, device) for g in shapes}
    runs: dict = {"1": {str(t): {} for t in inputs}, str(world): {str(t): {} for t in inputs}}
    outputs: dict = {}  # rank 0: (gpus, tokens, row) -> the first forward's output
    if rank == 0:
        log(f"{PROG} {args.cp}: {step} in a Wan2.1-T2V-1.3B{'' if config == models.WAN_T2V_1_3B else '-like'} model "
            f"({config['num_layers']} layers), {', '.join(f'{t} tokens' for t in inputs)}; the one-GPU rows first")
        model = models.build_transformer(config, device)
        for row in one_gpu_rows(args.cp, step_mod):
            for tokens, x in inputs.items():
                one: dict = {}
                runs["1"][str(tokens)][row.name] = models.run_row(
                    model, x, row, "eager", args.warmup, args.iters, device, one, tokens, f"1 GPU {row.label} at {tokens} tokens", log)
                if ("eager", tokens, row.name) in one:
                    outputs["1", tokens, row.name] = one["eager", tokens, row.name]
        del model
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    model = parallel_transformer(config, device, args.cp, world)
    rows = cp_rows(args.cp, step_mod)
    for row in rows:
        for tokens, x in inputs.items():
            cell, out = run_cp_row(model, x, row, args.warmup, args.iters, device,
                                   f"{world} GPUs {args.cp} {row.label} at {tokens} tokens", log)
            runs[str(world)][str(tokens)][row.name] = gathered(cell, dist)
            if rank == 0:
                outputs[str(world), tokens, row.name] = out
    if rank != 0:
        return 0
    for (gpus, tokens, name), out in outputs.items():  # every output against the one-GPU SDPA default's
        ref = outputs.get(("1", tokens, "sdpa_default"))
        if ref is not None:
            runs[gpus][str(tokens)][name].update(models.agreement(out, ref))
    meta = models.gpu_meta(device)
    meta["world_size"] = world
    if cuda:
        meta.update(nccl=".".join(map(str, torch.cuda.nccl.version())), gpus=[torch.cuda.get_device_name(i) for i in range(world)])
    root = root or (models.SMOKE_ROOT if args.quick else models.ROOT)
    json_path = models.results_path(f"cp-{args.cp}-{world}gpu", meta["gpu"], root)
    result = {
        "kind": "capstone-cp", "cp": args.cp, "gpus": world,
        "path": str(json_path.relative_to(models.ROOT)) if json_path.is_relative_to(models.ROOT) else str(json_path),
        "meta": meta, "step": step,
        "model": {"class": "WanTransformer3DModel", "config": config, "config_source": models.CONFIG_SOURCE,
                  "dtype": "bfloat16", "seed": models.SEED, "text_tokens": models.TEXT_TOKENS, "timestep": models.TIMESTEP},
        "parallelism": {"config": f"ContextParallelConfig({args.cp}_degree={world})",
                        "attention_backend": "native" if args.cp == "ulysses" else "_native_cudnn",
                        "drop_in": f"{step}.sdpa(strict=True)" if args.cp == "ulysses" else f"verify.cp.ring_sdpa({step}, strict=True)"},
        "shapes": {str(models.tokens_of(g)): list(g) for g in shapes},
        "backends": {"1": [[r.name, r.label] for r in one_gpu_rows(args.cp, step_mod)], str(world): [[r.name, r.label] for r in rows]},
        "attention_calls_per_rank": {"1": models.attention_calls(config), str(world): calls_per_rank(args.cp, config, world)},
        "timing": {"warmup": args.warmup, "iters": args.iters, "mode": "eager",
                   "clock": f"{'CUDA events' if cuda else 'wall clock'} on every rank; a row's ms is the slowest rank's median"},
        "runs": runs, "argv": sys.argv[1:], "seconds": round(time.time() - t0, 1),
    }
    result["speedup_vs_one_gpu_sdpa_default"] = speedups(runs, "1", "sdpa_default")
    result["speedup_vs_same_gpus_baseline"] = {str(world): speedups(runs, "", rows[0].name)[str(world)]}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1, default=str))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / json_path.name).write_text(json_path.read_text())
    print(summary(result), flush=True)
    print(f"wrote {result['path']}", flush=True)
    failed = [f"{g} GPU {t} {n}" for g, by_t in runs.items() for t, cells in by_t.items() for n, c in cells.items()
              if c.get("status", "").startswith("failed")]
    if failed:
        print(f"FAILED: {', '.join(failed)} (the row says why)", flush=True)
    return 1 if failed else 0


def summary(result: dict) -> str:
    """| GPUs, tokens | each row: ms (x the one-GPU SDPA default) | agreement |, one line per cell that ran."""
    lines = [f"{result['cp']} over {result['gpus']} GPUs, {result['step']}: one denoiser forward (eager)",
             "| GPUs | tokens | row | ms | × 1-GPU SDPA default | rel err / cosine vs 1-GPU SDPA default | routed per rank |",
             "|---:|---:|---|---:|---:|---|---:|"]
    for gpus, by_tokens in result["runs"].items():
        labels = dict(map(tuple, result["backends"][gpus]))
        for tokens, cells in by_tokens.items():
            for name, c in cells.items():
                sp = result["speedup_vs_one_gpu_sdpa_default"].get(gpus, {}).get(tokens, {}).get(name)
                agree = f"{c['rel_err']:.2e} / {c['cosine']:.6f}" if "rel_err" in c else "-"
                routed = (f"{c['routed']} of {result['attention_calls_per_rank'][gpus]}" if "routed" in c else "-")
                lines.append(f"| {gpus} | {tokens} | {labels.get(name, name)} | "
                             + (f"{c['ms']:.1f} | {sp:.3f}× | " if c.get("ms") and sp else f"{models.short_status(c)} | - | ")
                             + f"{agree} | {routed} |")
    return "\n".join(lines)
