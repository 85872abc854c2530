"""Timing: every step and torch SDPA's cuDNN / FLASH / EFFICIENT backends, in one run, on the same inputs.

Method (llm.c / triton's do_bench): warm up; flush L2 before every timed call (a 256 MB memset, 4x
the H200's 60 MB L2); time each call with CUDA events; report the median. The CPU queues the flush,
the start event, the call and the end event, and runs ahead of the GPU, so launch overhead stays out
of the numbers. A short pause separates the implementations.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

HEADS = 16
HEAD_DIM = 128
TOTAL_TOKENS = 16384
SEQLENS_OF_RECORD = [1024, 2048, 4096, 8192, 16384]  # batch = 16384 / N (LADDER.md)
SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
LABELS = {"sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA FLASH (FA2)", "sdpa_efficient": "SDPA EFFICIENT",
          "cublas_gemm": "cuBLAS GEMM 8192^3"}


def flops(batch: int, heads: int, seqlen: int, head_dim: int = HEAD_DIM) -> int:
    """Two matmuls of 2*N*N*d FLOPs each, per (batch, head)."""
    return 4 * batch * heads * seqlen * seqlen * head_dim


class L2Flush:
    def __init__(self, nbytes: int = 256 << 20):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def __call__(self):
        self.buf.zero_()


def time_cuda(fn, flush: L2Flush, budget_s: float = 1.0, min_reps: int = 5, max_reps: int = 100) -> dict:
    """Median time of fn() in milliseconds, L2 flushed before each call."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate = time.perf_counter() - t0
    reps = int(min(max_reps, max(min_reps, budget_s / max(estimate, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = lambda f: ms[min(len(ms) - 1, int(f * len(ms)))]  # noqa: E731
    return {"median_ms": q(0.5), "min_ms": ms[0], "p25_ms": q(0.25), "p75_ms": q(0.75), "reps": reps}


def sdpa_fn(backend_name: str, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)
    return fn


def gemm_tflops(flush: L2Flush, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda: a @ b, flush, budget_s=1.0)
    return 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12


def run(impls: dict, seqlens: list[int], budget_s: float = 1.0, log=print) -> dict:
    """impls: {name: attention(q, k, v)}. Returns {name: {N: timing + tflops}} with the SDPA backends added."""
    flush = L2Flush()
    results: dict[str, dict] = {name: {} for name in [*impls, *SDPA_BACKENDS]}
    errors: dict[str, str] = {}
    for n in seqlens:
        batch = TOTAL_TOKENS // n
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(batch, HEADS, n, HEAD_DIM, device="cuda", generator=gen).add_(0.5).to(torch.bfloat16)
                   for _ in range(3))
        fns = {name: (lambda f=f: f(q, k, v)) for name, f in impls.items()}
        for name, backend in SDPA_BACKENDS.items():
            fns[name] = sdpa_fn(backend, q, k, v)
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                t = time_cuda(fn, flush, budget_s)
            except RuntimeError as e:  # a backend torch cannot run here: say so, keep going
                errors[name] = str(e).splitlines()[0]
                log(f"  {name:<16} unavailable: {errors[name]}")
                continue
            t["tflops"] = flops(batch, HEADS, n) / (t["median_ms"] * 1e-3) / 1e12
            t["batch"] = batch
            results[name][n] = t
            log(f"  N={n:<6} batch={batch:<3} {name:<16} {t['median_ms']:9.3f} ms  {t['tflops']:7.1f} TFLOP/s  ({t['reps']} reps)")
            time.sleep(0.1)  # a short pause between kernels
    results["cublas_gemm"] = {"8192": {"tflops": gemm_tflops(flush)}}
    return {"timings": results, "unavailable": errors}
