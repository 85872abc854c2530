"""The last turn's cost (tail.log): TFLOP/s at shapes whose work tiles fill whole turns of 132 CTAs (2112 = 16 x 132,
3168 = 24 x 132) beside the shapes of record (2048 tiles: 15.5 turns; the video shape's 3072: 23.3), step16, step17
and FA3, interleaved steady-state windows, the SM clock by NVML. On the GPU machine, FA3's wheel installed:
    python3 results/h200/2026-12-02-step18/tail.py step16,step17
(SHAPES=d1K,d2K,... picks shapes of record by name instead: the run that timed step18's first build beside step17,
ab-first-build.log.)"""
import os
import statistics
import sys
import time

import torch

from verify import steps as S
from verify.bench import ClockSampler, fa3_attention

TAIL = [("d1K 2048 tiles", 16, 16, 1024), ("t1K 2112 tiles", 8, 33, 1024), ("d2K 2048", 8, 16, 2048),
        ("t2K 2112", 4, 33, 2048), ("d8K 2048", 2, 16, 8192), ("t8K 2112", 1, 33, 8192), ("vid 3072", 1, 12, 32760),
        ("tvid 3168", 1, 33, 12288)]
RECORD = {"d1K": (16, 16, 1024), "d2K": (8, 16, 2048), "d4K": (4, 16, 4096), "d8K": (2, 16, 8192),
          "d16K": (1, 16, 16384), "vid": (1, 12, 32760)}
ROUNDS = int(os.environ.get("ROUNDS", 3))


def window(fn, secs, sampler):
    """fn() back to back for about secs: (ms per call, median SM clock in the window)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    fn()
    torch.cuda.synchronize()
    n = max(4, int(secs / ((time.perf_counter() - t) / 2)))
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    mhz = [r[0] for r in sampler.between(t0 + 0.1, time.perf_counter())]
    return e0.elapsed_time(e1) / n, statistics.median(mhz) if mhz else float("nan")


def main():
    names = sys.argv[1].split(",")
    S.build(names)
    mods = {n: S.load(n) for n in names}
    fa3, why = fa3_attention()
    print("fa3:", why or "ok", flush=True)
    shapes = [(x, *RECORD[x]) for x in os.environ["SHAPES"].split(",")] if "SHAPES" in os.environ else TAIL
    t_start = time.perf_counter()
    with ClockSampler() as sampler:
        for label, b, h, n in shapes:
            q = torch.randn(b, h, n, 128, device="cuda").add_(0.5).bfloat16()
            k, v = (torch.randn(b, h, n, 128, device="cuda").add_(0.5).bfloat16() for _ in range(2))
            fns = {name: (lambda m=m: m.attention(q, k, v)) for name, m in mods.items()}
            if fa3:
                qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
                fns["fa3"] = lambda: fa3(qt, kt, vt, causal=False)
            window(next(iter(fns.values())), 1.5, sampler)
            res = {x: [] for x in fns}
            for rnd in range(ROUNDS):
                for x, fn in (list(fns.items()) if rnd % 2 == 0 else list(reversed(fns.items()))):
                    res[x].append(window(fn, 0.7, sampler))
            fl = 4 * b * h * n * n * 128
            print(f"\n[{time.perf_counter() - t_start:.0f} s] {label}: batch {b}, heads {h}, N {n}; {ROUNDS} rounds", flush=True)
            mean = {x: statistics.mean(t for t, _ in r) for x, r in res.items()}
            for x, r in res.items():
                mhz = statistics.median(m for _, m in r)
                tf = fl / mean[x] / 1e9
                rel = f"x fa3 {mean['fa3'] / mean[x]:.3f}" if fa3 and x != "fa3" else ""
                print(f"  {x:<8} {tf:7.1f} TFLOP/s  {mhz:5.0f} MHz  {tf / mhz * 1e3:6.1f}/GHz  {rel:<14}"
                      f"  {mean[x] * 1e3:8.1f} us  (rounds: {' '.join(f'{fl / tt / 1e9:.0f}' for tt, _ in r)})", flush=True)
    print("GPU:", torch.cuda.get_device_name(0))


if __name__ == "__main__":
    main()
