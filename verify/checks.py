"""Numerical checks of a step on the GPU against the float64 reference (verify/reference.py).

The rules (FlashAttention's own tests use the same idea for the max error):
  * O:   relative Frobenius error <= 1e-2, and max abs error <= 2x that of a naive bf16 attention
         (bf16 matmuls, as a plain PyTorch model computes it) + ATOL;
  * LSE: max abs error <= 1e-3;
  * no NaN/Inf anywhere; outputs are poisoned with NaN before the call, so an unwritten element fails;
  * fresh random inputs every run, with a non-zero mean (a zero mean hides errors in the max handling).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from verify.reference import attention_reference

O_REL_FROB = 1e-2
O_NAIVE_FACTOR = 2.0
ATOL = 1e-4
LSE_ABS = 1e-3
INPUT_MEAN = 0.5


def fresh_seed() -> int:
    """A new seed every run (printed on failure so a failing case can be replayed)."""
    return int(os.environ.get("FLASHLADDER_SEED") or int.from_bytes(os.urandom(4), "little"))


def make_inputs(batch, heads, seqlen_q, seqlen_k, *, factor=1.0, seed=None, device="cuda"):
    """q, k, v bf16 ~ factor * N(INPUT_MEAN, 1) in torch's [batch, heads, seqlen, 128] layout."""
    gen = torch.Generator(device="cpu").manual_seed(fresh_seed() if seed is None else seed)
    def one(n):
        return (factor * (torch.randn(batch, heads, n, 128, generator=gen) + INPUT_MEAN)).to(torch.bfloat16).to(device)
    return one(seqlen_q), one(seqlen_k), one(seqlen_k)


def naive_bf16_attention(q, k, v, scale):
    """Attention as a plain bf16 PyTorch model computes it: the error budget's yardstick."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale          # bf16 scores
    p = torch.softmax(s.float(), dim=-1).to(torch.bfloat16)   # bf16 probabilities
    return torch.matmul(p, v)


@dataclass
class Errors:
    o_rel_frob: float
    o_max_abs: float
    o_max_abs_naive: float
    lse_max_abs: float
    nonfinite_o: int
    nonfinite_lse: int

    def failures(self) -> list[str]:
        bad = []
        if self.nonfinite_o or self.nonfinite_lse:
            bad.append(f"{self.nonfinite_o} non-finite O and {self.nonfinite_lse} non-finite LSE elements "
                       "(NaN-poisoned outputs not written, or NaN/Inf computed)")
        if not self.o_rel_frob <= O_REL_FROB:  # `not <=` so that NaN fails
            bad.append(f"O relative Frobenius error {self.o_rel_frob:.3g} > {O_REL_FROB}")
        limit = O_NAIVE_FACTOR * self.o_max_abs_naive + ATOL
        if not self.o_max_abs <= limit:
            bad.append(f"O max abs error {self.o_max_abs:.3g} > {O_NAIVE_FACTOR} x naive bf16 "
                       f"({self.o_max_abs_naive:.3g}) + {ATOL}")
        if not self.lse_max_abs <= LSE_ABS:
            bad.append(f"LSE max abs error {self.lse_max_abs:.3g} > {LSE_ABS}")
        return bad


def run_poisoned(mod, q, k, v, scale=None):
    """Call the step writing into NaN-poisoned buffers; returns (o, lse)."""
    o = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    mod.attention_out(q, k, v, o, lse, scale)
    torch.cuda.synchronize()
    return o, lse


def measure_errors(mod, q, k, v, scale=None) -> Errors:
    scale_ = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    o, lse = run_poisoned(mod, q, k, v, scale)
    o_ref, lse_ref = attention_reference(*(t.double().cpu().numpy() for t in (q, k, v)), scale_)
    o64, lse64 = o.double().cpu().numpy(), lse.double().cpu().numpy()
    naive = naive_bf16_attention(q, k, v, scale_).double().cpu().numpy()
    with np.errstate(invalid="ignore"):
        return Errors(
            o_rel_frob=float(np.linalg.norm(o64 - o_ref) / np.linalg.norm(o_ref)),
            o_max_abs=float(np.max(np.abs(o64 - o_ref))),
            o_max_abs_naive=float(np.max(np.abs(naive - o_ref))),
            lse_max_abs=float(np.max(np.abs(lse64 - lse_ref))),
            nonfinite_o=int((~np.isfinite(o64)).sum()),
            nonfinite_lse=int((~np.isfinite(lse64)).sum()),
        )
