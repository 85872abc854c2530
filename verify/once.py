"""Run every selected step once on one shape: for compute-sanitizer and ncu, e.g.

    compute-sanitizer --tool racecheck python -m verify.once --steps 1-6
"""
import argparse

import torch

from verify import steps as steps_mod
from verify.checks import make_inputs

ap = argparse.ArgumentParser()
ap.add_argument("--steps")
ap.add_argument("--shape", default="2,2,512,256", help="batch,heads,seqlen_q,seqlen_k")
args = ap.parse_args()
shape = [int(x) for x in args.shape.split(",")]
for step in steps_mod.select(args.steps):
    steps_mod.build([step], log=lambda *_: None)
    mod = steps_mod.load(step)
    q, k, v = make_inputs(*shape)
    o, lse = mod.attention(q, k, v)
    torch.cuda.synchronize()
    print(f"{step}: ran {tuple(shape)}, finite={bool(torch.isfinite(o).all() and torch.isfinite(lse).all())}", flush=True)
