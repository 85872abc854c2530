"""A/B of step variants whose math is their base step's: O and LSE checked bitwise equal to the base's (poisoned
outputs, several work tiles per CTA, ragged lengths), then interleaved steady-state timings beside the bases and FA3,
with the SM clock read by NVML during each window. Each window runs a fixed number of calls (estimated from a
synchronized probe), so no window waits on a deep launch queue.
Usage: python .scratch/ab2/abq.py step06=.scratch/ab2/s06max step13=.scratch/ab2/s13max ..."""
import statistics, sys, time, torch
from pathlib import Path
from verify import steps as S
from verify.variants import build_variant
from verify.bench import fa3_attention, ClockSampler
pairs = [a.split("=") if "=" in a else (a, None) for a in sys.argv[1:]]  # BASE=VARIANT, or BASE alone (timed only)
S.build(sorted({b for b, _ in pairs if "/" not in b}))
mods, base_of = {}, {}
for b, v in pairs:
    if "/" in b:  # a variant folder as the base
        name, rep = build_variant(Path(b)); print("built", name, rep, flush=True); mods.setdefault(name, S.load(name)); b = name
    mods.setdefault(b, S.load(b))
    if v is None:
        continue
    name, rep = build_variant(Path(v)); print("built", name, rep, flush=True); mods[name] = S.load(name); base_of[name] = b
fa3, why = fa3_attention(); print("fa3:", why or "ok", flush=True)
cases = [(4, 16, 4096, 4096), (3, 5, 1000, 3001), (2, 16, 8192, 129), (1, 1, 1, 1), (7, 3, 777, 513), (1, 40, 2048, 2048),
         (2, 2, 256, 20000)]
T0 = time.perf_counter()
def ref32(q, k, v):
    """fp32 reference in row blocks: O [b, h, nq, d] float, LSE [b, h, nq]."""
    o = torch.empty(q.shape, device="cuda"); lse = torch.empty(q.shape[:3], device="cuda")
    kf, vf = k.float(), v.float()
    for i in range(0, q.shape[2], 2048):
        s = (q[:, :, i:i + 2048].float() @ kf.transpose(-1, -2)) / 128 ** 0.5
        m = s.amax(-1, keepdim=True); p_ = torch.exp(s - m); l = p_.sum(-1, keepdim=True)
        o[:, :, i:i + 2048] = (p_ @ vf) / l; lse[:, :, i:i + 2048] = (m + torch.log(l))[..., 0]
    return o, lse
bad = 0
for b, h, nq, nk in cases:
    g = torch.Generator(device="cpu").manual_seed(nq * 7 + nk + int(time.time()))
    q = (torch.randn(b, h, nq, 128, generator=g) + .5).bfloat16().cuda()
    k = (torch.randn(b, h, nk, 128, generator=g) + .5).bfloat16().cuda()
    v = (torch.randn(b, h, nk, 128, generator=g) + .5).bfloat16().cuda()
    outs = {}
    for name, mod in mods.items():
        o = torch.full_like(q, float("nan")); lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        try:
            mod.attention_out(q, k, v, o, lse); torch.cuda.synchronize()
        except Exception as e:
            print(f"  {name} refuses {b}x{h}x{nq}x{nk}: {str(e).splitlines()[0][:100]}", flush=True); continue
        outs[name] = (o, lse)
    for name, base in base_of.items():
        if name not in outs or base not in outs:
            continue
        (o, l), (o0, l0) = outs[name], outs[base]
        assert not torch.isnan(o0).any() and not torch.isnan(l0).any()
        if torch.equal(o, o0) and torch.equal(l, l0):
            print(f"  bitwise {name} vs {base} {b}x{h}x{nq}x{nk}", flush=True); continue
        ro, rl = ref32(q, k, v)
        e0o, e0l = (o0.float() - ro).abs().max().item(), (l0 - rl).abs().max().item()
        eo, el = (o.float() - ro).abs().nan_to_num(1e9).max().item(), (l - rl).abs().nan_to_num(1e9).max().item()
        ok = eo <= 2 * e0o + 1e-3 and el <= 2 * e0l + 1e-4
        bad += not ok
        print(f"  {'ok ' if ok else 'BAD'} {name} vs {base} {b}x{h}x{nq}x{nk} not bitwise: O err {eo:.2e} ({base} {e0o:.2e}), "
              f"LSE err {el:.2e} ({base} {e0l:.2e})", flush=True)
print("equality checks: BAD cases", bad, flush=True)

def window(fn, secs, sampler):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); fn(); torch.cuda.synchronize()
    n = max(4, int(secs / ((time.perf_counter() - t) / 2)))
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    t0 = time.perf_counter(); e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize(); t1 = time.perf_counter()
    mhz = [r[0] for r in sampler.between(t0 + 0.1, t1)]
    return e0.elapsed_time(e1) / n, statistics.median(mhz) if mhz else float("nan")

import os
shapes = {"1K": (16, 16, 1024), "2K": (8, 16, 2048), "4K": (4, 16, 4096), "8K": (2, 16, 8192), "16K": (1, 16, 16384), "video": (1, 12, 32760)}
shapes = {k: v for k, v in shapes.items() if k in os.environ.get("SHAPES", "4K,16K").split(",")}
ROUNDS = 3
with ClockSampler() as sampler:
    for label, (b, h, n) in shapes.items():
        q, k, v = (torch.randn(b, h, n, 128, device="cuda").add_(0.5).bfloat16() for _ in range(3))
        fns = {name: (lambda m=m: m.attention(q, k, v)) for name, m in mods.items()}
        if fa3:
            qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
            fns["fa3"] = lambda: fa3(qt, kt, vt)
        window(next(iter(fns.values())), 1.5, sampler)  # to the power limit
        res = {x: [] for x in fns}
        for rnd in range(ROUNDS):
            for x, fn in (list(fns.items()) if rnd % 2 == 0 else list(reversed(fns.items()))):
                res[x].append(window(fn, 0.7, sampler))
        fl = 4 * b * h * n * n * 128
        print(f"\n[{time.perf_counter() - T0:.0f} s] {label}: batch {b}, heads {h}, N {n}; {ROUNDS} rounds of 0.7 s windows, alternating order", flush=True)
        mean = {x: statistics.mean(t for t, _ in r) for x, r in res.items()}
        for x, r in res.items():
            mhz = statistics.median(m for _, m in r); tf = fl / mean[x] / 1e9
            rel = f"x {base_of[x]} {mean[base_of[x]] / mean[x]:.3f}" if x in base_of else ""
            print(f"  {x:<10} {tf:7.1f} TFLOP/s  {mhz:5.0f} MHz  {tf / mhz * 1e3:6.1f}/GHz  {rel:<18}"
                  f"  (rounds: {' '.join(f'{fl / tt / 1e9:.0f}' for tt, _ in r)})", flush=True)
print("GPU:", torch.cuda.get_device_name(0))
