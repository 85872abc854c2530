"""1K / 2K / 4K dense at the shapes of record: verify's own timer (bench.measure: the L2 flush, the warm-up until the
clock settles, the window's median), REPS rounds in alternating orders, steps and variants beside FA3.
    python short.py step14,step17,step18 .scratch/v18s4k ..."""
import os
import statistics
import sys
from pathlib import Path

import torch

from verify import steps as S
from verify.bench import ClockSampler, L2Flush, Timing, fa3_attention, fit_to_clock, flops, measure, shape_of
from verify.variants import build_variant

REPS = int(os.environ.get("REPS", 3))
NS = [int(x) for x in os.environ.get("NS", "1024,2048,4096").split(",")]


def main():
    steps = sys.argv[1].split(",")
    S.build(steps)
    mods = {n: S.load(n) for n in steps}
    for v in sys.argv[2:]:
        name, rep = build_variant(Path(v))
        print("built", name, rep, flush=True)
        mods[name] = S.load(name)
    fa3, why = fa3_attention()
    print("fa3:", why or "ok", flush=True)
    flush = L2Flush()
    timing = Timing(settle_max_s=1.0)
    with ClockSampler() as sampler:
        timing = fit_to_clock(timing, sampler.interval_s)
        for n in NS:
            b, h, _ = shape_of(n)
            gen = torch.Generator(device="cuda").manual_seed(n)
            q, k, v = (torch.randn(b, h, n, 128, device="cuda", generator=gen).add_(0.5).to(torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
            fns = {name: (lambda m=m: m.attention(q, k, v)) for name, m in mods.items()}
            if fa3:
                fns["fa3"] = lambda: fa3(qt, kt, vt)
            res = {x: [] for x in fns}
            for rep in range(REPS):
                for name, fn in (list(fns.items()) if rep % 2 == 0 else list(reversed(fns.items()))):
                    res[name].append(measure(fn, flush, sampler, timing))
            print(f"\nN {n}: batch {b}, heads {h}; {REPS} rounds (median ms of each window; x FA3 from the mean of the medians)")
            mean = {x: statistics.mean(c["median_ms"] for c in r) for x, r in res.items()}
            for name, r in res.items():
                tf = flops(b, h, n) / mean[name] / 1e9
                rel = f"x fa3 {mean['fa3'] / mean[name]:.3f}" if fa3 and name != "fa3" else ""
                cells = " ".join(f"{c['median_ms'] * 1e3:.1f}@{c['sm_mhz_median']:.0f}" for c in r)
                spread = max((c["p75_ms"] - c["p25_ms"]) / c["median_ms"] for c in r)
                print(f"  {name:<8} {mean[name] * 1e3:7.1f} us {tf:6.1f} TFLOP/s {rel:<12} widest p25-p75 {spread:5.3f}  us@MHz: {cells}",
                      flush=True)


if __name__ == "__main__":
    main()
