"""The backward's timing (python -m verify.backward, and python -m verify's backward table): the backward pass alone,
beside SDPA's backends and FlashAttention-4 (where flash-attn-4 is installed), timed as verify/bench.py times a forward.

For each implementation and N (batch = 16K / N, 16 heads, d = 128, bf16): O is computed once with gradients, then
`torch.autograd.grad(o, (q, k, v), dO)` is what is timed (L2 flushed before each call, warm-up until the SM clock
settles, the median of a window). TFLOP/s are counted as FlashAttention counts them: 2.5 x the forward's 4 B H N^2 d
(causal: half). Rows are named as the forward's causal rows are: stepNN_bwd, stepNN_bwd_causal, sdpa_cudnn_bwd, ...
"""
from __future__ import annotations

from verify import bench
from verify import steps as steps_mod

BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's: five GEMMs of Q K^T's size to the forward's two
SEQLENS = [4096, 8192, 16384]  # the backward table's N (those of a run's seqlens)
# The passes over the N: (row suffix, causal, query heads, key/value heads, dtype, head dim); "_gqa": causal with
# Llama-3-8B's grouped heads, as the forward's GQA rows (bench.CAUSAL_TABLES); "_fp16" and "_fp16_causal": the first two
# in fp16, for the steps that take it (info["dtypes"]) and the peers, as the forward's breadth tables
# (bench.BREADTH_TABLES); "_hdim64" and "_hdim64_causal": the first two at head dim 64, for the steps whose backward
# takes it (info["backward_head_dims"]).
HEADS = bench.CAUSAL_TABLES["causal"]
PASSES = [("", False, *HEADS, "bfloat16", 128), ("_causal", True, *HEADS, "bfloat16", 128),
          ("_gqa", True, *bench.CAUSAL_TABLES["gqa"], "bfloat16", 128),
          ("_fp16", False, *HEADS, "float16", 128), ("_fp16_causal", True, *HEADS, "float16", 128),
          ("_hdim64", False, *HEADS, "bfloat16", 64), ("_hdim64_causal", True, *HEADS, "bfloat16", 64)]


def steps_with_backward() -> list[str]:
    """The steps whose kernel.cu exports a backward (flashladder_bwd)."""
    return [s for s in steps_mod.all_steps() if "flashladder_bwd(" in (steps_mod.ROOT / "steps" / s / "kernel.cu").read_text()]


def backward_fn(forward, q, k, v):
    """A call that runs the backward alone: O is computed once, with gradients, outside it."""
    import torch
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = forward(q, k, v)
    d_o = torch.randn_like(o)

    def fn():
        return torch.autograd.grad(o, (q, k, v), d_o, retain_graph=True)
    return fn


def fa4_attention():
    """FlashAttention-4's attention (flash-attn-4, its CuTe DSL kernels: on Hopper its sm90 forward and backward) as
    forward(q, k, v, causal, scale) on torch's [batch, heads, seqlen, d] layout, or (None, why not). Optional, as FA3
    is: never a dependency of a step."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as e:  # not installed
        return None, f"FlashAttention-4 not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    except Exception as e:  # installed, but its CUTLASS DSL cannot start here: say what it said
        return None, f"FlashAttention-4 not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    def forward(q, k, v, causal=False, scale=None):
        scaled = {} if scale is None else {"softmax_scale": scale}  # FA4's default: 1 / sqrt(d)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, **scaled)
        out = out[0] if isinstance(out, tuple) else out  # (out, lse) in the versions that return both
        return out.transpose(1, 2)
    return forward, None


def implementations(steps: dict, causal: bool, fa4=None, suffix: str | None = None) -> dict:
    """name -> forward(q, k, v) returning O with its autograd graph: each step of `steps` ({step: module}; a step whose
    backward gives the same bits only on request, twice: stepNN_bwd and stepNN_deterministic_bwd), then SDPA cuDNN and
    FLASH, then FlashAttention-4 where `fa4` (fa4_attention()) is given. Each name ends in `suffix` (default: "_causal"
    for causal calls); SDPA takes grouped key/value heads with enable_gqa=True."""
    mask = "top_left" if causal else False
    fns = {}
    for step, mod in steps.items():
        fns[f"{step}_bwd"] = lambda q, k, v, mod=mod: mod.attention(q, k, v, causal=mask, deterministic=False)[0]
        if mod.info.get("backward_deterministic") == "on request":  # what the same bits every call cost
            fns[f"{step}_deterministic_bwd"] = lambda q, k, v, mod=mod: mod.attention(q, k, v, causal=mask,
                                                                                      deterministic=True)[0]
    for backend, name in (("CUDNN_ATTENTION", "sdpa_cudnn"), ("FLASH_ATTENTION", "sdpa_flash")):
        fns[f"{name}_bwd"] = lambda q, k, v, backend=backend: bench.sdpa_fn(
            backend, q, k, v, is_causal=causal, **({"enable_gqa": True} if q.shape[1] != k.shape[1] else {}))()
    if fa4 is not None:
        fns["fa4_bwd"] = lambda q, k, v: fa4(q, k, v, causal=causal)
    suffix = ("_causal" if causal else "") if suffix is None else suffix
    return {name + suffix: fn for name, fn in fns.items()}


def backward_seqlens(seqlens: list[int]) -> list[int]:
    """The backward table's N in a run of `seqlens`: those of SEQLENS it has."""
    return [n for n in SEQLENS if n in seqlens]


def run(steps: dict, seqlens: list[int], timing: bench.Timing | None = None, log=print, causal: bool = True) -> dict:
    """Time the backward of `steps` ({step: module}, each with info["backward"]) and SDPA's at each N, dense (and causal,
    causal with Llama-3-8B's grouped heads, and fp16 and head dim 64 where a step takes them: PASSES):
    {"step": the last of them, "seqlens", "flops", "method", "timings": {name: {N: cell}}, "unavailable": {name: {N: why}}}
    (what a results file keeps under "backward"; verify/report.py draws its table)."""
    import torch
    timing, flush = timing or bench.Timing(), bench.L2Flush()
    timings: dict = {}
    unavailable: dict = {}
    fa4, why_not_fa4 = fa4_attention()
    if fa4 is None:
        log(f"  fa4_bwd: {why_not_fa4}")
        unavailable["fa4_bwd"] = {"all": why_not_fa4}
    with bench.ClockSampler() as sampler:
        if sampler.source:
            timing = bench.fit_to_clock(timing, sampler.interval_s)
        for suffix, masked, heads, heads_kv, dtype, d in (PASSES if causal else [p for p in PASSES if not p[1]]):
            takes = {s: m for s, m in steps.items() if dtype in m.info.get("dtypes", ["bfloat16"])
                     and d in m.info.get("backward_head_dims", [128])}
            if not takes:  # no step of the run takes the dtype and head dim: nothing to time them beside
                continue
            for n in seqlens:
                batch = bench.shape_of(n)[0]
                gen = torch.Generator(device="cuda").manual_seed(n)
                q, k, v = (torch.randn(batch, h, n, d, device="cuda", generator=gen).add_(0.5).to(getattr(torch, dtype))
                           for h in (heads, heads_kv, heads_kv))
                work = BACKWARD_FLOPS * (bench.causal_flops if masked else bench.flops)(batch, heads, n, d)
                for name, forward in implementations(takes, masked, fa4, suffix).items():
                    fn = backward_fn(forward, q, k, v)
                    if why := bench.refusal(fn):
                        unavailable.setdefault(name, {})[str(n)] = why
                        log(f"  N={n:<6} {name}: not timed: {why}")
                        continue
                    cell = bench.with_tflops(bench.measure(fn, flush, sampler, timing), work)
                    cell["batch"], cell["heads"], cell["heads_kv"] = batch, heads, heads_kv
                    timings.setdefault(name, {})[str(n)] = cell
                    log(bench.log_line(f"N={n:<6} {name}", cell))
    return {"step": list(steps)[-1], "seqlens": seqlens, "flops": f"{BACKWARD_FLOPS} x 4 B H N^2 d (causal: half)",
            "method": timing.describe(), "timings": timings, "unavailable": unavailable}
