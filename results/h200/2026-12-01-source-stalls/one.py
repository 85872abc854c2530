"""One profiled call (for ncu --profile-from-start off), after five warm-up calls, from the repository's root:

    python3 results/h200/2026-12-01-source-stalls/one.py IMPL CAUSAL BATCH HEADS N [HEADS_K]

IMPL: a step (step14, step15) or fa3; CAUSAL: 0, or 1 for SDPA's top-left mask.
"""
import sys

import torch

sys.path.insert(0, ".")
from verify import bench, steps  # noqa: E402

impl, causal, b, h, n = sys.argv[1], sys.argv[2] != "0", *map(int, sys.argv[3:6])
hk = int(sys.argv[6]) if len(sys.argv) > 6 else h
mask = "top_left" if causal else False
q = torch.randn(b, h, n, 128, device="cuda").add_(0.5).to(torch.bfloat16)
k, v = (torch.randn(b, hk, n, 128, device="cuda").add_(0.5).to(torch.bfloat16) for _ in range(2))
if impl == "fa3":
    fa3, why = bench.fa3_attention()
    assert fa3, why
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))

    def fn():
        return fa3(qt, kt, vt, causal=mask)
else:
    attention = steps.load(impl).attention

    def fn():
        return attention(q, k, v, causal=mask) if causal else attention(q, k, v)
for _ in range(5):
    fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
