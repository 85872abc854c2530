"""Causal A/B: variants of step15 checked bitwise (or against an fp32 reference) on causal and GQA cases, then
interleaved steady-state windows beside step15 and FA3 causal, with the SM clock read by NVML.
Usage: python .scratch/ab2/abc.py step15=.scratch/ab2/VARIANT ..."""
import os, statistics, sys, time, torch
from pathlib import Path
from verify import steps as S
from verify.variants import build_variant
from verify.bench import fa3_attention, ClockSampler
pairs = [a.split("=") for a in sys.argv[1:]]
S.build(sorted({b for b, _ in pairs}))
mods, base_of = {}, {}
for b, v in pairs:
    mods.setdefault(b, S.load(b))
    name, rep = build_variant(Path(v)); print("built", name, rep, flush=True); mods[name] = S.load(name); base_of[name] = b
fa3, why = fa3_attention(); print("fa3:", why or "ok", flush=True)
cases = [(2, 8, 4096, 4096, 8, "top_left"), (3, 5, 1000, 3001, 5, "bottom_right"), (2, 4, 3001, 1000, 4, "bottom_right"),
         (1, 32, 2048, 2048, 8, "top_left"), (2, 4, 777, 513, 1, "top_left"), (1, 16, 8192, 8192, 16, False),
         (2, 3, 129, 20000, 3, "bottom_right")]
def ref32(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    nq, nk = q.shape[2], k.shape[2]
    off = 0 if causal in (False, "top_left") else nk - nq
    o = torch.empty(q.shape, device="cuda"); lse = torch.empty(q.shape[:3], device="cuda")
    kf, vf = k.float(), v.float()
    for i in range(0, nq, 1024):
        s = (q[:, :, i:i + 1024].float() @ kf.transpose(-1, -2)) / 128 ** 0.5
        if causal:
            rows = torch.arange(i, min(i + 1024, nq), device="cuda")[:, None]
            s = s.masked_fill(torch.arange(nk, device="cuda")[None, :] > rows + off, float("-inf"))
        m = s.amax(-1, keepdim=True).clamp_min(-1e30); p_ = torch.exp(s - m); l = p_.sum(-1, keepdim=True)
        o[:, :, i:i + 1024] = torch.nan_to_num((p_ @ vf) / l); lse[:, :, i:i + 1024] = (m + torch.log(l))[..., 0].masked_fill(l[..., 0] == 0, float("-inf"))
    return o, lse
bad = 0
for b, h, nq, nk, hk, causal in cases:
    g = torch.Generator(device="cpu").manual_seed(nq * 7 + nk + int(time.time()))
    q = (torch.randn(b, h, nq, 128, generator=g) + .5).bfloat16().cuda()
    k = (torch.randn(b, hk, nk, 128, generator=g) + .5).bfloat16().cuda()
    v = (torch.randn(b, hk, nk, 128, generator=g) + .5).bfloat16().cuda()
    outs = {}
    for name, mod in mods.items():
        o = torch.full_like(q, float("nan")); lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        mod.attention_out(q, k, v, o, lse, causal=causal); torch.cuda.synchronize()
        outs[name] = (o, lse)
    for name, base in base_of.items():
        (o, l), (o0, l0) = outs[name], outs[base]
        tag = f"{b}x{h}/{hk}x{nq}x{nk} {causal}"
        if torch.equal(o, o0) and torch.equal(l, l0):
            print(f"  bitwise {name} vs {base} {tag}", flush=True); continue
        ro, rl = ref32(q, k, v, causal)
        fin = torch.isfinite(rl)
        e0o, e0l = (o0.float() - ro).abs().max().item(), (l0 - rl)[fin].abs().max().item()
        eo, el = (o.float() - ro).abs().nan_to_num(1e9).max().item(), (l - rl)[fin].abs().nan_to_num(1e9).max().item()
        ok = eo <= 2 * e0o + 1e-3 and el <= 2 * e0l + 1e-4 and torch.equal(torch.isfinite(l), fin)
        bad += not ok
        print(f"  {'ok ' if ok else 'BAD'} {name} vs {base} {tag} not bitwise: O err {eo:.2e} ({base} {e0o:.2e}), "
              f"LSE err {el:.2e} ({base} {e0l:.2e})", flush=True)
print("equality checks: BAD cases", bad, flush=True)
T0 = time.perf_counter()
def window(fn, secs, sampler):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); fn(); torch.cuda.synchronize()
    n = max(4, int(secs / ((time.perf_counter() - t) / 2)))
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    t0 = time.perf_counter(); e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize(); t1 = time.perf_counter()
    mhz = [r[0] for r in sampler.between(t0 + 0.1, t1)]
    return e0.elapsed_time(e1) / n, statistics.median(mhz) if mhz else float("nan")
shapes = {"c4K": (4, 16, 16, 4096, "top_left"), "c8K": (2, 16, 16, 8192, "top_left"), "c16K": (1, 16, 16, 16384, "top_left"),
          "gqa8K": (2, 32, 8, 8192, "top_left"), "d1K": (16, 16, 16, 1024, False), "d2K": (8, 16, 16, 2048, False), "d4K": (4, 16, 16, 4096, False), "d16K": (1, 16, 16, 16384, False)}
shapes = {k: v for k, v in shapes.items() if k in os.environ.get("SHAPES", "c4K,c8K,c16K,gqa8K").split(",")}
ROUNDS = 3
with ClockSampler() as sampler:
    for label, (b, h, hk, n, causal) in shapes.items():
        q = torch.randn(b, h, n, 128, device="cuda").add_(0.5).bfloat16()
        k, v = (torch.randn(b, hk, n, 128, device="cuda").add_(0.5).bfloat16() for _ in range(2))
        fns = {name: (lambda m=m: m.attention(q, k, v, causal=causal)) for name, m in mods.items()}
        if fa3:
            qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
            fns["fa3"] = lambda: fa3(qt, kt, vt, causal=causal)
        window(next(iter(fns.values())), 1.5, sampler)
        res = {x: [] for x in fns}
        for rnd in range(ROUNDS):
            for x, fn in (list(fns.items()) if rnd % 2 == 0 else list(reversed(fns.items()))):
                res[x].append(window(fn, 0.7, sampler))
        fl = 4 * b * h * n * n * 128 / (2 if causal else 1)
        print(f"\n[{time.perf_counter() - T0:.0f} s] {label}: batch {b}, heads {h}/{hk}, N {n}, causal {causal}; {ROUNDS} rounds", flush=True)
        mean = {x: statistics.mean(t for t, _ in r) for x, r in res.items()}
        for x, r in res.items():
            mhz = statistics.median(m for _, m in r); tf = fl / mean[x] / 1e9
            rel = f"x {base_of[x]} {mean[base_of[x]] / mean[x]:.3f}" if x in base_of else ""
            rel += f"  x fa3 {mean['fa3'] / mean[x]:.3f}" if fa3 and x != "fa3" else ""
            print(f"  {x:<12} {tf:7.1f} TFLOP/s  {mhz:5.0f} MHz  {tf / mhz * 1e3:6.1f}/GHz  {rel:<30}"
                  f"  (rounds: {' '.join(f'{fl / tt / 1e9:.0f}' for tt, _ in r)})", flush=True)
print("GPU:", torch.cuda.get_device_name(0))
