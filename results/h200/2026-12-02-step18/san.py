"""The sanitizers' workload (sanitizer_*_18.txt): two calls of a step at one shape, e.g.
    compute-sanitizer --tool memcheck python3 results/h200/2026-12-02-step18/san.py step18 1 17 1024 1024 17 0
(step, batch, heads, seqlen_q, seqlen_k, heads_k, causal: 0, top_left or bottom_right)."""
import sys

import torch

from verify import steps as S

step, (b, h, nq, nk, hk), causal = sys.argv[1], map(int, sys.argv[2:7]), sys.argv[7]
S.build([step])
m = S.load(step)
q = torch.randn(b, h, nq, 128, device="cuda").add_(0.5).bfloat16()
k, v = (torch.randn(b, hk, nk, 128, device="cuda").add_(0.5).bfloat16() for _ in range(2))
for _ in range(2):
    o, lse = m.attention(q, k, v, causal=False if causal == "0" else causal)
torch.cuda.synchronize()
print("ok", step, b, h, nq, nk, hk, causal, o.float().abs().mean().item(), torch.isfinite(lse).all().item())
