"""Per-call and per-tile costs: us per call at whole turns of 132 CTAs (33 heads), N = 512 / 1K / 2K, 2..32 turns,
step18 and FA3, each call replayed from a CUDA graph of REPS calls (no host cost), interleaved rounds, SM clock."""
import os
import statistics
import sys
import time

import torch

from verify import steps as S
from verify.bench import ClockSampler, fa3_attention

REPS = 20
ROUNDS = int(os.environ.get("ROUNDS", 3))
SHAPES = [(b, 33, 512) for b in (4, 8, 16, 32)] + [(b, 33, 1024) for b in (2, 4, 8, 16)] + [(b, 33, 2048) for b in (1, 2, 4, 8)]
SHAPES += [(16, 16, 1024), (8, 16, 2048)]


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    return g


def window(g, secs, sampler):
    torch.cuda.synchronize()
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    n = max(3, int(secs / (time.perf_counter() - t)))
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    mhz = [r[0] for r in sampler.between(t0 + 0.05, time.perf_counter())]
    return e0.elapsed_time(e1) / n / REPS * 1e3, statistics.median(mhz) if mhz else float("nan")


def main():
    names = sys.argv[1].split(",")
    S.build(names)
    mods = {n: S.load(n) for n in names}
    fa3, why = fa3_attention()
    print("fa3:", why or "ok", flush=True)
    t_start = time.perf_counter()
    with ClockSampler() as sampler:
        for b, h, n in SHAPES:
            q = torch.randn(b, h, n, 128, device="cuda").add_(0.5).bfloat16()
            k, v = (torch.randn(b, h, n, 128, device="cuda").add_(0.5).bfloat16() for _ in range(2))
            fns = {name: (lambda m=m: m.attention(q, k, v)) for name, m in mods.items()}
            if fa3:
                qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
                fns["fa3"] = lambda: fa3(qt, kt, vt, causal=False)
            graphs = {x: graph_of(fn) for x, fn in fns.items()}
            window(next(iter(graphs.values())), 0.8, sampler)
            res = {x: [] for x in graphs}
            for rnd in range(ROUNDS):
                for x, g in (list(graphs.items()) if rnd % 2 == 0 else list(reversed(graphs.items()))):
                    res[x].append(window(g, 0.35, sampler))
            fl = 4 * b * h * n * n * 128
            tiles = b * h * (n // 128)
            print(f"\n[{time.perf_counter() - t_start:.0f} s] b {b} h {h} N {n}: {tiles} tiles, {tiles / 132:.1f} turns", flush=True)
            for x, r in res.items():
                us = statistics.mean(t for t, _ in r)
                mhz = statistics.median(m for _, m in r)
                tf = fl / us / 1e6
                print(f"  {x:<8} {us:9.2f} us  {tf:7.1f} TFLOP/s  {mhz:5.0f} MHz  {us * mhz:10.0f} cycles"
                      f"  (rounds: {' '.join(f'{t:.1f}' for t, _ in r)})", flush=True)
            del graphs
    print("GPU:", torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
