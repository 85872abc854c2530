"""One profiled call: python one.py IMPL CAUSAL B H N [HK]. IMPL: a step or fa3.
(From results/h200/2026-12-01-source-stalls, git d8990ea.)"""
import sys

import torch

sys.path.insert(0, ".")
from verify import bench, steps  # noqa: E402

impl, causal, b, h, n = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
hk = int(sys.argv[6]) if len(sys.argv) > 6 else h
causal = False if causal == "0" else "top_left"
q = torch.randn(b, h, n, 128, device="cuda").add_(0.5).to(torch.bfloat16)
k, v = (torch.randn(b, hk, n, 128, device="cuda").add_(0.5).to(torch.bfloat16) for _ in range(2))
if impl == "fa3":
    fa3, why = bench.fa3_attention()
    assert fa3, why
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))

    def fn():
        return fa3(qt, kt, vt, causal=causal)
else:
    att = steps.load(impl).attention

    def fn():
        return att(q, k, v, causal=causal) if causal else att(q, k, v)
for _ in range(5):
    fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
fn()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
