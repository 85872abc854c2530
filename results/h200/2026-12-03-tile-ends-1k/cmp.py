"""Variants of step19 against step19 at dense, ragged, causal and grouped shapes: bitwise, else the largest differences."""
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from verify import steps as S
from verify.variants import build_variant

with ThreadPoolExecutor(8) as pool:  # every build at once (step19's and the variants')
    steps_built = pool.submit(S.build, ["step19"])
    built = list(pool.map(lambda f: build_variant(Path(f)), sys.argv[1:]))
    steps_built.result()
ref = S.load("step19")
if os.environ.get("REF"):  # a variant as the reference
    ref = S.load(build_variant(Path(os.environ["REF"]))[0])
for name, rep in built:
    var = S.load(name)
    print("built", name, rep, flush=True)
    for b, h, hk, nq, nk, causal in ((16, 16, 16, 1024, 1024, False), (8, 16, 16, 2048, 2048, False), (2, 5, 5, 777, 1999, False),
                                     (1, 17, 17, 1024, 1024, False), (1, 32, 8, 2048, 2048, "top_left"),
                                     (2, 4, 1, 777, 513, "bottom_right"), (1, 16, 16, 8192, 8192, False)):
        q = torch.randn(b, h, nq, 128, device="cuda").add_(0.5).bfloat16()
        k, v = (torch.randn(b, hk, nk, 128, device="cuda").add_(0.5).bfloat16() for _ in range(2))
        (o1, l1), (o2, l2) = ref.attention(q, k, v, causal=causal), var.attention(q, k, v, causal=causal)
        same = torch.equal(o1, o2) and torch.equal(l1, l2)
        fin = bool(torch.isfinite(o2).all())
        do = (o1.float() - o2.float()).abs().max().item()
        dl = (l1 - l2)[torch.isfinite(l1)].abs().max().item()
        print(f"  {name} vs step19 {b}x{h}/{hk}x{nq}x{nk} {causal}: {'same' if same else 'DIFFERENT'}"
              f" max|dO| {do:.3g} max|dLSE| {dl:.3g} finite {fin}", flush=True)
