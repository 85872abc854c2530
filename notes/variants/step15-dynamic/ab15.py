"""A/B of step15 variants: correctness (fp32 torch reference: causal both alignments, GQA, dead rows), then interleaved
timings of causal, GQA-causal and dense calls against FA3 and step14."""
import math, sys, time, torch
from pathlib import Path
import torch.nn.functional as F
from verify import steps as S
from verify.variants import build_variant
from verify.bench import fa3_attention
variants = sys.argv[1:]
S.build(["step14", "step15"])
mods = {"step14": S.load("step14"), "step15": S.load("step15")}
for v in variants:
    name, rep = build_variant(Path(v)); print("built", name, rep, flush=True); mods[name] = S.load(name)
fa3, why = fa3_attention(); print("fa3:", why or "ok")
import fa3_fwd_interface
def ref(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1); v = v.repeat_interleave(g, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(128)
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        off = 0 if causal == "top_left" else nk - nq
        i = torch.arange(nq, device=q.device)[:, None]; j = torch.arange(nk, device=q.device)[None]
        s = s.masked_fill(j > i + off, -math.inf)
    m = s.amax(-1, keepdim=True); dead = torch.isinf(m)
    p = torch.exp(s - torch.where(dead, 0, m)); l = p.sum(-1, keepdim=True)
    return torch.where(dead, 0, (p @ v.float()) / l), torch.where(dead, -math.inf, m + torch.log(l))[..., 0]
bad = 0
cases = [(1,2,2,128,128), (1,2,2,300,1000), (2,4,4,1000,300), (1,2,2,1,1), (1,2,2,127,129), (1,2,2,1000,100),
         (1,32,8,1024,1024), (1,8,1,777,1500), (2,16,16,2048,2048), (1,4,2,4097,4095), (4, 40, 8, 600, 700)]
for name, mod in mods.items():
    if name == "step14": continue
    for b, h, hk, nq, nk in cases:
        for causal in (False, "top_left", "bottom_right"):
            g = torch.Generator(device="cpu").manual_seed(nq * 7 + nk)
            q = (torch.randn(b, h, nq, 128, generator=g) + .5).bfloat16().cuda()
            k = (torch.randn(b, hk, nk, 128, generator=g) + .5).bfloat16().cuda()
            v = (torch.randn(b, hk, nk, 128, generator=g) + .5).bfloat16().cuda()
            o = torch.full_like(q, float("nan")); lse = torch.full(q.shape[:3], float("nan"), device="cuda")
            mod.attention_out(q, k, v, o, lse, causal=causal); torch.cuda.synchronize()
            o2, lse2 = mod.attention(q, k, v, causal=causal)
            ro, rl = ref(q, k, v, causal); live = torch.isfinite(rl)
            eo = (o.float() - ro).abs().max().item()
            el = (lse[live] - rl[live]).abs().max().item() if live.any() else 0.0
            deadok = bool(((lse[~live] == -math.inf).all() and (o.float()[~live] == 0).all()).item()) if (~live).any() else True
            ok = eo < 2e-2 and el < 1e-3 and deadok and not torch.isnan(o).any() and torch.equal(o, o2) and torch.equal(lse, lse2)
            bad += not ok
            if not ok: print(f"BAD {name} b{b} h{h}/{hk} {nq}x{nk} {causal} O {eo:.2e} LSE {el:.2e} dead-ok {deadok}", flush=True)
    print(name, "checked", flush=True)
print("BAD cases:", bad, flush=True)
def window(fn, secs):
    torch.cuda.synchronize(); e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    n = 0; e0.record(); t0 = time.perf_counter()
    while time.perf_counter() - t0 < secs:
        for _ in range(5): fn()
        n += 5
    e1.record(); torch.cuda.synchronize(); return e0.elapsed_time(e1) / n
from torch.nn.attention import sdpa_kernel, SDPBackend
for N in (4096, 8192, 16384):
    for h, hk in ((16, 16), (32, 8)):
        b = 16384 // N
        q = torch.randn(b, h, N, 128, device="cuda", dtype=torch.bfloat16); k = torch.randn(b, hk, N, 128, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        fns = {n: (lambda m=m: m.attention(q, k, v, causal="top_left")) for n, m in mods.items() if n != "step14"}
        fns["fa3"] = lambda: fa3_fwd_interface.flash_attn_func(qt, kt, vt, causal=True)
        if h == hk and N == 8192:
            fns.update({f"{n}_dense": (lambda m=m: m.attention(q, k, v)) for n, m in mods.items()})
            fns["fa3_dense"] = lambda: fa3_fwd_interface.flash_attn_func(qt, kt, vt)
        for fn in fns.values(): window(fn, 0.3)
        res = {n: [] for n in fns}
        for rnd in range(3):
            for n, fn in (fns.items() if rnd % 2 == 0 else reversed(fns.items())):
                res[n].append(window(fn, 0.4))
        fl = 4 * b * h * N * N * 128
        print(N, f"{h}/{hk}", "  ".join(f"{n} {fl / (1 if 'dense' in n else 2) / (sum(t) / len(t)) / 1e9:.0f}" for n, t in res.items()), flush=True)
