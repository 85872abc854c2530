"""A variant of step19 against step19, bitwise, at dense, ragged, causal and grouped shapes (a change to how the
wgmma descriptors are made must not change a bit): python3 results/h200/2026-12-02-step19/same.py .scratch/v19desc"""
import sys
from pathlib import Path

import torch

from verify import steps as S
from verify.variants import build_variant

S.build(["step19"])
ref = S.load("step19")
name, _ = build_variant(Path(sys.argv[1]))
var = S.load(name)
bad = 0
for b, h, hk, nq, nk, causal in ((16, 16, 16, 1024, 1024, False), (8, 16, 16, 2048, 2048, False), (2, 5, 5, 777, 1999, False),
                                 (1, 17, 17, 1024, 1024, False), (1, 32, 8, 2048, 2048, "top_left"),
                                 (2, 4, 1, 777, 513, "bottom_right"), (1, 16, 16, 8192, 8192, False)):
    q = torch.randn(b, h, nq, 128, device="cuda").add_(0.5).bfloat16()
    k, v = (torch.randn(b, hk, nk, 128, device="cuda").add_(0.5).bfloat16() for _ in range(2))
    (o1, l1), (o2, l2) = ref.attention(q, k, v, causal=causal), var.attention(q, k, v, causal=causal)
    same = torch.equal(o1, o2) and torch.equal(l1, l2)
    bad += not same
    print(f"  bitwise {name} vs step19 {b}x{h}/{hk}x{nq}x{nk} {causal}: {'same' if same else 'DIFFERENT'}")
print(f"equality checks: BAD cases {bad}")
sys.exit(1 if bad else 0)
