"""One call of a step under compute-sanitizer: python .scratch/san.py STEP B H N_Q N_K HK CAUSAL"""
import sys, torch
from verify import steps as S
step, b, h, nq, nk, hk, causal = sys.argv[1], *map(int, sys.argv[2:7]), sys.argv[7]
causal = False if causal == "none" else causal
S.build([step], log=lambda *_: None)
m = S.load(step)
q = torch.randn(b, h, nq, 128, device="cuda").add_(0.5).bfloat16()
k, v = (torch.randn(b, hk, nk, 128, device="cuda").add_(0.5).bfloat16() for _ in range(2))
o = m.attention(q, k, v, causal=causal); torch.cuda.synchronize()
print(f"{step}: ran {(b, h, nq, nk, hk, causal)}, finite={bool(torch.isfinite(o).all())}")
